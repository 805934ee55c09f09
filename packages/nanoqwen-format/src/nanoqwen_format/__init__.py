"""The .nanoqwen container: byte-exact spec (SPEC.md), zero-copy mmap reader, streaming writer.

    import nanoqwen_format as nqf
    with nqf.open(path) as f: f.records, f.metadata, f.array(name), f.quantized(name), f.verify()
    with nqf.Writer(path) as w: w.add_array(...), w.add_quantized(...), w.set_metadata(...)
    nqf.clean_partials(path): remove stale temp files of killed writes to path (the Writer does it too)
    nqf.int4 / nqf.int8: quantize_rtn, pack, unpack, dequantize;  nqf.bf16: from_f32, to_f32

This package knows nothing of torch: numpy, msgpack and xxhash only.
"""

from . import bf16, int4, int8, partials, spec
from .errors import *  # noqa: F403 - the hierarchy is part of the public API
from .errors import __all__ as _error_names
from .partials import PartialFile, PartialFileWarning, clean_partials
from .quantized import QuantizedTensor, layout_tag
from .reader import NanoqwenFile, open  # noqa: A004
from .records import TensorRecord
from .writer import Writer

__version__ = "0.1.0"

__all__ = [
    "open",
    "NanoqwenFile",
    "Writer",
    "PartialFile",
    "PartialFileWarning",
    "clean_partials",
    "TensorRecord",
    "QuantizedTensor",
    "layout_tag",
    "bf16",
    "int4",
    "int8",
    "spec",
    "partials",
    *_error_names,
]
