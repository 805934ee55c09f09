"""Tensor records: the index entries of a .nanoqwen file, their validation and their msgpack form.

The index is a msgpack array of maps, one per tensor in increasing offset order (SPEC.md section 7.1).
`parse_index` turns the unpacked array into `TensorRecord`s and applies every per-record rule of the
spec: field types, name and tag lengths, rank, element count, alignment, bounds inside the data
region, no overlap, byte length implied by shape and encoding. Records of an encoding or layout this
library does not know are kept (so the file still opens and `verify()` still works); their bytes are
only bounds-checked, and accessing them raises UnsupportedEncodingError.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import (
    DimensionOverflowError,
    DuplicateTensorError,
    EncodingError,
    LimitExceededError,
    MalformedIndexError,
    MisalignedError,
    OutOfBoundsError,
    OverlapError,
    ShapeMismatchError,
    UnsupportedEncodingError,
)
from .quantized import PLAIN_ENCODINGS, QUANT_ENCODINGS, parse_layout
from .spec import MAX_ELEMENTS, MAX_NAME_NBYTES, MAX_RANK, MAX_TAG_NBYTES, MAX_TENSORS, MAX_U64, TENSOR_ALIGN

__all__ = ["TensorRecord", "parse_index", "record_to_map", "expected_nbytes"]


@dataclass(frozen=True)
class TensorRecord:
    """One tensor's index entry.

    name: str; encoding: "bf16" | "f16" | "f32" | "int4" | "int8" | (unknown, kept as read)
    dtype: logical element type ("bf16", "f16", "f32"; quantized tensors: "bf16", their compute type)
    shape: tuple of ints >= 1; offset: absolute byte offset in the file (multiple of 256)
    nbytes: byte length; checksum: xxh3-64 of those bytes
    group_size, symmetric, layout: quantized encodings only (None for plain encodings)
    """

    name: str
    encoding: str
    dtype: str
    shape: tuple
    offset: int
    nbytes: int
    checksum: int
    group_size: int | None = None
    symmetric: bool | None = None
    layout: str | None = None

    @property
    def is_quantized(self) -> bool:
        return self.encoding in QUANT_ENCODINGS

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def expected_nbytes(encoding: str, shape, group_size=None, symmetric=None, layout=None) -> int:
    """Byte length that a known encoding implies; raises UnsupportedEncodingError for unknown ones."""
    if encoding in PLAIN_ENCODINGS:
        n = PLAIN_ENCODINGS[encoding].itemsize
        for d in shape:
            n *= d
        return n
    if encoding in QUANT_ENCODINGS:
        return parse_layout(encoding, layout, shape, group_size, symmetric).nbytes
    raise UnsupportedEncodingError(f"unknown encoding {encoding!r}")


def record_to_map(rec: TensorRecord) -> dict:
    """The msgpack map of a record (keys per SPEC.md section 7.1)."""
    m = {
        "name": rec.name,
        "encoding": rec.encoding,
        "dtype": rec.dtype,
        "shape": list(rec.shape),
        "offset": rec.offset,
        "nbytes": rec.nbytes,
        "xxh3": rec.checksum,
    }
    if rec.encoding in QUANT_ENCODINGS:
        m["group_size"] = rec.group_size
        m["symmetric"] = rec.symmetric
        m["layout"] = rec.layout
    return m


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _tag(m: dict, key: str, where: str, path, required: bool = True) -> str | None:
    v = m.get(key)
    if v is None and not required:
        return None
    if not isinstance(v, str):
        raise MalformedIndexError(
            f"field {key!r} must be a string, got {type(v).__name__}", path=path, where=where
        )
    if len(v.encode("utf-8", "surrogatepass")) > MAX_TAG_NBYTES:
        raise LimitExceededError(
            f"field {key!r} is longer than {MAX_TAG_NBYTES} bytes", path=path, where=where
        )
    return v


def check_record(rec: TensorRecord, *, path=None, where: str | None = None) -> None:
    """Rules that need only the record itself: names, rank, dims, element count, encoding fields, nbytes.

    Shared by the reader and the writer. Raises the specific FormatError subclass.
    """
    where = where or f"tensor {rec.name!r}"
    if not rec.name:
        raise MalformedIndexError("empty tensor name", path=path, where=where)
    if len(rec.name.encode("utf-8", "surrogatepass")) > MAX_NAME_NBYTES:
        raise LimitExceededError(f"name is longer than {MAX_NAME_NBYTES} UTF-8 bytes", path=path, where=where)
    if len(rec.shape) > MAX_RANK:
        raise LimitExceededError(
            f"rank {len(rec.shape)} exceeds the limit of {MAX_RANK}", path=path, where=where
        )
    if len(rec.shape) == 0:
        raise MalformedIndexError("shape is empty (rank 0 is not allowed)", path=path, where=where)
    numel = 1
    for d in rec.shape:
        if not _int(d) or d < 1:
            raise MalformedIndexError(f"dimension {d!r} is not an integer >= 1", path=path, where=where)
        numel *= d
        if numel > MAX_ELEMENTS:
            raise DimensionOverflowError(
                f"shape {list(rec.shape)} has more than 2**62 elements", path=path, where=where
            )
    known = rec.encoding in PLAIN_ENCODINGS or rec.encoding in QUANT_ENCODINGS
    if rec.encoding in PLAIN_ENCODINGS:
        if rec.dtype != rec.encoding:
            raise MalformedIndexError(
                f"dtype {rec.dtype!r} must equal encoding {rec.encoding!r}", path=path, where=where
            )
    elif rec.encoding in QUANT_ENCODINGS:
        if rec.dtype != "bf16":
            raise MalformedIndexError(
                f"dtype of a {rec.encoding} tensor must be 'bf16', got {rec.dtype!r}", path=path, where=where
            )
        if not _int(rec.group_size) or not isinstance(rec.symmetric, bool) or not isinstance(rec.layout, str):
            raise MalformedIndexError(
                "quantized record needs int group_size, bool symmetric, str layout", path=path, where=where
            )
    if known:
        try:
            exp = expected_nbytes(rec.encoding, rec.shape, rec.group_size, rec.symmetric, rec.layout)
        except UnsupportedEncodingError:
            return  # unknown layout tag of a known family: kept, checked on access
        except EncodingError as e:
            raise ShapeMismatchError(e.reason, path=path, where=where) from None
        if exp != rec.nbytes:
            raise ShapeMismatchError(
                f"nbytes is {rec.nbytes} but shape {list(rec.shape)} in {rec.layout or rec.encoding} "
                f"needs {exp}",
                path=path,
                where=where,
            )


def parse_index(obj, *, data_offset: int, data_end: int, path=None) -> dict[str, TensorRecord]:
    """Validate an unpacked index and return {name: TensorRecord} in file order.

    data_offset .. data_end is the region tensors must lie in (data_end = index_offset).
    """
    if not isinstance(obj, list):
        raise MalformedIndexError(
            f"index must be an array, got {type(obj).__name__}", path=path, where="index"
        )
    if len(obj) > MAX_TENSORS:
        raise LimitExceededError(
            f"{len(obj)} tensors, over the limit of {MAX_TENSORS}", path=path, where="index"
        )
    records: dict[str, TensorRecord] = {}
    prev_end, prev_name = data_offset, None
    for i, m in enumerate(obj):
        where = f"index record {i}"
        if not isinstance(m, dict):
            raise MalformedIndexError(f"record must be a map, got {type(m).__name__}", path=path, where=where)
        name = m.get("name")
        if not isinstance(name, str):
            raise MalformedIndexError("field 'name' must be a string", path=path, where=where)
        where = f"index record {i} ({name[:80]!r})"
        encoding = _tag(m, "encoding", where, path)
        dtype = _tag(m, "dtype", where, path)
        shape = m.get("shape")
        if not isinstance(shape, list):
            raise MalformedIndexError("field 'shape' must be an array", path=path, where=where)
        for key in ("offset", "nbytes", "xxh3"):
            v = m.get(key)
            if not _int(v) or not 0 <= v <= MAX_U64:
                raise MalformedIndexError(
                    f"field {key!r} must be an unsigned 64-bit int, got {v!r}", path=path, where=where
                )
        quant = encoding in QUANT_ENCODINGS
        gs, sym, layout = m.get("group_size"), m.get("symmetric"), m.get("layout")
        if layout is not None:
            layout = _tag(m, "layout", where, path)
        rec = TensorRecord(
            name=name,
            encoding=encoding,
            dtype=dtype,
            shape=tuple(shape),
            offset=m["offset"],
            nbytes=m["nbytes"],
            checksum=m["xxh3"],
            group_size=gs if quant else None,
            symmetric=sym if quant else None,
            layout=layout if quant else None,
        )
        if name in records:
            raise DuplicateTensorError(f"tensor name {name!r} appears twice", path=path, where=where)
        # Placement first (alignment, inside the data region, no overlap): these protect memory.
        if rec.offset % TENSOR_ALIGN:
            raise MisalignedError(
                f"offset {rec.offset} is not a multiple of {TENSOR_ALIGN}", path=path, where=where
            )
        end = rec.offset + rec.nbytes
        if rec.offset < data_offset or end > data_end:
            raise OutOfBoundsError(
                f"bytes {rec.offset}..{end} are outside the data region {data_offset}..{data_end}",
                path=path,
                where=where,
            )
        if rec.offset < prev_end:
            raise OverlapError(
                f"starts at {rec.offset}, before the end {prev_end} of the previous tensor {prev_name!r} "
                "(records must be in increasing offset order without overlap)",
                path=path,
                where=where,
            )
        check_record(rec, path=path, where=where)
        prev_end, prev_name = end, name
        records[name] = rec
    return records
