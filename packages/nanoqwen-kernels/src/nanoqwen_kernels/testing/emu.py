"""The package's CUDA kernels run on the CPU, to test what they compute where there is no GPU.

    with emu.emulated(sms=4):
        gemv_int4(...)   # the launchers as they are, on CPU tensors; each launch runs the kernel's
                         # own CUDA source, compiled for the host (csrc/emu/simt.h)

How. A family (specs.py: its `.cu` files and compile options) is compiled with g++ and
`-DNQ_HOST_EMU -include emu/simt.h` into a shared library (cached under ~/.cache/nanoqwen/emu, keyed
by a hash of every source and option), with its `extern "C"` kernels registered by name (found in the
preprocessed unit). `launch` has `launch.launch`'s signature: the numpy-scalar arguments are passed by
pointer, as cuLaunchKernel takes them, and their count and sizes are checked against the kernel's
parameters (a missing or misplaced argument of another size fails the launch). Every CTA runs on
an OS thread of its own, all at once, and its threads are fibers that switch at warp-collective
operations, barriers, mbarrier waits and at random points; bulk copies and cp.async complete late
(emu/simt.h has the model and what it does not model: the memory model is the host's, stronger than
the GPU's, so missing fences go unseen; fast-math intrinsics are the host's precise functions).

`emulated()` points the launchers' module-level names (`launch`, `require_sm90`, the SM count) of gemv,
gemm (both kernels: mma.sync, and wgmma with TMA), layer_ops, attention and sampling at the emulator,
and cuda_driver.tensor_map_2d at the emulator's tensor maps, and restores them on exit. `sms` is the SM
count the launchers plan for (the GEMV's and GEMM's split-K, the attention plans' split count). It is
slow (fiber switches): for small shapes only.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import itertools
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from ..build import CSRC_DIR, KernelSpec

EMU_DIR = CSRC_DIR / "emu"
CACHE_DIR = Path(os.environ.get("NANOQWEN_CACHE", Path.home() / ".cache" / "nanoqwen")) / "emu"
CXX_FLAGS = ("-std=c++17", "-O1", "-fPIC", "-shared", "-ffp-contract=off", "-Wno-unknown-pragmas",
             "-ftls-model=global-dynamic", "-DNQ_HOST_EMU")
_ENTRY_RE = re.compile(r'extern\s+"C"\s+void\s+(\w+)\s*\(')

_libraries: dict[str, ctypes.CDLL] = {}
_launches = itertools.count()  # launches since `emulated()` was entered: with its seed, each one's seed
_settings = {"seed": 0, "timeout_s": 300.0}


class EmulatorError(RuntimeError):
    """A kernel launch on the emulator failed: a deadlock, a timeout, a bad bulk copy or mbarrier use."""


def compiler() -> str:
    cxx = os.environ.get("CXX") or shutil.which("g++")
    if not cxx:
        raise EmulatorError("the kernel emulator needs a C++17 compiler (g++, or $CXX)")
    return cxx


def _source_hash(spec: KernelSpec, cxx: str) -> str:
    """Of everything the build depends on: the sources under csrc/ (all of them: a family includes
    headers), this module (it writes the unit), the options, the compiler and its version."""
    h = hashlib.sha256()
    for path in sorted(CSRC_DIR.rglob("*")):
        if path.suffix in (".cu", ".cuh", ".h", ".cpp"):
            h.update(str(path.relative_to(CSRC_DIR)).encode() + path.read_bytes())
    h.update(Path(__file__).read_bytes())
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout
    h.update("\0".join((*spec.sources, *spec.options, *CXX_FLAGS, cxx, version)).encode())
    return h.hexdigest()[:16]


def entry_points(spec: KernelSpec) -> list[str]:
    """The `extern "C"` kernels of a family, from its preprocessed emulator unit."""
    unit = "".join(f'#include "{s}"\n' for s in spec.sources)
    out = subprocess.run([compiler(), "-E", "-P", *CXX_FLAGS[:1], "-DNQ_HOST_EMU", *spec.options,
                          "-include", str(EMU_DIR / "simt.h"), "-I", str(CSRC_DIR), "-x", "c++", "-"],
                         input=unit, capture_output=True, text=True, check=False)
    if out.returncode:
        raise EmulatorError(f"preprocessing family {spec.name!r} for the emulator failed:\n"
                            f"{out.stderr[-4000:]}")
    return sorted(set(_ENTRY_RE.findall(out.stdout)))


def library(spec: KernelSpec) -> ctypes.CDLL:
    """The family's emulator library, compiled on first use (cached by source hash)."""
    cxx = compiler()
    key = f"{spec.name}-{_source_hash(spec, cxx)}"
    lib = _libraries.get(key)
    if lib is not None:
        return lib
    so = CACHE_DIR / f"libnqemu-{key}.so"
    if not so.exists():
        names = entry_points(spec)
        if not names:
            raise EmulatorError(f"family {spec.name!r} has no extern \"C\" kernels")
        regs = ",\n".join(f'  nq_emu::entry("{n}", &{n})' for n in names)
        unit = "".join(f'#include "{s}"\n' for s in spec.sources) + (
            f"static const nq_emu::Registration nq_emu_regs[] = {{\n{regs}\n}};\n"
            f"static nq_emu::Registrar nq_emu_registrar(nq_emu_regs, {len(names)});\n")
        CACHE_DIR.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=CACHE_DIR) as tmp:
            src = Path(tmp) / f"emu_{spec.name}.cpp"
            src.write_text(unit)
            out = Path(tmp) / so.name
            cmd = [cxx, *CXX_FLAGS, *spec.options, "-include", str(EMU_DIR / "simt.h"), "-I", str(CSRC_DIR),
                   str(src), str(EMU_DIR / "runtime.cpp"), "-o", str(out), "-lpthread"]
            res = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if res.returncode:
                raise EmulatorError(f"compiling family {spec.name!r} for the emulator failed:\n"
                                    f"{res.stderr[-6000:]}")
            os.replace(out, so)  # atomic: a concurrent test process sees the whole library or none
    lib = ctypes.CDLL(str(so))
    dims = ctypes.POINTER(ctypes.c_uint)
    lib.nq_emu_launch.argtypes = [ctypes.c_char_p, dims, dims, ctypes.c_uint, ctypes.POINTER(ctypes.c_void_p),
                                  ctypes.c_int, dims, ctypes.c_ulonglong, ctypes.c_double, ctypes.c_char_p,
                                  ctypes.c_int]
    lib.nq_emu_launch.restype = ctypes.c_int
    _libraries[key] = lib
    return lib


def loaded_families() -> set[str]:
    """The families (specs.py names) whose emulator libraries this process has loaded."""
    return {key.rsplit("-", 1)[0] for key in _libraries}


def _dims(d) -> tuple[int, int, int]:
    d = tuple(int(x) for x in (d if isinstance(d, tuple | list) else (d,)))
    return (d + (1, 1, 1))[:3]


def launch(family: str, kernel: str, device_index: int, grid, block, args, shared_mem: int = 0) -> None:
    """`launch.launch` on the emulator (same arguments; `device_index` is ignored: launches run one after
    the other). Raises EmulatorError with the emulator's reason when the launch fails."""
    from ..specs import SPECS

    if family not in SPECS:
        raise KeyError(f"no kernel family {family!r}; known: {sorted(SPECS)}")
    launch_spec(SPECS[family], kernel, grid, block, args, shared_mem)


def launch_spec(spec: KernelSpec, kernel: str, grid, block, args, shared_mem: int = 0) -> None:
    """Launch `kernel` of the build `spec` (which need not be in specs.py: the emulator's self-tests)."""
    lib = library(spec)
    for i, a in enumerate(args):
        if not isinstance(a, np.generic):
            raise TypeError(f"{spec.name}.{kernel}: argument {i} is a {type(a).__name__}, not a numpy scalar "
                            "(launch.ptr / i32 / f32)")
    holders = [_aligned_copy(a) for a in args]  # each argument's bytes, alive for the call
    params = (ctypes.c_void_p * max(1, len(holders)))(*[h.ctypes.data for h in holders])
    sizes = (ctypes.c_uint * max(1, len(holders)))(*[h.nbytes for h in holders])
    g, b = (ctypes.c_uint * 3)(*_dims(grid)), (ctypes.c_uint * 3)(*_dims(block))
    err = ctypes.create_string_buffer(512)
    seed = _settings["seed"] * 1_000_003 + next(_launches)
    code = lib.nq_emu_launch(kernel.encode(), g, b, int(shared_mem), params, len(holders), sizes, seed,
                             _settings["timeout_s"], err, len(err))
    if code:
        raise EmulatorError(f"{spec.name}.{kernel}: {err.value.decode()}")


def _aligned_copy(arg: np.generic) -> np.ndarray:
    """The argument's bytes in a 64-byte-aligned buffer (a by-value struct such as a tensor map is
    alignas(64) in the kernel, and the entry's trampoline copies it from there)."""
    raw = np.array(arg)
    buf = np.zeros(raw.nbytes + 64, np.uint8)
    off = -buf.ctypes.data % 64
    out = buf[off : off + raw.nbytes]
    out[:] = np.frombuffer(raw.tobytes(), np.uint8)
    return out


TENSOR_MAP_MAGIC = 0x4E51454D55544D32  # "NQEMUTM2": runtime.cpp's EmuTensorMap


def tensor_map_2d(address: int, rows: int, cols: int, box_rows: int, box_cols: int, dtype: int,
                  swizzle: int) -> np.void:
    """`cuda_driver.tensor_map_2d` for the emulator: the same 128-byte kernel argument, holding the
    emulator's own encoding of the matrix and its box (emu/runtime.cpp's EmuTensorMap), checked as the
    driver checks it (16-byte aligned address and row pitch; a 128-byte box row for the 128-byte
    swizzle)."""
    from .. import cuda_driver as cd

    elem = cd._ELEMENT_BYTES[dtype]
    row_bytes = cols * elem
    swizzled = swizzle == cd.CU_TENSOR_MAP_SWIZZLE_128B
    if address % 16 or row_bytes % 16 or (swizzled and box_cols * elem != 128):
        raise cd.CudaDriverError(f"tensor map [{rows}, {cols}] at {address:#x}, box [{box_rows}, "
                                 f"{box_cols}]: misaligned (the emulator checks as the driver does)")
    words = np.array([TENSOR_MAP_MAGIC, address, rows, cols, row_bytes], np.uint64).tobytes()
    words += np.array([box_rows, box_cols, elem, swizzle], np.uint32).tobytes()
    return np.void(words.ljust(128, b"\0"))


@contextlib.contextmanager
def emulated(sms: int = 4, seed: int = 0, timeout_s: float = 300.0):
    """Run the launchers of gemv, gemm, layer_ops, attention and sampling on the emulator inside the
    block (see the module header); `sms`: the SM count they plan for (the GEMV's and the GEMM's split-K,
    the attention plans' split count); `seed`: varies the threads' interleavings. The wgmma GEMM's
    tensor maps are the emulator's own (`tensor_map_2d`)."""
    from .. import attention, cuda_driver, gemm, gemv, layer_ops, sampling

    launchers = (gemv, gemm, layer_ops, attention, sampling)
    patches = [(m, "launch", launch) for m in launchers if hasattr(m, "launch")]
    patches += [(cuda_driver, "tensor_map_2d", tensor_map_2d)]
    patches += [(m, "require_sm90", lambda device: 0) for m in launchers if hasattr(m, "require_sm90")]
    patches += [(gemv, "_sm_count", lambda index: sms)]
    saved = [(m, name, getattr(m, name)) for m, name, _ in patches]
    global _launches
    old, old_launches = dict(_settings), _launches
    _settings.update(seed=seed, timeout_s=timeout_s)
    _launches = itertools.count()  # the same seed replays the same launches' interleavings
    for m, name, value in patches:
        setattr(m, name, value)
    try:
        yield
    finally:
        for m, name, value in saved:
            setattr(m, name, value)
        _settings.update(old)
        _launches = old_launches
