"""The backend seam: what a token generator must provide, and the plain-torch reference backend.

A backend turns token requests into a stream of token events. It owns the model, the paged KV cache
and sampling; it stops a sequence on an EOS id, at `max_tokens`, or when the context is full. Text
(detokenizing, stop strings, statistics) is the caller's job (`generate.py`), so every backend gets
it for free and identically.

    backend = ReferenceBackend.from_file(path, device="cpu")      # or the CUDA engine, same protocol
    run = backend.start([TokenRequest(prompt_ids, params, eos_ids)])
    for events in run:           # one list per model step of events.TokenEvent (request = index)
        ...                      # run.finish(i) ends request i early (a stop string matched)

A request whose logits hold NaN/Inf ends with an `events.ErrorEvent` instead of a token (no token is
sampled from such logits); the other requests of the run go on.

Both backends are one adapter (`engine_run.EngineRun`) over an engine. `ReferenceBackend.start()`
runs a `ReferenceEngine` whose KV pool holds every request's prompt + max_tokens (capped at the
context) at once, fp32 pages by default, every request in one batch (no preemption), with the
backend's prefix caching and prompt-lookup speculation settings; the previous start()'s engine is
kept when it is big enough, so its prefix cache serves the next start() (a chat's next turn).
The protocol's types (`Backend`, `TokenRequest`, the errors, `resolve_device`) are in backend_types.py
and re-exported here.
"""

from __future__ import annotations

from collections.abc import Sequence
from os import PathLike

import torch

from .backend_types import (
    Backend,
    BackendError,
    BackendRun,
    ContextLengthError,
    TokenRequest,
    resolve_device,
)
from .engine_run import EngineRun, check_prompts
from .events import ErrorEvent, TokenEvent
from .kv_cache import KVCacheSpec
from .reference import ReferenceModel
from .reference_engine import ReferenceEngine, ReferenceEngineConfig
from .speculative import SpeculationConfig
from .stats import EngineStats

__all__ = [
    "Backend",
    "BackendRun",
    "BackendError",
    "ContextLengthError",
    "TokenRequest",
    "TokenEvent",
    "ErrorEvent",
    "ReferenceBackend",
    "resolve_device",
]


class ReferenceBackend:
    """The plain-torch reference model behind the `Backend` protocol, through a `ReferenceEngine`.

    kv_dtype: dtype of the page pool. float32 by default on the reference (exact match with HF in
    fp32: Qwen2's large key biases make bf16-rounded keys move logits by ~2 units); the CUDA engine
    keeps bf16 pages.
    prefix_caching: requests that share a prompt prefix share its full KV blocks (engine/blocks.py),
      within one start() and across start()s while the engine is kept (`engine_for`); False computes
      every prompt whole.
    speculation: prompt-lookup speculation for greedy requests (speculative.py); None = off.
    """

    def __init__(self, model: ReferenceModel, block_size: int = 16, prefill_chunk: int = 512,
                 kv_dtype: torch.dtype = torch.float32, max_context: int | None = None, *,
                 prefix_caching: bool = True, speculation: SpeculationConfig | None = None):
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        if speculation is not None and not isinstance(speculation, SpeculationConfig):
            raise ValueError(f"speculation must be a SpeculationConfig or None, got {speculation!r}")
        self.model = model
        self.config = model.config
        self.block_size = block_size
        self.prefill_chunk = prefill_chunk
        self.kv_dtype = kv_dtype
        self.prefix_caching = prefix_caching
        self.speculation = speculation
        limit = model.config.max_position_embeddings
        if max_context is not None and not 1 < max_context <= limit:
            raise ValueError(f"max_context must be in 2..{limit}, got {max_context}")
        self.max_context = max_context or limit
        dt = str(model.dtype).removeprefix("torch.")
        self.name = f"reference (plain torch) on {model.device}, {dt} matmuls, {str(kv_dtype)[6:]} KV pages"
        self._engine: ReferenceEngine | None = None  # the latest start()'s engine (engine_for)

    @classmethod
    def from_file(cls, path: str | PathLike, device: str = "cpu", dtype: torch.dtype = torch.float32,
                  *, verify: bool = True, **kwargs) -> ReferenceBackend:
        """Load a container (checksums and finite weights checked unless `verify=False`: integrity.py)."""
        dev = resolve_device(device)
        return cls(ReferenceModel.from_file(path, device=dev, dtype=dtype, verify=verify), **kwargs)

    def engine_for(self, requests: Sequence[TokenRequest]) -> ReferenceEngine:
        """The engine for one start(): the previous one when it is idle, its pool holds every request's
        prompt + max_tokens (capped at the context) at once and its batch takes all of them (so its
        prefix cache carries over, e.g. from one chat turn to the next); else a fresh one sized so
        (at least twice the previous pool, up to every request at full context)."""
        need = sum(-(-min(len(r.prompt_ids) + r.params.max_tokens, self.max_context) // self.block_size)
                   for r in requests)
        old = self._engine
        if (old is not None and not old.has_work and old.blocks.usable_blocks >= need
                and old.config.max_batch >= len(requests)):
            return old
        if old is not None:  # grow geometrically, so that a chat's growing turns soon fit one pool
            cap = len(requests) * -(-self.max_context // self.block_size)
            need = max(need, min(2 * old.blocks.usable_blocks, cap))
        cfg = self.config
        per_block = KVCacheSpec(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, num_blocks=1,
                                block_size=self.block_size, dtype=self.kv_dtype).bytes_per_block
        # + 1: the block manager's padding block; admit_watermark 0: the pool is sized for all requests,
        # none waits for headroom (cached prefix blocks are evicted on demand)
        ecfg = ReferenceEngineConfig(kv_memory_bytes=(need + 1) * per_block, block_size=self.block_size,
                                     max_batch=len(requests), prefill_chunk=self.prefill_chunk,
                                     max_model_len=self.max_context, kv_dtype=self.kv_dtype,
                                     admit_watermark=0.0, prefix_caching=self.prefix_caching,
                                     speculation=self.speculation)
        self._engine = old = None  # drop the old pool before allocating the new one
        self._engine = ReferenceEngine(self.model, ecfg)
        return self._engine

    def start(self, requests: Sequence[TokenRequest]) -> EngineRun:
        requests = list(requests)
        if not requests:
            raise ValueError("no requests")
        check_prompts(requests, self.max_context, self.config.vocab_size)  # before allocating a pool
        return EngineRun(self.engine_for(requests), requests)

    def stats(self) -> EngineStats | None:
        """The counters of the engine that ran the latest start() (None before any)."""
        return self._engine.stats() if self._engine is not None else None
