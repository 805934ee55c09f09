"""The g128 GEMVs' staged scale records (csrc/gemv_int4.cuh `ScaleStager`: the scales and zero pairs of a
block's rows in shared memory, two tile-columns per loop trip; the opt-in build `gemv.register_staged()`)
on the CPU emulator (nanoqwen_kernels.emu).

The staged loop does the per-column loop's arithmetic in the same order on the same operands, so the
check is bit for bit: every g128 entry kind the engine launches gives the same bits in the staged build
(-DNQ_GEMV_STAGED_SCALES=1, a second emulator library) as in the default one (the per-column loop).
The kinds: plain, SiLU
input + residual epilogue (down), norm prologue (gate_up), residual epilogue (o), norm prologue + RoPE /
paged K/V epilogue (qkv). The shapes reach each branch of the staged loop: an odd tile count (the last
warp has no tile 1: its records are those of rows past N), an odd and an even number of tile-columns per
block (the loop's tail column, and none), K split and not, more columns than one batch of the records'
loads takes, M = 1, 5 and 8; symmetric and asymmetric, bf16 and fp16 scales. Outputs start NaN-poisoned
in both runs. A fp32-reference check of the plain
kernels is test_emu_cpu.py's; the GPU tests (test_gemv.py and the fused-kernel tests) run the same
kernels on the device.
"""

from __future__ import annotations

import zlib

import pytest
import torch
from int4_testkit import kc_plan, random_int4, same_bits
from nanoqwen_kernels import emu, gemv, layer_ops
from nanoqwen_kernels.gemv import GemvWorkspace, NormPrologue, ResidualEpilogue

pytestmark = pytest.mark.usefixtures("emu_compiler")
CPU = torch.device("cpu")
STAGED = gemv.STAGED_FAMILY


@pytest.fixture(scope="module", autouse=True)
def staged_family():
    """The staged build, registered for this module only (the registry is global: test_build.py
    parametrizes over it)."""
    from nanoqwen_kernels.specs import SPECS

    gemv.register_staged()
    yield
    del SPECS[STAGED]
LAYOUTS = [(False, torch.bfloat16), (True, torch.bfloat16), (False, torch.float16), (True, torch.float16)]
LAYOUT_IDS = ["asym", "sym", "asym-f16s", "sym-f16s"]


def _gen(request) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


# (n, k, kc, m): n = 136 is 17 tiles (the last warp has tile 0 only); kc odd / even / a last split of one
# column; k = 128 * kc: unsplit; kc = 21 > 2 x RECORD_BATCH (18): the records' second batch
PLAIN_CASES = [(136, 384, 3, 1), (136, 512, 4, 5), (264, 896, 3, 8), (256, 1024, 2, 3), (136, 640, 5, 8),
               (136, 2688, 21, 2)]


@pytest.mark.parametrize("symmetric,scale_dtype", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("n,k,kc,m", PLAIN_CASES)
def test_plain_gemv_staged_equals_per_column_loop(n, k, kc, m, symmetric, scale_dtype, request):
    gen = _gen(request)
    w = random_int4(n, k, 128, symmetric, gen, CPU, scale_dtype)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    plan = kc_plan(n, k, kc)
    outs = {}
    for family in (STAGED, "gemv"):
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
        with emu.emulated(sms=4, seed=m):
            gemv.gemv_int4(x, w, out, bias, workspace=GemvWorkspace.allocate([plan], CPU), plan=plan,
                           family=family)
        outs[family] = out
    assert not outs[STAGED].isnan().any()
    same_bits(outs[STAGED], outs["gemv"], f"staged vs per-column loop, plan {plan}")


def _norm(k: int, m: int, gen: torch.Generator) -> NormPrologue:
    """A norm prologue: weights near 1, and sums of squares per 128 columns of ~128 (unit rows), as a
    residual epilogue leaves them."""
    stats = 128 * (0.5 + torch.rand(gemv.norm_stats_shape(m, k), generator=gen))
    return NormPrologue((1 + 0.1 * torch.randn(k, generator=gen)).to(torch.bfloat16), stats, 1e-6)


@pytest.mark.parametrize("symmetric,scale_dtype", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("kind", ["down", "gate_up", "o"])
def test_fused_gemvs_staged_equal_per_column_loop(kind, symmetric, scale_dtype, request):
    """down: SiLU*mul input + residual epilogue (K split, odd kc); gate_up: norm prologue (unsplit, an
    odd tile count); o: residual epilogue (K split, even kc)."""
    gen = _gen(request)
    n, k, kc, m = {"down": (264, 1152, 3, 5), "gate_up": (392, 640, 5, 8), "o": (256, 1024, 2, 1)}[kind]
    w = random_int4(n, k, 128, symmetric, gen, CPU, scale_dtype)
    plan = kc_plan(n, k, kc)
    x = torch.randn(m, 2 * k if kind == "down" else k, generator=gen).to(torch.bfloat16)
    resid0 = torch.randn(m, n, generator=gen).to(torch.bfloat16)
    norm = None
    if kind == "gate_up":
        norm = _norm(k, m, gen)
    results = {}
    for family in (STAGED, "gemv"):
        ws = GemvWorkspace.allocate([plan], CPU)
        with emu.emulated(sms=4, seed=m):
            if kind == "gate_up":
                out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
                gemv.gemv_int4(x, w, out, workspace=ws, plan=plan, family=family, norm=norm)
                results[family] = (out,)
            else:
                res = ResidualEpilogue(resid0.clone(), torch.full(gemv.norm_stats_shape(m, n), float("nan")))
                gemv.gemv_int4(x, w, None, workspace=ws, plan=plan, silu_mul_input=kind == "down",
                               family=family, residual=res)
                results[family] = (res.residual, res.stats)
    for a, b in zip(results[STAGED], results["gemv"], strict=True):
        assert not a.isnan().any()
        same_bits(a, b, f"{kind}: staged vs per-column loop, plan {plan}")


@pytest.mark.parametrize("symmetric,scale_dtype", LAYOUTS, ids=LAYOUT_IDS)
def test_qkv_norm_rope_staged_equals_per_column_loop(symmetric, scale_dtype, request):
    """The qkv kernel (norm prologue + RoPE / paged K/V epilogue), K split with an odd kc, M = 5."""
    gen = _gen(request)
    shape = layer_ops.AttentionShape(4, 2, 64)
    n, k, m, block_size, blocks = shape.qkv_width, 640, 5, 16, 4
    w = random_int4(n, k, 128, symmetric, gen, CPU, scale_dtype)
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    norm = _norm(k, m, gen)
    positions = torch.randint(0, 4000, (m,), generator=gen, dtype=torch.int32)
    slots = torch.tensor([3, 17, -1, 40, 63], dtype=torch.int32)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    plan = kc_plan(n, k, 3)
    results = {}
    for family in (STAGED, "gemv"):
        q = torch.full((m, shape.n_heads, shape.head_dim), float("nan"), dtype=torch.bfloat16)
        kc, vc = (torch.full((blocks, shape.n_kv_heads, block_size, shape.head_dim), float("nan"),
                             dtype=torch.bfloat16) for _ in range(2))
        with emu.emulated(sms=4, seed=m):
            gemv.gemv_int4_qkv_rope(x, w, bias, shape, positions, slots, inv_freq, q, kc, vc,
                                    GemvWorkspace.allocate([plan], CPU), plan, family=family, norm=norm)
        results[family] = (q, kc, vc)
    assert not results[STAGED][0].isnan().any()
    for a, b, what in zip(results[STAGED], results["gemv"], ("q", "k cache", "v cache"), strict=True):
        same_bits(a, b, f"qkv {what}: staged vs per-column loop")
