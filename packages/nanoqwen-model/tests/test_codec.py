"""The torch codec against nanoqwen-format's numpy reference, bit for bit, for every group size,
symmetric and asymmetric, on fresh random weights (nanoqwen-format is a test-only oracle here)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from nanoqwen_model import codec

nqf = pytest.importorskip("nanoqwen_format")

SHAPES = [(8, 128), (40, 384), (136, 1024)]


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("shape", SHAPES)
def test_int4_matches_format_reference(group_size, symmetric, shape):
    rng = np.random.default_rng([group_size, int(symmetric), *shape])
    w = rng.standard_normal(shape).astype(np.float32) * rng.uniform(0.01, 2.0)
    qt = nqf.int4.quantize_rtn(w, group_size, symmetric)
    words = torch.from_numpy(qt.qweight.view(np.int32))
    q = codec.unpack_int4(words)
    assert q.dtype == torch.uint8
    assert np.array_equal(q.numpy(), nqf.int4.unpack(qt))
    assert torch.equal(codec.pack_int4(q), words)
    scales = torch.from_numpy(qt.scales).view(torch.bfloat16)
    zeros = None if qt.zeros is None else torch.from_numpy(qt.zeros)
    assert np.array_equal(codec.dequantize_int4(words, scales, zeros, group_size).numpy(),
                          nqf.int4.dequantize(qt))


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_f16_scales_match_format_reference(group_size, symmetric):
    """The -f16s layout: fp16 scales (values bf16 cannot hold), zero points 0..16 (16 included)."""
    rng = np.random.default_rng([group_size, int(symmetric), 16])
    n, k = 40, 384
    q = rng.integers(0, 16, (n, k), dtype=np.uint8)
    s16 = rng.uniform(1e-3, 1e-1, (n, k // group_size)).astype(np.float16)
    zeros = None if symmetric else rng.integers(0, 17, (n, k // group_size), dtype=np.uint8)
    if zeros is not None:
        zeros[-1, -1] = 16
    qt = nqf.int4.pack(q, s16, zeros, group_size, scale_dtype="f16")
    words = torch.from_numpy(qt.qweight.view(np.int32))
    got = codec.dequantize_int4(words, torch.from_numpy(qt.scales),
                                None if zeros is None else torch.from_numpy(zeros), group_size)
    assert np.array_equal(got.numpy(), nqf.int4.dequantize(qt))
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        codec.dequantize_int4(words, torch.from_numpy(qt.scales).float(), None, group_size)


def test_int4_pack_covers_every_nibble_value():
    """Every value 0..15 at every position of a tile survives pack -> unpack (no lost bits)."""
    q = (torch.arange(8 * 256) % 16).reshape(8, 256).to(torch.uint8).roll(3, 1)
    assert torch.equal(codec.unpack_int4(codec.pack_int4(q)), q)
    with pytest.raises(ValueError, match="tile layout"):
        codec.pack_int4(torch.zeros(8, 100, dtype=torch.uint8))


@pytest.mark.parametrize("group_size", [64, 128])
def test_int8_matches_format_reference(group_size):
    rng = np.random.default_rng(group_size)
    w = rng.standard_normal((24, 256)).astype(np.float32)
    qt = nqf.int8.quantize_rtn(w, group_size, True)
    scales = torch.from_numpy(qt.scales).view(torch.bfloat16)
    got = codec.dequantize_int8(torch.from_numpy(qt.qweight), scales, group_size)
    assert np.array_equal(got.numpy(), nqf.int8.dequantize(qt))
