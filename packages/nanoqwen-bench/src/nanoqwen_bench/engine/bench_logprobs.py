"""What logprobs cost on the GPU: the decode step with and without them, batch 1 and 64.

    python -m nanoqwen_bench.engine.bench_logprobs [--model PATH] --out DIR [--reps 4] [--new 128]

One engine (graph mode, overlapped decode, prefix caching and speculation off: what is measured is
the step, not what the features do), the same random prompts of 128 tokens for both sides, decoded
alternately with `logprobs` = MAX_TOP_LOGPROBS (the most a request can ask: the sampled token and 20
alternatives, every row asking) and without (a, b, then b, a, ...):

- `step_ms`: the engine's wall time per decode step (= batch / engine tok/s), medians over the repeats;
  the difference is what a client pays per token for asking;
- `op_ms`: the GPU time of the logprob work alone at that batch (log-softmax over the vocabulary in
  fp32, gather, top-20, the copy to the host; CUDA events around `logprobs.row_logprobs` on the step's
  own logits), median of 50 calls;
- `graph_ms`: one replay of the decode graph (the step's device time without logprobs), for scale.

The logprob work runs after the graph replay, outside it (ModelRunner._logprobs), and only in steps
where a row asked: without logprobs a step launches nothing more than before.

Writes DIR/logprobs_cost.json. No model given: the synthetic Qwen2.5-Coder-7B geometry (random INT4
weights), as `nanoqwen-cli bench`.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from nanoqwen_runtime.engine.config import EngineConfig
from nanoqwen_runtime.engine.engine import Engine
from nanoqwen_runtime.engine.scheduler import Request
from nanoqwen_runtime.logprobs import MAX_TOP_LOGPROBS, row_logprobs
from nanoqwen_runtime.sampling import SamplingParams

from ..files import write_atomic
from .bench import _decode_rate, _prompt, _run, engine_of, replay_time

__all__ = ["logprobs_cost", "main"]

BATCHES = (1, 64)


def _decode(engine: Engine, batch: int, new: int, seed: int, logprobs: int | None) -> float:
    """Engine decode tok/s of `batch` fresh 128-token prompts, `new` tokens each."""
    vocab = engine.geom.vocab_size
    reqs = [Request(_prompt(128, vocab, seed + i), SamplingParams(max_tokens=new), f"lp{seed}-{i}",
                    ignore_eos=True, logprobs=logprobs) for i in range(batch)]
    _, log = _run(engine, reqs)
    return _decode_rate(log)


def _op_seconds(engine: Engine, batch: int, reps: int = 50) -> float:
    """Median GPU seconds of the logprob work of a step of `batch` rows (on the workspace's logits)."""
    from nanoqwen_bench.gpu import event_seconds

    ws, v = engine.runner.ws, engine.geom.vocab_size
    host = torch.empty(batch * (1 + 2 * MAX_TOP_LOGPROBS), dtype=torch.float32, pin_memory=True)

    def op() -> None:
        packed = row_logprobs(ws.logits[:batch], ws.tokens[:batch], MAX_TOP_LOGPROBS, v)
        host[:packed.numel()].view(packed.shape).copy_(packed, non_blocking=True)

    return statistics.median(event_seconds(op, reps))


def logprobs_cost(engine: Engine, *, batches: tuple[int, ...] = BATCHES, reps: int = 4, new: int = 128,
                  seed: int = 300_000) -> list[dict]:
    """Per batch: step time with and without logprobs (medians of `reps` alternating runs), the logprob
    op's GPU time alone, and the graph replay's."""
    rows = []
    for batch in batches:
        rates: dict[str, list[float]] = {"on": [], "off": []}
        for rep in range(reps):
            for side in (("on", "off") if rep % 2 == 0 else ("off", "on")):
                rates[side].append(_decode(engine, batch, new, seed + 10_000 * rep + 100 * batch + len(side),
                                           MAX_TOP_LOGPROBS if side == "on" else None))
        on, off = (statistics.median(rates[k]) for k in ("on", "off"))
        graph_s = replay_time(engine, engine.config.bucket_for(batch), 128 + new - 1)
        rows.append({"batch": batch, "step_ms_on": 1e3 * batch / on, "step_ms_off": 1e3 * batch / off,
                     "step_cost_ms": 1e3 * batch * (1 / on - 1 / off), "tok_s_on": on, "tok_s_off": off,
                     "on_all": rates["on"], "off_all": rates["off"],
                     "on_slower": max(rates["on"]) < min(rates["off"]),
                     "op_ms": 1e3 * _op_seconds(engine, batch), "graph_ms": 1e3 * graph_s})
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="a .nanoqwen container (default: synthetic 7B geometry)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--new", type=int, default=128)
    args = ap.parse_args(argv)
    cfg = EngineConfig(kv_memory_bytes=8 << 30, max_model_len=4096, max_batch=max(BATCHES),
                       prefix_caching=False, speculation=None)
    engine, model = engine_of(args.model, cfg)
    rows = logprobs_cost(engine, reps=args.reps, new=args.new)
    out = {"device": torch.cuda.get_device_name(), "model": model, "top_logprobs": MAX_TOP_LOGPROBS,
           "context": 128, "new_tokens": args.new, "reps": args.reps, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out / "logprobs_cost.json", json.dumps(out, indent=2) + "\n")
    for r in rows:
        print(f"batch {r['batch']}: step {r['step_ms_off']:.3f} ms -> {r['step_ms_on']:.3f} ms with "
              f"logprobs (+{r['step_cost_ms']:.3f} ms; the op alone {r['op_ms']:.3f} ms GPU; graph "
              f"{r['graph_ms']:.3f} ms)")


if __name__ == "__main__":
    main()
