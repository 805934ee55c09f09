"""The `autocomplete` workload: a user typing down a real file, one fill-in-the-middle request per stop.

Files: the Python standard library of the running interpreter (`workloads.stdlib_files`, sorted, then
shuffled with a seeded `random.Random`), so every machine with the same Python picks the same files
without anything to download. The current file is the first one with at least `prefix_max +
suffix_tokens` tokens of text; the extra file (another open file of the project) is the next one, cut
to its first `extra_tokens` tokens at a line end.

Requests: the cursor starts on the line where the text above it reaches `prefix_min` tokens and moves
down the file, the same number of lines each time, so that the last request's prefix holds about
`prefix_max` tokens. At each stop the user has typed half of the cursor's line: the prefix is the file
from its top to there, the suffix the rest of that line and the lines below, up to `suffix_tokens`
tokens. The prefix starts at the top of the file every time, as an editor sends the code above the
cursor: successive prompts share the extra file and the prefix up to the previous stop, which is what
the prefix cache can serve; the suffix follows the prefix in the FIM prompt and is prefilled again.
Nothing here imports torch or reads a model; token counts come from the tokenizer given.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from nanoqwen_runtime.fim import ExtraFile
from nanoqwen_runtime.tokenizer import Tokenizer

from .workloads import stdlib_dir, stdlib_files

__all__ = ["AutocompleteRequest", "autocomplete_requests"]


@dataclass(frozen=True)
class AutocompleteRequest:
    """One stop of the cursor: `prefix` / `suffix` text of `path`, and the extra file."""

    index: int
    path: str
    line: int
    prefix: str
    suffix: str
    extra: ExtraFile


def _lines_upto(lines: list[str], counts: list[int], budget: int, start: int = 0) -> int:
    """The end (exclusive) of the longest run of lines from `start` whose tokens stay within `budget`."""
    total, end = 0, start
    while end < len(lines) and total + counts[end] <= budget:
        total += counts[end]
        end += 1
    return end


def autocomplete_requests(tok: Tokenizer, n_requests: int = 32, *, prefix_min: int = 1024,
                          prefix_max: int = 2048, suffix_tokens: int = 1024, extra_tokens: int = 1024,
                          seed: int = 0) -> list[AutocompleteRequest]:
    """`n_requests` cursor stops down one stdlib file (module header). Raises ValueError when no file
    of the stdlib is long enough."""
    if n_requests < 1 or not 0 < prefix_min <= prefix_max or suffix_tokens < 1 or extra_tokens < 0:
        raise ValueError(f"bad sizes: n_requests={n_requests}, prefix {prefix_min}..{prefix_max}, "
                         f"suffix {suffix_tokens}, extra {extra_tokens}")
    root = stdlib_dir()
    files = stdlib_files()
    random.Random(seed).shuffle(files)
    chosen: list[tuple[str, list[str], list[int]]] = []
    for f in files:
        try:
            text = (root / f).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        lines = text.splitlines(keepends=True)
        counts = [len(tok.encode_text(ln)) for ln in lines]
        need = prefix_max + suffix_tokens if not chosen else 1
        if sum(counts) >= need and len(lines) > 8:
            chosen.append((f, lines, counts))
            if len(chosen) == 2:
                break
    if len(chosen) < 2:
        raise ValueError(f"no stdlib file under {root} has {prefix_max + suffix_tokens} tokens")
    (path, lines, counts), (extra_path, extra_lines, extra_counts) = chosen
    extra = ExtraFile(extra_path, "".join(extra_lines[:_lines_upto(extra_lines, extra_counts, extra_tokens)]))
    # the cursor's first line is the one where the text above it reaches prefix_min tokens
    first = min(len(lines) - 2, _lines_upto(lines, counts, prefix_min) + 1)
    last = max(first, _lines_upto(lines, counts, prefix_max))
    step = max(1, (last - first) // max(1, n_requests - 1))
    out = []
    for i in range(n_requests):
        line = min(first + i * step, len(lines) - 2)
        cur = lines[line]
        typed = len(cur.rstrip("\n")) // 2
        prefix = "".join(lines[:line]) + cur[:typed]
        below = _lines_upto(lines, counts, max(0, suffix_tokens - counts[line]), line + 1)
        suffix = cur[typed:] + "".join(lines[line + 1:below])
        out.append(AutocompleteRequest(i, path, line, prefix, suffix, extra))
    return out
