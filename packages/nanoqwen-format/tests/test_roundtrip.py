"""Writer -> reader round trips: every encoding, zero-copy views, metadata, verify, writer hygiene."""

from __future__ import annotations

import os
import tracemalloc

import nanoqwen_format as nqf
import numpy as np
import pytest
from nanoqwen_format.spec import DATA_ALIGN, TENSOR_ALIGN
from nqf_testkit import META, build_tensors, write_container


def _expected_plain(payload, enc):
    if enc == "bf16":
        return payload if payload.dtype == np.uint16 else nqf.bf16.from_f32(payload)
    return payload


def test_roundtrip_every_encoding(container):
    path, tensors = container
    with nqf.open(path) as f:
        assert list(f.records) == list(tensors)  # file order = add order
        assert f.metadata == META
        assert f.config == META["config"] and f.tokenizer_json == META["tokenizer"]
        assert f.chat_template == META["chat_template"]
        for name, (kind, payload, enc) in tensors.items():
            rec = f.records[name]
            assert rec.offset % TENSOR_ALIGN == 0 and rec.offset >= DATA_ALIGN
            if kind == "array":
                a = f.array(name)
                exp = _expected_plain(payload, enc)
                assert a.dtype == exp.dtype and a.shape == exp.shape and np.array_equal(a, exp)
                assert rec.group_size is None and rec.layout is None and rec.dtype == enc
            else:
                qt = f.quantized(name)
                assert qt.layout == payload.layout == rec.layout and rec.group_size == payload.group_size
                assert rec.symmetric == payload.symmetric and rec.shape == payload.shape
                mod = nqf.int4 if rec.encoding == "int4" else nqf.int8
                assert np.array_equal(mod.unpack(qt), mod.unpack(payload))
                assert np.array_equal(qt.scales, payload.scales)
                np.testing.assert_array_equal(f.dequantize(name), mod.dequantize(payload))
                assert f.raw(name).nbytes == rec.nbytes == payload.nbytes
        assert f.verify() == sum(r.nbytes for r in f.records.values())


def test_views_are_zero_copy_and_read_only(container):
    path, _ = container
    with nqf.open(path) as f:
        raw = f.raw("embed_tokens")
        arr = f.array("embed_tokens")
        qt = f.quantized("layers.0.qkv")
        assert np.shares_memory(raw, arr)
        assert not arr.flags.writeable and not qt.qweight.flags.writeable
        assert np.shares_memory(f.raw("layers.0.qkv"), qt.zeros)
    # views outlive the file object
    assert arr.sum() is not None and int(qt.qweight[0, 0, 0, 0]) >= 0
    with pytest.raises(nqf.ClosedFileError):
        f.array("embed_tokens")


def test_open_touches_no_tensor_bytes(container):
    """Corrupting tensor bytes does not affect open(): only verify() reads them."""
    path, _ = container
    with nqf.open(path) as f:
        rec = f.records["layers.0.down"]
    data = bytearray(path.read_bytes())
    data[rec.offset + 5] ^= 0xFF
    path.write_bytes(bytes(data))
    with nqf.open(path) as f:
        assert f.array("final_norm").shape == (256,)
        with pytest.raises(nqf.ChecksumError) as ei:
            f.verify()
    assert ei.value.tensor == "layers.0.down" and "layers.0.down" in str(ei.value)


def test_accessor_errors(container):
    path, _ = container
    with nqf.open(path) as f:
        with pytest.raises(nqf.TensorNotFoundError):
            f.array("nope")
        with pytest.raises(KeyError):  # TensorNotFoundError is also a KeyError
            f.raw("nope")
        with pytest.raises(nqf.EncodingError):
            f.array("layers.0.qkv")
        with pytest.raises(nqf.EncodingError):
            f.quantized("final_norm")


def test_missing_metadata_keys(tmp_path):
    path = tmp_path / "m.nanoqwen"
    write_container(path, meta={"config": {"a": 1}})
    with nqf.open(path) as f:
        assert f.config == {"a": 1}
        with pytest.raises(nqf.MissingMetadataError):
            _ = f.tokenizer_json


def test_empty_container(tmp_path):
    path = tmp_path / "empty.nanoqwen"
    with nqf.Writer(path):
        pass
    with nqf.open(path) as f:
        assert f.records == {} and f.metadata == {} and f.verify() == 0


def test_writer_removes_temp_on_exception_and_keeps_old_file(tmp_path):
    path = tmp_path / "m.nanoqwen"
    path.write_bytes(b"previous content")
    with pytest.raises(RuntimeError):
        with nqf.Writer(path) as w:
            w.add_array("a", np.ones(8, np.float32))
            raise RuntimeError("boom")
    assert os.listdir(tmp_path) == ["m.nanoqwen"] and path.read_bytes() == b"previous content"


def test_writer_removes_temp_on_keyboard_interrupt(tmp_path):
    path = tmp_path / "m.nanoqwen"
    with pytest.raises(KeyboardInterrupt):
        with nqf.Writer(path) as w:
            w.add_array("a", np.ones(8, np.float32))
            raise KeyboardInterrupt
    assert os.listdir(tmp_path) == []


def test_writer_failed_add_removes_temp(tmp_path):
    path = tmp_path / "m.nanoqwen"
    with pytest.raises(nqf.DuplicateTensorError):
        with nqf.Writer(path) as w:
            w.add_array("a", np.ones(8, np.float32))
            w.add_array("a", np.ones(8, np.float32))
    assert os.listdir(tmp_path) == []
    with pytest.raises(nqf.WriterStateError):
        w.add_array("b", np.ones(8, np.float32))


@pytest.mark.parametrize(
    "meta,err",
    [
        ({"x": np.int64(3)}, nqf.MetadataError),
        ({"x": {1, 2}}, nqf.MetadataError),
        ({1: "int key"}, nqf.MetadataError),
        ({"x": object()}, nqf.MetadataError),
        ({"x": 2**64}, nqf.MetadataError),
        ([1, 2], nqf.MetadataError),
        ({"x": "y" * (nqf.spec.MAX_METADATA_NBYTES + 1)}, nqf.LimitExceededError),
    ],
)
def test_writer_rejects_bad_metadata(tmp_path, meta, err):
    with nqf.Writer(tmp_path / "m.nanoqwen") as w:
        with pytest.raises(err):
            w.set_metadata(meta)


def test_writer_rejects_deep_metadata(tmp_path):
    deep = {}
    node = deep
    for _ in range(nqf.spec.MAX_METADATA_DEPTH):
        node["d"] = {}
        node = node["d"]
    with nqf.Writer(tmp_path / "m.nanoqwen") as w:
        with pytest.raises(nqf.NestingTooDeepError):
            w.set_metadata(deep)


@pytest.mark.parametrize(
    "name,array,enc,err",
    [
        ("x" * 257, np.ones(2, np.float32), "f32", nqf.LimitExceededError),
        ("", np.ones(2, np.float32), "f32", nqf.MalformedIndexError),
        ("rank9", np.ones((1,) * 9, np.float32), "f32", nqf.LimitExceededError),
        ("rank0", np.float32(1.0), "f32", nqf.MalformedIndexError),
        ("ints", np.ones(2, np.int32), "f32", nqf.EncodingError),
        ("ints16", np.ones(2, np.int16), "bf16", nqf.EncodingError),
        ("enc", np.ones(2, np.float32), "int4", nqf.EncodingError),
    ],
)
def test_writer_rejects_bad_tensors(tmp_path, name, array, enc, err):
    with pytest.raises(err):
        with nqf.Writer(tmp_path / "m.nanoqwen") as w:
            w.add_array(name, array, encoding=enc)
    assert os.listdir(tmp_path) == []


def test_writer_memory_is_bounded(tmp_path):
    """Writing 24 tensors of 4 MiB (96 MiB in all) peaks at a small multiple of one tensor.

    The bf16 conversion of a float32 tensor needs one uint32 temporary and the uint16 result.
    """
    arrays = [np.full((1024, 1024), i, np.float32) for i in range(12)]
    tracemalloc.start()
    with nqf.Writer(tmp_path / "m.nanoqwen") as w:
        for i, a in enumerate(arrays):
            w.add_array(f"t{i}", a, encoding="f32")
            w.add_array(f"b{i}", a, encoding="bf16")  # conversion allocates one 2 MiB temporary
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 2.5 * arrays[0].nbytes, f"peak {peak} bytes"


def test_float_input_to_bf16_is_rounded_nearest_even(tmp_path):
    path = tmp_path / "m.nanoqwen"
    x = np.random.default_rng(5).standard_normal(1000).astype(np.float32)
    with nqf.Writer(path) as w:
        w.add_array("x", x)
    with nqf.open(path) as f:
        assert np.array_equal(f.array("x"), nqf.bf16.from_f32(x))
        np.testing.assert_array_equal(f.dequantize("x"), nqf.bf16.to_f32(nqf.bf16.from_f32(x)))


def test_rewrite_is_byte_identical(tmp_path):
    a, b = tmp_path / "a.nanoqwen", tmp_path / "b.nanoqwen"
    write_container(a, build_tensors(3))
    write_container(b, build_tensors(3))
    assert a.read_bytes() == b.read_bytes()


def test_interrupt_in_the_middle_of_a_tensor_write(tmp_path, monkeypatch):
    path = tmp_path / "m.nanoqwen"
    calls = {"n": 0}
    real_write = nqf.Writer._write

    def flaky_write(self, data):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt
        real_write(self, data)

    monkeypatch.setattr(nqf.Writer, "_write", flaky_write)
    with pytest.raises(KeyboardInterrupt):
        with nqf.Writer(path) as w:
            assert not path.exists()  # nothing appears under the final name before close
            for i in range(10):
                w.add_array(f"t{i}", np.ones(1000, np.float32))
    assert os.listdir(tmp_path) == []


def test_writer_without_with_block(tmp_path):
    path = tmp_path / "m.nanoqwen"
    w = nqf.Writer(path)
    w.open()
    w.add_array("x", np.arange(5, dtype=np.float32), encoding="f32")
    w.close()
    with nqf.open(path) as f:
        assert np.array_equal(f.array("x"), np.arange(5, dtype=np.float32))
    with pytest.raises(nqf.WriterStateError):
        w.add_array("y", np.ones(2, np.float32))
