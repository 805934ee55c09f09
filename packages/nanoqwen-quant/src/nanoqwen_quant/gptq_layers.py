"""The GPTQ layer loop: every decoder layer quantized true-sequentially, checkpointed per layer.

The model is nanoqwen_model's forward, cut where each projection takes its input:

    for each layer i not yet in the checkpoint (x: the layer's inputs, from the quantized layer i-1):
        qkv     <- GPTQ(H of rms_norm(x))                             every Hessian is built from
        o_proj  <- GPTQ(H of attention with the quantized qkv)        inputs computed with the
        gate_up <- GPTQ(H of rms_norm(h)), h = x + o_proj(attention)  stages already quantized
        down    <- GPTQ(H of silu(gate) * up of the quantized gate_up)
        x       <- the layer's output with all four quantized weights (the next layer's inputs)
        checkpoint: layer_{i}.pt, then hidden.pt (io.Checkpoint)

Activations live on the quantization device as one flat token batch, f32 [S*T, hidden] for S
calibration windows of T tokens (window after window, positions 0..T-1 in each): `x` (the layer
input) and `h` (the residual after attention). Every stage runs over chunks of `calib_batch` whole
windows (`dense_attend(n, T)`), so only one chunk's intermediate activations exist at a time; only
the current layer's weights and one Hessian at a time are on the device (qkv / gate_up: [hidden,
hidden], o_proj: [q_dim, q_dim], down: [intermediate, intermediate]).

Resume: the computation is deterministic and both checkpoint files hold exact fp32 / uint8 values, so
a resumed run reaches the same bytes as an uninterrupted one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import nanoqwen_model.forward as fwd
import torch

from .calib import CalibrationSet
from .gptq import HessianAccumulator, gptq_quantize
from .io import Checkpoint, LayerCheckpoint
from .metrics import output_rel_err, weight_rel_err
from .options import PackOptions, Progress
from .rtn import QuantResult, quantize_rtn
from .sources import Source

__all__ = ["run_gptq"]


@dataclass
class _Chunk:
    """Up to `calib_batch` whole calibration windows: their rows of the flat activations, their
    positions (int64 [n*T], 0..T-1 per window) and the attention that keeps windows apart."""

    rows: slice
    positions: torch.Tensor
    attend: fwd.Attend


def _chunks(n_seqs: int, seq_len: int, batch: int, dev: torch.device) -> list[_Chunk]:
    out = []
    for s in range(0, n_seqs, batch):
        n = min(batch, n_seqs - s)
        out.append(_Chunk(slice(s * seq_len, (s + n) * seq_len),
                          torch.arange(seq_len, device=dev).repeat(n), fwd.dense_attend(n, seq_len)))
    return out


def run_gptq(source: Source, calib: CalibrationSet, opts: PackOptions, dev: torch.device, ckpt: Checkpoint,
             fingerprint: str, progress: Progress, log: Callable[[str], None]) -> None:
    """Quantize every layer not yet in `ckpt`; on return every layer file exists.

    calib.ids: int64 [S, T] calibration windows; `fingerprint` identifies source, recipe, tokens and
    device type (a checkpoint made with another one is refused)."""
    cfg = source.config
    n_layers = cfg.num_hidden_layers
    start = ckpt.open(fingerprint, opts.resume, n_layers)
    if start >= n_layers:
        log(f"checkpoint {ckpt.folder}: all {n_layers} layers already quantized")
        return
    if start > 0:
        log(f"resuming from checkpoint {ckpt.folder} at layer {start}")
        x = ckpt.load_hidden().to(dev)
    else:
        emb = source.embed_tokens()
        x = emb[calib.ids.reshape(-1)].float().to(dev)  # [S*T, hidden]
        del emb
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    n_seqs, seq_len = calib.ids.shape
    chunks = _chunks(n_seqs, seq_len, opts.calib_batch, dev)
    inv_freq = fwd.rope_inv_freq(cfg.head_dim, cfg.rope_theta, dev)
    h = torch.empty_like(x)
    for i in range(start, n_layers):
        t0 = time.perf_counter()
        layer = _gptq_layer(i, source, x, h, chunks, inv_freq, opts, dev, progress)
        ckpt.save_layer(i, layer)
        ckpt.save_hidden(i + 1, x)
        for m in layer.notes:
            log(m)
        summary = " ".join(f"{n}={e['out_rel']:.2e}(rtn {e['rtn_out_rel']:.2e})"
                           for n, e in layer.errors.items())
        log(f"layer {i}: {time.perf_counter() - t0:.1f}s  out_rel {summary}")
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    progress("gptq done", n_layers, n_layers)


def _gptq_layer(i: int, source: Source, x: torch.Tensor, h: torch.Tensor, chunks: list[_Chunk],
                inv_freq: torch.Tensor, opts: PackOptions, dev: torch.device,
                progress: Progress) -> LayerCheckpoint:
    """GPTQ of layer i, true-sequential. x, h f32 [S*T, hidden]: x is updated in place to the layer's
    quantized output, h is scratch. Returns the layer's quantized linears (CPU), errors and notes."""
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
        errs[name] = {"w_rel": weight_rel_err(f[name], dq), "out_rel": output_rel_err(f[name], dq, acc.H),
                      "rtn_out_rel": output_rel_err(f[name], rtn, acc.H), "damp": g.damp_used,
                      "dead_columns": g.dead_columns}
        notes.extend(f"layer {i} {name}: {m}" for m in g.notes)
        res[name] = g.quant.cpu()
        wq[name] = dq
        del acc.H

    def attn(c: _Chunk) -> torch.Tensor:
        xn = fwd.rms_norm(x[c.rows], f["input_norm"], eps)
        w = {"qkv": wq["qkv"], "qkv_bias": f["qkv_bias"]}
        return fwd.attention_input(cfg, xn, w, c.positions, inv_freq, c.attend, i)

    def mlp(c: _Chunk) -> torch.Tensor:
        return fwd.mlp_input(cfg, fwd.rms_norm(h[c.rows], f["post_attn_norm"], eps), wq["gate_up"])

    # 1. qkv: inputs are rms_norm(x)
    progress(f"layer {i} hessian qkv", i, n_layers)
    acc = HessianAccumulator(cfg.hidden_size, dev)
    for c in chunks:
        acc.add(fwd.rms_norm(x[c.rows], f["input_norm"], eps))
    quantize_stage("qkv", acc)
    # 2. o_proj: inputs are the attention outputs computed with the quantized qkv
    progress(f"layer {i} hessian o_proj", i, n_layers)
    acc = HessianAccumulator(cfg.q_dim, dev)
    for c in chunks:
        acc.add(attn(c))
    quantize_stage("o_proj", acc)
    # 3. gate_up: inputs are rms_norm(h), h = x + o_q(attn_q)
    progress(f"layer {i} hessian gate_up", i, n_layers)
    acc = HessianAccumulator(cfg.hidden_size, dev)
    for c in chunks:
        h[c.rows] = x[c.rows] + fwd.linear(attn(c), wq["o_proj"])
        acc.add(fwd.rms_norm(h[c.rows], f["post_attn_norm"], eps))
    quantize_stage("gate_up", acc)
    # 4. down: inputs are silu(gate) * up with the quantized gate_up
    progress(f"layer {i} hessian down", i, n_layers)
    acc = HessianAccumulator(cfg.intermediate_size, dev)
    for c in chunks:
        acc.add(mlp(c))
    quantize_stage("down", acc)
    # 5. the next layer's inputs, from the fully quantized layer
    progress(f"layer {i} forward", i, n_layers)
    for c in chunks:
        x[c.rows] = h[c.rows] + fwd.linear(mlp(c), wq["down"])
    return LayerCheckpoint(res, errs, notes)
