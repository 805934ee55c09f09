"""The `autocomplete` latency benchmark: what a typing user feels from editor autocomplete.

`nanoqwen-cli bench --model M --workload autocomplete` (CUDA engine), or `run_autocomplete(engine,
tokenizer, ...)` on any engine with the request API (`Engine`, `ReferenceEngine`): the cursor stops of
`nanoqwen_bench.autocomplete` (one stdlib file typed down, 1-2K tokens of prefix, ~1K of suffix, one
extra file of ~1K), each turned into the repo-level FIM prompt (`fim.fim_prompt`: the way a base model
is prompted; latency does not depend on the way) and run alone, greedy, up to `max_tokens` generated
tokens, one after the other, as a user's requests come. Every odd request is cancelled after
`cancel_after` tokens (`engine.abort`: the user typed on), as editors do.

Reported (autocomplete.json / .md):
- per request: prompt tokens, tokens served from the prefix cache (the engine's `prefix_hit_tokens`
  counter across the request, plus `prefix_reused_tokens` when the engine's `cache_reuse` is on: the
  code below the cursor copied from cached blocks at a shifted position, engine/blocks.py), TTFT
  (submit -> first token) and time to last token (submit -> the
  request's end; for a cancelled request, its abort), generated tokens, cancelled or not;
- p50 / p95 of TTFT and time-to-last-token, over the warm requests (all but the first, whose prefix
  nothing has cached yet), apart for completed and cancelled ones; the first request alone;
- the share of prompt tokens served from the cache (warm requests), and its share among the requests
  right after a cancelled one (a cancelled request's prompt blocks stay cached);
- KV blocks in use after each request (0 after every one: an aborted request frees its blocks).

The time to last token of the issue's goal (32 generated tokens) is `--max-tokens 32`.
"""

from __future__ import annotations

import datetime
import json
import platform
import time
from collections.abc import Callable
from pathlib import Path

from nanoqwen_runtime.engine.sequence import FinishReason, Request
from nanoqwen_runtime.fim import fim_prompt
from nanoqwen_runtime.sampling import SamplingParams

from ..autocomplete import AutocompleteRequest, autocomplete_requests

__all__ = ["run_autocomplete", "render_markdown", "percentile"]

Log = Callable[[str], None]


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) by linear interpolation between order statistics; None if empty."""
    if not values:
        return None
    v = sorted(values)
    pos = (len(v) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def _one(engine, ids: list[int], stop_ids, max_tokens: int, cancel_after: int | None, rid: str) -> dict:
    """Run one request alone; its timings, tokens and cache counters."""
    if engine.has_work:
        raise RuntimeError("the autocomplete bench needs an idle engine (one request at a time)")
    before = engine.stats()
    eos = frozenset(getattr(engine.geom, "eos_token_id", ()) or ()) | stop_ids
    req = Request(list(ids), SamplingParams(temperature=0.0, max_tokens=max_tokens), rid, eos_ids=eos)
    t0 = time.perf_counter()
    refused = engine.submit(req)
    if refused is not None:
        raise RuntimeError(f"autocomplete request {rid} refused: {refused.detail}")
    t_first = t_end = None
    n = 0
    reason = None
    while engine.has_work and reason is None:
        for ev in engine.step():
            if getattr(ev, "request_id", None) == rid and hasattr(ev, "reason"):  # its FinishEvent
                t_end, reason = time.perf_counter(), FinishReason(ev.reason).value
                n = ev.num_generated
            elif getattr(ev, "request", None) == rid:
                n += 1
                if t_first is None:
                    t_first = time.perf_counter()
                if cancel_after is not None and n >= cancel_after and reason is None:
                    engine.abort(rid)
                    t_end, reason = time.perf_counter(), "cancelled"
                    break
    while engine.has_work:  # nothing else runs; an abort is complete at once
        engine.step()
    if reason is None:
        raise RuntimeError(f"autocomplete request {rid} never finished")
    if reason in ("error", "refused"):
        raise RuntimeError(f"autocomplete request {rid} ended with {reason}")
    after = engine.stats()
    reused = after.prefix_reused_tokens - before.prefix_reused_tokens
    return {"prompt_tokens": len(ids),
            "cached_tokens": after.prefix_hit_tokens - before.prefix_hit_tokens + reused,
            "reused_tokens": reused,
            "queried_tokens": after.prefix_queried_tokens - before.prefix_queried_tokens,
            "generated_tokens": n, "ttft_s": (t_first - t0) if t_first else None, "ttlt_s": t_end - t0,
            "finish": reason, "kv_blocks_used_after": engine.kv_blocks_used()}


def _summary(rows: list[dict]) -> dict:
    def pct(key, sel):
        vals = [r[key] for r in sel if r[key] is not None]
        return {"p50_ms": _ms(percentile(vals, 50)), "p95_ms": _ms(percentile(vals, 95)), "n": len(vals)}

    warm = rows[1:]
    done = [r for r in warm if r["finish"] != "cancelled"]
    cancelled = [r for r in warm if r["finish"] == "cancelled"]
    after_cancel = [r for i, r in enumerate(rows) if i > 0 and rows[i - 1]["finish"] == "cancelled"]

    def share(sel, key="cached_tokens"):
        p = sum(r["prompt_tokens"] for r in sel)
        return round(sum(r[key] for r in sel) / p, 4) if p else None

    return {"ttft_completed": pct("ttft_s", done), "ttlt_completed": pct("ttlt_s", done),
            "ttft_cancelled": pct("ttft_s", cancelled), "ttlt_cancelled": pct("ttlt_s", cancelled),
            "first_request": {"ttft_ms": _ms(rows[0]["ttft_s"]), "ttlt_ms": _ms(rows[0]["ttlt_s"]),
                              "prompt_tokens": rows[0]["prompt_tokens"]},
            "cache_share_warm": share(warm), "cache_share_after_cancel": share(after_cancel),
            "reused_share_warm": share(warm, "reused_tokens"),
            "mean_prompt_tokens": round(sum(r["prompt_tokens"] for r in rows) / len(rows), 1),
            "mean_generated_completed": round(sum(r["generated_tokens"] for r in done) / len(done), 2)
            if done else None,
            "max_kv_blocks_after": max(r["kv_blocks_used_after"] for r in rows)}


def _ms(s: float | None) -> float | None:
    return None if s is None else round(1000 * s, 2)


def run_autocomplete(engine, tokenizer, out_dir: Path | None = None, *, n_requests: int = 32,
                     max_tokens: int = 48, cancel_after: int = 5, prefix_min: int = 1024,
                     prefix_max: int = 2048, suffix_tokens: int = 1024, extra_tokens: int = 1024,
                     model: str = "", log: Log = print) -> dict:
    """Run the workload on `engine` (idle; prefix caching as configured) with `tokenizer` (a Qwen2.5-Coder
    tokenizer: it needs the FIM tokens; any container's will do for a synthetic model of the same vocab).
    Returns the report; writes autocomplete.json / .md into `out_dir` when given."""
    reqs: list[AutocompleteRequest] = autocomplete_requests(
        tokenizer, n_requests, prefix_min=prefix_min, prefix_max=prefix_max, suffix_tokens=suffix_tokens,
        extra_tokens=extra_tokens)
    rows = []
    for r in reqs:
        p = fim_prompt(tokenizer, r.prefix, r.suffix, [r.extra], path=r.path)
        if len(p.ids) + max_tokens > engine.max_model_len:
            raise ValueError(f"request {r.index}: {len(p.ids)} prompt tokens + {max_tokens} do not fit the "
                             f"engine's context ({engine.max_model_len})")
        cancel = cancel_after if r.index % 2 == 1 else None
        row = _one(engine, p.ids, p.stop_ids, max_tokens, cancel, f"ac-{r.index}")
        row |= {"index": r.index, "line": r.line, "cancel_after": cancel}
        rows.append(row)
        log(f"autocomplete {r.index}: line {r.line}, {row['prompt_tokens']} prompt tokens "
            f"({row['cached_tokens']} cached), TTFT {_ms(row['ttft_s'])} ms, last token "
            f"{_ms(row['ttlt_s'])} ms, "
            f"{row['generated_tokens']} tokens, {row['finish']}")
    dev = getattr(engine, "device", None)
    device = platform.processor() or "cpu"
    if dev is not None and getattr(dev, "type", "cpu") == "cuda":
        import torch

        device = torch.cuda.get_device_name(dev)
    rep = {"workload": "autocomplete", "model": model, "device": device, "engine": type(engine).__name__,
           "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
           "file": reqs[0].path, "extra_file": reqs[0].extra.filename,
           "settings": {"n_requests": n_requests, "max_tokens": max_tokens, "cancel_after": cancel_after,
                        "prefix_tokens": [prefix_min, prefix_max], "suffix_tokens": suffix_tokens,
                        "extra_tokens": extra_tokens, "greedy": True,
                        "cache_reuse": getattr(getattr(engine, "config", None), "cache_reuse", 0)},
           "summary": _summary(rows), "requests": rows}
    if out_dir is not None:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "autocomplete.json").write_text(json.dumps(rep, indent=1))
        (out_dir / "autocomplete.md").write_text(render_markdown(rep))
    return rep


def render_markdown(rep: dict) -> str:
    s, st = rep["summary"], rep["settings"]

    def row(name, t, ll):
        return f"| {name} | {t['p50_ms']} | {t['p95_ms']} | {ll['p50_ms']} | {ll['p95_ms']} | {t['n']} |"

    lines = [
        "# Workload `autocomplete`: a user typing down a file",
        "",
        f"{rep['model'] or 'model'} on {rep['device']} ({rep['engine']}), {rep['date']}; {st['n_requests']} "
        f"requests down `{rep['file']}` with `{rep['extra_file']}` as the extra file; prefix "
        f"{st['prefix_tokens'][0]}-{st['prefix_tokens'][1]} tokens, suffix {st['suffix_tokens']}, extra "
        f"{st['extra_tokens']}; greedy, up to {st['max_tokens']} tokens; every odd request cancelled after "
        f"{st['cancel_after']} tokens.",
        "",
        "| warm requests | TTFT p50 (ms) | TTFT p95 | last token p50 (ms) | last token p95 | n |",
        "|---|---:|---:|---:|---:|---:|",
        row("completed", s["ttft_completed"], s["ttlt_completed"]),
        row("cancelled", s["ttft_cancelled"], s["ttlt_cancelled"]),
        "",
        f"- first request (cold cache): TTFT {s['first_request']['ttft_ms']} ms, last token "
        f"{s['first_request']['ttlt_ms']} ms, {s['first_request']['prompt_tokens']} prompt tokens",
        f"- prompt tokens served from the prefix cache (warm requests): {s['cache_share_warm']}; right after "
        f"a cancelled request: {s['cache_share_after_cancel']}; of the warm requests' prompt tokens, "
        f"{s['reused_share_warm']} copied at a shifted position (cache reuse "
        f"{st['cache_reuse'] or 'off'})",
        f"- mean prompt {s['mean_prompt_tokens']} tokens; mean generated (completed) "
        f"{s['mean_generated_completed']}; KV blocks in use after a request, at most: "
        f"{s['max_kv_blocks_after']} (0: aborted requests free theirs)",
        "",
        "| # | line | prompt | cached | TTFT ms | last token ms | tokens | end |",
        "|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rep["requests"]:
        lines.append(f"| {r['index']} | {r['line']} | {r['prompt_tokens']} | {r['cached_tokens']} | "
                     f"{_ms(r['ttft_s'])} | {_ms(r['ttlt_s'])} | {r['generated_tokens']} | {r['finish']} |")
    return "\n".join(lines) + "\n"
