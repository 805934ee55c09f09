"""bf16, int4 (tile8x128) and int8 (rowmajor) references against independent, literal definitions.

The int4 layout is checked against a plain loop that transcribes DESIGN.md's formula (tile, lane,
word, nibble -> row, column), on fresh random values, several odd-multiple sizes, every group size,
symmetric and asymmetric. torch is used only as an oracle for bf16 rounding.
"""

from __future__ import annotations

import time

import nanoqwen_format as nqf
import numpy as np
import pytest

# Tolerances, one table: (what, bound, why)
TOL = {
    # RTN error per element is at most half a step, except at the group maximum, which the bf16
    # rounding of the scale (relative error <= 2**-9) can push 7.5 * 2**-8 steps past the grid.
    "rtn_int4_sym_steps": 0.5 + 7.5 * 2**-8 + 1e-5,
    # asymmetric: the zero point is rounded to an integer, so the grid shifts by up to half a step;
    # values at the ends of the range can then be clipped by at most one step (plus the bf16 term).
    "rtn_int4_asym_steps": 1.0 + 15 * 2**-8 + 1e-5,
    # int8: absmax / s <= 127 / (1 - 2**-9) < 127.25, so clipping costs < 0.25 step: half a step holds.
    "rtn_int8_steps": 0.5 + 1e-5,
}
SIZES = [(8, 128), (24, 384), (40, 640)]
KOFF = [0, 8, 16, 24, 1, 9, 17, 25]


def loop_unpack(words: np.ndarray, n: int, k: int) -> np.ndarray:
    """DESIGN.md's formula, literally: nibble p of word w of lane L of tile (tr, tc)."""
    q = np.full((n, k), 255, dtype=np.uint8)
    for tr in range(n // 8):
        for tc in range(k // 128):
            for lane in range(32):
                g, t = lane // 4, lane % 4
                for w in range(4):
                    word = int(words[tr, tc, lane, w])
                    for p in range(8):
                        q[8 * tr + g, 128 * tc + 32 * w + 2 * t + KOFF[p]] = (word >> (4 * p)) & 15
    return q


@pytest.mark.parametrize("n,k", SIZES)
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_pack_matches_layout_formula(n, k, group_size, symmetric):
    rng = np.random.default_rng(n * k + group_size)
    q = rng.integers(0, 16, (n, k), dtype=np.uint8)
    scales = nqf.bf16.from_f32(rng.uniform(0.01, 0.1, (n, k // group_size)))
    zeros = None if symmetric else rng.integers(0, 16, (n, k // group_size), dtype=np.uint8)
    qt = nqf.int4.pack(q, scales, zeros, group_size)
    assert qt.qweight.dtype == np.uint32 and qt.qweight.shape == (n // 8, k // 128, 32, 4)
    assert qt.layout == f"int4-g{group_size}-tile8x128-v1" and qt.symmetric == symmetric
    assert np.array_equal(loop_unpack(qt.qweight, n, k), q)
    assert np.array_equal(nqf.int4.unpack(qt), q)
    # tile (tr, tc) is 512 contiguous bytes at word offset (tr * K/128 + tc) * 128
    flat = qt.qweight.reshape(-1)
    tr, tc = n // 8 - 1, k // 128 - 1
    assert np.array_equal(flat[(tr * (k // 128) + tc) * 128:][:128], qt.qweight[tr, tc].reshape(-1))
    # dequantize is (q - z) * f32(s), z = 8 when symmetric
    z = np.full((n, k // group_size), 8.0) if symmetric else zeros.astype(np.float64)
    ref = (q - np.repeat(z, group_size, axis=1)) * np.repeat(nqf.bf16.to_f32(scales), group_size, axis=1)
    np.testing.assert_array_equal(nqf.int4.dequantize(qt), ref.astype(np.float32))


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_f16s_pack_and_dequantize(group_size, symmetric, tmp_path):
    """The -f16s variant: same words, fp16 scales kept exactly (not bf16 values), zero points up to 16;
    dequantize is (q - z) * f32(s) in float64 then rounded once -- exact, as the product of a 5-bit
    integer and an 11-bit significand fits fp32's 24 bits."""
    n, k = 24, 384
    rng = np.random.default_rng(group_size + symmetric)
    q = rng.integers(0, 16, (n, k), dtype=np.uint8)
    scales = rng.uniform(1e-3, 1e-1, (n, k // group_size)).astype(np.float16)
    assert not np.array_equal(nqf.bf16.to_f32(nqf.bf16.from_f32(scales.astype(np.float32))),
                              scales.astype(np.float32))  # the test needs scales bf16 cannot hold
    zeros = None if symmetric else rng.integers(0, 17, (n, k // group_size), dtype=np.uint8)
    if zeros is not None:
        zeros[0, 0] = 16
    qt = nqf.int4.pack(q, scales, zeros, group_size, scale_dtype="f16")
    assert qt.layout == f"int4-g{group_size}-tile8x128-f16s-v1" and qt.scale_dtype == "f16"
    assert qt.layout == nqf.layout_tag("int4", group_size, "f16")
    assert np.array_equal(nqf.int4.unpack(qt), q)
    z = np.full((n, k // group_size), 8.0) if symmetric else zeros.astype(np.float64)
    ref = (q - np.repeat(z, group_size, axis=1)) * np.repeat(scales.astype(np.float64), group_size, axis=1)
    np.testing.assert_array_equal(nqf.int4.dequantize(qt), ref.astype(np.float32))
    path = tmp_path / "f16s.nanoqwen"
    with nqf.Writer(path) as w:
        w.add_quantized("w", qt)
    with nqf.open(path) as f:
        rec = f.records["w"]
        assert (rec.layout, rec.dtype, f.major, f.minor) == (qt.layout, "bf16", 1, 1)
        back = f.quantized("w")
        assert back.scales.dtype == np.float16 and np.array_equal(back.scales, scales)
        np.testing.assert_array_equal(f.dequantize("w"), ref.astype(np.float32))
        # the scale part sits where SPEC.md 8.2 says, as IEEE binary16 little-endian
        s_off = -(-n * k // 2 // 256) * 256
        assert bytes(f.raw("w")[s_off : s_off + 2 * scales.size]) == scales.astype("<f2").tobytes()


def test_int4_f16s_rejects_bad_input():
    q, s16 = np.zeros((8, 128), np.uint8), np.ones((8, 1), np.float16)
    with pytest.raises(nqf.EncodingError, match="zero point 17 > 16"):
        nqf.int4.pack(q, s16, np.full((8, 1), 17, np.uint8), 128, scale_dtype="f16")
    with pytest.raises(nqf.EncodingError, match="zero point 16 > 15"):  # the bf16 layout keeps 0..15
        nqf.int4.pack(q, np.ones((8, 1), np.uint16), np.full((8, 1), 16, np.uint8), 128)
    with pytest.raises(nqf.EncodingError, match="scales must be float16"):
        nqf.int4.pack(q, np.ones((8, 1), np.uint16), None, 128, scale_dtype="f16")
    with pytest.raises(nqf.EncodingError, match="scale_dtype"):
        nqf.int4.pack(q, s16, None, 128, scale_dtype="f32")
    with pytest.raises(nqf.EncodingError):
        nqf.layout_tag("int8", 128, "f16")  # no int8 layout with fp16 scales


def test_int4_words_are_little_endian_bytes():
    q = np.zeros((8, 128), dtype=np.uint8)
    q[0, 0], q[0, 1] = 3, 5  # lane 0, word 0: nibble 0 holds col 0, nibble 4 holds col 1
    q[1, 8] = 7  # row 1 -> lane 4 (g = 1, t = 0), word 0, nibble 1 (KOFF[1] = 8)
    qt = nqf.int4.pack(q, np.zeros((8, 1), np.uint16), None, 128)
    raw = qt.qweight.tobytes()
    assert raw[0] == 0x03 and raw[2] == 0x05  # bits 0..3 = 3, bits 16..19 = 5
    assert raw[4 * 16] == 0x70  # lane 4, word 0, byte 0, high nibble


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group_size", [32, 128])
def test_int4_quantize_rtn_error_bound(symmetric, group_size):
    rng = np.random.default_rng(7)
    n, k = 24, 384
    w = (rng.standard_normal((n, k)) * rng.uniform(0.01, 2.0, (n, 1))).astype(np.float32)
    if not symmetric:
        w += np.float32(0.5)  # a shifted distribution, where asymmetric pays off
    qt = nqf.int4.quantize_rtn(w, group_size, symmetric)
    err = np.abs(nqf.int4.dequantize(qt) - w)
    step = np.repeat(nqf.bf16.to_f32(qt.scales), group_size, axis=1)
    bound = TOL["rtn_int4_sym_steps"] if symmetric else TOL["rtn_int4_asym_steps"]
    assert (err <= bound * step).all()
    assert np.array_equal(nqf.int4.unpack(qt).max() <= 15, True)
    rel = np.linalg.norm(nqf.int4.dequantize(qt) - w) / np.linalg.norm(w)
    assert rel < 0.12  # 4-bit RTN on Gaussian groups: ~0.1 (g128) and lower for g32


def test_int4_rejects_bad_input():
    with pytest.raises(nqf.EncodingError):
        nqf.int4.pack(np.zeros((12, 128), np.uint8), np.zeros((12, 1), np.uint16), None, 128)  # N % 8
    with pytest.raises(nqf.EncodingError):
        nqf.int4.pack(np.zeros((8, 96), np.uint8), np.zeros((8, 3), np.uint16), None, 32)  # K % 128
    with pytest.raises(nqf.EncodingError):
        nqf.int4.pack(np.full((8, 128), 16, np.uint8), np.zeros((8, 1), np.uint16), None, 128)
    with pytest.raises(nqf.EncodingError):
        nqf.int4.pack(np.zeros((8, 128), np.uint8), np.zeros((8, 2), np.uint16), None, 128)  # scales shape
    with pytest.raises(nqf.EncodingError):
        nqf.int4.pack(np.zeros((8, 128), np.uint8), np.zeros((8, 1), np.uint16), None, 96)
    with pytest.raises(nqf.EncodingError):
        nqf.int4.quantize_rtn(np.full((8, 128), np.nan, np.float32), 128, True)


def test_int4_pack_speed_7b_gate_up():
    rng = np.random.default_rng(0)
    n, k = 18944, 3584
    q = rng.integers(0, 16, (n, k), dtype=np.uint8)
    scales = np.ones((n, k // 128), np.uint16)
    t0 = time.process_time()  # CPU time: robust to other jobs on the shared CI machine
    qt = nqf.int4.pack(q, scales, None, 128)
    elapsed = time.process_time() - t0
    assert elapsed < 2.0, f"packing 18944x3584 took {elapsed:.2f} CPU s"
    assert np.array_equal(nqf.int4.unpack(qt)[::997], q[::997])


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_int8_roundtrip_and_bound(group_size):
    rng = np.random.default_rng(group_size)
    n, k = 13, 384  # int8 rowmajor has no N constraint
    w = rng.standard_normal((n, k)).astype(np.float32)
    qt = nqf.int8.quantize_rtn(w, group_size)
    assert qt.layout == f"int8-g{group_size}-rowmajor-v1" and qt.qweight.dtype == np.int8
    q = nqf.int8.unpack(qt)
    assert q.min() >= -127
    step = np.repeat(nqf.bf16.to_f32(qt.scales), group_size, axis=1)
    assert (np.abs(nqf.int8.dequantize(qt) - w) <= TOL["rtn_int8_steps"] * step).all()
    qt2 = nqf.int8.pack(q, qt.scales, None, group_size)
    np.testing.assert_array_equal(nqf.int8.dequantize(qt2), q * step)
    with pytest.raises(nqf.EncodingError):
        nqf.int8.pack(np.full((2, 128), -128, np.int8), np.zeros((2, 1), np.uint16), None, 128)
    with pytest.raises(nqf.EncodingError):
        nqf.int8.pack(q, qt.scales, np.zeros_like(qt.scales, dtype=np.uint8), group_size)
    with pytest.raises(nqf.EncodingError):
        nqf.int8.quantize_rtn(w, group_size, symmetric=False)


def test_bf16_matches_torch_rne():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    x = np.concatenate([
        rng.standard_normal(100_000).astype(np.float32) * 1e3,
        np.array([0.0, -0.0, np.inf, -np.inf, 3.4028235e38, -3.4028235e38, 1e-40, -1e-45], np.float32),
        # exact ties: low 16 bits 0x8000 with even and odd kept bit
        np.array([0x3F808000, 0x3F818000, 0x7F7F8000], np.uint32).view(np.float32),
    ])
    ours = nqf.bf16.from_f32(x)
    ref = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(ours, ref)
    widened = torch.from_numpy(x).to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(nqf.bf16.to_f32(ours), widened)
    nan = nqf.bf16.from_f32(np.array([np.nan, -np.nan], np.float32))
    assert np.isnan(nqf.bf16.to_f32(nan)).all()
