"""Checks of the g128 GEMVs on the int8 tensor cores (the opt-in build `gemv.register_int8_mma()`;
csrc/gemv_int4.cuh `stage_x_planes`, `mma_col_int8`), shared by the emulator test
(test_gemv_int8_mma_emu.py) and the GPU test (test_gemv_int8_mma.py). Each check takes a device and a
`launch` context factory (the emulator's `emu.emulated`, or nothing on the GPU).

What must hold, and why:
- **Plain kernels against their reference.** The build multiplies x as it rounds it to 16-bit block
  floating point per row and 128-column group (`reference.int8_planes_input`); the output must equal the
  fp32 product of the dequantized weight with that input within the bf16 row of reference.TOLERANCES.
  Why that table and nothing more: the products (q - z) X are integers, summed exactly in s32 (|v| <
  2^26), float(v) rounds once (2^-24 relative), times p exactly (a power of two), and the groups then add
  in fp32 as the bf16 loop's do -- the table's derivation (bf16 output rounding + fp32 summation order).
  Inputs span 2^-12..2^3 inside each group, with exact zeros, so that rounding happens (asserted).
- **Non-finite input is not hidden:** a group holding Inf or NaN makes its row's outputs NaN; the other
  rows keep their values.
- **Fused kinds bit for bit against the plain int8 kernel** on the same input (the staging is the bf16
  build's): the residual epilogue = bf16(y + residual); the norm prologue = rms_norm, then the plain kernel;
  the qkv epilogue = the plain kernel, then qkv_rope_kv_write (the attention merge prologue:
  attention_merge_testkit with `family`).
Outputs start NaN-poisoned; split-K counters must be back at 0. Each check takes the family (the build,
INT8_MMA_FAMILY).
"""

from __future__ import annotations

import contextlib

import torch
from int4_testkit import random_int4, same_bits
from nanoqwen_kernels import gemv, layer_ops
from nanoqwen_kernels import reference as R
from nanoqwen_kernels.gemv import GemvPlan, GemvWorkspace, NormPrologue, ResidualEpilogue

I8 = gemv.INT8_MMA_FAMILY
EPS = 1e-6


def no_context(**_):
    return contextlib.nullcontext()


def wide_range_x(m: int, k: int, gen: torch.Generator, device) -> torch.Tensor:
    """bf16 [m, k]: N(0, 1) times 2^-12..2^3 per element, every 7th element zero."""
    scale = torch.pow(2.0, torch.randint(-12, 4, (m, k), generator=gen, device=device).float())
    x = torch.randn(m, k, generator=gen, device=device) * scale
    x.view(-1)[::7] = 0.0
    return x.to(torch.bfloat16)


def half_integers(m: int, k: int, gen: torch.Generator, device) -> torch.Tensor:
    """Residual rows whose sums of squares are exact in fp32 in any order (test_gemv_fused_norm.py)."""
    mag = torch.randint(1, 9, (m, k), generator=gen, device=device).float() * 0.5
    sign = torch.randint(0, 2, (m, k), generator=gen, device=device).float() * 2 - 1
    return (mag * sign).to(torch.bfloat16)


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def run_plain(x, w, plan: GemvPlan, launch, bias=None, silu=False, seed=0, family=I8) -> torch.Tensor:
    out = torch.full((x.shape[0], w.n), float("nan"), dtype=torch.bfloat16, device=x.device)
    ws = GemvWorkspace.allocate([plan], x.device)
    with launch(seed=seed):
        gemv.gemv_int4(x, w, out, bias, workspace=ws, plan=plan, silu_mul_input=silu, family=family)
    _sync(x.device)
    assert int(ws.counters.abs().sum()) == 0, "split-K counters not reset"
    return out


def check_plain(n, k, plan, m, symmetric, scale_dtype, gen, device, launch=no_context, silu=False,
                family=I8) -> None:
    w = random_int4(n, k, 128, symmetric, gen, device, scale_dtype)
    x = (torch.randn(m, 2 * k, generator=gen, device=device).to(torch.bfloat16) if silu
         else wide_range_x(m, k, gen, device))
    bias = torch.randn(n, generator=gen, device=device).to(torch.bfloat16)
    out = run_plain(x, w, plan, launch, bias, silu=silu, seed=m, family=family)
    xin = R.silu_mul(x).to(torch.bfloat16) if silu else x
    xq = R.int8_planes_input(xin)
    if not silu:
        assert bool((xq != x.float()).any()), "no element was rounded: the case does not test the rounding"
    dense = R.dequantize_int4(w.qweight, w.scales, w.zeros, 128)
    R.assert_close(out, R.linear(xq, dense, bias), what=f"int8 GEMV [{n}, {k}] M={m} {plan}")


def check_non_finite_rows(gen, device, launch=no_context, family=I8) -> None:
    n, k, m = 136, 512, 4
    w = random_int4(n, k, 128, False, gen, device)
    x = wide_range_x(m, k, gen, device)
    plan = GemvPlan(n, k, 2, 2)
    clean = run_plain(x, w, plan, launch, family=family)
    x[1, 200] = float("inf")
    x[3, 511] = float("nan")
    dirty = run_plain(x, w, plan, launch, family=family)
    assert bool(dirty[[1, 3]].isnan().all()), "a row with Inf / NaN input must come out NaN"
    same_bits(dirty[[0, 2]], clean[[0, 2]], "rows without non-finite input")


def check_residual_epilogue(n, k, plan, m, silu, symmetric, scale_dtype, gen, device,
                            launch=no_context, family=I8) -> None:
    w = random_int4(n, k, 128, symmetric, gen, device, scale_dtype)
    x = torch.randn(m, 2 * k if silu else k, generator=gen, device=device).to(torch.bfloat16)
    y = run_plain(x, w, plan, launch, silu=silu, seed=m, family=family)
    residual = (4 * torch.randn(m, n, generator=gen, device=device)).to(torch.bfloat16)
    fused = residual.clone()
    stats = torch.full(gemv.norm_stats_shape(m, n), float("nan"), device=device)
    ws = GemvWorkspace.allocate([plan], device)
    with launch(seed=m):
        gemv.gemv_int4(x, w, None, workspace=ws, plan=plan, silu_mul_input=silu, family=family,
                       residual=ResidualEpilogue(fused, stats))
    _sync(device)
    same_bits(fused, (y.float() + residual.float()).to(torch.bfloat16), f"residual epilogue, plan {plan}")
    assert not bool(stats.isnan().any())
    assert int(ws.counters.abs().sum()) == 0, "split-K counters not reset"


def _normed(residual, weight, launch) -> torch.Tensor:
    out = torch.full(residual.shape, float("nan"), dtype=torch.bfloat16, device=residual.device)
    with launch():
        layer_ops.rms_norm(residual, weight, out, EPS)
    return out


def check_norm_prologue(n, k, plan, m, symmetric, scale_dtype, gen, device, launch=no_context,
                        family=I8) -> None:
    w = random_int4(n, k, 128, symmetric, gen, device, scale_dtype)
    residual = half_integers(m, k, gen, device)
    weight = (1 + 0.1 * torch.randn(k, generator=gen, device=device)).to(torch.bfloat16)
    unfused = run_plain(_normed(residual, weight, launch), w, plan, launch, seed=m, family=family)
    fused = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=device)
    with launch(seed=m):
        gemv.gemv_int4(residual, w, fused, workspace=GemvWorkspace.allocate([plan], device), plan=plan,
                       family=family, norm=NormPrologue(weight, R.residual_stats(residual), EPS))
    _sync(device)
    assert not bool(fused.isnan().any())
    same_bits(fused, unfused, f"norm prologue, plan {plan}")


def check_qkv_epilogue(shape: layer_ops.AttentionShape, k, plan, m, symmetric, scale_dtype, gen, device,
                       launch=no_context, family=I8) -> None:
    """The qkv kernel (norm prologue + RoPE / paged K/V epilogue) against the plain kernel on the normed
    input, then qkv_rope_kv_write."""
    n, block_size, blocks = shape.qkv_width, 16, 2 * m + 3
    w = random_int4(n, k, 128, symmetric, gen, device, scale_dtype)
    bias = torch.randn(n, generator=gen, device=device).to(torch.bfloat16)
    residual = half_integers(m, k, gen, device)
    weight = (1 + 0.1 * torch.randn(k, generator=gen, device=device)).to(torch.bfloat16)
    positions = torch.randint(0, 32768, (m,), generator=gen, device=device, dtype=torch.int32)
    slots = torch.randperm(blocks * block_size, generator=gen, device=device)[:m].to(torch.int32)
    slots[m // 2] = -1  # not written
    inv_freq = layer_ops.rope_inv_freq(shape.head_dim, 1_000_000.0, device)

    def buffers():
        q = torch.full((m, shape.n_heads, shape.head_dim), float("nan"), dtype=torch.bfloat16, device=device)
        cache = [torch.full((blocks, shape.n_kv_heads, block_size, shape.head_dim), float("nan"),
                            dtype=torch.bfloat16, device=device) for _ in range(2)]
        return q, *cache

    qkv = run_plain(_normed(residual, weight, launch), w, plan, launch, bias, seed=m, family=family)
    unfused = buffers()
    with launch(seed=m):
        layer_ops.qkv_rope_kv_write(qkv, shape, positions, slots, inv_freq, *unfused)
    fused = buffers()
    with launch(seed=m):
        gemv.gemv_int4_qkv_rope(residual, w, bias, shape, positions, slots, inv_freq, *fused,
                                GemvWorkspace.allocate([plan], device), plan, family=family,
                                norm=NormPrologue(weight, R.residual_stats(residual), EPS))
    _sync(device)
    assert not bool(fused[0].isnan().any())
    for a, b, what in zip(fused, unfused, ("q", "k cache", "v cache"), strict=True):
        same = (a.view(torch.int16) == b.view(torch.int16)) | (a.isnan() & b.isnan())
        assert bool(same.all()), f"qkv {what}: {int((~same).sum())} elements differ"
