"""Continuous-batching scheduler and KV block manager of the CUDA engine (pure Python, CPU-testable).

The scheduler decides, before every engine step, which sequences run and how many of their tokens
are computed; the block manager hands KV pages to them with exact accounting. Neither touches a
device: the model runner turns a `StepPlan` into device buffers (see `metadata.py`).

One rule covers prefill and decode. A sequence holds `tokens` (prompt + generated so far) and
`num_computed`, the number of those whose K/V are in the cache:

    tokens:  |<-------------------------- len(tokens) ------------------------->|
             |<------ num_computed (in cache) ------>|<--- uncomputed (query) -->|

A step computes `query_len` of the uncomputed tokens (a prefill chunk, or the one last token at
decode) and, when that reaches the end of `tokens`, samples the next token. So a fresh request is
"prefill" (uncomputed = prompt length) and a running one "decode" (uncomputed = 1).

Policy:
- Admission is FIFO. A request that could never run (prompt + max_new_tokens over the context limit
  or over the whole pool) is refused at submission with the reason; everything else is guaranteed
  to finish, because the oldest running sequence can always take the whole pool.
- Steps alternate between a prefill step (chunks of up to `prefill_chunk` tokens over one or more
  sequences) and a decode step (every decode-phase sequence, one token each), so that arrivals get a
  low time to first token without stalling the running batch.
- When a sequence needs a page and none is free, the youngest running sequence is preempted: its
  pages are freed and it goes back to the front of the queue keeping its generated tokens; on
  resume its prompt + generated tokens are recomputed (prefill), and it continues where it stopped.
  Preemption never touches another sequence's pages, so it cannot corrupt them.
"""

from __future__ import annotations

import enum
import itertools
import os
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from ..sampling import SamplingParams


class FinishReason(enum.StrEnum):
    EOS = "eos"            # an end-of-sequence token was sampled
    STOP = "stop"          # a stop string appeared in the output
    LENGTH = "length"      # max_new_tokens reached
    CONTEXT = "context"    # the engine's context limit reached
    REFUSED = "refused"    # never admitted (reason in the event)
    ABORTED = "aborted"    # cancelled by the caller
    ERROR = "error"        # the model failed at run time (non-finite logits); no token emitted (detail)


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    """One generation request: prompt token ids and sampling settings (validated by `SamplingParams`).

    `params.seed=None` gets a fresh random seed when the engine accepts the request. `ignore_eos`
    keeps generating past EOS tokens (benchmarks use it to fix the output length); `eos_ids`
    replaces the model's EOS ids for this request. A request whose prompt + max_tokens exceeds the
    context limit runs until the context is full (finish reason "context"). `detokenize=False` leaves
    the events' text empty (the `Backend` adapter: its `Pipeline` decodes the tokens itself, once).
    """

    prompt_tokens: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str | None = None
    ignore_eos: bool = False
    eos_ids: frozenset[int] | None = None
    detokenize: bool = True


@dataclass(eq=False)
class Sequence:
    """Scheduler state of one request. `tokens` = prompt + generated so far."""

    seq_id: int
    request: Request
    tokens: list[int]
    num_prompt: int
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    admitted_order: int = -1  # larger = admitted later (preempted first)
    seed: int = 0  # the request's seed, or a fresh random one when it gave None

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.num_prompt

    @property
    def uncomputed(self) -> int:
        return len(self.tokens) - self.num_computed

    @property
    def in_decode(self) -> bool:
        return self.status is SeqStatus.RUNNING and self.uncomputed == 1


class BlockAllocatorProtocol(Protocol):
    """What the block manager needs from the shared allocator (nanoqwen_runtime.kv_cache)."""

    def allocate(self, n: int) -> list[int]: ...
    def free(self, blocks: list[int]) -> None: ...
    @property
    def num_free(self) -> int: ...


class BlockManager:
    """Exact page accounting: every block is either free or owned by exactly one live sequence.

    Block `padding_block` (allocated once at construction) is where padded rows of a graph-bucketed
    decode batch write their K/V; it never belongs to a sequence and is not counted as used.
    """

    def __init__(self, allocator: BlockAllocatorProtocol, num_blocks: int, block_size: int):
        self.allocator = allocator
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.padding_block = allocator.allocate(1)[0]
        self.usable_blocks = num_blocks - 1
        self._owned: dict[int, int] = {}  # block -> seq_id

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    @property
    def num_used(self) -> int:
        return len(self._owned)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def extra_blocks(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks `seq` must gain to hold `num_tokens` tokens in total."""
        return max(0, self.blocks_for(num_tokens) - len(seq.blocks))

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        n = self.extra_blocks(seq, num_tokens)
        if n:
            new = self.allocator.allocate(n)
            for b in new:
                if b in self._owned or b == self.padding_block:
                    raise AssertionError(f"allocator handed out block {b}, which is in use")
                self._owned[b] = seq.seq_id
            seq.blocks.extend(new)

    def release(self, seq: Sequence) -> None:
        for b in seq.blocks:
            if self._owned.pop(b, None) != seq.seq_id:
                raise AssertionError(f"seq {seq.seq_id} released block {b} it does not own")
        self.allocator.free(seq.blocks)
        seq.blocks = []

    def check(self, live: list[Sequence]) -> None:
        """Raise if the accounting is off: used + free + padding == total, no shared blocks."""
        seen: dict[int, int] = {}
        for s in live:
            if len(s.blocks) < self.blocks_for(s.num_computed):
                raise AssertionError(f"seq {s.seq_id}: {s.num_computed} tokens in {len(s.blocks)} blocks")
            for b in s.blocks:
                if b in seen:
                    raise AssertionError(f"block {b} owned by seqs {seen[b]} and {s.seq_id}")
                seen[b] = s.seq_id
        if seen != self._owned:
            raise AssertionError("block ownership table disagrees with the sequences")
        if self.num_used + self.num_free + 1 != self.num_blocks:
            raise AssertionError(f"used {self.num_used} + free {self.num_free} + 1 != {self.num_blocks}")


@dataclass
class StepPlan:
    """What one engine step computes: for each sequence, `query_lens[i]` tokens starting at
    `start_pos[i]` (= its num_computed); `sample[i]` says whether it samples a token afterwards."""

    kind: str  # "prefill" | "decode"
    seqs: list[Sequence]
    query_lens: list[int]
    start_pos: list[int]
    sample: list[bool]
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)


class Scheduler:
    def __init__(self, blocks: BlockManager, *, max_batch: int, max_model_len: int, prefill_chunk: int,
                 admit_watermark: float = 0.01):
        self.blocks = blocks
        self.max_batch = max_batch
        self.max_model_len = max_model_len
        self.prefill_chunk = prefill_chunk
        self.watermark_blocks = int(admit_watermark * blocks.usable_blocks)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._ids = itertools.count()
        self._admit_counter = itertools.count()
        self._last_kind = "decode"
        self.num_preemptions = 0

    # ---- submission ---------------------------------------------------------------------------
    def refusal_reason(self, request: Request) -> str | None:
        """Why `request` can never run on this engine, or None."""
        n = len(request.prompt_tokens)
        if n == 0:
            return "empty prompt"
        if not isinstance(request.params, SamplingParams):
            return f"params must be a SamplingParams, got {type(request.params).__name__}"
        # the sequence stops at the context limit (finish reason "context") if max_tokens is larger
        need = min(n + request.params.max_tokens, self.max_model_len)
        if n >= self.max_model_len:
            return (f"prompt has {n} tokens; the context limit is {self.max_model_len} "
                    "(prompt plus at least one generated token must fit)")
        if self.blocks.blocks_for(need) > self.blocks.usable_blocks:
            return (f"needs {self.blocks.blocks_for(need)} KV blocks of {self.blocks.block_size} tokens; "
                    f"the whole pool has {self.blocks.usable_blocks}")
        return None

    def add(self, request: Request) -> Sequence:
        """Queue a request (the caller has checked `refusal_reason`)."""
        seed = request.params.seed
        if seed is None:
            seed = int.from_bytes(os.urandom(8), "little") >> 1
        seq = Sequence(seq_id=next(self._ids), request=request, tokens=list(request.prompt_tokens),
                       num_prompt=len(request.prompt_tokens), seed=seed)
        self.waiting.append(seq)
        return seq

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def live(self) -> list[Sequence]:
        return [*self.running, *self.waiting]

    # ---- planning -----------------------------------------------------------------------------
    def schedule(self) -> StepPlan | None:
        """Plan the next step, preempting if pages run out. None when there is nothing to do."""
        has_prefill = any(s.uncomputed > 1 for s in self.running) or bool(self.waiting)
        has_decode = any(s.in_decode for s in self.running)
        plan = None
        if has_prefill and (self._last_kind == "decode" or not has_decode):
            plan = self._schedule_prefill()
        if plan is None and has_decode:
            plan = self._schedule_decode()
        if plan is None and has_prefill and self.running:
            plan = self._schedule_prefill()
        if plan is not None:
            self._last_kind = plan.kind
        return plan

    def _preempt_youngest(self, exclude: Sequence | None) -> Sequence | None:
        victims = [s for s in self.running if s is not exclude]
        if not victims:
            return None
        victim = max(victims, key=lambda s: s.admitted_order)
        self._preempt(victim)
        return victim

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.release(seq)
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _reserve(self, seq: Sequence, num_tokens: int, preempted: list[Sequence]) -> bool:
        """Give `seq` pages for `num_tokens` tokens, preempting younger sequences if needed.
        False if `seq` itself had to be preempted (it was the youngest)."""
        while self.blocks.extra_blocks(seq, num_tokens) > self.blocks.num_free:
            younger = [s for s in self.running if s is not seq and s.admitted_order > seq.admitted_order]
            if younger:
                victim = max(younger, key=lambda s: s.admitted_order)
                self._preempt(victim)
                preempted.append(victim)
            else:
                # seq is the youngest: it yields to the older ones (unless it is alone, which
                # submission checks made impossible).
                if len(self.running) == 1:
                    raise AssertionError("a lone sequence does not fit the pool; submission check failed")
                self._preempt(seq)
                preempted.append(seq)
                return False
        self.blocks.grow(seq, num_tokens)
        return True

    def _schedule_decode(self) -> StepPlan | None:
        preempted: list[Sequence] = []
        for seq in sorted([s for s in self.running if s.in_decode], key=lambda s: s.admitted_order):
            if seq.status is SeqStatus.RUNNING:
                self._reserve(seq, len(seq.tokens), preempted)
        seqs = sorted([s for s in self.running if s.in_decode], key=lambda s: s.admitted_order)
        if not seqs:
            return None
        return StepPlan("decode", seqs, [1] * len(seqs), [s.num_computed for s in seqs], [True] * len(seqs),
                        preempted)

    def _schedule_prefill(self) -> StepPlan | None:
        budget = self.prefill_chunk
        preempted: list[Sequence] = []
        chosen: list[tuple[Sequence, int]] = []
        # 1. running sequences still in prefill, oldest first
        for seq in sorted([s for s in self.running if s.uncomputed > 1], key=lambda s: s.admitted_order):
            if budget == 0 or seq.status is not SeqStatus.RUNNING:
                continue
            q = min(seq.uncomputed, budget)
            if self._reserve(seq, seq.num_computed + q, preempted):
                chosen.append((seq, q))
                budget -= q
        chosen = [(s, q) for s, q in chosen if s.status is SeqStatus.RUNNING]
        # 2. admit waiting sequences FIFO while pages (above the watermark) and batch slots allow
        while budget > 0 and self.waiting and len(self.running) < self.max_batch:
            seq = self.waiting[0]
            q = min(seq.uncomputed, budget)
            need = self.blocks.extra_blocks(seq, q)
            reserve = self.watermark_blocks if self.running else 0
            if need + reserve > self.blocks.num_free:
                break
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            seq.admitted_order = next(self._admit_counter)
            self.running.append(seq)
            self.blocks.grow(seq, q)
            chosen.append((seq, q))
            budget -= q
        if not chosen:
            return None
        seqs = [s for s, _ in chosen]
        qs = [q for _, q in chosen]
        return StepPlan("prefill", seqs, qs, [s.num_computed for s in seqs],
                        [s.num_computed + q == len(s.tokens) for s, q in chosen], preempted)

    # ---- after the step -----------------------------------------------------------------------
    def commit(self, plan: StepPlan, sampled: dict[int, int]) -> list[Sequence]:
        """Record a finished step: advance `num_computed`, append sampled tokens (seq_id -> token).
        Returns the sequences that received a token (the caller checks stop conditions)."""
        out = []
        for seq, q, smp in zip(plan.seqs, plan.query_lens, plan.sample, strict=True):
            if seq.status is not SeqStatus.RUNNING:
                continue
            seq.num_computed += q
            if smp:
                seq.tokens.append(sampled[seq.seq_id])
                out.append(seq)
        return out

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
            self.blocks.release(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
