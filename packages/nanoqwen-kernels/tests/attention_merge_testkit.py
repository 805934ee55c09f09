"""Checks of the o projection's attention merge prologue (`gemv.gemv_int4(..., merge=...)`, csrc/
gemv_int4.cuh stage_x_merged) shared by its GPU test (test_gemv_attention_merge.py) and its emulator
test (test_gemv_attention_merge_emu.py). Each `check_*` takes a device and sizes.

What must hold, and why:
- **Bitwise equal to the launches it replaces.** The merge prologue uses the combine kernel's
  arithmetic (the same weights, the same per-split fmaf, the same order of the sums, the same
  bf16 rounding), so `attention.run` + the combine kernel + the `_resid` GEMV and `attention.run(...,
  defer_merge=True)` + the `_merge_resid` GEMV leave the same residual and the same statistics, bit
  for bit. No tolerance is needed: any difference is a bug (a wrong row, split, column or order).
- **What it may not read.** Before the deferred run, the plan's partial buffers (work_o, work_lse) are
  NaN and work_splits holds a large count: a row that came out final (unsplit, or merged in the
  attention launch) and is still read from the partials, a split past the row's count, or a count
  the attention launch did not write, turns the residual NaN or wrong.
- **Every row kind in one batch:** unsplit short contexts, split rows at several counts (up to the
  plan's), a context-0 slot (zeros), rows merged inside the attention launch (fuse_max_splits > 1);
  GEMV plans that split K (a block stages a few heads) and one that does not (a block stages them all).
- **Determinism:** each case runs twice, bit-identical, with the GEMV's split-K counters back at 0.
"""

from __future__ import annotations

import torch
from int4_testkit import random_int4, same_bits
from nanoqwen_kernels import reference as R
from nanoqwen_kernels.attention import AttentionGeometry, plan_decode
from nanoqwen_kernels.gemv import (
    MERGE_MAX_SPLITS,
    GemvPlan,
    GemvWorkspace,
    ResidualEpilogue,
    gemv_int4,
    norm_stats_shape,
    plan_gemv,
)
from nanoqwen_kernels.reference_attention import make_paged_case


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def check_merge_prologue_equals_combine(heads: tuple[int, int, int], lens: list[int], device, *,
                                        max_context_len: int, fuse_max: int = 1, gemv_split: str = "auto",
                                        group_size: int = 128, symmetric: bool = False,
                                        scale_dtype=torch.bfloat16, n_out: int | None = None,
                                        seed: int = 0, runs: int = 2) -> None:
    """One decode batch (`lens`: the context per sequence, M = len(lens) <= 8 rows) of attention with
    heads (n_heads, n_kv_heads, head_dim) and the o projection [n_out, n_heads * head_dim] (random INT4
    weight) added into a random residual: combine kernel + `_resid` GEMV against the deferred merge +
    `_merge_resid` GEMV, bitwise. gemv_split: "auto" (plan_gemv) or "unsplit" (one block row stages
    all of K)."""
    nh, nkv, hd = heads
    m, k = len(lens), nh * hd
    n = n_out or k
    case = make_paged_case(nh, nkv, hd, 16, lens, seed=seed, max_pages=-(-max_context_len // 16),
                           device=device)
    plan = plan_decode(AttentionGeometry(nh, nkv, hd, 16), max_batch=m, max_context_len=max_context_len,
                       fuse_max_splits=fuse_max, device=device)
    assert plan.can_defer_merge and 1 < plan.num_splits <= MERGE_MAX_SPLITS, plan
    gen = torch.Generator(device=device).manual_seed(seed)
    w = random_int4(n, k, group_size, symmetric, gen, device, scale_dtype)
    gplan = (plan_gemv(n, k, device, group_size=group_size) if gemv_split == "auto"
             else GemvPlan(n, k, 1, k // 128))
    ws = GemvWorkspace.allocate([gplan], device)
    residual0 = (4 * torch.randn(m, n, generator=gen, device=device)).to(torch.bfloat16)
    stats_shape = norm_stats_shape(m, n)

    def attention(defer: bool) -> torch.Tensor:
        out = torch.full((m, nh, hd), float("nan"), dtype=torch.bfloat16, device=device)
        if defer:  # what a deferred merge may not read: stale partials, unwritten split counts
            plan.work_o.fill_(float("nan"))
            plan.work_lse.fill_(float("nan"))
            plan.work_splits.fill_(1 << 20)
        plan.run(case.q, case.k_cache, case.v_cache, case.page_table, case.context_lens, out=out,
                 defer_merge=defer)
        return out.view(m, k)

    def o_proj(x: torch.Tensor, merge) -> tuple[torch.Tensor, torch.Tensor]:
        residual = residual0.clone()
        stats = torch.full(stats_shape, float("nan"), dtype=torch.float32, device=device)
        gemv_int4(x, w, None, None, ws, gplan, residual=ResidualEpilogue(residual, stats),
                  merge=merge)
        _sync(device)
        assert int(ws.counters.abs().sum()) == 0, "split-K counters not reset"
        return residual, stats

    expected = o_proj(attention(False), None)
    attn_ref = case.reference().view(m, k)
    # the unfused side is itself right (attention_testkit checks the rows; here the whole product)
    y_ref = R.linear(attn_ref.to(torch.bfloat16), R.dequantize_int4(w.qweight, w.scales, w.zeros, group_size))
    assert torch.isfinite(expected[0].float()).all() and torch.isfinite(y_ref.float()).all()
    for run in range(runs):
        got = o_proj(attention(True), plan.merge_input())
        what = (f"{heads} lens {lens} fuse_max {fuse_max} gemv {gemv_split} ({gplan.splits} K splits) "
                f"run {run}")
        same_bits(got[0], expected[0], f"{what}: residual")
        same_bits(got[1], expected[1], f"{what}: residual statistics")
    if 0 in lens:  # a context-0 slot's attention row is zeros: the residual gains only y(0) = 0
        i = lens.index(0)
        same_bits(expected[0][i], (residual0[i].float() + 0.0).to(torch.bfloat16), "context-0 row")


def check_defer_merge_is_refused_where_it_cannot_run(device) -> None:
    """A plan without the combine kernel (unsplit, or every split merged in the attention launch), or one
    that splits more than MERGE_MAX_SPLITS ways, refuses defer_merge with the reason; the GEMV refuses a
    merge with the wrong width, too few rows or a norm / SiLU input."""
    import pytest

    g = AttentionGeometry(4, 2, 128, 16)
    unsplit = plan_decode(g, max_batch=2, max_context_len=64, device=device)
    fused = plan_decode(g, max_batch=2, max_context_len=512, fuse_max_splits=16, device=device)
    many = plan_decode(g, max_batch=1, max_context_len=8192, device=device)
    assert many.num_splits > MERGE_MAX_SPLITS, many
    for p in (unsplit, fused, many):
        assert not p.can_defer_merge
        with pytest.raises(ValueError, match="does not defer"):
            p.merge_input()
    case = make_paged_case(4, 2, 128, 16, [40, 9], max_pages=4, device=device)
    with pytest.raises(ValueError, match="defer_merge needs"):
        unsplit.run(case.q, case.k_cache, case.v_cache, case.page_table, case.context_lens, defer_merge=True)
    plan = plan_decode(g, max_batch=2, max_context_len=512, device=device)
    assert plan.can_defer_merge
    gen = torch.Generator(device=device).manual_seed(3)
    w = random_int4(256, 512, 128, True, gen, device)
    x = torch.zeros(2, 512, dtype=torch.bfloat16, device=device)
    resid = torch.zeros(2, 256, dtype=torch.bfloat16, device=device)
    stats = torch.zeros(norm_stats_shape(2, 256), dtype=torch.float32, device=device)
    ws = GemvWorkspace.allocate([plan_gemv(256, 512, device)], device)
    epi = ResidualEpilogue(resid, stats)
    with pytest.raises(ValueError, match="o projection"):
        gemv_int4(x, w, torch.empty(2, 256, dtype=torch.bfloat16, device=device), None, ws,
                  merge=plan.merge_input())
    w_wide = random_int4(256, 1024, 128, True, gen, device)
    with pytest.raises(ValueError, match="columns"):
        gemv_int4(torch.zeros(2, 1024, dtype=torch.bfloat16, device=device), w_wide, None, None,
                  GemvWorkspace.allocate([plan_gemv(256, 1024, device)], device), residual=epi,
                  merge=plan.merge_input())
    small = plan_decode(g, max_batch=1, max_context_len=512, device=device)
    with pytest.raises(ValueError, match="rows"):
        gemv_int4(x, w, None, None, ws, residual=epi, merge=small.merge_input())
