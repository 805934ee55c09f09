"""CPU: GEMV planning (every K tile-column in exactly one split, no empty split, enough blocks) and
the clear error a launcher gives for a tensor that is not on an sm_90 GPU."""

from __future__ import annotations

import pytest
import torch
from nanoqwen_kernels import gemv, layer_ops, sampling
from nanoqwen_kernels.launch import UnsupportedDeviceError, require_sm90

SHAPES = [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944), (152064, 3584), (8, 128), (200, 640),
          (55296, 5120), (5120, 27648), (152064, 8192)]  # fmt: skip


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("target", [1, 2, 3, 4, 6, 10_000])
def test_plan_covers_k_exactly(n, k, target):
    plan = gemv.plan_shape(n, k, 132, target)
    kt = k // 128
    assert plan.splits >= 1 and plan.kc >= 1
    assert plan.splits * plan.kc >= kt  # every tile-column is covered
    assert (plan.splits - 1) * plan.kc < kt  # the last split is not empty
    assert plan.blocks_n == -(-n // gemv.ROWS_PER_BLOCK)
    if plan.splits == 1:
        assert plan.workspace_floats(8) == 0
    else:
        assert plan.workspace_floats(8) == plan.splits * 8 * n
    # shared memory of the staged activations fits the 227 KB a block may use
    assert plan.shared_bytes(8) <= 100 * 1024


def test_plan_splits_small_n_and_not_large_n():
    assert gemv.plan_shape(3584, 18944, 132).splits > 1  # down: 28 row blocks alone leave SMs idle
    assert gemv.plan_shape(152064, 3584, 132).splits == 1  # lm_head: 1188 row blocks


def test_workspace_sized_from_all_plans():
    plans = [gemv.plan_shape(n, k, 132) for n, k in SHAPES]
    ws = gemv.GemvWorkspace.allocate(plans, torch.device("cpu"))
    assert ws.partials.numel() == max(p.workspace_floats(8) for p in plans)
    assert ws.counters.numel() == max(p.blocks_n for p in plans)
    assert int(ws.counters.abs().sum()) == 0


def test_cpu_tensors_get_a_clear_error():
    with pytest.raises(UnsupportedDeviceError, match="CUDA tensors"):
        require_sm90(torch.device("cpu"))
    x = torch.zeros(2, 64, dtype=torch.bfloat16)
    with pytest.raises(UnsupportedDeviceError):
        layer_ops.rms_norm(x, torch.zeros(64, dtype=torch.bfloat16), torch.empty_like(x), 1e-6)
    with pytest.raises(UnsupportedDeviceError):
        sampling.sample_tokens(
            x, sampling.SamplingState.allocate(2, "cpu"), torch.empty(2, dtype=torch.int32)
        )
