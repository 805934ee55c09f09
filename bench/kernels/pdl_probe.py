"""Does programmatic dependent launch take effect, and what does it buy per kernel? (GPU machine)

    PYTHONPATH=packages/nanoqwen-format/src:packages/nanoqwen-model/src:packages/nanoqwen-kernels/src \
        python3 bench/kernels/pdl_probe.py

1. Overlap probe: kernel `spin` (132 blocks) triggers its dependents at once and spins ~20 us;
   kernel `probe` (launched after it on the same stream) stamps %globaltimer before and after
   `griddepcontrol.wait`. With PDL in effect, probe's first stamp comes before spin's end. Eager and
   inside a captured CUDA graph, with the attribute and without.
2. Chains: R back-to-back launches in one graph (each GEMV on its own weight copy, > 4x L2), timed
   with PDL on and off (the launchers' `pdl=` argument): per-launch time of each 7B decode GEMV at
   M = 1, and of a norm + o-GEMV pair.
One JSON object on stdout.
"""

# ruff: noqa: B023
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch
from nanoqwen_kernels import cuda_driver, gemv, layer_ops

sys.path.insert(0, str(Path(__file__).parent))
from bench_kernels import L2_ROTATE_BYTES, random_weight, time_graph  # noqa: E402

SRC = r"""
extern "C" __global__ void spin(unsigned long long* t, long long cycles) {
  asm volatile("griddepcontrol.launch_dependents;");
  long long s = clock64();
  while (clock64() - s < cycles) {}
  unsigned long long now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  atomicMax(t, now);
}
extern "C" __global__ void probe(unsigned long long* t) {
  unsigned long long now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  atomicMin(t + 1, now);
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
  atomicMin(t + 2, now);
}
"""


def stamps(v) -> dict:
    return {"probe_start_minus_spin_end_ns": v[1] - v[0], "wait_end_minus_spin_end_ns": v[2] - v[0]}


def overlap_probe() -> dict:
    import cupy
    import numpy as np

    mod = cupy.RawModule(code=SRC, options=("-arch=sm_90a",))
    spin, probe = mod.get_function("spin"), mod.get_function("probe")
    t = torch.zeros(3, dtype=torch.int64, device="cuda")
    init = torch.tensor([0, 2**62, 2**62], dtype=torch.int64, device="cuda")

    def go(fn, args, pdl: bool, stream: int):
        if pdl:
            cuda_driver.launch_pdl(fn.kernel.ptr, (132,), (32,), args, 0, stream)
        else:
            with cupy.cuda.ExternalStream(stream):
                fn((132,), (32,), args)

    def step(spin_pdl: bool, probe_pdl: bool):
        t.copy_(init)
        stream = torch.cuda.current_stream().cuda_stream
        go(spin, (np.uint64(t.data_ptr()), np.int64(40_000)), spin_pdl, stream)
        go(probe, (np.uint64(t.data_ptr()),), probe_pdl, stream)

    for _ in range(3):  # warm: module load, ctypes setup
        step(True, True)
    torch.cuda.synchronize()
    out = {}
    for spin_pdl, probe_pdl in ((False, False), (False, True), (True, True)):
        key = f"spin_attr={spin_pdl},probe_attr={probe_pdl}"
        gaps = []
        for _ in range(3):
            step(spin_pdl, probe_pdl)
            torch.cuda.synchronize()
            gaps.append(stamps(t.tolist()))
        out["eager " + key] = min(gaps, key=lambda d: d["probe_start_minus_spin_end_ns"])
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):
            step(spin_pdl, probe_pdl)
        torch.cuda.current_stream().wait_stream(s)
        gaps = []
        for _ in range(3):
            g.replay()
            torch.cuda.synchronize()
            gaps.append(stamps(t.tolist()))
        out["graph " + key] = min(gaps, key=lambda d: d["probe_start_minus_spin_end_ns"])
    return out


def chains() -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    shapes = [("qkv", 4608, 3584), ("o", 3584, 3584), ("gate_up", 37888, 3584), ("down", 3584, 18944)]
    ws = gemv.GemvWorkspace.allocate([gemv.plan_gemv(n, k) for _, n, k in shapes], torch.device("cuda"))
    h = 3584
    resid = torch.randn(1, h, generator=gen, device="cuda").to(torch.bfloat16)
    normw = (1 + 0.1 * torch.randn(h, generator=gen, device="cuda")).to(torch.bfloat16)
    normed = torch.empty_like(resid)
    for name, n, k in shapes:
        w0 = random_weight(n, k, gen)
        copies = max(2, math.ceil(L2_ROTATE_BYTES / w0.nbytes()))
        weights = [w0] + [random_weight(n, k, gen) for _ in range(copies - 1)]
        x = torch.randn(1, k, generator=gen, device="cuda").to(torch.bfloat16)
        out = torch.empty(1, n, dtype=torch.bfloat16, device="cuda")
        row = {"kernel": f"gemv {name} M=1", "launches": 2 * copies}
        for pdl in (False, True):
            t = time_graph(lambda i: gemv.gemv_int4(x, weights[i % copies], out, workspace=ws, pdl=pdl),
                           2 * copies)
            row[f"us_pdl={pdl}"] = round(t * 1e6, 2)
        rows.append(row)
        if name == "o":  # a norm feeding the GEMV, as in the decoder layer
            row = {"kernel": "add_rms_norm + gemv o M=1", "launches": 2 * copies}
            o_out = torch.empty(1, h, dtype=torch.bfloat16, device="cuda")

            for pdl in (False, True):

                def pair(i):
                    layer_ops.fused_add_rms_norm(o_out, resid, normw, normed, 1e-6, pdl=pdl)
                    gemv.gemv_int4(normed, weights[i % copies], o_out, workspace=ws, pdl=pdl)

                t = time_graph(pair, 2 * copies)
                row[f"us_pdl={pdl}"] = round(t * 1e6, 2)
            rows.append(row)
    return rows


def main() -> None:
    res = {"device": torch.cuda.get_device_name(), "overlap": overlap_probe()}
    if "--overlap-only" not in sys.argv:
        res["chains"] = chains()
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
