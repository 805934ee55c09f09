"""GPU: the fused-layer GEMVs (csrc/gemv_int4.cuh: the norm prologue and the residual epilogue) against
the launches they replace, as the engine ran them before: the plain GEMV, then
`layer_ops.fused_add_rms_norm` (its residual update), then `layer_ops.rms_norm` / the next GEMV.

- Residual epilogue (`_resid`, `_silu_resid`): the new residual must be **bitwise equal** to
  bf16(residual + bf16(y)) with y the plain GEMV's stored output (the same fp32 sum rounded the same
  way, then the same bf16 add as fused_add_rms_norm). Its statistics (per row and 128 columns, the sum
  of squares of the new residual, fp32) are checked against fp64: each is a square (one rounding) summed
  in a tree of depth 3 (a lane's four columns) + 5 (the warp's butterfly) over non-negative terms, so its
  relative error is at most (1 + 2^-24)^9 - 1 < 10 * 2^-24.
- Norm prologue (`_norm`, `_norm_rope`): on residuals whose sums of squares are exact in fp32 in any
  order (half-integers in +-[0.5, 4]: squares are multiples of 1/4 and a row's sum stays below 2^16, 18
  significant bits), the statistics are exact, so rs = rsqrtf(ss / K + eps) is the same float as the
  rms_norm kernel's, the staged input the same bits as its output, and the GEMV output must be
  **bitwise equal** to rms_norm then the plain GEMV (or the plain `_rope` kernel).
- The chain on random data (`test_fused_chain_*`): there the two sums of squares differ in order, so rs
  may differ by a few fp32 ulps (rsqrtf is within 2 ulps on either input). Each normalised input element
  is then the same bf16 value or its neighbour (an ulp of bf16 is 2^-7 relative at most, the rs
  difference < 2^-20), so |y_fused - y_unfused| <= 2^-7 sum_k |W[n, k] xn[k]| (the inputs' change
  through the same fp32 dot product, whose own rounding is < K * 2^-24 of the same sum) + 2^-7 |y|
  (both outputs rounded to bf16: one ulp apart at most beyond the change of their fp32 values).

Outputs, residual statistics and the buffer tail past them are NaN-poisoned; split-K counters must
return to zero; the chain is also captured in a CUDA graph and replayed on new inputs."""

from __future__ import annotations

import pytest
import torch
from int4_testkit import random_int4, same_bits
from nanoqwen_kernels import reference as R

pytestmark = pytest.mark.gpu

EPS = 1e-6
LAYOUTS = [(128, False), (128, True), (64, False), (32, True)]
LAYOUT_IDS = ["g128-asym", "g128-sym", "g64-asym", "g32-sym"]
SCALES = [torch.bfloat16, torch.float16]
SCALE_IDS = ["bf16_scales", "fp16_scales"]
KC_MAX = 48  # gemv.KC_MAX: an unsplit plan exists only for K <= 48 tile-columns


def _plan(n, k, split, device, *, silu=False, group_size=128):
    from nanoqwen_kernels.gemv import GemvPlan, plan_gemv, plan_shape

    sms = torch.cuda.get_device_properties(device).multi_processor_count
    plan = {"auto": lambda: plan_gemv(n, k, device, silu_input=silu, group_size=group_size),
            "unsplit": lambda: GemvPlan(n, k, 1, k // 128),
            "forced_split": lambda: plan_shape(n, k, sms, 10_000)}[split]()
    assert split == "auto" or (plan.splits == 1) == (split == "unsplit"), plan
    return plan


def _poisoned(shape, device, dtype=torch.bfloat16):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def _stats_buffer(m, h, device):
    """NaN-poisoned fp32 statistics [m, ceil(h / 128)] as the first part of a longer buffer: returns
    (view, tail), the tail must stay NaN."""
    from nanoqwen_kernels.gemv import norm_stats_shape

    shape = norm_stats_shape(m, h)
    buf = _poisoned((shape[0] * shape[1] + 64,), device, torch.float32)
    return buf[: shape[0] * shape[1]].view(shape), buf[shape[0] * shape[1]:]


def _assert_stats(stats, residual, what):
    """Derived bound (module docstring): relative error < 10 * 2^-24 of the fp64 sum."""
    ref = R.residual_stats(residual).double()
    got = stats.double()
    assert not bool(stats.isnan().any()), f"{what}: statistics not written"
    over = (got - ref).abs() / (10 * 2**-24 * ref).clamp_min(1e-30)
    assert bool((over <= 1).all()), f"{what}: worst {float(over.max()):.2f}x the derived bound"


def _half_integers(m, k, gen, device):
    """Residual rows whose sums of squares are exact in fp32 in any order (module docstring)."""
    mag = torch.randint(1, 9, (m, k), generator=gen, device=device).float() * 0.5
    sign = torch.randint(0, 2, (m, k), generator=gen, device=device).float() * 2 - 1
    return (mag * sign).to(torch.bfloat16)


def _norm_weight(k, gen, device):
    return (1 + 0.1 * torch.randn(k, generator=gen, device=device)).to(torch.bfloat16)


# (n, k, silu input): o_proj and down of the 7B and the 0.5B, and an N of 7.8 row blocks
RESIDUAL_SHAPES = [(3584, 3584, False), (3584, 18944, True), (896, 896, False), (896, 4864, True),
                   (1000, 640, False), (1000, 640, True)]
RESIDUAL_CASES = [
    pytest.param(n, k, silu, split, id=f"{n}x{k}{'-silu' if silu else ''}-{split}")
    for n, k, silu in RESIDUAL_SHAPES
    for split in ("auto", "unsplit", "forced_split")
    if not (split == "unsplit" and k // 128 > KC_MAX)
]


@pytest.mark.parametrize("n,k,silu,split", RESIDUAL_CASES)
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("group_size,symmetric", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("scale_dtype", SCALES, ids=SCALE_IDS)
def test_residual_epilogue_equals_gemv_then_add(n, k, silu, split, m, group_size, symmetric, scale_dtype,
                                                gen, device):
    from nanoqwen_kernels.gemv import GemvWorkspace, ResidualEpilogue, gemv_int4

    w = random_int4(n, k, group_size, symmetric, gen, device, scale_dtype)
    x = torch.randn(m, 2 * k if silu else k, generator=gen, device=device).to(torch.bfloat16)
    residual = (4 * torch.randn(m, n, generator=gen, device=device)).to(torch.bfloat16)
    plan = _plan(n, k, split, device, silu=silu, group_size=group_size)
    ws = GemvWorkspace.allocate([plan], device)
    y = _poisoned((m, n), device)
    gemv_int4(x, w, y, None, ws, plan, silu_mul_input=silu)
    expected = (y.float() + residual.float()).to(torch.bfloat16)  # fused_add_rms_norm's update
    fused = residual.clone()
    stats, tail = _stats_buffer(m, n, device)
    assert gemv_int4(x, w, None, None, ws, plan, silu_mul_input=silu,
                     residual=ResidualEpilogue(fused, stats)) is None
    what = f"[{n}, {k}] M={m} {plan}"
    same_bits(fused, expected, f"{what}: residual")
    _assert_stats(stats, expected, what)
    assert bool(tail.isnan().all()), f"{what}: statistics written past [M, ceil(N / 128)]"
    assert int(ws.counters.abs().sum()) == 0, "split-K counters not reset"


# (n, k): gate_up of the 7B and the 0.5B, and a small odd one (N = 1.6 row blocks)
NORM_CASES = [
    pytest.param(n, k, split, id=f"{n}x{k}-{split}")
    for n, k in [(37888, 3584), (9728, 896), (200, 640)]
    for split in ("auto", "unsplit", "forced_split")
]


@pytest.mark.parametrize("n,k,split", NORM_CASES)
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("group_size,symmetric", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("scale_dtype", SCALES, ids=SCALE_IDS)
def test_norm_prologue_equals_rms_norm_then_gemv(n, k, split, m, group_size, symmetric, scale_dtype, gen,
                                                 device):
    from nanoqwen_kernels.gemv import GemvWorkspace, NormPrologue, gemv_int4
    from nanoqwen_kernels.layer_ops import rms_norm

    w = random_int4(n, k, group_size, symmetric, gen, device, scale_dtype)
    residual = _half_integers(m, k, gen, device)
    weight = _norm_weight(k, gen, device)
    stats = R.residual_stats(residual)  # exact: fp64 sums of exact squares, below 2^16
    plan = _plan(n, k, split, device, group_size=group_size)
    ws = GemvWorkspace.allocate([plan], device)
    normed = _poisoned((m, k), device)
    rms_norm(residual, weight, normed, EPS)
    unfused = _poisoned((m, n), device)
    gemv_int4(normed, w, unfused, None, ws, plan)
    fused = _poisoned((m, n), device)
    gemv_int4(residual, w, fused, None, ws, plan, norm=NormPrologue(weight, stats, EPS))
    same_bits(fused, unfused, f"[{n}, {k}] M={m} {plan}")
    assert int(ws.counters.abs().sum()) == 0, "split-K counters not reset"


@pytest.mark.parametrize("hq,hkv,d,k", [(28, 4, 128, 3584), (14, 2, 64, 896), (6, 2, 32, 640)],
                         ids=["7b", "0.5b", "odd-d32"])
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("group_size,symmetric", [(128, False), (32, True)], ids=["g128-asym", "g32-sym"])
@pytest.mark.parametrize("split", ["auto", "forced_split"])
def test_norm_prologue_of_the_qkv_rope_gemv(hq, hkv, d, k, m, group_size, symmetric, split, gen, device):
    """The `_norm_rope` kernels: rms_norm then the plain `_rope` kernel, bitwise (q and the caches)."""
    from nanoqwen_kernels.gemv import GemvWorkspace, NormPrologue, gemv_int4_qkv_rope
    from nanoqwen_kernels.layer_ops import AttentionShape, rms_norm, rope_inv_freq

    shape = AttentionShape(hq, hkv, d)
    w = random_int4(shape.qkv_width, k, group_size, symmetric, gen, device)
    bias = torch.randn(shape.qkv_width, generator=gen, device=device).to(torch.bfloat16)
    residual = _half_integers(m, k, gen, device)
    weight = _norm_weight(k, gen, device)
    positions = torch.randint(0, 32768, (m,), generator=gen, device=device, dtype=torch.int32)
    num_blocks, bs = 2 * m + 3, 16
    slots = torch.randperm(num_blocks * bs, generator=gen, device=device)[:m].to(torch.int32)
    inv_freq = rope_inv_freq(d, 1_000_000.0, device)
    plan = _plan(w.n, k, split, device, group_size=group_size)
    ws = GemvWorkspace.allocate([plan], device)

    def run(x, norm):
        q = _poisoned((m, hq, d), device)
        kc, vc = _poisoned((num_blocks, hkv, bs, d), device), _poisoned((num_blocks, hkv, bs, d), device)
        gemv_int4_qkv_rope(x, w, bias, shape, positions, slots, inv_freq, q, kc, vc, ws, plan, norm=norm)
        return q, kc, vc

    normed = _poisoned((m, k), device)
    rms_norm(residual, weight, normed, EPS)
    unfused = run(normed, None)
    fused = run(residual, NormPrologue(weight, R.residual_stats(residual), EPS))
    for name, a, b in zip(("q_out", "k_cache", "v_cache"), fused, unfused, strict=True):
        same = (a.view(torch.int16) == b.view(torch.int16)) | (a.isnan() & b.isnan())
        assert bool(same.all()), f"M={m} {plan}: {name} differs at {int((~same).sum())} spots"
    assert not bool(fused[0].isnan().any()), "q_out not written"
    assert int(ws.counters.abs().sum()) == 0


def _chain(x, w_o, w_gu, residual, weight, ws, plans, fused, stats=None):
    """One decode half-layer: residual += o(x); y = gate_up(RMSNorm(residual) * weight). fused: the
    residual epilogue + norm prologue (stats: their statistics buffer); else GEMV, fused_add_rms_norm,
    GEMV. Returns y."""
    from nanoqwen_kernels.gemv import NormPrologue, ResidualEpilogue, gemv_int4
    from nanoqwen_kernels.layer_ops import fused_add_rms_norm

    m = x.shape[0]
    y = torch.empty(m, w_gu.n, dtype=torch.bfloat16, device=x.device)
    if fused:
        gemv_int4(x, w_o, None, None, ws, plans[0], residual=ResidualEpilogue(residual, stats))
        gemv_int4(residual, w_gu, y, None, ws, plans[1], norm=NormPrologue(weight, stats, EPS))
    else:
        proj = torch.empty(m, w_o.n, dtype=torch.bfloat16, device=x.device)
        normed = torch.empty_like(residual)
        gemv_int4(x, w_o, proj, None, ws, plans[0])
        fused_add_rms_norm(proj, residual, weight, normed, EPS)
        gemv_int4(normed, w_gu, y, None, ws, plans[1])
    return y


def _assert_chain_close(y_fused, y_unfused, normed, w_gu, what):
    """The derived bound of the module docstring, from the unfused path's normalised input."""
    dense = R.dequantize_int4(w_gu.qweight, w_gu.scales, w_gu.zeros, w_gu.group_size).float()
    mass = normed.float().abs() @ dense.abs().t()  # sum_k |W[n, k] xn[k]|, [M, N]
    bound = 2**-7 * mass + 2**-7 * y_unfused.float().abs()
    assert not bool(y_fused.isnan().any()), f"{what}: NaN"
    over = (y_fused.float() - y_unfused.float()).abs() / bound
    assert bool((over <= 1).all()), f"{what}: worst {float(over.max()):.2f}x the derived bound"


@pytest.mark.parametrize("m", [1, 5, 8])
@pytest.mark.parametrize("symmetric", [False, True], ids=["asym", "sym"])
def test_fused_chain_matches_the_unfused_chain(m, symmetric, gen, device):
    from nanoqwen_kernels.gemv import GemvWorkspace, plan_gemv
    from nanoqwen_kernels.layer_ops import rms_norm

    h, inter = 3584, 18944
    w_o = random_int4(h, h, 128, symmetric, gen, device)
    w_gu = random_int4(2 * inter, h, 128, symmetric, gen, device)
    plans = (plan_gemv(h, h, device), plan_gemv(2 * inter, h, device))
    ws = GemvWorkspace.allocate(plans, device)
    x = torch.randn(m, h, generator=gen, device=device).to(torch.bfloat16)
    residual = (4 * torch.randn(m, h, generator=gen, device=device)).to(torch.bfloat16)
    weight = _norm_weight(h, gen, device)
    res_unfused, res_fused = residual.clone(), residual.clone()
    stats, tail = _stats_buffer(m, h, device)
    y_unfused = _chain(x, w_o, w_gu, res_unfused, weight, ws, plans, False)
    y_fused = _chain(x, w_o, w_gu, res_fused, weight, ws, plans, True, stats)
    same_bits(res_fused, res_unfused, f"M={m}: residual")
    _assert_stats(stats, res_unfused, f"M={m}")
    assert bool(tail.isnan().all())
    normed = torch.empty_like(res_unfused)
    rms_norm(res_unfused, weight, normed, EPS)
    _assert_chain_close(y_fused, y_unfused, normed, w_gu, f"M={m}")
    assert int(ws.counters.abs().sum()) == 0


def test_fused_chain_graph_replay(gen, device):
    """Captured once, replayed on new inputs: each replay's residual equals the unfused chain's
    bitwise and its output is within the chain's bound; the split-K counters return to zero."""
    from nanoqwen_kernels.gemv import GemvWorkspace, plan_gemv
    from nanoqwen_kernels.layer_ops import rms_norm

    m, h, inter = 4, 3584, 18944
    w_o = random_int4(h, h, 128, False, gen, device)
    w_gu = random_int4(2 * inter, h, 128, False, gen, device)
    plans = (plan_gemv(h, h, device), plan_gemv(2 * inter, h, device))
    assert plans[0].splits > 1, plans
    ws = GemvWorkspace.allocate(plans, device)
    x = torch.randn(m, h, generator=gen, device=device).to(torch.bfloat16)
    residual = torch.randn(m, h, generator=gen, device=device).to(torch.bfloat16)
    weight = _norm_weight(h, gen, device)
    stats, _ = _stats_buffer(m, h, device)
    _chain(x, w_o, w_gu, residual.clone(), weight, ws, plans, True, stats)  # warm-up (module loads)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = _chain(x, w_o, w_gu, residual, weight, ws, plans, True, stats)
    for _ in range(3):
        x.copy_(torch.randn(m, h, generator=gen, device=device).to(torch.bfloat16))
        start = (4 * torch.randn(m, h, generator=gen, device=device)).to(torch.bfloat16)
        residual.copy_(start)
        y.fill_(float("nan"))
        stats.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        res_unfused = start.clone()
        y_unfused = _chain(x, w_o, w_gu, res_unfused, weight, ws, plans, False)
        same_bits(residual, res_unfused, "graph replay: residual")
        normed = torch.empty_like(res_unfused)
        rms_norm(res_unfused, weight, normed, EPS)
        _assert_chain_close(y, y_unfused, normed, w_gu, "graph replay")
    assert int(ws.counters.abs().sum()) == 0


def test_fused_gemv_rejects_what_it_cannot_run(gen, device):
    from nanoqwen_kernels.gemv import GemvWorkspace, NormPrologue, ResidualEpilogue, gemv_int4, plan_gemv

    m, h = 2, 640
    w = random_int4(h, h, 128, False, gen, device)
    plan = plan_gemv(h, h, device)
    ws = GemvWorkspace.allocate([plan], device)
    x = torch.randn(m, h, generator=gen, device=device).to(torch.bfloat16)
    res = torch.randn(m, h, generator=gen, device=device).to(torch.bfloat16)
    stats, _ = _stats_buffer(m, h, device)
    out = torch.empty(m, h, dtype=torch.bfloat16, device=device)
    norm = NormPrologue(_norm_weight(h, gen, device), stats, EPS)
    with pytest.raises(ValueError, match="not with silu_mul_input or residual"):
        gemv_int4(torch.randn(m, 2 * h, device=device).to(torch.bfloat16), w, out, None, ws, plan,
                  silu_mul_input=True, norm=norm)
    with pytest.raises(ValueError, match="not both"):
        gemv_int4(x, w, out, None, ws, plan, residual=ResidualEpilogue(res, stats))
    with pytest.raises(ValueError, match="not both"):
        gemv_int4(x, w, None, None, ws, plan)
    with pytest.raises(ValueError, match="norm.stats"):
        gemv_int4(x, w, out, None, ws, plan, norm=NormPrologue(norm.weight, stats[:1], EPS))
    with pytest.raises(TypeError, match="residual.stats"):
        gemv_int4(x, w, None, None, ws, plan, residual=ResidualEpilogue(res, stats.double()))
    with pytest.raises(ValueError, match="overlaps x"):
        gemv_int4(x, w, None, None, ws, plan, residual=ResidualEpilogue(x, stats))
