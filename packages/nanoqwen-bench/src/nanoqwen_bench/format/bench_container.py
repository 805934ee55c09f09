"""Benchmark of the .nanoqwen reader on a Qwen2.5-Coder-7B-shaped file (about 5.5 GB).

    python -m nanoqwen_bench.format.bench_container [--dir DIR] [--keep] [--reuse] [--repeat N]

1. Writes a container with the 7B tensor set: 28 layers of int4-g128 qkv [4608, 3584],
   o_proj [3584, 3584], gate_up [37888, 3584], down [3584, 18944], bf16 norms and biases, bf16
   embed_tokens and lm_head [152064, 3584]. Tensor contents are constant patterns (this measures the
   container, not the data); the bytes are really written, no sparse holes.
2. Index read, cold: drops the file from the page cache (posix_fadvise DONTNEED, no root needed),
   then in a fresh process times `nqf.open()` plus reading records and metadata, and reports how many
   bytes of the file are then resident (fincore): only the header and footer pages, no tensor data.
   Index read, warm: the same, repeated, median.
3. verify() on one core (the process is pinned to CPU 0), warm cache: one untimed pass to load the
   page cache, then the best of --repeat timed passes, in GB/s of tensor bytes, by wall clock and
   per CPU-second (process_time), which stays meaningful when other jobs share the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nanoqwen_format as nqf
import numpy as np

HIDDEN, INTER, LAYERS, VOCAB, HEADS, KV_HEADS, HEAD_DIM = 3584, 18944, 28, 152064, 28, 4, 128


def _int4(n: int, k: int, cache: dict) -> nqf.QuantizedTensor:
    if (n, k) not in cache:
        cache[(n, k)] = nqf.QuantizedTensor(
            qweight=np.full((n // 8, k // 128, 32, 4), 0x89ABCDEF, np.uint32),
            scales=np.full((n, k // 128), 0x3C00, np.uint16),
            zeros=None,
            shape=(n, k),
            group_size=128,
            symmetric=True,
            layout=nqf.layout_tag("int4", 128),
            encoding="int4",
        )
    return cache[(n, k)]


def write_7b(path: Path) -> float:
    cache: dict = {}
    qkv_rows = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    embed = np.full((VOCAB, HIDDEN), 0x3F80, np.uint16)
    norm = np.full(HIDDEN, 0x3F80, np.uint16)
    t0 = time.perf_counter()
    with nqf.Writer(path) as w:
        w.add_array("embed_tokens", embed)
        for i in range(LAYERS):
            w.add_array(f"layers.{i}.input_norm", norm)
            w.add_quantized(f"layers.{i}.qkv", _int4(qkv_rows, HIDDEN, cache))
            w.add_array(f"layers.{i}.qkv_bias", np.full(qkv_rows, 0x3F80, np.uint16))
            w.add_quantized(f"layers.{i}.o_proj", _int4(HIDDEN, HEADS * HEAD_DIM, cache))
            w.add_array(f"layers.{i}.post_attn_norm", norm)
            w.add_quantized(f"layers.{i}.gate_up", _int4(2 * INTER, HIDDEN, cache))
            w.add_quantized(f"layers.{i}.down", _int4(HIDDEN, INTER, cache))
        w.add_array("final_norm", norm)
        w.add_array("lm_head", embed)
        w.set_metadata(
            {
                "config": {"architecture": "qwen2", "hidden_size": HIDDEN, "num_hidden_layers": LAYERS},
                "tokenizer": "x" * 7_000_000,  # the size of Qwen2.5's tokenizer.json
                "chat_template": "{{ messages }}",
            }
        )
    return time.perf_counter() - t0


OPEN_PROBE = """
import sys, time, json
t0 = time.perf_counter()
import nanoqwen_format as nqf
t1 = time.perf_counter()
with nqf.open(sys.argv[1]) as f:
    n = len(f.records); cfg = f.config; tok = len(f.tokenizer_json)
t2 = time.perf_counter()
print(json.dumps({"open_s": t2 - t1, "tensors": n}))
"""


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def resident_bytes(path: Path) -> int | None:
    if shutil.which("fincore") is None:
        return None
    out = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return int(out[0])


def probe_open(path: Path) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", OPEN_PROBE, str(path)], capture_output=True, text=True, check=True
    ).stdout
    return json.loads(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None, help="folder for the 5.5 GB file (default: a temp folder)")
    ap.add_argument("--keep", action="store_true", help="keep the file")
    ap.add_argument("--reuse", action="store_true", help="reuse the file in --dir if it exists (with --keep)")
    ap.add_argument("--repeat", type=int, default=5, help="timed verify() passes")
    args = ap.parse_args()
    folder = Path(args.dir or tempfile.mkdtemp(prefix="nqf-bench-"))
    path = folder / "qwen7b-shaped.nanoqwen"
    print(f"load average before: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    try:
        if args.reuse and path.exists():
            print(f"reusing {path}")
        else:
            write_s = write_7b(path)
            size = path.stat().st_size
            print(f"file: {size / 1e9:.2f} GB, written in {write_s:.1f} s ({size / write_s / 1e9:.2f} GB/s)")
        size = path.stat().st_size

        cold = []
        for _ in range(3):
            drop_cache(path)
            before = resident_bytes(path)
            r = probe_open(path)
            cold.append((r["open_s"], before, resident_bytes(path)))
        print(
            "index read, cold cache: open() + records + metadata = "
            f"{statistics.median(c[0] for c in cold) * 1e3:.2f} ms median of 3; resident before/after: "
            + ", ".join(f"{b}/{a} bytes" for _, b, a in cold)
            + f" of {size}"
        )
        warm = [probe_open(path)["open_s"] for _ in range(5)]
        print(
            f"index read, warm cache: {statistics.median(warm) * 1e3:.2f} ms median of 5 "
            f"({r['tensors']} tensors, 7 MB tokenizer string)"
        )

        os.sched_setaffinity(0, {0})
        with nqf.open(path) as f:
            nbytes = f.verify()  # load the page cache
            times, cpu = [], []
            for _ in range(args.repeat):
                t0, c0 = time.perf_counter(), time.process_time()
                f.verify()
                times.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
        t, c = min(times), min(cpu)
        runs = ", ".join(f"{x:.2f}" for x in times)
        print(
            f"verify(), one core (CPU 0), warm cache: {nbytes / 1e9:.2f} GB in {t:.2f} s wall = "
            f"{nbytes / t / 1e9:.1f} GB/s (best of {args.repeat}; runs {runs} s); "
            f"{nbytes / c / 1e9:.1f} GB per CPU-second (process_time, robust to a busy machine)"
        )
        print(f"load average after: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    finally:
        if not args.keep:
            path.unlink(missing_ok=True)
            if args.dir is None:
                shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
