"""The constrained-neighbours bench (nanoqwen_bench.engine.bench_mask) on the CPU, with the CUDA
engine's code on the torch backend and the tiny test model: all three sides ran full-batch steps, the
constrained side was masked by llguidance on the host, and its steps went ahead with their masks
taken after their forward (the overlap the bench measures is the path that ran)."""

from __future__ import annotations

from nanoqwen_bench.engine.bench_mask import constrained_neighbours
from nanoqwen_runtime.engine import Engine, EngineConfig
from nanoqwen_runtime.testing import write_tiny_container


def test_constrained_neighbours_runs_each_side(tmp_path):
    path = write_tiny_container(tmp_path / "tiny.nanoqwen", seed=1)
    engine = Engine.from_file(path, EngineConfig(device="cpu", backend="torch", mode="eager", num_blocks=96,
                                                 max_model_len=256, prefill_chunk=256, max_batch=8,
                                                 prefix_caching=False))
    row = constrained_neighbours(engine, batch=4, new=10, reps=1)
    assert row["batch"] == 4 and all(len(v) == 1 and v[0] > 0 for v in row["all_ms"].values())
    assert all(n > 0 for n in row["full_steps"].values()), row["full_steps"]
    assert row["steps_ahead_masked"] > 0 and row["host_mask_ms"] > 0
    assert engine.config.overlap and engine.kv_blocks_used() == 0
