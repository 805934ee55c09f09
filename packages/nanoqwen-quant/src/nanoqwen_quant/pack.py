"""`pack`: a Qwen2 checkpoint -> a `.nanoqwen` container, with method none (bf16), rtn or gptq, optionally
with the clip search (clip.py) and AWQ scaling (awq.py).

This module only orchestrates; each step has its own module, imported one way (only cli.py and
model_fetch.py import pack.py):

    options.py  PackOptions (the recipe)          rtn.py / gptq.py  the quantizers of one matrix
    sources.py  the checkpoint, layer by layer     gptq_layers.py    the GPTQ decoder-layer loop
    calib.py    calibration windows                io.py             container writer, checkpoints

Flow (one decoder layer in memory at a time):

    none / rtn:  the container writer asks for each layer's quantized linears as it reaches the
                 layer (RTN of the four fused linears, clip-searched with --clip, or nothing for
                 none) and streams it out.
    gptq, or rtn with --awq (calibrated): calibration windows -> gptq_layers.run_gptq fills the
                 checkpoint folder layer by layer (resumable) -> the container is assembled from the
                 checkpoint files (AWQ's folded norms replace the source's) -> the folder is removed.
    import:      a GPTQ/AWQ checkpoint (pack_import.py, checkpoints.py): its codes, fp16 scales and
                 zero points are moved into the f16-scale INT4 layout layer by layer, exactly.

Resume: the checkpoint records a fingerprint of the recipe, source, calibration tokens and device
type; a mismatch is refused. A resumed run assembles a byte-identical file (see gptq_layers.py).
Per-layer errors in the metadata (`quantization.layer_errors`) are defined in metrics.py.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import nanoqwen_format as nqf
import torch

from .calib import CalibrationSet, build_calibration
from .calib_chat import ChatRenderer
from .clip import quantize_rtn_clipped
from .gptq_layers import run_gptq
from .io import Checkpoint, container_metadata, write_container
from .metrics import weight_rel_err
from .options import LINEARS, PackOptions, Progress, UsageError, no_progress
from .pack_import import check_import_options, pack_import
from .rtn import QuantResult, quantize_rtn
from .sources import Source

__all__ = ["PackOptions", "PackSummary", "check_output_path", "checkpoint_folder", "pack"]

# Bumped whenever what a checkpoint holds, or how the layer loop computes it, changes: a checkpoint of
# an older loop is then refused instead of being resumed into a file a fresh run would not write.
# 2: activations are flat [tokens, hidden] and computed with nanoqwen_model's forward.
# 3: clip search and AWQ (folded norms in the layer files), RTN as the loop's quantizer.
CHECKPOINT_VERSION = 3


@dataclass
class PackSummary:
    """What `pack` did: the file, its size, the time, per-layer errors and damping notes."""

    out: Path
    seconds: float
    nbytes: int
    layer_errors: list[dict]
    notes: list[str]
    device: str


def check_output_path(out: str | Path, opts: PackOptions,
                      check_checkpoint: bool = True) -> list[nqf.PartialFile]:
    """Check that a pack to `out` can write its files, before any source is read; remove the stale temp
    files of killed packs to `out` and return them (and those left alone), one-line `str()` each.
    `check_checkpoint` False leaves the checkpoint folder unchecked: the CLI's early call when no
    --method was given, since the source may turn the method into import, which keeps none.

    UsageError: `out` is a directory or another non-regular file (a regular file, or a symlink to
    one, is replaced atomically when the pack succeeds). FileNotFoundError / NotADirectoryError /
    PermissionError: the folder of `out` is missing, not a folder, or not writable. CheckpointError
    (GPTQ): the checkpoint folder is there without `resume`, or missing with it.
    nanoqwen_format.ConcurrentWriteError: another pack is writing `out` now."""
    out = Path(out)
    if out.is_dir():
        raise UsageError(f"output (-o/--out) {out} is a directory; give a file path such as "
                         f"{out / 'model.nanoqwen'}")
    if out.exists() and not out.is_file():
        raise UsageError(f"output (-o/--out) {out} exists and is not a regular file")
    folder = out.absolute().parent
    if not folder.exists():
        raise FileNotFoundError(errno.ENOENT, "output folder does not exist", str(folder))
    if not folder.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "output folder is not a folder", str(folder))
    if not os.access(folder, os.W_OK | os.X_OK):
        raise PermissionError(errno.EACCES, "output folder is not writable", str(folder))
    if opts.method == "gptq" and check_checkpoint:
        checkpoint_folder(out, opts).check(opts.resume)
    return nqf.clean_partials(out)


def checkpoint_folder(out: Path, opts: PackOptions) -> Checkpoint:
    """The GPTQ checkpoint folder of a pack to `out`: `opts.checkpoint_dir`, or OUT.ckpt."""
    return Checkpoint(Path(opts.checkpoint_dir) if opts.checkpoint_dir else Path(str(out) + ".ckpt"))


def pack(source: Source, out: str | Path, opts: PackOptions, progress: Progress = no_progress,
         log: Callable[[str], None] = print, calibration: CalibrationSet | None = None) -> PackSummary:
    """Pack `source` into `out` (written atomically). Returns the summary; raises on any failure.

    Every option, the device and the output path are checked first (`opts.validate()`,
    `opts.check_model(source.config)`, `check_output_path`), before any tensor is read or hashed;
    removed stale temp files are reported to `log`.
    `calibration`: pre-tokenized GPTQ calibration windows; by default they are built from
    `opts.calib_paths`, or the stdlib's chat conversations in the source's template (`opts.calib_text`),
    with the source's tokenizer."""
    opts.validate()
    opts.check_model(source.config)
    check_import_options(source, opts)  # a GPTQ/AWQ source is imported, never requantized
    dev = opts.resolved_device()
    out = Path(out)
    for p in check_output_path(out, opts):
        log(f"{out}: {p}")
    t0 = time.perf_counter()
    source.check_complete()
    source_sha = source.source_sha256()
    if opts.method == "import":
        layer_errors, notes = pack_import(source, out, opts, source_sha, progress, log)
    elif not opts.calibrated:
        layer_errors, notes = _pack_rtn(source, out, opts, dev, source_sha, progress, log)
    else:
        layer_errors, notes = _pack_gptq(source, out, opts, dev, source_sha, progress, log, calibration)
    return PackSummary(out, time.perf_counter() - t0, out.stat().st_size, layer_errors, notes, str(dev))


def _pack_rtn(source: Source, out: Path, opts: PackOptions, dev: torch.device, source_sha: str,
              progress: Progress, log: Callable[[str], None]) -> tuple[list[dict], list[str]]:
    """Method none or rtn: straight into the container writer, one layer at a time."""
    layer_errors: list[dict] = []

    def quantized_layer(i: int, lw: dict[str, torch.Tensor]) -> dict[str, QuantResult]:
        if opts.method == "none":
            layer_errors.append({})
            return {}
        res, errs = {}, {}
        for name in LINEARS:
            w = lw[name].to(dev)
            if opts.clip:
                r = quantize_rtn_clipped(w, opts.group_size, opts.symmetric)
            else:
                r = quantize_rtn(w, opts.group_size, opts.symmetric)
            errs[name] = {"w_rel": weight_rel_err(w, r.dequantize())}
            res[name] = r.cpu()
        layer_errors.append(errs)
        return res

    def meta(lm_head_w_rel: float | None) -> dict:
        extra = opts.recipe_metadata() if opts.method != "none" else {}
        return container_metadata(source, opts, layer_errors, extra, source_sha, lm_head_w_rel)

    write_container(source, opts, out, quantized_layer, meta, progress, log)
    return layer_errors, []


def _pack_gptq(source: Source, out: Path, opts: PackOptions, dev: torch.device, source_sha: str,
               progress: Progress, log: Callable[[str], None],
               calibration: CalibrationSet | None) -> tuple[list[dict], list[str]]:
    """Method gptq, or rtn with AWQ: the layer loop into the checkpoint, then the container from it."""
    ckpt = checkpoint_folder(out, opts)
    calib = calibration or build_calibration(source.tokenizer_json, opts.calib_tokens, opts.calib_seq_len,
                                             opts.calib_paths, chat_renderer(source, opts))
    log(f"calibration: {calib.tokens} tokens ({calib.ids.shape[0]} x {calib.ids.shape[1]}) from "
        f"{calib.files} documents of {calib.source}; device {dev}")
    fingerprint = _fingerprint(source_sha, opts, calib.sha256, source.config.to_metadata(), dev)
    run_gptq(source, calib, opts, dev, ckpt, fingerprint, progress, log)
    layer_errors: list[dict] = []
    notes: list[str] = []
    for i in range(source.config.num_hidden_layers):
        layer = ckpt.load_layer(i, opts.group_size)
        layer_errors.append(layer.errors)
        notes += layer.notes
        del layer

    def quantized_layer(i: int, lw: dict[str, torch.Tensor]) -> dict[str, QuantResult]:
        layer = ckpt.load_layer(i, opts.group_size)
        lw.update(layer.norms)  # AWQ's folded norms: the writer takes the non-linear tensors from lw
        return layer.quant

    def meta(lm_head_w_rel: float | None) -> dict:
        extra = {**opts.recipe_metadata(), "calibration": calib.to_metadata()}
        if opts.method == "gptq":
            extra |= {"gptq": opts.gptq.to_metadata(), "gptq_notes": notes}
        return container_metadata(source, opts, layer_errors, extra, source_sha, lm_head_w_rel)

    write_container(source, opts, out, quantized_layer, meta, progress, log)
    ckpt.remove()
    return layer_errors, notes


def chat_renderer(source: Source, opts: PackOptions) -> ChatRenderer | None:
    """The renderer of the chat calibration text (the source's own chat template), or None when the
    calibration text is code or user files (`opts.chat_calibration`)."""
    if not opts.chat_calibration:
        return None
    eos = source.config.eos_token_id
    return ChatRenderer(source.chat_template, source.tokenizer_json, source.config.bos_token_id,
                        eos[0] if eos else None)


def _fingerprint(source_sha: str, opts: PackOptions, tokens_sha: str, config: dict, dev: torch.device) -> str:
    """sha256 of everything a GPTQ checkpoint depends on (see CHECKPOINT_VERSION)."""
    d = {"checkpoint_version": CHECKPOINT_VERSION, "device": dev.type, "source_sha256": source_sha,
         "config": config, "tokens_sha256": tokens_sha, "group_size": opts.group_size,
         "symmetric": opts.symmetric, "gptq": opts.gptq.to_metadata(), "calib_batch": opts.calib_batch,
         "method": opts.method, "recipe": opts.recipe_metadata(),
         "torch": torch.__version__}
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()
