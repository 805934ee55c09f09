"""Where a prefill step's wall time goes: the GPU's kernels against the step's wall time.

    python -m nanoqwen_bench.engine.bench_prefill [--model PATH] --out DIR [--tokens 512,4096] [--reps 3]

A prefill step runs eagerly (only decode steps are captured in graphs), so its launches cost the host
time. Per prompt length: the median wall time of `reps` prefill steps of fresh random prompts (no
prefix-cache hit, as `nanoqwen-cli bench`'s prefill rows), then one more step under torch.profiler:

- `kernel_ms`: the sum of its kernels' times; `busy_ms`: the union of their intervals (the time the GPU
  ran anything); `span_ms`: first kernel start to last kernel end;
- `idle_ms` = wall - busy: the time the step's GPU work waited on the host (launches, planning, the
  uploads and the read-back), the part a graph or a cheaper launch path could remove;
- `enqueue_ms`: the host's time inside `ModelRunner.queue_forward` (every launch of the forward queued,
  median of the timed steps): near the wall time, the step is host-bound;
- `launches` and the kernels that took the most time (name, calls, total ms).

Writes DIR/prefill_breakdown.json. No model given: the synthetic Qwen2.5-Coder-7B geometry (random INT4
weights), as `nanoqwen-cli bench`.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import time
from pathlib import Path

import torch
from nanoqwen_runtime.engine.config import EngineConfig
from nanoqwen_runtime.engine.engine import Engine
from nanoqwen_runtime.engine.scheduler import Request
from nanoqwen_runtime.sampling import SamplingParams

from ..files import write_atomic
from .bench import _prompt, _run, engine_of

__all__ = ["busy_union", "prefill_breakdown", "main"]

TOP_KERNELS = 12


def busy_union(spans: list[tuple[float, float]]) -> float:
    """Length of the union of the intervals [start, end) in `spans` (any order, any overlap)."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted(spans):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def _prefill_step_s(engine: Engine, n: int, seed: int, rid: str) -> tuple[float, float]:
    """(wall time of the prefill steps, host time spent queueing their forwards) of one n-token request."""
    prompt = _prompt(n, engine.geom.vocab_size, seed)
    req = Request(prompt, SamplingParams(max_tokens=1), rid, ignore_eos=True)
    runner, queued = engine.runner, []
    queue_forward = runner.queue_forward

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return queue_forward(*args, **kwargs)
        finally:
            queued.append(time.perf_counter() - t0)

    runner.queue_forward = timed
    try:
        _, log = _run(engine, [req])
    finally:
        del runner.queue_forward  # the class's method again
    return sum(dt for kind, _, dt in log if kind == "prefill"), sum(queued)


def prefill_breakdown(engine: Engine, n: int, *, reps: int = 3, seed: int = 7) -> dict:
    """One prompt length's breakdown (module docstring); the engine must be idle, its KV pool room for n."""
    _prefill_step_s(engine, n, seed - 1, f"warm{n}")  # first use of this length's plans
    timed = [_prefill_step_s(engine, n, seed + 1000 * r, f"p{n}-{r}") for r in range(reps)]
    walls = [w for w, _ in timed]
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        profiled_wall, _ = _prefill_step_s(engine, n, seed + 1000 * reps, f"prof{n}")
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if not kernels:
        raise RuntimeError("torch.profiler recorded no kernel of the prefill step")
    spans = [(e.time_range.start, e.time_range.end) for e in kernels]
    per_name: dict[str, list[float]] = collections.defaultdict(list)
    for e in kernels:
        per_name[e.name].append(e.time_range.elapsed_us())
    top = sorted(per_name.items(), key=lambda kv: -sum(kv[1]))[:TOP_KERNELS]
    wall_ms = 1e3 * statistics.median(walls)
    busy_ms = busy_union(spans) / 1e3
    return {"tokens": n, "reps": reps, "wall_ms": wall_ms, "wall_ms_all": [1e3 * w for w in walls],
            "profiled_wall_ms": 1e3 * profiled_wall, "launches": len(kernels),
            "kernel_ms": sum(e.time_range.elapsed_us() for e in kernels) / 1e3, "busy_ms": busy_ms,
            "span_ms": (max(s[1] for s in spans) - min(s[0] for s in spans)) / 1e3,
            "idle_ms": wall_ms - busy_ms, "prefill_tok_s": n / (wall_ms / 1e3),
            "enqueue_ms": 1e3 * statistics.median(q for _, q in timed),
            "top_kernels": [{"name": k, "calls": len(v), "total_ms": sum(v) / 1e3} for k, v in top]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a .nanoqwen container (default: synthetic 7B geometry)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokens", default="512,4096", help="prompt lengths, comma-separated")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    lengths = [int(t) for t in args.tokens.split(",")]
    cfg = EngineConfig(kv_memory_bytes=8 << 30, max_model_len=max(8192, max(lengths) + 1),
                       prefix_caching=False, speculation=None)
    engine, model = engine_of(args.model, cfg)
    rows = [prefill_breakdown(engine, n, reps=args.reps) for n in lengths]
    out = {"device": torch.cuda.get_device_name(), "model": model, "prefill_chunk": cfg.prefill_chunk,
           "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out / "prefill_breakdown.json", json.dumps(out, indent=2) + "\n")
    for r in rows:
        print(f"prefill {r['tokens']}: step {r['wall_ms']:.2f} ms ({r['prefill_tok_s']:.0f} tok/s); GPU busy "
              f"{r['busy_ms']:.2f} ms ({r['launches']} kernels, {r['kernel_ms']:.2f} ms summed), idle "
              f"{r['idle_ms']:.2f} ms; host queueing the forward {r['enqueue_ms']:.2f} ms")
        for k in r["top_kernels"]:
            print(f"    {k['total_ms']:8.3f} ms  {k['calls']:4d} x  {k['name'][:90]}")


if __name__ == "__main__":
    main()
