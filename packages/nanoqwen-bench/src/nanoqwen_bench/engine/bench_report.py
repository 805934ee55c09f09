"""The engine benchmark's report: pure functions from measured numbers to `bench.json` and `bench.md`.

`bench.py` measures and collects raw numbers in one dict (`raw`, layout below); `build_report(raw)`
derives every ratio and returns the JSON document; `markdown(report)` renders it; `write_report`
writes both and the plots. Nothing here touches a GPU, so a CPU test checks the schema with made-up
numbers (`tests/test_bench_report.py`), and a run cut short still gets a complete, valid document:
a section that failed or never ran has an empty list or None in its place and its error under
"errors".

The roofline is the READ bandwidth (`read_bandwidth_GBps`, a kernel that only reads a 4 GiB buffer,
measured in the same run): a decode step reads weights and KV and writes almost nothing. The
device-to-device copy bandwidth (bytes read + written) is reported beside it, and so is the fraction
of it (`roofline_frac_copy`), because earlier results were given that way; it is no ceiling (cuBLAS's
bf16 lm_head GEMV reads at 107% of it).

raw = {
  "meta": {"command", "device", "date", "torch", "python", "model", "prefix_caching", "speculation"},
  "read_bandwidth": {"bytes_per_s", "nbytes", "reps", "median_s", "min_s", "max_s"},
  "copy_bandwidth_Bps": float,
  "memory": Engine.memory_report() as a dict, plus "weights_gpu_bytes", "device_total_bytes",
  "decode_batch1": [{"context", "engine_tok_s", "graph_replay_s", "graph_tok_s",
                     "bytes_per_token_parts": {part: bytes}, ...}],
  "decode_batched": [{"batch", "engine_tok_s", "graph_tok_s", ...}],
  "prefill": [{"prompt", "prefill_s", "prefill_tok_s", "ttft_s" (medians of "reps" fresh prompts),
               "prefill_s_all", "ttft_s_all"}], "ttft_2k": {same},
  "eager": [{"batch", "engine_tok_s", ...}],
  "profile": bench_profile.profile_decode_ops(...) result (batch 1),
  "profile_batched": [the same at batch 16, 32, 64: the INT4 GEMM's steps],
  "model_load": LoadStats as a dict (--model FILE), "load_test": bench.load_time(...) result,
  "prefix_cache": bench.prefix_cache_ttft(...) result, "engine_stats": EngineStats as a dict,
  "features_cost": bench.features_cost(...) result (features on vs off, same run),
  "layout_speed": bench.layout_speed(...) result (g128 asym vs sym, synthetic model only),
  "overlap_ab": bench.overlap_ab(...) result (EngineConfig.overlap on vs off, synthetic model only),
  "lm_head_ab": bench.lm_head_ab(...) result (an INT4 lm_head vs bf16, synthetic model only),
  "errors": {section: message},
}
"""

from __future__ import annotations

import json
from pathlib import Path

# keys bench.json always has (tests/test_bench_report.py checks them; more may be added)
REQUIRED_KEYS = ("date", "device", "read_bandwidth_GBps", "copy_bandwidth_GBps", "memory", "decode_batch1",
                 "decode_batched", "prefill", "ttft_2k_ms", "launches_per_decode_step")
MEMORY_KEYS = ("container_bytes", "weights_gpu_bytes", "kv_pool_bytes", "peak_allocated_bytes")
DECODE1_KEYS = ("context", "graph_tok_s", "engine_tok_s", "bytes_per_token", "roofline_frac_read")


def _frac(num, den):
    return None if num is None or not den else num / den


def _decode1_row(r: dict, read_bps: float | None, copy_bps: float | None) -> dict:
    parts = dict(r.get("bytes_per_token_parts") or {})
    total = sum(parts.values()) if parts else None
    graph, engine = r.get("graph_tok_s"), r.get("engine_tok_s")
    roof_read = _frac(read_bps, total)
    roof_copy = _frac(copy_bps, total)
    out = {k: v for k, v in r.items() if k != "bytes_per_token_parts"}
    out.update({
        "context": r["context"], "graph_tok_s": graph, "engine_tok_s": engine,
        "bytes_per_token": total, "bytes_per_token_parts": parts,
        "roofline_tok_s_read": roof_read, "roofline_frac_read": _frac(graph, roof_read),
        "roofline_frac_read_engine": _frac(engine, roof_read),
        "roofline_tok_s_copy": roof_copy, "roofline_frac_copy": _frac(graph, roof_copy),
    })
    return out


def profile_report(p: dict | None, read_bps: float | None, graph_replay_s: float | None) -> dict | None:
    """Per-op bandwidth against the read roofline, and the kernel-time sum against the graph replay."""
    if not p:
        return None
    out = dict(p)
    ops = []
    for o in p.get("ops", []):
        us, nbytes = o.get("us_per_step"), o.get("bytes_per_step")
        gbps = nbytes / us / 1e3 if us and nbytes else None
        ops.append(dict(o, GBps=gbps, frac_read=_frac(gbps * 1e9 if gbps else None, read_bps)))
    out["ops"] = ops
    total_us = p.get("kernel_us_per_step")
    out["graph_replay_us"] = graph_replay_s * 1e6 if graph_replay_s else None
    out["gap_us"] = (out["graph_replay_us"] - total_us
                     if out["graph_replay_us"] is not None and total_us is not None else None)
    return out


def build_report(raw: dict) -> dict:
    """The bench.json document from the raw measurements (any section may be missing)."""
    meta = raw.get("meta", {})
    rb = raw.get("read_bandwidth") or {}
    read_bps = rb.get("bytes_per_s")
    copy_bps = raw.get("copy_bandwidth_Bps")
    decode1 = [_decode1_row(r, read_bps, copy_bps) for r in raw.get("decode_batch1", [])]
    graph_128 = next((r.get("graph_replay_s") for r in raw.get("decode_batch1", []) if r["context"] == 128),
                     None)
    mem = dict(raw.get("memory") or {})
    for k in MEMORY_KEYS:
        mem.setdefault(k, None)
    prof = profile_report(raw.get("profile"), read_bps, graph_128)
    graph_by_batch = {r["batch"]: r.get("graph_replay_s") for r in raw.get("decode_batched", [])}
    prof_batched = [profile_report(p, read_bps, graph_by_batch.get(p.get("batch")))
                    for p in raw.get("profile_batched", [])]
    ttft = raw.get("ttft_2k")
    rep = {
        "command": meta.get("command"), "date": meta.get("date"), "device": meta.get("device"),
        "model": meta.get("model"), "torch": meta.get("torch"), "python": meta.get("python"),
        "read_bandwidth_GBps": read_bps / 1e9 if read_bps else None,
        "read_bandwidth": rb or None,
        "copy_bandwidth_GBps": copy_bps / 1e9 if copy_bps else None,
        "memory": mem,
        "decode_batch1": decode1,
        "decode_batched": [dict(r, batch=r["batch"], engine_tok_s=r.get("engine_tok_s"),
                                graph_tok_s=r.get("graph_tok_s")) for r in raw.get("decode_batched", [])],
        "prefill": [dict(r, prompt_tokens=r["prompt"], tok_s=r["prefill_tok_s"])
                    for r in raw.get("prefill", [])],
        "ttft_2k_ms": 1e3 * ttft["ttft_s"] if ttft else None,
        "eager": list(raw.get("eager", [])),
        "launches_per_decode_step": prof.get("launches_per_step") if prof else None,
        "profile": prof,
        "profile_batched": prof_batched,
    }
    rep["prefix_caching"] = meta.get("prefix_caching")
    rep["speculation"] = meta.get("speculation")
    for k in ("engine_start_s", "num_kv_blocks", "kv_blocks_used_after", "model_load", "load_test",
              "prefix_cache", "engine_stats", "features_cost", "layout_speed", "overlap_ab",
              "lm_head_ab"):
        if raw.get(k) is not None:
            rep[k] = raw[k]
    if raw.get("errors"):
        rep["errors"] = dict(raw["errors"])
    return rep


# ---------------------------------------------------------------------------------------------------
# markdown
# ---------------------------------------------------------------------------------------------------


def _f(v, fmt: str = ".0f", scale: float = 1.0, suffix: str = "") -> str:
    """A number formatted, or '-' when it was not measured."""
    return "-" if v is None else f"{v * scale:{fmt}}{suffix}"


def _gb(v) -> str:
    return _f(v, ".2f", 1e-9, " GB")


def markdown(rep: dict) -> str:
    """The report as markdown tables (sections that failed are listed under Errors)."""
    rb = rep.get("read_bandwidth") or {}
    lines = ["# nanoqwen engine benchmark", "",
             f"- command: `{rep.get('command')}`", f"- device: {rep.get('device')}",
             f"- date: {rep.get('date')}",
             f"- model: {rep.get('model')}", f"- torch {rep.get('torch')}, Python {rep.get('python')}",
             f"- read bandwidth (the roofline; a kernel that only reads {_gb(rb.get('nbytes'))}, median of "
             f"{rb.get('reps', '-')} launches): {_f(rep.get('read_bandwidth_GBps'))} GB/s",
             f"- copy bandwidth (device-to-device, read + write; not a ceiling for reads): "
             f"{_f(rep.get('copy_bandwidth_GBps'))} GB/s", ""]
    m = rep.get("memory") or {}
    lines += ["## GPU memory", "", "| what | bytes |", "| --- | --- |"]
    for key, label in (("container_bytes", "container tensors"),
                       ("weight_buffer_bytes", "weight buffer on GPU"),
                       ("dense_cache_bytes", "bf16 dense weight cache"),
                       ("weights_gpu_bytes", "weights on GPU (buffer + dense cache)"),
                       ("kv_pool_bytes", "KV pool"),
                       ("workspace_bytes", "activation workspace + step buffers"),
                       ("graph_pool_bytes", "CUDA graphs: torch pool growth"),
                       ("graph_device_bytes", "CUDA graphs: device free-memory drop"),
                       ("allocated_bytes", "torch allocated (after the graph-mode runs)"),
                       ("peak_allocated_bytes", "torch peak allocated"), ("reserved_bytes", "torch reserved"),
                       ("device_total_bytes", "device total")):
        if key in m:
            lines.append(f"| {label} | {_gb(m[key])} |")
    if "kv_pool_tokens" in m:
        lines += ["", f"KV pool: {m['kv_pool_tokens']} tokens; a bf16 dense weight cache (the pre-INT4-GEMM "
                  f"default) would take {m['kv_tokens_of_dense_cache']} of them."]
    lines += ["", "## Decode, batch 1 (CUDA graph)", "",
              "| context | graph tok/s | engine tok/s | bytes/token | read roofline tok/s "
              "| graph % of read roofline | engine % | graph % of copy roofline |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rep.get("decode_batch1", []):
        lines.append(f"| {r['context']} | {_f(r.get('graph_tok_s'))} | {_f(r.get('engine_tok_s'))} | "
                     f"{_gb(r.get('bytes_per_token'))} | {_f(r.get('roofline_tok_s_read'))} | "
                     f"{_f(r.get('roofline_frac_read'), '.1f', 100, '%')} | "
                     f"{_f(r.get('roofline_frac_read_engine'), '.1f', 100, '%')} | "
                     f"{_f(r.get('roofline_frac_copy'), '.1f', 100, '%')} |")
    if rep.get("decode_batch1"):
        r0 = rep["decode_batch1"][0]
        parts = ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in r0.get("bytes_per_token_parts", {}).items())
        lines += ["", f"Bytes per token at context {r0['context']}: {parts}"]
    lines += ["", "## Decode, aggregate (context 128 + 128 generated)", "",
              "| batch | engine tok/s | graph-replay tok/s |", "| --- | --- | --- |"]
    for r in rep.get("decode_batched", []):
        lines.append(f"| {r['batch']} | {_f(r.get('engine_tok_s'))} | {_f(r.get('graph_tok_s'))} |")
    lines += ["", "## Prefill", "", "| prompt | tok/s | time (ms) |", "| --- | --- | --- |"]
    for r in rep.get("prefill", []):
        lines.append(f"| {r['prompt_tokens']} | {_f(r.get('tok_s'))} | "
                     f"{_f(r.get('prefill_s'), '.1f', 1e3)} |")
    if rep.get("ttft_2k_ms") is not None:
        lines += ["", f"Time to first token, 2048-token prompt: {rep['ttft_2k_ms']:.1f} ms"]
    if rep.get("prefix_caching") is not None:
        lines += ["", f"Features on in these figures: prefix caching {rep['prefix_caching']}, speculation "
                  f"{rep.get('speculation')}"]
    pc = rep.get("prefix_cache")
    if pc:
        lines += ["", f"Prefix cache: TTFT of a prompt sharing a {pc['prefix_tokens']}-token prefix with an "
                  f"earlier one {1e3 * pc['warm_ttft_s']:.1f} ms vs cold {1e3 * pc['cold_ttft_s']:.1f} ms: "
                  f"{100 * pc['warm_over_cold']:.1f}% (goal <= 15%), hit tokens {pc['warm_hit_tokens']}"]
    es = rep.get("engine_stats")
    if es:
        lines += ["", f"Engine counters after the decode sections: prefix hit {es['prefix_hit_tokens']} of "
                  f"{es['prefix_queried_tokens']} prompt tokens; drafted {es['spec_drafted_tokens']}, "
                  f"accepted {es['spec_accepted_tokens']} in {es['spec_steps']} verify steps"]
    lines += _features_md(rep.get("features_cost"))
    lines += _layout_md(rep.get("layout_speed"))
    lines += _overlap_md(rep.get("overlap_ab"))
    lines += _lm_head_md(rep.get("lm_head_ab"), rep.get("read_bandwidth_GBps"))
    lines += ["", "## Graph vs eager (context 128, engine wall time)", "",
              "| batch | graph-mode tok/s | eager tok/s |",
              "| --- | --- | --- |"]
    graph = {r["batch"]: r for r in rep.get("decode_batched", [])}
    for r in rep.get("eager", []):
        lines.append(f"| {r['batch']} | {_f(graph.get(r['batch'], {}).get('engine_tok_s'))} | "
                     f"{_f(r.get('engine_tok_s'), '.1f')} |")
    lines += profile_markdown(rep.get("profile"))
    for p in rep.get("profile_batched") or []:
        lines += profile_markdown(p)
    lines += _load_md(rep)
    if rep.get("errors"):
        lines += ["", "## Errors", ""] + [f"- {k}: {v}" for k, v in rep["errors"].items()]
    return "\n".join(lines) + "\n"


def _ab_md(title: str, note: str, a: str, b: str, rows: list[dict], verdict: str) -> list[str]:
    lines = ["", title, "", note, "",
             f"| batch | {a} tok/s | {b} tok/s | {a}/{b} | spread {a} / {b} | verdict |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['a_tok_s']:.0f} | {r['b_tok_s']:.0f} | {r['a_over_b']:.3f} | "
                     f"{100 * r['spread_a']:.1f}% / {100 * r['spread_b']:.1f}% | "
                     f"{verdict if r['a_slower'] else 'ok'} |")
    return lines


def _features_md(fc: dict | None) -> list[str]:
    if not fc:
        return []
    lines = _ab_md(f"## Prefix caching + speculation on vs off (same run, context {fc['context']} + "
                   f"{fc['new_tokens']} generated, nothing to reuse)",
                   f"Medians of {fc['reps']} alternating repeats per side; a regression is every 'on' repeat "
                   "slower than every 'off' repeat (rank test, U = 0).", "on", "off", fc["rows"],
                   "REGRESSION")
    es = fc.get("on_engine_stats") or {}
    if es:
        lines += ["", f"Features-on engine: prefix hit {es.get('prefix_hit_tokens')} of "
                  f"{es.get('prefix_queried_tokens')} prompt tokens; drafted "
                  f"{es.get('spec_drafted_tokens')}, accepted {es.get('spec_accepted_tokens')} in "
                  f"{es.get('spec_steps')} verify steps"]
    return lines


def _layout_md(ls: dict | None) -> list[str]:
    if not ls:
        return []
    return _ab_md("## INT4 layout: g128 asym (the default recipe) vs g128 sym (same run, context 128 + 128)",
                  f"Weight bytes read per token: asym {ls['weight_bytes_a'] / 1e9:.3f} GB, sym "
                  f"{ls['weight_bytes_b'] / 1e9:.3f} GB. Medians of {ls['reps']} alternating repeats.",
                  "asym", "sym", ls["rows"], "slower")


def _graph_ratio_lines(a: str, b: str, rows: list[dict]) -> list[str]:
    """Each side's graph replay tok/s beside an `_ab_md` table, and each side's engine over graph."""
    lines = ["", f"| batch | graph replay {a} tok/s | {b} tok/s | {a}/{b} | engine/graph {a} | {b} |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        ga, gb = r.get("a_graph_tok_s"), r.get("b_graph_tok_s")
        ratio = ga / gb if ga and gb else None
        eng_a, eng_b = r["a_tok_s"] / ga if ga else None, r["b_tok_s"] / gb if gb else None
        lines.append(f"| {r['batch']} | {_f(ga, '.0f')} | {_f(gb, '.0f')} | {_f(ratio, '.3f')} "
                     f"| {_f(eng_a, '.3f')} | {_f(eng_b, '.3f')} |")
    return lines


def _engine_ab_md(title: str, a: str, b: str, rows: list[dict], reps: int, detail: str = "") -> list[str]:
    """An engine option against its default (`bench.ab_decode` rows): the table with the rank-test verdict,
    the note that says how it was measured (then `detail`), and each side's graph replay beside it."""
    note = (f"Engine tok/s, medians of {reps} alternating repeats per side; 'slower' is every '{a}' repeat "
            f"slower than every '{b}' repeat (rank test, U = 0).") + (f" {detail}" if detail else "")
    return _ab_md(title, note, a, b, rows, "slower") + _graph_ratio_lines(a, b, rows)


def _overlap_md(ov: dict | None) -> list[str]:
    if not ov:
        return []
    return _engine_ab_md("## Overlapped decode (EngineConfig.overlap) vs synchronous steps (same run, "
                         f"context {ov['context']} + {ov['new_tokens']})", "overlap", "off", ov["rows"],
                         ov["reps"],
                         f"The overlap engine queued {ov['steps_ahead_on']} of its {ov['decode_steps_on']} "
                         f"decode steps ahead (the off engine {ov['steps_ahead_off']}).")


def _lm_head_md(lh: dict | None, read_gbps: float | None) -> list[str]:
    if not lh:
        return []
    paths = lh.get("graph_paths_a") or {}
    run = f"(same run, context {lh['context']} + {lh['new_tokens']})"
    note = (f"Bytes per token at the last step: int4 {lh['bytes_per_token_a'] / 1e9:.3f} GB, "
            f"bf16 {lh['bytes_per_token_b'] / 1e9:.3f} GB. lm_head path of the int4 side's "
            f"batch-1 graph: {_lm_head_path(paths)}.")
    name, title = "int4", f"## INT4 lm_head (`nanoqwen-quant pack --lm-head int4`) vs bf16 {run}"
    lines = _engine_ab_md(title, name, "bf16", lh["rows"], lh["reps"], note)
    lines += ["", f"| batch | graph replay {name}, % of the read roofline | bf16 |", "| --- | --- | --- |"]
    read_bps = read_gbps * 1e9 if read_gbps else None
    for r in lh["rows"]:
        cells = []
        for side in ("a", "b"):
            graph = r.get(f"{side}_graph_tok_s")
            moved = graph * lh[f"bytes_per_token_{side}"] if graph else None  # bytes/s the replay moved
            cells.append(_f(_frac(moved, read_bps), ".1f", 100, "%"))
        lines.append(f"| {r['batch']} | {cells[0]} | {cells[1]} |")
    return lines


def _lm_head_path(paths: dict | None) -> str:
    """What the graph's path counters say the lm_head ran as: INT4 GEMVs are 4 per layer plus one for an
    INT4 lm_head; a bf16 lm_head is the one cuBLAS GEMM."""
    if not paths:
        return "not recorded"
    return ", ".join(f"{k} {v}" for k, v in sorted(paths.items()) if k in ("gemv_int4", "cublas_bf16"))


def profile_markdown(p: dict | None) -> list[str]:
    """The markdown lines of one `profile_report`: a section with its per-op and per-kernel tables."""
    if not p:
        return []
    warn = ""
    if p.get("starved_chunks"):
        warn = (f"; WARNING: the host fell behind the GPU in {p['starved_chunks']} of {p['chunks']} chunks, "
                "so those times include host gaps")
    lines = ["", f"## Time per op of a batch-{p.get('batch', 1)} decode step (eager, context "
             f"{p.get('context')}, CUDA events)",
             "", f"{_f(p.get('launches_per_step'))} launches per step "
             f"({_f(p.get('kernel_launches_per_step'))} nanoqwen kernels + "
             f"{_f(p.get('library_calls_per_step'))} cuBLAS/torch calls); sum of op times "
             f"{_f(p.get('kernel_us_per_step'))} us, median of {p.get('steps')} steps; graph replay "
             f"{_f(p.get('graph_replay_us'))} us (graph minus sum: {_f(p.get('gap_us'))} us). Ops were "
             "queued behind a GPU-side wait and ran back to back, so each time is GPU time, not host time"
             f"{warn}.", "",
             "| op | calls/step | us/step | MB/step | GB/s | % of read BW |",
             "| --- | --- | --- | --- | --- | --- |"]
    for o in p.get("ops", []):
        lines.append(f"| {o['op']} | {_f(o.get('calls_per_step'), '.0f')} | "
                     f"{_f(o.get('us_per_step'), '.1f')} | {_f(o.get('bytes_per_step'), '.1f', 1e-6)} | "
                     f"{_f(o.get('GBps'))} | {_f(o.get('frac_read'), '.1f', 100, '%')} |")
    lines += ["", "| kernel | launches/step | us/step | us/launch |", "| --- | --- | --- | --- |"]
    for k in p.get("kernels", []):
        n = k.get("launches_per_step")
        per = k["us_per_step"] / n if n else None
        lines.append(f"| `{k['kernel']}` | {_f(n, '.0f')} | {_f(k.get('us_per_step'), '.1f')} | "
                     f"{_f(per, '.2f')} |")
    return lines


def _load_md(rep: dict) -> list[str]:
    lines = []
    ml = rep.get("model_load")
    if ml:
        lines += ["", "## Loading the model", "",
                  f"{_gb(ml.get('nbytes'))} from {ml.get('path')}: {_f(ml.get('total_seconds'), '.2f')} s "
                  f"(upload {_f(ml.get('seconds'), '.2f')} s; " + _verify_md(ml) + ")"]
    ld = rep.get("load_test")
    if ld:
        plain, ver = ld.get("plain", {}), ld.get("verify", {})
        lines += ["", "## Loading (synthetic container of the same geometry, page cache warm)", "",
                  f"{_gb(ld.get('file_bytes'))} to the GPU through pinned 64 MiB chunks: with --no-verify "
                  f"{_f(plain.get('total_seconds'), '.2f')} s (upload {_f(plain.get('upload_GBps'), '.1f')} "
                  f"GB/s); verified (the default) {_f(ver.get('total_seconds'), '.2f')} s (upload "
                  f"{_f(ver.get('upload_GBps'), '.1f')} GB/s; " + _verify_md(ver) + ")"]
    return lines


def _verify_md(stats: dict) -> str:
    """The checks of one load (LoadStats as a dict): hashing overlaps the upload on a worker thread,
    so its cost is the wait, not the hashing time; the NaN/Inf check runs after the upload."""
    if stats.get("verified") is False or not stats.get("verify_seconds"):
        return "not verified"
    return (f"checksums hashed in {_f(stats.get('verify_seconds'), '.2f')} s beside the copies, "
            f"upload waited {_f(stats.get('verify_wait_seconds'), '.2f')} s for them; NaN/Inf check "
            f"{_f(stats.get('finite_seconds'), '.3f')} s")


def write_report(rep: dict, out_dir: Path, *, plots: bool = True) -> None:
    """bench.json and bench.md (and, with matplotlib, two plots) into `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench.json").write_text(json.dumps(rep, indent=1, default=str))
    (out_dir / "bench.md").write_text(markdown(rep))
    if plots:
        _plots(rep, out_dir)


def _plots(rep: dict, out_dir: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # the numbers are written; say why there is no plot
        (out_dir / "plots-missing.txt").write_text(f"matplotlib unavailable: {e}\n")
        return
    rs = [r for r in rep.get("decode_batched", []) if r.get("graph_tok_s") is not None]
    if rs:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.plot([r["batch"] for r in rs], [r["engine_tok_s"] for r in rs], "o-", label="engine")
        ax.plot([r["batch"] for r in rs], [r["graph_tok_s"] for r in rs], "s--", label="graph replay")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel("aggregate decode tok/s")
        ax.set_title(f"{rep.get('device')}: decode vs batch (ctx 128)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / "tok_s_vs_batch.png", dpi=120)
        plt.close(fig)
    rs = [r for r in rep.get("decode_batch1", []) if r.get("graph_tok_s") is not None]
    if rs:
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.plot([r["context"] for r in rs], [r["graph_tok_s"] for r in rs], "o-", label="graph replay")
        ax.plot([r["context"] for r in rs], [r["engine_tok_s"] for r in rs], "s--", label="engine")
        if all(r.get("roofline_tok_s_read") for r in rs):
            ax.plot([r["context"] for r in rs], [r["roofline_tok_s_read"] for r in rs], ":",
                    label="read-bandwidth roofline")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length")
        ax.set_ylabel("batch-1 decode tok/s")
        ax.set_title(f"{rep.get('device')}: decode vs context")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / "tok_s_vs_context.png", dpi=120)
        plt.close(fig)
