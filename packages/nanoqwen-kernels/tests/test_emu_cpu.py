"""CPU: the kernel emulator itself (nanoqwen_kernels.testing.emu, csrc/emu/): that what it claims to model, it
models, so that a kernel test passing on it means something.

- the tensor-core fragment layout and arithmetic: one mma.m16n8k16 from fragments loaded as the PTX ISA
  lays them out equals A @ B + C in fp64 (the products of bf16 values are exact; the emulator sums in
  double and rounds once, so the bound is one f32 rounding of the result);
- warp shuffles (indexed and xor);
- bulk copies complete late: a kernel that reads its shared-memory destination without waiting on the
  mbarrier sees the poisoned bytes in some launches, and the right ones whenever it waits;
- a wait that never ends is an EmulatorError after the timeout, not a hang;
- the INT4 GEMV (bf16 mma) and the INT8 GEMV (f16 mma, prmt, f16 packing), run on the emulator, equal
  the fp32 reference within the GEMVs' own GPU tolerance (`R.assert_close`): the emulated kernels
  compute what the GPU kernels compute (those kernels' fragment loads passed on the H200, so this is
  the check of the emulator's mma layout that is not circular);
- misuse is reported: a write past the dynamic shared memory, divergent warp collectives, arguments
  that do not match the kernel's parameters;
- ldmatrix (.x4, .x4.trans) hands out the PTX ISA fragments; cp.async zero-fills past its src-size
  and lands late (a read without cp.async.wait_all sees the poison in some launches); the attention's
  named barrier counts only the threads that arrive (a count no set of warps can fill is a deadlock);
- every PTX wrapper of the emulated families has a host branch: they build for the emulator;
- the emulator is test support: importing the kernels' modules never imports it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from int4_testkit import random_int4, reference_out
from nanoqwen_kernels import reference as R
from nanoqwen_kernels.build import KernelSpec
from nanoqwen_kernels.launch import i32, ptr
from nanoqwen_kernels.testing import emu

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


def test_misuse_is_reported():
    """A write past the dynamic shared memory, lanes of a warp in different collectives, and arguments
    that do not match the kernel's parameters (count, size, a Python value) fail the launch."""
    with pytest.raises(emu.EmulatorError, match="wrote past its 64 bytes of dynamic shared memory"):
        emu.launch_spec(SELFTEST, "selftest_smem_write", 1, 32, (i32(64 + 8),), 64)
    emu.launch_spec(SELFTEST, "selftest_smem_write", 1, 32, (i32(63),), 64)  # the last byte is fine
    out = torch.zeros(32, dtype=torch.int32)
    with pytest.raises(emu.EmulatorError, match="different collectives"):
        emu.launch_spec(SELFTEST, "selftest_divergent_collectives", 1, 32, (ptr(out),))
    with pytest.raises(emu.EmulatorError, match="takes 1 arguments, the launcher passed 2"):
        emu.launch_spec(SELFTEST, "selftest_shuffles", 1, 32, (ptr(out), i32(0)))
    with pytest.raises(emu.EmulatorError, match="argument 0 is 8 bytes, the launcher passed 4"):
        emu.launch_spec(SELFTEST, "selftest_shuffles", 1, 32, (i32(0),))
    with pytest.raises(TypeError, match="not a numpy scalar"):
        emu.launch_spec(SELFTEST, "selftest_shuffles", 1, 32, (out.data_ptr(),))


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


@pytest.mark.parametrize("n,k,g,m", [(200, 640, 64, 2), (136, 1152, 128, 5)])
def test_int8_gemv_on_the_emulator_matches_the_reference(n, k, g, m):
    """The f16 side of the emulator (gemv_int8: prmt, sub.f16x2, the f16 mma, f16 packing), with a row
    beyond fp16's range (the kernel scales each row by a power of two), against the fp32 reference."""
    from nanoqwen_kernels.gemv import Int8Weight, gemv_int8

    gen = torch.Generator().manual_seed(n + k)
    q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scales = ((0.5 + torch.rand(n, k // g, generator=gen)) / (73.0 * k**0.5)).to(torch.bfloat16)
    w = Int8Weight(q, scales, n, k, g)
    x = torch.randn(m, k, generator=gen)
    x[0] *= 1e5
    x = x.to(torch.bfloat16)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
    with emu.emulated(sms=4):
        gemv_int8(x, w, out)
    ref = R.linear(x, R.dequantize_int8(q, scales, g))
    for i in range(m):  # each row against its own scale
        R.assert_close(out[i : i + 1], ref[i : i + 1], f"emulated INT8 GEMV row {i}")


def test_the_emulated_families_have_their_kernels():
    from nanoqwen_kernels.specs import SPECS

    assert {"gemv_int4_g128_asym_rope", "gemv_int8_g128"} <= set(emu.entry_points(SPECS["gemv"]))
    assert {"paged_attention_decode_hd128", "paged_attention_prefill_hd64",
            "paged_attention_combine_hd128"} <= set(emu.entry_points(SPECS["attention"]))
    assert emu.entry_points(SPECS["sampling"]) == ["sample_tokens_bf16"]


def test_emulated_patches_every_launcher_and_restores_it():
    from nanoqwen_kernels import attention, gemm, gemv, layer_ops, sampling

    modules = (gemv, gemm, layer_ops, attention, sampling)
    before = [(m.launch, m.require_sm90) for m in modules]
    with emu.emulated(sms=7):
        assert all(m.launch is emu.launch for m in modules)
        assert gemv._sm_count(0) == 7  # the SM count every plan reads (attention, gemm too)
        assert all(m.require_sm90(torch.device("cpu")) == 0 for m in modules)
    assert [(m.launch, m.require_sm90) for m in modules] == before


def test_ldmatrix_fragments():
    """ldmatrix .x4 and .x4.trans hand out the PTX ISA fragments: lane l gets, of matrix j, row l / 4,
    elements 2 (l % 4) and + 1 (.trans: column l / 4 of rows 2 (l % 4) and + 1), low half first."""
    gen = torch.Generator().manual_seed(2)
    m = torch.randint(0, 1 << 16, (32, 8), generator=gen, dtype=torch.int64)  # [32, 8] 16-bit elements
    src = (m[:, 0::2] | (m[:, 1::2] << 16)).to(torch.int64).numpy().astype(np.uint32)
    src_t = torch.from_numpy(src.view(np.int32).copy())
    for trans in (0, 1):
        out = torch.full((128,), -1, dtype=torch.int32)
        emu.launch_spec(SELFTEST, "selftest_ldmatrix", 1, 32, (ptr(src_t), ptr(out), i32(trans)), 512)
        got = out.numpy().view(np.uint32).reshape(32, 4)
        for lane in range(32):
            g, t = lane // 4, lane % 4
            for j in range(4):
                if trans:
                    lo, hi = m[8 * j + 2 * t, g], m[8 * j + 2 * t + 1, g]
                else:
                    lo, hi = m[8 * j + g, 2 * t], m[8 * j + g, 2 * t + 1]
                assert int(got[lane, j]) == int(lo) | (int(hi) << 16), (trans, lane, j)


def test_cp_async_zero_fill_and_late_completion():
    """src-size bytes are copied and the rest of the 16 zero-filled (0: nothing read); without a wait,
    some launches read the poisoned shared memory (the copy lands late), never with one."""
    src = torch.arange(1, 17, dtype=torch.uint8)
    seen = set()
    for src_bytes in (16, 6, 0):
        want = src.clone()
        want[src_bytes:] = 0
        for _ in range(20):
            for wait in (1, 0):
                out = torch.zeros(4, dtype=torch.int32)
                emu.launch_spec(SELFTEST, "selftest_cp_async", 1, 32, (ptr(src), ptr(out), i32(src_bytes),
                                                                     i32(wait)), 16)
                got = out.view(torch.uint8)
                if wait:
                    assert torch.equal(got, want), (src_bytes, got.tolist())
                elif torch.equal(got, want):
                    seen.add("data")
                else:
                    seen.add("poison" if bool((got == 0xA5).all()) else "?")
    assert seen == {"poison", "data"}, seen


def test_named_barrier_counts_only_the_threads_that_arrive():
    out = torch.full((128,), -1, dtype=torch.int32)
    emu.launch_spec(SELFTEST, "selftest_named_barrier", 1, 160, (ptr(out),), 512)
    t = np.arange(32, 160)
    assert out.tolist() == (32 + (t - 32 + 32) % 128).tolist()
    with pytest.raises(emu.EmulatorError, match="deadlock"):
        emu.launch_spec(SELFTEST, "selftest_named_barrier", 1, 128, (ptr(out),), 512)


def test_the_kernels_never_import_the_emulator():
    """nanoqwen_kernels.testing (the emulator) is off the kernels' import path: a fresh interpreter that
    imports every launcher module has not loaded it."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from nanoqwen_kernels import attention, build, cuda_driver, gemm, gemv, launch, layer_ops\n"
            "from nanoqwen_kernels import reference, reference_attention, sampling, specs\n"
            "print(sorted(m for m in sys.modules if m.startswith('nanoqwen_kernels.testing')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
