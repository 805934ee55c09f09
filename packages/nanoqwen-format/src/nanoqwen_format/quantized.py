"""Encodings, layout tags and the QuantizedTensor container shared by int4 and int8.

A record's `encoding` is the family ("bf16", "f16", "f32", "int4", "int8"). Quantized families also
carry a `layout` tag that fixes the byte arrangement exactly, e.g. "int4-g128-tile8x128-v1"; a tag
never changes meaning, a new arrangement gets a new tag. "int4-g{G}-tile8x128-f16s-v1" (container
1.1) is the tile layout with IEEE fp16 scales instead of bf16 ones, for imported GPTQ/AWQ checkpoints
whose fp16 scales do not survive a rounding to bf16; its zero points may be 0..16. This module parses
tags, computes the byte length of a record from (encoding, shape, group size, symmetric) and the
offsets of the parts
(qweight, scales, zeros) inside one quantized tensor's bytes (DESIGN.md, SPEC.md section 8).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from . import bf16
from .errors import EncodingError, UnsupportedEncodingError
from .spec import align_up

__all__ = [
    "PLAIN_ENCODINGS",
    "QUANT_ENCODINGS",
    "GROUP_SIZES",
    "PART_ALIGN",
    "QuantizedTensor",
    "QuantLayout",
    "parse_layout",
    "layout_tag",
    "plain_dtype",
    "SCALE_DTYPES",
]

PLAIN_ENCODINGS = {"bf16": np.dtype("<u2"), "f16": np.dtype("<f2"), "f32": np.dtype("<f4")}
QUANT_ENCODINGS = ("int4", "int8")
GROUP_SIZES = (32, 64, 128)
PART_ALIGN = 256  # parts inside a quantized tensor start on 256-byte boundaries

_LAYOUT_RE = re.compile(r"^(int4|int8)-g([0-9]+)-(tile8x128|rowmajor)(-f16s)?-v1$")
_KNOWN_LAYOUTS = {("int4", "tile8x128", ""), ("int4", "tile8x128", "-f16s"), ("int8", "rowmajor", "")}
# scale dtype name -> numpy dtype of the `scales` part as QuantizedTensor holds it
# (bf16: the uint16 bit patterns, numpy has no bf16; f16: IEEE binary16 values)
SCALE_DTYPES = {"bf16": np.dtype("<u2"), "f16": np.dtype("<f2")}
# the largest zero point each scale dtype's layout allows: 15 for the v1 tile layout (nanoqwen's own
# quantizers), 16 for f16s (GPTQ v1 checkpoints store z - 1 in a nibble, so z reaches 16)
MAX_ZERO = {"bf16": 15, "f16": 16}


def plain_dtype(encoding: str) -> np.dtype:
    """Little-endian numpy storage dtype of a plain encoding (bf16 -> uint16 bit patterns)."""
    try:
        return PLAIN_ENCODINGS[encoding]
    except KeyError:
        raise UnsupportedEncodingError(f"unknown plain encoding {encoding!r}") from None


def layout_tag(encoding: str, group_size: int, scale_dtype: str = "bf16") -> str:
    """The v1 layout tag for an encoding family, group size and scale dtype ("bf16", or "f16": int4 only,
    the `-f16s` variant)."""
    arrangement = {"int4": "tile8x128", "int8": "rowmajor"}.get(encoding)
    if arrangement is None or group_size not in GROUP_SIZES:
        raise EncodingError(f"no layout for encoding {encoding!r} with group size {group_size!r}")
    if scale_dtype not in SCALE_DTYPES or (scale_dtype == "f16" and encoding != "int4"):
        raise EncodingError(f"no {encoding} layout with {scale_dtype!r} scales")
    suffix = "-f16s" if scale_dtype == "f16" else ""
    return f"{encoding}-g{group_size}-{arrangement}{suffix}-v1"


@dataclass(frozen=True)
class QuantLayout:
    """Byte arrangement of one quantized tensor [N, K]: part offsets and total length."""

    encoding: str
    n: int
    k: int
    group_size: int
    symmetric: bool
    qweight_nbytes: int
    scales_offset: int
    zeros_offset: int | None
    nbytes: int
    scale_dtype: str = "bf16"  # "bf16" or "f16" (the -f16s tag): 2 bytes per scale either way


def parse_layout(encoding: str, layout: str, shape, group_size: int, symmetric: bool) -> QuantLayout:
    """Check a quantized record's fields against each other and return its part layout.

    Raises UnsupportedEncodingError for a tag this library does not know, and EncodingError when
    the fields contradict each other or the layout's shape rules (int4: N % 8 == 0, K % 128 == 0).
    """
    m = _LAYOUT_RE.match(layout) if isinstance(layout, str) else None
    if m is None or (m.group(1), m.group(3), m.group(4) or "") not in _KNOWN_LAYOUTS:
        raise UnsupportedEncodingError(f"unknown layout tag {layout!r}")
    fam, g = m.group(1), int(m.group(2))
    scale_dtype = "f16" if m.group(4) else "bf16"
    if fam != encoding:
        raise EncodingError(f"layout {layout!r} does not belong to encoding {encoding!r}")
    if g not in GROUP_SIZES or g != group_size:
        raise EncodingError(f"layout {layout!r} disagrees with group_size {group_size!r}")
    if len(shape) != 2:
        raise EncodingError(f"{encoding} tensors are 2-D [N, K], got shape {list(shape)}")
    n, k = int(shape[0]), int(shape[1])
    if k % group_size:
        raise EncodingError(f"K={k} is not a multiple of the group size {group_size}")
    groups = n * (k // group_size)
    if fam == "int4":
        if n % 8 or k % 128:
            raise EncodingError(f"int4 tile8x128 needs N % 8 == 0 and K % 128 == 0, got [{n}, {k}]")
        qbytes = n * k // 2
        scales_offset = align_up(qbytes, PART_ALIGN)
        if symmetric:
            zeros_offset, nbytes = None, scales_offset + 2 * groups
        else:
            zeros_offset = align_up(scales_offset + 2 * groups, PART_ALIGN)
            nbytes = zeros_offset + groups
    else:
        if not symmetric:
            raise EncodingError("int8 rowmajor is symmetric only")
        qbytes = n * k
        scales_offset = align_up(qbytes, PART_ALIGN)
        zeros_offset, nbytes = None, scales_offset + 2 * groups
    return QuantLayout(fam, n, k, group_size, bool(symmetric), qbytes, scales_offset, zeros_offset, nbytes,
                       scale_dtype)


@dataclass(frozen=True, eq=False)
class QuantizedTensor:
    """A group-quantized weight [N, K] in one of the layout tags.

    qweight: int4 -> np.uint32 [N/8, K/128, 32, 4] (tile8x128 words); int8 -> np.int8 [N, K]
    scales:  [N, K/G], row-major: np.uint16 bf16 bit patterns, or np.float16 for the `-f16s` layout
    zeros:   np.uint8 [N, K/G] in 0..15 (0..16 for `-f16s`; int4 asymmetric) or None (symmetric:
             implicit 8 for int4)
    shape:   (N, K) logical shape; group_size: G in {32, 64, 128}
    layout:  the layout tag, e.g. "int4-g128-tile8x128-v1"; encoding: "int4" or "int8"
    The constructor checks every dtype and shape against the layout.
    """

    qweight: np.ndarray
    scales: np.ndarray
    zeros: np.ndarray | None
    shape: tuple
    group_size: int
    symmetric: bool
    layout: str
    encoding: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        lay = parse_layout(self.encoding, self.layout, self.shape, self.group_size, self.symmetric)
        n, k, g = lay.n, lay.k, self.group_size
        if self.encoding == "int4":
            _check(self.qweight, np.uint32, (n // 8, k // 128, 32, 4), "qweight")
        else:
            _check(self.qweight, np.int8, (n, k), "qweight")
        _check(self.scales, SCALE_DTYPES[lay.scale_dtype], (n, k // g), "scales")
        if self.symmetric:
            if self.zeros is not None:
                raise EncodingError("symmetric QuantizedTensor must have zeros=None")
        else:
            _check(self.zeros, np.uint8, (n, k // g), "zeros")

    @property
    def scale_dtype(self) -> str:
        """"bf16" (scales hold bf16 bit patterns) or "f16" (np.float16 values, the `-f16s` layout)."""
        return self.part_layout.scale_dtype

    def scales_f32(self) -> np.ndarray:
        """The scales widened to np.float32 [N, K/G] (exact for both scale dtypes)."""
        if self.scale_dtype == "f16":
            return self.scales.astype(np.float32)
        return bf16.to_f32(self.scales)

    @property
    def part_layout(self) -> QuantLayout:
        """Offsets of the parts inside the record bytes (see DESIGN.md)."""
        return parse_layout(self.encoding, self.layout, self.shape, self.group_size, self.symmetric)

    @property
    def nbytes(self) -> int:
        """Byte length of the record this tensor becomes in a file."""
        return self.part_layout.nbytes

    def to_bytes_parts(self):
        """Yield (offset, contiguous little-endian array) for each part, in file order."""
        lay = self.part_layout
        yield 0, _le(self.qweight)
        yield lay.scales_offset, _le(self.scales)
        if lay.zeros_offset is not None:
            yield lay.zeros_offset, np.ascontiguousarray(self.zeros)


def _le(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a if a.dtype.byteorder in ("<", "|", "=") else a.astype(a.dtype.newbyteorder("<"))


def _check(a, dtype, shape, what: str) -> None:
    if not isinstance(a, np.ndarray):
        raise EncodingError(f"{what} must be a numpy array, got {type(a).__name__}")
    if a.dtype != np.dtype(dtype):
        raise EncodingError(f"{what} must be {np.dtype(dtype)}, got {a.dtype}")
    if tuple(a.shape) != tuple(shape):
        raise EncodingError(f"{what} must have shape {list(shape)}, got {list(a.shape)}")
