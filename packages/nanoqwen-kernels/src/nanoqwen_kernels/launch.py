"""Run-time side of the kernels: device check, module cache, current-stream launch, input checks.

Every launcher in this package goes through `launch()`: it looks up the kernel in the op family's
module (compiled at first use by `build.load_module`, one module per family and device), wraps the
current torch stream as a CuPy `ExternalStream` and launches on it. Nothing here allocates device
memory or synchronises the host, so launches can be captured in a CUDA graph once each family has
been loaded (call `warm_up()` before capture: loading a module is not capturable).

While a CUDA graph is being captured, a kernel of a `programmatic` family (specs.py) is launched with
programmatic dependent launch (the graph gets a programmatic edge): it may start while the kernel
before it still runs, and waits for its inputs itself (common.cuh's pdl_wait), so its launch, block
start and first weight loads overlap the previous kernel's tail. Eager launches stay plain: an eager
step of small kernels is bound by the host, and this launch path costs the host more than CuPy's
(measured: the real 0.5B's eager prefill of 64 prompts took 0.149 s programmatic, 0.108 s plain).
`NANOQWEN_PDL=0` in the environment launches every kernel plainly (an A/B switch for benchmarks; the
outputs are the same).
Programmatic launches, and a kernel that takes a CUtensorMap by value (an `np.void` argument), go
through `cuLaunchKernelEx` (cuda_driver.py); every other one through CuPy.

Only sm_90 (Hopper) is supported: `require_sm90` raises `UnsupportedDeviceError` on anything else;
there is no slower fallback path.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import torch

from . import build, cuda_driver
from .specs import SPECS


class UnsupportedDeviceError(RuntimeError):
    """The tensor is not on a CUDA device of compute capability 9.0 (H100/H200)."""


_lock = threading.Lock()
_modules: dict[tuple[str, int], object] = {}
_functions: dict[tuple[str, str, int], object] = {}
_streams: dict[tuple[int, int], object] = {}
_checked_devices: set[int] = set()
# programmatic dependent launch for the families that allow it, in graph capture (module docstring)
PROGRAMMATIC = os.environ.get("NANOQWEN_PDL", "1") != "0"


def require_sm90(device: torch.device) -> int:
    """Device index of `device`, after checking it is a CUDA GPU with compute capability 9.0."""
    if device.type != "cuda":
        raise UnsupportedDeviceError(f"nanoqwen kernels need CUDA tensors, got device {device}")
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _checked_devices:
        major, minor = torch.cuda.get_device_capability(index)
        if (major, minor) != (9, 0):
            name = torch.cuda.get_device_name(index)
            raise UnsupportedDeviceError(
                f"nanoqwen kernels are built for sm_90a (H100/H200) only; device {index} ({name}) is "
                f"sm_{major}{minor}. There is no fallback path: use a Hopper GPU."
            )
        _checked_devices.add(index)
    return index


def get_function(family: str, kernel: str, device_index: int):
    """The `cupy.RawKernel` named `kernel` in op family `family` on the given device."""
    key = (family, kernel, device_index)
    fn = _functions.get(key)
    if fn is not None:
        return fn
    import cupy

    with _lock:
        mkey = (family, device_index)
        module = _modules.get(mkey)
        if module is None:
            if family not in SPECS:
                raise KeyError(f"no kernel family {family!r}; known: {sorted(SPECS)}")
            with cupy.cuda.Device(device_index):
                module = build.load_module(SPECS[family])
            _modules[mkey] = module
        with cupy.cuda.Device(device_index):
            fn = module.get_function(kernel)
        _functions[key] = fn
    return fn


def module_global(family: str, name: str, device_index: int):
    """A `cupy.cuda.MemoryPointer` to the `__device__` variable `name` of op family `family` on the
    device (timing probes read their records back through it); the family's module loads first."""
    if (family, device_index) not in _modules:
        raise KeyError(f"kernel family {family!r} is not loaded on device {device_index}: launch it first")
    import cupy

    with cupy.cuda.Device(device_index):
        return _modules[(family, device_index)].get_global(name)


def current_stream(device_index: int):
    """The current torch stream on `device_index`, as a (cached) `cupy.cuda.ExternalStream`."""
    ptr = torch.cuda.current_stream(device_index).cuda_stream
    key = (device_index, ptr)
    stream = _streams.get(key)
    if stream is None:
        import cupy

        stream = cupy.cuda.ExternalStream(ptr, device_index)
        _streams[key] = stream
    return stream


def launch(family: str, kernel: str, device_index: int, grid, block, args, shared_mem: int = 0) -> None:
    """Launch `family.kernel` on the current torch stream, in stream order. `args` are numpy scalars
    (see `ptr`; a CUtensorMap is an `np.void`, launched through `cuda_driver.launch_ex`)."""
    fn = get_function(family, kernel, device_index)
    # the attribute starts at 48 KB less the kernel's static shared memory: opt in whenever the launch
    # needs more than that (not only above 48 KB of dynamic memory: with static memory beside it, less
    # is already too much, CUDA_ERROR_INVALID_VALUE)
    if fn.max_dynamic_shared_size_bytes < shared_mem:
        fn.max_dynamic_shared_size_bytes = shared_mem
    import cupy

    programmatic = (PROGRAMMATIC and SPECS[family].programmatic
                    and torch.cuda.is_current_stream_capturing())
    with cupy.cuda.Device(device_index):
        # the driver path: the programmatic attribute, or a CUtensorMap by value
        if programmatic or any(isinstance(a, np.void) for a in args):
            stream = torch.cuda.current_stream(device_index).cuda_stream
            cuda_driver.launch_ex(fn.kernel.ptr, grid, block, args, shared_mem, stream, programmatic)
            return
        with current_stream(device_index):
            fn(tuple(grid), tuple(block), tuple(args), shared_mem=shared_mem)


def warm_up(families=None, device: torch.device | None = None) -> None:
    """Compile/load the given op families (all by default) so later launches can be graph-captured."""
    device = device or torch.device("cuda", torch.cuda.current_device())
    index = require_sm90(device)
    import cupy

    for family in families or SPECS:
        if (family, index) not in _modules:
            with _lock, cupy.cuda.Device(index):
                _modules[(family, index)] = build.load_module(SPECS[family])


# ---------------------------------------------------------------------------------------------------
# argument helpers
# ---------------------------------------------------------------------------------------------------


def ptr(t: torch.Tensor | None) -> np.uint64:
    """Kernel argument for a tensor's data pointer (0 for None)."""
    return np.uint64(0 if t is None else t.data_ptr())


def i32(v: int) -> np.int32:
    if not -(2**31) <= v < 2**31:
        raise ValueError(f"{v} does not fit in int32")
    return np.int32(v)


def f32(v: float) -> np.float32:
    return np.float32(v)


def check(
    t: torch.Tensor,
    name: str,
    dtype: torch.dtype,
    shape: tuple | None = None,
    device: torch.device | None = None,
    contiguous: bool = True,
    align: int = 16,
) -> None:
    """Raise ValueError/TypeError naming `name` if `t` has the wrong type, dtype, shape, layout or device.

    `shape` entries that are None are not checked.
    """
    # every launch of an eager step checks ~4 tensors: a plain loop here, not a generator under any()
    # (a third less host time per call)
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    if shape is not None:
        have = t.shape
        bad = len(have) != len(shape)
        if not bad:
            for want, got in zip(shape, have, strict=True):  # equal lengths here
                if want is not None and want != got:
                    bad = True
                    break
        if bad:
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name}: expected shape {want}, got {list(have)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected device {device}, got {t.device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name}: must be contiguous")
    if t.numel() > 0 and t.data_ptr() % align != 0:
        raise ValueError(f"{name}: data pointer must be {align}-byte aligned")
