"""Prefill linears (M > 64): dequantize + cuBLAS in series, against dequantizing the next weight piece on
a side stream while cuBLAS multiplies the current one, on one GPU.

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) python bench/kernels/prefill_overlap.py --out DIR \
        [--ms 128,512,2048] [--layers 4]

The engine's prefill path (ops_kernels.PREFILL_PATH = "dequant_gemm") runs, per linear, the
memory-bound dequantization (0.12 GB read, 0.47 GB written per 7B layer) and then the compute-bound
cuBLAS GEMM, one after the other. The dequantization of the next piece does not depend on the current
product, so it can run beside it. A cuBLAS GEMM fills every SM, so the side stream only gets SMs when
cuBLAS is told to leave some: `torch._C._set_sm_carveout_experimental(c)` (cuBLASLt's SM count target)
with the dequantization limited to `c x blocks-per-SM` blocks.

Variants, each on the same `--layers` layers of the four 7B linears (distinct random INT4 g128 asym
weights, so they come from HBM), each timed as the median of 7 runs of the whole sequence (CUDA events):
- serial: today's path (one scratch, dequantize then mm per linear);
- overlap c=C b=B r=R: weights cut into pieces of at most R rows (R a multiple of 8; gate_up's 37,888
  rows in pieces), two scratch buffers used in turn, piece j + 1 dequantized on the side stream (at
  most B blocks) while piece j's mm runs with C SMs carved out (C = 0: no carve-out).
Every variant's outputs are compared with the serial ones (max |diff| over max |ref|). The mm alone
with and without the carve-out is timed too (does the carve-out take effect on this torch.mm?).
Writes prefill_overlap.json and prefill_overlap.md under --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from nanoqwen_kernels import gemv
from nanoqwen_kernels.bench import event_seconds

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gemm import SHAPES  # noqa: E402
from bench_kernels import random_weight  # noqa: E402


def row_view(w: gemv.Int4Weight, r0: int, r1: int) -> gemv.Int4Weight:
    """Rows r0..r1 - 1 of w (multiples of 8), zero-copy (the tile layout is row-tile major)."""
    z = None if w.zeros is None else w.zeros[r0:r1]
    return gemv.Int4Weight(w.qweight[r0 // 8:r1 // 8], w.scales[r0:r1], z, r1 - r0, w.k, w.group_size)


def set_carveout(c: int) -> None:
    torch._C._set_sm_carveout_experimental(c if c > 0 else None)


def median_ms(fn, runs: int = 7) -> float:
    """Median GPU ms of `runs` calls of fn() after one untimed call."""
    return statistics.median(event_seconds(fn, runs, warm=1)) * 1e3


def overlapped_fn(lins, pieces, xs, outs, bufs, side, carve: int, blocks: int):
    """The whole sequence with piece j + 1 dequantized on `side` (at most `blocks` blocks) while piece j's
    mm runs with `carve` SMs carved out; two buffers in turn."""

    def buf(j):
        pw = pieces[j][3]
        return bufs[j % 2][:pw.n * pw.k].view(pw.n, pw.k)

    def run():
        main_s = torch.cuda.current_stream()
        side.wait_stream(main_s)
        mm_done, dq_done = [None] * len(pieces), [None] * len(pieces)
        gemv.dequantize_int4(pieces[0][3], buf(0))
        for j, (i, r0, r1, pw) in enumerate(pieces):
            if j + 1 < len(pieces):
                with torch.cuda.stream(side):
                    if j >= 1:
                        side.wait_event(mm_done[j - 1])  # buffer (j + 1) % 2 was piece j - 1's
                    gemv.dequantize_int4(pieces[j + 1][3], buf(j + 1), max_blocks=blocks)
                    dq_done[j + 1] = side.record_event()
            if j >= 1:
                main_s.wait_event(dq_done[j])
            set_carveout(carve)
            torch.mm(xs[pw.k], buf(j).t(), out=outs[i][:, r0:r1])
            set_carveout(0)
            mm_done[j] = main_s.record_event()
        main_s.wait_stream(side)

    return run


def run_m(m: int, lins, configs: str, gen, rows: list) -> None:
    dev = torch.device("cuda")
    xs = {k: torch.randn(m, k, generator=gen, device=dev).to(torch.bfloat16) for k in {w.k for _, w in lins}}
    ref = [torch.empty(m, w.n, dtype=torch.bfloat16, device=dev) for _, w in lins]
    outs = [torch.full((m, w.n), float("nan"), dtype=torch.bfloat16, device=dev) for _, w in lins]
    scratch = torch.empty(max(w.n * w.k for _, w in lins), dtype=torch.bfloat16, device=dev)

    def serial():
        for (_, w), o in zip(lins, ref, strict=True):
            gemv.linear_int4_prefill(xs[w.k], w, o, scratch[:w.n * w.k].view(w.n, w.k))

    t_serial = median_ms(serial)
    rows.append({"m": m, "variant": "serial", "ms": t_serial, "err": 0.0})
    print(f"M={m:5d} serial {t_serial:8.3f} ms", flush=True)
    # the mm alone, gate_up, with and without a carve-out (does it take effect?)
    gw = next(w for name, w in lins if name == "gate_up")
    dense = scratch[:gw.n * gw.k].view(gw.n, gw.k)
    gemv.dequantize_int4(gw, dense)
    for c in (0, 16, 32):
        set_carveout(c)
        t = median_ms(lambda: torch.mm(xs[gw.k], dense.t(), out=ref[2]))
        set_carveout(0)
        rows.append({"m": m, "variant": f"mm gate_up alone c={c}", "ms": t})
        print(f"M={m:5d} mm gate_up alone carve-out {c:3d}: {t * 1e3:8.1f} us", flush=True)
    serial()
    torch.cuda.synchronize()
    side = torch.cuda.Stream(device=dev)
    for cfg in configs.split(","):
        c, b, r = (int(v) for v in cfg.split(":"))
        pieces = [(i, r0, min(w.n, r0 + r), row_view(w, r0, min(w.n, r0 + r)))
                  for i, (_, w) in enumerate(lins) for r0 in range(0, w.n, r)]
        big = max(p[3].n * p[3].k for p in pieces)
        bufs = [torch.empty(big, dtype=torch.bfloat16, device=dev) for _ in range(2)]
        t = median_ms(overlapped_fn(lins, pieces, xs, outs, bufs, side, c, b))
        err = max(((o.float() - rf.float()).abs().max() / rf.float().abs().max()).item()
                  for o, rf in zip(outs, ref, strict=True))
        name = f"overlap c={c} b={b} r={r}"
        rows.append({"m": m, "variant": name, "ms": t, "err": err, "pieces": len(pieces)})
        print(f"M={m:5d} {name:28s} {t:8.3f} ms ({t_serial / t:5.3f}x serial) err {err:.2e}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--ms", default="128,512,2048")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--configs", default="0:2112:37888,0:2112:18944,16:128:18944,16:64:18944,24:192:18944,"
                                         "32:256:18944,32:128:18944,48:384:18944,24:192:9472",
                    help="carve-out SMs : dequantize blocks : piece rows, comma-separated")
    args = ap.parse_args(argv)
    gen = torch.Generator(device="cuda").manual_seed(0)
    lins = [(name, random_weight(n, k, gen, symmetric=False))
            for _ in range(args.layers) for name, n, k in SHAPES]
    print("preferred blas:", torch.backends.cuda.preferred_blas_library(), flush=True)
    rows: list[dict] = []
    for m in (int(v) for v in args.ms.split(",")):
        run_m(m, lins, args.configs, gen, rows)
        torch.cuda.empty_cache()
    rep = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "layers": args.layers,
           "command": " ".join(sys.argv), "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prefill_overlap.json").write_text(json.dumps(rep, indent=1))
    lines = [f"# Prefill linears: serial against overlapped dequantization ({rep['date']}, {rep['device']})",
             "", f"{args.layers} layers of the four 7B linears, INT4 g128 asym; ms per run (median of 7).",
             "", "| M | variant | ms | vs serial | max err / max ref |", "| --- | --- | --- | --- | --- |"]
    serial_ms = {r["m"]: r["ms"] for r in rows if r["variant"] == "serial"}
    for r in rows:
        e = f"{r['err']:.1e}" if "err" in r else ""
        vs = "" if r["variant"].startswith("mm ") else f"{serial_ms[r['m']] / r['ms']:.3f}x"
        lines.append(f"| {r['m']} | {r['variant']} | {r['ms']:.3f} | {vs} | {e} |")
    (args.out / "prefill_overlap.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
