"""CPU: the launch plumbing. `launch.launch` takes the `cuLaunchKernelEx` path (cuda_driver.py) only for a
kernel that takes a CUtensorMap by value, the CuPy launch otherwise; the ctypes mirrors of cuda.h's
CUlaunchConfig / CUlaunchAttribute have the C layout (a small C program compiled against the local
cuda.h prints sizes and offsets, compared field by field); arguments that are not numpy scalars are
refused before anything reaches the driver.
"""

from __future__ import annotations

import contextlib
import ctypes
import shutil
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from nanoqwen_kernels import cuda_driver, launch
from nanoqwen_kernels.specs import SPECS


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
  printf("programmatic %d\n", (int)CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION);
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
    assert cuda_driver.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION == c["programmatic"]


@pytest.mark.parametrize(("enabled", "capturing"), [(False, True), (True, False), (True, True)])
def test_launch_takes_the_driver_path_for_a_tensor_map_or_a_programmatic_family(monkeypatch, enabled,
                                                                                capturing):
    """launch.launch: a by-value CUtensorMap argument (np.void), or a family specs.py marks programmatic
    while launch.PROGRAMMATIC is on and a graph is being captured -> cuda_driver.launch_ex on the current
    torch stream (with the attribute for the latter); otherwise the plain CuPy launch. (CuPy, the module,
    the stream and the capture state are stand-ins: no GPU here.)"""
    programmatic = enabled and capturing
    calls = []

    class Kernel:
        max_dynamic_shared_size_bytes = 0
        kernel = types.SimpleNamespace(ptr=1234)

        def __call__(self, grid, block, args, shared_mem=0):
            calls.append(("plain", grid, block, shared_mem))

    fake_cupy = types.ModuleType("cupy")
    fake_cupy.cuda = types.SimpleNamespace(Device=lambda index: contextlib.nullcontext())
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    monkeypatch.setattr(launch, "get_function", lambda family, kernel, index: Kernel())
    monkeypatch.setattr(launch, "current_stream", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda index: types.SimpleNamespace(cuda_stream=77))

    def launch_ex(function_ptr, grid, block, args, shared_mem, stream_ptr, programmatic):
        calls.append(("driver", function_ptr, shared_mem, stream_ptr, programmatic))

    monkeypatch.setattr(cuda_driver, "launch_ex", launch_ex)
    monkeypatch.setattr(launch, "PROGRAMMATIC", enabled)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
    assert SPECS["gemv"].programmatic and SPECS["gemm_ws"].programmatic and not SPECS["bench"].programmatic
    args = (np.int32(1),)
    launch.launch("gemv", "k", 0, (2, 1, 1), (32, 1, 1), args)
    launch.launch("bench", "k", 0, (2, 1, 1), (32, 1, 1), args, 64)
    launch.launch("gemm_ws", "k", 0, (2, 1, 1), (32, 1, 1), args + (np.void(bytes(128)),), 64)
    gemv = ("driver", 1234, 0, 77, True) if programmatic else ("plain", (2, 1, 1), (32, 1, 1), 0)
    assert calls == [gemv, ("plain", (2, 1, 1), (32, 1, 1), 64), ("driver", 1234, 64, 77, programmatic)]


@pytest.mark.parametrize("programmatic", [False, True])
def test_launch_ex_passes_each_parameter_and_the_attribute(monkeypatch, programmatic):
    """cuda_driver.launch_ex: what cuLaunchKernelEx receives (a stand-in driver reads it during the call):
    the grid, block, shared memory and stream; one pointer per parameter to that parameter's bytes; with
    programmatic, one attribute: CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (6), value 1."""
    seen = {}

    class Lib:
        def cuLaunchKernelEx(self, cfg_ref, function_ptr, params, extra):  # noqa: N802 (the driver's name)
            cfg = ctypes.cast(cfg_ref, ctypes.POINTER(cuda_driver.CUlaunchConfig)).contents
            seen["dims"] = (cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ, cfg.blockDimX, cfg.sharedMemBytes,
                            cfg.hStream)
            seen["attrs"] = [(cfg.attrs[i].id, int.from_bytes(ctypes.string_at(
                ctypes.addressof(cfg.attrs[i]) + cuda_driver.CUlaunchAttribute.value.offset, 4), "little"))
                for i in range(cfg.numAttrs)]  # fmt: skip
            seen["params"] = [ctypes.string_at(params[i], size) for i, size in enumerate((8, 4, 2, 128))]
            seen["function"] = function_ptr
            return 0

    monkeypatch.setattr(cuda_driver, "_libcuda", lambda: Lib())
    tmap = np.void(bytes(range(128)))
    args = (np.uint64(0x1122334455667788), np.int32(-5), np.float16(1.5), tmap)
    cuda_driver.launch_ex(99, (3, 2), (64,), args, 1024, 555, programmatic)
    assert seen["function"] == 99 and seen["dims"] == (3, 2, 1, 64, 1024, 555)
    assert seen["params"] == [a.tobytes() for a in args]
    assert seen["attrs"] == ([(cuda_driver.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, 1)]
                             if programmatic else [])


def test_launch_ex_refuses_python_ints():
    with pytest.raises(TypeError, match="numpy scalar"):
        cuda_driver.launch_ex(0, (1,), (32,), (np.int32(1), 5), 0, 0)
