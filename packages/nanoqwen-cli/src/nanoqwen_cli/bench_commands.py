"""`nanoqwen-cli bench`: the CUDA engine benchmark (decode/prefill tok/s, TTFT, graph vs eager, bytes
per token against the copy bandwidth measured in the same run, kernels per step).

    nanoqwen-cli bench                         synthetic Qwen2.5-Coder-7B geometry built on the GPU
    nanoqwen-cli bench --model m.nanoqwen      a given container
    nanoqwen-cli bench --out bench/engine      where bench.json, bench.md and the plots go

Needs a Hopper GPU; on a machine without one it exits 1 with that reason (no CPU fallback).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def bench(
    model: Annotated[Path | None, typer.Option(help="a .nanoqwen container (default: synthetic 7B)")] = None,
    out: Annotated[Path, typer.Option(help="output folder for bench.json, bench.md, plots")] = Path(
        "bench/engine"),
    kv_memory: Annotated[str, typer.Option(help="KV pool size, e.g. 24GiB")] = "24GiB",
    quick: Annotated[bool, typer.Option(help="skip the 32K context (a faster smoke run)")] = False,
    load_test: Annotated[Path | None, typer.Option(
        help="folder where a synthetic container is written to time loading (removed afterwards)")] = None,
) -> None:
    """Benchmark the CUDA engine end to end on one GPU."""
    import torch

    if not torch.cuda.is_available():
        typer.echo("nanoqwen-cli bench needs a CUDA GPU (sm_90); none is available here", err=True)
        raise typer.Exit(1)
    from nanoqwen_runtime.engine.bench import run_bench
    from nanoqwen_runtime.engine.config import parse_bytes

    res = run_bench(model=str(model) if model else None, out_dir=out, kv_memory=parse_bytes(kv_memory),
                    quick=quick, log=lambda s: typer.echo(s, err=True), load_test_dir=load_test)
    typer.echo((out / "bench.md").read_text())
    bw = res["copy_bandwidth_GBps"]
    typer.echo(f"wrote {out}/bench.json, bench.md and plots; copy bandwidth {bw:.0f} GB/s")
