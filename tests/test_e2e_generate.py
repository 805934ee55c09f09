"""End to end on the real Qwen2.5-Coder-0.5B: GGUF -> `nanoqwen-quant pack --method rtn` (INT4) ->
greedy code generation for 3 coding prompts through the runtime (one batch on the CPU reference).

Each answer's first code block must parse with `ast.parse` and define the function asked for. The
packed container comes from the root conftest's `qwen05b_packed` cache.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

TASKS = [
    ("fibonacci", "Write a Python function `fibonacci(n)` that returns the n-th Fibonacci number."),
    ("is_palindrome", "Write a Python function `is_palindrome(s)` that checks whether a string is a "
                      "palindrome, ignoring case and non-alphanumeric characters."),
    ("merge_sorted", "Write a Python function `merge_sorted(a, b)` that merges two sorted lists into one "
                     "sorted list."),
]
SUFFIX = " Reply with only the code."


@pytest.fixture(scope="session")
def qwen_packed_rtn(qwen05b_packed) -> Path:
    return qwen05b_packed("rtn")


def first_code_block(text: str) -> str:
    blocks = re.findall(r"```(?:python|py)?[ \t]*\n(.*?)```", text, flags=re.S)
    assert blocks, f"no fenced code block in:\n{text}"
    return blocks[0]


@pytest.mark.model
@pytest.mark.slow
def test_pack_rtn_then_generate_code_that_parses(qwen_packed_rtn):
    import nanoqwen_format as nqf
    import torch
    from nanoqwen_runtime import Pipeline, SamplingParams

    with nqf.open(qwen_packed_rtn) as f:
        assert f.metadata["quantization"]["method"] == "rtn"
        assert f.records["layers.0.qkv"].encoding == "int4"
    pipe = Pipeline.load(qwen_packed_rtn, device="cpu", dtype=torch.float32)
    prompts = [pipe.chat_prompt([{"role": "user", "content": task + SUFFIX}]) for _, task in TASKS]
    results = pipe.generate(prompts, SamplingParams(temperature=0.0, max_tokens=320))
    for (name, _), r in zip(TASKS, results, strict=True):
        assert r.finish_reason == "eos", f"{name}: did not finish ({r.finish_reason}):\n{r.text}"
        tree = ast.parse(first_code_block(r.text))
        defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert name in defined, f"{name} not defined in:\n{r.text}"
