"""Write the chat calibration text to files: one conversation per file, for reading or for `--calib DIR`.

The text is `nanoqwen-quant pack`'s default calibration text since 2026-12-04 (`--calib-text chat`,
nanoqwen_quant/calib_chat.py, where its recipe and its reasons are): each documented function of the
standard library's calibration split, asked for and answered in the model's chat template. Here it is
rendered by the runtime's `ChatTemplate` from a container, and written out; `pack` renders the same
conversations with transformers from the source, and tokenizes them to the same ids as it reads these
files (tests/test_chat_calibration.py). The HumanEval run that chose the default (bench/quality/README.md,
H200, 2026-12-04) calibrated on files written by this script.

    python -m nanoqwen_bench.quality.chat_calib MODEL.nanoqwen --out DIR [--conversations 2000]

Each file DIR/chat-NNNNN.txt is one conversation, in the split's order.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from nanoqwen_quant.calib_chat import conversations


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
