"""Test support shipped with the kernels, never imported by them or by the engine: `emu`, the kernel
emulator that runs the kernels' own CUDA source on the CPU (the CPU suites of nanoqwen-kernels and
nanoqwen-runtime check the GEMV, layer-op, attention and sampling kernels the engine launches with it)."""
