"""Paged KV cache: block allocator, per-sequence page tables and the pool tensor.

These classes are shared by the plain-torch reference model and the CUDA engine (docs/DESIGN.md,
"Paged KV cache"); the pool layout below is the contract the attention kernels read.

    pool: [num_layers, 2, num_blocks, n_kv_heads, block_size, head_dim]  (2 = K, V; bf16 by default)
          layer l's K cache = pool[l, 0], V cache = pool[l, 1]: [num_blocks, n_kv_heads, block_size, head_dim]

    seq b:  |<------------- context_len[b] (tokens in cache after this step) ------------->|
            |<---- cached prefix (context_len - query_len) ---->|<---- query_len[b] --->|
            token at position p lives in page  page_table[b, p // block_size], slot p % block_size

    page_table: int32 [B, max_pages_per_seq]  (entries past a sequence's last page are 0 and ignored)
    context_lens: int32 [B];  query_lens: int32 [B]
    slot_mapping: int64 [T]   flat slot block * block_size + offset of each new token (T = sum query_lens)

Accounting is exact: `BlockAllocator` hands out each block at most once, `free` refuses a block that
is not allocated, and `num_free + num_used == num_blocks` always. Allocation is all-or-nothing, so a
sequence that cannot grow leaves the allocator as it was (`OutOfBlocks`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from nanoqwen_model.forward import apply_rope

__all__ = [
    "KVCacheSpec",
    "BlockAllocator",
    "OutOfBlocks",
    "SequencePages",
    "PagedKVCache",
    "StepMetadata",
    "build_step_metadata",
    "KVShift",
    "shift_kv",
]


class OutOfBlocks(RuntimeError):
    """The allocator has fewer free blocks than a request needs (nothing was allocated)."""


@dataclass(frozen=True)
class KVCacheSpec:
    """Geometry of a paged KV pool. `block_size` tokens per page (16: 4 KiB pages at head_dim 128)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_blocks: int
    block_size: int = 16
    dtype: torch.dtype = torch.bfloat16
    shape: tuple[int, ...] = field(init=False)
    bytes_per_block: int = field(init=False)  # all layers, K and V

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "num_blocks", "block_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"KVCacheSpec.{name} must be a positive int, got {v!r}")
        object.__setattr__(self, "shape", (self.num_layers, 2, self.num_blocks, self.num_kv_heads,
                                           self.block_size, self.head_dim))
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        object.__setattr__(self, "bytes_per_block", self.num_layers * 2 * self.num_kv_heads
                           * self.block_size * self.head_dim * itemsize)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)


class BlockAllocator:
    """Free-list allocator of block ids 0..num_blocks-1 with exact accounting.

    Freed blocks are reused last-in first-out (a just-freed page is likely still in cache).
    """

    def __init__(self, num_blocks: int):
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        self.num_blocks = num_blocks
        # Pop from the end: hand out 0, 1, 2, ... first.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """`n` distinct free block ids, or `OutOfBlocks` (allocating nothing)."""
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"cannot allocate {n!r} blocks")
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} KV blocks, only {len(self._free)} of {self.num_blocks} are free")
        blocks = [self._free.pop() for _ in range(n)]
        self._used.update(blocks)
        return blocks

    def free(self, blocks: Sequence[int]) -> None:
        """Return blocks to the pool. A block that is not allocated (or repeated) raises ValueError."""
        blocks = list(blocks)
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"free(): repeated block ids in {blocks}")
        bad = [b for b in blocks if b not in self._used]
        if bad:
            raise ValueError(f"free(): blocks {bad} are not allocated (double free or foreign id)")
        for b in blocks:
            self._used.remove(b)
            self._free.append(b)


class SequencePages:
    """Page table of one sequence: the blocks holding its tokens, in position order."""

    def __init__(self, allocator: BlockAllocator, block_size: int):
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.allocator = allocator
        self.block_size = block_size
        self.blocks: list[int] = []
        self.num_tokens = 0  # tokens whose K/V are (or are being) written
        self.released = False

    @property
    def capacity(self) -> int:
        return len(self.blocks) * self.block_size

    def pages_needed(self, num_new_tokens: int) -> int:
        """Extra pages needed to append `num_new_tokens` tokens."""
        total = self.num_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(self.blocks))

    def append(self, num_new_tokens: int) -> list[int]:
        """Reserve room for `num_new_tokens` more tokens and count them in; returns their flat slots.

        All-or-nothing: on `OutOfBlocks` the sequence is unchanged.
        """
        if self.released:
            raise RuntimeError("sequence pages were released")
        if num_new_tokens < 0:
            raise ValueError(f"cannot append {num_new_tokens} tokens")
        self.blocks.extend(self.allocator.allocate(self.pages_needed(num_new_tokens)))
        start = self.num_tokens
        self.num_tokens += num_new_tokens
        bs = self.block_size
        return [self.blocks[p // bs] * bs + p % bs for p in range(start, self.num_tokens)]

    def slot(self, position: int) -> int:
        """Flat slot (block * block_size + offset) of the token at `position`."""
        if not 0 <= position < self.num_tokens:
            raise IndexError(f"position {position} outside 0..{self.num_tokens - 1}")
        return self.blocks[position // self.block_size] * self.block_size + position % self.block_size

    def release(self) -> None:
        """Give every block back to the allocator (idempotent)."""
        if not self.released:
            self.allocator.free(self.blocks)
            self.blocks = []
            self.num_tokens = 0
            self.released = True


@dataclass
class StepMetadata:
    """Tensors describing one forward step over B sequences (see the diagram in the module header).

    query_lens[b] new tokens of sequence b are in the flat token batch, sequence after sequence.
    """

    page_table: torch.Tensor    # int32 [B, max_pages]
    context_lens: torch.Tensor  # int32 [B]
    query_lens: torch.Tensor    # int32 [B]
    positions: torch.Tensor     # int64 [T]
    slot_mapping: torch.Tensor  # int64 [T]
    # host copies (the reference model loops over sequences)
    context_lens_host: list[int]
    query_lens_host: list[int]


def build_step_metadata(seqs: Sequence[SequencePages], query_lens: Sequence[int],
                        device: torch.device | str = "cpu") -> StepMetadata:
    """Append `query_lens[b]` tokens to each sequence's pages and describe the step.

    Raises `OutOfBlocks` (and appends nothing to any sequence) when the pool cannot hold the step.
    """
    if len(seqs) != len(query_lens) or not seqs:
        raise ValueError(f"{len(seqs)} sequences but {len(query_lens)} query lengths")
    need = sum(s.pages_needed(q) for s, q in zip(seqs, query_lens, strict=True))
    alloc = seqs[0].allocator
    if any(s.allocator is not alloc for s in seqs):
        raise ValueError("all sequences of a step must share one allocator")
    if not alloc.can_allocate(need):
        raise OutOfBlocks(f"step needs {need} KV blocks, {alloc.num_free} free")
    slots: list[int] = []
    positions: list[int] = []
    for s, q in zip(seqs, query_lens, strict=True):
        start = s.num_tokens
        slots.extend(s.append(q))
        positions.extend(range(start, start + q))
    max_pages = max(1, max(len(s.blocks) for s in seqs))
    table = torch.zeros((len(seqs), max_pages), dtype=torch.int32)
    for b, s in enumerate(seqs):
        if s.blocks:
            table[b, : len(s.blocks)] = torch.tensor(s.blocks, dtype=torch.int32)
    ctx = [s.num_tokens for s in seqs]
    return StepMetadata(
        page_table=table.to(device),
        context_lens=torch.tensor(ctx, dtype=torch.int32, device=device),
        query_lens=torch.tensor(list(query_lens), dtype=torch.int32, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        context_lens_host=ctx,
        query_lens_host=list(query_lens),
    )


class PagedKVCache:
    """The pool tensor plus its allocator. `pool` has the DESIGN.md layout (see the module header)."""

    def __init__(self, spec: KVCacheSpec, device: torch.device | str = "cpu"):
        self.spec = spec
        self.device = torch.device(device)
        self.pool = torch.zeros(spec.shape, dtype=spec.dtype, device=self.device)
        self.allocator = BlockAllocator(spec.num_blocks)

    def new_sequence(self) -> SequencePages:
        return SequencePages(self.allocator, self.spec.block_size)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K cache, V cache) of one layer, each [num_blocks, n_kv_heads, block_size, head_dim] views."""
        return self.pool[layer, 0], self.pool[layer, 1]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store new keys/values. k, v: [T, n_kv_heads, head_dim]; slot_mapping: int64 [T] flat slots."""
        kc, vc = self.layer(layer)
        bs = self.spec.block_size
        blocks = torch.div(slot_mapping, bs, rounding_mode="floor")
        offs = slot_mapping % bs
        kc[blocks, :, offs] = k.to(kc.dtype)
        vc[blocks, :, offs] = v.to(vc.dtype)

    def gather(self, layer: int, pages: torch.Tensor, context_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of one sequence: pages int [n_pages] -> two [n_kv_heads, context_len, head_dim]."""
        kc, vc = self.layer(layer)
        h, d = self.spec.num_kv_heads, self.spec.head_dim
        n = pages.numel()
        k = kc[pages].permute(1, 0, 2, 3).reshape(h, n * self.spec.block_size, d)[:, :context_len]
        v = vc[pages].permute(1, 0, 2, 3).reshape(h, n * self.spec.block_size, d)[:, :context_len]
        return k, v


@dataclass(frozen=True)
class KVShift:
    """A copy of cached K/V to other positions (the prefix cache's shifted reuse, blocks.py): the token
    at flat slot `src_slots[j]` (position p) goes to `dst_slots[j]` (position p + `delta`), its key
    rotated by `delta` positions."""

    src_slots: list[int]
    dst_slots: list[int]
    delta: int


def shift_kv(pool: torch.Tensor, shift: KVShift, inv_freq: torch.Tensor) -> None:
    """Apply `shift` to every layer of `pool` [L, 2, num_blocks, Hkv, block_size, D] in place.

    A cached key is RoPE(k, p); RoPE composes by adding angles, so RoPE(RoPE(k, p), delta) is the key
    the token would have at p + delta (`apply_rope` at position delta, in fp32, rounded once to the
    pool's dtype). Values move unchanged. The sources are read in full before any destination is
    written, so the two may share blocks. Runs in stream order on the pool's device."""
    bs = pool.shape[4]
    src = torch.tensor(shift.src_slots, dtype=torch.int64, device=pool.device)
    dst = torch.tensor(shift.dst_slots, dtype=torch.int64, device=pool.device)
    if src.shape != dst.shape or src.numel() == 0:
        raise ValueError(f"a KV shift needs as many sources as destinations, at least one (got "
                         f"{src.numel()}, {dst.numel()})")
    rows = pool[:, :, src // bs, :, src % bs]  # [T, L, 2, Hkv, D] (a copy)
    t, layers, _, heads, d = rows.shape
    if shift.delta:
        k = rows[:, :, 0].reshape(t, layers * heads, d)
        pos = torch.full((t,), shift.delta, dtype=torch.int64, device=pool.device)
        rows[:, :, 0] = apply_rope(k, pos, inv_freq).reshape(t, layers, heads, d).to(pool.dtype)
    pool[:, :, dst // bs, :, dst % bs] = rows
