"""`nanoqwen-cli infill`: fill in the middle between the text before a cursor and the text after it.

infill MODEL --prefix-file BEFORE [--suffix-file AFTER] [--extra-file PATH ...] [--path NAME]
       [--way fim|chat] [--max-tokens N] [--time-budget-ms MS] [--max-lines N] [--no-trim]
       [--temperature T] [--top-p P] [--top-k K] [--seed S] [--stop STR ...]
       [--device cpu|cuda] [--backend reference|engine] [--max-model-len N] [--threads N] [--json]
    The middle goes to stdout as it is generated, byte for byte (nothing is added: no final newline), so
    `cat before.py - after.py` around it gives the file. The backend, the prompting way and the statistics
    go to stderr. --prompt-file is another name of --prefix-file (either may be `-`: stdin). The prompt
    (nanoqwen_runtime.fim): the FIM tokens for a base model, the chat-template infill for an Instruct
    one (by the container's metadata, as `inspect` shows it), or --way. Extra files are shown to the
    model before the current file (`--path`, default the prefix file's name) and dropped, the first
    given first, when they do not fit the context. The middle is cut where it starts repeating the
    suffix (--no-trim: not) and at --max-lines lines; --time-budget-ms ends generation once that many
    milliseconds have passed since the first token and a newline has been generated (llama-server's
    t_max_predict_ms). --json prints one object at the end instead: {"middle", "way", "variant",
    "prompt_tokens", "generated_tokens", "ttft_s", "finish_reason", "trimmed", "extra_files_used",
    "extra_files_dropped", "backend"}.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from .errors import CliError, UsageError
from .generate_commands import (
    Backend,
    Device,
    Dtype,
    MaxModelLen,
    MaxTokens,
    ModelArg,
    Seed,
    Stop,
    Temperature,
    Threads,
    TopK,
    TopP,
)
from .inputs import decode_utf8, read_prompt
from .loading import (
    LoadOptions,
    check_max_model_len,
    check_sampling,
    describe_threads,
    load_backend,
    open_container,
)
from .model_commands import resolve_model

DEFAULT_MAX_TOKENS = 128


def _read_file(path: Path, option: str) -> str:
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CliError(f"cannot read {option} {path}: {e.strerror or e}") from None
    return decode_utf8(data, f"{option} {path}")


def infill(
    model: ModelArg,
    prefix_file: Annotated[Path | None, typer.Option("--prefix-file", "--prompt-file",
                                                     help="the text before the cursor (- for stdin)")] = None,
    suffix_file: Annotated[Path | None, typer.Option("--suffix-file",
                                                     help="the text after the cursor")] = None,
    extra_file: Annotated[list[Path] | None, typer.Option("--extra-file", help="another file of the project "
                                                          "shown to the model (repeatable)")] = None,
    path: Annotated[str | None, typer.Option(help="the current file's name in the prompt (default: the "
                                                  "prefix file's name)")] = None,
    way: Annotated[str | None, typer.Option(help="fim (FIM tokens) | chat (chat-template infill); default: "
                                                 "by the model (base: fim, Instruct: chat)")] = None,
    max_tokens: MaxTokens = None,
    time_budget_ms: Annotated[int | None, typer.Option("--time-budget-ms", help="stop this long after the "
                                                       "first token, once a newline is out")] = None,
    max_lines: Annotated[int | None, typer.Option("--max-lines", help="line budget of the middle")] = None,
    no_trim: Annotated[bool, typer.Option("--no-trim", help="keep a middle that repeats the suffix")] = False,
    temperature: Temperature = 0.0,
    top_p: TopP = None,
    top_k: TopK = None,
    seed: Seed = None,
    stop: Stop = None,
    device: Device = "cpu",
    backend: Backend = None,
    max_model_len: MaxModelLen = None,
    dtype: Dtype = None,
    threads: Threads = None,
    json_out: Annotated[bool, typer.Option("--json", help="print one JSON object at the end")] = False,
) -> None:
    """Fill in the middle between --prefix-file and --suffix-file: the middle to stdout, statistics to
    stderr."""
    from nanoqwen_runtime import fim

    if way is not None and way not in fim.WAYS:
        raise UsageError(f"--way must be one of {', '.join(fim.WAYS)}, got {way!r}")
    if time_budget_ms is not None and time_budget_ms < 1:
        raise UsageError(f"--time-budget-ms must be >= 1, got {time_budget_ms}")
    if max_lines is not None and max_lines < 1:
        raise UsageError(f"--max-lines must be >= 1, got {max_lines}")
    if prefix_file is None:
        raise UsageError("no prefix: give --prefix-file PATH (the text before the cursor; - reads stdin)")
    opts = LoadOptions(device=device, backend=backend, dtype=dtype, threads=threads,
                       max_model_len=max_model_len)
    opts.check()
    kw = check_sampling(temperature, top_p, top_k,
                        max_tokens if max_tokens is not None else DEFAULT_MAX_TOKENS,
                        seed, stop)
    prefix = read_prompt(None, prefix_file)
    suffix = _read_file(suffix_file, "--suffix-file") if suffix_file is not None else ""
    if not prefix and not suffix:
        raise UsageError("the prefix and the suffix are both empty: there is nothing to fill in")
    extra = [fim.ExtraFile(p.name, _read_file(p, "--extra-file")) for p in extra_file or []]
    name = path or (prefix_file.name if str(prefix_file) != "-" else "filename")
    from nanoqwen_runtime.generate import Pipeline

    with open_container(resolve_model(model)) as f:  # opened and checked once; weights read last
        check_max_model_len(f, opts.max_model_len)
        pipe = Pipeline.from_file(f, None)
        pipe.backend, threads = load_backend(f, opts, pipe.tokenizer)
    variant, why = pipe.variant or ("base", "not read from the container")
    chosen = way or pipe.infill_way
    params = pipe.sampling_params(**kw)
    limit = pipe.backend.max_context
    try:
        prompt = fim.build_prompt(chosen, pipe.tokenizer, pipe.template, prefix, suffix, extra, path=name,
                                  budget=max(1, limit - min(params.max_tokens, limit // 2)))
    except fim.ContextOverflowError as e:
        if e.prompt_tokens >= limit:
            raise UsageError(f"{e} (the context window is {limit} tokens)") from None
        prompt = fim.build_prompt(chosen, pipe.tokenizer, pipe.template, prefix, suffix, [], path=name,
                                  budget=limit - 1)
    except fim.FIMError as e:
        raise CliError(str(e)) from None
    params = params.with_(stop=params.stop + prompt.stop)
    if not json_out:
        typer.echo(f"backend: {pipe.backend.name}" + (f"; {describe_threads(threads)}" if threads else ""),
                   err=True)
        typer.echo(f"model: {variant} ({why}); infill way: {chosen}"
                   + (f"; extra files: {prompt.extras_used} used, {prompt.extras_dropped} dropped to fit"
                      if extra else ""), err=True)
    trimmer = fim.MiddleTrimmer(suffix, max_lines=max_lines, suffix_repeat=not no_trim)
    shown: list[str] = []
    result, reason, t_first, n_gen = None, None, None, 0
    seen_newline = False
    t0 = time.perf_counter()
    events = pipe.stream([prompt.ids], params, [prompt.stop_ids | pipe.eos_ids])
    try:
        for ev in events:
            now = time.perf_counter()
            if ev.token_id is not None:
                n_gen += 1
                t_first = t_first if t_first is not None else now
            piece, done = trimmer.push(ev.text)
            seen_newline = seen_newline or "\n" in ev.text
            over = time_budget_ms is not None and seen_newline and t_first is not None \
                and (now - t_first) * 1000 >= time_budget_ms
            if ev.result is not None:
                result = ev.result
                piece += trimmer.flush()
                reason = "trim" if trimmer.trimmed else result.finish_reason
            elif done or over:
                if not done:
                    piece += trimmer.flush()
                reason = "trim" if done else "time"
            if piece:
                shown.append(piece)
                if not json_out:
                    sys.stdout.write(piece)
                    sys.stdout.flush()
            if reason is not None:
                break
    finally:
        events.close()  # ends the request in the backend when the middle was cut early
    if result is not None and result.error is not None:
        raise CliError(result.error)
    ttft = (t_first - t0) if t_first is not None else 0.0
    if json_out:
        typer.echo(json.dumps({"middle": "".join(shown), "way": chosen, "variant": variant,
                               "prompt_tokens": len(prompt.ids), "generated_tokens": n_gen,
                               "ttft_s": round(ttft, 4), "finish_reason": reason, "trimmed": trimmer.trimmed,
                               "extra_files_used": prompt.extras_used,
                               "extra_files_dropped": prompt.extras_dropped, "backend": pipe.backend.name},
                              ensure_ascii=False))
    else:
        sys.stdout.flush()
        typer.echo(f"\n[{len(prompt.ids)} prompt tokens, {n_gen} generated, TTFT {ttft * 1000:.0f} ms, "
                   f"finish: {reason}{', trimmed' if trimmer.trimmed else ''}]", err=True)
