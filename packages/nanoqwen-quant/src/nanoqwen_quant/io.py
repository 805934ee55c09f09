"""Files a pack writes: the `.nanoqwen` container (tensors in DESIGN.md order, then the metadata map)
and the GPTQ checkpoint folder that makes an interrupted run resumable.

Container order: embed_tokens, then per layer input_norm, qkv, qkv_bias, o_proj, post_attn_norm,
gate_up, down, then final_norm and lm_head. Each layer's weights are read from the source and its
quantized linears asked of a callback only when the writer reaches it, so one layer is in memory at
a time. The file is written by `nanoqwen_format.Writer` (temp file, atomic rename).

Checkpoint folder (`OUT.ckpt` by default):

    recipe.json         {"fingerprint": sha256 of source, recipe, calibration tokens, device type}
    layer_{i:03d}.pt    {name}.q / {name}.scale / {name}.zero of the four linears of layer i,
                        "errors" (json: per-projection metrics), "notes" (json: damping raises),
                        norm.{input_norm,post_attn_norm} (AWQ only: the norms its scales were folded into)
    hidden.pt           {"next_layer": i + 1, "x": f32 [tokens, hidden], the inputs of layer i + 1}

Both .pt files go to a temp name, are fsynced and renamed (`atomic_torch_save`), layer file first, so
hidden.pt never points past a layer file that is not complete.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import nanoqwen_format as nqf
import numpy as np
import torch
from nanoqwen_model.forward import LAYER_TENSORS

from .metrics import weight_rel_err
from .options import LINEARS, PackOptions, Progress
from .rtn import QuantResult
from .sources import Source

__all__ = ["CheckpointError", "Checkpoint", "LayerCheckpoint", "atomic_torch_save", "write_container",
           "container_metadata", "bf16_bits"]

# quantized_layer(i, layer weights by container name) -> {linear name: QuantResult}; {} keeps bf16
QuantizedLayer = Callable[[int, dict[str, torch.Tensor]], dict[str, QuantResult]]
TOOLS = ("nanoqwen-quant", "nanoqwen-model", "nanoqwen-format", "torch", "gguf", "safetensors", "tokenizers",
         "transformers", "huggingface_hub")


def atomic_torch_save(obj, path: Path) -> None:
    """torch.save to `path` through a fsynced temp file and a rename: `path` is old or complete."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def bf16_bits(t: torch.Tensor) -> np.ndarray:
    """A float tensor rounded to bf16 -> np.uint16 bit patterns [same shape], on the CPU."""
    return t.detach().cpu().to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)


# ------------------------------------------------------------------------------------- container
def write_container(source: Source, opts: PackOptions, out: Path, quantized_layer: QuantizedLayer,
                    metadata: Callable[[float | None], dict], progress: Progress,
                    log: Callable[[str], None] = print) -> None:
    """Write the container `out`. `metadata(lm_head_w_rel)` is called once every tensor is written
    (lm_head_w_rel: the int8/int4 lm_head's weight error, None for bf16). Temp files of earlier writes
    to `out` that the writer removes or leaves alone are reported to `log`, one line each."""
    cfg = source.config
    with nqf.Writer(out, on_partial=lambda p: log(f"{out}: {p}")) as w:
        w.add_array("embed_tokens", bf16_bits(source.embed_tokens()), "bf16")
        for i in range(cfg.num_hidden_layers):
            progress(f"layer {i}", i, cfg.num_hidden_layers)
            lw = source.layer(i)
            q = quantized_layer(i, lw)
            p = f"layers.{i}."
            for name in LAYER_TENSORS:
                if name in LINEARS and name in q:
                    w.add_quantized(p + name, q[name].to_nqf())
                else:
                    w.add_array(p + name, bf16_bits(lw[name]))
            del lw, q
        progress("final norm, lm_head", cfg.num_hidden_layers, cfg.num_hidden_layers)
        w.add_array("final_norm", bf16_bits(source.final_norm()))
        lm_err = None
        if opts.lm_head != "bf16" or not cfg.tie_word_embeddings:
            head = source.lm_head()
            if opts.lm_head == "bf16":
                w.add_array("lm_head", bf16_bits(head))
            else:
                hf = head.float().cpu()
                del head
                mod = nqf.int4 if opts.lm_head == "int4" else nqf.int8
                sym = opts.symmetric if opts.lm_head == "int4" else True  # int8 is symmetric only
                qt = mod.quantize_rtn(hf.numpy(), opts.group_size, sym)
                lm_err = weight_rel_err(hf, torch.from_numpy(mod.dequantize(qt)))
                w.add_quantized("lm_head", qt)
                del hf, qt
        w.set_metadata(metadata(lm_err))


def _tool_versions() -> dict[str, str]:
    out = {}
    for pkg in TOOLS:
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            continue
    return out


def container_metadata(source: Source, opts: PackOptions, layer_errors: list[dict], extra: dict,
                       source_sha: str, lm_head_w_rel: float | None) -> dict:
    """The container's metadata map (docs/DESIGN.md, "Metadata"); `extra` goes into `quantization`
    (GPTQ: its parameters, the calibration set, damping notes). No timestamps: a resumed pack must
    give a byte-identical file."""
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


# ------------------------------------------------------------------------------------ checkpoint
class CheckpointError(RuntimeError):
    """A checkpoint folder is in the way, does not match the recipe, or is incomplete."""


@dataclass
class LayerCheckpoint:
    """One layer's GPTQ result as stored: the four quantized linears (CPU), errors and damping notes,
    and the norms AWQ folded its scales into (f32, bf16-exact; empty without AWQ)."""

    quant: dict[str, QuantResult]
    errors: dict[str, dict]
    notes: list[str]
    norms: dict[str, torch.Tensor] = field(default_factory=dict)


class Checkpoint:
    """The GPTQ checkpoint folder (layout in the module docstring)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)

    def _layer_path(self, i: int) -> Path:
        return self.folder / f"layer_{i:03d}.pt"

    def check(self, resume: bool) -> None:
        """Raise CheckpointError unless a run can start (`resume` False: no folder there yet) or resume
        (`resume` True: a checkpoint folder is there). Cheap: called before the source is read; the
        fingerprint is compared by `open`."""
        if self.folder.exists() and not resume:
            raise CheckpointError(f"checkpoint folder {self.folder} exists: pass --resume to continue that "
                                  "run, or delete it to start over")
        if not self.folder.exists():
            if resume:
                raise CheckpointError(f"--resume: no checkpoint folder {self.folder}")
            return
        if not (self.folder / "recipe.json").is_file():
            raise CheckpointError(f"{self.folder} is not a nanoqwen-quant checkpoint (no recipe.json)")

    def open(self, fingerprint: str, resume: bool, n_layers: int) -> int:
        """Create the folder, or check the one there against `fingerprint` when resuming. Returns the
        first layer still to quantize (0 for a fresh run, n_layers when all are done)."""
        recipe = self.folder / "recipe.json"
        self.check(resume)
        if not self.folder.exists():
            self.folder.mkdir(parents=True)
            recipe.write_text(json.dumps({"fingerprint": fingerprint}))
            return 0
        if json.loads(recipe.read_text()).get("fingerprint") != fingerprint:
            raise CheckpointError(f"{self.folder} was made with another source, recipe, calibration set or "
                                  "device type; it cannot be resumed with these options")
        hidden = self.folder / "hidden.pt"
        if not hidden.is_file():
            return 0
        nxt = int(torch.load(hidden, weights_only=True, map_location="cpu")["next_layer"])
        for i in range(nxt):
            if not self._layer_path(i).is_file():
                raise CheckpointError(f"{self.folder}: {self._layer_path(i).name} missing although "
                                      "hidden.pt is past it")
        return min(nxt, n_layers)

    def save_layer(self, i: int, layer: LayerCheckpoint) -> None:
        d: dict = {"errors": json.dumps(layer.errors, sort_keys=True), "notes": json.dumps(layer.notes)}
        for name, r in layer.quant.items():
            d[f"{name}.q"] = r.q
            d[f"{name}.scale"] = r.scale
            if r.zero is not None:
                d[f"{name}.zero"] = r.zero
        for name, t in layer.norms.items():
            d[f"norm.{name}"] = t
        atomic_torch_save(d, self._layer_path(i))

    def load_layer(self, i: int, group_size: int) -> LayerCheckpoint:
        d = torch.load(self._layer_path(i), weights_only=True, map_location="cpu")
        quant = {n: QuantResult(d[f"{n}.q"], d[f"{n}.scale"], d.get(f"{n}.zero"), group_size)
                 for n in LINEARS}
        norms = {k.removeprefix("norm."): v for k, v in d.items() if k.startswith("norm.")}
        return LayerCheckpoint(quant, json.loads(d["errors"]), json.loads(d["notes"]), norms)

    def save_hidden(self, next_layer: int, x: torch.Tensor) -> None:
        """x f32 [tokens, hidden]: the inputs of layer `next_layer` (written after its layer file)."""
        atomic_torch_save({"next_layer": next_layer, "x": x.cpu()}, self.folder / "hidden.pt")

    def load_hidden(self) -> torch.Tensor:
        """f32 [tokens, hidden] on the CPU, as `save_hidden` stored it."""
        return torch.load(self.folder / "hidden.pt", weights_only=True, map_location="cpu")["x"]

    def remove(self) -> None:
        shutil.rmtree(self.folder)
