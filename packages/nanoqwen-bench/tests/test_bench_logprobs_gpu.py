"""GPU: the logprobs cost bench (engine/bench_logprobs.py) on a 2-layer model of the 7B's shapes: both
sides ran, the logprob op's GPU time is measured, and the steps with logprobs took the device path
(a decode graph was replayed, and the rows that asked got logprobs)."""

from __future__ import annotations

import pytest
from nanoqwen_bench.engine.bench_logprobs import logprobs_cost
from nanoqwen_model import QWEN25_CODER_7B
from nanoqwen_runtime.engine import Engine, EngineConfig
from nanoqwen_runtime.engine.synthetic import random_weights

pytestmark = pytest.mark.gpu
GEOM = QWEN25_CODER_7B.with_(num_hidden_layers=2)


def test_logprobs_cost_runs_both_sides():
    eng = Engine(GEOM, random_weights(GEOM, "cuda", seed=3),
                 EngineConfig(kv_memory_bytes=1 << 30, max_model_len=1024, max_batch=64,
                              prefix_caching=False))
    replays = sum(eng.runner.replays.values())
    rows = logprobs_cost(eng, batches=(1, 8), reps=2, new=8)
    assert [r["batch"] for r in rows] == [1, 8]
    for r in rows:
        assert len(r["on_all"]) == len(r["off_all"]) == 2
        assert r["op_ms"] > 0 and r["graph_ms"] > 0 and r["step_ms_on"] > 0 and r["step_ms_off"] > 0
    assert sum(eng.runner.replays.values()) > replays
    assert eng.kv_blocks_used() == 0
