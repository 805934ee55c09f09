"""The one place where failures become what a user sees: one line on stderr and an exit code.

    exit 0    done
    exit 1    a file, the model or the machine failed: a missing or unreadable file, a file that is not a
              .nanoqwen container (a GGUF or HF folder that needs packing, an empty, truncated or corrupt
              file), a bad model config or weights, no GPU, out of memory, a run-time model error
    exit 2    the command line is wrong: an option, its value or a combination of options, or the prompt
              (missing, empty, not UTF-8, longer than the context)
    exit 130  interrupted (Ctrl-C)

Every command is registered through `cli_command` (main.py), which runs it and turns the expected
exceptions into `error: <one line>`; anything else is a bug and keeps its traceback. `--debug` (a
global option: `nanoqwen-cli --debug generate ...`) or NANOQWEN_DEBUG=1 shows the traceback of expected
errors too. `describe` is the table: it names exceptions by module and class name, so nothing heavy
(torch, the runtime) is imported to classify an error that cannot have come from there.

Expected, by the class's package and name (most specific first):
    CliError / UsageError            raised by the CLI itself (its message, exit 1 / 2)
    nanoqwen_runtime SamplingError, ContextLengthError                          exit 2
    nanoqwen_format  FormatError family (TruncatedError, BadMagicError, ChecksumError, ...)   exit 1
    any other exception class defined in a nanoqwen_* package (ConfigError, BackendError,
      WeightError, TokenizerError, kernel build and device errors, ...)          exit 1
    torch OutOfMemoryError (CUDA OOM), with advice                              exit 1
    MemoryError, OSError (a file: missing, unreadable, a folder), UnicodeError  exit 1
    ValueError raised inside a nanoqwen_* module                                exit 1
    KeyboardInterrupt                                                           exit 130
"""

from __future__ import annotations

import functools
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import typer

EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

DEBUG_ENV = "NANOQWEN_DEBUG"

# Runtime errors that are about what the user asked for, not about the model or the machine.
_USAGE_CLASSES = {("nanoqwen_runtime", "SamplingError"), ("nanoqwen_runtime", "ContextLengthError")}

OOM_ADVICE = ("lower --kv-memory (e.g. --kv-memory 4GiB) or --max-model-len, or free the GPU "
              "of other processes")


class CliError(Exception):
    """An expected failure the CLI itself detects; `message` is the line shown, `exit_code` 1."""

    exit_code = EXIT_ERROR

    def __init__(self, message: str, exit_code: int | None = None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class UsageError(CliError):
    """The command line is wrong (an option, a combination of options, the prompt): exit 2."""

    exit_code = EXIT_USAGE


@dataclass(frozen=True)
class Failure:
    """What the user sees for one expected exception."""

    message: str
    exit_code: int


def _classes(exc: BaseException) -> list[tuple[str, str]]:
    """(top-level package, class name) of every class in the exception's MRO."""
    return [(c.__module__.split(".")[0], c.__name__) for c in type(exc).__mro__]


def _raised_in_nanoqwen(exc: BaseException) -> bool:
    """True when the innermost frame of the traceback is in a nanoqwen_* module (a deliberate raise,
    not a ValueError from deep inside numpy or torch)."""
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return str(tb.tb_frame.f_globals.get("__name__", "")).startswith("nanoqwen_")


def _first_sentence(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return re.split(r"(?<=\.)\s", line, maxsplit=1)[0]


def _format_hint(name: str) -> str:
    if name in ("ChecksumError", "IndexChecksumError", "MetadataChecksumError"):
        return " (the file is corrupt: copy or pack it again; `nanoqwen-cli verify FILE` checks it)"
    if name == "TruncatedError":
        return " (the file is incomplete: copy or pack it again)"
    if name == "BadMagicError":
        return " (not a .nanoqwen container)"
    return ""


def describe(exc: BaseException) -> Failure | None:
    """The line and exit code for an expected exception; None for anything else (a bug)."""
    if isinstance(exc, CliError):
        return Failure(str(exc), exc.exit_code)
    if isinstance(exc, KeyboardInterrupt):
        return Failure("interrupted (Ctrl-C)", EXIT_INTERRUPTED)
    classes = _classes(exc)
    text = str(exc) or type(exc).__name__
    if any(c in _USAGE_CLASSES for c in classes):
        return Failure(text, EXIT_USAGE)
    if any(c == ("nanoqwen_format", "FormatError") for c in classes):
        return Failure(f"{type(exc).__name__}: {text}{_format_hint(type(exc).__name__)}", EXIT_ERROR)
    if classes[0][0].startswith("nanoqwen_"):
        return Failure(f"{type(exc).__name__}: {text}", EXIT_ERROR)
    if any(pkg == "torch" and name == "OutOfMemoryError" for pkg, name in classes):
        return Failure(f"out of GPU memory ({_first_sentence(text)}); {OOM_ADVICE}", EXIT_ERROR)
    if isinstance(exc, MemoryError):
        return Failure("out of memory (host RAM); use a smaller model or prompt", EXIT_ERROR)
    if isinstance(exc, OSError):
        if exc.filename is not None and exc.strerror:
            return Failure(f"cannot read {exc.filename}: {exc.strerror}", EXIT_ERROR)
        return Failure(f"{type(exc).__name__}: {text}", EXIT_ERROR)
    if isinstance(exc, UnicodeError):
        return Failure(f"{type(exc).__name__}: {text}", EXIT_ERROR)
    if isinstance(exc, ValueError) and _raised_in_nanoqwen(exc):
        return Failure(text, EXIT_ERROR)
    return None


class _Debug:
    """`--debug` of the current command line (the global callback sets it on every invocation)."""

    on = False


def debug_enabled() -> bool:
    """`--debug` was given on this command line, or NANOQWEN_DEBUG=1."""
    return _Debug.on or os.environ.get(DEBUG_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def set_debug(value: bool) -> None:
    _Debug.on = bool(value)


def say(message: str) -> None:
    """One line on stderr: newlines inside the message are folded so it stays one line."""
    sys.stdout.flush()
    typer.echo("error: " + " ".join(message.split("\n")), err=True)


def handle(exc: BaseException) -> Failure:
    """Report an expected exception as one line and return it; re-raise anything else, and every
    exception in debug mode (so its traceback shows)."""
    failure = describe(exc)
    if failure is None or debug_enabled():
        raise exc
    if failure.exit_code == EXIT_INTERRUPTED:
        sys.stdout.flush()
        typer.echo(failure.message, err=True)
    else:
        say(failure.message)
    return failure


def cli_command(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a command function: expected exceptions become one line on stderr and typer.Exit(code)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort):
            raise
        except BrokenPipeError:  # stdout closed early (`| head`): nothing more to say to anyone
            _silence_stdout()
            raise typer.Exit(EXIT_ERROR) from None
        except BaseException as exc:  # noqa: BLE001 - the table decides; the rest is re-raised
            if isinstance(exc, SystemExit | GeneratorExit):
                raise
            failure = handle(exc)
            raise typer.Exit(failure.exit_code) from None

    return run


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not report the broken pipe."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
