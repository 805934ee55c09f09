"""GPU: the o projection's attention merge prologue (`gemv.gemv_int4(..., merge=...)`, the `_merge_resid`
kernels) against the combine kernel + the `_resid` GEMV it replaces, bit for bit, on the 7B and 0.5B
head layouts and o_proj shapes: attention_merge_testkit.py has the checks and why they hold. Batches of
1, 2 and 8 decode rows mixing unsplit, split (up to 16 splits, the most the prologue takes), context-0
and in-kernel-merged rows; the engine's GEMV plans (K split) and an unsplit one.
"""

from __future__ import annotations

import pytest
import torch
from attention_merge_testkit import (
    check_defer_merge_is_refused_where_it_cannot_run,
    check_merge_prologue_equals_combine,
)

pytestmark = pytest.mark.gpu

HEADS = {"7b": (28, 4, 128), "0.5b": (14, 2, 64)}
CASES = [  # (geometry, context lengths, plan's max context, fuse_max_splits, GEMV plan, layout)
    ("7b", [777], 1024, 1, "auto", (128, False, torch.bfloat16)),
    ("7b", [130, 1], 1024, 1, "auto", (128, True, torch.bfloat16)),
    ("7b", [1, 64, 129, 1000, 512, 0, 333, 700], 1024, 1, "auto", (128, False, torch.float16)),
    ("7b", [1000, 65, 300, 2], 1024, 4, "auto", (64, True, torch.bfloat16)),
    ("0.5b", [1024, 5, 129, 640, 0], 1024, 1, "unsplit", (128, False, torch.bfloat16)),
    ("0.5b", [400, 90], 512, 1, "auto", (32, False, torch.float16)),
]


@pytest.mark.parametrize("geom, lens, max_ctx, fuse_max, gemv_split, layout", CASES,
                         ids=[f"{c[0]}-m{len(c[1])}-fuse{c[3]}-{c[4]}-g{c[5][0]}" for c in CASES])
def test_merge_prologue_equals_combine(geom, lens, max_ctx, fuse_max, gemv_split, layout, device):
    group_size, symmetric, scale_dtype = layout
    check_merge_prologue_equals_combine(HEADS[geom], lens, device, max_context_len=max_ctx, fuse_max=fuse_max,
                                        gemv_split=gemv_split, group_size=group_size, symmetric=symmetric,
                                        scale_dtype=scale_dtype,
                                        seed=len(lens), runs=3)


def test_defer_merge_is_refused_where_it_cannot_run(device):
    check_defer_merge_is_refused_where_it_cannot_run(device)
