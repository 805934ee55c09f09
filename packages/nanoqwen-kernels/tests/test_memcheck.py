"""GPU: compute-sanitizer memcheck over a reduced run of every kernel family (memcheck_kernels.py),
judged by memcheck's own clean summary (conftest.sanitizer_failure). Skips with a reason when
compute-sanitizer is not installed or cannot use the device."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu


def test_memcheck_reduced_set(compute_sanitizer):
    compute_sanitizer("memcheck", Path(__file__).with_name("memcheck_kernels.py"),
                      "memcheck_kernels: all kernels ran and matched their references")
