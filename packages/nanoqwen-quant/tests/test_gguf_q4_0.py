"""Exact import of GGUF Q4_0 linears: an already-quantized source is respected.

The oracle is the gguf package (llama.cpp's own Python reader): `gguf.quants.quantize` writes the Q4_0
blocks and `gguf.quants.dequantize` gives the file's fp32 weights; nanoqwen's code writes neither.

- `unpack_q4_0` + the container's symmetric g32 fp16-scale layout give back gguf's fp32 weights bit for
  bit (nanoqwen_format's numpy decoder and nanoqwen_model's torch codec), on random blocks whose codes
  reach 0 and 15; malformed blocks are refused with the tensor named.
- A two-layer all-Q4_0 GGUF made from the real 0.5B (its metadata, tokenizer and embeddings as they
  are; the seven linears of each layer requantized to Q4_0 by gguf) is imported by default, exactly,
  and runs through the reference runtime; a mixed GGUF (the real 0.5B itself) is not importable.
"""

from __future__ import annotations

import gguf
import nanoqwen_format as nqf
import numpy as np
import pytest
import torch
from nanoqwen_model import codec
from nanoqwen_quant.checkpoints import FUSED, CheckpointImportError, unpack_q4_0
from nanoqwen_quant.cli import app
from nanoqwen_quant.options import PackOptions, UsageError
from nanoqwen_quant.pack import pack
from nanoqwen_quant.sources import GGUFSource, gguf_name, is_quantized_source, open_source
from typer.testing import CliRunner

Q4_0 = gguf.GGMLQuantizationType.Q4_0
LAYERS = 2  # decoder layers kept in the derived GGUF


def _q4_0(w: np.ndarray) -> np.ndarray:
    """gguf's Q4_0 blocks of a float32 [N, K] matrix (uint8 [N, K / 32 * 18])."""
    return gguf.quants.quantize(np.ascontiguousarray(w, dtype=np.float32), Q4_0)


@pytest.mark.parametrize(("n", "k"), [(8, 128), (24, 384), (136, 256)])
def test_unpacked_q4_0_dequantizes_to_ggufs_weights_bit_for_bit(n, k):
    rng = np.random.default_rng(n * 1000 + k)
    w = rng.standard_normal((n, k)).astype(np.float32) * rng.uniform(0.01, 3.0, (n, 1)).astype(np.float32)
    blocks = _q4_0(w)
    want = gguf.quants.dequantize(blocks, Q4_0).astype(np.float32)
    q, d = unpack_q4_0(blocks, n, k, "w")
    assert q.dtype == np.uint8 and q.shape == (n, k) and d.dtype == np.float16 and d.shape == (n, k // 32)
    assert q.min() == 0 and q.max() == 15  # Q4_0's round trip reaches both ends of the code range
    qt = nqf.int4.pack(q, d, None, 32, scale_dtype="f16")
    assert qt.symmetric and qt.layout == "int4-g32-tile8x128-f16s-v1"
    assert np.array_equal(nqf.int4.dequantize(qt), want)  # nanoqwen_format's numpy decoder
    w_t = codec.dequantize_int4(torch.from_numpy(qt.qweight.view(np.int32).copy()),
                                torch.from_numpy(qt.scales.copy()), None, 32)
    assert torch.equal(w_t, torch.from_numpy(want))  # nanoqwen_model's torch codec


def test_malformed_q4_0_blocks_are_refused():
    blocks = _q4_0(np.random.default_rng(0).standard_normal((8, 128)).astype(np.float32))
    with pytest.raises(CheckpointImportError, match="blk.0.attn_q.weight: 575 bytes"):
        unpack_q4_0(blocks.ravel()[:-1], 8, 128, "blk.0.attn_q.weight")
    with pytest.raises(CheckpointImportError, match="not a multiple of 32"):
        unpack_q4_0(blocks, 8, 120, "w")
    bad = blocks.copy()
    bad[3, 0:2] = np.array([np.inf], dtype=np.float16).view(np.uint8)  # block 0 of row 3: d = inf
    with pytest.raises(CheckpointImportError, match="NaN or Inf"):
        unpack_q4_0(bad, 8, 128, "w")


def _copy_fields(reader: gguf.GGUFReader, writer: gguf.GGUFWriter, block_count: int) -> None:
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # the writer's own header fields
        if name == "qwen2.block_count":
            writer.add_block_count(block_count)
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub)


@pytest.fixture(scope="module")
def q4_0_gguf(qwen05b_gguf, tmp_path_factory):
    """The real 0.5B cut to LAYERS decoder layers, its linears requantized to Q4_0 by gguf; everything
    else (metadata, tokenizer, embeddings, lm_head, norms, biases) copied as stored."""
    path = tmp_path_factory.mktemp("q4_0") / "qwen05b-2layers-q4_0.gguf"
    reader = gguf.GGUFReader(qwen05b_gguf)
    linears = {gguf_name(f"model.layers.{i}.{b}.weight") for i in range(LAYERS)
               for parts in FUSED.values() for b in parts}  # fmt: skip
    writer = gguf.GGUFWriter(str(path), "qwen2")
    _copy_fields(reader, writer, LAYERS)
    for t in reader.tensors:
        if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= LAYERS:
            continue
        shape = [int(x) for x in reversed(t.shape.tolist())]  # ggml [ne0, ne1] -> row-major [ne1, ne0]
        if t.name in linears:
            w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
            writer.add_tensor(t.name, _q4_0(w), raw_shape=_q4_0(w).shape, raw_dtype=Q4_0)
        else:
            writer.add_tensor(t.name, np.asarray(t.data), raw_shape=np.asarray(t.data).shape,
                              raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.model
def test_mixed_gguf_is_not_importable(qwen05b_gguf, tmp_path):
    """The real 0.5B mixes Q5_0 / Q6_K / Q8_0 / Q4_K linears: no exact import, requantized as before."""
    src = open_source(str(qwen05b_gguf))
    assert src.scheme is None and not is_quantized_source(src)
    with pytest.raises(UsageError, match="GGUF whose decoder linears are all Q4_0"):
        pack(src, tmp_path / "x.nanoqwen", PackOptions(method="import"), log=lambda m: None)


@pytest.mark.model
def test_q4_0_gguf_imports_exactly_by_default_and_runs(q4_0_gguf, tmp_path):
    src = open_source(str(q4_0_gguf))
    assert isinstance(src, GGUFSource) and is_quantized_source(src)
    assert (src.scheme.method, src.scheme.fmt, src.scheme.group_size) == ("gguf", "Q4_0", 32)
    out = tmp_path / "q4_0.nanoqwen"
    res = CliRunner().invoke(app, ["pack", str(q4_0_gguf), "-o", str(out)])  # no --method: import
    assert res.exit_code == 0, res.output
    assert "importing gguf (Q4_0) g32 sym exactly" in res.output
    reader = gguf.GGUFReader(q4_0_gguf)
    tensors = {t.name: t for t in reader.tensors}
    with nqf.open(out) as f:
        f.verify()
        q = f.metadata["quantization"]
        assert (q["method"], q["group_size"], q["symmetric"]) == ("import", 32, True)
        assert q["source_format"]["format"] == "gguf" and q["source_format"]["checkpoint_format"] == "Q4_0"
        for i in range(LAYERS):
            for name, parts in FUSED.items():
                rec = f.records[f"layers.{i}.{name}"]
                assert rec.layout == "int4-g32-tile8x128-f16s-v1"
                want = np.concatenate([
                    gguf.quants.dequantize(tensors[n].data, Q4_0).astype(np.float32)
                    for n in (gguf_name(f"model.layers.{i}.{b}.weight") for b in parts)])
                assert np.array_equal(f.dequantize(f"layers.{i}.{name}"), want), (i, name)
    # the container runs through the reference runtime: greedy tokens from a chat prompt
    from nanoqwen_runtime.generate import Pipeline
    from nanoqwen_runtime.sampling import SamplingParams

    pipe = Pipeline.load(out)
    [r] = pipe.generate([pipe.chat_prompt([{"role": "user", "content": "Write hello world in Python."}])],
                        SamplingParams(max_tokens=4, temperature=0.0))
    assert r.error is None and r.finish_reason in ("eos", "length") and 1 <= r.generated_tokens <= 4


@pytest.mark.model
def test_q4_0_gguf_can_still_be_requantized_when_asked(q4_0_gguf, tmp_path):
    """Asked for explicitly, rtn requantizes the Q4_0 file to g128 (smaller and faster than Q4_0's g32
    with fp16 scales), as for any GGUF."""
    out = tmp_path / "rtn.nanoqwen"
    pack(open_source(str(q4_0_gguf)), out, PackOptions(method="rtn"), log=lambda m: None)
    with nqf.open(out) as f:
        assert f.metadata["quantization"]["method"] == "rtn"
        assert f.records["layers.0.qkv"].layout == "int4-g128-tile8x128-v1"
