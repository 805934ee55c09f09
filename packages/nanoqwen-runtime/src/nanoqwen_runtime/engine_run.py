"""One `BackendRun` over any engine: the adapter that puts the CUDA `Engine` (engine/backend.py) and the
plain-torch `ReferenceEngine` (backend.py `ReferenceBackend`) behind the `Backend` protocol.

    run = EngineRun(engine, [TokenRequest(prompt_ids, params, eos_ids), ...])   # submits them all
    for events in run: ...      # one list per engine step: TokenEvent/ErrorEvent, request = index
    run.finish(i)               # aborts request i (the pipeline matched a stop string)

Mapping: the engine's `TokenEvent`s are passed on with `request` set to the request's index. Requests
are submitted with `detokenize=False` and without stop strings: text and stop strings are the
pipeline's job, so every token is decoded once. A request the engine ends with `FinishReason.ERROR`
(non-finite logits) becomes an `events.ErrorEvent` carrying the engine's detail. Before anything is
submitted, a prompt that does not fit the engine's context is refused with `ContextLengthError` and a
token id outside the vocabulary with `ValueError`; any other refusal of the engine is a `BackendError`
(and nothing of the run stays queued).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from .backend_types import BackendError, ContextLengthError, TokenRequest
from .engine.sequence import FinishReason, Request
from .events import ErrorEvent, TokenEvent
from .request_stream import FinishEvent

__all__ = ["EngineRun", "check_prompts"]


def check_prompts(requests: list[TokenRequest], max_context: int, vocab_size: int) -> None:
    """ContextLengthError / ValueError for a prompt no engine of this context and vocabulary can run."""
    for r in requests:
        n = len(r.prompt_ids)
        if n >= max_context:
            raise ContextLengthError(
                f"the prompt has {n} tokens but the context window is {max_context} tokens "
                f"(prompt plus at least one generated token must fit); shorten the prompt")
        bad = [t for t in r.prompt_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt token ids out of range 0..{vocab_size - 1}: {bad[:5]}")


class EngineRun:
    """The requests of one `Backend.start()` on an engine with the `engine_base.EngineBase` surface
    (`submit`, `step`, `abort`, `has_work`, `max_model_len`, `geom`)."""

    def __init__(self, engine, requests: list[TokenRequest]):
        if not requests:
            raise ValueError("no requests")
        check_prompts(requests, engine.max_model_len, engine.geom.vocab_size)
        self.engine = engine
        self.ids = [f"run-{id(self)}-{i}" for i in range(len(requests))]
        self.index = {rid: i for i, rid in enumerate(self.ids)}
        for rid, r in zip(self.ids, requests, strict=True):
            req = Request(list(r.prompt_ids), r.params.with_(stop=()), rid, eos_ids=frozenset(r.eos_ids),
                          detokenize=False)
            ev = engine.submit(req)
            if ev is not None:
                for other in self.ids:  # leave nothing queued behind the refusal
                    engine.abort(other)
                raise BackendError(f"request {self.index[rid]} refused: {ev.detail}")

    def finish(self, index: int) -> None:
        self.engine.abort(self.ids[index])

    def __iter__(self) -> Iterator[list[TokenEvent | ErrorEvent]]:
        while self.engine.has_work:
            out: list[TokenEvent | ErrorEvent] = []
            for ev in self.engine.step():
                if isinstance(ev, TokenEvent):
                    out.append(dataclasses.replace(ev, request=self.index[ev.request]))
                elif isinstance(ev, FinishEvent) and ev.reason is FinishReason.ERROR:
                    out.append(ErrorEvent(self.index[ev.request_id], ev.num_generated, ev.detail))
            if out:
                yield out
