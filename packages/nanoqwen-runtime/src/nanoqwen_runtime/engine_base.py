"""The request side both engines share: submission checks, aborts, token events, finishing, statistics.

The CUDA `engine.Engine` and the plain-torch `reference_engine.ReferenceEngine` differ only in how a
step runs the model (`step()`); everything around it is this one class, so both refuse the same
requests with the same reasons, end requests by the same rules (`request_stream.RequestStream`) and
report the same counters (`stats.EngineStats`):

    submit(Request) -> FinishEvent | None     refusal (nothing queued) or None (queued)
    step() -> [TokenEvent..., FinishEvent]    subclass: schedule, run the model, `scheduler.commit`,
                                              then `_emit(seq)` for every sequence that got tokens
    abort(request_id), has_work, generate(requests), kv_blocks_used(), check_accounting(), stats()

A subclass sets, before any request: `geom` (Qwen2Config), `tokenizer` (or None), `max_model_len`,
`blocks` (engine.blocks.BlockManager) and `scheduler` (engine.scheduler.Scheduler), then calls
`EngineBase.__init__`.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace

import torch
from nanoqwen_model.forward import rope_inv_freq

from .engine.sequence import FinishReason, Request, SeqStatus, Sequence
from .kv_cache import shift_kv
from .request_stream import Event, FinishEvent, RequestStream
from .stats import EngineStats

__all__ = ["EngineBase"]


class EngineBase(ABC):
    """Requests, streams and counters of an engine (see the module header). Not thread-safe."""

    def __init__(self) -> None:
        self._streams: dict[int, RequestStream] = {}
        self._ids = 0
        self._prompt_lp: dict = {}  # seq_id -> logprobs.PromptLogprobs, while its prompt is prefilled
        self.num_logprob_requests = 0  # live requests that asked for logprobs (none: steps skip the work)
        self.mask_seconds = 0.0  # host time spent computing token masks of constrained rows
        self._inv_freq: torch.Tensor | None = None  # RoPE frequencies of K/V shifts (made at the first)

    # ---- requests ---------------------------------------------------------------------------------
    def submit(self, request: Request) -> FinishEvent | None:
        """Queue a request; returns a refusal event (and queues nothing) if it can never run."""
        if request.request_id is None:
            request.request_id = f"req-{self._ids}"
        self._ids += 1
        why = self.scheduler.refusal_reason(request)
        if why is None and not all(0 <= t < self.geom.vocab_size for t in request.prompt_tokens):
            why = f"prompt has token ids outside 0..{self.geom.vocab_size - 1}"
        if why is None and request.params.stop and self.tokenizer is None:
            why = "stop strings need a tokenizer; this model has none"
        matcher = None
        if why is None and request.grammar is not None:
            matcher, why = self._grammar_matcher(request)
        if why is not None:
            return FinishEvent(request.request_id, FinishReason.REFUSED, detail=why,
                               num_prompt_tokens=len(request.prompt_tokens))
        seq = self.scheduler.add(request)
        seq.matcher = matcher
        self._streams[seq.seq_id] = RequestStream.open(seq, self.tokenizer)
        if request.logprobs is not None:
            self.num_logprob_requests += 1
        return None

    def abort(self, request_id: str) -> FinishEvent | None:
        """End a queued or running request now (its pages are freed); None if it is not live."""
        for st in list(self._streams.values()):
            if st.seq.request.request_id == request_id:
                return self._finish(st, FinishReason.ABORTED)
        return None

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def generate(self, requests: Iterable[Request]) -> Iterator[Event]:
        """Submit `requests` and run until every request (also ones submitted meanwhile) is done."""
        for r in requests:
            ev = self.submit(r)
            if ev is not None:
                yield ev
        while self.has_work:
            yield from self.step()

    # ---- stepping ---------------------------------------------------------------------------------
    @abstractmethod
    def step(self, side_work: Callable[[], None] | None = None) -> list[Event]:
        """Run one engine step; its events. `side_work()`, when given, is called once per step that
        runs, where the caller's host work costs the step least: after a captured graph's launch (the
        host only waits for the device there), else before the forward pass (host-bound: the caller's
        work should not wait for it)."""

    # ---- constrained decoding (grammar.py, token_mask.py) ------------------------------------------
    supports_grammar = True  # False: an engine built without the token mask refuses grammars

    def _eos_ids(self, request: Request) -> tuple[int, ...]:
        eos = request.eos_ids if request.eos_ids is not None else self.geom.eos_token_id
        return tuple(sorted(int(e) for e in eos))

    def _grammar_matcher(self, request: Request):
        """(GrammarMatcher, None) for a constrained request, or (None, why it is refused)."""
        if not self.supports_grammar:
            return None, "this engine was built without the token mask (grammars are off)"
        if self.tokenizer is None or not getattr(self.tokenizer, "source_json", None):
            return None, "a grammar needs the model's tokenizer; this model has none"
        if request.ignore_eos:
            return None, "ignore_eos cannot be combined with a grammar (EOS ends a complete grammar)"
        from .grammar import GrammarError, GrammarMatcher, matcher_tokenizer

        tok = matcher_tokenizer(self.tokenizer.source_json, self.geom.vocab_size, self._eos_ids(request))
        try:
            return GrammarMatcher(request.grammar, tok), None
        except GrammarError as e:
            return None, str(e)

    def _fill_token_masks(self, rows: list[tuple[int, Sequence]], out: torch.Tensor) -> int:
        """Write the bitmask of each (row, constrained sequence) into `out[row]` (int32 [R, W], CPU);
        other rows are left as they are (all ones). Returns the number of rows written; the host time
        it took adds to `mask_seconds`."""
        t0 = time.perf_counter()
        for r, seq in rows:
            seq.matcher.fill_bitmask(out[r])
        self.mask_seconds += time.perf_counter() - t0
        return len(rows)

    def _advance_grammar(self, seq: Sequence) -> str | None:
        """Feed the tokens the last commit appended to `seq` to its matcher (EOS ids end the request
        and are not fed); the error if one was not allowed (the mask makes that impossible)."""
        eos = self._eos_ids(seq.request)
        for tok in seq.tokens[len(seq.tokens) - seq.num_new_tokens:]:
            if tok in eos:
                break
            if not seq.matcher.accept(tok):
                return f"token {tok} broke the request's grammar: {seq.matcher.error}"
        return None

    def _emit(self, seq: Sequence, logprobs: list | None = None, prompt_logprobs: tuple | None = None
              ) -> list[Event]:
        """Events of the tokens the last `scheduler.commit` appended to `seq` (RequestStream rules), and
        the request's `FinishEvent` when one of them ends it. `logprobs`: a `TokenLogprobs` per
        committed token (requests that asked, logprobs.py); `prompt_logprobs` rides on token 0."""
        st = self._streams[seq.seq_id]
        if seq.matcher is not None:
            why = self._advance_grammar(seq)
            if why is not None:
                return [self._finish(st, FinishReason.ERROR, why)]
        events: list[Event] = []
        tokens, reason = st.emit_committed(self.geom.eos_token_id, self.max_model_len)
        if logprobs is not None:
            tokens = [replace(ev, logprobs=lp, prompt_logprobs=prompt_logprobs if ev.index == 0 else None)
                      for ev, lp in zip(tokens, logprobs, strict=False)]
        events.extend(tokens)
        if reason is not None:
            events.append(self._finish(st, reason))
        return events

    def _error(self, seq: Sequence, detail: str) -> FinishEvent:
        """End `seq` with FinishReason.ERROR before its step is committed (no token is emitted)."""
        return self._finish(self._streams[seq.seq_id], FinishReason.ERROR, detail)

    def _finish(self, st: RequestStream, reason: FinishReason, detail: str = "") -> FinishEvent:
        seq = st.seq
        if seq.status is not SeqStatus.FINISHED:
            self.scheduler.finish(seq, reason)
        del self._streams[seq.seq_id]
        self._prompt_lp.pop(seq.seq_id, None)
        if seq.request.logprobs is not None:
            self.num_logprob_requests -= 1
        return st.finish_event(reason, detail)

    def _apply_kv_shifts(self, pool: torch.Tensor) -> None:
        """Copy the K/V that the last `schedule()`'s admissions reuse at shifted positions
        (`Scheduler.pending_shifts`, engine/blocks.py) into `pool`, before the step's forward."""
        shifts = self.scheduler.pending_shifts
        if not shifts:
            return
        if self._inv_freq is None:
            self._inv_freq = rope_inv_freq(self.geom.head_dim, self.geom.rope_theta, pool.device)
        for shift in shifts:
            shift_kv(pool, shift, self._inv_freq)
        shifts.clear()

    # ---- introspection ----------------------------------------------------------------------------
    def kv_blocks_used(self) -> int:
        return self.blocks.num_used

    def check_accounting(self) -> None:
        self.blocks.check(self.scheduler.live())

    def stats(self) -> EngineStats:
        """Counters and gauges now (nanoqwen_runtime.stats). `kv_blocks_total` excludes the padding
        block; `kv_blocks_cached` are unreferenced prefix blocks (evictable, so counted as free)."""
        sch, bm = self.scheduler, self.blocks
        return EngineStats(running=len(sch.running), waiting=len(sch.waiting),
                           kv_blocks_total=bm.usable_blocks, kv_blocks_used=bm.num_used,
                           kv_blocks_cached=bm.num_cached, preemptions=sch.num_preemptions,
                           prefix_queried_tokens=sch.prefix_queried_tokens,
                           prefix_hit_tokens=sch.prefix_hit_tokens,
                           prefix_reused_tokens=sch.reuse_hit_tokens, spec_steps=sch.spec_steps,
                           spec_drafted_tokens=sch.spec_drafted_tokens,
                           spec_accepted_tokens=sch.spec_accepted_tokens)
