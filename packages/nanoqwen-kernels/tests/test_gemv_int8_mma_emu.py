"""The g128 GEMVs on the int8 tensor cores (the opt-in build `gemv.register_int8_mma()`) on the CPU
emulator (nanoqwen_kernels.testing.emu): the checks of int8_mma_testkit.py (what must hold, and why, is
written there), and the rounding's documented bound (reference.int8_planes_input).

Shapes reach the loop's branches (an odd tile count, odd and even columns per block, K split and not,
M = 1, 5, 8), for symmetric and asymmetric weights with bf16 and fp16
scales. The GPU runs the same checks at the 7B shapes (test_gemv_int8_mma.py).
"""

from __future__ import annotations

import functools
import zlib

import int8_mma_testkit as kit
import pytest
import torch
from attention_merge_testkit import check_merge_prologue_equals_combine
from int4_testkit import kc_plan
from nanoqwen_kernels import layer_ops
from nanoqwen_kernels import reference as R
from nanoqwen_kernels.testing import emu

pytestmark = pytest.mark.usefixtures("emu_compiler")
CPU = torch.device("cpu")
LAYOUTS = [(False, torch.bfloat16), (True, torch.bfloat16), (False, torch.float16), (True, torch.float16)]
LAYOUT_IDS = ["asym", "sym", "asym-f16s", "sym-f16s"]
TWO_LAYOUTS, TWO_LAYOUT_IDS = [LAYOUTS[0], LAYOUTS[3]], [LAYOUT_IDS[0], LAYOUT_IDS[3]]
LAUNCH = functools.partial(emu.emulated, sms=4)


@pytest.fixture
def gen(request) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


# (n, k, kc, m): n = 136 is 17 tiles (the last warp has tile 0 only); kc odd / even / a last split of one
# column; k = 128 * kc: unsplit
PLAIN_CASES = [(136, 384, 3, 1), (136, 512, 4, 5), (264, 896, 3, 8), (256, 1024, 2, 3), (136, 640, 5, 8)]


@pytest.mark.parametrize("symmetric,scale_dtype", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("n,k,kc,m", PLAIN_CASES)
def test_plain_gemv_matches_the_rounded_input_reference(n, k, kc, m, symmetric, scale_dtype, gen,
                                                        int8_family):
    kit.check_plain(n, k, kc_plan(n, k, kc), m, symmetric, scale_dtype, gen, CPU, LAUNCH, family=int8_family)


@pytest.mark.parametrize("symmetric,scale_dtype", TWO_LAYOUTS, ids=TWO_LAYOUT_IDS)
def test_silu_input_gemv_matches_its_reference(symmetric, scale_dtype, gen, int8_family):
    kit.check_plain(264, 1152, kc_plan(264, 1152, 3), 5, symmetric, scale_dtype, gen, CPU, LAUNCH, silu=True,
                    family=int8_family)


def test_the_rounding_stays_within_its_documented_bound():
    gen = torch.Generator().manual_seed(7)
    x = kit.wide_range_x(6, 1024, gen, CPU)
    x[0, :128] = 0.0  # an all-zero group
    x[1, 128:256] = torch.tensor(1e-38).to(torch.bfloat16)  # below the clamp (e = 15)
    xq = R.int8_planes_input(x).double().view(6, 8, 128)
    xd = x.double().view(6, 8, 128)
    gmax = xd.abs().amax(dim=2, keepdim=True)
    err = (xq - xd).abs()
    normal = (gmax >= 2.0**-112).expand_as(err)  # the groups above the clamp
    assert bool((err <= 2.0**-15 * gmax)[normal].all())
    assert bool((err[normal & (xd.abs() >= 2.0**-7 * gmax)] == 0).all())
    assert bool((xq[0, 0] == 0).all())
    assert bool((err[1, 1] <= 2.0**-127).all()), "below the clamp: multiples of 2^-126"


def test_a_non_finite_group_makes_its_row_nan(gen, int8_family):
    kit.check_non_finite_rows(gen, CPU, LAUNCH, family=int8_family)


@pytest.mark.parametrize("symmetric,scale_dtype", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("silu", [False, True], ids=["o", "down"])
def test_residual_epilogue_equals_plain_then_add(silu, symmetric, scale_dtype, gen, int8_family):
    """o: K split, even kc, M = 1; down: the SiLU*mul input, K split, odd kc, M = 5."""
    n, k, kc, m = (264, 1152, 3, 5) if silu else (256, 1024, 2, 1)
    kit.check_residual_epilogue(n, k, kc_plan(n, k, kc), m, silu, symmetric, scale_dtype, gen, CPU, LAUNCH,
                                family=int8_family)


@pytest.mark.parametrize("symmetric,scale_dtype", LAYOUTS, ids=LAYOUT_IDS)
def test_norm_prologue_equals_rms_norm_then_plain(symmetric, scale_dtype, gen, int8_family):
    """gate_up's kernel: unsplit, an odd tile count, M = 8."""
    kit.check_norm_prologue(392, 640, kc_plan(392, 640, 5), 8, symmetric, scale_dtype, gen, CPU, LAUNCH,
                            family=int8_family)


@pytest.mark.parametrize("symmetric,scale_dtype", TWO_LAYOUTS, ids=TWO_LAYOUT_IDS)
def test_qkv_epilogue_equals_plain_then_rope_kv_write(symmetric, scale_dtype, gen, int8_family):
    """K split with an odd kc, M = 5."""
    shape = layer_ops.AttentionShape(4, 2, 64)
    kit.check_qkv_epilogue(shape, 640, kc_plan(shape.qkv_width, 640, 3), 5, symmetric, scale_dtype, gen, CPU,
                           LAUNCH, family=int8_family)


def test_merge_prologue_equals_combine_then_resid(request, int8_family):
    seed = zlib.crc32(request.node.nodeid.encode()) % 100_000
    with emu.emulated(sms=132, seed=seed, timeout_s=60.0):
        check_merge_prologue_equals_combine((8, 2, 128), [1, 64, 129, 333, 512, 0], CPU, max_context_len=512,
                                            seed=seed, family=int8_family)
