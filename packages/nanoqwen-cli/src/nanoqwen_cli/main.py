"""The `nanoqwen-cli` command: a small registry of subcommands.

Each command lives in its own module as a plain typer-annotated function; this file only registers
them, each through `errors.cli_command` (the one mapping of expected errors to one line on stderr and
exit code 1 or 2), and adds the global options `--version` and `--debug`. `main()` is the console
entry point: it also turns the command-line parser's own errors (an unknown option, a value of the
wrong type) into one line and exit 2. Nothing here imports torch: `--help` and `--version` stay fast.
Run `nanoqwen-cli --help` (or `python -m nanoqwen_cli.main --help`).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from .bench_commands import bench
from .container_commands import inspect, verify
from .errors import EXIT_ERROR, EXIT_INTERRUPTED, EXIT_USAGE, cli_command, set_debug
from .generate_commands import chat, generate
from .infill_command import infill
from .model_commands import list_models, rm
from .serve_command import serve

# The other packages whose versions --version prints (torch last), in dependency order.
PACKAGES = ("nanoqwen-format", "nanoqwen-model", "nanoqwen-quant", "nanoqwen-kernels", "nanoqwen-runtime",
            "torch")

app = typer.Typer(
    name="nanoqwen-cli",
    no_args_is_help=True,
    add_completion=False,
    # plain Python tracebacks (with --debug): rich's would print every local, tensors included
    pretty_exceptions_enable=False,
    help="nanoqwen: INT4 inference for Qwen2.5-Coder. Generate text and chat with a .nanoqwen container "
         "(on the CPU or a Hopper GPU), benchmark the CUDA engine, inspect and verify containers. A model "
         "is a .nanoqwen file, a GGUF file, an HF folder or an HF id, packed into the cache once (list, rm). "
         "Errors are one line on stderr: exit 1 for a file, the model or the machine, 2 for the command "
         "line; --debug shows the traceback.",
)


def _version_of(dist: str) -> str:
    """The installed version of a distribution; the source tree's `__version__` when the package is
    only on PYTHONPATH (the GPU machines); 'not installed' otherwise. Imports nothing heavy."""
    from importlib import metadata, util

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        pass
    spec = util.find_spec(dist.replace("-", "_"))
    if spec is None or spec.origin is None:
        return "not installed"
    origin = Path(spec.origin)
    for source in (origin, origin.with_name("version.py")):  # torch keeps it in version.py
        if source.is_file():
            for line in source.read_text(encoding="utf-8").splitlines():
                if line.startswith("__version__"):
                    return line.split("=", 1)[1].split("#")[0].strip().strip("\"'") + " (not pip-installed)"
    return "unknown version"


def _print_version(value: bool) -> None:
    if not value:
        return
    typer.echo(f"nanoqwen-cli {_version_of('nanoqwen-cli')}")
    for dist in PACKAGES:
        typer.echo(f"  {dist} {_version_of(dist)}")
    typer.echo(f"  python {sys.version.split()[0]}")
    raise typer.Exit(0)


@app.callback()
def _global_options(
    version: Annotated[bool, typer.Option(
        "--version", is_eager=True, callback=_print_version,
        help="print the versions of nanoqwen-cli, the other nanoqwen packages and torch, and exit")] = False,
    debug: Annotated[bool, typer.Option(
        "--debug", help="show the traceback of an error, not one line (also: NANOQWEN_DEBUG=1)")] = False,
) -> None:
    set_debug(debug)


app.command("generate")(cli_command(generate))
app.command("chat")(cli_command(chat))
app.command("infill")(cli_command(infill))
app.command("bench")(cli_command(bench))
app.command("inspect")(cli_command(inspect))
app.command("verify")(cli_command(verify))
app.command("serve")(cli_command(serve))
app.command("list")(cli_command(list_models))
app.command("rm")(cli_command(rm))


def _parser_error(exc: Exception) -> int | None:
    """The exit code of an error of the command-line parser (click, or typer's copy of it), after
    saying it in one line; None when `exc` is not one. Classes are matched by name: typer releases
    differ in where click's exceptions live."""
    names = {c.__name__ for c in type(exc).__mro__ if c.__module__.split(".")[0] in ("click", "typer")}
    if "NoArgsIsHelpError" in names:  # no arguments at all: the help text
        exc.show()
        return exc.exit_code
    if "UsageError" in names:  # an unknown option or command, a missing argument, a value of the wrong type
        ctx = getattr(exc, "ctx", None)
        where = ctx.command_path if ctx is not None else "nanoqwen-cli"
        typer.echo(f"error: {exc.format_message()} (see {where} --help)".replace("\n", " "), err=True)
        return EXIT_USAGE
    if "ClickException" in names:
        typer.echo(f"error: {exc.format_message()}".replace("\n", " "), err=True)
        return exc.exit_code
    if "Abort" in names:
        typer.echo("interrupted", err=True)
        return EXIT_INTERRUPTED
    return None


def main(argv: list[str] | None = None) -> None:
    """Console entry point: run `app`; the parser's errors become one line too. Exits with the code."""
    try:
        code = app(args=argv, prog_name="nanoqwen-cli", standalone_mode=False)
    except Exception as exc:  # noqa: BLE001 - only the parser's errors are handled here
        code = _parser_error(exc)
        if code is None:
            raise
    sys.exit(code if isinstance(code, int) else (0 if code is None else EXIT_ERROR))


if __name__ == "__main__":
    main()
