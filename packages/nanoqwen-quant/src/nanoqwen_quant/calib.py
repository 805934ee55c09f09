"""Calibration and held-out evaluation text, tokenized with the model's own tokenizer.

Corpus: the `.py` sources of the running Python's standard library (present on any machine, real code,
deterministic for a given Python version). Each file goes to exactly one of two splits, fixed by the
sha256 of its path relative to the stdlib root:

    first byte of sha256(relpath) <  HELDOUT_BYTE  -> "heldout" (about 10% of files; eval text)
    first byte of sha256(relpath) >= HELDOUT_BYTE  -> "calib"   (GPTQ / AWQ calibration)

so calibration and evaluation text never share a file. Inside a split, files are taken in order of
that hash (a deterministic shuffle across packages). The calibration text made of the "calib" split is
either its documented functions as chat conversations in the model's template (`calib_chat.py`: the
default of a pack, `--calib-text chat`) or its files as they are (`--calib-text code`); documents are
joined by a blank line until enough tokens are collected. `--calib PATH` replaces both with user
files/folders (every file, recursively, in sorted path order; files that are not UTF-8 text are
refused).

Calibration sequences are `n_tokens // seq_len` non-overlapping windows of `seq_len` tokens of the
concatenated token stream; the sha256 of the int32 token ids goes into the container metadata.
"""

from __future__ import annotations

import hashlib
import sys
import sysconfig
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .calib_chat import ChatRenderer, chat_texts

HELDOUT_BYTE = 26  # 26/256 ~ 10% of the stdlib files are held out for evaluation
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


class CalibrationError(ValueError):
    """Calibration text is missing, unreadable or too short."""


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _hash(rel: str) -> bytes:
    return hashlib.sha256(rel.encode()).digest()


def stdlib_files(split: str) -> list[Path]:
    """The stdlib `.py` files of one split ("calib" or "heldout"), in hash order."""
    if split not in ("calib", "heldout"):
        raise ValueError(f"split must be 'calib' or 'heldout', got {split!r}")
    root = stdlib_root()
    items = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root).as_posix()
        if _SKIP_DIRS & set(rel.split("/")[:-1]) or not p.is_file():
            continue
        h = _hash(rel)
        if (h[0] < HELDOUT_BYTE) == (split == "heldout"):
            items.append((h, p))
    items.sort()
    if not items:
        raise CalibrationError(f"no Python sources found under {root}")
    return [p for _, p in items]


def user_files(paths: list[str | Path]) -> list[Path]:
    """Every file under the given files/folders, in sorted path order."""
    out = []
    for spec in paths:
        p = Path(spec).expanduser()
        if p.is_file():
            out.append(p)
        elif p.is_dir():
            out += sorted(q for q in p.rglob("*") if q.is_file())
        else:
            raise CalibrationError(f"calibration path not found: {spec}")
    if not out:
        raise CalibrationError(f"no files under {[str(p) for p in paths]}")
    return out


def _read_text(p: Path, strict: bool) -> str | None:
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        if strict:
            raise CalibrationError(f"{p}: not UTF-8 text") from None
        return None


def heldout_text(n_chars: int) -> str:
    """At least `n_chars` characters of held-out stdlib code (whole files, never in calibration)."""
    parts, total = [], 0
    for p in stdlib_files("heldout"):
        t = _read_text(p, strict=False)
        if not t:
            continue
        parts.append(t)
        total += len(t) + 2
        if total >= n_chars:
            break
    return "\n\n".join(parts)


@dataclass
class CalibrationSet:
    """Token windows for GPTQ. ids: int64 [n_seqs, seq_len]."""

    ids: torch.Tensor
    source: str  # "python-stdlib X.Y.Z", "chat:python-stdlib X.Y.Z" or "files:" + the user paths
    files: int  # documents used: files, or conversations for the chat text
    sha256: str  # of the int32 token ids, row-major

    @property
    def tokens(self) -> int:
        return int(self.ids.numel())

    def to_metadata(self) -> dict:
        n, t = self.ids.shape
        return {"source": self.source, "files": self.files, "tokens": self.tokens, "sequences": int(n),
                "seq_len": int(t), "tokens_sha256": self.sha256, "heldout_rule": heldout_rule()}


def heldout_rule() -> str:
    return f"stdlib file held out iff sha256(relpath)[0] < {HELDOUT_BYTE}"


def build_calibration(tokenizer_json: str, n_tokens: int, seq_len: int, paths: list[str | Path] | None = None,
                      chat: ChatRenderer | None = None) -> CalibrationSet:
    """Tokenize calibration text into `n_tokens // seq_len` windows of `seq_len` tokens.

    The text, in order of precedence: the files under `paths` (user text); the conversations of
    `calib_chat` rendered by `chat` (the default of a pack: stdlib functions asked for and answered in
    the model's chat template); else the stdlib calibration split's code as it is. Each document (a file
    or a conversation) is followed by a blank line."""
    from tokenizers import Tokenizer

    if seq_len < 16 or n_tokens < seq_len:
        raise CalibrationError(f"need seq_len >= 16 and tokens >= seq_len, got {n_tokens} / {seq_len}")
    tok = Tokenizer.from_str(tokenizer_json)
    stdlib = f"python-stdlib {sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}"
    if paths:
        texts: Iterable[str | None] = (_read_text(p, True) for p in user_files(paths))
        source = "files:" + ",".join(str(p) for p in paths)
    elif chat is not None:
        texts = chat_texts(chat, stdlib_files("calib"))
        source = f"chat:{stdlib}"
    else:
        texts = (_read_text(p, False) for p in stdlib_files("calib"))
        source = stdlib
    want = (n_tokens // seq_len) * seq_len
    ids: list[int] = []
    used = 0
    sep = tok.encode("\n\n", add_special_tokens=False).ids
    for text in texts:
        if not text:
            continue
        ids += tok.encode(text, add_special_tokens=False).ids + sep
        used += 1
        if len(ids) >= want:
            break
    if len(ids) < want:
        raise CalibrationError(f"calibration text has {len(ids)} tokens, fewer than the {want} asked for")
    arr = np.asarray(ids[:want], dtype=np.int32)
    return CalibrationSet(torch.from_numpy(arr.astype(np.int64)).view(-1, seq_len), source, used,
                          hashlib.sha256(arr.tobytes()).hexdigest())
