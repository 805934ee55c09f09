"""Paged attention for decode and chunked prefill: plan once, run many times (CUDA-graph safe).

The kernels (csrc/attention.cuh) read K/V through per-sequence page tables from the paged cache of
DESIGN.md. Lengths live in device buffers, so nothing in `run()` depends on them on the host:

    seq b:  |<------------- context_lens[b] (tokens in cache after this step) ------------->|
            |<---- cached prefix (context_len - query_len) ---->|<---- query_len[b] --->|
            token at position p lives in page page_table[b, p // block_size], slot p % block_size
    page_table:      int32 [B, max_pages]  (entries past a sequence's last page are never read)
    context_lens:    int32 [B]             (0 marks a padding slot of a decode batch: output zeros)
    query_start_loc: int32 [B + 1]         (prefill: sequence b's queries are q[qsl[b]:qsl[b+1]];
                                            decode has exactly one query per sequence)

The new tokens' K/V must already be in the cache (the fused QKV/RoPE kernel writes them), and
query_len <= context_len <= plan.max_context_len (device values, not checked: that would sync).

`plan_decode` / `plan_prefill` fix the launch shape: the most split-KV CTAs per sequence
(flash-decoding, from the maximum context, so one sequence fills the 132 SMs; the kernel uses
min(num_splits, tiles of the actual context) of them, none when the context has at most
UNSPLIT_MAX_TILES tiles), the grid, and the fp32 work
buffers of the split merge. Up to FUSE_MAX_SPLITS splits are merged inside the attention launch by
the last split to finish (arrival counters, back to zero at the end of every launch: one plan serves
one stream at a time); a plan that can split further also launches the combine kernel, which merges
the rows split more ways than that. So a plan of at most FUSE_MAX_SPLITS splits is one launch.
At decode the combine can also go into the o projection instead (`run(..., defer_merge=True)`, then
`gemv.gemv_int4(out, ..., merge=plan.merge_input())`: the same bits, one launch fewer).
`plan.run(...)` allocates nothing (when `out` is given) and never synchronises, so a captured graph
replays it for any lengths up to the maximum. Call `launch.warm_up(["attention"])` (or one eager run)
before capturing.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from . import gemv as _gemv
from .launch import check, f32, i32, launch, ptr, require_sm90

FAMILY = "attention"
TILE = 64  # KV tokens per pipeline stage (csrc/attention.cuh TILE)
THREADS = 160  # one producer warp + four consumer warps
CTAS_PER_SM = 2  # shared memory and registers allow two CTAs per SM
MAX_SPLITS = 256  # csrc/attention.cuh MAX_SPLITS (the combine's shared weights)
COMBINE_THREADS = 512  # csrc/attention.cuh COMBINE_THREADS
CTA_OVERHEAD_TILES = 1  # prologue + epilogue + combine share of one CTA, in tile-times (a guess)
FUSE_CAP = 16  # csrc/attention.cuh FUSE_CAP: the most splits the in-kernel merge can take
# Measured on the H200: a context of at most UNSPLIT_MAX_TILES tiles runs
# unsplit (2 tiles: 7.1 us against 7.7-8.2 split in two + combine, batch 1); FUSE_MAX_SPLITS: the most
# splits merged inside the attention launch by the last split to finish, more go to the combine kernel.
# 1 = never: the in-kernel merge measured slower than the combine kernel at every split count tried
# (its tail is an atomic and then the partial rows' L2 round trips in one CTA; batch 1, context 128,
# two splits: 8.6 us against 7.7-8.2), so it is an option, not the default.
UNSPLIT_MAX_TILES = 2
FUSE_MAX_SPLITS = 1


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Compile-time shape of one attention entry point (mirrors csrc/attention.cu)."""

    name: str
    rows: int  # query rows (token, head-in-group pairs) per CTA
    stages: int  # depth of the K/V shared-memory ring
    head_dim: int

    @property
    def shared_mem(self) -> int:
        # the K/V ring, then one [16, head_dim] Q slice per consumer warp
        return self.stages * 2 * TILE * self.head_dim * 2 + 4 * 16 * self.head_dim * 2


_COMBINE = {128: "paged_attention_combine_hd128", 64: "paged_attention_combine_hd64"}
_KERNELS = {
    ("decode", 128): KernelConfig("paged_attention_decode_hd128", rows=16, stages=3, head_dim=128),
    ("decode", 64): KernelConfig("paged_attention_decode_hd64", rows=16, stages=4, head_dim=64),
    ("prefill", 128): KernelConfig("paged_attention_prefill_hd128", rows=64, stages=3, head_dim=128),
    ("prefill", 64): KernelConfig("paged_attention_prefill_hd64", rows=64, stages=4, head_dim=64),
}


@dataclasses.dataclass(frozen=True)
class AttentionGeometry:
    """Head layout and page size. Qwen2.5-Coder-7B: 28/4/128; 0.5B: 14/2/64. block_size: tokens/page."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    block_size: int = 16

    def __post_init__(self) -> None:
        if self.n_heads <= 0 or self.n_kv_heads <= 0 or self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads {self.n_heads} must be a positive multiple of n_kv_heads {self.n_kv_heads}"
            )
        if self.head_dim not in (64, 128):
            raise ValueError(f"head_dim {self.head_dim} unsupported: the kernels are built for 64 and 128")
        bs = self.block_size
        # >= 2: one producer lane holds one page id of a 64-token tile; power of two: shifts, no division.
        if bs < 2 or bs > 4096 or bs & (bs - 1):
            raise ValueError(f"block_size {bs} must be a power of two in [2, 4096]")

    @property
    def group(self) -> int:
        return self.n_heads // self.n_kv_heads


def choose_num_splits(base_ctas: int, max_context_len: int, num_sms: int,
                      unsplit_max_tiles: int = UNSPLIT_MAX_TILES) -> int:
    """Split-KV count minimizing the modelled critical path, fewest splits on a tie.

    A CTA streams its split's tiles; CTAS_PER_SM * num_sms CTAs run at once ("a wave"). The model's
    time is waves * (ceil(tiles / splits) + CTA_OVERHEAD_TILES) tile-times, so it favours filling the
    last wave (a batch of 32 sequences x 4 KV heads = 128 CTAs takes 2 splits, 256 CTAs, not 3 = 384
    CTAs = 1.45 waves), splits that divide the tiles evenly, and few splits when the batch is large.
    The device partition is even too, over min(splits, tiles) splits of the actual context
    (attention.cuh cta_work): a graph planned for a long context pays nothing at a short one for the
    splits it does not need.
    """
    tiles = max(1, -(-max_context_len // TILE))
    slots = CTAS_PER_SM * num_sms
    # never more splits than one wave needs: each split adds a partial row per query row for the
    # combine to read (a 512-token chunk on a 4K prefix with 8 splits spent 21 us combining)
    if tiles <= unsplit_max_tiles:  # the kernel runs such a context unsplit whatever the plan says
        return 1
    cap = min(MAX_SPLITS, tiles, -(-slots // max(1, base_ctas)))
    best, best_cost = 1, None
    for s in range(1, cap + 1):
        cost = -(-base_ctas * s // slots) * (-(-tiles // s) + CTA_OVERHEAD_TILES)
        if best_cost is None or cost < 0.97 * best_cost:  # more splits only for a real gain
            best, best_cost = s, cost
    return best


class PagedAttentionPlan:
    """Fixed launch shape and work buffers for one batch shape; see the module docstring.

    Build with `plan_decode` or `plan_prefill`. Attributes: geometry, mode ("decode"/"prefill"),
    max_batch, max_query_len, max_total_q, max_context_len, num_splits, num_row_tiles.
    """

    def __init__(
        self,
        geometry: AttentionGeometry,
        mode: str,
        *,
        max_batch: int,
        max_query_len: int,
        max_total_q: int,
        max_context_len: int,
        device: torch.device | str,
        num_splits: int | None = None,
        unsplit_max_tiles: int | None = None,
        fuse_max_splits: int | None = None,
    ) -> None:
        if mode not in ("decode", "prefill"):
            raise ValueError(f"mode must be 'decode' or 'prefill', got {mode!r}")
        for name, v in (("max_batch", max_batch), ("max_query_len", max_query_len),
                        ("max_total_q", max_total_q), ("max_context_len", max_context_len)):
            if v <= 0:
                raise ValueError(f"{name} must be positive, got {v}")
        if max_query_len > max_context_len:
            raise ValueError(f"max_query_len {max_query_len} > max_context_len {max_context_len}")
        dev = torch.device(device)
        self.device_index = require_sm90(dev)
        # "cuda" -> "cuda:N": tensors compare equal (a CPU device only on the kernel emulator, testing/emu.py)
        self.device = torch.device("cuda", self.device_index) if dev.type == "cuda" else dev
        self.geometry = geometry
        self.mode = mode
        self.max_batch, self.max_query_len, self.max_total_q = max_batch, max_query_len, max_total_q
        self.max_context_len = max_context_len
        self.kernel = _KERNELS[(mode, geometry.head_dim)]
        self.num_row_tiles = -(-max_query_len * geometry.group // self.kernel.rows)
        base = max_batch * geometry.n_kv_heads * self.num_row_tiles
        num_sms = _gemv._sm_count(self.device_index)  # the one SM count every plan reads (testing/emu.py)
        self.unsplit_max_tiles = UNSPLIT_MAX_TILES if unsplit_max_tiles is None else unsplit_max_tiles
        self.fuse_max_splits = FUSE_MAX_SPLITS if fuse_max_splits is None else fuse_max_splits
        if self.unsplit_max_tiles < 0:
            raise ValueError(f"unsplit_max_tiles must be >= 0, got {self.unsplit_max_tiles}")
        if not 1 <= self.fuse_max_splits <= FUSE_CAP:
            raise ValueError(f"fuse_max_splits must be in [1, {FUSE_CAP}], got {self.fuse_max_splits}")
        if num_splits is None:
            num_splits = choose_num_splits(base, max_context_len, num_sms, self.unsplit_max_tiles)
        if not 1 <= num_splits <= MAX_SPLITS:
            raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
        self.num_splits = num_splits
        self.scale_log2 = (1.0 / math.sqrt(geometry.head_dim)) * math.log2(math.e)
        # decode: one query per sequence, so query_start_loc is the fixed ramp 0..B
        self._decode_qsl = (
            torch.arange(max_batch + 1, dtype=torch.int32, device=self.device) if mode == "decode" else None
        )
        if num_splits > 1:
            nh, hd = geometry.n_heads, geometry.head_dim
            f32 = dict(dtype=torch.float32, device=self.device)
            self.work_o = torch.empty(num_splits, max_total_q, nh, hd, **f32)
            self.work_lse = torch.empty(num_splits, max_total_q, nh, **f32)
            # one arrival counter per (sequence, KV head, row tile): the last split to arrive merges
            self.counters = torch.zeros(max_batch * geometry.n_kv_heads * self.num_row_tiles,
                                        dtype=torch.int32, device=self.device)
            self.work_splits = torch.empty(max_total_q, nh, dtype=torch.int32, device=self.device)
        else:
            self.work_o = self.work_lse = self.counters = self.work_splits = None

    def __repr__(self) -> str:
        g = self.geometry
        return (f"PagedAttentionPlan({self.mode}, heads {g.n_heads}/{g.n_kv_heads}x{g.head_dim}, "
                f"block {g.block_size}, max_batch {self.max_batch}, max_context {self.max_context_len}, "
                f"splits {self.num_splits} (in-kernel merge <= {self.fuse_max_splits}), "
                f"row tiles {self.num_row_tiles})")

    def _check(self, q, k_cache, v_cache, page_table, context_lens, qsl, out):
        g, dev = self.geometry, self.device
        check(q, "q", torch.bfloat16, (None, g.n_heads, g.head_dim), dev, contiguous=False)
        if q.stride(2) != 1 or q.stride(1) != g.head_dim or q.stride(0) % 8 or q.storage_offset() % 8:
            raise ValueError("q: heads must be contiguous [*, n_heads, head_dim] rows, 16-byte aligned "
                             f"(strides {q.stride()})")
        for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
            check(c, name, torch.bfloat16, (None, g.n_kv_heads, g.block_size, g.head_dim), dev)
        if k_cache.shape != v_cache.shape:
            raise ValueError(f"k_cache {list(k_cache.shape)} and v_cache {list(v_cache.shape)} differ")
        batch = page_table.shape[0] if page_table.dim() == 2 else -1
        check(page_table, "page_table", torch.int32, (None, None), dev, contiguous=False, align=4)
        if page_table.stride(1) != 1:
            raise ValueError("page_table: rows must be contiguous")
        if not 1 <= batch <= self.max_batch:
            raise ValueError(f"batch {batch} outside [1, max_batch={self.max_batch}] of this plan")
        if page_table.shape[1] * g.block_size < self.max_context_len:
            raise ValueError(f"page_table has {page_table.shape[1]} pages per sequence: fewer than "
                             f"max_context_len {self.max_context_len} needs at block_size {g.block_size}")
        check(context_lens, "context_lens", torch.int32, (batch,), dev, align=4)
        total_q = q.shape[0]
        if self.mode == "decode":
            if total_q != batch:
                raise ValueError(f"decode: q has {total_q} rows for a batch of {batch} (one query each)")
        else:
            if qsl is None:
                raise ValueError("prefill: query_start_loc [B + 1] is required")
            check(qsl, "query_start_loc", torch.int32, (batch + 1,), dev, align=4)
            if total_q > self.max_total_q:
                raise ValueError(f"q has {total_q} rows, more than max_total_q {self.max_total_q}")
        if out is not None:
            check(out, "out", torch.bfloat16, (total_q, g.n_heads, g.head_dim), dev)
        return batch, total_q

    def run(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        page_table: torch.Tensor,
        context_lens: torch.Tensor,
        query_start_loc: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        *,
        defer_merge: bool = False,
    ) -> torch.Tensor:
        """Attention output [total_q, n_heads, head_dim] bf16 (written into `out` when given).

        q: bf16 [total_q, n_heads, head_dim] (rows may be strided, e.g. a view of the fused QKV output);
        k_cache, v_cache: bf16 [num_blocks, n_kv_heads, block_size, head_dim] (one layer of the pool);
        page_table: int32 [B, max_pages]; context_lens: int32 [B];
        query_start_loc: int32 [B + 1], prefill only (decode: total_q == B).
        One kernel launch, or two when the plan can split more than fuse_max_splits ways (`launches`).
        defer_merge: leave the rows split more than fuse_max_splits ways unmerged in the plan's work
        buffers (no combine launch): the o projection's GEMV merges them while it stages its input,
        `gemv.gemv_int4(out, ..., merge=plan.merge_input())`, the same bits as the combine kernel. Only
        for plans that launch the combine kernel and split at most gemv.MERGE_MAX_SPLITS ways
        (`can_defer_merge`). Until that GEMV has run, out holds only the rows that came out final.
        """
        if defer_merge and not self.can_defer_merge:
            raise ValueError(f"defer_merge needs a plan with the combine kernel and at most "
                             f"{_gemv.MERGE_MAX_SPLITS} splits: {self!r}")
        batch, total_q = self._check(q, k_cache, v_cache, page_table, context_lens, query_start_loc, out)
        if out is None:
            out = torch.empty(total_q, self.geometry.n_heads, self.geometry.head_dim,
                              dtype=torch.bfloat16, device=self.device)
        if total_q == 0:
            return out
        qsl = self._decode_qsl if self.mode == "decode" else query_start_loc
        g, cfg = self.geometry, self.kernel
        args = (
            ptr(q), np.int64(q.stride(0)),
            ptr(k_cache), ptr(v_cache),
            ptr(page_table), i32(page_table.stride(0)),
            ptr(context_lens), ptr(qsl), ptr(out), ptr(self.work_o),
            ptr(self.work_lse), ptr(self.counters), ptr(self.work_splits),
            i32(self.max_total_q), i32(g.n_heads),
            i32(g.n_kv_heads), i32(g.block_size.bit_length() - 1), i32(self.num_splits),
            i32(self.num_row_tiles), i32(self.unsplit_max_tiles),
            i32(self.fuse_max_splits), f32(self.scale_log2),
        )
        grid = (self.num_row_tiles * self.num_splits, g.n_kv_heads, batch)
        launch(FAMILY, cfg.name, self.device_index, grid, (THREADS,), args, shared_mem=cfg.shared_mem)
        if self.launches == 2 and not defer_merge:
            launch(FAMILY, _COMBINE[g.head_dim], self.device_index, (total_q * g.n_heads,),
                          (COMBINE_THREADS,), args + (i32(total_q),))
        return out

    @property
    def launches(self) -> int:
        """Kernel launches per run(): 1, or 2 with the combine kernel (num_splits > fuse_max_splits)."""
        return 2 if self.num_splits > self.fuse_max_splits else 1

    @property
    def can_defer_merge(self) -> bool:
        """Whether `run(..., defer_merge=True)` may leave the combine to the o projection's GEMV: the plan
        launches the combine kernel, splits at most gemv.MERGE_MAX_SPLITS ways, and has a head_dim the
        GEMV's merge prologue is built for."""
        return (self.launches == 2 and self.num_splits <= _gemv.MERGE_MAX_SPLITS
                and self.geometry.head_dim in _gemv.MERGE_HEAD_DIMS)

    def merge_input(self) -> _gemv.AttentionMerge:
        """What the o projection's GEMV needs to merge the rows that `run(..., defer_merge=True)` left
        split: this plan's work buffers (its input x is run()'s out, [total_q, n_heads * head_dim])."""
        if not self.can_defer_merge:
            raise ValueError(f"this plan does not defer its merge: {self!r}")
        return _gemv.AttentionMerge(self.work_o, self.work_lse, self.work_splits, self.fuse_max_splits)


def plan_decode(
    geometry: AttentionGeometry,
    *,
    max_batch: int,
    max_context_len: int,
    device: torch.device | str = "cuda",
    num_splits: int | None = None,
    unsplit_max_tiles: int | None = None,
    fuse_max_splits: int | None = None,
) -> PagedAttentionPlan:
    """Plan decode attention (one new token per sequence) for up to `max_batch` sequences. The split
    knobs default to the module's measured UNSPLIT_MAX_TILES and FUSE_MAX_SPLITS."""
    return PagedAttentionPlan(geometry, "decode", max_batch=max_batch, max_query_len=1, max_total_q=max_batch,
                              max_context_len=max_context_len, device=device, num_splits=num_splits,
                              unsplit_max_tiles=unsplit_max_tiles, fuse_max_splits=fuse_max_splits)


def plan_prefill(
    geometry: AttentionGeometry,
    *,
    max_batch: int,
    max_query_len: int,
    max_total_q: int,
    max_context_len: int,
    device: torch.device | str = "cuda",
    num_splits: int | None = None,
    unsplit_max_tiles: int | None = None,
    fuse_max_splits: int | None = None,
) -> PagedAttentionPlan:
    """Plan chunked prefill: chunks of up to `max_query_len` new tokens (`max_total_q` over the batch)."""
    return PagedAttentionPlan(geometry, "prefill", max_batch=max_batch, max_query_len=max_query_len,
                              max_total_q=max_total_q, max_context_len=max_context_len, device=device,
                              num_splits=num_splits, unsplit_max_tiles=unsplit_max_tiles,
                              fuse_max_splits=fuse_max_splits)
