"""CPU tests of the engine benchmark without a GPU: the schema of bench.json built from made-up numbers
(full, partial, and with `--model FILE`), the markdown of each, and the measuring sections (decode,
prefill, bytes per token, memory report, the per-op event profile with host-clock events) on a tiny
model through the torch op backend."""

from __future__ import annotations

import json
import math
import statistics
import time

import pytest
import torch
from nanoqwen_bench.engine import bench, bench_profile
from nanoqwen_bench.engine.bench_report import (
    DECODE1_KEYS,
    MEMORY_KEYS,
    REQUIRED_KEYS,
    build_report,
    markdown,
    write_report,
)
from nanoqwen_model import Qwen2Config
from nanoqwen_runtime.engine import Engine, EngineConfig
from nanoqwen_runtime.engine.synthetic import random_weights, write_container

TINY = Qwen2Config(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=64, intermediate_size=384, vocab_size=512, rope_theta=1e6, rms_norm_eps=1e-6,
                   max_position_embeddings=512, tie_word_embeddings=False, eos_token_id=(3,))
READ_BPS, COPY_BPS = 4.8e12, 4.2e12
PARTS = {"int4_words": 3_262_000_000, "int4_scales": 102_000_000, "lm_head": 1_090_000_000,
         "norms_bias_embed": 700_000, "kv": 7_300_000, "logits_and_activations": 600_000}


def fake_raw(**extra) -> dict:
    """Raw measurements shaped as bench.run_bench collects them, with made-up numbers."""
    dec = [{"context": c, "batch": 1, "new_tokens": 128, "engine_tok_s": 400.0 - c / 100, "prefill_s": 0.01,
            "ttft_s": 0.02, "graph_replay_s": 1 / (423.0 - c / 100), "graph_tok_s": 423.0 - c / 100,
            "context_class": 512, "bytes_per_token_parts": dict(PARTS, kv=c * 57344)} for c in (128, 4096)]
    raw = {
        "meta": {"command": "nanoqwen-cli bench", "device": "NVIDIA H200", "date": "2026-12-01 10:00 UTC",
                 "torch": "2.11.0", "python": "3.12.3", "model": "synthetic"},
        "read_bandwidth": {"bytes_per_s": READ_BPS, "nbytes": 4 << 30, "reps": 30, "median_s": 9e-4,
                           "min_s": 8.9e-4, "max_s": 9.2e-4},
        "copy_bandwidth_Bps": COPY_BPS,
        "memory": {"container_bytes": 5_550_000_000, "weight_buffer_bytes": 5_560_000_000,
                   "dense_cache_bytes": 13_000_000_000, "weights_gpu_bytes": 18_560_000_000,
                   "kv_pool_bytes": 24 << 30, "workspace_bytes": 400_000_000, "graph_pool_bytes": 50_000_000,
                   "graph_device_bytes": 80_000_000, "allocated_bytes": 45_000_000_000,
                   "peak_allocated_bytes": 46_000_000_000, "reserved_bytes": 47_000_000_000,
                   "device_total_bytes": 150_000_000_000},
        "decode_batch1": dec,
        "decode_batched": [{"context": 128, "batch": b, "engine_tok_s": 400.0 * b ** 0.8,
                            "graph_tok_s": 423.0 * b ** 0.8} for b in (1, 8, 32, 64)],
        "prefill": [{"prompt": n, "prefill_s": n / 4e4, "prefill_tok_s": 4e4, "ttft_s": n / 4e4}
                    for n in (512, 4096)],
        "ttft_2k": {"prompt": 2048, "prefill_s": 0.0435, "prefill_tok_s": 47000.0, "ttft_s": 0.0435},
        "eager": [{"context": 128, "batch": b, "engine_tok_s": 100.0 * b} for b in (1, 8)],
        "profile": {"steps": 5, "context": 131, "spin_ns": 20_000_000, "spin_every_marks": 64, "chunks": 25,
                    "starved_chunks": 0, "chunk_host_s_max": 0.004, "kernel_launches_per_step": 258,
                    "library_calls_per_step": 1, "launches_per_step": 259, "kernel_us_per_step": 2380.0,
                    "ops": [{"op": "linear gate_up", "calls_per_step": 28, "us_per_step": 760.0,
                             "bytes_per_step": 1_950_000_000},
                            {"op": "linear lm_head", "calls_per_step": 1, "us_per_step": 248.0,
                             "bytes_per_step": 1_090_000_000}],
                    "kernels": [{"kernel": "gemv_int4_g128_sym", "launches_per_step": 84,
                                 "us_per_step": 1300.0},
                                {"kernel": "<torch/cuBLAS>", "launches_per_step": 1, "us_per_step": 248.0}]},
        "engine_start_s": 10.0, "num_kv_blocks": 28086, "kv_blocks_used_after": 0,
    }
    raw.update(extra)
    return raw


def check_schema(rep: dict) -> None:
    """The keys bench.json promises, with the types a reader relies on."""
    assert set(REQUIRED_KEYS) <= set(rep), set(REQUIRED_KEYS) - set(rep)
    assert set(MEMORY_KEYS) <= set(rep["memory"])
    for r in rep["decode_batch1"]:
        assert set(DECODE1_KEYS) <= set(r)
    for r in rep["decode_batched"]:
        assert {"batch", "engine_tok_s", "graph_tok_s"} <= set(r)
    for r in rep["prefill"]:
        assert {"prompt_tokens", "tok_s"} <= set(r)
    json.loads(json.dumps(rep))  # plain JSON, nothing that needs default=str


def test_report_schema_and_ratios_from_fake_numbers(tmp_path):
    raw = fake_raw()
    rep = build_report(raw)
    check_schema(rep)
    assert rep["read_bandwidth_GBps"] == pytest.approx(4800)
    assert rep["copy_bandwidth_GBps"] == pytest.approx(4200)
    r = rep["decode_batch1"][0]
    total = sum(raw["decode_batch1"][0]["bytes_per_token_parts"].values())
    assert r["bytes_per_token"] == total
    assert r["roofline_frac_read"] == pytest.approx(r["graph_tok_s"] * total / READ_BPS)
    assert r["roofline_frac_copy"] == pytest.approx(r["graph_tok_s"] * total / COPY_BPS)
    assert r["roofline_frac_read"] < r["roofline_frac_copy"]  # reading alone is faster than copying
    assert r["roofline_frac_read_engine"] == pytest.approx(r["engine_tok_s"] * total / READ_BPS)
    assert rep["memory"]["weights_gpu_bytes"] == 18_560_000_000
    assert rep["ttft_2k_ms"] == pytest.approx(43.5) and rep["launches_per_decode_step"] == 259
    assert [p["prompt_tokens"] for p in rep["prefill"]] == [512, 4096]
    prof = rep["profile"]
    assert prof["graph_replay_us"] == pytest.approx(1e6 / (423.0 - 1.28))
    assert prof["gap_us"] == pytest.approx(prof["graph_replay_us"] - 2380.0)
    gu = prof["ops"][0]
    assert gu["GBps"] == pytest.approx(1.95e9 / 760e-6 / 1e9)
    assert gu["frac_read"] == pytest.approx(gu["GBps"] / 4800)
    write_report(rep, tmp_path, plots=False)
    assert json.loads((tmp_path / "bench.json").read_text()) == rep
    md = (tmp_path / "bench.md").read_text()
    assert "read bandwidth (the roofline" in md and ": 4800 GB/s" in md and "copy bandwidth" in md
    assert "| 128 | 422 | 399 | 4.46 GB |" in md  # graph, engine, bytes per token
    assert "| weights on GPU (buffer + dense cache) | 18.56 GB |" in md and "| KV pool |" in md
    assert "| linear gate_up | 28 | 760.0 | 1950.0 |" in md and "259 launches per step" in md
    assert "Errors" not in md and "WARNING" not in md


def test_report_with_model_file_renders():
    """`--model FILE` stores the model's LoadStats; markdown() once raised KeyError 'file_bytes' on it."""
    stats = {"path": "/m/q.nanoqwen", "nbytes": 5_550_000_000, "seconds": 1.1, "verify_seconds": 0.0,
             "verify_wait_seconds": 0.0, "finite_seconds": 0.0, "total_seconds": 1.2, "verified": False,
             "upload_GBps": 5.0}
    load_test = {"file_bytes": 5_550_000_000, "write_s": 30.0,
                 "plain": {"total_seconds": 1.12, "upload_GBps": 5.0, "verify_seconds": 0.0,
                           "verified": False},
                 "verify": {"total_seconds": 1.29, "upload_GBps": 4.6, "verify_seconds": 0.83,
                            "verify_wait_seconds": 0.09, "finite_seconds": 0.004, "verified": True}}
    raw = fake_raw(model_load=stats, load_test=load_test)
    raw["meta"].update(command="nanoqwen-cli bench --model /m/q.nanoqwen", model="/m/q.nanoqwen")
    rep = build_report(raw)
    check_schema(rep)
    md = markdown(rep)
    assert "## Loading the model" in md and "5.55 GB from /m/q.nanoqwen: 1.20 s" in md
    assert "5.55 GB from /m/q.nanoqwen: 1.20 s (upload 1.10 s; not verified)" in md
    assert ("with --no-verify 1.12 s (upload 5.0 GB/s); verified (the default) 1.29 s (upload 4.6 GB/s; "
            "checksums hashed in 0.83 s beside the copies, upload waited 0.09 s for them; "
            "NaN/Inf check 0.004 s)") in md


def test_partial_report_has_every_key():
    """A run cut short (or every section failed) still writes a complete document."""
    raw = {"meta": {"device": "NVIDIA H200", "date": "d"}, "decode_batch1": [], "decode_batched": [],
           "prefill": [], "eager": [], "errors": {"read_bandwidth": "RuntimeError: x", "profile": "E: y"},
           "profile": None}
    rep = build_report(raw)
    check_schema(rep)
    assert rep["read_bandwidth_GBps"] is None and rep["launches_per_decode_step"] is None
    assert rep["ttft_2k_ms"] is None and all(v is None for v in rep["memory"].values())
    md = markdown(rep)
    assert "- read_bandwidth: RuntimeError: x" in md
    # a decode row measured before the bandwidth failed: no ratios, still rendered
    raw["decode_batch1"] = fake_raw()["decode_batch1"][:1]
    rep = build_report(raw)
    assert rep["decode_batch1"][0]["roofline_frac_read"] is None and "| 128 | 422 |" in markdown(rep)


def test_lm_head_ab_is_reported_with_each_sides_roofline_fraction():
    """The synthetic run's int4-vs-bf16 lm_head section reaches bench.json and bench.md: each side's graph
    replay as a fraction of the read roofline from its own bytes per token (the 900 tok/s goal),
    and the int4 side's lm_head path from its graph's counters."""
    row = {"batch": 1, "a_tok_s": 520.0, "b_tok_s": 470.0, "a_over_b": 520 / 470, "spread_a": 0.01,
           "spread_b": 0.02, "a_all": [520.0] * 4, "b_all": [470.0] * 4, "a_slower": False,
           "a_graph_tok_s": 530.0, "b_graph_tok_s": 480.0}
    raw = fake_raw()
    raw["lm_head_ab"] = {"rows": [row], "reps": 4, "a": "int4", "b": "bf16", "context": 128,
                         "new_tokens": 128, "bytes_per_token_a": 3.66e9, "bytes_per_token_b": 4.46e9,
                         "graph_paths_a": {"gemv_int4": 113, "attention": 28},
                         "graph_paths_b": {"gemv_int4": 112, "cublas_bf16": 1}}
    rep = build_report(raw)
    assert rep["lm_head_ab"]["bytes_per_token_a"] == 3.66e9
    md = markdown(rep)
    assert ("## INT4 lm_head (`nanoqwen-quant pack --lm-head int4`) vs bf16 (same run, context 128 + 128)"
            in md)
    assert "int4 3.660 GB, bf16 4.460 GB" in md and "batch-1 graph: gemv_int4 113." in md
    assert "| 1 | 520 | 470 | 1.106 | 1.0% / 2.0% | ok |" in md
    read = raw["read_bandwidth"]["bytes_per_s"]
    frac_a, frac_b = 100 * 530 * 3.66e9 / read, 100 * 480 * 4.46e9 / read
    assert f"| 1 | {frac_a:.1f}% | {frac_b:.1f}% |" in md


def test_lm_head_ab_builds_the_int4_side(monkeypatch):
    """lm_head_ab: the int4-lm_head weights (a) against the bf16 ones (b), both features off."""
    import types

    built = []

    def ab_engine(geom, weights, **cfg):
        built.append((weights.lm_head, cfg))
        runner = types.SimpleNamespace(context_class=lambda ctx: 512,
                                       graph_paths={(1, 512): {"n": len(built)}})
        return types.SimpleNamespace(runner=runner)

    monkeypatch.setattr(bench, "_ab_engine", ab_engine)
    monkeypatch.setattr(bench, "ab_decode", lambda a, b, batches, reps: [{"batch": x} for x in batches])
    monkeypatch.setattr(bench, "bytes_per_token", lambda engine, ctx: {"all": 1})
    monkeypatch.setattr(bench.torch.cuda, "empty_cache", lambda: None)
    weights = random_weights(TINY, "cpu", seed=1)
    off = {"prefix_caching": False, "speculation": None}
    lh = bench.lm_head_ab(TINY, weights, batches=(1,), reps=2)
    (head_a, cfg_a), (head_b, cfg_b) = built
    assert cfg_a == cfg_b == off
    assert head_b is weights.lm_head and head_a is not weights.lm_head and head_a.n == TINY.vocab_size
    assert lh["rows"] == [{"batch": 1}]
    assert (lh["graph_paths_a"], lh["graph_paths_b"]) == ({"n": 1}, {"n": 2})


# ---------------------------------------------------------------------------------------------------
# the measuring sections on a tiny model (torch op backend, CPU)
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_container(tmp_path_factory.mktemp("bench") / "tiny.nanoqwen", TINY, seed=1)


def cpu_engine(path) -> Engine:
    cfg = EngineConfig(device="cpu", backend="torch", mode="eager", num_blocks=64, block_size=16,
                       max_model_len=256, prefill_chunk=48, max_batch=8, overlap=False)
    return Engine.from_file(path, cfg)


class HostEvent:
    """Stands in for torch.cuda.Event on the CPU: record() reads the host clock."""

    def record(self):
        self.t = time.perf_counter()

    def elapsed_time(self, other) -> float:
        return (other.t - self.t) * 1e3


def test_layout_speed_compares_asym_with_sym_on_cpu(monkeypatch):
    """The synthetic run's asym-vs-sym section on the torch backend: the default layout's weights carry
    a zero point per group (uint8 in {7, 8, 9}), the other side none; both sides measured `reps` times
    alternately; the bytes per token differ by exactly the zero points (one byte per group)."""
    from nanoqwen_runtime.engine.synthetic import random_weights

    def ab_engine(geom, weights, **cfg):
        return Engine(geom, weights, EngineConfig(device="cpu", backend="torch", mode="eager", num_blocks=64,
                                                  block_size=16, max_model_len=256, prefill_chunk=48,
                                                  max_batch=8, **cfg))

    monkeypatch.setattr(bench, "_ab_engine", ab_engine)
    asym = random_weights(TINY, "cpu", seed=0, symmetric=False)
    z = asym.layers[0].qkv.zeros
    assert z.dtype == torch.uint8 and set(z.unique().tolist()) <= {7, 8, 9} and len(z.unique()) > 1
    real_decode = bench.decode_at_context
    monkeypatch.setattr(bench, "decode_at_context",
                        lambda e, ctx, new, batch=1, seed=0: real_decode(e, 16, 6, batch=batch, seed=seed))
    out = bench.layout_speed(TINY, asym, batches=(1, 2), reps=2)
    assert [r["batch"] for r in out["rows"]] == [1, 2]
    assert all(len(r["a_all"]) == len(r["b_all"]) == 2 for r in out["rows"])
    groups = sum(lin.zeros.numel() for layer in asym.layers
                 for lin in (layer.qkv, layer.o_proj, layer.gate_up, layer.down))
    assert out["weight_bytes_a"] - out["weight_bytes_b"] == groups


def test_overlap_ab_on_cpu_reaches_the_report(monkeypatch):
    """The synthetic run's overlap-vs-synchronous section on the torch backend: both sides measured
    `reps` times alternately, only the overlap engine queued steps ahead; bench.md shows the table and
    each side's engine / graph ratio (no graph on the CPU: '-')."""
    from nanoqwen_runtime.engine.synthetic import random_weights

    def ab_engine(geom, weights, **cfg):
        return Engine(geom, weights, EngineConfig(device="cpu", backend="torch", mode="eager", num_blocks=64,
                                                  block_size=16, max_model_len=256, prefill_chunk=48,
                                                  max_batch=8, **cfg))

    monkeypatch.setattr(bench, "_ab_engine", ab_engine)
    real_decode = bench.decode_at_context
    monkeypatch.setattr(bench, "decode_at_context",
                        lambda e, ctx, new, batch=1, seed=0: real_decode(e, 16, 8, batch=batch, seed=seed))
    out = bench.overlap_ab(TINY, random_weights(TINY, "cpu", seed=0), batches=(1, 3), reps=2)
    assert [r["batch"] for r in out["rows"]] == [1, 3]
    assert all(len(r["a_all"]) == len(r["b_all"]) == 2 for r in out["rows"])
    assert out["steps_ahead_off"] == 0 and 0 < out["steps_ahead_on"] < out["decode_steps_on"]
    raw = fake_raw()
    raw["overlap_ab"] = out
    md = markdown(build_report(raw))
    assert "## Overlapped decode (EngineConfig.overlap) vs synchronous steps" in md
    assert f"queued {out['steps_ahead_on']} of its {out['decode_steps_on']} decode steps ahead" in md
    assert "| 3 | - | - | - | - | - |" in md


def test_sections_on_cpu_feed_the_report(tiny_path, tmp_path):
    engine = cpu_engine(tiny_path)
    d = bench.decode_at_context(engine, 40, 12, batch=2)
    assert d["engine_tok_s"] > 0 and d["prefill_s"] > 0 and "graph_tok_s" not in d
    p = bench.prefill_rate(engine, 100)
    assert p["prefill_tok_s"] > 0 and p["reps"] == bench.PREFILL_REPS == len(p["prefill_s_all"])
    assert p["prefill_s"] == statistics.median(p["prefill_s_all"])
    assert p["prefill_tok_s"] == 100 / p["prefill_s"]
    assert engine.stats().prefix_hit_tokens == 0  # each repeat a fresh prompt: no prefix-cache hit
    parts = bench.bytes_per_token(engine, 128)
    assert parts["int4_words"] > 0 and parts["kv"] == 128 * TINY.kv_bytes_per_token()
    mem = engine.memory_report()
    assert mem.kv_pool_bytes == 64 * TINY.kv_bytes_per_token() * 16
    assert 0 < mem.container_bytes <= mem.weight_buffer_bytes  # the loader's buffer holds padding too
    assert mem.weights_gpu_bytes == mem.weight_buffer_bytes and mem.dense_cache_bytes == 0
    assert mem.workspace_bytes > 0 and mem.graph_pool_bytes == 0

    spins = []
    tl = bench_profile.Timeline(event_factory=HostEvent, spin_fn=spins.append)
    prof = bench_profile.profile_decode_ops(engine, steps=3, prompt=20, timeline=tl)
    assert engine.kv_blocks_used() == 0 and engine.runner.ops is engine.ops  # left as found
    # the warm-up wait first (0 ns: it only loads the kernel), then the timed chunks' waits
    assert spins[0] == 0 and spins[1:] and all(ns >= bench_profile.SPIN_MIN_NS for ns in spins[1:])
    ops = {o["op"]: o for o in prof["ops"]}
    L = TINY.num_hidden_layers
    # the torch backend fuses no norm: layer 0's input norm is an RMSNorm, the others add + RMSNorm
    assert ops["linear qkv + rope/KV write (after RMSNorm)"]["calls_per_step"] == 1
    assert ops["linear qkv + rope/KV write (after add + RMSNorm)"]["calls_per_step"] == L - 1
    assert ops["linear gate_up (after add + RMSNorm)"]["calls_per_step"] == L
    assert ops["linear o_proj + residual"]["calls_per_step"] == L
    assert ops["add_rms_norm"]["calls_per_step"] == 1  # the final norm, of the last down's pending add
    assert ops["linear lm_head"]["calls_per_step"] == 1
    assert ops["attention"]["calls_per_step"] == L and ops["sample"]["calls_per_step"] == 1
    assert all(o["us_per_step"] >= 0 for o in prof["ops"])
    assert ops["linear lm_head"]["bytes_per_step"] >= TINY.vocab_size * TINY.hidden_size * 2
    # the torch backend launches no nanoqwen kernel: every op call counts as one library call
    calls = sum(o["calls_per_step"] for o in prof["ops"])
    assert prof["kernel_launches_per_step"] == 0 and prof["launches_per_step"] == calls
    assert prof["kernel_us_per_step"] > 0 and prof["steps"] == 3 and prof["starved_chunks"] <= prof["chunks"]

    raw = fake_raw(profile=prof, memory=bench.asdict(mem) | {"weights_gpu_bytes": mem.weights_gpu_bytes})
    raw["decode_batch1"] = [dict(d, graph_tok_s=10.0, graph_replay_s=0.1, context=128, batch=1,
                                 bytes_per_token_parts=parts)]
    raw["decode_batched"], raw["prefill"], raw["eager"] = [dict(d, graph_tok_s=10.0)], [p], [d]
    rep = build_report(raw)
    check_schema(rep)
    assert rep["launches_per_decode_step"] == calls
    assert math.isfinite(rep["profile"]["gap_us"])
    write_report(rep, tmp_path)
    md = (tmp_path / "bench.md").read_text()
    assert "| linear qkv + rope/KV write (after add + RMSNorm) | 1 |" in md
    pytest.importorskip("matplotlib")
    assert (tmp_path / "tok_s_vs_batch.png").stat().st_size > 1000


def test_patch_launches_marks_and_restores(monkeypatch):
    """Every nanoqwen_kernels module's `launch` is wrapped while profiling and restored afterwards."""
    from nanoqwen_kernels import gemv, layer_ops
    from nanoqwen_kernels import launch as klaunch

    seen = []
    monkeypatch.setattr(klaunch, "launch", lambda fam, kernel, *a, **k: seen.append(kernel))
    monkeypatch.setattr(gemv, "launch", klaunch.launch)
    monkeypatch.setattr(layer_ops, "launch", klaunch.launch)
    original = klaunch.launch
    tl = bench_profile.Timeline(event_factory=HostEvent, spin_fn=lambda ns: None)
    tl.begin_step()
    undo = bench_profile.patch_launches(tl)
    try:
        assert gemv.launch is not original and gemv.launch is klaunch.launch is layer_ops.launch
        tl.op = "linear qkv"
        gemv.launch("gemv", "gemv_int4_g128_sym", 0, (1,), (1,), ())
        tl.suspended = True
        layer_ops.launch("bench", "spin_ns", 0, (1,), (1,), ())
    finally:
        undo()
    assert seen == ["gemv_int4_g128_sym", "spin_ns"]  # both ran; only the first was marked
    assert [(op, k) for _, op, k in tl.marks] == [("linear qkv", "gemv_int4_g128_sym")]
    assert gemv.launch is original and layer_ops.launch is original and klaunch.launch is original


def test_profile_marks_every_launch_of_the_kernel_backend(tiny_path, monkeypatch):
    """The kernel backend without a GPU (as test_engine_cpu's plumbing test: device checks and launches
    replaced, attention plans faked): every nanoqwen launch of a decode step is marked and counted, the
    bf16 lm_head (torch.mm here, cuBLAS on the GPU) is the one library call, the GPU-side waits are
    not counted as kernels, and every patched `launch` is restored."""
    import nanoqwen_kernels.attention as kattn
    import nanoqwen_kernels.gemm as kgemm
    import nanoqwen_kernels.gemv as kgemv
    import nanoqwen_kernels.layer_ops as kops
    import nanoqwen_kernels.sampling as ksamp
    from nanoqwen_kernels import launch as klaunch
    from nanoqwen_runtime.engine import ops_kernels
    from nanoqwen_runtime.engine.engine import Engine as EngineCls
    from nanoqwen_runtime.engine.loader import load

    def recorded(family, kernel, *args, **kw):
        launched.append(kernel)

    launched: list[str] = []
    monkeypatch.setattr(klaunch, "launch", recorded)
    for mod in (kops, ksamp, kgemv, kgemm):  # (the 20-token prefill runs the INT4 GEMM)
        monkeypatch.setattr(mod, "require_sm90", lambda device: 0)
        monkeypatch.setattr(mod, "launch", recorded)
    monkeypatch.setattr(kgemv, "_sm_count", lambda index: 132)
    monkeypatch.setattr(ops_kernels.klaunch, "require_sm90", lambda device: 0)

    class FakePlan:
        def __init__(self, mode):
            self.mode = mode
            self.can_defer_merge = False  # one launch per attention run: no split rows to merge

        def run(self, *args, **kw):  # the real plan launches through launch.launch too
            klaunch.launch("attention", f"paged_attention_{self.mode}", 0, (1,), (1,), ())

    monkeypatch.setattr(kattn, "plan_decode", lambda g, **kw: FakePlan("decode"))
    monkeypatch.setattr(kattn, "plan_prefill", lambda g, **kw: FakePlan("prefill"))
    monkeypatch.setattr("nanoqwen_runtime.engine.engine.make_ops",
                        lambda config, geom: ops_kernels.KernelOps(geom, config, torch.device("cpu")))
    m = load(tiny_path, "cpu")
    cfg = EngineConfig(device="cpu", backend="torch", mode="eager", num_blocks=64, block_size=16,
                       max_model_len=256, prefill_chunk=48, max_batch=8, dense_weight_cache=False,
                       overlap=False)
    cfg.backend = "kernels"  # after validation: the launches are mocked, so CPU tensors are fine
    engine = EngineCls(m.geometry, m.weights, cfg)

    def spin(ns):  # goes through launch() as nanoqwen_bench.gpu.spin does
        klaunch.launch("bench", "spin_ns", 0, (1,), (1,), ())

    tl = bench_profile.Timeline(event_factory=HostEvent, spin_fn=spin)
    p = bench_profile.profile_decode_ops(engine, steps=3, prompt=20, timeline=tl)
    L = TINY.num_hidden_layers
    kernels = {k["kernel"]: k["launches_per_step"] for k in p["kernels"]}
    # per layer: 4 GEMVs (qkv with the input norm as its prologue (but layer 0) and RoPE + the K/V
    # write as its epilogue, o adding into the residual, gate_up with the post-attention norm as its
    # prologue, down with SiLU*mul fused and adding into the residual), attention; per step:
    # embedding, layer 0's input norm, the final norm, sampling; torch/cuBLAS: the bf16 lm_head and
    # the logits' range (NaN check)
    assert p["kernel_launches_per_step"] == 4 + 5 * L and p["library_calls_per_step"] == 2
    assert p["launches_per_step"] == 6 + 5 * L
    assert kernels["gemv_int4_g128_sym_resid"] == L and kernels["gemv_int4_g128_sym_silu_resid"] == L
    assert kernels["gemv_int4_g128_sym_norm"] == L and kernels["gemv_int4_g128_sym_norm_rope"] == L - 1
    assert kernels["gemv_int4_g128_sym_rope"] == 1 and "qkv_rope_kv_write_bf16" not in kernels
    assert kernels["rms_norm_bf16"] == 2 and "fused_add_rms_norm_bf16" not in kernels
    assert kernels["paged_attention_decode"] == L and kernels[bench_profile.LIBRARY] == 2
    assert "spin_ns" not in kernels and launched.count("spin_ns") >= 3  # waits ran, were not counted
    assert engine.runner.ops is engine.ops
    assert klaunch.launch is recorded and kgemv.launch is recorded and kops.launch is recorded


def test_run_bench_end_to_end_on_cpu(tiny_path, tmp_path, monkeypatch):
    """`run_bench(model=FILE)` from start to report without a GPU: the device calls are stood in for
    (bandwidths, memory counters, CUDA events, the GPU-side wait), every engine is the tiny model on
    the torch backend, and the graph replay time is faked. Sections that cannot run on the tiny model
    (4K context, prefills of 512 and 4K, 2K TTFT: over its 512-token limit) must be recorded as errors
    while the rest completes and the report (json + md) is written with every key."""
    import nanoqwen_bench.gpu as kbench
    from nanoqwen_runtime.engine.engine import Engine as RealEngine

    def cpu_cfg(cfg):
        return EngineConfig(device="cpu", backend="torch", mode="eager", num_blocks=2048, block_size=16,
                            max_model_len=None, prefill_chunk=256, max_batch=64, dense_weight_cache=False,
                            prefix_caching=cfg.prefix_caching, speculation=cfg.speculation,
                            overlap=cfg.overlap)  # the bench's eager engine must be synchronous

    class CpuEngine(RealEngine):
        def __init__(self, geom, weights, config, **kw):
            super().__init__(geom, weights, cpu_cfg(config), **kw)

        @classmethod
        def from_file(cls, path, config=None, **kw):
            return super().from_file(path, cpu_cfg(config), **kw)

    real_decode = bench.decode_at_context

    def decode(engine, ctx, new, batch=1, seed=0):
        r = real_decode(engine, ctx, min(new, 8), batch=batch, seed=seed)  # fewer tokens: CPU time
        if engine is not eager_engine[0]:  # the "graph" engine: fake its replay
            r.update(graph_replay_s=batch / (1.1 * r["engine_tok_s"]), graph_tok_s=1.1 * r["engine_tok_s"])
        return r

    eager_engine = [None]
    real_profile = bench_profile.profile_decode_ops

    def profile(engine, steps, batch=1):
        eager_engine[0] = engine
        return real_profile(engine, steps=steps, prompt=20, batch=batch)

    monkeypatch.setattr(bench, "decode_at_context", decode)
    monkeypatch.setattr(bench_profile, "profile_decode_ops", profile)
    monkeypatch.setattr(bench, "copy_bandwidth", lambda device: COPY_BPS)
    monkeypatch.setattr(kbench, "read_bandwidth", lambda device: fake_raw()["read_bandwidth"])
    monkeypatch.setattr(kbench, "spin", lambda ns, device=None: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "fake GPU")
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 30, 2 << 30))
    monkeypatch.setattr(torch.cuda, "Event", lambda enable_timing=True: HostEvent())
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)

    # the eager engine is made second: mark it when it is built so `decode` leaves it eager
    class MarkingEngine(CpuEngine):
        def __init__(self, geom, weights, config, **kw):
            super().__init__(geom, weights, config, **kw)
            if config.mode == "eager":
                eager_engine[0] = self

        @classmethod
        def from_file(cls, path, config=None, **kw):  # run_bench's graph-mode engine
            eng = super().from_file(path, config, **kw)
            eager_engine[0] = None
            return eng

    monkeypatch.setattr(bench, "Engine", MarkingEngine)
    logs = []
    rep = bench.run_bench(model=str(tiny_path), out_dir=tmp_path, log=logs.append, quick=True,
                          profile_steps=2)
    check_schema(rep)
    assert set(rep["errors"]) == {"decode_ctx4096", "prefill512", "prefill4096", "ttft_2k"}, rep["errors"]
    assert [r["context"] for r in rep["decode_batch1"]] == [128]
    assert rep["decode_batch1"][0]["roofline_frac_read"] > 0
    assert [r["batch"] for r in rep["decode_batched"]] == [1, 8, 16, 32, 64]
    assert rep["prefill"] == [] and rep["ttft_2k_ms"] is None
    assert [r["batch"] for r in rep["eager"]] == [1, 8]
    assert rep["memory"]["kv_pool_bytes"] == 2048 * TINY.kv_bytes_per_token() * 16
    assert rep["launches_per_decode_step"] > 0 and rep["model_load"]["path"] == str(tiny_path)
    # per-op profiles of batched steps beside batch 1's (the per-kernel table)
    assert [p["batch"] for p in rep["profile_batched"]] == list(bench.PROFILE_BATCHES)
    assert all(p["ops"] and p["kernel_us_per_step"] > 0 for p in rep["profile_batched"])
    # features on vs off in the same run: both sides measured at every batch size, alternately
    fc = rep["features_cost"]
    assert [r["batch"] for r in fc["rows"]] == list(bench.FEATURES_BATCHES)
    for r in fc["rows"]:
        assert len(r["a_all"]) == len(r["b_all"]) == bench.AB_REPS
        assert r["a_over_b"] == pytest.approx(r["a_tok_s"] / r["b_tok_s"])
        assert r["a_slower"] == (max(r["a_all"]) < min(r["b_all"]))
    assert fc["regression"] == any(r["a_slower"] for r in fc["rows"])
    assert "layout_speed" not in rep  # a --model run has its own layout: no synthetic asym/sym comparison
    assert fc["on_engine_stats"]["prefix_queried_tokens"] > 0  # the "on" engine had its prefix cache on
    md = (tmp_path / "bench.md").read_text()
    assert "## Loading the model" in md and "## Errors" in md
    assert "| linear qkv + rope/KV write (after RMSNorm) |" in md
    assert "## Prefix caching + speculation on vs off" in md
    assert "## Time per op of a batch-1 decode step" in md
    assert "## Time per op of a batch-64 decode step" in md
    assert json.loads((tmp_path / "bench.json").read_text())["device"] == "fake GPU"


def test_profile_refuses_an_overlapped_engine(tiny_path):
    """An overlapped engine's step() returns with the step it queued still running: its marks are not
    complete when the profile reads them (an H100 run failed there), so the profile asks
    for a synchronous engine instead of timing half-finished steps."""
    cfg = EngineConfig(device="cpu", backend="torch", mode="eager", num_blocks=64, block_size=16,
                       max_model_len=256, prefill_chunk=48, max_batch=8)
    assert cfg.overlap  # the default
    with pytest.raises(ValueError, match="overlap=False"):
        bench_profile.profile_decode_ops(Engine.from_file(tiny_path, cfg), steps=1, prompt=20)
