"""The paged attention kernels on the CPU emulator (nanoqwen_kernels.testing.emu: the kernels' own CUDA source
compiled for the host; the producer warp's cp.async copies land late, the consumer warps meet on their
named barrier, ldmatrix and mma.sync gather the warp's fragments). The checks are
attention_testkit.py's, the GPU tests' own, on smaller cases: fresh random inputs (seeded by the
test's name), context lengths that are not multiples of the page or the 64-token tile, NaN in every
cache slot without a live token, out-of-range page-table entries past each sequence, NaN-poisoned
outputs, R.ATTENTION_ROW per row, and every case run twice, bit-identical, with the split counters
back at zero (each launch interleaves the threads differently).

Covered: decode unsplit, split with the in-kernel merge (fuse_max 4, 16) and with the combine kernel
(fuse_max 1), splits by the actual context in one batch, a context-0 slot, chunked prefill (causal
over a cached prefix, several sequences, split and merged either way), block sizes 8 to 64, head
dims 64 and 128 (prefill at 128: the 7B's row tiles of 7 heads per KV head). The plans are made for
132 SMs (`emulated(sms=132)`: the H200's split counts).
"""

from __future__ import annotations

import zlib

import pytest
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
    run_repeated,
)
from nanoqwen_kernels.attention import AttentionGeometry, plan_decode
from nanoqwen_kernels.reference_attention import make_paged_case
from nanoqwen_kernels.testing import emu

pytestmark = pytest.mark.usefixtures("emu_compiler")
CPU = "cpu"
TIMEOUT_S = 60.0  # a launch takes well under a second here; a minute without progress is a deadlock
SMS = 132  # the plans' split counts are the H200's
RUNS = 2  # each case twice: other interleavings, the same bits


@pytest.fixture
def seed(request) -> int:
    return zlib.crc32(request.node.nodeid.encode()) % 100_000


@pytest.mark.parametrize("geom, block_size, pages", [("7b", 8, 3), ("0.5b", 32, 2)])
def test_decode_every_length(geom, block_size, pages, seed):
    """Every context length 1 .. `pages` pages + 1 (up to 65 tokens: a second tile of one token, a
    partial tail page) in one batch."""
    with emu.emulated(sms=SMS, seed=seed, timeout_s=TIMEOUT_S):
        check_decode_every_length(geom, block_size, None, CPU, pages=pages, seed=seed, runs=RUNS)


@pytest.mark.parametrize("geom", ["7b", "0.5b"])
def test_decode_long_context_splits(geom, seed):
    """The plan's own split count (8 at 132 SMs) over up to 7 tiles, lengths off the tile and page."""
    with emu.emulated(sms=SMS, seed=seed, timeout_s=TIMEOUT_S):
        check_decode_long_context_splits(geom, 4, CPU, lens=(449, 1, 64, 203), max_context_len=480, seed=seed,
                                         runs=RUNS)


@pytest.mark.parametrize("geom, fuse_max", [("0.5b", 1), ("7b", 4), ("0.5b", 16)])
def test_decode_splits_follow_the_actual_context(geom, fuse_max, seed):
    """A plan for 512-token contexts (8 splits) on short, tile-edge and long ones in one batch:
    unsplit, split and merged in the kernel (fuse_max 4, 16) or by the combine kernel (1)."""
    with emu.emulated(sms=SMS, seed=seed, timeout_s=TIMEOUT_S):
        check_decode_splits_follow_the_actual_context(
            geom, fuse_max, CPU, max_context_len=512,
            batches=((seed, [1, 64, 65, 129, 333, 512]), (seed + 1, [500, 3, 130, 64 * 5 + 1, 2, 250])),
            runs=RUNS)


@pytest.mark.parametrize("geom", ["7b", "0.5b"])
def test_decode_unsplit_long_context_wraps_the_ring(geom, seed):
    """One CTA per (sequence, KV head) over up to 9 tiles: the producer goes round its ring of 3 (head
    dim 128) or 4 (64) stages twice, waiting on the consumers' "empty" barriers (the split cases above
    have at most 2 tiles per CTA: their ring never wraps)."""
    nh, nkv, hd = GEOMS[geom]
    with emu.emulated(sms=SMS, seed=seed, timeout_s=TIMEOUT_S):
        case = make_paged_case(nh, nkv, hd, 16, [555, 257, 9], seed=seed, max_pages=36, device=CPU)
        plan = plan_decode(AttentionGeometry(nh, nkv, hd, 16), max_batch=3, max_context_len=576, num_splits=1,
                           device=CPU)
        check_rows(run_repeated(plan, case, RUNS), case.reference())


def test_decode_zero_context_slot_gives_zeros(seed):
    with emu.emulated(sms=SMS, seed=seed, timeout_s=TIMEOUT_S):
        check_decode_zero_context_slot_gives_zeros(CPU, runs=RUNS)


PREFILL_CASES = [(1, 1), (7, 7), (65, 65), (6, 1), (33, 16), (170, 70), (129, 2)]  # (context, query)
# the combine kernel runs one CTA of 512 threads per output row: fewer query tokens
COMBINE_CASES = [(7, 7), (33, 16), (170, 20), (129, 2)]


@pytest.mark.parametrize("num_splits, fuse_max, cases", [(1, 1, PREFILL_CASES), (2, 16, PREFILL_CASES),
                                                         (3, 1, COMBINE_CASES)],
                         ids=["unsplit", "in-kernel-merge", "combine-kernel"])
def test_chunked_prefill(num_splits, fuse_max, cases, seed):
    with emu.emulated(sms=SMS, seed=seed, timeout_s=TIMEOUT_S):
        check_chunked_prefill("0.5b", num_splits, fuse_max, CPU, cases=cases, max_pages=12, seed=seed,
                              runs=RUNS)


def test_prefill_block_size_8_and_single_long_chunk(seed):
    """One chunk of 37 tokens after 66 cached, pages of 8: 5 row tiles of 64 (token, head) pairs per
    KV head."""
    with emu.emulated(sms=SMS, seed=seed, timeout_s=TIMEOUT_S):
        check_prefill_block_size_8_and_single_long_chunk(CPU, context=103, query=37, seed=seed, runs=RUNS)


def test_run_rejects_bad_input():
    with emu.emulated(sms=SMS, timeout_s=TIMEOUT_S):
        check_run_rejects_bad_input(CPU)
