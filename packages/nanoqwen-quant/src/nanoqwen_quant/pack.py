"""`pack`: a Qwen2 checkpoint -> a `.nanoqwen` container, with method none (bf16), rtn or gptq.

Flow (one decoder layer in memory at a time):

    none / rtn:  embed -> for each layer: read, quantize the four fused linears, write -> final_norm
                 -> lm_head. Straight into the streaming nanoqwen_format.Writer.
    gptq:        calibration tokens -> x = embed[ids] (f32, on the device)
                 for each layer i not yet in the checkpoint:
                     qkv  <- GPTQ(H of rms_norm(x))                        (true-sequential:
                     o    <- GPTQ(H of attention with the quantized qkv)     every Hessian is
                     gate_up <- GPTQ(H of rms_norm(h)), h from quantized o   built from the
                     down <- GPTQ(H of silu(g)*u from quantized gate_up)     quantized stages)
                     x    <- layer output with all four quantized weights  (next layer's input)
                     checkpoint: layer_{i}.pt (quantized tensors, errors), then hidden.pt (x, i+1)
                 then the container is assembled from the checkpoint files.

Resume: `hidden.pt` is written (atomically) only after its layer file, both hold exact fp32/uint8
values, and the computation is deterministic, so a resumed run assembles a byte-identical file. The
checkpoint records a fingerprint of the recipe, source and calibration tokens; a mismatch is refused.

Per-layer errors in the metadata: `w_rel` = ||W - Q||_F / ||W||_F for every method; for GPTQ also
`out_rel` = tr(E H E^T) / tr(W H W^T), the relative output MSE on the calibration inputs, and
`rtn_out_rel`, the same for RTN on the same inputs (so the gain is visible per projection).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .calib import CalibrationSet, build_calibration
from .quantize import GROUP_SIZES, GPTQConfig, quantize_rtn
from .sources import Source

LINEARS = ("qkv", "o_proj", "gate_up", "down")
LM_HEAD_CHOICES = ("bf16", "int8", "int4")
METHODS = ("none", "rtn", "gptq")


@dataclass
class PackOptions:
    """The recipe. `calib_tokens` is rounded down to whole `calib_seq_len` windows."""

    method: str = "rtn"
    group_size: int = 128
    symmetric: bool = True
    lm_head: str = "bf16"
    device: str = "auto"  # "auto": CUDA when present, else CPU
    calib_paths: list[str] | None = None
    calib_tokens: int = 65536
    calib_seq_len: int = 2048
    calib_batch: int = 4  # sequences per forward chunk (bounds activation memory)
    gptq: GPTQConfig = field(default_factory=GPTQConfig)
    checkpoint_dir: str | None = None  # default: OUT + ".ckpt"
    resume: bool = False

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.lm_head not in LM_HEAD_CHOICES:
            raise ValueError(f"lm_head must be one of {LM_HEAD_CHOICES}, got {self.lm_head!r}")
        if self.group_size not in GROUP_SIZES:
            raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {self.group_size}")
        self.gptq.group_size = self.group_size
        self.gptq.symmetric = self.symmetric

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dev = torch.device(self.device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda asked for, but torch sees no CUDA device")
        return dev


@dataclass
class PackSummary:
    out: Path
    seconds: float
    nbytes: int
    layer_errors: list[dict]
    notes: list[str]
    device: str


Progress = Callable[[str, int, int], None]  # (stage description, done, total)


def _noop(stage: str, done: int, total: int) -> None:
    pass


def _bits(t: torch.Tensor) -> np.ndarray:
    """bf16 tensor -> np.uint16 bit patterns."""
    return t.detach().cpu().to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)


def _tool_versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("nanoqwen-quant", "nanoqwen-format", "torch", "gguf", "safetensors", "tokenizers",
                "transformers", "huggingface_hub"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            continue
    return out


def _rel(num: torch.Tensor, den: torch.Tensor) -> float:
    return float(num) / max(float(den), 1e-30)


def _weight_err(w: torch.Tensor, dq: torch.Tensor) -> float:
    w = w.float()
    return _rel(torch.linalg.vector_norm(w - dq), torch.linalg.vector_norm(w))


def _out_err(w: torch.Tensor, dq: torch.Tensor, H: torch.Tensor) -> float:
    """tr(E H E^T) / tr(W H W^T): relative output MSE on the inputs H was accumulated from."""
    w = w.float()
    e = w - dq
    return _rel(((e @ H) * e).sum(), ((w @ H) * w).sum())


class _Assembler:
    """Writes the container in DESIGN.md order: embed, layers..., final_norm, lm_head."""

    def __init__(self, source: Source, opts: PackOptions, out: Path):
        self.source, self.opts, self.out = source, opts, out
        self.lm_head_w_rel: float | None = None

    def write(self, quantized_layer: Callable[[int, dict], dict], metadata: Callable[[], dict],
              progress: Progress) -> None:
        import nanoqwen_format as nqf

        src, cfg = self.source, self.source.config
        with nqf.Writer(self.out) as w:
            w.add_array("embed_tokens", _bits(src.embed_tokens()), "bf16")
            for i in range(cfg.num_hidden_layers):
                progress(f"layer {i}", i, cfg.num_hidden_layers)
                lw = src.layer(i)
                q = quantized_layer(i, lw)
                w.add_array(f"layers.{i}.input_norm", _bits(lw["input_norm"]))
                self._add_linear(w, f"layers.{i}.qkv", lw["qkv"], q.get("qkv"))
                w.add_array(f"layers.{i}.qkv_bias", _bits(lw["qkv_bias"]))
                self._add_linear(w, f"layers.{i}.o_proj", lw["o_proj"], q.get("o_proj"))
                w.add_array(f"layers.{i}.post_attn_norm", _bits(lw["post_attn_norm"]))
                self._add_linear(w, f"layers.{i}.gate_up", lw["gate_up"], q.get("gate_up"))
                self._add_linear(w, f"layers.{i}.down", lw["down"], q.get("down"))
                del lw, q
            progress("final norm, lm_head", cfg.num_hidden_layers, cfg.num_hidden_layers)
            w.add_array("final_norm", _bits(src.final_norm()))
            lm_err = None
            if self.opts.lm_head != "bf16" or not cfg.tie_word_embeddings:
                head = src.lm_head()
                if self.opts.lm_head == "bf16":
                    w.add_array("lm_head", _bits(head))
                else:
                    hf = head.float().cpu()
                    del head
                    mod = nqf.int4 if self.opts.lm_head == "int4" else nqf.int8
                    sym = self.opts.symmetric if self.opts.lm_head == "int4" else True  # int8 is sym only
                    qt = mod.quantize_rtn(hf.numpy(), self.opts.group_size, sym)
                    lm_err = _weight_err(hf, torch.from_numpy(mod.dequantize(qt)))
                    w.add_quantized("lm_head", qt)
                    del hf, qt
            self.lm_head_w_rel = lm_err
            w.set_metadata(metadata())

    @staticmethod
    def _add_linear(w, name: str, weight: torch.Tensor, q) -> None:
        if q is None:
            w.add_array(name, _bits(weight))
        else:
            w.add_quantized(name, q.to_nqf())


def _base_metadata(source: Source, opts: PackOptions, layer_errors: list[dict], extra: dict,
                   source_sha: str, lm_head_w_rel: float | None) -> dict:
    quant = {"method": opts.method, "bits": 16 if opts.method == "none" else 4,
             "group_size": None if opts.method == "none" else opts.group_size,
             "symmetric": None if opts.method == "none" else opts.symmetric,
             "lm_head": opts.lm_head, "lm_head_method": None if opts.lm_head == "bf16" else "rtn",
             "lm_head_w_rel": lm_head_w_rel, "layer_errors": layer_errors, **extra}
    return {
        "config": source.config.to_metadata(),
        "tokenizer": source.tokenizer_json,
        "chat_template": source.chat_template,
        "generation": source.generation,
        "quantization": quant,
        "provenance": {"source": source.spec, "source_sha256": source_sha, "tools": _tool_versions()},
    }


def pack(source: Source, out: str | Path, opts: PackOptions, progress: Progress = _noop,
         log: Callable[[str], None] = print, calibration: CalibrationSet | None = None) -> PackSummary:
    """Pack `source` into `out` (written atomically). Returns the summary; raises on any failure.

    `calibration`: pre-tokenized GPTQ calibration windows; by default they are built from
    `opts.calib_paths` (or the stdlib) with the source's tokenizer."""
    opts.validate()
    out = Path(out)
    if not out.parent.is_dir():
        raise FileNotFoundError(f"output folder {out.parent} does not exist")
    t0 = time.perf_counter()
    source.check_complete()
    source_sha = source.source_sha256()
    notes: list[str] = []
    layer_errors: list[dict] = []
    asm = _Assembler(source, opts, out)
    dev = opts.resolved_device()
    if opts.method in ("none", "rtn"):
        def quantized_layer(i: int, lw: dict) -> dict:
            if opts.method == "none":
                layer_errors.append({})
                return {}
            res, errs = {}, {}
            for name in LINEARS:
                w = lw[name].to(dev)
                r = quantize_rtn(w, opts.group_size, opts.symmetric)
                errs[name] = {"w_rel": _weight_err(w, r.dequantize())}
                res[name] = r.cpu()
            layer_errors.append(errs)
            return res

        def meta() -> dict:
            return _base_metadata(source, opts, layer_errors, {}, source_sha, asm.lm_head_w_rel)

        asm.write(quantized_layer, meta, progress)
    else:
        from .gptq_run import run_gptq

        ckpt = Path(opts.checkpoint_dir) if opts.checkpoint_dir else Path(str(out) + ".ckpt")
        calib = calibration or build_calibration(source.tokenizer_json, opts.calib_tokens, opts.calib_seq_len,
                                                 opts.calib_paths)
        log(f"calibration: {calib.tokens} tokens ({calib.ids.shape[0]} x {calib.ids.shape[1]}) from "
            f"{calib.files} files of {calib.source}; device {dev}")
        fingerprint = _fingerprint(source_sha, opts, calib.sha256, source.config.to_metadata(), dev)
        run_gptq(source, calib, opts, dev, ckpt, fingerprint, progress, log)
        for i in range(source.config.num_hidden_layers):
            p = torch.load(ckpt / f"layer_{i:03d}.pt", weights_only=True, map_location="cpu")
            layer_errors.append(json.loads(p["errors"]))
            notes += json.loads(p["notes"])
            del p

        def quantized_layer(i: int, lw: dict) -> dict:
            from .quantize import QuantResult

            p = torch.load(ckpt / f"layer_{i:03d}.pt", weights_only=True, map_location="cpu")
            return {n: QuantResult(p[f"{n}.q"], p[f"{n}.scale"], p.get(f"{n}.zero"), opts.group_size)
                    for n in LINEARS}

        def meta() -> dict:
            extra = {"gptq": opts.gptq.to_metadata(), "calibration": calib.to_metadata(),
                     "gptq_notes": notes}
            return _base_metadata(source, opts, layer_errors, extra, source_sha, asm.lm_head_w_rel)

        asm.write(quantized_layer, meta, progress)
        shutil.rmtree(ckpt)
    return PackSummary(out, time.perf_counter() - t0, out.stat().st_size, layer_errors, notes, str(dev))


def _fingerprint(source_sha: str, opts: PackOptions, tokens_sha: str, config: dict, dev: torch.device) -> str:
    d = {"device": dev.type, "source_sha256": source_sha, "config": config, "tokens_sha256": tokens_sha,
         "group_size": opts.group_size, "symmetric": opts.symmetric, "gptq": opts.gptq.to_metadata(),
         "calib_batch": opts.calib_batch, "torch": torch.__version__}
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()


def atomic_torch_save(obj, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
