"""bfloat16 <-> float32 conversions on numpy arrays.

numpy has no bf16 dtype, so nanoqwen carries bf16 values as `np.uint16` bit patterns: the upper
16 bits of the IEEE float32 with the same sign, exponent and top 7 mantissa bits. `from_f32`
rounds to nearest, ties to even (what torch's `.to(torch.bfloat16)` does); NaNs stay NaN (quiet) and
keep their sign. `to_f32` is exact. torch code views the bits with
`torch.from_numpy(bits).view(torch.bfloat16)`.
"""

from __future__ import annotations

import numpy as np

from .errors import EncodingError

__all__ = ["from_f32", "to_f32"]


def from_f32(a) -> np.ndarray:
    """Round float values to bf16, nearest-even.

    a: array-like of any float dtype (converted to float32 first), any shape.
    Returns np.uint16 bf16 bit patterns of the same shape.
    """
    f = np.ascontiguousarray(a, dtype=np.float32)
    bits = f.view(np.uint32)
    # Add 0x7FFF plus the lowest kept bit, then truncate: round half to even. Overflow of the
    # largest finite values carries into the exponent and gives +-inf, which is correct.
    # (In place, so the peak is one uint32 temporary plus the output.)
    r = bits >> np.uint32(16)
    r &= np.uint32(1)
    r += np.uint32(0x7FFF)
    r += bits
    r >>= np.uint32(16)
    out = r.astype(np.uint16)
    del r
    nan = np.isnan(f)
    if nan.any():
        out[nan] = ((bits[nan] >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16)
    return out


def to_f32(bits) -> np.ndarray:
    """Widen bf16 bit patterns to float32 exactly.

    bits: np.uint16 (or int16) array-like of bf16 bit patterns, any shape.
    Returns np.float32 array of the same shape.
    """
    b = np.asarray(bits)
    if b.dtype not in (np.uint16, np.int16):
        raise EncodingError(f"bf16.to_f32 needs uint16 bit patterns, got dtype {b.dtype}")
    return (b.astype(np.uint32) << np.uint32(16)).view(np.float32)

