"""`nanoqwen-cli bench --workload ...` from the command line to the written reports, without a GPU:
`torch.cuda.is_available` says yes and the engine is the tiny model (test tokenizer and chat template)
on the torch op backend, eager, on the CPU. What is tested is the command's wiring: the options reach
the runner, workload-<name>.json/.md are written into --out, the markdown is printed, and the summary
line names each workload's ratio against its goal. The option checks (exit 2) are in
test_hostile_inputs.py."""

from __future__ import annotations

import json

import pytest
import torch
from nanoqwen_bench.engine import bench_workload
from nanoqwen_cli.main import app
from nanoqwen_runtime.engine import EngineConfig
from nanoqwen_runtime.engine.engine import Engine as RealEngine
from nanoqwen_runtime.testing import write_tiny_container
from typer.testing import CliRunner


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_container(tmp_path_factory.mktemp("wl") / "tiny.nanoqwen", method="rtn", seed=3)


def test_bench_workload_writes_reports(tiny, tmp_path, monkeypatch):
    seen = {}

    class CpuEngine(RealEngine):
        @classmethod
        def from_file(cls, path, config=None, **kw):
            seen["kv_memory_bytes"], seen["speculation"] = config.kv_memory_bytes, config.speculation
            return RealEngine.from_file(path, EngineConfig(device="cpu", backend="torch", mode="eager",
                                                           num_blocks=64, max_model_len=None, max_batch=8,
                                                           prefill_chunk=256), **kw)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench_workload, "Engine", CpuEngine)
    out = tmp_path / "wl"
    # free-form only: its prompts (~150 byte tokens) fit the tiny model's 256 positions
    r = CliRunner().invoke(app, ["bench", "--model", str(tiny), "--out", str(out), "--workload", "free-form",
                                 "--workload", "free-form", "--speculate", "ngram:3", "--prompts", "2",
                                 "--max-tokens", "5", "--kv-memory", "1GiB"])
    assert r.exit_code == 0, r.output
    # the engine's own default stays off: each request says off or on
    assert seen == {"kv_memory_bytes": 1 << 30, "speculation": None}
    rep = json.loads((out / "workload-free-form.json").read_text())
    assert rep["n_prompts"] == 2 and rep["max_tokens"] == 5 and rep["speculation"]["k"] == 3
    assert sorted(p.name for p in out.iterdir()) == ["workload-free-form.json", "workload-free-form.md"]
    md = (out / "workload-free-form.md").read_text()
    assert md.strip() in r.stdout  # printed once (the repeated --workload runs once)
    assert r.stdout.count("# Workload `free-form`") == 1
    last = r.stdout.strip().splitlines()[-1]
    goal = "met" if rep["goal_met"] else "NOT met"
    assert last == (f"wrote {out}/workload-free-form.json and the .md beside each; free-form "
                    f"{rep['speedup']:.2f}x (goal 0.95x {goal})"), last


@pytest.mark.parametrize("args,reuse", [((), 0), (("--cache-reuse", "64"), 64)])
def test_bench_autocomplete_passes_cache_reuse_to_the_engine(tiny, tmp_path, monkeypatch, args, reuse):
    """`--workload autocomplete --cache-reuse N` builds the engine with `cache_reuse=N` (0 without the
    option) and hands it, with --prompts / --max-tokens, to run_autocomplete (recorded here: its own
    run is test_bench_autocomplete.py's)."""
    from nanoqwen_bench.engine import bench_autocomplete
    from nanoqwen_runtime.engine import engine as engine_module

    seen = {}

    class RecordingEngine:
        @classmethod
        def from_file(cls, path, config=None, **kw):
            seen["cache_reuse"], seen["kv"] = config.cache_reuse, config.kv_memory_bytes
            return cls()

    def fake_run(engine, tok, out, *, n_requests, max_tokens, model, log):
        seen["run"] = (type(engine).__name__, n_requests, max_tokens)
        out.mkdir(parents=True, exist_ok=True)
        (out / "autocomplete.md").write_text("# Autocomplete\n")
        return {"summary": {"ttlt_completed": {"p50_ms": 1.0}, "cache_share_warm": 0.5}}

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(engine_module, "Engine", RecordingEngine)
    monkeypatch.setattr(bench_autocomplete, "run_autocomplete", fake_run)
    r = CliRunner().invoke(app, ["bench", "--model", str(tiny), "--out", str(tmp_path / "ac"), "--workload",
                                 "autocomplete", "--prompts", "3", "--max-tokens", "7", "--kv-memory", "1GiB",
                                 *args])
    assert r.exit_code == 0, r.output
    assert seen == {"cache_reuse": reuse, "kv": 1 << 30, "run": ("RecordingEngine", 3, 7)}
    assert "# Autocomplete" in r.stdout and "cache share 0.5" in r.stdout
