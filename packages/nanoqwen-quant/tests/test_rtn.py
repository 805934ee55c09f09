"""The RTN grid of rtn.py: equal to nanoqwen_format's numpy reference bit for bit, within its derived
error bound, bf16-exact scales; bad inputs refused. Fresh random inputs, odd (tile-legal) sizes."""

from __future__ import annotations

import nanoqwen_format as nqf
import numpy as np
import pytest
import torch
from nanoqwen_quant.rtn import group_params, quantize_rtn

# Error bound of one dequantized weight, in units of its group's scale s (derived, not measured).
# s is absmax/7.5 (sym) or (max - min)/15 (asym) computed in fp32 and rounded to bf16, so
# s = exact * (1 + e) with |e| <= U = 2^-8 (bf16: 8 significant bits) + 2^-23 (the fp32 quotient).
# Unclamped, |w - (q - z) s| <= s/2 (round to nearest). Clamped at the top:
#   sym:  w = absmax = 7.5 s / (1 + e) dequantizes to 7 s: error <= s/2 + 7.5 s U / (1 - U)
#   asym: w <= hi, z <= -lo/s + 1/2, hi - lo = 15 s / (1 + e): error <= s/2 + 15 s U / (1 - U)
# (clamped at the bottom the error stays within s/2: -8 s is on the symmetric grid, and the
# asymmetric zero point's rounding keeps w + z s >= -s/2).
U = 2**-8 + 2**-23
RTN_ERR_SYM = 0.5 + 7.5 * U / (1 - U)
RTN_ERR_ASYM = 0.5 + 15 * U / (1 - U)


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_rtn_matches_format_reference(sym, group_size):
    g = torch.Generator().manual_seed(group_size + sym)
    w = torch.randn(136, 384, generator=g) * 0.05 + 0.01
    w[3, :group_size] = 0  # an all-zero group
    ours = quantize_rtn(w, group_size, sym).to_nqf()
    ref = nqf.int4.quantize_rtn(w.numpy(), group_size, sym)
    np.testing.assert_array_equal(ours.qweight, ref.qweight)
    np.testing.assert_array_equal(ours.scales, ref.scales)
    if sym:
        assert ours.zeros is None and ref.zeros is None
    else:
        np.testing.assert_array_equal(ours.zeros, ref.zeros)


@pytest.mark.parametrize("sym", [True, False])
def test_rtn_dequantize_error_bound(sym):
    w = torch.randn(72, 256, generator=torch.Generator().manual_seed(11)) * 0.1
    r = quantize_rtn(w, 64, sym)
    err = (r.dequantize() - w).abs().view(72, 4, 64)
    bound = r.scale[:, :, None] * (RTN_ERR_SYM if sym else RTN_ERR_ASYM)
    assert bool((err <= bound).all()), float((err / r.scale[:, :, None]).max())
    # (q - z) * s is exact in fp32 (|q - z| <= 15 times an 8-bit bf16 scale), so both codecs agree exactly
    np.testing.assert_array_equal(r.dequantize().numpy(), nqf.int4.dequantize(r.to_nqf()))


def test_group_params_bf16_scales():
    w = torch.randn(8, 256, generator=torch.Generator().manual_seed(12)) * 3e-3
    s, z = group_params(w, 128, symmetric=False)
    assert torch.equal(s, s.to(torch.bfloat16).float())
    assert bool(((z >= 0) & (z <= 15)).all())


def test_bad_inputs():
    with pytest.raises(ValueError, match="group_size"):
        quantize_rtn(torch.randn(8, 128), 48, True)
    with pytest.raises(ValueError, match="K %"):
        quantize_rtn(torch.randn(8, 100), 32, True)
    with pytest.raises(ValueError, match="NaN"):
        quantize_rtn(torch.full((8, 128), float("nan")), 32, True)
