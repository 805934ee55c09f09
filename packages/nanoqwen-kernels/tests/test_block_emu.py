"""The post-attention block kernel on the CPU emulator (nanoqwen_kernels.emu: the kernel's own CUDA
source compiled for the host, every CTA an OS thread, its threads fibers switched at warp-collective
operations, barriers and at random points, bulk copies completing late). The checks are
block_testkit.py's, the GPU tests' own, with the GEMVs they compare against also emulated.

What this finds without a GPU: work-split, indexing, bulk-copy / mbarrier and counter-protocol bugs,
a deadlock (the launch fails with the emulator's reason instead of hanging), results that depend on
the interleaving (each launch interleaves the threads differently: the determinism checks compare
launches). What it cannot: the GPU's weaker memory model (a missing fence), L1 incoherence, timing.
The geometry is the small "odd" one (H = 40 pairs, I = 9 tile-columns, Kq = 3 tile-columns), with 4
SMs (ranges spanning several pairs, pairs cut between warps) and 32 SMs (512 warps for 120 o_proj
pair-columns: every o_proj pair cut into 3 pieces, CTAs with no work in an op); the `_qkv` op also with
heads of 128 columns (the 7B's head size), at a small width.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from block_testkit import (
    GEOMETRIES,
    LAYOUT_IDS,
    LAYOUTS,
    check_block_rejects_what_it_cannot_run,
    check_down_and_determinism,
    check_next_qkv_op,
    check_o_proj_and_gate_up,
    check_randomised_delays_change_nothing,
)
from nanoqwen_kernels import emu

ODD = GEOMETRIES[2]
_AB = Path(__file__).parents[3] / "bench" / "kernels" / "block_ab.py"


def _block_ab_builds() -> dict:
    """The compile-option builds the GPU benchmark sweeps (bench/kernels/block_ab.py's BUILDS)."""
    module_spec = importlib.util.spec_from_file_location("block_ab", _AB)
    block_ab = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(block_ab)
    return block_ab.BUILDS


AB_BUILDS = _block_ab_builds()
SMS = [4, 32]
TIMEOUT_S = 60.0  # a launch takes ~1 s here; one that makes no progress for a minute is a deadlock


pytestmark = pytest.mark.usefixtures("emu_compiler")
CPU = torch.device("cpu")


@pytest.fixture
def cpu_gen(request):
    import zlib

    g = torch.Generator()
    g.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    return g


def _cases(test):
    """Every (SM count, M, layout) case, with the bf16 build and the int8 one (`block_testkit.families`)."""
    for name, values, ids in (("symmetric,scale_dtype", LAYOUTS, LAYOUT_IDS), ("m", [1, 2], None),
                              ("sms", SMS, None), ("int8", [False, True], ["bf16", "int8"])):
        test = pytest.mark.parametrize(name, values, ids=ids)(test)
    return test


@_cases
def test_o_proj_and_gate_up(sms, m, symmetric, scale_dtype, int8, cpu_gen):
    with emu.emulated(sms=sms, seed=m, timeout_s=TIMEOUT_S):
        check_o_proj_and_gate_up(ODD, m, symmetric, scale_dtype, cpu_gen, CPU, int8=int8)
    if int8:  # the int8 builds' launches ran (both sides of the comparison)
        assert {"block_i8mma", "gemv_i8mma"} <= set(emu.loaded_families())


@_cases
def test_down_and_determinism(sms, m, symmetric, scale_dtype, int8, cpu_gen):
    with emu.emulated(sms=sms, seed=10 + m, timeout_s=TIMEOUT_S):
        check_down_and_determinism(ODD, m, symmetric, scale_dtype, cpu_gen, CPU, int8=int8)


@_cases
def test_next_qkv_op(sms, m, symmetric, scale_dtype, int8, cpu_gen):
    with emu.emulated(sms=sms, seed=20 + m, timeout_s=TIMEOUT_S):
        check_next_qkv_op(ODD, m, symmetric, scale_dtype, cpu_gen, CPU, int8=int8)


# heads of 128 columns (the 7B's: 8 pairs per head meet on a head counter) at a small width: H = 384,
# I = 640, Kq = 3 heads x 128
D128 = ("d128", 384, 640, 384)


@pytest.mark.parametrize("int8", [False, True], ids=["bf16", "int8"])
@pytest.mark.parametrize("m", [1, 2])
def test_next_qkv_op_with_heads_of_128(m, int8, cpu_gen):
    with emu.emulated(sms=4, seed=30 + m, timeout_s=TIMEOUT_S):
        check_next_qkv_op(D128, m, False, torch.bfloat16, cpu_gen, CPU, int8=int8)


def test_randomised_delays_change_nothing(cpu_gen):
    """The stress build (a pause before each chunk: on the emulator, a switch to another thread)."""
    with emu.emulated(sms=8, seed=3, timeout_s=TIMEOUT_S):
        check_randomised_delays_change_nothing(ODD, cpu_gen, CPU)


def test_block_rejects_what_it_cannot_run(cpu_gen):
    with emu.emulated(sms=4, timeout_s=TIMEOUT_S):
        check_block_rejects_what_it_cannot_run(cpu_gen, CPU)


@pytest.mark.parametrize("name", sorted(AB_BUILDS))
def test_benchmark_builds_compute_what_the_default_does(name, cpu_gen):
    """Every build block_ab.py times on the GPU (warps per CTA, tile-columns per slot, slots per ring, the
    int8 loop or not) passes the down and `_qkv` checks here first: a wrong build would be timed, not
    tested, there."""
    from nanoqwen_kernels import block

    family = f"block_{name}"
    build = block.BlockBuild(*AB_BUILDS[name])
    if family not in block.BUILDS:
        block.register_build(family, build)
    with emu.emulated(sms=4, seed=40, timeout_s=TIMEOUT_S):
        check_down_and_determinism(ODD, 2, False, torch.bfloat16, cpu_gen, CPU, build.int8, family)
        check_next_qkv_op(ODD, 2, False, torch.bfloat16, cpu_gen, CPU, build.int8, family)
    assert family in emu.loaded_families()  # the launches ran this build
