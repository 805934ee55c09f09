"""Group-wise symmetric INT8 in the `int8-g{G}-rowmajor-v1` layout (the lm_head option).

w[n, k] = q[n, k] * f32(s[n, k // G]) with q int8 in -127..127, stored row-major [N, K] at offset 0 of
the record, bf16 scales [N, K/G] at align_up(N*K, 256). Same four functions as `int4`.
"""

from __future__ import annotations

import numpy as np

from . import bf16
from .errors import EncodingError
from .quantized import GROUP_SIZES, QuantizedTensor, layout_tag

__all__ = ["quantize_rtn", "pack", "unpack", "dequantize"]


def pack(q, scales, zeros, group_size: int) -> QuantizedTensor:
    """Wrap int8 values and bf16 scales as a QuantizedTensor (encoding "int8").

    Same signature as `int4.pack`. q: int8 [N, K] in -127..127; scales: uint16 bf16 bits [N, K/G];
    zeros must be None (the layout is symmetric only).
    """
    if zeros is not None:
        raise EncodingError("int8 rowmajor is symmetric only: zeros must be None")
    q = np.asarray(q)
    if q.ndim != 2 or q.dtype != np.int8:
        raise EncodingError(f"int8.pack needs q as int8 [N, K], got {q.dtype} {list(q.shape)}")
    if group_size not in GROUP_SIZES:
        raise EncodingError(f"int8 group_size must be one of {GROUP_SIZES}, got {group_size!r}")
    if q.size and int(q.min()) < -127:
        raise EncodingError("int8.pack: q has value -128 (the range is -127..127)")
    n, k = q.shape
    return QuantizedTensor(
        qweight=np.ascontiguousarray(q),
        scales=np.ascontiguousarray(scales),
        zeros=None,
        shape=(n, k),
        group_size=group_size,
        symmetric=True,
        layout=layout_tag("int8", group_size),
        encoding="int8",
    )


def unpack(qt: QuantizedTensor) -> np.ndarray:
    """The logical values q, np.int8 [N, K]."""
    _check_qt(qt)
    return np.asarray(qt.qweight)


def dequantize(qt: QuantizedTensor) -> np.ndarray:
    """Reference dequantization: np.float32 [N, K], w = q * f32(s)."""
    _check_qt(qt)
    n, k = qt.shape
    g = qt.group_size
    q = qt.qweight.reshape(n, k // g, g).astype(np.float32)
    return (q * bf16.to_f32(qt.scales)[:, :, None]).reshape(n, k)


def quantize_rtn(w, group_size: int, symmetric: bool = True) -> QuantizedTensor:
    """Round-to-nearest symmetric int8: s = absmax / 127 (rounded to nearest bf16), q = clip(rint(w / s)).

    w: float array [N, K] with K % group_size == 0.
    """
    if not symmetric:
        raise EncodingError("int8 rowmajor is symmetric only")
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise EncodingError(f"int8.quantize_rtn needs a 2-D weight, got shape {list(w.shape)}")
    n, k = w.shape
    if group_size not in GROUP_SIZES or k % group_size:
        raise EncodingError(f"int8: K={k} must be a multiple of group_size in {GROUP_SIZES}")
    if not np.isfinite(w).all():
        raise EncodingError("int8.quantize_rtn: weight has NaN or inf")
    wg = w.reshape(n, k // group_size, group_size)
    scale = np.abs(wg).max(axis=2) / np.float32(127.0)
    s_bits = bf16.from_f32(np.where(scale > 0, scale, np.float32(1.0)))
    s = bf16.to_f32(s_bits)
    if not (s > 0).all():  # a subnormal scale can round to bf16 zero
        s = np.where(s > 0, s, np.float32(1.0))
        s_bits = bf16.from_f32(s)
    q = np.clip(np.rint(wg / s[:, :, None]), -127, 127).astype(np.int8).reshape(n, k)
    return pack(q, s_bits, None, group_size)


def _check_qt(qt) -> None:
    if not isinstance(qt, QuantizedTensor) or qt.encoding != "int8":
        raise EncodingError(f"expected an int8 QuantizedTensor, got {type(qt).__name__}")
