"""Group-wise INT4 in the `int4-g{G}-tile8x128-v1` layout: numpy reference quantize/pack/unpack/dequantize.

Logical weight q[N, K] in 0..15, bf16 scales s[N, K/G], zero points z[N, K/G] (asymmetric) or the
implicit 8 (symmetric); w[n, k] = (q[n, k] - z[n, k // G]) * f32(s[n, k // G]).
The `int4-g{G}-tile8x128-f16s-v1` variant has the same words and fp16 scales (np.float16), zero points
0..16 (imported GPTQ/AWQ checkpoints: `pack(..., scale_dtype="f16")`); the formula is the same.

Packed words are uint32 [N/8, K/128, 32, 4]: one 8x128 tile is 512 contiguous bytes, lane L = 4g + t
owns the four words [L, 0..3]; word w covers tile columns 32w .. 32w+31 and its nibble p (bits 4p..4p+3)
holds row 8*tile_row + g, column 128*tile_col + 32w + 2t + KOFF[p] with KOFF = [0, 8, 16, 24, 1, 9, 17, 25]
(DESIGN.md explains why: one lop3 per nibble pair yields the bf16x2 B-operand of mma.m16n8k16).

Vectorisation: write the 32 columns of a word as c = 8j + 2t + h (j = p % 4, h = p // 4). Byte b of a
little-endian word holds nibbles 2b (low) and 2b+1 (high), i.e. h = b // 2 and j = 2(b % 2) + {0, 1}.
So pack is one reshape of q to [N/8, g, K/128, w, jp, jl, t, h], one OR of the jl = 0 / jl = 1 halves
into bytes, one transpose to [N/8, K/128, g, t, w, h, jp] and a view as '<u4'. Packing an
18944 x 3584 matrix takes about 0.3 s on one core.
"""

from __future__ import annotations

import numpy as np

from . import bf16
from .errors import EncodingError
from .quantized import GROUP_SIZES, MAX_ZERO, SCALE_DTYPES, QuantizedTensor, layout_tag

__all__ = ["KOFF", "quantize_rtn", "pack", "unpack", "dequantize"]

KOFF = (0, 8, 16, 24, 1, 9, 17, 25)


def _check_nk(n: int, k: int, group_size: int) -> None:
    if group_size not in GROUP_SIZES:
        raise EncodingError(f"int4 group_size must be one of {GROUP_SIZES}, got {group_size!r}")
    if n % 8 or k % 128 or n <= 0 or k <= 0:
        raise EncodingError(f"int4 tile8x128 needs N % 8 == 0 and K % 128 == 0, got [{n}, {k}]")


def pack(q, scales, zeros, group_size: int, scale_dtype: str = "bf16") -> QuantizedTensor:
    """Pack logical int4 values into the tile8x128 layout.

    q: uint8 [N, K] values 0..15; scales [N, K/G]: uint16 bf16 bits (scale_dtype "bf16", layout
    `int4-g{G}-tile8x128-v1`) or np.float16 (scale_dtype "f16", layout `...-f16s-v1`); zeros: uint8
    [N, K/G] in 0..15 (0..16 with f16 scales) or None (symmetric, implicit zero point 8). Returns a
    QuantizedTensor (encoding "int4").
    """
    if scale_dtype not in SCALE_DTYPES:
        raise EncodingError(f"int4.pack: scale_dtype must be one of {tuple(SCALE_DTYPES)}, "
                            f"got {scale_dtype!r}")
    q = np.asarray(q)
    if q.ndim != 2 or q.dtype != np.uint8:
        raise EncodingError(f"int4.pack needs q as uint8 [N, K], got {q.dtype} {list(q.shape)}")
    n, k = q.shape
    _check_nk(n, k, group_size)
    if q.size and int(q.max()) > 15:
        raise EncodingError(f"int4.pack: q has value {int(q.max())} > 15")
    if zeros is not None:
        zeros = np.ascontiguousarray(zeros)
        zmax = MAX_ZERO[scale_dtype]
        if zeros.dtype == np.uint8 and zeros.size and int(zeros.max()) > zmax:
            raise EncodingError(f"int4.pack: zero point {int(zeros.max())} > {zmax}")
    x = q.reshape(n // 8, 8, k // 128, 4, 2, 2, 4, 2)  # [N/8, g, KT, w, jp, jl, t, h]
    byte = x[:, :, :, :, :, 0] | (x[:, :, :, :, :, 1] << np.uint8(4))  # [N/8, g, KT, w, jp, t, h]
    byte = byte.transpose(0, 2, 1, 5, 3, 6, 4)  # [N/8, KT, g, t, w, h, jp]
    words = np.ascontiguousarray(byte).reshape(n // 8, k // 128, 32, 16).view("<u4")
    return QuantizedTensor(
        qweight=words.astype(np.uint32, copy=False),
        scales=np.ascontiguousarray(scales),
        zeros=zeros,
        shape=(n, k),
        group_size=group_size,
        symmetric=zeros is None,
        layout=layout_tag("int4", group_size, scale_dtype),
        encoding="int4",
    )


def unpack(qt: QuantizedTensor) -> np.ndarray:
    """Inverse of pack: the logical values q, np.uint8 [N, K] in 0..15."""
    _check_qt(qt)
    n, k = qt.shape
    b = np.ascontiguousarray(qt.qweight).view(np.uint8).reshape(n // 8, k // 128, 8, 4, 4, 2, 2)
    # b axes: [N/8, KT, g, t, w, h, jp]; split each byte into (jl = 0: low nibble, jl = 1: high nibble)
    out = np.empty((n // 8, 8, k // 128, 4, 2, 2, 4, 2), dtype=np.uint8)  # [N/8, g, KT, w, jp, jl, t, h]
    bt = b.transpose(0, 2, 1, 4, 6, 3, 5)  # [N/8, g, KT, w, jp, t, h]
    np.bitwise_and(bt, np.uint8(15), out=out[:, :, :, :, :, 0])
    np.right_shift(bt, np.uint8(4), out=out[:, :, :, :, :, 1])
    return out.reshape(n, k)


def dequantize(qt: QuantizedTensor) -> np.ndarray:
    """Reference dequantization: np.float32 [N, K], w = (q - z) * f32(s) (s bf16 or fp16: widened exactly,
    one rounding in the product)."""
    _check_qt(qt)
    n, k = qt.shape
    g = qt.group_size
    q = unpack(qt).reshape(n, k // g, g).astype(np.float32)
    z = np.float32(8.0) if qt.zeros is None else qt.zeros.astype(np.float32)[:, :, None]
    s = qt.scales_f32()[:, :, None]
    return ((q - z) * s).reshape(n, k)


def quantize_rtn(w, group_size: int, symmetric: bool) -> QuantizedTensor:
    """Round-to-nearest group quantization of a float weight.

    w: float array [N, K] (N % 8 == 0, K % 128 == 0), converted to float32.
    Symmetric: s = absmax / 7.5, z = 8 (the range -8 s .. 7 s, as GPTQ's symmetric mode).
    Asymmetric: s = (max(w, 0) - min(w, 0)) / 15, z = round(-min / s) in 0..15.
    Scales are rounded to the nearest bf16 first and q = clip(rint(w / s) + z, 0, 15) uses the stored
    scale (nanoqwen_quant's torch RTN/GPTQ grid matches this bit for bit). All-zero groups get scale 1.
    Error per element <= s/2 + clipping of at most 7.5 * 2**-8 s at the group maximum (the bf16
    rounding of s), and <= s asymmetric (the zero point is an integer).
    """
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise EncodingError(f"int4.quantize_rtn needs a 2-D weight, got shape {list(w.shape)}")
    n, k = w.shape
    _check_nk(n, k, group_size)
    if not np.isfinite(w).all():
        raise EncodingError("int4.quantize_rtn: weight has NaN or inf")
    wg = w.reshape(n, k // group_size, group_size)
    if symmetric:
        scale = np.abs(wg).max(axis=2) / np.float32(7.5)
    else:
        lo = np.minimum(wg.min(axis=2), 0)
        hi = np.maximum(wg.max(axis=2), 0)
        scale = (hi - lo) / np.float32(15.0)
    s_bits = bf16.from_f32(np.where(scale > 0, scale, np.float32(1.0)))
    s = bf16.to_f32(s_bits)
    if not (s > 0).all():  # a subnormal scale can round to bf16 zero
        s = np.where(s > 0, s, np.float32(1.0))
        s_bits = bf16.from_f32(s)
    if symmetric:
        zeros = None
        z = np.float32(8.0)
    else:
        zeros = np.clip(np.rint(-lo / s), 0, 15).astype(np.uint8)
        z = zeros.astype(np.float32)[:, :, None]
    q = np.clip(np.rint(wg / s[:, :, None]) + z, 0, 15).astype(np.uint8).reshape(n, k)
    return pack(q, s_bits, zeros, group_size)


def _check_qt(qt) -> None:
    if not isinstance(qt, QuantizedTensor) or qt.encoding != "int4":
        raise EncodingError(f"expected an int4 QuantizedTensor, got {type(qt).__name__}")
