"""The hostile-input table of the CLI: every row runs `python -m nanoqwen_cli.main` in a
subprocess on the CPU (CUDA_VISIBLE_DEVICES="", so no GPU even where one exists) and checks

- the exit code: 1 for a file, the model or the machine, 2 for the command line and the prompt;
- stderr: exactly one line, holding every phrase of `says` (case-insensitive), and no traceback.
  A row that exits 0 (the session goes on) must print one `error:` line for each refused input and
  nothing else of the kind;
- no file left behind: the folder the command runs in (which holds every input) lists the same names
  before and after.

The inputs are built by hostile/cli_hostile_inputs.py. "{name}" in a row's argv is the path of input
`name`; bytes in argv go to the OS unchanged (how invalid UTF-8 reaches a real command line).
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "hostile"))

import cli_hostile_inputs as hostile  # noqa: E402

TIMEOUT_S = 180


@dataclass(frozen=True)
class Row:
    case: str
    argv: tuple[str | bytes, ...]
    code: int
    says: tuple[str, ...] = ()   # phrases of the one error line
    stdin: bytes = b""
    replies: int | None = None   # chat: the number of answers expected on stdout
    started: bool = False        # the error comes after the backend and sampling lines (2 more lines)


M = "{tiny}"
BAD_ARG = os.fsencode("def f(\udcff):")             # the OS hands Python b"def f(\xff):"
SURROGATE_ARG = os.fsencode("ab\udced\udca0\udc80")  # b"ab\xed\xa0\x80": a UTF-8-encoded lone surrogate
PACK = "pack it first: nanoqwen-quant pack"
FLIPPED = ("checksum", hostile.FLIPPED_TENSOR)
NONFINITE = ("non-finite logits",)
LONG = ("tokens but the context window is 256 tokens",)
P = ("-p", "x")

TABLE = [
    # --- damaged containers --------------------------------------------------------------------------
    Row("empty file", ("generate", "{empty}", *P), 1, ("TruncatedError", "0 bytes")),
    Row("empty file, chat", ("chat", "{empty}"), 1, ("TruncatedError",), stdin=b"hi\n"),
    Row("truncated file", ("generate", "{truncated}", *P), 1, ("TruncatedError",)),
    Row("truncated file, inspect", ("inspect", "{truncated}"), 1, ("TruncatedError",)),
    Row("wrong magic", ("generate", "{magic}", *P), 1, ("BadMagicError", "not a .nanoqwen")),
    Row("wrong magic, verify", ("verify", "{magic}"), 1, ("BadMagicError",)),
    # checksums are verified on load by default: generate and chat refuse a flipped byte, naming the tensor
    Row("flipped byte in a tensor", ("generate", "{flipped}", *P), 1, FLIPPED),
    Row("flipped byte in a tensor, chat", ("chat", "{flipped}"), 1, FLIPPED, stdin=b"hi\n"),
    Row("flipped byte in a tensor, verify", ("verify", "{flipped}"), 1, FLIPPED),
    Row("flipped byte, --no-verify", ("generate", "{flipped}", *P, "--no-verify", "--max-tokens=2"), 0),
    # non-finite weights are refused at load, naming the tensor (greedy printed "!!!!", sampling crashed)
    Row("final_norm NaN, greedy", ("generate", "{nan_norm}", *P, "--temperature", "0"), 1, ("final_norm",)),
    Row("final_norm NaN, sampling", ("generate", "{nan_norm}", *P, "--temperature", "0.8"), 1,
        ("final_norm",)),
    Row("final_norm NaN, chat", ("chat", "{nan_norm}"), 1, ("final_norm",), stdin=b"hi\n"),
    # finite weights whose logits overflow: the request ends with an error, no garbage on stdout
    Row("non-finite logits at run time", ("generate", "{overflow}", *P, "--json"), 1, NONFINITE),
    Row("non-finite logits at run time, text", ("generate", "{overflow}", *P), 1, NONFINITE, started=True),
    Row("non-finite logits at run time, chat", ("chat", "{overflow}"), 1, NONFINITE, stdin=b"hi\n",
        replies=1, started=True),
    # --- not a container yet -----------------------------------------------------------------------
    # generate and chat pack a GGUF or HF folder into the model cache (test_models_by_name.py); these are
    # broken ones, refused naming the file and why, with nothing written to the cache (run_cli's env)
    Row("broken GGUF passed to generate", ("generate", "{gguf}", *P), 1,
        ("model.gguf cannot be packed", "architecture None is not supported")),
    Row("broken GGUF passed to chat", ("chat", "{gguf}"), 1, ("model.gguf cannot be packed",)),
    Row("broken HF folder passed to generate", ("generate", "{hf}", *P), 1,
        ("Qwen2.5-Coder-0.5B cannot be packed", "config.json lacks the required keys")),
    Row("broken HF folder passed to chat", ("chat", "{hf}"), 1, ("Qwen2.5-Coder-0.5B cannot be packed",)),
    Row("GGUF passed to bench --model", ("bench", "--model", "{gguf}", "--out", "bench-out"), 1, (PACK,)),
    Row("missing model file", ("generate", "{missing}", *P), 1, ("no such file",)),
    # --- the prompt ----------------------------------------------------------------------------------
    Row("invalid UTF-8 in the prompt argument", ("generate", M, "-p", BAD_ARG), 2,
        ("not valid UTF-8", "byte offset 6")),
    Row("lone surrogate in the prompt argument", ("generate", M, "-p", SURROGATE_ARG), 2,
        ("not valid UTF-8", "byte offset 2")),
    Row("invalid UTF-8 in --prompt-file", ("generate", M, "--prompt-file", "{bad_utf8}"), 2,
        ("--prompt-file", "not valid UTF-8", "byte offset 7")),
    Row("invalid UTF-8 on stdin (-p -)", ("generate", M, "-p", "-"), 2, ("stdin", "byte offset 3"),
        stdin=b"abc\x80def"),
    Row("invalid UTF-8 in --system", ("chat", M, "--system", BAD_ARG), 2, ("--system", "byte offset 6")),
    Row("empty prompt without --chat", ("generate", M, "-p", ""), 2, ("prompt is empty",)),
    Row("empty stdin with -p -", ("generate", M, "-p", "-"), 2, ("prompt is empty",)),
    Row("no prompt at all", ("generate", M), 2, ("no prompt",)),
    Row("two prompts", ("generate", M, *P, "--prompt-file", "{good}"), 2, ("give the prompt once",)),
    Row("prompt longer than the context", ("generate", M, "-p", "word " * 400), 2, LONG),
    Row("prompt file over 128 KiB, longer than the context", ("generate", M, "--prompt-file", "{long}"), 2,
        LONG),
    Row("--prompt-file missing", ("generate", M, "--prompt-file", "{missing}"), 1,
        ("cannot read --prompt-file", "No such file")),
    Row("-p - reads the prompt from stdin", ("generate", M, "-p", "-", "--max-tokens", "3"), 0,
        stdin=b"def add(a, b):\n"),
    Row("--prompt-file reads the prompt", ("generate", M, "--prompt-file", "{good}", "--max-tokens", "3"), 0),
    # --- options ------------------------------------------------------------------------------------
    Row("negative temperature", ("generate", M, *P, "--temperature", "-1"), 2, ("temperature must be",)),
    Row("NaN temperature", ("generate", M, *P, "--temperature", "nan"), 2, ("finite",)),
    Row("top-p above 1", ("generate", M, *P, "--top-p", "1.5"), 2, ("top_p must be in (0, 1]",)),
    Row("negative top-k", ("generate", M, *P, "--top-k", "-1"), 2, ("top_k must be",)),
    Row("zero max-tokens", ("generate", M, *P, "--max-tokens", "0"), 2, ("max_tokens must be",)),
    Row("bad sampling value in chat", ("chat", M, "--top-p", "0"), 2, ("top_p must be",)),
    Row("temperature not a number", ("generate", M, *P, "--temperature", "abc"), 2,
        ("--temperature", "generate --help")),
    Row("unknown option", ("chat", M, "--nope"), 2, ("No such option",)),
    Row("--system without --chat", ("generate", M, *P, "--system", "s"), 2, ("--system needs --chat",)),
    Row("--device cuda without a GPU", ("generate", M, *P, "--device", "cuda"), 1, ("no CUDA GPU",)),
    Row("unknown device", ("generate", M, *P, "--device", "tpu"), 2, ("--device must be",)),
    Row("--max-model-len over the model's", ("generate", M, *P, "--max-model-len", "4096"), 2,
        ("--max-model-len must be <= 256",)),
    Row("--speculate with K over 7", ("generate", M, *P, "--speculate", "ngram:8"), 2,
        ("--speculate", "K must be in 1..7")),
    Row("--speculate unknown method, chat", ("chat", M, "--speculate", "medusa"), 2,
        ("--speculate", "unknown speculation 'medusa'", "ngram:K")),
    # --- chat sessions go on ------------------------------------------------------------------------
    Row("chat: an invalid UTF-8 line, then a valid one", ("chat", M, "--max-tokens", "4"), 0,
        ("not valid UTF-8", "byte offset 0", "not sent"), stdin=b"\xff\xfe bad\nhello\n", replies=1),
    Row("chat: a turn longer than the context, then a short one", ("chat", M, "--max-tokens", "4"), 0,
        LONG + ("turn is dropped",), stdin=b"word " * 300 + b"\nhello\n", replies=1),
    Row("chat: end of input at once", ("chat", M), 0, stdin=b"", replies=0),
    # --- bench --------------------------------------------------------------------------------------
    Row("bench --model without a GPU", ("bench", "--model", M, "--out", "bench-out"), 1,
        ("needs a CUDA GPU",)),
    Row("bench with a bad --kv-memory", ("bench", "--model", M, "--kv-memory", "lots"), 2, ("--kv-memory",)),
    Row("bench --workload without --model", ("bench", "--workload", "code-edit"), 2,
        ("--workload needs --model", "random weights")),
    Row("bench --workload unknown", ("bench", "--model", M, "--workload", "poetry"), 2,
        ("--workload must be one of code-edit, free-form", "'poetry'")),
    Row("bench --workload --speculate off", ("bench", "--model", M, "--workload", "code-edit", "--speculate",
                                             "off"), 2, ("nothing to compare",)),
    Row("bench --workload --prompts 0", ("bench", "--model", M, "--workload", "free-form", "--prompts", "0"),
        2, ("--prompts must be >= 1",)),
    Row("bench --speculate without --workload", ("bench", "--model", M, "--speculate", "ngram"), 2,
        ("--speculate is a --workload option",)),
    Row("bench --cache-reuse without autocomplete", ("bench", "--model", M, "--workload", "free-form",
                                                     "--cache-reuse", "64"), 2,
        ("--cache-reuse is an option of --workload autocomplete",)),
    Row("bench --cache-reuse -1", ("bench", "--model", M, "--workload", "autocomplete", "--cache-reuse",
                                   "-1"), 2, ("--cache-reuse must be >= 0",)),
    Row("bench --workload without a GPU", ("bench", "--model", M, "--workload", "code-edit", "--out",
                                           "bench-out"), 1, ("needs a CUDA GPU",)),
]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    folder = tmp_path_factory.mktemp("hostile")
    sound = hostile.tiny(folder)
    paths = {
        "tiny": sound,
        "empty": hostile.empty(folder),
        "truncated": hostile.truncated(folder, sound),
        "magic": hostile.wrong_magic(folder, sound),
        "flipped": hostile.flipped_byte(folder, sound),
        "nan_norm": hostile.nan_final_norm(folder, sound),
        "overflow": hostile.overflowing_final_norm(folder, sound),
        "gguf": hostile.gguf(folder),
        "hf": hostile.hf_folder(folder),
        "bad_utf8": hostile.text_file(folder, "bad.txt", b"def f(x\xff):\n"),
        "good": hostile.text_file(folder, "good.txt", b"def add(a, b):\n"),
        "long": hostile.text_file(folder, "long.txt", hostile.long_code(150 * 1024)),
        "missing": folder / "missing.txt",
    }
    return folder, paths


def listing(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def run_cli(folder: Path, argv: list[str | bytes], stdin: bytes) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "NANOQWEN_DEBUG"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["NANOQWEN_CACHE"] = str(folder.parent / f"{folder.name}-cache")  # outside `folder`: its own listing
    command = [sys.executable, "-m", "nanoqwen_cli.main", *argv]
    proc = subprocess.run(command, input=stdin, capture_output=True, cwd=folder, env=env, timeout=TIMEOUT_S)
    assert not (folder.parent / f"{folder.name}-cache" / "models").exists() or not any(
        (folder.parent / f"{folder.name}-cache" / "models").iterdir()), "a refused model left a cache file"
    return proc


@pytest.mark.parametrize("row", [pytest.param(r, id=r.case) for r in TABLE])
def test_hostile_input(row: Row, inputs):
    folder, paths = inputs
    argv = [a.format(**{k: str(v) for k, v in paths.items()}) if isinstance(a, str) else a for a in row.argv]
    before = listing(folder)
    proc = run_cli(folder, argv, row.stdin)
    stderr = proc.stderr.decode("utf-8", "replace")
    shown = f"rc {proc.returncode}\nstderr:\n{stderr}\nstdout:\n{proc.stdout[-2000:]!r}"
    assert proc.returncode == row.code, shown
    assert "Traceback" not in stderr, shown
    lines = [line for line in stderr.splitlines() if line.strip()]
    if row.code != 0:
        assert len(lines) == 1 + 2 * row.started, shown
        assert not row.started or lines[0].startswith("backend:"), shown
        refused = lines[-1:]
    else:
        refused = [line for line in lines if line.startswith("error:")]
        assert len(refused) == (1 if row.says else 0), shown
        assert proc.stdout, shown
    for phrase in row.says:
        assert phrase.lower() in refused[0].lower(), shown
    if row.replies is not None:
        assert proc.stdout.decode().count("assistant> ") == row.replies, shown
    assert listing(folder) == before, "files left behind"
