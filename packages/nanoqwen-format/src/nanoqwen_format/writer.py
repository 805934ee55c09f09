"""The streaming .nanoqwen writer.

Tensors are written one by one as they are added, each hashed and padded to a 256-byte boundary,
so memory holds at most the tensor being written (plus the small index). The index, the metadata
and the trailer go at the end (SPEC.md section 3), which is why no offset needs to be known in
advance. Everything is written to a temporary file `NAME.partial-PID-RANDOM` in the destination
folder (partials.py: mode 0666 & ~umask, locked while written; stale ones of a killed writer are
removed first, and a running write to the same path is refused); on a clean exit of the `with`
block it is flushed, fsynced and renamed over `path` atomically (then the folder is fsynced). An
existing file at `path` is replaced; a directory or another non-regular file there is refused
before anything is written. On any exception, KeyboardInterrupt included, the temporary file is
removed and `path` is left untouched. The writer applies the same hard limits as the reader before
writing a byte.
"""

from __future__ import annotations

import errno
import os
import stat
import warnings
from collections.abc import Callable

import msgpack
import numpy as np
import xxhash

from . import bf16
from .errors import (
    DuplicateTensorError,
    EncodingError,
    LimitExceededError,
    WriterStateError,
)
from .metadata import pack_metadata
from .partials import PartialFile, PartialFileWarning, clean_partials, create_partial
from .quantized import PLAIN_ENCODINGS, QuantizedTensor
from .records import TensorRecord, check_record, record_to_map
from .spec import (
    DATA_ALIGN,
    MAX_INDEX_NBYTES,
    MAX_TENSORS,
    TENSOR_ALIGN,
    align_up,
    pack_header,
    pack_trailer,
    xxh3,
)

__all__ = ["Writer"]

_ZEROS = bytes(DATA_ALIGN)


class Writer:
    """Stream tensors into a new .nanoqwen file at `path` (see the module docstring).

    with Writer(path) as w:
        w.add_array(name, array, encoding="bf16")   # "bf16" | "f16" | "f32"
        w.add_quantized(name, qt)                   # QuantizedTensor from nqf.int4 / nqf.int8
        w.set_metadata(meta)                        # any time before the block exits

    `partials`: after open(), the temp files of earlier writes to `path` that were removed (stale)
    or left alone. Each is reported to `on_partial(PartialFile)` (`str()` of it is a one-line report)
    or, without it, as a PartialFileWarning.
    """

    def __init__(self, path, on_partial: Callable[[PartialFile], None] | None = None) -> None:
        self.path = os.fspath(path)
        self._on_partial = on_partial
        self._fh = None
        self._tmp: str | None = None
        self._records: list[TensorRecord] = []
        self._names: set[str] = set()
        self._meta_bytes: bytes = pack_metadata({})
        self._pos = 0
        self._state = "new"  # new -> open -> done | failed
        self.partials: list[PartialFile] = []

    # ---- lifetime -------------------------------------------------------------------------------
    def __enter__(self) -> Writer:
        self.open()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            self.close()
        else:
            self.abort()
        return False

    def open(self) -> None:
        """Check the target, clean up after earlier writes, create the temp file and write the header
        (called by `with`). IsADirectoryError / FileExistsError when `path` is a directory or another
        non-regular file; ConcurrentWriteError when a live writer is writing `path`."""
        if self._state != "new":
            raise WriterStateError(f"writer is {self._state}; open() only once", path=self.path)
        _check_target(self.path)
        self.partials = clean_partials(self.path)
        for p in self.partials:
            if self._on_partial is not None:
                self._on_partial(p)
            else:
                warnings.warn(f"{self.path}: {p}", PartialFileWarning, stacklevel=2)
        fd, self._tmp = create_partial(self.path)
        self._fh = os.fdopen(fd, "wb")
        self._state = "open"
        try:
            self._write(pack_header(DATA_ALIGN))
            self._pad_to(DATA_ALIGN)
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """Discard everything written; remove the temporary file. Safe to call more than once."""
        fh, self._fh = self._fh, None
        if fh is not None:
            try:
                fh.close()
            except OSError:
                pass
        tmp, self._tmp = self._tmp, None
        if tmp is not None:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        if self._state != "done":
            self._state = "failed"

    def close(self) -> None:
        """Write index, metadata and trailer, then rename the file into place."""
        self._check_open()
        try:
            index_bytes = _pack_index(self._records)
            if len(index_bytes) > MAX_INDEX_NBYTES:
                raise LimitExceededError(
                    f"index packs to {len(index_bytes)} bytes, over the limit of {MAX_INDEX_NBYTES}",
                    path=self.path,
                    where="index",
                )
            index_offset = self._pos
            self._write(index_bytes)
            meta_offset = self._pos
            self._write(self._meta_bytes)
            self._write(
                pack_trailer(
                    index_offset,
                    len(index_bytes),
                    xxh3(index_bytes),
                    meta_offset,
                    len(self._meta_bytes),
                    xxh3(self._meta_bytes),
                )
            )
            self._fh.flush()
            os.fsync(self._fh.fileno())
            self._fh.close()
            self._fh = None
            os.replace(self._tmp, self.path)
            self._tmp = None
            self._state = "done"
            _fsync_dir(os.path.dirname(os.path.abspath(self.path)))
        except BaseException:
            self.abort()
            raise

    # ---- content --------------------------------------------------------------------------------
    def set_metadata(self, meta: dict) -> None:
        """Set the whole metadata map (replaces any earlier one). Validated and packed right away.

        Raises MetadataError for values msgpack cannot store (numpy scalars, sets, objects, non-string
        keys), NestingTooDeepError, or LimitExceededError over MAX_METADATA_NBYTES.
        """
        if self._state not in ("new", "open"):
            raise WriterStateError(f"writer is {self._state}", path=self.path)
        self._meta_bytes = pack_metadata(meta)

    def add_array(self, name: str, array, encoding: str = "bf16") -> TensorRecord:
        """Write a plain tensor.

        encoding "bf16": array is np.uint16 bit patterns, or a float array rounded to bf16 (nearest even);
        "f16" / "f32": a float array, converted (f32 -> f16 rounds). Shape: any rank 1..8, dims >= 1.
        """
        self._check_open()
        if encoding not in PLAIN_ENCODINGS:
            raise EncodingError(
                f"add_array encoding must be one of {sorted(PLAIN_ENCODINGS)}, got {encoding!r}",
                path=self.path,
                where=f"tensor {name!r}",
            )
        a = np.asarray(array)
        if encoding == "bf16":
            if a.dtype == np.uint16:
                data = a
            elif a.dtype.kind == "f":
                data = bf16.from_f32(a)
            else:
                raise EncodingError(
                    f"bf16 needs uint16 bit patterns or floats, got {a.dtype}",
                    path=self.path,
                    where=f"tensor {name!r}",
                )
        else:
            if a.dtype.kind != "f":
                raise EncodingError(
                    f"{encoding} needs a float array, got {a.dtype}", path=self.path, where=f"tensor {name!r}"
                )
            data = a.astype(PLAIN_ENCODINGS[encoding], copy=False)
        data = np.ascontiguousarray(data, dtype=PLAIN_ENCODINGS[encoding])
        rec = TensorRecord(
            name=name,
            encoding=encoding,
            dtype=encoding,
            shape=tuple(int(d) for d in a.shape),
            offset=0,
            nbytes=data.nbytes,
            checksum=0,
        )
        return self._add(rec, [(0, data)])

    def add_quantized(self, name: str, qt: QuantizedTensor) -> TensorRecord:
        """Write a quantized tensor (parts at the offsets its layout tag fixes)."""
        self._check_open()
        if not isinstance(qt, QuantizedTensor):
            raise EncodingError(
                f"add_quantized needs a QuantizedTensor, got {type(qt).__name__}",
                path=self.path,
                where=f"tensor {name!r}",
            )
        rec = TensorRecord(
            name=name,
            encoding=qt.encoding,
            dtype="bf16",
            shape=qt.shape,
            offset=0,
            nbytes=qt.nbytes,
            checksum=0,
            group_size=qt.group_size,
            symmetric=qt.symmetric,
            layout=qt.layout,
        )
        return self._add(rec, list(qt.to_bytes_parts()))

    # ---- internals ------------------------------------------------------------------------------
    def _add(self, rec: TensorRecord, parts) -> TensorRecord:
        where = f"tensor {rec.name!r}"
        if not isinstance(rec.name, str):
            raise EncodingError(f"tensor name must be a str, got {type(rec.name).__name__}", path=self.path)
        if rec.name in self._names:
            raise DuplicateTensorError(
                f"tensor name {rec.name!r} already written", path=self.path, where=where
            )
        if len(self._records) >= MAX_TENSORS:
            raise LimitExceededError(f"more than {MAX_TENSORS} tensors", path=self.path, where=where)
        check_record(rec, path=self.path, where=where)
        try:
            self._pad_to(align_up(self._pos, TENSOR_ALIGN))
            offset = self._pos
            h = xxhash.xxh3_64()
            for part_off, arr in parts:
                gap = offset + part_off - self._pos
                if gap:
                    h.update(_ZEROS[:gap] if gap <= DATA_ALIGN else bytes(gap))
                    self._pad_to(offset + part_off)
                mv = memoryview(arr).cast("B")
                h.update(mv)
                self._write(mv)
            if self._pos - offset != rec.nbytes:
                raise EncodingError(
                    f"wrote {self._pos - offset} bytes, record says {rec.nbytes}", path=self.path, where=where
                )
        except BaseException:
            self.abort()
            raise
        done = TensorRecord(
            rec.name,
            rec.encoding,
            rec.dtype,
            rec.shape,
            offset,
            rec.nbytes,
            h.intdigest(),
            rec.group_size,
            rec.symmetric,
            rec.layout,
        )
        self._records.append(done)
        self._names.add(rec.name)
        return done

    def _check_open(self) -> None:
        if self._state != "open":
            raise WriterStateError(f"writer is {self._state}; use it inside its `with` block", path=self.path)

    def _write(self, data) -> None:
        self._fh.write(data)
        self._pos += len(data) if not isinstance(data, memoryview) else data.nbytes

    def _pad_to(self, pos: int) -> None:
        while self._pos < pos:
            self._write(_ZEROS[: min(DATA_ALIGN, pos - self._pos)])


def _pack_index(records: list[TensorRecord]) -> bytes:
    return msgpack.packb([record_to_map(r) for r in records], use_bin_type=True)


def _check_target(path: str) -> None:
    """Refuse a target that a rename would not simply replace: a directory (also through a symlink),
    a device, a FIFO or a socket. A missing path, a regular file or a symlink to one is fine."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    except OSError:
        return  # e.g. a dangling or looping symlink: the rename replaces the link itself
    if stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(errno.EISDIR, "is a directory; give a file path", path)
    if not stat.S_ISREG(st.st_mode):
        raise FileExistsError(errno.EEXIST, "exists and is not a regular file; it will not be replaced", path)


def _fsync_dir(folder: str) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
