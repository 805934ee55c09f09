"""`nanoqwen-cli inspect` and `nanoqwen-cli verify`: look inside and check a .nanoqwen container.

inspect FILE          a table of tensors (name, encoding/layout, shape, offset, bytes, xxh3) and a
                      metadata summary, as wide as the terminal or 80 columns in a pipe (xxh3,
                      then offset, are left out, saying so, when the table would not fit); exit 0,
                      or 1 and one line on stderr when the file cannot be
                      opened (missing, not a container, damaged header, trailer or index)
inspect FILE --json   the same as one JSON object (schema below); long strings and binary
                      metadata values are summarised as {"chars": n} / {"bytes": n}
verify FILE           checks the header, trailer, index, metadata and every tensor checksum;
                      exit 0 and "OK ..." when sound, exit 1 and the reason (the FormatError's class
                      and message, as one line on stderr: errors.py) otherwise

JSON schema: {"path", "version": "1.0", "file_bytes", "data_offset", "index_offset",
"tensor_bytes", "tensors": [{"name", "encoding", "dtype", "shape", "offset", "nbytes", "xxh3"
(16 hex digits), "group_size", "symmetric", "layout"}], "metadata": {...}, "model_variant": {"variant":
"base" | "instruct", "why", "infill_way": "fim" | "chat"}}. The variant comes from the metadata
(nanoqwen_runtime.fim.model_variant: the packer's `variant` key, else the name of the source the
container was packed from); editor autocomplete wants a base model.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from .inputs import check_model_path

if TYPE_CHECKING:
    import nanoqwen_format as nqf

# Metadata strings longer than this (the tokenizer JSON, the chat template) are shown by length only.
LONG_STRING = 200
PIPE_WIDTH = 80
# the tensor table's columns left out first when the width is short (--json always has them all)
DROPPABLE = ["xxh3", "offset"]
GAP = 2  # the tensor table has no vertical rules: one space of padding each side of a column boundary


def _console():
    """stdout console: the terminal's width, or 80 columns when stdout is a pipe or a file."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=PIPE_WIDTH)


def fit_columns(headers: list[str], rows: list[list[str]], width: int, droppable: list[str],
                gap: int = GAP) -> list[str]:
    """The headers whose columns fit in `width` (`gap` characters between columns), leaving out those
    of `droppable`, in its order, until the rest fit."""
    widths = {h: max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)}
    kept = list(headers)
    for h in droppable:
        if sum(widths[k] for k in kept) + gap * (len(kept) - 1) <= width:
            break
        kept.remove(h)
    return kept


def _summarise(value, limit: int):
    if isinstance(value, str):
        return value if len(value) <= limit else {"chars": len(value)}
    if isinstance(value, bytes):
        return {"bytes": len(value)}
    if isinstance(value, dict):
        return {k: _summarise(v, limit) for k, v in value.items()}
    if isinstance(value, list):
        return [_summarise(v, limit) for v in value]
    return value


def _variant(metadata: dict, config: dict) -> dict:
    """Base or Instruct model, and the fill-in-the-middle prompting the server uses for it."""
    from nanoqwen_runtime import fim

    variant, why = fim.model_variant(metadata)
    way = fim.choose_way(variant, int(config["hidden_size"]))
    return {"variant": variant, "why": why, "infill_way": way}


def _describe(f: nqf.NanoqwenFile) -> dict:
    return {
        "path": f.path,
        "version": f"{f.major}.{f.minor}",
        "file_bytes": f.size,
        "data_offset": f.data_offset,
        "index_offset": f.index_offset,
        "tensor_bytes": sum(r.nbytes for r in f.records.values()),
        "tensors": [
            {
                "name": r.name,
                "encoding": r.encoding,
                "dtype": r.dtype,
                "shape": list(r.shape),
                "offset": r.offset,
                "nbytes": r.nbytes,
                "xxh3": f"{r.checksum:016x}",
                "group_size": r.group_size,
                "symmetric": r.symmetric,
                "layout": r.layout,
            }
            for r in f.records.values()
        ],
        "metadata": _summarise(f.metadata, LONG_STRING),
        "model_variant": _variant(f.metadata, f.config),
    }


def inspect(
    file: Annotated[Path, typer.Argument(help="a .nanoqwen file")],
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON object instead of tables")] = False,
) -> None:
    """Show the tensors and metadata of a .nanoqwen file (reads the index only, not the tensors)."""
    import nanoqwen_format as nqf
    from rich.markup import escape
    from rich.table import Table

    with nqf.open(check_model_path(file)) as f:
        info = _describe(f)
    out = _console()
    if as_json:
        typer.echo(json.dumps(info, indent=2, ensure_ascii=False))
        return
    out.print(f"[bold]{escape(info['path'])}[/]", highlight=False)
    mv = info["model_variant"]
    out.print(f"model: {mv['variant']} ({escape(mv['why'])}); fill-in-the-middle prompting: "
              f"{mv['infill_way']}", highlight=False)
    out.print(f".nanoqwen {info['version']}  {info['file_bytes']:,} bytes  {len(info['tensors'])} tensors "
              f"({info['tensor_bytes']:,} bytes)", highlight=False)
    headers = ["name", "encoding", "shape", "offset", "bytes", "xxh3"]
    rows = []
    for t in info["tensors"]:
        enc = t["layout"] + (" sym" if t["symmetric"] else " asym") if t["layout"] else t["encoding"]
        rows.append([t["name"], enc, "x".join(map(str, t["shape"])), f"{t['offset']:,}", f"{t['nbytes']:,}",
                     t["xxh3"]])
    kept = fit_columns(headers, rows, out.width, DROPPABLE)
    table = Table(box=None, pad_edge=False, header_style="bold")
    for col in kept:
        table.add_column(col, justify="right" if col in ("offset", "bytes") else "left", no_wrap=True)
    for r in rows:
        table.add_row(*[v for h, v in zip(headers, r, strict=True) if h in kept])
    out.print(table)
    if len(kept) < len(headers):
        out.print(f"({', '.join(h for h in headers if h not in kept)} left out at {out.width} columns: "
                  "--json or a wider terminal shows them)", highlight=False)
    meta = Table(title="metadata", show_edge=False, pad_edge=False, title_justify="left")
    meta.add_column("key", no_wrap=True)
    meta.add_column("value", overflow="fold")
    for key, value in info["metadata"].items():
        meta.add_row(escape(key), escape(json.dumps(value, ensure_ascii=False)[:400]))
    out.print(meta)


def verify(file: Annotated[Path, typer.Argument(help="a .nanoqwen file")]) -> None:
    """Check every checksum of a .nanoqwen file: exit 0 when sound, 1 (saying why) otherwise."""
    import nanoqwen_format as nqf

    t0 = time.perf_counter()
    with nqf.open(check_model_path(file)) as f:  # a FormatError is the answer: one line, exit 1
        nbytes = f.verify()
        version, count = f"{f.major}.{f.minor}", len(f.records)
    dt = time.perf_counter() - t0
    typer.echo(f"OK {file}: .nanoqwen {version}, {count} tensors, {nbytes:,} tensor bytes "
               f"verified in {dt:.2f} s ({nbytes / max(dt, 1e-9) / 1e9:.1f} GB/s)")
