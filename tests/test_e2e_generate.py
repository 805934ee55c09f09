"""End to end on the real Qwen2.5-Coder-0.5B: GGUF -> `nanoqwen-quant pack --method rtn` (INT4) ->
greedy code generation for 3 coding prompts through the runtime (one batch on the CPU reference).

Each answer's first code block must parse with `ast.parse` and define the function asked for. The
packed container is cached next to the GGUF under `packs/`, keyed by the GGUF hash and the sources of
nanoqwen-quant and nanoqwen-format, so a changed packer is re-run and an unchanged one is not.
"""

from __future__ import annotations

import ast
import hashlib
import re
import subprocess
import sys
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


def _fingerprint(gguf: Path, method: str) -> str:
    import nanoqwen_format
    import nanoqwen_quant

    h = hashlib.sha256(f"{method}\n".encode())
    sha_file = gguf.with_name(gguf.name + ".sha256")
    h.update(sha_file.read_bytes() if sha_file.exists() else str(gguf.stat().st_size).encode())
    for mod in (nanoqwen_quant, nanoqwen_format):
        for src in sorted(Path(mod.__file__).parent.rglob("*.py")):
            h.update(src.name.encode())
            h.update(src.read_bytes())
    return h.hexdigest()[:16]


@pytest.fixture(scope="session")
def qwen_packed_rtn(qwen05b_gguf) -> Path:
    out = qwen05b_gguf.parent / "packs" / f"qwen05b-rtn-{_fingerprint(qwen05b_gguf, 'rtn')}.nanoqwen"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        for stale in out.parent.glob("qwen05b-rtn-*.nanoqwen"):  # packed by an older packer
            stale.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "nanoqwen_quant.cli", "pack", str(qwen05b_gguf), "-o", str(out),
               "--method", "rtn", "--device", "cpu"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"
    return out


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
