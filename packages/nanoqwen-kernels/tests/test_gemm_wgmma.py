"""GPU: the wgmma INT4 GEMM (csrc/gemm_int4_ws.cuh, plan.kernel "wgmma": M <= 64, and the prefill plan's
M blocks of 128 rows) against the fp32 reference on fresh random weights: the 7B shapes at M = 9..64 and
65..512, odd shapes (N % 128 != 0, K / 128 odd) at every group size, symmetric and asymmetric, bf16 and
fp16 scales, several K splits, graph replay. Outputs are NaN-poisoned with a poisoned guard after
row M - 1 (int4_testkit.run_gemm).

Tolerance: reference.TOLERANCES[bfloat16], as test_gemm.py's, for the same reason: each output element
is the sum of exact fp32 products of the exact bf16 (q - z) weights and bf16 activations, one fresh fp32
fragment per quantization group (wgmma sums a group's k16 steps in fp32 as the mma.sync chain does),
scaled into an fp32 accumulator (<= K / 16 accumulator adds: the atol's derivation), rounded once to
bf16 (the rtol's). What differs from the mma.sync kernel is only who moves the data. The prefill plan
(NT = 16) multiplies the weights scaled and rounded to bf16 first, round((q - z) s), as dequantise + cuBLAS
does, so its reference is the fp32 product with that bf16 weight (reference_out(bf16_weight=True)), and
the same tolerance holds for the same reasons: exact fp32 products, fp32 sums, one rounding. Against the
unrounded weight its error would grow by the weights' rounding (up to 2^-9 of each product, random in
sign: ~2^-9 of the output's norm, beyond the atol on outputs that cancel).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from int4_testkit import random_int4, reference_out, run_gemm
from nanoqwen_kernels import reference as R

pytestmark = pytest.mark.gpu

SHAPES_7B = [("qkv", 4608, 3584), ("o", 3584, 3584), ("gate_up", 37888, 3584), ("down", 3584, 18944)]
ODD_SHAPES = [(24, 384), (200, 640), (136, 4096), (1000, 1152)]


def wgmma_plan(n, k, m, group_size, splits):
    from nanoqwen_kernels.gemm import GemmPlan, m_class

    mc = m_class(m)
    return GemmPlan.of(n, k, group_size, mc // 8, mc, splits, kernel="wgmma")


@pytest.mark.parametrize("m", [9, 16, 17, 32, 33, 48, 63, 64])
@pytest.mark.parametrize("name,n,k", SHAPES_7B)
def test_wgmma_7b_shapes(name, n, k, m, gen, device):
    w = random_int4(n, k, 128, False, gen, device)
    x = torch.randn(m, k, generator=gen, device=device).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen, device=device).to(torch.bfloat16) if name == "qkv" else None
    splits = 4 if name in ("o", "down") else 1
    got = run_gemm(x, w, bias, wgmma_plan(n, k, m, 128, splits))
    R.assert_close(got, reference_out(x, w, bias), f"wgmma gemm {name} M={m}")


@pytest.mark.parametrize("name,n,k", [s for s in SHAPES_7B if s[0] in ("gate_up", "down")])
@pytest.mark.parametrize("m", [33, 64])
def test_planner_runs_wgmma_where_measured(name, n, k, m, gen, device):
    """The engine's plan for these shapes at M = 33..64 is the wgmma kernel (MEASURED_PLANS): assert the
    path, then the output."""
    from nanoqwen_kernels.gemm import plan_gemm

    plan = plan_gemm(n, k, m, 128, device)
    assert plan.kernel == "wgmma"
    w = random_int4(n, k, 128, False, gen, device)
    x = torch.randn(m, k, generator=gen, device=device).to(torch.bfloat16)
    R.assert_close(run_gemm(x, w, None, plan), reference_out(x, w, None), f"planned wgmma {name} M={m}")


@pytest.mark.parametrize("n,k", ODD_SHAPES)
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("m,splits", [(13, 1), (40, 2), (64, 3)])
def test_wgmma_odd_shapes(n, k, group_size, symmetric, m, splits, gen, device):
    w = random_int4(n, k, group_size, symmetric, gen, device)
    x = torch.randn(m, k, generator=gen, device=device).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen, device=device).to(torch.bfloat16)
    got = run_gemm(x, w, bias, wgmma_plan(n, k, m, group_size, splits))
    R.assert_close(got, reference_out(x, w, bias), f"wgmma [{n}, {k}] g{group_size} M={m} S={splits}")


@pytest.mark.parametrize("group_size", [32, 128])
@pytest.mark.parametrize("symmetric", [True, False])
def test_wgmma_fp16_scales(group_size, symmetric, gen, device):
    n, k, m = 1000, 1152, 50
    w = random_int4(n, k, group_size, symmetric, gen, device, scale_dtype=torch.float16)
    x = torch.randn(m, k, generator=gen, device=device).to(torch.bfloat16)
    got = run_gemm(x, w, None, wgmma_plan(n, k, m, group_size, 2))
    R.assert_close(got, reference_out(x, w, None), f"wgmma f16s g{group_size}")


@pytest.mark.parametrize("group_size", [32, 128])
@pytest.mark.parametrize("symmetric", [True, False])
def test_wgmma_prefill_fp16_scales(group_size, symmetric, gen, device):
    from nanoqwen_kernels.gemm import plan_gemm_prefill

    n, k, m = 1000, 1152, 300
    w = random_int4(n, k, group_size, symmetric, gen, device, scale_dtype=torch.float16)
    x = torch.randn(m, k, generator=gen, device=device).to(torch.bfloat16)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    got = run_gemm(x, w, None, plan_gemm_prefill(n, k, m, group_size, sms))
    R.assert_close(got, reference_out(x, w, None, bf16_weight=True), f"wgmma prefill f16s g{group_size}")


@pytest.mark.parametrize("m", [65, 100, 128, 129, 200, 512])
@pytest.mark.parametrize("name,n,k", SHAPES_7B)
def test_wgmma_prefill_plan_7b_shapes(name, n, k, m, gen, device):
    """plan_gemm_prefill (NT = 16: M blocks of 128 rows, 384 threads, setmaxnreg to 232 registers for the
    consumers): split along K up to 128 rows, several M blocks above."""
    from nanoqwen_kernels.gemm import plan_gemm_prefill

    sms = torch.cuda.get_device_properties(device).multi_processor_count
    plan = plan_gemm_prefill(n, k, m, 128, sms)
    assert plan.kernel == "wgmma" and plan.n_tiles == 16
    w = random_int4(n, k, 128, False, gen, device)
    x = torch.randn(m, k, generator=gen, device=device).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen, device=device).to(torch.bfloat16) if name == "qkv" else None
    R.assert_close(run_gemm(x, w, bias, plan), reference_out(x, w, bias, bf16_weight=True),
                   f"wgmma prefill {name} M={m} S={plan.splits}")


@pytest.mark.parametrize("n,k", ODD_SHAPES)
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("m", [65, 130, 300])
def test_wgmma_prefill_plan_odd_shapes(n, k, group_size, symmetric, m, gen, device):
    """The planned launch; above 128 rows also the stream-K launch forced on the same inputs: tiles
    shared by blocks, blocks left without units, the partials summed by the last to arrive, the counters
    back at zero."""
    from nanoqwen_kernels.gemm import plan_gemm_prefill

    sms = torch.cuda.get_device_properties(device).multi_processor_count
    plan = plan_gemm_prefill(n, k, m, group_size, sms)
    w = random_int4(n, k, group_size, symmetric, gen, device)
    x = torch.randn(m, k, generator=gen, device=device).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen, device=device).to(torch.bfloat16)
    want = reference_out(x, w, bias, bf16_weight=True)
    R.assert_close(run_gemm(x, w, bias, plan), want,
                   f"wgmma prefill [{n}, {k}] g{group_size} M={m} S={plan.splits}")
    if m > 128:
        stream_k = dataclasses.replace(plan, stream_k_blocks=sms)
        R.assert_close(run_gemm(x, w, bias, stream_k), want, f"wgmma prefill stream-K [{n}, {k}] M={m}")


def test_wgmma_graph_replay(gen, device):
    """Captured once, replayed on new inputs written into the captured x: the tensor map captured with the
    launch names x's buffer, so the replay reads the new values; split-K counters reset every replay."""
    from nanoqwen_kernels.gemm import allocate_workspace, gemm_int4

    n, k, m = 3584, 18944, 57
    w = random_int4(n, k, 128, False, gen, device)
    plan = wgmma_plan(n, k, m, 128, 4)
    ws = allocate_workspace([plan], device)
    x = torch.randn(m, k, generator=gen, device=device).to(torch.bfloat16)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=device)
    gemm_int4(x, w, out, workspace=ws, plan=plan)  # first use: compile and load outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemm_int4(x, w, out, workspace=ws, plan=plan)
    for _ in range(3):
        x.copy_(torch.randn(m, k, generator=gen, device=device).to(torch.bfloat16))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        R.assert_close(out, reference_out(x, w, None), "wgmma graph replay")
        assert int(ws.counters.abs().sum()) == 0


def test_wgmma_rejects_what_it_cannot_run(gen, device):
    from nanoqwen_kernels.gemm import gemm_int4

    w = random_int4(3584, 18944, 32, False, gen, device)
    x = torch.randn(64, 18944, generator=gen, device=device).to(torch.bfloat16)
    out = torch.empty(64, 3584, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match="shared memory"):  # g32, K unsplit: the scale table is too big
        gemm_int4(x, w, out, plan=wgmma_plan(3584, 18944, 64, 32, 1))
    gate_up = torch.randn(64, 2 * 18944, generator=gen, device=device).to(torch.bfloat16)
    with pytest.raises(ValueError, match="plain input"):
        gemm_int4(gate_up, w, out, plan=wgmma_plan(3584, 18944, 64, 32, 4), silu_mul_input=True)
