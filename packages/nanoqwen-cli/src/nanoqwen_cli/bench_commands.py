"""`nanoqwen-cli bench`: the CUDA engine benchmark on one GPU (decode/prefill tok/s, TTFT, graph vs eager,
GPU memory, bytes per token against the read bandwidth measured in the same run, time per op).

    nanoqwen-cli bench                         synthetic Qwen2.5-Coder-7B geometry built on the GPU
    nanoqwen-cli bench --geometry 1.5b         the same for the 1.5B (or 0.5b) geometry
    nanoqwen-cli bench --model m.nanoqwen      a given container
    nanoqwen-cli bench --out bench/out/engine  where bench.json, bench.md and the plots go
    nanoqwen-cli bench --model m.nanoqwen --workload code-edit --workload free-form [--speculate ngram:K]
        [--prompts 16] [--max-tokens 256]
    nanoqwen-cli bench --model m.nanoqwen --workload autocomplete [--cache-reuse N]
                                               prompt-lookup speculation off vs on on real prompts
                                               (nanoqwen_bench.engine.bench_workload):
                                               workload-<name>.json/.md

Needs a Hopper GPU; on a machine without one it exits 1 with that reason (no CPU fallback). The
options and the --model file are checked first (a GGUF or an HF folder gets the command that packs
it); nothing is written before the GPU is found. With --workload only the workload benchmark runs
(it needs --model: a workload on random weights means nothing); --speculate picks its speculative
side (default `ngram`), and is an error without --workload (the engine sections run without it).

The benchmark itself is nanoqwen-bench's (`nanoqwen_bench.engine`), imported only when the command
runs, so that `nanoqwen-cli --help` and the other commands do not load it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .errors import CliError, UsageError
from .inputs import check_model_path

# nanoqwen_bench.workloads.WORKLOADS (no import at startup), and autocomplete
# (nanoqwen_bench.engine.bench_autocomplete)
WORKLOAD_NAMES = ("code-edit", "free-form", "autocomplete")


def bench(
    model: Annotated[Path | None, typer.Option(help="a .nanoqwen container (default: synthetic 7B weights "
                                                    "built on the GPU)")] = None,
    geometry: Annotated[str, typer.Option(
        help="without --model: the synthetic weights' geometry, 7b | 1.5b | 0.5b (Qwen2.5-Coder)")] = "7b",
    out: Annotated[Path, typer.Option(help="output folder for bench.json, bench.md, plots")] = Path(
        "bench/out/engine"),
    kv_memory: Annotated[str, typer.Option(help="KV pool size, e.g. 24GiB")] = "24GiB",
    quick: Annotated[bool, typer.Option(help="skip the 32K context (a faster smoke run)")] = False,
    load_test: Annotated[Path | None, typer.Option(
        help="folder where a synthetic container is written to time loading (removed afterwards)")] = None,
    profile_steps: Annotated[int, typer.Option(help="eager decode steps timed op by op")] = 5,
    features_off: Annotated[bool, typer.Option(
        "--features-off", help="engine sections with prefix caching and speculation off (the baseline "
                               "they must not regress; on by default)")] = False,
    workload: Annotated[list[str] | None, typer.Option(
        help="run a workload instead of the engine sections, speculation off vs on (repeatable): "
             "code-edit | free-form; needs --model")] = None,
    speculate: Annotated[str | None, typer.Option(
        help="--workload: the speculative side, ngram or ngram:K (K drafted tokens per step, 1..7; "
             "default ngram = ngram:4)")] = None,
    prompts: Annotated[int | None, typer.Option(help="--workload: prompts per workload (default 16)")] = None,
    max_tokens: Annotated[int | None, typer.Option(
        "--max-tokens", help="--workload: generated-token limit per prompt (default 256)")] = None,
    cache_reuse: Annotated[int | None, typer.Option(
        "--cache-reuse", help="--workload autocomplete: reuse cached K/V at shifted positions for runs of at "
                              "least this many tokens, as serve's --cache-reuse (default 0: off)")] = None,
    only: Annotated[str | None, typer.Option(
        help="run only these sections, comma-separated, as bench.json names them (e.g. "
             "decode_ctx128,overlap_ab,lm_head_ab); the bandwidths always run")] = None,
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
    --only runs some sections only (a name no section has is such a failure).

    --workload code-edit|free-form (with --model) runs the workload benchmark
    instead: each prompt alone, greedy, speculation off then on, tok/s, the
    ratio, acceptance rate, mean accepted length and how many outputs agree;
    writes workload-<name>.json and .md into --out. --workload autocomplete
    replays a user typing down a file (fill-in-the-middle requests, half of
    them cancelled after 5 tokens): TTFT and time to last token p50/p95, the
    share of prompt tokens served from the prefix cache; --prompts is its
    number of requests (default 32), --max-tokens its budget (default 48),
    --cache-reuse the engine's shifted reuse as `serve --cache-reuse`;
    writes autocomplete.json and .md.
    """
    if profile_steps < 1:
        raise UsageError(f"--profile-steps must be >= 1, got {profile_steps}")
    from nanoqwen_model import QWEN25_CODER_GEOMETRIES

    if geometry not in QWEN25_CODER_GEOMETRIES:
        raise UsageError(f"--geometry must be one of {', '.join(QWEN25_CODER_GEOMETRIES)}, got {geometry!r}")
    if model is not None and geometry != "7b":
        raise UsageError("--geometry picks synthetic weights; --model's container has its own geometry")
    sections = None
    if only is not None:
        sections = frozenset(name.strip() for name in only.split(","))
        if "" in sections:
            raise UsageError(f"--only: an empty section name in {only!r}")
        if workload:
            raise UsageError("--only selects engine sections; --workload runs none")
    spec = _check_workload_options(model, workload, speculate, prompts, max_tokens)
    if cache_reuse is not None:
        if "autocomplete" not in (workload or []):
            raise UsageError("--cache-reuse is an option of --workload autocomplete")
        if cache_reuse < 0:
            raise UsageError(f"--cache-reuse must be >= 0 (0: off), got {cache_reuse}")
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
    if workload:
        if "autocomplete" in workload:
            _run_autocomplete(model, out, kv_bytes, prompts or 32, max_tokens or 48, cache_reuse or 0)
        rest = [w for w in dict.fromkeys(workload) if w != "autocomplete"]
        if rest:
            _run_workloads(model, out, kv_bytes, rest, spec, prompts or 16, max_tokens or 256)
        return
    from nanoqwen_bench.engine.bench import run_bench

    rep = run_bench(model=str(model) if model else None, out_dir=out, kv_memory=kv_bytes,
                    geometry=QWEN25_CODER_GEOMETRIES[geometry], quick=quick,
                    log=lambda s: typer.echo(s, err=True), load_test_dir=load_test,
                    profile_steps=profile_steps, features=not features_off, only=sections)
    typer.echo((out / "bench.md").read_text())
    bw = ", ".join(f"{name} {rep[key]:.0f} GB/s" for name, key in
                   (("read", "read_bandwidth_GBps"), ("copy", "copy_bandwidth_GBps")) if rep.get(key))
    errors = rep.get("errors") or {}
    typer.echo(f"wrote {out}/bench.json, bench.md and plots; {bw or 'no bandwidth measured'}"
               + (f"; {len(errors)} section(s) failed: {', '.join(errors)}" if errors else ""))
    if errors:
        raise typer.Exit(1)


def _check_workload_options(model, workload, speculate, prompts, max_tokens):
    """Refuse bad --workload/--speculate/--prompts/--max-tokens values and combinations (exit 2);
    the speculative side's SpeculationConfig when --workload is given."""
    if not workload:
        for flag, value in (("--speculate", speculate), ("--prompts", prompts), ("--max-tokens", max_tokens)):
            if value is not None:
                raise UsageError(f"{flag} is a --workload option (the engine sections run without "
                                 "speculation)")
        return None
    bad = [w for w in workload if w not in WORKLOAD_NAMES]
    if bad:
        raise UsageError(f"--workload must be one of {', '.join(WORKLOAD_NAMES)}, got {bad[0]!r}")
    if model is None:
        raise UsageError("--workload needs --model (a real .nanoqwen container): a workload on random "
                         "weights means nothing")
    if prompts is not None and prompts < 1:
        raise UsageError(f"--prompts must be >= 1, got {prompts}")
    if max_tokens is not None and max_tokens < 1:
        raise UsageError(f"--max-tokens must be >= 1, got {max_tokens}")
    from nanoqwen_runtime.speculative import SpeculationConfig

    try:
        spec = SpeculationConfig.parse("ngram" if speculate is None else speculate)
    except ValueError as e:
        raise UsageError(f"--speculate: {e}") from None
    if spec is None:
        raise UsageError("--speculate off leaves --workload nothing to compare (it runs speculation off "
                         "and on); give ngram or ngram:K")
    return spec


def _run_autocomplete(model: Path, out: Path, kv_bytes: int, n_requests: int, max_tokens: int,
                      cache_reuse: int) -> None:
    """The autocomplete latency workload (nanoqwen_bench.engine.bench_autocomplete) on the CUDA engine."""
    from nanoqwen_bench.engine.bench_autocomplete import run_autocomplete
    from nanoqwen_runtime import Tokenizer
    from nanoqwen_runtime.engine.config import EngineConfig
    from nanoqwen_runtime.engine.engine import Engine

    engine = Engine.from_file(model, EngineConfig(kv_memory_bytes=kv_bytes, cache_reuse=cache_reuse))
    rep = run_autocomplete(engine, Tokenizer.from_file(model), out, n_requests=n_requests,
                           max_tokens=max_tokens,
                           model=str(model), log=lambda s: typer.echo(s, err=True))
    typer.echo((out / "autocomplete.md").read_text())
    s = rep["summary"]
    typer.echo(f"wrote {out}/autocomplete.json and .md; warm time to last token p50 "
               f"{s['ttlt_completed']['p50_ms']} ms, cache share {s['cache_share_warm']}")


def _run_workloads(model: Path, out: Path, kv_bytes: int, workloads: list[str], spec, n_prompts: int,
                   max_tokens: int) -> None:
    from nanoqwen_bench.engine.bench_workload import run_workload_bench
    from nanoqwen_runtime.engine.config import EngineConfig

    reports = run_workload_bench(model, out, workloads, config=EngineConfig(kv_memory_bytes=kv_bytes),
                                 n_prompts=n_prompts, max_tokens=max_tokens, speculation=spec,
                                 log=lambda s: typer.echo(s, err=True))
    for name in reports:
        typer.echo((out / f"workload-{name}.md").read_text())
    typer.echo(f"wrote {', '.join(f'{out}/workload-{n}.json' for n in reports)} and the .md beside each; "
               + "; ".join(f"{n} {r['speedup']:.2f}x (goal {r['goal']}x "
                           f"{'met' if r['goal_met'] else 'NOT met'})" for n, r in reports.items()))
