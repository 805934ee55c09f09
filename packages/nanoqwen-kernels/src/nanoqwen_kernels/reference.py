"""Plain-torch references of every kernel in this package except attention (reference_attention.py),
and the one table of test tolerances.

Each reference computes in fp32 (inputs upcast), with no tiling or fusion, so it can be checked by
eye against HF's Qwen2 code and DESIGN.md. The INT4 decoder below reads the tile layout directly
(shifts and a permutation in torch) and is itself tested against nanoqwen_format's numpy
`int4.unpack` / `int4.dequantize`, so kernel tests on large GPU tensors need no numpy round trip.
Where the bf16 model rounds an intermediate to bf16 (the residual sum, a bias added to a bf16 GEMV
output), the reference rounds it the same way; everything else stays fp32 until the output.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class Tolerance:
    rtol: float
    atol: float
    why: str


# Output dtype -> tolerance of |kernel - reference| <= atol + rtol * |reference|, reference in fp32.
TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.bfloat16: Tolerance(
        rtol=2**-7,
        atol=1e-4,
        why="bf16 output: rounding to nearest costs up to 2^-8 relative; 2^-7 leaves one ulp for fp32 "
        "summation order or an fma contraction flipping a rounding tie; atol covers fp32 accumulation "
        "differences (~1e-7 of the sum of |terms|) on O(1) outputs that cancel to near zero",
    ),
    torch.float32: Tolerance(rtol=1e-5, atol=1e-6, why="fp32 output: summation order only"),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str = "output") -> None:
    """Check a kernel output against its fp32 reference with the table's tolerance for actual.dtype.
    NaN anywhere in `actual` (e.g. an unwritten poisoned element) always fails."""
    tol = TOLERANCES[actual.dtype]
    a = actual.float()
    e = expected.float().to(a.device)
    if a.shape != e.shape:
        raise AssertionError(f"{what}: shape {list(a.shape)} != reference {list(e.shape)}")
    nan = torch.isnan(a) & ~torch.isnan(e)
    if nan.any():
        idx = nan.nonzero()[0].tolist()
        raise AssertionError(f"{what}: {int(nan.sum())} NaN elements (unwritten?), first at {idx}")
    err = (a - e).abs()
    bound = tol.atol + tol.rtol * e.abs()
    bad = err > bound
    if bad.any():
        idx = bad.nonzero()[0].tolist()
        worst = (err / bound).max().item()
        raise AssertionError(
            f"{what}: {int(bad.sum())}/{a.numel()} elements off (worst {worst:.2f}x the tolerance); "
            f"first at {idx}: got {a[tuple(idx)].item()!r}, expected {e[tuple(idx)].item()!r}"
        )


# ---------------------------------------------------------------------------------------------------
# INT4 layout int4-g{G}-tile8x128-v1
# ---------------------------------------------------------------------------------------------------


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """q[N, K] (int32 values 0..15) from the packed words [N/8, K/128, 32, 4] (int32 or uint32 bits).

    Word (lane L = 4g + t, w), nibble p = 4h + j holds row 8 tile_row + g and column
    128 tile_col + 32w + 8j + 2t + h (KOFF[p] = 8j + h)."""
    nt, kt = qweight.shape[0], qweight.shape[1]
    words = qweight.to(torch.int32).reshape(nt, kt, 8, 4, 4)  # [tr, tc, g, t, w]
    shifts = 4 * torch.arange(8, device=qweight.device, dtype=torch.int32)
    nib = (words.unsqueeze(-1) >> shifts) & 15  # [tr, tc, g, t, w, p]
    nib = nib.reshape(nt, kt, 8, 4, 4, 2, 4)  # p = 4h + j -> [.., h, j]
    # -> [tr, g, tc, w, j, t, h]
    return nib.permute(0, 2, 1, 4, 6, 3, 5).reshape(nt * 8, kt * 128)


def dequantize_int4(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int
) -> torch.Tensor:
    """fp32 [N, K]: w = (q - z) * f32(s), z = 8 when zeros is None (symmetric)."""
    q = unpack_int4(qweight).float()
    n, k = q.shape
    q = q.reshape(n, k // group_size, group_size)
    z = 8.0 if zeros is None else zeros.float().unsqueeze(-1)
    return ((q - z) * scales.float().unsqueeze(-1)).reshape(n, k)


def dequantize_int8(qweight: torch.Tensor, scales: torch.Tensor, group_size: int) -> torch.Tensor:
    """INT8 row-major [N, K] (int8) with bf16 scales [N, K/G] -> fp32 [N, K] = q * s."""
    s = scales.float().repeat_interleave(group_size, dim=1)
    return qweight.float() * s


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 x[M, K] @ w[N, K]^T + bias[N] (all upcast to fp32; TF32 off)."""
    y = torch.matmul(x.float(), w.float().t())
    return y if bias is None else y + bias.float()


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """fp32 silu(gate) * up for gate_up [T, 2I]."""
    g, u = gate_up.float().chunk(2, dim=-1)
    return torch.nn.functional.silu(g) * u


# ---------------------------------------------------------------------------------------------------
# layer ops
# ---------------------------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(fp32 normalised output, new bf16 residual = bf16(x + residual))."""
    new_res = (x.float() + residual.float()).to(torch.bfloat16)
    return rms_norm(new_res, weight, eps), new_res


def embedding(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return table[ids.long()].float()


def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Qwen2 RoPE (rotate_half) on x [T, H, D] in fp32, angle = fp32(position) * inv_freq."""
    xf = x.float()
    angle = positions.float()[:, None] * inv_freq.float()[None, :]  # [T, D/2]
    cos, sin = torch.cos(angle)[:, None, :], torch.sin(angle)[:, None, :]
    half = xf.shape[-1] // 2
    a, b = xf[..., :half], xf[..., half:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def qkv_rope_kv_write(qkv, n_heads, n_kv_heads, head_dim, positions, slot_mapping, inv_freq,
                      k_cache, v_cache, bias=None):  # fmt: skip
    """Reference of the fused op: returns fp32 q [T, Hq, D] and writes (bf16) into k_cache/v_cache
    (tensors the caller owns, e.g. clones): slot s -> page s // block_size, offset s % block_size."""
    t = qkv.shape[0]
    x = qkv.float() if bias is None else (qkv.float() + bias.float()).to(torch.bfloat16).float()
    x = x.reshape(t, n_heads + 2 * n_kv_heads, head_dim)
    q = rope(x[:, :n_heads], positions, inv_freq)
    k = rope(x[:, n_heads : n_heads + n_kv_heads], positions, inv_freq)
    v = x[:, n_heads + n_kv_heads :]
    bs = k_cache.shape[2]
    for i, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        k_cache[slot // bs, :, slot % bs] = k[i].to(k_cache.dtype)
        v_cache[slot // bs, :, slot % bs] = v[i].to(v_cache.dtype)
    return q


# ---------------------------------------------------------------------------------------------------
# sampling
# ---------------------------------------------------------------------------------------------------


def sampling_mask(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """bool [V]: the tokens a sampler may return for one row (ties at a threshold are kept, as in HF's
    `scores < kth_value` masks). top-k on logits, then top-p on the tempered probabilities of the
    survivors: keep logits >= the largest value whose tail mass reaches top_p (computed in fp64)."""
    lf = logits.double()
    keep = torch.ones_like(lf, dtype=torch.bool)
    if 0 < top_k < lf.numel():
        kth = torch.topk(lf, top_k).values[-1]
        keep &= lf >= kth
    if top_p < 1.0:
        vals = torch.where(keep, lf, torch.full_like(lf, -float("inf")))
        sorted_vals, _ = torch.sort(vals, descending=True)
        mass = torch.exp((sorted_vals - sorted_vals[0]) / temperature)
        cum = torch.cumsum(mass, 0)
        pos = int(torch.searchsorted(cum, top_p * cum[-1]).clamp(max=cum.numel() - 1))
        keep &= lf >= sorted_vals[pos]
    return keep


def sampling_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """fp64 [V]: the distribution a sampler must draw from (softmax(l / T) renormalised on the mask)."""
    keep = sampling_mask(logits, temperature, top_k, top_p)
    lf = logits.double() / temperature
    lf = torch.where(keep, lf, torch.full_like(lf, -float("inf")))
    return torch.softmax(lf, 0)
