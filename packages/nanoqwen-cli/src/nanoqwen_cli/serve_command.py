"""`nanoqwen-cli serve MODEL`: an OpenAI-compatible HTTP server (server/ has the app and the engine process).

serve MODEL [--host 127.0.0.1] [--port 8000] [--device cpu|cuda|cuda:N] [--api-key KEY]
      [--model-name NAME] [--kv-memory SIZE] [--max-model-len N] [--max-batch N] [--max-waiting N]
      [--max-body SIZE] [--drain-timeout S] [--eager] [--no-overlap] [--no-verify] [--threads N]
      [--speculate ngram[:K]] [--no-prefix-cache] [--cache-reuse N] [--cpu-placement auto|off]

`--device cuda` runs the CUDA `Engine` (CUDA graphs unless --eager; the next decode step queued before the
last one is read back unless `--no-overlap`: EngineConfig.overlap); `--device cpu` runs the
plain-torch `ReferenceEngine` (fp32), so the server can be tested for real without a GPU. The
server listens at once; GET /health answers 503 "loading" until the model is loaded (and the graphs
captured), then 200. A model that fails to load ends the command with its one-line error (exit 1).
The engine runs in a process of its own (server/engine_process.py), built from an `EngineSpec`;
--threads sets torch's threads there (default on the CPU: nanoqwen_runtime.cpu_threads' rule, printed
in the ready line). If that process dies (crash, OOM kill), its requests end with an error, the server
stops and the command exits 1 with one line saying how it died. On cuda with 4 or more CPUs the engine
process runs on two hardware threads of its own and the HTTP process on the others (`--cpu-placement
auto`, server/cpu_placement.py; one server per GPU: each takes the pair of its GPU's number); `off`
leaves both to the scheduler, as does `--device cpu`.
Binds 127.0.0.1 unless --host says otherwise. `--api-key` (or NANOQWEN_API_KEY) makes /v1/* require
`Authorization: Bearer KEY`. SIGTERM (or Ctrl-C) drains while the server keeps listening: GET /health
answers 503 {"status": "draining"}, new requests get 503 in the OpenAI error shape, running ones get up
to --drain-timeout seconds to finish and the rest are aborted; one line on stderr says that draining
started, one how it ended; then the command exits 0 (130 for Ctrl-C). Speculation left out takes the
backend's measured default (loading.DEFAULT_SPECULATION: off on both engines).

Both engines cache the KV blocks of prompt prefixes (a later request that starts with the same
system prompt or conversation skips their prefill; `--no-prefix-cache` turns it off) and, with
`--speculate ngram[:K]`, speculate greedy (temperature 0) requests by prompt lookup
(nanoqwen_runtime.speculative). GET /metrics shows both: prefix-cache hit tokens and hit rate, cached
blocks, drafted and accepted tokens and verify steps (server/metrics.py).

`--cache-reuse N` (llama-server's option of the same name; off by default) also reuses, past the cached
prefix, runs of at least N tokens that cached blocks hold at another position, with their keys rotated
(nanoqwen_runtime.engine.blocks): fill-in-the-middle requests from an editor, whose code below the
cursor follows a prefix that changed, skip its prefill. Those tokens keep the K/V of their old context,
so an answer may differ from the exact one; nothing computed from them enters the prefix cache.
"""

from __future__ import annotations

from typing import Annotated

import typer

from .errors import UsageError
from .generate_commands import (
    Device,
    KvMemory,
    MaxModelLen,
    ModelArg,
    NoOverlap,
    NoPrefixCache,
    NoVerify,
    Speculate,
    Threads,
)
from .loading import LoadOptions, check_max_model_len, open_container
from .model_commands import resolve_model

API_KEY_ENV = "NANOQWEN_API_KEY"


def _size(text: str, option: str) -> int:
    from nanoqwen_runtime.engine.config import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as e:
        raise UsageError(f"{option}: {e}") from None


def serve(
    model: ModelArg,
    host: Annotated[str, typer.Option(help="address to bind (127.0.0.1: this machine only; 0.0.0.0: "
                                           "every interface, put --api-key on it)")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port (0 picks a free one)")] = 8000,
    device: Device = "cpu",
    api_key: Annotated[str | None, typer.Option("--api-key", envvar=API_KEY_ENV, show_envvar=True,
                                                help="require 'Authorization: Bearer KEY' on /v1/*")] = None,
    model_name: Annotated[str | None, typer.Option("--model-name", help="the model id clients send "
                                                   "(default: MODEL as given; a .nanoqwen file's name "
                                                   "without .nanoqwen)")]
    = None,
    kv_memory: KvMemory = None,
    max_model_len: MaxModelLen = None,
    max_batch: Annotated[int | None, typer.Option("--max-batch", help="running sequences at most "
                                                  "(default: 64 on cuda, 16 on cpu)")] = None,
    max_waiting: Annotated[int, typer.Option("--max-waiting", help="requests waiting for a batch slot at "
                                             "most; past it, 429 with Retry-After")] = 256,
    max_body: Annotated[str, typer.Option("--max-body", help="largest request body; past it, 413")] = "4MiB",
    drain_timeout: Annotated[float, typer.Option("--drain-timeout", help="seconds running requests get to "
                                                 "finish after SIGTERM before they are aborted")] = 30.0,
    eager: Annotated[bool, typer.Option("--eager", help="cuda: no CUDA graphs (debugging)")] = False,
    no_overlap: NoOverlap = False,
    no_verify: NoVerify = False,
    threads: Threads = None,
    speculate: Speculate = None,
    no_prefix_cache: NoPrefixCache = False,
    cache_reuse: Annotated[int, typer.Option(
        "--cache-reuse", help="reuse cached K/V at shifted positions for runs of at least this many tokens "
        "past the cached prefix (editor autocomplete: the code below the cursor); approximate, 0 = off")] = 0,
    dense_weight_cache: Annotated[bool, typer.Option(
        "--dense-weight-cache", help="cuda: also keep a bf16 copy of every INT4 linear for steps of more "
        "than 8 rows (faster batched decode and prefill while the INT4 GEMM is slower than cuBLAS; costs "
        "2 bytes per weight, about 13 GB at 7B, taken from the KV pool and printed at load)")] = False,
    log_level: Annotated[str, typer.Option("--log-level", help="uvicorn log level")] = "info",
    cpu_placement: Annotated[str, typer.Option(
        "--cpu-placement", help="cuda, auto: the engine process gets the last two hardware threads (whole "
        "cores) and the HTTP process the other CPUs (at least 2; else no placement), so that streaming does "
        "not slow the engine's steps; off: wherever the scheduler puts them")] = "auto",
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API (chat/completions, completions, models)."""
    from .server.engine_spec import EngineSpec

    opts = LoadOptions(device=device, backend="engine" if device.startswith("cuda") else "reference",
                       threads=threads, kv_memory=kv_memory, eager=eager, overlap=not no_overlap,
                       max_model_len=max_model_len, verify=not no_verify,
                       speculate=speculate, prefix_cache=not no_prefix_cache)
    opts.check()  # also parses --speculate (a bad value: exit 2)
    spec = opts.speculation()
    if not 0 <= port <= 65535:
        raise UsageError(f"--port must be in 0..65535, got {port}")
    if dense_weight_cache and not device.startswith("cuda"):
        raise UsageError("--dense-weight-cache applies to --device cuda (the CUDA engine's linears) only")
    if max_batch is not None and max_batch < 1:
        raise UsageError(f"--max-batch must be >= 1, got {max_batch}")
    if cache_reuse < 0:
        raise UsageError(f"--cache-reuse must be >= 0 (0: off), got {cache_reuse}")
    if cache_reuse and no_prefix_cache:
        raise UsageError("--cache-reuse copies the prefix cache's blocks: not with --no-prefix-cache")
    if max_waiting < 1:
        raise UsageError(f"--max-waiting must be >= 1, got {max_waiting}")
    if drain_timeout < 0:
        raise UsageError(f"--drain-timeout must be >= 0, got {drain_timeout}")
    if api_key is not None and not api_key.strip():
        raise UsageError("--api-key is empty")
    if cpu_placement not in ("auto", "off"):
        raise UsageError(f"--cpu-placement must be auto or off, got {cpu_placement!r}")
    body_limit = _size(max_body, "--max-body")
    kv_bytes = _size(kv_memory, "--kv-memory") if kv_memory else None
    path = resolve_model(model)
    name = model_name or (path.name.removesuffix(".nanoqwen") if path == model else str(model))

    from nanoqwen_runtime.backend import resolve_device
    from nanoqwen_runtime.generate import Pipeline

    resolve_device(device)  # no GPU for --device cuda: one line, exit 1, before anything starts
    with open_container(path) as f:  # once here: the text side (the engine process reads the weights)
        check_max_model_len(f, max_model_len)
        pipeline = Pipeline.from_file(f, None)  # tokenizer, chat template, defaults
    engine = EngineSpec(path=str(path), device=device, eager=eager, overlap=opts.overlap,
                        kv_memory_bytes=kv_bytes,
                        max_model_len=max_model_len, max_batch=max_batch, verify=not no_verify,
                        speculation=spec, prefix_caching=not no_prefix_cache, cache_reuse=cache_reuse,
                        dense_weight_cache=dense_weight_cache, threads=threads)

    from .server import cpu_placement as placement
    from .server.runner import run_server

    error = run_server(engine, pipeline, name, host=host, port=port, api_key=api_key,
                       max_body_bytes=body_limit, max_waiting=max_waiting, drain_timeout_s=drain_timeout,
                       log_level=log_level,
                       placement=placement.plan(cpu_placement, slot=placement.device_slot(device))
                       if device.startswith("cuda") else None)
    if error is not None:
        raise error
