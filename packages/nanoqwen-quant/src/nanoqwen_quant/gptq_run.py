"""The GPTQ layer loop: true-sequential quantization of each decoder layer, checkpointed per layer.

Activations live on the quantization device as f32 [n_seqs, seq_len, hidden]: `x` (the layer input)
and `h` (the residual after attention). Each stage runs over the calibration sequences in chunks of
`calib_batch`, so only one projection's intermediate activations exist at a time; only the current
layer's weights and one Hessian at a time are on the device (the qkv/gate_up Hessians are
[hidden, hidden], down's is [intermediate, intermediate]).

Checkpoint folder (`OUT.ckpt` by default):
    recipe.json         fingerprint of source, recipe, calibration tokens and device type
    layer_{i:03d}.pt    q / scale / zero of the four linears of layer i, errors, damping notes
    hidden.pt           {"next_layer": i + 1, "x": f32 activations entering layer i + 1}
Both .pt files are written to a temp name, fsynced and renamed, layer file first.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from . import qwen2
from .calib import CalibrationSet
from .quantize import HessianAccumulator, QuantResult, gptq_quantize, quantize_rtn
from .sources import Source


class CheckpointError(RuntimeError):
    """A checkpoint folder is in the way, does not match the recipe, or is incomplete."""


def _prepare_checkpoint(ckpt: Path, fingerprint: str, resume: bool, n_layers: int) -> int:
    """Returns the first layer still to quantize (0 for a fresh run)."""
    recipe = ckpt / "recipe.json"
    if ckpt.exists() and not resume:
        raise CheckpointError(f"checkpoint folder {ckpt} exists: pass --resume to continue that run, "
                              "or delete it to start over")
    if not ckpt.exists():
        if resume:
            raise CheckpointError(f"--resume: no checkpoint folder {ckpt}")
        ckpt.mkdir(parents=True)
        recipe.write_text(json.dumps({"fingerprint": fingerprint}))
        return 0
    if not recipe.is_file():
        raise CheckpointError(f"{ckpt} is not a nanoqwen-quant checkpoint (no recipe.json)")
    old = json.loads(recipe.read_text()).get("fingerprint")
    if old != fingerprint:
        raise CheckpointError(f"{ckpt} was made with another source, recipe, calibration set or device "
                              "type; it cannot be resumed with these options")
    hidden = ckpt / "hidden.pt"
    if not hidden.is_file():
        return 0
    nxt = int(torch.load(hidden, weights_only=True, map_location="cpu")["next_layer"])
    for i in range(nxt):
        if not (ckpt / f"layer_{i:03d}.pt").is_file():
            raise CheckpointError(f"{ckpt}: layer_{i:03d}.pt missing although hidden.pt is past it")
    return min(nxt, n_layers)


def run_gptq(source: Source, calib: CalibrationSet, opts, dev: torch.device, ckpt: Path, fingerprint: str,
             progress: Callable[[str, int, int], None], log: Callable[[str], None]) -> None:
    """Quantize every layer not yet in `ckpt`; on return every layer_{i}.pt exists."""
    from .pack import atomic_torch_save

    cfg = source.config
    n_layers = cfg.num_hidden_layers
    start = _prepare_checkpoint(ckpt, fingerprint, opts.resume, n_layers)
    if start >= n_layers:
        log(f"checkpoint {ckpt}: all {n_layers} layers already quantized")
        return
    if start > 0:
        log(f"resuming from checkpoint {ckpt} at layer {start}")
        x = torch.load(ckpt / "hidden.pt", weights_only=True, map_location="cpu")["x"].to(dev)
    else:
        emb = source.embed_tokens()
        x = emb[calib.ids].float().to(dev)  # [S, T, h]
        del emb
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    rope = qwen2.rope_cos_sin(calib.ids.shape[1], cfg.head_dim, cfg.rope_theta, dev)
    S, B = x.shape[0], opts.calib_batch
    chunks = [slice(s, min(s + B, S)) for s in range(0, S, B)]
    h = torch.empty_like(x)
    for i in range(start, n_layers):
        t0 = time.perf_counter()
        layer, errs, notes = _gptq_layer(i, source, x, h, chunks, rope, opts, dev, progress)
        atomic_torch_save(layer, ckpt / f"layer_{i:03d}.pt")
        atomic_torch_save({"next_layer": i + 1, "x": x.cpu()}, ckpt / "hidden.pt")
        for m in notes:
            log(m)
        summary = " ".join(f"{n}={e['out_rel']:.2e}(rtn {e['rtn_out_rel']:.2e})" for n, e in errs.items())
        log(f"layer {i}: {time.perf_counter() - t0:.1f}s  out_rel {summary}")
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    progress("gptq done", n_layers, n_layers)


def _gptq_layer(i: int, source: Source, x: torch.Tensor, h: torch.Tensor, chunks: list[slice], rope, opts,
                dev: torch.device, progress) -> tuple[dict, dict, list[str]]:
    """GPTQ of layer i, true-sequential. Updates x in place to the layer's quantized output (h is
    scratch). Returns the checkpoint dict, the per-projection errors and the damping notes."""
    from .pack import _out_err, _weight_err

    cfg = source.config
    n_layers, eps = cfg.num_hidden_layers, cfg.rms_norm_eps
    f = {k: v.to(dev).float() for k, v in source.layer(i).items()}
    wq: dict[str, torch.Tensor] = {}  # dequantized f32 weights of the finished stages
    res: dict[str, QuantResult] = {}
    errs: dict[str, dict] = {}
    notes: list[str] = []

    def quantize_stage(name: str, acc: HessianAccumulator) -> None:
        progress(f"layer {i} gptq {name}", i, n_layers)
        g = gptq_quantize(f[name], acc.H, opts.gptq)
        dq = g.quant.dequantize()
        rtn = quantize_rtn(f[name], opts.group_size, opts.symmetric).dequantize()
        errs[name] = {"w_rel": _weight_err(f[name], dq), "out_rel": _out_err(f[name], dq, acc.H),
                      "rtn_out_rel": _out_err(f[name], rtn, acc.H), "damp": g.damp_used,
                      "dead_columns": g.dead_columns}
        notes.extend(f"layer {i} {name}: {m}" for m in g.notes)
        res[name] = g.quant.cpu()
        wq[name] = dq
        del acc.H

    def attn(c: slice) -> torch.Tensor:
        xn = qwen2.rms_norm(x[c], f["input_norm"], eps)
        return qwen2.attention_input(cfg, xn, wq["qkv"], f["qkv_bias"], rope)

    # 1. qkv: inputs are rms_norm(x)
    progress(f"layer {i} hessian qkv", i, n_layers)
    acc = HessianAccumulator(cfg.hidden_size, dev)
    for c in chunks:
        acc.add(qwen2.rms_norm(x[c], f["input_norm"], eps))
    quantize_stage("qkv", acc)
    # 2. o_proj: inputs are the attention outputs computed with the quantized qkv
    progress(f"layer {i} hessian o_proj", i, n_layers)
    acc = HessianAccumulator(cfg.q_size, dev)
    for c in chunks:
        acc.add(attn(c))
    quantize_stage("o_proj", acc)
    # 3. gate_up: inputs are rms_norm(h), h = x + o_q(attn_q)
    progress(f"layer {i} hessian gate_up", i, n_layers)
    acc = HessianAccumulator(cfg.hidden_size, dev)
    for c in chunks:
        h[c] = x[c] + qwen2.linear(attn(c), wq["o_proj"])
        acc.add(qwen2.rms_norm(h[c], f["post_attn_norm"], eps))
    quantize_stage("gate_up", acc)
    # 4. down: inputs are silu(gate) * up with the quantized gate_up
    progress(f"layer {i} hessian down", i, n_layers)
    acc = HessianAccumulator(cfg.intermediate_size, dev)
    for c in chunks:
        acc.add(qwen2.mlp_input(cfg, qwen2.rms_norm(h[c], f["post_attn_norm"], eps), wq["gate_up"]))
    quantize_stage("down", acc)
    # 5. the next layer's inputs, from the fully quantized layer
    progress(f"layer {i} forward", i, n_layers)
    for c in chunks:
        m = qwen2.mlp_input(cfg, qwen2.rms_norm(h[c], f["post_attn_norm"], eps), wq["gate_up"])
        x[c] = h[c] + qwen2.linear(m, wq["down"])
    layer = {"errors": json.dumps(errs, sort_keys=True), "notes": json.dumps(notes)}
    for name, r in res.items():
        layer[f"{name}.q"] = r.q
        layer[f"{name}.scale"] = r.scale
        if r.zero is not None:
            layer[f"{name}.zero"] = r.zero
    return layer, errs, notes
