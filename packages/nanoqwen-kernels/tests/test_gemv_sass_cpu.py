"""CPU CI: the instruction count of the g128 decode GEMVs' main loop, from the SASS of the cubin nvcc
builds for sm_90a, disassembled by nvdisasm and counted by
nanoqwen_bench/kernels/ceilings/ceilings_report.py's `hot_loop_counts` (the loop body that holds the
most mma instructions: two tile-columns per trip). The
loop's issue rate is what limits these kernels at HBM speed, so a change that
makes ptxas issue more per tile-column fails here, before any device time is spent. The build's hot
kernels must not spill either. Needs nvcc and nvdisasm (the `nvidia-cuda-nvdisasm` wheel, a test
dependency in noxfile.py); skips with the reason where either is missing.

The bound is derived per tile-column (1 KiB of weights) and warp from what the loop must issue
(csrc/gemv_int4.cuh `mma_tile_column`, `load_tile_column`), the floor:
- the dequantisation: per 32-bit word 3 SHF + 4 LOP3 + 4 HADD2, 8 words: 88;
- 8 HMMA (4 words x 2 mma.m16n8k16);
- loads: 4 LDS.128 of x, 2 LDG.128 of weights, 2 LDG of the two rows' scales, and for asymmetric weights
  2 LDG of their zero points: 8 / 10;
- the two scales widened to fp32 (a shift, or cvt for fp16 scales): 2; asymmetric, the two zero pairs
  (one PRMT each): 2;
- 4 FFMA (the scales);
which is 110 symmetric, 114 asymmetric. Above the floor the loop may spend, per global load of the
column, ADDR_PER_LOAD = 8 integer instructions on its 64-bit address (the addresses are derived from the
row bases and the tile-column alone, which ptxas may rematerialise from the thread index: the lane's row,
a 64-bit multiply-add by the row stride and its carry, the offset of the column), and LOOP_ALLOWANCE = 9
on the loop itself (the column counter, the guards of the next stage's loads, their compares and
branches, over two columns per trip).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from nanoqwen_kernels import build, gemv
from nanoqwen_kernels.specs import SPECS

CEILINGS = (Path(__file__).resolve().parents[2] / "nanoqwen-bench" / "src" / "nanoqwen_bench" / "kernels"
            / "ceilings" / "ceilings_report.py")
ADDR_PER_LOAD = 8
LOOP_ALLOWANCE = 9
MMA_PER_TRIP = 16  # two tile-columns per trip, 8 mma each
# (floor, global loads) per tile-column, symmetric / asymmetric (module docstring)
BF16 = {False: (88 + 8 + 8 + 2 + 4, 4), True: (88 + 8 + 10 + 2 + 2 + 4, 6)}

pytestmark = [
    pytest.mark.skipif(build.nvcc_path() is None, reason="nvcc not installed on this machine"),
    pytest.mark.skipif(build.nvdisasm_path() is None, reason="nvdisasm not found (PATH, /usr/local/cuda/bin, "
                                                             "the nvidia-cuda-nvdisasm wheel)"),
]


def _ceilings_report():
    spec = importlib.util.spec_from_file_location("ceilings_report", CEILINGS)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["ceilings_report"] = mod
    spec.loader.exec_module(mod)
    return mod


def _loops(spec, tmp_dir: Path, marker: str) -> dict[str, tuple[float, int]]:
    """Per g128 GEMV kernel of the build `spec`: (SASS instructions per tile-column of its hot loop, the
    `marker` mma instructions in that loop, 8 per tile-column). Its hot kernels must not spill."""
    cr = _ceilings_report()
    cubin, report = build.compile_nvcc(spec, tmp_dir)
    spilled = {k: report[k] for k in spec.hot_kernels if report[k].uses_local_memory}
    assert not spilled, f"the {spec.name} build's hot kernels use local memory: {spilled}"
    text = subprocess.run([build.nvdisasm_path(), "-c", str(cubin)], capture_output=True, text=True,
                          check=True).stdout
    out = {}
    for name, lines in cr.parse_sass(text).items():
        if name.startswith("gemv_int4_g128_"):
            counts, mma = cr.hot_loop_counts(lines, marker)
            out[name] = (sum(counts.values()) / (mma / 8), mma)
    return out


def _bound(table: dict, name: str) -> tuple[int, int]:
    """(floor, most allowed) per tile-column of the kernel `name` (asymmetric or not)."""
    floor, loads = table["_asym" in name]
    return floor, floor + loads * ADDR_PER_LOAD + LOOP_ALLOWANCE


def _check(loops: dict[str, tuple[float, int]], table: dict) -> None:
    # every entry kind: plain, SiLU input, norm, RoPE, residual, merge; sym / asym; bf16 / fp16 scales
    assert len(loops) == 36, sorted(loops)
    assert {mma for _, mma in loops.values()} == {MMA_PER_TRIP}, "not the two-column loop"
    out = {k: (v, _bound(table, k)) for k, (v, _) in loops.items()
           if not _bound(table, k)[0] <= v <= _bound(table, k)[1]}
    assert not out, f"instructions per tile-column outside (floor, bound): {out}"


@pytest.fixture(scope="module")
def g128_loops(tmp_path_factory) -> dict[str, tuple[float, int]]:
    return _loops(SPECS[gemv.FAMILY], tmp_path_factory.mktemp("gemv_sass"), "HMMA")


def test_every_g128_gemv_loop_is_within_the_derived_bound(g128_loops):
    _check(g128_loops, BF16)


def test_the_engines_decode_kernels_are_counted(g128_loops):
    """The kernels the 7B decode step launches at the default recipe's layout (g128 asym): qkv, o,
    gate_up, down."""
    for name in ("gemv_int4_g128_asym_norm_rope", "gemv_int4_g128_asym_resid", "gemv_int4_g128_asym_norm",
                 "gemv_int4_g128_asym_silu_resid"):
        floor, most = _bound(BF16, name)
        assert floor <= g128_loops[name][0] <= most, (name, g128_loops[name])
