"""The INT4 group grid and round-to-nearest quantization in torch; `QuantResult`, a quantized weight.

Grid (identical to `nanoqwen_format.int4.quantize_rtn`, which a test checks bit for bit): groups of
G consecutive input columns of one output row share a bf16 scale `s` and a zero point `z`.

    symmetric:  s = absmax / 7.5,             z = 8                    (GPTQ's symmetric mode)
    asymmetric: s = (max(w,0) - min(w,0))/15, z = round(-min(w,0)/s)   in 0..15
    s is rounded to bf16 first (an all-zero group gets s = 1), then q = clamp(round(w/s) + z, 0, 15)
    and the dequantized weight is (q - z) * s.

GPTQ (`gptq.py`) uses the same grid (`group_params`, `quantize_columns`) column by column.
"""

from __future__ import annotations

from dataclasses import dataclass

import nanoqwen_format as nqf
import numpy as np
import torch

__all__ = ["GROUP_SIZES", "QuantResult", "check_weight", "group_params", "quantize_columns", "quantize_rtn"]

GROUP_SIZES = (32, 64, 128)


@dataclass
class QuantResult:
    """A quantized weight [N, K]. q uint8 [N, K] in 0..15; scale f32 [N, K/G] (bf16-exact values);
    zero uint8 [N, K/G] or None (symmetric: implicit 8). All on the CPU after `.cpu()`."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    group_size: int

    @property
    def symmetric(self) -> bool:
        return self.zero is None

    def dequantize(self) -> torch.Tensor:
        """f32 [N, K]: (q - z) * s."""
        n, k = self.q.shape
        g = self.group_size
        z = 8.0 if self.zero is None else self.zero.float()[:, :, None]
        w = (self.q.view(n, k // g, g).float() - z) * self.scale[:, :, None]
        return w.view(n, k)

    def cpu(self) -> QuantResult:
        return QuantResult(self.q.cpu(), self.scale.cpu(), None if self.zero is None else self.zero.cpu(),
                           self.group_size)

    def to_nqf(self) -> nqf.QuantizedTensor:
        """The nanoqwen_format int4 QuantizedTensor (packs the tile8x128 layout)."""
        s_bits = self.scale.cpu().to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        zeros = None if self.zero is None else self.zero.cpu().numpy()
        return nqf.int4.pack(self.q.cpu().numpy(), s_bits, zeros, self.group_size)


def check_weight(w: torch.Tensor, group_size: int) -> None:
    """Raise ValueError unless w is a finite [N, K] matrix with K a multiple of a supported group size."""
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {group_size}")
    if w.ndim != 2 or w.shape[1] % group_size:
        raise ValueError(f"weight must be [N, K] with K % {group_size} == 0, got {list(w.shape)}")
    if not torch.isfinite(w).all():
        raise ValueError("weight has NaN or inf")


def group_params(w: torch.Tensor, group_size: int, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point per (row, group). w f32 [N, K] -> (s f32 [N, K/G], z f32 [N, K/G])."""
    n, k = w.shape
    wg = w.float().view(n, k // group_size, group_size)
    if symmetric:
        scale = wg.abs().amax(-1) / 7.5
    else:
        lo = wg.amin(-1).clamp(max=0)
        hi = wg.amax(-1).clamp(min=0)
        scale = (hi - lo) / 15.0
    one = torch.ones((), dtype=torch.float32, device=w.device)
    scale = torch.where(scale > 0, scale, one).to(torch.bfloat16).float()
    scale = torch.where(scale > 0, scale, one)  # a tiny scale could round to bf16 zero
    if symmetric:
        zero = torch.full_like(scale, 8.0)
    else:
        zero = torch.round(-lo / scale).clamp(0, 15)
    return scale, zero


def quantize_columns(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """q = clamp(round(w / s) + z, 0, 15) (f32, integer-valued); w [N, C], s and z broadcastable."""
    return (torch.round(w / scale) + zero).clamp(0, 15)


def quantize_rtn(w: torch.Tensor, group_size: int, symmetric: bool) -> QuantResult:
    """Round-to-nearest INT4. w float [N, K] (K % G == 0) on any device -> QuantResult on that device."""
    check_weight(w, group_size)
    n, k = w.shape
    s, z = group_params(w, group_size, symmetric)
    wg = w.float().view(n, k // group_size, group_size)
    q = quantize_columns(wg, s[:, :, None], z[:, :, None]).to(torch.uint8).view(n, k)
    return QuantResult(q, s, None if symmetric else z.to(torch.uint8), group_size)
