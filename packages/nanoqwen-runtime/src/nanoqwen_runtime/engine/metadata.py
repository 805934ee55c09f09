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

A step planned ahead (`StepPlan.ahead`: the engine's overlapped decode) has no host token ids: row b
takes its id from row feed_rows[b] of the previous step's sampled tokens, on the device
(`ModelRunner.launch`), and counts that token as generated (its RNG offset is one more).
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
    num_real: int             # rows 0..num_real-1 are real (a sequence's, `plan_rows`); the rest padding
    max_query_len: int
    max_context_len: int
    # planned ahead: int32 [num_real], the previous step's row whose sampled token is row b's input id
    # (input_ids holds 0 there until the device copies it); None: input_ids are the ids
    feed_rows: np.ndarray | None = None
    # int32 [num_real, ceil(V/32)]: the token bitmask of each real row (token_mask.py; all ones for
    # rows without a grammar), or None when no row of the step is constrained
    token_bitmask: np.ndarray | None = None

    @property
    def num_rows(self) -> int:
        return len(self.context_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


def plan_rows(plan: StepPlan) -> list[tuple[int, int, int]]:
    """The rows of a step as (sequence index, first position, query length). One row per sequence,
    except
    - in a verify step (a decode step carrying drafts): sequence i with a draft of k tokens is k+1
      decode rows, row j computing position start+j with context start+j+1 over the same pages;
    - in a prefill chunk that skips a span (a, b) (`StepPlan.skips`): two rows over the same pages,
      positions start..a-1 (context a) and b..end-1 (context end). The second attends to the first's
      K/V, written earlier in the same layer, and to the span's, copied before the step."""
    if plan.has_drafts and plan.kind != "decode":
        raise AssertionError("only decode steps carry drafts")
    if plan.skips and plan.kind != "prefill":
        raise AssertionError("only prefill steps skip spans")
    rows = []
    for i, (st, q) in enumerate(zip(plan.start_pos, plan.query_lens, strict=True)):
        skip = plan.skip(i)
        if plan.drafts and plan.drafts[i]:
            rows += [(i, st + j, 1) for j in range(q)]
        elif skip is not None:
            before = skip[0] - st
            if not 0 < before < q:
                raise AssertionError(f"a chunk of {q} tokens from {st} skipping {skip}: a row would be empty")
            rows += [(i, st, before), (i, skip[1], q - before)]
        else:
            rows.append((i, st, q))
    return rows


def sampled_rows(plan: StepPlan) -> dict[int, list[int]]:
    """Plan index -> the rows of `plan_rows` whose sampled tokens it keeps: every row of a verify step,
    else its last row (the first row of a chunk that skips a span samples nothing)."""
    out: dict[int, list[int]] = {}
    for r, (i, _, _) in enumerate(plan_rows(plan)):
        if plan.drafts and plan.drafts[i]:
            out.setdefault(i, []).append(r)
        else:
            out[i] = [r]
    return out


def build_step_inputs(plan: StepPlan, *, block_size: int, max_pages: int, padding_block: int,
                      pad_to: int | None = None) -> StepInputs:
    """Flatten a plan into the arrays above. `pad_to` pads a decode batch to a graph bucket.

    A verify step (drafts) becomes one decode row per verified token (`plan_rows`): row j of a
    sequence holds its j-th step token at position start+j and attends to start+j+1 tokens of the
    sequence's pages, the K/V of rows 0..j-1 written earlier in the same layer. So each row computes
    exactly what a plain decode step at that position would, and the step samples every row."""
    rows_spec = plan_rows(plan)
    B = len(rows_spec)
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
    pending = 1 if plan.ahead else 0  # a step planned ahead computes the token its predecessor samples
    feeds = [[0] if plan.ahead else plan.step_tokens(i) for i in range(len(plan.seqs))]
    for b, (i, start, q) in enumerate(rows_spec):
        seq = plan.seqs[i]
        ctx = start + q
        first = plan.start_pos[i]
        if ctx > first + len(feeds[i]):
            raise AssertionError(f"seq {seq.seq_id}: computing past its tokens ({ctx} > "
                                 f"{first + len(feeds[i])})")
        npages = -(-ctx // block_size)
        if npages > max_pages:
            raise AssertionError(f"seq {seq.seq_id}: {ctx} tokens need {npages} pages > {max_pages}")
        if len(seq.blocks) < npages:
            raise AssertionError(f"seq {seq.seq_id}: {ctx} tokens but only {len(seq.blocks)} pages")
        input_ids[t:t + q] = feeds[i][start - first:ctx - first]
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
        # the RNG offset of a row is the index of the token it samples (verify rows are greedy; the
        # rows of a chunk that skips a span sample, if at all, the sequence's next token)
        offset[b] = seq.num_generated + pending + (start - first if plan.drafts and plan.drafts[i] else 0)
        max_q = max(max_q, q)
        max_ctx = max(max_ctx, ctx)
    for b in range(B, rows):  # padding rows: one token at position 0 in the padding block
        t += 1
        query_start[b + 1] = t
    sample_rows = query_start[1:] - 1
    feed_rows = np.asarray(plan.feed_rows, np.int32) if plan.ahead else None
    return StepInputs(plan.kind, input_ids, positions, slot_mapping, query_start, context_lens, page_table,
                      sample_rows.astype(np.int32), temperature, top_p, top_k, seed, offset, B,
                      max_q, max_ctx, feed_rows)


class DeviceStepBuffers:
    """Static device buffers for step inputs, allocated once at their maximum sizes.

    All fields live in ONE device byte buffer (16-byte aligned slices; per-row fields first, then
    per-token fields, the page table last), mirrored by pinned host buffers. A step writes its
    values into a host mirror with numpy and uploads the used prefix with a single H2D copy on the
    current stream (ending after row B-1 of the page table), instead of one copy per field.
    Graph capture records kernels that read the device slices, so a replay after `load()` sees the
    new step's values.

    Two host mirrors, used in turn: the upload is asynchronous, and with the overlapped decode the
    next step's inputs are written while the previous step (and maybe its upload) is still queued. A
    mirror is written again two loads later, when the step that uploaded from it has been read back
    (the engine has at most one step in flight beyond the one it reads back).
    """

    def __init__(self, *, max_tokens: int, max_rows: int, max_pages: int, device: torch.device):
        self.max_tokens, self.max_rows, self.max_pages = max_tokens, max_rows, max_pages
        R, T = max_rows, max_tokens
        self.spec = [  # name, torch dtype, numpy dtype, shape
            ("sample_rows", torch.int32, np.int32, (R,)), ("temperature", torch.float32, np.float32, (R,)),
            ("top_p", torch.float32, np.float32, (R,)), ("top_k", torch.int32, np.int32, (R,)),
            ("seed", torch.int64, np.int64, (R,)), ("offset", torch.int64, np.int64, (R,)),
            ("query_start", torch.int32, np.int32, (R + 1,)), ("context_lens", torch.int32, np.int32, (R,)),
            ("input_ids", torch.int32, np.int32, (T,)), ("positions", torch.int32, np.int32, (T,)),
            ("slot_mapping", torch.int32, np.int32, (T,)), ("feed_rows", torch.int32, np.int32, (R,)),
            ("page_table", torch.int32, np.int32, (R, max_pages)),
        ]
        offsets, pos = {}, 0
        for name, _, npdt, shape in self.spec:
            offsets[name] = pos
            pos += -(-int(np.prod(shape)) * np.dtype(npdt).itemsize // 16) * 16
        self.offsets, self.nbytes = offsets, pos
        pin = device.type == "cuda"
        self._dev_bytes = torch.zeros(pos, dtype=torch.uint8, device=device)
        self._host_bytes = [torch.zeros(pos, dtype=torch.uint8, pin_memory=pin) for _ in range(2)]
        self._turn = 0  # the mirror the next load() writes
        self.dev: dict[str, torch.Tensor] = {}
        self.hosts: list[dict[str, np.ndarray]] = [{}, {}]
        for name, tdt, npdt, shape in self.spec:
            n = int(np.prod(shape)) * np.dtype(npdt).itemsize
            o = offsets[name]
            self.dev[name] = self._dev_bytes[o:o + n].view(tdt).view(*shape)
            for hb, host in zip(self._host_bytes, self.hosts, strict=True):
                host[name] = hb.numpy()[o:o + n].view(npdt).reshape(shape)
        self.dev["context_lens"].fill_(1)
        for host in self.hosts:
            host["context_lens"][:] = 1

    def load(self, inputs: StepInputs) -> dict[str, torch.Tensor]:
        """Copy `inputs` into the buffers; return views sized for this step (T tokens, B rows)."""
        T, B = inputs.num_tokens, inputs.num_rows
        if T > self.max_tokens or B > self.max_rows:
            raise ValueError(f"step of {T} tokens / {B} rows exceeds the buffers "
                             f"({self.max_tokens} / {self.max_rows})")
        if inputs.page_table.shape[1] != self.max_pages:
            raise ValueError(f"page table has {inputs.page_table.shape[1]} columns, buffers {self.max_pages}")
        # (this mirror's last upload, two loads ago, belongs to a step that has been read back)
        host, host_bytes = self.hosts[self._turn], self._host_bytes[self._turn]
        self._turn ^= 1
        views = {}
        for name, _, _, _ in self.spec:
            arr = getattr(inputs, name)
            if arr is None:  # feed_rows of a step whose ids come from the host
                views[name] = self.dev[name][:0]
                continue
            n = arr.shape[0]
            host[name][:n] = arr
            views[name] = self.dev[name][:n]
        end = self.offsets["page_table"] + B * self.max_pages * 4
        self._dev_bytes[:end].copy_(host_bytes[:end], non_blocking=True)
        return views
