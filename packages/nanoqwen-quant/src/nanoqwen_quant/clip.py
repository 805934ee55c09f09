"""Clipping search: per INT4 group, the scale (and zero point) that minimises the reconstruction error.

Plain RTN (`rtn.group_params`) maps a group's full range onto the grid, so one outlier widens every
step of its group. As llama.cpp's `make_qx_quants` / `make_qkx2_quants` and AWQ's `auto_clip` do, we
try a grid of clip ratios r (1.00, 0.98, ..., 0.70) and keep, per group, the one with the smallest

    err(r) = sum_k c_k (w_k - dq_k(r))^2          c_k = 1 (plain) or E[x_k^2] = diag(H)_k (activation-
                                                  weighted: the output error of that column's input)

    symmetric:  s = bf16(r * absmax / 7.5),            z = 8
    asymmetric: s = bf16(r * (hi - lo) / 15),          z = round(-r * lo / s) in 0..15   (lo <= 0 <= hi)

then one least-squares refit of the scale for the chosen codes (s* = sum c (w)(q-z) / sum c (q-z)^2,
rounded to bf16), kept only where it lowers err further. r = 1 is tried first and a later candidate
replaces it only when strictly better, so the result is never worse than plain RTN on the objective
(a CI test checks it). The codes are those of `rtn.quantize_columns` with the chosen (s, z): the grid is
unchanged, only the scales differ, so the container format and the kernels need nothing new.
"""

from __future__ import annotations

import torch

from .rtn import QuantResult, check_weight, quantize_columns

__all__ = ["CLIP_RATIOS", "clip_group_params", "quantize_rtn_clipped"]

CLIP_RATIOS = tuple(round(1.0 - 0.02 * i, 2) for i in range(16))  # 1.00 .. 0.70 (AWQ's auto_clip: 1 .. 0.5)


def _bf16_scale(scale: torch.Tensor) -> torch.Tensor:
    """bf16-exact positive scales (as `rtn.group_params`: an all-zero group or a bf16 zero gets 1)."""
    one = torch.ones((), dtype=torch.float32, device=scale.device)
    scale = torch.where(scale > 0, scale, one).to(torch.bfloat16).float()
    return torch.where(scale > 0, scale, one)


def _params(lo: torch.Tensor, hi: torch.Tensor, amax: torch.Tensor, r: float,
            symmetric: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if symmetric:
        s = _bf16_scale(amax * r / 7.5)
        return s, torch.full_like(s, 8.0)
    s = _bf16_scale((hi - lo) * r / 15.0)
    return s, torch.round(-lo * r / s).clamp(0, 15)


def _group_err(wg: torch.Tensor, cg: torch.Tensor | None, s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """Weighted squared error per group. wg f32 [N, K/G, G], cg [K/G, G] or None, s/z [N, K/G].
    `rtn.quantize_columns` then (q - z) s - w, computed in place in one temporary."""
    s3, z3 = s[:, :, None], z[:, :, None]
    d = wg / s3
    d.round_().add_(z3).clamp_(0, 15).sub_(z3).mul_(s3).sub_(wg).square_()
    if cg is not None:
        d.mul_(cg)
    return d.sum(-1)


# Rows are searched in chunks of about this many weights: it bounds the search's temporaries (a few
# f32 copies of a chunk) on a 7B's gate_up / down; the time is the same as whole-matrix passes
# (measured on the 0.5B's gate_up on CPU: 5.1 s vs 5.3 s with in-place error passes, 30 s before them).
CHUNK_WEIGHTS = {"cpu": 1 << 20, "cuda": 1 << 25}


def clip_group_params(w: torch.Tensor, group_size: int, symmetric: bool,
                      col_weight: torch.Tensor | None = None,
                      ratios: tuple[float, ...] = CLIP_RATIOS) -> tuple[torch.Tensor, torch.Tensor]:
    """Clip-searched scale and zero per (row, group), the drop-in for `rtn.group_params`.

    w float [N, K] (K % group_size == 0); col_weight f32 [K] >= 0 (diag of the Hessian) or None for the
    plain weight error. Returns (s f32 [N, K/G] bf16-exact, z f32 [N, K/G] integer-valued)."""
    if not ratios or ratios[0] != 1.0:
        raise ValueError(f"clip ratios must start with 1.0 (plain RTN), got {ratios}")
    n, k = w.shape
    cg = None
    if col_weight is not None:
        if col_weight.shape != (k,):
            raise ValueError(f"col_weight must be [{k}], got {list(col_weight.shape)}")
        cg = col_weight.float().clamp(min=0).view(k // group_size, group_size)
    rows = max(1, CHUNK_WEIGHTS.get(w.device.type, 1 << 17) // k)
    parts = [_search_rows(w[r:r + rows].float().view(-1, k // group_size, group_size), cg, symmetric,
                          ratios) for r in range(0, n, rows)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def _search_rows(wg: torch.Tensor, cg: torch.Tensor | None, symmetric: bool,
                 ratios: tuple[float, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The search on a chunk of rows: wg f32 [n, K/G, G] -> (s, z) f32 [n, K/G]."""
    lo = wg.amin(-1).clamp(max=0)
    hi = wg.amax(-1).clamp(min=0)
    amax = wg.abs().amax(-1)
    best_s, best_z = _params(lo, hi, amax, ratios[0], symmetric)
    best = _group_err(wg, cg, best_s, best_z)
    for r in ratios[1:]:
        s, z = _params(lo, hi, amax, r, symmetric)
        e = _group_err(wg, cg, s, z)
        better = e < best
        best = torch.where(better, e, best)
        best_s = torch.where(better, s, best_s)
        best_z = torch.where(better, z, best_z)
    # least-squares refit of the scale for the chosen codes (zero point fixed)
    s3, z3 = best_s[:, :, None], best_z[:, :, None]
    c = quantize_columns(wg, s3, z3) - z3
    cw = c if cg is None else c * cg
    num = (cw * wg).sum(-1)
    den = (cw * c).sum(-1)
    refit = _bf16_scale(torch.where(den > 0, num / den.clamp(min=1e-30), best_s))
    e = _group_err(wg, cg, refit, best_z)
    better = e < best
    return torch.where(better, refit, best_s), best_z


def quantize_rtn_clipped(w: torch.Tensor, group_size: int, symmetric: bool,
                         col_weight: torch.Tensor | None = None) -> QuantResult:
    """RTN with clip-searched group parameters. w float [N, K] on any device -> QuantResult there;
    col_weight f32 [K] (diag H) or None (see `clip_group_params`)."""
    check_weight(w, group_size)
    n, k = w.shape
    s, z = clip_group_params(w, group_size, symmetric, col_weight)
    wg = w.float().view(n, k // group_size, group_size)
    q = quantize_columns(wg, s[:, :, None], z[:, :, None]).to(torch.uint8).view(n, k)
    return QuantResult(q, s, None if symmetric else z.to(torch.uint8), group_size)
