"""The CUDA engine benchmark (`bench`, run by `nanoqwen-cli bench`), its per-op profile
(`bench_profile`), its report (`bench_report`) and the workload benchmark (`bench_workload`)."""
