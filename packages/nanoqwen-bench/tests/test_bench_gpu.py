"""GPU: the engine benchmark's own machinery on a small model, before it meets the 7B run: the per-op
CUDA-event profile of eager decode steps (kernel backend: every launch is marked, the bf16 lm_head is
cuBLAS, the host queued every chunk before its GPU-side wait ended) and the memory report of a
graph-mode engine (the dense cache and the graph capture are counted)."""

from __future__ import annotations

import pytest
import torch
from nanoqwen_bench.engine.bench import bytes_per_token, decode_at_context, memory
from nanoqwen_bench.engine.bench_profile import LIBRARY, profile_decode_ops
from nanoqwen_bench.engine.bench_report import REQUIRED_KEYS, build_report, markdown
from nanoqwen_model import QWEN25_CODER_7B
from nanoqwen_runtime.engine import Engine, EngineConfig
from nanoqwen_runtime.engine.synthetic import random_weights

pytestmark = pytest.mark.gpu
GEOM = QWEN25_CODER_7B.with_(num_hidden_layers=2)  # 7B layer shapes, 2 layers


@pytest.fixture(scope="module")
def weights():
    return random_weights(GEOM, "cuda", seed=3)


def test_profile_of_eager_decode_steps(weights):
    eng = Engine(GEOM, weights, EngineConfig(kv_memory_bytes=1 << 30, max_model_len=2048, mode="eager",
                                             dense_weight_cache=False, overlap=False))
    p = profile_decode_ops(eng, steps=3, prompt=64)
    assert eng.kv_blocks_used() == 0 and eng.runner.ops is eng.ops
    assert p["starved_chunks"] == 0, p  # every chunk was queued before its wait ended
    ops = {o["op"]: o for o in p["ops"]}
    # qkv: layer 0 after a plain RMSNorm of the embeddings, layer 1 with the norm as its prologue
    assert ops["linear qkv + rope/KV write (after RMSNorm)"]["calls_per_step"] == 1
    assert ops["linear qkv + rope/KV write (RMSNorm fused)"]["calls_per_step"] == 1
    assert ops["linear gate_up (RMSNorm fused)"]["calls_per_step"] == 2
    assert ops["linear lm_head"]["calls_per_step"] == 1
    # per layer: qkv (norm prologue but layer 0, RoPE + the K/V write fused), attention (+ the combine
    # kernel when the plan splits more ways than it merges in-kernel), o (adding into the residual),
    # gate_up (norm prologue), down (SiLU*mul fused, adding into the residual); per step: embedding,
    # layer 0's input norm, final norm, sampling; the bf16 lm_head is one cuBLAS call and the logits'
    # range (the NaN/Inf check) one torch reduction
    bucket = min(b for b, _ in eng.ops.decode_plans)  # the batch-1 step's plan (ops.attention_plan)
    plan = eng.ops.decode_plans[(bucket, eng.runner.context_class(64 + 3))]
    # a plan that splits into at most 16 leaves its merge to the o_proj GEMV: no combine launch, the
    # GEMV's `_merge_` build instead
    deferred = int(plan.can_defer_merge)
    assert p["kernel_launches_per_step"] == 4 + (4 + plan.launches - deferred) * 2
    kernels = {k["kernel"] for k in p["kernels"]}
    assert ("paged_attention_combine_hd128" in kernels) == (plan.launches - deferred == 2), sorted(kernels)
    assert any("_merge_hd128" in k for k in kernels) == bool(deferred), sorted(kernels)
    assert any(k.endswith("_rope") for k in kernels) and "qkv_rope_kv_write_bf16" not in kernels
    assert p["library_calls_per_step"] == 2 and any(k["kernel"] == LIBRARY for k in p["kernels"])
    assert ops["logits_range"]["calls_per_step"] == 1
    assert all(o["us_per_step"] > 0 for o in p["ops"])
    lm = ops["linear lm_head"]
    assert lm["bytes_per_step"] >= GEOM.vocab_size * GEOM.hidden_size * 2
    assert lm["bytes_per_step"] / (lm["us_per_step"] * 1e-6) < 10e12  # no impossible bandwidth


@pytest.mark.parametrize("batch", [16, 33])
def test_profile_of_batched_eager_decode_steps_runs_the_int4_gemm(weights, batch):
    """A batched profile times decode steps of `batch` rows, and its kernel list says which path ran:
    the INT4 GEMM for the layer linears (M > 8), on the kernel the planner picks for each shape (the
    mma.sync family `gemm`, or `gemm_ws` where gemm.MEASURED_PLANS picks it), no decode GEMV; the engine
    is left idle."""
    from nanoqwen_kernels.gemm import KERNELS, plan_gemm

    eng = Engine(GEOM, weights, EngineConfig(kv_memory_bytes=1 << 30, max_model_len=2048, mode="eager",
                                             dense_weight_cache=False, overlap=False))
    p = profile_decode_ops(eng, steps=3, prompt=64, batch=batch)
    assert p["batch"] == batch and eng.kv_blocks_used() == 0 and not eng.has_work
    kernels = {k["kernel"]: k for k in p["kernels"]}
    gemm = [k for k in kernels if k.startswith(("gemm_int4_", "gemm_ws_int4_"))]
    assert gemm and not any(k.startswith("gemv_int4_") for k in kernels), sorted(kernels)
    h, inter = GEOM.hidden_size, GEOM.intermediate_size
    shapes = [(GEOM.qkv_dim, h), (h, GEOM.q_dim), (2 * inter, h), (h, inter)]  # qkv, o, gate_up, down
    families = {KERNELS[plan_gemm(n, k, batch, 128).kernel][0] for n, k in shapes}
    assert {k.split("_int4_")[0] for k in gemm} == families, (sorted(gemm), families)
    # 2 layers x (qkv, o, gate_up, down), one launch each
    assert sum(kernels[k]["launches_per_step"] for k in gemm) == 4 * GEOM.num_hidden_layers
    ops = {o["op"]: o for o in p["ops"]}
    # above 8 rows the norm is its own fused add + RMSNorm launch, whose traffic the linear's op counts
    gate_up = ops["linear gate_up (after add + RMSNorm)"]
    assert gate_up["bytes_per_step"] > batch * GEOM.hidden_size * 2  # x of every row read


def test_memory_report_and_report_of_a_graph_engine(weights):
    torch.cuda.reset_peak_memory_stats()
    eng = Engine(GEOM, weights, EngineConfig(kv_memory_bytes=1 << 30, max_model_len=2048))
    d = decode_at_context(eng, 100, 16)
    m = memory(eng)
    assert m["kv_pool_bytes"] == eng.num_blocks * GEOM.kv_bytes_per_token() * 16
    # no bf16 copy by default: the weights on the GPU are the container's tensors, padding
    # of the loader's buffer aside (256-byte alignment per tensor: far under 5%)
    assert m["dense_cache_bytes"] == 0
    assert m["weights_gpu_bytes"] == m["weight_buffer_bytes"]
    assert m["container_bytes"] <= m["weight_buffer_bytes"] <= 1.05 * m["container_bytes"]
    # capture took from torch's pool, never gave back (the device's free memory is not checked: other
    # processes on the GPU, such as parallel test workers, move it during the capture)
    assert m["graph_pool_bytes"] >= 0
    assert m["peak_allocated_bytes"] >= m["kv_pool_bytes"] + m["weight_buffer_bytes"]
    raw = {"meta": {"device": torch.cuda.get_device_name()}, "memory": m, "decode_batched": [],
           "prefill": [], "eager": [],
           "decode_batch1": [dict(d, bytes_per_token_parts=bytes_per_token(eng, 100))]}
    rep = build_report(raw)
    assert set(REQUIRED_KEYS) <= set(rep) and rep["decode_batch1"][0]["bytes_per_token"] > 0
    assert "| 100 |" in markdown(rep)
