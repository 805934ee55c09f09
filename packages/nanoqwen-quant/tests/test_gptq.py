"""GPTQ of gptq.py on one matrix: the Hessian against its closed form, GPTQ below RTN's output error
on correlated inputs, exactly RTN when the inputs are uncorrelated, damping raised and reported when
Cholesky fails, static groups keep RTN's scales, dead inputs handled, bad inputs refused."""

from __future__ import annotations

import pytest
import torch
from nanoqwen_quant.gptq import GPTQConfig, HessianAccumulator, gptq_quantize
from nanoqwen_quant.rtn import quantize_rtn

FP32_U = 2**-24  # unit roundoff of fp32


def _correlated(t: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) / k ** 0.5 + torch.eye(k)
    x = torch.randn(t, k, generator=g) @ mix
    x[:, : k // 16] *= 6  # a few outlier channels, as in real LLM activations
    return x


def _out_mse(x: torch.Tensor, w: torch.Tensor, dq: torch.Tensor) -> float:
    return float(((x @ (w - dq).t()) ** 2).mean())


def test_hessian_accumulator_matches_closed_form():
    n, k = 1000, 128
    x = _correlated(n, k, 1)
    parts = (x[:1], x[1:333], x[333:])
    acc = HessianAccumulator(k, "cpu")
    for part in parts:
        acc.add(part)
    ref = 2 * x.double().t() @ x.double() / n  # the same fp32 inputs, summed in fp64
    assert acc.n == n
    # Bound (Higham's gamma_m, any summation order): H_ij is 2/n times a sum of n products; fp32 sums
    # it to within gamma_n * (2/n) sum |x_i x_j| <= gamma_n * max_i H_ii (Cauchy-Schwarz: a PSD matrix's
    # largest entry is on its diagonal). The sqrt(2/n) pre-scaling adds 4 roundings per product and the
    # running rescale H *= n_old / n_new 2 per chunk: m = n + 4 + 2 * chunks.
    m = n + 4 + 2 * len(parts)
    atol = m * FP32_U / (1 - m * FP32_U) * float(torch.diag(ref).max())
    torch.testing.assert_close(acc.H.double(), ref, rtol=0, atol=atol)


@pytest.mark.parametrize("act_order", [True, False])
@pytest.mark.parametrize("sym", [True, False])
def test_gptq_beats_rtn_on_correlated_inputs(act_order, sym):
    n, k = 200, 384
    x = _correlated(3000, k, 2)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(3)) * 0.02
    acc = HessianAccumulator(k, "cpu")
    acc.add(x)
    H = acc.H.clone()
    res = gptq_quantize(w, acc.H, GPTQConfig(group_size=128, symmetric=sym, act_order=act_order))
    assert torch.equal(acc.H, H), "gptq_quantize must not modify H"
    rtn = quantize_rtn(w, 128, sym)
    # GPTQ exists to lower the output error on its calibration inputs: it must, on the same grid
    e_gptq, e_rtn = _out_mse(x, w, res.quant.dequantize()), _out_mse(x, w, rtn.dequantize())
    assert e_gptq < e_rtn, (e_gptq, e_rtn)
    assert not res.damp_raised and res.damp_used == 0.01
    # static groups: the scales are those of the original weights, i.e. RTN's
    assert torch.equal(res.quant.scale, rtn.scale)
    if not sym:
        assert torch.equal(res.quant.zero, rtn.zero)
    assert int(res.quant.q.max()) <= 15


@pytest.mark.parametrize("act_order", [True, False])
def test_gptq_is_rtn_on_uncorrelated_inputs(act_order):
    # H diagonal: the Cholesky factor of H^-1 is diagonal, so every update of the not-yet-quantized
    # columns is multiplied by an exact zero and GPTQ rounds each weight as RTN does, bit for bit
    k = 256
    w = torch.randn(40, k, generator=torch.Generator().manual_seed(6)) * 0.02
    H = torch.diag(torch.rand(k, generator=torch.Generator().manual_seed(7)) + 0.5)
    res = gptq_quantize(w, H, GPTQConfig(act_order=act_order))
    assert torch.equal(res.quant.q, quantize_rtn(w, 128, True).q)


def test_gptq_raises_damping_and_reports_it():
    k = 128
    x = _correlated(500, k, 4)
    H = (2 * x.t() @ x / 500).double()
    # Shift H to an indefinite matrix whose smallest eigenvalue is exactly -5% of its mean diagonal m:
    # damping d adds d * m, so 1% leaves it at -4% of m (Cholesky must fail) and 10% lifts it to +5%
    # (it must succeed). Both margins are far above fp32 Cholesky's backward error, about k * 2^-24
    # of ||H|| <= k * m, i.e. 1e-3 m here.
    lam_min = float(torch.linalg.eigvalsh(H)[0])
    mean_diag = float(torch.diag(H).mean())
    c = (lam_min + 0.05 * mean_diag) / 1.05  # H - cI: smallest eigenvalue -0.05 (mean_diag - c)
    H = (H - c * torch.eye(k, dtype=torch.float64)).float()
    w = torch.randn(16, k, generator=torch.Generator().manual_seed(8)) * 0.02
    res = gptq_quantize(w, H, GPTQConfig())
    assert res.damp_raised and res.damp_used == pytest.approx(0.1)
    assert res.notes and "Cholesky failed at damping 0.01" in res.notes[0]


def test_gptq_dead_inputs():
    k = 256
    x = _correlated(800, k, 5)
    x[:, 7] = 0
    x[:, 200] = 0
    acc = HessianAccumulator(k, "cpu")
    acc.add(x)
    w = torch.randn(24, k, generator=torch.Generator().manual_seed(9)) * 0.02
    res = gptq_quantize(w, acc.H, GPTQConfig())
    assert res.dead_columns == 2
    dq = res.quant.dequantize()
    assert torch.isfinite(dq).all()
    # dead columns are quantized from zeroed weights: their value is the grid's zero, i.e. exactly 0
    assert bool((dq[:, [7, 200]] == 0).all())


def test_bad_inputs():
    with pytest.raises(ValueError, match="H must be"):
        gptq_quantize(torch.randn(8, 128), torch.eye(64), GPTQConfig())
    with pytest.raises(ValueError, match="dynamic groups need act_order=False"):
        gptq_quantize(torch.randn(8, 128), torch.eye(128), GPTQConfig(act_order=True, static_groups=False))


@pytest.mark.parametrize("clip", [False, True])
def test_dynamic_groups(clip):
    # AutoGPTQ's default without act-order: each group's scale comes from the weights as updated by the
    # sweep when it reaches the group. The first group sees no update, so its scales are RTN's (or the
    # clip search's) on the original weights; the result beats RTN's output error on the same H.
    from nanoqwen_quant.clip import clip_group_params
    from nanoqwen_quant.gptq import HessianAccumulator
    from nanoqwen_quant.rtn import group_params, quantize_rtn

    g = torch.Generator().manual_seed(11)
    w = torch.randn(48, 256, generator=g) * 0.05
    acc = HessianAccumulator(256, "cpu")
    acc.add(torch.randn(1024, 256, generator=g) * (torch.rand(256, generator=g) + 0.2))
    cfg = GPTQConfig(group_size=64, act_order=False, static_groups=False, clip=clip)
    r = gptq_quantize(w, acc.H, cfg)
    s0, _ = (clip_group_params(w, 64, True) if clip else group_params(w, 64, True))
    assert torch.equal(r.quant.scale[:, 0], s0[:, 0])
    assert not torch.equal(r.quant.scale[:, 1:], s0[:, 1:])  # later groups: from the updated weights
    assert torch.equal(r.quant.scale, r.quant.scale.to(torch.bfloat16).float())

    def out_err(dq):
        e = w - dq
        return float((e @ acc.H * e).sum())

    assert out_err(r.quant.dequantize()) < out_err(quantize_rtn(w, 64, True).dequantize())
