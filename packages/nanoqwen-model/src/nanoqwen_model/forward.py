"""The Qwen2 forward in plain torch: the one model definition that nanoqwen computes with.

Used by the reference runtime (paged decoding, the oracle of the CUDA engine), by GPTQ calibration
and perplexity evaluation in nanoqwen-quant, and by the kernels' references (RMSNorm, RoPE,
attention). HF transformers' `Qwen2ForCausalLM` is its oracle (tests/test_forward.py).

Tokens are one flat batch: `T` tokens from one or several sequences, each with its absolute
position. Only attention needs to know which tokens belong together, so the forward takes it as a
callable, `attend(layer, q, k, v) -> o`, as gpt-fast takes its KV cache:

    dense_attend(batch, seq_len)   B whole sequences of seq_len tokens (calibration, perplexity)
    (a paged cache)                the reference runtime writes k/v to its pages and reads the context

One layer, split where GPTQ needs the input of each projection (`decoder_layer` composes them):

    xn = rms_norm(h, input_norm)                                   input of qkv
    a  = attend(rope(q), rope(k), v) of qkv = xn @ W_qkv^T + b    input of o_proj    f32 [T, Hq*D]
    h  = h + a @ W_o^T
    hn = rms_norm(h, post_attn_norm)                               input of gate_up
    m  = silu(gate) * up of hn @ W_gate_up^T                       input of down      f32 [T, I]
    h  = h + m @ W_down^T

Numerics: the residual stream, norms, RoPE (fp32 angle = fp32(position) * inv_freq, HF's form) and
attention (fp32 scores, softmax and accumulation, scale 1/sqrt(D)) are fp32. A linear computes in
its weight's dtype (bf16 weights: bf16 matmul, as HF in bf16; fp32 weights: fp32) and returns fp32.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F

from .config import Qwen2Config

__all__ = [
    "Attend", "rms_norm", "rope_inv_freq", "apply_rope", "causal_attention", "dense_attend", "linear",
    "attention_input", "mlp_input", "decoder_layer", "forward", "logits", "token_nll", "layer_weights",
]

# attend(layer, q f32 [T, Hq, D] roped, k f32 [T, Hkv, D] roped, v f32 [T, Hkv, D]) -> f32 [T, Hq*D]
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
LAYER_TENSORS = ("input_norm", "qkv", "qkv_bias", "o_proj", "post_attn_norm", "gate_up", "down")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H] (any float dtype), weight [H] -> f32 [..., H] = x / rms(x) * weight, in fp32."""
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def rope_inv_freq(head_dim: int, theta: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """f32 [head_dim / 2]: theta^(-2i / head_dim), computed as HF's Qwen2 rotary embedding does (fp32,
    on the CPU, then moved), so every user rotates by bit-identical frequencies."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return (1.0 / (theta**exponent)).to(device)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Qwen2 RoPE (non-interleaved, HF `rotate_half`). x [T, heads, D] -> f32 [T, heads, D].

    angle[t, i] = f32(positions[t]) * inv_freq[i]; out[..., i] = x_i cos - x_{i+D/2} sin and
    out[..., i+D/2] = x_{i+D/2} cos + x_i sin, for i < D/2."""
    xf = x.float()
    angle = positions.to(xf.device).float()[:, None] * inv_freq.to(xf.device)[None, :]  # [T, D/2]
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
    half = xf.shape[-1] // 2
    a, b = xf[..., :half], xf[..., half:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     q_positions: torch.Tensor) -> torch.Tensor:
    """GQA attention of one sequence over its context, in fp32.

    q [Tq, Hq, D] at absolute positions `q_positions` [Tq]; k, v [Tk, Hkv, D] are the sequence's
    tokens 0..Tk-1. Query t sees keys at positions <= q_positions[t]. Query head h reads KV head
    h // (Hq / Hkv). Returns f32 [Tq, Hq * D]."""
    tq, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    qh = q.float().view(tq, hkv, g, d).permute(1, 2, 0, 3)  # [Hkv, g, Tq, D]
    kh = k.float().permute(1, 0, 2)                          # [Hkv, Tk, D]
    vh = v.float().permute(1, 0, 2)
    scores = torch.matmul(qh, kh.unsqueeze(1).transpose(-1, -2)) * (1.0 / math.sqrt(d))  # [Hkv,g,Tq,Tk]
    kpos = torch.arange(k.shape[0], device=q.device)
    future = kpos[None, :] > q_positions.to(q.device).long()[:, None]  # [Tq, Tk]
    scores = scores.masked_fill(future, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), vh.unsqueeze(1))  # [Hkv, g, Tq, D]
    return out.permute(2, 0, 1, 3).reshape(tq, hq * d)


def dense_attend(batch: int, seq_len: int) -> Attend:
    """`attend` for `batch` whole sequences of `seq_len` tokens each, flattened sequence after
    sequence (positions 0..seq_len-1 in each): plain causal attention, no cache."""
    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(seq_len, device=q.device)
        rows = [causal_attention(q[s:s + seq_len], k[s:s + seq_len], v[s:s + seq_len], pos)
                for s in range(0, batch * seq_len, seq_len)]
        return torch.cat(rows, dim=0)

    return attend


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ w [N, K]^T (+ bias [N]) computed in w's dtype -> f32 [..., N]."""
    b = None if bias is None else bias.to(w.dtype)
    return F.linear(x.to(w.dtype), w, b).float()


def attention_input(cfg: Qwen2Config, xn: torch.Tensor, w: Mapping[str, torch.Tensor],
                    positions: torch.Tensor, inv_freq: torch.Tensor, attend: Attend,
                    layer: int) -> torch.Tensor:
    """The attention of one layer up to o_proj. xn f32 [T, H] (normed) -> f32 [T, Hq*D]."""
    t = xn.shape[0]
    qkv = linear(xn, w["qkv"], w["qkv_bias"])
    q, k, v = qkv.split([cfg.q_dim, cfg.kv_dim, cfg.kv_dim], dim=-1)
    q = apply_rope(q.reshape(t, cfg.num_attention_heads, cfg.head_dim), positions, inv_freq)
    k = apply_rope(k.reshape(t, cfg.num_key_value_heads, cfg.head_dim), positions, inv_freq)
    return attend(layer, q, k, v.reshape(t, cfg.num_key_value_heads, cfg.head_dim))


def mlp_input(cfg: Qwen2Config, hn: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """hn f32 [T, H], gate_up [2I, H] (rows gate, then up) -> silu(gate) * up, f32 [T, I]."""
    gu = linear(hn, gate_up)
    gate, up = gu.split(cfg.intermediate_size, dim=-1)
    return F.silu(gate) * up


def decoder_layer(cfg: Qwen2Config, h: torch.Tensor, w: Mapping[str, torch.Tensor], positions: torch.Tensor,
                  inv_freq: torch.Tensor, attend: Attend, layer: int) -> torch.Tensor:
    """One decoder layer. h f32 [T, H] residual stream; w: the layer's tensors by their container name
    without the `layers.{i}.` prefix (LAYER_TENSORS). Returns the new f32 [T, H] residual stream."""
    eps = cfg.rms_norm_eps
    a = attention_input(cfg, rms_norm(h, w["input_norm"], eps), w, positions, inv_freq, attend, layer)
    h = h + linear(a, w["o_proj"])
    m = mlp_input(cfg, rms_norm(h, w["post_attn_norm"], eps), w["gate_up"])
    return h + linear(m, w["down"])


def layer_weights(weights: Mapping[str, torch.Tensor], layer: int) -> dict[str, torch.Tensor]:
    """The tensors of layer `layer` out of a whole-model map of container names."""
    return {name: weights[f"layers.{layer}.{name}"] for name in LAYER_TENSORS}


def logits(cfg: Qwen2Config, weights: Mapping[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
    """Final norm and lm_head (the embeddings when tied): h f32 [R, H] -> f32 [R, V]."""
    head = weights["lm_head"] if "lm_head" in weights else weights["embed_tokens"]
    return linear(rms_norm(h, weights["final_norm"], cfg.rms_norm_eps), head)


def forward(cfg: Qwen2Config, weights: Mapping[str, torch.Tensor], tokens: torch.Tensor,
            positions: torch.Tensor, attend: Attend, rows: torch.Tensor | None = None,
            inv_freq: torch.Tensor | None = None) -> torch.Tensor:
    """The whole model on a flat token batch.

    weights: container names (docs/DESIGN.md) -> tensors, matrices in the dtype to compute in, already
    dequantized; tokens int [T]; positions int [T]; rows: which tokens' logits to return (None: all).
    Returns f32 logits [len(rows) or T, V]."""
    if inv_freq is None:
        inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta)
    emb = weights["embed_tokens"]
    h = emb[tokens.to(emb.device).long()].float()
    positions = positions.to(h.device)
    for i in range(cfg.num_hidden_layers):
        h = decoder_layer(cfg, h, layer_weights(weights, i), positions, inv_freq, attend, i)
    if rows is not None:
        h = h[rows.to(h.device).long()]
    return logits(cfg, weights, h)


def token_nll(cfg: Qwen2Config, weights: Mapping[str, torch.Tensor], hidden: torch.Tensor,
              targets: torch.Tensor, chunk: int = 512) -> torch.Tensor:
    """Negative log-likelihood of each target. hidden f32 [T, H] (the last layer's output), targets
    long [T] (the token that follows each position) -> f32 [T]. Logits are built `chunk` rows at a
    time, so a [T, V] matrix never exists at once."""
    out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    tg = targets.to(hidden.device)
    for s in range(0, hidden.shape[0], chunk):
        lg = logits(cfg, weights, hidden[s:s + chunk])
        out[s:s + chunk] = F.cross_entropy(lg, tg[s:s + chunk], reduction="none")
    return out
