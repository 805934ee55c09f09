"""Per-step inputs of the engine: host arrays built from a `StepPlan`, and the static device buffers
they are copied into (fixed addresses, so a captured CUDA graph reads them on every replay).

The lengths, for a step over B sequences holding T new tokens in total (decode: T == B):

    seq b:  |<------------------- context_lens[b] (in cache after this step) ------------------>|
            |<------ cached prefix = start_pos[b] ------>|<------- query_lens[b] ----------->|
                                                         ^ positions of the new tokens:
                                                           start_pos[b] + 0 .. query_lens[b]-1
    flat token axis (T rows of every activation):
            |<- seq 0 query ->|<---- seq 1 query ---->|  ...  |<- seq B-1 query ->|
            ^ query_start[0]=0 ^ query_start[1]         ...                ^ query_start[B] = T
    token at position p of seq b lives in KV page page_table[b, p // block_size], slot p % block_size
    logits are computed only for rows sample_rows[b] = query_start[b+1] - 1 (each sequence's last
    new token); the engine keeps the tokens of sequences whose plan says `sample`.

Decode batches are padded to a graph bucket Bp >= B. Padded rows b in B..Bp-1 get token 0, position 0,
context_len 1 and a page table (and slot_mapping) that points only at the padding block, so their
K/V writes land in a page no sequence owns and their sampled tokens are dropped.

Sampling parameters ride along per row: temperature (0 = greedy), top_p, top_k, seed and the number
of tokens the sequence has generated so far (the RNG offset: a replayed graph draws fresh numbers,
and a sequence's draws do not depend on its batch neighbours).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .scheduler import StepPlan


@dataclass
class StepInputs:
    """Host (numpy) inputs of one step. Shapes: T = tokens, B = rows (padded batch)."""

    kind: str
    input_ids: np.ndarray     # int32 [T]
    positions: np.ndarray     # int32 [T]
    slot_mapping: np.ndarray  # int32 [T]   page * block_size + slot of each new token's K/V
    query_start: np.ndarray   # int32 [B + 1]
    context_lens: np.ndarray  # int32 [B]
    page_table: np.ndarray    # int32 [B, max_pages]
    sample_rows: np.ndarray   # int32 [B]   row of the flat token axis whose logits are sampled
    temperature: np.ndarray   # float32 [B]
    top_p: np.ndarray         # float32 [B]
    top_k: np.ndarray         # int32 [B]
    seed: np.ndarray          # int64 [B]
    offset: np.ndarray        # int64 [B]
    num_real: int             # rows 0..num_real-1 are real sequences; the rest are padding
    max_query_len: int
    max_context_len: int

    @property
    def num_rows(self) -> int:
        return len(self.context_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


def build_step_inputs(plan: StepPlan, *, block_size: int, max_pages: int, padding_block: int,
                      pad_to: int | None = None) -> StepInputs:
    """Flatten a plan into the arrays above. `pad_to` pads a decode batch to a graph bucket."""
    B = len(plan.seqs)
    rows = pad_to if pad_to is not None else B
    if rows < B:
        raise ValueError(f"pad_to={pad_to} is smaller than the batch ({B})")
    if plan.kind == "prefill" and rows != B:
        raise ValueError("prefill steps are not padded")
    T = plan.num_tokens + (rows - B)
    input_ids = np.zeros(T, np.int32)
    positions = np.zeros(T, np.int32)
    slot_mapping = np.full(T, padding_block * block_size, np.int32)
    query_start = np.zeros(rows + 1, np.int32)
    context_lens = np.ones(rows, np.int32)
    page_table = np.full((rows, max_pages), padding_block, np.int32)
    temperature = np.zeros(rows, np.float32)
    top_p = np.ones(rows, np.float32)
    top_k = np.zeros(rows, np.int32)
    seed = np.zeros(rows, np.int64)
    offset = np.zeros(rows, np.int64)
    t = 0
    max_q = 1
    max_ctx = 1
    for b, (seq, q, start) in enumerate(zip(plan.seqs, plan.query_lens, plan.start_pos, strict=True)):
        ctx = start + q
        if ctx > len(seq.tokens):
            raise AssertionError(f"seq {seq.seq_id}: computing past its tokens ({ctx} > {len(seq.tokens)})")
        npages = -(-ctx // block_size)
        if npages > max_pages:
            raise AssertionError(f"seq {seq.seq_id}: {ctx} tokens need {npages} pages > {max_pages}")
        if len(seq.blocks) < npages:
            raise AssertionError(f"seq {seq.seq_id}: {ctx} tokens but only {len(seq.blocks)} pages")
        input_ids[t:t + q] = seq.tokens[start:ctx]
        positions[t:t + q] = np.arange(start, ctx, dtype=np.int32)
        page_table[b, :npages] = seq.blocks[:npages]
        pos = positions[t:t + q].astype(np.int64)
        pages = page_table[b, pos // block_size].astype(np.int64)
        slot_mapping[t:t + q] = pages * block_size + pos % block_size
        context_lens[b] = ctx
        t += q
        query_start[b + 1] = t
        sp = seq.request.params
        temperature[b] = sp.temperature
        top_p[b] = sp.top_p
        top_k[b] = sp.top_k
        seed[b] = seq.seed
        offset[b] = seq.num_generated
        max_q = max(max_q, q)
        max_ctx = max(max_ctx, ctx)
    for b in range(B, rows):  # padding rows: one token at position 0 in the padding block
        t += 1
        query_start[b + 1] = t
    sample_rows = query_start[1:] - 1
    return StepInputs(plan.kind, input_ids, positions, slot_mapping, query_start, context_lens, page_table,
                      sample_rows.astype(np.int32), temperature, top_p, top_k, seed, offset, B,
                      max_q, max_ctx)


class DeviceStepBuffers:
    """Static device buffers for step inputs, allocated once at their maximum sizes.

    A step copies its `StepInputs` into the leading slices (one pinned staging buffer, one H2D copy
    per array, all on the current stream). Graph capture records kernels that read these slices, so
    replay after `load()` sees the new step's values.
    """

    def __init__(self, *, max_tokens: int, max_rows: int, max_pages: int, device: torch.device):
        self.max_tokens, self.max_rows, self.max_pages = max_tokens, max_rows, max_pages
        i32, f32, i64 = torch.int32, torch.float32, torch.int64
        spec = {
            "input_ids": ((max_tokens,), i32), "positions": ((max_tokens,), i32),
            "slot_mapping": ((max_tokens,), i32),
            "query_start": ((max_rows + 1,), i32), "context_lens": ((max_rows,), i32),
            "page_table": ((max_rows, max_pages), i32), "sample_rows": ((max_rows,), i32),
            "temperature": ((max_rows,), f32), "top_p": ((max_rows,), f32), "top_k": ((max_rows,), i32),
            "seed": ((max_rows,), i64), "offset": ((max_rows,), i64),
        }
        pin = device.type == "cuda"
        self.dev = {k: torch.zeros(shape, dtype=dt, device=device) for k, (shape, dt) in spec.items()}
        self.host = {k: torch.zeros(shape, dtype=dt, pin_memory=pin) for k, (shape, dt) in spec.items()}
        self.dev["context_lens"].fill_(1)

    def load(self, inputs: StepInputs) -> dict[str, torch.Tensor]:
        """Copy `inputs` into the buffers; return views sized for this step (T tokens, B rows)."""
        T, B = inputs.num_tokens, inputs.num_rows
        if T > self.max_tokens or B > self.max_rows:
            raise ValueError(f"step of {T} tokens / {B} rows exceeds the buffers "
                             f"({self.max_tokens} / {self.max_rows})")
        views = {}
        for name, dev in self.dev.items():
            arr = getattr(inputs, name)
            host = self.host[name]
            n = arr.shape[0]
            if name == "page_table" and arr.shape[1] != self.max_pages:
                raise ValueError(f"page table has {arr.shape[1]} columns, buffers {self.max_pages}")
            # The host staging buffer is reused: the previous step's copy has finished, because
            # every step ends by reading its sampled tokens back (a synchronisation).
            host[:n].copy_(torch.from_numpy(arr))
            dev[:n].copy_(host[:n], non_blocking=True)
            views[name] = dev[:n]
        return views
