"""Kernel microbenchmarks: `python -m nanoqwen_bench.kernels` (the INT4 GEMVs, layer ops and sampler;
`bench_kernels`), `bench_gemm` (the INT4 GEMM), `bench_attention` (paged attention) and
`decode_ceilings` (the batch-1 decode step against its ceilings)."""
