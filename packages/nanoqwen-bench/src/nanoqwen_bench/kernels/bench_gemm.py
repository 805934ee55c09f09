"""Microbenchmark of the INT4 GEMM (M > 8) against cuBLAS bf16 and dequantize + cuBLAS, on one GPU.

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) \
        python -m nanoqwen_bench.kernels.bench_gemm --out bench/out/gemm [--quick]

For the four Qwen2.5-Coder-7B layer linears (qkv 3584->4608, o 3584->3584, gate+up 3584->2x18944,
down 18944->3584; INT4 g128 symmetric) and M in {16, 32, 64, 128, 512, 2048}, three ways to compute
y[M, N] = x[M, K] @ W^T:

- int4_gemm:     nanoqwen_kernels.gemm.gemm_int4 on the packed INT4 weights, the planner's plan for M
                 (the engine's path for 9 <= M <= ops_kernels.INT4_GEMM_MAX_ROWS);
- int4_gemm_wgmma128: M > 64 only: the wgmma kernel's prefill plan (gemm.plan_gemm_prefill: M blocks
                 of 128 rows, each dequantised tile reused over 128 tokens), where its shared memory
                 fits (the engine's path up to ops_kernels.INT4_PREFILL_GEMM_MAX_ROWS);
- cublas_bf16:   torch.mm on a bf16 weight (what a bf16 copy of the weights buys: the ceiling the INT4
                 GEMM must approach at large M, and beat at small M);
- dequant_gemm:  gemv.linear_int4_prefill = dequantize into one bf16 scratch + torch.mm (the engine's
                 path above INT4_PREFILL_GEMM_MAX_ROWS);
- tinygemm:      torch._weight_int4pack_mm on its own tiled layout, g128 (baselines.py): torch's
                 built-in INT4 matmul, the one gpt-fast and torchao use;
- gemlite:       gemlite.GemLiteLinear (Triton, A16W4 g128, baselines.py) at the M values where it
                 ships a tuned config for the GPU (`--gemlite-autotune`: every M, tuned in the warm-up).

Method as bench_kernels.py: R launches captured in one CUDA graph, each on a different copy of the
weights (together > 4x the L2, so weights come from HBM), median of 15 replays. The read bandwidth
(nanoqwen_bench.gpu.read_bandwidth, 1 GiB) is measured first in the same run. Reported: time, TFLOP/s (2
M N K per product), and the achieved bandwidth of each path's minimum bytes (weights + scales + x + out,
each once) as a fraction of the read bandwidth (the roofline for M <= 64). The fastest of int4_gemm,
int4_gemm_wgmma128 and dequant_gemm (summed over the four shapes) is printed per M: it is what
ops_kernels.INT4_GEMM_MAX_ROWS / INT4_PREFILL_GEMM_MAX_ROWS should say. Writes
bench_gemm.json and bench_gemm.md under --out. Experiments: `--define NAME[=VALUE]` (repeatable) times
builds of both GEMM families (mma.sync "gemm", wgmma "gemm_ws") with those -D options as int4_gemm and
int4_gemm_wgmma128 (every other M <= 64 plan is timed by sweep_gemm_plans); `--asym` times asymmetric
weights; every timed build's output is first checked against the fp32
reference (except the probes'); `--int4-only` skips the other paths; `--ms 16,32` picks the M values;
`--model 1.5b|0.5b` the real test models' shapes instead of the 7B's. Timing probes (wrong outputs,
tests never build them), each `--define`: `NQ_GEMM_PROBE_NO_LDSM` (B fragments from registers, no
ldmatrix), `NQ_GEMM_PROBE_NO_MMA` (an FADD per mma instead), `NQ_GEMM_PROBE_NO_WLOAD` (weights made in
registers, no global loads), `NQ_GEMM_PROBE_NO_X` (no activation copies; the chunk waits and barriers
stay), `NQ_GEMM_PROBE_NO_XBAR` (neither copies nor waits nor barriers); of the wgmma kernel
`NQ_GEMM_WS_PROBE_NO_MMA`, `NQ_GEMM_WS_PROBE_COPY_ONLY`, `NQ_GEMM_WS_PROBE_X_ONCE`,
`NQ_GEMM_WS_PROBE_NO_MAINLOOP`
(csrc/gemm_int4_ws.cuh says what each leaves out), and `NQ_GEMM_WS_PROBE_CLOCKS`, which keeps the
outputs and prints, per M <= 64 wgmma launch, where its blocks' time goes (`ws_clock_phases`). Runs in
well under a minute on
the H200 once the kernels are compiled (first use: NVRTC).
"""

# ruff: noqa: B023  (every closure below runs inside time_graph before its loop variables change)
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import sys
import time
from pathlib import Path

import torch
from nanoqwen_kernels import gemm, gemv
from nanoqwen_kernels import reference as R

from ..gpu import read_bandwidth, time_graph
from .baselines import gemlite_copies, gemlite_mm, gemlite_plan, tinygemm_copies, tinygemm_mm
from .bench_kernels import L2_ROTATE_BYTES, rotated_weights

SHAPES = [("qkv", 4608, 3584), ("o", 3584, 3584), ("gate_up", 37888, 3584), ("down", 3584, 18944)]
# the layer linears of the real test models (`--model`), for plans measured beyond the 7B
MODEL_SHAPES = {
    "7b": SHAPES,
    "1.5b": [("qkv", 2048, 1536), ("o", 1536, 1536), ("gate_up", 17920, 1536), ("down", 1536, 8960)],
    "0.5b": [("qkv", 1152, 896), ("o", 896, 896), ("gate_up", 9728, 896), ("down", 896, 4864)],
}
MS = (16, 32, 64, 128, 512, 2048)
QUANTIZED_PATHS = ("int4_gemm", "int4_gemm_wgmma128", "dequant_gemm")
PATHS = (*QUANTIZED_PATHS, "cublas_bf16", "tinygemm", "gemlite")



def check_output(out, x, w, bf16_weight=False) -> None:
    """out (bf16 [M, N]) against the kernel tests' oracle: the fp32 product of x with the dequantized
    weight (nanoqwen_kernels.reference; bf16_weight: rounded to bf16 first, as the prefill plan
    multiplies it), within the bf16 tolerance of reference.TOLERANCES."""
    R.assert_close(out, R.int4_linear(x, w, bf16_weight=bf16_weight), what="bench_gemm output")


# nq_gemm_ws::WsClock: the clocks probe's named slots, of CLOCK_RECORD u64 per block, CLOCK_BLOCKS blocks
CLOCK_SLOTS = ("gt_entry", "entry", "init", "table", "first_full", "run", "reduce", "end", "gt_end", "smid",
               "producer_end", "set1_run")
CLOCK_RECORD, CLOCK_BLOCKS = 16, 1024


def ws_clock_phases(family: str, blocks: int) -> dict:
    """The clocks probe's record of the last launch of `family` (a build with NQ_GEMM_WS_PROBE_CLOCKS) of
    `blocks` blocks: the kernel's span and its blocks' start spread (%globaltimer, us), and the median
    block's phases in us (its clock64 deltas at the clock rate the blocks' own spans give): barrier init,
    scale table, wait for the first ring slot, main loop, set 1's lag, the sets' sum, store (finish_tile),
    the whole block; and the producer's last copy issued, from the block's entry."""
    import cupy
    import numpy as np
    from nanoqwen_kernels import launch

    ptr = launch.module_global(family, "nq_gemm_ws_clocks", torch.cuda.current_device())
    rec = cupy.ndarray((CLOCK_BLOCKS, CLOCK_RECORD), cupy.uint64, memptr=ptr)[: min(blocks, CLOCK_BLOCKS)]
    rec = rec.get().astype(np.int64)
    c = {name: rec[:, i] for i, name in enumerate(CLOCK_SLOTS)}
    ghz = (c["end"] - c["entry"]).sum() / max(1, (c["gt_end"] - c["gt_entry"]).sum())  # cycles per ns
    us = lambda a, b: float(np.median(c[b] - c[a])) / ghz / 1e3  # noqa: E731
    return {"span_us": float(c["gt_end"].max() - c["gt_entry"].min()) / 1e3,
            "start_spread_us": float(c["gt_entry"].max() - c["gt_entry"].min()) / 1e3,
            "clock_ghz": float(ghz), "blocks": int(len(rec)), "sms": int(len(set(c["smid"].tolist()))),
            "init": us("entry", "init"), "table": us("init", "table"),
            "first_slot": us("table", "first_full"), "loop": us("first_full", "run"),
            "set1_lag": us("run", "set1_run"), "sum_sets": us("run", "reduce"),
            "store": us("reduce", "end"), "block": us("entry", "end"),
            "producer_last_copy": us("entry", "producer_end")}  # fmt: skip


def bench_shape(name, n, k, ms, gen, read_bw, rows, families=None, int4_only=False, asym=False, check=True,
                gemlite_autotune=False, clocks=False):
    families = families or {}
    weights = rotated_weights(n, k, gen, symmetric=not asym)
    w0, copies = weights[0], len(weights)
    dense_copies = max(2, math.ceil(L2_ROTATE_BYTES / (2 * n * k)))
    dense = [torch.randn(n, k, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(dense_copies)]
    scratch = torch.empty(n, k, dtype=torch.bfloat16, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    plans = {m: gemm.plan_gemm(n, k, m) for m in ms}
    prefill_plans = {}
    for m in (m for m in ms if m > gemm.MBLOCK):
        try:
            prefill_plans[m] = gemm.plan_gemm_prefill(n, k, m, 128, sms)
        except ValueError as e:  # shared memory: noted, not timed
            print(f"{name}: int4_gemm_wgmma128 not timed at M {m}: {e}", flush=True)
    ws = gemm.allocate_workspace(gemm.plans_for_shapes([(n, k)], 128, sms) + list(plans.values())
                                 + list(prefill_plans.values()),
                                 torch.device("cuda"))

    tiny = [] if int4_only else tinygemm_copies(n, k, gen, L2_ROTATE_BYTES, ms)
    lite_ms, why = ([], None) if int4_only else gemlite_plan(n, k, ms, gemlite_autotune)
    lite = gemlite_copies(n, k, gen, L2_ROTATE_BYTES, lite_ms) if lite_ms else []
    if why:
        print(f"{name}: gemlite not timed at M {sorted(set(ms) - set(lite_ms))}: {why}", flush=True)
    for m in ms:
        x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
        out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
        plan = plans[m]
        act = 2 * m * (n + k)  # x read + out written, bf16
        paths = {
            "int4_gemm": (lambda i: gemm.gemm_int4(x, weights[i % copies], out, None, ws, plan,
                                                   family=families.get(plan.kernel)), copies,
                          w0.nbytes() + act),
            "cublas_bf16": (lambda i: torch.mm(x, dense[i % dense_copies].t(), out=out), dense_copies,
                            2 * n * k + act),
            "dequant_gemm": (lambda i: gemv.linear_int4_prefill(x, weights[i % copies], out, scratch),
                             copies, w0.nbytes() + act),
            "tinygemm": (lambda i: tinygemm_mm(x, tiny[i % len(tiny)]), len(tiny),
                         tiny[0].nbytes() + act if tiny else 0),
        }  # fmt: skip
        if m in prefill_plans:
            paths["int4_gemm_wgmma128"] = (
                lambda i: gemm.gemm_int4(x, weights[i % copies], out, None, ws, prefill_plans[m],
                                         family=families.get("wgmma")), copies, w0.nbytes() + act)
        if m in lite_ms:
            paths["gemlite"] = (lambda i: gemlite_mm(x, lite[i % len(lite)]), len(lite),
                                lite[0].nbytes() + act)
        if int4_only:
            paths = {p: v for p, v in paths.items() if p.startswith("int4_gemm")}
        if check:  # a timing probe's outputs are wrong by design
            gemm.gemm_int4(x, w0, out, None, ws, plan, family=families.get(plan.kernel))
            torch.cuda.synchronize()
            check_output(out, x, w0)
            if "int4_gemm_wgmma128" in paths:
                out.fill_(float("nan"))
                gemm.gemm_int4(x, w0, out, None, ws, prefill_plans[m], family=families.get("wgmma"))
                torch.cuda.synchronize()
                check_output(out, x, w0, bf16_weight=True)
        for path, (fn, reps, nbytes) in paths.items():
            t = time_graph(fn, reps)
            row = {"shape": name, "n": n, "k": k, "m": m, "path": path, "us": t * 1e6,
                   "tflops": 2 * m * n * k / t / 1e12, "bytes": nbytes, "frac_read_bw": nbytes / t / read_bw}
            if path == "int4_gemm":
                row["plan"] = (f"{plan.kernel} NT={plan.n_tiles} S={plan.splits} kc={plan.kc} "
                               f"grid={plan.grid(m)}")
                if clocks and plan.kernel == "wgmma" and m <= gemm.MBLOCK:
                    row["clocks"] = ws_clock_phases(families["wgmma"], math.prod(plan.grid(m)))
                    print(f"{name:8s} M={m:5d} clocks " + " ".join(
                        f"{key} {v:.2f}" if isinstance(v, float) else f"{key} {v}"
                        for key, v in row["clocks"].items()), flush=True)
            elif path == "int4_gemm_wgmma128":
                p = prefill_plans[m]
                row["plan"] = f"wgmma NT=16 S={p.splits} grid={p.grid(m)}"
            rows.append(row)
            print(f"{name:8s} M={m:5d} {path:13s} {t * 1e6:9.1f} us {row['tflops']:7.1f} TFLOP/s "
                  f"{row['frac_read_bw']:6.1%} of read BW  {row.get('plan', '')}", flush=True)


def crossover(rows) -> dict:
    """Per M: the sum over the shapes of each path's time (None for a path not timed at every shape),
    and which of nanoqwen's quantized paths is faster."""
    out = {}
    shapes = {r["shape"] for r in rows}
    for m in sorted({r["m"] for r in rows}):
        tot = {}
        for p in PATHS:
            times = [r["us"] for r in rows if r["m"] == m and r["path"] == p]
            tot[p] = sum(times) if len(times) == len(shapes) else None
        quantized = [p for p in QUANTIZED_PATHS if tot[p] is not None]
        faster = min(quantized, key=tot.__getitem__) if len(quantized) > 1 else None
        out[m] = tot | {"faster_quantized": faster}
    return out


def markdown(rep) -> str:
    lines = [f"# INT4 GEMM microbenchmark ({rep['date']})", "", f"- device: {rep['device']}",
             f"- read bandwidth: {rep['read_bandwidth_GBps']:.0f} GB/s (1 GiB, median of 30 launches)",
             f"- weights: INT4 g128 {'asymmetric' if rep.get('asym') else 'symmetric'}; "
             "bytes = weights (+ scales) + x + out, each once", "",
             "| shape | M | path | us | TFLOP/s | % of read BW | cuBLAS bf16 time / this | plan |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    cub = {(r["shape"], r["m"]): r["us"] for r in rep["rows"] if r["path"] == "cublas_bf16"}
    for r in rep["rows"]:
        vs = f"{cub[(r['shape'], r['m'])] / r['us']:.2f}x" if cub else "-"  # --int4-only: no cuBLAS
        lines.append(f"| {r['shape']} | {r['m']} | {r['path']} | {r['us']:.1f} | {r['tflops']:.1f} | "
                     f"{r['frac_read_bw']:.1%} | {vs} | {r.get('plan', '')} |")
    lines += ["", "Sum over the four shapes (us), and the faster of nanoqwen's quantized paths:", "",
              "| M | " + " | ".join(PATHS) + " | faster |", "| --- " * (len(PATHS) + 2) + "|"]
    for m, c in rep["crossover"].items():
        cells = " | ".join("-" if c.get(p) is None else f"{c[p]:.1f}" for p in PATHS)
        lines.append(f"| {m} | {cells} | {c['faster_quantized']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for bench_gemm.json / bench_gemm.md")
    ap.add_argument("--quick", action="store_true", help="M = 16, 64, 512 only")
    ap.add_argument("--ms", help="comma-separated M values instead (e.g. 16,32,64)")
    ap.add_argument("--define", action="append", default=[], metavar="NAME[=VALUE]",
                    help="build the GEMM with -DNAME[=VALUE] (repeatable) and time that build")
    ap.add_argument("--int4-only", action="store_true", help="time only int4_gemm")
    ap.add_argument("--asym", action="store_true",
                    help="asymmetric weights (zero points), the default recipe's")
    ap.add_argument("--model", choices=sorted(MODEL_SHAPES), default="7b", help="whose layer shapes (7b)")
    ap.add_argument("--gemlite-autotune", action="store_true",
                    help="time gemlite also where it ships no tuned config (its autotune runs first)")
    args = ap.parse_args(argv)
    families = {}  # plan.kernel -> a kernel family built with the --define options (else the default's)
    if args.define:
        from nanoqwen_kernels.specs import SPECS

        options = tuple(f"-D{d}" for d in args.define)
        tag = hashlib.sha256("|".join(options).encode()).hexdigest()[:10]
        for kernel, (base, _) in gemm.KERNELS.items():
            families[kernel] = f"{base}-{tag}"
            SPECS[families[kernel]] = dataclasses.replace(SPECS[base], name=families[kernel], options=options)
    t0 = time.time()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rb = read_bandwidth(torch.device("cuda"), nbytes=1 << 30)
    read_bw = rb["bytes_per_s"]
    print(f"read bandwidth {read_bw / 1e9:.0f} GB/s", flush=True)
    rows: list[dict] = []
    ms = tuple(int(m) for m in args.ms.split(",")) if args.ms else (16, 64, 512) if args.quick else MS
    for name, n, k in MODEL_SHAPES[args.model]:
        bench_shape(name, n, k, ms, gen, read_bw, rows, families, args.int4_only, args.asym,
                    check=not any("_PROBE_" in d and "_CLOCKS" not in d for d in args.define),
                    gemlite_autotune=args.gemlite_autotune,
                    clocks="NQ_GEMM_WS_PROBE_CLOCKS" in args.define)
        torch.cuda.empty_cache()  # the shape's weight copies are gone with bench_shape's frame
    rep = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "defines": args.define, "model": args.model, "asym": args.asym,
           "device": torch.cuda.get_device_name(0), "command": " ".join(sys.argv),
           "read_bandwidth_GBps": read_bw / 1e9, "read_bandwidth": rb, "rows": rows,
           "crossover": crossover(rows)}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_gemm.json").write_text(json.dumps(rep, indent=1))
    (args.out / "bench_gemm.md").write_text(markdown(rep))
    for m, c in rep["crossover"].items():
        times = ", ".join(f"{p} {c[p]:.1f} us" for p in PATHS if c.get(p) is not None)
        print(f"M={m:5d}: {times} -> {c['faster_quantized']}")
    print(f"wrote {args.out}/bench_gemm.json and .md in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
