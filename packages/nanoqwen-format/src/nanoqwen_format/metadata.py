"""Metadata and index msgpack: strict, bounded packing and unpacking.

Both sections are msgpack (SPEC.md section 7). Unpacking never trusts a length prefix: every
max_*_len limit is set to the section size (itself checked against the file size and the hard
limits before any byte is read), so a 5-byte array header claiming 2**32 elements fails instead of
allocating. After unpacking, one iterative walk checks the nesting depth, that every map key is a
string and that only the allowed value types occur (nil, bool, int, float, str, bin, array, map).
Writers apply the same rules before a byte is written.
"""

from __future__ import annotations

import msgpack

from .errors import FormatError, LimitExceededError, MetadataError, NestingTooDeepError
from .spec import MAX_METADATA_DEPTH, MAX_METADATA_NBYTES

__all__ = ["unpack_section", "check_tree", "pack_metadata"]

_SCALARS = (type(None), bool, int, float, str, bytes)


def unpack_section(data: bytes, what: str, error: type[FormatError], path=None):
    """Unpack one msgpack object that must span `data` exactly.

    Any msgpack failure (bad bytes, truncated object, trailing bytes, non-string map key, invalid
    UTF-8, ext types) becomes `error` with a message naming `what`.
    """
    n = len(data)
    try:
        obj = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_str_len=n,
            max_bin_len=n,
            max_array_len=n,
            max_map_len=n // 2,
            max_ext_len=0,
        )
    except msgpack.exceptions.StackError:
        raise NestingTooDeepError(
            "msgpack nests deeper than the unpacker's stack", path=path, where=what
        ) from None
    except msgpack.ExtraData as e:
        raise error(
            f"{len(e.extra)} trailing bytes after the msgpack object", path=path, where=what
        ) from None
    except (ValueError, TypeError, msgpack.UnpackException, RecursionError, OverflowError) as e:
        raise error(f"not valid msgpack: {type(e).__name__}: {e}", path=path, where=what) from None
    return obj


def check_tree(
    obj,
    what: str,
    *,
    max_depth: int = MAX_METADATA_DEPTH,
    path=None,
    error: type[FormatError] = MetadataError,
) -> None:
    """Check depth, key types and value types of an unpacked (or to-be-packed) msgpack tree.

    Depth counts containers: a flat map is depth 1. Raises NestingTooDeepError or `error`.
    """
    stack = [(obj, 1, what)]
    while stack:
        node, depth, where = stack.pop()
        if isinstance(node, dict | list | tuple):
            if depth > max_depth:
                raise NestingTooDeepError(
                    f"containers nest deeper than the limit of {max_depth}", path=path, where=where
                )
            if isinstance(node, dict):
                for key, value in node.items():
                    if not isinstance(key, str):
                        raise error(
                            f"map key {key!r} is a {type(key).__name__}, not a string", path=path, where=where
                        )
                    if isinstance(value, dict | list | tuple):
                        stack.append((value, depth + 1, f"{where}.{key}"))
                    elif not isinstance(value, _SCALARS):
                        raise error(
                            f"value of {key!r} has unsupported type {type(value).__name__}",
                            path=path,
                            where=where,
                        )
            else:
                for i, value in enumerate(node):
                    if isinstance(value, dict | list | tuple):
                        stack.append((value, depth + 1, f"{where}[{i}]"))
                    elif not isinstance(value, _SCALARS):
                        raise error(
                            f"item {i} has unsupported type {type(value).__name__}", path=path, where=where
                        )
            continue
        if not isinstance(node, _SCALARS):
            raise error(f"unsupported type {type(node).__name__}", path=path, where=where)
        if isinstance(node, int) and not isinstance(node, bool) and not -(2**63) <= node < 2**64:
            raise error(f"integer {node} does not fit msgpack's 64 bits", path=path, where=where)


def pack_metadata(meta) -> bytes:
    """Validate and pack a metadata dict for a writer.

    Raises MetadataError (not a dict, non-string keys, values msgpack cannot store: numpy scalars,
    sets, objects...), NestingTooDeepError or LimitExceededError (over MAX_METADATA_NBYTES).
    """
    if not isinstance(meta, dict):
        raise MetadataError(f"metadata must be a dict, got {type(meta).__name__}", where="metadata")
    check_tree(meta, "metadata")
    try:
        data = msgpack.packb(meta, use_bin_type=True, strict_types=False)
    except (TypeError, ValueError, OverflowError) as e:
        raise MetadataError(f"cannot pack metadata: {e}", where="metadata") from None
    if len(data) > MAX_METADATA_NBYTES:
        raise LimitExceededError(
            f"metadata packs to {len(data)} bytes, over the limit of {MAX_METADATA_NBYTES}", where="metadata"
        )
    return data
