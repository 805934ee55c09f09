"""CPU: nanoqwen_bench.quality.infill, the fill-in-the-middle pass-rate harness (its GPU runs use a device).
Task construction on a hand-made problem (single-line and multi-line spans of the canonical solution,
fixed by a hash), scoring of canonical, wrong and suffix-repeating middles with and without trimming,
and the summary table. Here, not under one package's tests: the harness drives nanoqwen-runtime on
containers that nanoqwen-quant packs."""

from __future__ import annotations

import importlib

INF = importlib.import_module("nanoqwen_bench.quality.infill")

ABS = {"task_id": "T/0", "entry_point": "absdiff",
       "prompt": 'def absdiff(a, b):\n    """|a - b|."""\n',
       "canonical_solution": "    d = a - b\n    if d < 0:\n        d = -d\n    return d\n",
       "test": "def check(candidate):\n    assert candidate(2, 5) == 3\n    assert candidate(5, 2) == 3\n"}


def test_tasks_are_spans_of_the_canonical_solution():
    tasks = INF.build_tasks([ABS])
    assert [t["kind"] for t in tasks] == ["single", "multi"]
    for t in tasks:
        assert t["prefix"] + t["middle"] + t["suffix"] == ABS["prompt"] + ABS["canonical_solution"]
        assert t["prefix"].startswith(ABS["prompt"]) and t["middle"].endswith("\n")
    assert tasks[0]["middle"].count("\n") == 1 and tasks[1]["middle"].count("\n") >= 2
    assert INF.build_tasks([ABS]) == tasks  # fixed by the hash
    assert INF.spread(list(range(10)), 5) == [0, 2, 4, 6, 8]


def test_scoring_raw_and_trimmed():
    t = {"task_id": "T/0/x", "problem": "T/0", "kind": "multi", "prefix": ABS["prompt"] + "    d = a - b\n",
         "middle": "    if d < 0:\n        d = -d\n", "suffix": "    return d\n"}
    rows = [{"task_id": "T/0/x", "kind": "multi", "completion": t["middle"]},
            {"task_id": "T/0/x", "kind": "multi", "completion": "    return 0\n"},
            # right, then runs on into the suffix and beyond: fails raw, passes trimmed
            {"task_id": "T/0/x", "kind": "multi",
             "completion": t["middle"] + "    return d\n\nprint(absdiff(1"}]
    scored = INF.score(rows, {"T/0/x": t}, {"T/0": ABS}, timeout=10, jobs=2)
    got = [(r["passed_raw"], r["passed_trim"]) for r in scored]
    assert got == [(True, True), (False, False), (False, True)]
    table = INF.summarize({("m", "fim"): scored})
    got = [(r["scoring"], r["all"]["passed"], r["all"]["n"]) for r in table]
    assert got == [("raw", 1, 3), ("trim", 2, 3)]
    assert "| m | fim | trim |" in INF.markdown(table, (1, 1), {})
