"""What the token mask of constrained decoding costs on the GPU (issue 49's "the mask's step cost at
batch 1 and 64"): two measurements, for the bench to run as a section of its own.

- `token_mask_op_us`: the mask op alone (`token_mask.apply_token_bitmask_` on the engine's bf16 logits
  view [B, V] of a [B, Vp] buffer), captured in a CUDA graph as the engine's step captures it and
  replayed `iters` times between CUDA events: microseconds per step, with an all-ones mask (every
  unconstrained step pays this) and a random mask (a batch of constrained rows; the op's work is the
  same, the numbers should agree).
- `token_mask_ab`: decode tok/s of a graph-mode engine with `EngineConfig.token_mask` on (a: the mask
  is part of every captured step, all ones here) against off (b), same weights, features off
  (`bench._variants_ab`: engine tok/s and each side's graph replay).

Neither needs a tokenizer: the host-side cost of a constrained row (llguidance computing its bitmask,
~tens of microseconds per row and token for a JSON schema, and the synchronous steps such a batch runs)
comes on top; `nanoqwen-cli serve` on a real model shows it per request.

    from nanoqwen_bench.engine.bench_mask import token_mask_ab, token_mask_op_us
    op = token_mask_op_us(geom, batches=(1, 64))
    ab = token_mask_ab(geom, weights, batches=(1, 64))
"""

from __future__ import annotations

import torch
from nanoqwen_model import Qwen2Config
from nanoqwen_runtime.token_mask import apply_token_bitmask_, bit_values, bitmask_words

__all__ = ["token_mask_op_us", "token_mask_ab", "MASK_BATCHES"]

MASK_BATCHES = (1, 64)


def token_mask_op_us(geom: Qwen2Config, *, batches: tuple[int, ...] = MASK_BATCHES, iters: int = 200,
                     device: str = "cuda") -> list[dict]:
    """Per batch size: {"batch", "all_ones_us", "random_us"}: microseconds per replay of a graph holding
    the mask op alone over [batch, vocab] bf16 logits (median of 5 timed runs of `iters` replays)."""
    out = []
    V = geom.vocab_size
    vp = -(-V // 8) * 8
    bits = bit_values(device)
    for B in batches:
        logits = torch.zeros(B, vp, dtype=torch.bfloat16, device=device)
        row = {"batch": B}
        for name, mask in (("all_ones_us", torch.full((B, bitmask_words(V)), -1, dtype=torch.int32,
                                                       device=device)),
                           ("random_us", torch.randint(-2**31, 2**31 - 1, (B, bitmask_words(V)),
                                                       dtype=torch.int64, device=device).to(torch.int32))):
            view = logits[:, :V]
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                apply_token_bitmask_(view, mask, bits)  # warm-up: allocations before capture
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                apply_token_bitmask_(view, mask, bits)
            times = []
            for _ in range(5):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(iters):
                    graph.replay()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1000.0 / iters)
            row[name] = sorted(times)[len(times) // 2]
            del graph
        out.append(row)
    return out


def token_mask_ab(geom: Qwen2Config, weights, *, batches: tuple[int, ...] = MASK_BATCHES,
                  reps: int | None = None) -> dict:
    """Decode with the token mask in every captured step (a, `token_mask=True`) against without it (b),
    `bench._variants_ab` (rows per batch size: engine tok/s of each side and its graph replay)."""
    from .bench import AB_REPS, _variants_ab

    return _variants_ab(geom, weights, "token_mask", False, (True,), batches=batches,
                        reps=AB_REPS if reps is None else reps)
