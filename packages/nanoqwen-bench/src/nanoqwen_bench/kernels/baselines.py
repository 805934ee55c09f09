"""Other INT4 kernels, timed beside nanoqwen's on the same shapes by the kernel benches.

- tinygemm: torch's built-in INT4 matmul (`torch._weight_int4pack_mm`; gpt-fast's and torchao's int4
  weight-only path), g128 with a bf16 scale and zero per group: w = (q - 8) * scale + zero. Its weight
  is repacked by `torch._convert_weight_to_int4pack` into the tiled layout the kernel reads (inner K tiles
  of 8), so it is timed on its own layout, as its users run it.

Weight values do not change the time. The weights here are random with zero = 0, so that the check
against the fp32 product of the dequantized weight does not depend on the zero's sign convention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["TinyGemmWeight", "random_tinygemm_weight", "tinygemm_copies", "tinygemm_mm", "check_tinygemm"]


@dataclass
class TinyGemmWeight:
    """An [N, K] INT4 weight in tinygemm's layout: `packed` (int32, tiled), `scales_and_zeros` (bf16
    [K / group_size, N, 2]), and the int4 values `q` (int32 [N, K], 0..15) kept for the check."""

    packed: torch.Tensor
    scales_and_zeros: torch.Tensor
    q: torch.Tensor | None
    n: int
    k: int
    group_size: int = 128

    def nbytes(self) -> int:
        """Bytes a product reads from the weight: the packed values, the scales and the zeros."""
        return self.packed.numel() * self.packed.element_size() + self.scales_and_zeros.numel() * 2


def random_tinygemm_weight(n: int, k: int, gen: torch.Generator, group_size: int = 128,
                           keep_values: bool = False) -> TinyGemmWeight:
    """A random [N, K] weight (K a multiple of 128) in tinygemm's layout, on cuda."""
    q = torch.randint(0, 16, (n, k), generator=gen, device="cuda", dtype=torch.int32)
    scales = ((0.5 + torch.rand(k // group_size, n, generator=gen, device="cuda")) / (4.6 * k**0.5))
    sz = torch.stack([scales, torch.zeros_like(scales)], dim=-1).to(torch.bfloat16).contiguous()
    pairs = ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8)
    packed = torch._convert_weight_to_int4pack(pairs, 8)
    return TinyGemmWeight(packed, sz, q if keep_values else None, n, k, group_size)


def tinygemm_mm(x: torch.Tensor, w: TinyGemmWeight) -> torch.Tensor:
    """y (bf16 [M, N]) = x (bf16 [M, K]) @ dequant(w)^T."""
    return torch._weight_int4pack_mm(x, w.packed, w.group_size, w.scales_and_zeros)


def check_tinygemm(w: TinyGemmWeight, m: int, gen: torch.Generator) -> None:
    """tinygemm's product against the fp32 product of the dequantized weight (w made with keep_values):
    within 2^-7 of the largest output (bf16 accumulation order and the output's rounding)."""
    x = torch.randn(m, w.k, generator=gen, device="cuda").to(torch.bfloat16)
    scale = w.scales_and_zeros[..., 0].float().repeat_interleave(w.group_size, dim=0).t()  # [N, K]
    dense = (w.q.float() - 8) * scale
    ref = x.float() @ dense.t()
    got = tinygemm_mm(x, w).float()
    err = float((got - ref).abs().max())
    bound = float(ref.abs().max()) * 2**-7
    if not err <= bound:
        raise AssertionError(f"tinygemm [{w.n}, {w.k}] at M={m}: max error {err:.3g} > {bound:.3g}")


def tinygemm_copies(n: int, k: int, gen: torch.Generator, total_bytes: int, check_m: int = 1
                    ) -> list[TinyGemmWeight]:
    """At least two random [N, K] tinygemm weights, together at least `total_bytes` (so that a timed
    loop over them reads from HBM, not L2); the first is checked (`check_tinygemm` at M = `check_m`)."""
    first = random_tinygemm_weight(n, k, gen, keep_values=True)
    check_tinygemm(first, check_m, gen)
    first.q = None
    count = max(2, math.ceil(total_bytes / first.nbytes()))
    return [first] + [random_tinygemm_weight(n, k, gen) for _ in range(count - 1)]
