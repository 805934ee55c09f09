"""The decode GEMV's cp.async weight ring (NQ_GEMV_ASYNC_DEPTH = R) against the register pipeline
(R = 0), same run, same plans (GPU machine):

    PYTHONPATH=packages/nanoqwen-format/src:packages/nanoqwen-kernels/src \
        python3 bench/kernels/ring_compare.py

1. Bitwise check: the ring only changes where the weights wait, not the arithmetic or its order, so
   every ring build must give exactly the default kernel's output (sym/asym, g32/64/128, SiLU input,
   split and unsplit plans, odd shapes, M = 1, 3, 8).
2. Timing (as bench_kernels.py: 2 x C launches in one graph over C weight copies > 4x L2) of the 7B
   decode shapes at M = 1 and 8, for each ring depth and split target, as a share of the copy bandwidth
   measured here. One JSON object on stdout.
"""

# ruff: noqa: B023
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch
from nanoqwen_kernels import build, gemv
from nanoqwen_kernels.specs import SPECS

sys.path.insert(0, str(Path(__file__).parent))
from bench_kernels import L2_ROTATE_BYTES, SHAPES, copy_bandwidth, random_weight, time_graph  # noqa: E402

RINGS = (2, 4, 6)


def register_families() -> dict[int, str]:
    fams = {}
    for r in RINGS:
        name = f"gemv_r{r}"
        SPECS[name] = build.KernelSpec(name, ("gemv.cu",), (f"-DNQ_GEMV_ASYNC_DEPTH={r}",))
        fams[r] = name
    return fams


def bitwise_checks(fams, gen) -> list[str]:
    bad = []
    cases = [
        (200, 640, g, sym, silu) for g in (32, 64, 128) for sym in (True, False) for silu in (False, True)
    ]
    cases += [
        (4608, 3584, 128, True, False),
        (3584, 18944, 128, True, True),
        (37888, 3584, 128, False, False),
    ]
    for n, k, g, sym, silu in cases:
        w = random_weight(n, k, gen, symmetric=sym, group_size=g)
        for t in (1, 4):
            plan = gemv.plan_gemv(n, k, target_blocks_per_sm=t)
            ws = gemv.GemvWorkspace.allocate([plan], torch.device("cuda"))
            for m in (1, 3, 8):
                x = torch.randn(m, 2 * k if silu else k, generator=gen, device="cuda").to(torch.bfloat16)
                ref = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
                gemv.gemv_int4(x, w, ref, workspace=ws, plan=plan, silu_mul_input=silu)
                for r, fam in fams.items():
                    out = torch.full_like(ref, float("nan"))
                    gemv.gemv_int4(x, w, out, workspace=ws, plan=plan, silu_mul_input=silu, family=fam)
                    if not torch.equal(out, ref):
                        bad.append(f"R={r} n={n} k={k} g={g} sym={sym} silu={silu} S={plan.splits} m={m}")
    return bad


def timings(fams, gen, bw) -> list[dict]:
    rows = []
    ws = gemv.GemvWorkspace.allocate(
        [gemv.plan_gemv(n, k, target_blocks_per_sm=t) for _, n, k in SHAPES for t in (2, 3, 4, 6, 8)],
        torch.device("cuda"),
    )
    for name, n, k in SHAPES:
        w0 = random_weight(n, k, gen)
        copies = max(2, math.ceil(L2_ROTATE_BYTES / w0.nbytes()))
        weights = [w0] + [random_weight(n, k, gen) for _ in range(copies - 1)]
        for m in (1, 8):
            x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
            out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            nbytes = w0.nbytes() + x.numel() * 2 + out.numel() * 2
            for t in (2, 4, 6, 8) if name != "lm_head" else (4,):
                plan = gemv.plan_gemv(n, k, target_blocks_per_sm=t)
                for r, fam in [(0, "gemv")] + list(fams.items()):
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
                            "kc": plan.kc,
                            "ring": r,
                            "us": round(us, 2),
                            "frac_copy": round(nbytes / (us * 1e-6) / bw, 4),
                        }
                    )
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    fams = register_families()
    bad = bitwise_checks(fams, gen)
    bw = max(copy_bandwidth().values())
    res = {
        "device": torch.cuda.get_device_name(),
        "copy_bandwidth_GBps": round(bw / 1e9),
        "bitwise_mismatches": bad,
        "rows": timings(fams, gen, bw),
    }
    best = {}
    for r in res["rows"]:
        key = (r["shape"], r["m"])
        if key not in best or r["us"] < best[key]["us"]:
            best[key] = r
    res["best"] = [dict(v) for v in best.values()]
    default = {(r["shape"], r["m"]): r for r in res["rows"] if r["ring"] == 0 and r["target"] == 4}
    res["summary"] = [
        f"{s} M={m}: default {default[(s, m)]['us']} us ({default[(s, m)]['frac_copy']:.1%}), best "
        f"R={b['ring']} t={b['target']} {b['us']} us ({b['frac_copy']:.1%})"
        for (s, m), b in best.items()
    ]
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
