"""`nanoqwen-cli inspect` and `nanoqwen-cli verify`: look inside and check a .nanoqwen container.

inspect FILE          a table of tensors (name, encoding/layout, shape, offset, bytes, xxh3) and a
                      metadata summary; exit 0, or 1 and one line on stderr when the file cannot be
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


def _console():
    """stdout console; when piped, wide enough that the tensor table is never truncated."""
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=200)


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


def _variant(metadata: dict) -> dict:
    """Base or Instruct model, and the fill-in-the-middle prompting the server uses for it."""
    from nanoqwen_runtime import fim

    variant, why = fim.model_variant(metadata)
    return {"variant": variant, "why": why, "infill_way": fim.choose_way(variant)}


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
        "model_variant": _variant(f.metadata),
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
    out.print(
        f"[bold]{escape(info['path'])}[/]  .nanoqwen {info['version']}  {info['file_bytes']:,} bytes  "
        f"{len(info['tensors'])} tensors ({info['tensor_bytes']:,} bytes)",
        highlight=False,
        soft_wrap=True,
    )
    mv = info["model_variant"]
    out.print(f"model: {mv['variant']} ({escape(mv['why'])}); fill-in-the-middle prompting: "
              f"{mv['infill_way']}",
              highlight=False, soft_wrap=True)
    table = Table(show_edge=False, pad_edge=False)
    for col, justify in [
        ("name", "left"),
        ("encoding", "left"),
        ("shape", "left"),
        ("offset", "right"),
        ("bytes", "right"),
        ("xxh3", "left"),
    ]:
        table.add_column(col, justify=justify, no_wrap=True)
    for t in info["tensors"]:
        enc = t["layout"] + (" sym" if t["symmetric"] else " asym") if t["layout"] else t["encoding"]
        table.add_row(
            t["name"], enc, "x".join(map(str, t["shape"])), f"{t['offset']:,}", f"{t['nbytes']:,}", t["xxh3"]
        )
    out.print(table)
    meta = Table(title="metadata", show_edge=False, pad_edge=False, title_justify="left")
    meta.add_column("key", no_wrap=True)
    meta.add_column("value")
    for key, value in info["metadata"].items():
        meta.add_row(key, json.dumps(value, ensure_ascii=False)[:400])
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
