"""What the token mask of constrained decoding costs on the GPU (the mask's step cost at batch 1 and
64): two measurements, for the bench to run as a section of its own.

- `token_mask_op_us`: the mask op alone (`token_mask.apply_token_bitmask_` on the engine's bf16 logits
  view [B, V] of a [B, Vp] buffer), captured in a CUDA graph as the engine's step captures it and
  replayed `iters` times between CUDA events: microseconds per step, with an all-ones mask (every
  unconstrained step pays this) and a random mask (a batch of constrained rows; the op's work is the
  same, the numbers should agree).
- `token_mask_ab`: decode tok/s of a graph-mode engine with `EngineConfig.token_mask` on (a: the mask
  is part of every captured step, all ones here) against off (b), same weights, features off
  (`bench.ab_decode`: engine tok/s and each side's graph replay, in alternating repeats).
- `constrained_neighbours`: what one constrained row costs the rows beside it (it needs a tokenizer):
  the engine's wall time per decode step of a full batch, all rows free (a) against one row under a
  grammar (b, overlapped as the engine runs it) and (c, the same with overlap off: what running such
  steps synchronously would cost), beside the host time llguidance took per mask
  (`EngineBase.mask_seconds`). The goal: b - a no more than the mask's own cost.

    python -m nanoqwen_bench.engine.bench_mask --tokenizer-from tokenizer.json --out DIR

writes DIR/mask_cost.json (synthetic Qwen2.5-Coder-7B geometry, random INT4 weights).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from nanoqwen_model import Qwen2Config
from nanoqwen_runtime.token_mask import apply_token_bitmask_, bit_values, bitmask_words

from ..files import write_atomic
from .bench import AB_REPS, _ab_engine, _prompt, _run, ab_decode, tokenizer_from

__all__ = ["token_mask_op_us", "token_mask_ab", "constrained_neighbours", "MASK_BATCHES", "main"]

MASK_BATCHES = (1, 64)
# The grammar of the constrained row: letters and spaces, then a rare terminator, so that random
# weights keep the row running (and its mask non-trivial: most of the vocabulary is forbidden).
NEIGHBOUR_GRAMMAR = 'start: /[a-z ]+/ "@@@"'


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
    same weights, features off: `bench.ab_decode` rows per batch size (engine tok/s of each side, its
    graph replay, the rank-test verdict)."""
    reps = AB_REPS if reps is None else reps
    on = _ab_engine(geom, weights, prefix_caching=False, speculation=None, token_mask=True)
    off = _ab_engine(geom, weights, prefix_caching=False, speculation=None, token_mask=False)
    rows = ab_decode(on, off, batches=batches, reps=reps)
    del on, off
    torch.cuda.empty_cache()
    return {"rows": rows, "reps": reps, "a": "token_mask on", "b": "token_mask off"}


def constrained_neighbours(engine, *, batch: int = 64, new: int = 64, reps: int = 3,
                           seed: int = 400_000) -> dict:
    """Median wall ms per decode step of `batch` rows (steps where every row emitted a token: the
    constrained row still running), all free (a) against one row under NEIGHBOUR_GRAMMAR (b), then
    (c) b with overlap off; alternating a, b, c over `reps` repeats. `engine`: graph mode, with a
    tokenizer, prefix caching off. Also the host ms per mask (llguidance) and the steps b ran ahead
    with masks taken after their forward."""
    from nanoqwen_runtime.engine.scheduler import Request
    from nanoqwen_runtime.grammar import lark_grammar
    from nanoqwen_runtime.sampling import SamplingParams

    grammar = lark_grammar(NEIGHBOUR_GRAMMAR)
    vocab = engine.geom.vocab_size
    steps: dict[str, list[float]] = {"a": [], "b": [], "c": []}
    full_steps = {"a": 0, "b": 0, "c": 0}
    mask_s = masks = ahead_masked = 0
    for rep in range(reps):
        for side in "abc":
            # detokenize=False: random weights sample ids past the tokenizer's vocabulary (the model's
            # padded rows), which have no text
            reqs = [Request(_prompt(128, vocab, seed + 1000 * rep + i), SamplingParams(max_tokens=new),
                            f"n{rep}{side}-{i}", ignore_eos=True, detokenize=False) for i in range(batch)]
            if side != "a":
                reqs[0] = Request(reqs[0].prompt_tokens, SamplingParams(max_tokens=new), reqs[0].request_id,
                                  detokenize=False, grammar=grammar)
            engine.config.overlap = side != "c"
            m0, n0, k0 = engine.mask_seconds, engine.num_masked_rows, engine.num_steps_ahead_masked
            _, log = _run(engine, reqs)
            full = [dt for k, r, dt in log if k == "decode" and r == batch][2:]
            steps[side].append(statistics.median(full) * 1e3)
            full_steps[side] += len(full)
            if side == "b":
                mask_s += engine.mask_seconds - m0
                masks += engine.num_masked_rows - n0
                ahead_masked += engine.num_steps_ahead_masked - k0
    engine.config.overlap = True
    a, b, c = (statistics.median(steps[k]) for k in "abc")
    host_mask_ms = 1e3 * mask_s / max(masks, 1)
    return {"batch": batch, "grammar": NEIGHBOUR_GRAMMAR, "step_ms_free": a, "step_ms_constrained": b,
            "step_ms_constrained_sync": c, "cost_ms": b - a, "cost_ms_sync": c - a,
            "host_mask_ms": host_mask_ms, "steps_ahead_masked": ahead_masked, "full_steps": full_steps,
            "all_ms": steps}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer-from", type=Path, required=True,
                    help="a Qwen2.5-Coder .nanoqwen container, or its tokenizer.json")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    from nanoqwen_model import QWEN25_CODER_7B
    from nanoqwen_runtime.engine import Engine, EngineConfig
    from nanoqwen_runtime.engine.synthetic import random_weights

    tok = tokenizer_from(args.tokenizer_from)
    geom = QWEN25_CODER_7B
    weights = random_weights(geom, torch.device("cuda"), seed=0, symmetric=False)
    args.out.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after every section: a later failure keeps what was measured
        write_atomic(args.out / "mask_cost.json", json.dumps(out, indent=2, default=str) + "\n")

    out = {"device": torch.cuda.get_device_name(), "model": "synthetic Qwen2.5-Coder-7B geometry",
           "op_us": token_mask_op_us(geom)}
    save()
    engine = Engine(geom, weights, EngineConfig(kv_memory_bytes=8 << 30, max_model_len=4096,
                                                prefix_caching=False, speculation=None), tokenizer=tok)
    out["neighbours"] = [constrained_neighbours(engine, batch=b, reps=args.reps) for b in (8, 64)]
    save()
    del engine
    out["mask_in_step_ab"] = token_mask_ab(geom, weights)
    save()
    for r in out["op_us"]:
        print(f"mask op alone, batch {r['batch']}: {r['all_ones_us']:.1f} us (all ones), "
              f"{r['random_us']:.1f} us (random)")
    for r in out["neighbours"]:
        print(f"batch {r['batch']}: step {r['step_ms_free']:.3f} ms free, {r['step_ms_constrained']:.3f} ms "
              f"with one constrained row (+{r['cost_ms']:.3f}; synchronous +{r['cost_ms_sync']:.3f}); "
              f"host mask {r['host_mask_ms']:.3f} ms; {r['steps_ahead_masked']} steps masked ahead")
    for r in out["mask_in_step_ab"]["rows"]:
        print(f"batch {r['batch']}: mask in every step {r['a_tok_s']:.0f} tok/s, without {r['b_tok_s']:.0f} "
              f"(x{r['a_over_b']:.3f}; slower by the rank test: {r['a_slower']})")


if __name__ == "__main__":
    main()
