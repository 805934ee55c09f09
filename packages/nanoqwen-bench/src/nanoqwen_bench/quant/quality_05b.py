"""Quality table of the README: perplexity of bf16 / RTN-g128 / GPTQ-g128 (and lm_head variants) of the
real Qwen2.5-Coder-0.5B-Instruct on held-out stdlib code, through the `nanoqwen-quant` CLI.

    python -m nanoqwen_bench.quant.quality_05b [--workdir /tmp/nanoqwen-quality] [--eval-tokens 8192]
        [--calib-tokens 16384] [--lm-head-variants]

Steps (each skipped when its output already exists in --workdir, so an interrupted run continues):
  nanoqwen-quant heldout -o WORK/heldout.py --chars 200000        (stdlib "heldout" split)
  nanoqwen-quant pack GGUF -o WORK/<name>.nanoqwen --method none|rtn|gptq [...]
  nanoqwen-quant eval WORK/<name>.nanoqwen --text WORK/heldout.py --max-tokens N --json > WORK/<name>.json
and prints a markdown table (perplexity, delta vs bf16, file size, pack time).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

GGUF = Path.home() / ".cache" / "nanoqwen" / "qwen2.5-coder-0.5b-instruct.gguf"


def variants(calib_tokens: int, lm_head: bool) -> dict[str, list[str]]:
    v = {
        "bf16": ["--method", "none"],
        "rtn-g128": ["--method", "rtn"],
        "gptq-g128": ["--method", "gptq", "--calib-tokens", str(calib_tokens)],
    }
    if lm_head:
        v |= {"rtn-g128-lmhead-int8": ["--method", "rtn", "--lm-head", "int8"],
              "rtn-g128-lmhead-int4": ["--method", "rtn", "--lm-head", "int4"]}
    return v


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", type=Path, default=GGUF)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/nanoqwen-quality"))
    ap.add_argument("--eval-tokens", type=int, default=8192)
    ap.add_argument("--calib-tokens", type=int, default=16384)
    ap.add_argument("--lm-head-variants", action="store_true")
    a = ap.parse_args()
    a.workdir.mkdir(parents=True, exist_ok=True)
    cli = [sys.executable, "-m", "nanoqwen_quant.cli"]
    text = a.workdir / "heldout.py"
    if not text.exists():
        subprocess.run([*cli, "heldout", "-o", str(text), "--chars", "200000"], check=True)
    rows = []
    for name, args in variants(a.calib_tokens, a.lm_head_variants).items():
        model = a.workdir / f"{name}.nanoqwen"
        timing = a.workdir / f"{name}.pack.json"
        if not model.exists():
            t0 = time.perf_counter()
            subprocess.run([*cli, "pack", str(a.gguf), "-o", str(model), *args], check=True)
            timing.write_text(json.dumps({"pack_s": time.perf_counter() - t0, "args": args}))
        res = a.workdir / f"{name}.json"
        if not res.exists():
            out = subprocess.run([*cli, "eval", str(model), "--text", str(text), "--max-tokens",
                                  str(a.eval_tokens), "--json"], check=True, capture_output=True, text=True)
            res.write_text(out.stdout.strip().splitlines()[-1])
        r = json.loads(res.read_text())
        pack_s = json.loads(timing.read_text())["pack_s"] if timing.exists() else float("nan")
        rows.append((name, r["perplexity"], r["tokens"], model.stat().st_size, pack_s))
    base = rows[0][1]
    print("| model | perplexity | vs bf16 | file | pack time |\n|---|---|---|---|---|")
    for name, ppl, _tok, size, pack_s in rows:
        delta = 100 * (ppl / base - 1)
        print(f"| {name} | {ppl:.4f} | {delta:+.2f}% | {size / 1e6:.0f} MB | {pack_s:.0f} s |")
    print(f"\n{rows[0][2]} tokens of held-out stdlib code ({text}), windows of 1024 tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
