"""Builders of hostile .nanoqwen files (the safetensors `attacks/` idea), one per failure of SPEC.md.

Each builder takes the bytes of a valid container (written by the library, see nqf_testkit.py) and
returns the bytes of a hostile variant. Most rebuild the index, metadata or trailer *with valid
checksums*, so that the reader has to catch the structural problem itself and not just a checksum
mismatch. `CASES` maps a case name to (builder, the FormatError subclass `open()` must raise).

Run `python attacks.py OUTDIR` to write every case to OUTDIR as `<case>.nanoqwen` for inspection
(e.g. with `nanoqwen-cli verify`).
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import msgpack
import nanoqwen_format as nqf
from nanoqwen_format.spec import pack_header, pack_trailer, xxh3


class Parts:
    """A valid file split into data region, index (unpacked), metadata bytes and trailer fields."""

    def __init__(self, data: bytes) -> None:
        self.size = len(data)
        t = struct.unpack("<7Q", data[-64:-8])
        self.index_offset, index_n, _, self.meta_offset, meta_n, _, _ = t
        self.body = data[: self.index_offset]
        self.index = msgpack.unpackb(data[self.index_offset : self.index_offset + index_n], raw=False)
        self.meta_bytes = data[self.meta_offset : self.meta_offset + meta_n]

    def build(self, index=None, index_bytes=None, meta_bytes=None, body=None, trailer=None) -> bytes:
        """Reassemble, with valid checksums everywhere unless `trailer` overrides fields."""
        body = self.body if body is None else body
        if index_bytes is None:
            index_bytes = msgpack.packb(self.index if index is None else index, use_bin_type=True)
        meta_bytes = self.meta_bytes if meta_bytes is None else meta_bytes
        fields = dict(
            index_offset=len(body),
            index_nbytes=len(index_bytes),
            index_xxh3=xxh3(index_bytes),
            metadata_offset=len(body) + len(index_bytes),
            metadata_nbytes=len(meta_bytes),
            metadata_xxh3=xxh3(meta_bytes),
        )
        fields.update(trailer or {})
        return body + index_bytes + meta_bytes + pack_trailer(**fields)

    def with_record(self, i: int, **changes) -> bytes:
        index = [dict(r) for r in self.index]
        for k, v in changes.items():
            if v is _DELETE:
                del index[i][k]
            else:
                index[i][k] = v
        return self.build(index=index)


_DELETE = object()


def _set_header(data: bytes, *, major=1, minor=0, data_offset=4096, reserved=b"") -> bytes:
    h = bytearray(pack_header(data_offset, major, minor))
    h[24 : 24 + len(reserved)] = reserved
    h[56:64] = struct.pack("<Q", xxh3(bytes(h[:56])))
    return bytes(h) + data[64:]


def _flip(data: bytes, pos: int) -> bytes:
    b = bytearray(data)
    b[pos] ^= 0x5A
    return bytes(b)


def _nested(depth: int) -> bytes:
    return b"\x81\xa1d" * (depth - 1) + b"\x80"  # {"d": {"d": ... {}}}: `depth` maps


def _truncate_at(section: str):
    def build(data: bytes) -> bytes:
        p = Parts(data)
        cut = {
            "empty": 0,
            "magic": 5,
            "header": 40,
            "header_padding": 4000,
            "data": 4096 + 300,
            "index": p.index_offset + 7,
            "metadata": p.meta_offset + 3,
            "trailer_start": p.size - 64,
            "trailer_last_byte": p.size - 1,
        }[section]
        return data[:cut]

    return build


def _int4_index(p: Parts) -> int:
    return next(i for i, r in enumerate(p.index) if r["encoding"] == "int4")


def _f16s_index(p: Parts) -> int:
    return next(i for i, r in enumerate(p.index) if "-f16s-" in r.get("layout", ""))


CASES = {
    **{
        f"truncated_{s}": (_truncate_at(s), nqf.TruncatedError)
        for s in (
            "empty",
            "magic",
            "header",
            "header_padding",
            "data",
            "index",
            "metadata",
            "trailer_start",
            "trailer_last_byte",
        )
    },
    "bad_magic": (lambda d: b"GGUF\x03\x00\x00\x00" + d[8:], nqf.BadMagicError),
    "future_major": (lambda d: _set_header(d, major=2), nqf.UnsupportedVersionError),
    "future_major_bad_checksum": (
        lambda d: d[:8] + struct.pack("<H", 9) + d[10:],
        nqf.UnsupportedVersionError,
    ),
    "header_checksum": (lambda d: _flip(d, 30), nqf.HeaderError),
    "header_nbytes_huge": (
        lambda d: _fix_header(d[:12] + struct.pack("<I", 2**32 - 1) + d[16:]),
        nqf.HeaderError,
    ),
    "data_offset_misaligned": (lambda d: _set_header(d, data_offset=4095), nqf.MisalignedError),
    "data_offset_2_63": (lambda d: _set_header(d, data_offset=2**63), nqf.TruncatedError),
    "trailer_checksum": (lambda d: _flip(d, len(d) - 20), nqf.TrailerError),
    "index_nbytes_2_63": (lambda d: Parts(d).build(trailer={"index_nbytes": 2**63}), nqf.LimitExceededError),
    "metadata_nbytes_2_63": (
        lambda d: Parts(d).build(trailer={"metadata_nbytes": 2**63}),
        nqf.LimitExceededError,
    ),
    "index_oversized": (
        lambda d: Parts(d).build(trailer={"index_nbytes": 32 * 2**20 + 1}),
        nqf.LimitExceededError,
    ),
    "metadata_oversized": (
        lambda d: Parts(d).build(trailer={"metadata_nbytes": 64 * 2**20 + 1}),
        nqf.LimitExceededError,
    ),
    "index_offset_past_end": (
        lambda d: Parts(d).build(trailer={"index_offset": 2**64 - 1}),
        nqf.OutOfBoundsError,
    ),
    "index_before_data": (lambda d: Parts(d).build(trailer={"index_offset": 100}), nqf.OutOfBoundsError),
    "index_checksum": (lambda d: _flip(d, Parts(d).index_offset + 2), nqf.IndexChecksumError),
    "metadata_checksum": (lambda d: _flip(d, Parts(d).meta_offset + 2), nqf.MetadataChecksumError),
    "index_not_msgpack": (lambda d: Parts(d).build(index_bytes=b"\xc1\xc1"), nqf.MalformedIndexError),
    "index_trailing_bytes": (
        lambda d: Parts(d).build(index_bytes=msgpack.packb([]) + b"\x00"),
        nqf.MalformedIndexError,
    ),
    "index_not_array": (lambda d: Parts(d).build(index={"tensors": []}), nqf.MalformedIndexError),
    "index_array_len_2_32": (
        lambda d: Parts(d).build(index_bytes=b"\xdd\xff\xff\xff\xff"),
        nqf.LimitExceededError,
    ),
    "index_str_len_2_32": (
        lambda d: Parts(d).build(index_bytes=b"\x91\x81\xa4name\xdb\xff\xff\xff\xff"),
        nqf.MalformedIndexError,
    ),
    "too_many_tensors": (lambda d: Parts(d).build(index=[None] * 65537), nqf.LimitExceededError),
    "record_not_map": (lambda d: Parts(d).build(index=[1]), nqf.MalformedIndexError),
    "record_missing_offset": (lambda d: Parts(d).with_record(0, offset=_DELETE), nqf.MalformedIndexError),
    "record_negative_offset": (lambda d: Parts(d).with_record(0, offset=-256), nqf.MalformedIndexError),
    "record_bool_nbytes": (lambda d: Parts(d).with_record(0, nbytes=True), nqf.MalformedIndexError),
    "record_shape_not_array": (lambda d: Parts(d).with_record(0, shape=7), nqf.MalformedIndexError),
    "record_zero_dim": (lambda d: Parts(d).with_record(0, shape=[0, 256]), nqf.MalformedIndexError),
    "record_rank_0": (lambda d: Parts(d).with_record(0, shape=[]), nqf.MalformedIndexError),
    "duplicate_name": (
        lambda d: Parts(d).with_record(1, name=Parts(d).index[0]["name"]),
        nqf.DuplicateTensorError,
    ),
    "name_too_long": (lambda d: Parts(d).with_record(0, name="n" * 257), nqf.LimitExceededError),
    "encoding_too_long": (lambda d: Parts(d).with_record(0, encoding="e" * 65), nqf.LimitExceededError),
    "rank_9": (lambda d: Parts(d).with_record(0, shape=[1] * 9), nqf.LimitExceededError),
    "offset_past_end": (
        lambda d: Parts(d).with_record(len(Parts(d).index) - 1, offset=2**40),
        nqf.OutOfBoundsError,
    ),
    "offset_near_2_64": (lambda d: Parts(d).with_record(0, offset=2**64 - 256), nqf.OutOfBoundsError),
    "nbytes_2_63": (lambda d: Parts(d).with_record(0, nbytes=2**63), nqf.OutOfBoundsError),
    "offset_in_header": (lambda d: Parts(d).with_record(0, offset=0), nqf.OutOfBoundsError),
    "offset_misaligned": (
        lambda d: Parts(d).with_record(0, offset=Parts(d).index[0]["offset"] + 2),
        nqf.MisalignedError,
    ),
    "overlapping_tensors": (
        lambda d: Parts(d).with_record(1, offset=Parts(d).index[0]["offset"]),
        nqf.OverlapError,
    ),
    "dims_overflow": (
        lambda d: Parts(d).with_record(0, shape=[2**31, 2**31, 2**31]),
        nqf.DimensionOverflowError,
    ),
    "dims_overflow_u64_wrap": (
        # 2**32 * 2**32 wraps to 0 in u64 arithmetic, and 0 * itemsize "matches" nbytes = 0
        lambda d: Parts(d).with_record(0, shape=[2**32, 2**32], nbytes=0),
        nqf.DimensionOverflowError,
    ),
    "shape_disagrees_with_nbytes": (
        lambda d: Parts(d).with_record(0, shape=[Parts(d).index[0]["shape"][0] + 1, 256]),
        nqf.ShapeMismatchError,
    ),
    "int4_group_size_disagrees": (
        lambda d: Parts(d).with_record(_int4_index(Parts(d)), group_size=32),
        nqf.ShapeMismatchError,
    ),
    "int4_symmetric_flipped": (
        lambda d: Parts(d).with_record(_int4_index(Parts(d)), symmetric=True),
        nqf.ShapeMismatchError,
    ),
    "int4_dtype_f32": (
        lambda d: Parts(d).with_record(_int4_index(Parts(d)), dtype="f32"),
        nqf.MalformedIndexError,
    ),
    # the fp16-scale int4 variant (container 1.1): the same shape rules as the bf16 tile layout
    "int4_f16s_nbytes_short": (
        lambda d: Parts(d).with_record(
            _f16s_index(Parts(d)), nbytes=Parts(d).index[_f16s_index(Parts(d))]["nbytes"] - 2
        ),
        nqf.ShapeMismatchError,
    ),
    "int4_f16s_symmetric_flipped": (
        lambda d: Parts(d).with_record(_f16s_index(Parts(d)), symmetric=True),
        nqf.ShapeMismatchError,
    ),
    "int4_f16s_group_size_disagrees": (
        lambda d: Parts(d).with_record(_f16s_index(Parts(d)), group_size=128),
        nqf.ShapeMismatchError,
    ),
    "int4_f16s_rows_not_multiple_of_8": (
        lambda d: Parts(d).with_record(_f16s_index(Parts(d)), shape=[12, 256]),
        nqf.ShapeMismatchError,
    ),
    "int4_f16s_dtype_f16": (
        # dtype stays the compute type "bf16"; the scale type is in the layout tag only
        lambda d: Parts(d).with_record(_f16s_index(Parts(d)), dtype="f16"),
        nqf.MalformedIndexError,
    ),
    "metadata_not_msgpack": (lambda d: Parts(d).build(meta_bytes=b"\xc1"), nqf.MetadataError),
    "metadata_not_map": (lambda d: Parts(d).build(meta_bytes=msgpack.packb([1, 2])), nqf.MetadataError),
    "metadata_int_key": (lambda d: Parts(d).build(meta_bytes=b"\x81\x01\x02"), nqf.MetadataError),
    "metadata_bad_utf8": (lambda d: Parts(d).build(meta_bytes=b"\x81\xa1k\xa2\xff\xfe"), nqf.MetadataError),
    "metadata_ext_type": (
        lambda d: Parts(d).build(meta_bytes=b"\x81\xa1k" + msgpack.packb(msgpack.ExtType(5, b"x"))),
        nqf.MetadataError,
    ),
    "metadata_map_len_2_32": (
        lambda d: Parts(d).build(meta_bytes=b"\xdf\xff\xff\xff\xff"),
        nqf.MetadataError,
    ),
    "metadata_nested_33": (lambda d: Parts(d).build(meta_bytes=_nested(33)), nqf.NestingTooDeepError),
    "metadata_nested_100000": (
        lambda d: Parts(d).build(meta_bytes=b"\x91" * 100_000 + b"\xc0"),
        nqf.NestingTooDeepError,
    ),
}


def _fix_header(data: bytes) -> bytes:
    return data[:56] + struct.pack("<Q", xxh3(data[:56])) + data[64:]


# Files that open: the problem shows only on access or in verify().
ON_ACCESS = {
    "tensor_checksum": lambda d: _flip(d, Parts(d).index[0]["offset"] + 1),
    "unknown_encoding": lambda d: Parts(d).with_record(0, encoding="fp8-e4m3", dtype="fp8-e4m3"),
    "unknown_int4_layout": lambda d: Parts(d).with_record(
        _int4_index(Parts(d)), layout=Parts(d).index[_int4_index(Parts(d))]["layout"].replace("-v1", "-v9")
    ),
    "unknown_int4_f16s_version": lambda d: Parts(d).with_record(
        _f16s_index(Parts(d)), layout=Parts(d).index[_f16s_index(Parts(d))]["layout"].replace("-v1", "-v9")
    ),
    # no int8 layout has fp16 scales: an unknown tag of a known family
    "unknown_int8_f16s_layout": lambda d: Parts(d).with_record(
        next(i for i, r in enumerate(Parts(d).index) if r["encoding"] == "int8"),
        layout=next(r for r in Parts(d).index if r["encoding"] == "int8")["layout"].replace(
            "-v1", "-f16s-v1"
        ),
    ),
}


def newer_minor(data: bytes) -> bytes:
    """A 1.7 file: reserved header bytes set, an unknown record key and an unknown metadata key."""
    p = Parts(data)
    index = [dict(r, future_key={"x": 1}) for r in p.index]
    meta = msgpack.unpackb(p.meta_bytes, raw=False)
    meta["future_section"] = [1, 2, 3]
    out = p.build(index=index, meta_bytes=msgpack.packb(meta, use_bin_type=True))
    return _set_header(out, minor=7, reserved=b"\x01" * 32)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent.parent))
    from nqf_testkit import write_container

    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    write_container(out / "valid.nanoqwen")
    valid = (out / "valid.nanoqwen").read_bytes()
    for name, (build, _) in CASES.items():
        (out / f"{name}.nanoqwen").write_bytes(build(valid))
    for name, build in ON_ACCESS.items():
        (out / f"{name}.nanoqwen").write_bytes(build(valid))
    print(f"wrote {len(CASES) + len(ON_ACCESS) + 1} files to {out}")
