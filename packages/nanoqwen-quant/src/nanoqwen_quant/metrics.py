"""The quantization errors recorded per projection in a container's `quantization.layer_errors`.

    w_rel   = ||W - Q||_F / ||W||_F                    every method (and the int8/int4 lm_head)
    out_rel = tr(E H E^T) / tr(W H W^T),  E = W - Q    GPTQ: the relative output MSE on the
                                                       calibration inputs H was accumulated from,
                                                       the quantity GPTQ minimises
    rtn_out_rel: out_rel of RTN's Q on the same H, so GPTQ's gain is visible per projection.
"""

from __future__ import annotations

import torch

__all__ = ["weight_rel_err", "output_rel_err"]


def _ratio(num: torch.Tensor, den: torch.Tensor) -> float:
    return float(num) / max(float(den), 1e-30)


def weight_rel_err(w: torch.Tensor, dq: torch.Tensor) -> float:
    """||W - Q||_F / ||W||_F. w [N, K] any float dtype, dq f32 [N, K] on the same device."""
    w = w.float()
    return _ratio(torch.linalg.vector_norm(w - dq), torch.linalg.vector_norm(w))


def output_rel_err(w: torch.Tensor, dq: torch.Tensor, H: torch.Tensor) -> float:
    """tr(E H E^T) / tr(W H W^T), E = W - Q. w [N, K] any float dtype, dq f32 [N, K], H f32 [K, K]."""
    w = w.float()
    e = w - dq
    return _ratio(((e @ H) * e).sum(), ((w @ H) * w).sum())
