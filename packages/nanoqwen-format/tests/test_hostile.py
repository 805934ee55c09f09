"""Every hostile file of hostile/attacks.py is rejected with its own FormatError subclass, and opening
it never allocates more than the file's size (measured with tracemalloc, which sees numpy and
msgpack allocations; the mmap itself is not an allocation)."""

from __future__ import annotations

import sys
import tracemalloc
from pathlib import Path

import nanoqwen_format as nqf
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent / "hostile"))
import attacks  # noqa: E402

# Opening a small valid file costs some interpreter bookkeeping of its own; a hostile length is
# at least gigabytes, so this allowance does not hide one.
ALLOC_SLACK = 64 * 1024


def _open_and_use(path) -> None:
    with nqf.open(path) as f:
        for name, rec in f.records.items():
            f.raw(name)
            if rec.is_quantized:
                f.quantized(name)
            else:
                f.array(name)
        f.verify()


@pytest.mark.parametrize("case", sorted(attacks.CASES))
def test_hostile_file_is_rejected(case, container_bytes, tmp_path):
    build, expected = attacks.CASES[case]
    data = build(container_bytes)
    path = tmp_path / f"{case}.nanoqwen"
    path.write_bytes(data)
    tracemalloc.start()
    try:
        with pytest.raises(nqf.FormatError) as ei:
            _open_and_use(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert type(ei.value) is expected, f"{case}: got {type(ei.value).__name__}: {ei.value}"
    assert str(path) in str(ei.value)  # the message says which file
    assert peak <= len(data) + ALLOC_SLACK, f"{case}: peak allocation {peak} for a {len(data)}-byte file"


def test_every_error_class_has_a_hostile_case():
    covered = {exp for _, exp in attacks.CASES.values()}
    expected = {
        nqf.TruncatedError,
        nqf.BadMagicError,
        nqf.UnsupportedVersionError,
        nqf.HeaderError,
        nqf.TrailerError,
        nqf.LimitExceededError,
        nqf.NestingTooDeepError,
        nqf.OutOfBoundsError,
        nqf.MisalignedError,
        nqf.OverlapError,
        nqf.DimensionOverflowError,
        nqf.ShapeMismatchError,
        nqf.MalformedIndexError,
        nqf.DuplicateTensorError,
        nqf.MetadataError,
        nqf.IndexChecksumError,
        nqf.MetadataChecksumError,
    }
    assert expected <= covered, expected - covered


def test_tensor_checksum_mismatch_found_by_verify(container_bytes, tmp_path):
    path = tmp_path / "bad.nanoqwen"
    path.write_bytes(attacks.ON_ACCESS["tensor_checksum"](container_bytes))
    with nqf.open(path) as f:
        first = next(iter(f.records))
        with pytest.raises(nqf.ChecksumError) as ei:
            f.verify()
    assert type(ei.value) is nqf.ChecksumError and ei.value.tensor == first and first in str(ei.value)


@pytest.mark.parametrize(
    "case",
    ["unknown_encoding", "unknown_int4_layout", "unknown_int4_f16s_version", "unknown_int8_f16s_layout"],
)
def test_unknown_encoding_opens_but_access_fails(case, container_bytes, tmp_path):
    path = tmp_path / f"{case}.nanoqwen"
    path.write_bytes(attacks.ON_ACCESS[case](container_bytes))
    with nqf.open(path) as f:
        name = next(n for n, r in f.records.items()
                    if "fp8" in r.encoding or (r.layout or "").endswith("v9")
                    or (r.encoding == "int8" and "f16s" in (r.layout or "")))
        assert f.verify() > 0  # checksums still cover it
        assert f.raw(name).nbytes == f.records[name].nbytes
        accessors = (f.quantized, f.dequantize) if f.records[name].is_quantized else (f.array, f.dequantize)
        for accessor in accessors:
            with pytest.raises(nqf.UnsupportedEncodingError) as ei:
                accessor(name)
            assert name in str(ei.value)


def test_newer_minor_version_is_read(container_bytes, tmp_path):
    path = tmp_path / "minor7.nanoqwen"
    path.write_bytes(attacks.newer_minor(container_bytes))
    ref = tmp_path / "ref.nanoqwen"
    ref.write_bytes(container_bytes)
    with nqf.open(path) as f, nqf.open(ref) as g:
        assert (f.major, f.minor) == (1, 7)
        assert f.metadata["future_section"] == [1, 2, 3]
        assert list(f.records) == list(g.records)
        for name in f.records:
            assert np.array_equal(f.dequantize(name), g.dequantize(name))
        f.verify()
