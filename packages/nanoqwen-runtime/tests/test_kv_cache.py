"""Block allocator accounting, page tables and the pool layout (DESIGN.md "Paged KV cache")."""

from __future__ import annotations

import random

import pytest
import torch
from nanoqwen_runtime.kv_cache import (
    BlockAllocator,
    KVCacheSpec,
    OutOfBlocks,
    PagedKVCache,
    build_step_metadata,
)


def test_allocator_exact_accounting_random_workload():
    rng = random.Random(7)
    alloc = BlockAllocator(37)
    held: list[list[int]] = []
    for _ in range(2000):
        if held and rng.random() < 0.45:
            alloc.free(held.pop(rng.randrange(len(held))))
        else:
            n = rng.randint(0, 6)
            if alloc.can_allocate(n):
                blocks = alloc.allocate(n)
                held.append(blocks)
            else:
                before = alloc.num_free
                with pytest.raises(OutOfBlocks):
                    alloc.allocate(n)
                assert alloc.num_free == before  # all-or-nothing
        in_use = [b for bl in held for b in bl]
        assert len(in_use) == len(set(in_use)) == alloc.num_used
        assert alloc.num_used + alloc.num_free == 37
        assert all(0 <= b < 37 for b in in_use)


def test_allocator_rejects_double_and_foreign_free():
    alloc = BlockAllocator(4)
    a = alloc.allocate(2)
    alloc.free(a)
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free(a)
    with pytest.raises(ValueError, match="not allocated"):
        alloc.free([99])
    b = alloc.allocate(1)
    with pytest.raises(ValueError, match="repeated"):
        alloc.free(b + b)
    with pytest.raises(ValueError):
        BlockAllocator(0)
    with pytest.raises(ValueError):
        alloc.allocate(-1)


@pytest.mark.parametrize("block_size", [1, 3, 16])
def test_sequence_pages_slots_and_release(block_size):
    alloc = BlockAllocator(64)
    cache_spec = KVCacheSpec(1, 1, 8, num_blocks=64, block_size=block_size)
    s1 = PagedKVCache(cache_spec).new_sequence()  # a separate allocator: checks independence
    seq = type(s1)(alloc, block_size)
    slots = seq.append(5) + seq.append(1) + seq.append(block_size * 2 + 1)
    n = 6 + block_size * 2 + 1
    assert seq.num_tokens == n and len(seq.blocks) == -(-n // block_size)
    assert len(set(slots)) == n
    for p, s in enumerate(slots):
        assert s == seq.blocks[p // block_size] * block_size + p % block_size == seq.slot(p)
    used = alloc.num_used
    assert used == len(seq.blocks)
    seq.release()
    seq.release()  # idempotent
    assert alloc.num_used == 0 and alloc.num_free == 64
    with pytest.raises(RuntimeError, match="released"):
        seq.append(1)


def test_sequence_append_is_all_or_nothing():
    alloc = BlockAllocator(2)
    seq = type(PagedKVCache(KVCacheSpec(1, 1, 8, 2, 4)).new_sequence())(alloc, 4)
    seq.append(7)
    with pytest.raises(OutOfBlocks):
        seq.append(2)
    assert seq.num_tokens == 7 and len(seq.blocks) == 2
    seq.append(1)  # fits in the last page
    assert seq.num_tokens == 8


def test_step_metadata_matches_diagram():
    cache = PagedKVCache(KVCacheSpec(2, 2, 8, num_blocks=20, block_size=4))
    a, b = cache.new_sequence(), cache.new_sequence()
    meta = build_step_metadata([a, b], [6, 3])
    assert meta.context_lens.tolist() == [6, 3] and meta.query_lens.tolist() == [6, 3]
    assert meta.positions.tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2]
    assert meta.page_table.dtype == torch.int32 and meta.page_table.shape == (2, 2)
    meta = build_step_metadata([a, b], [1, 2])
    assert meta.context_lens.tolist() == [7, 5] and meta.positions.tolist() == [6, 3, 4]
    for row, seq in enumerate((a, b)):
        for p in range(seq.num_tokens):
            page = int(meta.page_table[row, p // 4])
            assert page * 4 + p % 4 == seq.slot(p)
    expect = [a.slot(6), b.slot(3), b.slot(4)]
    assert meta.slot_mapping.tolist() == expect


def test_step_metadata_out_of_blocks_changes_nothing():
    cache = PagedKVCache(KVCacheSpec(1, 1, 8, num_blocks=3, block_size=4))
    a, b = cache.new_sequence(), cache.new_sequence()
    build_step_metadata([a], [4])
    with pytest.raises(OutOfBlocks):
        build_step_metadata([a, b], [4, 8])
    assert a.num_tokens == 4 and b.num_tokens == 0 and cache.allocator.num_used == 1


@pytest.mark.parametrize("block_size,heads,dim", [(16, 2, 64), (5, 3, 24)])
def test_pool_layout_write_and_gather(block_size, heads, dim):
    torch.manual_seed(0)
    spec = KVCacheSpec(3, heads, dim, num_blocks=11, block_size=block_size, dtype=torch.float32)
    cache = PagedKVCache(spec)
    assert cache.pool.shape == (3, 2, 11, heads, block_size, dim)
    seqs = [cache.new_sequence() for _ in range(3)]
    cache.allocator.allocate(1)  # a hole, so pages are not contiguous per sequence
    lens = [block_size + 3, 2, 2 * block_size]
    meta = build_step_metadata(seqs, lens)
    k = torch.randn(sum(lens), heads, dim)
    v = torch.randn(sum(lens), heads, dim)
    cache.write(1, k, v, meta.slot_mapping)
    # token p of sequence b sits at pool[1, 0, page_table[b, p // bs], :, p % bs, :]
    start = 0
    for b, n in enumerate(lens):
        for p in range(n):
            page = int(meta.page_table[b, p // block_size])
            assert torch.equal(cache.pool[1, 0, page, :, p % block_size], k[start + p])
            assert torch.equal(cache.pool[1, 1, page, :, p % block_size], v[start + p])
        pages = meta.page_table[b, : -(-n // block_size)].long()
        kg, vg = cache.gather(1, pages, n)
        assert torch.equal(kg, k[start:start + n].transpose(0, 1))
        assert torch.equal(vg, v[start:start + n].transpose(0, 1))
        start += n
    assert spec.bytes_per_block == 3 * 2 * heads * block_size * dim * 4


def test_spec_rejects_bad_geometry():
    with pytest.raises(ValueError, match="block_size"):
        KVCacheSpec(1, 1, 8, num_blocks=4, block_size=0)
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheSpec(1, 1, 8, num_blocks=-1)
