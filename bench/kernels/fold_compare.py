"""The decode GEMV with the zero point folded out of the per-pair dequantisation (NQ_GEMV_FOLD_ZERO=1:
the mma multiplies 128 + q, each group is corrected by (128 + z) * sum(x) once) against the default
(NQ_GEMV_FOLD_ZERO=0), same run, same plans (GPU machine):

    PYTHONPATH=packages/nanoqwen-format/src:packages/nanoqwen-kernels/src \\
        python3 bench/kernels/fold_compare.py

1. Correctness: both builds against the fp32 torch reference (tests' tolerance table) on odd shapes,
   sym/asym, g32/64/128, SiLU input, M = 1, 3, 8, split and unsplit plans; max |fold - default|.
2. Timing (as bench_kernels.py) of the 7B decode shapes at M = 1 and 8 with the default plan and the
   t6 plan. One JSON object on stdout.
"""

# ruff: noqa: B023
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch
from nanoqwen_kernels import build, gemv
from nanoqwen_kernels import reference as R
from nanoqwen_kernels.specs import SPECS

sys.path.insert(0, str(Path(__file__).parent))
from bench_kernels import L2_ROTATE_BYTES, SHAPES, copy_bandwidth, random_weight, time_graph  # noqa: E402

FOLD = "gemv_fold"


def reference(x, w, silu):
    dense = R.dequantize_int4(w.qweight, w.scales, w.zeros, w.group_size)
    return R.linear(R.silu_mul(x).to(torch.bfloat16) if silu else x, dense, None)


def correctness(gen) -> dict:
    failures, worst = [], 0.0
    cases = [
        (n, k, g, sym, silu)
        for n, k in ((200, 640), (4608, 3584))
        for g in (32, 64, 128)
        for sym in (True, False)
        for silu in (False, True)
    ]
    cases += [(3584, 18944, 128, True, True), (37888, 3584, 128, False, False)]
    for n, k, g, sym, silu in cases:
        w = random_weight(n, k, gen, symmetric=sym, group_size=g)
        for t in (1, 4):
            plan = gemv.plan_gemv(n, k, target_blocks_per_sm=t)
            ws = gemv.GemvWorkspace.allocate([plan], torch.device("cuda"))
            for m in (1, 3, 8):
                x = (torch.randn(m, 2 * k if silu else k, generator=gen, device="cuda") * 2).to(
                    torch.bfloat16
                )
                ref = reference(x, w, silu)
                outs = {}
                for fam in ("gemv", FOLD):
                    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
                    gemv.gemv_int4(x, w, out, workspace=ws, plan=plan, silu_mul_input=silu, family=fam)
                    outs[fam] = out
                    try:
                        R.assert_close(out, ref, f"{fam} n={n} k={k} g={g} sym={sym} silu={silu} m={m}")
                    except AssertionError as e:
                        failures.append(str(e)[:300])
                d = float((outs["gemv"].float() - outs[FOLD].float()).abs().max())
                worst = max(worst, d / max(float(ref.float().abs().max()), 1e-6))
    return {"failures": failures, "max_abs_diff_fold_vs_default_rel_to_max": worst, "cases": len(cases) * 6}


def timings(gen, bw) -> list[dict]:
    rows = []
    plans = [gemv.plan_gemv(n, k, target_blocks_per_sm=t) for _, n, k in SHAPES for t in (4, 6)]
    ws = gemv.GemvWorkspace.allocate(plans, torch.device("cuda"))
    for name, n, k in SHAPES:
        w0 = random_weight(n, k, gen)
        copies = max(2, math.ceil(L2_ROTATE_BYTES / w0.nbytes()))
        weights = [w0] + [random_weight(n, k, gen) for _ in range(copies - 1)]
        for m in (1, 8):
            x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
            out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            nbytes = w0.nbytes() + x.numel() * 2 + out.numel() * 2
            for t in (4, 6):
                plan = gemv.plan_gemv(n, k, target_blocks_per_sm=t)
                for fam in ("gemv", FOLD, "gemv", FOLD):  # twice each, interleaved
                    us = 1e6 * time_graph(
                        lambda i: gemv.gemv_int4(
                            x, weights[i % copies], out, workspace=ws, plan=plan, family=fam
                        ),
                        2 * copies,
                    )
                    rows.append(
                        {
                            "shape": name,
                            "m": m,
                            "target": t,
                            "S": plan.splits,
                            "family": fam,
                            "us": round(us, 2),
                            "frac_copy": round(nbytes / (us * 1e-6) / bw, 4),
                        }
                    )
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def main() -> None:
    SPECS[FOLD] = build.KernelSpec(FOLD, ("gemv.cu",), ("-DNQ_GEMV_FOLD_ZERO=1",))
    gen = torch.Generator(device="cuda").manual_seed(0)
    res = {"device": torch.cuda.get_device_name(), "correctness": correctness(gen)}
    bw = max(copy_bandwidth().values())
    res["copy_bandwidth_GBps"] = round(bw / 1e9)
    res["rows"] = timings(gen, bw)
    best = {}
    for r in res["rows"]:
        key = (r["shape"], r["m"], r["target"], r["family"])
        best[key] = min(best.get(key, 1e9), r["us"])
    res["summary"] = [
        f"{s} M={m} t{t}: default {best[(s, m, t, 'gemv')]} us, fold {best[(s, m, t, FOLD)]} us "
        f"({best[(s, m, t, 'gemv')] / best[(s, m, t, FOLD)]:.3f}x)"
        for (s, m, t, f) in best
        if f == "gemv"
    ]
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
