"""The batch-1 decode step measured part by part against its ceilings: where a step's time goes.

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) \
        python3 -m nanoqwen_bench.kernels.decode_ceilings --out DIR
    ... decode_ceilings.py --ncu-target --out DIR        # build the 7B decode graph, replay it once
                                                         # between cudaProfilerStart/Stop (wrap in ncu)
    ... decode_ceilings.py --gemv-target gate_up         # 3 launches of one decode GEMV (wrap in ncu)
    ... decode_ceilings.py --ncu-summary DIR             # parse the ncu outputs in DIR into the report

The default mode measures, in one process, each against the read bandwidth of the same run
(nanoqwen_bench.gpu.read_bandwidth, 4 GiB, median of 30):
1. `launch`: the cost of an empty (and a dependent) kernel in a replayed graph (ceilings/ceilings_micro.py);
2. `decode`: the engine's batch-1 decode graph on the synthetic 7B geometry: replay time (CUDA events)
   against the sum of its kernels' own durations: from a torch.profiler (CUPTI) trace of replays when
   the profiler works on the machine (the kernels' start/end in the replay: the gaps themselves), and
   from the eager CUDA-event profile (bench_profile.profile_decode_ops); ncu's per-node durations
   come from `--ncu-target` + `--ncu-summary`;
4. `streaming`: the read ceiling of bulk copies into an mbarrier ring vs plain 16-byte loads at 32-192 KB
   in flight per SM, at 4 GiB and at the GEMVs' sizes;
5. `compute`: the GEMV's dequant + mma loop over shared-memory-resident weights, in weight bytes/s:
   gemv_int4's loop (v1) and the v2 loops of ceilings/gemv_loop_v2.cuh (fewer instructions; their
   output must equal v1's bit for bit);
`sass`: instructions per tile-column of those loops (and of gemv_int4) from the cubins' SASS.
(3., the GEMVs' ncu stall reasons, is `--gemv-target` under ncu, then `--ncu-summary`.)
A failing section is recorded under "errors" in the JSON and the others still run. Writes
DIR/ceilings.json and DIR/ceilings.md after every section.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

from .ceilings import ceilings_report as CR

GEMV_SHAPES = {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)}
NCU_TARGET_JSON = "ncu_target.json"
NCU_TIMELINE_CSV = "ncu-timeline.csv"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------------
# the engine's batch-1 decode graph
# ---------------------------------------------------------------------------------------------------


def engine_config(mode: str = "graph"):
    """Batch 1 only (one graph bucket, one context class): the graph the bench replays at context 128,
    without capturing the other 60-odd graphs."""
    from nanoqwen_runtime.engine.config import EngineConfig

    return EngineConfig(
        kv_memory_bytes=2 << 30,
        max_model_len=4096,
        max_batch=1,
        graph_buckets=(1,),
        graph_context_classes=(512,),
        mode=mode,
        prefix_caching=False,
        speculation=None,
        overlap=mode == "graph",  # the eager profile times synchronous steps
    )


def decode_graph(device, context: int = 128, new: int = 16):
    """(engine, weights, geometry, graph, graph key) after a real decode at `context` tokens (so the
    graph's buffers hold that step), the synthetic Qwen2.5-Coder-7B weights (INT4 g128 symmetric, bf16
    lm_head), as `nanoqwen-cli bench` builds them."""
    import torch
    from nanoqwen_model import QWEN25_CODER_7B
    from nanoqwen_runtime.engine.engine import Engine
    from nanoqwen_runtime.engine.synthetic import random_weights

    from nanoqwen_bench.engine.bench import decode_at_context

    weights = random_weights(QWEN25_CODER_7B, device, seed=0)
    torch.cuda.synchronize()
    engine = Engine(QWEN25_CODER_7B, weights, engine_config("graph"))
    decode_at_context(engine, context, new, seed=context)
    key = (1, engine.runner.context_class(context + new - 1))
    return engine, weights, QWEN25_CODER_7B, engine.runner.graphs[key], key


def decode_section(device, read_bps: float, out_dir: Path) -> dict:
    """Replay time of the batch-1 decode graph vs the sum of its kernels (see the module docstring)."""
    import torch
    from nanoqwen_runtime.engine.engine import Engine

    from nanoqwen_bench.engine.bench import bytes_per_token
    from nanoqwen_bench.engine.bench_profile import profile_decode_ops
    from nanoqwen_bench.gpu import median_replay_seconds

    t0 = time.perf_counter()
    engine, weights, geom, graph, key = decode_graph(device)
    res: dict = {
        "graph_key": list(key),
        "engine_build_s": time.perf_counter() - t0,
        "layers": geom.num_hidden_layers,
        "graph_paths": dict(engine.runner.graph_paths[key]),
    }
    replays = [median_replay_seconds(graph, 100) for _ in range(3)]
    res["replay_us_each_of_3x100"] = [r * 1e6 for r in replays]
    res["replay_us"] = statistics.median(replays) * 1e6
    nbytes = sum(bytes_per_token(engine, 128 + 15).values())
    res["bytes_per_step"] = nbytes
    res["replay_frac_read_roofline"] = nbytes / (res["replay_us"] * 1e-6) / read_bps
    log(
        f"decode graph replay {res['replay_us']:.1f} us ({1e6 / res['replay_us']:.0f} tok/s, "
        f"{100 * res['replay_frac_read_roofline']:.1f}% of the read roofline)"
    )
    try:
        res["cupti"] = cupti_timeline(graph, geom.num_hidden_layers, out_dir)
        c = res["cupti"]
        log(
            f"CUPTI: {c['kernels_per_replay']} kernels per replay, busy {c['busy_us']:.1f} us, gaps "
            f"{c['gap_us']:.1f} us (median {c['median_gap_ns']:.0f} ns)"
        )
    except Exception as e:  # noqa: BLE001 - recorded in the report; the eager profile still runs
        res["cupti_error"] = f"{type(e).__name__}: {e}"
        log(f"CUPTI timeline unavailable: {res['cupti_error']}")
    del engine, graph
    torch.cuda.empty_cache()
    eager = Engine(geom, weights, engine_config("eager"))
    prof = profile_decode_ops(eager, steps=5)
    res["eager_profile"] = {
        k: prof[k]
        for k in (
            "kernel_us_per_step",
            "launches_per_step",
            "kernel_launches_per_step",
            "library_calls_per_step",
            "starved_chunks",
            "chunks",
            "kernels",
        )
    }
    res["replay_minus_eager_sum_us"] = res["replay_us"] - prof["kernel_us_per_step"]
    del eager, weights
    torch.cuda.empty_cache()
    return res


def cupti_timeline(graph, layers: int, out_dir: Path, replays: int = 5) -> dict:
    """torch.profiler (CUPTI) trace of `replays` replays: each replay's kernels with start and end, so
    the gaps are read, not inferred. Splits the trace into replays by kernel count."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    ks = sorted(CR.chrome_trace_kernels(trace), key=lambda k: k[1])
    if not ks or len(ks) % replays:
        raise RuntimeError(f"{len(ks)} kernel events for {replays} replays: cannot split the trace")
    per = len(ks) // replays
    reps = [CR.timeline_gaps(ks[i * per : (i + 1) * per]) for i in range(replays)]
    mid = sorted(reps, key=lambda r: r["span_ns"])[replays // 2]
    (out_dir / "raw").mkdir(parents=True, exist_ok=True)
    names = [k[0] for k in ks[:per]]
    (out_dir / "raw" / "cupti_replay.json").write_text(
        json.dumps({"kernels": [[n, s - ks[0][1], e - ks[0][1]] for n, s, e in ks[:per]]}, indent=0)
    )
    return {
        "replays": replays,
        "kernels_per_replay": per,
        "span_us": mid["span_ns"] / 1e3,
        "busy_us": mid["busy_ns"] / 1e3,
        "gap_us": mid["gap_ns"] / 1e3,
        "gap_us_per_layer": mid["gap_ns"] / 1e3 / layers,
        "median_gap_ns": mid["median_gap_ns"],
        "max_gap_ns": mid["max_gap_ns"],
        "overlaps": mid["overlaps"],
        "by_transition": dict(list(mid["by_transition"].items())[:20]),
        "kernel_names": sorted(set(CR.short_kernel_name(n) for n in names)),
    }


# ---------------------------------------------------------------------------------------------------
# ncu targets
# ---------------------------------------------------------------------------------------------------


def ncu_target(device, out_dir: Path) -> None:
    """Build the decode graph, time it (outside the profiled range), then replay it once between
    cudaProfilerStart/Stop for `ncu --profile-from-start off --graph-profiling node`."""
    import torch

    from nanoqwen_bench.gpu import median_replay_seconds

    engine, _, geom, graph, key = decode_graph(device)
    replay = median_replay_seconds(graph, 100)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    graph.replay()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / NCU_TARGET_JSON).write_text(
        json.dumps({"replay_us": replay * 1e6, "graph_key": list(key), "layers": geom.num_hidden_layers})
    )
    log(f"ncu target: decode graph {key} replayed once under the profiler; replay {replay * 1e6:.1f} us")


def gemv_target(device, shape: str, m: int, symmetric: bool, launches: int = 3) -> None:
    """`launches` launches of the decode GEMV `shape` as the engine runs it (g128, the default plan;
    `down` takes the gate_up output and fuses SiLU*mul, like ops_kernels.mlp_down), each on its own
    copy of the weights (cold in L2 even with ncu --cache-control none)."""
    import torch
    from nanoqwen_kernels import gemv as kgemv
    from nanoqwen_kernels.launch import warm_up

    from .ceilings import ceilings_micro as micro

    n, k = GEMV_SHAPES[shape]
    gen = torch.Generator(device=device)
    gen.manual_seed(1)
    ws = [micro.random_int4_weight(n, k, symmetric, gen, device) for _ in range(launches)]
    silu = shape == "down"
    x = torch.randn(m, 2 * k if silu else k, generator=gen, device=device).to(torch.bfloat16)
    out = torch.empty(m, n, dtype=torch.bfloat16, device=device)
    plan = kgemv.plan_gemv(n, k, device)
    workspace = kgemv.GemvWorkspace.allocate([plan], device)
    warm_up(["gemv"], device)
    for w in ws:
        kgemv.gemv_int4(x, w, out, None, workspace, plan, silu_mul_input=silu)
    torch.cuda.synchronize()
    log(
        f"gemv target {shape}: {launches} launches of gemv_int4_{ws[0].kernel_suffix()}"
        f"{'_silu' if silu else ''}, M={m}, plan splits={plan.splits} kc={plan.kc}"
    )


def _ncu_file(dir_: Path, name: str) -> Path:
    """DIR/name, or DIR/raw/name where run_ceilings.sh packs it (raw.tar.gz unpacked in DIR)."""
    for p in (dir_ / name, dir_ / "raw" / name):
        if p.is_file():
            return p
    raise FileNotFoundError(f"{name} is neither in {dir_} nor in {dir_ / 'raw'}")


def ncu_summary(dir_: Path) -> dict:
    """Parse ncu-timeline.csv (with ncu_target.json) and ncu-gemv-*-raw.csv in DIR (or DIR/raw); merge into
    DIR/ceilings.json if it exists; write DIR/ncu-summary.{json,md}. A missing or unparsable file is
    recorded as an error for its part."""
    out: dict = {"errors": {}}
    try:
        kernels = CR.parse_ncu_csv(_ncu_file(dir_, NCU_TIMELINE_CSV).read_text())
        target = json.loads(_ncu_file(dir_, NCU_TARGET_JSON).read_text())
        durs = [k["metrics"]["gpu__time_duration.sum"] for k in kernels]
        by_kernel: dict[str, list[float]] = {}
        for k, d in zip(kernels, durs, strict=True):
            by_kernel.setdefault(CR.short_kernel_name(k["kernel"]), []).append(d)
        total = sum(durs) / 1e3
        out["timeline"] = {
            "kernels": len(kernels),
            "sum_kernel_us": total,
            "replay_us": target["replay_us"],
            "gap_us": target["replay_us"] - total,
            "gap_us_per_layer": (target["replay_us"] - total) / target["layers"],
            "gap_us_per_kernel": (target["replay_us"] - total) / len(kernels),
            "by_kernel": {
                n: {"launches": len(v), "us": sum(v) / 1e3}
                for n, v in sorted(by_kernel.items(), key=lambda kv: -sum(kv[1]))
            },
        }
    except (OSError, ValueError, KeyError) as e:
        out["errors"]["timeline"] = f"{type(e).__name__}: {e}"
    out["gemv"] = {}
    for shape in GEMV_SHAPES:
        try:
            rows = CR.parse_ncu_raw_csv(_ncu_file(dir_, f"ncu-gemv-{shape}-raw.csv").read_text())
            row = rows[-1]
            pick = {
                "duration_us": ("gpu__time_duration.sum", 1e-3),
                "dram_pct": ("dram__throughput.avg.pct_of_peak_sustained_elapsed", 1.0),
                "sm_pct": ("sm__throughput.avg.pct_of_peak_sustained_elapsed", 1.0),
                "achieved_occupancy_pct": ("sm__warps_active.avg.pct_of_peak_sustained_active", 1.0),
                "warp_cycles_per_issue": ("smsp__average_warp_latency_per_inst_issued.ratio", 1.0),
                "registers": ("launch__registers_per_thread", 1.0),
            }
            d = {k: (row[m] * f if isinstance(row.get(m), float) else None) for k, (m, f) in pick.items()}
            d["kernel"] = row.get("Kernel Name")
            try:
                d["stalls"] = [[r, v, s] for r, v, s in CR.stall_breakdown(row)]
            except ValueError as e:  # the other figures stand; the missing breakdown is named
                d["stalls"] = []
                out["errors"][f"gemv_{shape}_stalls"] = str(e)
            out["gemv"][shape] = d
        except (OSError, ValueError) as e:
            out["errors"][f"gemv_{shape}"] = f"{type(e).__name__}: {e}"
    (dir_ / "ncu-summary.json").write_text(json.dumps(out, indent=1))
    (dir_ / "ncu-summary.md").write_text(ncu_markdown(out))
    main_json = dir_ / "ceilings.json"
    if main_json.is_file():
        raw = json.loads(main_json.read_text())
        raw["ncu"] = out
        main_json.write_text(json.dumps(raw, indent=1))
        (dir_ / "ceilings.md").write_text(build_markdown(raw))
    return out


# ---------------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------------


def ncu_markdown(n: dict) -> str:
    md = ["## ncu\n"]
    t = n.get("timeline")
    if t:
        md.append(
            f"Decode graph under `ncu --graph-profiling node`: {t['kernels']} kernels, sum of their "
            f"durations {t['sum_kernel_us']:.1f} us; replay (same process, CUDA events) "
            f"{t['replay_us']:.1f} us; gaps = replay - sum = {t['gap_us']:.1f} us "
            f"({t['gap_us_per_layer']:.2f} us per layer, {t['gap_us_per_kernel']:.2f} us per kernel).\n"
        )
        md.append(
            CR.md_table(
                ["kernel", "launches", "us"], [[k, v["launches"], v["us"]] for k, v in t["by_kernel"].items()]
            )
        )
    rows = []
    for shape, d in n.get("gemv", {}).items():
        top = ", ".join(f"{r} {v:.1f} ({100 * s:.0f}%)" for r, v, s in d["stalls"][:4])
        rows.append(
            [
                shape,
                d["duration_us"],
                d["dram_pct"],
                d["sm_pct"],
                d["achieved_occupancy_pct"],
                d["warp_cycles_per_issue"],
                d["registers"],
                top,
            ]
        )
    if rows:
        md.append("\nGEMV stall reasons (cycles per issued instruction; share of all stall cycles):\n\n")
        md.append(
            CR.md_table(
                ["GEMV", "us", "DRAM %", "SM %", "occupancy %", "cycles/issue", "regs", "top stalls"], rows
            )
        )
    for k, v in n.get("errors", {}).items():
        md.append(f"\n- ncu {k}: {v}\n")
    return "".join(md)


def build_markdown(raw: dict) -> str:
    """ceilings.md from the raw numbers (every section optional)."""
    meta = raw["meta"]
    rb = raw.get("read_bandwidth")
    rbs = f"{rb['bytes_per_s'] / 1e9:.0f} GB/s" if rb else "not measured"
    md = [
        f"# Decode ceilings\n\n{meta['device']}, {meta['date']}, torch {meta['torch']}. "
        f"Command: `{meta['command']}`. Read bandwidth (4 GiB, median of 30): {rbs}.\n\n"
    ]
    if "launch" in raw:
        lc = raw["launch"]
        md.append("## 1. Launch cost in a replayed graph (us per kernel)\n\n")
        md.append(
            CR.md_table(
                ["kernels", "N=1", "N=32", "N=256", "marginal (256 vs 32)"],
                [
                    [
                        r["kind"],
                        r["per_kernel_us"]["1"],
                        r["per_kernel_us"]["32"],
                        r["per_kernel_us"]["256"],
                        r["marginal_us"],
                    ]
                    for r in lc["rows"]
                ],
            )
        )
        md.append("\n%globaltimer timeline of 64 kernels in one graph (medians):\n\n")
        md.append(
            CR.md_table(
                ["grid", "gap end->start ns", "pitch ns", "kernel ns", "timer step ns"],
                [
                    [g, v["median_gap_ns"], v["median_pitch_ns"], v["median_duration_ns"], v["timer_step_ns"]]
                    for g, v in lc["timeline"].items()
                ],
            )
        )
    if "decode" in raw:
        d = raw["decode"]
        md.append(
            f"\n## 2. Batch-1 decode graph (synthetic 7B, context 128)\n\nReplay {d['replay_us']:.1f} us "
            f"= {1e6 / d['replay_us']:.0f} tok/s = {100 * d['replay_frac_read_roofline']:.1f}% of the read "
            f"roofline ({d['bytes_per_step'] / 1e9:.3f} GB per step).\n"
        )
        c = d.get("cupti")
        if c:
            md.append(
                f"CUPTI trace of the replay: {c['kernels_per_replay']} kernels, span {c['span_us']:.1f} us, "
                f"kernels busy {c['busy_us']:.1f} us, gaps {c['gap_us']:.1f} us "
                f"({c['gap_us_per_layer']:.2f} us per layer; median gap {c['median_gap_ns']:.0f} ns, "
                f"max {c['max_gap_ns']:.0f} ns, {c['overlaps']} overlaps).\n\n"
            )
            md.append(
                CR.md_table(
                    ["transition", "n", "total us", "median ns"],
                    [
                        [k, v["n"], v["total_ns"] / 1e3, v["median_ns"]]
                        for k, v in list(c["by_transition"].items())[:12]
                    ],
                )
            )
        else:
            md.append(f"CUPTI trace: {d.get('cupti_error', 'not taken')}.\n")
        e = d.get("eager_profile")
        if e:
            md.append(
                f"\nEager CUDA-event profile: {e['launches_per_step']} launches per step, kernels "
                f"{e['kernel_us_per_step']:.1f} us; replay - that sum = "
                f"{d['replay_minus_eager_sum_us']:.1f} us "
                f"({e['starved_chunks']} of {e['chunks']} chunks starved).\n"
            )
    if "streaming" in raw:
        s = raw["streaming"]
        md.append(
            "\n## 4. Streaming-read ceiling\n\nGB/s on 4 GiB, and per GEMV size the fraction of that "
            "config's 4 GiB rate (time per read from a graph of reads of rotating windows: includes "
            "the graph's per-kernel gap).\n\n"
        )
        labels = list(s["sizes"]) + ["1GiB"]
        rows = []
        for r in s["rows"]:
            if "error" in r:
                rows.append([r["name"], r["in_flight_kb"], r["error"], None] + [None] * len(labels))
                continue
            rows.append(
                [r["name"], r["in_flight_kb"], r["big_GBps"], r["big_frac_read_bw"]]
                + [r["sizes"][lab]["frac_of_big"] for lab in labels]
            )
        md.append(CR.md_table(["config", "KB/SM", "GB/s 4GiB", "of read BW"] + labels, rows))
        best = max((r for r in s["rows"] if "big_GBps" in r), key=lambda r: r["big_GBps"], default=None)
        if best:
            md.append(
                f"\nBest at 4 GiB: {best['name']}, {best['big_GBps']:.0f} GB/s. Its us per read: "
                + ", ".join(f"{lab} {best['sizes'][lab]['us']:.1f}" for lab in labels)
                + ".\n"
            )
    if "compute" in raw:
        c = raw["compute"]
        md.append("\n## 5. GEMV compute ceiling (dequant + mma on resident weights)\n\n")
        md.append(
            CR.md_table(
                ["kernel", "M", "blocks/SM", "regs", "weight GB/s", "x read BW", "x v1", "wall?"],
                [
                    [
                        r["kernel"],
                        r["m"],
                        r["occupancy_blocks_per_sm"],
                        r["registers"],
                        r["weight_bytes_per_s"] / 1e9,
                        r["over_read_bw"],
                        r.get("over_v1"),
                        "dequant is the wall" if r["dequant_is_the_wall"] else "no",
                    ]
                    if "error" not in r
                    else [
                        r["kernel"],
                        r["m"],
                        r["occupancy_blocks_per_sm"],
                        r["registers"],
                        None,
                        None,
                        None,
                        f"CHECK FAILED: {r['error']}",
                    ]
                    for r in c["rows"]
                ],
            )
        )
        if any(r["kernel"].endswith(("_v2", "_v2u1")) and "error" not in r for r in c["rows"]):
            md.append(
                "\nThe v2 rows passed the bitwise check: their fp32 outputs equal v1's at every M = 1..8 "
                "(ceilings/gemv_loop_v2.cuh says why they must).\n"
            )
    if "sass" in raw:
        md.append(
            "\n## SASS of the GEMV loop (instructions per warp per tile-column = 1024 B of weights)\n\n"
        )
        md.append(
            CR.md_table(
                ["kernel", "instr / tile-column", "top opcodes"],
                [
                    [k, v["per_tile_column"], v["top"]] if "error" not in v else [k, None, v["error"]]
                    for k, v in raw["sass"].items()
                ],
            )
        )
    if "ncu" in raw:
        md.append("\n" + ncu_markdown(raw["ncu"]))
    for k, v in raw.get("errors", {}).items():
        md.append(f"\n- section {k} FAILED: {v}\n")
    return "".join(md)


class Run:
    """The raw numbers, the sections that fill them, the report rewritten after each."""

    def __init__(self, out_dir: Path, raw: dict):
        self.out_dir, self.raw = out_dir, raw

    def section(self, key: str, fn, *args, **kw):
        t0 = time.perf_counter()
        try:
            res = fn(*args, **kw)
            self.raw[key] = res
            return res
        except Exception as e:  # noqa: BLE001 - recorded in the report, never hidden
            self.raw.setdefault("errors", {})[key] = f"{type(e).__name__}: {e}"
            log(f"SECTION {key} FAILED: {type(e).__name__}: {e}\n{traceback.format_exc()}")
            return None
        finally:
            self.raw.setdefault("section_s", {})[key] = time.perf_counter() - t0
            self.save()

    def save(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / "ceilings.json").write_text(json.dumps(self.raw, indent=1, default=str))
        (self.out_dir / "ceilings.md").write_text(build_markdown(self.raw))


def sass_section(cubins: dict[str, Path]) -> dict:
    """Instruction counts of the GEMV loops from the cubins (nvdisasm on PATH or in /usr/local/cuda/bin).
    Each cubin is disassembled once; a kernel whose cubin nvdisasm refuses (a device's nvdisasm older than
    the package's cubin) gets {"error": ...} with nvdisasm's message, the others still count.
    Raises only when no kernel could be counted."""
    import shutil
    import subprocess

    # nvdisasm, not cuobjdump: its branch targets are labels, which the loop finder follows
    tool = shutil.which("nvdisasm") or next(
        (p for p in ("/usr/local/cuda/bin/nvdisasm",) if Path(p).is_file()), None
    )
    if tool is None:
        raise RuntimeError("nvdisasm not found (PATH, /usr/local/cuda/bin): no SASS counts")
    texts: dict[Path, str | Exception] = {}
    out = {}
    for kernel, cubin in cubins.items():
        if cubin not in texts:
            r = subprocess.run([tool, "-c", str(cubin)], capture_output=True, text=True)
            texts[cubin] = (
                r.stdout
                if r.returncode == 0
                else RuntimeError(f"nvdisasm -c {cubin.name}: exit {r.returncode}: {r.stderr.strip()[:300]}")
            )
        text = texts[cubin]
        try:
            if isinstance(text, Exception):
                raise text
            counts, hmma = CR.hot_loop_counts(CR.parse_sass(text)[kernel])
        except (RuntimeError, ValueError, KeyError) as e:
            out[kernel] = {"error": f"{type(e).__name__}: {e}"}
            continue
        cols = hmma / 8  # 8 HMMA per warp per tile-column (4 words x 2 mma.m16n8k16)
        out[kernel] = {
            "per_tile_column": sum(counts.values()) / cols,
            "hmma": hmma,
            "counts": dict(counts.most_common()),
            "top": ", ".join(f"{op} {n / cols:g}" for op, n in counts.most_common(6)),
        }
    if all("error" in v for v in out.values()):
        raise RuntimeError("; ".join(f"{k}: {v['error']}" for k, v in out.items()))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("bench/out/ceilings"))
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument(
        "--ncu-target",
        action="store_true",
        help="build the decode graph, replay it once "
        "between cudaProfilerStart/Stop (run under ncu --profile-from-start off)",
    )
    mode.add_argument("--gemv-target", choices=sorted(GEMV_SHAPES), help="launch one decode GEMV 3 times")
    mode.add_argument("--ncu-summary", type=Path, metavar="DIR", help="parse the ncu outputs in DIR")
    ap.add_argument("--m", type=int, default=1, help="rows for --gemv-target (1..8)")
    ap.add_argument(
        "--asym",
        action="store_true",
        help="--gemv-target with zero points (the engine's synthetic 7B is symmetric)",
    )
    ap.add_argument(
        "--only",
        default="launch,streaming,compute,sass,decode",
        help="comma-separated sections of the default mode",
    )
    args = ap.parse_args(argv)
    if args.ncu_summary:
        s = ncu_summary(args.ncu_summary)
        print(ncu_markdown(s))
        return 1 if s["errors"] else 0

    import torch

    device = torch.device("cuda")
    if args.ncu_target:
        ncu_target(device, args.out)
        return 0
    if args.gemv_target:
        gemv_target(device, args.gemv_target, args.m, not args.asym)
        return 0

    from nanoqwen_kernels import build
    from nanoqwen_kernels.specs import SPECS

    from ..gpu import read_bandwidth
    from .ceilings import ceilings_micro as micro

    only = set(args.only.split(","))
    raw = {
        "meta": {
            "command": "python3 -m nanoqwen_bench.kernels.decode_ceilings " + " ".join(argv or sys.argv[1:]),
            "device": torch.cuda.get_device_name(device),
            "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "sms": torch.cuda.get_device_properties(device).multi_processor_count,
        }
    }
    run = Run(args.out, raw)
    rb = run.section("read_bandwidth", read_bandwidth, device)
    if not rb:
        log("no read bandwidth: every other number is a ratio to it, stopping")
        return 1
    read_bps = rb["bytes_per_s"]
    log(f"read bandwidth {read_bps / 1e9:.0f} GB/s")
    k = run.section("kernels_build", micro.CeilingKernels, device)
    if k is None:
        only -= {"launch", "streaming", "compute", "sass"}
    else:
        raw["kernels_build"] = {"cubin": str(k.cubin)}
    if "launch" in only and run.section("launch", micro.launch_cost, k, device):
        for r in raw["launch"]["rows"]:
            log(
                f"launch {r['kind']}: {r['per_kernel_us']['256']:.2f} us/kernel at N=256, marginal "
                f"{r['marginal_us']:.2f}"
            )
    if "streaming" in only and run.section("streaming", micro.streaming, k, device, read_bps):
        for r in raw["streaming"]["rows"]:
            if "big_GBps" in r:
                log(
                    f"stream {r['name']:24s} {r['in_flight_kb']:4d} KB/SM: {r['big_GBps']:6.0f} GB/s "
                    f"({100 * r['big_frac_read_bw']:.0f}%), 8 MB read {r['sizes']['qkv']['us']:.1f} us"
                )
    if "compute" in only and run.section("compute", micro.compute_ceiling, k, device, read_bps):
        for r in raw["compute"]["rows"]:
            if "error" in r:
                log(f"compute {r['kernel']} M={r['m']}: CHECK FAILED, no rate: {r['error']}")
                continue
            log(
                f"compute {r['kernel']} M={r['m']}: {r['weight_bytes_per_s'] / 1e9:.0f} GB/s of weights = "
                f"{r['over_read_bw']:.2f}x the read bandwidth"
                + (f", {r['over_v1']:.2f}x v1" if "over_v1" in r else "")
            )
    if "sass" in only:

        def cubins():
            gemv_cubin = build.cached_cubin(SPECS["gemv"])
            return sass_section(
                {
                    "gemv_int4_g128_sym": gemv_cubin,
                    "gemv_int4_g128_sym_silu": gemv_cubin,
                    "gemv_compute_g128_sym": k.cubin,
                    "gemv_compute_g128_asym": k.cubin,
                    "gemv_compute_g128_sym_v2": k.cubin,
                    "gemv_compute_g128_asym_v2": k.cubin,
                    "gemv_compute_g128_sym_v2u1": k.cubin,
                    "gemv_compute_g128_asym_v2u1": k.cubin,
                }
            )

        run.section("sass", cubins)
    if "decode" in only:
        run.section("decode", decode_section, device, read_bps, args.out)
    log(f"wrote {args.out}/ceilings.json and ceilings.md")
    return 1 if raw.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
