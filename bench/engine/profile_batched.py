"""Where a batched decode step's time goes, per op and per kernel (issue 12's per-kernel table).

    python bench/engine/profile_batched.py --out DIR [--batches 1,16,32,64] [--steps 5]

On the H200: the synthetic Qwen2.5-Coder-7B (random INT4 g128 asym weights, the default recipe's
layout; bf16 lm_head, as `nanoqwen-cli bench`), an eager engine, and `bench_profile.profile_decode_ops`
at each batch size: CUDA events around every op and kernel of `--steps` decode steps (context ~128),
each op's bytes against the read bandwidth measured first in the same run. The same tables are part
of `nanoqwen-cli bench` (`profile`, `profile_batched`); this script is the short way to them (about a
minute once the kernels are compiled). Writes DIR/profile_batched.json and DIR/profile_batched.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch
from nanoqwen_kernels.bench import read_bandwidth
from nanoqwen_model import QWEN25_CODER_7B
from nanoqwen_runtime.engine import Engine, EngineConfig
from nanoqwen_runtime.engine.bench_profile import profile_decode_ops
from nanoqwen_runtime.engine.bench_report import profile_markdown, profile_report
from nanoqwen_runtime.engine.synthetic import random_weights


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batches", default="1,16,32,64")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    device = torch.device("cuda")
    rb = read_bandwidth(device)
    weights = random_weights(QWEN25_CODER_7B, device, seed=0, symmetric=False)
    engine = Engine(QWEN25_CODER_7B, weights, EngineConfig(kv_memory_bytes=4 << 30, max_model_len=4096,
                                                           mode="eager", dense_weight_cache=False,
                                                           overlap=False))
    args.out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    doc = {"date": now, "device": torch.cuda.get_device_name(device),
           "model": "synthetic Qwen2.5-Coder-7B geometry (random INT4 g128 asym, bf16 lm_head)",
           "read_bandwidth_GBps": rb["bytes_per_s"] / 1e9, "profiles": []}
    for b in batches:
        p = profile_report(profile_decode_ops(engine, steps=args.steps, batch=b), rb["bytes_per_s"], None)
        doc["profiles"].append(p)
        print(f"batch {b}: {p['kernel_us_per_step']:.0f} us of GPU time per step, "
              f"{p['starved_chunks']} of {p['chunks']} chunks starved", flush=True)
        write(doc, args.out)  # after each batch: a run cut short keeps what it measured
    return 0


def write(doc: dict, out: Path) -> None:
    (out / "profile_batched.json").write_text(json.dumps(doc, indent=1))
    lines = [f"# Decode step per op and kernel ({doc['device']}, {doc['date']})", "",
             f"{doc['model']}; eager engine; read bandwidth {doc['read_bandwidth_GBps']:.0f} GB/s "
             "(same run)."]
    for p in doc["profiles"]:
        lines += profile_markdown(p)
    (out / "profile_batched.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
