"""`nanoqwen-cli bench --model FILE` from the command line to the written report, without a GPU.

The device calls are stood in for the way nanoqwen-runtime's tests/test_bench_report.py does it
(bandwidths, memory counters, CUDA events, the GPU-side wait; every engine is the tiny model on the
torch op backend, eager, on the CPU; the graph replay time is faked), and `torch.cuda.is_available`
says yes. What is tested is the command's wiring: the options reach `run_bench`, the report (json, md,
plots) is written into --out, bench.md is printed, the summary line names the bandwidths, and the exit
code says whether a section failed. (`bench --model` once crashed at the report.)
"""

from __future__ import annotations

import json
import time

import pytest
import torch
from nanoqwen_bench.engine import bench, bench_profile
from nanoqwen_cli.main import app
from nanoqwen_model import Qwen2Config
from nanoqwen_runtime.engine import EngineConfig
from nanoqwen_runtime.engine.synthetic import write_container
from typer.testing import CliRunner

pytest.importorskip("matplotlib")

TINY = Qwen2Config(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=64, intermediate_size=384, vocab_size=512, rope_theta=1e6, rms_norm_eps=1e-6,
                   max_position_embeddings=512, tie_word_embeddings=False, eos_token_id=(3,))
# Contexts and prompts of the bench (up to 4K) are cut to this, so every section runs, and quickly.
MAX_CTX = 200
READ_BPS, COPY_BPS = 4.8e12, 4.2e12


class HostEvent:
    """Stands in for torch.cuda.Event on the CPU: record() reads the host clock."""

    def record(self):
        self.t = time.perf_counter()

    def elapsed_time(self, other) -> float:
        return (other.t - self.t) * 1e3

    def synchronize(self):
        pass


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_container(tmp_path_factory.mktemp("bench") / "tiny.nanoqwen", TINY, seed=1)


@pytest.fixture
def cpu_bench(monkeypatch):
    """run_bench on the CPU: engines on the torch backend, device calls faked, fewer decode tokens."""
    import nanoqwen_bench.gpu as kbench
    from nanoqwen_runtime.engine.engine import Engine as RealEngine

    seen: dict = {}

    def cpu_cfg(cfg):
        seen.setdefault("kv_memory_bytes", cfg.kv_memory_bytes)
        return EngineConfig(device="cpu", backend="torch", mode="eager", num_blocks=2048, block_size=16,
                            max_model_len=None, prefill_chunk=256, max_batch=64,
                            dense_weight_cache=False, overlap=cfg.overlap)  # the profile's is synchronous

    graph_engines = []

    class CpuEngine(RealEngine):
        def __init__(self, geom, weights, config, **kw):
            super().__init__(geom, weights, cpu_cfg(config), **kw)

        @classmethod
        def from_file(cls, path, config=None, **kw):  # run_bench's graph-mode engine (--model)
            seen["model"] = str(path)
            engine = super().from_file(path, cpu_cfg(config), **kw)
            graph_engines.append(engine)
            return engine

    real_decode, real_prefill = bench.decode_at_context, bench.prefill_rate

    def decode(engine, ctx, new, batch=1, seed=0):
        r = real_decode(engine, min(ctx, MAX_CTX), min(new, 8), batch=batch, seed=seed)  # CPU time
        if engine in graph_engines:  # the "graph" engine: fake its replay
            r.update(graph_replay_s=batch / (1.1 * r["engine_tok_s"]), graph_tok_s=1.1 * r["engine_tok_s"])
        return r

    real_profile = bench_profile.profile_decode_ops
    read = {"bytes_per_s": READ_BPS, "nbytes": 4 << 30, "reps": 30, "median_s": 9e-4, "min_s": 8.9e-4,
            "max_s": 9.2e-4}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "Engine", CpuEngine)
    monkeypatch.setattr(bench, "decode_at_context", decode)
    monkeypatch.setattr(bench, "prefill_rate", lambda engine, n, seed=0: real_prefill(engine, min(n, MAX_CTX),
                                                                                    seed=seed))
    monkeypatch.setattr(bench_profile, "profile_decode_ops",
                        lambda engine, steps, batch=1: real_profile(engine, steps=steps, prompt=20,
                                                                    batch=batch))
    monkeypatch.setattr(bench, "copy_bandwidth", lambda device: COPY_BPS)
    monkeypatch.setattr(kbench, "read_bandwidth", lambda device: read)
    monkeypatch.setattr(kbench, "spin", lambda ns, device=None: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "fake GPU")
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 30, 2 << 30))
    monkeypatch.setattr(torch.cuda, "Event", lambda enable_timing=True: HostEvent())
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    return seen


def test_bench_model_writes_its_report(tiny_path, tmp_path, cpu_bench):
    out = tmp_path / "report"
    r = CliRunner().invoke(app, ["bench", "--model", str(tiny_path), "--out", str(out), "--quick",
                                 "--profile-steps", "2", "--kv-memory", "1GiB"])
    assert r.exit_code == 0, r.output
    assert cpu_bench == {"kv_memory_bytes": 1 << 30, "model": str(tiny_path)}  # the options reached it
    rep = json.loads((out / "bench.json").read_text())
    assert rep["device"] == "fake GPU" and rep["model_load"]["path"] == str(tiny_path)
    assert not rep.get("errors"), rep["errors"]
    assert len(rep["decode_batch1"]) == 2
    assert [d["batch"] for d in rep["decode_batched"]] == [1, 8, 16, 32, 64]
    assert rep["ttft_2k_ms"] > 0 and rep["launches_per_decode_step"] > 0
    md = (out / "bench.md").read_text()
    assert "## Loading the model" in md and "| linear qkv + rope/KV write (after RMSNorm) |" in md
    assert md.strip() in r.stdout  # the report is printed
    assert (out / "tok_s_vs_batch.png").stat().st_size > 1000
    last = r.stdout.strip().splitlines()[-1]
    assert last == f"wrote {out}/bench.json, bench.md and plots; read 4800 GB/s, copy 4200 GB/s", last


def test_bench_failed_section_exits_1_with_the_report(tiny_path, tmp_path, cpu_bench, monkeypatch):
    def broken(engine, ctx, new, batch=1, seed=0):
        raise RuntimeError("decode broke")

    monkeypatch.setattr(bench, "decode_at_context", broken)
    out = tmp_path / "report"
    r = CliRunner().invoke(app, ["bench", "--model", str(tiny_path), "--out", str(out), "--quick",
                                 "--profile-steps", "2"])
    assert r.exit_code == 1, r.output
    failed = ["decode_ctx128", "decode_ctx4096", "batch1", "batch8", "batch16", "batch32", "batch64",
              "eager1", "eager8", "features_cost"]  # features on vs off also decodes
    assert f"{len(failed)} section(s) failed: {', '.join(failed)}" in r.stdout
    rep = json.loads((out / "bench.json").read_text())
    assert list(rep["errors"]) == failed and rep["prefill"]  # the other sections still ran
    assert "## Errors" in (out / "bench.md").read_text()


def test_bench_only_runs_the_named_sections(tiny_path, tmp_path, cpu_bench, monkeypatch):
    """--only: the named sections and the bandwidths run, no other section does (the decode calls are
    counted), and the report holds just them."""
    calls = []
    real = bench.decode_at_context
    monkeypatch.setattr(bench, "decode_at_context", lambda *a, **kw: calls.append(a[1:3]) or real(*a, **kw))
    out = tmp_path / "report"
    r = CliRunner().invoke(app, ["bench", "--model", str(tiny_path), "--out", str(out), "--quick",
                                 "--only", "decode_ctx128, batch8"])
    assert r.exit_code == 0, r.output
    assert calls == [(128, 128), (128, 128)]  # decode_ctx128, then batch 8's one call
    rep = json.loads((out / "bench.json").read_text())
    assert [d["context"] for d in rep["decode_batch1"]] == [128]
    assert [d["batch"] for d in rep["decode_batched"]] == [8]
    assert rep["read_bandwidth_GBps"] == READ_BPS / 1e9 and rep["copy_bandwidth_GBps"] == COPY_BPS / 1e9
    assert rep["prefill"] == [] and rep["eager"] == [] and "features_cost" not in rep


def test_bench_only_with_an_unknown_section_exits_1(tiny_path, tmp_path, cpu_bench):
    out = tmp_path / "report"
    r = CliRunner().invoke(app, ["bench", "--model", str(tiny_path), "--out", str(out), "--quick",
                                 "--only", "decode_ctx128,lm_head_ab"])
    assert r.exit_code == 1, r.output
    rep = json.loads((out / "bench.json").read_text())
    # lm_head_ab is a section of the synthetic model's run only: a --model run has none
    assert rep["errors"]["only"].startswith("no section named lm_head_ab; this run's sections: "
                                            "read_bandwidth, copy_bandwidth_Bps, decode_ctx128")
    assert [d["context"] for d in rep["decode_batch1"]] == [128]


@pytest.mark.parametrize("only", ["decode_ctx128,", " , "])
def test_bench_only_refuses_an_empty_name(only, tiny_path, tmp_path):
    r = CliRunner().invoke(app, ["bench", "--model", str(tiny_path), "--out", str(tmp_path),
                                 "--only", only])
    assert r.exit_code == 2 and "--only: an empty section name" in r.output, r.output


def test_bench_geometry_reaches_run_bench(tmp_path, monkeypatch):
    """--geometry 1.5b: run_bench builds the synthetic weights of Qwen2.5-Coder-1.5B's geometry."""
    from nanoqwen_model import QWEN25_CODER_15B

    seen = {}

    def fake_run_bench(**kw):
        seen.update(kw)
        (kw["out_dir"] / "bench.md").write_text("# report\n")
        return {"read_bandwidth_GBps": 3000.0}

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "run_bench", fake_run_bench)
    out = tmp_path / "report"
    out.mkdir()
    r = CliRunner().invoke(app, ["bench", "--geometry", "1.5b", "--out", str(out), "--only", "batch64"])
    assert r.exit_code == 0, r.output
    assert seen["geometry"] == QWEN25_CODER_15B and seen["model"] is None
    assert seen["only"] == frozenset({"batch64"})


@pytest.mark.parametrize("args,message", [
    (["--geometry", "3b"], "--geometry must be one of 7b, 1.5b, 0.5b, got '3b'"),
    (["--geometry", "0.5b", "--model", "m.nanoqwen"], "--geometry picks synthetic weights"),
])
def test_bench_geometry_refuses_bad_values(args, message, tmp_path):
    r = CliRunner().invoke(app, ["bench", "--out", str(tmp_path), *args])
    assert r.exit_code == 2 and message in r.output, r.output
