"""The CUDA engine behind the runtime's `Backend` protocol (nanoqwen_runtime.backend), so that
`generate.Pipeline` (and through it `nanoqwen-cli generate/chat --device cuda`) streams from it.

    pipeline = load_pipeline(path, EngineConfig())          # tokenizer, template, defaults, engine
    for ev in pipeline.stream(["def fib(n):"], pipeline.sampling_params(max_tokens=64)): ...

The run is `engine_run.EngineRun`, the same adapter `ReferenceBackend` runs its engine with (how
events, errors and refusals map: its module header). One engine serves one `start()` at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from os import PathLike

from nanoqwen_model import Qwen2Config

from ..backend_types import BackendError, TokenRequest
from ..engine_run import EngineRun
from .config import EngineConfig
from .engine import Engine


class EngineBackend:
    """`Backend` over one `Engine` (requests of one `start()` run together, continuously batched)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.config: Qwen2Config = engine.geom
        self.max_context = engine.max_model_len
        c = engine.config
        self.name = (f"CUDA engine ({c.backend} op backend, {c.mode} mode) on {engine.device}, "
                     f"{engine.blocks.usable_blocks} KV blocks of {c.block_size} tokens")

    @classmethod
    def from_file(cls, path, config: EngineConfig | None = None,
                  progress=None, tokenizer=None) -> EngineBackend:
        """`path`: a path or an open `NanoqwenFile` (container.py); `tokenizer`: the container's, when
        the caller has built it already."""
        return cls(Engine.from_file(path, config, progress=progress, tokenizer=tokenizer))

    def stats(self):
        """The engine's counters (nanoqwen_runtime.stats.EngineStats) since it was built."""
        return self.engine.stats()

    def start(self, requests: Sequence[TokenRequest]) -> EngineRun:
        if not requests:
            raise ValueError("no requests")
        if self.engine.has_work:
            raise BackendError("the engine is still running an earlier start(); finish iterating it first")
        return EngineRun(self.engine, list(requests))


def load_pipeline(path: str | PathLike, config: EngineConfig | None = None, progress=None):
    """A `generate.Pipeline` (tokenizer, chat template, EOS ids, defaults from the container) whose
    backend is the CUDA engine."""
    from ..container import opened
    from ..generate import Pipeline

    with opened(path) as f:
        pipe = Pipeline.from_file(f, None)
        pipe.backend = EngineBackend.from_file(f, config, progress, tokenizer=pipe.tokenizer)
    return pipe
