"""A second, minimal .nanoqwen reader written from SPEC.md alone (it must not import nanoqwen_format).

It exists to prove that SPEC.md is complete: test_spec_reader.py checks that it decodes a file the
library wrote into exactly the tensors the library returns. It follows SPEC.md sections 3-8 with
plain `struct` and `msgpack`, and decodes int4 by scattering every nibble to the (row, column) that
section 8.2's formula gives: a different method from the library's reshape/transpose.
"""

from __future__ import annotations

import struct

import msgpack
import numpy as np
import xxhash

MAGIC = b"\x89NQWEN\r\n"
TRAILER_MAGIC = b"NQWN-END"
KOFF = [0, 8, 16, 24, 1, 9, 17, 25]


class SpecReaderError(Exception):
    pass


def _align_up(n: int, a: int) -> int:
    return -(-n // a) * a


def _bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def read(path) -> tuple[dict, dict]:
    """Return (metadata, {name: decoded}) where decoded is float32 for every tensor.

    Plain tensors: their values as float32 (bf16 widened). int4/int8: the dequantized [N, K] weight.
    Also checks every checksum the spec defines.
    """
    data = open(path, "rb").read()
    size = len(data)
    if size < 4096 + 64 or data[:8] != MAGIC:
        raise SpecReaderError("not a .nanoqwen file")
    major, minor, header_nbytes, data_offset = struct.unpack("<HHIQ", data[8:24])
    if major != 1:
        raise SpecReaderError(f"major version {major}")
    if struct.unpack("<Q", data[56:64])[0] != xxhash.xxh3_64_intdigest(data[:56]):
        raise SpecReaderError("header checksum")
    trailer = data[size - 64:]
    if trailer[56:] != TRAILER_MAGIC:
        raise SpecReaderError("truncated")
    idx_off, idx_n, idx_h, meta_off, meta_n, meta_h, tr_h = struct.unpack("<7Q", trailer[:56])
    if xxhash.xxh3_64_intdigest(trailer[:48]) != tr_h:
        raise SpecReaderError("trailer checksum")
    if not (data_offset <= idx_off and meta_off == idx_off + idx_n and meta_off + meta_n == size - 64):
        raise SpecReaderError("sections not contiguous")
    index_bytes = data[idx_off:idx_off + idx_n]
    meta_bytes = data[meta_off:meta_off + meta_n]
    if xxhash.xxh3_64_intdigest(index_bytes) != idx_h or xxhash.xxh3_64_intdigest(meta_bytes) != meta_h:
        raise SpecReaderError("index or metadata checksum")
    index = msgpack.unpackb(index_bytes, raw=False)
    metadata = msgpack.unpackb(meta_bytes, raw=False)
    tensors = {}
    prev_end = data_offset
    for rec in index:
        off, nb = rec["offset"], rec["nbytes"]
        if off % 256 or off < prev_end or off + nb > idx_off:
            raise SpecReaderError(f"bad placement of {rec['name']}")
        prev_end = off + nb
        blob = data[off:off + nb]
        if xxhash.xxh3_64_intdigest(blob) != rec["xxh3"]:
            raise SpecReaderError(f"checksum of {rec['name']}")
        tensors[rec["name"]] = _decode(rec, blob)
    return metadata, tensors


def _decode(rec: dict, blob: bytes) -> np.ndarray:
    enc, shape = rec["encoding"], tuple(rec["shape"])
    if enc == "bf16":
        return _bf16_to_f32(np.frombuffer(blob, "<u2")).reshape(shape)
    if enc == "f16":
        return np.frombuffer(blob, "<f2").astype(np.float32).reshape(shape)
    if enc == "f32":
        return np.frombuffer(blob, "<f4").reshape(shape).copy()
    n, k = shape
    g = rec["group_size"]
    f16s = enc == "int4" and rec["layout"] == f"int4-g{g}-tile8x128-f16s-v1"  # SPEC.md 8.2, fp16 scales
    assert f16s or rec["layout"] == f"{enc}-g{g}-" + ("tile8x128" if enc == "int4" else "rowmajor") + "-v1"
    if enc == "int8":
        q = np.frombuffer(blob, np.int8, n * k).reshape(n, k).astype(np.float32)
        s_off = _align_up(n * k, 256)
        s = _bf16_to_f32(np.frombuffer(blob, "<u2", n * (k // g), s_off)).reshape(n, k // g)
        assert len(blob) == s_off + 2 * n * (k // g)
        return q * np.repeat(s, g, axis=1)
    # int4, SPEC.md 8.2: word [tr, tc, L, w], nibble p -> (8 tr + L // 4, 128 tc + 32 w + 2 (L % 4) + KOFF[p])
    words = np.frombuffer(blob, "<u4", n * k // 8).reshape(n // 8, k // 128, 32, 4)
    tr = np.arange(n // 8)[:, None, None, None, None]
    tc = np.arange(k // 128)[None, :, None, None, None]
    lane = np.arange(32)[None, None, :, None, None]
    w = np.arange(4)[None, None, None, :, None]
    p = np.arange(8)[None, None, None, None, :]
    rows = 8 * tr + lane // 4 + 0 * (tc + w + p)
    cols = 128 * tc + 32 * w + 2 * (lane % 4) + np.array(KOFF)[p] + 0 * tr
    nibbles = (words[..., None] >> (4 * p).astype(np.uint32)) & 15
    q = np.full((n, k), -1, np.int64)
    q[rows, cols] = nibbles
    assert (q >= 0).all(), "every (row, column) is covered exactly by the layout"
    s_off = _align_up(n * k // 2, 256)
    if f16s:
        s = np.frombuffer(blob, "<f2", n * (k // g), s_off).astype(np.float32).reshape(n, k // g)
    else:
        s = _bf16_to_f32(np.frombuffer(blob, "<u2", n * (k // g), s_off)).reshape(n, k // g)
    if rec["symmetric"]:
        z = np.full((n, k // g), 8.0, np.float32)
        assert len(blob) == s_off + 2 * n * (k // g)
    else:
        z_off = _align_up(s_off + 2 * n * (k // g), 256)
        z = np.frombuffer(blob, np.uint8, n * (k // g), z_off).reshape(n, k // g).astype(np.float32)
        assert len(blob) == z_off + n * (k // g)
    return (q.astype(np.float32) - np.repeat(z, g, axis=1)) * np.repeat(s, g, axis=1)
