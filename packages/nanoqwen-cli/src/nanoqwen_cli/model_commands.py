"""Models by name in the CLI: `resolve_model` (what `generate`, `chat` and `serve` call on their MODEL
argument) and the `list` and `rm` commands of the model cache.

MODEL is a .nanoqwen file, a local GGUF file or Hugging Face folder, or a Hugging Face id
(`owner/name[@revision][:file.gguf|:QUANT][:recipe]`); anything but a .nanoqwen file is fetched and
packed into the cache once (`$NANOQWEN_CACHE/models`, default ~/.cache/nanoqwen/models) and found there
afterwards without the network. The rules live in nanoqwen_quant.model_cache / model_fetch, imported
only when a name needs them (`--help` stays fast, and a .nanoqwen path imports nothing more).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .container_commands import fit_columns
from .errors import CliError

PIPE_WIDTH = 80


def resolve_model(model: str | Path) -> Path:
    """The .nanoqwen file MODEL names, fetched and packed into the cache when needed (progress and the
    recipe on stderr). CliError (one line, exit 1) when it cannot be found, fetched or packed."""
    from nanoqwen_quant.model_cache import ModelNameError
    from nanoqwen_quant.model_fetch import ModelFetchError, resolve

    try:
        return resolve(str(model))
    except (ModelNameError, ModelFetchError) as e:
        raise CliError(str(e)) from None


def _console():
    from rich.console import Console

    console = Console()
    return console if console.is_terminal else Console(width=PIPE_WIDTH)


def list_models(
    as_json: Annotated[bool, typer.Option("--json", help="print one JSON list instead of the table")] = False,
) -> None:
    """List the models in the cache: name, recipe, size and file ($NANOQWEN_CACHE/models)."""
    import json

    from nanoqwen_quant.model_cache import cached_models, file_size, models_dir
    from rich.markup import escape
    from rich.table import Table

    models = cached_models()
    if as_json:
        typer.echo(json.dumps([{"name": m.name, "recipe": m.recipe, "full_name": m.full_name,
                                "bytes": m.nbytes, "path": str(m.path)} for m in models], indent=2))
        return
    out = _console()
    if not models:
        out.print(f"no models in the cache {escape(str(models_dir()))}", highlight=False, soft_wrap=True)
        return
    headers = ["name", "recipe", "size", "file"]
    rows = [[m.name, m.recipe, file_size(m.nbytes), m.path.name] for m in models]
    kept = fit_columns(headers, rows, out.width, ["file"])
    out.print(escape(str(models_dir())), highlight=False, soft_wrap=True)
    table = Table(box=None, pad_edge=False, header_style="bold")
    for col in kept:
        table.add_column(col, justify="right" if col == "size" else "left", overflow="fold")
    for r in rows:
        table.add_row(*[escape(v) for h, v in zip(headers, r, strict=True) if h in kept])
    out.print(table)
    if "file" not in kept:
        out.print(f"(file names left out at {out.width} columns: list --json or a wider terminal shows them)",
                  highlight=False)


def rm(
    name: Annotated[str, typer.Argument(help="a cached model as `list` shows it: NAME, or NAME:RECIPE when "
                                        "several recipes of it are cached, or its file name")],
) -> None:
    """Remove a model from the cache."""
    from nanoqwen_quant.model_cache import ModelNameError, file_size, remove

    try:
        removed = remove(name)
    except ModelNameError as e:
        raise CliError(str(e)) from None
    for m in removed:
        typer.echo(f"removed {m.full_name} ({file_size(m.nbytes)}): {m.path}")
