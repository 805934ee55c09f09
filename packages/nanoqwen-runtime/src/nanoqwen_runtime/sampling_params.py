"""`SamplingParams`, validated at construction, and `SamplingError`: torch-free, so that a command
line can be checked before torch (or anything else heavy) is imported. sampling.py re-exports both."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

__all__ = ["SamplingParams", "SamplingError"]


class SamplingError(ValueError):
    """An invalid sampling parameter."""


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature: >= 0; 0 is greedy (argmax, ties to the lowest id).
    top_k: 0 disables; otherwise keep the k most likely tokens.
    top_p: in (0, 1]; 1 disables; otherwise keep the smallest set whose probability reaches top_p.
    seed: None draws a fresh seed from the OS; an int makes sampling reproducible.
    max_tokens: generated-token limit (>= 1).
    stop: strings that end generation (not included in the output).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 256
    stop: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t < 0:
            raise SamplingError(f"temperature must be a finite number >= 0 (0 means greedy), got {t!r}")
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise SamplingError(f"top_k must be an integer >= 0 (0 disables it), got {k!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, int | float) or not (0.0 < p <= 1.0):
            raise SamplingError(f"top_p must be in (0, 1] (1 disables it), got {p!r}")
        s = self.seed
        if s is not None and (isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < 2**63):
            raise SamplingError(f"seed must be an integer in [0, 2^63), got {s!r}")
        m = self.max_tokens
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise SamplingError(f"max_tokens must be an integer >= 1, got {m!r}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        for x in stop:
            if not isinstance(x, str) or not x:
                raise SamplingError(f"stop strings must be non-empty strings, got {x!r}")
        object.__setattr__(self, "stop", stop)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def with_(self, **changes) -> SamplingParams:
        return replace(self, **changes)
