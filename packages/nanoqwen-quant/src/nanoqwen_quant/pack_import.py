"""`pack --method import`: a GPTQ/AWQ checkpoint (sources.QuantizedHFSource), or a GGUF whose decoder
linears are all Q4_0 (sources.GGUFSource with a `scheme`) -> a `.nanoqwen` container, exactly (the
formats and their conversion: checkpoints.py).

The container writer (io.write_container) streams it like an RTN pack, one layer at a time: the
non-quantized tensors come from `source.plain_layer(i)` (bf16), the four fused linears from
`source.quantized_layer(i)` in the `int4-g{G}-tile8x128-f16s-v1` layout. No error is measured (the
import is exact); the metadata's `quantization` describes the checkpoint's scheme (method "import",
`source_format`).

Which method a source takes (`check_import_options`, called by pack.pack before anything is read):
a GPTQ/AWQ checkpoint is imported (requantizing it is refused: its weights are already on a 4-bit
grid, and a second rounding only adds error; it has no float weights to requantize either), and
"import" needs such a checkpoint or an all-Q4_0 GGUF. An all-Q4_0 GGUF is imported when no method is
given (cli.py); asked for explicitly, rtn, gptq and none still requantize or dequantize it (g128 is
smaller and faster than Q4_0's g32 with fp16 scales, and `none` is the reference of `eval`). The quantizer's
options (clip, AWQ scaling; group size and symmetry unless an int4/int8 lm_head uses them) are
refused with "import": the checkpoint fixes them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import nanoqwen_format as nqf
import torch

from .io import container_metadata, write_container
from .options import PackOptions, Progress, UsageError
from .sources import QuantizedHFSource, Source, is_quantized_source

__all__ = ["check_import_options", "pack_import"]


class _Imported:
    """A quantized linear as io.write_container takes it (it calls `to_nqf()`)."""

    def __init__(self, qt: nqf.QuantizedTensor):
        self.qt = qt

    def to_nqf(self) -> nqf.QuantizedTensor:
        return self.qt


def check_import_options(source: Source, opts: PackOptions) -> None:
    """UsageError unless `opts.method` fits `source` (see the module header)."""
    quantized = is_quantized_source(source)
    if isinstance(source, QuantizedHFSource) and opts.method != "import":
        raise UsageError(f"{source.spec} is a {source.scheme.method} checkpoint: it is imported exactly "
                         f"with --method import (or no --method); requantizing it with {opts.method} is "
                         "refused (a second rounding of weights already on a 4-bit grid only adds error)")
    if opts.method != "import":
        return
    if not quantized:
        raise UsageError(f"method import (--method) needs a GPTQ or AWQ checkpoint or a GGUF whose "
                         f"decoder linears are all Q4_0, and {source.spec} is neither: use --method rtn, "
                         "gptq or none")
    defaults = PackOptions()
    for field_, flag in (("clip", "--clip"), ("clip_act", "--clip-act"), ("awq", "--awq")):
        if getattr(opts, field_, None) != getattr(defaults, field_, None):
            raise UsageError(f"{field_} ({flag}) applies to quantizing, and method import keeps the "
                             "checkpoint's own quantization")
    if opts.group_size != defaults.group_size and opts.lm_head == "bf16":
        raise UsageError("group_size (--group-size) applies to the int4/int8 lm_head only with method "
                         f"import, which keeps the checkpoint's own group size ({source.scheme.group_size})")
    if opts.symmetric != defaults.symmetric and opts.lm_head != "int4":
        raise UsageError("symmetric=False (--asym) applies to an int4 lm_head only with method import, "
                         "which keeps the checkpoint's own zero points")


class _PlainLayers:
    """`source` as write_container reads it, with `layer(i)` = `source.plain_layer(i)`: only the
    non-quantized tensors of a layer, the linears coming from `quantized_layer` (a GGUF's `layer` would
    dequantize them too)."""

    def __init__(self, source: Source):
        self._source = source

    def __getattr__(self, name: str):
        return getattr(self._source, name)

    def layer(self, i: int) -> dict[str, torch.Tensor]:
        return self._source.plain_layer(i)


def pack_import(source: Source, out: Path, opts: PackOptions, source_sha: str,
                progress: Progress, log: Callable[[str], None]) -> tuple[list[dict], list[str]]:
    """Write the container of an imported checkpoint. Returns (layer_errors: {} per layer, nothing is
    measured; notes: one line saying what was imported)."""
    sc = source.scheme
    layer_errors: list[dict] = [{} for _ in range(source.config.num_hidden_layers)]
    symmetric: list[bool] = []

    def quantized_layer(i: int, lw: dict[str, torch.Tensor]) -> dict:
        qts = source.quantized_layer(i)
        symmetric.extend(qt.symmetric for qt in qts.values())
        return {name: _Imported(qt) for name, qt in qts.items()}

    def meta(lm_head_w_rel: float | None) -> dict:
        m = container_metadata(source, opts, layer_errors, {}, source_sha, lm_head_w_rel)
        m["quantization"].update(method="import", bits=4, group_size=sc.group_size,
                                 symmetric=all(symmetric), source_format=sc.to_metadata())
        return m

    write_container(_PlainLayers(source), opts, out, quantized_layer, meta, progress, log)
    return layer_errors, [f"imported {sc.method} ({sc.fmt}) g{sc.group_size} exactly, layout "
                          f"{nqf.layout_tag('int4', sc.group_size, 'f16')}"]
