"""Experiment (kept in git only): the prefill plan (NT = 16) at M = 256 / 512 split S ways along K, per
7B shape. `python -m nanoqwen_bench.kernels.prefill_splits 256,512` on one GPU."""
import math, sys
import torch
from nanoqwen_kernels import gemm
from nanoqwen_bench.gpu import time_graph
from nanoqwen_bench.kernels.bench_kernels import random_weight
from nanoqwen_bench.kernels.bench_gemm import SHAPES, L2_ROTATE_BYTES, check_output

gen = torch.Generator(device="cuda").manual_seed(0)
sms = torch.cuda.get_device_properties(0).multi_processor_count
print(torch.cuda.get_device_name(0), sms, "SMs")
tot = {}
for name, n, k in SHAPES:
    w0 = random_weight(n, k, gen, symmetric=True)
    copies = max(2, math.ceil(L2_ROTATE_BYTES / w0.nbytes()))
    weights = [w0] + [random_weight(n, k, gen, symmetric=True) for _ in range(copies - 1)]
    for m in (int(a) for a in sys.argv[1].split(",")):
        x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
        out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
        for s in (1, 2, 3, 4, 5, 6, 8):
            plan = gemm.GemmPlan.of(n, k, 128, 16, m if s > 1 else None, s, kernel="wgmma")
            if plan.splits != s or gemm.ws_shared_bytes(128, plan.kc, 128, True) > gemm.MAX_SHARED_BYTES:
                continue
            ws = gemm.allocate_workspace([plan], torch.device("cuda"))
            out.fill_(float("nan"))
            gemm.gemm_int4(x, w0, out, None, ws, plan)
            torch.cuda.synchronize()
            check_output(out, x, w0, bf16_weight=True)
            t = time_graph(lambda i: gemm.gemm_int4(x, weights[i % copies], out, None, ws, plan), copies)
            ctas = plan.m_blocks(m) * plan.blocks_n * s
            tot.setdefault((m, s), []).append(t * 1e6)
            print(f"{name:8s} M={m} S={s} CTAs={ctas:5d} waves={ctas / sms:5.2f} {t * 1e6:8.1f} us "
                  f"{2 * m * n * k / t / 1e12:6.1f} TFLOP/s", flush=True)
    del weights
    torch.cuda.empty_cache()
