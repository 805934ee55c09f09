"""GPU: INT4 GEMM (M > 8: decode batches and prefill chunks), its split-K path and the fused SiLU*mul
input, against the fp32 torch reference (nanoqwen_model's INT4 codec, then an fp32 product) on fresh
random weights, at the Qwen2.5-Coder-7B shapes and at odd shapes (N a multiple of 8 but not of 128,
K = 128 x odd), for M from 9 to 4096. Outputs are NaN-poisoned, with a poisoned guard region after
the M rows, before each launch: every row < M must be written and nothing after it.

Tolerance: reference.TOLERANCES[bfloat16], the table's entry derived for the GEMV. It holds for the
GEMM unchanged because each output element is computed by the same arithmetic: the same exact bf16
(q - z) weights and bf16 activations (products exact in fp32), summed in fp32 by the same mma
k-order per 16 columns, one fresh fragment per quantization group scaled into an fp32 accumulator
(<= K / 16 accumulator adds, the atol's derivation), rounded once to bf16 (the rtol's derivation).
M only changes which rows share a weight fragment, not how any one element is summed. The SiLU*mul
input is rounded to bf16 as the GEMV's is (same formula, __expf), and so is the reference's.
"""

from __future__ import annotations

import pytest
import torch
from int4_testkit import random_int4, reference_out, run_gemm
from nanoqwen_kernels import reference as R
from nanoqwen_kernels.gemm import MEASURED_PLANS

pytestmark = pytest.mark.gpu

SHAPES_7B = [("qkv", 4608, 3584), ("o", 3584, 3584), ("gate_up", 37888, 3584), ("down", 3584, 18944)]
ODD_SHAPES = [(24, 384), (200, 640), (136, 4096), (1000, 1152)]  # N % 128 != 0, K / 128 odd or not
M_ALL = [9, 13, 16, 17, 31, 32, 33, 48, 63, 64, 65, 127, 200, 512, 1000, 4096]
# the fp32 reference of gate_up at M = 4096 is a 2.2 GB product: large M on the other shapes only
CASES_7B = [
    pytest.param(name, n, k, m, id=f"{name}-M{m}")
    for name, n, k in SHAPES_7B
    for m in M_ALL
    if not (name in ("gate_up", "down") and m > 1000)
]


@pytest.mark.parametrize("name,n,k,m", CASES_7B)
def test_gemm_7b_shapes(name, n, k, m, gen, device):
    w = random_int4(n, k, 128, True, gen, device)
    x = torch.randn(m, k, generator=gen, device=device).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen, device=device).to(torch.bfloat16) if name == "qkv" else None
    R.assert_close(run_gemm(x, w, bias), reference_out(x, w, bias), f"gemm {name} M={m}")


@pytest.mark.parametrize("name,n,k", [s for s in SHAPES_7B])
@pytest.mark.parametrize("m", [9, 33, 64, 200])
def test_gemm_7b_asymmetric(name, n, k, m, gen, device):
    w = random_int4(n, k, 128, False, gen, device)
    x = torch.randn(m, k, generator=gen, device=device).to(torch.bfloat16)
    R.assert_close(run_gemm(x, w, None), reference_out(x, w, None), f"gemm asym {name} M={m}")


# every measured plan (the 7B / 1.5B / 0.5B linears at g128, 132 SMs), at its class's top M and below
MEASURED_CASES = [
    pytest.param(n, k, m, id=f"{n}x{k}-M{m}")
    for (_sms, n, k, _g, max_m) in MEASURED_PLANS
    for m in {16: (9, 16), 32: (25, 32), 64: (47, 64)}[max_m]
]


@pytest.mark.parametrize("n,k,m", MEASURED_CASES)
def test_gemm_measured_plan(n, k, m, gen, device):
    """On a 132-SM GPU the planner runs gemm.MEASURED_PLANS' kernel, M-block rows and K splits
    (asserted, not assumed), several M blocks where the plan's rows are fewer than M; asymmetric
    weights, as the default recipe packs them."""
    from nanoqwen_kernels import gemm

    if torch.cuda.get_device_properties(device).multi_processor_count != 132:
        pytest.skip("MEASURED_PLANS lists 132-SM plans (H100 SXM / H200); this GPU plans by the model")
    plan = gemm.plan_gemm(n, k, m, 128, device)
    kernel, nt, splits = MEASURED_PLANS[(132, n, k, 128, gemm.m_class(m))]
    assert (plan.kernel, plan.n_tiles, plan.splits) == (kernel, nt, splits)
    assert plan.grid(m)[0] == -(-m // (8 * nt))
    w = random_int4(n, k, 128, False, gen, device)
    x = torch.randn(m, k, generator=gen, device=device).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen, device=device).to(torch.bfloat16)
    R.assert_close(run_gemm(x, w, bias, plan), reference_out(x, w, bias), f"gemm planned [{n}, {k}] M={m}")


@pytest.mark.parametrize("n,k", ODD_SHAPES)
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("m", [9, 17, 40, 64, 65, 130])
def test_gemm_odd_shapes(n, k, group_size, symmetric, m, gen, device):
    w = random_int4(n, k, group_size, symmetric, gen, device)
    x = torch.randn(m, k, generator=gen, device=device).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen, device=device).to(torch.bfloat16)
    R.assert_close(run_gemm(x, w, bias), reference_out(x, w, bias), f"gemm [{n}, {k}] g{group_size} M={m}")


@pytest.mark.parametrize("n,k,group_size", [(4608, 3584, 128), (200, 640, 32), (136, 1152, 64)])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("m", [9, 40, 130])
@pytest.mark.parametrize("silu", [False, True], ids=["plain", "silu"])
def test_gemm_fp16_scales(n, k, group_size, symmetric, m, silu, gen, device):
    """The -f16s layout (fp16 scales, zero points 0..16): widening either scale type to f32 is exact,
    so the same tolerance holds (test_gemv.py)."""
    w = random_int4(n, k, group_size, symmetric, gen, device, torch.float16)
    assert w.kernel_suffix().endswith("_f16s")
    x = torch.randn(m, 2 * k if silu else k, generator=gen, device=device).to(torch.bfloat16)
    bias = None if silu else torch.randn(n, generator=gen, device=device).to(torch.bfloat16)
    out = run_gemm(x, w, bias, silu=silu)
    R.assert_close(out, reference_out(x, w, bias, silu=silu), f"gemm f16s [{n}, {k}] g{group_size} M={m}")


@pytest.mark.parametrize("n,k", [(200, 640), (136, 4096), (3584, 18944)])
@pytest.mark.parametrize("m", [9, 24, 64])
def test_gemm_forced_split(n, k, m, gen, device):
    from nanoqwen_kernels.gemm import plan_gemm

    w = random_int4(n, k, 128, False, gen, device)
    x = torch.randn(m, k, generator=gen, device=device).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen, device=device).to(torch.bfloat16)
    plan = plan_gemm(n, k, m, 128, device).with_splits(64)
    assert plan.splits > 1
    R.assert_close(run_gemm(x, w, bias, plan), reference_out(x, w, bias), f"gemm split {plan.splits}")


MULTI_SPLIT_SHAPES = [(3584, 3584, 128), (3584, 18944, 128), (200, 640, 32), (136, 4096, 64)]
MULTI_SPLIT_BLOCKS = [(4, 64, 33), (4, 64, 47), (4, 64, 64), (2, 32, 17), (2, 32, 32), (2, 64, 50)]


@pytest.mark.parametrize("n,k,group_size", MULTI_SPLIT_SHAPES)
@pytest.mark.parametrize("n_tiles,max_m,m", MULTI_SPLIT_BLOCKS)
@pytest.mark.parametrize("splits", [3, 64])
@pytest.mark.parametrize("silu", [False, True], ids=["plain", "silu"])
def test_gemm_multi_block_split_k(n, k, group_size, n_tiles, max_m, m, splits, silu, gen, device):
    """Several M blocks, each split along K (the partials of M block x land in rows 8 NT x.. of the
    [S, M, N] scratch, one arrival counter per (M block, row block) tile): every row written once,
    counters back at zero, the same tolerance (each element's sum is unchanged)."""
    from nanoqwen_kernels.gemm import GemmPlan

    plan = GemmPlan.of(n, k, group_size, n_tiles, max_m, splits)
    assert plan.splits > 1 and plan.m_blocks(m) > 1 and plan.counters == plan.m_blocks(max_m) * plan.blocks_n
    w = random_int4(n, k, group_size, False, gen, device)
    x = torch.randn(m, 2 * k if silu else k, generator=gen, device=device).to(torch.bfloat16)
    bias = None if silu else torch.randn(n, generator=gen, device=device).to(torch.bfloat16)
    R.assert_close(run_gemm(x, w, bias, plan, silu=silu), reference_out(x, w, bias, silu=silu),
                   f"gemm NT={n_tiles} x {plan.m_blocks(m)} blocks, {plan.splits} splits, M={m}")


@pytest.mark.parametrize("m", [9, 33, 64, 100])
@pytest.mark.parametrize("n,k,group_size", [(3584, 18944, 128), (40, 640, 32), (136, 1152, 64)])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_gemm_fused_silu_mul_input(m, n, k, group_size, symmetric, gen, device):
    w = random_int4(n, k, group_size, symmetric, gen, device)
    gate_up = torch.randn(m, 2 * k, generator=gen, device=device).to(torch.bfloat16)
    out = run_gemm(gate_up, w, None, silu=True)
    R.assert_close(out, reference_out(gate_up, w, None, silu=True), f"gemm silu_mul input M={m}")


@pytest.mark.parametrize("m,multi_block", [(16, False), (64, False), (300, False), (47, True)])
def test_gemm_repeated_launches_and_graph_replay(m, multi_block, gen, device):
    """Counters return to zero (split-K at M <= 64, also with several M blocks): launches in a row and
    a captured graph replayed with new inputs stay correct."""
    from nanoqwen_kernels.gemm import GemmPlan, allocate_workspace, gemm_int4, plan_gemm
    from nanoqwen_kernels.launch import warm_up

    n, k = 3584, 18944
    w = random_int4(n, k, 128, True, gen, device)
    plan = plan_gemm(n, k, m, 128, device)
    if multi_block:
        plan = GemmPlan.of(n, k, 128, 4, 64, 4)
        assert plan.m_blocks(m) == 2
    assert (plan.splits > 1) == (m <= 64)
    ws = allocate_workspace([plan], device)
    x = torch.empty(m, k, dtype=torch.bfloat16, device=device)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=device)
    warm_up(["gemm"], device)
    for _ in range(2):
        x.copy_(torch.randn(m, k, generator=gen, device=device))
        out.fill_(float("nan"))
        gemm_int4(x, w, out, workspace=ws, plan=plan)
        R.assert_close(out, reference_out(x, w, None), "repeated gemm")
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        gemm_int4(x, w, out, workspace=ws, plan=plan)
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(3):  # back to back on one workspace
                gemm_int4(x, w, out, workspace=ws, plan=plan)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(2):
        x.copy_(torch.randn(m, k, generator=gen, device=device))
        out.fill_(float("nan"))
        graph.replay()
        R.assert_close(out, reference_out(x, w, None), "gemm graph replay")
    assert int(ws.counters.abs().sum()) == 0


def test_gemm_matches_gemv_bitwise_per_row(gen, device):
    """Same arithmetic per element as the GEMV (the tolerance argument above): with the same split-K
    plan shape the mma.sync kernel's 9-row GEMM equals the GEMV run on rows 0..7 and row 8, bit for bit.
    (Not the wgmma kernel: its two consumer sets sum the even and the odd tile-columns apart, then add,
    as a 2-way K split does; test_gemm_wgmma.py holds it to the same tolerance.)"""
    from nanoqwen_kernels.gemm import GemmPlan
    from nanoqwen_kernels.gemv import GemvPlan, GemvWorkspace, gemv_int4

    n, k = 4608, 3584
    w = random_int4(n, k, 128, False, gen, device)
    x = torch.randn(9, k, generator=gen, device=device).to(torch.bfloat16)
    plan = GemmPlan.of(n, k, 128, 2, 16, 1)
    assert (plan.kernel, plan.splits, plan.kc) == ("mma", 1, k // 128)
    got = run_gemm(x, w, None, plan)
    gplan = GemvPlan(n, k, 1, k // 128)
    want = torch.empty(9, n, dtype=torch.bfloat16, device=device)
    ws = GemvWorkspace.allocate([gplan], device)
    gemv_int4(x[:8], w, want[:8], workspace=ws, plan=gplan)
    gemv_int4(x[8:], w, want[8:], workspace=ws, plan=gplan)
    assert torch.equal(got, want)


def test_gemm_rejects_bad_inputs(gen, device):
    from nanoqwen_kernels.gemm import gemm_int4, plan_gemm

    w = random_int4(24, 384, 128, True, gen, device)
    out = torch.empty(20, 24, dtype=torch.bfloat16, device=device)
    with pytest.raises(TypeError, match="dtype"):
        gemm_int4(torch.randn(20, 384, device=device), w, out)
    with pytest.raises(ValueError, match="shape"):
        gemm_int4(torch.randn(20, 256, device=device).to(torch.bfloat16), w, out)
    with pytest.raises(ValueError, match="M <= 16"):
        x = torch.randn(20, 384, device=device).to(torch.bfloat16)
        gemm_int4(x, w, out, plan=plan_gemm(24, 384, 16, 128, device))
    with pytest.raises(ValueError, match="plan is for"):
        x = torch.randn(20, 384, device=device).to(torch.bfloat16)
        gemm_int4(x, w, out, plan=plan_gemm(24, 384, 20, 64, device))
