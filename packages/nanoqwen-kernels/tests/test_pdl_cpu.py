"""CPU: programmatic dependent launch plumbing.

- The ctypes mirrors of cuda.h's CUlaunchConfig / CUlaunchAttribute have the C layout: a small C
  program compiled against the local cuda.h prints sizes and offsets, compared field by field.
- Every kernel entry point keeps the PDL contract of csrc/common.cuh: it reaches `pdl_wait` (directly
  or through `pdl_enter`) — a kernel launched with the attribute but without the wait would race its
  predecessor.
- `use_pdl` switches the launch path and restores it; arguments that are not numpy scalars are refused
  before anything reaches the driver.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from nanoqwen_kernels import cuda_driver, launch

CSRC = Path(launch.__file__).parent / "csrc"


def _cuda_include() -> Path | None:
    nvcc = shutil.which("nvcc")
    candidates = [Path(nvcc).resolve().parent.parent / "include"] if nvcc else []
    candidates.append(Path("/usr/local/cuda/include"))
    return next((c for c in candidates if (c / "cuda.h").is_file()), None)


C_PROGRAM = r"""
#include <stddef.h>
#include <stdio.h>
#include <cuda.h>
int main(void) {
  printf("attr_size %zu\n", sizeof(CUlaunchAttribute));
  printf("attr_value %zu\n", offsetof(CUlaunchAttribute, value));
  printf("value_size %zu\n", sizeof(CUlaunchAttributeValue));
  printf("config_size %zu\n", sizeof(CUlaunchConfig));
  printf("sharedMemBytes %zu\n", offsetof(CUlaunchConfig, sharedMemBytes));
  printf("hStream %zu\n", offsetof(CUlaunchConfig, hStream));
  printf("attrs %zu\n", offsetof(CUlaunchConfig, attrs));
  printf("numAttrs %zu\n", offsetof(CUlaunchConfig, numAttrs));
  printf("pss %d\n", (int)CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION);
  return 0;
}
"""


def test_launch_structs_match_cuda_h(tmp_path):
    inc, cc = _cuda_include(), shutil.which("cc") or shutil.which("gcc")
    if inc is None or cc is None:
        pytest.skip("needs cuda.h (a CUDA toolkit) and a C compiler to check the struct layout")
    src, exe = tmp_path / "layout.c", tmp_path / "layout"
    src.write_text(C_PROGRAM)
    subprocess.run([cc, "-I", str(inc), str(src), "-o", str(exe)], check=True, capture_output=True)
    c = dict(line.split() for line in subprocess.run([str(exe)], check=True, capture_output=True,
                                                     text=True).stdout.splitlines())
    c = {k: int(v) for k, v in c.items()}
    A, C = cuda_driver.CUlaunchAttribute, cuda_driver.CUlaunchConfig
    assert ctypes.sizeof(A) == c["attr_size"]
    assert A.value.offset == c["attr_value"] and A.value.size == c["value_size"]
    assert ctypes.sizeof(C) == c["config_size"]
    for field in ("sharedMemBytes", "hStream", "attrs", "numAttrs"):
        assert getattr(C, field).offset == c[field], field
    assert cuda_driver.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION == c["pss"]


def _kernel_bodies(text: str):
    """(name, the first 400 characters of the body) of every __global__ entry point."""
    for m in re.finditer(r"__global__[^{]*?\b(\w+)\s*\(([^{]*)\)\s*\{", text):
        yield m.group(1), text[m.end(): m.end() + 400]


def test_every_kernel_entry_waits_before_touching_dependent_memory():
    seen = 0
    for path in sorted(CSRC.glob("*.cu")):
        for name, body in _kernel_bodies(path.read_text()):
            seen += 1
            first = body.replace("\\", " ").split(";")[0].strip()
            if first.startswith(("gemv_int4<", "nq_gemv8::gemv_int8<")):
                # the decode GEMVs prefetch weights first; their wait is inside (checked below)
                continue
            assert first in ("pdl_enter()", "pdl_wait()"), f"{path.name}:{name} starts with {first!r}"
    assert seen >= 10
    for header, fn, first_x in (("gemv_int4.cuh", "NQ_DEVICE void gemv_int4(", "stage_x<XMODE>(xs"),
                                ("gemv_int8.cuh", "NQ_DEVICE void gemv_int8(", "ld_v4(x + ")):
        src = (CSRC / header).read_text()
        body = src[src.index(fn):]
        wait, stage, first_store = body.index("pdl_wait();"), body.index(first_x), body.index("out[")
        assert wait < stage < first_store, header
        # before the wait only the weight prefetch: no x, workspace, counter or output access
        assert re.findall(r"\b(stage_x|ws|counters|out|x)\[", body[:wait]) == [], header
        assert "ld_v4(x" not in body[:wait], header


def test_use_pdl_switches_and_restores():
    before = launch.pdl_enabled()
    with launch.use_pdl(not before):
        assert launch.pdl_enabled() is (not before)
        with launch.use_pdl(False):
            assert launch.pdl_enabled() is False
        assert launch.pdl_enabled() is (not before)
    assert launch.pdl_enabled() is before


def test_launch_pdl_refuses_python_ints():
    with pytest.raises(TypeError, match="numpy scalar"):
        cuda_driver.launch_pdl(0, (1,), (32,), (np.int32(1), 5), 0, 0)
