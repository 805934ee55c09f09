"""Checks of the post-attention block kernel (block.py, csrc/block_int4.cuh) shared by its GPU tests
(test_block.py) and its emulator tests (test_block_emu.py: the same checks on the CPU, the kernel's
own source compiled by nanoqwen_kernels.emu). Each `check_*` takes a geometry and a device. The kernel
is compared with the three GEMV launches it replaces (o_proj with the residual epilogue, gate_up with
the norm prologue, down with the SiLU input and the residual epilogue: the engine's decode path for
M <= 8, itself tested against the fp32 reference in test_gemv*.py), on the same device.

What must hold, and why:
- **o_proj, bitwise.** The test's o_proj input and weights make every fp32 sum exact in any order:
  attn holds half-integers in +-[0.5, 4], the scales are 2^-9 and q - z is an integer in [-16, 15], so
  every product is a multiple of 2^-10 below 2^-3 in magnitude and a row's sum (3584 terms at most
  here) stays below 2^9: 19 significant bits, exact in fp32 whatever the order of the additions, and
  the same in the kernel's pieces as in the GEMV's split-K. So y_o is the same fp32 value, and the
  residual after o_proj is the same bits (bf16(bf16(y) + r), the same operations).
  It is observable on its own in the cases whose down weights are all zero (every nibble 8 and every
  zero point 8: q - z = 0), where down adds exactly 0 and the final residual IS the residual after
  o_proj.
- **gate_up: the GEMV chain's derived bound** (test_gemv_fused_norm.py, `_assert_chain_close`): the
  residual after o_proj is the same bits, but its sums of squares are grouped per 16 columns here and
  per 128 in the GEMV, so rs may differ by a few fp32 ulps and each normalised input element is the
  same bf16 value or its neighbour (relative change <= 2^-7); the fp32 dot products' own rounding (a
  different grouping of the same terms) is < K 2^-24 of sum |W x| (< 2^-12 of it at K = 3584); and
  both outputs are rounded to bf16 (one ulp apart at most beyond their fp32 difference): |dy| <=
  2^-7 sum_k |W[n, k] xn[k]| + 2^-7 |y|.
- **down, from the kernel's own gate_up:** the GEMV (SiLU input, residual epilogue) fed the kernel's
  gate_up output and the exact residual after o_proj gives y_ref. Both sum the same per-group terms
  in fp32; a term passes through at most 8 chained mma steps of its group, KT = K / 128 sequential
  fma into a piece's accumulator and <= 16 additions of pieces or splits: d <= 8 + 148 + 16 = 172
  roundings of <= 2^-23 each (2^-23, not 2^-24: the tensor core may truncate), so each sum is within
  d 2^-23 sum |W h| of the exact one and the two within 2^-13.6 of it; bf16(y) then differs by at most
  that plus one bf16 ulp of y (<= 2^-7 |y|), and the final bf16 add by at most one ulp of the new
  residual (<= 2^-7 |r|): |dr| <= 2^-13 sum_k |W[n, k] h[k]| + 2^-7 |y_ref| + 2^-7 |r_ref|.
- **Statistics:** per row and 128 columns, as the GEMV writes them: each square (one rounding) summed
  in its pair by a 16-lane butterfly (depth 4), then the block's 8 pair sums in order (7 additions):
  12 roundings of non-negative terms, relative error <= (1 + 2^-24)^12 - 1 < 13 * 2^-24 of the fp64
  sum of the kernel's own residual.
- **Determinism:** two launches give the same bits; the counters are back at zero after each launch;
  a captured graph replays on new inputs with the eager launch's bits.
Outputs and statistics are NaN-poisoned first, with a poisoned tail that must stay so.

The int8 build (`int8=True`: block.register_int8_mma(), x rounded to the int8 GEMV build's planes) is
compared with the int8 GEMV build's launches (gemv.register_int8_mma()), with the same bounds and one
term more for gate_up: o_proj's input (half-integers within a factor 8 of each other) is exact in the
planes, so o_proj stays bitwise; down's and qkv's inputs are the same bits on both sides (the kernel's
own gate_up / residual), so are their planes; gate_up's normalised input may differ by an ulp between
the sides, and each side rounds it to its planes by at most 2^-15 of the element's 128-column group's
largest |x| (gemv_int4.cuh): |dy| gains 2^-14 sum_k |W[n, k]| gmax(k).
"""

from __future__ import annotations

import pytest
import torch
from int4_testkit import random_int4, same_bits
from nanoqwen_kernels import reference as R
from nanoqwen_kernels.gemv import (
    GemvWorkspace,
    NormPrologue,
    ResidualEpilogue,
    gemv_int4,
    gemv_int4_qkv_rope,
    norm_stats_shape,
    plan_gemv,
)

EPS = 1e-6
# (name, hidden H, intermediate I, o_proj's K): the 7B, the 0.5B (o_proj has fewer pair-columns than
# the grid has warps: every pair is cut into 7 pieces), and an odd one (H = 40 pairs, I = 9 tile-columns)
GEOMETRIES = [("7b", 3584, 18944, 3584), ("0.5b", 896, 4864, 896), ("odd", 640, 1152, 384)]
LAYOUTS = [(False, torch.bfloat16), (True, torch.bfloat16), (False, torch.float16)]
LAYOUT_IDS = ["asym", "sym", "asym-f16s"]

def sync(device) -> None:
    """Wait for the device's work (the emulator's launches are synchronous)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _poisoned(shape, device, dtype=torch.bfloat16, tail=64):
    """NaN-filled view of `shape` at the front of a longer buffer; returns (view, tail)."""
    n = 1
    for s in shape:
        n *= s
    buf = torch.full((n + tail,), float("nan"), dtype=dtype, device=device)
    return buf[:n].view(shape), buf[n:]


def _exact_o_weight(n, k, symmetric, scale_dtype, gen, device):
    """An INT4 weight with power-of-two scales (2^-9): o_proj's sums are exact (module docstring)."""
    w = random_int4(n, k, 128, symmetric, gen, device, scale_dtype)
    w.scales.fill_(2.0**-9)
    return w


def _zero_weight(n, k, symmetric, scale_dtype, gen, device):
    """An INT4 weight of the given layout that dequantises to exactly 0 (every nibble 8, zero points 8)."""
    w = random_int4(n, k, 128, symmetric, gen, device, scale_dtype)
    w.qweight.fill_(0x88888888 - 2**32)
    if w.zeros is not None:
        w.zeros.fill_(8)
    return w


def _half_integers(m, k, gen, device):
    mag = torch.randint(1, 9, (m, k), generator=gen, device=device).float() * 0.5
    sign = torch.randint(0, 2, (m, k), generator=gen, device=device).float() * 2 - 1
    return (mag * sign).to(torch.bfloat16)


def families(int8: bool) -> tuple[str, str]:
    """(the block kernel's family, the family of the GEMVs it is compared with): the bf16 builds, or both
    int8 builds (module docstring)."""
    from nanoqwen_kernels import block, gemv

    if int8:
        return block.register_int8_mma(), gemv.register_int8_mma()
    return block.FAMILY, gemv.FAMILY


class Layer:
    """One layer's post-attention weights and a decode step's inputs; int8: run and compare the int8 builds
    (`families`)."""

    def __init__(self, geom, m, symmetric, scale_dtype, gen, device, zero_down=False, int8=False,
                 block_family=None):
        self.int8 = int8
        self.block_family, self.gemv_family = families(int8)
        self.block_family = block_family or self.block_family  # a benchmark build of the same loop
        self.name, h, inter, kq = geom
        self.h, self.inter, self.kq, self.m = h, inter, kq, m
        self.w_o = _exact_o_weight(h, kq, symmetric, scale_dtype, gen, device)
        self.w_gu = random_int4(2 * inter, h, 128, symmetric, gen, device, scale_dtype)
        self.w_d = (_zero_weight(h, inter, symmetric, scale_dtype, gen, device) if zero_down
                    else random_int4(h, inter, 128, symmetric, gen, device, scale_dtype))
        self.norm_w = (1 + 0.1 * torch.randn(h, generator=gen, device=device)).to(torch.bfloat16)
        self.attn = _half_integers(m, kq, gen, device)
        self.resid0 = (4 * torch.randn(m, h, generator=gen, device=device)).to(torch.bfloat16)

    def plan(self, device):
        from nanoqwen_kernels.block import plan_post_attention

        return plan_post_attention(self.h, self.inter, self.kq, device, family=self.block_family)

    def run_block(self, plan, ws, resid=None):
        """One launch into poisoned outputs; returns (resid, gate_up, stats) and checks the tails."""
        from nanoqwen_kernels.block import post_attention_block

        dev = self.attn.device
        resid = self.resid0.clone() if resid is None else resid
        gate_up, gu_tail = _poisoned((self.m, 2 * self.inter), dev)
        stats, st_tail = _poisoned(norm_stats_shape(self.m, self.h), dev, torch.float32)
        post_attention_block(self.attn, self.w_o, self.norm_w, EPS, self.w_gu, self.w_d, resid, gate_up,
                             stats, ws, plan)
        sync(dev)
        assert bool(gu_tail.isnan().all()), "gate_up written past [M, 2I]"
        assert bool(st_tail.isnan().all()), "statistics written past [M, H / 128]"
        assert int(ws.counters.abs().sum()) == 0, "counters not back at zero"
        return resid, gate_up, stats

    def gemv_o(self):
        """The residual after o_proj by the GEMV (residual epilogue); returns (resid1, stats128)."""
        dev = self.attn.device
        plan = plan_gemv(self.h, self.kq, dev)
        resid = self.resid0.clone()
        stats = torch.empty(norm_stats_shape(self.m, self.h), dtype=torch.float32, device=dev)
        gemv_int4(self.attn, self.w_o, None, None, GemvWorkspace.allocate([plan], dev), plan,
                  family=self.gemv_family, residual=ResidualEpilogue(resid, stats))
        return resid, stats

    def gemv_gate_up(self, resid1, stats128):
        dev = self.attn.device
        plan = plan_gemv(2 * self.inter, self.h, dev)
        y = torch.empty(self.m, 2 * self.inter, dtype=torch.bfloat16, device=dev)
        gemv_int4(resid1, self.w_gu, y, None, GemvWorkspace.allocate([plan], dev), plan,
                  family=self.gemv_family, norm=NormPrologue(self.norm_w, stats128, EPS))
        return y

    def gemv_down(self, gate_up, resid1):
        """(y_down fp32-exact-ish bf16 output, resid2) by the GEMV from the given gate_up."""
        dev = self.attn.device
        plan = plan_gemv(self.h, self.inter, dev, silu_input=True)
        ws = GemvWorkspace.allocate([plan], dev)
        y = torch.empty(self.m, self.h, dtype=torch.bfloat16, device=dev)
        gemv_int4(gate_up, self.w_d, y, None, ws, plan, silu_mul_input=True, family=self.gemv_family)
        resid = resid1.clone()
        stats = torch.empty(norm_stats_shape(self.m, self.h), dtype=torch.float32, device=dev)
        gemv_int4(gate_up, self.w_d, None, None, ws, plan, silu_mul_input=True, family=self.gemv_family,
                  residual=ResidualEpilogue(resid, stats))
        return y, resid


def _dense(w):
    return R.dequantize_int4(w.qweight, w.scales, w.zeros, w.group_size).float()


def _assert_stats(stats, residual, what):
    ref = R.residual_stats(residual).double()
    assert not bool(stats.isnan().any()), f"{what}: statistics not written"
    over = (stats.double() - ref).abs() / (13 * 2**-24 * ref).clamp_min(1e-30)
    assert bool((over <= 1).all()), f"{what}: statistics off by {float(over.max()):.2f}x the derived bound"


def _assert_gate_up(got, want, resid1, layer, what):
    from nanoqwen_kernels.layer_ops import rms_norm

    normed = torch.empty_like(resid1)
    rms_norm(resid1, layer.norm_w, normed, EPS)
    w_abs = _dense(layer.w_gu).abs()
    mass = normed.float().abs() @ w_abs.t()
    bound = 2**-7 * mass + 2**-7 * want.float().abs()
    if layer.int8:  # each side's planes round x by <= 2^-15 of its group's largest |x| (module docstring)
        m, k = normed.shape
        gmax = normed.float().abs().view(m, k // 128, 128).amax(dim=-1).repeat_interleave(128, dim=-1)
        bound = bound + 2**-14 * (gmax @ w_abs.t())
    assert not bool(got.isnan().any()), f"{what}: gate_up not written"
    over = (got.float() - want.float()).abs() / bound
    assert bool((over <= 1).all()), f"{what}: gate_up off by {float(over.max()):.2f}x the derived bound"


def _assert_down(resid2, resid2_ref, y_ref, gate_up, layer, what):
    h = R.silu_mul(gate_up).to(torch.bfloat16).float()
    mass = h.abs() @ _dense(layer.w_d).abs().t()
    bound = 2**-13 * mass + 2**-7 * y_ref.float().abs() + 2**-7 * resid2_ref.float().abs()
    over = (resid2.float() - resid2_ref.float()).abs() / bound.clamp_min(1e-30)
    assert bool((over <= 1).all()), f"{what}: residual off by {float(over.max()):.2f}x the derived bound"


def check_o_proj_and_gate_up(geom, m, symmetric, scale_dtype, gen, device, int8=False, block_family=None):
    """Down adds exactly 0: the final residual is the residual after o_proj (bitwise the GEMV's), and
    gate_up is within the chain's derived bound."""
    from nanoqwen_kernels.block import BlockWorkspace

    layer = Layer(geom, m, symmetric, scale_dtype, gen, device, zero_down=True, int8=int8,
                  block_family=block_family)
    plan = layer.plan(device)
    ws = BlockWorkspace.allocate(plan, device)
    resid, gate_up, stats = layer.run_block(plan, ws)
    resid1, stats128 = layer.gemv_o()
    what = f"{geom[0]} M={m} {plan.warps}"
    same_bits(resid, resid1, f"{what}: residual after o_proj")
    _assert_stats(stats, resid, what)
    _assert_gate_up(gate_up, layer.gemv_gate_up(resid1, stats128), resid1, layer, what)


def check_down_and_determinism(geom, m, symmetric, scale_dtype, gen, device, int8=False, block_family=None):
    """The whole block: down from the kernel's own gate_up within its derived bound; the statistics;
    a second launch gives the same bits."""
    from nanoqwen_kernels.block import BlockWorkspace

    layer = Layer(geom, m, symmetric, scale_dtype, gen, device, int8=int8, block_family=block_family)
    plan = layer.plan(device)
    ws = BlockWorkspace.allocate(plan, device)
    resid, gate_up, stats = layer.run_block(plan, ws)
    resid_again, gate_up_again, stats_again = layer.run_block(plan, ws)
    what = f"{geom[0]} M={m} {plan.warps}"
    same_bits(resid_again, resid, f"{what}: second launch, residual")
    same_bits(gate_up_again, gate_up, f"{what}: second launch, gate_up")
    assert torch.equal(stats_again, stats), f"{what}: second launch, statistics"
    resid1, _ = layer.gemv_o()
    y_ref, resid2_ref = layer.gemv_down(gate_up, resid1)
    _assert_down(resid, resid2_ref, y_ref, gate_up, layer, what)
    _assert_stats(stats, resid, what)


def check_randomised_delays_change_nothing(geom, gen, device):
    """Deadlock freedom and determinism under other schedules: a build that pauses a pseudo-random
    0-4 us before each chunk (NQ_BLOCK_STRESS_DELAY_NS) finishes and gives the default build's bits."""
    from nanoqwen_kernels import block

    stress = "block_test_stress"
    if stress not in block.BUILDS:
        block.register_build(stress, block.BlockBuild(extra_options=("-DNQ_BLOCK_STRESS_DELAY_NS=4000",)))
    layer = Layer(geom, 2, False, torch.bfloat16, gen, device)
    plan = layer.plan(device)
    want = layer.run_block(plan, block.BlockWorkspace.allocate(plan, device))
    splan = block.plan_post_attention(layer.h, layer.inter, layer.kq, device, family=stress)
    sws = block.BlockWorkspace.allocate(splan, device)
    for _ in range(3):
        got = layer.run_block(splan, sws)
        same_bits(got[0], want[0], f"{geom[0]} stress build: residual")
        same_bits(got[1], want[1], f"{geom[0]} stress build: gate_up")
        assert torch.equal(got[2], want[2]), f"{geom[0]} stress build: statistics"


# (Hq, Hkv, D), Hq D = o_proj's K; "d128": the emulator's small geometry with the 7B's head size
HEADS = {"7b": (28, 4, 128), "0.5b": (14, 2, 64), "odd": (6, 2, 64), "d128": (3, 1, 128)}

class NextLayer:
    """The next layer's qkv projection and a decode step's RoPE / paged-cache inputs (NaN-poisoned q and
    caches)."""

    def __init__(self, layer, symmetric, scale_dtype, gen, device):
        from nanoqwen_kernels.layer_ops import AttentionShape, rope_inv_freq

        hq, hkv, d = HEADS[layer.name]
        self.shape = AttentionShape(hq, hkv, d)
        n, m = self.shape.qkv_width, layer.m
        self.w = random_int4(n, layer.h, 128, symmetric, gen, device, scale_dtype)
        self.bias = torch.randn(n, generator=gen, device=device).to(torch.bfloat16)
        self.norm_w = (1 + 0.1 * torch.randn(layer.h, generator=gen, device=device)).to(torch.bfloat16)
        self.positions = torch.randint(0, 32768, (m,), generator=gen, device=device, dtype=torch.int32)
        self.num_blocks, self.bs = 2 * m + 3, 16
        slots = torch.randperm(self.num_blocks * self.bs, generator=gen, device=device)
        self.slots = slots[:m].to(torch.int32)
        self.inv_freq = rope_inv_freq(d, 1_000_000.0, device)

    def outputs(self, m, device):
        cache = (self.num_blocks, self.shape.n_kv_heads, self.bs, self.shape.head_dim)
        q = _poisoned((m, self.shape.n_heads, self.shape.head_dim), device)[0]
        return q, _poisoned(cache, device)[0], _poisoned(cache, device)[0]

    def spec(self, q, kc, vc):
        from nanoqwen_kernels.block import NextQkv

        return NextQkv(self.w, self.bias, self.norm_w, self.shape, self.positions, self.slots, self.inv_freq,
                       q, kc, vc)


def check_next_qkv_op(geom, m, symmetric, scale_dtype, gen, device, int8=False, block_family=None):
    """The `_qkv` kernels: ops 0-2 give the bits of the kernel without the qkv op (the same work
    partition), and q / the K/V slots are within the qkv GEMV's derived bound (below) of
    `gemv_int4_qkv_rope` with the norm prologue, run on the kernel's own final residual and statistics
    (so the normalised input is the same bits); cache slots other than the rows' stay NaN.

    Bound: the qkv sums differ only in grouping (d <= 8 + K / 128 + 16 roundings of <= 2^-23, as for
    down: < 2^-13 sum |W x|), bf16(y + bias) adds one ulp (2^-7 |v|): delta(v) <= 2^-13 mass + 2^-7 |v|
    for a v head element; RoPE moves an output by at most delta(a) + delta(b) of its pair (a, b) plus one
    ulp of the output (2^-7 |out|; both sides use the same sin / cos bits)."""
    from nanoqwen_kernels.block import BlockWorkspace, plan_post_attention, post_attention_block
    from nanoqwen_kernels.layer_ops import rms_norm

    layer = Layer(geom, m, symmetric, scale_dtype, gen, device, int8=int8, block_family=block_family)
    nxt = NextLayer(layer, symmetric, scale_dtype, gen, device)
    base_plan = layer.plan(device)
    want = layer.run_block(base_plan, BlockWorkspace.allocate(base_plan, device))
    plan = plan_post_attention(layer.h, layer.inter, layer.kq, device, family=layer.block_family,
                               qkv_dim=nxt.shape.qkv_width)
    ws = BlockWorkspace.allocate(plan, device)
    resid = layer.resid0.clone()
    gate_up = _poisoned((m, 2 * layer.inter), device)[0]
    stats = _poisoned(norm_stats_shape(m, layer.h), device, torch.float32)[0]
    q, kc, vc = nxt.outputs(m, device)
    post_attention_block(layer.attn, layer.w_o, layer.norm_w, EPS, layer.w_gu, layer.w_d, resid, gate_up,
                         stats, ws, plan, next_qkv=nxt.spec(q, kc, vc))
    sync(device)
    assert int(ws.counters.abs().sum()) == 0, "counters not back at zero"
    what = f"{geom[0]} M={m}"
    same_bits(resid, want[0], f"{what}: residual with the qkv op")
    same_bits(gate_up, want[1], f"{what}: gate_up with the qkv op")
    assert torch.equal(stats, want[2]), f"{what}: statistics with the qkv op"
    # the reference: the qkv GEMV with the norm prologue on the kernel's own residual and statistics
    gplan = plan_gemv(nxt.w.n, nxt.w.k, device)
    gws = GemvWorkspace.allocate([gplan], device)
    norm = NormPrologue(nxt.norm_w, stats, EPS)
    pre = torch.empty(m, nxt.w.n, dtype=torch.bfloat16, device=device)
    gemv_int4(resid, nxt.w, pre, nxt.bias, gws, gplan, family=layer.gemv_family, norm=norm)
    q_ref, kc_ref, vc_ref = nxt.outputs(m, device)
    gemv_int4_qkv_rope(resid, nxt.w, nxt.bias, nxt.shape, nxt.positions, nxt.slots, nxt.inv_freq, q_ref,
                       kc_ref, vc_ref, gws, gplan, layer.gemv_family, norm=norm)
    normed = torch.empty_like(resid)
    rms_norm(resid, nxt.norm_w, normed, EPS)
    mass = normed.float().abs() @ _dense(nxt.w).abs().t()  # [M, N]
    delta = 2**-13 * mass + 2**-7 * pre.float().abs()
    hq, hkv, d = HEADS[geom[0]]
    half = d // 2
    delta_heads = delta.view(m, hq + 2 * hkv, d)
    pair = delta_heads[..., :half] + delta_heads[..., half:]
    rope_bound = torch.cat([pair, pair], dim=-1)  # [M, heads, D]: delta(a) + delta(b) per output
    _assert_close_to(q, q_ref, rope_bound[:, :hq] + 2**-7 * q_ref.float().abs(), f"{what}: q")
    slots = nxt.slots.long()
    for name, got, ref, bound in (("k", kc, kc_ref, rope_bound[:, hq:hq + hkv]),
                                  ("v", vc, vc_ref, delta_heads[:, hq + hkv:])):
        rows_got = got.permute(0, 2, 1, 3).reshape(-1, hkv, d)  # [slot, Hkv, D]
        rows_ref = ref.permute(0, 2, 1, 3).reshape(-1, hkv, d)
        extra = 2**-7 * rows_ref[slots].float().abs() if name == "k" else 0.0
        _assert_close_to(rows_got[slots], rows_ref[slots], bound + extra, f"{what}: {name} cache")
        untouched = torch.ones(rows_got.shape[0], dtype=torch.bool, device=device)
        untouched[slots] = False
        assert bool(rows_got[untouched].isnan().all()), f"{what}: {name} cache written outside the slots"


def _assert_close_to(got, ref, bound, what):
    assert not bool(got.isnan().any()), f"{what}: NaN (unwritten?)"
    over = (got.float() - ref.float()).abs() / bound.clamp_min(1e-30)
    assert bool((over <= 1).all()), f"{what}: off by {float(over.max()):.2f}x the derived bound"


def check_block_rejects_what_it_cannot_run(gen, device):
    from nanoqwen_kernels.block import BlockWorkspace, post_attention_block

    layer = Layer(GEOMETRIES[2], 1, False, torch.bfloat16, gen, device)
    plan = layer.plan(device)
    ws = BlockWorkspace.allocate(plan, device)
    gu = torch.empty(1, 2 * layer.inter, dtype=torch.bfloat16, device=device)
    stats = torch.empty(norm_stats_shape(1, layer.h), dtype=torch.float32, device=device)
    args = dict(o_proj=layer.w_o, norm_weight=layer.norm_w, eps=EPS, gate_up_w=layer.w_gu, down=layer.w_d,
                residual=layer.resid0.clone(), gate_up=gu, stats=stats, workspace=ws, plan=plan)
    three = torch.zeros(3, layer.kq, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match="1..2 rows"):
        post_attention_block(three, **args)
    g64 = random_int4(2 * layer.inter, layer.h, 64, False, gen, device)
    with pytest.raises(ValueError, match="group size 128"):
        post_attention_block(layer.attn, **{**args, "gate_up_w": g64})
    sym = random_int4(layer.h, layer.inter, 128, True, gen, device)
    with pytest.raises(ValueError, match="share one layout"):
        post_attention_block(layer.attn, **{**args, "down": sym})
    with pytest.raises(ValueError, match="stats"):
        post_attention_block(layer.attn, **{**args, "stats": stats[:, :-1].contiguous()})

