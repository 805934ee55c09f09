"""GPU: INT4 GEMV (decode, M = 1..8), its split-K path, the fused SiLU*mul input, the "stream" variant
(K split inside a block), dequantize, and the prefill linear, against the fp32 torch reference on fresh
random weights, at the Qwen2.5-Coder-7B shapes and at odd shapes. Outputs are NaN-poisoned before each
launch; the stream variant's tests also check NaN guard regions on both sides of the output."""

from __future__ import annotations

import pytest
import torch
from nanoqwen_kernels import reference as R

pytestmark = pytest.mark.gpu

# (name, N, K) of the 7B decode projections: qkv, o, gate+up, down, lm_head
SHAPES_7B = [
    ("qkv", 4608, 3584),
    ("o", 3584, 3584),
    ("gate_up", 37888, 3584),
    ("down", 3584, 18944),
    ("lm_head", 152064, 3584),
]
ODD_SHAPES = [(8, 128), (24, 384), (200, 640), (1000, 1152), (136, 4096)]


def random_int4(n, k, group_size, symmetric, gen, device):
    """A random Int4Weight whose outputs are O(1) for N(0, 1) inputs: every bit pattern of the packed
    words is a valid weight, so the words are random bytes."""
    from nanoqwen_kernels.gemv import Int4Weight

    words = torch.randint(0, 256, (n * k // 2,), generator=gen, device=device, dtype=torch.uint8)
    qweight = words.view(torch.int32).reshape(n // 8, k // 128, 32, 4)
    base = 1.0 / (4.6 * k**0.5)
    scales = (base * (0.5 + torch.rand(n, k // group_size, generator=gen, device=device))).to(torch.bfloat16)
    zeros = None
    if not symmetric:
        zeros = torch.randint(0, 16, (n, k // group_size), generator=gen, device=device, dtype=torch.uint8)
    return Int4Weight(qweight, scales, zeros, n, k, group_size)


def reference_out(x, w, bias, silu=False):
    dense = R.dequantize_int4(w.qweight, w.scales, w.zeros, w.group_size)
    xin = R.silu_mul(x).to(torch.bfloat16) if silu else x
    return R.linear(xin, dense, bias)


def run_gemv(x, w, bias, plan=None, silu=False):
    """Launch with a fresh workspace into a NaN-poisoned output; returns (out, workspace)."""
    from nanoqwen_kernels.gemv import GemvWorkspace, gemv_int4, plan_gemv

    plan = plan or plan_gemv(w.n, w.k, x.device)
    ws = GemvWorkspace.allocate([plan], x.device)
    out = torch.full((x.shape[0], w.n), float("nan"), dtype=torch.bfloat16, device=x.device)
    gemv_int4(x, w, out, bias=bias, workspace=ws, plan=plan, silu_mul_input=silu)
    return out, ws


@pytest.mark.parametrize("name,n,k", SHAPES_7B, ids=[s[0] for s in SHAPES_7B])
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_gemv_7b_shapes(name, n, k, m, symmetric, gen, device):
    if name == "lm_head" and m == 3:
        pytest.skip("lm_head: M = 1 and 8 cover it; the fp32 reference is 2 GB")
    w = random_int4(n, k, 128, symmetric, gen, device)
    x = torch.randn(m, k, generator=gen, device=device).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen, device=device).to(torch.bfloat16) if name == "qkv" else None
    out, ws = run_gemv(x, w, bias)
    R.assert_close(out, reference_out(x, w, bias), f"gemv {name} M={m}")
    assert int(ws.counters.abs().sum()) == 0, "split-K counters not reset"


@pytest.mark.parametrize("n,k", ODD_SHAPES)
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("m", [1, 2, 5, 8])
@pytest.mark.parametrize("split", [False, True], ids=["auto", "forced_split"])
def test_gemv_odd_shapes(n, k, group_size, symmetric, m, split, gen, device):
    from nanoqwen_kernels.gemv import plan_shape

    w = random_int4(n, k, group_size, symmetric, gen, device)
    x = torch.randn(m, k, generator=gen, device=device).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen, device=device).to(torch.bfloat16)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    plan = plan_shape(n, k, sms, target_blocks_per_sm=10_000) if split else None
    if split and k > 128:
        assert plan.splits > 1
    out, ws = run_gemv(x, w, bias, plan)
    R.assert_close(out, reference_out(x, w, bias), f"gemv [{n}, {k}] g{group_size} M={m}")
    assert int(ws.counters.abs().sum()) == 0


@pytest.mark.parametrize("m", [1, 4, 8])
@pytest.mark.parametrize("n,k", [(3584, 18944), (40, 640)])
def test_gemv_fused_silu_mul_input(m, n, k, gen, device):
    w = random_int4(n, k, 128, False, gen, device)
    gate_up = torch.randn(m, 2 * k, generator=gen, device=device).to(torch.bfloat16)
    out, _ = run_gemv(gate_up, w, None, silu=True)
    R.assert_close(out, reference_out(gate_up, w, None, silu=True), "gemv silu_mul input")


def test_gemv_repeated_launches_and_graph_replay(gen, device):
    """Split-K counters return to zero: many launches in a row and a captured graph stay correct."""
    from nanoqwen_kernels.gemv import GemvWorkspace, gemv_int4, plan_gemv
    from nanoqwen_kernels.launch import warm_up

    n, k = 3584, 18944
    w = random_int4(n, k, 128, True, gen, device)
    plan = plan_gemv(n, k, device)
    assert plan.splits > 1
    ws = GemvWorkspace.allocate([plan], device)
    x = torch.empty(2, k, dtype=torch.bfloat16, device=device)
    out = torch.empty(2, n, dtype=torch.bfloat16, device=device)
    warm_up(["gemv"], device)
    for _ in range(3):
        x.copy_(torch.randn(2, k, generator=gen, device=device))
        out.fill_(float("nan"))
        gemv_int4(x, w, out, workspace=ws, plan=plan)
        R.assert_close(out, reference_out(x, w, None), "repeated gemv")
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        gemv_int4(x, w, out, workspace=ws, plan=plan)  # warm on the capture stream
        with torch.cuda.graph(graph, stream=stream):
            gemv_int4(x, w, out, workspace=ws, plan=plan)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(2):
        x.copy_(torch.randn(2, k, generator=gen, device=device))
        out.fill_(float("nan"))
        graph.replay()
        R.assert_close(out, reference_out(x, w, None), "gemv graph replay")


@pytest.mark.parametrize("n,k,group_size,symmetric", [(4608, 3584, 128, True), (200, 640, 32, False)])
def test_dequantize_is_exact(n, k, group_size, symmetric, gen, device):
    from nanoqwen_kernels.gemv import dequantize_int4

    w = random_int4(n, k, group_size, symmetric, gen, device)
    out = torch.full((n, k), float("nan"), dtype=torch.bfloat16, device=device)
    dequantize_int4(w, out)
    ref = R.dequantize_int4(w.qweight, w.scales, w.zeros, group_size).to(torch.bfloat16)
    assert torch.equal(out, ref)  # (q - z) * s is exact in fp32: one rounding, same as torch's


@pytest.mark.parametrize("t", [1, 17, 512])
def test_linear_int4_prefill(t, gen, device):
    from nanoqwen_kernels.gemv import linear_int4_prefill

    n, k = 4608, 3584
    w = random_int4(n, k, 128, False, gen, device)
    x = torch.randn(t, k, generator=gen, device=device).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen, device=device).to(torch.bfloat16)
    out = torch.full((t, n), float("nan"), dtype=torch.bfloat16, device=device)
    scratch = torch.empty(n, k, dtype=torch.bfloat16, device=device)
    linear_int4_prefill(x, w, out, scratch, bias)
    # cuBLAS sums bf16 products in fp32 over the rounded bf16 weight: compare against the same weight
    dense = R.dequantize_int4(w.qweight, w.scales, w.zeros, 128).to(torch.bfloat16)
    R.assert_close(out, R.linear(x, dense, bias), "prefill linear")


def test_gemv_rejects_bad_inputs(gen, device):
    from nanoqwen_kernels.gemv import gemv_int4

    w = random_int4(24, 384, 128, True, gen, device)
    out = torch.empty(1, 24, dtype=torch.bfloat16, device=device)
    with pytest.raises(ValueError, match="1..8 rows"):
        gemv_int4(torch.randn(9, 384, device=device).to(torch.bfloat16), w, torch.empty(9, 24, device=device))
    with pytest.raises(TypeError, match="dtype"):
        gemv_int4(torch.randn(1, 384, device=device), w, out)
    with pytest.raises(ValueError, match="shape"):
        gemv_int4(torch.randn(1, 256, device=device).to(torch.bfloat16), w, out)
    with pytest.raises(ValueError, match="contiguous"):
        xt = torch.randn(384, 2, device=device).to(torch.bfloat16).t()
        gemv_int4(xt, w, torch.empty(2, 24, dtype=torch.bfloat16, device=device))


# ---------------------------------------------------------------------------------------------------
# "stream" variant (csrc/gemv_int4_stream.cuh): plan_gemv(..., variant="stream")
# ---------------------------------------------------------------------------------------------------

GUARD = 4096  # poisoned bf16 elements on each side of the output: a stray write lands in one


def run_stream(x, w, bias, plan, silu=False):
    """Launch the stream variant (no workspace: it must not need one) into a NaN-poisoned output that
    sits between two NaN-poisoned guard regions; fails if a guard element was written."""
    from nanoqwen_kernels.gemv import gemv_int4

    m = x.shape[0]
    assert plan.uses_stream(m), (plan, m)
    buf = torch.full((2 * GUARD + m * w.n,), float("nan"), dtype=torch.bfloat16, device=x.device)
    out = buf[GUARD : GUARD + m * w.n].view(m, w.n)
    gemv_int4(x, w, out, bias=bias, workspace=None, plan=plan, silu_mul_input=silu)
    guards = torch.cat([buf[:GUARD], buf[GUARD + m * w.n :]])
    assert torch.isnan(guards.float()).all(), "stream GEMV wrote outside its output"
    return out


@pytest.mark.parametrize("name,n,k", SHAPES_7B, ids=[s[0] for s in SHAPES_7B])
@pytest.mark.parametrize("m", [1, 2, 8])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_gemv_stream_7b_shapes(name, n, k, m, symmetric, gen, device):
    from nanoqwen_kernels.gemv import plan_gemv

    if name == "lm_head" and m == 2:
        pytest.skip("lm_head: M = 1 and 8 cover it; the fp32 reference is 2 GB")
    plan = plan_gemv(n, k, device, variant="stream")
    if not plan.uses_stream(m):
        assert name == "down" and m > 2, f"stream variant unexpectedly off for {name} M={m}: {plan}"
        pytest.skip(f"{name}: x of M = {m} rows exceeds the stream variant's staging budget")
    w = random_int4(n, k, 128, symmetric, gen, device)
    x = torch.randn(m, k, generator=gen, device=device).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen, device=device).to(torch.bfloat16) if name == "qkv" else None
    out = run_stream(x, w, bias, plan)
    R.assert_close(out, reference_out(x, w, bias), f"stream gemv {name} M={m} k_slices={plan.k_slices}")


@pytest.mark.parametrize("n,k", ODD_SHAPES)
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("k_slices", [None, 1, 2, 4, 8], ids=["auto", "s1", "s2", "s4", "s8"])
def test_gemv_stream_odd_shapes(n, k, group_size, symmetric, m, k_slices, gen, device):
    """Every k_slices the shape allows: slices of 1..32 tile-columns (not multiples of the ring depth),
    pairs with a missing second tile (N % 16 == 8), blocks whose last pairs are past N."""
    from nanoqwen_kernels.gemv import plan_gemv

    if k_slices is not None and k_slices > k // 128:
        pytest.skip(f"K = {k} has {k // 128} tile-columns: at most that many slices")
    plan = plan_gemv(n, k, device, variant="stream", k_slices=k_slices)
    w = random_int4(n, k, group_size, symmetric, gen, device)
    x = torch.randn(m, k, generator=gen, device=device).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen, device=device).to(torch.bfloat16)
    out = run_stream(x, w, bias, plan)
    what = f"stream gemv [{n}, {k}] g{group_size} M={m} k_slices={plan.k_slices}"
    R.assert_close(out, reference_out(x, w, bias), what)


@pytest.mark.parametrize(
    "m,n,k", [(1, 3584, 18944), (2, 3584, 18944), (1, 40, 640), (5, 40, 640), (8, 200, 1152)]
)
def test_gemv_stream_fused_silu_mul_input(m, n, k, gen, device):
    from nanoqwen_kernels.gemv import plan_gemv

    plan = plan_gemv(n, k, device, variant="stream")
    w = random_int4(n, k, 128, False, gen, device)
    gate_up = torch.randn(m, 2 * k, generator=gen, device=device).to(torch.bfloat16)
    out = run_stream(gate_up, w, None, plan, silu=True)
    R.assert_close(out, reference_out(gate_up, w, None, silu=True), f"stream gemv silu_mul input M={m}")


def test_gemv_stream_plan_dispatches_by_m(gen, device):
    """One stream plan serves M = 1..8: the stream kernel up to stream_max_m (down: 2 rows of x fit
    its shared-memory budget), the default split-K kernel above, both correct on the same plan."""
    from nanoqwen_kernels.gemv import GemvWorkspace, gemv_int4, plan_gemv

    n, k = 3584, 18944
    plan = plan_gemv(n, k, device, variant="stream")
    assert plan.stream_max_m == 2 and plan.uses_stream(2) and not plan.uses_stream(3)
    w = random_int4(n, k, 128, True, gen, device)
    ws = GemvWorkspace.allocate([plan], device)
    for m in (1, 3, 8):
        x = torch.randn(m, k, generator=gen, device=device).to(torch.bfloat16)
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=device)
        gemv_int4(x, w, out, workspace=ws, plan=plan)
        R.assert_close(out, reference_out(x, w, None), f"stream plan M={m}")
    assert int(ws.counters.abs().sum()) == 0
    with pytest.raises(ValueError, match="GemvWorkspace"):  # M = 3 runs the split-K kernel
        gemv_int4(torch.zeros(3, k, dtype=torch.bfloat16, device=device), w, out[:3], plan=plan)


def test_gemv_stream_deterministic_and_graph_replay(gen, device):
    """Launches in a row give bit-identical outputs (fixed slice order), and a captured graph replays
    correctly on new inputs (nothing in the variant carries state between launches)."""
    from nanoqwen_kernels.gemv import gemv_int4, plan_gemv
    from nanoqwen_kernels.launch import warm_up

    n, k = 4608, 3584
    plan = plan_gemv(n, k, device, variant="stream")
    assert plan.k_slices > 1
    w = random_int4(n, k, 128, False, gen, device)
    bias = torch.randn(n, generator=gen, device=device).to(torch.bfloat16)
    x = torch.randn(1, k, generator=gen, device=device).to(torch.bfloat16)
    out = torch.empty(1, n, dtype=torch.bfloat16, device=device)
    warm_up(["gemv"], device)
    first = None
    for _ in range(3):
        out.fill_(float("nan"))
        gemv_int4(x, w, out, bias=bias, plan=plan)
        first = out.clone() if first is None else first
        assert torch.equal(out, first), "stream GEMV is not deterministic"
    R.assert_close(first, reference_out(x, w, bias), "stream gemv repeated")
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        gemv_int4(x, w, out, bias=bias, plan=plan)
        with torch.cuda.graph(graph, stream=stream):
            gemv_int4(x, w, out, bias=bias, plan=plan)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(2):
        x.copy_(torch.randn(1, k, generator=gen, device=device))
        out.fill_(float("nan"))
        graph.replay()
        R.assert_close(out, reference_out(x, w, bias), "stream gemv graph replay")


def test_gemv_stream_default_switch(gen, device, monkeypatch):
    """STREAM_DEFAULT_MAX_M (the one-line switch): plan_gemv's default plans then run the stream kernel
    up to that M, which needs no workspace even where the default plan splits K; at 0 they do not."""
    from nanoqwen_kernels import gemv

    n, k = 3584, 18944
    w = random_int4(n, k, 128, True, gen, device)
    x = torch.randn(2, k, generator=gen, device=device).to(torch.bfloat16)
    out = torch.full((2, n), float("nan"), dtype=torch.bfloat16, device=device)
    assert gemv.STREAM_DEFAULT_MAX_M == 0 and gemv.plan_gemv(n, k, device).variant == "default"
    with pytest.raises(ValueError, match="GemvWorkspace"):
        gemv.gemv_int4(x[:1], w, out[:1])
    monkeypatch.setattr(gemv, "STREAM_DEFAULT_MAX_M", 1)
    plan = gemv.plan_gemv(n, k, device)
    assert plan.variant == "stream" and plan.stream_max_m == 1 and plan.splits > 1
    gemv.gemv_int4(x[:1], w, out[:1])  # plan=None -> plan_gemv -> stream kernel, no workspace
    R.assert_close(out[:1], reference_out(x[:1], w, None), "stream by default, M=1")
    with pytest.raises(ValueError, match="GemvWorkspace"):  # M = 2 stays on the split-K kernel
        gemv.gemv_int4(x, w, out)
