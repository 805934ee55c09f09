"""The quality table: every INT4 recipe of `nanoqwen-quant pack` on a real model, evaluated against `none`.

    python -m nanoqwen_bench.quality.run_quality --gguf 0.5b=PATH [--gguf 1.5b=PATH] --out DIR [--device cuda]
        [--recipes none,rtn,...] [--eval-tokens 8192] [--seq-len 1024] [--calib-tokens 65536]

For each model: the GGUF is read once into memory (its dequantization is a fixed cost of every pack,
timed once as `source_read_s`), then every recipe is packed in-process with `nanoqwen_quant.pack.pack`
on `--device`, evaluated with `nanoqwen_quant.evaluate` on the held-out stdlib split (disjoint from the
calibration split: calib.py) against the `none` pack's scores on the same tokens, and deleted unless
`--keep`. Rows (one per model x recipe) go to OUT/quality.json and OUT/quality.md as they finish, so an
interrupted run keeps what it measured; a row already in OUT/quality.json is not measured again.

Columns: perplexity, its change vs none, greedy next-token agreement with none (teacher-forced top-1),
pack seconds (quantization only; add source_read_s for a pack from the file), bits per weight of the
quantized linears (their container bytes x 8 / their weights: codes, scales, zeros and padding).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import nanoqwen_format as nqf
import torch
from nanoqwen_quant.calib import heldout_rule, heldout_text
from nanoqwen_quant.evaluate import evaluate, score
from nanoqwen_quant.options import LINEARS, PackOptions
from nanoqwen_quant.pack import pack
from nanoqwen_quant.sources import GGUFSource, Source

# name -> PackOptions fields, symmetry always explicit (method none is the reference and comes first)
RECIPES: dict[str, dict] = {
    "none": {"method": "none"},
    "rtn": {"method": "rtn", "symmetric": True},
    "rtn-asym": {"method": "rtn", "symmetric": False},
    "rtn-g64": {"method": "rtn", "group_size": 64, "symmetric": True},
    "rtn-asym-g32": {"method": "rtn", "symmetric": False, "group_size": 32},
    "rtn-asym-g64": {"method": "rtn", "symmetric": False, "group_size": 64},
    "rtn-clip": {"method": "rtn", "clip": True, "symmetric": True},
    "awq-clip": {"method": "rtn", "awq": True, "clip": True, "symmetric": True},
    "awq-clipact": {"method": "rtn", "awq": True, "clip": True, "clip_act": True, "symmetric": True},
    "awq-clipact-asym": {"method": "rtn", "awq": True, "clip": True, "clip_act": True, "symmetric": False},
    "gptq": {"method": "gptq", "symmetric": True},
    "gptq-asym": {"method": "gptq", "symmetric": False},
    "gptq-clip": {"method": "gptq", "clip": True, "symmetric": True},
    "gptq-clipact": {"method": "gptq", "clip": True, "clip_act": True, "symmetric": True},
    "gptq-clip-asym": {"method": "gptq", "clip": True, "symmetric": False},
    "gptq-clip-g64": {"method": "gptq", "clip": True, "group_size": 64, "symmetric": True},
    "gptq-awq-clip": {"method": "gptq", "awq": True, "clip": True, "symmetric": True},
    # GPTQ calibrated on chat conversations in the model's own template (nanoqwen_quant/calib_chat.py):
    # the default recipe since 2026-12-04 (`PackOptions()`)
    "gptq-asym-chat": {"method": "gptq", "symmetric": False, "calib_text": "chat"},
}
# Every other calibrated recipe (GPTQ, AWQ) was measured on the stdlib code as it is, the only built-in
# calibration text before 2026-12-04: keep that meaning (`calib_text="code"` unless the recipe names one).
for _kw in RECIPES.values():
    if _kw["method"] == "gptq" or _kw.get("awq"):
        _kw.setdefault("calib_text", "code")


class CachedSource(Source):
    """A source whose layers are read (dequantized) once and then served from memory."""

    def __init__(self, inner: Source):
        self.inner = inner
        for a in ("spec", "config", "tokenizer_json", "chat_template", "generation"):
            setattr(self, a, getattr(inner, a))
        t0 = time.perf_counter()
        self._layers = [inner.layer(i) for i in range(inner.config.num_hidden_layers)]
        self._embed = inner.embed_tokens()
        self._final = inner.final_norm()
        self._head = inner.lm_head() if not inner.config.tie_word_embeddings else None
        self._sha = inner.source_sha256()
        inner.check_complete()
        self.read_seconds = time.perf_counter() - t0

    def layer(self, i: int) -> dict[str, torch.Tensor]:
        return dict(self._layers[i])  # a fresh dict: the writer may replace AWQ's folded norms in it

    def embed_tokens(self) -> torch.Tensor:
        return self._embed

    def final_norm(self) -> torch.Tensor:
        return self._final

    def lm_head(self) -> torch.Tensor:
        return self._embed if self._head is None else self._head

    def source_sha256(self) -> str:
        return self._sha

    def check_complete(self) -> None:
        return None

    def _has(self, hf_name: str) -> bool:
        return self.inner._has(hf_name)

    def _get(self, hf_name: str) -> torch.Tensor:
        return self.inner._get(hf_name)


def linear_bits_per_weight(path: Path) -> float:
    """Container bytes of the decoder layers' four linears x 8 / their number of weights."""
    nbytes = weights = 0
    with nqf.open(path) as f:
        for name, rec in f.records.items():
            if name.startswith("layers.") and name.rsplit(".", 1)[1] in LINEARS:
                nbytes += rec.nbytes
                n = 1
                for d in rec.shape:
                    n *= d
                weights += n
    return 8 * nbytes / weights


def markdown(rows: list[dict]) -> str:
    out = ["| model | recipe | perplexity | Δ vs none | agreement | pack s | bits/weight |",
           "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        delta = "" if r["recipe"] == "none" else f"{100 * r['ppl_delta']:+.2f}%"
        agree = "" if r["recipe"] == "none" else f"{100 * r['agreement']:.2f}%"
        out.append(f"| {r['model']} | {r['recipe']} | {r['perplexity']:.4f} | {delta} | {agree} | "
                   f"{r['pack_s']:.1f} | {r['bits_per_weight']:.3f} |")
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", action="append", required=True, help="NAME=PATH of a GGUF, repeatable")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated subset of: "
                    + ", ".join(RECIPES))
    ap.add_argument("--eval-tokens", type=int, default=8192)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--calib-tokens", type=int, default=PackOptions.calib_tokens)
    ap.add_argument("--keep", action="store_true", help="keep the packed containers in OUT")
    a = ap.parse_args()
    names = a.recipes.split(",")
    unknown = [n for n in names if n not in RECIPES]
    if unknown or names[0] != "none":
        ap.error(f"recipes must start with none and be among {list(RECIPES)}; got {names}")
    a.out.mkdir(parents=True, exist_ok=True)
    rows_path = a.out / "quality.json"
    doc = json.loads(rows_path.read_text()) if rows_path.exists() else {"rows": []}
    doc |= {"heldout": heldout_rule(), "eval_tokens": a.eval_tokens, "seq_len": a.seq_len,
            "calib_tokens": a.calib_tokens, "device": a.device, "torch": torch.__version__}
    done = {(r["model"], r["recipe"]) for r in doc["rows"]}
    text = heldout_text(a.eval_tokens * 6)  # ~3.5 characters per token of code, with margin
    for spec in a.gguf:
        model, _, path = spec.partition("=")
        print(f"[{model}] reading {path}", flush=True)
        src = CachedSource(GGUFSource(path))
        doc.setdefault("source_read_s", {})[model] = src.read_seconds
        print(f"[{model}] source read in {src.read_seconds:.1f} s", flush=True)
        ref_scores = None
        for name in names:
            if (model, name) in done and name != "none":
                continue
            out = a.out / f"{model}-{name}.nanoqwen"
            kw = dict(RECIPES[name])
            if kw["method"] == "gptq" or kw.get("awq"):
                kw["calib_tokens"] = a.calib_tokens
            opts = PackOptions(device=a.device, **kw)
            if not out.exists():
                summary = pack(src, out, opts, log=lambda m: None)
                pack_s = summary.seconds
            else:
                pack_s = float("nan")
            if name == "none":
                t0 = time.perf_counter()
                ref_scores = score(out, text, a.seq_len, a.eval_tokens, a.device)
                row = {"perplexity": ref_scores.perplexity, "ppl_delta": 0.0, "agreement": 1.0,
                       "tokens": ref_scores.tokens, "eval_s": time.perf_counter() - t0}
            else:
                r = evaluate(out, text, ref_scores, a.seq_len, a.eval_tokens, a.device)
                row = {"perplexity": r.perplexity, "ppl_delta": r.ppl_delta, "agreement": r.agreement,
                       "tokens": r.tokens, "eval_s": r.seconds}
            row = {"model": model, "recipe": name, "options": kw, "pack_s": pack_s,
                   "bits_per_weight": linear_bits_per_weight(out), "bytes": out.stat().st_size, **row}
            if not a.keep and name != "none":
                out.unlink()
            doc["rows"] = [r for r in doc["rows"] if (r["model"], r["recipe"]) != (model, name)] + [row]
            rows_path.write_text(json.dumps(doc, indent=1))
            (a.out / "quality.md").write_text(markdown(doc["rows"]))
            print(f"[{model}] {name}: ppl {row['perplexity']:.4f} ({100 * row['ppl_delta']:+.2f}%), "
                  f"agreement "
                  f"{100 * row['agreement']:.2f}%, pack {pack_s:.1f} s, eval {row['eval_s']:.1f} s, "
                  f"{row['bits_per_weight']:.3f} bits/weight", flush=True)
        if not a.keep:
            (a.out / f"{model}-none.nanoqwen").unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
