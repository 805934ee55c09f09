"""One open of a `.nanoqwen` container, shared by everything that reads it.

    with nqf.open(path) as f:                    # header, index and metadata parsed and checked once
        pipeline = Pipeline.from_file(f, None)   # tokenizer (parsed once), chat template, defaults
        backend = ReferenceBackend.from_file(f)  # the weights, read from the same open file

Every loader that takes a container (`load_weights`, `ReferenceModel/ReferenceBackend/ReferenceEngine
.from_file`, `Pipeline.from_file`, the CUDA engine's `load`) accepts either a path, which it opens and
closes, or a `nanoqwen_format.NanoqwenFile` the caller opened, which it reads and leaves open.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from os import PathLike

import nanoqwen_format as nqf

__all__ = ["opened"]


@contextlib.contextmanager
def opened(source: str | PathLike | nqf.NanoqwenFile) -> Iterator[nqf.NanoqwenFile]:
    """`source` itself when it is an open `NanoqwenFile` (left open), else the file at that path,
    opened for the `with` block and closed after it."""
    if isinstance(source, nqf.NanoqwenFile):
        yield source
        return
    with nqf.open(source) as f:
        yield f
