"""GPU: the qkv GEMV with the RoPE / paged K/V write epilogue (`gemv.gemv_int4_qkv_rope`, the `_rope`
entry points) against the two launches it replaces, `gemv_int4` then `layer_ops.qkv_rope_kv_write`
(bias fused into the GEMV, as the engine runs them), and against the fp32 torch reference.

Against the two launches the result must be **bitwise equal**: the epilogue rounds y + bias to bf16
exactly as the GEMV stores it (one rounding of the same fp32 sum: the S == 1 store, or the split-K
partials added in split order), then applies the same `rope_sincos` / `rope_rotate` arithmetic as
qkv_rope_kv_write (each product and sum rounded on its own, no FMA contraction) and rounds once more.
Against the reference: q and k within the tolerance table's bf16 bound composed twice (the GEMV's
rounding, then RoPE's; reference.py's derivation), v within the GEMV's.

Outputs are NaN-poisoned: q_out completely, the caches everywhere, so a write to a wrong slot or a
missing write shows; a row with slot -1 (a padding row) must leave the caches untouched."""

from __future__ import annotations

import pytest
import torch
from int4_testkit import random_int4, reference_out
from nanoqwen_kernels import reference as R

pytestmark = pytest.mark.gpu

# (Hq, Hkv, D, K): the 7B, the 0.5B, the 1.5B, and an odd one (D = 32: 4 heads per 128-row block;
# N = 320 is 2.5 blocks: a half-empty last block)
GEOMETRIES = [
    pytest.param(28, 4, 128, 3584, id="7b"),
    pytest.param(14, 2, 64, 896, id="0.5b"),
    pytest.param(12, 2, 128, 1536, id="1.5b"),
    pytest.param(6, 2, 32, 640, id="odd-d32"),
]


def _inputs(hq, hkv, d, k, m, gen, device, *, block_size=16):
    from nanoqwen_kernels.layer_ops import AttentionShape, rope_inv_freq

    shape = AttentionShape(hq, hkv, d)
    num_blocks = 2 * m + 3
    x = torch.randn(m, k, generator=gen, device=device).to(torch.bfloat16)
    bias = torch.randn(shape.qkv_width, generator=gen, device=device).to(torch.bfloat16)
    positions = torch.randint(0, 32768, (m,), generator=gen, device=device, dtype=torch.int32)
    slots = torch.randperm(num_blocks * block_size, generator=gen, device=device)[:m].to(torch.int32)
    if m > 2:
        slots[1] = -1  # a padding row: q written, no cache write
    inv_freq = rope_inv_freq(d, 1_000_000.0, device)
    cache_shape = (num_blocks, hkv, block_size, d)
    return shape, x, bias, positions, slots, inv_freq, cache_shape


def _poisoned(shape, device):
    return torch.full(shape, float("nan"), dtype=torch.bfloat16, device=device)


def _two_launches(x, w, bias, shape, positions, slots, inv_freq, cache_shape, plan):
    """What the fused launch replaces: the GEMV (bias fused) into qkv, then qkv_rope_kv_write."""
    from nanoqwen_kernels.gemv import GemvWorkspace, gemv_int4
    from nanoqwen_kernels.layer_ops import qkv_rope_kv_write

    ws = GemvWorkspace.allocate([plan], x.device)
    qkv = _poisoned((x.shape[0], w.n), x.device)
    gemv_int4(x, w, qkv, bias, ws, plan)
    q, kc, vc = (_poisoned((x.shape[0], shape.n_heads, shape.head_dim), x.device),
                 _poisoned(cache_shape, x.device), _poisoned(cache_shape, x.device))
    qkv_rope_kv_write(qkv, shape, positions, slots, inv_freq, q, kc, vc)
    return q, kc, vc


def _fused(x, w, bias, shape, positions, slots, inv_freq, cache_shape, plan):
    from nanoqwen_kernels.gemv import GemvWorkspace, gemv_int4_qkv_rope

    ws = GemvWorkspace.allocate([plan], x.device)
    q, kc, vc = (_poisoned((x.shape[0], shape.n_heads, shape.head_dim), x.device),
                 _poisoned(cache_shape, x.device), _poisoned(cache_shape, x.device))
    gemv_int4_qkv_rope(x, w, bias, shape, positions, slots, inv_freq, q, kc, vc, ws, plan)
    assert int(ws.counters.abs().sum()) == 0, "split-K counters not reset"
    return q, kc, vc


def _assert_same_bits(fused, unfused, what):
    for name, a, b in zip(("q_out", "k_cache", "v_cache"), fused, unfused, strict=True):
        same = (a.view(torch.int16) == b.view(torch.int16)) | (a.isnan() & b.isnan())
        assert bool(same.all()), f"{what}: {name} differs from the two launches at {int((~same).sum())} spots"


@pytest.mark.parametrize("hq,hkv,d,k", GEOMETRIES)
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("group_size,symmetric", [(128, False), (128, True), (64, False), (32, True)],
                         ids=["g128-asym", "g128-sym", "g64-asym", "g32-sym"])
@pytest.mark.parametrize("split", ["auto", "unsplit", "forced_split"])
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16], ids=["bf16_scales", "fp16_scales"])
def test_fused_qkv_rope_equals_the_two_launches(hq, hkv, d, k, m, group_size, symmetric, split, scale_dtype,
                                                gen, device):
    from nanoqwen_kernels.gemv import GemvPlan, plan_gemv, plan_shape

    shape, x, bias, positions, slots, inv_freq, cache_shape = _inputs(hq, hkv, d, k, m, gen, device)
    w = random_int4(shape.qkv_width, k, group_size, symmetric, gen, device, scale_dtype)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    plan = {"auto": plan_gemv(w.n, k, device, group_size=group_size),
            "unsplit": GemvPlan(w.n, k, 1, k // 128),  # K <= KC_MAX tile-columns here: one block row
            "forced_split": plan_shape(w.n, k, sms, 10_000)}[split]
    assert split == "auto" or (plan.splits == 1) == (split == "unsplit"), plan
    fused = _fused(x, w, bias, shape, positions, slots, inv_freq, cache_shape, plan)
    _assert_same_bits(fused, _two_launches(x, w, bias, shape, positions, slots, inv_freq, cache_shape, plan),
                      f"{shape} M={m} {plan}")
    # and against the fp32 reference: the reference GEMV output y (fp32), RoPE on it in fp32
    from nanoqwen_model.forward import apply_rope

    q, kc, vc = fused
    y = reference_out(x, w, bias).reshape(m, hq + 2 * hkv, d)
    q_ref = apply_rope(y[:, :hq], positions, inv_freq)
    k_ref = apply_rope(y[:, hq:hq + hkv], positions, inv_freq)
    _assert_rope_close(q, q_ref, y[:, :hq], "q")
    bs = cache_shape[2]
    for i, slot in enumerate(slots.tolist()):
        page, off = divmod(slot, bs)
        if slot < 0:
            continue
        _assert_rope_close(kc[page, :, off], k_ref[i], y[i, hq:hq + hkv], f"k cache row {i}")
        R.assert_close(vc[page, :, off], y[i, hq + hkv:], f"v cache row {i}")
        kc[page, :, off] = float("nan")  # checked: poison again, so that what is left must be all NaN
        vc[page, :, off] = float("nan")
    assert bool(kc.isnan().all()) and bool(vc.isnan().all()), "K/V written outside the rows' slots"


def _assert_rope_close(actual, expected, pre_rope, what):
    """|kernel - reference| after RoPE, bounded from the GEMV's bound (reference.py's table: atol + rtol
    |y| per element of y). RoPE rotates each pair (a, b) = (y_c, y_{c + D/2}) by an angle: an output
    element is a cos - b sin (or b cos + a sin), so an error (da, db) in the pair moves it by at most
    |da| + |db| <= 2 atol + rtol (|a| + |b|); rounding the rotated value to bf16 adds 2^-8 of it; the
    kernel's sin/cos (range reduction in double, fast intrinsics on |r| <= pi: ~1e-6 absolute) adds
    2^-20 (|a| + |b|). An elementwise rtol on the output alone would not hold where a cos ~ b sin."""
    tol = R.TOLERANCES[torch.bfloat16]
    half = pre_rope.shape[-1] // 2
    pair = pre_rope[..., :half].abs() + pre_rope[..., half:].abs()
    pair = torch.cat([pair, pair], dim=-1)
    bound = 2 * tol.atol + tol.rtol * pair + 2**-8 * expected.abs() + 2**-20 * pair
    a = actual.float()
    assert not bool(a.isnan().any()), f"{what}: NaN (unwritten?)"
    over = (a - expected).abs() / bound
    assert bool((over <= 1).all()), f"{what}: worst {float(over.max()):.2f}x the derived bound"


def test_fused_qkv_rope_graph_replay(gen, device):
    """Captured once with a split plan, replayed on new inputs: each replay equals the two launches
    (the split-K counters return to zero inside the graph)."""
    from nanoqwen_kernels.gemv import GemvWorkspace, gemv_int4_qkv_rope, plan_gemv

    m = 4
    shape, x, bias, positions, slots, inv_freq, cache_shape = _inputs(28, 4, 128, 3584, m, gen, device)
    w = random_int4(shape.qkv_width, 3584, 128, False, gen, device)
    plan = plan_gemv(w.n, w.k, device)
    assert plan.splits > 1, plan
    ws = GemvWorkspace.allocate([plan], device)
    q = _poisoned((m, 28, 128), device)
    kc, vc = _poisoned(cache_shape, device), _poisoned(cache_shape, device)
    gemv_int4_qkv_rope(x, w, bias, shape, positions, slots, inv_freq, q, kc, vc, ws, plan)  # warm-up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemv_int4_qkv_rope(x, w, bias, shape, positions, slots, inv_freq, q, kc, vc, ws, plan)
    for _ in range(3):
        x.copy_(torch.randn(m, 3584, generator=gen, device=device).to(torch.bfloat16))
        positions.random_(0, 32768, generator=gen)
        for t in (q, kc, vc):
            t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _assert_same_bits((q, kc, vc),
                          _two_launches(x, w, bias, shape, positions, slots, inv_freq, cache_shape, plan),
                          "graph replay")
    assert int(ws.counters.abs().sum()) == 0


def test_fused_qkv_rope_rejects_what_it_cannot_run(gen, device):
    from nanoqwen_kernels.gemv import gemv_int4_qkv_rope
    from nanoqwen_kernels.layer_ops import AttentionShape

    shape, x, bias, positions, slots, inv_freq, cache_shape = _inputs(6, 2, 32, 640, 2, gen, device)
    w = random_int4(shape.qkv_width, 640, 128, True, gen, device)
    q, kc, vc = _poisoned((2, 6, 32), device), _poisoned(cache_shape, device), _poisoned(cache_shape, device)
    with pytest.raises(ValueError, match="head_dim"):  # 128 % 40 != 0: heads would straddle a block
        gemv_int4_qkv_rope(x, w, bias, AttentionShape(4, 2, 40), positions, slots, inv_freq, q, kc, vc)
    with pytest.raises(ValueError, match="rows"):  # the weight is not this shape's qkv
        gemv_int4_qkv_rope(x, w, bias, AttentionShape(5, 2, 32), positions, slots, inv_freq, q, kc, vc)
    with pytest.raises(ValueError, match="1..8"):
        gemv_int4_qkv_rope(torch.zeros(9, 640, dtype=torch.bfloat16, device=device), w, bias, shape,
                           positions, slots, inv_freq, q, kc, vc)
