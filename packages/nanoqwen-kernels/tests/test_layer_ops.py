"""GPU: norms, SiLU*mul, embedding gather and the fused q/k/v bias + RoPE + paged KV write against the
fp32 torch references, on fresh random data at 7B and odd shapes, outputs NaN-poisoned first.

Tolerances: the bf16 entry of reference.TOLERANCES (rtol 2^-7, atol 1e-4, derived there). Each kernel
here computes in fp32 and rounds once to bf16 (<= 2^-8 relative); its fp32 result differs from
torch's by ~1e-6 relative (sums of <= 3584 squares, rsqrtf and __expf within a few ulp at these
magnitudes, __sincosf after a double-precision range reduction to |r| <= pi: ~1e-6 absolute), far
under the second half-ulp the table's 2^-7 leaves. Exact where the kernel does no arithmetic
(embedding, V) or the reference makes the same single rounding (the residual)."""

from __future__ import annotations

import pytest
import torch
from nanoqwen_kernels import reference as R

pytestmark = pytest.mark.gpu
EPS = 1e-6


def randn(shape, gen, device, scale=1.0):
    return (scale * torch.randn(shape, generator=gen, device=device)).to(torch.bfloat16)


def poisoned(shape, device, dtype=torch.bfloat16):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


@pytest.mark.parametrize("t,h", [(1, 3584), (5, 3584), (37, 896), (3, 8), (2, 1000)])
def test_rms_norm(t, h, gen, device):
    from nanoqwen_kernels.layer_ops import rms_norm

    x, w = randn((t, h), gen, device, 3.0), randn((h,), gen, device)
    out = poisoned((t, h), device)
    rms_norm(x, w, out, EPS)
    R.assert_close(out, R.rms_norm(x, w, EPS), "rms_norm")


@pytest.mark.parametrize("t,h", [(1, 3584), (8, 3584), (33, 896), (2, 1000)])
def test_fused_add_rms_norm(t, h, gen, device):
    from nanoqwen_kernels.layer_ops import fused_add_rms_norm

    x, res, w = randn((t, h), gen, device), randn((t, h), gen, device, 10.0), randn((h,), gen, device)
    ref_out, ref_res = R.fused_add_rms_norm(x, res, w, EPS)
    out = poisoned((t, h), device)
    fused_add_rms_norm(x, res, w, out, EPS)
    assert torch.equal(res, ref_res)  # the same single bf16 rounding of an fp32 sum
    R.assert_close(out, ref_out, "fused_add_rms_norm")


@pytest.mark.parametrize("t,inter", [(1, 18944), (8, 18944), (5, 4864), (3, 8)])
def test_silu_mul(t, inter, gen, device):
    from nanoqwen_kernels.layer_ops import silu_mul

    gu = randn((t, 2 * inter), gen, device, 3.0)
    out = poisoned((t, inter), device)
    silu_mul(gu, out)
    R.assert_close(out, R.silu_mul(gu), "silu_mul")


@pytest.mark.parametrize("t,v,h", [(1, 152064, 3584), (7, 151936, 896), (3, 100, 8)])
def test_embedding_gather(t, v, h, gen, device):
    from nanoqwen_kernels.layer_ops import embedding_gather

    table = randn((v, h), gen, device)
    ids = torch.randint(0, v, (t,), generator=gen, device=device, dtype=torch.int32)
    out = poisoned((t, h), device)
    embedding_gather(ids, table, out)
    assert torch.equal(out, table[ids.long()])


def test_embedding_out_of_range_id_gives_nan_row(gen, device):
    from nanoqwen_kernels.layer_ops import embedding_gather

    table = randn((50, 16), gen, device)
    ids = torch.tensor([3, 50, -1, 7], dtype=torch.int32, device=device)
    out = torch.zeros(4, 16, dtype=torch.bfloat16, device=device)
    embedding_gather(ids, table, out)
    assert torch.equal(out[0], table[3]) and torch.equal(out[3], table[7])
    assert torch.isnan(out[1]).all() and torch.isnan(out[2]).all()


@pytest.mark.parametrize(
    "hq,hkv,d,t,block_size,with_bias",
    [
        (28, 4, 128, 1, 16, True),  # 7B decode
        (28, 4, 128, 37, 16, False),  # 7B prefill chunk, bias fused in the GEMV
        (14, 2, 64, 5, 16, True),  # 0.5B
        (4, 4, 32, 9, 4, True),  # odd
    ],
)
def test_qkv_rope_kv_write(hq, hkv, d, t, block_size, with_bias, gen, device):
    from nanoqwen_kernels.layer_ops import AttentionShape, qkv_rope_kv_write, rope_inv_freq

    shape = AttentionShape(hq, hkv, d)
    num_blocks = 2 * t // block_size + 4
    qkv = randn((t, shape.qkv_width), gen, device)
    bias = randn((shape.qkv_width,), gen, device) if with_bias else None
    positions = torch.randint(0, 32768, (t,), generator=gen, device=device, dtype=torch.int32)
    slots = torch.randperm(num_blocks * block_size, generator=gen, device=device)[:t].to(torch.int32)
    if t > 2:
        slots[1] = -1  # a padding token: no cache write
    inv_freq = rope_inv_freq(d, 1_000_000.0, device)
    k_cache = poisoned((num_blocks, hkv, block_size, d), device)
    v_cache = poisoned((num_blocks, hkv, block_size, d), device)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    q_out = poisoned((t, hq, d), device)
    qkv_rope_kv_write(qkv, shape, positions, slots, inv_freq, q_out, k_cache, v_cache, bias)
    q_ref = R.qkv_rope_kv_write(qkv, hq, hkv, d, positions, slots, inv_freq, k_ref, v_ref, bias)
    R.assert_close(q_out, q_ref, "q")
    written = torch.isfinite(k_ref)
    assert torch.equal(torch.isfinite(k_cache), written), "K written at the wrong slots"
    assert torch.equal(torch.isfinite(v_cache), torch.isfinite(v_ref)), "V written at the wrong slots"
    # both sides bf16, rounded from fp32 values ~1e-6 apart: equal, or one ulp apart when they straddle
    # a rounding tie; one bf16 ulp is <= 2^-7 of the value, the table's rtol
    R.assert_close(k_cache[written], k_ref[written].float(), "k cache")
    assert torch.equal(v_cache[written], v_ref[written])


def test_layer_ops_reject_bad_inputs(gen, device):
    from nanoqwen_kernels.layer_ops import rms_norm

    x = randn((2, 64), gen, device)
    with pytest.raises(ValueError, match="shape"):
        rms_norm(x, randn((32,), gen, device), torch.empty_like(x), EPS)
    with pytest.raises(TypeError, match="dtype"):
        rms_norm(x.float(), randn((64,), gen, device), torch.empty_like(x), EPS)
    with pytest.raises(ValueError, match="multiple of 8"):
        rms_norm(randn((2, 12), gen, device), randn((12,), gen, device), randn((2, 12), gen, device), EPS)
