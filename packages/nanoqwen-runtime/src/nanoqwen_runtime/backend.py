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

`ReferenceBackend` schedules every step the same way: each unfinished request contributes either
its next prefill chunk (up to `prefill_chunk` tokens) or its one decode token, all in one
`ReferenceModel.forward` over the shared page pool, so several sequences prefill and decode at once.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from os import PathLike
from typing import Protocol, runtime_checkable

import torch
from nanoqwen_model import Qwen2Config

from .events import (
    FINISH_CONTEXT,
    FINISH_EOS,
    FINISH_LENGTH,
    ErrorEvent,
    TokenEvent,
    nonfinite_logits_message,
)
from .kv_cache import KVCacheSpec, PagedKVCache, SequencePages, build_step_metadata
from .reference import ReferenceModel
from .sampling import Sampler, SamplingParams

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

class BackendError(RuntimeError):
    """A backend cannot run as asked (for example `--device cuda` without a GPU)."""


class ContextLengthError(ValueError):
    """A prompt does not fit in the model's context window."""


@dataclass(frozen=True)
class TokenRequest:
    prompt_ids: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)
    eos_ids: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_ids", tuple(int(t) for t in self.prompt_ids))
        object.__setattr__(self, "eos_ids", frozenset(int(t) for t in self.eos_ids))
        if not self.prompt_ids:
            raise ValueError("a request needs at least one prompt token")


@runtime_checkable
class BackendRun(Protocol):
    def __iter__(self) -> Iterator[list[TokenEvent | ErrorEvent]]: ...
    def finish(self, index: int) -> None: ...


@runtime_checkable
class Backend(Protocol):
    name: str           # printed by the CLI, e.g. "reference (plain torch) on cpu, float32"
    config: Qwen2Config
    max_context: int    # prompt + generated tokens per sequence

    def start(self, requests: Sequence[TokenRequest]) -> BackendRun: ...


def resolve_device(device: str) -> torch.device:
    """'cpu' or 'cuda[:n]'; a CUDA device without a GPU is an error, never a silent CPU fallback."""
    if device not in ("cpu",) and not device.startswith("cuda"):
        raise BackendError(f"unknown device {device!r} (use 'cpu' or 'cuda')")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise BackendError(f"device {device!r} asked for, but no CUDA GPU is available "
                           "(torch.cuda.is_available() is False); use --device cpu")
    return torch.device(device)


class ReferenceBackend:
    """The plain-torch reference model behind the `Backend` protocol.

    kv_dtype: dtype of the page pool. float32 by default on the reference (exact match with HF in
    fp32: Qwen2's large key biases make bf16-rounded keys move logits by ~2 units); the CUDA engine
    keeps bf16 pages.
    """

    def __init__(self, model: ReferenceModel, block_size: int = 16, prefill_chunk: int = 512,
                 kv_dtype: torch.dtype = torch.float32, max_context: int | None = None):
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.model = model
        self.config = model.config
        self.block_size = block_size
        self.prefill_chunk = prefill_chunk
        self.kv_dtype = kv_dtype
        limit = model.config.max_position_embeddings
        if max_context is not None and not 1 < max_context <= limit:
            raise ValueError(f"max_context must be in 2..{limit}, got {max_context}")
        self.max_context = max_context or limit
        dt = str(model.dtype).removeprefix("torch.")
        self.name = f"reference (plain torch) on {model.device}, {dt} matmuls, {str(kv_dtype)[6:]} KV pages"

    @classmethod
    def from_file(cls, path: str | PathLike, device: str = "cpu", dtype: torch.dtype = torch.float32,
                  *, verify: bool = True, **kwargs) -> ReferenceBackend:
        """Load a container (checksums and finite weights checked unless `verify=False`: integrity.py)."""
        dev = resolve_device(device)
        return cls(ReferenceModel.from_file(path, device=dev, dtype=dtype, verify=verify), **kwargs)

    def check_prompt(self, n_prompt: int) -> None:
        if n_prompt >= self.max_context:
            raise ContextLengthError(
                f"the prompt has {n_prompt} tokens but the context window is {self.max_context} tokens "
                f"(prompt plus at least one generated token must fit); shorten the prompt")

    def start(self, requests: Sequence[TokenRequest]) -> _ReferenceRun:
        if not requests:
            raise ValueError("no requests")
        for r in requests:
            self.check_prompt(len(r.prompt_ids))
            bad = [t for t in r.prompt_ids if not 0 <= t < self.config.vocab_size]
            if bad:
                raise ValueError(f"prompt token ids out of range 0..{self.config.vocab_size - 1}: {bad[:5]}")
        return _ReferenceRun(self, list(requests))


class _SeqState:
    def __init__(self, request: TokenRequest, pages: SequencePages, max_context: int):
        self.request = request
        self.pages = pages
        self.sampler = Sampler(request.params)
        self.prefilled = 0
        self.generated: list[int] = []
        self.pending: int | None = None  # sampled token not yet fed to the model
        self.budget = min(request.params.max_tokens, max_context - len(request.prompt_ids))
        self.done = False


class _ReferenceRun:
    def __init__(self, backend: ReferenceBackend, requests: list[TokenRequest]):
        self.backend = backend
        spec_tokens = sum(-(-min(len(r.prompt_ids) + r.params.max_tokens, backend.max_context)
                            // backend.block_size) for r in requests)
        cfg = backend.config
        self.cache = PagedKVCache(KVCacheSpec(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                                              num_blocks=spec_tokens, block_size=backend.block_size,
                                              dtype=backend.kv_dtype), device=backend.model.device)
        self.seqs = [_SeqState(r, self.cache.new_sequence(), backend.max_context) for r in requests]

    def finish(self, index: int) -> None:
        s = self.seqs[index]
        if not s.done:
            s.done = True
            s.pages.release()

    def __iter__(self) -> Iterator[list[TokenEvent | ErrorEvent]]:
        chunk = self.backend.prefill_chunk
        while True:
            active = [i for i, s in enumerate(self.seqs) if not s.done]
            if not active:
                return
            tokens: list[int] = []
            qlens: list[int] = []
            for i in active:
                s = self.seqs[i]
                prompt = s.request.prompt_ids
                if s.prefilled < len(prompt):
                    part = prompt[s.prefilled: s.prefilled + chunk]
                    s.prefilled += len(part)
                    tokens.extend(part)
                    qlens.append(len(part))
                else:
                    tokens.append(s.pending)
                    qlens.append(1)
            meta = build_step_metadata([self.seqs[i].pages for i in active], qlens, self.cache.device)
            logits = self.backend.model.forward(torch.tensor(tokens, dtype=torch.int64), meta, self.cache)
            events: list[TokenEvent | ErrorEvent] = []
            finite = torch.isfinite(logits).all(dim=-1).tolist()
            for row, i in enumerate(active):
                s = self.seqs[i]
                if s.prefilled < len(s.request.prompt_ids):
                    continue  # mid-prefill: no token yet
                if not finite[row]:
                    events.append(ErrorEvent(i, len(s.generated), nonfinite_logits_message(len(s.generated))))
                    self.finish(i)
                    continue
                tok = s.sampler(logits[row])
                s.generated.append(tok)
                s.pending = tok
                reason = None
                if tok in s.request.eos_ids:
                    reason = FINISH_EOS
                elif len(s.generated) >= s.budget:
                    hit_limit = len(s.generated) >= s.request.params.max_tokens
                    reason = FINISH_LENGTH if hit_limit else FINISH_CONTEXT
                events.append(TokenEvent(i, tok, len(s.generated) - 1, finish_reason=reason))
                if reason is not None:
                    self.finish(i)
            if events:
                yield events
