"""Every INT4 GEMM plan of the M <= 64 classes, timed per shape: what `gemm.MEASURED_PLANS` holds.

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) \\
        python -m nanoqwen_bench.kernels.sweep_gemm_plans --model 7b,1.5b,0.5b --out bench/out/gemm-plans

For each layer linear of the chosen models (bench_gemm.MODEL_SHAPES; INT4 g128, asymmetric weights as the
default recipe packs them) and each M class 16 / 32 / 64, at the class's top M: every plan that fits,
kernel ("mma": mma.sync, "wgmma": TMA + wgmma) x M-block rows 8 NT <= the class (fewer rows run several
M blocks) x K splits S in 1, 2, 3, 4, 6, 8, 12, 18 (as `GemmPlan.with_splits` rounds them). Each plan's
output is first checked against the fp32 reference; then timed as bench_gemm times (weights rotated
through more than 4x the L2, CUDA graph, median of 15 replays). Prints, per shape and class, the
planner's plan and the fastest, with their times, and writes sweep_gemm_plans.json (every timing) and
sweep_gemm_plans.md (the table, and the fastest plans as `MEASURED_PLANS` entries) under --out.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from nanoqwen_kernels import gemm

from ..gpu import time_graph
from .bench_gemm import MODEL_SHAPES, check_output
from .bench_kernels import rotated_weights

CLASSES = (16, 32, 64)
SPLITS = (1, 2, 3, 4, 6, 8, 12, 18)


def candidate_plans(n: int, k: int, max_m: int) -> list[gemm.GemmPlan]:
    """Every distinct plan of the class that fits in shared memory (plain input, g128)."""
    plans = {}
    for kernel in ("mma", "wgmma"):
        for nt in (2, 4, 8):
            if 8 * nt > max_m:
                continue
            for s in SPLITS:
                p = gemm.GemmPlan.of(n, k, 128, nt, max_m, s, kernel=kernel)
                if p.shared_bytes(False) <= gemm.MAX_SHARED_BYTES:
                    plans[(kernel, nt, p.splits)] = p
    return list(plans.values())


def sweep_shape(model, name, n, k, gen, sms) -> list[dict]:
    weights = rotated_weights(n, k, gen, symmetric=False)
    w0, copies = weights[0], len(weights)
    rows = []
    for m in CLASSES:
        x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
        out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
        pick = gemm.plan_gemm_shape(n, k, 128, m, sms)
        pick_key = (pick.kernel, pick.n_tiles, pick.splits)
        for p in candidate_plans(n, k, m):
            ws = gemm.allocate_workspace([p], torch.device("cuda"))
            out.fill_(float("nan"))
            gemm.gemm_int4(x, w0, out, None, ws, p)
            torch.cuda.synchronize()
            check_output(out, x, w0)
            t = time_graph(lambda i: gemm.gemm_int4(x, weights[i % copies], out, None, ws, p), copies)  # noqa: B023
            rows.append({"model": model, "shape": name, "n": n, "k": k, "m": m, "kernel": p.kernel,
                         "n_tiles": p.n_tiles, "splits": p.splits, "us": t * 1e6,
                         "planned": (p.kernel, p.n_tiles, p.splits) == pick_key})
        here = [r for r in rows if r["m"] == m]
        best = min(here, key=lambda r: r["us"])
        planned = [r for r in here if r["planned"]]
        pt = f"{planned[0]['us']:6.1f} us" if planned else "not among the candidates"
        print(f"{model:4s} {name:8s} M={m:2d}  planned {pick.kernel} NT={pick.n_tiles} S={pick.splits}: "
              f"{pt}; fastest {best['kernel']} NT={best['n_tiles']} S={best['splits']}: {best['us']:6.1f} us",
              flush=True)
    return rows


def fastest(rows) -> dict:
    """(model, shape, n, k, m) -> the fastest row."""
    out = {}
    for r in rows:
        key = (r["model"], r["shape"], r["n"], r["k"], r["m"])
        if key not in out or r["us"] < out[key]["us"]:
            out[key] = r
    return out


def markdown(rep) -> str:
    lines = [f"# INT4 GEMM plans, M <= 64 ({rep['date']})", "",
             f"- device: {rep['device']} ({rep['sms']} SMs)",
             "- INT4 g128 asymmetric; each class timed at its top M", "",
             "| model | shape | M | planned | us | fastest | us | planned / fastest |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    best = fastest(rep["rows"])
    for (model, shape, _n, _k, m), b in best.items():
        p = next((r for r in rep["rows"]
                  if r["planned"] and (r["model"], r["shape"], r["m"]) == (model, shape, m)), None)
        ps = f"{p['kernel']} NT={p['n_tiles']} S={p['splits']} | {p['us']:.1f}" if p else "- | -"
        ratio = f"{p['us'] / b['us']:.2f}" if p else "-"
        lines.append(f"| {model} | {shape} | {m} | {ps} | {b['kernel']} NT={b['n_tiles']} S={b['splits']} | "
                     f"{b['us']:.1f} | {ratio} |")
    lines += ["", "The fastest plans as `gemm.MEASURED_PLANS` entries:", "", "```python"]
    lines += [f"({rep['sms']}, {n}, {k}, 128, {m}): (\"{b['kernel']}\", {b['n_tiles']}, {b['splits']}),"
              for (_model, _shape, n, k, m), b in best.items()]
    return "\n".join(lines + ["```"]) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for sweep_gemm_plans.json / .md")
    ap.add_argument("--model", default="7b,1.5b,0.5b", help="comma-separated: " + ", ".join(MODEL_SHAPES))
    args = ap.parse_args(argv)
    models = [m for m in args.model.split(",") if m]
    unknown = sorted(set(models) - set(MODEL_SHAPES))
    if unknown:
        ap.error(f"--model {','.join(unknown)}: not one of {', '.join(MODEL_SHAPES)}")
    t0 = time.perf_counter()
    gen = torch.Generator(device="cuda").manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for model in models:
        for name, n, k in MODEL_SHAPES[model]:
            rows += sweep_shape(model, name, n, k, gen, sms)
            torch.cuda.empty_cache()
    rep = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(0), "sms": sms,
           "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sweep_gemm_plans.json").write_text(json.dumps(rep, indent=1))
    (args.out / "sweep_gemm_plans.md").write_text(markdown(rep))
    print(f"wrote {args.out}/sweep_gemm_plans.json and .md in {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
