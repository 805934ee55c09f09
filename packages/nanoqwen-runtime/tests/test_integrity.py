"""Integrity on the CPU (integrity.py): checksums checked on load by default by every loader (the engine's
streamed one, the reference's per tensor), NaN/Inf weights refused at load, and non-finite logits at run
time ending the request with an error instead of a token, on the engine's torch backend, the
reference backend and the `Pipeline` over each.

Containers: `testing.write_tiny_container` (INT4 linears, vocabulary 294 so the engine's padded-logits
path runs), corrupted by flipping bytes of a copy, or written with NaN/Inf/huge values under valid
checksums through its `edit` hook.
"""

from __future__ import annotations

import struct
from pathlib import Path

import nanoqwen_format as nqf
import numpy as np
import pytest
import torch
from nanoqwen_runtime import Pipeline
from nanoqwen_runtime.backend import ReferenceBackend, TokenRequest
from nanoqwen_runtime.engine import Engine, EngineConfig, FinishReason, Request
from nanoqwen_runtime.engine import loader as engine_loader
from nanoqwen_runtime.engine.backend import load_pipeline
from nanoqwen_runtime.events import ErrorEvent
from nanoqwen_runtime.integrity import NonFiniteWeightError, WeightError
from nanoqwen_runtime.reference import ReferenceModel
from nanoqwen_runtime.sampling import SamplingParams
from nanoqwen_runtime.testing import engine_events, write_tiny_container

BF16_NAN = 0x7FC0
BF16_INF = 0x7F80
SAMPLING = {"greedy": SamplingParams(max_tokens=6),
            "sampled": SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, top_k=20, seed=5)}


def cpu_config(**kw) -> EngineConfig:
    base = dict(device="cpu", backend="torch", mode="eager", num_blocks=64, block_size=16, prefill_chunk=48,
                max_batch=8)
    return EngineConfig(**(base | kw))


def flip_byte(src: Path, dst: Path, offset: int) -> Path:
    data = bytearray(src.read_bytes())
    data[offset] ^= 0x5A
    dst.write_bytes(bytes(data))
    return dst


def record(path: Path, name: str) -> nqf.TensorRecord:
    with nqf.open(path) as f:
        return f.records[name]


LOADERS = {
    "engine": lambda p, verify: Engine.from_file(p, cpu_config(verify=verify)),
    "reference": lambda p, verify: ReferenceModel.from_file(p, verify=verify),
    "pipeline": lambda p, verify: Pipeline.load(p, verify=verify),
    "engine-pipeline": lambda p, verify: load_pipeline(p, cpu_config(verify=verify)),
}


# ---- checksums --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def corrupt(tiny_int4, tmp_path_factory) -> dict[str, Path]:
    """One byte flipped: in layers.1.gate_up (INT4 words), in a norm, in the metadata, in the index."""
    d = tmp_path_factory.mktemp("corrupt")
    gate_up = record(tiny_int4, "layers.1.gate_up")
    norm = record(tiny_int4, "layers.0.post_attn_norm")
    size = tiny_int4.stat().st_size
    idx_off, idx_n, _, meta_off, meta_n, _, _ = struct.unpack(
        "<7Q", tiny_int4.read_bytes()[size - 64: size - 8])
    return {
        "layers.1.gate_up": flip_byte(tiny_int4, d / "up.nanoqwen", gate_up.offset + gate_up.nbytes // 3),
        "layers.0.post_attn_norm": flip_byte(tiny_int4, d / "norm.nanoqwen", norm.offset + norm.nbytes - 1),
        "metadata": flip_byte(tiny_int4, d / "meta.nanoqwen", meta_off + meta_n // 2),
        "index": flip_byte(tiny_int4, d / "index.nanoqwen", idx_off + idx_n // 2),
    }


@pytest.mark.parametrize("loader", list(LOADERS))
@pytest.mark.parametrize("tensor", ["layers.1.gate_up", "layers.0.post_attn_norm"])
def test_corrupt_tensor_is_refused_by_default_and_loads_with_verify_false(corrupt, loader, tensor):
    with pytest.raises(nqf.ChecksumError) as err:
        LOADERS[loader](corrupt[tensor], True)
    assert err.value.tensor == tensor
    msg = str(err.value)
    assert f"tensor {tensor!r}: checksum mismatch" in msg and "\n" not in msg
    LOADERS[loader](corrupt[tensor], False)  # the explicit opt-out loads it


@pytest.mark.parametrize("loader", list(LOADERS))
@pytest.mark.parametrize("section,error", [("metadata", nqf.MetadataChecksumError),
                                           ("index", nqf.IndexChecksumError)])
def test_corrupt_metadata_or_index_is_refused_even_without_verify(corrupt, loader, section, error):
    """The index and metadata are checked at every open (they are parsed): no opt-out."""
    for verify in (True, False):
        with pytest.raises(error, match=f"{section} checksum mismatch") as err:
            LOADERS[loader](corrupt[section], verify)
        assert isinstance(err.value, nqf.ChecksumError) and "\n" not in str(err.value)


def test_default_is_verify():
    assert EngineConfig().verify is True


def test_loader_streams_checksums_across_chunk_boundaries(tiny_int4, corrupt, monkeypatch):
    """Chunks of 1000 bytes (not a multiple of the 256-byte alignment): records span chunks, and the
    bytes uploaded are those of a single-chunk load."""
    whole = engine_loader.load(tiny_int4, "cpu")
    assert whole.stats.verified and whole.stats.verify_seconds > 0 and whole.stats.finite_seconds > 0
    monkeypatch.setattr(engine_loader, "CHUNK_BYTES", 1000)
    chunked = engine_loader.load(tiny_int4, "cpu")
    assert torch.equal(chunked.buffer, whole.buffer)
    with pytest.raises(nqf.ChecksumError, match="layers.1.gate_up"):
        engine_loader.load(corrupt["layers.1.gate_up"], "cpu")
    plain = engine_loader.load(corrupt["layers.1.gate_up"], "cpu", verify=False)
    assert not plain.stats.verified and plain.stats.verify_seconds == 0 == plain.stats.finite_seconds


def test_stream_verifier_covers_exactly_each_tensors_bytes(tmp_path):
    """Odd tensor sizes leave zero padding between records: a flipped padding byte is not covered
    (SPEC.md section 4: readers do not interpret gap bytes) and a flipped tensor byte is, named, at
    every chunk size; the bytes hashed are the tensors' bytes."""
    path = tmp_path / "odd.nanoqwen"
    with nqf.Writer(path) as w:
        w.add_array("a", np.arange(5, dtype=np.float32), encoding="f32")
        w.add_array("b", np.linspace(-1, 1, 301, dtype=np.float32), encoding="bf16")
        w.add_array("c", np.ones(1000, dtype=np.float32), encoding="f32")
        w.set_metadata({})
    with nqf.open(path) as f:
        recs = list(f.records.values())
        gap = recs[0].offset + recs[0].nbytes  # first padding byte after "a"
        assert gap < recs[1].offset
        data_end = recs[-1].offset + recs[-1].nbytes
        total = f.verify()
    assert total == sum(r.nbytes for r in recs)
    cases = {"padding": (flip_byte(path, tmp_path / "pad.nanoqwen", gap), None),
             "b": (flip_byte(path, tmp_path / "b.nanoqwen", recs[1].offset + 300), "b")}
    for chunk in (1, 7, 256, 1000, 1 << 20):
        for name, (p, bad) in {"clean": (path, None), **cases}.items():
            raw = p.read_bytes()
            with nqf.open(p) as f:
                v = f.stream_verifier()
                start = recs[0].offset
                try:
                    for s in range(start, data_end, chunk):
                        v.feed(s, np.frombuffer(raw, np.uint8, min(chunk, data_end - s), s))
                    assert v.finish() == total and bad is None, (chunk, name)
                except nqf.ChecksumError as e:
                    assert e.tensor == bad, (chunk, name)


# ---- non-finite weights -----------------------------------------------------------------------------

def plant(name_wanted: str, count: int, bits: int):
    """An `edit` hook writing `count` copies of the bf16 pattern `bits` into tensor `name_wanted` (its
    scales when it is quantized)."""
    def edit(name, value):
        if name != name_wanted:
            return value
        if isinstance(value, nqf.QuantizedTensor):
            value.scales.reshape(-1)[:count] = bits
            return value
        a = nqf.bf16.from_f32(value)
        a.reshape(-1)[:count] = bits
        return a
    return edit


@pytest.fixture(scope="module")
def nonfinite(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("nonfinite")
    return {
        "final_norm": write_tiny_container(d / "norm.nanoqwen", "rtn", 2,
                                           edit=plant("final_norm", 3, BF16_NAN)),
        "layers.0.gate_up": write_tiny_container(d / "scale.nanoqwen", "rtn", 2,
                                                 edit=plant("layers.0.gate_up", 1, BF16_NAN)),
        "embed_tokens": write_tiny_container(d / "embed.nanoqwen", "rtn", 2,
                                             edit=plant("embed_tokens", 2, BF16_INF)),
        "layers.1.qkv_bias": write_tiny_container(d / "bias.nanoqwen", "rtn", 2,
                                                  edit=plant("layers.1.qkv_bias", 1, BF16_INF | 0x8000)),
    }


EXPECTED = {"final_norm": "tensor 'final_norm' holds 3 non-finite values (NaN/Inf)",
            "layers.0.gate_up": "tensor 'layers.0.gate_up' (scales) holds 1 non-finite value (NaN/Inf)",
            "embed_tokens": "tensor 'embed_tokens' holds 2 non-finite values (NaN/Inf)",
            "layers.1.qkv_bias": "tensor 'layers.1.qkv_bias' holds 1 non-finite value (NaN/Inf)"}


@pytest.mark.parametrize("loader", list(LOADERS))
@pytest.mark.parametrize("tensor", list(EXPECTED))
def test_nonfinite_weights_are_refused_naming_the_tensor(nonfinite, loader, tensor):
    with nqf.open(nonfinite[tensor]) as f:
        f.verify()  # the checksums are valid: only the values are bad
    with pytest.raises(NonFiniteWeightError) as err:
        LOADERS[loader](nonfinite[tensor], True)
    msg = str(err.value)
    assert EXPECTED[tensor] in msg and msg.endswith("the container is corrupt") and "\n" not in msg
    assert err.value.tensor == tensor and isinstance(err.value, WeightError | ValueError)
    LOADERS[loader](nonfinite[tensor], False)


# ---- non-finite logits at run time --------------------------------------------------------------------

@pytest.fixture(scope="module")
def overflowing(tmp_path_factory) -> Path:
    """Finite but huge: final_norm = 3e38 (bf16) everywhere. It passes every load check, and the
    normed hidden state overflows to Inf, so the logits are Inf/NaN at the first token."""
    def edit(name, value):
        return np.full_like(value, 3e38) if name == "final_norm" else value

    return write_tiny_container(tmp_path_factory.mktemp("overflow") / "huge.nanoqwen", "rtn", 2, edit=edit)


@pytest.mark.parametrize("mode", list(SAMPLING))
def test_engine_ends_request_on_nonfinite_logits(overflowing, nonfinite, mode):
    """Huge final_norm (verified load) and NaN final_norm (verify=False): every request ends with
    FinishReason.ERROR and a one-line detail, no token is emitted, no block is leaked."""
    for path, verify in ((overflowing, True), (nonfinite["final_norm"], False)):
        engine = Engine.from_file(path, cpu_config(verify=verify))
        reqs = [Request([5, 6, 7, 8][: n], SAMPLING[mode], f"r{n}") for n in (1, 4)]
        toks, fins = engine_events(engine, reqs)
        assert toks == {}
        for f in fins.values():
            assert f.reason is FinishReason.ERROR and f.num_generated == 0 and f.tokens == []
            assert "non-finite logits (NaN/Inf) after 0 generated tokens" in f.detail and "\n" not in f.detail
        assert engine.kv_blocks_used() == 0


@pytest.mark.parametrize("mode", list(SAMPLING))
def test_engine_nan_mid_generation_ends_only_that_request(tiny_int4, mode, monkeypatch):
    """NaN in one row of a decode step's logits: that request ends with ERROR after the tokens it had;
    the other request of the batch runs to its length; the NaN row's token is never emitted."""
    engine = Engine.from_file(tiny_int4, cpu_config())
    real_linear = engine.ops.linear
    state = {"decode_steps": 0}

    def linear(x, lin, out, bias=None):
        real_linear(x, lin, out, bias)
        if lin is engine.weights.lm_head and out.shape[0] == 2:
            state["decode_steps"] += 1
            if state["decode_steps"] == 3:  # the third two-row step: row 1 is request "b"
                out[1, 7] = float("nan")

    monkeypatch.setattr(engine.ops, "linear", linear)
    params = SAMPLING[mode].with_(max_tokens=8)
    toks, fins = engine_events(engine, [Request([5, 6], params, "a", ignore_eos=True),
                                        Request([9, 10, 11], params, "b", ignore_eos=True)])
    assert fins["a"].reason is FinishReason.LENGTH and len(toks["a"]) == 8
    assert fins["b"].reason is FinishReason.ERROR and fins["b"].num_generated == len(toks["b"]) == 2
    assert "after 2 generated tokens" in fins["b"].detail
    assert engine.kv_blocks_used() == 0


@pytest.mark.parametrize("mode", list(SAMPLING))
def test_reference_backend_ends_request_on_nonfinite_logits(overflowing, nonfinite, mode):
    for path, verify in ((overflowing, True), (nonfinite["final_norm"], False)):
        backend = ReferenceBackend.from_file(path, verify=verify)
        run = backend.start([TokenRequest((5, 6, 7), SAMPLING[mode]), TokenRequest((9,), SAMPLING[mode])])
        events = [ev for step in run for ev in step]
        assert all(isinstance(ev, ErrorEvent) for ev in events)
        assert sorted(ev.request for ev in events) == [0, 1]
        assert all(ev.index == 0 and ev.finish_reason == "error" and "non-finite logits" in ev.message
                   for ev in events)


@pytest.mark.parametrize("backend", ["reference", "engine"])
@pytest.mark.parametrize("mode", list(SAMPLING))
def test_pipeline_reports_the_error_and_prints_no_garbage(overflowing, backend, mode):
    pipe = Pipeline.load(overflowing) if backend == "reference" else load_pipeline(overflowing, cpu_config())
    events = list(pipe.stream(["def fib(n):", "import os"], SAMPLING[mode]))
    assert all(ev.text == "" for ev in events)
    results = [ev.result for ev in events if ev.result is not None]
    assert len(results) == 2
    for r in results:
        assert r.finish_reason == "error" and r.token_ids == [] and r.text == ""
        assert r.error.startswith("the model produced non-finite logits (NaN/Inf)") and "\n" not in r.error
        assert r.stats()["error"] == r.error


def test_pipeline_keeps_the_text_before_the_error(tiny_int4, monkeypatch):
    """NaN at the 4th token of a reference run: the 3 tokens before it are the result's text."""
    pipe = Pipeline.load(tiny_int4)
    params = SamplingParams(max_tokens=8)
    clean = pipe.generate(["def add(a, b):"], params)[0]
    assert clean.generated_tokens >= 4, clean  # no EOS before the poisoned step (fixed weights)
    real = pipe.backend.model.forward
    calls = {"n": 0}

    def forward(*a, **kw):
        out = real(*a, **kw).clone()
        calls["n"] += 1
        if calls["n"] == 4:  # prefill gave token 1; decode steps 2 and 3; the 4th step is poisoned
            out[0, 3] = float("inf")
        return out

    monkeypatch.setattr(pipe.backend.model, "forward", forward)
    r = pipe.generate(["def add(a, b):"], params)[0]
    assert r.finish_reason == "error" and r.token_ids == clean.token_ids[:3]
    assert r.text == pipe.tokenizer.decode([t for t in r.token_ids if t not in pipe.eos_ids])
    assert "after 3 generated tokens" in r.error


@pytest.mark.model
def test_real_05b_streams_its_checksums_through_the_engine_loader(qwen_packed_none):
    """The real 0.5B (bf16, 1.26 GB: nineteen 64 MiB chunks, tensors spanning chunk boundaries) loads
    with every tensor hashed on the worker thread, into the same bytes as an unverified load, and its
    real weights pass the NaN/Inf check. (The costs are measured in the README, not asserted here: the
    2-core machine is shared.)"""
    m = engine_loader.load(qwen_packed_none, "cpu")
    with nqf.open(qwen_packed_none) as f:
        tensor_bytes = sum(r.nbytes for r in f.records.values())
    assert tensor_bytes > 8 * engine_loader.CHUNK_BYTES
    assert m.stats.verified and m.stats.verify_seconds > 0 and m.stats.finite_seconds > 0
    plain = engine_loader.load(qwen_packed_none, "cpu", verify=False)
    assert torch.equal(plain.buffer, m.buffer)
