"""The oracles of the kernel tests and the one table of test tolerances.

The model math is nanoqwen_model's, imported, never re-implemented here (one truth: the kernels are
tested against the same definitions the reference runtime and the quantizer compute with):

    kernel                          oracle
    gemv_int4 / dequant_int4        nanoqwen_model.codec.dequantize_int4 (bf16 or fp16 scales), then
                                    forward.linear in fp32
    gemv_int8                       nanoqwen_model.codec.dequantize_int8, then forward.linear in fp32
    rms_norm_bf16                   nanoqwen_model.forward.rms_norm
    qkv_rope_kv_write_bf16          nanoqwen_model.forward.apply_rope (+ the paged write below)
    sample_tokens_bf16              nanoqwen_model.sampling.sampling_mask / sampling_probs
    paged attention                 nanoqwen_model.forward.causal_attention (reference_attention.py)

What is left here is kernel-specific glue: `linear` upcasting the weight so the product is fp32
whatever the operand dtypes (the kernels accumulate in fp32), `int4_linear` on a dequantised INT4
weight (optionally rounded to bf16, as the prefill GEMM multiplies it), SiLU*mul on a fused gate_up row, the
fused residual add that rounds the new residual to bf16 as the kernel stores it, the bias rounded to
bf16 before RoPE as the GEMV output is, the paged K/V write, and the tolerances: `TOLERANCES` with
`assert_close` (elementwise, per output dtype) and `ATTENTION_ROW` with `assert_rows_close` (per
row). Everything else stays fp32 until the output.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from nanoqwen_model import forward
from nanoqwen_model.codec import dequantize_int4, dequantize_int8
from nanoqwen_model.forward import apply_rope, rms_norm
from nanoqwen_model.sampling import sampling_mask, sampling_probs

__all__ = [
    "Tolerance", "TOLERANCES", "assert_close", "RowTolerance", "ATTENTION_ROW", "assert_rows_close",
    "dequantize_int4", "dequantize_int8", "linear", "silu_mul", "rms_norm",
    "fused_add_rms_norm", "residual_stats", "qkv_rope_kv_write", "sampling_mask", "sampling_probs",
]  # fmt: skip


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
        why="bf16 output: rounding to nearest costs up to 2^-8 relative (bf16 keeps 8 significant bits); "
        "2^-7 leaves one more half-ulp for fp32 summation order or an fma contraction flipping a rounding "
        "tie, or for two bf16 values rounded from fp32 sums that straddle a tie (one ulp, <= 2^-7 "
        "relative). atol covers fp32 accumulation differences on outputs that cancel to near zero: "
        "the tests draw O(1) outputs, so the sum of |terms| is <= ~130 (GEMV: 0.7 sqrt(K) at K = 18944, "
        "asymmetric) and its fp32 rounding noise, random in sign over <= K / 16 accumulator adds, is "
        "~1e-7 of that, 1e-5: atol is 10x it",
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


@dataclasses.dataclass(frozen=True)
class RowTolerance:
    """|| kernel row - reference row ||_2 <= rel_l2 * || reference row ||_2, for every row."""

    rel_l2: float
    why: str


# Paged attention, bf16 output, per row (one query token and head: a head_dim vector), checked
# against the fp32 reference of that row. An elementwise atol cannot work here: at long context a
# row's outputs are averages over ~ctx/e tokens (softmax of N(0, 1) scores), so |o| ~ 1/sqrt(1500) at
# 4097 tokens, and any atol that covers short rows hides a 20% error on a long one.
#
# The kernel computes o = bf16( sum_j bf16(p_j) v_j / l ) with p_j = 2^(s_j - m) in (0, 1] from fp32
# scores and l = sum_j p_j in fp32 (of the unrounded p_j). Errors relative to the row's ||o||, in
# u = 2^-8 (bf16 unit roundoff: 8 significant bits, round to nearest = half an ulp of [1, 2)):
#   (a) output rounding to bf16: <= u per element, so <= u on the row's norm: 1 half-ulp.
#   (b) P rounded to bf16 as the A operand of the P.V mma (V is bf16 in the cache: exact): weights
#       p_j (1 + d_j), |d_j| <= u, error e = sum_j d_j p_j v_j / l. q, K, V are independent N(0, 1)
#       in the tests, so given the scores e and o are Gaussian vectors: ||e||^2 = D c_e X and
#       ||o||^2 = D c_o Y with X, Y ~ chi^2_D / D, c_e = sum_j d_j^2 p_j^2 / l^2 <= u^2 c_o, at any
#       context length. So ||e|| / ||o|| <= u sqrt(X / Y); at D = 64 (the worse head_dim) X <= 2.45
#       and Y >= 0.272 but with probability 1e-9 each (chi-square quantiles): <= 3 u, 3 half-ulps.
#   (c) fp32 accumulation of P.V: <= 4097 / 16 + 16 chained adds per accumulator, each <= 2^-23
#       (even if the tensor core truncates), on terms whose |sum| is ~31x ||o|| / sqrt(D) at 4097
#       tokens: <= 1e-3 if every rounding had the same sign (0.26 u); the alpha rescales (<= 65) and
#       the split combine add < 1e-5.
#   (d) fp32 scores (bf16 q.k products are exact in fp32; 24 chained adds) and ex2.approx (~2^-22):
#       weights off by <= 1.1e-4 relative, <= (3 + 1) x 1.1e-4 on the row by the argument of (b)
#       (+1: l carries the same error): 0.11 u.
#   The fp32 reference: errors of kind (c) and (d) with random signs (sqrt(n) 2^-24 over its n <= 4097
#   adds, as in the elementwise table): < 0.1 u.
# Total: u (1 + 3 (1 + u) + 0.26 + 0.11 + 0.1) < 4.5 u = 1.76%.
ATTENTION_ROW = RowTolerance(
    rel_l2=4.5 * 2**-8,
    why="bf16 output rounding (1 half-ulp) + bf16 P in the P.V mma (3 half-ulps at a 1e-9 chi-square "
    "tail, D = 64) + fp32 accumulation over <= 4097 tokens, ex2.approx and the reference (< 0.5)",
)


def assert_rows_close(actual: torch.Tensor, expected: torch.Tensor, tol: RowTolerance,
                      what: str = "output") -> None:
    """Check every row (the last dimension) of a kernel output against its fp32 reference: relative
    L2 error <= tol.rel_l2. A reference row that is exactly zero (e.g. a padding slot) must come out
    exactly zero. NaN anywhere in `actual` (e.g. an unwritten poisoned element) always fails."""
    a = actual.float()
    e = expected.float().to(a.device)
    if a.shape != e.shape:
        raise AssertionError(f"{what}: shape {list(a.shape)} != reference {list(e.shape)}")

    def where(flat_row: int) -> list[int]:  # index of a row in the leading dimensions
        return [int(i) for i in torch.unravel_index(torch.tensor(flat_row), a.shape[:-1])]

    nan = torch.isnan(a).flatten(0, -2).any(dim=-1) if a.dim() > 1 else torch.isnan(a).any()[None]
    if nan.any():
        raise AssertionError(f"{what}: {int(nan.sum())} rows hold NaN (unwritten?), first at "
                             f"{where(int(nan.nonzero()[0, 0]))}")
    a2, e2 = a.reshape(-1, a.shape[-1]), e.reshape(-1, e.shape[-1])
    err, scale = (a2 - e2).norm(dim=-1), e2.norm(dim=-1)
    zero = scale == 0
    if (zero & (err > 0)).any():
        first = int((zero & (err > 0)).nonzero()[0, 0])
        raise AssertionError(f"{what}: row {where(first)} should be zero (its reference is)")
    rel = torch.where(zero, torch.zeros_like(err), err / torch.where(zero, torch.ones_like(scale), scale))
    bad = rel > tol.rel_l2
    if bad.any():
        worst = int(rel.argmax())
        raise AssertionError(
            f"{what}: {int(bad.sum())}/{rel.numel()} rows off; worst {where(worst)}: relative L2 error "
            f"{rel[worst].item():.3e} > {tol.rel_l2:.3e} (row norm {scale[worst].item():.3e})"
        )


# ---------------------------------------------------------------------------------------------------
# glue the kernels need beyond the model's definitions
# ---------------------------------------------------------------------------------------------------


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 x[M, K] @ w[N, K]^T + bias[N]: the model's `linear` on the weight upcast to fp32 (it computes
    in the weight's dtype), i.e. the exact products of what the kernel reads, accumulated in fp32 as
    the kernels accumulate (TF32 off, torch's default)."""
    return forward.linear(x, w.float(), bias)


def int4_linear(x: torch.Tensor, w, bias: torch.Tensor | None = None, *, bf16_weight: bool = False
                ) -> torch.Tensor:
    """`linear` of x with an INT4 weight `w` (gemv.Int4Weight: qweight, scales, zeros, group_size),
    dequantised by the model's codec to (q - z) * s; bf16_weight: that weight rounded to bf16 first,
    round((q - z) s), which the wgmma GEMM's prefill plan multiplies (as dequantise + cuBLAS does)."""
    dense = dequantize_int4(w.qweight, w.scales, w.zeros, w.group_size)
    return linear(x, dense.to(torch.bfloat16) if bf16_weight else dense, bias)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """fp32 silu(gate) * up for gate_up [T, 2I] (rows gate, then up)."""
    g, u = gate_up.float().chunk(2, dim=-1)
    return F.silu(g) * u


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(fp32 normalised output, new bf16 residual = bf16(x + residual)): the kernel stores the sum in
    the bf16 residual and normalises what it stored."""
    new_res = (x.float() + residual.float()).to(torch.bfloat16)
    return rms_norm(new_res, weight, eps), new_res


def residual_stats(residual: torch.Tensor, block: int = 128) -> torch.Tensor:
    """fp32 [M, ceil(N / block)]: per row and block of `block` columns, the sum of squares of the bf16
    residual [M, N], computed in fp64 and rounded once (what a GEMV's residual epilogue writes, up to
    its fp32 summation order)."""
    m, n = residual.shape
    nb = -(-n // block)
    sq = F.pad(residual.double() ** 2, (0, nb * block - n))
    return sq.view(m, nb, block).sum(-1).float()


def qkv_rope_kv_write(qkv, n_heads, n_kv_heads, head_dim, positions, slot_mapping, inv_freq,
                      k_cache, v_cache, bias=None):  # fmt: skip
    """Reference of the fused op: returns fp32 q [T, Hq, D] and writes (bf16) into k_cache/v_cache
    (tensors the caller owns, e.g. clones): slot s -> page s // block_size, offset s % block_size;
    slot < 0: no write. With a bias, qkv + bias is rounded to bf16 first, as a GEMV with fused bias
    would have stored it."""
    t = qkv.shape[0]
    x = qkv.float() if bias is None else (qkv.float() + bias.float()).to(torch.bfloat16).float()
    x = x.reshape(t, n_heads + 2 * n_kv_heads, head_dim)
    q = apply_rope(x[:, :n_heads], positions, inv_freq)
    k = apply_rope(x[:, n_heads : n_heads + n_kv_heads], positions, inv_freq)
    v = x[:, n_heads + n_kv_heads :]
    bs = k_cache.shape[2]
    for i, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        k_cache[slot // bs, :, slot % bs] = k[i].to(k_cache.dtype)
        v_cache[slot // bs, :, slot % bs] = v[i].to(v_cache.dtype)
    return q
