"""GPU: the g128 GEMVs on the int8 tensor cores (the opt-in build `gemv.register_int8_mma()`) at the
Qwen2.5-Coder-7B decode shapes with the engine's plans, and at odd ones: the checks of
int8_mma_testkit.py (what must hold, and why, is written there), plus the merge prologue
(attention_merge_testkit). The emulator runs the same checks on small shapes (test_gemv_int8_mma_emu.py).
"""

from __future__ import annotations

import int8_mma_testkit as kit
import pytest
import torch
from attention_merge_testkit import check_merge_prologue_equals_combine
from nanoqwen_kernels import layer_ops
from nanoqwen_kernels.gemv import GemvPlan, plan_gemv

pytestmark = pytest.mark.gpu
LAYOUTS = [(False, torch.bfloat16), (True, torch.bfloat16), (False, torch.float16)]
LAYOUT_IDS = ["asym", "sym", "asym-f16s"]


# (name, N, K) of the 7B decode projections (down: the SiLU-input kernel), and odd shapes
SHAPES = [("qkv", 4608, 3584), ("o", 3584, 3584), ("gate_up", 37888, 3584), ("down", 3584, 18944),
          ("odd", 200, 640), ("odd", 1000, 1152), ("odd", 136, 4096)]


@pytest.mark.parametrize("symmetric,scale_dtype", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("name,n,k", SHAPES, ids=[f"{s[0]}-{s[1]}x{s[2]}" for s in SHAPES])
def test_plain_gemv_matches_the_rounded_input_reference(name, n, k, m, symmetric, scale_dtype, gen, device,
                                                        int8_family):
    silu = name == "down"
    kit.check_plain(n, k, plan_gemv(n, k, device, silu_input=silu), m, symmetric, scale_dtype, gen, device,
                    silu=silu, family=int8_family)


@pytest.mark.parametrize("m", [1, 8])
def test_forced_split_and_unsplit_plans(m, gen, device, int8_family):
    for plan in (GemvPlan(1000, 1152, 9, 1), GemvPlan(1000, 1152, 1, 9), GemvPlan(1000, 1152, 2, 5)):
        kit.check_plain(1000, 1152, plan, m, False, torch.bfloat16, gen, device, family=int8_family)


def test_a_non_finite_group_makes_its_row_nan(gen, device, int8_family):
    kit.check_non_finite_rows(gen, device, family=int8_family)


@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("name,n,k,silu", [("o", 3584, 3584, False), ("down", 3584, 18944, True)])
def test_residual_epilogue_equals_plain_then_add(name, n, k, silu, m, gen, device, int8_family):
    plan = plan_gemv(n, k, device, silu_input=silu)
    kit.check_residual_epilogue(n, k, plan, m, silu, False, torch.bfloat16, gen, device, family=int8_family)


@pytest.mark.parametrize("symmetric,scale_dtype", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("m", [1, 8])
def test_norm_prologue_equals_rms_norm_then_plain(m, symmetric, scale_dtype, gen, device, int8_family):
    plan = plan_gemv(37888, 3584, device)
    kit.check_norm_prologue(37888, 3584, plan, m, symmetric, scale_dtype, gen, device, family=int8_family)


@pytest.mark.parametrize("m", [1, 5, 8])
def test_qkv_epilogue_equals_plain_then_rope_kv_write(m, gen, device, int8_family):
    shape = layer_ops.AttentionShape(28, 4, 128)
    kit.check_qkv_epilogue(shape, 3584, plan_gemv(shape.qkv_width, 3584, device), m, False, torch.bfloat16,
                           gen, device, family=int8_family)


def test_merge_prologue_equals_combine_then_resid(device, int8_family):
    check_merge_prologue_equals_combine((28, 4, 128), [1, 64, 129, 333, 512, 0, 7, 300], device,
                                        max_context_len=512, family=int8_family)
