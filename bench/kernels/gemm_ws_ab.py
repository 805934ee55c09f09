"""A/B of the INT4 GEMM at decode batches (M = 16..64): the mma.sync kernel on its planned shape
against the warp-specialised wgmma kernel (csrc/gemm_int4_ws.cuh) at several K split counts, and
its build variants (`--define`), on the four Qwen2.5-Coder-7B layer linears, one GPU.

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python bench/kernels/gemm_ws_ab.py --out DIR \
        [--ms 16,32,48,64] [--splits 1,2,4] [--define NQ_GEMM_WS_BATCH=2] \
        [--probe NQ_GEMM_WS_PROBE_NO_MMA] [--shapes gate_up] [--no-mma] [--no-time] [--sym]

Every kernel's output is checked against the fp32 reference (gemv_ab.check_output) before it is
timed; the timing is bench_gemm's: launches on rotating weight copies (> 4x the L2) in one CUDA graph,
median of 15 replays. Writes gemm_ws_ab.json and gemm_ws_ab.md under --out.
"""

# ruff: noqa: B023  (every closure runs inside time_graph before its loop variables change)
from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from pathlib import Path

import torch
from nanoqwen_kernels import build, gemm
from nanoqwen_kernels.bench import read_bandwidth, time_graph
from nanoqwen_kernels.specs import SPECS

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gemm import L2_ROTATE_BYTES, SHAPES  # noqa: E402
from bench_kernels import random_weight  # noqa: E402
from gemv_ab import check_output  # noqa: E402


def variant_family(define: str | None) -> str:
    if not define:
        return "gemm_ws"
    options = tuple(f"-D{d}" for d in define.split("+"))
    family = "gemm_ws-" + hashlib.sha256("|".join(options).encode()).hexdigest()[:10]
    SPECS[family] = build.KernelSpec(family, ("gemm_ws.cu",), options)
    return family


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--ms", default="16,32,48,64")
    ap.add_argument("--splits", default="1,2,3,4,6")
    ap.add_argument("--define", action="append", default=[],
                    help="a variant build: NAME[+NAME2] (repeatable)")
    ap.add_argument("--probe", action="append", default=[],
                    help="a timing-probe build (wrong outputs, not checked): NAME[+NAME2] (repeatable)")
    ap.add_argument("--shapes", default="qkv,o,gate_up,down")
    ap.add_argument("--no-time", action="store_true", help="launch each kernel once (under ncu)")
    ap.add_argument("--no-mma", action="store_true", help="leave out the mma.sync kernel (its compile)")
    ap.add_argument("--sym", action="store_true",
                    help="symmetric weights (default: asymmetric, the default recipe)")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    read_bw = read_bandwidth(torch.device("cuda"), nbytes=1 << 30)["bytes_per_s"]
    print(f"read bandwidth {read_bw / 1e9:.0f} GB/s", flush=True)
    variants = [(None, "gemm_ws")] + [(d, variant_family(d)) for d in args.define + args.probe]
    ms = [int(m) for m in args.ms.split(",")]
    split_set = [int(s) for s in args.splits.split(",")]
    rows = []
    for name, n, k in [s for s in SHAPES if s[0] in args.shapes.split(",")]:
        w0 = random_weight(n, k, gen, symmetric=args.sym)
        copies = max(2, math.ceil(L2_ROTATE_BYTES / w0.nbytes()))
        weights = [w0] + [random_weight(n, k, gen, symmetric=args.sym) for _ in range(copies - 1)]
        for m in ms:
            head = gemm.plan_gemm(n, k, m, silu_input=True)  # the mma.sync kernel's plan (no wgmma table)
            mc = gemm.m_class(m)
            cands = [] if args.no_mma else [("mma", head, "gemm")]
            seen = set()
            for s in split_set:
                p = gemm.GemmPlan.of(n, k, 128, mc // 8, mc, s, kernel="wgmma")
                if p.splits in seen:
                    continue
                seen.add(p.splits)
                cands += [(f"wgmma{'/' + d if d else ''}", p, fam) for d, fam in variants]
            ws = gemm.allocate_workspace([c[1] for c in cands], torch.device("cuda"))
            x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
            out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            nbytes = w0.nbytes() + 2 * m * (n + k)
            for label, plan, fam in cands:
                out.fill_(float("nan"))
                gemm.gemm_int4(x, w0, out, None, ws, plan, family=fam)
                torch.cuda.synchronize()
                if not any(label.endswith("/" + p) for p in args.probe):
                    check_output(out, x, w0)
                if args.no_time:
                    continue
                t = time_graph(
                    lambda i: gemm.gemm_int4(x, weights[i % copies], out, None, ws, plan, family=fam), copies)
                row = {"shape": name, "m": m, "kernel": label, "splits": plan.splits, "nt": plan.n_tiles,
                       "us": t * 1e6, "tflops": 2 * m * n * k / t / 1e12,
                       "frac_read_bw": nbytes / t / read_bw}
                rows.append(row)
                print(f"{name:8s} M={m:3d} {label:24s} NT={plan.n_tiles} S={plan.splits:2d} "
                      f"{t * 1e6:8.1f} us "
                      f"{row['tflops']:6.1f} TF/s {row['frac_read_bw']:6.1%} BW", flush=True)
    (args.out / "gemm_ws_ab.json").write_text(json.dumps({"read_bw": read_bw, "rows": rows}, indent=1))
    # summary: per (M, kernel label) the sum over shapes of the best split's time, and HEAD's
    lines = ["| M | kernel | qkv | o | gate_up | down | sum (us) |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    labels = sorted({r["kernel"] for r in rows}, key=lambda s: (s != "mma", s))
    for m in ms:
        for lab in labels:
            best = {}
            for r in rows:
                if r["m"] == m and r["kernel"] == lab:
                    cur = best.get(r["shape"])
                    if cur is None or r["us"] < cur["us"]:
                        best[r["shape"]] = r
            cells = [f"{best[s]['us']:.1f} (S{best[s]['splits']})" if s in best else "" for s, _, _ in SHAPES]
            total = sum(b["us"] for b in best.values())
            lines.append(f"| {m} | {lab} | " + " | ".join(cells) + f" | {total:.1f} |")
    (args.out / "gemm_ws_ab.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
