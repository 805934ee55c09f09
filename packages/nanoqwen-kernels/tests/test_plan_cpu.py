"""CPU: GEMV planning (every K tile-column in exactly one split, no empty split, enough blocks) and
the clear error a launcher gives for a tensor that is not on an sm_90 GPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from nanoqwen_kernels import gemm, gemv, layer_ops, sampling
from nanoqwen_kernels.launch import UnsupportedDeviceError, require_sm90

SHAPES = [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944), (152064, 3584), (8, 128), (200, 640),
          (55296, 5120), (5120, 27648), (152064, 8192)]  # fmt: skip


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("target", [1, 2, 3, 4, 6, 10_000, "g128", "g128-silu", "g64", "g64-silu"])
def test_plan_covers_k_exactly(n, k, target):
    if isinstance(target, str):  # the default target of one kernel kind
        plan = gemv.plan_shape(n, k, 132, silu_input=target.endswith("silu"),
                               group_size=int(target.split("-")[0][1:]))
    else:
        plan = gemv.plan_shape(n, k, 132, target)
    kt = k // 128
    assert plan.splits >= 1 and plan.kc >= 1
    assert plan.splits * plan.kc >= kt  # every tile-column is covered
    assert (plan.splits - 1) * plan.kc < kt  # the last split is not empty
    assert plan.blocks_n == -(-n // gemv.ROWS_PER_BLOCK)
    if plan.splits == 1:
        assert plan.workspace_floats(8) == 0
    else:
        assert plan.workspace_floats(8) == plan.splits * 8 * n
    # shared memory of the staged activations fits the 227 KB a block may use
    assert plan.shared_bytes(8) <= 100 * 1024


def test_plan_splits_small_n_and_not_large_n():
    assert gemv.plan_shape(3584, 18944, 132).splits > 1  # down: 28 row blocks alone leave SMs idle
    assert gemv.plan_shape(152064, 3584, 132).splits == 1  # lm_head: 1188 row blocks


def test_default_split_targets_of_the_7b_decode_shapes():
    # the targets measured on the H200 (gemv.TARGET_BLOCKS_PER_SM's comment), at 132 SMs:
    # g128 plain: about 3 blocks per SM, or 4 where 3 would leave the shape unsplit
    assert gemv.plan_shape(4608, 3584, 132) == gemv.plan_shape(4608, 3584, 132, 3)  # qkv
    assert gemv.plan_shape(4608, 3584, 132).splits == 10
    assert gemv.plan_shape(3584, 3584, 132).splits == 14  # o (3 and 4 blocks per SM agree)
    assert gemv.plan_shape(37888, 3584, 132, 3).splits == 1
    assert gemv.plan_shape(37888, 3584, 132) == gemv.plan_shape(37888, 3584, 132, 4)  # gate_up
    assert gemv.plan_shape(37888, 3584, 132).splits == 2
    assert gemv.plan_shape(152064, 3584, 132).splits == 1  # lm_head: unsplit at any target
    # g128 SiLU input (down; 2 blocks resident): 2 blocks per SM
    assert gemv.plan_shape(3584, 18944, 132, silu_input=True) == gemv.plan_shape(3584, 18944, 132, 2)
    assert gemv.plan_shape(3584, 18944, 132, silu_input=True).splits == 9
    # g32 / g64: the old target, plain or SiLU input
    for silu in (False, True):
        for n, k in SHAPES:
            assert gemv.plan_shape(n, k, 132, silu_input=silu, group_size=64) == gemv.plan_shape(
                n, k, 132, gemv.TARGET_BLOCKS_PER_SM)


def test_workspace_sized_from_all_plans():
    plans = [gemv.plan_shape(n, k, 132) for n, k in SHAPES]
    ws = gemv.GemvWorkspace.allocate(plans, torch.device("cpu"))
    assert ws.partials.numel() == max(p.workspace_floats(8) for p in plans)
    assert ws.counters.numel() == max(p.blocks_n for p in plans)
    assert int(ws.counters.abs().sum()) == 0


def test_cpu_tensors_get_a_clear_error():
    with pytest.raises(UnsupportedDeviceError, match="CUDA tensors"):
        require_sm90(torch.device("cpu"))
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    with pytest.raises(UnsupportedDeviceError):
        layer_ops.rms_norm(x, torch.zeros(64, dtype=torch.bfloat16), torch.empty_like(x), 1e-6)
    with pytest.raises(UnsupportedDeviceError):
        sampling.sample_tokens(
            x, sampling.SamplingState.allocate(2, "cpu"), torch.empty(2, dtype=torch.int32)
        )


# ---- INT4 GEMM (M > 8) -----------------------------------------------------------------------------


@pytest.mark.parametrize("m,n_tiles", [(1, 2), (9, 2), (16, 2), (17, 4), (32, 4), (33, 8), (64, 8), (65, 8),
                                       (4096, 8)])  # fmt: skip
def test_gemm_n_tiles_by_m(m, n_tiles):
    assert gemm.n_tiles_for(m) == n_tiles


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("max_m", [16, 32, 64, None])
@pytest.mark.parametrize("group_size", [32, 128])
def test_gemm_plan_covers_k_and_fits(n, k, max_m, group_size):
    plan = gemm.plan_gemm_shape(n, k, group_size, max_m, 132)
    kt = k // 128
    assert plan.splits * plan.kc >= kt and (plan.splits - 1) * plan.kc < kt
    assert plan.blocks_n == -(-n // gemm.ROWS_PER_BLOCK)
    measured = gemm.MEASURED_PLANS.get((132, n, k, group_size, max_m))
    if measured is not None:  # measured: that kernel, M blocks of 8 NT rows, the measured splits
        assert (plan.kernel, plan.n_tiles, plan.splits) == measured
        assert plan.max_m == max_m and plan.m_blocks(max_m) == max_m // (8 * plan.n_tiles)
        assert plan.shared_bytes(False) <= gemm.MAX_SHARED_BYTES
        assert plan.threads == (640 if plan.kernel == "wgmma" else 256)
        return
    assert plan.kernel == "mma"
    if max_m is None:  # many M blocks: never split K (the M blocks give the CTAs; no [S, M, N] scratch)
        assert plan.splits == 1 and plan.n_tiles == 8 and plan.counters == 0
    else:  # the argmin of the documented cost model (ties: fewer splits), one M block of max_m rows
        assert plan.rows_per_mblock == max_m
        slots = 132 * gemm.blocks_per_sm(group_size, plan.n_tiles)
        kt = k // 128
        costs = {s: gemm.split_cost(plan.blocks_n, kt, s, slots, max_m) for s in range(1, min(kt, 64) + 1)}
        assert gemm.split_cost(plan.blocks_n, kt, plan.splits, slots, max_m) == min(costs.values())
    for silu in (False, True):
        assert plan.shared_bytes(silu) <= 227 * 1024 // gemm.blocks_per_sm(group_size, plan.n_tiles)


def test_gemm_wgmma_plans():
    """The wgmma kernel serves the M classes 16..64 only, takes a plain input, and its shared memory
    (ring + the block's scale table) grows with the K range: g32 down unsplit does not fit."""
    with pytest.raises(ValueError, match="M <= 64"):
        gemm.GemmPlan(4608, 3584, 128, 8, 1, 28, None, kernel="wgmma")
    with pytest.raises(ValueError, match="kernel"):
        gemm.GemmPlan(4608, 3584, 128, 8, 1, 28, 64, kernel="tma")
    assert gemm.ws_shared_bytes(64, 148, 32, True) > gemm.MAX_SHARED_BYTES
    assert gemm.ws_shared_bytes(64, 37, 128, True) <= gemm.MAX_SHARED_BYTES
    assert gemm.kernel_name("g128_asym", False, 8, "wgmma") == "gemm_ws_int4_g128_asym_n8"


def test_gemm_split_plans_of_the_7b_shapes():
    """Wave quantization in the model (the SiLU-input plans: MEASURED_PLANS has the plain input's):
    down at M <= 64 (28 row blocks, 1 block per SM at NT = 8) splits into one wave (<= 132 blocks), not
    into 5 x 28 = 140 (two waves); qkv at M = 16 fills its 264 slots."""
    down = gemm.plan_gemm_shape(3584, 18944, 128, 64, 132, True)
    assert down.kernel == "mma" and down.splits > 1 and down.blocks_n * down.splits <= 132
    qkv = gemm.plan_gemm_shape(4608, 3584, 128, 16, 132, True)
    assert 132 < qkv.blocks_n * qkv.splits <= 264
    assert gemm.plan_gemm_shape(37888, 3584, 128, 64, 132).splits == 1  # 296 row blocks: partials cost more


def test_gemm_measured_plans_cover_the_test_models_on_132_sms_only():
    """MEASURED_PLANS has every M class of the 7B / 1.5B / 0.5B layer linears at g128 on 132 SMs; a
    plan with fewer rows than its class runs several M blocks (two or four at the class's top M), one
    arrival counter per (M block, row block) tile when split. Another SM count, another group size or
    the SiLU input plans by the model."""
    shapes = {(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944), (2048, 1536), (1536, 1536),
              (17920, 1536), (1536, 8960), (1152, 896), (896, 896), (9728, 896), (896, 4864)}
    assert set(gemm.MEASURED_PLANS) == {(132, n, k, 128, c) for n, k in shapes for c in (16, 32, 64)}
    for (sms, n, k, g, max_m), (kernel, nt, splits) in gemm.MEASURED_PLANS.items():
        plan = gemm.plan_gemm_shape(n, k, g, max_m, sms)
        assert (plan.kernel, plan.n_tiles, plan.splits, plan.max_m) == (kernel, nt, splits, max_m)
        blocks = max_m // (8 * nt)
        assert plan.grid(max_m) == (blocks, plan.blocks_n, splits)
        assert plan.counters == (blocks * plan.blocks_n if splits > 1 else 0)
        assert plan.splits * plan.kc >= k // 128 > (plan.splits - 1) * plan.kc
    several = gemm.plan_gemm_shape(4608, 3584, 128, 64, 132)  # 7B qkv at class 64: two 32-row M blocks
    assert (several.kernel, several.n_tiles) == ("wgmma", 4)
    assert several.grid(33) == (2, 36, 1) and several.grid(32) == (1, 36, 1)
    for n, k in [(37888, 3584), (3584, 18944), (4608, 3584)]:
        assert gemm.plan_gemm_shape(n, k, 128, 64, 114).kernel == "mma"
        assert gemm.plan_gemm_shape(n, k, 128, 64, 114).n_tiles == 8
        assert gemm.plan_gemm_shape(n, k, 64, 64, 132).kernel == "mma"
        assert gemm.plan_gemm_shape(n, k, 128, 64, 132, True).kernel == "mma"


def test_gemm_grid_walks_m_blocks_fastest():
    plan = gemm.plan_gemm_shape(37888, 3584, 128, None, 132)
    assert plan.grid(4096) == (64, 296, 1)
    assert plan.grid(65) == (2, 296, 1)
    small = gemm.plan_gemm_shape(3584, 18944, 128, 32, 132)
    assert small.grid(20) == (1, 28, small.splits) and small.splits > 1  # down: 28 row blocks alone


def test_gemm_workspace_sized_from_all_plans():
    shapes = [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944)]
    plans = gemm.plans_for_shapes(shapes, 128, 132)
    ws = gemm.allocate_workspace(plans, torch.device("cpu"))
    assert ws.partials.numel() == max(p.workspace_floats(p.max_m) for p in plans if p.needs_workspace) > 0
    assert any(p.kernel == "wgmma" and p.max_m == 128 and p.splits > 1 for p in plans)  # the prefill plans
    stream_k = [p for p in plans if p.stream_k_blocks]  # and above 128 rows: 2 partial tiles per block
    assert stream_k and ws.partials.numel() >= 2 * 132 * 128 * 128
    assert ws.counters.numel() >= max(p.m_blocks(p.max_m) * p.blocks_n for p in plans if p.splits > 1)
    assert ws.counters.numel() >= 132  # stream-K: one per block
    assert int(ws.counters.abs().sum()) == 0


def test_gemm_kernel_names_are_all_built():
    from nanoqwen_kernels import build
    from nanoqwen_kernels.specs import SPECS

    suffixes = [f"g{g}_{kind}{scale}" for g in (32, 64, 128) for kind in ("sym", "asym")
                for scale in ("", "_f16s")]
    names = {gemm.kernel_name(s, silu, nt) for s in suffixes for silu in (False, True) for nt in (2, 4, 8)}
    hot = set(SPECS["gemm"].hot_kernels)
    assert hot <= names
    assert all(n.startswith("gemm_int4_g32_") and n.endswith("_n8") for n in names - hot)  # specs.py
    src = (build.CSRC_DIR / "gemm.cu").read_text()
    assert all(f"NQ_GEMM_G({g})" in src for g in (32, 64, 128))


@pytest.mark.parametrize("splits", [1, 2, 3, 7, 28, 500])
def test_gemm_plan_with_splits_covers_k(splits):
    plan = gemm.plan_gemm_shape(4608, 3584, 128, 16, 132)
    forced = plan.with_splits(splits)
    kt = 3584 // 128
    assert forced.splits * forced.kc >= kt and (forced.splits - 1) * forced.kc < kt  # each column once
    assert forced.splits == -(-kt // -(-kt // min(splits, kt))) <= splits
    assert (forced.n, forced.k, forced.n_tiles, forced.max_m) == (plan.n, plan.k, plan.n_tiles, plan.max_m)
    with pytest.raises(ValueError, match="bounded M class"):
        gemm.plan_gemm_shape(4608, 3584, 128, None, 132).with_splits(2)
    multi = gemm.GemmPlan.of(3584, 3584, 128, 4, 64, 4)  # several M blocks may split
    assert (multi.splits, multi.m_blocks(64), multi.counters) == (4, 2, 2 * multi.blocks_n)


def test_gemm_plan_refuses_inconsistent_shapes():
    with pytest.raises(ValueError, match="exactly once"):
        gemm.GemmPlan(3584, 3584, 128, 8, 3, 5, 64)  # 3 x 5 tile-columns < 28
    with pytest.raises(ValueError, match="bounded M class"):
        gemm.GemmPlan(3584, 3584, 128, 8, 2, 14, None)  # split K for any M: no bounded [S, M, N] scratch
    with pytest.raises(ValueError, match="use n_tiles 2"):
        gemm.GemmPlan(3584, 3584, 128, 4, 1, 28, 16)  # 32-row M blocks for M <= 16
    with pytest.raises(ValueError, match="does not serve"):
        gemm.GemmPlan(3584, 3584, 128, 4, 1, 28, 48)
    with pytest.raises(ValueError, match="at least one row"):
        gemm.n_tiles_for(0)


def test_prefill_plan_blocks_of_128_rows_fill_the_sms():
    """plan_gemm_prefill: the wgmma kernel at NT = 16 (384 threads). Up to 128 rows, one M block split
    along K until row blocks x splits about fill the SMs; above, M blocks of 128 rows, K unsplit."""
    p = gemm.plan_gemm_prefill(4608, 3584, 100, 128, 132)  # 36 row blocks
    assert (p.kernel, p.n_tiles, p.max_m, p.splits, p.threads) == ("wgmma", 16, 128, 3, 384)
    assert p.grid(100) == (1, 36, 3) and p.counters == 36
    big = gemm.plan_gemm_prefill(37888, 3584, 512, 128, 132)  # 4 x 296 tiles: 8.97 full waves
    assert (big.max_m, big.splits, big.stream_k_blocks, big.grid(512)) == (None, 1, 0, (4, 296, 1))
    qkv = gemm.plan_gemm_prefill(4608, 3584, 512, 128, 132)  # 144 tiles: a second wave of 12 -> stream-K
    assert (qkv.stream_k_blocks, qkv.grid(512), qkv.units_per_block(512)) == (132, (132, 1, 1), 31)
    assert qkv.units(512) == 4 * 36 * 28 and qkv.counters == 132
    assert qkv.workspace_floats(4096) == 2 * 132 * 128 * 128  # two partial tiles per block, any M
    assert not gemm.plan_gemm_prefill(4608, 3584, 256, 128, 132).stream_k_blocks  # 72 tiles x 28: no gain
    assert gemm.plan_gemm_prefill(3584, 18944, 256, 128, 132).stream_k_blocks == 132  # down: 56 tiles x 148
    tiny = dataclasses.replace(gemm.plan_gemm_prefill(24, 384, 129, 128, 132), stream_k_blocks=132)
    assert tiny.grid(129) == (6, 1, 1)  # at most one block per unit
    with pytest.raises(ValueError, match="stream-K"):
        dataclasses.replace(p, stream_k_blocks=132)  # the split plan of <= 128 rows
    # the split-K scratch of a 128-row class: [S, 128, N] floats
    ws = gemm.allocate_workspace([p], torch.device("cpu"))
    assert ws.partials.numel() >= 3 * 128 * 4608 and ws.counters.numel() >= 36
    down = gemm.plan_gemm_prefill(3584, 18944, 512, 128, 132)  # the 7B's down, K unsplit: it fits
    assert gemm.ws_shared_bytes(128, down.kc, 128, True) <= gemm.MAX_SHARED_BYTES
    with pytest.raises(ValueError, match="shared memory"):  # g32 over K = 18944 unsplit: the table
        gemm.plan_gemm_prefill(3584, 18944, 512, 32, 132)
    assert gemm.prefill_plan_if_fits(3584, 18944, 512, 32, 132) is None  # the engine dequantises there
    split = gemm.plan_gemm_prefill(3584, 18944, 100, 32, 132)  # split along K up to 128 rows: it fits
    assert gemm.prefill_plan_if_fits(3584, 18944, 100, 32, 132) == split
    with pytest.raises(ValueError, match="M > 64"):
        gemm.plan_gemm_prefill(4608, 3584, 64, 128, 132)


def test_gemm_plan_refuses_what_no_kernel_runs():
    with pytest.raises(ValueError, match="NT <= 8 serves M <= 64"):
        gemm.GemmPlan.of(4608, 3584, 128, 8, None, kernel="wgmma")
    with pytest.raises(ValueError, match="n_tiles 16"):  # NT = 16 is the wgmma kernel's only
        gemm.GemmPlan.of(4608, 3584, 128, 16, 128)
    with pytest.raises(ValueError, match="split-K needs a bounded M class"):
        gemm.GemmPlan(4608, 3584, 128, 16, 2, 14, None, "wgmma")
