"""Helpers shared by the INT4 kernel tests (test_gemv.py, test_gemm.py): a random INT4 weight and the
fp32 reference output. conftest.py puts this folder on sys.path (pytest imports the test files with
--import-mode=importlib, so they cannot import each other)."""

from __future__ import annotations

import torch
from nanoqwen_kernels import reference as R


def random_int4(n, k, group_size, symmetric, gen, device, scale_dtype=torch.bfloat16):
    """A random Int4Weight whose outputs are O(1) for N(0, 1) inputs: every bit pattern of the packed
    words is a valid weight, so the words are random bytes. scale_dtype float16: the -f16s layout, whose
    zero points span 0..16 (GPTQ v1's stored-minus-one gives 16); the scales are then fp16 values with
    10 mantissa bits, which bf16 could not hold (a kernel reading them as bf16 would fail)."""
    from nanoqwen_kernels.gemv import Int4Weight

    words = torch.randint(0, 256, (n * k // 2,), generator=gen, device=device, dtype=torch.uint8)
    qweight = words.view(torch.int32).reshape(n // 8, k // 128, 32, 4)
    base = 1.0 / (4.6 * k**0.5)
    scales = (base * (0.5 + torch.rand(n, k // group_size, generator=gen, device=device))).to(scale_dtype)
    zeros = None
    if not symmetric:
        zmax = 16 if scale_dtype == torch.float16 else 15
        zeros = torch.randint(0, zmax + 1, (n, k // group_size), generator=gen, device=device,
                              dtype=torch.uint8)
    w = Int4Weight(qweight, scales, zeros, n, k, group_size)
    assert w.kernel_suffix().endswith("_f16s") == (scale_dtype == torch.float16)  # which kernel runs
    return w


def kc_plan(n: int, k: int, kc: int):
    """A GemvPlan of kc tile-columns per block (the last split takes what is left)."""
    from nanoqwen_kernels.gemv import GemvPlan

    return GemvPlan(n, k, -(-(k // 128) // kc), kc)


def same_bits(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """a and b hold the same bits (bf16 or fp32, compared as integers: NaN payloads and the sign of zero
    count); the message says how many elements differ and where the first is."""
    ints = {2: torch.int16, 4: torch.int32}[a.element_size()]
    same = a.contiguous().view(ints) == b.contiguous().view(ints)
    bad = (~same).nonzero()
    assert bad.numel() == 0, (f"{what}: {bad.shape[0]} of {a.numel()} elements differ, "
                              f"first at {bad[0].tolist()}")


def reference_out(x, w, bias, silu=False, bf16_weight=False):
    """fp32 x @ W^T (+ bias) of the dequantised weight; bf16_weight: of the weight rounded to bf16 first
    (round((q - z) s): what the prefill plan's kernel and dequantise + cuBLAS multiply)."""
    xin = R.silu_mul(x).to(torch.bfloat16) if silu else x
    return R.int4_linear(xin, w, bias, bf16_weight=bf16_weight)


def run_gemm(x, w, bias, plan=None, silu=False):
    """Launch into a NaN-poisoned output followed by a poisoned guard of 2 rows; check the guard is
    untouched and the split-K counters are back at zero; return out [M, N]."""
    from nanoqwen_kernels.gemm import allocate_workspace, gemm_int4, plan_gemm

    m = x.shape[0]
    plan = plan or plan_gemm(w.n, w.k, m, w.group_size, x.device, silu_input=silu)
    ws = allocate_workspace([plan], x.device)
    buf = torch.full(((m + 2) * w.n,), float("nan"), dtype=torch.bfloat16, device=x.device)
    out = buf[: m * w.n].view(m, w.n)
    gemm_int4(x, w, out, bias=bias, workspace=ws, plan=plan, silu_mul_input=silu)
    assert torch.isnan(buf[m * w.n :].float()).all(), "GEMM wrote past row M - 1"
    assert int(ws.counters.abs().sum()) == 0, "split-K counters not reset"
    return out
