"""The o projection's attention merge prologue on the CPU emulator (nanoqwen_kernels.testing.emu: the kernels'
own CUDA source compiled for the host). The checks are attention_merge_testkit.py's, the GPU test's own, on
smaller head counts: the deferred merge + `_merge_resid` GEMV against the combine kernel + `_resid` GEMV,
bit for bit, with stale partials NaN and the split counts poisoned before each deferred run; unsplit,
split, context-0 and in-kernel-merged rows in one batch; GEMV plans that split K and one that does not;
head dims 128 and 64. Plans are made for 132 SMs (`emulated(sms=132)`: the H200's split counts).
"""

from __future__ import annotations

import zlib

import pytest
import torch
from attention_merge_testkit import (
    check_defer_merge_is_refused_where_it_cannot_run,
    check_merge_prologue_equals_combine,
)
from nanoqwen_kernels.testing import emu

pytestmark = pytest.mark.usefixtures("emu_compiler")
CPU = torch.device("cpu")
TIMEOUT_S = 60.0
SMS = 132


@pytest.fixture
def seed(request) -> int:
    return zlib.crc32(request.node.nodeid.encode()) % 100_000


@pytest.mark.parametrize(
    "heads, lens, fuse_max, gemv_split, group_size, symmetric, scale_dtype",
    [
        ((8, 2, 128), [1, 64, 129, 333, 512, 0], 1, "auto", 128, False, torch.bfloat16),
        ((6, 2, 64), [130, 7, 400, 65, 250], 4, "unsplit", 64, True, torch.float16),
        ((4, 1, 128), [500, 200, 129, 3, 512, 300, 450, 2], 1, "auto", 32, True, torch.bfloat16),
    ],
    ids=["hd128-g128-asym-ksplit", "hd64-g64-sym-f16s-unsplit-fuse4", "hd128-g32-sym-m8"],
)
def test_merge_prologue_equals_combine(heads, lens, fuse_max, gemv_split, group_size, symmetric, scale_dtype,
                                       seed):
    with emu.emulated(sms=SMS, seed=seed, timeout_s=TIMEOUT_S):
        check_merge_prologue_equals_combine(heads, lens, CPU, max_context_len=512, fuse_max=fuse_max,
                                            gemv_split=gemv_split, group_size=group_size, symmetric=symmetric,
                                            scale_dtype=scale_dtype, seed=seed)


def test_defer_merge_is_refused_where_it_cannot_run(seed):
    with emu.emulated(sms=SMS, seed=seed, timeout_s=TIMEOUT_S):
        check_defer_merge_is_refused_where_it_cannot_run(CPU)
