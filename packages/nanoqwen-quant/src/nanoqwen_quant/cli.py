"""`nanoqwen-quant`: pack a Qwen2 checkpoint into a .nanoqwen (none / rtn / gptq), evaluate perplexity,
and write the held-out evaluation text.

    nanoqwen-quant pack SRC -o OUT.nanoqwen --method rtn|gptq|none --group-size 128 [--sym|--asym]
                        [--lm-head bf16|int8|int4] [--calib PATH ...] [--calib-tokens N] [--device D]
                        [--resume]
    nanoqwen-quant eval MODEL.nanoqwen --text FILE [--json] [--seq-len 1024] [--max-tokens N]
    nanoqwen-quant heldout -o FILE [--chars N]     held-out stdlib code, disjoint from calibration

SRC is a GGUF file, a local HF folder (safetensors + config.json + tokenizer.json), or an HF hub id.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .calib import heldout_rule, heldout_text
from .evaluate import perplexity
from .gptq import GPTQConfig
from .options import PackOptions
from .pack import PackSummary
from .pack import pack as do_pack
from .sources import open_source

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Import Qwen2 checkpoints and quantize them to INT4 (RTN, GPTQ) into .nanoqwen files.")
err = Console(stderr=True)


@app.command()
def pack(
    src: str = typer.Argument(..., help="GGUF file, local HF folder, or HF hub id (owner/name[@rev])"),
    out: Path = typer.Option(..., "-o", "--out", help="output .nanoqwen path (written atomically)"),
    method: str = typer.Option("rtn", help="none (bf16 linears) | rtn | gptq"),
    group_size: int = typer.Option(128, help="INT4 group size: 32, 64 or 128"),
    sym: bool = typer.Option(True, "--sym/--asym", help="symmetric (zero point 8) or asymmetric"),
    lm_head: str = typer.Option("bf16", help="bf16 | int8 | int4 (RTN, group size as above)"),
    calib: list[str] = typer.Option(None, help="calibration files/folders (default: Python stdlib sources)"),
    calib_tokens: int = typer.Option(65536, help="calibration tokens (whole windows of --calib-seq-len)"),
    calib_seq_len: int = typer.Option(2048, help="tokens per calibration window"),
    calib_batch: int = typer.Option(4, help="windows per forward chunk"),
    damp: float = typer.Option(0.01, help="GPTQ damping, fraction of mean diag(H)"),
    act_order: bool = typer.Option(True, "--act-order/--no-act-order", help="GPTQ act-order (static groups)"),
    device: str = typer.Option("auto", help="auto (CUDA when present) | cpu | cuda | cuda:N"),
    resume: bool = typer.Option(False, help="continue an interrupted GPTQ run from OUT.ckpt"),
    checkpoint_dir: str = typer.Option(None, help="GPTQ checkpoint folder (default OUT.ckpt)"),
) -> None:
    """Pack SRC into OUT with the given recipe."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS (resume)
    opts = PackOptions(method=method, group_size=group_size, symmetric=sym, lm_head=lm_head, device=device,
                       calib_paths=calib or None, calib_tokens=calib_tokens, calib_seq_len=calib_seq_len,
                       calib_batch=calib_batch, gptq=GPTQConfig(damp_percent=damp, act_order=act_order),
                       checkpoint_dir=checkpoint_dir, resume=resume)
    try:
        opts.validate()
        err.print(f"opening {src}")
        source = open_source(src)
    except Exception as e:  # every source / option error is a clear one-line message
        err.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2) from e
    c = source.config
    err.print(f"qwen2: {c.num_hidden_layers} layers, hidden {c.hidden_size}, heads {c.num_attention_heads}/"
              f"{c.num_key_value_heads}, intermediate {c.intermediate_size}, vocab {c.vocab_size}, "
              f"tied {c.tie_word_embeddings}; method {method} g{group_size} {'sym' if sym else 'asym'}, "
              f"lm_head {lm_head}")
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    with Progress(*columns, console=err, transient=False) as bar:
        task = bar.add_task("layers", total=c.num_hidden_layers)

        def progress(stage: str, done: int, total: int) -> None:
            bar.update(task, description=stage, completed=done, total=total)

        try:
            summary = do_pack(source, out, opts, progress=progress, log=lambda m: bar.console.print(m))
        except Exception as e:
            err.print(f"[red]error:[/red] {type(e).__name__}: {e}")
            raise typer.Exit(1) from e
    _print_summary(summary)


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
    else:
        err.print(f"{s.out}: {s.nbytes / 1e9:.3f} GB in {s.seconds:.1f} s (bf16 linears, no quantization)")
    for n in s.notes:
        err.print(f"[yellow]note:[/yellow] {n}")


@app.command("eval")
def eval_cmd(
    model: Path = typer.Argument(..., help=".nanoqwen file"),
    text: Path = typer.Option(..., help="UTF-8 text file (held-out code; see `heldout`)"),
    json_out: bool = typer.Option(False, "--json", help="print one JSON object"),
    seq_len: int = typer.Option(1024, help="tokens per window"),
    max_tokens: int = typer.Option(None, help="score only the first N tokens of the text"),
    device: str = typer.Option("auto", help="auto | cpu | cuda"),
) -> None:
    """Perplexity of MODEL on the text (plain-torch forward)."""
    try:
        r = perplexity(model, text.read_text(encoding="utf-8"), seq_len=seq_len, max_tokens=max_tokens,
                       device=device, text_name=str(text))
    except Exception as e:
        err.print(f"[red]error:[/red] {type(e).__name__}: {e}")
        raise typer.Exit(1) from e
    if json_out:
        sys.stdout.write(json.dumps(r.to_dict()) + "\n")
    else:
        print(f"perplexity {r.perplexity:.4f} over {r.tokens} tokens ({r.windows} windows <= {r.seq_len}), "
              f"{r.seconds:.1f} s on {r.device}")


@app.command()
def heldout(
    out: Path = typer.Option(..., "-o", "--out", help="where to write the text"),
    chars: int = typer.Option(200_000, help="at least this many characters (whole files)"),
) -> None:
    """Write held-out Python stdlib code that the default calibration set never uses."""
    text = heldout_text(chars)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, out)
    err.print(f"wrote {len(text)} characters to {out} ({heldout_rule()})")


if __name__ == "__main__":
    app()
