"""The global options (--version, --debug), the help texts, a light start, and errors.py's table."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from nanoqwen_cli import errors
from nanoqwen_cli.main import app
from typer.testing import CliRunner

runner = CliRunner()
COMMANDS = ("generate", "chat", "bench", "inspect", "verify")


def run_module(*args: str, env: dict | None = None, code: str | None = None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k != "NANOQWEN_DEBUG"}
    argv = ["-c", code] if code else ["-m", "nanoqwen_cli.main", *args]
    env = {**base, **(env or {})}
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, timeout=120)


def test_version_names_every_package_and_torch():
    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0].startswith("nanoqwen-cli 0.")
    names = [line.split()[0] for line in lines[1:]]
    assert names == ["nanoqwen-format", "nanoqwen-model", "nanoqwen-quant", "nanoqwen-kernels",
                     "nanoqwen-runtime", "torch", "python"]
    import torch

    assert f"  torch {torch.__version__}" in lines


def test_help_and_version_do_not_import_torch():
    code = "\n".join([
        "import sys",
        "from nanoqwen_cli.main import main",
        "for argv in (['--version'], ['--help'], ['generate', '--help'], ['chat', '--help']):",
        "    try:",
        "        main(argv)",
        "    except SystemExit as e:",
        "        assert e.code == 0, (argv, e.code)",
        "heavy = [m for m in ('torch', 'nanoqwen_runtime.backend', 'numpy') if m in sys.modules]",
        "print('HEAVY', heavy)",
    ])
    r = run_module(code=code)
    assert r.returncode == 0, r.stderr
    assert "HEAVY []" in r.stdout


def test_top_level_help_lists_every_command():
    r = runner.invoke(app, ["--help"], env={"COLUMNS": "200"})
    assert r.exit_code == 0
    assert "Inspect and verify .nanoqwen containers." not in r.stdout  # the old, partial summary
    for cmd in COMMANDS:
        assert cmd in r.stdout
    assert "--version" in r.stdout and "--debug" in r.stdout


def test_system_help_matches_each_command():
    gen = runner.invoke(app, ["generate", "--help"], env={"COLUMNS": "200"}).stdout
    chat = runner.invoke(app, ["chat", "--help"], env={"COLUMNS": "200"}).stdout
    assert "system message (needs --chat)" in gen
    assert "--chat" not in chat  # chat has no --chat option, and its --system does not need one
    for text in (gen, chat):
        assert "--no-verify" in text and "--max-model-len" in text
    assert "--prompt-file" in gen and "- reads it from stdin" in gen


@pytest.mark.parametrize("how", [["--debug"], []])
def test_debug_shows_the_traceback(tmp_path, how):
    empty = tmp_path / "empty.nanoqwen"
    empty.write_bytes(b"")
    r = run_module(*how, "inspect", str(empty), env={} if how else {"NANOQWEN_DEBUG": "1"})
    assert r.returncode == 1
    assert "Traceback (most recent call last)" in r.stderr and "TruncatedError" in r.stderr
    plain = run_module("inspect", str(empty))
    assert plain.returncode == 1 and plain.stderr.count("\n") == 1 and "Traceback" not in plain.stderr


def test_a_bug_keeps_its_traceback(monkeypatch, tmp_path):
    """An exception errors.py does not list is not dressed as a one-line error."""
    import nanoqwen_format as nqf

    def broken(path):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(nqf, "open", broken)
    path = tmp_path / "m.nanoqwen"
    path.write_bytes(b"x" * 64)
    r = runner.invoke(app, ["verify", str(path)])
    assert isinstance(r.exception, ZeroDivisionError)


def _raise_in(module_name: str, exc: BaseException) -> BaseException:
    """`exc` raised from a frame whose module is `module_name` (as errors.py sees a traceback)."""
    namespace = {"__name__": module_name}
    exec("def boom(e):\n    raise e\n", namespace)
    try:
        namespace["boom"](exc)
    except BaseException as caught:  # noqa: BLE001
        return caught
    raise AssertionError("not raised")


def test_describe_table():
    import torch
    from nanoqwen_format import ChecksumError
    from nanoqwen_model import ConfigError
    from nanoqwen_runtime.backend import BackendError, ContextLengthError
    from nanoqwen_runtime.sampling import SamplingError

    oom = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has 1 GiB free.")
    cases = [
        (errors.UsageError("bad option"), 2, "bad option"),
        (errors.CliError("no such file: x"), 1, "no such file"),
        (SamplingError("top_p must be in (0, 1]"), 2, "top_p"),
        (ContextLengthError("the prompt has 9 tokens but the context window is 8 tokens"), 2, "9 tokens"),
        (ChecksumError("checksum mismatch", path="m.nanoqwen", where="tensor 'x'"), 1,
         "ChecksumError: m.nanoqwen: tensor 'x': checksum mismatch (the file is corrupt"),
        (ConfigError("hidden_size must be positive"), 1, "ConfigError: hidden_size"),
        (BackendError("no CUDA GPU is available"), 1, "BackendError"),
        (oom, 1, "out of GPU memory (CUDA out of memory.); lower --kv-memory"),
        (MemoryError(), 1, "out of memory (host RAM)"),
        (FileNotFoundError(2, "No such file or directory", "m.nanoqwen"), 1,
         "cannot read m.nanoqwen: No such file or directory"),
        (UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"), 1, "UnicodeDecodeError"),
        (_raise_in("nanoqwen_runtime.chat", ValueError("this container has no chat template")), 1,
         "no chat template"),
        (KeyboardInterrupt(), 130, "interrupted"),
    ]
    for exc, code, phrase in cases:
        f = errors.describe(exc)
        assert f is not None and f.exit_code == code and phrase in f.message, (exc, f)
    # a ValueError from inside numpy is a bug of ours until shown otherwise: its traceback stays
    try:
        np.zeros(3).reshape(4)
    except ValueError as e:
        assert errors.describe(e) is None
    assert errors.describe(ZeroDivisionError()) is None


def test_parser_errors_are_one_line():
    r = run_module("generate", "m.nanoqwen", "-p", "x", "--top-k", "many")
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and "--top-k" in r.stderr and "generate --help" in r.stderr
    r = run_module("frobnicate")  # not a command ("serve" is one)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "No such command" in r.stderr
