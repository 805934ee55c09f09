"""SPEC.md is enough for an independent reader: spec_reader.py (no nanoqwen_format import) decodes a
library-written file into the same tensors and metadata as the library."""

from __future__ import annotations

import ast
from pathlib import Path

import nanoqwen_format as nqf
import numpy as np

HERE = Path(__file__).parent


def test_spec_reader_does_not_import_the_library():
    tree = ast.parse((HERE / "spec_reader.py").read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
    assert imported <= {"__future__", "struct", "msgpack", "numpy", "xxhash"}, imported


def test_spec_reader_matches_library(container):
    import spec_reader

    path, _ = container
    meta, tensors = spec_reader.read(path)
    with nqf.open(path) as f:
        assert meta == f.metadata
        assert list(tensors) == list(f.records)
        for name in f.records:
            ours = f.dequantize(name)
            assert ours.dtype == np.float32 and tensors[name].shape == ours.shape
            np.testing.assert_array_equal(tensors[name], ours, err_msg=name)
