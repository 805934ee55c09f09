"""`nanoqwen-quant`: pack a Qwen2 checkpoint into a .nanoqwen (none / rtn / gptq), evaluate perplexity,
and write the held-out evaluation text.

    nanoqwen-quant pack SRC [-o OUT.nanoqwen] --method gptq|rtn|none|import --group-size 128 [--sym|--asym]
                        [--clip|--no-clip] [--clip-act] [--awq|--no-awq]
                        [--lm-head bf16|int8|int4] [--calib PATH ... | --calib-text chat|code]
                        [--calib-tokens N]
                        [--calib-seq-len N] [--calib-batch N] [--damp F] [--act-order|--no-act-order]
                        [--static-groups|--dynamic-groups]
                        [--device D] [--resume] [--checkpoint-dir DIR] [--verbose] [--debug]
    nanoqwen-quant eval MODEL.nanoqwen --text FILE [--reference NONE.nanoqwen] [--json] [--seq-len 1024]
                        [--max-tokens N] [--device D]
    nanoqwen-quant heldout -o FILE [--chars N]     held-out stdlib code, disjoint from calibration

SRC is a GGUF file, a local HF folder (safetensors + config.json + tokenizer.json), or an HF hub id
(`owner/name[@revision][:file.gguf|:QUANT][:recipe]`, model_cache.py). Without -o the container goes
into the model cache (`$NANOQWEN_CACHE/models`), where `nanoqwen-cli generate SRC` finds it; a pack
already there is not repeated. The pack ends with one summary line (file, size, time, device, the
worst layer's weight error); `--verbose` adds the per-layer error table and GPTQ's damping notes.
Without --method: GPTQ asym g128 calibrated on chat conversations in the model's own template
(`PackOptions`' defaults, chosen by the pass rate in bench/RESULTS.md), or `import` for an
already-quantized GPTQ/AWQ checkpoint or a GGUF whose decoder linears are all Q4_0. A calibrated pack
(GPTQ, or `--awq`) on the CPU prints one notice first (its cost, and `--method rtn`, the
calibration-free recipe).

Errors: one line on stderr, `error: ...`, and exit code 2 for a bad command line (an option value or
combination, `-o` naming a directory: `UsageError` and click's own parse errors) or 1 for everything
else (files, the source, the device, CUDA out of memory, a corrupt container); 130 on Ctrl-C.
`--debug` (or NANOQWEN_DEBUG=1) also prints the traceback. `pack` checks every option, the device and
the output path before it opens the source.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import nanoqwen_format as nqf
import torch
import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .calib import heldout_rule, heldout_text
from .evaluate import evaluate
from .gptq import GPTQConfig
from .model_cache import parse_model
from .model_fetch import open_named, recipe_label, summary_line
from .options import PackOptions, UsageError
from .pack import PackSummary, check_output_path
from .pack import pack as do_pack
from .sources import is_quantized_source

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Import Qwen2 checkpoints and quantize them to INT4 (RTN, GPTQ) into .nanoqwen files.")
err = Console(stderr=True)
_D = PackOptions()  # the CLI's defaults are the recipe's (PackOptions)
DEBUG_HELP = "on an error, print the traceback too (also NANOQWEN_DEBUG=1)"


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _message(e: BaseException) -> str:
    """What went wrong, in one line, with advice where there is one. The expected failures are
    ValueErrors (UsageError, SourceError, ConfigError, CalibrationError), RuntimeErrors
    (CheckpointError, DeviceError, CUDA OOM), OSErrors and nanoqwen_format's FormatErrors."""
    if isinstance(e, torch.cuda.OutOfMemoryError):
        # torch says "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has ... (a paragraph)"
        detail = _one_line(str(e)).removeprefix("CUDA out of memory.").strip().split(". ", 1)[0].rstrip(".")
        return (f"CUDA out of memory{f' ({detail})' if detail else ''}; try fewer --calib-tokens, a smaller "
                "--calib-batch, another GPU (--device cuda:N) or --device cpu")
    if isinstance(e, OSError) and e.filename is not None:
        return f"{e.filename}: {e.strerror or e}"
    if isinstance(e, ValueError | RuntimeError | OSError | nqf.FormatError):
        return _one_line(str(e)) or type(e).__name__
    return (f"unexpected {type(e).__name__}: {_one_line(str(e))} (rerun with --debug and report the "
            "traceback)")


@contextmanager
def _errors(debug: bool) -> Iterator[None]:
    """Turn every exception of a command into one stderr line and an exit code (module docstring)."""
    try:
        yield
    except (typer.Exit, typer.Abort):
        raise
    except KeyboardInterrupt:
        sys.stderr.write("error: interrupted\n")
        raise typer.Exit(130) from None
    except Exception as e:
        if debug or os.environ.get("NANOQWEN_DEBUG") == "1":
            traceback.print_exception(e, file=sys.stderr)
        sys.stderr.write(f"error: {_message(e)}\n")
        raise typer.Exit(2 if isinstance(e, UsageError) else 1) from None


def main(argv: list[str] | None = None) -> int:
    """The `nanoqwen-quant` entry point: the typer app, with its parse errors (a bad option value, a
    missing argument) as one line too."""
    command = typer.main.get_command(app)
    try:
        rv = command.main(args=argv, prog_name="nanoqwen-quant", standalone_mode=False)
    except typer.Abort:
        sys.stderr.write("error: interrupted\n")
        return 130
    except Exception as e:
        # click's exceptions, told by their interface: recent typer releases carry their own copy of
        # click, older ones raise click's own classes
        if not (hasattr(e, "format_message") and isinstance(getattr(e, "exit_code", None), int)):
            raise
        if type(e).__name__ == "NoArgsIsHelpError":
            e.show()  # no arguments at all: the help, as click prints it
            return e.exit_code
        ctx = getattr(e, "ctx", None)
        where = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
        sys.stderr.write(f"error: {_one_line(e.format_message())}{where}\n")
        return e.exit_code
    return rv if isinstance(rv, int) else 0


@app.command()
def pack(
    src: str = typer.Argument(..., help="GGUF file, local HF folder, or HF hub id "
                              "(owner/name[@revision][:file.gguf|:QUANT][:recipe])"),
    out: Path = typer.Option(None, "-o", "--out", help="output .nanoqwen path: written to "
                             "OUT.partial-PID-RANDOM beside it, then renamed; an existing file is replaced, "
                             "a directory refused (default: the model cache, $NANOQWEN_CACHE/models, "
                             "where nanoqwen-cli finds it by SRC)"),
    method: str = typer.Option(None, help="gptq (calibrated) | rtn (no calibration) | none (bf16 linears) "
                               "| import (a GPTQ/AWQ checkpoint or an all-Q4_0 GGUF, exactly); default: "
                               "import for those, else gptq"),
    group_size: int = typer.Option(_D.group_size, help="INT4 group size: 32, 64 or 128 (also the int8/int4 "
                                   "lm_head's)"),
    sym: bool = typer.Option(_D.symmetric, "--sym/--asym",
                             help="symmetric (zero point 8) or asymmetric INT4"),
    clip: bool = typer.Option(_D.clip, "--clip/--no-clip", help="per-group clip search of the INT4 scales "
                              "(RTN's grid; GPTQ's static groups)"),
    clip_act: bool = typer.Option(_D.clip_act, "--clip-act/--no-clip-act", help="weight the clip search by "
                                  "the calibration activations' E[x^2] (needs --method gptq or --awq)"),
    awq: bool = typer.Option(_D.awq, "--awq/--no-awq", help="AWQ activation-aware scaling from the "
                             "calibration set, folded into the norms / up rows (calibrated layer loop)"),
    lm_head: str = typer.Option("bf16", help="bf16 | int8 | int4 (RTN, group size as above)"),
    calib: list[str] = typer.Option(None, help="GPTQ/AWQ: calibration files/folders, repeatable "
                                    "(replaces the built-in text of --calib-text)"),
    calib_text: str = typer.Option(None, help="GPTQ/AWQ: the built-in calibration text: chat (the default: "
                                   "stdlib functions asked for and answered in the model's chat template) "
                                   "| code (the stdlib files as they are)"),
    calib_tokens: int = typer.Option(65536, help="GPTQ/AWQ: calibration tokens (whole windows of "
                                     "--calib-seq-len)"),
    calib_seq_len: int = typer.Option(2048, help="GPTQ/AWQ: tokens per calibration window (>= 16)"),
    calib_batch: int = typer.Option(4, help="GPTQ/AWQ: windows per forward chunk (bounds activation memory)"),
    damp: float = typer.Option(0.01, help="GPTQ: damping, fraction of mean diag(H); raised x10 on failure"),
    act_order: bool = typer.Option(True, "--act-order/--no-act-order",
                                   help="GPTQ: act-order (static groups)"),
    static_groups: bool = typer.Option(True, "--static-groups/--dynamic-groups",
                                       help="GPTQ: group scales from the original weights (static) or from "
                                       "the updated ones as the sweep reaches each group (dynamic: needs "
                                       "--no-act-order)"),
    device: str = typer.Option("auto", help="auto (CUDA when present) | cpu | cuda | cuda:N"),
    resume: bool = typer.Option(False, "--resume",
                                help="GPTQ/AWQ: continue an interrupted run from its checkpoint folder"),
    checkpoint_dir: str = typer.Option(None, help="GPTQ/AWQ: checkpoint folder (default OUT.ckpt)"),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="print the per-layer error table too"),
    debug: bool = typer.Option(False, "--debug", help=DEBUG_HELP),
) -> None:
    """Pack SRC into OUT (or the model cache) with the given recipe. Options marked GPTQ are refused with
    another --method."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS (resume)
    with _errors(debug):
        name = parse_model(src)
        if name.kind == "container":
            raise UsageError(f"{src} is already a .nanoqwen container: there is nothing to pack")
        if method is None and name.recipe is not None:
            method = name.recipe
        elif method is not None and name.recipe not in (None, method):
            raise UsageError(f"{src} names the recipe {name.recipe}, and --method is {method}: give one")
        opts = PackOptions(method=method or _D.method, group_size=group_size, symmetric=sym, clip=clip,
                           clip_act=clip_act, awq=awq, lm_head=lm_head,
                           device=device, calib_paths=calib or None, calib_text=calib_text,
                           calib_tokens=calib_tokens,
                           calib_seq_len=calib_seq_len, calib_batch=calib_batch,
                           gptq=GPTQConfig(damp_percent=damp, act_order=act_order,
                                           static_groups=static_groups),
                           checkpoint_dir=checkpoint_dir, resume=resume)
        # everything that can be checked without the source, before it is opened (a GGUF's tokenizer
        # conversion and a hub download take a while, hashing the source 25-60 s)
        opts.validate()
        reported: set[str] = set()

        def say(line: str) -> None:
            if line not in reported:  # a file left alone is found again by pack() and by the writer
                reported.add(line)
                err.print(line, markup=False, highlight=False, soft_wrap=True)

        # without --method a GPTQ/AWQ source becomes an import, which has no checkpoint folder: pack()
        # checks that folder once the method is known
        if out is not None:
            for p in check_output_path(out, opts, check_checkpoint=method is not None):
                say(f"{out}: {p}")
        else:  # into the cache: done already when a container of this source and recipe is there
            labels = [recipe_label(opts)] if method is not None else ["import", recipe_label(opts)]
            cached = next((p for p in map(name.cache_path, labels) if p.is_file()), None)
            if cached is not None:
                err.print(f"{cached}: already in the model cache (nanoqwen-cli rm removes it)",
                          markup=False, highlight=False, soft_wrap=True)
                return
        if err.is_terminal:  # feedback while a hub download or a GGUF's tokenizer conversion runs
            err.print(f"opening {src}", markup=False, highlight=False, soft_wrap=True)
        source = open_named(name, say)
        if method is None and is_quantized_source(source):  # no --method: import it exactly
            opts.method = "import"
            opts.validate()
        opts.check_model(source.config)
        if out is None:
            out = name.cache_path(recipe_label(opts))
            out.parent.mkdir(parents=True, exist_ok=True)
            for p in check_output_path(out, opts):
                say(f"{out}: {p}")
        c = source.config
        notice = cpu_calibration_notice(opts, c.num_hidden_layers)
        if notice:
            err.print(notice, markup=False, highlight=False, soft_wrap=True)
        err.print(f"qwen2: {c.num_hidden_layers} layers, hidden {c.hidden_size}, heads "
                  f"{c.num_attention_heads}/{c.num_key_value_heads}, intermediate {c.intermediate_size}, "
                  f"vocab {c.vocab_size}, tied {c.tie_word_embeddings}; method {opts.method} g{group_size} "
                  f"{'sym' if sym else 'asym'}{' clip' if clip else ''}{'-act' if clip_act else ''}"
                  f"{' awq' if awq else ''}, lm_head {lm_head}", soft_wrap=True)
        if opts.method == "import":  # the checkpoint's scheme, not the (unused) quantizer options above
            sc = source.scheme
            err.print(f"importing {sc.method} ({sc.fmt}) g{sc.group_size} {'sym' if sc.sym else 'asym'} "
                      "exactly: int4 with fp16 scales", soft_wrap=True)
        columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
        with Progress(*columns, console=err, transient=False) as bar:
            task = bar.add_task("layers", total=c.num_hidden_layers)

            def progress(stage: str, done: int, total: int) -> None:
                bar.update(task, description=stage, completed=done, total=total)

            summary = do_pack(source, out, opts, progress=progress, log=say)
    if verbose:
        _print_summary(summary)
    notes = f"; {len(summary.notes)} notes (--verbose shows them)" if summary.notes and not verbose else ""
    err.print(summary_line(summary) + notes, markup=False, highlight=False, soft_wrap=True)


def cpu_calibration_notice(opts: PackOptions, layers: int) -> str | None:
    """The one line `pack` prints before a calibrated layer loop (GPTQ, or --awq) that will run on the
    CPU, or None (not calibrated, or on CUDA). It informs, and changes nothing: the pack runs as asked."""
    if not opts.calibrated or opts.resolved_device().type != "cpu":
        return None
    what = "GPTQ" if opts.method == "gptq" else "AWQ (--awq)"
    return (f"note: {what} calibrates on the CPU here, which takes long: about 2 minutes per layer of the "
            f"0.5B on a 2-core machine (measured, bench/quality/README.md), more per layer for larger "
            f"models; this model has {layers} layers. --method rtn is the calibration-free recipe "
            "(seconds per layer, no calibration); on a CUDA GPU the 0.5B's GPTQ takes about a minute.")


def _print_summary(s: PackSummary) -> None:
    t = Table(title=f"{s.out}: {s.nbytes / 1e9:.3f} GB in {s.seconds:.1f} s on {s.device}")
    t.add_column("layer", justify="right")
    names = sorted({n for e in s.layer_errors for n in e})
    keys = ["w_rel", "out_rel", "rtn_out_rel"]
    shown = [k for k in keys if any(k in v for e in s.layer_errors for v in e.values())]
    for n in names:
        for k in shown:
            t.add_column(f"{n} {k}", justify="right")
    for i, e in enumerate(s.layer_errors):
        t.add_row(str(i), *[f"{e[n][k]:.2e}" if n in e and k in e[n] else "-" for n in names for k in shown])
    if names:
        err.print(t)
    for n in s.notes:
        err.print(f"[yellow]note:[/yellow] {n}")


@app.command("eval")
def eval_cmd(
    model: Path = typer.Argument(..., help=".nanoqwen file"),
    text: Path = typer.Option(..., help="UTF-8 text file (held-out code; see `heldout`)"),
    reference: Path = typer.Option(None, help="the --method none pack of the same source: also report its "
                                   "perplexity and the greedy next-token agreement with it"),
    json_out: bool = typer.Option(False, "--json", help="print one JSON object"),
    seq_len: int = typer.Option(1024, help="tokens per window"),
    max_tokens: int = typer.Option(None, help="score only the first N tokens of the text"),
    device: str = typer.Option("auto", help="auto (CUDA when present) | cpu | cuda | cuda:N"),
    debug: bool = typer.Option(False, "--debug", help=DEBUG_HELP),
) -> None:
    """Perplexity of MODEL on the text and, with --reference, the greedy (teacher-forced top-1)
    agreement with the reference (plain-torch forward; on the GPU with --device cuda)."""
    with _errors(debug):
        r = evaluate(model, text.read_text(encoding="utf-8"), reference=reference, seq_len=seq_len,
                     max_tokens=max_tokens, device=device, text_name=str(text))
    if json_out:
        sys.stdout.write(json.dumps(r.to_dict()) + "\n")
    else:
        print(f"perplexity {r.perplexity:.4f} over {r.tokens} tokens ({r.windows} windows <= {r.seq_len}), "
              f"{r.seconds:.1f} s on {r.device}")
        if r.agreement is not None:
            print(f"reference perplexity {r.reference_perplexity:.4f} ({100 * r.ppl_delta:+.2f}%), greedy "
                  f"agreement {100 * r.agreement:.2f}%")


@app.command()
def heldout(
    out: Path = typer.Option(..., "-o", "--out", help="where to write the text"),
    chars: int = typer.Option(200_000, help="at least this many characters (whole files)"),
    debug: bool = typer.Option(False, "--debug", help=DEBUG_HELP),
) -> None:
    """Write held-out Python stdlib code that the default calibration set never uses."""
    with _errors(debug):
        if out.is_dir():
            raise UsageError(f"output (-o/--out) {out} is a directory; give a file path")
        text = heldout_text(chars)
        tmp = out.with_name(out.name + ".tmp")
        try:
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, out)
        finally:
            tmp.unlink(missing_ok=True)
    err.print(f"wrote {len(text)} characters to {out} ({heldout_rule()})")


if __name__ == "__main__":
    sys.exit(main())
