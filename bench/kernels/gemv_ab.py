"""A/B timing of the INT4 decode GEMV: the kernels of one source tree against another's, on one GPU.

    PYTHONPATH=A/packages/nanoqwen-format/src:A/packages/nanoqwen-kernels/src \
        python bench/kernels/gemv_ab.py time --label A --out a.json
    PYTHONPATH=...B... python bench/kernels/gemv_ab.py time --label B --out b.json [--variant gemv_exact]
    python bench/kernels/gemv_ab.py compare a.json b.json --out ab.md

`time` measures, in this process, the read bandwidth (nanoqwen_kernels.bench.read_bandwidth: 4 GiB,
median of 30) and `gemv_int4` with its default plan at the Qwen2.5-Coder-7B decode shapes (qkv
3584->4608, o 3584->3584, gate_up 3584->2x18944, down 18944->3584 with the fused SiLU*mul input, as the
engine launches it), g128 sym and asym, M = 1 and 8 (`--ms`: other row counts). Timing as
bench_kernels.py: R launches in one CUDA graph, each on another copy of the weights (> 256 MiB in all:
cold L2), median of 15 replays.
Bytes counted: the weight's packed bytes + scales (+ zeros) + x + out (`Int4Weight.nbytes` + I/O).
Every timed output is first checked against the kernel tests' oracle (nanoqwen_kernels.reference:
the fp32 product with the dequantized weight, bf16 tolerance from reference.TOLERANCES), so a variant
that computes something else stops the run instead of reporting a time.
`--variant NAME` registers a compile-option build of the "gemv" family (`VARIANTS`) and times it;
`--target-blocks N` plans every shape's K split for about N blocks per SM (plan_gemv's default: 4).

`compare` prints B's time over A's per row and the geometric mean, with each side's fraction of its
own run's read bandwidth. Run both sides in one device call, back to back, so they share the machine.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

SHAPES = [("qkv", 4608, 3584), ("o", 3584, 3584), ("gate_up", 37888, 3584), ("down", 3584, 18944)]
# `--with-lm-head`: the INT4 lm_head option's GEMV too (unsplit, kc = 28: the shape whose occupancy at
# M = 5..8 the g128 scale records cost, 3 -> 2 blocks per SM; packages/nanoqwen-kernels/NOTES.md, session 25)
LM_HEAD_SHAPE = ("lm_head", 152064, 3584)
L2_ROTATE_BYTES = 256 << 20
# compile-option builds of the "gemv" family that `--variant` can time
VARIANTS = {
    "gemv_exact": ("-DNQ_GEMV_EXACT_LOOP",),
    "gemv_mb3": ("-DNQ_GEMV_MIN_BLOCKS_G128=3",),
    "gemv_exact_mb3": ("-DNQ_GEMV_EXACT_LOOP", "-DNQ_GEMV_MIN_BLOCKS_G128=3"),
    # the exact loop everywhere, the g32/g64 kernels at 2 blocks per SM (session 9 timed it before the
    # g128 SiLU kernels had a macro of their own: they were at 2 blocks too, today's default)
    "gemv_exact_mb2": ("-DNQ_GEMV_EXACT_LOOP", "-DNQ_GEMV_MIN_BLOCKS=2"),
    # the g128 SiLU kernels at 3 blocks per SM (spills 4-8 bytes; pair with --target-blocks 3)
    "gemv_silu_mb3": ("-DNQ_GEMV_MIN_BLOCKS_G128_SILU=3",),
}


def check_output(out, x, w, silu: bool = False) -> None:
    """out (bf16 [M, N]) against the kernel tests' oracle: the fp32 product with the dequantized weight
    (nanoqwen_kernels.reference), within the bf16 tolerance of reference.TOLERANCES."""
    import torch
    from nanoqwen_kernels import reference as R

    dense = R.dequantize_int4(w.qweight, w.scales, w.zeros, w.group_size)
    xin = R.silu_mul(x).to(torch.bfloat16) if silu else x
    R.assert_close(out, R.linear(xin, dense, None), what="gemv_ab output")


def _plan(gemv, n: int, k: int, silu: bool, target_blocks: int | None):
    """The engine's plan of the shape (down: the SiLU-input kernel's), or one for `target_blocks`."""
    if target_blocks is not None:
        return gemv.plan_gemv(n, k, target_blocks_per_sm=target_blocks)
    try:
        return gemv.plan_gemv(n, k, silu_input=silu)
    except TypeError:  # a tree from before the per-kernel split targets (2026-12-02)
        return gemv.plan_gemv(n, k)


def time_gemv(label: str, variant: str | None, target_blocks: int | None = None,
              with_lm_head: bool = False, ms: tuple[int, ...] = (1, 8)) -> dict:
    import torch
    from bench_kernels import random_weight
    from nanoqwen_kernels import build, gemv
    from nanoqwen_kernels.bench import read_bandwidth, time_graph
    from nanoqwen_kernels.specs import SPECS

    family = "gemv"
    if variant:
        SPECS[variant] = build.KernelSpec(variant, ("gemv.cu",), VARIANTS[variant])
        family = variant
    dev = torch.device("cuda")
    read_bps = read_bandwidth(dev)["bytes_per_s"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = SHAPES + ([LM_HEAD_SHAPE] if with_lm_head else [])
    plans = [_plan(gemv, n, k, name == "down", target_blocks) for name, n, k in shapes]
    ws = gemv.GemvWorkspace.allocate(plans, dev)
    rows = []
    for name, n, k in shapes:
        silu = name == "down"
        for symmetric in (True, False):
            w0 = random_weight(n, k, gen, symmetric)
            copies = max(2, math.ceil(L2_ROTATE_BYTES / w0.nbytes()))
            weights = [w0] + [random_weight(n, k, gen, symmetric) for _ in range(copies - 1)]
            plan = _plan(gemv, n, k, silu, target_blocks)
            for m in ms:
                x = torch.randn(m, 2 * k if silu else k, generator=gen, device="cuda").to(torch.bfloat16)
                out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
                gemv.gemv_int4(x, w0, out, workspace=ws, plan=plan, silu_mul_input=silu, family=family)
                torch.cuda.synchronize()
                check_output(out, x, w0, silu)

                def fn(i, x=x, out=out, weights=weights, plan=plan, silu=silu, copies=copies):
                    gemv.gemv_int4(x, weights[i % copies], out, workspace=ws, plan=plan, silu_mul_input=silu,
                                   family=family)  # fmt: skip

                t = time_graph(fn, reps=2 * copies)
                nbytes = w0.nbytes() + x.numel() * 2 + out.numel() * 2
                rows.append({"shape": name, "kind": "sym" if symmetric else "asym", "m": m, "us": t * 1e6,
                             "gbps": nbytes / t / 1e9, "frac_read": nbytes / t / read_bps,
                             "splits": plan.splits})  # fmt: skip
                print(f"{label} {name:8s} {rows[-1]['kind']:4s} M={m} {t * 1e6:7.2f} us "
                      f"{rows[-1]['frac_read']:6.1%} of read BW", flush=True)  # fmt: skip
            weights = None
            torch.cuda.empty_cache()
    return {"label": label, "variant": variant, "target_blocks": target_blocks,
            "device": torch.cuda.get_device_name(),
            "read_bytes_per_s": read_bps, "rows": rows}  # fmt: skip


def compare(a: dict, b: dict) -> str:
    key = lambda r: (r["shape"], r["kind"], r["m"])  # noqa: E731
    bi = {key(r): r for r in b["rows"]}
    lines = [f"# GEMV A/B: {b['label']} over {a['label']} ({a['device']})\n",
             f"Read bandwidth: A {a['read_bytes_per_s'] / 1e9:.0f} GB/s, "
             f"B {b['read_bytes_per_s'] / 1e9:.0f} GB/s\n",
             "| shape | kind | M | A us | B us | B/A time | A frac read | B frac read |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    logs = []
    for r in a["rows"]:
        s = bi.get(key(r))
        if s is None:
            continue
        ratio = s["us"] / r["us"]
        logs.append(math.log(ratio))
        lines.append(f"| {r['shape']} | {r['kind']} | {r['m']} | {r['us']:.2f} | {s['us']:.2f} | "
                     f"{ratio:.3f} | "
                     f"{r['frac_read']:.1%} | {s['frac_read']:.1%} |")  # fmt: skip
    if logs:
        lines.append(f"\nGeometric mean of B/A time: {math.exp(sum(logs) / len(logs)):.3f}\n")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("time")
    t.add_argument("--label", required=True)
    t.add_argument("--out", type=Path, required=True)
    t.add_argument("--variant", choices=sorted(VARIANTS))
    t.add_argument("--target-blocks", type=int, help="plan_gemv's split-K target (blocks per SM)")
    t.add_argument("--with-lm-head", action="store_true", help="time the INT4 lm_head's GEMV too")
    t.add_argument("--ms", default="1,8", help="row counts M to time, e.g. 1,2,4,8")
    c = sub.add_parser("compare")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    c.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if args.cmd == "time":
        ms = tuple(int(v) for v in args.ms.split(","))
        if not all(1 <= m <= 8 for m in ms):
            p.error(f"--ms: row counts in 1..8 (the decode GEMV's), got {args.ms}")
        res = time_gemv(args.label, args.variant, args.target_blocks, args.with_lm_head, ms)
        args.out.write_text(json.dumps(res, indent=1))
        return 0
    md = compare(json.loads(args.a.read_text()), json.loads(args.b.read_text()))
    print(md)
    if args.out:
        args.out.write_text(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
