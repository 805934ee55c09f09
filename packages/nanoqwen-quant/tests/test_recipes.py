"""The quality recipes on matrices and on the tiny model: the clip search (clip.py) is never worse than
plain RTN on its objective, AWQ's folding (awq.py) is exact in fp32, recipe options are validated, the
eval's agreement metric, and packs with --clip / --awq write plain Qwen2 containers whose folded norms
reproduce the float model.
"""

from __future__ import annotations

import nanoqwen_format as nqf
import pytest
import torch
from nanoqwen_model import forward as fwd
from nanoqwen_quant.awq import AWQ_ALPHAS, awq_search, fold_into_norm, fold_into_up
from nanoqwen_quant.clip import CLIP_RATIOS, clip_group_params, quantize_rtn_clipped
from nanoqwen_quant.evaluate import agreement, evaluate, score
from nanoqwen_quant.gptq import GPTQConfig, HessianAccumulator, gptq_quantize
from nanoqwen_quant.options import PackOptions, UsageError
from nanoqwen_quant.pack import pack
from nanoqwen_quant.rtn import group_params, quantize_rtn
from nanoqwen_quant.sources import HFFolderSource, open_source

FP32_U = 2**-24
# The search compares candidates by fp32 sums of G non-negative terms; such a sum is within G * U of
# its exact value (relative), so an fp64 recomputation of two candidates' errors can order them the
# other way by at most 2 G U relative: the slack of the "never worse" check below.
G_MAX = 128


def _group_err64(w: torch.Tensor, dq: torch.Tensor, g: int, c: torch.Tensor | None) -> torch.Tensor:
    n, k = w.shape
    d = (w.double() - dq.double()).square().view(n, k // g, g)
    if c is not None:
        d = d * c.double().view(k // g, g)
    return d.sum(-1)


def _heavy_tailed(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.distributions.StudentT(3.0).sample((n, k)) * 0.02  # outliers widen plain RTN's range
    return (w + 0.001 * torch.randn(n, k, generator=g)).to(torch.bfloat16).float()


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("weighted", [False, True])
def test_clip_never_worse_than_rtn(sym, group_size, weighted):
    torch.manual_seed(group_size + 2 * sym + 4 * weighted)
    w = _heavy_tailed(72, 384, group_size)
    w[5, :group_size] = 0  # an all-zero group keeps RTN's scale 1
    c = torch.rand(384) ** 4 + 1e-3 if weighted else None
    rtn = quantize_rtn(w, group_size, sym)
    clipped = quantize_rtn_clipped(w, group_size, sym, c)
    e_rtn = _group_err64(w, rtn.dequantize(), group_size, c)
    e_clip = _group_err64(w, clipped.dequantize(), group_size, c)
    assert bool((e_clip <= e_rtn * (1 + 2 * G_MAX * FP32_U)).all())
    assert float(e_clip.sum()) < float(e_rtn.sum())  # heavy tails: clipping does help overall
    # the scales are bf16-exact and codes on the 0..15 grid (the container format is unchanged)
    assert torch.equal(clipped.scale, clipped.scale.to(torch.bfloat16).float())
    assert int(clipped.q.max()) <= 15
    assert clipped.scale[5, 0] == 1.0
    # with ratio 1.0 alone only the least-squares refit may move RTN's scale (zero points stay RTN's)
    s1, z1 = clip_group_params(w, group_size, sym, c, ratios=(1.0,))
    s0, z0 = group_params(w, group_size, sym)
    assert torch.equal(z1, z0)
    assert 0 < int((s1 != s0).sum()) < s0.numel()


def test_clip_refuses_bad_inputs():
    w = torch.randn(8, 128)
    with pytest.raises(ValueError, match="start with 1.0"):
        clip_group_params(w, 128, True, ratios=(0.9, 1.0))
    with pytest.raises(ValueError, match="col_weight must be"):
        clip_group_params(w, 128, True, torch.ones(64))
    assert CLIP_RATIOS[0] == 1.0 and min(CLIP_RATIOS) == 0.7


def test_gptq_with_clip_grid_keeps_clip_scales_and_beats_rtn():
    # static groups with --clip: GPTQ's scales are the clip search's on the original weights (weighted by
    # diag H with clip_act), then the error feedback lowers the output error below clipped RTN's
    g = torch.Generator().manual_seed(3)
    w = _heavy_tailed(64, 256, 7)
    x = torch.randn(2048, 256, generator=g) * (torch.rand(256, generator=g) * 3 + 0.1)
    acc = HessianAccumulator(256, "cpu")
    acc.add(x)
    cfg = GPTQConfig(group_size=64, clip=True, clip_act=True)
    res = gptq_quantize(w, acc.H, cfg)
    s, _ = clip_group_params(w, 64, True, torch.diag(acc.H))
    assert torch.equal(res.quant.scale, s)
    rtn = quantize_rtn_clipped(w, 64, True, torch.diag(acc.H)).dequantize()

    def out_err(dq):
        return float(((w - dq) @ acc.H * (w - dq)).sum())

    assert out_err(res.quant.dequantize()) < out_err(rtn)


def test_awq_fold_into_norm_is_exact_in_fp32():
    g = torch.Generator().manual_seed(0)
    k, n, t = 256, 96, 64
    norm = (1 + 0.3 * torch.randn(k, generator=g)).to(torch.bfloat16).float()
    norm[7] = 0  # a dead channel keeps its norm and s_eff = 1
    w = torch.randn(n, k, generator=g) * 0.05
    x = torch.randn(t, k, generator=g) * (torch.rand(k, generator=g) * 4 + 0.05)
    s = x.abs().mean(0) ** 0.5
    new_norm, w2, s_eff = fold_into_norm(norm, w, s)
    assert torch.equal(new_norm, new_norm.to(torch.bfloat16).float())  # stays storable as bf16
    assert s_eff[7] == 1 and new_norm[7] == 0
    # element by element: norm' * w' = norm * w up to two fp32 roundings (s_eff = norm / norm' and
    # w * s_eff), relative 2 U (+U^2)
    lhs = new_norm.double()[None, :] * w2.double()
    rhs = norm.double()[None, :] * w.double()
    assert bool(((lhs - rhs).abs() <= 2.01 * FP32_U * rhs.abs()).all())
    # the layer's output in fp32: each of the K products is off by <= 2 U relative (above) and each side's
    # fp32 dot product of K terms by <= K U of sum |terms| (summation), so (2 + 2K) U sum |x_k w_k|
    y0 = fwd.rms_norm(x, norm, 1e-6) @ w.t()
    y1 = fwd.rms_norm(x, new_norm, 1e-6) @ w2.t()
    bound = (2 + 2 * k) * FP32_U * (fwd.rms_norm(x, norm, 1e-6).abs() @ w.abs().t())
    assert bool(((y1 - y0).abs() <= bound).all())
    assert not torch.equal(w2, w)  # a fold happened


def test_awq_fold_into_up_is_exact_in_fp32():
    g = torch.Generator().manual_seed(1)
    h, i, t = 64, 128, 32
    gate_up = torch.randn(2 * i, h, generator=g) * 0.1
    down = torch.randn(h, i, generator=g) * 0.1
    s = torch.rand(i, generator=g) * 3 + 0.2
    gu2, d2 = fold_into_up(gate_up, down, s, i)
    assert torch.equal(gu2[:i], gate_up[:i])  # gate rows untouched (silu is not scale-equivariant)
    x = torch.randn(t, h, generator=g)

    def mlp(gu, d):
        a = x @ gu.t()
        return (torch.nn.functional.silu(a[:, :i]) * a[:, i:]) @ d.t()

    # per product: up / s and down * s are one fp32 rounding each (2 U); the intermediate's own
    # roundings (x @ up, silu, the product) see the same relative errors on both sides except the
    # 1/s scaling, so the bound is as in the norm fold: (2 + 2 I) U sum |terms| with a 2x margin for
    # the up-projection's products entering once more
    ref = mlp(gate_up, down)
    a = x @ gate_up.t()
    terms = (torch.nn.functional.silu(a[:, :i]) * a[:, i:]).abs() @ down.abs().t()
    assert bool(((mlp(gu2, d2) - ref).abs() <= 2 * (2 + 2 * i) * FP32_U * terms).all())
    with pytest.raises(ValueError, match="expected"):
        fold_into_up(gate_up, down, s[:-1], i)


def test_awq_search_never_worse_and_helps_outlier_channels():
    g = torch.Generator().manual_seed(5)
    k, n = 256, 128
    w = torch.randn(n, k, generator=g) * 0.05
    scale = torch.ones(k)
    scale[:8] = 20.0  # a few channels with large activations, as in real LLM layers
    x = torch.randn(4096, k, generator=g) * scale
    acc = HessianAccumulator(k, "cpu")
    acc.add(x)
    torch.testing.assert_close(acc.abs_mean, x.abs().mean(0), rtol=1e-5, atol=0)

    def dq(m):
        return quantize_rtn(m, 128, True).dequantize()

    r = awq_search(w, acc.H, acc.abs_mean, dq)
    plain = dq(w)
    e = w - plain
    assert r.loss_plain == pytest.approx(float((e @ acc.H * e).sum()) / float((w @ acc.H * w).sum()),
                                         rel=1e-5)
    assert r.alpha > 0 and r.loss < r.loss_plain
    assert r.alpha in AWQ_ALPHAS and bool((r.s > 0).all())
    with pytest.raises(ValueError, match="start with 0"):
        awq_search(w, acc.H, acc.abs_mean, dq, alphas=(0.5,))


@pytest.mark.parametrize("kw, msg", [
    ({"method": "none", "clip": True}, "method none writes bf16"),
    ({"method": "none", "awq": True}, "method none writes bf16"),
    ({"clip_act": True}, "needs clip"),
    ({"method": "rtn", "clip": True, "clip_act": True}, "needs calibration activations"),
    ({"method": "rtn", "calib_tokens": 4096}, "applies to method gptq or --awq only"),
])
def test_recipe_options_validated(kw, msg):
    with pytest.raises(UsageError, match=msg):
        PackOptions(**kw).validate()


def test_recipe_options_copied_to_gptq():
    o = PackOptions(method="gptq", clip=True, clip_act=True, group_size=64, symmetric=False)
    o.validate()
    assert (o.gptq.clip, o.gptq.clip_act, o.gptq.group_size, o.gptq.symmetric) == (True, True, 64, False)
    assert o.calibrated and PackOptions(method="rtn", awq=True).calibrated
    assert not PackOptions(method="rtn").calibrated and not PackOptions(method="none").calibrated
    PackOptions(method="rtn", awq=True, calib_tokens=4096).validate()  # AWQ takes the calibration options


def test_agreement_metric():
    a = torch.tensor([1, 2, 3, 4])
    assert agreement(a, a) == 1.0
    assert agreement(a, torch.tensor([1, 0, 3, 0])) == 0.5
    with pytest.raises(ValueError, match="non-empty"):
        agreement(a, a[:3])
    with pytest.raises(ValueError, match="non-empty"):
        agreement(a[:0], a[:0])


@pytest.fixture(scope="module")
def tiny_packs(tiny_hf, calib_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("recipes")
    calib = {"calib_paths": [str(calib_dir)], "calib_tokens": 512, "calib_seq_len": 64}
    recipes = {"none": PackOptions(method="none"), "rtn": PackOptions(method="rtn"),
               "rtn-clip": PackOptions(method="rtn", clip=True),
               "awq-clip": PackOptions(method="rtn", awq=True, clip=True, clip_act=True, **calib),
               "gptq-awq": PackOptions(method="gptq", awq=True, clip=True, group_size=64, **calib)}
    out = {}
    for name, opts in recipes.items():
        out[name] = d / f"{name}.nanoqwen"
        pack(open_source(str(tiny_hf)), out[name], opts, log=lambda m: None)
    return out


def test_recipe_metadata_and_folded_norms(tiny_packs, tiny_hf):
    src = HFFolderSource(tiny_hf)
    for name, path in tiny_packs.items():
        with nqf.open(path) as f:
            f.verify()
            q = f.metadata["quantization"]
            if name == "none":
                assert "clip" not in q
                continue
            assert q["clip"] == (name != "rtn") and q["awq"] == ("awq" in name)
            lw = src.layer(1)
            norm = f.array("layers.1.input_norm")
            norm = torch.from_numpy(norm.copy()).view(torch.bfloat16).float()
            if "awq" in name:
                # the folded norms are in the container (and differ from the source's), the chosen
                # alphas are recorded per projection
                assert not torch.equal(norm, lw["input_norm"].float())
                errs = q["layer_errors"][1]
                assert {"awq_alpha", "awq_rel", "awq_rel_plain"} <= set(errs["qkv"])
                assert errs["down"]["awq_rel"] <= errs["down"]["awq_rel_plain"]
            else:
                assert torch.equal(norm, lw["input_norm"].float())


def test_eval_agreement_on_tiny(tiny_packs):
    text = "def add(a, b):\n    return a + b\n" * 20
    ref = score(tiny_packs["none"], text, seq_len=64, device="cpu")
    same = evaluate(tiny_packs["none"], text, reference=ref, seq_len=64, device="cpu")
    assert same.agreement == 1.0 and same.ppl_delta == 0.0 and same.tokens == ref.tokens
    for name in ("rtn", "rtn-clip", "awq-clip", "gptq-awq"):
        r = evaluate(tiny_packs[name], text, reference=tiny_packs["none"], seq_len=64, device="cpu")
        assert 0.0 <= r.agreement <= 1.0 and r.reference_perplexity == pytest.approx(ref.perplexity)
    with pytest.raises(ValueError, match="other tokens"):
        evaluate(tiny_packs["rtn"], text, reference=ref, seq_len=32, device="cpu")


def test_cli_eval_reference_json(tiny_packs, tmp_path, capsys):
    import json

    from nanoqwen_quant.cli import main

    text = tmp_path / "t.py"
    text.write_text("for i in range(10):\n    print(i * i)\n" * 20)
    rc = main(["eval", str(tiny_packs["rtn-clip"]), "--text", str(text), "--reference",
               str(tiny_packs["none"]), "--seq-len", "64", "--device", "cpu", "--json"])
    assert rc == 0
    d = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert d["reference"] == str(tiny_packs["none"]) and 0.0 <= d["agreement"] <= 1.0
    assert d["ppl_delta"] == pytest.approx(d["perplexity"] / d["reference_perplexity"] - 1)
