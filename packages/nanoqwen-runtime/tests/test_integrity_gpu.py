"""GPU: integrity on the CUDA path (kernel backend, pinned staging, CUDA graphs). The CPU side of every
check is in test_integrity.py; here the same checks run where they differ:

- the loader hashes chunks from the pinned staging buffers on a worker thread while the DMA runs
  (small chunks: both staging buffers are reused many times) and counts NaN/Inf on the device;
- the logits' range is computed inside the captured decode graphs: a request whose logits turn
  non-finite at a replayed decode step, or at an eager prefill step, ends with FinishReason.ERROR and
  no token, greedy and sampled, in graph and eager mode;
- the cost of that reduction at batch 1 and 64 over the 7B's vocabulary.

Model: synthetic, Qwen2.5-Coder-0.5B layer shapes with 2 layers (real vocabulary, tied embeddings).
"""

from __future__ import annotations

from pathlib import Path

import nanoqwen_format as nqf
import numpy as np
import pytest
import torch
from nanoqwen_model import QWEN25_CODER_05B, QWEN25_CODER_7B
from nanoqwen_runtime.engine import Engine, EngineConfig, FinishReason, Request, TokenEvent
from nanoqwen_runtime.engine import loader as engine_loader
from nanoqwen_runtime.engine.synthetic import write_container
from nanoqwen_runtime.integrity import NonFiniteWeightError
from nanoqwen_runtime.sampling import SamplingParams
from nanoqwen_runtime.testing import engine_events

pytestmark = pytest.mark.gpu

GEOM = QWEN25_CODER_05B.with_(num_hidden_layers=2)
SAMPLING = {"greedy": SamplingParams(max_tokens=8),
            "sampled": SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, top_k=40, seed=3)}


@pytest.fixture(scope="module")
def healthy(tmp_path_factory) -> Path:
    return write_container(tmp_path_factory.mktemp("integrity") / "ok.nanoqwen", GEOM, seed=4, device="cuda")


def rewrite(src: Path, dst: Path, name: str, edit) -> Path:
    """Copy a container, tensor by tensor, with `edit(bf16 bits or QuantizedTensor)` applied to `name`
    (the copy's checksums are valid)."""
    with nqf.open(src) as f, nqf.Writer(dst) as w:
        for rec in f.records.values():
            if rec.is_quantized:
                q = f.quantized(rec.name)
                zeros = None if q.zeros is None else q.zeros.copy()
                qt = nqf.QuantizedTensor(q.qweight.copy(), q.scales.copy(), zeros, q.shape, q.group_size,
                                         q.symmetric, q.layout, q.encoding)
                w.add_quantized(rec.name, edit(qt) if rec.name == name else qt)
            else:
                a = f.array(rec.name).copy()
                w.add_array(rec.name, edit(a) if rec.name == name else a, "bf16")
        w.set_metadata(f.metadata)
    return dst


@pytest.fixture(scope="module")
def overflowing(healthy, tmp_path_factory) -> Path:
    """final_norm = 3e38 (finite bf16) everywhere: passes the load checks; the logits overflow."""
    huge = int(nqf.bf16.from_f32(np.array([3e38], np.float32))[0])
    return rewrite(healthy, tmp_path_factory.mktemp("integrity") / "huge.nanoqwen", "final_norm",
                   lambda a: np.full_like(a, huge))


def gpu_config(**kw) -> EngineConfig:
    return EngineConfig(**(dict(kv_memory_bytes=1 << 30, max_model_len=1024, prefill_chunk=256) | kw))


def test_streamed_checksums_and_finite_check_on_the_gpu(healthy, tmp_path, monkeypatch):
    monkeypatch.setattr(engine_loader, "CHUNK_BYTES", (3 << 20) + 100)  # many chunks, odd boundaries
    m = engine_loader.load(healthy, "cuda")
    assert m.stats.verified and m.stats.verify_seconds > 0 and m.stats.finite_seconds > 0
    assert torch.equal(m.buffer.cpu(), engine_loader.load(healthy, "cpu", verify=False).buffer)
    with nqf.open(healthy) as f:
        rec = f.records["layers.1.gate_up"]
    data = bytearray(healthy.read_bytes())
    data[rec.offset + rec.nbytes // 2] ^= 0x10
    bad = tmp_path / "bad.nanoqwen"
    bad.write_bytes(bytes(data))
    with pytest.raises(nqf.ChecksumError, match="tensor 'layers.1.gate_up': checksum mismatch"):
        Engine.from_file(bad, gpu_config())
    def two_nan_scales(qt):
        qt.scales.reshape(-1)[:2] = 0x7FC0
        return qt

    nan = rewrite(healthy, tmp_path / "nan-scale.nanoqwen", "layers.0.qkv", two_nan_scales)
    with pytest.raises(NonFiniteWeightError, match=r"tensor 'layers.0.qkv' \(scales\) holds 2 non-finite"):
        Engine.from_file(nan, gpu_config())
    Engine.from_file(nan, gpu_config(verify=False, mode="eager"))


@pytest.mark.parametrize("mode", ["graph", "eager"])
@pytest.mark.parametrize("sampling", list(SAMPLING))
def test_overflowing_container_ends_requests_with_error(overflowing, mode, sampling):
    engine = Engine.from_file(overflowing, gpu_config(mode=mode))
    reqs = [Request(list(range(100, 100 + n)), SAMPLING[sampling], f"r{n}") for n in (1, 37, 300)]
    toks, fins = engine_events(engine, reqs)
    assert toks == {} and len(fins) == 3
    for f in fins.values():
        assert f.reason is FinishReason.ERROR and f.num_generated == 0
        assert "non-finite logits (NaN/Inf) after 0 generated tokens" in f.detail
    assert engine.kv_blocks_used() == 0


@pytest.mark.parametrize("mode", ["graph", "eager"])
@pytest.mark.parametrize("sampling", list(SAMPLING))
def test_nan_at_a_decode_step_ends_requests(healthy, mode, sampling):
    """Healthy tokens first (the flag is clear on real logits, in graph replays too); then final_norm
    is overwritten with NaN on the device, and the next decode step (a graph replay in graph mode)
    ends every request with ERROR, emitting none of its tokens. Overlap off: with it, the step in flight
    when the weights are overwritten was queued before, and its healthy tokens come back first
    (TokenEvents where this test wants the finish events)."""
    engine = Engine.from_file(healthy, gpu_config(mode=mode, overlap=False))
    reqs = [Request(list(range(200, 200 + n)), SAMPLING[sampling].with_(max_tokens=50), f"r{n}",
                    ignore_eos=True) for n in (5, 70, 3)]
    for r in reqs:
        assert engine.submit(r) is None
    toks: dict[str, list[int]] = {}
    while min((len(toks.get(r.request_id, [])) for r in reqs), default=0) < 3:
        for ev in engine.step():
            assert isinstance(ev, TokenEvent), ev
            toks.setdefault(ev.request, []).append(ev.token_id)
    replays = sum(engine.runner.replays.values())
    assert (replays > 0) == (mode == "graph")
    engine.weights.final_norm.fill_(float("nan"))
    fins = engine.step()
    assert len(fins) == 3 and all(f.reason is FinishReason.ERROR for f in fins)
    assert all(f.num_generated == len(toks[f.request_id]) and f.tokens == toks[f.request_id] for f in fins)
    if mode == "graph":
        assert sum(engine.runner.replays.values()) == replays + 1  # the step that flagged them was a replay
    assert not engine.has_work and engine.kv_blocks_used() == 0


@pytest.mark.parametrize("batch", [1, 64])
def test_logits_range_in_a_graph(batch):
    """One aminmax over B x V bf16 logits (V of the 7B: 152064; 0.3 MB per row) in a captured graph,
    as the engine runs it: exact min/max, NaN propagates. Its time (CUDA events) is printed for the
    record, not asserted: performance is measured by the benchmark, not by a timed test."""
    V = QWEN25_CODER_7B.vocab_size
    logits = torch.randn(batch, V, device="cuda", dtype=torch.bfloat16)
    lo = torch.empty(batch, device="cuda", dtype=torch.bfloat16)
    hi = torch.empty_like(lo)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            torch.aminmax(logits, dim=-1, out=(lo, hi))
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(100):
            torch.aminmax(logits, dim=-1, out=(lo, hi))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    g.replay()
    start.record()
    g.replay()
    end.record()
    end.synchronize()
    us = start.elapsed_time(end) * 1e3 / 100
    assert torch.equal(lo, logits.amin(-1)) and torch.equal(hi, logits.amax(-1))
    logits[0, 5] = float("nan")
    g.replay()
    assert bool(torch.isnan(lo[0])) and bool(torch.isnan(hi[0]))  # NaN propagates on the GPU too
    print(f"\n[logits range] batch {batch}: {us:.1f} us per step ({batch * V * 2 / 1e6:.2f} MB read, "
          f"{batch * V * 2 / (us * 1e-6) / 1e9:.0f} GB/s)")
