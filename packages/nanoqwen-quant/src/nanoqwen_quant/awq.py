"""AWQ-style activation-aware scaling (Lin et al. 2023), folded so the container stays a plain Qwen2.

A linear y = x W^T with input channels of very different magnitude loses most to INT4 in the columns
that meet large activations. Scaling column k of W by s_k and the input channel k by 1/s_k leaves y
unchanged in exact arithmetic but moves quantization error away from those columns. As AutoAWQ:

    s = mean|x|^alpha,  normalised by sqrt(max(s) * min(s));  alpha in 0, 0.05, ..., 1 (alpha = 0: s = 1)
    loss(alpha) = tr(E H E^T),  E = W - Q(W diag(s)) diag(s)^-1,  H = 2/n sum x x^T (the GPTQ Hessian)

i.e. the output MSE over every calibration token (AutoAWQ samples a batch; H makes it exact and costs
one [N, K] x [K, K] product per alpha). Q is plain RTN on the recipe's grid (as AutoAWQ's search);
the recipe's final quantizer (RTN+clip or GPTQ) then runs on the scaled weight. alpha = 0 is tried first
and kept unless another alpha is strictly better, so the search never raises the loss it measures.

Where 1/s goes (no new runtime op):
    qkv      <- input_norm:      norm' = bf16(norm / s); s_eff = norm / norm' (the container's norm is
    gate_up  <- post_attn_norm:  bf16, so the weights take s_eff: norm' * (W s_eff) = norm * W exactly)
    down     <- the up rows of gate_up: up' = up / s (both sides are quantized later, no bf16 step)
    o_proj   <- v rows of qkv: not done. With GQA one v channel feeds num_heads / num_kv_heads o_proj
                columns, so the scale would have to be tied across them; AutoAWQ skips this pair when
                the shapes differ and so do we (o_proj gets the clip search only).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["AWQ_ALPHAS", "AWQScale", "awq_search", "fold_into_norm", "fold_into_up"]

AWQ_ALPHAS = tuple(i / 20 for i in range(21))  # AutoAWQ's n_grid = 20


@dataclass
class AWQScale:
    """The chosen per-input-channel scale s f32 [K] (> 0), its alpha, and the relative output error
    tr(E H E^T) / tr(W H W^T) at alpha = 0 (plain) and at the chosen alpha."""

    s: torch.Tensor
    alpha: float
    loss_plain: float
    loss: float


def _scale(abs_mean: torch.Tensor, alpha: float) -> torch.Tensor:
    s = abs_mean.float().clamp(min=1e-4).pow(alpha)
    return s / (s.max() * s.min()).sqrt()


def awq_search(w: torch.Tensor, H: torch.Tensor, abs_mean: torch.Tensor,
               dequant: Callable[[torch.Tensor], torch.Tensor],
               alphas: tuple[float, ...] = AWQ_ALPHAS) -> AWQScale:
    """Grid-search alpha for one linear. w f32 [N, K], H f32 [K, K], abs_mean f32 [K] (mean |x| per
    input channel), dequant(W) -> f32 [N, K] (quantize and dequantize, the search's quantizer)."""
    if not alphas or alphas[0] != 0.0:
        raise ValueError(f"AWQ alphas must start with 0 (no scaling), got {alphas}")
    k = w.shape[1]
    if H.shape != (k, k) or abs_mean.shape != (k,):
        raise ValueError(f"H must be [{k}, {k}] and abs_mean [{k}], got {list(H.shape)}, "
                         f"{list(abs_mean.shape)}")
    best = None
    den = max(float(((w @ H) * w).sum()), 1e-30)
    for a in alphas:
        s = torch.ones(k, dtype=torch.float32, device=w.device) if a == 0 else _scale(abs_mean, a)
        e = w - dequant(w * s) / s
        loss = float(((e @ H) * e).sum()) / den  # metrics.output_rel_err, its denominator computed once
        if best is None:
            best = AWQScale(s, a, loss, loss)
        elif loss < best.loss:
            best = AWQScale(s, a, best.loss_plain, loss)
    return best


def fold_into_norm(norm: torch.Tensor, w: torch.Tensor,
                   s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fold 1/s into an RMSNorm weight that the container stores in bf16.

    norm f32 [K] (bf16-exact), w f32 [N, K] (the linear fed by the norm), s f32 [K] > 0. Returns
    (norm' f32 [K] bf16-exact, w' f32 [N, K] = w * s_eff, s_eff f32 [K]) with norm' * s_eff = norm, so
    rms_norm(x, norm') @ w'^T = rms_norm(x, norm) @ w^T up to fp32 rounding. Channels whose norm is 0 or
    whose norm / s would leave bf16's range keep s_eff = 1."""
    new = (norm / s).to(torch.bfloat16).float()
    ok = (norm != 0) & (new != 0) & torch.isfinite(new)
    new = torch.where(ok, new, norm)
    s_eff = torch.where(ok, norm / new, torch.ones_like(norm))
    return new, w * s_eff, s_eff


def fold_into_up(gate_up: torch.Tensor, down: torch.Tensor, s: torch.Tensor,
                 intermediate: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold down's input scale into the up rows of the fused gate_up: silu(gate) * (up / s) @ (down s)^T
    equals silu(gate) * up @ down^T. gate_up f32 [2I, H] (gate rows, then up rows), down f32 [H, I],
    s f32 [I] > 0 -> (gate_up', down')."""
    if gate_up.shape[0] != 2 * intermediate or down.shape[1] != intermediate or s.shape != (intermediate,):
        raise ValueError(f"gate_up [2*{intermediate}, H], down [H, {intermediate}] and s [{intermediate}] "
                         f"expected, got {list(gate_up.shape)}, {list(down.shape)}, {list(s.shape)}")
    gu = gate_up.clone()
    gu[intermediate:] /= s[:, None]
    return gu, down * s
