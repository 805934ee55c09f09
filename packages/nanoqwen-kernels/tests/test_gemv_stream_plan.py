"""CPU: the "stream" GEMV variant's plan (gemv.plan_shape_stream) and a line-by-line Python model of the
kernel's work decomposition (csrc/gemv_int4_stream.cuh): which warp of which block computes which tile
pair over which tile-columns, and the register ring's load/compute order. The GPU tests in
test_gemv.py check the numbers; these check, without a GPU, that every (tile row, tile-column) is
computed exactly once, from a ring slot that holds it, and that every output row is written once."""

from __future__ import annotations

import numpy as np
import pytest
from nanoqwen_kernels import gemv

SHAPES = [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944), (152064, 3584), (8, 128), (24, 384),
          (200, 640), (1000, 1152), (136, 4096), (55296, 5120), (5120, 27648), (152064, 8192)]  # fmt: skip
DEPTH = 4  # NQ_GEMV_STREAM_DEPTH in csrc/gemv.cu


def ring_schedule(tc_lo: int, tc_hi: int, depth: int) -> list[int]:
    """The tile-columns one warp computes, in order, following the kernel's prologue and ring loop;
    asserts each is computed from the ring slot that was loaded with it."""
    ring: list[int | None] = [tc_lo + u if tc_lo + u < tc_hi else None for u in range(depth)]
    order = []
    for base in range(tc_lo, tc_hi, depth):
        for u in range(depth):
            tc = base + u
            if tc < tc_hi:
                assert ring[u] == tc, f"slot {u} holds {ring[u]}, compute wants {tc}"
                order.append(tc)
                ring[u] = tc + depth if tc + depth < tc_hi else None
    assert all(r is None for r in ring), "a load was issued that is never consumed"
    return order


def simulate(plan: gemv.GemvPlan, depth: int = DEPTH):
    """Run the kernel's index arithmetic for every block and warp; return (count of computations per
    [tile_row, tile_col], count of writes per output row), as gemv_int4_stream touches them."""
    n, k, kw = plan.n, plan.k, plan.k_slices
    kt, nt = k // 128, n // 8
    computed = np.zeros((nt, kt), dtype=np.int32)
    written = np.zeros(n, dtype=np.int32)
    schedules = {}
    pairs_per_block = gemv.STREAM_WARPS // kw
    for block in range(plan.stream_blocks):
        for warp in range(gemv.STREAM_WARPS):
            pslot, slc = divmod(warp, kw)
            pair = block * pairs_per_block + pslot
            tr0, tr1 = 2 * pair, 2 * pair + 1
            has0, has1 = tr0 < nt, tr1 < nt
            if not has0:
                continue
            tc_lo, tc_hi = slc * kt // kw, (slc + 1) * kt // kw
            key = (tc_lo, tc_hi)
            if key not in schedules:
                schedules[key] = np.array(ring_schedule(tc_lo, tc_hi, depth), dtype=np.int64)
            rows = [tr0, tr1] if has1 else [tr0]
            for tr in rows:
                np.add.at(computed[tr], schedules[key], 1)
            if slc == 0:  # the epilogue: the slice-0 warp writes the rows of both tiles
                for tr in rows:
                    written[8 * tr : 8 * tr + 8] += 1
    return computed, written


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("k_slices", [None, 1, 2, 4, 8])
def test_stream_plan_covers_every_tile_once(n, k, k_slices):
    if k_slices is not None and k_slices > k // 128:
        with pytest.raises(ValueError, match="k_slices"):
            gemv.plan_shape_stream(n, k, 132, k_slices)
        return
    plan = gemv.plan_shape_stream(n, k, 132, k_slices)
    assert plan.variant == "stream" and plan.k_slices in (1, 2, 4, 8) and plan.k_slices <= k // 128
    # the default plan's fields are kept for M > stream_max_m
    base = gemv.plan_shape(n, k, 132)
    assert (plan.splits, plan.kc, plan.blocks_n) == (base.splits, base.kc, base.blocks_n)
    assert plan.workspace_floats(8) == base.workspace_floats(8)
    # the last block holds at least one existing pair
    pairs = -(-n // 16)
    per_block = gemv.STREAM_WARPS // plan.k_slices
    assert (plan.stream_blocks - 1) * per_block < pairs <= plan.stream_blocks * per_block
    for depth in (DEPTH, 1, 3):
        computed, written = simulate(plan, depth)
        assert (computed == 1).all(), f"tiles computed {computed.min()}..{computed.max()} times"
        assert (written == 1).all(), f"rows written {written.min()}..{written.max()} times"


@pytest.mark.parametrize("n,k", SHAPES)
def test_stream_plan_shared_memory_and_m(n, k):
    plan = gemv.plan_shape_stream(n, k, 132)
    m = plan.stream_max_m
    assert 0 <= m <= gemv.MAX_M
    if m:
        assert plan.stream_shared_bytes(m) <= gemv.STREAM_SMEM_MAX
    if m < gemv.MAX_M:
        assert plan.stream_shared_bytes(m + 1) > gemv.STREAM_SMEM_MAX
    assert plan.uses_stream(1) == (m >= 1)
    assert not plan.uses_stream(m + 1)
    assert not gemv.plan_shape(n, k, 132).uses_stream(1)  # the default plan never runs the variant
    assert gemv.plan_shape_stream(n, k, 132, max_m=1).stream_max_m == min(m, 1)


def test_stream_plan_7b_choices():
    """The 7B decode shapes on 132 SMs: one wave of blocks with the most K slices for the small
    shapes, >= 4 waves for gate_up and lm_head; the stream kernel runs every M but down's M > 2."""
    got = {(n, k): gemv.plan_shape_stream(n, k, 132) for n, k in SHAPES[:5]}
    assert {s: (p.k_slices, p.stream_blocks, p.stream_max_m) for s, p in got.items()} == {
        (4608, 3584): (4, 144, 8),
        (3584, 3584): (8, 224, 8),
        (37888, 3584): (4, 1184, 8),
        (3584, 18944): (8, 224, 2),
        (152064, 3584): (1, 1188, 8),
    }
