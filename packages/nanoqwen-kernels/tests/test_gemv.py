"""GPU: INT4 GEMV (decode, M = 1..8), its split-K path, the fused SiLU*mul input, dequantize, and the
prefill linear, against the fp32 torch reference (nanoqwen_model's INT4 codec, then an fp32 product)
on fresh random weights, at the Qwen2.5-Coder-7B shapes and at odd shapes. Outputs are NaN-poisoned
before each launch. Every comparison uses the tolerance table of reference.py (bf16 output: 2^-7
relative + 1e-4 absolute, derived there) or is exact.

The scale dtype is a parameter of the tables (ids `bf16_scales` / `fp16_scales`): fp16 scales are the
`int4-g{G}-tile8x128-f16s-v1` layout of imported GPTQ/AWQ checkpoints, with zero points 0..16. Widening
either scale type to f32 is exact, so the derivation of the tolerance is the same for both; select the
fp16 cases with `-k fp16_scales`."""

from __future__ import annotations

import pytest
import torch
from int4_testkit import random_int4, reference_out
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
# The 7B cases: every shape at M = 1, 3, 8, sym and asym, except lm_head at M = 3 (M = 1 and 8 cover
# its code paths; its fp32 reference is a 2 GB dense weight per case).
CASES_7B = [
    pytest.param(name, n, k, m, id=f"{name}-M{m}")
    for name, n, k in SHAPES_7B
    for m in (1, 3, 8)
    if not (name == "lm_head" and m == 3)
]
# fp16 scales at the 7B shapes: M = 1 and 8 cover the code paths (the odd-shape table covers every M)
CASES_7B_SCALES = [
    pytest.param(*c.values, dt, id=f"{c.id}-{dt_id}")
    for c in CASES_7B
    for dt, dt_id in ((torch.bfloat16, "bf16_scales"), (torch.float16, "fp16_scales"))
    if dt == torch.bfloat16 or c.values[3] != 3
]
SCALES = pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16],
                                 ids=["bf16_scales", "fp16_scales"])


def run_gemv(x, w, bias, plan=None, silu=False):
    """Launch with a fresh workspace into a NaN-poisoned output; returns (out, workspace)."""
    from nanoqwen_kernels.gemv import GemvWorkspace, gemv_int4, plan_gemv

    plan = plan or plan_gemv(w.n, w.k, x.device)
    ws = GemvWorkspace.allocate([plan], x.device)
    out = torch.full((x.shape[0], w.n), float("nan"), dtype=torch.bfloat16, device=x.device)
    gemv_int4(x, w, out, bias=bias, workspace=ws, plan=plan, silu_mul_input=silu)
    return out, ws


@pytest.mark.parametrize("name,n,k,m,scale_dtype", CASES_7B_SCALES)
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_gemv_7b_shapes(name, n, k, m, scale_dtype, symmetric, gen, device):
    w = random_int4(n, k, 128, symmetric, gen, device, scale_dtype)
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
@SCALES
def test_gemv_odd_shapes(n, k, group_size, symmetric, m, split, scale_dtype, gen, device):
    from nanoqwen_kernels.gemv import plan_shape

    w = random_int4(n, k, group_size, symmetric, gen, device, scale_dtype)
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
@SCALES
def test_gemv_fused_silu_mul_input(m, n, k, scale_dtype, gen, device):
    w = random_int4(n, k, 128, False, gen, device, scale_dtype)
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
            for _ in range(3):  # back to back on one workspace
                gemv_int4(x, w, out, workspace=ws, plan=plan)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(2):
        x.copy_(torch.randn(2, k, generator=gen, device=device))
        out.fill_(float("nan"))
        graph.replay()
        R.assert_close(out, reference_out(x, w, None), "gemv graph replay")


@pytest.mark.parametrize("n,k,group_size,symmetric", [(4608, 3584, 128, True), (200, 640, 32, False),
                                                      (136, 1024, 64, False)])
@SCALES
def test_dequantize_is_exact(n, k, group_size, symmetric, scale_dtype, gen, device):
    from nanoqwen_kernels.gemv import dequantize_int4

    w = random_int4(n, k, group_size, symmetric, gen, device, scale_dtype)
    out = torch.full((n, k), float("nan"), dtype=torch.bfloat16, device=device)
    dequantize_int4(w, out)
    ref = R.dequantize_int4(w.qweight, w.scales, w.zeros, group_size).to(torch.bfloat16)
    assert torch.equal(out, ref)  # (q - z) * s is exact in fp32: one rounding, same as torch's


@pytest.mark.parametrize("max_blocks", [1, 7])
def test_dequantize_on_few_blocks_is_exact(max_blocks, gen, device):
    """`max_blocks` (prefill_overlap.py's side-stream dequantisation): the blocks stride over every tile."""
    from nanoqwen_kernels.gemv import dequantize_int4

    w = random_int4(200, 640, 32, False, gen, device)
    out = torch.full((200, 640), float("nan"), dtype=torch.bfloat16, device=device)
    dequantize_int4(w, out, max_blocks=max_blocks)
    assert torch.equal(out, R.dequantize_int4(w.qweight, w.scales, w.zeros, 32).to(torch.bfloat16))
    with pytest.raises(ValueError, match="max_blocks"):
        dequantize_int4(w, out, max_blocks=0)


@pytest.mark.parametrize("t", [1, 17, 512])
@SCALES
def test_linear_int4_prefill(t, scale_dtype, gen, device):
    from nanoqwen_kernels.gemv import linear_int4_prefill

    n, k = 4608, 3584
    w = random_int4(n, k, 128, False, gen, device, scale_dtype)
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


def test_int4_weight_fp16_scales_dtype(gen, device):
    """Int4Weight takes bf16 or fp16 scales and refuses others; from_quantized keeps fp16 scales fp16
    (a -f16s QuantizedTensor's np.float16 scales must not be reinterpreted as bf16 bits)."""
    import nanoqwen_format as nqf
    import numpy as np
    from nanoqwen_kernels.gemv import Int4Weight

    w = random_int4(24, 384, 128, True, gen, device)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        Int4Weight(w.qweight, w.scales.float(), None, 24, 384, 128)
    rng = np.random.default_rng(0)
    s16 = rng.uniform(1e-3, 1e-1, (24, 3)).astype(np.float16)
    qt = nqf.int4.pack(rng.integers(0, 16, (24, 384), dtype=np.uint8), s16,
                       rng.integers(0, 17, (24, 3), dtype=np.uint8), 128, scale_dtype="f16")
    up = Int4Weight.from_quantized(qt, device)
    assert up.scales.dtype == torch.float16 and up.kernel_suffix() == "g128_asym_f16s"
    assert torch.equal(up.scales.cpu(), torch.from_numpy(s16))
