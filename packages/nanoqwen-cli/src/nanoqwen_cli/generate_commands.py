"""`nanoqwen-cli generate` and `nanoqwen-cli chat`: text generation from a .nanoqwen container.

generate MODEL (--prompt TEXT | --prompt - | --prompt-file PATH) [--chat] [--system TEXT]
         [--max-tokens N] [--temperature T] [--top-p P] [--top-k K] [--seed S] [--stop STR ...]
         [--device cpu|cuda] [--backend reference|engine] [--kv-memory SIZE] [--eager] [--no-overlap]
         [--max-model-len N] [--no-verify] [--dtype float32|bfloat16] [--threads N] [--speculate ngram[:K]]
         [--json]
    Streams the generated text to stdout as tokens arrive. The backend line (what runs, where) and the
    statistics line (prompt tokens, generated tokens, TTFT, decode tok/s) go to stderr, so stdout is
    only the text. With --json nothing streams: one JSON object is printed at the end
    {"text", "prompt_tokens", "generated_tokens", "ttft_s", "decode_tok_s", "finish_reason",
    "backend", "speculation", "sampling"}. `--prompt -` (or `--prompt-file -`) reads the prompt from
    stdin; a prompt from a file or stdin is used byte for byte. Ctrl-C ends the line of partial text
    and exits 130.
chat MODEL [--system TEXT] [...same sampling/device options]
    A multi-turn REPL: each line is a user turn; `/reset` clears the history, `/exit`, end of input
    (Ctrl-D) or Ctrl-C at the prompt quits (exit 0). Ctrl-C during a reply stops it and returns to the
    prompt; the question and the partial reply stay in the history (a reply stopped before any text
    drops the question too). A line that is not UTF-8, or a turn the context cannot hold, is refused
    with one line and the session goes on with its history.

Sampling options left out take the container's `generation` defaults; `--temperature 0` is greedy.
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

`--speculate ngram` (or `ngram:K`, K = 1..7 drafted tokens per step, default 4) turns on prompt-lookup
speculative decoding (nanoqwen_runtime.speculative): tokens that followed an earlier occurrence of the
text's last few tokens are drafted and checked in one step, on either backend. The greedy output is
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
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from .errors import EXIT_USAGE, CliError, UsageError, debug_enabled, describe, say
from .inputs import decode_line, read_prompt, stdin_tolerant, text_arg
from .model_commands import resolve_model

DTYPES = ("float32", "bfloat16")
BACKENDS = ("reference", "engine")

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
Threads = Annotated[int | None, typer.Option(help="CPU threads for torch (default: torch's, one per core)")]
Speculate = Annotated[str | None, typer.Option(help="prompt-lookup speculative decoding: ngram or ngram:K "
                                               "(K drafted tokens per step, 1..7; ngram = ngram:4); off by "
                                               "default; greedy requests only")]


@dataclass(frozen=True)
class LoadOptions:
    """How to build the backend: the device/backend options shared by generate and chat."""

    device: str = "cpu"
    backend: str | None = None       # None: engine on cuda, reference on cpu
    dtype: str | None = None         # reference matmul dtype
    threads: int | None = None
    kv_memory: str | None = None     # engine
    eager: bool = False              # engine
    overlap: bool = True             # engine: EngineConfig.overlap (--no-overlap)
    max_model_len: int | None = None
    verify: bool = True
    speculate: str | None = None     # --speculate text; None or "off": no speculation
    prefix_cache: bool = True        # prefix caching of either backend (--no-prefix-cache)

    def resolved_backend(self) -> str:
        return self.backend or ("engine" if self.device.startswith("cuda") else "reference")

    def check(self) -> None:
        """Refuse bad values and combinations (exit 2) before anything is loaded."""
        dev = self.device
        if dev != "cpu" and not (dev == "cuda" or (dev.startswith("cuda:") and dev[5:].isdigit())):
            raise UsageError(f"--device must be cpu, cuda or cuda:N, got {dev!r}")
        if self.backend is not None and self.backend not in BACKENDS:
            raise UsageError(f"--backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise UsageError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.threads is not None and self.threads < 1:
            raise UsageError(f"--threads must be >= 1, got {self.threads}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise UsageError(f"--max-model-len must be >= 2, got {self.max_model_len}")
        backend = self.resolved_backend()
        if backend != "engine" and (self.kv_memory is not None or self.eager or not self.overlap):
            raise UsageError("--kv-memory, --eager and --no-overlap are engine options (--device cuda or "
                             "--backend engine)")
        if backend == "engine" and not dev.startswith("cuda"):
            raise UsageError("--backend engine runs on a CUDA GPU only; use --device cuda")
        self.speculation()

    def speculation(self):
        """The --speculate value as a `SpeculationConfig` (None: off); a bad value is a UsageError."""
        from nanoqwen_runtime.speculative import SpeculationConfig

        try:
            return SpeculationConfig.parse(self.speculate)
        except ValueError as e:
            raise UsageError(f"--speculate: {e}") from None


def _context_window(model: Path) -> int:
    """The model's max_position_embeddings, read from the container's metadata (no tensor is read)."""
    import nanoqwen_format as nqf

    with nqf.open(model) as f:
        return int(f.config["max_position_embeddings"])


def _load(model: Path, opts: LoadOptions):
    """Build the Pipeline for the chosen backend; every refusal is an exception errors.py maps."""
    import torch

    if opts.threads is not None:
        torch.set_num_threads(opts.threads)
    from nanoqwen_runtime.backend import ReferenceBackend, resolve_device
    from nanoqwen_runtime.generate import Pipeline

    if opts.max_model_len is not None:
        limit = _context_window(model)
        if opts.max_model_len > limit:
            raise UsageError(f"--max-model-len must be <= {limit} (this model's context window), "
                             f"got {opts.max_model_len}")
    dev = resolve_device(opts.device)  # BackendError when there is no GPU: exit 1
    if opts.resolved_backend() == "engine":
        from nanoqwen_runtime.engine.backend import EngineBackend
        from nanoqwen_runtime.engine.config import EngineConfig, parse_bytes

        try:
            kv = parse_bytes(opts.kv_memory) if opts.kv_memory else None
        except ValueError as e:
            raise UsageError(f"--kv-memory: {e}") from None
        cfg = EngineConfig(device=opts.device, mode="eager" if opts.eager else "graph", kv_memory_bytes=kv,
                           max_model_len=opts.max_model_len, verify=opts.verify,
                           speculation=opts.speculation(), prefix_caching=opts.prefix_cache,
                           overlap=opts.overlap)
        return Pipeline.from_container(model, EngineBackend.from_file(model, cfg))
    name = opts.dtype or ("bfloat16" if dev.type == "cuda" else "float32")
    ref = ReferenceBackend.from_file(model, device=opts.device, dtype=getattr(torch, name),
                                     verify=opts.verify, max_context=opts.max_model_len,
                                     speculation=opts.speculation(), prefix_caching=opts.prefix_cache)
    return Pipeline.from_container(model, ref)


def _check_options(temperature, top_p, top_k, max_tokens, seed, stop) -> dict:
    """Validate sampling options before the (slow) model load, so mistakes fail fast (exit 2)."""
    from nanoqwen_runtime.sampling import SamplingParams

    stop = tuple(text_arg(s, "--stop") for s in stop) if stop else None
    kw = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "max_tokens": max_tokens, "seed": seed,
          "stop": stop}
    SamplingParams(**{k: v for k, v in kw.items() if v is not None})  # SamplingError: exit 2
    return kw


def _finite(out: dict) -> dict:
    """NaN/Inf statistics (decode tok/s of a one-token answer) as null: JSON has no NaN."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in out.items()}


def _stats_line(result) -> str:
    return (f"[{result.prompt_tokens} prompt tokens, {result.generated_tokens} generated, "
            f"TTFT {result.ttft_s * 1000:.0f} ms, decode {result.decode_tok_s:.2f} tok/s, "
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


def _prompt_ids(pipe, text: str) -> list[int]:
    """The prompt's token ids; a prompt the context cannot hold (with one generated token) is refused
    with both lengths (exit 2), the same way on every backend and before anything is printed."""
    ids = pipe.tokenizer.encode(text)
    limit = pipe.backend.max_context
    if len(ids) >= limit:
        raise UsageError(f"the prompt has {len(ids)} tokens but the context window is {limit} tokens "
                         "(prompt plus at least one generated token must fit); shorten the prompt")
    return ids


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
    kw = _check_options(temperature, top_p, top_k, max_tokens, seed, stop)
    text = read_prompt(prompt, prompt_file)
    if not text and not chat:
        raise UsageError("the prompt is empty (give some text, or --chat to send an empty user turn)")
    system = text_arg(system, "--system") if system is not None else None
    pipe = _load(resolve_model(model), opts)
    params = pipe.sampling_params(**kw)
    if chat:
        messages = [{"role": "system", "content": system}] if system is not None else []
        text = pipe.chat_prompt(messages + [{"role": "user", "content": text}])
    ids = _prompt_ids(pipe, text)
    if not json_out:
        typer.echo(f"backend: {pipe.backend.name}", err=True)
        typer.echo(_describe_params(params, opts.speculation()), err=True)
    try:
        result = _reply(pipe, ids, params, stream=not json_out)
    except Stopped as stopped:
        if not json_out and stopped.text and not stopped.text.endswith("\n"):
            sys.stdout.write("\n")  # the shell prompt starts on a line of its own
            sys.stdout.flush()
        raise
    if json_out:
        spec = opts.speculation()
        out = {"text": result.text, **result.stats(), "backend": pipe.backend.name,
               "speculation": spec.spec() if spec is not None and params.greedy else None,
               "sampling": {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
                            "seed": params.seed, "max_tokens": params.max_tokens, "stop": list(params.stop)}}
        typer.echo(json.dumps(_finite(out), ensure_ascii=False, allow_nan=False))
    else:
        sys.stdout.write("\n")
        if result.error is None:
            typer.echo(_stats_line(result), err=True)
    if result.error is not None:  # the model failed at run time (NaN/Inf logits): nothing garbled shown
        raise ModelRunError(result.error)


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
    kw = _check_options(temperature, top_p, top_k, max_tokens, seed, stop)
    system = text_arg(system, "--system") if system is not None else None
    pipe = _load(resolve_model(model), opts)
    params = pipe.sampling_params(**kw)
    typer.echo(f"backend: {pipe.backend.name}", err=True)
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
            ids = _prompt_ids(pipe, pipe.chat_prompt(history))
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
