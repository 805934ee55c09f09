"""`nanoqwen-cli generate` and `nanoqwen-cli chat`: text generation from a .nanoqwen container.

generate MODEL (--prompt TEXT | --prompt - | --prompt-file PATH) [--chat] [--system TEXT]
         [--max-tokens N] [--temperature T] [--top-p P] [--top-k K] [--seed S] [--stop STR ...]
         [--device cpu|cuda] [--backend reference|engine] [--kv-memory SIZE] [--eager] [--no-overlap]
         [--max-model-len N] [--no-verify] [--dtype float32|bfloat16] [--threads N] [--speculate ngram[:K]]
         [--json]
    Streams the generated text to stdout as tokens arrive. The backend line (what runs, where, the CPU
    threads and why) and the statistics line (prompt tokens, generated tokens, TTFT, decode tok/s, and
    with speculation the drafted and accepted tokens and the acceptance rate) go to stderr, so stdout
    is only the text. With --json nothing streams: one JSON object is printed at the end
    {"text", "prompt_tokens", "generated_tokens", "ttft_s", "decode_tok_s", "finish_reason",
    "backend", "threads", "speculation", "drafted_tokens", "accepted_tokens", "acceptance_rate",
    "sampling"}. `--prompt -` (or `--prompt-file -`) reads the prompt from
    stdin; a prompt from a file or stdin is used byte for byte. Ctrl-C ends the line of partial text
    and exits 130.
chat MODEL [--system TEXT] [...same sampling/device options]
    A multi-turn REPL: each line is a user turn; `/reset` clears the history, `/exit`, end of input
    (Ctrl-D) or Ctrl-C at the prompt quits (exit 0). Ctrl-C during a reply stops it and returns to the
    prompt; the question and the partial reply stay in the history (a reply stopped before any text
    drops the question too). A line that is not UTF-8, or a turn the context cannot hold, is refused
    with one line and the session goes on with its history.

Sampling options left out take the container's `generation` defaults; `--temperature 0` is greedy.
Every option, and generate's prompt length, is checked before the weights are read (loading.py): the
container is opened and checked once, its tokenizer built once, and the weights read from that open
file last. On the CPU torch's threads follow `--threads`, OMP_NUM_THREADS or
nanoqwen_runtime.cpu_threads' rule (physical cores, affinity, cgroup quota, busy CPUs).
The backend is explicit and printed: `--device cuda` runs the CUDA engine and `--device cpu` the
plain-torch reference unless `--backend reference|engine` says otherwise (`--backend reference
--device cuda` runs the reference on the GPU). `--device cuda` without a GPU is an error (exit 1),
never a silent fall back to the CPU. Engine options: `--kv-memory SIZE` (KV pool, e.g. 8GiB; default
90% of the memory left after the weights), `--eager` (launch every kernel from Python instead of
replaying CUDA graphs; for debugging) and `--no-overlap` (read each decode step back before queuing
the next; by default the next step is queued first, so the host's work between steps runs while the
GPU computes, with the same tokens up to a near-tie: nanoqwen-runtime's engine.py). Every
tensor's checksum is checked while loading unless `--no-verify` is given. Errors are one line on
stderr (errors.py: exit 2 for the command line and the prompt, 1 for files, the model and the
machine). A request the model fails at run time (NaN/Inf logits: no token is sampled from them) ends
with its one-line error and exit 1, in chat too.

`--speculate ngram` (or `ngram:K`, K = 1..7 drafted tokens per step, default 4) or `off` sets
prompt-lookup speculative decoding (nanoqwen_runtime.speculative): tokens that followed an earlier
occurrence of the text's last few tokens are drafted and checked in one step, on either backend. Left
out, the backend's measured default (loading.DEFAULT_SPECULATION): ngram:4 on the CUDA engine, where
it gained on code edits and on new text; off on the CPU reference, where it gains on answers that copy
the prompt and loses on new text. The greedy output is
the same as without it (exactly on the reference backend; on the engine until a near-tie).
Speculation is off for temperature > 0: the greedy path is exact; sampled requests are not
speculated (the sampling line on stderr says so). `--no-prefix-cache` turns off prefix caching on
either backend (full KV blocks of a prompt prefix that several requests share are computed once);
the output is the same either way.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Annotated

import typer

from .errors import EXIT_USAGE, CliError, UsageError, debug_enabled, describe, say
from .inputs import decode_line, read_prompt, stdin_tolerant, text_arg
from .loading import (
    LoadOptions,
    check_max_model_len,
    check_sampling,
    describe_threads,
    load_backend,
    open_container,
    prompt_ids,
)
from .model_commands import resolve_model

ModelArg = Annotated[Path, typer.Argument(help="a .nanoqwen file, a GGUF file, an HF folder or an HF id "
                                               "(owner/name[:file.gguf|:QUANT][:recipe]); all but a "
                                               ".nanoqwen are packed into the model cache once "
                                               "(nanoqwen-cli list)", show_default=False)]
Prompt = Annotated[str | None, typer.Option("--prompt", "-p", help="prompt text; - reads it from stdin")]
PromptFile = Annotated[Path | None, typer.Option("--prompt-file", help="read the prompt from a file "
                                                 "(- for stdin), byte for byte; it must be UTF-8")]
MaxTokens = Annotated[int | None, typer.Option("--max-tokens", help="generated-token limit")]
Temperature = Annotated[float | None, typer.Option(help="0 = greedy (default: the container's)")]
TopP = Annotated[float | None, typer.Option("--top-p", help="nucleus mass in (0, 1]; 1 disables")]
TopK = Annotated[int | None, typer.Option("--top-k", help="keep the K most likely tokens; 0 disables")]
Seed = Annotated[int | None, typer.Option(help="sampling seed (reproducible runs)")]
Stop = Annotated[list[str] | None, typer.Option("--stop", help="stop string (repeatable)")]
Device = Annotated[str, typer.Option(help="cpu | cuda | cuda:N (cuda without a GPU is an error)")]
Backend = Annotated[str | None, typer.Option(help="reference (plain torch) | engine (CUDA engine, GPU only); "
                                                  "default: engine on cuda, reference on cpu")]
KvMemory = Annotated[str | None, typer.Option("--kv-memory", help="engine KV pool size, e.g. 8GiB "
                                              "(default: 90% of the GPU memory left after the weights)")]
Eager = Annotated[bool, typer.Option("--eager", help="engine: launch kernels eagerly instead of "
                                     "replaying CUDA graphs (debugging)")]
NoOverlap = Annotated[bool, typer.Option("--no-overlap", help="engine: read each decode step back before "
                                         "queuing the next (default: the next is queued first, so the "
                                         "host's per-step work overlaps the GPU's; the same tokens up to a "
                                         "near-tie)")]
MaxModelLen = Annotated[int | None, typer.Option("--max-model-len", help="tokens per sequence, prompt plus "
                                                 "generated (default: the model's context window)")]
NoPrefixCache = Annotated[bool, typer.Option("--no-prefix-cache", help="free KV blocks when a request "
                                             "ends instead of caching them for prompts that share a prefix")]
NoVerify = Annotated[bool, typer.Option("--no-verify", help="skip the checksum of every tensor at load "
                                        "(default: checked, a corrupt file is refused)")]
Dtype = Annotated[str | None, typer.Option(help="reference matmul dtype: float32 | bfloat16 "
                                                "(default float32 on cpu, bfloat16 on cuda)")]
SystemGenerate = Annotated[str | None, typer.Option(help="system message (needs --chat)")]
SystemChat = Annotated[str | None, typer.Option(help="system message opening the conversation "
                                                     "(kept by /reset)")]
Threads = Annotated[int | None, typer.Option(help="CPU threads for torch (default: the physical cores this "
                                                  "process may use, capped by the cgroup CPU quota and by "
                                                  "the cores other jobs keep busy: see the README)")]
Speculate = Annotated[str | None, typer.Option(help="prompt-lookup speculative decoding: ngram, ngram:K "
                                               "(K drafted tokens per step, 1..7; ngram = ngram:4) or off "
                                               "(the default); greedy requests only; it pays off when the "
                                               "answer copies the prompt (code edits)")]


def _finite(out: dict) -> dict:
    """NaN/Inf statistics (decode tok/s of a one-token answer) as null: JSON has no NaN."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in out.items()}


def _stats_line(result, speculation=None) -> str:
    """The statistics line; `speculation` (config, drafted, accepted) adds the drafted and accepted
    tokens and the acceptance rate."""
    spec = ""
    if speculation is not None:
        cfg, drafted, accepted = speculation
        rate = f"{100 * accepted / drafted:.0f}%" if drafted else "n/a"
        spec = f", speculation {cfg.spec()}: {drafted} drafted, {accepted} accepted ({rate})"
    return (f"[{result.prompt_tokens} prompt tokens, {result.generated_tokens} generated, "
            f"TTFT {result.ttft_s * 1000:.0f} ms, decode {result.decode_tok_s:.2f} tok/s{spec}, "
            f"finish: {result.finish_reason}]")


def _describe_params(p, spec=None) -> str:
    if p.greedy:
        mode = "greedy (temperature 0)"
    else:
        mode = f"temperature {p.temperature}, top_p {p.top_p}, top_k {p.top_k}, seed {p.seed}"
    out = f"sampling: {mode}, max_tokens {p.max_tokens}" + (f", stop {list(p.stop)}" if p.stop else "")
    if spec is not None:
        out += (f", speculation {spec.spec()}" if p.greedy else
                ", speculation off (temperature > 0: sampled requests are not speculated)")
    return out


class ModelRunError(CliError):
    """A request the model failed at run time (`GenerationResult.error`: NaN/Inf logits): exit 1."""


class Stopped(KeyboardInterrupt):
    """Ctrl-C during a reply; `text` is the part of it that was shown."""

    def __init__(self, text: str):
        super().__init__()
        self.text = text


def _reply(pipe, prompt: list[int], params, stream: bool):
    """Generate for one prompt; streams text to stdout when `stream`. Returns the GenerationResult;
    Ctrl-C raises `Stopped` with the text shown so far, the backend left ready for the next request."""
    shown: list[str] = []
    result = None
    events = pipe.stream([prompt], params)
    try:
        for ev in events:
            if ev.text:
                shown.append(ev.text)
                if stream:
                    sys.stdout.write(ev.text)
                    sys.stdout.flush()
            if ev.result is not None:
                result = ev.result
    except KeyboardInterrupt:
        events.close()  # Pipeline.stream ends the interrupted request in the backend
        raise Stopped("".join(shown)) from None
    return result


def generate(
    model: ModelArg,
    prompt: Prompt = None,
    prompt_file: PromptFile = None,
    chat: Annotated[bool, typer.Option("--chat", help="wrap the prompt in the chat template")] = False,
    system: SystemGenerate = None,
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
    no_overlap: NoOverlap = False,
    max_model_len: MaxModelLen = None,
    no_verify: NoVerify = False,
    no_prefix_cache: NoPrefixCache = False,
    dtype: Dtype = None,
    threads: Threads = None,
    speculate: Speculate = None,
    json_out: Annotated[bool, typer.Option("--json", help="print one JSON object at the end")] = False,
) -> None:
    """Generate text from a prompt (argument, file or stdin), streaming it, then print statistics."""
    if system is not None and not chat:
        raise UsageError("--system needs --chat (it is a chat-template message)")
    opts = LoadOptions(device=device, backend=backend, dtype=dtype, threads=threads, kv_memory=kv_memory,
                       eager=eager, max_model_len=max_model_len, verify=not no_verify, speculate=speculate,
                       prefix_cache=not no_prefix_cache, overlap=not no_overlap)
    opts.check()
    kw = check_sampling(temperature, top_p, top_k, max_tokens, seed, stop)
    text = read_prompt(prompt, prompt_file)
    if not text and not chat:
        raise UsageError("the prompt is empty (give some text, or --chat to send an empty user turn)")
    system = text_arg(system, "--system") if system is not None else None
    from nanoqwen_runtime.generate import Pipeline

    with open_container(resolve_model(model)) as f:  # opened and checked once; weights read last
        limit = check_max_model_len(f, opts.max_model_len)
        pipe = Pipeline.from_file(f, None)
        params = pipe.sampling_params(**kw)
        if chat:
            messages = [{"role": "system", "content": system}] if system is not None else []
            text = pipe.chat_prompt(messages + [{"role": "user", "content": text}])
        ids = prompt_ids(pipe, text, limit)  # a prompt too long is refused before the weights are read
        pipe.backend, threads = load_backend(f, opts, pipe.tokenizer)
    spec = opts.speculation() if params.greedy else None
    if not json_out:
        typer.echo(f"backend: {pipe.backend.name}" + (f"; {describe_threads(threads)}" if threads else ""),
                   err=True)
        typer.echo(_describe_params(params, opts.speculation()), err=True)
    before = spec_counts(pipe.backend)
    try:
        result = _reply(pipe, ids, params, stream=not json_out)
    except Stopped as stopped:
        if not json_out and stopped.text and not stopped.text.endswith("\n"):
            sys.stdout.write("\n")  # the shell prompt starts on a line of its own
            sys.stdout.flush()
        raise
    drafted, accepted = (a - b for a, b in zip(spec_counts(pipe.backend), before, strict=True))
    if json_out:
        out = {"text": result.text, **result.stats(), "backend": pipe.backend.name,
               "threads": threads.threads if threads else None,
               "speculation": spec.spec() if spec is not None else None,
               "drafted_tokens": drafted if spec is not None else None,
               "accepted_tokens": accepted if spec is not None else None,
               "acceptance_rate": round(accepted / drafted, 4) if spec is not None and drafted else None,
               "sampling": {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
                            "seed": params.seed, "max_tokens": params.max_tokens, "stop": list(params.stop)}}
        typer.echo(json.dumps(_finite(out), ensure_ascii=False, allow_nan=False))
    else:
        sys.stdout.write("\n")
        if result.error is None:
            typer.echo(_stats_line(result, (spec, drafted, accepted) if spec is not None else None), err=True)
    if result.error is not None:  # the model failed at run time (NaN/Inf logits): nothing garbled shown
        raise ModelRunError(result.error)


def spec_counts(backend) -> tuple[int, int]:
    """(drafted, accepted) tokens the backend's engine has counted so far (EngineStats; (0, 0) before
    its first run). A generate call has one run, so the difference around it is that run's."""
    stats = backend.stats()
    return (stats.spec_drafted_tokens, stats.spec_accepted_tokens) if stats is not None else (0, 0)


def _end_line(started: bool) -> None:
    if started:
        sys.stdout.write("\n")
    sys.stdout.flush()


def _read_turn(stdin_is_tty: bool) -> str | None:
    """The next input line; None to end the session (end of input, or Ctrl-C at the prompt)."""
    try:
        return input("you> ")
    except (EOFError, KeyboardInterrupt):
        if stdin_is_tty:
            sys.stdout.write("\n")
        return None


def chat(
    model: ModelArg,
    system: SystemChat = None,
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
    no_overlap: NoOverlap = False,
    max_model_len: MaxModelLen = None,
    no_verify: NoVerify = False,
    no_prefix_cache: NoPrefixCache = False,
    dtype: Dtype = None,
    threads: Threads = None,
    speculate: Speculate = None,
) -> None:
    """Multi-turn chat in the terminal: one line per turn, /reset clears the history, /exit quits.

    Ctrl-C during a reply stops it and returns to the prompt (the partial reply stays in the history);
    Ctrl-C at the prompt, or Ctrl-D, quits. A line that is not UTF-8 is refused and the session goes on.
    """
    opts = LoadOptions(device=device, backend=backend, dtype=dtype, threads=threads, kv_memory=kv_memory,
                       eager=eager, max_model_len=max_model_len, verify=not no_verify, speculate=speculate,
                       prefix_cache=not no_prefix_cache, overlap=not no_overlap)
    opts.check()
    kw = check_sampling(temperature, top_p, top_k, max_tokens, seed, stop)
    system = text_arg(system, "--system") if system is not None else None
    from nanoqwen_runtime.generate import Pipeline

    with open_container(resolve_model(model)) as f:  # opened and checked once; weights read last
        check_max_model_len(f, opts.max_model_len)
        pipe = Pipeline.from_file(f, None)
        params = pipe.sampling_params(**kw)
        pipe.backend, threads = load_backend(f, opts, pipe.tokenizer)
    typer.echo(f"backend: {pipe.backend.name}" + (f"; {describe_threads(threads)}" if threads else ""),
               err=True)
    typer.echo(_describe_params(params, opts.speculation()) + "  (/reset clears the history, /exit or "
               "Ctrl-D quits, Ctrl-C stops a reply)", err=True)
    base = [{"role": "system", "content": system}] if system is not None else []
    history = list(base)
    stdin_tolerant()
    tty = sys.stdin.isatty()
    while (line := _read_turn(tty)) is not None:
        try:
            line = decode_line(line)
        except UsageError as e:
            say(f"{e}; not sent (the session goes on)")
            continue
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
        started = False  # "assistant> " is on the screen
        try:
            ids = prompt_ids(pipe, pipe.chat_prompt(history))
            sys.stdout.write("assistant> ")
            started = True
            result = _reply(pipe, ids, params, stream=True)
        except KeyboardInterrupt as stop:  # Stopped during the reply, or Ctrl-C just before it
            partial = getattr(stop, "text", "")
            _end_line(started)
            if partial:
                history.append({"role": "assistant", "content": partial})
                typer.echo("(stopped; the partial reply is kept in the history)", err=True)
            else:
                history.pop()
                typer.echo("(stopped before any text; the question is dropped from the history)", err=True)
            continue
        except Exception as e:
            failure = describe(e)
            if failure is None or failure.exit_code != EXIT_USAGE or debug_enabled():
                _end_line(started)
                raise  # the model or the machine failed: errors.py ends the session with one line
            _end_line(started)
            history.pop()
            say(f"{failure.message}; this turn is dropped (/reset clears the history)")
            continue
        sys.stdout.write("\n")
        sys.stdout.flush()
        if result.error is not None:  # the model failed at run time: the session ends (exit 1)
            raise ModelRunError(result.error)
        typer.echo(_stats_line(result), err=True)
        history.append({"role": "assistant", "content": result.text})
