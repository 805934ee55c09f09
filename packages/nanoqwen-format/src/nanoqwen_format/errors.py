"""The one exception hierarchy of nanoqwen_format.

Every failure the reader or the writer detects raises a subclass of `FormatError`, never a bare
`ValueError`, `struct.error`, `KeyError` or msgpack exception. Each hostile-file case of SPEC.md has
its own class, so tests (and callers) can tell a truncated download from a corrupt index from a file
written by a newer, incompatible version. Messages say what is wrong and where: the file path, the
section ("header", "trailer", "index", "metadata", "tensor 'layers.0.qkv'") and the numbers involved.
"""

from __future__ import annotations

__all__ = [
    "FormatError",
    "TruncatedError",
    "BadMagicError",
    "UnsupportedVersionError",
    "HeaderError",
    "TrailerError",
    "LimitExceededError",
    "NestingTooDeepError",
    "OutOfBoundsError",
    "MisalignedError",
    "OverlapError",
    "DimensionOverflowError",
    "ShapeMismatchError",
    "MalformedIndexError",
    "DuplicateTensorError",
    "MetadataError",
    "MissingMetadataError",
    "ChecksumError",
    "IndexChecksumError",
    "MetadataChecksumError",
    "UnsupportedEncodingError",
    "EncodingError",
    "TensorNotFoundError",
    "WriterStateError",
    "ConcurrentWriteError",
    "ClosedFileError",
]


class FormatError(Exception):
    """Base of every error raised by nanoqwen_format.

    `path` is the file concerned (or None), `where` the section or tensor, and `reason` the bare
    message; `str(err)` joins them as "path: where: reason".
    """

    def __init__(self, reason: str, *, path: object = None, where: str | None = None) -> None:
        self.reason = reason
        self.path = None if path is None else str(path)
        self.where = where
        parts = [p for p in (self.path, where, reason) if p]
        super().__init__(": ".join(parts))


class TruncatedError(FormatError):
    """The file ends before a section it must contain (header, trailer, index, metadata)."""


class BadMagicError(FormatError):
    """The first 8 bytes are not the .nanoqwen magic: not a .nanoqwen file."""


class UnsupportedVersionError(FormatError):
    """The file's major version is newer than this reader understands."""


class HeaderError(FormatError):
    """A header field is invalid or the header checksum does not match."""


class TrailerError(FormatError):
    """A trailer field is invalid or the trailer checksum does not match."""


class LimitExceededError(FormatError):
    """A size exceeds one of SPEC.md's hard limits (index, metadata, names, rank, tensor count)."""


class NestingTooDeepError(LimitExceededError):
    """Metadata nests maps/arrays deeper than MAX_METADATA_DEPTH."""


class OutOfBoundsError(FormatError):
    """A section or tensor lies (partly) outside the region of the file it must lie in."""


class MisalignedError(FormatError):
    """A tensor offset or the data offset is not aligned as SPEC.md requires."""


class OverlapError(FormatError):
    """Two tensors overlap, or records are not in increasing offset order."""


class DimensionOverflowError(FormatError):
    """A shape's element count exceeds 2**62 (it would overflow 64-bit size arithmetic)."""


class ShapeMismatchError(FormatError):
    """A record's byte length disagrees with the length its shape and encoding imply."""


class MalformedIndexError(FormatError):
    """The index is not valid msgpack or a record has a missing or ill-typed field."""


class DuplicateTensorError(MalformedIndexError):
    """Two tensors have the same name."""


class MetadataError(FormatError):
    """Metadata is not valid msgpack, not a map with string keys, or holds an unsupported value."""


class MissingMetadataError(MetadataError, KeyError):
    """A metadata key that an accessor needs (config, tokenizer, chat_template) is absent."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return FormatError.__str__(self)


class ChecksumError(FormatError):
    """Stored and computed xxh3-64 differ. `tensor` names the tensor (None for a section)."""

    def __init__(self, reason: str, *, tensor: str | None = None, **kw) -> None:
        self.tensor = tensor
        super().__init__(reason, **kw)


class IndexChecksumError(ChecksumError):
    """The index bytes do not match the index checksum stored in the trailer."""


class MetadataChecksumError(ChecksumError):
    """The metadata bytes do not match the metadata checksum stored in the trailer."""


class UnsupportedEncodingError(FormatError):
    """A tensor uses an encoding or layout tag this reader does not know (raised on access only)."""


class EncodingError(FormatError):
    """Data does not fit its encoding: wrong dtype, shape, group size, value range or accessor."""


class TensorNotFoundError(FormatError, KeyError):
    """No tensor of that name in the file."""

    def __str__(self) -> str:
        return FormatError.__str__(self)


class WriterStateError(FormatError):
    """The writer is used outside its `with` block, after close, or after a failed write."""


class ConcurrentWriteError(FormatError):
    """Another writer, alive, is writing the same path (its temp file is locked): the second is refused."""


class ClosedFileError(FormatError):
    """A tensor accessor or verify() was called after the file was closed."""
