"""CPU: the kernel emulator itself (nanoqwen_kernels.emu, csrc/emu/): that what it claims to model, it
models, so that a kernel test passing on it means something.

- the tensor-core fragment layout and arithmetic: one mma.m16n8k16 from fragments loaded as the PTX ISA
  lays them out equals A @ B + C in fp64 (the products of bf16 values are exact; the emulator sums in
  double and rounds once, so the bound is one f32 rounding of the result);
- warp shuffles (indexed and xor);
- bulk copies complete late: a kernel that reads its shared-memory destination without waiting on the
  mbarrier sees the poisoned bytes in some launches, and the right ones whenever it waits;
- a wait that never ends is an EmulatorError after the timeout, not a hang;
- the INT4 GEMV, run on the emulator, equals the fp32 reference within the GEMV's own GPU tolerance
  (test_gemv.py's `R.assert_close`): the emulated kernel computes what the GPU kernel computes;
- every PTX wrapper of the emulated families has a host branch: gemv and block build for the emulator.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from int4_testkit import random_int4, reference_out
from nanoqwen_kernels import emu
from nanoqwen_kernels import reference as R
from nanoqwen_kernels.build import KernelSpec
from nanoqwen_kernels.launch import i32, ptr

pytestmark = pytest.mark.usefixtures("emu_compiler")
SELFTEST = KernelSpec("emu_selftest", ("emu/selftest.cu",))


def test_mma_fragments_and_arithmetic():
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(16, 16, generator=gen).to(torch.bfloat16)
    b = torch.randn(16, 8, generator=gen).to(torch.bfloat16)
    c = torch.randn(16, 8, generator=gen)
    d = torch.full((16, 8), float("nan"))
    b_cols = b.t().contiguous()  # B[k][n] at b[n * 16 + k]
    emu.launch_spec(SELFTEST, "selftest_mma", 1, 32, (ptr(a), ptr(b_cols), ptr(c), ptr(d)))
    want = a.double() @ b.double() + c.double()
    assert torch.allclose(d.double(), want, rtol=2**-23, atol=0), (d - want).abs().max()


def test_warp_shuffles():
    out = torch.full((64,), -1, dtype=torch.int32)
    emu.launch_spec(SELFTEST, "selftest_shuffles", 1, 32, (ptr(out),))
    lanes = np.arange(32)
    assert out[:32].tolist() == ((lanes ^ 5) * 10).tolist()
    assert out[32:].tolist() == ((31 - lanes) * 10).tolist()


def test_bulk_copies_complete_late():
    src = torch.tensor([1, 2, 3, 4], dtype=torch.int32)
    seen = set()
    for _ in range(40):
        for wait in (1, 0):
            out = torch.zeros(4, dtype=torch.int32)
            emu.launch_spec(SELFTEST, "selftest_bulk_copy", 1, 32, (ptr(src), ptr(out), i32(wait)), 128)
            if wait:
                assert out.tolist() == [1, 2, 3, 4], "a waited-for copy must have landed"
            else:
                seen.add(tuple(out.tolist()))
    poison = tuple([np.uint32(0xA5A5A5A5).astype(np.int32).item()] * 4)
    assert poison in seen, "no launch read the destination before the copy landed"
    assert (1, 2, 3, 4) in seen, "no copy completed at once either"


def test_a_wait_that_never_ends_is_an_error():
    flag = torch.zeros(1, dtype=torch.int32)
    with emu.emulated(timeout_s=1.0):
        with pytest.raises(emu.EmulatorError, match="no progress within 1 s"):
            emu.launch_spec(SELFTEST, "selftest_wait_forever", 2, 64, (ptr(flag),))


@pytest.mark.parametrize("n,k,m,symmetric", [(256, 384, 1, False), (384, 256, 3, True), (136, 512, 8, False)])
def test_gemv_on_the_emulator_matches_the_reference(n, k, m, symmetric):
    from nanoqwen_kernels.gemv import GemvWorkspace, gemv_int4, plan_gemv

    gen = torch.Generator().manual_seed(n + k + m)
    w = random_int4(n, k, 128, symmetric, gen, "cpu")
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    buf = torch.full(((m + 1) * n,), float("nan"), dtype=torch.bfloat16)
    out = buf[: m * n].view(m, n)
    with emu.emulated(sms=4, seed=m):
        plan = plan_gemv(n, k, torch.device("cpu"))
        gemv_int4(x, w, out, workspace=GemvWorkspace.allocate([plan], torch.device("cpu")), plan=plan)
    assert plan.splits > 1  # the split-K path (partials, the last block's sum) ran
    assert bool(buf[m * n:].isnan().all()), "written past [M, N]"
    R.assert_close(out, reference_out(x, w, None), "emulated GEMV")


def test_the_emulated_families_have_their_kernels():
    from nanoqwen_kernels.specs import SPECS

    names = set(emu.entry_points(SPECS["block"]))
    assert set(SPECS["block"].hot_kernels) <= names
    assert {"gemv_int4_g128_asym_rope", "gemv_int8_g128"} <= set(emu.entry_points(SPECS["gemv"]))
