"""Plain-torch reference for paged attention (the oracle the CUDA kernels are tested against).

The attention math is the model's: `nanoqwen_model.forward.causal_attention` (GQA, causal by
absolute position, softmax scale 1/sqrt(head_dim), fp32). What is paged-attention specific is here:
reading each sequence's K/V out of the paged cache exactly as DESIGN.md lays it out, and the
positions of a chunk's queries:

    seq b:  |<------------- context_lens[b] (tokens in cache, new ones included) ------------->|
            |<---- cached prefix (context_len - query_len) ---->|<---- query_len[b] --->|
            query token i sits at position context_len - query_len + i and sees positions 0..that one

    token p of sequence b lives in k_cache/v_cache[page_table[b, p // block_size], :, p % block_size]

A sequence with context_len 0 (a padding slot of a decode batch) yields zeros. No tiling, splitting or
online softmax: the kernels' tricks are what is being tested.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch
from nanoqwen_model.forward import causal_attention


def gather_kv(cache: torch.Tensor, pages: torch.Tensor, context_len: int) -> torch.Tensor:
    """The first `context_len` tokens of one sequence from a paged cache, token-major.

    cache: [num_blocks, n_kv_heads, block_size, head_dim]; pages: int [>= ceil(context_len/block_size)].
    Returns [context_len, n_kv_heads, head_dim] in cache's dtype.
    """
    n_pages = -(-context_len // cache.shape[2])
    blocks = cache[pages[:n_pages].long().to(cache.device)]  # [n_pages, n_kv, block_size, hd]
    return blocks.permute(0, 2, 1, 3).reshape(-1, cache.shape[1], cache.shape[3])[:context_len]


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal paged attention in fp32, one sequence at a time through `causal_attention`.

    q: [total_q, n_heads, head_dim] (any float dtype); k_cache, v_cache: [num_blocks, n_kv_heads,
    block_size, head_dim]; page_table: int [B, max_pages]; context_lens: int [B];
    query_start_loc: int [B + 1] (sequence b's queries are rows query_start_loc[b]:query_start_loc[b+1]);
    None means decode, one query per sequence (total_q == B).
    Returns fp32 [total_q, n_heads, head_dim].
    """
    total_q, n_heads, head_dim = q.shape
    n_kv = k_cache.shape[1]
    if n_heads % n_kv:
        raise ValueError(f"n_heads {n_heads} is not a multiple of n_kv_heads {n_kv}")
    batch = page_table.shape[0]
    ctx_host = context_lens.cpu().tolist()
    if query_start_loc is None:
        if total_q != batch:
            raise ValueError(f"decode reference: q has {total_q} rows for a batch of {batch}")
        starts = list(range(batch + 1))
    else:
        starts = query_start_loc.cpu().tolist()
        if len(starts) != batch + 1 or starts[-1] != total_q:
            raise ValueError("query_start_loc must have B + 1 entries ending at total_q")
    out = torch.zeros(total_q, n_heads, head_dim, dtype=torch.float32, device=q.device)
    for b in range(batch):
        q0, q1, ctx = starts[b], starts[b + 1], ctx_host[b]
        qlen = q1 - q0
        if qlen == 0 or ctx == 0:
            continue
        if ctx < qlen:
            raise ValueError(f"sequence {b}: context_len {ctx} < query_len {qlen}")
        k = gather_kv(k_cache, page_table[b], ctx)
        v = gather_kv(v_cache, page_table[b], ctx)
        positions = torch.arange(ctx - qlen, ctx, device=q.device)
        out[q0:q1] = causal_attention(q[q0:q1], k, v, positions).view(qlen, n_heads, head_dim)
    return out


# ---------------------------------------------------------------------------------------------------
# Random paged-cache cases (tests, sanitizer driver and benchmarks share them)
# ---------------------------------------------------------------------------------------------------

PAGE_POISON = 1 << 30  # page-table entries past a sequence's last page: any read of one faults


@dataclasses.dataclass
class PagedCase:
    """One attention problem on a paged cache. Shapes as in `paged_attention_reference`."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    page_table: torch.Tensor
    context_lens: torch.Tensor
    query_start_loc: torch.Tensor | None  # None: decode

    def reference(self) -> torch.Tensor:
        """fp32 [total_q, n_heads, head_dim]: `paged_attention_reference` of the case."""
        return paged_attention_reference(self.q, self.k_cache, self.v_cache, self.page_table,
                                         self.context_lens, self.query_start_loc)


def make_paged_case(
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    block_size: int,
    context_lens: list[int],
    query_lens: list[int] | None = None,
    *,
    max_pages: int | None = None,
    spare_blocks: int = 7,
    device: str | torch.device = "cuda",
    seed: int = 0,
    strided_q: bool = True,
    poison: bool = True,
) -> PagedCase:
    """A random case: every sequence gets its own randomly chosen, shuffled (non-contiguous) pages.

    query_lens None means decode (one query per sequence, query_start_loc None). With `poison`, every
    cache slot that holds no live token (spare blocks, the tail of each last page) is NaN and every
    page-table entry past a sequence's last page is PAGE_POISON, so reading either shows. With
    `strided_q`, q is the q part of a fused [total_q, (n_heads + 2 n_kv_heads) * head_dim] buffer.
    """
    gen = torch.Generator().manual_seed(seed)
    batch = len(context_lens)
    pages_per_seq = [-(-c // block_size) for c in context_lens]
    max_pages = max_pages or max(1, max(pages_per_seq))
    total_pages = sum(pages_per_seq)
    num_blocks = total_pages + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    page_table = torch.full((batch, max_pages), PAGE_POISON, dtype=torch.int32)
    live = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    at = 0
    for b, (ctx, n) in enumerate(zip(context_lens, pages_per_seq, strict=True)):
        blocks = perm[at:at + n]
        at += n
        page_table[b, :n] = blocks.to(torch.int32)
        for i, blk in enumerate(blocks.tolist()):
            live[blk, : min(block_size, ctx - i * block_size)] = True
    shape = (num_blocks, n_kv_heads, block_size, head_dim)
    k = torch.randn(shape, generator=gen).to(torch.bfloat16)
    v = torch.randn(shape, generator=gen).to(torch.bfloat16)
    if poison:
        dead = ~live[:, None, :, None].expand(shape)
        k[dead] = float("nan")
        v[dead] = float("nan")
    if query_lens is None:
        qlens, qsl = [1] * batch, None
    else:
        qlens = list(query_lens)
        if len(qlens) != batch or any(ql > c for ql, c in zip(qlens, context_lens, strict=True)):
            raise ValueError("query_lens must have one entry per sequence, each <= its context_len")
        qsl = torch.tensor([0] + list(itertools.accumulate(qlens)), dtype=torch.int32)
    total_q = sum(qlens)
    width = (n_heads + 2 * n_kv_heads) * head_dim if strided_q else n_heads * head_dim
    fused = torch.randn(total_q, width, generator=gen).to(torch.bfloat16)
    q = fused.to(device)[:, : n_heads * head_dim].view(total_q, n_heads, head_dim)
    return PagedCase(
        q=q,
        k_cache=k.to(device),
        v_cache=v.to(device),
        page_table=page_table.to(device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        query_start_loc=None if qsl is None else qsl.to(device),
    )
