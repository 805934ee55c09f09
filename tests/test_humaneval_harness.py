"""CPU: nanoqwen_bench.quality.humaneval, the HumanEval pass-rate harness (its real runs are on
a GPU). Program extraction on hand-written answers, scoring of a hand-written problem
set (a correct answer passes; a wrong one, and one that loops forever, fail), the exact McNemar
p-value against values worked out by hand, the report of `score`, and `generate --device cpu` on the
runtime's tiny random container (its text is noise: only the rows' form is checked). The sampling
mode: per-request seeds (distinct, reproducible), the pass@1 estimator, its bootstrap CI and the
sign-flip p-value on hand-made per-sample results, the projection of samples needed, `generate
--samples 2` (rows, seeds, a rerun repeats them) and the sampled report of `score`.

Here, not under one package's tests: the harness drives nanoqwen-runtime's Pipeline on containers
that nanoqwen-quant packs."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]

HE = importlib.import_module("nanoqwen_bench.quality.humaneval")

ADD = {"task_id": "T/0", "entry_point": "add",
       "prompt": 'def add(a, b):\n    """Return a + b."""\n',
       "canonical_solution": "    return a + b\n",
       "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n"}
NEG = {"task_id": "T/1", "entry_point": "neg",
       "prompt": 'def neg(x):\n    """Return -x."""\n',
       "canonical_solution": "    return -x\n",
       "test": "def check(candidate):\n    assert candidate(4) == -4\n"}


def test_extract_block_with_the_function():
    answer = "Here it is:\n```python\ndef add(a, b):\n    return a + b\n```\nThen\n```python\nprint(1)\n```\n"
    assert HE.extract_program(ADD, answer) == "def add(a, b):\n    return a + b\n"


def test_extract_block_without_the_function_gets_the_prompt():
    answer = "```python\n    return a + b\n```"
    assert HE.extract_program(ADD, answer) == ADD["prompt"] + "    return a + b\n"


def test_extract_no_block_is_prompt_plus_raw_text():
    answer = "    return a + b\n"
    assert HE.extract_program(ADD, answer) == ADD["prompt"] + answer


def test_extract_skips_other_languages_and_reads_an_unclosed_block():
    answer = "```bash\npip install x\n```\n```py\ndef add(a, b):\n    return a + b\n"  # cut at max_tokens
    assert HE.extract_program(ADD, answer) == "def add(a, b):\n    return a + b\n"
    # a helper named like the entry point's prefix is not the entry point
    assert HE.extract_program(ADD, "```python\ndef add_one(a):\n    return a\n```").startswith(ADD["prompt"])


def test_mcnemar_exact_p_values():
    assert HE.mcnemar_p(0, 6) == pytest.approx(0.03125)      # 2 * (1/2)^6
    assert HE.mcnemar_p(6, 0) == pytest.approx(0.03125)
    assert HE.mcnemar_p(3, 3) == 1.0
    assert HE.mcnemar_p(0, 0) == 1.0
    assert HE.mcnemar_p(1, 9) == pytest.approx(2 * (1 + 10) / 1024)  # 0.021484375
    assert HE.mcnemar_p(2, 8) == pytest.approx(2 * (1 + 10 + 45) / 1024)


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_score_pass_fail_and_timeout(tmp_path):
    problems = _write_jsonl(tmp_path / "problems.jsonl", [ADD, NEG])
    out = tmp_path / "out"
    out.mkdir()
    # baseline "none": both right; "wrong": add is wrong, neg loops forever (must time out, fail)
    def rows(add_answer: str, neg_answer: str) -> list[dict]:
        return [{"task_id": "T/0", "completion": add_answer, "finish_reason": "eos"},
                {"task_id": "T/1", "completion": neg_answer, "finish_reason": "eos"}]

    _write_jsonl(out / "none.completions.jsonl",
                 rows("```python\ndef add(a, b):\n    return a + b\n```", "    return -x\n"))
    _write_jsonl(out / "wrong.completions.jsonl",
                 rows("```python\ndef add(a, b):\n    return a - b\n```",
                      "```python\n    while True:\n        pass\n```"))
    rc = HE.main(["score", "--out", str(out), "--problems", str(problems), "--timeout", "2", "--jobs", "2"])
    assert rc == 0
    res = {r["task_id"]: r for r in map(json.loads, (out / "wrong.results.jsonl").read_text().splitlines())}
    assert res["T/0"]["status"] == "failed" and "AssertionError" in res["T/0"]["reason"]
    assert res["T/1"]["status"] == "timeout" and not res["T/1"]["passed"]
    base = [json.loads(x) for x in (out / "none.results.jsonl").read_text().splitlines()]
    assert [r["passed"] for r in base] == [True, True]
    s = json.loads((out / "humaneval.json").read_text())
    assert s["baseline"] == "none" and s["problems"] == 2 and s["canonical"] == {"passed": 2, "total": 2}
    assert s["models"]["none"]["passed"] == 2 and s["models"]["wrong"]["passed"] == 0
    v = s["models"]["wrong"]["vs_baseline"]
    assert (v["baseline_only"], v["model_only"], v["delta_points"]) == (2, 0, -100.0)
    assert v["mcnemar_p"] == pytest.approx(0.5)  # 2 * (1/2)^2
    md = (out / "humaneval.md").read_text()
    assert "| wrong | 0/2 | 0.0% |" in md and "A difference of 1 problem is 50.00 points" in md


def test_score_refuses_mismatched_problem_sets(tmp_path, capsys):
    problems = _write_jsonl(tmp_path / "problems.jsonl", [ADD, NEG])
    out = tmp_path / "out"
    out.mkdir()
    _write_jsonl(out / "a.completions.jsonl", [{"task_id": "T/0", "completion": ""}])
    _write_jsonl(out / "b.completions.jsonl", [{"task_id": "T/0", "completion": ""},
                                               {"task_id": "T/1", "completion": ""}])
    assert HE.main(["score", "--out", str(out), "--problems", str(problems), "--timeout", "2"]) == 2
    assert "different problems" in capsys.readouterr().err
    _write_jsonl(out / "a.completions.jsonl", [{"task_id": "T/9", "completion": ""}])
    assert HE.main(["score", "--out", str(out), "--problems", str(problems), "--timeout", "2"]) == 2
    assert "unknown task_id" in capsys.readouterr().err


def test_generate_cpu_writes_well_formed_rows(tmp_path):
    from nanoqwen_runtime.testing import write_tiny_container

    # a context of 1,024: the tiny tokenizer spends about one token per byte of the chat prompt
    model = write_tiny_container(tmp_path / "tiny.nanoqwen", method="none", seed=3,
                                 config_overrides={"max_position_embeddings": 1024})
    problems = _write_jsonl(tmp_path / "problems.jsonl", [ADD, NEG, {**ADD, "task_id": "T/2"}])
    out = tmp_path / "out"
    rc = HE.main(["generate", "--model", f"tiny={model}", "--out", str(out), "--device", "cpu",
                  "--limit", "2", "--max-tokens", "6", "--problems", str(problems)])
    assert rc == 0
    rows = [json.loads(x) for x in (out / "tiny.completions.jsonl").read_text().splitlines()]
    assert [r["task_id"] for r in rows] == ["T/0", "T/1"]
    for r in rows:
        assert isinstance(r["completion"], str)
        assert r["finish_reason"] in ("eos", "length")
        assert 1 <= r["generated_tokens"] <= 6 and r["prompt_tokens"] > 0
    meta = json.loads((out / "tiny.generate.json").read_text())
    assert meta["problems"] == 2 and meta["backend"].startswith("reference")
    assert not list(out.glob("*.tmp"))


def test_bad_model_spec_is_refused(tmp_path, capsys):
    problems = _write_jsonl(tmp_path / "problems.jsonl", [ADD])
    assert HE.main(["generate", "--model", "no/slash=x.nanoqwen", "--out", str(tmp_path / "o"),
                    "--device", "cpu", "--problems", str(problems)]) == 2
    assert "NAME=PATH" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------- sampling
def _scored(matrix: list[list[bool]]) -> list[dict]:
    """Hand-made scored rows: matrix[i][j] = did sample j of task T/i pass."""
    return [{"task_id": f"T/{i}", "sample": j, "passed": ok, "status": "passed" if ok else "failed",
             "reason": "", "finish_reason": "eos"}
            for i, row in enumerate(matrix) for j, ok in enumerate(row)]


def test_sample_seeds_are_distinct_and_reproducible():
    seeds = [HE.sample_seed(0, i, j) for i in range(164) for j in range(50)]
    assert len(set(seeds)) == len(seeds)
    assert all(0 <= x < 2**63 for x in seeds)
    assert seeds == [HE.sample_seed(0, i, j) for i in range(164) for j in range(50)]
    assert HE.sample_seed(1, 0, 0) != HE.sample_seed(0, 0, 0)
    assert HE.sample_seed(0, 1, 0) != HE.sample_seed(0, 0, 1)  # the arguments are not summed


def test_sampled_model_equal_to_the_baseline():
    base = [[True, False, True, True], [False, False, False, True], [True, True, True, True],
            [False, True, False, False], [False, False, False, False]]
    s = HE.summarize({"none": _scored(base), "same": _scored(base)}, "none")
    assert s["samples"] == 4 and s["problems"] == 5
    m = s["models"]["same"]
    assert m["pass_at_1"] == pytest.approx(100 * 9 / 20)  # mean of 3/4, 1/4, 1, 1/4, 0
    assert m["passed_samples"] == 9 and m["solved_any"] == 4
    lo, hi = m["ci95_points"]
    assert lo < m["pass_at_1"] < hi
    v = m["vs_baseline"]
    assert v["delta_points"] == 0 and v["ci95_points"] == [0, 0] and v["sign_flip_p"] == 1.0
    assert v["problems_differing"] == 0


def test_sampled_model_failing_a_fixed_half():
    n, big_n = 4, 4
    base = [[True] * big_n for _ in range(n)]
    half = [[j >= big_n // 2 for j in range(big_n)] for _ in range(n)]  # fails samples 0 and 1 everywhere
    s = HE.summarize({"none": _scored(base), "half": _scored(half)}, "none")
    assert s["models"]["none"]["pass_at_1"] == 100
    m = s["models"]["half"]
    assert m["pass_at_1"] == pytest.approx(50) and m["ci95_points"] == pytest.approx([50, 50])
    v = m["vs_baseline"]
    assert v["delta_points"] == pytest.approx(-50) and v["ci95_points"] == pytest.approx([-50, -50])
    # every d_i = -1/2: of the 2^4 sign patterns only all-minus and all-plus reach |sum| = 2
    assert v["sign_flip_p"] == pytest.approx(2 / 16)


def test_bootstrap_ci_is_reproducible_and_brackets_the_mean():
    rng = np.random.default_rng(5)
    base = (rng.random((40, 6)) < 0.6).tolist()
    other = (rng.random((40, 6)) < 0.5).tolist()
    first = HE.summarize({"none": _scored(base), "other": _scored(other)}, "none")
    again = HE.summarize({"none": _scored(base), "other": _scored(other)}, "none")
    assert first == again
    v = first["models"]["other"]["vs_baseline"]
    lo, hi = v["ci95_points"]
    assert lo < v["delta_points"] < hi and v["se_points"] > 0
    # the CI's half-width is about 1.96 standard errors
    assert (hi - lo) / 2 == pytest.approx(1.96 * v["se_points"], rel=0.15)


def test_sign_flip_random_patterns_agree_with_the_exact_count():
    d = np.array([0.5, -0.25, 0.75, 0.5, 0.25, 1.0, -0.5, 0.25, 0.5, 0.0, 0.75, -0.25, 0.5])
    exact = HE.sign_flip_p(d)                       # 12 nonzero: all 4,096 patterns
    sampled = HE.sign_flip_p(d, exact_max=0)         # 20,000 random patterns
    assert 0 < exact < 0.2
    assert sampled == pytest.approx(exact, abs=0.01)
    assert HE.sign_flip_p(np.zeros(7)) == 1.0


def test_samples_needed_projection():
    # within-problem noise only: x_i = (+1, -1) for 100 problems; W = var([1, -1]) / 2 = 1, B = 0;
    # var(N') = 2 / (100 N') <= (0.01 / 1.96)^2  ->  N' >= 2 * 1.96^2 / 0.01 = 768.32
    x = np.tile([1.0, -1.0], (100, 1))
    assert HE.samples_needed(x) == 769
    # the problems' own spread only: d_i = +-1, W = 0, B ~ 1 > 100 (0.01 / 1.96)^2: unreachable
    y = np.repeat(np.array([[1.0], [-1.0]]), 50, axis=0).repeat(2, axis=1)
    assert HE.samples_needed(y) is None


def test_decoding_options_are_checked():
    assert HE.Decoding.from_args(1, None, 0.95, 0) == HE.Decoding()  # greedy
    d = HE.Decoding.from_args(3, None, 0.95, 7)
    assert (d.samples, d.temperature, d.top_p, d.seed) == (3, 0.8, 0.95, 7)
    for args, msg in [((2, 0.0, 0.95, 0), "needs --temperature > 0"), ((1, 0.5, 0.95, 0), "needs --samples"),
                      ((2, None, 0.0, 0), "--top-p"), ((0, None, 0.95, 0), "--samples must"),
                      ((2, None, 0.95, -1), "--seed")]:
        with pytest.raises(HE.HarnessError, match=msg):
            HE.Decoding.from_args(*args)


def test_generate_cpu_samples_and_sampled_report(tmp_path, capsys):
    from nanoqwen_runtime.testing import write_tiny_container

    model = write_tiny_container(tmp_path / "tiny.nanoqwen", method="none", seed=3,
                                 config_overrides={"max_position_embeddings": 1024})
    problems = _write_jsonl(tmp_path / "problems.jsonl", [ADD, NEG, {**ADD, "task_id": "T/2"}])
    common = ["--device", "cpu", "--limit", "2", "--max-tokens", "6", "--problems", str(problems),
              "--samples", "2", "--seed", "11"]
    out = tmp_path / "out"
    assert HE.main(["generate", "--model", f"none={model}", "--model", f"same={model}", "--out", str(out),
                    *common]) == 0
    rows = [json.loads(x) for x in (out / "none.completions.jsonl").read_text().splitlines()]
    assert [(r["task_id"], r["sample"]) for r in rows] == [("T/0", 0), ("T/0", 1), ("T/1", 0), ("T/1", 1)]
    assert [r["seed"] for r in rows] == [HE.sample_seed(11, i, j) for i in range(2) for j in range(2)]
    for r in rows:
        assert isinstance(r["completion"], str) and r["finish_reason"] in ("eos", "length")
        assert 1 <= r["generated_tokens"] <= 6 and r["prompt_tokens"] > 0
    meta = json.loads((out / "none.generate.json").read_text())
    assert (meta["problems"], meta["requests"], meta["samples"], meta["temperature"], meta["top_p"],
            meta["top_k"], meta["seed"]) == (2, 4, 2, 0.8, 0.95, 0, 11)
    # a rerun repeats every draw
    again = tmp_path / "again"
    assert HE.main(["generate", "--model", f"none={model}", "--out", str(again), *common]) == 0
    assert (again / "none.completions.jsonl").read_text() == (out / "none.completions.jsonl").read_text()
    # completions generated with other settings are not reused silently
    assert HE.main(["generate", "--model", f"none={model}", "--out", str(out),
                    *common[:-4], "--samples", "3"]) == 2
    assert "samples 2 (asked 3)" in capsys.readouterr().err
    # score: every sample is scored; the same container with the same seeds differs by nothing
    assert HE.main(["score", "--out", str(out), "--problems", str(problems), "--timeout", "5",
                    "--jobs", "2"]) == 0
    res = [json.loads(x) for x in (out / "same.results.jsonl").read_text().splitlines()]
    assert [(r["task_id"], r["sample"]) for r in res] == [("T/0", 0), ("T/0", 1), ("T/1", 0), ("T/1", 1)]
    s = json.loads((out / "humaneval.json").read_text())
    assert s["samples"] == 2 and s["decoding"]["seed"] == 11 and s["canonical"] == {"passed": 2, "total": 2}
    v = s["models"]["same"]["vs_baseline"]
    assert v["delta_points"] == 0 and v["sign_flip_p"] == 1.0
    md = (out / "humaneval.md").read_text()
    assert "sampled (2 problems × 2 samples)" in md and "temperature 0.8, top-p 0.95" in md
    assert "| same |" in md and "| +0.00 | +0.00 – +0.00 |" in md


def test_score_refuses_uneven_samples(tmp_path, capsys):
    problems = _write_jsonl(tmp_path / "problems.jsonl", [ADD, NEG])
    out = tmp_path / "out"
    out.mkdir()
    two = [{"task_id": t, "sample": j, "completion": ""} for t in ("T/0", "T/1") for j in range(2)]
    _write_jsonl(out / "a.completions.jsonl", two[:3])  # T/1 lacks sample 1
    assert HE.main(["score", "--out", str(out), "--problems", str(problems), "--timeout", "2"]) == 2
    assert "every task needs samples 0..N-1" in capsys.readouterr().err
    _write_jsonl(out / "a.completions.jsonl", two)
    _write_jsonl(out / "b.completions.jsonl", [{"task_id": t, "completion": ""} for t in ("T/0", "T/1")])
    assert HE.main(["score", "--out", str(out), "--problems", str(problems), "--timeout", "2"]) == 2
    assert "different samples per problem" in capsys.readouterr().err
