"""The `autocomplete` workload on the synthetic Qwen2.5-Coder-7B (random well-scaled INT4 weights built on
the GPU, the 7B's exact geometry; ../shared/TEST-MODELS.md) with the tokenizer of a real container.

Latency does not depend on weight values, so this measures the issue's goal on the 7B shape: p50 time
to last token <= 120 ms for 32 generated tokens with a warm cache. Random weights rarely sample an end
token, so requests run to `--max-tokens`. The real 1.5B runs through the CLI instead:
`nanoqwen-cli bench --model coder-1.5b.nanoqwen --workload autocomplete --max-tokens 32`.

    python -m nanoqwen_bench.engine.autocomplete_synthetic --tokenizer-from coder.nanoqwen|tokenizer.json
        [--max-tokens 32]
        [--requests 32] [--kv-memory 16GiB] [--cache-reuse N] [--out bench/out/autocomplete-7b]

`--cache-reuse N`: the engine's shifted reuse of cached K/V (EngineConfig.cache_reuse, serve's
--cache-reuse; 0, the default, is exact prefix caching only).
"""

from __future__ import annotations

import argparse
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer-from", type=Path, required=True,
                    help="a Qwen2.5-Coder .nanoqwen container, or its tokenizer.json")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--kv-memory", default="16GiB")
    ap.add_argument("--cache-reuse", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("bench/out/autocomplete-7b"))
    a = ap.parse_args(argv)

    from nanoqwen_model.config import QWEN25_CODER_7B
    from nanoqwen_runtime.engine import Engine, EngineConfig
    from nanoqwen_runtime.engine.config import parse_bytes
    from nanoqwen_runtime.engine.synthetic import random_weights

    from nanoqwen_bench.engine.bench import tokenizer_from
    from nanoqwen_bench.engine.bench_autocomplete import run_autocomplete

    tok = tokenizer_from(a.tokenizer_from)
    weights = random_weights(QWEN25_CODER_7B, "cuda", seed=0)
    engine = Engine(QWEN25_CODER_7B, weights, EngineConfig(kv_memory_bytes=parse_bytes(a.kv_memory),
                                                           cache_reuse=a.cache_reuse))
    rep = run_autocomplete(engine, tok, a.out, n_requests=a.requests, max_tokens=a.max_tokens,
                           model="synthetic Qwen2.5-Coder-7B (random INT4 weights)")
    print((a.out / "autocomplete.md").read_text())
    s = rep["summary"]
    print(f"goal: warm p50 time to last token {s['ttlt_completed']['p50_ms']} ms (<= 120 ms for 32 tokens), "
          f"cache share {s['cache_share_warm']} (>= 0.90)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
