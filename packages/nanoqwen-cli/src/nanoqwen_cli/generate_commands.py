"""`nanoqwen-cli generate` and `nanoqwen-cli chat`: text generation from a .nanoqwen container.

generate MODEL --prompt TEXT [--chat] [--system TEXT] [--max-tokens N] [--temperature T] [--top-p P]
         [--top-k K] [--seed S] [--stop STR ...] [--device cpu|cuda] [--backend reference|engine]
         [--kv-memory SIZE] [--eager] [--dtype float32|bfloat16] [--threads N] [--json]
    Streams the generated text to stdout as tokens arrive. The backend line (what runs, where) and the
    statistics line (prompt tokens, generated tokens, TTFT, decode tok/s) go to stderr, so stdout is
    only the text. With --json nothing streams: one JSON object is printed at the end
    {"text", "prompt_tokens", "generated_tokens", "ttft_s", "decode_tok_s", "finish_reason",
    "backend", "sampling"}.
chat MODEL [--system TEXT] [...same sampling/device options]
    A multi-turn REPL: each line is a user turn; `/reset` clears the history, `/exit` or end of input
    quits.

Sampling options left out take the container's `generation` defaults; `--temperature 0` is greedy.
The backend is explicit and printed: `--device cuda` runs the CUDA engine and `--device cpu` the
plain-torch reference unless `--backend reference|engine` says otherwise (`--backend reference
--device cuda` runs the reference on the GPU). `--device cuda` without a GPU is an error (exit 2),
never a silent fall back to the CPU. Engine options: `--kv-memory SIZE` (KV pool, e.g. 8GiB; default
90% of the memory left after the weights) and `--eager` (launch every kernel from Python instead of
replaying CUDA graphs; for debugging). Bad
options (a negative temperature, a prompt longer than the context) exit 2 with a one-line message.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

DTYPES = ("float32", "bfloat16")
BACKENDS = ("reference", "engine")

ModelArg = Annotated[Path, typer.Argument(exists=True, dir_okay=False, help=".nanoqwen container")]
MaxTokens = Annotated[int | None, typer.Option("--max-tokens", help="generated-token limit")]
Temperature = Annotated[float | None, typer.Option(help="0 = greedy (default: the container's)")]
TopP = Annotated[float | None, typer.Option("--top-p", help="nucleus mass in (0, 1]; 1 disables")]
TopK = Annotated[int | None, typer.Option("--top-k", help="keep the K most likely tokens; 0 disables")]
Seed = Annotated[int | None, typer.Option(help="sampling seed (reproducible runs)")]
Stop = Annotated[list[str] | None, typer.Option("--stop", help="stop string (repeatable)")]
Device = Annotated[str, typer.Option(help="cpu | cuda (cuda without a GPU is an error)")]
Backend = Annotated[str | None, typer.Option(help="reference (plain torch) | engine (CUDA engine, GPU only); "
                                                  "default: engine on cuda, reference on cpu")]
KvMemory = Annotated[str | None, typer.Option("--kv-memory", help="engine KV pool size, e.g. 8GiB "
                                              "(default: 90% of the GPU memory left after the weights)")]
Eager = Annotated[bool, typer.Option("--eager", help="engine: launch kernels eagerly instead of "
                                     "replaying CUDA graphs (debugging)")]
Dtype = Annotated[str | None, typer.Option(help="reference matmul dtype: float32 | bfloat16 "
                                                "(default float32 on cpu, bfloat16 on cuda)")]
System = Annotated[str | None, typer.Option(help="system message (with --chat)")]
Threads = Annotated[int | None, typer.Option(help="CPU threads for torch (default: torch's, one per core)")]


def _fail(msg: str) -> typer.Exit:
    typer.echo(f"error: {msg}", err=True)
    return typer.Exit(2)


def _load(model: Path, device: str, backend: str | None, dtype: str | None, threads: int | None = None,
          kv_memory: str | None = None, eager: bool = False):
    """Build the Pipeline for the chosen backend; every refusal becomes a clear one-line error.

    `backend=None` means the device's backend: the engine on cuda, the reference on cpu."""
    import torch

    if threads is not None:
        if threads < 1:
            raise _fail(f"--threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
    from nanoqwen_runtime.backend import BackendError, ReferenceBackend, resolve_device
    from nanoqwen_runtime.generate import Pipeline

    if backend is None:
        backend = "engine" if device.startswith("cuda") else "reference"
    if backend not in BACKENDS:
        raise _fail(f"--backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if dtype is not None and dtype not in DTYPES:
        raise _fail(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if backend != "engine" and (kv_memory is not None or eager):
        raise _fail("--kv-memory and --eager are engine options (--device cuda or --backend engine)")
    try:
        dev = resolve_device(device)
        if backend == "engine":
            if dev.type != "cuda":
                raise _fail("--backend engine runs on a CUDA GPU only; use --device cuda")
            from nanoqwen_runtime.engine.backend import EngineBackend
            from nanoqwen_runtime.engine.config import EngineConfig, parse_bytes

            try:
                cfg = EngineConfig(mode="eager" if eager else "graph",
                                   kv_memory_bytes=parse_bytes(kv_memory) if kv_memory else None)
            except ValueError as e:
                raise _fail(str(e)) from None
            return Pipeline.from_container(model, EngineBackend.from_file(model, cfg))
        name = dtype or ("bfloat16" if dev.type == "cuda" else "float32")
        ref = ReferenceBackend.from_file(model, device=device, dtype=getattr(torch, name))
        return Pipeline.from_container(model, ref)
    except BackendError as e:
        raise _fail(str(e)) from None


def _params(pipe, **kw):
    from nanoqwen_runtime.sampling import SamplingError

    try:
        return pipe.sampling_params(**kw)
    except SamplingError as e:
        raise _fail(str(e)) from None


def _check_options(temperature, top_p, top_k, max_tokens, seed, stop) -> dict:
    """Validate sampling options before the (slow) model load, so mistakes fail fast."""
    from nanoqwen_runtime.sampling import SamplingError, SamplingParams

    kw = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "max_tokens": max_tokens, "seed": seed,
          "stop": tuple(stop) if stop else None}
    try:
        SamplingParams(**{k: v for k, v in kw.items() if v is not None})
    except SamplingError as e:
        raise _fail(str(e)) from None
    return kw


def _stats_line(result) -> str:
    return (f"[{result.prompt_tokens} prompt tokens, {result.generated_tokens} generated, "
            f"TTFT {result.ttft_s * 1000:.0f} ms, decode {result.decode_tok_s:.2f} tok/s, "
            f"finish: {result.finish_reason}]")


def _describe_params(p) -> str:
    if p.greedy:
        mode = "greedy (temperature 0)"
    else:
        mode = f"temperature {p.temperature}, top_p {p.top_p}, top_k {p.top_k}, seed {p.seed}"
    return f"sampling: {mode}, max_tokens {p.max_tokens}" + (f", stop {list(p.stop)}" if p.stop else "")


def _run_one(pipe, prompt: str, params, stream: bool):
    """Generate for one prompt; streams text to stdout when `stream`. Returns the GenerationResult."""
    from nanoqwen_runtime.backend import ContextLengthError

    result = None
    try:
        for ev in pipe.stream([prompt], params):
            if stream and ev.text:
                sys.stdout.write(ev.text)
                sys.stdout.flush()
            if ev.result is not None:
                result = ev.result
    except ContextLengthError as e:
        raise _fail(str(e)) from None
    return result


def generate(
    model: ModelArg,
    prompt: Annotated[str, typer.Option("--prompt", "-p", help="prompt text")],
    chat: Annotated[bool, typer.Option("--chat", help="wrap the prompt in the chat template")] = False,
    system: System = None,
    max_tokens: MaxTokens = None,
    temperature: Temperature = None,
    top_p: TopP = None,
    top_k: TopK = None,
    seed: Seed = None,
    stop: Stop = None,
    device: Device = "cpu",
    backend: Backend = None,
    kv_memory: KvMemory = None,
    eager: Eager = False,
    dtype: Dtype = None,
    threads: Threads = None,
    json_out: Annotated[bool, typer.Option("--json", help="print one JSON object at the end")] = False,
) -> None:
    """Generate text from a prompt, streaming it, then print statistics."""
    if system is not None and not chat:
        raise _fail("--system needs --chat (it is a chat-template message)")
    kw = _check_options(temperature, top_p, top_k, max_tokens, seed, stop)
    pipe = _load(model, device, backend, dtype, threads, kv_memory, eager)
    params = _params(pipe, **kw)
    text = prompt
    if chat:
        messages = ([{"role": "system", "content": system}] if system is not None else [])
        text = pipe.chat_prompt(messages + [{"role": "user", "content": prompt}])
    if not json_out:
        typer.echo(f"backend: {pipe.backend.name}", err=True)
        typer.echo(_describe_params(params), err=True)
    result = _run_one(pipe, text, params, stream=not json_out)
    if json_out:
        out = {"text": result.text, **result.stats(), "backend": pipe.backend.name,
               "sampling": {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
                            "seed": params.seed, "max_tokens": params.max_tokens, "stop": list(params.stop)}}
        typer.echo(json.dumps(out, ensure_ascii=False))
    else:
        sys.stdout.write("\n")
        typer.echo(_stats_line(result), err=True)


def chat(
    model: ModelArg,
    system: System = None,
    max_tokens: MaxTokens = None,
    temperature: Temperature = None,
    top_p: TopP = None,
    top_k: TopK = None,
    seed: Seed = None,
    stop: Stop = None,
    device: Device = "cpu",
    backend: Backend = None,
    kv_memory: KvMemory = None,
    eager: Eager = False,
    dtype: Dtype = None,
    threads: Threads = None,
) -> None:
    """Multi-turn chat in the terminal (/reset clears the history, /exit quits)."""
    kw = _check_options(temperature, top_p, top_k, max_tokens, seed, stop)
    pipe = _load(model, device, backend, dtype, threads, kv_memory, eager)
    params = _params(pipe, **kw)
    typer.echo(f"backend: {pipe.backend.name}", err=True)
    typer.echo(_describe_params(params) + "  (/reset clears the history, /exit quits)", err=True)
    base = [{"role": "system", "content": system}] if system is not None else []
    history = list(base)
    while True:
        try:
            line = input("you> ")
        except EOFError:
            break
        cmd = line.strip()
        if cmd in ("/exit", "/quit"):
            break
        if cmd == "/reset":
            history = list(base)
            typer.echo("(history cleared)", err=True)
            continue
        if not cmd:
            continue
        history.append({"role": "user", "content": line})
        sys.stdout.write("assistant> ")
        result = _run_one(pipe, pipe.chat_prompt(history), params, stream=True)
        sys.stdout.write("\n")
        sys.stdout.flush()
        typer.echo(_stats_line(result), err=True)
        history.append({"role": "assistant", "content": result.text})
