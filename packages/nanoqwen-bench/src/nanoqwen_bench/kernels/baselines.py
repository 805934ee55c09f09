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

__all__ = ["TinyGemmWeight", "random_tinygemm_weight", "tinygemm_copies", "tinygemm_mm", "check_tinygemm",
           "GemliteWeight", "gemlite_missing", "gemlite_tuned", "gemlite_plan", "random_gemlite_weight",
           "gemlite_copies", "gemlite_mm", "check_gemlite"]


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


def _check_product(what: str, got: torch.Tensor, x: torch.Tensor, dense: torch.Tensor) -> None:
    """got (bf16 [M, N]) against x.float() @ dense^T (dense: the dequantized weight, fp32 [N, K]): within
    2^-7 of the largest output (the kernels' accumulation order and the bf16 output's rounding)."""
    ref = x.float() @ dense.t()
    err = float((got.float() - ref).abs().max())
    bound = float(ref.abs().max()) * 2**-7
    if not err <= bound:
        raise AssertionError(f"{what} at M={x.shape[0]}: max error {err:.3g} > {bound:.3g}")


def check_tinygemm(w: TinyGemmWeight, m: int, gen: torch.Generator) -> None:
    """tinygemm's product against the fp32 product of the dequantized weight (w made with keep_values)."""
    x = torch.randn(m, w.k, generator=gen, device="cuda").to(torch.bfloat16)
    scale = w.scales_and_zeros[..., 0].float().repeat_interleave(w.group_size, dim=0).t()  # [N, K]
    _check_product(f"tinygemm [{w.n}, {w.k}]", tinygemm_mm(x, w), x, (w.q.float() - 8) * scale)


def _checked_copies(make, check, total_bytes: int, check_ms) -> list:
    """At least two weights from make(keep_values), together at least `total_bytes` (so that a timed loop
    over them reads from HBM, not L2); the first is made with its values kept, checked at each M of
    `check_ms` (check(w, m): each M may run another kernel), then its values are dropped."""
    first = make(True)
    for m in check_ms:
        check(first, m)
    first.q = None
    count = max(2, math.ceil(total_bytes / first.nbytes()))
    return [first] + [make(False) for _ in range(count - 1)]


def tinygemm_copies(n: int, k: int, gen: torch.Generator, total_bytes: int, check_ms=(1,)
                    ) -> list[TinyGemmWeight]:
    """Random [N, K] tinygemm weights for a timed loop (`_checked_copies`)."""
    return _checked_copies(lambda keep: random_tinygemm_weight(n, k, gen, keep_values=keep),
                           lambda w, m: check_tinygemm(w, m, gen), total_bytes, check_ms)


@dataclass
class GemliteWeight:
    """An [N, K] INT4 weight as a packed `gemlite.GemLiteLinear`, and, kept for the check, its int4
    values `q` (uint8 [N, K]) and bf16 scales [N, K / group_size] (zero point 8)."""

    linear: torch.nn.Module
    q: torch.Tensor | None
    scales: torch.Tensor | None
    n: int
    k: int
    group_size: int = 128

    def nbytes(self) -> int:
        """Bytes a product reads from the weight: the packed values, the scales and the zeros."""
        parts = (self.linear.W_q, self.linear.scales, self.linear.zeros)
        return sum(t.numel() * t.element_size() for t in parts)


def gemlite_missing() -> str | None:
    """Why gemlite cannot be timed here (not installed, or failing at import), or None."""
    try:
        import gemlite  # noqa: F401
    except Exception as e:  # its import queries the GPU and compiles nothing: any failure is the reason
        return f"gemlite not importable: {type(e).__name__}: {e}"
    return None


def gemlite_tuned(n: int, k: int, m: int, group_size: int = 128) -> bool:
    """Whether gemlite ships a tuned config for this GPU and a bf16 A16W4 [N, K] product at M rows (else
    its first call runs its autotune: tens of seconds per shape and M)."""
    from gemlite import core
    from gemlite.triton_kernels.utils import get_closest_m

    # the key of gemlite's config cache: (M class, N, K, group, values per 32-bit word, fp16/bf16 W4 type)
    key = str((get_closest_m(m), n, k, group_size, 8, 104))
    return key in core.GEMLITE_TRITON_CONFIG_CACHE.get(core.get_matmul_type(m, 4), {})


def gemlite_plan(n: int, k: int, ms, autotune: bool = False) -> tuple[list[int], str | None]:
    """The M values (of `ms`) at which the benches time gemlite at an [N, K] shape, and why the others
    are not timed (None when all are): where it ships a tuned config for the GPU, or every M with
    `autotune` (its autotune then runs in the warm-up); none where it is not importable."""
    missing = gemlite_missing()
    if missing:
        return [], missing
    timed = [m for m in ms if autotune or gemlite_tuned(n, k, m)]
    why = None if len(timed) == len(ms) else \
        "gemlite ships no tuned config for this GPU and shape (--gemlite-autotune: tune it)"
    return timed, why


def random_gemlite_weight(n: int, k: int, gen: torch.Generator, group_size: int = 128,
                          keep_values: bool = False) -> GemliteWeight:
    """A random [N, K] INT4 weight (zero point 8) packed by gemlite, on cuda."""
    import gemlite

    q = torch.randint(0, 16, (n, k), generator=gen, device="cuda", dtype=torch.uint8)
    scales = ((0.5 + torch.rand(n, k // group_size, generator=gen, device="cuda")) / (4.6 * k**0.5)
              ).to(torch.bfloat16)  # fmt: skip
    # fp32 output: with bf16 output gemlite's split-K kernels add their partial sums atomically in bf16
    # (max error 2^-4.7 of the largest output at M = 1 on an H100, 2^-6.5 at M = 8; fp32: 2^-9.6)
    linear = gemlite.GemLiteLinear(4, group_size=group_size, in_features=k, out_features=n,
                                   input_dtype=gemlite.DType.BF16, output_dtype=gemlite.DType.FP32)
    linear.pack(q, scales, torch.full_like(scales, 8.0), bias=None)
    kept = (q, scales) if keep_values else (None, None)
    return GemliteWeight(linear, *kept, n, k, group_size)


def gemlite_mm(x: torch.Tensor, w: GemliteWeight) -> torch.Tensor:
    """y (fp32 [M, N]) = x (bf16 [M, K]) @ dequant(w)^T."""
    return w.linear(x)


def check_gemlite(w: GemliteWeight, m: int, gen: torch.Generator) -> None:
    """gemlite's product against the fp32 product of the dequantized weight (w made with keep_values)."""
    x = torch.randn(m, w.k, generator=gen, device="cuda").to(torch.bfloat16)
    dense = (w.q.float() - 8) * w.scales.float().repeat_interleave(w.group_size, dim=1)
    _check_product(f"gemlite [{w.n}, {w.k}]", gemlite_mm(x, w), x, dense)


def gemlite_copies(n: int, k: int, gen: torch.Generator, total_bytes: int, check_ms=(1,)
                   ) -> list[GemliteWeight]:
    """Random [N, K] gemlite weights for a timed loop (`_checked_copies`)."""
    copies = _checked_copies(lambda keep: random_gemlite_weight(n, k, gen, keep_values=keep),
                             lambda w, m: check_gemlite(w, m, gen), total_bytes, check_ms)
    copies[0].scales = None
    return copies
