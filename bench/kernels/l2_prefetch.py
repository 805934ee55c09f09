"""How much of the decode GEMV's fixed cost an L2 prefetch of its weights would remove (issue 13).

    PYTHONPATH=... python bench/kernels/l2_prefetch.py --out l2.md [--json l2.json]

The small decode GEMVs (qkv, o) run at 22-28% of the read bandwidth: a fixed ~4 us per kernel of
ramp-up and tail on top of their bytes. Their weights never depend on the activations, so they could
be fetched into the 50 MB L2 while the kernels before them (RMSNorm, RoPE, attention: no weight
reads) run. Before building that into the engine, this measures its ceiling and its cost, per 7B shape
(g128 asym, M = 1, the engine's plan), each row a CUDA graph of R iterations (median of 15 replays):

- cold: every launch on another copy of the weights (> 256 MiB in all), as gemv_ab.py;
- hot: the same weights every launch (qkv, o, down fit the L2: the ceiling of any prefetch);
- gap: spin(GAP) then the GEMV on cold weights, minus the spin alone (the GEMV after an idle gap);
- pf-gap / pf-gap-el: l2_prefetch(weights) (normal / evict_last policy), spin(GAP), the GEMV, minus
  the prefetch and spin alone: what a prefetch issued GAP before the GEMV buys;
- pf-stream-el: prefetch (evict_last), then the gate_up GEMV on cold weights (68 MB through the L2),
  then the GEMV, minus the first two: whether the prefetched lines survive a big streaming GEMV.

Every GEMV output is checked against the fp32 reference before any timing (as gemv_ab.py).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import random_weight  # noqa: E402
from gemv_ab import L2_ROTATE_BYTES, SHAPES, check_output  # noqa: E402

GAP_NS = 8_000


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--json", type=Path)
    p.add_argument("--gap-ns", type=int, default=GAP_NS)
    args = p.parse_args(argv)

    import torch
    from nanoqwen_kernels import gemv
    from nanoqwen_kernels.bench import l2_prefetch, read_bandwidth, spin, time_graph

    dev = torch.device("cuda")
    read_bps = read_bandwidth(dev)["bytes_per_s"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    plans = {name: gemv.plan_gemv(n, k, silu_input=name == "down") for name, n, k in SHAPES}
    ws = gemv.GemvWorkspace.allocate(list(plans.values()), dev)

    def cold_set(name, n, k):
        w0 = random_weight(n, k, gen, symmetric=False)
        copies = max(2, math.ceil(L2_ROTATE_BYTES / w0.nbytes()))
        return [w0] + [random_weight(n, k, gen, symmetric=False) for _ in range(copies - 1)]

    def inputs(name, n, k):
        silu = name == "down"
        x = torch.randn(1, 2 * k if silu else k, generator=gen, device="cuda").to(torch.bfloat16)
        out = torch.full((1, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        return x, out, silu

    gu_name, gu_n, gu_k = SHAPES[2]
    gate_up = cold_set(gu_name, gu_n, gu_k)
    gu_x, gu_out, _ = inputs(gu_name, gu_n, gu_k)

    def run_gate_up(i):
        gemv.gemv_int4(gu_x, gate_up[i % len(gate_up)], gu_out, workspace=ws, plan=plans[gu_name])

    def prefetch(w, evict_last):
        for t in (w.qweight, w.scales, w.zeros):
            if t is not None:
                l2_prefetch(t, evict_last=evict_last)

    gap = args.gap_ns
    rows = []
    for name, n, k in SHAPES:
        weights = cold_set(name, n, k)
        copies = len(weights)
        x, out, silu = inputs(name, n, k)
        plan = plans[name]
        gemv.gemv_int4(x, weights[0], out, workspace=ws, plan=plan, silu_mul_input=silu)
        torch.cuda.synchronize()
        check_output(out, x, weights[0], silu)

        def g(i, weights=weights, x=x, out=out, plan=plan, silu=silu):
            gemv.gemv_int4(x, weights[i % len(weights)], out, workspace=ws, plan=plan, silu_mul_input=silu)

        reps = 2 * copies

        def pf(i, el, weights=weights):
            prefetch(weights[i % len(weights)], el)

        t = {"cold": time_graph(g, reps), "hot": time_graph(lambda i, g=g: g(0), reps)}
        t_spin = time_graph(lambda i: spin(gap), reps)
        t["gap"] = time_graph(lambda i, g=g: (spin(gap), g(i)), reps) - t_spin
        for label, el in (("pf-gap", False), ("pf-gap-el", True)):
            base = time_graph(lambda i, el=el, pf=pf: (pf(i, el), spin(gap)), reps)
            t[label] = time_graph(lambda i, el=el, pf=pf, g=g: (pf(i, el), spin(gap), g(i)), reps) - base
        base = time_graph(lambda i, pf=pf: (pf(i, True), run_gate_up(i)), reps)
        t["pf-stream-el"] = time_graph(lambda i, pf=pf, g=g: (pf(i, True), run_gate_up(i), g(i)),
                                       reps) - base  # fmt: skip
        t_pf = time_graph(lambda i, pf=pf: pf(i, True), reps)
        nbytes = weights[0].nbytes() + x.numel() * 2 + out.numel() * 2
        row = {"shape": name, "nbytes": nbytes, "prefetch_launch_us": t_pf * 1e6,
               **{f"{key}_us": v * 1e6 for key, v in t.items()}}  # fmt: skip
        rows.append(row)
        print(name, " ".join(f"{key} {v * 1e6:.2f}" for key, v in t.items()),
              f"prefetch alone {t_pf * 1e6:.2f}", flush=True)  # fmt: skip
        weights = None
        torch.cuda.empty_cache()

    keys = ["cold", "hot", "gap", "pf-gap", "pf-gap-el", "pf-stream-el"]
    lines = [f"# L2 prefetch ceiling of the decode GEMV ({torch.cuda.get_device_name()})\n",
             f"Read bandwidth of this run: {read_bps / 1e9:.0f} GB/s. GAP = {args.gap_ns / 1e3:.1f} us. "
             "g128 asym, M = 1, the engine's plans; us per GEMV (`bench/kernels/l2_prefetch.py`).\n",
             "| shape | MB | " + " | ".join(keys) + " | cold % of read BW | prefetch launch alone |",
             "|---|---|" + "---|" * len(keys) + "---|---|"]  # fmt: skip
    for r in rows:
        frac = r["nbytes"] / (r["cold_us"] * 1e-6) / read_bps
        lines.append(f"| {r['shape']} | {r['nbytes'] / 1e6:.1f} | "
                     + " | ".join(f"{r[k + '_us']:.2f}" for k in keys)
                     + f" | {frac:.1%} | {r['prefetch_launch_us']:.2f} |")  # fmt: skip
    md = "\n".join(lines) + "\n"
    print(md)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(md)
    if args.json:
        args.json.write_text(json.dumps({"read_bytes_per_s": read_bps, "gap_ns": args.gap_ns, "rows": rows},
                                        indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
