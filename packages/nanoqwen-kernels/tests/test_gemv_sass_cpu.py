"""CPU CI: the instruction count of the g128 decode GEMVs' main loop in the staged-scale build (issue 13,
stage 1: the loop's issue rate limited them on the H200, bench/kernels/CEILINGS.md section 5;
`gemv.staged_spec()`, opt-in since it measured 2.7% slower on the H100), from the SASS of the cubin
nvcc builds for sm_90a, disassembled by nvdisasm and counted by
nanoqwen_bench/kernels/ceilings/ceilings_report.py's `hot_loop_counts` (the loop body that holds the
most HMMA). The build's hot kernels must not spill either.

The bound is derived, per tile-column (1 KiB of weights) and warp, from what the staged-scale loop must
issue (csrc/gemv_int4.cuh):
- the dequantisation: per 32-bit word 3 SHF + 4 LOP3 + 4 HADD2, 8 words: 88;
- 8 HMMA (4 words x 2 mma.m16n8k16);
- 4 LDS.128 of x, 1 LDS of the two rows' scale records, 2 LDG.128 of weights: 7;
- 4 FFMA (the scales): 4;
which is 107, plus at most 9 for the loop itself (two running weight pointers, two shared-memory
pointers, the down-counter, its compare and branch, the guard of the next stage's loads, over two
columns per trip): 116. The default build's per-column loop takes 141.5-161; a change that lets ptxas
recompute addresses in the staged loop again (session 25: 151 -> 113 for gate_up's kernel) fails here,
before any device time is spent. Needs nvcc and nvdisasm (the `nvidia-cuda-nvdisasm` wheel, a test dependency
in noxfile.py); skips with the reason where either is missing.

The int8 build with staged records (`gemv.int8_mma_spec(staged=True)`, session 26; the loop body that
holds the most IMMA), per tile-column:
- the dequantisation: per 32-bit word 1 SHF + 2 LOP3, 8 words: 24;
- 8 IMMA (4 words x the lo and hi planes);
- 4 LDS.128 of x's planes, 1 LDS.128 of the plane table, 1 LDS of the records, 2 LDG.128 of weights: 8;
- per output of the fragment: 256 hi + lo, + z (-sum X), float(), x p, fma with the scale: 5 x 4 = 20;
which is 60, plus the loop's 9 and 2 LOP3 that take the asymmetric zero points out of their records: 71.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from nanoqwen_kernels import build, gemv

CEILINGS = (Path(__file__).resolve().parents[2] / "nanoqwen-bench" / "src" / "nanoqwen_bench" / "kernels"
            / "ceilings" / "ceilings_report.py")
FLOOR = 88 + 8 + 7 + 4  # dequantisation, mma, loads, scale fmas (module docstring)
LOOP_ALLOWANCE = 9
HMMA_PER_TRIP = 16  # two tile-columns per trip
INT8_FLOOR = 24 + 8 + 8 + 20  # the int8 staged build (module docstring)
INT8_ALLOWANCE = LOOP_ALLOWANCE + 2

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


@pytest.fixture(scope="module")
def g128_loops(tmp_path_factory) -> dict[str, tuple[float, int]]:
    # not registered: the registry is global (test_build.py iterates it)
    return _loops(gemv.staged_spec(), tmp_path_factory.mktemp("gemv_sass"), "HMMA")


@pytest.fixture(scope="module")
def int8_loops(tmp_path_factory) -> dict[str, tuple[float, int]]:
    return _loops(gemv.int8_mma_spec(staged=True), tmp_path_factory.mktemp("gemv_i8_sass"), "IMMA")


def test_every_g128_gemv_loop_is_within_the_derived_bound(g128_loops):
    # every entry kind: plain, SiLU input, norm, RoPE, residual, merge; sym / asym; bf16 / fp16 scales
    assert len(g128_loops) == 36, sorted(g128_loops)
    assert {hmma for _, hmma in g128_loops.values()} == {HMMA_PER_TRIP}, "not the two-column staged loop"
    over = {k: v for k, (v, _) in g128_loops.items() if v > FLOOR + LOOP_ALLOWANCE}
    assert not over, f"instructions per tile-column above {FLOOR} + {LOOP_ALLOWANCE}: {over}"


def test_the_engines_decode_kernels_are_counted(g128_loops):
    """The kernels the 7B decode step launches at the default recipe's layout (g128 asym): qkv, o,
    gate_up, down."""
    for name in ("gemv_int4_g128_asym_norm_rope", "gemv_int4_g128_asym_resid", "gemv_int4_g128_asym_norm",
                 "gemv_int4_g128_asym_silu_resid"):
        assert FLOOR <= g128_loops[name][0] <= FLOOR + LOOP_ALLOWANCE, (name, g128_loops[name])


def test_every_int8_gemv_loop_is_within_the_derived_bound(int8_loops):
    assert len(int8_loops) == 36, sorted(int8_loops)
    assert {mma for _, mma in int8_loops.values()} == {HMMA_PER_TRIP}, "not the two-column staged loop"
    over = {k: v for k, (v, _) in int8_loops.items() if v > INT8_FLOOR + INT8_ALLOWANCE}
    assert not over, f"instructions per tile-column above {INT8_FLOOR} + {INT8_ALLOWANCE}: {over}"
