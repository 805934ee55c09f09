"""The INT4 and INT8 weight encodings of docs/DESIGN.md, in torch: the one codec outside nanoqwen-format.

nanoqwen-format keeps the numpy reference (what the packer writes, what SPEC.md describes); this is
its torch twin for code that holds weights as tensors, on any device: the engine's torch backend, the
kernels' references, the synthetic models built on the GPU. tests/test_codec.py checks it against
the numpy reference bit for bit.

INT4 layout `int4-g{G}-tile8x128-v1`: words [N/8, K/128, 32, 4] (uint32 bits, held as int32 since
torch has no uint32 arithmetic). In tile (tile_row, tile_col), lane L = 4g + t, word w, nibble
p = 4h + j (bits 4p..4p+3) holds

    row 8 tile_row + g,   column 128 tile_col + 32 w + 8 j + 2 t + h

Dequantization: w[n, k] = (q[n, k] - z[n, k // G]) * f32(s[n, k // G]), z = 8 when symmetric.
The `int4-g{G}-tile8x128-f16s-v1` variant (imported GPTQ/AWQ checkpoints) has the same words with
fp16 scales (torch.float16) and zero points 0..16: `dequantize_int4` takes either scale dtype and
widens it exactly, so the product is exact in f32 for both (|q - z| <= 16 times an 11-bit significand).
INT8 layout `int8-g{G}-rowmajor-v1`: q int8 [N, K], w = q * f32(s[n, k // G]).
"""

from __future__ import annotations

import torch

__all__ = ["unpack_int4", "pack_int4", "dequantize_int4", "dequantize_int8", "SCALE_DTYPES"]

_SHIFTS = tuple(range(0, 32, 4))


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """Words int32/uint32 [N/8, K/128, 32, 4] -> q uint8 [N, K], values 0..15."""
    nt, kt = qweight.shape[0], qweight.shape[1]
    words = qweight.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.tensor(_SHIFTS, dtype=torch.int64, device=qweight.device)
    nib = (words.reshape(nt, kt, 8, 4, 4).unsqueeze(-1) >> shifts) & 15  # [tr, tc, g, t, w, p]
    nib = nib.reshape(nt, kt, 8, 4, 4, 2, 4)                              # p = 4h + j -> [.., h, j]
    # [tr, tc, g, t, w, h, j] -> [tr, g, tc, w, j, t, h]: row 8 tr + g, column 128 tc + 32 w + 8 j + 2 t + h
    return nib.permute(0, 2, 1, 4, 6, 3, 5).reshape(nt * 8, kt * 128).to(torch.uint8)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] values 0..15 (N % 8 == 0, K % 128 == 0) -> words int32 [N/8, K/128, 32, 4]
    (the inverse of `unpack_int4`)."""
    n, k = q.shape
    if n % 8 or k % 128:
        raise ValueError(f"INT4 tile layout needs N % 8 == 0 and K % 128 == 0, got [{n}, {k}]")
    x = q.to(torch.int64).reshape(n // 8, 8, k // 128, 4, 4, 4, 2)  # [tr, g, tc, w, j, t, h]
    nib = x.permute(0, 2, 1, 5, 3, 6, 4).reshape(n // 8, k // 128, 32, 4, 8)  # [tr, tc, L, w, p=4h+j]
    shifts = torch.tensor(_SHIFTS, dtype=torch.int64, device=q.device)
    words = (nib << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


SCALE_DTYPES = (torch.bfloat16, torch.float16)  # layouts int4-...-v1 and int4-...-f16s-v1


def dequantize_int4(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                    group_size: int) -> torch.Tensor:
    """f32 [N, K] from words [N/8, K/128, 32, 4], scales bf16 or fp16 [N, K/G], zeros uint8 [N, K/G]
    (0..16) or None."""
    if scales.dtype not in SCALE_DTYPES:
        raise TypeError(f"INT4 scales must be bfloat16 or float16, got {scales.dtype}")
    q = unpack_int4(qweight).float()
    n, k = q.shape
    q = q.reshape(n, k // group_size, group_size)
    z = 8.0 if zeros is None else zeros.float().unsqueeze(-1)
    return ((q - z) * scales.float().unsqueeze(-1)).reshape(n, k)


def dequantize_int8(qweight: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """f32 [N, K] from q int8 [N, K] and scales bf16 [N, K/G]."""
    n, k = qweight.shape
    q = qweight.float().reshape(n, k // group_size, group_size)
    return (q * scales.float().unsqueeze(-1)).reshape(n, k)
