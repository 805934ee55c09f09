"""The server benchmark's own tools (packages/nanoqwen-bench/server/): `step_trace.breakdown` on
hand-made trace rows, and `lean_client.LeanClient` against a real `nanoqwen-cli serve` of the tiny random
container on the CPU."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses resolve string annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


SERVER_TOOLS = ROOT / "packages" / "nanoqwen-bench" / "server"
step_trace = _load("step_trace", SERVER_TOOLS / "step_trace.py")
lean_client = _load("lean_client", SERVER_TOOLS / "lean_client.py")


def row(t_wake, t_step, t_done, t_sent, kind, n_submits=0, n_tokens=0):
    return {"t_wake": t_wake, "n_cmds": n_submits, "n_submits": n_submits, "t_step": t_step,
            "t_done": t_done, "kind": kind, "n_tokens": n_tokens, "t_sent": t_sent}


def test_breakdown_splits_the_window_into_steps_work_around_them_and_idle():
    """Window [10, 20] s. Rows: a prefill woken by 2 submits (1.0 s of step inside 1.5 s busy), two
    decodes (2.0 and 3.0 s of step inside 2.5 / 3.25 s busy), a row with no step (0.25 s, an abort),
    and one row outside the window. Busy 1.5 + 2.5 + 3.25 + 0.25 = 7.5 s of the 10 s: idle 2.5 s;
    around = 7.5 - (1 + 2 + 3) = 1.5 s."""
    rows = [
        row(9.0, 9.1, 9.5, 9.6, "decode"),                       # before the window: left out
        row(10.5, 10.6, 11.6, 12.0, "prefill", n_submits=2, n_tokens=2),
        row(12.0, 12.1, 14.1, 14.5, "decode", n_tokens=2),
        row(15.0, 15.1, 18.1, 18.25, "decode", n_tokens=2),
        row(18.5, None, 18.75, 18.75, None, n_submits=0),
    ]
    b = step_trace.breakdown(rows, 10.0, 20.0)
    assert b["rows"] == 4 and b["steps"] == 3
    assert b["decode_steps"] == 2 and b["decode_step_ms"] == pytest.approx(2500.0)
    assert b["decode_step_p50_ms"] == pytest.approx(2500.0)
    assert b["prefill_steps"] == 1 and b["prefill_ms"] == pytest.approx(1000.0)
    assert b["around_ms"] == pytest.approx(1500.0)
    assert b["idle_ms"] == pytest.approx(2500.0)
    assert b["submit_rows"] == 1 and b["first_submit_ms"] == pytest.approx(500.0)
    assert b["last_submit_ms"] == pytest.approx(500.0)
    assert b["first_decode_ms"] == pytest.approx(2100.0)


def test_breakdown_of_an_empty_window_and_a_missing_trace(tmp_path):
    b = step_trace.breakdown([row(1.0, 1.1, 1.2, 1.3, "decode")], 5.0, 6.0)
    assert b["rows"] == 0 and b["decode_step_ms"] is None and b["idle_ms"] == pytest.approx(1000.0)
    with pytest.raises(FileNotFoundError, match="NANOQWEN_ENGINE_TRACE"):
        step_trace.read_trace(tmp_path / "none.jsonl")


def test_lean_client_streams_from_a_real_server(tmp_path):
    """Four concurrent streams of 12 tokens (ignore_eos) from `nanoqwen-cli serve --device cpu` on the
    tiny container: each completes with its usage count, and its times are in order."""
    from nanoqwen_cli.server.testing import ServerProcess
    from nanoqwen_runtime.testing import write_tiny_container

    model = write_tiny_container(tmp_path / "tiny.nanoqwen", method="rtn", seed=5)

    async def run(url: str):
        client = lean_client.LeanClient(url, "tiny")
        await client.open(4)
        results = await asyncio.gather(*(client.stream([5 + i, 6, 7], 12) for i in range(4)))
        again = await client.stream([9], 3)  # a pooled connection is reused
        await client.close()
        return results, again

    with ServerProcess(model, "--threads", "1", "--model-name", "tiny") as srv:
        results, again = asyncio.run(run(srv.url))
    for r in [*results, again]:
        assert r.ok, r.error
        assert r.t_send <= r.t_first <= r.read_times[0]
        assert r.read_times == sorted(r.read_times)
    assert [r.completion_tokens for r in results] == [12] * 4 and again.completion_tokens == 3


def test_loadtest_pairs_each_round_with_its_own_engine_run():
    """The overhead ratio is the median of per-round ratios (HTTP run and the engine run beside it), so
    a host that drifts between rounds moves both sides of a ratio together."""
    loadtest = _load("loadtest", SERVER_TOOLS / "loadtest.py")
    http = [{"throughput_tok_s": t} for t in (9000.0, 8000.0, 10000.0)]
    engine = [{"throughput_tok_s": t} for t in (10000.0, 8000.0, 12500.0)]
    ratios = loadtest.paired_ratios(http, engine)
    assert ratios == [0.9, 1.0, 0.8]
    # the medians of all runs would pair 9000 with 10000: 0.9 too, but from runs of different rounds
    assert sorted(ratios)[1] == 0.9


def test_loadtest_keeps_its_clients_off_the_engine_processs_cpus(monkeypatch):
    """With `--cpu-placement auto` the client runs of the load test are bound to the server's HTTP CPUs
    (the engine process and the engine baseline have their two CPUs to themselves); `--client-cpus any`
    and a server without placement leave them unbound."""
    from nanoqwen_cli.server import cpu_placement

    loadtest = _load("loadtest", SERVER_TOOLS / "loadtest.py")
    plan = cpu_placement.CpuPlacement(engine=(14, 15), http=tuple(range(14)))
    monkeypatch.setattr(cpu_placement, "plan", lambda mode, slot=0: plan if mode == "auto" else None)
    assert loadtest.client_cpus("auto", "cuda", "http") == tuple(range(14))
    assert loadtest.client_cpus("auto", "cuda", "both") == tuple(range(14))
    assert loadtest.client_cpus("auto", "cuda", "any") is None
    assert loadtest.client_cpus("off", "cuda", "http") is None
    assert loadtest.baseline_cpus("auto", "cuda") == (14, 15)
    engine_cpus = loadtest.baseline_cpus("auto", "cuda")
    assert set(loadtest.client_cpus("auto", "cuda", "http")).isdisjoint(engine_cpus)
