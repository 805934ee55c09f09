"""A small plain-torch dense Qwen2 forward, one decoder layer at a time, for calibration and perplexity.

Not paged and not fast: it exists so that GPTQ can compute each layer's inputs from the previous,
already-quantized layer, and so that `eval` can score a container without the runtime. All math is
fp32 on whatever device the tensors are on (weights are bf16 values widened to fp32).

Shapes: hidden states `x` are f32 [B, T, hidden] (B sequences of T tokens, positions 0..T-1, causal).
The layer is split at the points where GPTQ needs the input of the next projection:

    xn   = rms_norm(x, input_norm)                              -> input of qkv
    a    = attention(xn @ qkv.T + qkv_bias)                     -> input of o_proj   [B, T, nq*d]
    h    = x + a @ o_proj.T
    hn   = rms_norm(h, post_attn_norm)                          -> input of gate_up
    m    = silu(hn @ gate.T) * (hn @ up.T)                      -> input of down     [B, T, I]
    out  = h + m @ down.T

RoPE is Qwen2's (HF `rotate_half`, non-interleaved, cos/sin in fp32); attention is GQA with softmax
scale 1/sqrt(head_dim), via `torch.nn.functional.scaled_dot_product_attention`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import Qwen2Config


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x f32 [..., h], weight [h] -> f32 [..., h]."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def rope_cos_sin(seq_len: int, head_dim: int, theta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin f32 [T, head_dim] for positions 0..T-1 (halves repeated, HF layout)."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim)
    ang = torch.arange(seq_len, dtype=torch.float64, device=device)[:, None] * inv_freq[None, :]
    ang = torch.cat([ang, ang], -1)
    return ang.cos().float(), ang.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x f32 [B, H, T, d]; out[i] = x[i] cos - x[i+d/2] sin, out[i+d/2] = x[i+d/2] cos + x[i] sin."""
    d = x.shape[-1] // 2
    rot = torch.cat([-x[..., d:], x[..., :d]], -1)
    return x * cos + rot * sin


def attention_input(cfg: Qwen2Config, xn: torch.Tensor, qkv: torch.Tensor, qkv_bias: torch.Tensor,
                    rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Causal GQA self-attention. xn f32 [B, T, h], qkv f32 [(nq+2nkv)*d, h] -> f32 [B, T, nq*d]."""
    B, T, _ = xn.shape
    d, nq, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    y = torch.addmm(qkv_bias.float(), xn.reshape(B * T, -1), qkv.t()).view(B, T, -1)
    q, k, v = y.split([nq * d, nkv * d, nkv * d], -1)
    q = q.view(B, T, nq, d).transpose(1, 2)
    k = k.view(B, T, nkv, d).transpose(1, 2)
    v = v.reshape(B, T, nkv, d).transpose(1, 2)
    cos, sin = rope[0][:T], rope[1][:T]
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if nq != nkv:
        k = k.repeat_interleave(nq // nkv, 1)
        v = v.repeat_interleave(nq // nkv, 1)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=d ** -0.5)
    return o.transpose(1, 2).reshape(B, T, nq * d)


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x f32 [..., K], w f32 [N, K] -> f32 [..., N]."""
    return (x.reshape(-1, x.shape[-1]) @ w.t()).view(*x.shape[:-1], w.shape[0])


def mlp_input(cfg: Qwen2Config, hn: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """hn f32 [B, T, h], gate_up f32 [2I, h] -> silu(gate) * up, f32 [B, T, I]."""
    gu = linear(hn, gate_up)
    g, u = gu.split(cfg.intermediate_size, -1)
    return F.silu(g) * u


def decoder_layer(cfg: Qwen2Config, x: torch.Tensor, w: dict[str, torch.Tensor],
                  rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """One full decoder layer. x f32 [B, T, h]; w: the container tensors of the layer (any float dtype)."""
    f = {k: v.float() for k, v in w.items()}
    xn = rms_norm(x, f["input_norm"], cfg.rms_norm_eps)
    h = x + linear(attention_input(cfg, xn, f["qkv"], f["qkv_bias"], rope), f["o_proj"])
    hn = rms_norm(h, f["post_attn_norm"], cfg.rms_norm_eps)
    return h + linear(mlp_input(cfg, hn, f["gate_up"]), f["down"])


def token_nll(hidden: torch.Tensor, final_norm: torch.Tensor, lm_head: torch.Tensor, targets: torch.Tensor,
              eps: float, chunk: int = 512) -> torch.Tensor:
    """Negative log-likelihood of each target. hidden f32 [B, T, h], lm_head [V, h], targets long [B, T]
    (the token that follows each position) -> f32 [B, T]. Logits are built `chunk` rows at a time."""
    hn = rms_norm(hidden, final_norm, eps).reshape(-1, hidden.shape[-1])
    tg = targets.reshape(-1)
    w = lm_head.float()
    out = torch.empty(hn.shape[0], dtype=torch.float32, device=hidden.device)
    for s in range(0, hn.shape[0], chunk):
        logits = hn[s:s + chunk] @ w.t()
        out[s:s + chunk] = F.cross_entropy(logits, tg[s:s + chunk], reduction="none")
    return out.view(targets.shape)
