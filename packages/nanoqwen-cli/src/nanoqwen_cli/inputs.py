"""What the user hands the CLI, checked before any model work: the model path and the prompt text.

Model path (`check_model_path`): a .nanoqwen container. A GGUF file (by its magic, `GGUF`) or a
Hugging Face folder (config.json or *.safetensors inside) is refused with the command that packs it;
a missing path or another folder is refused too. The container itself is checked by the loaders
(nanoqwen_format raises one FormatError per kind of damage; errors.py shows it as one line).

Prompt text (`read_prompt`, `decode_line`): from the argument (`-p TEXT`), stdin (`-p -` or
`--prompt-file -`) or a file (`--prompt-file PATH`), used byte for byte (a trailing newline is kept).
It must be UTF-8: invalid bytes are refused with their byte offset. An argument reaches Python as
text the OS decoded with surrogateescape (an invalid byte becomes a lone surrogate U+DC80..U+DCFF), so
it is encoded back to the OS's bytes first and the offset is that of the byte on the command line.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from .errors import CliError, UsageError

GGUF_MAGIC = b"GGUF"
STDIN = "-"


def _pack_hint(path: Path) -> str:
    return f"pack it first: nanoqwen-quant pack {shlex.quote(str(path))} -o model.nanoqwen"


def check_model_path(path: Path) -> Path:
    """Refuse what is certainly not a .nanoqwen container, saying what to do; return `path`."""
    if path.is_dir():
        if (path / "config.json").is_file() or any(path.glob("*.safetensors")):
            raise CliError(f"{path} is a Hugging Face checkpoint folder, not a .nanoqwen container; "
                           + _pack_hint(path))
        raise CliError(f"{path} is a folder, not a .nanoqwen container")
    if not path.exists():
        raise CliError(f"no such file: {path}")
    with open(path, "rb") as f:
        head = f.read(len(GGUF_MAGIC))
    if head == GGUF_MAGIC:
        raise CliError(f"{path} is a GGUF file, not a .nanoqwen container; " + _pack_hint(path))
    return path


def decode_utf8(data: bytes, what: str) -> str:
    """`data` as text; invalid UTF-8 is refused (exit 2) with the offset of the first bad byte."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        bad = data[e.start:e.end].hex(" ")
        raise UsageError(f"{what} is not valid UTF-8: byte offset {e.start} (0x{bad}: {e.reason})") from None


def _text_from_os(text: str, what: str, to_bytes) -> str:
    """Text the OS or a stream decoded with surrogateescape, checked as UTF-8."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        pass
    try:
        data = to_bytes(text)
    except UnicodeEncodeError as e:  # a surrogate surrogateescape cannot have made (U+D800..U+DC7F, ...)
        raise UsageError(f"{what} holds a lone surrogate U+{ord(text[e.start]):04X} at character "
                         f"{e.start}; give UTF-8 text") from None
    return decode_utf8(data, what)


def read_prompt(prompt: str | None, prompt_file: Path | None, stdin=None) -> str:
    """The prompt from `-p TEXT`, `-p -` (stdin) or `--prompt-file PATH|-`; exactly one must be given."""
    if prompt is not None and prompt_file is not None:
        raise UsageError("give the prompt once: --prompt TEXT, --prompt - (stdin) or --prompt-file PATH")
    if prompt is None and prompt_file is None:
        raise UsageError("no prompt: give --prompt TEXT, --prompt - (read stdin) or --prompt-file PATH")
    if prompt == STDIN or (prompt_file is not None and str(prompt_file) == STDIN):
        stream = stdin if stdin is not None else sys.stdin
        data = stream.buffer.read() if hasattr(stream, "buffer") else stream.read()
        if isinstance(data, str):
            return _text_from_os(data, "the prompt on stdin", lambda t: t.encode("utf-8", "surrogateescape"))
        return decode_utf8(data, "the prompt on stdin")
    if prompt_file is not None:
        try:
            data = prompt_file.read_bytes()
        except OSError as e:
            raise CliError(f"cannot read --prompt-file {prompt_file}: {e.strerror or e}") from None
        return decode_utf8(data, f"--prompt-file {prompt_file}")
    return _text_from_os(prompt, "the prompt (--prompt)", os.fsencode)


def text_arg(value: str, option: str) -> str:
    """A text option from the command line (--system, --stop), checked as UTF-8 like the prompt."""
    return _text_from_os(value, option, os.fsencode)


def decode_line(line: str) -> str:
    """One line of chat input (stdin read with surrogateescape), checked as UTF-8."""
    return _text_from_os(line, "this line", lambda t: t.encode("utf-8", "surrogateescape"))


def stdin_tolerant(stream=None) -> None:
    """Make stdin decode UTF-8 with surrogateescape, so an invalid byte reaches `decode_line` (which
    refuses that one line) instead of raising inside `input()` and ending the chat."""
    stream = stream if stream is not None else sys.stdin
    try:
        stream.reconfigure(encoding="utf-8", errors="surrogateescape")
    except (AttributeError, ValueError, OSError):  # not a TextIOWrapper, or already read from
        pass
