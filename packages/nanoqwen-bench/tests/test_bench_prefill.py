"""The prefill breakdown (bench_prefill): the GPU-busy union on CPU; on the GPU, one breakdown of a
2-layer 7B-shaped engine whose prefill runs the INT4 GEMM's prefill plan."""

from __future__ import annotations

import pytest
import torch
from nanoqwen_bench.engine.bench_prefill import busy_union


def test_busy_union_counts_overlaps_once_and_gaps_not_at_all():
    assert busy_union([]) == 0.0
    assert busy_union([(0.0, 10.0)]) == 10.0
    # unsorted, nested, touching and disjoint intervals: [0, 12) + [20, 25)
    spans = [(20.0, 25.0), (5.0, 12.0), (0.0, 10.0), (2.0, 3.0), (12.0, 12.0)]
    assert busy_union(spans) == 17.0


@pytest.mark.gpu
def test_prefill_breakdown_on_the_int4_prefill_gemm():
    from nanoqwen_bench.engine.bench_prefill import prefill_breakdown
    from nanoqwen_model import QWEN25_CODER_7B
    from nanoqwen_runtime.engine import Engine, EngineConfig
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
    assert any("gemm_ws_int4" in k["name"] for k in r["top_kernels"]), r["top_kernels"]
    torch.cuda.synchronize()
