"""The INT4 GEMM's two kernels on the CPU emulator (nanoqwen_kernels.testing.emu: the kernels' own CUDA
source compiled for the host): the mma.sync kernel (csrc/gemm_int4.cuh: cp.async copies that land late,
ldmatrix and mma.sync gathering the warp's fragments) and the wgmma kernel (csrc/gemm_int4_ws.cuh: the
producer warp's TMA boxes landing late on the ring's mbarriers, 128-byte swizzle, wgmma reading B through
its descriptor, the consumer sets' named barriers). In both the split-K blocks race for their tile's
arrival counter. The checks are test_gemm.py's and test_gemm_wgmma.py's, the GPU tests' own, on smaller
cases: fresh random weights and inputs (seeded by the test's name), N not a multiple of 128 (the TMA box
reads rows past N as zeros), K / 128 odd, groups of 32 / 64 / 128, symmetric and not, bf16 and fp16
scales; a NaN-poisoned output with a poisoned guard after row M - 1 (every row written, nothing after)
and the split-K counters back at zero (int4_testkit.run_gemm); tolerance reference.TOLERANCES as
test_gemm.py derives it (the same arithmetic per element in both kernels; the prefill plan's against the
weight rounded to bf16 first, test_gemm_wgmma.py says why).

Covered: each M class (16 / 32 / 64 rows in one block) and M > 64 (several unsplit 64-row blocks), a
forced K split, several M blocks each split along K, the fused SiLU*mul input; the wgmma kernel at
every NT (the wgmma's N = 16, 32, 64, and 128 for prefill) with and without K splits.
The plans are made for `emulated(sms=4)`.
"""

from __future__ import annotations

import dataclasses
import zlib

import pytest
import torch
from int4_testkit import random_int4, reference_out, run_gemm
from nanoqwen_kernels import gemm
from nanoqwen_kernels import reference as R
from nanoqwen_kernels.testing import emu

pytestmark = pytest.mark.usefixtures("emu_compiler")
CPU = torch.device("cpu")


@pytest.fixture
def gen(request):
    g = torch.Generator()
    g.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    return g


@pytest.fixture
def emulated():
    with emu.emulated(sms=4, timeout_s=60.0):
        yield


def _inputs(n, k, m, group_size, symmetric, silu, gen, scale_dtype=torch.bfloat16):
    w = random_int4(n, k, group_size, symmetric, gen, CPU, scale_dtype)
    x = torch.randn(m, 2 * k if silu else k, generator=gen).to(torch.bfloat16)
    bias = None if silu else torch.randn(n, generator=gen).to(torch.bfloat16)
    return w, x, bias


@pytest.mark.parametrize("n,k,group_size", [(24, 384, 128), (200, 640, 32), (136, 1152, 64)])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("m", [9, 17, 40, 64, 65, 130])
def test_gemm_odd_shapes(n, k, group_size, symmetric, m, gen, emulated):
    w, x, bias = _inputs(n, k, m, group_size, symmetric, False, gen)
    plan = gemm.plan_gemm(n, k, m, group_size, CPU)
    assert plan.kernel == "mma" and plan.max_m == gemm.m_class(m)
    R.assert_close(run_gemm(x, w, bias, plan), reference_out(x, w, bias),
                   f"gemm [{n}, {k}] g{group_size} M={m}")


@pytest.mark.parametrize("m", [9, 40, 100])
@pytest.mark.parametrize("silu", [False, True], ids=["plain", "silu"])
def test_gemm_fp16_scales(m, silu, gen, emulated):
    w, x, bias = _inputs(136, 1152, m, 64, False, silu, gen, torch.float16)
    assert w.kernel_suffix().endswith("_f16s")
    R.assert_close(run_gemm(x, w, bias, silu=silu), reference_out(x, w, bias, silu=silu), f"gemm f16s M={m}")


@pytest.mark.parametrize("m", [9, 33, 64])
def test_gemm_forced_split(m, gen, emulated):
    w, x, bias = _inputs(200, 1152, m, 128, False, False, gen)
    plan = gemm.plan_gemm(200, 1152, m, 128, CPU).with_splits(9)
    assert plan.splits > 1
    R.assert_close(run_gemm(x, w, bias, plan), reference_out(x, w, bias), f"gemm split {plan.splits} M={m}")


@pytest.mark.parametrize("n_tiles,max_m,m", [(4, 64, 47), (2, 32, 17), (2, 64, 50)])
@pytest.mark.parametrize("silu", [False, True], ids=["plain", "silu"])
def test_gemm_multi_block_split_k(n_tiles, max_m, m, silu, gen, emulated):
    """Several M blocks, each split along K: the partials of M block x land in its rows of the
    [S, M, N] scratch, one arrival counter per (M block, row block) tile."""
    plan = gemm.GemmPlan.of(136, 1152, 64, n_tiles, max_m, 3)
    assert plan.splits > 1 and plan.m_blocks(m) > 1
    w, x, bias = _inputs(136, 1152, m, 64, False, silu, gen)
    R.assert_close(run_gemm(x, w, bias, plan, silu=silu), reference_out(x, w, bias, silu=silu),
                   f"gemm NT={n_tiles} x {plan.m_blocks(m)} blocks, {plan.splits} splits, M={m}")


def wgmma_plan(n, k, m, group_size, splits):
    mc = gemm.m_class(m)
    return gemm.GemmPlan.of(n, k, group_size, mc // 8, mc, splits, kernel="wgmma")


@pytest.mark.parametrize("n,k", [(24, 384), (200, 640), (136, 1152)])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("m,splits", [(13, 1), (40, 2), (64, 3)])
def test_wgmma_odd_shapes(n, k, group_size, symmetric, m, splits, gen, emulated):
    w, x, bias = _inputs(n, k, m, group_size, symmetric, False, gen)
    plan = wgmma_plan(n, k, m, group_size, splits)
    R.assert_close(run_gemm(x, w, bias, plan), reference_out(x, w, bias),
                   f"wgmma [{n}, {k}] g{group_size} M={m} S={plan.splits}")


@pytest.mark.parametrize("group_size", [32, 128])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_wgmma_fp16_scales(group_size, symmetric, gen, emulated):
    w, x, _ = _inputs(200, 1152, 50, group_size, symmetric, False, gen, torch.float16)
    assert w.kernel_suffix().endswith("_f16s")
    R.assert_close(run_gemm(x, w, None, wgmma_plan(200, 1152, 50, group_size, 2)), reference_out(x, w, None),
                   f"wgmma f16s g{group_size}")


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_wgmma_prefill_stream_k_shares_tiles(symmetric, gen, emulated):
    """The prefill plan's stream-K launch (above 128 rows, where `prefill_stream_k_pays`; forced here):
    [24, 640] at M = 129 is 2 tiles x 5 tile-columns over 4 blocks of 3 units, so tile 1 is shared by
    blocks 1, 2 and 3, and block 1 leaves a partial of each tile (both of its slots); the last to arrive
    sums three partials in block order."""
    plan = dataclasses.replace(gemm.plan_gemm_prefill(24, 640, 129, 128, 4), stream_k_blocks=4)
    assert plan.grid(129) == (4, 1, 1) and plan.units_per_block(129) == 3
    w, x, bias = _inputs(24, 640, 129, 128, symmetric, False, gen)
    R.assert_close(run_gemm(x, w, bias, plan), reference_out(x, w, bias, bf16_weight=True),
                   "wgmma prefill stream-K")


@pytest.mark.parametrize("group_size", [32, 128])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_wgmma_prefill_fp16_scales(group_size, symmetric, gen, emulated):
    """The prefill plan scales fp16 scales in fp32 (bf16 ones with one bf16x2 multiply): the same
    round((q - z) s)."""
    w, x, bias = _inputs(200, 1152, 150, group_size, symmetric, False, gen, torch.float16)
    plan = gemm.plan_gemm_prefill(200, 1152, 150, group_size, 4)
    R.assert_close(run_gemm(x, w, bias, plan), reference_out(x, w, bias, bf16_weight=True),
                   f"wgmma prefill f16s g{group_size}")


def test_wgmma_tensor_maps_are_the_emulators_own(gen):
    """Inside emulated() the GEMM's tensor maps come from the emulator (the driver is not there); outside,
    cuda_driver's own function is back."""
    from nanoqwen_kernels import cuda_driver

    real = cuda_driver.tensor_map_2d
    with emu.emulated(sms=4):
        assert cuda_driver.tensor_map_2d is emu.tensor_map_2d
        m = cuda_driver.tensor_map_2d_bf16(1 << 20, 40, 640, 16, 64)
        assert len(bytes(m)) == 128 and int.from_bytes(bytes(m)[:8], "little") == emu.TENSOR_MAP_MAGIC
        with pytest.raises(cuda_driver.CudaDriverError, match="misaligned"):
            cuda_driver.tensor_map_2d_bf16((1 << 20) + 8, 40, 640, 16, 64)
    assert cuda_driver.tensor_map_2d is real


@pytest.mark.parametrize("n,k", [(24, 384), (200, 640), (136, 1152)])
@pytest.mark.parametrize("group_size", [32, 128])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("m", [65, 128, 129, 300])
def test_wgmma_prefill_blocks_of_128_rows(n, k, group_size, symmetric, m, gen, emulated):
    """plan_gemm_prefill: NT = 16 (the wgmma's N = 128, one consumer set, 384 threads); up to 128 rows
    one M block split along K, above several M blocks unsplit; rows past M and N read as zeros."""
    plan = gemm.plan_gemm_prefill(n, k, m, group_size, 4)
    assert plan.kernel == "wgmma" and plan.n_tiles == 16 and plan.threads == 384
    assert (plan.max_m, plan.m_blocks(m)) == ((128, 1) if m <= 128 else (None, -(-m // 128)))
    w, x, bias = _inputs(n, k, m, group_size, symmetric, False, gen)
    R.assert_close(run_gemm(x, w, bias, plan), reference_out(x, w, bias, bf16_weight=True),
                   f"wgmma NT=16 [{n}, {k}] g{group_size} M={m} S={plan.splits}")
