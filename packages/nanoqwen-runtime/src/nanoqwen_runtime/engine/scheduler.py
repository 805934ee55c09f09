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

import itertools
import os
from collections import deque
from dataclasses import dataclass, field

from ..kv_cache import KVShift
from ..logprobs import check_request as check_logprobs
from ..sampling import SamplingParams
from ..speculative import NgramDrafter, SpeculationConfig, accept_greedy
from .blocks import BlockAllocatorProtocol, BlockManager, ShiftedRun
from .sequence import FinishReason, Request, SeqStatus, Sequence

__all__ = ["FinishReason", "SeqStatus", "Request", "Sequence", "StepPlan", "Scheduler", "BlockManager",
           "BlockAllocatorProtocol", "VERIFY_MAX_ROWS"]

# A decode step that carries drafts runs each sequence's pending token plus its drafts as rows; drafts
# are added only while the step has at most this many rows: up to 8 rows the INT4 GEMV reads every
# weight once (its M <= 8 path), so the extra rows cost almost nothing. Past it they cost real compute.
VERIFY_MAX_ROWS = 8


@dataclass
class StepPlan:
    """What one engine step computes: for each sequence, `query_lens[i]` tokens starting at
    `start_pos[i]` (= its num_computed); `sample[i]` says whether it samples a token afterwards.

    A decode step may carry drafts (`drafts[i]`, prompt-lookup speculation): then sequence i computes
    its pending token plus the drafted tokens, `query_lens[i] = 1 + len(drafts[i])` rows, and the step
    samples a greedy token after every one of them (the verify step; `Scheduler.commit` keeps the
    agreeing prefix). The drafted tokens are not in `seq.tokens`: `step_tokens(i)` gives the row ids.

    A prefill chunk may skip a span (`skips[i] = (a, b)`: the K/V of positions a..b-1 were copied at
    admission, `Sequence.reused_span`): then its `query_lens[i]` tokens are positions start..a-1 and
    b..`end_pos(i)`-1, two rows of the step (`metadata.plan_rows`), so that an editor's prompt with
    copied code below the cursor is prefilled in one step, not two.
    """

    kind: str  # "prefill" | "decode"
    seqs: list[Sequence]
    query_lens: list[int]
    start_pos: list[int]
    sample: list[bool]
    preempted: list[Sequence] = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)  # per sequence ([] each when none)
    feed_rows: list[int] = field(default_factory=list)  # planned ahead: the previous step's row per seq
    skips: list[tuple[int, int] | None] = field(default_factory=list)  # per sequence of a prefill step

    def skip(self, i: int) -> tuple[int, int] | None:
        """The span of positions sequence i's chunk skips, or None."""
        return self.skips[i] if self.skips else None

    def end_pos(self, i: int) -> int:
        """One past the last position sequence i computes in this step."""
        end = self.start_pos[i] + self.query_lens[i]
        skip = self.skip(i)
        return end + (skip[1] - skip[0] if skip else 0)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def has_drafts(self) -> bool:
        return any(self.drafts)

    @property
    def ahead(self) -> bool:
        """Planned before the previous step's tokens were known (`Scheduler.plan_ahead`)."""
        return bool(self.feed_rows)

    def step_tokens(self, i: int) -> list[int]:
        """Token ids sequence i feeds to this step (its pending token plus drafts in a verify step).
        A step planned ahead has no host ids: its rows read them on the device (`feed_rows`)."""
        if self.feed_rows:
            raise AssertionError("a step planned ahead takes its token ids from the previous step's output")
        seq, start = self.seqs[i], self.start_pos[i]
        if self.drafts and self.drafts[i]:
            return [*seq.tokens[start:start + 1], *self.drafts[i]]
        return seq.tokens[start:self.end_pos(i)]  # a skipped span's ids included: rows index by position


def chunk_span(seq: Sequence, q: int) -> tuple[int, tuple[int, int] | None]:
    """A prefill chunk of `q` tokens from `seq.num_computed`: one past its last position, and the span
    it skips (the K/V copied at admission, `seq.reused_span`) when it reaches past the span's start."""
    end, span = seq.num_computed + q, seq.reused_span
    if span is not None and end > span[0]:
        return end + span[1] - span[0], span
    return end, None


class Scheduler:
    """Plans steps (see the module header). `speculation` is the default for requests that leave
    `Request.speculation` None; `verify_max_rows` caps the rows of a decode step that carries drafts."""

    def __init__(self, blocks: BlockManager, *, max_batch: int, max_model_len: int, prefill_chunk: int,
                 admit_watermark: float = 0.01, speculation: SpeculationConfig | None = None,
                 verify_max_rows: int = VERIFY_MAX_ROWS, cache_reuse: int = 0):
        self.blocks = blocks
        # shifted reuse of cached K/V past the exact prefix (blocks.py), for runs of at least this many
        # tokens; 0: off. The copies an admission decides wait in `pending_shifts` for the engine, which
        # applies them (kv_cache.shift_kv) before the step's forward.
        self.cache_reuse = cache_reuse
        self.pending_shifts: list[KVShift] = []
        # the last find_shifted answer: (seq_id, cache_version, hit, end, run); the search costs about a
        # microsecond per prompt token and a queued request is planned again every step
        self._last_shifted: tuple | None = None
        self.reuse_hit_tokens = 0
        self.speculation = speculation
        self.verify_max_rows = verify_max_rows
        # counters (EngineStats): prompt tokens looked up in / taken from the prefix cache at admission,
        # decode steps' drafted and accepted tokens
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0
        self.spec_steps = 0
        self.spec_drafted_tokens = 0
        self.spec_accepted_tokens = 0
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
        sp = request.speculation
        if sp is not None and sp is not False and not isinstance(sp, SpeculationConfig):
            return f"speculation must be None, False or a SpeculationConfig, got {sp!r}"
        why = check_logprobs(request.logprobs, request.prompt_logprobs)
        if why is not None:
            return why
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
        spec = self.speculation if request.speculation is None else request.speculation
        # speculation is off for temperature > 0 (class docstring) and for constrained requests (a
        # draft would have to follow the grammar: they are not speculated at all)
        if spec and request.params.greedy and request.grammar is None:
            seq.drafter = NgramDrafter(spec, request.prompt_tokens)
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

    def plan_ahead(self, plan: StepPlan) -> StepPlan | None:
        """The decode step that `schedule()` will plan after `plan` is committed, planned NOW, before
        `plan`'s sampled tokens are known (the engine's overlapped decode, EngineConfig.overlap: the
        engine launches it before it reads `plan`'s tokens back, so the host's work between steps runs
        while the device computes). None when the step after `plan` might be planned differently once
        the tokens are known; the engine then commits `plan` first and calls `schedule()`.

        It is planned ahead when `plan` is a decode step without drafts, every running sequence is in
        it, and
        - every sequence continues past `plan` unless one of its tokens ends it (EOS, a stop string):
          a sequence that `plan`'s token takes to max_tokens or the context limit is left out;
        - no waiting request could be admitted after the commit unless a token ends a sequence
          (`_admission_blocked`: the batch is full, or the pool is, watermark included). A slot or pages
          that an EOS frees then go to the waiting request one step later than without overlap;
        - the pages for one more token each are free now without evicting a cached block (no
          preemption or eviction ahead: `schedule()` decides those after the commit, when the pages of
          sequences that leave are back);
        - no sequence is expected to get drafts: its drafter backs off through that step (propose()
          would return [] and change no state), or its context as last committed has no n-gram match
          (`NgramDrafter.idle_at`: a prediction; if the token in flight gives it one, that draft is
          made one step later than `schedule()` would make it, with the same tokens emitted), or the
          step has at least `verify_max_rows` rows (no room for drafts; if a token ends a sequence,
          the step it would have drafted in runs without drafts).
        A sequence that `plan`'s token ends (EOS, stop) or that is aborted still computes one row in the
        step planned ahead: its output is dropped at commit (the sequence is no longer running), its
        K/V row lands past its end in a page it released, which a later owner writes before reading
        (the device runs the steps in launch order). That row and a draft made a step later are the
        differences from `schedule()`: the step has a row more than the synchronous engine's, which can
        change its graph bucket or kernel path and so the other rows' logits in their last bits (the
        tokens up to a near-tie); the verify steps of speculating sequences can fall elsewhere."""
        if plan.kind != "decode" or plan.has_drafts or any(not s.in_decode for s in self.running):
            return None
        live = [(row, s) for row, s in enumerate(plan.seqs) if s.status is SeqStatus.RUNNING]
        if len(live) != len(self.running):
            return None
        keep = [(row, s) for row, s in live  # (the token in flight does not end it by length)
                if s.num_generated + 1 < s.request.params.max_tokens
                and len(s.tokens) + 1 < self.max_model_len]
        if not keep:
            return None
        if self.waiting and not self._admission_blocked([s for _, s in keep], [s for _, s in live]):
            return None
        if len(keep) < self.verify_max_rows and any(not _drafter_idle_next(s) for _, s in keep):
            return None
        # only free blocks, no eviction: before the commit, the pages of sequences leaving are not yet
        # released, and `schedule()` after it could take one of those instead of evicting a cached block
        need = sum(self.blocks.extra_blocks(s, len(s.tokens) + 1) for _, s in keep)
        if need > self.blocks.allocator.num_free:
            return None
        for _, s in keep:
            self.blocks.grow(s, len(s.tokens) + 1)
        seqs = [s for _, s in keep]
        n = len(seqs)
        return StepPlan("decode", seqs, [1] * n, [len(s.tokens) for s in seqs], [True] * n, [],
                        [[] for _ in seqs], [row for row, _ in keep])

    def _admission_blocked(self, continuing: list[Sequence], running: list[Sequence]) -> bool:
        """Whether `_schedule_prefill`, run after the commit of a decode step over `running` (of which
        `continuing` do not reach a length limit), surely admits nothing if no token ends a sequence:
        the batch stays full, or the queue's first request needs more pages than can be free then.
        Its need is bounded below by today's (the `_schedule_prefill` formula) less one block per running
        sequence (the commit may put one more full block of each in the prefix cache: a longer hit),
        and at least one (its last token is never in a cached block); the pages free then, above by
        today's plus every page of the sequences leaving (a shared one stays held)."""
        if len(continuing) >= self.max_batch:
            return True
        bm = self.blocks
        need = self._admission(self.waiting[0], self.prefill_chunk)[3]
        need_at_least = max(1, need - (len(running) if bm.prefix_caching else 0))
        left = {id(s) for s in continuing}
        free_at_most = bm.num_free + sum(len(s.blocks) for s in running if id(s) not in left)
        reserve = self.watermark_blocks if continuing else 0
        return need_at_least + reserve > free_at_most

    def _admission(self, seq: Sequence, budget: int
                   ) -> tuple[list[int], list[bytes], int, int, ShiftedRun | None]:
        """Admitting waiting `seq` into a prefill step with `budget` tokens left: its cached prefix
        (blocks, keys), the tokens it would compute now (at least one is left to compute: the step
        must produce logits), the free blocks that takes (new ones, and cached blocks of the prefix
        no one holds, which leave the free count), and with `cache_reuse` the run of cached blocks it
        would copy past the prefix (blocks.find_shifted; the pages it lands in are taken now). The
        chunk then starts after the run when it starts at the prefix's end; otherwise it computes the
        tokens up to the run and, as the budget allows, those after it (a chunk that skips the run). A
        request that wants its prompt's logprobs takes no cached K/V: they need the logits at every
        prompt position (logprobs.py)."""
        n = len(seq.tokens)
        if seq.request.prompt_logprobs:
            hit_blocks, hit_keys = [], []
        else:
            hit_blocks, hit_keys = self.blocks.lookup(seq.tokens, n - 1)
        hit = len(hit_blocks) * self.blocks.block_size
        run = None
        if self.cache_reuse and not seq.request.prompt_logprobs:
            run = self._shifted_run(seq, hit, n - 1)
        start, stop = hit, n
        if run is not None:
            start, stop = (run.end, n) if run.start == hit else (hit, run.start)
        q = min(stop - start, budget)
        held = max(start + q, run.end if run is not None else 0)
        if run is not None and stop == run.start and q == stop - start:  # the tokens after the run too
            tail = min(n - run.end, budget - q)
            q, held = q + tail, run.end + tail
        need = self.blocks.blocks_for(held) - len(hit_blocks) + self.blocks.evictable_among(hit_blocks)
        return hit_blocks, hit_keys, q, need, run

    def _shifted_run(self, seq: Sequence, hit: int, end: int) -> ShiftedRun | None:
        """blocks.find_shifted for waiting `seq` past its exact hit, asked again only when the cache or
        the hit changed since the last answer (a waiting sequence's tokens do not change)."""
        key = (seq.seq_id, self.blocks.cache_version, hit, end)
        if self._last_shifted is None or self._last_shifted[:4] != key:
            self._last_shifted = (*key, self.blocks.find_shifted(seq.tokens, hit, end, self.cache_reuse))
        return self._last_shifted[4]

    def _fit_rows(self, seq: Sequence, q: int, skips: int) -> int:
        """`q`, or the chunk cut where `seq`'s reused span starts when skipping the span would take a
        second row the step has no room for: a prefill step has at most max_batch rows (the engine's
        step buffers), counting the running sequences, each a row, and one more per skipping chunk."""
        _, skip = chunk_span(seq, q)
        if skip is not None and len(self.running) + skips + 1 > self.max_batch:
            return skip[0] - seq.num_computed
        return q

    def _reuse(self, seq: Sequence, run: ShiftedRun) -> None:
        """Take pages through `run` for newly admitted `seq` and queue the copy of the run's K/V into
        them (`pending_shifts`); prefill skips the run (`Sequence.reused_span`), and nothing from its
        first token on is cached."""
        bs = self.blocks.block_size
        self.blocks.grow(seq, run.end)
        src = [b * bs + j for b in run.blocks for j in range(bs)]
        dst = [seq.blocks[p // bs] * bs + p % bs for p in range(run.start, run.end)]
        self.pending_shifts.append(KVShift(src, dst, run.delta))
        seq.first_shifted_block = run.start // bs
        if run.start == seq.num_computed:
            seq.num_computed = run.end
        else:
            seq.reused_span = (run.start, run.end)
        self.reuse_hit_tokens += run.end - run.start

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
        seq.reused_span = seq.first_shifted_block = None  # recomputed on resume (or reused anew)
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
        drafts = self._draft(seqs)
        return StepPlan("decode", seqs, [1 + len(d) for d in drafts], [s.num_computed for s in seqs],
                        [True] * len(seqs), preempted, drafts)

    def _draft(self, seqs: list[Sequence]) -> list[list[int]]:
        """Prompt-lookup drafts for a decode step, oldest sequence first, while the step stays within
        `verify_max_rows` rows. A draft never reaches past max_tokens or the context limit (the
        verify step's bonus token included), and never takes a page another sequence would need: it
        only uses pages that are free now (or it is shortened)."""
        rows_left = self.verify_max_rows - len(seqs)
        out: list[list[int]] = []
        for seq in seqs:
            d: list[int] = []
            if seq.drafter is not None and rows_left > 0:
                limit = min(rows_left, seq.request.params.max_tokens - seq.num_generated - 1,
                            self.max_model_len - len(seq.tokens))
                d = seq.drafter.propose(seq.tokens[seq.num_prompt:], max(0, limit))
                room = (len(seq.blocks) + self.blocks.num_free) * self.blocks.block_size - len(seq.tokens)
                d = d[:max(0, room)]
                if d:
                    self.blocks.grow(seq, len(seq.tokens) + len(d))
                rows_left -= len(d)
            out.append(d)
        return out

    def _schedule_prefill(self) -> StepPlan | None:
        budget = self.prefill_chunk
        preempted: list[Sequence] = []
        chosen: list[tuple[Sequence, int]] = []
        skips = 0  # chunks that skip a span: a second row each; rows stay <= max_batch
        # 1. running sequences still in prefill, oldest first
        for seq in sorted([s for s in self.running if s.uncomputed > 1], key=lambda s: s.admitted_order):
            if budget == 0 or seq.status is not SeqStatus.RUNNING:
                continue
            q = self._fit_rows(seq, min(seq.prefill_left, budget), skips)
            if self._reserve(seq, chunk_span(seq, q)[0], preempted):
                chosen.append((seq, q))
                budget -= q
                skips += chunk_span(seq, q)[1] is not None
        chosen = [(s, q) for s, q in chosen if s.status is SeqStatus.RUNNING]
        # 2. admit waiting sequences FIFO while pages (above the watermark) and batch slots allow; a
        # sequence starts after the longest cached prefix of its tokens (at least one token is left to
        # compute: the step must produce logits)
        while budget > 0 and self.waiting and len(self.running) + skips < self.max_batch:
            seq = self.waiting[0]
            hit_blocks, hit_keys, q, need, run = self._admission(seq, budget)
            hit = len(hit_blocks) * self.blocks.block_size
            reserve = self.watermark_blocks if self.running else 0
            if need + reserve > self.blocks.num_free:
                break
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            seq.admitted_order = next(self._admit_counter)
            self.running.append(seq)
            if self.blocks.prefix_caching and not seq.request.prompt_logprobs:
                self.prefix_queried_tokens += len(seq.tokens)
                self.prefix_hit_tokens += hit
            self.blocks.acquire(seq, hit_blocks, hit_keys)
            seq.num_computed = hit
            if run is not None:
                self._reuse(seq, run)
                q = self._fit_rows(seq, q, skips)
            self.blocks.grow(seq, chunk_span(seq, q)[0])
            chosen.append((seq, q))
            budget -= q
            skips += chunk_span(seq, q)[1] is not None
        if not chosen:
            return None
        seqs = [s for s, _ in chosen]
        qs = [q for _, q in chosen]
        spans = [chunk_span(s, q) for s, q in chosen]
        skips = [skip for _, skip in spans] if any(skip for _, skip in spans) else []
        return StepPlan("prefill", seqs, qs, [s.num_computed for s in seqs],
                        [end == len(s.tokens) for s, (end, _) in zip(seqs, spans, strict=True)], preempted,
                        skips=skips)

    # ---- after the step -----------------------------------------------------------------------
    def commit(self, plan: StepPlan, sampled: dict[int, int | list[int]]) -> list[Sequence]:
        """Record a finished step: advance `num_computed`, append sampled tokens (seq_id -> token, or
        for a sequence that carried drafts the greedy token after each of its 1 + len(draft) rows).
        A verify step keeps the drafts the model agrees with plus its own next token
        (`speculative.accept_greedy`) and releases pages grown for rejected drafts; the K/V rows it
        wrote for them lie past the sequence's end and are overwritten later. Full computed blocks
        enter the prefix cache. Returns the sequences that received tokens, each with
        `num_new_tokens` set (the caller checks stop conditions token by token)."""
        out = []
        for i, (seq, smp) in enumerate(zip(plan.seqs, plan.sample, strict=True)):
            if seq.status is not SeqStatus.RUNNING:
                continue
            draft = plan.drafts[i] if plan.drafts else []
            if plan.feed_rows and seq.num_computed != plan.start_pos[i]:
                raise AssertionError(f"seq {seq.seq_id}: a step planned ahead committed out of order "
                                     f"({seq.num_computed} computed, the step starts at {plan.start_pos[i]})")
            if draft:
                if seq.seq_id not in sampled:
                    # a verify row not emitted (non-finite logits): its sequence was finished by the caller
                    raise AssertionError(f"seq {seq.seq_id}: verify step without sampled tokens")
                new = accept_greedy(draft, sampled[seq.seq_id])
                accepted = len(new) - 1
                seq.drafter.record(len(draft), accepted)
                self.spec_steps += 1
                self.spec_drafted_tokens += len(draft)
                self.spec_accepted_tokens += accepted
                seq.num_computed += 1 + accepted
                seq.tokens.extend(new)
                self.blocks.shrink(seq, len(seq.tokens))
            else:
                seq.num_computed = plan.end_pos(i)
                if seq.reused_span is not None and seq.num_computed >= seq.reused_span[0]:
                    seq.num_computed = max(seq.num_computed, seq.reused_span[1])  # copied at admission
                    seq.reused_span = None
                if not smp:
                    self.blocks.register(seq)
                    continue
                tok = sampled[seq.seq_id]
                new = tok if isinstance(tok, list) else [tok]
                if len(new) != 1:
                    raise AssertionError(f"seq {seq.seq_id}: {len(new)} tokens for a step without drafts")
                seq.tokens.extend(new)
            if seq.drafter is not None:  # what plan_ahead asks it about (NgramDrafter.idle_at)
                seq.drafter.observe(new)
            seq.num_new_tokens = len(new)
            self.blocks.register(seq)
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


def _drafter_idle_next(seq: Sequence) -> bool:
    """Whether `seq` may go without drafts in the decode step after the next commit: it has no drafter,
    or its drafter backs off through that generated length (no draft whatever the token), or expects no
    match (`NgramDrafter.idle_at`: its context as last committed has none)."""
    d = seq.drafter
    return d is None or d.idle_at(seq.num_generated + 1)
