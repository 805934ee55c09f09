"""CPU: programmatic dependent launch plumbing. PDL is an explicit `pdl=` argument of every launch,
nothing else (no environment variable, no global switch, no context manager).

- The ctypes mirrors of cuda.h's CUlaunchConfig / CUlaunchAttribute have the C layout: a small C
  program compiled against the local cuda.h prints sizes and offsets, compared field by field.
- Every kernel entry point keeps the PDL contract of csrc/common.cuh: it reaches `pdl_wait` (directly
  or through `pdl_enter`) — a kernel launched with the attribute but without the wait would race its
  predecessor.
- Every public launcher takes a keyword-only `pdl=False` and hands it to each of its launches;
  `launch.launch` takes the cuLaunchKernelEx path when pdl is True (or a CUtensorMap is passed by
  value, without the attribute then); arguments that are not
  numpy scalars are refused before anything reaches the driver.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import inspect
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from nanoqwen_kernels import attention, cuda_driver, gemm, gemv, launch, layer_ops, sampling
from nanoqwen_kernels.specs import SPECS

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


# Families whose kernels are never launched with PDL, with the launchers that prove it (none takes a
# `pdl` argument; checked below, so the exemption ends the day one does).
NO_PDL_FAMILIES = {"bench": ("nanoqwen_kernels.bench", ("read_xor", "spin"))}  # benchmark tools


def test_every_kernel_entry_waits_before_touching_dependent_memory():
    seen = 0
    for family, spec in sorted(SPECS.items()):
        if family in NO_PDL_FAMILIES:
            module, names = NO_PDL_FAMILIES[family]
            mod = importlib.import_module(module)
            for fn in names:
                assert "pdl" not in inspect.signature(getattr(mod, fn)).parameters, f"{module}.{fn}"
            continue
        for source in spec.sources:
            for name, body in _kernel_bodies((CSRC / source).read_text()):
                seen += 1
                first = body.replace("\\", " ").split(";")[0].strip()
                if first.startswith(("gemv_int4<", "nq_gemv8::gemv_int8<", "gemm_int4<", "gemm_int4_ws<")):
                    # the decode GEMVs prefetch weights first; their wait is inside (checked below)
                    continue
                assert first in ("pdl_enter()", "pdl_wait()"), f"{source}:{name} starts with {first!r}"
    assert seen >= 10
    for header, fn, first_x, store in (
        ("gemv_int4.cuh", "NQ_DEVICE void gemv_int4(", "stage_x<XMODE>(xs", "out["),
        ("gemv_int8.cuh", "NQ_DEVICE void gemv_int8(", "ld_v4(x + ", "out["),
        ("gemm_int4.cuh", "NQ_DEVICE void gemm_int4(", "issue(0);", "out["),
        # the producer warp waits; the consumers store (finish_tile) only what it delivered after
        ("gemm_int4_ws.cuh", "NQ_DEVICE void gemm_int4_ws(", "tma_load_2d(slot", "finish_tile<"),
    ):
        src = (CSRC / header).read_text()
        body = src[src.index(fn):]
        wait, stage, first_store = body.index("pdl_wait();"), body.index(first_x), body.index(store)
        assert wait < stage < first_store, header
        # before the wait only the weight prefetch: no x, workspace, counter or output access
        assert re.findall(r"\b(stage_x|ws|counters|out|x)\[", body[:wait]) == [], header
        assert "ld_v4(x" not in body[:wait], header


LAUNCHERS = [
    gemv.gemv_int4, gemv.gemv_int4_qkv_rope, gemv.gemv_int8, gemv.dequantize_int4, gemv.linear_int4_prefill,
    gemm.gemm_int4,
    layer_ops.rms_norm, layer_ops.fused_add_rms_norm, layer_ops.silu_mul, layer_ops.embedding_gather,
    layer_ops.qkv_rope_kv_write, sampling.sample_tokens, attention.PagedAttentionPlan.run,
]  # fmt: skip


@pytest.mark.parametrize("fn", LAUNCHERS, ids=lambda f: f.__qualname__)
def test_every_launcher_takes_keyword_only_pdl_off_by_default(fn):
    p = inspect.signature(fn).parameters.get("pdl")
    assert p is not None and p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is False


def test_no_global_pdl_switch():
    for name in ("use_pdl", "pdl_enabled", "_pdl"):
        assert not hasattr(launch, name), name
    assert "NANOQWEN_PDL" not in Path(launch.__file__).read_text()
    assert inspect.signature(launch.launch).parameters["pdl"].default is False


def _cpu_attention_plan(mode: str, num_splits: int) -> attention.PagedAttentionPlan:
    """A plan with CPU work buffers (PagedAttentionPlan's constructor wants an sm_90 GPU): the fields
    run() reads, as the constructor sets them for 14/2/64 heads, block 16, batch 2, context 32."""
    plan = object.__new__(attention.PagedAttentionPlan)
    plan.geometry = attention.AttentionGeometry(14, 2, 64, 16)
    plan.mode, plan.device, plan.device_index = mode, torch.device("cpu"), 0
    plan.max_batch, plan.max_query_len, plan.max_total_q, plan.max_context_len = 2, 1, 2, 32
    plan.kernel = attention._KERNELS[(mode, 64)]
    plan.num_row_tiles, plan.num_splits, plan.scale_log2 = 1, num_splits, 0.18
    plan._decode_qsl = torch.arange(3, dtype=torch.int32)
    plan.work_o = torch.empty(num_splits, 2, 14, 64)
    plan.work_lse = torch.empty(num_splits, 2, 14)
    plan.counters = torch.zeros(2 * 2 * 1, dtype=torch.int32)
    plan.work_splits = torch.empty(2, 14, dtype=torch.int32)
    plan.unsplit_max_tiles, plan.fuse_max_splits = 2, 2  # 3 splits: the combine kernel too
    return plan


def _call_every_launcher(pdl_kw: dict) -> None:
    """One call of each public launcher on small CPU tensors (their checks pass; the launch is mocked)."""
    bf = dict(dtype=torch.bfloat16)
    n, k = 16, 256
    w4 = gemv.Int4Weight(torch.zeros(n // 8, k // 128, 32, 4, dtype=torch.int32),
                         torch.ones(n, k // 128, **bf), None, n, k, 128)  # fmt: skip
    plan = gemv.plan_shape(n, k, 132, 10_000)  # split K: the workspace path
    ws = gemv.GemvWorkspace.allocate([plan], torch.device("cpu"))
    x, out = torch.zeros(2, k, **bf), torch.zeros(2, n, **bf)
    gemv.gemv_int4(x, w4, out, None, ws, plan, **pdl_kw)
    gemv.gemv_int4(torch.zeros(2, 2 * k, **bf), w4, out, None, ws, plan, silu_mul_input=True, **pdl_kw)
    w8 = gemv.Int8Weight(torch.zeros(n, k, dtype=torch.int8), torch.ones(n, k // 128, **bf), n, k, 128)
    gemv.gemv_int8(x, w8, out, **pdl_kw)
    dense = torch.zeros(n, k, **bf)
    gemv.dequantize_int4(w4, dense, **pdl_kw)
    gemv.linear_int4_prefill(torch.zeros(9, k, **bf), w4, torch.zeros(9, n, **bf), dense, **pdl_kw)
    gplan = gemm.plan_gemm_shape(n, k, 128, 16, 132)  # split K: the workspace path
    gws = gemm.allocate_workspace([gplan], torch.device("cpu"))
    gemm.gemm_int4(torch.zeros(9, k, **bf), w4, torch.zeros(9, n, **bf), None, gws, gplan, **pdl_kw)
    h = torch.zeros(3, 64, **bf)
    layer_ops.rms_norm(h, torch.ones(64, **bf), torch.zeros_like(h), 1e-6, **pdl_kw)
    layer_ops.fused_add_rms_norm(h, torch.zeros_like(h), torch.ones(64, **bf), torch.zeros_like(h), 1e-6,
                                 **pdl_kw)  # fmt: skip
    layer_ops.silu_mul(torch.zeros(3, 128, **bf), torch.zeros(3, 64, **bf), **pdl_kw)
    layer_ops.embedding_gather(torch.zeros(3, dtype=torch.int32), torch.zeros(10, 64, **bf), h, **pdl_kw)
    shape = layer_ops.AttentionShape(4, 2, 32)
    cache = torch.zeros(4, 2, 16, 32, **bf)
    pos = torch.zeros(3, dtype=torch.int32)
    layer_ops.qkv_rope_kv_write(torch.zeros(3, shape.qkv_width, **bf), shape, pos, pos,
                                layer_ops.rope_inv_freq(32, 1e6, "cpu"), torch.zeros(3, 4, 32, **bf), cache,
                                cache.clone(), **pdl_kw)  # fmt: skip
    wqkv = gemv.Int4Weight(torch.zeros(shape.qkv_width // 8, k // 128, 32, 4, dtype=torch.int32),
                           torch.ones(shape.qkv_width, k // 128, **bf), None, shape.qkv_width, k, 128)
    qplan = gemv.plan_shape(shape.qkv_width, k, 132, 10_000)  # split K: the workspace path
    gemv.gemv_int4_qkv_rope(torch.zeros(3, k, **bf), wqkv, None, shape, pos, pos,
                            layer_ops.rope_inv_freq(32, 1e6, "cpu"), torch.zeros(3, 4, 32, **bf), cache,
                            cache.clone(), gemv.GemvWorkspace.allocate([qplan], torch.device("cpu")), qplan,
                            **pdl_kw)  # fmt: skip
    sampling.sample_tokens(torch.zeros(2, 64, **bf), sampling.SamplingState.allocate(2, "cpu"),
                           torch.zeros(2, dtype=torch.int32), **pdl_kw)  # fmt: skip
    kv = torch.zeros(5, 2, 16, 64, **bf)
    pages = torch.zeros(2, 2, dtype=torch.int32)
    _cpu_attention_plan("decode", num_splits=3).run(torch.zeros(2, 14, 64, **bf), kv, kv, pages,
                                                    torch.ones(2, dtype=torch.int32), **pdl_kw)


@pytest.mark.parametrize("pdl", [None, False, True], ids=["default", "off", "on"])
def test_launchers_pass_pdl_to_every_launch(pdl, monkeypatch):
    """Each launcher's kernels (the split combine of attention too) get the caller's pdl, and plain
    launches when the caller says nothing."""
    launched: list[tuple[str, bool]] = []

    def record(family, kernel, *args, pdl=False, **kw):
        launched.append((kernel, pdl))

    for mod in (gemv, gemm, layer_ops, sampling, attention):
        monkeypatch.setattr(mod, "require_sm90", lambda device: 0)
        monkeypatch.setattr(mod, "launch", record)
    monkeypatch.setattr(gemv, "_sm_count", lambda index: 132)
    _call_every_launcher({} if pdl is None else {"pdl": pdl})
    kernels = [k for k, _ in launched]
    assert len(kernels) == 15 and "paged_attention_combine_hd64" in kernels, kernels
    assert all(p is bool(pdl) for _, p in launched), launched


def test_launch_takes_the_pdl_path_only_when_asked(monkeypatch):
    """launch.launch: pdl=True -> cuda_driver.launch_pdl on the current torch stream; a by-value
    CUtensorMap argument -> the same, with pdl=False; otherwise the plain CuPy launch. (CuPy, the
    module and the stream are stand-ins: no GPU here.)"""
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
    def launch_pdl(function_ptr, grid, block, args, shared_mem, stream_ptr, *, pdl=True):
        calls.append(("driver", function_ptr, shared_mem, stream_ptr, pdl))

    monkeypatch.setattr(cuda_driver, "launch_pdl", launch_pdl)
    args = (np.int32(1),)
    launch.launch("gemv", "k", 0, (2, 1, 1), (32, 1, 1), args)
    launch.launch("gemv", "k", 0, (2, 1, 1), (32, 1, 1), args, 64, pdl=False)
    launch.launch("gemv", "k", 0, (2, 1, 1), (32, 1, 1), args, 64, pdl=True)
    # a CUtensorMap by value (np.void) needs the driver path, without the PDL attribute unless asked
    launch.launch("gemm_ws", "k", 0, (2, 1, 1), (32, 1, 1), args + (np.void(bytes(128)),), 64)
    assert calls == [("plain", (2, 1, 1), (32, 1, 1), 0), ("plain", (2, 1, 1), (32, 1, 1), 64),
                     ("driver", 1234, 64, 77, True), ("driver", 1234, 64, 77, False)]  # fmt: skip


def test_launch_pdl_refuses_python_ints():
    with pytest.raises(TypeError, match="numpy scalar"):
        cuda_driver.launch_pdl(0, (1,), (32,), (np.int32(1), 5), 0, 0)
