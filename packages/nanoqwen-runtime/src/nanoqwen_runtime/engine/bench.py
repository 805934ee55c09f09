"""The engine benchmark behind `nanoqwen-cli bench` (and `nox -s bench`): end-to-end numbers on one GPU.

Everything is measured in one run, on one model (synthetic Qwen2.5-Coder-7B geometry built on the
GPU, or a given .nanoqwen file):

- copy bandwidth: a 2 GiB device-to-device copy, bytes read + written over the median time; the
  roofline of every decode number below is this bandwidth over the bytes one step must move;
- decode tok/s at batch 1 for contexts 128 / 4K / 32K (graph mode), with the GPU time of the graph
  replay alone (CUDA events) beside the engine's wall time (which adds the host: scheduling, step
  inputs, the token read-back);
- aggregate decode tok/s at batch 8 / 32 / 64 (context 128 + generated);
- prefill tok/s for 512- and 4096-token prompts; time to first token for a 2K prompt;
- graph versus eager at batch 1 and 8;
- bytes per decoded token at batch 1: INT4 words, scales, lm_head, norms/bias/embedding row, KV,
  and the fraction of the copy bandwidth achieved;
- kernels per decode step and the time of each, from the torch profiler on eager steps (each
  kernel's bytes over its time gives its bandwidth; the sum against the graph's time gives the gaps).

Results: a JSON document, a markdown table and two plots (tok/s vs batch, tok/s vs context).
"""

from __future__ import annotations

import datetime
import json
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from ..sampling import SamplingParams
from .config import QWEN25_7B, EngineConfig, ModelGeometry
from .engine import Engine, FinishEvent, TokenEvent
from .scheduler import Request

Log = Callable[[str], None]


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30, reps: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write), median of `reps`."""
    a = torch.empty(nbytes // 2, dtype=torch.int16, device=device).random_()
    b = torch.empty_like(a)
    times = []
    for _ in range(3):
        b.copy_(a)
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    del a, b
    return 2 * nbytes / statistics.median(times)


def _prompt(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, min(vocab, 150000), (n,), generator=g).tolist()


def _run(engine: Engine, requests: list[Request]) -> tuple[dict[str, FinishEvent], list[tuple]]:
    """Run to completion with a step log: (kind, rows, seconds) per step."""
    log = []
    fins = {}
    for r in requests:
        ev = engine.submit(r)
        if ev is not None:
            raise RuntimeError(f"bench request refused: {ev.detail}")
    while engine.has_work:
        kinds = engine.num_steps.copy()
        t0 = time.perf_counter()
        evs = engine.step()
        dt = time.perf_counter() - t0
        kind = "decode" if engine.num_steps["decode"] > kinds["decode"] else "prefill"
        rows = sum(1 for e in evs if isinstance(e, TokenEvent))
        log.append((kind, rows, dt))
        for e in evs:
            if isinstance(e, FinishEvent):
                fins[e.request_id] = e
    return fins, log


def _decode_rate(log, skip: int = 3) -> float:
    """Generated tokens per second over the decode steps (the first `skip` left out as warm-up)."""
    steps = [(r, dt) for k, r, dt in log if k == "decode"][skip:]
    return sum(r for r, _ in steps) / sum(dt for _, dt in steps)


def replay_time(engine: Engine, bucket: int, context: int, reps: int = 50) -> float:
    """Median GPU time (s) of one replay of the decode graph of `bucket` at `context` tokens, with the
    step buffers as the last step left them."""
    g = engine.runner.graphs[(bucket, engine.runner.context_class(context))]
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return statistics.median(times)


def decode_at_context(engine: Engine, ctx: int, new: int, batch: int = 1, seed: int = 0) -> dict:
    """Prefill `batch` prompts of `ctx` tokens, decode `new` tokens each; rates and replay time."""
    vocab = engine.geom.vocab_size
    reqs = [Request(_prompt(ctx, vocab, seed + i), SamplingParams(max_tokens=new), f"c{ctx}b{batch}-{i}",
                    ignore_eos=True) for i in range(batch)]
    # stop one token early to time the graph replay with the buffers of a real step at this context
    fins, log = _run(engine, reqs)
    out = {"context": ctx, "batch": batch, "new_tokens": new, "engine_tok_s": _decode_rate(log),
           "prefill_s": sum(dt for k, _, dt in log if k == "prefill"),
           "ttft_s": statistics.median(f.ttft_s for f in fins.values())}
    if engine.config.mode == "graph":
        bucket = engine.config.bucket_for(batch)
        out["graph_replay_s"] = replay_time(engine, bucket, ctx + new - 1)
        out["context_class"] = engine.runner.context_class(ctx + new - 1)
        out["graph_tok_s"] = batch / out["graph_replay_s"]
    return out


def prefill_rate(engine: Engine, n: int, seed: int = 7) -> dict:
    fins, log = _run(engine, [Request(_prompt(n, engine.geom.vocab_size, seed), SamplingParams(max_tokens=1),
                                      f"p{n}", ignore_eos=True)])
    t = sum(dt for k, _, dt in log if k == "prefill")
    return {"prompt": n, "prefill_s": t, "prefill_tok_s": n / t, "ttft_s": fins[f"p{n}"].ttft_s}


def bytes_per_token(engine: Engine, ctx: int) -> dict:
    w = engine.weights.decode_bytes()
    w["kv"] = ctx * engine.geom.kv_bytes_per_token()
    w["logits_and_activations"] = engine.geom.vocab_size * 2 * 2  # logits written + read by the sampler
    w["total"] = sum(v for k, v in w.items() if k != "total")
    return w


def profile_decode_kernels(engine: Engine, steps: int = 5) -> dict:
    """Kernel names, counts and total GPU time per decode step (eager batch-1 steps, torch profiler)."""
    from torch.profiler import ProfilerActivity, profile

    vocab = engine.geom.vocab_size
    engine.submit(Request(_prompt(128, vocab, 3), SamplingParams(max_tokens=steps + 3), "prof",
                          ignore_eos=True))
    while engine.has_work and engine.num_steps["decode"] == 0:
        engine.step()
    engine.step()  # one decode step warm
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        n = 0
        while engine.has_work and n < steps:
            engine.step()
            n += 1
        torch.cuda.synchronize()
    while engine.has_work:
        engine.step()
    per = {}
    for ev in prof.key_averages():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue  # CPU-side ops would count their kernels twice
        t = getattr(ev, "device_time_total", None)
        if t is None:
            t = ev.cuda_time_total
        per[ev.key] = {"count_per_step": ev.count / n, "us_per_step": t / n}
    total_us = sum(v["us_per_step"] for v in per.values())
    launches = sum(v["count_per_step"] for v in per.values())
    return {"steps": n, "kernels_per_step": launches, "kernel_us_per_step": total_us,
            "per_kernel": dict(sorted(per.items(), key=lambda kv: -kv[1]["us_per_step"]))}


def pdl_ab(geom: ModelGeometry, weights, batches=(1, 8), rounds: int = 3) -> dict:
    """Decode graph replay with programmatic dependent launch on and off, same weights, same run:
    two engines of the same config but `pdl`, measured alternately (`rounds` times, best of each)."""
    cfg = dict(kv_memory_bytes=4 << 30, max_model_len=4096, dense_weight_cache=False)
    engines = {pdl: Engine(geom, weights, EngineConfig(pdl=pdl, **cfg)) for pdl in (True, False)}
    rows = []
    for b in batches:
        best = {True: 0.0, False: 0.0}
        for r in range(rounds):
            for pdl, eng in engines.items():
                res = decode_at_context(eng, 128, 32, batch=b, seed=300 + 10 * r)
                best[pdl] = max(best[pdl], res["graph_tok_s"])
        rows.append({"batch": b, "context": 128, "graph_tok_s_pdl": best[True],
                     "graph_tok_s_plain": best[False], "speedup": best[True] / best[False]})
    del engines
    torch.cuda.empty_cache()
    return {"rows": rows, "rounds": rounds}


def load_time(geometry: ModelGeometry, folder: Path) -> dict:
    """Write a synthetic container of `geometry`, then time `loader.load` to the GPU (page cache warm:
    the file was just written) with and without the checksum pass. The file is removed afterwards."""
    from .loader import load
    from .synthetic import write_container

    path = folder / "synthetic-bench.nanoqwen"
    t0 = time.perf_counter()
    write_container(path, geometry, seed=1, device="cuda")
    write_s = time.perf_counter() - t0
    try:
        out = {"file_bytes": path.stat().st_size, "write_s": write_s}
        for verify in (False, True):
            torch.cuda.synchronize()
            m = load(path, "cuda", verify=verify)
            torch.cuda.synchronize()
            key = "verify" if verify else "plain"
            out[key] = asdict(m.stats) | {"upload_GBps": m.stats.gbps}
            del m
            torch.cuda.empty_cache()
        return out
    finally:
        path.unlink(missing_ok=True)


def _section(res: dict, key: str, log: Log, fn, *args, **kw):
    """Run one benchmark section; a failure is recorded in the results (and logged), not hidden,
    and does not stop the other sections. The results so far are saved after every section, so a
    run cut short still leaves its numbers."""
    try:
        res[key] = fn(*args, **kw)
        return res[key]
    except Exception as e:  # noqa: BLE001 - reported in the output, never swallowed
        import traceback

        res.setdefault("errors", {})[key] = f"{type(e).__name__}: {e}"
        log(f"SECTION {key} FAILED: {type(e).__name__}: {e}\n{traceback.format_exc()}")
        return None
    finally:
        out_dir = res.get("_out_dir")
        if out_dir is not None:
            (Path(out_dir) / "bench.json").write_text(json.dumps(res, indent=1, default=str))


def run_bench(*, model: str | None, out_dir: Path, log: Log = print, quick: bool = False,
              kv_memory: int = 24 << 30, geometry: ModelGeometry = QWEN25_7B,
              load_test_dir: Path | None = None) -> dict:
    """Run everything; write bench.json, bench.md and plots into `out_dir`; return the results."""
    from .synthetic import random_weights

    device = torch.device("cuda")
    out_dir.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    res: dict = {"command": "nanoqwen-cli bench" + (f" --model {model}" if model else ""),
                 "device": torch.cuda.get_device_name(device), "date": now, "torch": torch.__version__,
                 "python": platform.python_version(), "_out_dir": str(out_dir)}
    bw = copy_bandwidth(device)
    res["copy_bandwidth_GBps"] = bw / 1e9
    log(f"copy bandwidth {bw / 1e9:.0f} GB/s")
    cfg = EngineConfig(kv_memory_bytes=kv_memory, max_model_len=None if not quick else 8192)
    t0 = time.perf_counter()
    if model:
        engine = Engine.from_file(model, cfg)
        res["load"] = asdict(engine.load_stats)
        res["model"] = model
    else:
        weights = random_weights(geometry, device, seed=0)
        torch.cuda.synchronize()
        res["model"] = "synthetic Qwen2.5-Coder-7B geometry (random INT4 g128 weights, bf16 lm_head)"
        engine = Engine(geometry, weights, cfg)
    res["engine_start_s"] = time.perf_counter() - t0
    res["num_kv_blocks"] = engine.num_blocks
    log(f"engine ready in {res['engine_start_s']:.1f}s ({engine.num_blocks} KV blocks)")

    # "32K": the model's 32768-token limit holds the prompt and the 64 decoded tokens
    contexts = [128, 4096, 32768 - 128] if not quick else [128, 4096]
    res["decode_batch1"] = []
    for ctx in contexts:
        r = _section(res, f"decode_ctx{ctx}", log, decode_at_context, engine, ctx, 64 if ctx > 4096 else 128)
        if r is None:
            continue
        del res[f"decode_ctx{ctx}"]
        b = bytes_per_token(engine, ctx)
        r["bytes_per_token"] = b
        r["roofline_tok_s"] = bw / b["total"]
        r["fraction_of_roofline"] = r["graph_tok_s"] / r["roofline_tok_s"]
        r["fraction_of_roofline_engine"] = r["engine_tok_s"] / r["roofline_tok_s"]
        res["decode_batch1"].append(r)
        log(f"batch 1 ctx {ctx}: graph {r['graph_tok_s']:.0f} tok/s, engine {r['engine_tok_s']:.0f} tok/s, "
            f"roofline {r['roofline_tok_s']:.0f} ({100 * r['fraction_of_roofline']:.0f}%)")
    res["decode_batched"] = []
    for batch in (1, 8, 32, 64):
        r = _section(res, f"batch{batch}", log, decode_at_context, engine, 128, 128, batch=batch, seed=100)
        if r is None:
            continue
        del res[f"batch{batch}"]
        res["decode_batched"].append(r)
        log(f"batch {batch}: engine {r['engine_tok_s']:.0f} tok/s aggregate, graph {r['graph_tok_s']:.0f}")
    res["prefill"] = []
    for n in (512, 4096):
        r = _section(res, f"prefill{n}", log, prefill_rate, engine, n)
        if r is not None:
            del res[f"prefill{n}"]
            res["prefill"].append(r)
            log(f"prefill {r['prompt']}: {r['prefill_tok_s']:.0f} tok/s")
    if _section(res, "ttft_2k", log, prefill_rate, engine, 2048, seed=11):
        log(f"TTFT 2K prompt: {1e3 * res['ttft_2k']['ttft_s']:.1f} ms")
    res["kv_blocks_used_after"] = engine.kv_blocks_used()
    weights_ref, geom = engine.weights, engine.geom
    del engine
    torch.cuda.empty_cache()
    if _section(res, "pdl_ab", log, pdl_ab, geom, weights_ref):
        for r in res["pdl_ab"]["rows"]:
            log(f"PDL A/B batch {r['batch']}: graph {r['graph_tok_s_pdl']:.0f} tok/s with PDL, "
                f"{r['graph_tok_s_plain']:.0f} without ({r['speedup']:.3f}x)")
    eager = Engine(geom, weights_ref, EngineConfig(kv_memory_bytes=4 << 30, max_model_len=4096, mode="eager"))
    res["eager"] = []
    for b in (1, 8):
        r = _section(res, f"eager{b}", log, decode_at_context, eager, 128, 32, batch=b, seed=200)
        if r is not None:
            del res[f"eager{b}"]
            res["eager"].append(r)
            log(f"eager batch {r['batch']}: {r['engine_tok_s']:.1f} tok/s")
    if _section(res, "profile", log, profile_decode_kernels, eager):
        log(f"kernels per decode step: {res['profile']['kernels_per_step']:.0f}, "
            f"kernel time {res['profile']['kernel_us_per_step']:.0f} us")
    del eager, weights_ref
    torch.cuda.empty_cache()
    if load_test_dir is not None and _section(res, "load", log, load_time, geometry, load_test_dir):
        ld = res["load"]
        plain, ver = ld["plain"], ld["verify"]
        log(f"load {ld['file_bytes'] / 1e9:.2f} GB: {plain['total_seconds']:.2f} s "
            f"({plain['upload_GBps']:.1f} GB/s upload), with --verify {ver['total_seconds']:.2f} s")
    res.pop("_out_dir", None)
    write_report(res, out_dir)
    return res


def markdown(res: dict) -> str:
    """The results as markdown tables (sections that failed are listed under Errors)."""
    lines = ["# nanoqwen engine benchmark", "",
             f"- command: `{res['command']}`", f"- device: {res['device']}", f"- date: {res['date']}",
             f"- model: {res.get('model', '?')}", f"- torch {res['torch']}, Python {res['python']}",
             f"- copy bandwidth (read + write): {res['copy_bandwidth_GBps']:.0f} GB/s", ""]
    lines += ["## Decode, batch 1 (CUDA graph)", "",
              "| context | graph tok/s | engine tok/s | bytes/token (GB) | roofline tok/s "
              "| graph % of roofline | engine % |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in res.get("decode_batch1", []):
        lines.append(f"| {r['context']} | {r['graph_tok_s']:.0f} | {r['engine_tok_s']:.0f} | "
                     f"{r['bytes_per_token']['total'] / 1e9:.3f} | {r['roofline_tok_s']:.0f} | "
                     f"{100 * r['fraction_of_roofline']:.1f}% | "
                     f"{100 * r['fraction_of_roofline_engine']:.1f}% |")
    if res.get("decode_batch1"):
        b = res["decode_batch1"][0]["bytes_per_token"]
        parts = ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in b.items())
        lines += ["", f"Bytes per token at context {res['decode_batch1'][0]['context']}: {parts}"]
    lines += ["", "## Decode, aggregate (context 128 + 128 generated)", "",
              "| batch | engine tok/s | graph-replay tok/s |", "| --- | --- | --- |"]
    for r in res.get("decode_batched", []):
        lines.append(f"| {r['batch']} | {r['engine_tok_s']:.0f} | {r.get('graph_tok_s', float('nan')):.0f} |")
    lines += ["", "## Prefill", "", "| prompt | tok/s | time (ms) |", "| --- | --- | --- |"]
    for r in res.get("prefill", []):
        lines.append(f"| {r['prompt']} | {r['prefill_tok_s']:.0f} | {1e3 * r['prefill_s']:.1f} |")
    if "ttft_2k" in res:
        lines += ["", f"Time to first token, 2048-token prompt: {1e3 * res['ttft_2k']['ttft_s']:.1f} ms"]
    if res.get("pdl_ab"):
        lines += ["", "## Programmatic dependent launch A/B (decode graph replay, context 128, same run)", "",
                  "| batch | with PDL tok/s | without tok/s | speedup |", "| --- | --- | --- | --- |"]
        for r in res["pdl_ab"]["rows"]:
            lines.append(f"| {r['batch']} | {r['graph_tok_s_pdl']:.0f} | {r['graph_tok_s_plain']:.0f} | "
                         f"{r['speedup']:.3f}x |")
    lines += ["", "## Graph vs eager (context 128)", "", "| batch | graph tok/s | eager tok/s |",
              "| --- | --- | --- |"]
    graph = {r["batch"]: r for r in res.get("decode_batched", [])}
    for r in res.get("eager", []):
        g = graph.get(r["batch"], {}).get("engine_tok_s", float("nan"))
        lines.append(f"| {r['batch']} | {g:.0f} | {r['engine_tok_s']:.1f} |")
    p = res.get("profile")
    if p:
        lines += ["", f"## Kernels per decode step (eager, batch 1): {p['kernels_per_step']:.0f} launches, "
                  f"{p['kernel_us_per_step']:.0f} us of kernel time", "", "| kernel | per step | us/step |",
                  "| --- | --- | --- |"]
        for k, v in list(p["per_kernel"].items())[:25]:
            lines.append(f"| `{k[:80]}` | {v['count_per_step']:.1f} | {v['us_per_step']:.1f} |")
    if res.get("load"):
        ld = res["load"]
        lines += ["", "## Loading (synthetic container of the same geometry, page cache warm)", "",
                  f"{ld['file_bytes'] / 1e9:.2f} GB: {ld['plain']['total_seconds']:.2f} s to the GPU "
                  f"(upload {ld['plain']['upload_GBps']:.1f} GB/s through pinned 64 MiB chunks); "
                  f"with --verify {ld['verify']['total_seconds']:.2f} s "
                  f"(checksums {ld['verify']['verify_seconds']:.2f} s)"]
    if res.get("errors"):
        lines += ["", "## Errors", ""] + [f"- {k}: {v}" for k, v in res["errors"].items()]
    return "\n".join(lines) + "\n"


def write_report(res: dict, out_dir: Path) -> None:
    (out_dir / "bench.json").write_text(json.dumps(res, indent=1, default=str))
    (out_dir / "bench.md").write_text(markdown(res))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # the numbers are written; say why there is no plot
        (out_dir / "plots-missing.txt").write_text(f"matplotlib unavailable: {e}\n")
        return
    fig, ax = plt.subplots(figsize=(5, 3.5))
    rs = res["decode_batched"]
    ax.plot([r["batch"] for r in rs], [r["engine_tok_s"] for r in rs], "o-", label="engine")
    ax.plot([r["batch"] for r in rs], [r["graph_tok_s"] for r in rs], "s--", label="graph replay")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("aggregate decode tok/s")
    ax.set_title(f"{res['device']}: decode vs batch (ctx 128)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "tok_s_vs_batch.png", dpi=120)
    fig, ax = plt.subplots(figsize=(5, 3.5))
    rs = res["decode_batch1"]
    ax.plot([r["context"] for r in rs], [r["graph_tok_s"] for r in rs], "o-", label="graph replay")
    ax.plot([r["context"] for r in rs], [r["engine_tok_s"] for r in rs], "s--", label="engine")
    ax.plot([r["context"] for r in rs], [r["roofline_tok_s"] for r in rs], ":", label="bandwidth roofline")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length")
    ax.set_ylabel("batch-1 decode tok/s")
    ax.set_title(f"{res['device']}: decode vs context")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "tok_s_vs_context.png", dpi=120)
