"""GPU tests of the paged attention kernels against the fp32 plain-torch reference.

Every case draws fresh random bf16 inputs on shuffled, non-contiguous page tables; cache slots that
hold no live token are NaN, page-table entries past a sequence's last page are out of range, and the
output is NaN-poisoned before each launch, so a stale read, an unmasked tail slot or an unwritten row
all fail. Each case runs three times and must be bit-identical (a moving error is a race). The
checks are attention_testkit.py's (test_attention_emu.py runs them on the CPU emulator too); the
graph replay and compute-sanitizer (racecheck, synccheck, memcheck over a reduced set) are GPU only.

Every output row (one query token and head) is checked on its own, relative to its own reference
norm: R.ATTENTION_ROW (attention_testkit.py says why).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from attention_testkit import (
    GEOMS,
    check_chunked_prefill,
    check_decode_every_length,
    check_decode_long_context_splits,
    check_decode_splits_follow_the_actual_context,
    check_decode_zero_context_slot_gives_zeros,
    check_prefill_block_size_8_and_single_long_chunk,
    check_rows,
    check_run_rejects_bad_input,
)
from nanoqwen_kernels.attention import AttentionGeometry, plan_decode
from nanoqwen_kernels.reference_attention import make_paged_case

pytestmark = pytest.mark.gpu

SANITIZE_SCRIPT = Path(__file__).parent / "sanitize_attention.py"


@pytest.mark.parametrize(
    "geom, block_size",
    [("7b", 16), ("0.5b", 16), ("7b", 8), ("0.5b", 32), ("7b", 64), ("0.5b", 128)],
)
@pytest.mark.parametrize("num_splits", [None, 3])
def test_decode_every_length(geom, block_size, num_splits, device):
    """Every context length 1 .. 3 pages + 1 in one mixed, shuffled batch."""
    check_decode_every_length(geom, block_size, num_splits, device)


@pytest.mark.parametrize("geom", ["7b", "0.5b"])
@pytest.mark.parametrize("batch", [1, 5])
def test_decode_long_context_splits(geom, batch, device):
    """Long and mixed contexts with the plan's own split count (several tiles per split)."""
    check_decode_long_context_splits(geom, batch, device)


@pytest.mark.parametrize("geom", ["7b", "0.5b"])
@pytest.mark.parametrize("fuse_max", [1, 4, 16])
def test_decode_splits_follow_the_actual_context(geom, fuse_max, device):
    """A plan made for 8K contexts (many splits) on short, tile-edge and long contexts in one batch."""
    check_decode_splits_follow_the_actual_context(geom, fuse_max, device)


def test_decode_zero_context_slot_gives_zeros(device):
    check_decode_zero_context_slot_gives_zeros(device)


@pytest.mark.parametrize("geom", ["7b", "0.5b"])
@pytest.mark.parametrize("num_splits", [1, 2, None])
@pytest.mark.parametrize("fuse_max", [1, 16], ids=["combine-kernel", "in-kernel-merge"])
def test_chunked_prefill(geom, num_splits, fuse_max, device):
    check_chunked_prefill(geom, num_splits, fuse_max, device)


def test_prefill_block_size_8_and_single_long_chunk(device):
    check_prefill_block_size_8_and_single_long_chunk(device)


def test_decode_graph_replay_serves_new_lengths():
    """One captured graph; new lengths, page tables and queries written into its buffers in place."""
    nh, nkv, hd = GEOMS["7b"]
    g = AttentionGeometry(nh, nkv, hd, 16)
    first = make_paged_case(nh, nkv, hd, 16, [10, 200, 33], seed=41, max_pages=40, strided_q=False,
                            spare_blocks=60)
    plan = plan_decode(g, max_batch=3, max_context_len=640)
    out = torch.full_like(first.q, float("nan"))
    plan.run(first.q, first.k_cache, first.v_cache, first.page_table, first.context_lens, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.run(first.q, first.k_cache, first.v_cache, first.page_table, first.context_lens, out=out)
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
        check_rows(out, nxt.reference())


def test_run_rejects_bad_input(device):
    check_run_rejects_bad_input(device)


@pytest.mark.slow
@pytest.mark.parametrize("tool", ["racecheck", "synccheck", "memcheck"])
def test_compute_sanitizer_clean(tool, compute_sanitizer):
    """The seed article's bug class (a barrier or stale read in the warp-specialized pipeline), by tool;
    each judged by its own clean summary line (conftest.sanitizer_failure)."""
    compute_sanitizer(tool, SANITIZE_SCRIPT, "sanitize_attention: OK")
