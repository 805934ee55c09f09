"""Chat-formatted calibration text: the default text of GPTQ and AWQ.

Why: GPTQ fits each layer's rounding to the calibration activations. Calibrated on raw standard-library
code it won the held-out perplexity of raw code and lost 4.5 points of HumanEval pass rate to `none` on
the real 1.5B; calibrated on the same functions asked for and answered in the model's chat template, it
gained 1.7 (6.3 points over the raw-code calibration, p = 0.002; bench/RESULTS.md). A model is prompted
the way it is deployed, so it is calibrated that way.

What: each conversation is one documented function of the standard library's *calibration* split
(`calib.stdlib_files("calib")`, in its hash order; never the held-out split that the perplexity proxy
reads). The user gives the function's signature and docstring and asks for it in one of `INSTRUCTIONS`
(picked by a hash of the signature; none is the HumanEval harness's wording), and the assistant answers
with the whole function in a ```python block. Functions: top-level or in a class, not decorated, with a
docstring and at least one statement after it, 6-80 lines, each distinct source once, dedented to column
0.

Rendering: the source's own chat template (`Source.chat_template`), through transformers'
`apply_chat_template` (the renderer the runtime's `ChatTemplate` is tested byte-identical to), with
`add_generation_prompt=False`. `calib.build_calibration` tokenizes the conversations in order, each
followed by a blank line, exactly as it reads user files, so the token stream equals the one measured
through files written by nanoqwen_bench.quality.chat_calib (tests/test_chat_calibration.py).
"""

from __future__ import annotations

import ast
import hashlib
from collections.abc import Iterable, Iterator
from pathlib import Path

__all__ = ["INSTRUCTIONS", "ChatRenderer", "chat_texts", "conversation", "conversations",
           "documented_functions"]

INSTRUCTIONS = (
    "Implement this Python function.",
    "Write the body of the following function so that it does what its docstring says.",
    "Here is a signature with its docstring. Give the full implementation.",
    "Fill in the implementation of this function.",
)
MIN_LINES, MAX_LINES = 6, 80


def documented_functions(source: str) -> Iterator[tuple[str, str]]:
    """(head, whole) for each documented function of `source`, in `ast.walk` order: head = the `def`
    line(s) through the end of the docstring, whole = the function's source; both dedented to column 0."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    lines = source.splitlines()
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or node.decorator_list:
            continue
        doc = node.body[0] if node.body else None
        if not (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
                and isinstance(doc.value.value, str)) or len(node.body) < 2:
            continue
        n = node.end_lineno - node.lineno + 1
        if not MIN_LINES <= n <= MAX_LINES:
            continue
        indent = node.col_offset
        block = lines[node.lineno - 1:node.end_lineno]
        if any(line.strip() and len(line) - len(line.lstrip()) < indent for line in block):
            continue  # a continuation line left of the def (odd formatting): skip rather than mangle
        block = [line[indent:] for line in block]
        head = block[:doc.end_lineno - node.lineno + 1]
        yield "\n".join(head), "\n".join(block)


def conversation(head: str, whole: str) -> list[dict[str, str]]:
    """The user's request for the function whose signature and docstring are `head`, and its answer."""
    pick = hashlib.sha256(head.encode()).digest()[0] % len(INSTRUCTIONS)
    return [
        {"role": "user", "content": f"{INSTRUCTIONS[pick]}\n\n```python\n{head}\n```"},
        {"role": "assistant", "content": f"```python\n{whole}\n```"},
    ]


def conversations(files: Iterable[Path], limit: int | None = None) -> Iterator[list[dict[str, str]]]:
    """Conversations from `files` in order (unreadable or non-UTF-8 files skipped), each distinct
    function once; at most `limit` when given."""
    seen: set[str] = set()
    count = 0
    for path in files:
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        for head, whole in documented_functions(source):
            if whole in seen:
                continue
            seen.add(whole)
            yield conversation(head, whole)
            count += 1
            if limit is not None and count >= limit:
                return


class ChatRenderer:
    """A chat template (jinja2 source) rendered by transformers, as `apply_chat_template` renders it.

    `bos_token_id` / `eos_token_id` (the model config's; the first of several eos ids) name the special
    tokens a template may use (`bos_token`, `eos_token`), as the runtime's `ChatTemplate` passes them."""

    def __init__(self, chat_template: str, tokenizer_json: str, bos_token_id: int | None = None,
                 eos_token_id: int | None = None):
        from tokenizers import Tokenizer
        from transformers import PreTrainedTokenizerFast

        if not chat_template:
            raise ValueError("the source has no chat template to render calibration conversations with")
        tok = Tokenizer.from_str(tokenizer_json)
        ids = {"bos_token": bos_token_id, "eos_token": eos_token_id}
        names = {name: tok.id_to_token(i) for name, i in ids.items()
                 if i is not None and tok.id_to_token(i) is not None}
        self._tok = PreTrainedTokenizerFast(tokenizer_object=tok, **names)
        self._template = chat_template

    def render(self, messages: list[dict[str, str]]) -> str:
        """The whole conversation's text, no generation prompt after it."""
        return self._tok.apply_chat_template(messages, chat_template=self._template, tokenize=False,
                                             add_generation_prompt=False)


def chat_texts(renderer: ChatRenderer, files: Iterable[Path]) -> Iterator[str]:
    """The rendered conversations of `files`, in order (lazily: the caller stops when it has enough)."""
    for messages in conversations(files):
        yield renderer.render(messages)
