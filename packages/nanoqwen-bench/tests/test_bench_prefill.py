"""The prefill breakdown (bench_prefill): the GPU-busy union and the queueing timer on CPU; on the GPU,
one breakdown of a 2-layer 7B-shaped engine whose prefill runs the INT4 GEMM's prefill plan."""

from __future__ import annotations

import pytest
import torch
from nanoqwen_bench.engine.bench_prefill import _prefill_step_s, busy_union
from nanoqwen_model import Qwen2Config
from nanoqwen_runtime.engine import Engine, EngineConfig
from nanoqwen_runtime.engine.synthetic import write_container


def test_busy_union_counts_overlaps_once_and_gaps_not_at_all():
    assert busy_union([]) == 0.0
    assert busy_union([(0.0, 10.0)]) == 10.0
    # unsorted, nested, touching and disjoint intervals: [0, 12) + [20, 25)
    spans = [(20.0, 25.0), (5.0, 12.0), (0.0, 10.0), (2.0, 3.0), (12.0, 12.0)]
    assert busy_union(spans) == 17.0


def test_prefill_step_times_the_forwards_queueing_on_cpu(tmp_path):
    """The timer around ModelRunner.queue_forward, on the torch backend: one prefill step of a 40-token
    request (prefill chunk 48), its queueing inside its wall time, the runner's own method back after."""
    geom = Qwen2Config(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=32, intermediate_size=256, vocab_size=300, rope_theta=1e6, rms_norm_eps=1e-6,
                       max_position_embeddings=256, tie_word_embeddings=False, eos_token_id=(3,))
    eng = Engine.from_file(write_container(tmp_path / "t.nanoqwen", geom, seed=1),
                           EngineConfig(device="cpu", backend="torch", mode="eager", num_blocks=16,
                                        block_size=16, max_model_len=128, prefill_chunk=48, max_batch=2))
    wall, queued = _prefill_step_s(eng, 40, seed=5, rid="a")
    assert 0 < queued <= wall
    assert "queue_forward" not in vars(eng.runner) and eng.num_steps["prefill"] == 1
    assert eng.kv_blocks_used() == 0


@pytest.mark.gpu
def test_prefill_breakdown_on_the_int4_prefill_gemm():
    from nanoqwen_bench.engine.bench_prefill import prefill_breakdown
    from nanoqwen_model import QWEN25_CODER_7B
    from nanoqwen_runtime.engine.synthetic import random_weights

    geom = QWEN25_CODER_7B.with_(num_hidden_layers=2)
    eng = Engine(geom, random_weights(geom, "cuda", seed=3),
                 EngineConfig(kv_memory_bytes=1 << 30, max_model_len=2048, prefix_caching=False,
                              speculation=None))
    before = eng.ops.paths["int4_gemm_wgmma128"]
    r = prefill_breakdown(eng, 300, reps=2)
    # 300 rows: every layer linear on the wgmma GEMM's prefill plan (4 steps: warm-up, 2 timed, profiled)
    assert eng.ops.paths["int4_gemm_wgmma128"] - before == 4 * 2 * 4
    assert eng.kv_blocks_used() == 0
    assert r["launches"] >= 4 * 2 and len(r["wall_ms_all"]) == 2
    assert 0 < r["busy_ms"] <= r["span_ms"] + 1e-6 and r["busy_ms"] <= r["kernel_ms"] + 1e-6
    assert r["busy_ms"] < r["profiled_wall_ms"]  # the GPU's work lies inside the step it was timed in
    assert 0 < r["enqueue_ms"] < r["wall_ms"]  # queueing the forward is part of the step
    assert "queue_forward" not in vars(eng.runner)  # the timer is gone again
    assert any("gemm_ws_int4" in k["name"] for k in r["top_kernels"]), r["top_kernels"]
    torch.cuda.synchronize()
