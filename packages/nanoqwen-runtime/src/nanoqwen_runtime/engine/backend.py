"""The CUDA engine behind the runtime's `Backend` protocol (nanoqwen_runtime.backend), so that
`generate.Pipeline` (and through it `nanoqwen-cli generate/chat --device cuda`) streams from it.

    pipeline = load_pipeline(path, EngineConfig())          # tokenizer, template, defaults, engine
    for ev in pipeline.stream(["def fib(n):"], pipeline.sampling_params(max_tokens=64)): ...

Mapping: the engine's per-step events become lists of `backend.TokenEvent(index, token_id,
finish_reason)`; an EOS token is reported with reason "eos" (the pipeline hides its text); stop
strings stay the pipeline's job (`run.finish(i)` aborts the engine request). A prompt that does not
fit is refused at `start()` with `ContextLengthError`, any other refusal with `BackendError`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from os import PathLike

from ..backend import BackendError, ContextLengthError, TokenEvent, TokenRequest
from ..config import ModelConfig
from .config import EngineConfig
from .engine import Engine, FinishEvent
from .engine import TokenEvent as EngineTokenEvent
from .scheduler import FinishReason, Request

_REASONS = {FinishReason.EOS: "eos", FinishReason.LENGTH: "length", FinishReason.CONTEXT: "context",
            FinishReason.STOP: "stop", FinishReason.ABORTED: "stop"}


class EngineBackend:
    """`Backend` over one `Engine` (requests of one `start()` run together, continuously batched)."""

    def __init__(self, engine: Engine, config: ModelConfig):
        self.engine = engine
        self.config = config
        self.max_context = engine.max_model_len
        c = engine.config
        self.name = (f"CUDA engine ({c.backend} op backend, {c.mode} mode) on {engine.device}, "
                     f"{engine.num_blocks} KV blocks of {c.block_size} tokens")

    @classmethod
    def from_file(cls, path: str | PathLike, config: EngineConfig | None = None,
                  progress=None) -> EngineBackend:
        engine = Engine.from_file(path, config, progress=progress)
        import nanoqwen_format as nqf

        with nqf.open(path) as f:
            cfg = ModelConfig.from_dict(f.config)
        return cls(engine, cfg)

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
            req = Request(list(r.prompt_ids), r.params.with_(stop=()), rid, eos_ids=frozenset(r.eos_ids))
            ev = engine.submit(req)
            if ev is not None:
                for other in self.ids:  # leave nothing queued behind the refusal
                    engine.abort(other)
                if "context limit" in ev.detail:
                    raise ContextLengthError(ev.detail)
                raise BackendError(f"request {self.index[rid]} refused: {ev.detail}")

    def finish(self, index: int) -> None:
        self.engine.abort(self.ids[index])

    def __iter__(self) -> Iterator[list[TokenEvent]]:
        while self.engine.has_work:
            out: list[TokenEvent] = []
            last: dict[int, int] = {}
            for ev in self.engine.step():
                if isinstance(ev, EngineTokenEvent):
                    i = self.index[ev.request_id]
                    last[i] = len(out)
                    out.append(TokenEvent(i, ev.token_id, None))
                elif isinstance(ev, FinishEvent):
                    i = self.index[ev.request_id]
                    reason = _REASONS[ev.reason]
                    if ev.reason is FinishReason.EOS:
                        out.append(TokenEvent(i, ev.tokens[-1], reason))
                    elif i in last:
                        out[last[i]] = TokenEvent(i, out[last[i]].token_id, reason)
            if out:
                yield out


def load_pipeline(path: str | PathLike, config: EngineConfig | None = None, progress=None):
    """A `generate.Pipeline` (tokenizer, chat template, EOS ids, defaults from the container) whose
    backend is the CUDA engine."""
    from ..generate import Pipeline

    return Pipeline.from_container(path, EngineBackend.from_file(path, config, progress))
