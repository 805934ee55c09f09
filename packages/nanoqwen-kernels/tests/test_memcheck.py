"""GPU: compute-sanitizer memcheck over a reduced run of every kernel family (memcheck_kernels.py).
Skips with a reason when compute-sanitizer is not installed or cannot use the device."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu


def _sanitizer() -> str | None:
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    for cand in (
        "/usr/local/cuda/bin/compute-sanitizer",
        "/usr/local/cuda/compute-sanitizer/compute-sanitizer",
    ):
        if os.path.exists(cand):
            return cand
    return None


def test_memcheck_reduced_set():
    exe = _sanitizer()
    if exe is None:
        pytest.skip("compute-sanitizer not installed")
    script = Path(__file__).with_name("memcheck_kernels.py")
    cmd = [exe, "--tool", "memcheck", "--error-exitcode", "99", "--print-limit", "20",
           sys.executable, str(script)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=dict(os.environ))
    log = proc.stdout + proc.stderr
    if "Device not supported" in log:
        pytest.skip("compute-sanitizer cannot use this device (e.g. under gVisor)")
    assert proc.returncode == 0, f"memcheck failed (exit {proc.returncode}):\n{log[-6000:]}"
    assert "ERROR SUMMARY: 0 errors" in log, log[-3000:]
