"""The calibrated layer loop (GPTQ, and AWQ scaling with either quantizer): every decoder layer
quantized true-sequentially, checkpointed per layer.

The model is nanoqwen_model's forward, cut where each projection takes its input:

    for each layer i not yet in the checkpoint (x: the layer's inputs, from the quantized layer i-1):
        qkv     <- Q(H of rms_norm(x))                             every Hessian is built from
        o_proj  <- Q(H of attention with the quantized qkv)        inputs computed with the
        gate_up <- Q(H of rms_norm(h)), h = x + o_proj(attention)  stages already quantized
        down    <- Q(H of silu(gate) * up of the quantized gate_up)
        x       <- the layer's output with all four quantized weights (the next layer's inputs)
        checkpoint: layer_{i}.pt, then hidden.pt (io.Checkpoint)

Q is GPTQ (method gptq) or RTN (method rtn with --awq), on the clip-searched grid with --clip. With
--awq (awq.py) a scale is searched on the same H before Q, for qkv (folded into input_norm), gate_up
(into post_attn_norm) and down (into the up rows of gate_up: searched on the inputs of the float
gate_up, before gate_up is quantized, since its up rows take the scale); the Hessian is transformed
with the scale (H' = H / s s^T) so Q sees the scaled inputs. The folded norms are checkpointed with
the layer and written to the container in place of the source's. Per projection `rtn_out_rel` is
always plain RTN of the unscaled weight on the unscaled H: the baseline the recipe is measured against.

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

from .awq import awq_search, fold_into_norm, fold_into_up
from .calib import CalibrationSet
from .clip import quantize_rtn_clipped
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


def _scaled_h(H: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """H of the inputs x / s: H / (s s^T). H f32 [K, K], s f32 [K]."""
    return H / s[:, None] / s[None, :]


def _gptq_layer(i: int, source: Source, x: torch.Tensor, h: torch.Tensor, chunks: list[_Chunk],
                inv_freq: torch.Tensor, opts: PackOptions, dev: torch.device,
                progress: Progress) -> LayerCheckpoint:
    """Layer i, true-sequential (module docstring). x, h f32 [S*T, hidden]: x is updated in place to
    the layer's quantized output, h is scratch. Returns the layer's quantized linears (CPU), its folded
    norms (AWQ; CPU f32, bf16-exact), errors and notes."""
    cfg = source.config
    n_layers, eps = cfg.num_hidden_layers, cfg.rms_norm_eps
    f = {k: v.to(dev).float() for k, v in source.layer(i).items()}
    wq: dict[str, torch.Tensor] = {}  # dequantized f32 weights of the finished stages
    res: dict[str, QuantResult] = {}
    errs: dict[str, dict] = {}
    notes: list[str] = []
    G, sym = opts.group_size, opts.symmetric

    def rtn_dq(w: torch.Tensor) -> torch.Tensor:
        return quantize_rtn(w, G, sym).dequantize()

    def awq_stage(name: str, acc: HessianAccumulator) -> torch.Tensor:
        """Search AWQ's scale for `name` on acc's H; returns s f32 [K] and records alpha and losses."""
        progress(f"layer {i} awq {name}", i, n_layers)
        sc = awq_search(f[name], acc.H, acc.abs_mean, rtn_dq)
        errs.setdefault(name, {}).update({"awq_alpha": sc.alpha, "awq_rel_plain": sc.loss_plain,
                                          "awq_rel": sc.loss})
        return sc.s

    def fold_norm(norm: str, name: str, s: torch.Tensor, acc: HessianAccumulator) -> None:
        f[norm], f[name], s_eff = fold_into_norm(f[norm], f[name], s)
        acc.H = _scaled_h(acc.H, s_eff)

    def quantize_stage(name: str, acc: HessianAccumulator, rtn_ref: float) -> None:
        progress(f"layer {i} {opts.method} {name}", i, n_layers)
        if opts.method == "gptq":
            g = gptq_quantize(f[name], acc.H, opts.gptq)
            quant = g.quant
            extra = {"damp": g.damp_used, "dead_columns": g.dead_columns}
            notes.extend(f"layer {i} {name}: {m}" for m in g.notes)
        elif opts.clip:
            quant = quantize_rtn_clipped(f[name], G, sym, torch.diag(acc.H) if opts.clip_act else None)
            extra = {}
        else:
            quant = quantize_rtn(f[name], G, sym)
            extra = {}
        dq = quant.dequantize()
        errs.setdefault(name, {}).update({"w_rel": weight_rel_err(f[name], dq),
                                          "out_rel": output_rel_err(f[name], dq, acc.H),
                                          "rtn_out_rel": rtn_ref, **extra})
        res[name] = quant.cpu()
        wq[name] = dq
        del acc.H

    def rtn_out_rel(name: str, acc: HessianAccumulator) -> float:
        """Plain RTN of the unscaled weight on the unscaled H (before any AWQ fold)."""
        return output_rel_err(f[name], rtn_dq(f[name]), acc.H)

    def attn(c: _Chunk) -> torch.Tensor:
        xn = fwd.rms_norm(x[c.rows], f["input_norm"], eps)
        w = {"qkv": wq["qkv"], "qkv_bias": f["qkv_bias"]}
        return fwd.attention_input(cfg, xn, w, c.positions, inv_freq, c.attend, i)

    def mlp(c: _Chunk, gate_up: torch.Tensor) -> torch.Tensor:
        return fwd.mlp_input(cfg, fwd.rms_norm(h[c.rows], f["post_attn_norm"], eps), gate_up)

    # 1. qkv: inputs are rms_norm(x)
    progress(f"layer {i} hessian qkv", i, n_layers)
    acc = HessianAccumulator(cfg.hidden_size, dev)
    for c in chunks:
        acc.add(fwd.rms_norm(x[c.rows], f["input_norm"], eps))
    ref = rtn_out_rel("qkv", acc)
    if opts.awq:
        fold_norm("input_norm", "qkv", awq_stage("qkv", acc), acc)
    quantize_stage("qkv", acc, ref)
    # 2. o_proj: inputs are the attention outputs computed with the quantized qkv
    progress(f"layer {i} hessian o_proj", i, n_layers)
    acc = HessianAccumulator(cfg.q_dim, dev)
    for c in chunks:
        acc.add(attn(c))
    quantize_stage("o_proj", acc, rtn_out_rel("o_proj", acc))
    # 3. gate_up: inputs are rms_norm(h), h = x + o_q(attn_q)
    progress(f"layer {i} hessian gate_up", i, n_layers)
    acc = HessianAccumulator(cfg.hidden_size, dev)
    for c in chunks:
        h[c.rows] = x[c.rows] + fwd.linear(attn(c), wq["o_proj"])
        acc.add(fwd.rms_norm(h[c.rows], f["post_attn_norm"], eps))
    ref = rtn_out_rel("gate_up", acc)
    if opts.awq:
        fold_norm("post_attn_norm", "gate_up", awq_stage("gate_up", acc), acc)
        # down's scale, from the inputs of the float (scaled) gate_up: its up rows take the scale
        progress(f"layer {i} hessian down (float gate_up)", i, n_layers)
        acc_d = HessianAccumulator(cfg.intermediate_size, dev)
        for c in chunks:
            acc_d.add(mlp(c, f["gate_up"]))
        s_down = awq_stage("down", acc_d)
        del acc_d
        f["gate_up"], f["down"] = fold_into_up(f["gate_up"], f["down"], s_down, cfg.intermediate_size)
    quantize_stage("gate_up", acc, ref)
    # 4. down: inputs are silu(gate) * up with the quantized gate_up (its up rows already scaled)
    progress(f"layer {i} hessian down", i, n_layers)
    acc = HessianAccumulator(cfg.intermediate_size, dev)
    for c in chunks:
        acc.add(mlp(c, wq["gate_up"]))
    if opts.awq:
        # plain RTN of the unscaled weight (down / s) on the unscaled inputs (x s: H s s^T)
        w0 = f["down"] / s_down
        ref = output_rel_err(w0, rtn_dq(w0), acc.H * s_down[:, None] * s_down[None, :])
        del w0
    else:
        ref = rtn_out_rel("down", acc)
    quantize_stage("down", acc, ref)
    # 5. the next layer's inputs, from the fully quantized layer
    progress(f"layer {i} forward", i, n_layers)
    for c in chunks:
        x[c.rows] = h[c.rows] + fwd.linear(mlp(c, wq["gate_up"]), wq["down"])
    norms = {n: f[n].cpu() for n in ("input_norm", "post_attn_norm")} if opts.awq else {}
    return LayerCheckpoint(res, errs, notes, norms)
