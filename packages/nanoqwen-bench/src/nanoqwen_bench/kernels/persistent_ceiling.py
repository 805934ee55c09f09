"""The ceiling of a persistent batch-1 decode kernel, measured before building one.

    PYTHONPATH=$(ls -d packages/*/src | paste -sd:) \
        python3 -m nanoqwen_bench.kernels.persistent_ceiling --model 7b,1.5b,0.5b --out bench/out/persistent

A batch-1 decode step at context `--context` is a list of phases, one per op that needs all of the
previous op's output: per layer qkv, attention (the layer's K and V), o, gate_up, down; then lm_head.
Their bytes are the default container's (INT4 g128: N*K/2 weight bytes, N*K/128 bf16 scales, the qkv
bias; a bf16 lm_head) and the bf16 KV. One buffer holds them back to back, and bench.cu's
`step_phases_u32x4` (and `step_phases_preload_u32x4`) read it in five ways (nanoqwen_bench.gpu.step_phases):
- `launches`: one launch per phase, in one CUDA graph: today's engine's structure, where each op waits
  for the previous launch to drain and then ramps up;
- `persistent`: one launch of resident CTAs (every SM full) with a grid barrier between phases;
- `persistent + L2 prefetch X`: the same, each CTA first asking the L2 for its share of the first X
  bytes of the next phase, then waiting at the barrier: weights depend on no activation, so a
  persistent kernel can fetch them before the previous op ends;
- `persistent + preload`: the same barrier, each thread first loading its first 4 vectors of the next
  phase into registers, as a persistent kernel's producer warps fill their shared-memory ring ahead of
  the op; the registers held cost occupancy (bench.cu's own entry, fewer CTAs per SM);
- `back to back`: one launch, no barrier: the partition's own streaming ceiling;
- `dataflow, G groups`: one launch of one CTA per SM (bench.cu's `step_phases_dataflow_u32x4`): a
  producer warp streams the CTA's slices, phase after phase, into a 12-slot (192 KB) shared-memory ring
  with bulk copies, never waiting for another CTA; the consumers wait, before each part of a phase, only
  for the group of CTAs that wrote the part's input slice (G groups; G = 1: the whole previous op, as at
  a barrier, with the ring running ahead across it): the design that starts an op on the input slices
  that are ready and loads its weights during the previous op (Hazy Research's megakernel).
Every variant's XOR of what it read is checked against read_xor's over the same bytes before it is
timed, and the barrier's flag check runs once per kind of barrier (no CTA let through early). Each time
is the median of graph replays, reported against the roofline: the step's bytes over the read bandwidth
this run measured (gpu.read_bandwidth). Only bytes are moved: the dequantisation and the MMAs, the activations
and the work inside an op are not modelled, so each figure bounds its design from above.
Writes OUT/persistent_ceiling.json and .md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from nanoqwen_model import QWEN25_CODER_GEOMETRIES, Qwen2Config

from .. import gpu

MODELS = QWEN25_CODER_GEOMETRIES
GROUP = 128
PREFETCH_BYTES = (1 << 20, 4 << 20, 16 << 20)  # of each next phase, spread over the CTAs
DATAFLOW_GROUPS = (1, 12, None)  # None: one group per CTA


def int4_bytes(n: int, k: int) -> int:
    """Bytes of an INT4 g128 [N, K] weight as the container stores it: packed nibbles and bf16 scales."""
    return n * k // 2 + n * -(-k // GROUP) * 2


def step_phases_of(g: Qwen2Config, context: int) -> list[tuple[str, int]]:
    """(op, bytes) of one batch-1 decode step at `context` tokens, in order: 5 phases per layer, then
    lm_head."""
    hd = g.head_dim
    q, kv = g.num_attention_heads * hd, g.num_key_value_heads * hd
    layer = [("qkv", int4_bytes(q + 2 * kv, g.hidden_size) + (q + 2 * kv) * 2),
             ("attention", context * 2 * kv * 2),
             ("o", int4_bytes(g.hidden_size, q)),
             ("gate_up", int4_bytes(2 * g.intermediate_size, g.hidden_size)),
             ("down", int4_bytes(g.hidden_size, g.intermediate_size))]  # fmt: skip
    return [op for _ in range(g.num_hidden_layers) for op in layer] + [
        ("lm_head", g.vocab_size * g.hidden_size * 2)]


@dataclass
class Variant:
    name: str
    seconds: float
    frac_roofline: float


def measure_model(name: str, g: Qwen2Config, context: int, read_bps: float, device: torch.device,
                  replays: int, blocks_per_sm: int | None = None) -> dict:
    """One model's variants (module header). blocks_per_sm: CTAs per SM of every variant (default: as
    many as fit, 4 of 512 threads; the preload variant at most as many as fit of its kernel)."""
    phases = step_phases_of(g, context)
    vecs = [-(-b // 16) for _, b in phases]
    bounds = torch.tensor([0, *torch.tensor(vecs).cumsum(0).tolist()], dtype=torch.int64, device=device)
    total = int(bounds[-1]) * 16
    data = torch.randint(-(2**31), 2**31 - 1, (total // 4,), dtype=torch.int32, device=device)
    sink = torch.zeros(1, dtype=torch.int32, device=device)
    bar = torch.zeros(2, dtype=torch.int32, device=device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    per_sm = gpu.resident_blocks("step_phases_u32x4", gpu.STEP_PHASES_THREADS, device)
    if blocks_per_sm is not None:
        if not 1 <= blocks_per_sm <= per_sm:
            raise ValueError(f"blocks_per_sm {blocks_per_sm}: 1 to {per_sm} fit on an SM")
        per_sm = blocks_per_sm
    preload_per_sm = min(per_sm, gpu.resident_blocks("step_phases_preload_u32x4", gpu.STEP_PHASES_THREADS,
                                                     device))
    blocks = sms * per_sm
    n = len(phases)

    want = torch.zeros(1, dtype=torch.int32, device=device)
    gpu.read_xor(data, want)
    # label: (mode, prefetch bytes per CTA, CTAs)
    variants = {"back to back": (gpu.PHASES_BACK_TO_BACK, 0, blocks),
                "persistent": (gpu.PHASES_BARRIER, 0, blocks)}
    for x in PREFETCH_BYTES:
        variants[f"persistent + L2 prefetch {x >> 20} MB"] = (gpu.PHASES_BARRIER_PREFETCH, share(x, blocks),
                                                              blocks)
    preload = (gpu.PHASES_BARRIER_PRELOAD, 0, sms * preload_per_sm)
    variants[f"persistent + preload {gpu.STEP_PHASES_PRELOAD_VECTORS} vectors per thread, "
             f"{preload_per_sm} CTAs per SM"] = preload

    def run(mode, prefetch, g, **kw):
        gpu.step_phases(data, bounds, sink, bar, blocks=g, mode=mode, prefetch_bytes=prefetch, **kw)

    barrier_kinds = [(gpu.PHASES_BARRIER, 0, blocks),
                     (gpu.PHASES_BARRIER_PREFETCH, share(PREFETCH_BYTES[0], blocks), blocks), preload]
    for mode, prefetch, g in barrier_kinds:
        _check_barrier(name, mode, n, lambda m=mode, p=prefetch, g=g, **kw: run(m, p, g, **kw), g, sink, bar,
                       want)
    rows = []
    for label, (mode, prefetch, g) in variants.items():
        sink.zero_()
        graph = gpu.capture_graph(lambda i, m=mode, p=prefetch, g=g: run(m, p, g), 1)
        _check_xor(label, sink, want, 1 + 3)  # the warm-up call, the capture's 3 replays
        t = gpu.median_replay_seconds(graph, replays)
        rows.append(Variant(label, t, total / read_bps / t))
        del graph
    counters = {}
    for groups in (g or sms for g in DATAFLOW_GROUPS):
        counters[groups] = torch.zeros(n * groups, dtype=torch.int32, device=device)
        _check_dataflow(name, n, groups, data, bounds, sink, counters[groups], sms, want)

        def dataflow(i, groups=groups):
            counters[groups].zero_()
            gpu.step_phases_dataflow(data, bounds, sink, counters[groups], blocks=sms, groups=groups)

        sink.zero_()
        graph = gpu.capture_graph(dataflow, 1)
        label = f"dataflow, {groups} groups, 1 CTA per SM"
        _check_xor(label, sink, want, 1 + 3)
        t = gpu.median_replay_seconds(graph, replays)
        rows.append(Variant(label, t, total / read_bps / t))
        del graph
    sink.zero_()
    graph = gpu.capture_graph(
        lambda i: gpu.step_phases(data, bounds, sink, bar, blocks=blocks, mode=gpu.PHASES_BARRIER,
                                  phases=slice(i, i + 1)), n)
    _check_xor("launches", sink, want, 1 + 3)
    t = gpu.median_replay_seconds(graph, replays)
    rows.insert(0, Variant("launches (one per phase)", t, total / read_bps / t))
    del graph
    b2b = next(r.seconds for r in rows if r.name == "back to back")
    per = {r.name: (r.seconds - b2b) / (n - 1) * 1e6 for r in rows if r.name != "back to back"}
    return {"model": name, "context": context, "phases": n, "step_bytes": total, "blocks": blocks,
            "blocks_per_sm": per_sm, "roofline_s": total / read_bps,
            "variants": [vars(r) for r in rows], "us_per_phase_over_back_to_back": per}


def share(nbytes: int, blocks: int) -> int:
    """Each CTA's part of `nbytes`, a multiple of 16."""
    return nbytes // blocks // 16 * 16


def _check_barrier(name: str, mode: int, n: int, run, blocks: int, sink: torch.Tensor, bar: torch.Tensor,
                   want: torch.Tensor) -> None:
    """One checked launch of `mode` (run(check_flags=, check_errors=)): it reads every byte once, runs
    n - 1 barriers, and no barrier lets a CTA through early."""
    device = sink.device
    flags = torch.zeros(blocks, dtype=torch.int32, device=device)
    errors = torch.zeros(1, dtype=torch.int32, device=device)
    sink.zero_()
    bar.zero_()
    run(check_flags=flags, check_errors=errors)
    torch.cuda.synchronize()
    if int(errors.item()) or int(sink.item()) != int(want.item()) or int(bar[1].item()) != n - 1:
        raise RuntimeError(f"{name}, mode {mode}: step_phases read XOR {int(sink.item()):#x} (read_xor "
                           f"{int(want.item()):#x}), {int(errors.item())} early CTAs, {int(bar[1].item())} "
                           f"barriers for {n} phases")


def _check_dataflow(name: str, n: int, groups: int, data, bounds, sink, counters, blocks: int,
                    want: torch.Tensor) -> None:
    """One checked dataflow launch: it reads every byte once, counts every CTA's every phase, and no
    wait let a CTA through before its group had finished the previous phase."""
    device = sink.device
    progress = torch.zeros(blocks, dtype=torch.int32, device=device)
    errors = torch.zeros(1, dtype=torch.int32, device=device)
    sink.zero_()
    counters.zero_()
    gpu.step_phases_dataflow(data, bounds, sink, counters, blocks=blocks, groups=groups, progress=progress,
                             check_errors=errors)
    torch.cuda.synchronize()
    sizes = torch.bincount(torch.arange(blocks) * groups // blocks, minlength=groups).tolist()
    if (int(errors.item()) or int(sink.item()) != int(want.item())
            or counters.view(n, groups).tolist() != [sizes] * n):
        raise RuntimeError(f"{name}, dataflow {groups} groups: read XOR {int(sink.item()):#x} (read_xor "
                           f"{int(want.item()):#x}), {int(errors.item())} early CTAs, counters "
                           f"{counters.view(n, groups)[:2].tolist()}... (group sizes {sizes})")


def _check_xor(label: str, sink: torch.Tensor, want: torch.Tensor, calls: int) -> None:
    """After `calls` full passes sink holds want if calls is odd, else 0 (XOR accumulates)."""
    torch.cuda.synchronize()
    expect = int(want.item()) if calls % 2 else 0
    if int(sink.item()) != expect:
        raise RuntimeError(f"{label}: XOR {int(sink.item()):#x} after {calls} passes, expected {expect:#x}")


def markdown(meta: dict, models: list[dict]) -> list[str]:
    lines = ["# Persistent decode kernel: streaming ceiling", "",
             f"{meta['device']}, {meta['date']}, read bandwidth {meta['read_GBps']:.0f} GB/s, "
             f"`{meta['command']}`", "",
             "| model | CTAs per SM | phases | step MB | roofline us | variant | us | of roofline "
             "| us per phase over back to back |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for m in models:
        for v in m["variants"]:
            per = m["us_per_phase_over_back_to_back"].get(v["name"])
            cells = (m["model"], m["blocks_per_sm"], m["phases"], f"{m['step_bytes'] / 1e6:.0f}",
                     f"{m['roofline_s'] * 1e6:.0f}", v["name"], f"{v['seconds'] * 1e6:.0f}",
                     f"{v['frac_roofline']:.1%}", "" if per is None else f"{per:.2f}")
            lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench/out/persistent"))
    ap.add_argument("--model", default="7b,1.5b,0.5b", help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--replays", type=int, default=30)
    ap.add_argument("--blocks-per-sm", default="", help="comma-separated CTAs per SM to run each model at "
                    "(default: as many as fit)")
    args = ap.parse_args(argv)
    names = args.model.split(",")
    if unknown := [n for n in names if n not in MODELS]:
        ap.error(f"unknown model(s) {unknown}; known: {', '.join(MODELS)}")
    device = torch.device("cuda", torch.cuda.current_device())
    args.out.mkdir(parents=True, exist_ok=True)
    rb = gpu.read_bandwidth(device)
    meta = {"device": torch.cuda.get_device_name(device), "read_GBps": rb["bytes_per_s"] / 1e9,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": " ".join(["python -m nanoqwen_bench.kernels.persistent_ceiling", *sys.argv[1:]])}
    models = []
    per_sm = [int(b) for b in args.blocks_per_sm.split(",") if b] or [None]
    for name, b in ((n, b) for b in per_sm for n in names):
        models.append(measure_model(name, MODELS[name], args.context, rb["bytes_per_s"], device,
                                    args.replays, b))
        torch.cuda.empty_cache()
        payload = {"meta": meta, "models": models}
        (args.out / "persistent_ceiling.json").write_text(json.dumps(payload, indent=1))
        lines = markdown(meta, models)
        (args.out / "persistent_ceiling.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
