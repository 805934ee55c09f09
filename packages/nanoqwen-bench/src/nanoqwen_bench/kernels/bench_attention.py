"""Microbenchmarks of paged attention on the GPU, against ceilings measured in the same run.

    PYTHONPATH=packages/nanoqwen-format/src:packages/nanoqwen-model/src:packages/nanoqwen-kernels/src \
        python -m nanoqwen_bench.kernels.bench_attention --out bench/out/attention.json

Ceilings: device-to-device copy bandwidth (1 GiB, bytes read + written) and a random 8192^3 bf16
torch matmul. Decode (Qwen2.5-Coder-7B heads 28/4/128, page size 16) at batch 1 and 32 for contexts
1K/8K/32K: achieved bandwidth counts the K and V bytes read (B * ctx * 4 heads * 128 * 2 B * 2).
Prefill of one sequence of 512 / 4096 tokens (causal), a 512-token chunk on a 3584-token prefix, and a
256-token chunk on a 3328-token prefix (a warm autocomplete request's step; `--ablate` also splits it
2 / 4 / 8 ways along the context: one sequence's chunk fills 4 x 28 row tiles of 64 rows on the SMs):
TFLOP/s count 4 * n_heads * head_dim per (query, visible key) pair. Each measurement replays a CUDA
graph of many calls that cycle over enough page tables (disjoint pages) to keep the KV traffic several
times larger than the 60 MB L2; time is the median over replays divided by the calls per graph.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import statistics

import torch
from nanoqwen_kernels import attention, launch, specs
from nanoqwen_kernels.attention import AttentionGeometry, plan_decode, plan_prefill

from ..gpu import event_seconds

GEOM = AttentionGeometry(n_heads=28, n_kv_heads=4, head_dim=128, block_size=16)


def _median_ms(fn, iters: int = 10, warmup: int = 3) -> float:
    return statistics.median(event_seconds(fn, iters, warmup)) * 1e3


def copy_bandwidth() -> float:
    src = torch.randn(256 * 2**20, device="cuda")  # 1 GiB fp32
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src), iters=20)
    return 2 * src.numel() * 4 / (ms * 1e-3)


def matmul_flops() -> float:
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = _median_ms(lambda: torch.matmul(a, b), iters=10)
    return 2 * n**3 / (ms * 1e-3)


def _graph_time(calls, n_calls: int) -> float:
    """Seconds per call: median over replays of a graph holding n_calls calls (cycling `calls`)."""
    for c in calls:  # eager warm-up (module load, attribute set) outside capture
        c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(n_calls):
            calls[i % len(calls)]()
    ms = _median_ms(graph.replay, iters=10, warmup=2)
    return ms * 1e-3 / n_calls


def _kernel_us(calls) -> dict[str, float]:
    """Mean device time per launch of each attention kernel over 2 passes of `calls` (torch profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            for c in calls:
                c()
        torch.cuda.synchronize()
    out = {}
    for evt in prof.key_averages():
        if "paged_attention" in evt.key:
            total = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0.0)
            out[evt.key.replace("paged_attention_", "")] = total / max(1, evt.count)
    return out


def _pool(num_blocks: int):
    shape = (num_blocks, GEOM.n_kv_heads, GEOM.block_size, GEOM.head_dim)
    k = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    return k, v


def _tables(nsets: int, batch: int, pages: int, num_blocks: int):
    perm = torch.randperm(num_blocks, device="cuda").to(torch.int32)
    return [perm[s * batch * pages:(s + 1) * batch * pages].view(batch, pages).contiguous()
            for s in range(nsets)]


# Build variants compared by --ablate (bench-only kernel families: same source, other -D options).
VARIANTS = {
    "prefill Q in registers, 16-token steps": ("-DNQ_ATTN_PREFILL_QREGS=1", "-DNQ_ATTN_PREFILL_SUB=16"),
}


def with_variant(options: tuple[str, ...], fn):
    """Run fn() with the attention family rebuilt with extra compiler options."""
    name = "attention_ablate_" + str(abs(hash(options)) % 10**8)
    base = specs.SPECS["attention"]
    specs.SPECS[name] = dataclasses.replace(base, name=name, options=base.options + options)
    saved, attention.FAMILY = attention.FAMILY, name
    try:
        return fn()
    finally:
        attention.FAMILY = saved


def bench_decode(batch: int, ctx: int, l2_bytes: int, num_splits: int | None = None,
                 plan_ctx: int | None = None) -> dict:
    """Decode at context `ctx`, with a plan made for `plan_ctx` (default ctx): the engine's graphs plan
    for their context class (512, 8192, the maximum) and run shorter contexts on it."""
    kv_bytes = batch * ctx * GEOM.n_kv_heads * GEOM.head_dim * 2 * 2
    nsets = max(1, min(128, math.ceil(4 * l2_bytes / kv_bytes)))
    pages = -(-ctx // GEOM.block_size)
    k, v = _pool(nsets * batch * pages)
    tables = _tables(nsets, batch, pages, k.shape[0])
    q = torch.randn(batch, GEOM.n_heads, GEOM.head_dim, device="cuda", dtype=torch.bfloat16)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    plan_ctx = plan_ctx or ctx
    plan = plan_decode(GEOM, max_batch=batch, max_context_len=plan_ctx, num_splits=num_splits)
    if plan_ctx > ctx:  # the page tables must cover the plan's length; pages past ctx are never read
        extra = -(-plan_ctx // GEOM.block_size) - pages
        tables = [torch.cat([t, t[:, :1].expand(-1, extra)], dim=1).contiguous() for t in tables]
    calls = [lambda t=t: plan.run(q, k, v, t, lens, out=out) for t in tables]
    n_calls = max(len(calls), min(200, math.ceil(2e-3 / (kv_bytes / 4e12))))
    sec = _graph_time(calls, n_calls)
    return dict(kind="decode", batch=batch, context=ctx, plan_context=plan_ctx, splits=plan.num_splits,
                us=sec * 1e6,
                bytes=kv_bytes, tb_s=kv_bytes / sec / 1e12, kernels_us=_kernel_us(calls[:8]))


def bench_prefill(qlen: int, ctx: int, num_splits: int | None = None) -> dict:
    pages = -(-ctx // GEOM.block_size)
    k, v = _pool(pages)
    table = _tables(1, 1, pages, pages)[0]
    q = torch.randn(qlen, GEOM.n_heads, GEOM.head_dim, device="cuda", dtype=torch.bfloat16)
    lens = torch.tensor([ctx], dtype=torch.int32, device="cuda")
    qsl = torch.tensor([0, qlen], dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    plan = plan_prefill(GEOM, max_batch=1, max_query_len=qlen, max_total_q=qlen, max_context_len=ctx,
                        num_splits=num_splits)
    pairs = sum(ctx - qlen + i + 1 for i in range(qlen))
    flops = 4 * GEOM.n_heads * GEOM.head_dim * pairs
    n_calls = max(1, min(100, math.ceil(2e-3 / (flops / 3e14))))
    calls = [lambda: plan.run(q, k, v, table, lens, qsl, out=out)]
    sec = _graph_time(calls, n_calls)
    return dict(kind="prefill", query=qlen, context=ctx, splits=plan.num_splits, us=sec * 1e6,
                flops=flops, tflop_s=flops / sec / 1e12, kernels_us=_kernel_us(calls))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--ablate", action="store_true", help="also time split counts and build variants")
    ap.add_argument("--define", action="append", default=[], metavar="NAME=VALUE",
                    help="build the kernels with -DNAME=VALUE for the whole run (repeatable)")
    ap.add_argument("--decode-only", action="store_true", help="the decode rows only")
    ap.add_argument("--unsplit-max-tiles", type=int, help="plans' unsplit contexts (default: module's)")
    ap.add_argument("--fuse-max", type=int, help="plans' most splits merged in-kernel (default: module's)")
    args = ap.parse_args()
    if args.unsplit_max_tiles is not None:
        attention.UNSPLIT_MAX_TILES = args.unsplit_max_tiles
    if args.fuse_max is not None:
        attention.FUSE_MAX_SPLITS = args.fuse_max
    if args.define:
        options = tuple(f"-D{d}" for d in args.define)
        return with_variant(options, lambda: _run(args))
    return _run(args)


def _run(args) -> None:
    launch.warm_up([attention.FAMILY])
    props = torch.cuda.get_device_properties(0)
    bw, mm = copy_bandwidth(), matmul_flops()
    rows = [bench_decode(b, c, props.L2_cache_size) for b in (1, 32) for c in (1024, 8192, 32768)]
    # the engine's decode graphs: context classes 512 / 8192 / 32768 serving shorter contexts
    rows += [bench_decode(b, c, props.L2_cache_size, plan_ctx=pc)
             for b, c, pc in ((1, 128, 512), (1, 128, 8192), (1, 4096, 8192), (1, 4096, 32768),
                              (8, 128, 512), (8, 4096, 8192), (32, 128, 512))]
    if not args.decode_only:
        rows += [bench_prefill(512, 512), bench_prefill(4096, 4096), bench_prefill(512, 4096),
                 bench_prefill(256, 3584)]
    if args.ablate:
        for b, c, splits in ((1, 32768, 32), (1, 32768, 128), (1, 8192, 32), (32, 8192, 1), (32, 8192, 4)):
            rows.append(dict(bench_decode(b, c, props.L2_cache_size, splits), note="forced splits"))
        for splits in (2, 4, 8):
            rows.append(dict(bench_prefill(256, 3584, splits), note="forced splits"))
        for label, options in VARIANTS.items():
            r = with_variant(options, lambda: bench_prefill(4096, 4096))
            rows.append(dict(r, note=label))
    res = dict(device=props.name, sms=props.multi_processor_count, torch=torch.__version__,
               date=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
               defines=args.define, unsplit_max_tiles=getattr(attention, "UNSPLIT_MAX_TILES", None),
               fuse_max_splits=getattr(attention, "FUSE_MAX_SPLITS", None), copy_tb_s=bw / 1e12,
               matmul_tflop_s=mm / 1e12, rows=rows)
    print(f"{props.name}: copy {bw / 1e12:.2f} TB/s, bf16 matmul {mm / 1e12:.0f} TFLOP/s, {res['date']}")
    print("| case | splits | time (us) | achieved | of ceiling | kernels, eager (us) |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        if r["kind"] == "decode":
            name = f"decode B={r['batch']} ctx={r['context']}"
            if r.get("plan_context", r["context"]) != r["context"]:
                name += f" (plan {r['plan_context']})"
            ach, pct = f"{r['tb_s']:.2f} TB/s", 100 * r["tb_s"] * 1e12 / bw
        else:
            name = f"prefill q={r['query']} ctx={r['context']}"
            ach, pct = f"{r['tflop_s']:.0f} TFLOP/s", 100 * r["tflop_s"] * 1e12 / mm
        ks = ", ".join(f"{k} {v:.1f}" for k, v in r["kernels_us"].items())
        if r.get("note"):
            name += f" ({r['note']})"
        print(f"| {name} | {r['splits']} | {r['us']:.1f} | {ach} | {pct:.0f}% | {ks} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
