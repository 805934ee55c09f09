"""The backend seam's types: the `Backend` protocol, its request and errors, and device resolution.

A backend turns token requests into a stream of token events (backend.py has the picture). These types
live apart from the backends so that the engines and the adapter that runs them (engine_run.py) can
name them without importing a backend; `nanoqwen_runtime.backend` re-exports all of them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
from nanoqwen_model import Qwen2Config

from .events import ErrorEvent, TokenEvent
from .sampling import SamplingParams

__all__ = ["Backend", "BackendRun", "BackendError", "ContextLengthError", "TokenRequest", "resolve_device"]


class BackendError(RuntimeError):
    """A backend cannot run as asked (for example `--device cuda` without a GPU)."""


class ContextLengthError(ValueError):
    """A prompt does not fit in the model's context window."""


@dataclass(frozen=True)
class TokenRequest:
    """Prompt token ids, sampling settings, and the ids that end the request (empty: none do)."""

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
