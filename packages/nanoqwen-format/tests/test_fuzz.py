"""Property-based fuzzing: mutate valid files; opening, reading every tensor and verify() may raise
only FormatError (never IndexError, struct.error, MemoryError, msgpack errors, numpy errors ...).

Two kinds of mutation: raw byte edits (flips, overwrites, truncation, insertion) anywhere in the
file, which mostly hit checksums; and structured edits that change one index field, trailer field
or header field to a hostile value and then *recompute every checksum*, which reach the structural
checks behind them. About 30 s on the 2-core CI machine (NQF_FUZZ_EXAMPLES sets the examples per
test, default 1500).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import msgpack
import nanoqwen_format as nqf
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent / "hostile"))
from attacks import Parts, _set_header  # noqa: E402

EXAMPLES = int(os.environ.get("NQF_FUZZ_EXAMPLES", "1500"))
SETTINGS = settings(
    max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)

HOSTILE_INTS = st.sampled_from(
    [
        0,
        1,
        7,
        8,
        255,
        256,
        257,
        4095,
        4096,
        2**31 - 1,
        2**31,
        2**32 - 1,
        2**32,
        2**62,
        2**63 - 1,
        2**63,
        2**64 - 1,
        -1,
        -(2**63),
    ]
) | st.integers(min_value=-(2**63), max_value=2**64 - 1)
VALUES = st.recursive(
    st.none() | st.booleans() | HOSTILE_INTS | st.floats() | st.text(max_size=300) | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
FIELDS = [
    "name",
    "encoding",
    "dtype",
    "shape",
    "offset",
    "nbytes",
    "xxh3",
    "group_size",
    "symmetric",
    "layout",
]
SHAPES = st.lists(HOSTILE_INTS, min_size=0, max_size=10)
TAGS = st.sampled_from(
    [
        "bf16",
        "f16",
        "f32",
        "int4",
        "int8",
        "int4-g128-tile8x128-v1",
        "int4-g32-tile8x128-v1",
        "int8-g128-rowmajor-v1",
        "int4-g96-tile8x128-v1",
        "int4-g128-tile8x128-v2",
        "",
        "x" * 70,
    ]
)


def _exercise(path) -> None:
    try:
        with nqf.open(path) as f:
            for name in f.records:
                f.raw(name)
                for accessor in (f.array, f.quantized, f.dequantize):
                    try:
                        accessor(name)
                    except nqf.EncodingError:
                        pass  # wrong accessor for this encoding: a FormatError, expected
            f.verify()
            for prop in ("config", "tokenizer_json", "chat_template"):
                try:
                    getattr(f, prop)
                except nqf.MetadataError:
                    pass
    except nqf.FormatError as e:
        SEEN[type(e).__name__] = SEEN.get(type(e).__name__, 0) + 1
        return
    SEEN["opened"] = SEEN.get("opened", 0) + 1


SEEN: dict[str, int] = {}  # error classes reached, for a look with `pytest -s` (the report below)


@st.composite
def byte_mutation(draw, size):
    kind = draw(st.sampled_from(["flip", "overwrite", "truncate", "insert", "zero_run"]))
    # bias positions toward the header and the footer, where the structure is
    region = draw(st.sampled_from(["head", "tail", "any"]))
    if region == "head":
        pos = draw(st.integers(0, min(size - 1, 4200)))
    elif region == "tail":
        pos = draw(st.integers(max(0, size - 3000), size - 1))
    else:
        pos = draw(st.integers(0, size - 1))
    return kind, pos, draw(st.binary(min_size=1, max_size=16))


def apply_byte_mutation(data: bytes, mutation) -> bytes:
    kind, pos, blob = mutation
    b = bytearray(data)
    if kind == "flip":
        b[pos] ^= blob[0] or 1
    elif kind == "overwrite":
        b[pos : pos + len(blob)] = blob
    elif kind == "truncate":
        del b[pos:]
    elif kind == "insert":
        b[pos:pos] = blob
    else:
        b[pos : pos + 8 * len(blob)] = bytes(len(b[pos : pos + 8 * len(blob)]))
    return bytes(b)


@SETTINGS
@given(data=st.data())
def test_fuzz_byte_mutations(container_bytes, tmp_path, data):
    n = data.draw(st.integers(1, 3))
    out = container_bytes
    for _ in range(n):
        out = apply_byte_mutation(out, data.draw(byte_mutation(len(out))) if out else ("insert", 0, b"\x00"))
    path = tmp_path / "fuzz.nanoqwen"
    path.write_bytes(out)
    _exercise(path)


@SETTINGS
@given(data=st.data())
def test_fuzz_structured_mutations(container_bytes, tmp_path, data):
    parts = Parts(container_bytes)
    index = [dict(r) for r in parts.index]
    target = data.draw(
        st.sampled_from(["record", "record", "record", "index", "metadata", "trailer", "header"])
    )
    meta_bytes = None
    trailer = None
    index_bytes = None
    if target == "record":
        for _ in range(data.draw(st.integers(1, 3))):
            i = data.draw(st.integers(0, len(index) - 1))
            field = data.draw(st.sampled_from(FIELDS + ["extra"]))
            if field == "shape":
                value = data.draw(SHAPES | VALUES)
            elif field in ("encoding", "dtype", "layout"):
                value = data.draw(TAGS | VALUES)
            elif field in ("offset", "nbytes", "group_size"):
                value = data.draw(
                    HOSTILE_INTS | st.sampled_from([index[i].get("offset", 0) + d for d in (-256, 256)])
                )
            else:
                value = data.draw(VALUES)
            if data.draw(st.booleans()) and field in index[i]:
                del index[i][field]
            else:
                index[i][field] = value
    elif target == "index":
        index_bytes = msgpack.packb(data.draw(VALUES), use_bin_type=True)
    elif target == "metadata":
        meta_bytes = msgpack.packb(data.draw(VALUES), use_bin_type=True)
    elif target == "trailer":
        key = data.draw(
            st.sampled_from(["index_offset", "index_nbytes", "metadata_offset", "metadata_nbytes"])
        )
        trailer = {key: data.draw(st.integers(0, 2**64 - 1) | HOSTILE_INTS.filter(lambda v: v >= 0))}
    try:
        out = parts.build(index=index, index_bytes=index_bytes, meta_bytes=meta_bytes, trailer=trailer)
    except (ValueError, TypeError, OverflowError, msgpack.PackException):
        return  # the mutation itself could not be packed (e.g. an int beyond 64 bits)
    if target == "header":
        out = _set_header(
            out,
            major=data.draw(st.integers(0, 3)),
            minor=data.draw(st.integers(0, 2**16 - 1)),
            data_offset=data.draw(
                st.sampled_from([0, 4095, 4096, 8192, 2**20, 2**63]) | st.integers(0, 2**64 - 1)
            ),
        )
    path = tmp_path / "fuzz.nanoqwen"
    path.write_bytes(out)
    _exercise(path)


@pytest.mark.parametrize("cut", [0, 1, 7, 8, 63, 64, 4095, 4096, 4159, 4160])
def test_tiny_prefixes(container_bytes, tmp_path, cut):
    path = tmp_path / "cut.nanoqwen"
    path.write_bytes(container_bytes[:cut])
    with pytest.raises(nqf.FormatError):
        nqf.open(path)


def test_fuzz_reached_the_structural_checks():
    """Runs after the fuzz tests (file order): the mutations must reach more than checksum errors."""
    if not SEEN:
        pytest.skip("fuzz tests did not run in this session")
    print("fuzz outcomes:", dict(sorted(SEEN.items(), key=lambda kv: -kv[1])))
    structural = {"MalformedIndexError", "OutOfBoundsError", "ShapeMismatchError", "TruncatedError"}
    assert len(structural & SEEN.keys()) >= 3 and "opened" in SEEN, SEEN
