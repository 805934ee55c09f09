"""`nanoqwen-cli bench`: the CUDA engine benchmark on one GPU (decode/prefill tok/s, TTFT, graph vs eager,
GPU memory, bytes per token against the read bandwidth measured in the same run, time per op).

    nanoqwen-cli bench                         synthetic Qwen2.5-Coder-7B geometry built on the GPU
    nanoqwen-cli bench --model m.nanoqwen      a given container
    nanoqwen-cli bench --out bench/engine      where bench.json, bench.md and the plots go

Needs a Hopper GPU; on a machine without one it exits 1 with that reason (no CPU fallback). The
options and the --model file are checked first (a GGUF or an HF folder gets the command that packs
it); nothing is written before the GPU is found.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .errors import CliError, UsageError
from .inputs import check_model_path


def bench(
    model: Annotated[Path | None, typer.Option(help="a .nanoqwen container (default: synthetic 7B weights "
                                                    "built on the GPU)")] = None,
    out: Annotated[Path, typer.Option(help="output folder for bench.json, bench.md, plots")] = Path(
        "bench/engine"),
    kv_memory: Annotated[str, typer.Option(help="KV pool size, e.g. 24GiB")] = "24GiB",
    quick: Annotated[bool, typer.Option(help="skip the 32K context (a faster smoke run)")] = False,
    load_test: Annotated[Path | None, typer.Option(
        help="folder where a synthetic container is written to time loading (removed afterwards)")] = None,
    profile_steps: Annotated[int, typer.Option(help="eager decode steps timed op by op")] = 5,
) -> None:
    """Benchmark the CUDA engine end to end on one GPU.

    Measured in one run: the read-only bandwidth (a kernel reading 4 GiB: the
    roofline of every decode figure), the copy bandwidth beside it; GPU memory
    (container, weights on the GPU with the bf16 cache, KV pool, workspace,
    CUDA graphs, peak); batch-1 decode at contexts 128 / 4K / 32K (graph replay,
    engine wall time, bytes per token, fraction of the read roofline); decode
    at batch 1 / 8 / 32 / 64; prefill 512 / 4096 and the TTFT of a 2K prompt;
    graph vs eager; time, bytes and bandwidth of each op of an eager decode
    step from CUDA events, launches per step.

    Writes bench.json, bench.md and two plots into --out and prints the
    markdown. Exits 1 if any section failed (the rest is still written).
    """
    if profile_steps < 1:
        raise UsageError(f"--profile-steps must be >= 1, got {profile_steps}")
    if model is not None:
        check_model_path(model)
    from nanoqwen_runtime.engine.config import parse_bytes

    try:
        kv_bytes = parse_bytes(kv_memory)
    except ValueError as e:
        raise UsageError(f"--kv-memory: {e}") from None
    import torch

    if not torch.cuda.is_available():
        raise CliError("nanoqwen-cli bench needs a CUDA GPU (sm_90); none is available here")
    from nanoqwen_runtime.engine.bench import run_bench

    rep = run_bench(model=str(model) if model else None, out_dir=out, kv_memory=kv_bytes,
                    quick=quick, log=lambda s: typer.echo(s, err=True), load_test_dir=load_test,
                    profile_steps=profile_steps)
    typer.echo((out / "bench.md").read_text())
    bw = ", ".join(f"{name} {rep[key]:.0f} GB/s" for name, key in
                   (("read", "read_bandwidth_GBps"), ("copy", "copy_bandwidth_GBps")) if rep.get(key))
    errors = rep.get("errors") or {}
    typer.echo(f"wrote {out}/bench.json, bench.md and plots; {bw or 'no bandwidth measured'}"
               + (f"; {len(errors)} section(s) failed: {', '.join(errors)}" if errors else ""))
    if errors:
        raise typer.Exit(1)
