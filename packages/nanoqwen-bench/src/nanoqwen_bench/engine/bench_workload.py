"""The workload benchmark behind `nanoqwen-cli bench --workload code-edit|free-form`: prompt-lookup
speculation off against on, on real prompts, in one run on one engine.

For each workload (prompt sets from `nanoqwen_bench.workloads`, rendered with the container's chat
template) every prompt runs alone (batch 1), greedy, up to `max_tokens` generated tokens (EOS ends it:
these are real answers), once with speculation off and once on; speculation is per request
(`Request.speculation`), so both runs share the engine, its graphs and its warm caches. The order
alternates (even prompts off first, odd prompts on first) so that neither mode always runs on a prefix
cache the other one just filled; the decode rates exclude the prefill anyway.

Reported per workload (workload-<name>.json and .md in the output folder):
- decode tok/s off and on: generated tokens after the first over the time from the first token to the
  last (the engine's FinishEvent), summed over the prompts; their ratio against the issue's goal
  (code-edit >= 2.0x, free-form >= 0.95x);
- acceptance rate (accepted / drafted tokens) and mean accepted length (accepted tokens per verify step
  that carried a draft), from the difference of `Engine.stats()` around each speculative request; the
  same difference around the non-speculative ones must be zero (reported as `off_drafted_tokens`);
- agreement: how many outputs are identical, and for the others the index of the first differing
  token. Greedy speculation is exact in exact arithmetic; on the GPU a verify step computes the rows in
  another batch shape than decode steps, so a near-tie may flip: the bench reports, never asserts.

A workload on random weights means nothing (the CLI refuses `--workload` without `--model`). The
runner itself takes any engine: the CPU test runs it on the torch op backend with a tiny container.
"""

from __future__ import annotations

import datetime
import json
import platform
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
from nanoqwen_runtime.engine.config import EngineConfig
from nanoqwen_runtime.engine.engine import Engine, FinishEvent
from nanoqwen_runtime.engine.scheduler import FinishReason, Request
from nanoqwen_runtime.sampling import SamplingParams
from nanoqwen_runtime.speculative import SpeculationConfig

from ..workloads import WorkloadPrompt, prompt_set_sha256, python_version, stdlib_dir, workload_prompts

Log = Callable[[str], None]

GOALS = {"code-edit": 2.0, "free-form": 0.95}  # speculative / plain decode tok/s
WARMUP_TOKENS = 16


def _run_one(engine: Engine, ids: list[int], max_tokens: int, spec: SpeculationConfig | bool,
             request_id: str) -> tuple[FinishEvent, dict]:
    """Run one greedy request alone to its end; its FinishEvent and the change of the engine's
    speculation counters over it."""
    if engine.has_work:
        raise RuntimeError("the workload bench needs an idle engine (batch 1)")
    before = engine.stats()
    req = Request(list(ids), SamplingParams(temperature=0.0, max_tokens=max_tokens), request_id,
                  speculation=spec if spec else False)
    ev = engine.submit(req)
    if ev is not None:
        raise RuntimeError(f"workload request {request_id} refused: {ev.detail}")
    fin = None
    while engine.has_work:
        for e in engine.step():
            if isinstance(e, FinishEvent) and e.request_id == request_id:
                fin = e
    if fin is None:
        raise RuntimeError(f"workload request {request_id} never finished")
    if fin.reason in (FinishReason.ERROR, FinishReason.REFUSED, FinishReason.ABORTED):
        raise RuntimeError(f"workload request {request_id} ended with {fin.reason.value}: {fin.detail}")
    after = engine.stats()
    delta = {k: getattr(after, k) - getattr(before, k)
             for k in ("spec_steps", "spec_drafted_tokens", "spec_accepted_tokens")}
    return fin, delta


def _decode_s(fin: FinishEvent) -> float:
    """Seconds from the first token to the last (0 for a one-token answer)."""
    return (fin.num_generated - 1) / fin.decode_tok_s if fin.num_generated > 1 and fin.decode_tok_s else 0.0


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where `a` and `b` differ (a shorter one differs where it ends); None
    when they are identical."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _mode_summary(rows: list[dict], mode: str) -> dict:
    gen = sum(r[mode]["generated_tokens"] for r in rows)
    dec_tokens = sum(max(r[mode]["generated_tokens"] - 1, 0) for r in rows)
    dec_s = sum(r[mode]["decode_s"] for r in rows)
    total_s = sum(r[mode]["total_s"] for r in rows)
    return {"generated_tokens": gen, "decode_s": dec_s, "decode_tok_s": dec_tokens / dec_s if dec_s else 0.0,
            "total_s": total_s, "end_to_end_tok_s": gen / total_s if total_s else 0.0,
            "mean_ttft_s": sum(r[mode]["ttft_s"] for r in rows) / len(rows)}


def run_workload(engine: Engine, name: str, prompts: list[WorkloadPrompt], prompt_ids: list[list[int]], *,
                 max_tokens: int, speculation: SpeculationConfig, log: Log = print) -> dict:
    """Run one workload off and on (see the module header); the report as a dict (JSON-ready)."""
    if not prompts or len(prompts) != len(prompt_ids):
        raise ValueError(f"need one token list per prompt, got {len(prompts)} prompts and "
                         f"{len(prompt_ids)} lists")
    # warm-up, left out of the figures: the first request of each mode (lazy graph shapes, allocator)
    for spec in (False, speculation):
        _run_one(engine, prompt_ids[0], min(WARMUP_TOKENS, max_tokens), spec, f"{name}-warmup-{bool(spec)}")
    rows = []
    for p, ids in zip(prompts, prompt_ids, strict=True):
        row: dict = {"index": p.index, "task": p.task, "source": p.source, "prompt_tokens": len(ids)}
        order = (False, True) if p.index % 2 == 0 else (True, False)
        for on in order:
            t0 = time.perf_counter()
            fin, delta = _run_one(engine, ids, max_tokens, speculation if on else False,
                                  f"{name}-{p.index}-{'on' if on else 'off'}")
            total = time.perf_counter() - t0
            row["on" if on else "off"] = {
                "generated_tokens": fin.num_generated, "finish_reason": fin.reason.value,
                "ttft_s": fin.ttft_s, "decode_s": _decode_s(fin), "total_s": total, "tokens": fin.tokens,
                **delta}
        a, b = row["off"]["tokens"], row["on"]["tokens"]
        row["first_divergence"] = first_divergence(a, b)
        row["identical"] = row["first_divergence"] is None
        on = row["on"]
        log(f"{name} #{p.index} ({p.task}): {len(ids)} prompt tokens, off {row['off']['generated_tokens']} / "
            f"on {on['generated_tokens']} tokens, drafted {on['spec_drafted_tokens']}, accepted "
            f"{on['spec_accepted_tokens']}" + ("" if row["identical"] else
                                                f", differs from token {row['first_divergence']}"))
        rows.append(row)
    off, on = _mode_summary(rows, "off"), _mode_summary(rows, "on")
    steps = sum(r["on"]["spec_steps"] for r in rows)
    drafted = sum(r["on"]["spec_drafted_tokens"] for r in rows)
    accepted = sum(r["on"]["spec_accepted_tokens"] for r in rows)
    on |= {"spec_steps": steps, "spec_drafted_tokens": drafted, "spec_accepted_tokens": accepted,
           "acceptance_rate": accepted / drafted if drafted else 0.0,
           "mean_accepted": accepted / steps if steps else 0.0}
    speedup = on["decode_tok_s"] / off["decode_tok_s"] if off["decode_tok_s"] else 0.0
    diverged = [r["first_divergence"] for r in rows if not r["identical"]]
    return {
        "workload": name, "n_prompts": len(rows), "max_tokens": max_tokens, "batch": 1, "greedy": True,
        "speculation": asdict(speculation), "off": off, "on": on, "speedup": speedup,
        "goal": GOALS.get(name), "goal_met": speedup >= GOALS[name] if name in GOALS else None,
        "off_drafted_tokens": sum(r["off"]["spec_drafted_tokens"] for r in rows),
        "agreement": {"identical": len(rows) - len(diverged), "total": len(rows),
                      "first_divergence": diverged,
                      "earliest_divergence": min(diverged) if diverged else None},
        "prompts": rows,
    }


def render_markdown(rep: dict) -> str:
    """One workload's report as markdown."""
    off, on, m, sp = rep["off"], rep["on"], rep["meta"], rep["speculation"]
    goal = f"{rep['goal']:.2f}x: {'met' if rep['goal_met'] else 'NOT met'}" if rep["goal"] else "none"
    ag = rep["agreement"]
    lines = [
        f"# Workload `{rep['workload']}`: speculation off vs on",
        "",
        f"{m['model']} on {m['device']} ({m['engine']}), {m['date']}; {rep['n_prompts']} prompts, batch 1, "
        f"greedy, up to {rep['max_tokens']} tokens; speculation `{m['speculation_spec']}` "
        f"(k {sp['k']}, n-gram {sp['ngram_max']}..{sp['ngram_min']}). "
        f"Python {m['python']}, prompt set sha256 `{m['prompt_set_sha256'][:16]}`.",
        "",
        "| | decode tok/s | end-to-end tok/s | generated tokens | mean TTFT (ms) |",
        "|---|---:|---:|---:|---:|",
        f"| off | {off['decode_tok_s']:.1f} | {off['end_to_end_tok_s']:.1f} | {off['generated_tokens']} | "
        f"{1e3 * off['mean_ttft_s']:.1f} |",
        f"| on | {on['decode_tok_s']:.1f} | {on['end_to_end_tok_s']:.1f} | {on['generated_tokens']} | "
        f"{1e3 * on['mean_ttft_s']:.1f} |",
        "",
        f"- speedup (decode tok/s on / off): **{rep['speedup']:.2f}x** (goal {goal})",
        f"- acceptance rate {on['acceptance_rate']:.3f} ({on['spec_accepted_tokens']} of "
        f"{on['spec_drafted_tokens']} drafted tokens), mean accepted length {on['mean_accepted']:.2f} "
        f"per verify step ({on['spec_steps']} steps)",
        f"- identical outputs: {ag['identical']} of {ag['total']}"
        + (f"; first divergences at tokens {ag['first_divergence']}" if ag["first_divergence"] else ""),
        f"- drafted tokens in the non-speculative runs: {rep['off_drafted_tokens']} (must be 0)",
        "",
        "| # | task | source | prompt | off tokens | on tokens | drafted | accepted | identical |",
        "|---:|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in rep["prompts"]:
        lines.append(f"| {r['index']} | {r['task']} | {r['source'] or '-'} | {r['prompt_tokens']} | "
                     f"{r['off']['generated_tokens']} | {r['on']['generated_tokens']} | "
                     f"{r['on']['spec_drafted_tokens']} | {r['on']['spec_accepted_tokens']} | "
                     f"{'yes' if r['identical'] else 'from ' + str(r['first_divergence'])} |")
    return "\n".join(lines) + "\n"


def run_workloads(engine: Engine, container: str | Path, workloads: list[str], out_dir: Path, *,
                  n_prompts: int = 16, max_tokens: int = 256, speculation: SpeculationConfig | None = None,
                  seed: int = 0, log: Log = print) -> dict[str, dict]:
    """Run each workload on `engine` (loaded from `container`, whose tokenizer and chat template render
    the prompts); write workload-<name>.json and .md into `out_dir`; return the reports by name."""
    from nanoqwen_runtime.engine.backend import EngineBackend
    from nanoqwen_runtime.generate import Pipeline

    if n_prompts < 1 or max_tokens < 1:
        raise ValueError(f"need n_prompts >= 1 and max_tokens >= 1, got {n_prompts}, {max_tokens}")
    speculation = speculation or SpeculationConfig()
    pipe = Pipeline.from_container(container, EngineBackend(engine))
    dev = engine.device
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    device = torch.cuda.get_device_name(dev) if dev.type == "cuda" else (platform.processor() or "cpu")
    meta = {"model": str(container), "date": now, "device": device,
            "engine": f"{engine.config.backend} ops, {engine.config.mode} mode, prefix caching "
                      f"{'on' if getattr(engine.config, 'prefix_caching', False) else 'off'}",
            "torch": torch.__version__, "python": python_version(), "stdlib": str(stdlib_dir()),
            "speculation_spec": speculation.spec(), "seed": seed}
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    reports = {}
    for name in workloads:
        prompts = workload_prompts(name, n_prompts, seed)
        ids = [pipe.tokenizer.encode(pipe.chat_prompt(p.chat_messages())) for p in prompts]
        limit = engine.max_model_len
        too_long = [(p.index, len(i)) for p, i in zip(prompts, ids, strict=True) if len(i) >= limit]
        if too_long:
            raise ValueError(f"{name}: prompts longer than the engine's context ({limit}): "
                             f"{too_long}")
        log(f"workload {name}: {len(prompts)} prompts, {sum(map(len, ids))} prompt tokens")
        rep = run_workload(engine, name, prompts, ids, max_tokens=max_tokens, speculation=speculation,
                           log=log)
        rep["meta"] = meta | {"prompt_set_sha256": prompt_set_sha256(prompts)}
        (out_dir / f"workload-{name}.json").write_text(json.dumps(rep, indent=1))
        (out_dir / f"workload-{name}.md").write_text(render_markdown(rep))
        off, on = rep["off"], rep["on"]
        log(f"workload {name}: off {off['decode_tok_s']:.1f} tok/s, on {on['decode_tok_s']:.1f} tok/s, "
            f"{rep['speedup']:.2f}x; acceptance {on['acceptance_rate']:.2f}, mean accepted "
            f"{on['mean_accepted']:.2f}; identical {rep['agreement']['identical']}/{len(prompts)}")
        reports[name] = rep
    return reports


def run_workload_bench(model: str | Path, out_dir: Path, workloads: list[str], *, config: EngineConfig,
                       n_prompts: int = 16, max_tokens: int = 256,
                       speculation: SpeculationConfig | None = None, log: Log = print) -> dict[str, dict]:
    """`nanoqwen-cli bench --model M --workload ...`: load `model` into an engine built with `config`
    (its own speculation default is irrelevant: every request here says off or on) and run
    `run_workloads`."""
    t0 = time.perf_counter()
    engine = Engine.from_file(model, config)
    log(f"engine ready in {time.perf_counter() - t0:.1f}s ({engine.num_blocks} KV blocks)")
    return run_workloads(engine, model, workloads, out_dir, n_prompts=n_prompts, max_tokens=max_tokens,
                         speculation=speculation, log=log)
