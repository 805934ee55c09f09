"""A/B of the engine's per-step host and GPU cost with and without the logits-range flag (issue 17),
in one process on one synthetic 7B engine per arm, arms alternated twice, on an otherwise idle GPU.

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python3 bench/engine/ab_step_overhead.py OUT.json

Arm "flag": the engine as shipped. Arm "no flag": `KernelOps.logits_range` replaced by a no-op
before the engine is built (so its graphs capture no reduction and every row reads back as finite).
Reported per arm: batch-1 engine and graph-replay tok/s at context 128, batch-64 engine tok/s and
prefill tok/s at 512 tokens (the bench's own functions)."""

from __future__ import annotations

import json
import statistics
import sys

import torch
from nanoqwen_model import QWEN25_CODER_7B
from nanoqwen_runtime.engine import Engine, EngineConfig, ops_kernels
from nanoqwen_runtime.engine.bench import decode_at_context, prefill_rate
from nanoqwen_runtime.engine.synthetic import random_weights


def measure(weights) -> dict:
    engine = Engine(QWEN25_CODER_7B, weights, EngineConfig(kv_memory_bytes=8 << 30, max_model_len=8192))
    b1 = decode_at_context(engine, 128, 128)
    b64 = decode_at_context(engine, 128, 64, batch=64, seed=100)
    pre = [prefill_rate(engine, 512, seed=s)["prefill_tok_s"] for s in range(5)]
    del engine
    torch.cuda.empty_cache()
    return {"b1_engine_tok_s": b1["engine_tok_s"], "b1_graph_tok_s": b1["graph_tok_s"],
            "b64_engine_tok_s": b64["engine_tok_s"], "prefill512_tok_s": statistics.median(pre)}


def main() -> None:
    weights = random_weights(QWEN25_CODER_7B, "cuda", seed=0)
    real = ops_kernels.KernelOps.logits_range
    results = {"flag": [], "no flag": []}
    for arm in ("flag", "no flag", "flag", "no flag"):
        ops_kernels.KernelOps.logits_range = real if arm == "flag" else (lambda self, logits, lo, hi: None)
        results[arm].append(measure(weights))
        print(arm, results[arm][-1], flush=True)
    ops_kernels.KernelOps.logits_range = real
    with open(sys.argv[1], "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "runs": results}, f, indent=1)


if __name__ == "__main__":
    main()
