"""Constants and fixed-size binary structures of the .nanoqwen container (SPEC.md, sections 2-5).

Everything here is a direct transcription of SPEC.md: the magic numbers, the version, the two
fixed-size structures (the 64-byte header at offset 0 and the 64-byte trailer at the end of the
file), alignments and the hard limits that readers and writers both enforce. All integers are
little-endian. Checksums are xxh3-64 with seed 0.
"""

from __future__ import annotations

import struct

import xxhash

MAGIC = b"\x89NQWEN\r\n"  # 8 bytes; the \x89 and \r\n catch text-mode transfers, as PNG's magic does
TRAILER_MAGIC = b"NQWN-END"  # last 8 bytes of every complete file
MAJOR = 1
MINOR = 1  # 1.1: the int4 `-f16s` layout tag (SPEC.md section 8.2)

# Header: offset 0, 64 bytes of fields, zero padding up to DATA_ALIGN.
#   magic 8s | major u16 | minor u16 | header_nbytes u32 | data_offset u64 | reserved 32x | header_xxh3 u64
HEADER_STRUCT = struct.Struct("<8sHHIQ32xQ")
HEADER_NBYTES = HEADER_STRUCT.size  # 64
assert HEADER_NBYTES == 64

# Trailer: the last 64 bytes of the file.
#   index_offset u64 | index_nbytes u64 | index_xxh3 u64 | metadata_offset u64 | metadata_nbytes u64
#   | metadata_xxh3 u64 | trailer_xxh3 u64 | magic 8s
TRAILER_STRUCT = struct.Struct("<QQQQQQQ8s")
TRAILER_NBYTES = TRAILER_STRUCT.size  # 64
assert TRAILER_NBYTES == 64

DATA_ALIGN = 4096  # data_offset is a multiple of this (writers use exactly 4096)
TENSOR_ALIGN = 256  # every tensor offset is a multiple of this
MIN_FILE_NBYTES = DATA_ALIGN + TRAILER_NBYTES

# Hard limits, enforced by readers and writers alike (SPEC.md section 6).
MAX_INDEX_NBYTES = 32 * 1024 * 1024
MAX_METADATA_NBYTES = 64 * 1024 * 1024
MAX_TENSORS = 65536
MAX_NAME_NBYTES = 256  # UTF-8 bytes of a tensor name
MAX_TAG_NBYTES = 64  # UTF-8 bytes of an encoding, dtype or layout string
MAX_RANK = 8
MAX_ELEMENTS = 2**62  # element count of one tensor (product of its dims)
MAX_METADATA_DEPTH = 32  # the top-level metadata map is depth 1
MAX_U64 = 2**64 - 1


def xxh3(data) -> int:
    """xxh3-64 (seed 0) of a bytes-like object, as an unsigned int; zero-copy for buffers."""
    return xxhash.xxh3_64_intdigest(data)


def align_up(n: int, alignment: int) -> int:
    """Smallest multiple of `alignment` that is >= n."""
    return (n + alignment - 1) // alignment * alignment


def pack_header(data_offset: int = DATA_ALIGN, major: int = MAJOR, minor: int = MINOR) -> bytes:
    """The 64 header bytes (fields plus their checksum)."""
    body = HEADER_STRUCT.pack(MAGIC, major, minor, HEADER_NBYTES, data_offset, 0)[:56]
    return body + struct.pack("<Q", xxh3(body))


def pack_trailer(
    index_offset: int,
    index_nbytes: int,
    index_xxh3: int,
    metadata_offset: int,
    metadata_nbytes: int,
    metadata_xxh3: int,
) -> bytes:
    """The 64 trailer bytes (fields, their checksum, then TRAILER_MAGIC)."""
    body = struct.pack(
        "<QQQQQQ", index_offset, index_nbytes, index_xxh3, metadata_offset, metadata_nbytes, metadata_xxh3
    )
    return body + struct.pack("<Q", xxh3(body)) + TRAILER_MAGIC
