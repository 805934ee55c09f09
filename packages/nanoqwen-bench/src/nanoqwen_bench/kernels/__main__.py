"""`python -m nanoqwen_bench.kernels [--out bench/out/kernels] [--quick]`: the kernel microbenchmarks."""

from .bench_kernels import main

raise SystemExit(main())
