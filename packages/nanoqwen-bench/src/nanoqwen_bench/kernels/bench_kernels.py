"""Microbenchmarks of the nanoqwen kernels on one GPU (`nox -s bench` runs them before the engine bench).

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) \
        python -m nanoqwen_bench.kernels --out bench/out/kernels [--quick] [--all-variants]

Ceilings, measured first in the same run: the READ bandwidth (nanoqwen_bench.gpu.read_bandwidth:
a kernel that only reads a 4 GiB buffer, median of 30 launches), which is the roofline of a GEMV (it
reads its weights and writes almost nothing), and the device-to-device copy bandwidth (bytes read +
written, best of three methods), reported beside it as before.

For each INT4 GEMV at the Qwen2.5-Coder-7B decode shapes (qkv 3584->4608, o 3584->3584, gate+up
3584->2x18944, down 18944->3584, lm_head 3584->152064) and M in {1, 2, 4, 8}: time per launch and
achieved bandwidth counting weight + scale + activation + output bytes, as a fraction of the read
bandwidth (the goal column too) and of the copy bandwidth. Timing: R launches captured in one CUDA
graph, each on a different copy of the weights (together > 4x the L2, so nothing is served from
cache), median of 15 replays after warm-up. Also: the split-K target variants of the default kernel
(t2/t3/t6; same module), asymmetric g128, the other INT4 kernels at the same shapes and M (torch's
tinygemm and gemlite, baselines.py: gemlite where it ships a tuned config for the GPU, everywhere with
`--gemlite-autotune`), cuBLAS bf16 at the same shapes, the fused SiLU*mul input,
the prefill path, the layer ops and the sampler. `--all-variants` adds the compile-option builds
(`BUILD_VARIANTS`). Writes bench_kernels.json and bench_kernels.md under --out.
"""

# ruff: noqa: B023  (every closure below runs inside time_graph before its loop variables change)
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
from nanoqwen_kernels import gemv, layer_ops, sampling
from nanoqwen_kernels.specs import SPECS

from ..gpu import read_bandwidth, time_graph
from .baselines import gemlite_copies, gemlite_mm, gemlite_plan, tinygemm_copies, tinygemm_mm

SHAPES = [("qkv", 4608, 3584), ("o", 3584, 3584), ("gate_up", 37888, 3584), ("down", 3584, 18944),
          ("lm_head", 152064, 3584)]  # fmt: skip
# the real 1.5B's decode shapes (`--model 1.5b`): the 7B's structure at head_dim 128, untied lm_head
SHAPES_15B = [("1.5b qkv", 2048, 1536), ("1.5b o", 1536, 1536), ("1.5b gate_up", 17920, 1536),
              ("1.5b down", 1536, 8960), ("1.5b lm_head", 151936, 1536)]  # fmt: skip
MODELS = {"7b": SHAPES, "1.5b": SHAPES_15B}
# goals of the INT4 GEMV, as fractions of the read bandwidth (its roofline: it reads its weights)
GOALS = {"qkv": 0.70, "o": 0.70, "gate_up": 0.85, "down": 0.85, "lm_head": 0.85}


def goal(shape: str) -> float:
    """The read-bandwidth goal of a GEMV shape ("qkv" or "1.5b qkv": by the linear's name)."""
    return GOALS[shape.split()[-1]]
L2_ROTATE_BYTES = 256 << 20  # > 4x the H200's 60 MB L2: weight copies rotated through, so timings read HBM
# compile-option builds of the "gemv" family, timed with --all-variants (default build: 4 blocks per SM
# at g128; the deeper-stage builds gemv_u2/u4 measured slower and went with the one-column pipeline)
BUILD_VARIANTS = {
    "gemv_exact": ("-DNQ_GEMV_EXACT_LOOP",),
    "gemv_mb3": ("-DNQ_GEMV_MIN_BLOCKS_G128=3",),
}


def copy_bandwidth() -> dict[str, float]:
    """Device-to-device copy of 4 GiB, bytes read + written per second, three ways (the max is the
    reference): cudaMemcpy in a graph, cudaMemcpy eagerly, and an elementwise kernel (x * 1)."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.float32, device="cuda").normal_()
    dst = torch.empty_like(src)
    res = {"memcpy_graph": 8 * n / time_graph(lambda i: dst.copy_(src), reps=5, replays=10)}
    times = []
    for _ in range(12):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    res["memcpy_eager"] = 8 * n / statistics.median(times[2:])
    res["kernel_mul"] = 8 * n / time_graph(lambda i: torch.mul(src, 1.0, out=dst), reps=5, replays=10)
    return res


def random_weight(n, k, gen, symmetric=True, group_size=128):
    words = torch.randint(0, 256, (n * k // 2,), generator=gen, device="cuda", dtype=torch.uint8)
    scales = ((0.5 + torch.rand(n, k // group_size, generator=gen, device="cuda")) / (4.6 * k**0.5)).to(
        torch.bfloat16
    )
    zeros = None
    if not symmetric:
        zeros = torch.randint(0, 16, (n, k // group_size), generator=gen, device="cuda", dtype=torch.uint8)
    return gemv.Int4Weight(words.view(torch.int32).reshape(n // 8, k // 128, 32, 4), scales, zeros, n, k,
                           group_size)  # fmt: skip


def rotated_weights(n, k, gen, symmetric=True) -> list[gemv.Int4Weight]:
    """Random [N, K] INT4 g128 weights, at least two and together more than L2_ROTATE_BYTES: a timed
    launch on copy i % len(copies) reads its weights from HBM, not from the L2."""
    first = random_weight(n, k, gen, symmetric)
    copies = max(2, math.ceil(L2_ROTATE_BYTES / first.nbytes()))
    return [first] + [random_weight(n, k, gen, symmetric) for _ in range(copies - 1)]


@dataclasses.dataclass
class Row:
    kernel: str
    shape: str
    m: int
    variant: str
    us: float
    gbps: float
    frac_copy: float
    note: str = ""


def sweep_plans(n: int, k: int) -> list[gemv.GemvPlan]:
    """Every distinct split-K plan of an [N, K] GEMV: one per split count that some number of tile-columns
    per block (1 .. KC_MAX) gives, fewest splits first."""
    kt = k // 128
    by_splits = {}
    for kc in range(1, min(kt, gemv.KC_MAX) + 1):  # the fewest tile-columns per block: the evenest split
        by_splits.setdefault(-(-kt // kc), kc)
    return [gemv.GemvPlan(n, k, splits, kc) for splits, kc in sorted(by_splits.items())]


def bench_gemv(copy_bw, gen, quick, rows, read_bw, all_variants=False, shapes=SHAPES, gemlite_autotune=False,
               split_sweep=False):
    plans = [gemv.plan_gemv(n, k, target_blocks_per_sm=t) for _, n, k in shapes for t in (2, 3, 4, 6)]
    if split_sweep:
        plans += [p for _, n, k in shapes for p in sweep_plans(n, k)]
    ws = gemv.GemvWorkspace.allocate(plans, torch.device("cuda"))
    if all_variants:
        for fam, opts in BUILD_VARIANTS.items():
            SPECS[fam] = dataclasses.replace(SPECS["gemv"], name=fam, options=opts, hot_kernels=())
    ms = (1, 8) if quick else (1, 2, 4, 8)
    for name, n, k in shapes:
        weights = rotated_weights(n, k, gen)
        w0, copies = weights[0], len(weights)
        for m in ms:
            x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
            out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            nbytes = w0.nbytes() + x.numel() * 2 + out.numel() * 2
            variants = [("t4", 4, "gemv")]
            if not quick or m in (1, 8):
                variants += [("t2", 2, "gemv"), ("t3", 3, "gemv"), ("t6", 6, "gemv")]
                if all_variants:
                    variants += [("t4_exact", 4, "gemv_exact"), ("t4_mb3", 4, "gemv_mb3")]
            for vname, target, family in variants:
                plan = gemv.plan_gemv(n, k, target_blocks_per_sm=target)

                def fn(i, plan=plan, family=family, x=x, out=out):
                    gemv.gemv_int4(x, weights[i % copies], out, workspace=ws, plan=plan, family=family)

                t = time_graph(fn, reps=2 * copies)
                bw = nbytes / t
                rows.append(Row("gemv_int4_g128_sym", name, m, f"{vname} S={plan.splits} kc={plan.kc}",
                                t * 1e6, bw / 1e9, bw / copy_bw))  # fmt: skip
                print(f"{name:8s} M={m} {vname:6s} S={plan.splits:2d} {t * 1e6:8.1f} us {bw / 1e9:7.0f} GB/s "
                      f"{bw / read_bw:6.1%} of read BW, {bw / copy_bw:6.1%} of copy BW",
                      flush=True)  # fmt: skip
            if split_sweep and m == 1:
                bench_split_sweep(name, n, k, weights, x, out, ws, nbytes, rows, read_bw, copy_bw)
        # asymmetric g128 at M=1 with the default plan
        wa = [random_weight(n, k, gen, symmetric=False) for _ in range(copies)]
        x = torch.randn(1, k, generator=gen, device="cuda").to(torch.bfloat16)
        out = torch.empty(1, n, dtype=torch.bfloat16, device="cuda")
        nb = wa[0].nbytes() + x.numel() * 2 + out.numel() * 2
        plan = gemv.plan_gemv(n, k)

        def fa(i, x=x, out=out, plan=plan):
            gemv.gemv_int4(x, wa[i % copies], out, workspace=ws, plan=plan)

        t = time_graph(fa, 2 * copies)
        rows.append(Row("gemv_int4_g128_asym", name, 1, "default", t * 1e6, nb / t / 1e9, nb / t / copy_bw))
        weights = wa = None
        bench_baselines(name, n, k, ms, gen, rows, read_bw, copy_bw, gemlite_autotune)
        # cuBLAS bf16 at the same shape (4x the weight bytes), for scale
        if name != "gate_up" or not quick:
            wd = [torch.randn(n, k, generator=gen, device="cuda").to(torch.bfloat16) for _ in range(2)]
            for m in (1, 8):
                x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
                out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
                t = time_graph(lambda i, x=x, out=out: torch.mm(x, wd[i % 2].t(), out=out), 4)
                nb = n * k * 2 + x.numel() * 2 + out.numel() * 2
                bw = nb / t
                rows.append(Row("cublas_bf16_mm", name, m, "torch.mm", t * 1e6, bw / 1e9, bw / copy_bw,
                                "bf16 weights: 4x the bytes"))  # fmt: skip
            wd = None
        torch.cuda.empty_cache()


def bench_split_sweep(name, n, k, weights, x, out, ws, nbytes, rows, read_bw, copy_bw):
    """The GEMV at every split-K plan of the shape (`sweep_plans`), at x's M: how much the split count
    (the blocks per SM, and their last partial wave) moves the time."""
    default = gemv.plan_gemv(n, k)
    for plan in sweep_plans(n, k):
        t = time_graph(lambda i, plan=plan: gemv.gemv_int4(x, weights[i % len(weights)], out, workspace=ws,
                                                           plan=plan), reps=2 * len(weights))  # fmt: skip
        bw = nbytes / t
        blocks = plan.blocks_n * plan.splits
        note = f"{blocks} blocks" + (" (the engine's plan)" if plan == default else "")
        rows.append(Row("gemv_int4_g128_sym_splits", name, x.shape[0], f"S={plan.splits} kc={plan.kc}",
                        t * 1e6, bw / 1e9, bw / copy_bw, note))  # fmt: skip
        print(f"{name:8s} M={x.shape[0]} sweep S={plan.splits:3d} kc={plan.kc:2d} {blocks:5d} blocks "
              f"{t * 1e6:8.1f} us {bw / read_bw:6.1%} of read BW", flush=True)


def bench_baselines(name, n, k, ms, gen, rows, read_bw, copy_bw, gemlite_autotune=False):
    """torch's tinygemm and gemlite (baselines.py) at the shape, g128, each M: checked at every M, then
    timed like the GEMV. gemlite runs where it ships a tuned config for the GPU, or everywhere with
    `gemlite_autotune` (its autotune then runs in the warm-up); a note row says why any M is not timed."""
    bench_baseline("tinygemm_int4_g128", "torch._weight_int4pack_mm",
                   tinygemm_copies(n, k, gen, L2_ROTATE_BYTES, ms), tinygemm_mm, name, n, k, ms, gen, rows,
                   read_bw, copy_bw)  # fmt: skip
    timed, why = gemlite_plan(n, k, ms, gemlite_autotune)
    for m in (m for m in ms if m not in timed):
        rows.append(Row("gemlite_int4_g128", name, m, "not timed", 0, 0, 0, why))
    if timed:
        bench_baseline("gemlite_int4_g128", "gemlite.GemLiteLinear",
                       gemlite_copies(n, k, gen, L2_ROTATE_BYTES, timed), gemlite_mm, name, n, k, timed, gen,
                       rows, read_bw, copy_bw)  # fmt: skip


def bench_baseline(kernel, variant, weights, mm, name, n, k, ms, gen, rows, read_bw, copy_bw):
    """Time mm(x, weights[i]) at each M over the checked copies (baselines.py) as the GEMV is timed."""
    w0, copies = weights[0], len(weights)
    for m in ms:
        x = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
        nbytes = w0.nbytes() + x.numel() * 2 + m * n * 2
        t = time_graph(lambda i, x=x: mm(x, weights[i % copies]), reps=2 * copies)
        bw = nbytes / t
        rows.append(Row(kernel, name, m, variant, t * 1e6, bw / 1e9, bw / copy_bw))
        print(f"{name:8s} M={m} {kernel} {t * 1e6:8.1f} us {bw / 1e9:7.0f} GB/s "
              f"{bw / read_bw:6.1%} of read BW", flush=True)


def bench_other(copy_bw, gen, rows):
    # fused SiLU*mul input into down, vs separate silu_mul + gemv
    n, k = 3584, 18944
    copies = 8
    ws_list = [random_weight(n, k, gen) for _ in range(copies)]
    ws = gemv.GemvWorkspace.allocate([gemv.plan_gemv(n, k)], torch.device("cuda"))
    gu = torch.randn(1, 2 * k, generator=gen, device="cuda").to(torch.bfloat16)
    act = torch.empty(1, k, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(1, n, dtype=torch.bfloat16, device="cuda")

    def fused(i):
        gemv.gemv_int4(gu, ws_list[i % copies], out, workspace=ws, silu_mul_input=True)

    t_fused = time_graph(fused, 2 * copies)

    def unfused(i):
        layer_ops.silu_mul(gu, act)
        gemv.gemv_int4(act, ws_list[i % copies], out, workspace=ws)

    t_unf = time_graph(unfused, 2 * copies)
    rows.append(Row("gemv_int4 down + silu_mul", "down", 1, "fused input", t_fused * 1e6, 0, 0))
    rows.append(Row("silu_mul; gemv_int4 down", "down", 1, "two launches", t_unf * 1e6, 0, 0))
    ws_list = None
    # prefill: dequantize + cuBLAS, T = 512 tokens at qkv and gate_up
    for name, n, k in (("qkv", 4608, 3584), ("gate_up", 37888, 3584), ("down", 3584, 18944)):
        w = random_weight(n, k, gen)
        scratch = torch.empty(n, k, dtype=torch.bfloat16, device="cuda")
        x = torch.randn(512, k, generator=gen, device="cuda").to(torch.bfloat16)
        out = torch.empty(512, n, dtype=torch.bfloat16, device="cuda")
        t_deq = time_graph(lambda i, w=w, s=scratch: gemv.dequantize_int4(w, s), 4)
        t_lin = time_graph(lambda i, w=w, s=scratch, x=x, o=out: gemv.linear_int4_prefill(x, w, o, s), 4)
        t_mm = time_graph(lambda i, s=scratch, x=x, o=out: torch.mm(x, s.t(), out=o), 4)
        flops = 2 * 512 * n * k
        deq_bytes = w.nbytes() + n * k * 2
        rows.append(
            Row(
                "dequant_int4", name, 0, "", t_deq * 1e6, deq_bytes / t_deq / 1e9, deq_bytes / t_deq / copy_bw
            )
        )
        rows.append(Row("linear_int4_prefill", name, 512, "dequant+cuBLAS", t_lin * 1e6, 0, 0,
                        f"{flops / t_lin / 1e12:.0f} TFLOP/s; "
                        f"cuBLAS alone {flops / t_mm / 1e12:.0f}"))  # fmt: skip
        w = scratch = None
    # layer ops at 7B decode / prefill sizes
    h = 3584
    for t_tok in (1, 512):
        x = torch.randn(t_tok, h, generator=gen, device="cuda").to(torch.bfloat16)
        res = torch.randn(t_tok, h, generator=gen, device="cuda").to(torch.bfloat16)
        wn = torch.randn(h, generator=gen, device="cuda").to(torch.bfloat16)
        o = torch.empty_like(x)
        t = time_graph(lambda i, x=x, r=res, w=wn, o=o: layer_ops.fused_add_rms_norm(x, r, w, o, 1e-6), 20)
        rows.append(
            Row("fused_add_rms_norm", f"{t_tok}x{h}", t_tok, "", t * 1e6, 4 * x.numel() * 2 / t / 1e9, 0)
        )
        shape = layer_ops.AttentionShape(28, 4, 128)
        qkv = torch.randn(t_tok, shape.qkv_width, generator=gen, device="cuda").to(torch.bfloat16)
        pos = torch.arange(t_tok, dtype=torch.int32, device="cuda")
        slots = torch.arange(t_tok, dtype=torch.int32, device="cuda")
        inv = layer_ops.rope_inv_freq(128, 1e6, "cuda")
        q = torch.empty(t_tok, 28, 128, dtype=torch.bfloat16, device="cuda")
        kc = torch.empty(t_tok // 16 + 2, 4, 16, 128, dtype=torch.bfloat16, device="cuda")
        vc = torch.empty_like(kc)
        t = time_graph(lambda i: layer_ops.qkv_rope_kv_write(qkv, shape, pos, slots, inv, q, kc, vc), 20)
        rows.append(Row("qkv_rope_kv_write", f"{t_tok} tokens 7B", t_tok, "", t * 1e6, 0, 0))
    # sampler at the 7B vocabulary
    for b, (temp, tk, tp), label in ((1, (0.0, 0, 1.0), "greedy"), (1, (0.7, 0, 0.9), "T=0.7 top_p=0.9"),
                                     (1, (0.7, 50, 0.9), "T=0.7 top_k=50 top_p=0.9"),
                                     (8, (0.7, 50, 0.9), "T=0.7 top_k=50 top_p=0.9")):  # fmt: skip
        logits = (3 * torch.randn(b, 152064, generator=gen, device="cuda")).to(torch.bfloat16)
        st = sampling.SamplingState.allocate(b, "cuda")
        st.temperature.fill_(temp)
        st.top_k.fill_(tk)
        st.top_p.fill_(tp)
        tok = torch.empty(b, dtype=torch.int32, device="cuda")
        t = time_graph(lambda i, lg=logits, st=st, tok=tok: sampling.sample_tokens(lg, st, tok), 10)
        rows.append(Row("sample_tokens", f"B={b} V=152064", b, label, t * 1e6, 0, 0))


def _frac(gbps: float, bw: float) -> str:
    return f"{gbps * 1e9 / bw:.1%}" if gbps else ""


def markdown(meta: dict, rows: list[Row]) -> list[str]:
    """bench_kernels.md: the ceilings, the default GEMV plan against its goals, then every row."""
    read_bw, copy_bw = meta["read_GBps"] * 1e9, meta["copy_GBps"] * 1e9
    copies = ", ".join(f"{k} {v:.0f}" for k, v in meta["copy_methods_GBps"].items())
    lines = ["# nanoqwen kernel microbenchmarks", "",
             f"- command: `{meta['command']}`",
             f"- device: {meta['device']} ({meta['sms']} SMs), torch {meta['torch']}, {meta['date']}",
             f"- read bandwidth (the roofline: a kernel that only reads {meta['read_bytes'] / 2**30:.0f} "
             f"GiB, median of {meta['read_reps']} launches): **{meta['read_GBps']:.0f} GB/s**",
             f"- copy bandwidth (read + write, best of: {copies}): {meta['copy_GBps']:.0f} GB/s", "",
             "## INT4 GEMV, default plan (t4), g128 symmetric: share of the read bandwidth vs the goal", "",
             "| GEMV | M | us | GB/s | of read BW | of copy BW | goal (read) | met | tinygemm us | "
             "speedup over tinygemm | gemlite us | speedup over gemlite | best variant |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    sym = [r for r in rows if r.kernel in ("gemv_int4_g128_sym", "gemv_int4_g128_sym_splits")]
    baseline = {(r.kernel, r.shape, r.m): r.us for r in rows if r.us}
    for r in (r for r in sym if r.variant.startswith("t4 ")):
        best = min((x for x in sym if x.shape == r.shape and x.m == r.m), key=lambda x: x.us)
        g = goal(r.shape)
        met = "yes" if r.gbps * 1e9 / read_bw >= g else "no"
        vs = []
        for other in ("tinygemm_int4_g128", "gemlite_int4_g128"):
            t = baseline.get((other, r.shape, r.m))
            vs.append(f"{t:.1f} | {t / r.us:.2f}x" if t else "- | -")
        lines.append(f"| {r.shape} | {r.m} | {r.us:.1f} | {r.gbps:.0f} | {_frac(r.gbps, read_bw)} | "
                     f"{_frac(r.gbps, copy_bw)} | {g:.0%} | {met} | {' | '.join(vs)} "
                     f"| {best.variant}: {best.us:.1f} us, {_frac(best.gbps, read_bw)} |")  # fmt: skip
    lines += ["", "## Every row", "",
              "| kernel | shape | M | variant | us | GB/s | of read BW | of copy BW | goal (read) | note |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for r in rows:
        g = goal(r.shape) if r.kernel.startswith("gemv_int4_g128") else None
        lines.append(f"| {r.kernel} | {r.shape} | {r.m} | {r.variant} | {r.us:.1f} | "
                     f"{r.gbps:.0f} | {_frac(r.gbps, read_bw)} | {_frac(r.gbps, copy_bw)} | "
                     f"{'' if g is None else f'{g:.0%}'} | {r.note} |")  # fmt: skip
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/out/kernels", help="folder for bench_kernels.json and .md")
    ap.add_argument("--quick", action="store_true", help="M = 1 and 8 only; fewer variants")
    ap.add_argument("--gemv-only", action="store_true")
    ap.add_argument("--model", default="7b",
                    help="comma-separated: whose decode shapes the GEMVs run at (7b, 1.5b; default 7b)")
    ap.add_argument("--all-variants", action="store_true",
                    help="also the compile-option builds (BUILD_VARIANTS)")
    ap.add_argument("--split-sweep", action="store_true",
                    help="also time every split-K plan of each GEMV shape at M = 1")
    ap.add_argument("--gemlite-autotune", action="store_true",
                    help="time gemlite also where it ships no tuned config (its autotune runs first)")
    args = ap.parse_args()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    props = torch.cuda.get_device_properties(0)
    t0 = time.time()
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    rb = read_bandwidth(torch.device("cuda"))
    read_bw = rb["bytes_per_s"]
    copy_all = copy_bandwidth()
    copy_bw = max(copy_all.values())
    copies = ", ".join(f"{k} {v / 1e9:.0f}" for k, v in copy_all.items())
    print(f"device {props.name}, {props.multi_processor_count} SMs; read bandwidth {read_bw / 1e9:.0f} GB/s; "
          f"copy bandwidth {copy_bw / 1e9:.0f} GB/s ({copies})", flush=True)  # fmt: skip
    rows: list[Row] = []
    shapes = [s for name in args.model.split(",") for s in MODELS[name]]
    bench_gemv(copy_bw, gen, args.quick, rows, read_bw, all_variants=args.all_variants, shapes=shapes,
               gemlite_autotune=args.gemlite_autotune, split_sweep=args.split_sweep)
    if not args.gemv_only:
        bench_other(copy_bw, gen, rows)
    meta = {"device": props.name, "sms": props.multi_processor_count, "read_GBps": read_bw / 1e9,
            "read_bytes": rb["nbytes"], "read_reps": rb["reps"], "read_min_max_s": [rb["min_s"], rb["max_s"]],
            "copy_GBps": copy_bw / 1e9, "copy_methods_GBps": {k: v / 1e9 for k, v in copy_all.items()},
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": " ".join(["python", *sys.argv]), "seconds": time.time() - t0}  # fmt: skip
    payload = {"meta": meta, "rows": [dataclasses.asdict(r) | {"frac_read": r.gbps * 1e9 / read_bw}
                                      for r in rows]}
    (out_dir / "bench_kernels.json").write_text(json.dumps(payload, indent=1))
    lines = markdown(meta, rows)
    (out_dir / "bench_kernels.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {out_dir}/bench_kernels.json and bench_kernels.md ({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
