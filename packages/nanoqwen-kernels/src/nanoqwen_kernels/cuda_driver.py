"""ctypes bindings of the CUDA driver calls CuPy does not expose: `cuLaunchKernelEx` and
`cuTensorMapEncodeTiled`.

`cuLaunchKernelEx` launches the kernels that take a CUtensorMap by value (the wgmma GEMM, family
"gemm_ws"), which CuPy's launch cannot pass, and every launch with the programmatic-dependent-launch
attribute. The structures mirror cuda.h (CUDA 12.0 and later;
`tests/test_launch_cpu.py` compiles a C program against the local cuda.h and compares sizes and
offsets).
"""

from __future__ import annotations

import ctypes
import functools
import itertools

import numpy as np


class CUlaunchAttribute(ctypes.Structure):
    """cuda.h CUlaunchAttribute: an id (enum, 4 bytes), 4 bytes of padding, a 64-byte value union."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


class CUlaunchConfig(ctypes.Structure):
    """cuda.h CUlaunchConfig."""

    _fields_ = [
        ("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
        ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
        ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(CUlaunchAttribute)), ("numAttrs", ctypes.c_uint),
    ]  # fmt: skip


class CudaDriverError(RuntimeError):
    """A CUDA driver call failed; the message carries the driver's error name and text."""


@functools.cache
def _libcuda() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(CUlaunchConfig), ctypes.c_void_p,
                                     ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p)]
    lib.cuLaunchKernelEx.restype = ctypes.c_int
    lib.cuTensorMapEncodeTiled.argtypes = [
        ctypes.c_void_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint64),
        ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint), ctypes.POINTER(ctypes.c_uint),
        ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
    ]  # fmt: skip
    lib.cuTensorMapEncodeTiled.restype = ctypes.c_int
    lib.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    return lib


def _error_text(lib: ctypes.CDLL, code: int) -> str:
    name, text = ctypes.c_char_p(), ctypes.c_char_p()
    lib.cuGetErrorName(code, ctypes.byref(name))
    lib.cuGetErrorString(code, ctypes.byref(text))
    return f"{(name.value or b'?').decode()} ({code}): {(text.value or b'?').decode()}"


# cuda.h CUlaunchAttributeID: the launch may start before the previous kernel on the stream completes
# (programmatic dependent launch; value: an int, 1 = allowed)
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6
_PROGRAMMATIC_ATTRS = (CUlaunchAttribute * 1)()
_PROGRAMMATIC_ATTRS[0].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
# CUlaunchAttributeValue.programmaticStreamSerializationAllowed = 1
_PROGRAMMATIC_ATTRS[0].value = (1).to_bytes(4, "little")


def launch_ex(function_ptr: int, grid, block, args, shared_mem: int, stream_ptr: int,
              programmatic: bool = False) -> None:
    """cuLaunchKernelEx of the CUfunction `function_ptr` on `stream_ptr`. `args`: numpy scalars in the
    kernel's parameter order (their dtype gives each parameter's size; a 128-byte `np.void` is a
    CUtensorMap passed by value). programmatic: with the programmatic stream serialization attribute
    (the kernel must wait for its inputs itself: common.cuh's pdl_wait). Raises CudaDriverError when the
    driver refuses the launch."""
    if not all(isinstance(a, np.generic) for a in args):
        raise TypeError("launch_ex: every argument must be a numpy scalar (its dtype gives the size)")
    lib = _libcuda()
    gx, gy, gz = (tuple(grid) + (1, 1))[:3]
    bx, by, bz = (tuple(block) + (1, 1))[:3]
    attrs = _PROGRAMMATIC_ATTRS if programmatic else None
    cfg = CUlaunchConfig(gx, gy, gz, bx, by, bz, shared_mem, stream_ptr, attrs, 1 if programmatic else 0)
    # the parameters' bytes back to back in one buffer (the driver copies each from its pointer)
    blob = b"".join([a.tobytes() for a in args])
    holder = ctypes.create_string_buffer(blob, max(1, len(blob)))
    base = ctypes.addressof(holder)
    offsets = itertools.accumulate([a.nbytes for a in args], initial=0)
    params = (ctypes.c_void_p * max(1, len(args)))(*[base + o for o in offsets][: len(args)])
    code = lib.cuLaunchKernelEx(ctypes.byref(cfg), function_ptr, params, None)
    if code != 0:
        raise CudaDriverError(f"cuLaunchKernelEx (grid {grid}, block {block}, {shared_mem} B shared): "
                              + _error_text(lib, code))


# cuda.h enums of cuTensorMapEncodeTiled
CU_TENSOR_MAP_DATA_TYPE_UINT64 = 4
CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 = 9
CU_TENSOR_MAP_SWIZZLE_NONE = 0
CU_TENSOR_MAP_SWIZZLE_128B = 3
CU_TENSOR_MAP_L2_PROMOTION_L2_256B = 3
_ELEMENT_BYTES = {CU_TENSOR_MAP_DATA_TYPE_UINT64: 8, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16: 2}


@functools.lru_cache(maxsize=4096)
def tensor_map_2d(address: int, rows: int, cols: int, box_rows: int, box_cols: int, dtype: int,
                  swizzle: int) -> np.void:
    """A CUtensorMap (128 bytes, as an `np.void` kernel argument) of a row-major matrix [rows, cols] of
    `dtype` (a CU_TENSOR_MAP_DATA_TYPE_*) at `address`, tiled in boxes of [box_rows, box_cols],
    out-of-range elements read as zeros. Cached: the engine's buffers and weights keep their addresses.
    Raises CudaDriverError when the driver refuses it (alignment: address and row pitch multiples of
    16; with the 128-byte swizzle a box row must be 128 bytes)."""
    lib = _libcuda()
    buf = (ctypes.c_ubyte * 128)()
    dims = (ctypes.c_uint64 * 2)(cols, rows)
    strides = (ctypes.c_uint64 * 1)(cols * _ELEMENT_BYTES[dtype])
    box = (ctypes.c_uint * 2)(box_cols, box_rows)
    elem = (ctypes.c_uint * 2)(1, 1)
    code = lib.cuTensorMapEncodeTiled(buf, dtype, 2, ctypes.c_void_p(address), dims, strides, box, elem, 0,
                                      swizzle, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, 0)
    if code != 0:
        raise CudaDriverError(f"cuTensorMapEncodeTiled ([{rows}, {cols}] of type {dtype} at {address:#x}, "
                              f"box [{box_rows}, {box_cols}]): " + _error_text(lib, code))
    return np.void(bytes(buf))


def tensor_map_2d_bf16(address: int, rows: int, cols: int, box_rows: int, box_cols: int) -> np.void:
    """`tensor_map_2d` of a bf16 matrix with the 128-byte swizzle (box_cols * 2 must be 128)."""
    return tensor_map_2d(address, rows, cols, box_rows, box_cols, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                         CU_TENSOR_MAP_SWIZZLE_128B)
