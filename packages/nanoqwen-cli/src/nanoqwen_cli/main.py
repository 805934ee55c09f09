"""The `nanoqwen-cli` command: a small registry of subcommands.

Each command lives in its own module as a plain typer-annotated function; this file only imports
and registers them, so engineers can add `generate`, `chat` and `bench` without touching each other's
code. Run `nanoqwen-cli --help` (or `python -m nanoqwen_cli.main --help`).
"""

from __future__ import annotations

import typer

from .bench_commands import bench
from .container_commands import inspect, verify
from .generate_commands import chat, generate

app = typer.Typer(
    name="nanoqwen-cli",
    no_args_is_help=True,
    add_completion=False,
    help="nanoqwen: INT4 inference for Qwen2.5-Coder. Inspect and verify .nanoqwen containers.",
)

app.command("inspect")(inspect)
app.command("verify")(verify)
app.command("bench")(bench)
app.command("generate")(generate)
app.command("chat")(chat)


if __name__ == "__main__":
    app()
