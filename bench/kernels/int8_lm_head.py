"""The INT8 lm_head (GPU machine): kernel bandwidth and what it buys a batch-1 decode step.

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python3 bench/kernels/int8_lm_head.py

1. gemv_int8 at the 7B lm_head shape (152064 x 3584, g128), M = 1 and 8, timed as bench_kernels.py
   (2 x C launches in one graph over C weight copies > 4x L2), as a share of the copy bandwidth
   measured here; beside it the INT4 GEMV and cuBLAS bf16 at the same shape.
2. Engine decode graph replay at batch 1, context 128, on the synthetic 7B geometry with a bf16, an
   int8 and an int4 lm_head (same seed for the layers), same run.
One JSON object on stdout.
"""

# ruff: noqa: B023
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch
from nanoqwen_kernels import gemv

sys.path.insert(0, str(Path(__file__).parent))
from bench_kernels import L2_ROTATE_BYTES, copy_bandwidth, random_weight, time_graph  # noqa: E402

N, K = 152064, 3584


def kernels(bw: float) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(0)

    def int8_weight():
        q = torch.randint(-127, 128, (N, K), generator=gen, device="cuda", dtype=torch.int8)
        s = (torch.rand(N, K // 128, generator=gen, device="cuda") * 1e-3).to(torch.bfloat16)
        return gemv.Int8Weight(q, s, N, K, 128)

    rows = []
    w8 = [int8_weight() for _ in range(max(2, math.ceil(L2_ROTATE_BYTES / int8_weight().nbytes())))]
    w4 = [random_weight(N, K, gen) for _ in range(max(2, math.ceil(L2_ROTATE_BYTES / (N * K // 2))))]
    dense = [torch.randn(N, K, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(2)]
    ws = gemv.GemvWorkspace.allocate([gemv.plan_gemv(N, K)], torch.device("cuda"))
    for m in (1, 8):
        x = torch.randn(m, K, generator=gen, device="cuda").to(torch.bfloat16)
        out = torch.empty(m, N, dtype=torch.bfloat16, device="cuda")
        io = x.numel() * 2 + out.numel() * 2
        cases = [
            (
                "gemv_int8 g128",
                w8[0].nbytes() + io,
                lambda i: gemv.gemv_int8(x, w8[i % len(w8)], out),
                2 * len(w8),
            ),
            (
                "gemv_int8 g128, 4 blocks/SM build",
                w8[0].nbytes() + io,
                lambda i: gemv.gemv_int8(x, w8[i % len(w8)], out, family="gemv_i8b4"),
                2 * len(w8),
            ),
            (
                "gemv_int4 g128",
                w4[0].nbytes() + io,
                lambda i: gemv.gemv_int4(x, w4[i % len(w4)], out, workspace=ws),
                2 * len(w4),
            ),
            ("cublas bf16", N * K * 2 + io, lambda i: torch.mm(x, dense[i % 2].t(), out=out), 4),
        ]
        for name, nbytes, fn, reps in cases:
            us = 1e6 * time_graph(fn, reps)
            rows.append(
                {
                    "kernel": name,
                    "m": m,
                    "us": round(us, 1),
                    "GBps": round(nbytes / us / 1e3),
                    "frac_copy": round(nbytes / (us * 1e-6) / bw, 4),
                }
            )
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def engines() -> list[dict]:
    from nanoqwen_model import QWEN25_CODER_7B as QWEN25_7B
    from nanoqwen_runtime.engine.bench import decode_at_context
    from nanoqwen_runtime.engine.config import EngineConfig
    from nanoqwen_runtime.engine.engine import Engine
    from nanoqwen_runtime.engine.synthetic import random_weights

    rows = []
    for head in ("bf16", "int8", "int4"):
        weights = random_weights(QWEN25_7B, "cuda", seed=0, lm_head=head)
        eng = Engine(
            QWEN25_7B,
            weights,
            EngineConfig(kv_memory_bytes=4 << 30, max_model_len=4096, dense_weight_cache=False),
        )
        best = max(decode_at_context(eng, 128, 32, seed=s)["graph_tok_s"] for s in (1, 2, 3))
        rows.append(
            {
                "lm_head": head,
                "graph_tok_s_batch1_ctx128": round(best, 1),
                "lm_head_bytes": weights.lm_head.nbytes if hasattr(weights.lm_head, "nbytes") else None,
            }
        )
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        del eng, weights
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    from nanoqwen_kernels import build
    from nanoqwen_kernels.specs import SPECS

    SPECS["gemv_i8b4"] = build.KernelSpec("gemv_i8b4", ("gemv.cu",), ("-DNQ_GEMV8_MIN_BLOCKS=4",))
    bw = max(copy_bandwidth().values())
    res = {
        "device": torch.cuda.get_device_name(),
        "copy_bandwidth_GBps": round(bw / 1e9),
        "kernels": kernels(bw),
    }
    torch.cuda.empty_cache()
    res["engine"] = engines()
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
