"""Chat-formatted GPTQ calibration text: the test of why GPTQ loses pass rate (issue 16).

GPTQ asym g128 wins the held-out perplexity of stdlib code (the kind of text its calibration set is)
and loses 4.5 points of HumanEval pass rate against `none` where RTN asym loses 1.5
(bench/quality/README.md, 2026-12-04). The suspect: the calibration set is raw library code, while the
prompts that measure coding ability are chat-templated instructions. This script writes a calibration
set in the deployment's shape, to be packed with `nanoqwen-quant pack SRC -o OUT --method gptq --calib
DIR` and measured with `humaneval.py run --samples 20 --temperature 0.2` beside the other recipes.

    python bench/quality/chat_calib.py MODEL.nanoqwen --out DIR [--conversations 2000]

Each file DIR/chat-NNNNN.txt is one conversation rendered with MODEL's chat template (any container of
the same model: the template and special tokens are the tokenizer's): the user gives the signature
and docstring of a function and asks for it in one of `INSTRUCTIONS` (picked by the function's hash;
none is the HumanEval harness's wording), and the assistant answers with the whole function in a
```python block. The functions (top-level or in a class, with a docstring, 6-80 lines) come from the
standard library's calibration split (`nanoqwen_quant.calib.stdlib_files("calib")`, in its hash
order), never from the held-out split that the perplexity proxy reads. `build_calibration` reads the
files in sorted name order and tokenizes each with the model's tokenizer, which keeps the template's
special tokens (`<|im_start|>` ...) as single ids.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import sys
from collections.abc import Iterator
from pathlib import Path

INSTRUCTIONS = (
    "Implement this Python function.",
    "Write the body of the following function so that it does what its docstring says.",
    "Here is a signature with its docstring. Give the full implementation.",
    "Fill in the implementation of this function.",
)
MIN_LINES, MAX_LINES = 6, 80


def documented_functions(source: str) -> Iterator[tuple[str, str]]:
    """(head, whole) for each documented function of `source`: head = the `def` line(s) through the end
    of the docstring, whole = the function's source; both dedented to column 0."""
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


def conversations(files: list[Path], limit: int) -> Iterator[list[dict[str, str]]]:
    """Up to `limit` conversations from `files` in order, each function once."""
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
            if count >= limit:
                return


def write_calibration(template, files: list[Path], out: Path, limit: int) -> int:
    """Render up to `limit` conversations with `template` (a nanoqwen_runtime ChatTemplate) into
    out/chat-NNNNN.txt; returns how many were written."""
    out.mkdir(parents=True, exist_ok=True)
    n = 0
    for n, messages in enumerate(conversations(files, limit), start=1):
        text = template.render(messages, add_generation_prompt=False)
        (out / f"chat-{n:05d}.txt").write_text(text, encoding="utf-8")
    return n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path, help="a container of the model (for its chat template)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--conversations", type=int, default=2000,
                    help="at most this many (2,000: 557K tokens of the Qwen tokenizer, 8x the default "
                         "--calib-tokens)")
    args = ap.parse_args(argv)
    from nanoqwen_quant.calib import stdlib_files
    from nanoqwen_runtime.generate import Pipeline

    pipe = Pipeline.from_container(args.model, backend=None)
    if pipe.template is None:
        print(f"error: {args.model} has no chat template", file=sys.stderr)
        return 1
    n = write_calibration(pipe.template, stdlib_files("calib"), args.out, args.conversations)
    print(f"{n} conversations -> {args.out}")
    return 0 if n else 1


if __name__ == "__main__":
    sys.exit(main())
