"""GPU tests of the paged attention kernels against the fp32 plain-torch reference.

Every case draws fresh random bf16 inputs on shuffled, non-contiguous page tables; cache slots that
hold no live token are NaN, page-table entries past a sequence's last page are out of range, and the
output is NaN-poisoned before each launch, so a stale read, an unmasked tail slot or an unwritten row
all fail. Each case runs three times and must be bit-identical (a moving error is a race). The
sanitizer test runs compute-sanitizer (racecheck, synccheck, memcheck) over a reduced set.

Every output row (one query token and head) is checked on its own, relative to its own reference
norm: R.ATTENTION_ROW (reference.py derives the bound: bf16 output rounding, bf16 P in the P.V mma,
fp32 accumulation over the context). A batch-wide or elementwise atol cannot catch a wrong long-context
row: those rows are averages over thousands of tokens, ~1/40 the size of a short row.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from nanoqwen_kernels import reference as R
from nanoqwen_kernels.attention import AttentionGeometry, plan_decode, plan_prefill
from nanoqwen_kernels.reference_attention import make_paged_case

pytestmark = pytest.mark.gpu

GEOMS = {"7b": (28, 4, 128), "0.5b": (14, 2, 64)}
SANITIZE_SCRIPT = Path(__file__).parents[1] / "bench" / "attention" / "sanitize_attention.py"


def _check(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Every [token, head] row within R.ATTENTION_ROW of its fp32 reference; NaN (unwritten) fails."""
    R.assert_rows_close(out, ref, R.ATTENTION_ROW, "paged attention")


def _run3(plan, case) -> torch.Tensor:
    """Three runs into NaN-poisoned outputs; all bit-identical (the last split to arrive merges, and
    which CTA that is varies run to run), and every split-arrival counter back at 0 after each (what
    the next launch and graph replay need). Returns the first."""
    outs = []
    for _ in range(3):
        out = torch.full((case.q.shape[0], *case.q.shape[1:]), float("nan"), dtype=torch.bfloat16,
                         device=case.q.device)
        plan.run(case.q, case.k_cache, case.v_cache, case.page_table, case.context_lens,
                 case.query_start_loc, out=out)
        outs.append(out)
        if plan.counters is not None:
            torch.cuda.synchronize()
            assert int(plan.counters.count_nonzero()) == 0, "a split group's counter was not reset"
    torch.cuda.synchronize()
    for o in outs[1:]:
        assert torch.equal(o.view(torch.int16), outs[0].view(torch.int16)), "runs differ: a race"
    return outs[0]


@pytest.mark.parametrize(
    "geom, block_size",
    [("7b", 16), ("0.5b", 16), ("7b", 8), ("0.5b", 32), ("7b", 64), ("0.5b", 128)],
)
@pytest.mark.parametrize("num_splits", [None, 3])
def test_decode_every_length(geom, block_size, num_splits):
    """Every context length 1 .. 3 pages + 1 in one mixed, shuffled batch."""
    nh, nkv, hd = GEOMS[geom]
    lens = list(range(1, 3 * block_size + 2))
    random.Random(block_size).shuffle(lens)
    case = make_paged_case(nh, nkv, hd, block_size, lens, seed=block_size, max_pages=5)
    g = AttentionGeometry(nh, nkv, hd, block_size)
    plan = plan_decode(g, max_batch=len(lens), max_context_len=5 * block_size, num_splits=num_splits)
    _check(_run3(plan, case), case.reference())


@pytest.mark.parametrize("geom", ["7b", "0.5b"])
@pytest.mark.parametrize("batch", [1, 5])
def test_decode_long_context_splits(geom, batch):
    """Long and mixed contexts with the plan's own split count (several tiles per split)."""
    nh, nkv, hd = GEOMS[geom]
    lens = [3001, 1, 64, 4097, 777][:batch]
    case = make_paged_case(nh, nkv, hd, 16, lens, seed=batch, max_pages=300)
    plan = plan_decode(AttentionGeometry(nh, nkv, hd, 16), max_batch=batch, max_context_len=4800)
    assert plan.num_splits > 1
    _check(_run3(plan, case), case.reference())


@pytest.mark.parametrize("geom", ["7b", "0.5b"])
@pytest.mark.parametrize("fuse_max", [1, 4, 16])
def test_decode_splits_follow_the_actual_context(geom, fuse_max):
    """A plan made for 8K contexts (many splits) on short, tile-edge and long contexts in one batch:
    each (sequence, KV head) runs unsplit up to unsplit_max_tiles tiles and else splits into
    min(num_splits, its tiles), so short contexts run unsplit beside an 8K one split num_splits ways;
    groups of at most fuse_max splits are merged by their last split (1: none), the others by the
    combine kernel, all in one batch."""
    nh, nkv, hd = GEOMS[geom]
    plan = plan_decode(AttentionGeometry(nh, nkv, hd, 16), max_batch=6, max_context_len=8192,
                       fuse_max_splits=fuse_max)
    assert plan.num_splits >= 8, plan
    assert plan.launches == (2 if plan.num_splits > fuse_max else 1)
    for seed, lens in ((61, [1, 64, 65, 129, 700, 8192]), (62, [8000, 3, 130, 64 * 17 + 1, 2, 4000])):
        case = make_paged_case(nh, nkv, hd, 16, lens, seed=seed, max_pages=8192 // 16)
        _check(_run3(plan, case), case.reference())


def test_decode_zero_context_slot_gives_zeros():
    nh, nkv, hd = GEOMS["7b"]
    lens = [5, 0, 40]
    case = make_paged_case(nh, nkv, hd, 16, lens, seed=11, max_pages=4)
    for splits in (1, 4):
        plan = plan_decode(AttentionGeometry(nh, nkv, hd, 16), max_batch=3, max_context_len=64,
                           num_splits=splits)
        out = _run3(plan, case)
        assert (out[1] == 0).all()
        _check(out, case.reference())


PREFILL_CASES = [  # (context_len, query_len): prefix = context_len - query_len
    (1, 1), (7, 7), (64, 64), (65, 65), (130, 130), (6, 1), (33, 16), (64, 33),
    (170, 70), (1050, 50), (300, 300), (129, 2),
]


@pytest.mark.parametrize("geom", ["7b", "0.5b"])
@pytest.mark.parametrize("num_splits", [1, 2, None])
@pytest.mark.parametrize("fuse_max", [1, 16], ids=["combine-kernel", "in-kernel-merge"])
def test_chunked_prefill(geom, num_splits, fuse_max):
    nh, nkv, hd = GEOMS[geom]
    ctx = [c for c, _ in PREFILL_CASES]
    qlen = [q for _, q in PREFILL_CASES]
    case = make_paged_case(nh, nkv, hd, 16, ctx, qlen, seed=21, max_pages=70)
    plan = plan_prefill(AttentionGeometry(nh, nkv, hd, 16), max_batch=len(ctx), max_query_len=max(qlen),
                        max_total_q=sum(qlen), max_context_len=70 * 16, num_splits=num_splits,
                        fuse_max_splits=fuse_max)
    _check(_run3(plan, case), case.reference())


def test_prefill_block_size_8_and_single_long_chunk():
    nh, nkv, hd = GEOMS["7b"]
    case = make_paged_case(nh, nkv, hd, 8, [777], [513], seed=31)
    plan = plan_prefill(AttentionGeometry(nh, nkv, hd, 8), max_batch=1, max_query_len=513,
                        max_total_q=513, max_context_len=777)
    _check(_run3(plan, case), case.reference())


@pytest.mark.parametrize("pdl", [False, True], ids=["plain", "pdl"])
def test_decode_graph_replay_serves_new_lengths(pdl):
    """One captured graph; new lengths, page tables and queries written into its buffers in place.
    With PDL, the split kernel and the combine are programmatic edges of the graph."""
    nh, nkv, hd = GEOMS["7b"]
    g = AttentionGeometry(nh, nkv, hd, 16)
    first = make_paged_case(nh, nkv, hd, 16, [10, 200, 33], seed=41, max_pages=40, strided_q=False,
                            spare_blocks=60)
    plan = plan_decode(g, max_batch=3, max_context_len=640)
    out = torch.full_like(first.q, float("nan"))
    plan.run(first.q, first.k_cache, first.v_cache, first.page_table, first.context_lens, out=out, pdl=pdl)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.run(first.q, first.k_cache, first.v_cache, first.page_table, first.context_lens, out=out,
                 pdl=pdl)
    for seed, lens in ((42, [640, 1, 17]), (43, [5, 600, 1])):
        nxt = make_paged_case(nh, nkv, hd, 16, lens, seed=seed, max_pages=40, strided_q=False,
                              spare_blocks=first.k_cache.shape[0] - sum(-(-c // 16) for c in lens))
        assert nxt.k_cache.shape == first.k_cache.shape
        for dst, src in ((first.q, nxt.q), (first.k_cache, nxt.k_cache), (first.v_cache, nxt.v_cache),
                         (first.page_table, nxt.page_table), (first.context_lens, nxt.context_lens)):
            dst.copy_(src)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check(out, nxt.reference())


def test_run_rejects_bad_input():
    nh, nkv, hd = GEOMS["0.5b"]
    case = make_paged_case(nh, nkv, hd, 16, [5, 9], seed=51, max_pages=2)
    plan = plan_decode(AttentionGeometry(nh, nkv, hd, 16), max_batch=2, max_context_len=32)
    with pytest.raises(TypeError, match="page_table"):
        plan.run(case.q, case.k_cache, case.v_cache, case.page_table.long(), case.context_lens)
    with pytest.raises(ValueError, match="pages per sequence"):
        plan.run(case.q, case.k_cache, case.v_cache, case.page_table[:, :1], case.context_lens)
    with pytest.raises(ValueError, match="max_batch"):
        bigger = torch.cat([case.page_table] * 2)
        plan.run(torch.cat([case.q] * 2), case.k_cache, case.v_cache, bigger, case.context_lens.repeat(2))
    with pytest.raises(ValueError, match="k_cache"):
        plan.run(case.q, case.k_cache[:, :1], case.v_cache, case.page_table, case.context_lens)


@pytest.mark.slow
@pytest.mark.parametrize("tool", ["racecheck", "synccheck", "memcheck"])
def test_compute_sanitizer_clean(tool, compute_sanitizer):
    """The seed article's bug class (a barrier or stale read in the warp-specialized pipeline), by tool;
    each judged by its own clean summary line (conftest.sanitizer_failure)."""
    compute_sanitizer(tool, SANITIZE_SCRIPT, "sanitize_attention: OK")
