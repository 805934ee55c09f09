"""GPU sampling launcher (csrc/sampling.cu): greedy, temperature, top-k, top-p, one launch per step.

Each row is read by up to MAX_CHUNKS blocks at once for its maximum (the greedy answer, and the
first pass of sampling); the last block of a row to finish takes it from there (csrc/sampling.cuh).

Per-sequence parameters live in device buffers (a `SamplingState`), so a captured CUDA graph reads
whatever the host last wrote into them, and each launch increments every row's Philox `offsets`
entry: a replayed graph draws fresh numbers, and (seed, offset) reproduces a draw exactly.

    temperature <= 0 -> argmax (lowest index among ties)
    top_k = 0 -> off;  top_p >= 1 -> off;  applied in HF's order: temperature, top-k, top-p
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from .launch import check, i32, launch, ptr, require_sm90

FAMILY = "sampling"
THREADS = 1024
MAX_CHUNKS = 32  # csrc/sampling.cuh MAX_CHUNKS: blocks per row


def chunks_per_row(vocab: int) -> int:
    """Blocks per row: about one 16-byte load per thread (19 at V = 152064), at most MAX_CHUNKS."""
    return max(1, min(MAX_CHUNKS, -(-(vocab // 8) // THREADS)))


@dataclasses.dataclass
class SamplingState:
    """Device buffers for up to `max_batch` rows: fp32 temperature, int32 top_k, fp32 top_p,
    int64 seed and int64 offset (the Philox counter, advanced by each launch); and the kernel's own
    scratch, made here: the chunk maxima (int64 [max_batch, MAX_CHUNKS]) and the rows' arrival
    counters (int32 [max_batch], zero between launches). One state serves one stream at a time."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seeds: torch.Tensor
    offsets: torch.Tensor
    partials: torch.Tensor = dataclasses.field(init=False, repr=False)
    counters: torch.Tensor = dataclasses.field(init=False, repr=False)

    def __post_init__(self) -> None:
        rows, dev = self.temperature.numel(), self.temperature.device
        self.partials = torch.zeros(rows, MAX_CHUNKS, dtype=torch.int64, device=dev)
        self.counters = torch.zeros(rows, dtype=torch.int32, device=dev)

    @classmethod
    def allocate(cls, max_batch: int, device) -> SamplingState:
        return cls(
            torch.zeros(max_batch, dtype=torch.float32, device=device),
            torch.zeros(max_batch, dtype=torch.int32, device=device),
            torch.ones(max_batch, dtype=torch.float32, device=device),
            torch.zeros(max_batch, dtype=torch.int64, device=device),
            torch.zeros(max_batch, dtype=torch.int64, device=device),
        )

    def set_row(self, row: int, temperature: float, top_k: int, top_p: float, seed: int) -> None:
        """Host-side setup of one row (copies to the device; not for use inside graph capture)."""
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        if top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")
        self.temperature[row] = temperature
        self.top_k[row] = top_k
        self.top_p[row] = top_p
        self.seeds[row] = seed
        self.offsets[row] = 0


def sample_tokens(logits: torch.Tensor, state: SamplingState, out: torch.Tensor) -> torch.Tensor:
    """out[B] (int32) = one token per row of logits (bf16 [B, V], V % 8 == 0, rows may be strided by a
    multiple of 8 elements). Advances state.offsets[:B] by one."""
    dev = logits.device
    index = require_sm90(dev)
    check(logits, "logits", torch.bfloat16, (None, None), dev, contiguous=False, align=2)
    b, v = logits.shape
    if logits.stride(1) != 1:
        raise ValueError("logits: the vocabulary dimension must be contiguous")
    if v % 8 or logits.stride(0) % 8 or logits.data_ptr() % 16:
        raise ValueError(
            f"logits: V ({v}) and the row stride ({logits.stride(0)}) must be multiples of 8 and rows "
            "16-byte aligned (pad the vocabulary)"
        )
    if b > state.temperature.numel():
        raise ValueError(f"batch {b} exceeds the SamplingState's {state.temperature.numel()} rows")
    check(out, "out", torch.int32, (b,), dev, align=4)
    for name in ("temperature", "top_k", "top_p", "seeds", "offsets", "partials", "counters"):
        t = getattr(state, name)
        if t.device != dev:
            raise ValueError(f"SamplingState.{name} is on {t.device}, logits on {dev}")
    if b:
        args = (ptr(logits), np.int64(logits.stride(0)), i32(v), ptr(state.temperature), ptr(state.top_k),
                ptr(state.top_p), ptr(state.seeds), ptr(state.offsets), ptr(out), ptr(state.partials),
                ptr(state.counters))  # fmt: skip
        launch(FAMILY, "sample_tokens_bf16", index, (b, chunks_per_row(v), 1), (THREADS, 1, 1), args)
    return out
