"""KV block manager of both engines: exact page accounting, reference counts and the prefix cache.

Every block of the pool is in exactly one of four states:

    padding    block `padding_block`, taken once at construction: padded rows of a graph-bucketed
               decode batch write their K/V there; never a sequence's, never counted as used
    used       referenced by >= 1 live sequence (`_ref[b]` = how many); several only through the cache
    cached     referenced by none, but holding the K/V of a full block of some token prefix: kept in
               the prefix cache, evicted least-recently-released first when a block is needed
    free       in the allocator's free list

    used + cached + free + 1 == num_blocks            (`check()` asserts it after every step)

Prefix cache. A full block (block_size tokens, all computed) is keyed by a chain over token ids:

    key[0] = H(ROOT   || tokens[0:bs])        key[i] = H(key[i-1] || tokens[i*bs:(i+1)*bs])

with H = BLAKE2b-128 over the int64 bytes, so a key names the block's tokens AND everything before
them. Lookups are collision-safe: each cached block also stores (parent key, its tokens), compared on
every hit, so a hash collision can only cost a miss, never wrong K/V. A new sequence walks its tokens
block by block from the root and takes the longest run of cached blocks (`lookup`); its prefill
starts after them. A block becomes cacheable when the sequence has computed all of it (prefill chunk
or decode step, `register`), never earlier: a cached block is never written again, because every
holder computes only positions past it. Two sequences computing the same block at once both keep
their own copy; the first registered is the cached one.

Shifted reuse (`find_shifted`; the scheduler's `cache_reuse`, llama-server's `--cache-reuse`). Past
the exact prefix, a run of cached blocks whose tokens appear again at another position (an editor's
fill-in-the-middle prompt: the code below the cursor, after a prefix that changed) can be copied there
with its keys rotated to the new positions (kv_cache.shift_kv) instead of being computed again. That
K/V is approximate: each token attended to the old context, not the new one. So a sequence's blocks
from the first shifted token on (`Sequence.first_shifted_block`) are keyed in a chain of their own, which
starts from `shifted_root(parent)` instead of the exact parent: `lookup`, which walks from ROOT_KEY,
never reaches them, so the exact prefix cache serves only exactly computed K/V; `find_shifted` finds
them by their tokens, so the next request can copy them again, as llama-server's slots shift what they
already shifted (an editor's suffix, copied request after request as the cursor moves). Only engines
with `cache_reuse` on ever see the approximation.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from .sequence import Sequence

ROOT_KEY = b"nanoqwen-prefix-root"


def shifted_root(parent: bytes) -> bytes:
    """The parent key of a sequence's first block of shifted-copy K/V (module header): a hash in its own
    domain (BLAKE2b's personalisation), which no exact chain produces, so such blocks never answer an
    exact lookup."""
    return hashlib.blake2b(parent, digest_size=16, person=b"nq-shifted").digest()


class BlockAllocatorProtocol(Protocol):
    """What the block manager needs from the shared allocator (nanoqwen_runtime.kv_cache)."""

    def allocate(self, n: int) -> list[int]: ...
    def free(self, blocks: list[int]) -> None: ...
    @property
    def num_free(self) -> int: ...


@dataclass(frozen=True)
class ShiftedRun:
    """Cached blocks `blocks` (consecutive in one chain, the first at chain index `first_index`) whose
    tokens are the prompt's tokens [start, start + len(blocks) * block_size)."""

    start: int
    blocks: list[int]
    first_index: int
    block_size: int

    @property
    def end(self) -> int:
        return self.start + len(self.blocks) * self.block_size

    @property
    def delta(self) -> int:
        """Positions the run moves by (new position - cached position)."""
        return self.start - self.first_index * self.block_size


def cache_reuse_error(cache_reuse, prefix_caching: bool) -> str | None:
    """Why an engine config's `cache_reuse` (the shortest run worth a shifted copy; 0: off) is invalid."""
    if isinstance(cache_reuse, bool) or not isinstance(cache_reuse, int) or cache_reuse < 0:
        return f"cache_reuse must be an int >= 0 (0: off), got {cache_reuse!r}"
    if cache_reuse and not prefix_caching:
        return "cache_reuse copies the prefix cache's blocks: it needs prefix caching on"
    return None


def block_key(parent: bytes, tokens) -> bytes:
    """The chained key of one full block: BLAKE2b-128(parent key || tokens as int64)."""
    return hashlib.blake2b(parent + np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=16).digest()


class BlockManager:
    """Pages for sequences (see the module header). `prefix_caching=False` caches nothing: a block
    goes back to the free list as soon as its sequence releases it."""

    def __init__(self, allocator: BlockAllocatorProtocol, num_blocks: int, block_size: int, *,
                 prefix_caching: bool = True):
        self.allocator = allocator
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.padding_block = allocator.allocate(1)[0]
        self.usable_blocks = num_blocks - 1
        self._ref: dict[int, int] = {}                     # used block -> live sequences holding it
        self._cache: dict[bytes, int] = {}                 # key -> block (used or cached)
        self._meta: dict[int, tuple[bytes, bytes, tuple[int, ...]]] = {}  # block -> (key, parent, tokens)
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks, least recent first
        self._index: dict[int, int] = {}                   # cached block -> its index in its chain
        self._by_tokens: dict[tuple[int, ...], set[int]] = {}  # a cached block's tokens -> blocks
        self.num_evictions = 0
        self.cache_version = 0  # bumped whenever a block enters or leaves the cache (what lookups see)

    # ---- sizes ----------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks a sequence can take now: free ones plus cached ones (evicted on demand)."""
        return self.allocator.num_free + len(self._evictable)

    @property
    def num_used(self) -> int:
        """Blocks referenced by live sequences (a shared block counts once)."""
        return len(self._ref)

    @property
    def num_cached(self) -> int:
        """Unreferenced blocks kept for their prefix (evictable)."""
        return len(self._evictable)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def extra_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` must gain to hold `num_tokens` tokens in total."""
        return max(0, self.blocks_for(num_tokens) - len(seq.blocks))

    # ---- prefix cache ---------------------------------------------------------------------------
    def lookup(self, tokens: list[int], max_tokens: int) -> tuple[list[int], list[bytes]]:
        """The longest run of cached full blocks that starts `tokens` and covers at most `max_tokens`
        of them: (blocks, their keys). Nothing is taken yet (`acquire`)."""
        if not self.prefix_caching:
            return [], []
        bs = self.block_size
        blocks: list[int] = []
        keys: list[bytes] = []
        parent = ROOT_KEY
        for i in range(min(len(tokens), max_tokens) // bs):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            key = block_key(parent, chunk)
            b = self._cache.get(key)
            if b is None:
                break
            _, p, toks = self._meta[b]
            if p != parent or toks != chunk:  # a hash collision: treat as a miss
                break
            blocks.append(b)
            keys.append(key)
            parent = key
        return blocks, keys

    def find_shifted(self, tokens: list[int], start: int, end: int, min_tokens: int) -> ShiftedRun | None:
        """The longest run of cached blocks, of at least `min_tokens` tokens, whose tokens are
        `tokens[q : q + n * block_size]` for some start <= q and q + n * block_size <= end (module
        header, shifted reuse); None if there is none. Blocks of a run follow each other in their chain
        (each one's parent is the previous one's key); the first may sit anywhere."""
        if not self.prefix_caching or not self._by_tokens:
            return None
        bs = self.block_size
        best: ShiftedRun | None = None
        q = start
        while q + bs <= end:
            found = 0
            for b in self._by_tokens.get(tuple(tokens[q:q + bs]), ()):
                run = [b]
                key = self._meta[b][0]
                while q + (len(run) + 1) * bs <= end:
                    chunk = tuple(tokens[q + len(run) * bs:q + (len(run) + 1) * bs])
                    nxt = self._cache.get(block_key(key, chunk))
                    if nxt is None or self._meta[nxt][1] != key or self._meta[nxt][2] != chunk:
                        break
                    run.append(nxt)
                    key = self._meta[nxt][0]
                found = max(found, len(run))
                if len(run) * bs >= min_tokens and (best is None or len(run) > len(best.blocks)):
                    best = ShiftedRun(q, run, self._index[b], bs)
            q += found * bs if found else 1
        return best

    def evictable_among(self, blocks: list[int]) -> int:
        """How many of `blocks` are cached with no holder (taking them lowers `num_free`)."""
        return sum(1 for b in blocks if b in self._evictable)

    def acquire(self, seq: Sequence, blocks: list[int], keys: list[bytes]) -> None:
        """Give an empty `seq` the cached prefix `blocks` (from `lookup`); the caller sets num_computed."""
        if seq.blocks:
            raise AssertionError(f"seq {seq.seq_id} already holds blocks; a prefix goes first")
        for b in blocks:
            self._evictable.pop(b, None)
            self._ref[b] = self._ref.get(b, 0) + 1
        seq.blocks = list(blocks)
        seq.block_keys = list(keys)

    def register(self, seq: Sequence) -> None:
        """Key every block of `seq` that is now full and computed; cache the ones not cached yet."""
        if not self.prefix_caching:
            return
        bs = self.block_size
        parent = seq.block_keys[-1] if seq.block_keys else ROOT_KEY
        full = seq.num_computed // bs
        for i in range(len(seq.block_keys), full):
            chunk = tuple(seq.tokens[i * bs:(i + 1) * bs])
            if i == seq.first_shifted_block:  # K/V from a shifted copy on: a chain of its own (module header)
                parent = shifted_root(parent)
            key = block_key(parent, chunk)
            b = seq.blocks[i]
            if key not in self._cache and b not in self._meta:
                self._cache[key] = b
                self._meta[b] = (key, parent, chunk)
                self._index[b] = i
                self._by_tokens.setdefault(chunk, set()).add(b)
                self.cache_version += 1
            seq.block_keys.append(key)
            parent = key

    def _evict(self, n: int) -> None:
        for _ in range(n):
            b, _ = self._evictable.popitem(last=False)
            key, _, chunk = self._meta.pop(b)
            del self._cache[key]
            del self._index[b]
            same = self._by_tokens[chunk]
            same.discard(b)
            if not same:
                del self._by_tokens[chunk]
            self.allocator.free([b])
            self.num_evictions += 1
            self.cache_version += 1

    # ---- growing and releasing ------------------------------------------------------------------
    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Give `seq` blocks for `num_tokens` tokens in total, evicting cached blocks if needed."""
        n = self.extra_blocks(seq, num_tokens)
        if not n:
            return
        short = n - self.allocator.num_free
        if short > 0:
            if short > len(self._evictable):
                raise AssertionError(f"seq {seq.seq_id} needs {n} blocks, {self.num_free} can be had")
            self._evict(short)
        new = self.allocator.allocate(n)
        for b in new:
            if b in self._ref or b == self.padding_block or b in self._meta:
                raise AssertionError(f"allocator handed out block {b}, which is in use")
            self._ref[b] = 1
        seq.blocks.extend(new)

    def _drop(self, blocks: list[int]) -> None:
        """One reference fewer on each block; unreferenced ones become cached (keyed) or free."""
        to_free = []
        for b in blocks:
            r = self._ref.get(b, 0)
            if r <= 0:
                raise AssertionError(f"block {b} released but not in use")
            if r > 1:
                self._ref[b] = r - 1
                continue
            del self._ref[b]
            if b in self._meta:
                self._evictable[b] = None  # most recent at the end
            else:
                to_free.append(b)
        if to_free:
            self.allocator.free(to_free)

    def shrink(self, seq: Sequence, num_tokens: int) -> None:
        """Release the blocks of `seq` past the ones holding `num_tokens` tokens (speculation rollback:
        pages grown for drafted tokens that were rejected)."""
        keep = self.blocks_for(num_tokens)
        if keep < len(seq.blocks):
            tail = seq.blocks[keep:]
            del seq.blocks[keep:]
            del seq.block_keys[keep:]
            self._drop(tail)

    def release(self, seq: Sequence) -> None:
        """Release all of `seq`'s blocks. Its last blocks are released first, so that they are evicted
        before the prefix blocks that more requests share."""
        self._drop(list(reversed(seq.blocks)))
        seq.blocks = []
        seq.block_keys = []

    # ---- checks ---------------------------------------------------------------------------------
    def check(self, live: list[Sequence]) -> None:
        """Raise if the accounting is off (see the module header)."""
        bs = self.block_size
        refs: dict[int, int] = {}
        for s in live:
            if len(s.blocks) < self.blocks_for(s.num_computed):
                raise AssertionError(f"seq {s.seq_id}: {s.num_computed} tokens in {len(s.blocks)} blocks")
            if len(set(s.blocks)) != len(s.blocks):
                raise AssertionError(f"seq {s.seq_id} holds a block twice: {s.blocks}")
            if len(s.block_keys) > s.num_computed // bs:
                raise AssertionError(f"seq {s.seq_id}: {len(s.block_keys)} keyed blocks but only "
                                     f"{s.num_computed} tokens computed")
            for b in s.blocks:
                refs[b] = refs.get(b, 0) + 1
        if refs != self._ref:
            raise AssertionError("block reference counts disagree with the sequences")
        for s in live:
            for i, b in enumerate(s.blocks):
                if refs[b] > 1 and (b not in self._meta or (i + 1) * bs > s.num_computed):
                    raise AssertionError(f"block {b} shared but not a cached, computed prefix of "
                                         f"seq {s.seq_id}")
        for b in self._evictable:
            if b in self._ref or b not in self._meta:
                raise AssertionError(f"evictable block {b} is in use or not cached")
        for b in self._meta:
            if b not in self._ref and b not in self._evictable:
                raise AssertionError(f"cached block {b} is neither used nor evictable")
        if len(self._cache) != len(self._meta) or any(self._cache.get(k) != b
                                                       for b, (k, _, _) in self._meta.items()):
            raise AssertionError("prefix cache tables disagree")
        by_tokens = {b for same in self._by_tokens.values() for b in same}
        if by_tokens != set(self._meta) or set(self._index) != set(self._meta) or any(
                b not in self._by_tokens.get(toks, ()) for b, (_, _, toks) in self._meta.items()):
            raise AssertionError("shifted-reuse indexes disagree with the prefix cache")
        if self.num_used + self.num_cached + self.allocator.num_free + 1 != self.num_blocks:
            raise AssertionError(f"used {self.num_used} + cached {self.num_cached} + free "
                                 f"{self.allocator.num_free} + 1 != {self.num_blocks}")
