"""Fixtures of the kernel tests: an sm_90 device (GPU tests), a seeded generator per test, and
compute-sanitizer runs judged by what each of its tools prints on a clean run."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # int4_testkit.py: helpers shared by the INT4 tests


@pytest.fixture
def device():
    """The current CUDA device, checked to be sm_90 (the kernels' only target)."""
    from nanoqwen_kernels.launch import require_sm90

    dev = torch.device("cuda", torch.cuda.current_device())
    require_sm90(dev)
    return dev


@pytest.fixture
def emu_compiler():
    """The C++ compiler the kernel emulator (nanoqwen_kernels.testing.emu) builds with; skips without one."""
    from nanoqwen_kernels.testing import emu

    try:
        return emu.compiler()
    except emu.EmulatorError as e:
        pytest.skip(str(e))


@pytest.fixture
def gen(request, device):
    """A CUDA generator seeded from the test's name: fresh random data per test, reproducible."""
    import zlib

    g = torch.Generator(device=device)
    g.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    return g


# ---------------------------------------------------------------------------------------------------
# compute-sanitizer
# ---------------------------------------------------------------------------------------------------

# The summary line each tool prints on a clean run (after compute-sanitizer's "========= " prefix).
# memcheck, synccheck and initcheck count errors; racecheck counts hazards in a line of its own
# (bench/attention/RESULTS.md has the lines of a real run).
SANITIZER_CLEAN = {
    "memcheck": "ERROR SUMMARY: 0 errors",
    "synccheck": "ERROR SUMMARY: 0 errors",
    "initcheck": "ERROR SUMMARY: 0 errors",
    "racecheck": "RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)",
}
_SUMMARY_RE = re.compile(r"^=+ ([A-Z][A-Z ]* SUMMARY: .*?)\s*$", re.MULTILINE)


def sanitizer_failure(tool: str, returncode: int, log: str) -> str | None:
    """Why a compute-sanitizer run of `tool` is not clean, or None when it is: the run must exit 0,
    print the tool's own clean summary line, and print no summary line that is not a clean one (a
    count other than zero, or a summary of another kind such as a leak report)."""
    clean = SANITIZER_CLEAN[tool]
    summaries = _SUMMARY_RE.findall(log)
    if returncode != 0:
        return f"compute-sanitizer --tool {tool} exited with status {returncode}; summaries {summaries}"
    unclean = [s for s in summaries if s not in SANITIZER_CLEAN.values()]
    if unclean:
        return f"{tool} reported {unclean}"
    if clean not in summaries:
        return f"no '{clean}' line in the {tool} log; summaries {summaries}"
    return None


@pytest.fixture(name="sanitizer_failure")
def sanitizer_failure_fixture():
    """`sanitizer_failure` itself (tests/test_sanitizer_cpu.py checks the verdict without a GPU)."""
    return sanitizer_failure


def _sanitizer_path() -> str | None:
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for cand in ("/usr/local/cuda/bin/compute-sanitizer",
                 "/usr/local/cuda/compute-sanitizer/compute-sanitizer"):
        if os.path.exists(cand):
            return cand
    return None


@pytest.fixture
def compute_sanitizer(tmp_path):
    """run(tool, script, done_marker): run `python script` under `compute-sanitizer --tool tool` and
    fail unless the sanitizer judges it clean (`sanitizer_failure`) and the script printed
    `done_marker` (it ran to its end, its own checks included). Skips with a reason when
    compute-sanitizer is not installed or cannot use the device. The log is kept in tmp_path."""
    exe = _sanitizer_path()
    if exe is None:
        pytest.skip("compute-sanitizer not installed")

    def run(tool: str, script: Path, done_marker: str, timeout: int = 900) -> str:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))  # the child imports what we import
        cmd = [exe, "--tool", tool, "--error-exitcode", "3", "--print-limit", "20",
               sys.executable, str(script)]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
        log = proc.stdout + proc.stderr
        (tmp_path / f"{tool}.log").write_text(log)
        if "Device not supported" in log:
            pytest.skip("compute-sanitizer cannot use this device (e.g. under gVisor)")
        problem = sanitizer_failure(tool, proc.returncode, log)
        assert problem is None, f"{problem}\n{log[-6000:]}"
        assert done_marker in log, f"{script.name} did not finish ('{done_marker}' missing)\n{log[-6000:]}"
        return log

    return run
