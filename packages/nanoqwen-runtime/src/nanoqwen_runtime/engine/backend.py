"""The CUDA engine behind the runtime's `Backend` protocol (nanoqwen_runtime.backend), so that
`generate.Pipeline` (and through it `nanoqwen-cli generate/chat --device cuda`) streams from it.

    pipeline = load_pipeline(path, EngineConfig())          # tokenizer, template, defaults, engine
    for ev in pipeline.stream(["def fib(n):"], pipeline.sampling_params(max_tokens=64)): ...

Mapping: the engine's `TokenEvent`s are passed on with `request` set to the request's index in
`start()`. Requests are submitted with `detokenize=False` and without stop strings: text and stop
strings are the pipeline's job (`run.finish(i)` aborts the engine request), so every token is decoded
once. A request the engine ends with `FinishReason.ERROR` (non-finite logits) becomes an
`events.ErrorEvent` carrying the engine's detail. A prompt that does not fit is refused at `start()`
with `ContextLengthError`, any other refusal with `BackendError`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from os import PathLike

from nanoqwen_model import Qwen2Config

from ..backend import BackendError, ContextLengthError, TokenRequest
from ..events import ErrorEvent, TokenEvent
from .config import EngineConfig
from .engine import Engine, FinishEvent
from .scheduler import FinishReason, Request


class EngineBackend:
    """`Backend` over one `Engine` (requests of one `start()` run together, continuously batched)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.config: Qwen2Config = engine.geom
        self.max_context = engine.max_model_len
        c = engine.config
        self.name = (f"CUDA engine ({c.backend} op backend, {c.mode} mode) on {engine.device}, "
                     f"{engine.num_blocks} KV blocks of {c.block_size} tokens")

    @classmethod
    def from_file(cls, path: str | PathLike, config: EngineConfig | None = None,
                  progress=None) -> EngineBackend:
        return cls(Engine.from_file(path, config, progress=progress))

    def start(self, requests: Sequence[TokenRequest]) -> _EngineRun:
        if not requests:
            raise ValueError("no requests")
        if self.engine.has_work:
            raise BackendError("the engine is still running an earlier start(); finish iterating it first")
        return _EngineRun(self.engine, list(requests))


class _EngineRun:
    def __init__(self, engine: Engine, requests: list[TokenRequest]):
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
                if "context limit" in ev.detail:
                    raise ContextLengthError(ev.detail)
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


def load_pipeline(path: str | PathLike, config: EngineConfig | None = None, progress=None):
    """A `generate.Pipeline` (tokenizer, chat template, EOS ids, defaults from the container) whose
    backend is the CUDA engine."""
    from ..generate import Pipeline

    return Pipeline.from_container(path, EngineBackend.from_file(path, config, progress))
