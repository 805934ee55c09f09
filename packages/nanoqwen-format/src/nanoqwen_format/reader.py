"""The .nanoqwen reader: `open(path)` maps the file and parses header, trailer, index and metadata.

Opening reads the 64-byte header, the 64-byte trailer, the index and the metadata, nothing else: no
tensor byte is touched until an accessor asks for it, so opening a 5 GB file costs a few page
faults. Every length and offset is checked against the file size (with Python's unbounded ints, so
nothing overflows) before the bytes it describes are read; the index and metadata checksums are
checked before they are unpacked. Accessors return zero-copy, read-only numpy views over the mmap;
views stay valid after `close()` (the mapping is released when the last view is gone).
"""

from __future__ import annotations

import mmap
import os
import struct
import time

import numpy as np
import xxhash

from . import int4, int8
from .errors import (
    BadMagicError,
    ChecksumError,
    ClosedFileError,
    EncodingError,
    HeaderError,
    IndexChecksumError,
    LimitExceededError,
    MalformedIndexError,
    MetadataChecksumError,
    MetadataError,
    MisalignedError,
    MissingMetadataError,
    OutOfBoundsError,
    TensorNotFoundError,
    TrailerError,
    TruncatedError,
    UnsupportedEncodingError,
    UnsupportedVersionError,
)
from .metadata import check_tree, unpack_section
from .quantized import PLAIN_ENCODINGS, SCALE_DTYPES, QuantizedTensor, parse_layout
from .records import TensorRecord, parse_index
from .spec import (
    DATA_ALIGN,
    HEADER_NBYTES,
    MAGIC,
    MAJOR,
    MAX_INDEX_NBYTES,
    MAX_METADATA_NBYTES,
    MAX_TENSORS,
    MIN_FILE_NBYTES,
    TRAILER_MAGIC,
    TRAILER_NBYTES,
    xxh3,
)

__all__ = ["open", "NanoqwenFile", "StreamVerifier"]

_builtin_open = open


def open(path) -> NanoqwenFile:  # noqa: A001 - the DESIGN.md name
    """Open a .nanoqwen file for reading (use as a context manager). Raises FormatError subclasses."""
    return NanoqwenFile(path)


class NanoqwenFile:
    """A mapped, validated .nanoqwen file.

    Attributes: path, major, minor, data_offset, metadata (dict), records (dict[str, TensorRecord]
    in file order), index_offset, size (file bytes).
    """

    def __init__(self, path) -> None:
        self.path = os.fspath(path)
        self._mm: mmap.mmap | None = None
        with _builtin_open(self.path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            # Only the header page and the footer are read here: no readahead into tensor data
            # while parsing (the disk's readahead window can be megabytes); restored afterwards.
            _advise(fh.fileno(), None, random=True)
            head = os.pread(fh.fileno(), len(MAGIC), 0)
            if size < len(MAGIC):
                raise TruncatedError(
                    f"file is {size} bytes, too short for the magic", path=self.path, where="header"
                )
            if head != MAGIC:
                raise BadMagicError(
                    f"first bytes are {head!r}, expected {MAGIC!r}", path=self.path, where="header"
                )
            if size < MIN_FILE_NBYTES:
                raise TruncatedError(
                    f"file is {size} bytes; a complete file has at least {MIN_FILE_NBYTES}",
                    path=self.path,
                    where="header",
                )
            self._mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            self.size = size
            try:
                _advise(fh.fileno(), self._mm, random=True)
                self._parse()
                _advise(fh.fileno(), self._mm, random=False)
            except BaseException:
                self._release()
                raise

    # ---- parsing -------------------------------------------------------------------------------
    def _err(self, cls, where, msg, **kw):
        return cls(msg, path=self.path, where=where, **kw)

    def _parse(self) -> None:
        mm, size = self._mm, self.size
        major, minor, header_nbytes, data_offset = struct.unpack_from("<HHIQ", mm, 8)
        if major != MAJOR:
            raise self._err(
                UnsupportedVersionError,
                "header",
                f"file is version {major}.{minor}; this reader supports major version {MAJOR}",
            )
        (stored,) = struct.unpack_from("<Q", mm, 56)
        if xxh3(mm[:56]) != stored:
            raise self._err(HeaderError, "header", "header checksum mismatch (corrupt header)")
        if header_nbytes < HEADER_NBYTES or header_nbytes > DATA_ALIGN:
            raise self._err(HeaderError, "header", f"header_nbytes {header_nbytes} not in 64..4096")
        if data_offset % DATA_ALIGN or data_offset < DATA_ALIGN:
            raise self._err(
                MisalignedError,
                "header",
                f"data_offset {data_offset} is not a positive multiple of {DATA_ALIGN}",
            )
        self.major, self.minor, self.data_offset = major, minor, data_offset

        t0 = size - TRAILER_NBYTES
        tr = mm[t0:size]
        if tr[56:] != TRAILER_MAGIC:
            raise self._err(
                TruncatedError,
                "trailer",
                "no trailer magic at the end of the file: truncated or never finished",
            )
        idx_off, idx_n, idx_h, meta_off, meta_n, meta_h, tr_h = struct.unpack_from("<7Q", tr, 0)
        if xxh3(tr[:48]) != tr_h:
            raise self._err(TrailerError, "trailer", "trailer checksum mismatch (corrupt trailer)")
        if idx_n > MAX_INDEX_NBYTES:
            raise self._err(
                LimitExceededError, "trailer", f"index is {idx_n} bytes, over the limit of {MAX_INDEX_NBYTES}"
            )
        if meta_n > MAX_METADATA_NBYTES:
            raise self._err(
                LimitExceededError,
                "trailer",
                f"metadata is {meta_n} bytes, over the limit of {MAX_METADATA_NBYTES}",
            )
        if data_offset > t0:
            raise self._err(
                TruncatedError, "header", f"data_offset {data_offset} is past the trailer at {t0}"
            )
        if idx_off < data_offset or meta_off != idx_off + idx_n or meta_off + meta_n != t0:
            raise self._err(
                OutOfBoundsError,
                "trailer",
                f"index {idx_off}+{idx_n} and metadata {meta_off}+{meta_n} must be contiguous "
                f"and end at the trailer ({t0}), after data_offset {data_offset}",
            )
        self.index_offset = idx_off
        if hasattr(mmap, "MADV_WILLNEED"):  # one read for the whole footer instead of a fault per page
            start = idx_off - idx_off % mmap.PAGESIZE
            mm.madvise(mmap.MADV_WILLNEED, start, size - start)

        # Zero-copy views of the two sections: hashing and unpacking read the mapping directly.
        with memoryview(mm) as view:
            index_view = view[idx_off : idx_off + idx_n]
            meta_view = view[meta_off : meta_off + meta_n]
            try:
                index_obj, meta = self._unpack_sections(index_view, idx_h, meta_view, meta_h)
            finally:
                index_view.release()
                meta_view.release()
        self.records: dict[str, TensorRecord] = parse_index(
            index_obj, data_offset=data_offset, data_end=idx_off, path=self.path
        )
        if not isinstance(meta, dict):
            raise self._err(MetadataError, "metadata", f"metadata must be a map, got {type(meta).__name__}")
        check_tree(meta, "metadata", path=self.path)
        self.metadata: dict = meta

    def _unpack_sections(self, index_view, idx_h: int, meta_view, meta_h: int):
        if xxh3(index_view) != idx_h:
            raise self._err(IndexChecksumError, "index", "index checksum mismatch (corrupt index)")
        if xxh3(meta_view) != meta_h:
            raise self._err(
                MetadataChecksumError, "metadata", "metadata checksum mismatch (corrupt metadata)"
            )
        count = _array_header_count(index_view[:5].tobytes())
        if count is not None and count > MAX_TENSORS:  # before unpacking: a list costs 8 bytes/element
            raise self._err(
                LimitExceededError, "index", f"{count} tensors, over the limit of {MAX_TENSORS}"
            )
        index_obj = unpack_section(index_view, "index", MalformedIndexError, self.path)
        meta = unpack_section(meta_view, "metadata", MetadataError, self.path)
        return index_obj, meta

    # ---- metadata accessors ---------------------------------------------------------------------
    def _meta(self, key: str, typ: type):
        if key not in self.metadata:
            raise self._err(MissingMetadataError, "metadata", f"no {key!r} key")
        v = self.metadata[key]
        if not isinstance(v, typ):
            raise self._err(MetadataError, "metadata", f"{key!r} is a {type(v).__name__}, not {typ.__name__}")
        return v

    @property
    def config(self) -> dict:
        """metadata["config"]: the Qwen2 config (HF config.json key names)."""
        return self._meta("config", dict)

    @property
    def tokenizer_json(self) -> str:
        """metadata["tokenizer"]: the HF tokenizer.json content."""
        return self._meta("tokenizer", str)

    @property
    def chat_template(self) -> str:
        """metadata["chat_template"]: the jinja2 chat template."""
        return self._meta("chat_template", str)

    # ---- tensor accessors -----------------------------------------------------------------------
    def _rec(self, name: str) -> TensorRecord:
        self._check_open()
        try:
            return self.records[name]
        except KeyError:
            raise self._err(TensorNotFoundError, None, f"no tensor named {name!r}") from None

    def _check_open(self) -> None:
        if self._mm is None:
            raise self._err(ClosedFileError, None, "file is closed")

    def raw(self, name: str) -> np.ndarray:
        """Zero-copy read-only np.uint8 [nbytes] view of a tensor's bytes (any encoding)."""
        rec = self._rec(name)
        return np.frombuffer(self._mm, dtype=np.uint8, count=rec.nbytes, offset=rec.offset)

    def array(self, name: str) -> np.ndarray:
        """Zero-copy read-only view of a plain tensor with its shape.

        bf16 -> np.uint16 bit patterns, f16 -> np.float16, f32 -> np.float32.
        """
        rec = self._rec(name)
        if rec.encoding not in PLAIN_ENCODINGS:
            if rec.is_quantized:
                raise self._err(
                    EncodingError, f"tensor {name!r}", f"is {rec.encoding}; use quantized() or dequantize()"
                )
            raise self._err(
                UnsupportedEncodingError, f"tensor {name!r}", f"unknown encoding {rec.encoding!r}"
            )
        dt = PLAIN_ENCODINGS[rec.encoding]
        return np.frombuffer(self._mm, dtype=dt, count=rec.numel, offset=rec.offset).reshape(rec.shape)

    def quantized(self, name: str) -> QuantizedTensor:
        """QuantizedTensor of zero-copy read-only views of a quantized tensor's parts."""
        rec = self._rec(name)
        if not rec.is_quantized:
            if rec.encoding in PLAIN_ENCODINGS:
                raise self._err(
                    EncodingError, f"tensor {name!r}", f"is {rec.encoding}, not quantized; use array()"
                )
            raise self._err(
                UnsupportedEncodingError, f"tensor {name!r}", f"unknown encoding {rec.encoding!r}"
            )
        try:
            lay = parse_layout(rec.encoding, rec.layout, rec.shape, rec.group_size, rec.symmetric)
        except UnsupportedEncodingError as e:
            raise self._err(UnsupportedEncodingError, f"tensor {name!r}", e.reason) from None
        n, k, g = lay.n, lay.k, lay.group_size
        base = rec.offset
        if rec.encoding == "int4":
            qw = np.frombuffer(self._mm, "<u4", n * k // 8, base).reshape(n // 8, k // 128, 32, 4)
        else:
            qw = np.frombuffer(self._mm, np.int8, n * k, base).reshape(n, k)
        sdt = SCALE_DTYPES[lay.scale_dtype]  # bf16 bit patterns, or fp16 values (-f16s)
        scales = np.frombuffer(self._mm, sdt, n * (k // g), base + lay.scales_offset).reshape(n, k // g)
        zeros = None
        if lay.zeros_offset is not None:
            zeros = np.frombuffer(self._mm, np.uint8, n * (k // g), base + lay.zeros_offset).reshape(
                n, k // g
            )
        return QuantizedTensor(qw, scales, zeros, (n, k), g, lay.symmetric, rec.layout, rec.encoding)

    def dequantize(self, name: str) -> np.ndarray:
        """np.float32 copy of any known tensor: quantized ones dequantized, plain ones widened."""
        rec = self._rec(name)
        if rec.is_quantized:
            qt = self.quantized(name)
            return (int4 if rec.encoding == "int4" else int8).dequantize(qt)
        a = self.array(name)
        if rec.encoding == "bf16":
            from . import bf16

            return bf16.to_f32(a)
        return a.astype(np.float32)

    # ---- integrity ------------------------------------------------------------------------------
    def verify(self) -> int:
        """Check every tensor's xxh3-64 (index and metadata were checked at open).

        Returns the number of tensor bytes checked; raises ChecksumError naming the first bad tensor.
        """
        self._check_open()
        return sum(self.verify_tensor(name) for name in self.records)

    def verify_tensor(self, name: str) -> int:
        """Check one tensor's xxh3-64 (a loader calls it as it reads each tensor: one pass over the
        bytes instead of `verify()` then the reads). Returns its byte count; raises ChecksumError
        naming the tensor."""
        rec = self._rec(name)
        with memoryview(self._mm) as view:
            got = xxh3(view[rec.offset : rec.offset + rec.nbytes])
        if got != rec.checksum:
            raise self._checksum_error(rec, got)
        return rec.nbytes

    def stream_verifier(self) -> StreamVerifier:
        """A `StreamVerifier` of this file's tensors, for a loader that copies the data region in
        chunks and hashes the bytes as they pass (instead of a separate `verify()` pass)."""
        self._check_open()
        return StreamVerifier(self)

    def _checksum_error(self, rec: TensorRecord, computed: int) -> ChecksumError:
        return self._err(
            ChecksumError,
            f"tensor {rec.name!r}",
            f"checksum mismatch: stored {rec.checksum:016x}, computed {computed:016x}",
            tensor=rec.name,
        )

    # ---- lifetime -------------------------------------------------------------------------------
    def _release(self) -> None:
        mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # numpy views still export the buffer; the mapping goes when they do

    def close(self) -> None:
        """Release the file. Arrays obtained earlier stay valid."""
        self._release()

    def __enter__(self) -> NanoqwenFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        version = f"{getattr(self, 'major', '?')}.{getattr(self, 'minor', '?')}"
        return f"NanoqwenFile({self.path!r}, version {version}, {len(getattr(self, 'records', {}))} tensors)"


class StreamVerifier:
    """Per-tensor xxh3-64 over bytes that arrive in chunks, in file order (`NanoqwenFile.stream_verifier`).

    `feed(offset, chunk)` takes the file's bytes `[offset, offset + len(chunk))`; each call continues
    where the previous one ended (any chunk size; the first may start anywhere up to the first
    tensor). Each tensor's hash gets exactly its own `nbytes` bytes from its `offset` (SPEC.md section
    4: the zero padding between tensors is not covered); when its last byte has arrived, the digest is
    compared and a mismatch raises `ChecksumError` naming the tensor (and every later `feed` raises it
    again). `finish()` checks that every tensor was seen. `seconds` is the time spent hashing.
    Not thread-safe: feed it from one thread at a time (a loader may use one worker thread: xxhash
    releases the GIL, so hashing overlaps the copies).
    """

    def __init__(self, f: NanoqwenFile) -> None:
        self._f = f
        self._recs = list(f.records.values())  # in increasing offset order (SPEC.md section 6)
        self._i = 0  # the first tensor not yet complete
        self._h = None  # streaming xxh3 state of tensor _i once its first byte arrived
        self._pos: int | None = None
        self.error: ChecksumError | None = None
        self.nbytes = 0
        self.seconds = 0.0

    def feed(self, offset: int, chunk) -> None:
        """Hash the tensor bytes inside `chunk` (a contiguous bytes-like, e.g. a uint8 numpy array)."""
        if self.error is not None:
            raise self.error
        end = offset + len(chunk)
        if self._pos is not None and offset != self._pos:
            raise ValueError(f"chunks must be contiguous: expected offset {self._pos}, got {offset}")
        self._pos = end
        t0 = time.perf_counter()
        try:
            view = memoryview(chunk).cast("B")
            while self._i < len(self._recs):
                rec = self._recs[self._i]
                r0, r1 = rec.offset, rec.offset + rec.nbytes
                if r0 > end or (r0 == end and r1 > r0):
                    break  # starts in a later chunk
                if self._h is None:
                    if r0 < offset:
                        raise ValueError(f"tensor {rec.name!r} starts at {r0}, before the first chunk")
                    self._h = xxhash.xxh3_64()
                lo, hi = max(r0, offset), min(r1, end)
                if hi > lo:
                    self._h.update(view[lo - offset : hi - offset])
                    self.nbytes += hi - lo
                if r1 > end:
                    break  # continues in the next chunk
                got, self._h = self._h.intdigest(), None
                self._i += 1
                if got != rec.checksum:
                    self.error = self._f._checksum_error(rec, got)
                    raise self.error
        finally:
            self.seconds += time.perf_counter() - t0

    def finish(self) -> int:
        """Raise if a tensor's bytes did not all arrive; return the tensor bytes hashed."""
        if self.error is not None:
            raise self.error
        if self._i < len(self._recs):
            raise ValueError(f"stream ended before tensor {self._recs[self._i].name!r} was complete")
        return self.nbytes


def _array_header_count(data: bytes) -> int | None:
    """Element count declared by a msgpack array header at the start of `data` (None if not an array)."""
    if not data:
        return None
    b = data[0]
    if 0x90 <= b <= 0x9F:
        return b & 0x0F
    if b == 0xDC and len(data) >= 3:
        return int.from_bytes(data[1:3], "big")
    if b == 0xDD and len(data) >= 5:
        return int.from_bytes(data[1:5], "big")
    return None


def _advise(fd: int, mm: mmap.mmap | None, random: bool) -> None:
    """Readahead hints (Linux): random access while parsing, normal (sequential) access afterwards."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM if random else os.POSIX_FADV_NORMAL)
    if mm is not None and hasattr(mmap, "MADV_RANDOM"):
        mm.madvise(mmap.MADV_RANDOM if random else mmap.MADV_NORMAL)
