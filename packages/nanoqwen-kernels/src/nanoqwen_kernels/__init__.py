"""CUDA kernels for nanoqwen (sm_90a): INT4 GEMV/GEMM, fused norms and RoPE, paged attention, sampling."""

__version__ = "0.1.0"
