"""Sampling parameters, the token sampler and stop-string matching.

- `SamplingParams` validates everything at construction and says what is wrong
  (`temperature=-1`: "temperature must be >= 0 (0 means greedy)").
- `Sampler` picks the next token of one sequence from its logits with the repo's one sampling
  reference (`nanoqwen_model.sampling`): greedy when temperature is 0 (as llama.cpp and the OpenAI
  API), otherwise temperature, then top-k, then top-p (nucleus), then a draw from a per-sequence CPU
  `torch.Generator` seeded from `seed`, so a seeded run repeats exactly on any device.
- `StopMatcher` finds stop strings in streamed text and holds back the tail that could still become
  one, so text after (and including) a stop string is never emitted.
"""

from __future__ import annotations

import os

import torch
from nanoqwen_model.sampling import sample

from .sampling_params import SamplingError, SamplingParams

__all__ = ["SamplingParams", "Sampler", "StopMatcher", "SamplingError"]


class Sampler:
    """Next-token choice for one sequence. `logits`: float [vocab] (any device)."""

    def __init__(self, params: SamplingParams, device: torch.device | str = "cpu"):
        self.params = params
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        self.seed = seed
        # Draws happen on the CPU: the same seed gives the same tokens on every device.
        self._gen = torch.Generator(device="cpu")
        self._gen.manual_seed(seed)

    def __call__(self, logits: torch.Tensor) -> int:
        p = self.params
        if logits.dim() != 1:
            raise ValueError(f"Sampler takes logits of shape [vocab], got {tuple(logits.shape)}")
        return sample(logits, p.temperature, p.top_k, p.top_p, self._gen)


class StopMatcher:
    """Incremental stop-string search over streamed text.

    `push(text)` returns (safe_text, stopped): `safe_text` can be shown now; once a stop string is
    found, everything from its start on is dropped and `stopped` is True. `flush()` returns the held
    back tail at the end of generation.
    """

    def __init__(self, stop: tuple[str, ...]):
        self.stop = tuple(stop)
        self._pending = ""
        self.stopped = False

    def push(self, text: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self.stop:
            return text, False
        buf = self._pending + text
        first = min((i for i in (buf.find(s) for s in self.stop) if i >= 0), default=-1)
        if first >= 0:
            self._pending = ""
            self.stopped = True
            return buf[:first], True
        # hold back the longest suffix of buf that is a proper prefix of some stop string
        hold = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:n]):
                    hold = n
                    break
        self._pending = buf[len(buf) - hold:] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return "" if self.stopped else out
