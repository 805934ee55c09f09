"""CPU: the post-attention block kernel's work decomposition and addressing, by a host emulation.

`emulate` below transliterates csrc/block_int4.cuh's bookkeeping -- the pair-column ranges of the warps
(`range_start`, `range_owner`, `piece_slot`), each warp's chunk cursor (`enter_op`, `chunk_cols`,
`advance`) run twice (the ring's issue cursor RING chunks ahead of the compute cursor, across the ops'
boundaries), the byte offsets of each chunk's two bulk copies, the flat indices of its scales and zero
points, the pieces' partial slots, the per-pair arrival counters and the last arrival's sum in k order,
the residual statistics per pair and their per-128-column sums by the last pair of each block
-- and runs it on the CPU, warps in a random order within each op (the order in which pieces arrive
is the GPU's to choose). Each chunk's "slot" is rebuilt from the packed bytes at the kernel's offsets
and dequantised by nanoqwen_kernels.reference with the scales found at the kernel's indices, in fp64.

Asserted: every chunk a warp computes is the one its ring slot was filled with; every pair-column of
every op is computed exactly once; no partial slot is written twice within an op, and the last arrival
reads exactly the partials of its pair's pieces; every pair is finished once; and the outputs (gate_up,
the residual, the statistics) equal a direct fp64 evaluation of the same three ops with the same bf16
roundings, bitwise (fp64 sums in another order differ by ~1e-16 relative: no bf16 rounding can tell
them apart short of a tie, which these seeds do not hit). The GPU tests (test_block.py) check the
kernel itself.
"""

from __future__ import annotations

import random

import pytest
import torch
from int4_testkit import random_int4
from nanoqwen_kernels import block
from nanoqwen_kernels import build as kbuild
from nanoqwen_kernels import reference as R
from nanoqwen_kernels.gemv import Int4Weight

EPS = 1e-6
TILE = 512


def _weight(n, k, symmetric, gen):
    return random_int4(n, k, 128, symmetric, gen, "cpu")


class Op:
    def __init__(self, w: Int4Weight, warps: int):
        self.w, self.N, self.K = w, w.n, w.k
        self.KT, self.NP = w.k // 128, w.n // 16
        self.T, self.W = self.NP * self.KT, warps

    # csrc/block_int4.cuh
    def range_start(self, gw):
        return (self.T * gw) // self.W

    def range_owner(self, c):
        return ((c + 1) * self.W - 1) // self.T

    def piece_slot(self, gw, p):
        return 0 if self.range_start(gw) >= p * self.KT else 1


class Cursor:
    """A warp's cursor over its chunks of the three ops (block_int4.cuh's Cursor, enter_op, chunk_cols,
    advance): op, the next chunk's pair p and tile-column tc, the pair-columns left of the range."""

    def __init__(self, ops, gw, chunk):
        self.ops, self.gw, self.chunk = ops, gw, chunk
        self.op = self.p = self.tc = self.left = self.kt = 0
        self._enter()

    def _enter(self):
        while self.op < len(self.ops):
            o = self.ops[self.op]
            if self.gw < o.W:
                start = o.range_start(self.gw)
                self.left = o.range_start(self.gw + 1) - start
                self.kt = o.KT
                self.p = start // o.KT
                self.tc = start - self.p * o.KT
                if self.left > 0:
                    return
            self.op += 1

    def cols(self):
        return min(self.chunk, self.kt - self.tc, self.left)

    def advance(self, nc):
        self.left -= nc
        self.tc += nc
        if self.tc == self.kt:
            self.tc = 0
            self.p += 1
        if self.left == 0:
            self.op += 1
            self._enter()

    @property
    def pos(self):  # the pair-column index (for the coverage check)
        return self.p * self.kt + self.tc


def _slot_dense(o: Op, p: int, tc: int, nc: int) -> torch.Tensor:
    """The chunk's 16 x (nc * 128) weights as the kernel sees them: two bulk copies of nc * 512 bytes at
    ((2p) KT + tc) * 512 and that + KT * 512, the scales / zero points of lane g's rows at
    (16p + g) KT + tc + j and that + 8 KT; dequantised in fp64."""
    raw = o.w.qweight.contiguous().view(torch.uint8).flatten()
    src = ((2 * p) * o.KT + tc) * TILE
    tile0 = raw[src: src + nc * TILE]
    tile1 = raw[src + o.KT * TILE: src + o.KT * TILE + nc * TILE]
    q = torch.cat([tile0, tile1]).view(torch.int32).reshape(2, nc, 32, 4)
    flat_s = o.w.scales.flatten()
    flat_z = None if o.w.zeros is None else o.w.zeros.flatten()
    idx = torch.tensor([[(16 * p + g) * o.KT + tc + j + (8 * o.KT if half else 0) for j in range(nc)]
                        for half in (0, 1) for g in range(8)])
    scales = flat_s[idx]
    zeros = None if flat_z is None else flat_z[idx]
    return R.dequantize_int4(q, scales, zeros, 128).double()


def _bf16(x):
    return x.to(torch.bfloat16).double()


def emulate(plan, build, weights, attn, resid0, norm_w, seed, qkv=None):
    """The kernel's algorithm on the CPU (module docstring). qkv: (in_norm_w, bias, head_dim) of the
    qkv op (weights has its weight as a 4th entry). Returns (resid, gate_up, stats, qkv_out, heads_done)."""
    ops = [Op(w, wp) for w, wp in zip(weights, plan.warps, strict=True)]
    total = plan.grid * build.warps
    m = attn.shape[0]
    rng = random.Random(seed)
    resid = resid0.double().clone()
    gate_up = torch.full((m, ops[1].N), float("nan"), dtype=torch.float64)
    pair_stats = torch.full((m, ops[0].NP), float("nan"), dtype=torch.float64)
    stats = torch.full((m, ops[0].N // 128), float("nan"), dtype=torch.float64)
    block_counters = [0] * (ops[0].N // 128)
    qkv_out = torch.full((m, ops[3].N), float("nan"), dtype=torch.float64) if qkv else None
    head_counters = [0] * (ops[3].N // qkv[2]) if qkv else []
    heads_done = [0] * len(head_counters)
    # per warp: the ring (what each slot holds), the issue cursor, the compute cursor, chunks computed
    rings = {}
    issue, comp, computed = {}, {}, {}
    for gw in range(total):
        ic = Cursor(ops, gw, build.chunk)
        rings[gw] = [None] * build.ring
        for s in range(build.ring):
            if ic.op < len(ops):
                rings[gw][s] = (ic.op, ic.p, ic.tc, ic.cols())
                ic.advance(ic.cols())
        issue[gw], comp[gw], computed[gw] = ic, Cursor(ops, gw, build.chunk), 0
    covered = [torch.zeros(o.T, dtype=torch.int32) for o in ops]
    for k, o in enumerate(ops):
        if k == 0:
            x = attn.double()
        elif k == 1:
            rs = 1.0 / torch.sqrt(stats.sum(1, keepdim=True) / o.K + EPS)  # stat_blocks = H / 128
            x = _bf16(resid * rs * norm_w.double())
        elif k == 2:
            x = R.silu_mul(_bf16(gate_up).float()).to(torch.bfloat16).double()
        else:  # the next layer's qkv: its input norm of the final residual
            rs = 1.0 / torch.sqrt(stats.sum(1, keepdim=True) / o.K + EPS)
            x = _bf16(resid * rs * qkv[0].double())
        ws: dict[tuple[int, int], tuple[int, torch.Tensor]] = {}
        counters = [0] * o.NP
        finished = [0] * o.NP
        order = list(range(total))
        rng.shuffle(order)
        for gw in order:
            cc = comp[gw]
            acc = torch.zeros(16, m, dtype=torch.float64)
            piece_from_0 = cc.tc == 0
            while cc.op == k:
                p, tc, nc = cc.p, cc.tc, cc.cols()
                ends = tc + nc == o.KT or nc == cc.left
                s = computed[gw] % build.ring
                assert rings[gw][s] == (k, p, tc, nc), f"warp {gw}: slot {s} holds another chunk"
                covered[k][cc.pos: cc.pos + nc] += 1
                cc.advance(nc)
                acc += _slot_dense(o, p, tc, nc) @ x[:, tc * 128:(tc + nc) * 128].t()
                ic = issue[gw]
                rings[gw][s] = None
                if ic.op < len(ops):
                    rings[gw][s] = (ic.op, ic.p, ic.tc, ic.cols())
                    ic.advance(ic.cols())
                computed[gw] += 1
                if not ends:
                    continue
                whole = piece_from_0 and tc + nc == o.KT
                piece_from_0 = True
                y = acc
                if not whole:
                    key = (gw, o.piece_slot(gw, p))
                    assert key not in ws, f"op {k}: partial slot {key} written twice"
                    ws[key] = (p, acc.clone())
                    counters[p] += 1
                    first = o.range_owner(p * o.KT)
                    pieces = o.range_owner((p + 1) * o.KT - 1) - first + 1
                    if counters[p] < pieces:
                        acc = torch.zeros(16, m, dtype=torch.float64)
                        continue
                    assert counters[p] == pieces
                    y = torch.zeros(16, m, dtype=torch.float64)
                    for j in range(pieces):
                        owner, part = ws[(first + j, o.piece_slot(first + j, p))]
                        assert owner == p, f"op {k}: pair {p} read a partial of pair {owner}"
                        y = y + part
                finished[p] += 1
                rows = slice(16 * p, 16 * p + 16)
                if k == 1:
                    gate_up[:, rows] = _bf16(y.t())
                elif k == 3:
                    bias = qkv[1].double()[rows] if qkv[1] is not None else 0.0
                    qkv_out[:, rows] = _bf16(y.t() + bias)
                    d = qkv[2]
                    hd = 16 * p // d  # the last of the head's d / 16 pairs does RoPE / K/V for it
                    head_counters[hd] += 1
                    if head_counters[hd] == d // 16:
                        assert not torch.isnan(qkv_out[:, hd * d:(hd + 1) * d]).any(), f"head {hd} incomplete"
                        heads_done[hd] += 1
                        head_counters[hd] = 0
                else:
                    resid[:, rows] = _bf16(_bf16(y.t()) + resid[:, rows])
                    pair_stats[:, p] = (resid[:, rows] ** 2).sum(1)
                    b = p >> 3  # the last of the 128-column block's 8 pairs adds them in pair order
                    block_counters[b] += 1
                    if block_counters[b] == 8:
                        stats[:, b] = pair_stats[:, 8 * b: 8 * b + 8].sum(1)
                        block_counters[b] = 0
                acc = torch.zeros(16, m, dtype=torch.float64)
        assert all(c == 1 for c in covered[k].tolist()), f"op {k}: pair-columns not covered exactly once"
        assert finished == [1] * o.NP, f"op {k}: pairs finished {finished}"
        assert block_counters == [0] * len(block_counters), f"op {k}: a statistics block left unfinished"
    assert all(r == [None] * build.ring for r in rings.values()), "chunks issued but never computed"
    assert head_counters == [0] * len(head_counters) and heads_done == [1] * len(heads_done), heads_done
    return resid, gate_up, stats, qkv_out


def direct(weights, attn, resid0, norm_w, qkv=None):
    """The ops with full fp64 products and the kernel's bf16 roundings."""
    w_o, w_gu, w_d = (R.dequantize_int4(w.qweight, w.scales, w.zeros, 128).double() for w in weights[:3])
    resid = _bf16(_bf16(attn.double() @ w_o.t()) + resid0.double())
    h = resid.shape[1]
    rs = 1.0 / torch.sqrt((resid**2).sum(1, keepdim=True) / h + EPS)
    gate_up = _bf16(_bf16(resid * rs * norm_w.double()) @ w_gu.t())
    act = R.silu_mul(gate_up.float()).to(torch.bfloat16).double()
    resid = _bf16(_bf16(act @ w_d.t()) + resid)
    qkv_out = None
    if qkv:
        w_q = R.dequantize_int4(weights[3].qweight, weights[3].scales, weights[3].zeros, 128).double()
        rs = 1.0 / torch.sqrt((resid**2).sum(1, keepdim=True) / h + EPS)
        bias = qkv[1].double() if qkv[1] is not None else 0.0
        qkv_out = _bf16(_bf16(resid * rs * qkv[0].double()) @ w_q.t() + bias)
    return resid, gate_up, (resid**2).view(resid.shape[0], -1, 128).sum(-1), qkv_out


# (hidden, intermediate, o_proj's K, SMs, the next qkv's (Hq, Hkv, D) or None): pairs whole and cut,
# ranges inside one pair and across several, fewer pair-columns than warps (o_proj at 3 SMs), a single
# CTA; heads of 32, 64 and 128 columns (2, 4, 8 pairs)
CASES = [(256, 384, 256, 1, None), (256, 384, 256, 3, (4, 2, 64)), (384, 1152, 640, 7, (5, 1, 128)),
         (384, 1152, 640, 2, None), (640, 896, 384, 5, (12, 4, 32)), (640, 896, 384, 5, None)]
BUILDS = [block.BlockBuild(), block.BlockBuild(16, 4, 2), block.BlockBuild(8, 2, 4)]


@pytest.mark.parametrize("h,inter,kq,sms,heads", CASES)
@pytest.mark.parametrize("build", BUILDS, ids=lambda b: f"w{b.warps}c{b.chunk}r{b.ring}")
@pytest.mark.parametrize("m", [1, 2])
def test_emulated_kernel_equals_the_ops(h, inter, kq, sms, heads, build, m):
    gen = torch.Generator().manual_seed(h * 7 + sms * 131 + m)
    weights = (_weight(h, kq, False, gen), _weight(2 * inter, h, False, gen), _weight(h, inter, True, gen))
    attn = torch.randn(m, kq, generator=gen).to(torch.bfloat16)
    resid0 = (4 * torch.randn(m, h, generator=gen)).to(torch.bfloat16)
    norm_w = (1 + 0.1 * torch.randn(h, generator=gen)).to(torch.bfloat16)
    qkv, qkv_dim = None, None
    if heads is not None:
        hq, hkv, d = heads
        qkv_dim = (hq + 2 * hkv) * d
        weights += (_weight(qkv_dim, h, False, gen),)
        qkv = ((1 + 0.1 * torch.randn(h, generator=gen)).to(torch.bfloat16),
               torch.randn(qkv_dim, generator=gen).to(torch.bfloat16), d)
    block.BUILDS["_emulated"] = build
    try:
        plan = block.plan_post_attention(h, inter, kq, torch.device("cpu"), sms=sms, family="_emulated",
                                         qkv_dim=qkv_dim)
    finally:
        del block.BUILDS["_emulated"]
    assert plan.warps == tuple(min(sms * build.warps, (n // 16) * (k // 128)) for n, k in plan.shapes)
    got = emulate(plan, build, weights, attn, resid0, norm_w, seed=sms, qkv=qkv)
    want = direct(weights, attn, resid0, norm_w, qkv=qkv)
    names = ("residual", "gate_up", "statistics", "qkv")
    for name, a, b in zip(names, got, want, strict=True):
        if name == "statistics":
            assert torch.allclose(a, b, rtol=1e-12), "statistics differ"
        elif b is not None:
            assert torch.equal(a.to(torch.bfloat16), b.to(torch.bfloat16)), f"{name} differs"


def test_plan_refuses_what_the_kernel_cannot_run():
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="multiple of 128"):
        block.plan_post_attention(3584, 18944 + 64, 3584, cpu, sms=132)
    with pytest.raises(ValueError, match="multiple of 128"):
        block.plan_post_attention(3584, 18944, 3600, cpu, sms=132)
    plan = block.plan_post_attention(3584, 18944, 3584, cpu, sms=132)
    assert plan.warps == (2112, 2112, 2112) and plan.max_pairs == 2368
    # x staged whole: 2 rows of the 18944-column down input + the rings fit the 227 KB an H100/H200 CTA gets
    assert plan.shared_bytes(2) + 1024 <= 227 * 1024
    # the int8 build adds the planes' table (64 bytes per 128 columns of x): it fits with 2 ring slots per
    # warp, and would not with the default build's 3
    i8 = block.plan_post_attention(3584, 18944, 3584, cpu, sms=132, family=block.register_int8_mma())
    assert i8.build.int8 and i8.build.ring == 2 and i8.warps == plan.warps
    assert i8.shared_bytes(2) == plan.shared_bytes(2) - 16 * 3072 + 18944 // 128 * 64
    assert i8.shared_bytes(2) + 1024 <= 227 * 1024
    assert block.BlockBuild(ring=3, int8=True).shared_bytes(2, 18944) + 1024 > 227 * 1024


@pytest.mark.skipif(kbuild.nvcc_path() is None, reason="nvcc not installed on this machine")
def test_benchmark_builds_compile_without_local_memory(tmp_path):
    """Every build bench/kernels/block_ab.py sweeps compiles without a stack frame or spills (a build
    that spilled would time the spills)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[3] / "bench" / "kernels" / "block_ab.py"
    module_spec = importlib.util.spec_from_file_location("block_ab", path)
    block_ab = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(block_ab)
    for name, shape in block_ab.BUILDS.items():
        build = block.BlockBuild(*shape)
        spec = kbuild.KernelSpec(f"block_{name}", ("block.cu",), build.options)
        _, report = kbuild.compile_nvcc(spec, tmp_path / name)
        kernels = [k for k in report if k.startswith("post_attention_block_")]
        assert len(kernels) == 8, (name, sorted(report))
        bad = {k: report[k] for k in kernels if report[k].uses_local_memory}
        assert not bad, f"build {name} {shape} uses local memory: {bad}"
