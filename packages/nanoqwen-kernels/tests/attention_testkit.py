"""Checks of the paged attention kernels (attention.py, csrc/attention.cuh) shared by their GPU tests
(test_attention.py) and their emulator tests (test_attention_emu.py: the same checks on the CPU, the
kernels' own source compiled by nanoqwen_kernels.testing.emu). Each `check_*` takes a device; the sizes are
arguments, the GPU tests' by default, so the emulator runs the same checks on smaller cases.

What must hold, and why:
- **Every output row within R.ATTENTION_ROW of the fp32 reference** (reference.py derives the bound:
  bf16 output rounding, bf16 P in the P.V mma, fp32 accumulation over the context), row by row and
  relative to the row's own norm: a batch-wide or elementwise atol cannot catch a wrong
  long-context row (an average over thousands of tokens, ~1/40 the size of a short row).
- **Stale or unmasked reads show:** cache slots that hold no live token are NaN, page-table entries
  past a sequence's last page are out of range, q rows are strided (a view of a fused QKV buffer),
  the pages of a sequence are shuffled, and the output is NaN-poisoned before each launch (an
  unwritten row fails).
- **Determinism:** each case runs several times into fresh poisoned outputs and must be
  bit-identical (the last split to arrive merges, and which CTA that is varies run to run: a moving
  result is a race), with every split-arrival counter back at 0 after each run (what the next launch
  and a graph replay need).
"""

from __future__ import annotations

import random

import pytest
import torch
from nanoqwen_kernels import reference as R
from nanoqwen_kernels.attention import AttentionGeometry, plan_decode, plan_prefill
from nanoqwen_kernels.reference_attention import make_paged_case

GEOMS = {"7b": (28, 4, 128), "0.5b": (14, 2, 64)}  # (n_heads, n_kv_heads, head_dim)

PREFILL_CASES = [  # (context_len, query_len): prefix = context_len - query_len
    (1, 1), (7, 7), (64, 64), (65, 65), (130, 130), (6, 1), (33, 16), (64, 33),
    (170, 70), (1050, 50), (300, 300), (129, 2),
]


def check_rows(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Every [token, head] row within R.ATTENTION_ROW of its fp32 reference; NaN (unwritten) fails."""
    R.assert_rows_close(out, ref, R.ATTENTION_ROW, "paged attention")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_repeated(plan, case, runs: int = 3) -> torch.Tensor:
    """`runs` runs into NaN-poisoned outputs; all bit-identical, and every split-arrival counter back
    at 0 after each. Returns the first."""
    outs = []
    for _ in range(runs):
        out = torch.full((case.q.shape[0], *case.q.shape[1:]), float("nan"), dtype=torch.bfloat16,
                         device=case.q.device)
        plan.run(case.q, case.k_cache, case.v_cache, case.page_table, case.context_lens,
                 case.query_start_loc, out=out)
        outs.append(out)
        if plan.counters is not None:
            _sync(case.q.device)
            assert int(plan.counters.count_nonzero()) == 0, "a split group's counter was not reset"
    _sync(case.q.device)
    for o in outs[1:]:
        assert torch.equal(o.view(torch.int16), outs[0].view(torch.int16)), "runs differ: a race"
    return outs[0]


def check_decode_every_length(geom: str, block_size: int, num_splits: int | None, device, *,
                              pages: int = 3, seed: int | None = None, runs: int = 3) -> None:
    """Every context length 1 .. `pages` pages + 1 in one mixed, shuffled batch."""
    nh, nkv, hd = GEOMS[geom]
    lens = list(range(1, pages * block_size + 2))
    seed = block_size if seed is None else seed
    random.Random(seed).shuffle(lens)
    case = make_paged_case(nh, nkv, hd, block_size, lens, seed=seed, max_pages=pages + 2, device=device)
    g = AttentionGeometry(nh, nkv, hd, block_size)
    plan = plan_decode(g, max_batch=len(lens), max_context_len=(pages + 2) * block_size,
                       num_splits=num_splits, device=device)
    check_rows(run_repeated(plan, case, runs), case.reference())


def check_decode_long_context_splits(geom: str, batch: int, device, *,
                                     lens=(3001, 1, 64, 4097, 777), max_context_len: int = 4800,
                                     seed: int | None = None, runs: int = 3) -> None:
    """Long and mixed contexts with the plan's own split count (several tiles per split)."""
    nh, nkv, hd = GEOMS[geom]
    lens = list(lens)[:batch]
    case = make_paged_case(nh, nkv, hd, 16, lens, seed=batch if seed is None else seed,
                           max_pages=-(-max_context_len // 16), device=device)
    plan = plan_decode(AttentionGeometry(nh, nkv, hd, 16), max_batch=batch, max_context_len=max_context_len,
                       device=device)
    assert plan.num_splits > 1
    check_rows(run_repeated(plan, case, runs), case.reference())


def check_decode_splits_follow_the_actual_context(
        geom: str, fuse_max: int, device, *, max_context_len: int = 8192, min_splits: int = 8,
        batches=((61, [1, 64, 65, 129, 700, 8192]), (62, [8000, 3, 130, 64 * 17 + 1, 2, 4000])),
        runs: int = 3) -> None:
    """A plan made for long contexts (many splits) on short, tile-edge and long contexts in one batch:
    each (sequence, KV head) runs unsplit up to unsplit_max_tiles tiles and else splits into
    min(num_splits, its tiles), so short contexts run unsplit beside a long one split num_splits ways;
    groups of at most fuse_max splits are merged by their last split (1: none), the others by the
    combine kernel, all in one batch. `batches`: (seed, context lengths), each as long as the first."""
    nh, nkv, hd = GEOMS[geom]
    plan = plan_decode(AttentionGeometry(nh, nkv, hd, 16), max_batch=len(batches[0][1]),
                       max_context_len=max_context_len, fuse_max_splits=fuse_max, device=device)
    assert plan.num_splits >= min_splits, plan
    assert plan.launches == (2 if plan.num_splits > fuse_max else 1)
    for seed, lens in batches:
        case = make_paged_case(nh, nkv, hd, 16, lens, seed=seed, max_pages=max_context_len // 16,
                               device=device)
        check_rows(run_repeated(plan, case, runs), case.reference())


def check_decode_zero_context_slot_gives_zeros(device, *, runs: int = 3) -> None:
    nh, nkv, hd = GEOMS["7b"]
    case = make_paged_case(nh, nkv, hd, 16, [5, 0, 40], seed=11, max_pages=4, device=device)
    for splits in (1, 4):
        plan = plan_decode(AttentionGeometry(nh, nkv, hd, 16), max_batch=3, max_context_len=64,
                           num_splits=splits, device=device)
        out = run_repeated(plan, case, runs)
        assert (out[1] == 0).all()
        check_rows(out, case.reference())


def check_chunked_prefill(geom: str, num_splits: int | None, fuse_max: int, device, *,
                          cases=PREFILL_CASES, max_pages: int = 70, seed: int = 21, runs: int = 3) -> None:
    """Chunks of several sequences at once (`cases`: (context_len, query_len)): causal over the cached
    prefix plus the chunk itself; the splits merged in the kernel or by the combine kernel."""
    nh, nkv, hd = GEOMS[geom]
    ctx = [c for c, _ in cases]
    qlen = [q for _, q in cases]
    case = make_paged_case(nh, nkv, hd, 16, ctx, qlen, seed=seed, max_pages=max_pages, device=device)
    plan = plan_prefill(AttentionGeometry(nh, nkv, hd, 16), max_batch=len(ctx), max_query_len=max(qlen),
                        max_total_q=sum(qlen), max_context_len=max_pages * 16, num_splits=num_splits,
                        fuse_max_splits=fuse_max, device=device)
    check_rows(run_repeated(plan, case, runs), case.reference())


def check_prefill_block_size_8_and_single_long_chunk(device, *, context: int = 777, query: int = 513,
                                                     seed: int = 31, runs: int = 3) -> None:
    nh, nkv, hd = GEOMS["7b"]
    case = make_paged_case(nh, nkv, hd, 8, [context], [query], seed=seed, device=device)
    plan = plan_prefill(AttentionGeometry(nh, nkv, hd, 8), max_batch=1, max_query_len=query,
                        max_total_q=query, max_context_len=context, device=device)
    check_rows(run_repeated(plan, case, runs), case.reference())


def check_run_rejects_bad_input(device) -> None:
    nh, nkv, hd = GEOMS["0.5b"]
    case = make_paged_case(nh, nkv, hd, 16, [5, 9], seed=51, max_pages=2, device=device)
    plan = plan_decode(AttentionGeometry(nh, nkv, hd, 16), max_batch=2, max_context_len=32, device=device)
    with pytest.raises(TypeError, match="page_table"):
        plan.run(case.q, case.k_cache, case.v_cache, case.page_table.long(), case.context_lens)
    with pytest.raises(ValueError, match="pages per sequence"):
        plan.run(case.q, case.k_cache, case.v_cache, case.page_table[:, :1], case.context_lens)
    with pytest.raises(ValueError, match="max_batch"):
        bigger = torch.cat([case.page_table] * 2)
        plan.run(torch.cat([case.q] * 2), case.k_cache, case.v_cache, bigger, case.context_lens.repeat(2))
    with pytest.raises(ValueError, match="k_cache"):
        plan.run(case.q, case.k_cache[:, :1], case.v_cache, case.page_table, case.context_lens)
