"""CPU: bench/quality/humaneval.py, the HumanEval pass-rate harness of issue 16 (its GPU run is the
lead's, on the H200). Program extraction on hand-written answers, scoring of a hand-written problem
set (a correct answer passes; a wrong one, and one that loops forever, fail), the exact McNemar
p-value against values worked out by hand, the report of `score`, and `generate --device cpu` on the
runtime's tiny random container (its text is noise: only the rows' form is checked).

Here, not under one package's tests: the harness drives nanoqwen-runtime's Pipeline on containers
that nanoqwen-quant packs."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


HE = _load("humaneval_harness", ROOT / "bench" / "quality" / "humaneval.py")

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
