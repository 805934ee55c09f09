"""The registry of kernel families: the one build description of every CUDA source in the package.

Each entry is a `build.KernelSpec`: its `.cu` entry files under `csrc/`, extra compiler options, and
the hot kernels that the CPU CI test (`tests/test_build.py`) requires to compile with a zero stack
frame and no spills. Both the first-use NVRTC compile (`build.load_module`) and the ahead-of-time nvcc
compile (`build.compile_nvcc`) read this dict and nothing else. To add a family: add its `.cu` file
and one entry here.
"""

from __future__ import annotations

from .build import KernelSpec

SPECS: dict[str, KernelSpec] = {
    "layer_ops": KernelSpec(
        name="layer_ops",
        programmatic=True,
        sources=("layer_ops.cu",),
        hot_kernels=(
            "rms_norm_bf16",
            "fused_add_rms_norm_bf16",
            "silu_mul_bf16",
            "embedding_gather_bf16",
            "qkv_rope_kv_write_bf16",
        ),
    ),
    "gemv": KernelSpec(
        name="gemv",
        programmatic=True,
        sources=("gemv.cu",),
        hot_kernels=tuple(
            f"gemv_int4_g{g}_{kind}{scales}{suffix}"
            for g in (32, 64, 128)
            for kind in ("sym", "asym")
            for scales in ("", "_f16s")  # bf16 scales, or fp16 (layout int4-g{G}-tile8x128-f16s-v1)
            # _rope: the qkv GEMV with the RoPE / K/V epilogue; _norm, _norm_rope: with the norm
            # prologue; _resid, _silu_resid: with the residual epilogue; _merge_hd*_resid: o_proj with the
            # attention merge prologue and the residual epilogue (gemv.cu)
            for suffix in ("", "_silu", "_rope", "_norm", "_norm_rope", "_resid", "_silu_resid",
                           "_merge_hd64_resid", "_merge_hd128_resid")
        )
        + tuple(
            f"dequant_int4_g{g}_{kind}{scales}"
            for g in (32, 64, 128)
            for kind in ("sym", "asym")
            for scales in ("", "_f16s")
        )
        + ("gemv_int8_g64", "gemv_int8_g128"),
    ),
    # INT4 GEMM, M > 8 (gemm.py). Hot: every kernel but g32 at NT = 8, which ptxas spills even at 255
    # registers (4 groups per tile-column: up to 252 bytes): correct, slower, rarely used (the shipped
    # containers are g128).
    "gemm": KernelSpec(
        name="gemm",
        programmatic=True,
        sources=("gemm.cu",),
        hot_kernels=tuple(
            f"gemm_int4_g{g}_{kind}{scale}{suffix}_n{nt}"
            for g in (32, 64, 128)
            for kind in ("sym", "asym")
            for scale in ("", "_f16s")
            for suffix in ("", "_silu")
            for nt in (2, 4, 8)
            if not (g == 32 and nt == 8)
        ),
    ),
    # INT4 GEMM on wgmma with a producer warp (gemm.py, plan.kernel "wgmma"): M <= 64 at NT = 2, 4, 8;
    # prefill M blocks of 128 rows at NT = 16, split-K up to 128 rows, stream-K above (_sk)
    "gemm_ws": KernelSpec(
        name="gemm_ws",
        programmatic=True,
        sources=("gemm_ws.cu",),
        hot_kernels=tuple(
            f"gemm_ws_int4_g{g}_{kind}{scale}_{nt}"
            for g in (32, 64, 128)
            for kind in ("sym", "asym")
            for scale in ("", "_f16s")
            for nt in ("n2", "n4", "n8", "n16", "n16_sk")
        ),
    ),
    "sampling": KernelSpec(
        name="sampling",
        programmatic=True,
        sources=("sampling.cu",),
        hot_kernels=("sample_tokens_bf16",),
    ),
    # benchmark tools (read-only bandwidth ceiling, GPU-side wait, persistent-kernel streaming ceiling), not
    # model kernels: nanoqwen_bench.gpu
    "bench": KernelSpec(
        name="bench",
        sources=("bench.cu",),
        hot_kernels=("read_xor_u32x4", "spin_ns", "step_phases_u32x4", "step_phases_preload_u32x4",
                     "step_phases_dataflow_u32x4"),
    ),
    "attention": KernelSpec(
        name="attention",
        programmatic=True,
        sources=("paged_attention.cu",),
        hot_kernels=(
            "paged_attention_decode_hd128",
            "paged_attention_decode_hd64",
            "paged_attention_prefill_hd128",
            "paged_attention_prefill_hd64",
            "paged_attention_combine_hd128",
            "paged_attention_combine_hd64",
        ),
    ),
}

# The families defined here, before any compile-option variant (a benchmark's) is registered
# adds its spec to SPECS at run time: each .cu entry file belongs to exactly one of them.
BASE_FAMILIES = tuple(SPECS)
