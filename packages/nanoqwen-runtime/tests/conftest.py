"""Fixtures of the runtime tests.

- `tiny_bf16`, `tiny_int4`: tiny random containers (nanoqwen_runtime.testing), built once per session.
- `qwen_hf_tokenizer`: the HF oracle tokenizer of the real 0.5B (transformers' own GGUF conversion).
- `model`, `hf` (module scope): `tiny_int4`'s plain-torch model in fp32, and HF's model of it (the
  oracle).
- `qwen_packed_none`: the real 0.5B packed with `nanoqwen-quant pack --method none` (bf16 weights),
  through the root conftest's cached `qwen05b_packed`.
- engine_testkit.py (importable from every test here): the tiny engine geometry, bounds and runners.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from nanoqwen_runtime.testing import write_tiny_container

sys.path.insert(0, str(Path(__file__).parent))  # engine_testkit.py: helpers shared by the engine tests


@pytest.fixture(scope="session")
def tiny_bf16(tmp_path_factory) -> Path:
    return write_tiny_container(tmp_path_factory.mktemp("tiny") / "tiny-bf16.nanoqwen", method="none", seed=1)


@pytest.fixture(scope="session")
def tiny_int4(tmp_path_factory) -> Path:
    return write_tiny_container(tmp_path_factory.mktemp("tiny") / "tiny-int4.nanoqwen", method="rtn", seed=2)


@pytest.fixture(scope="module")
def model(tiny_int4):
    import torch
    from nanoqwen_runtime.reference import ReferenceModel

    return ReferenceModel.from_file(tiny_int4, dtype=torch.float32)


@pytest.fixture(scope="module")
def hf(tiny_int4):
    from nanoqwen_runtime.testing import hf_model

    return hf_model(tiny_int4)


@pytest.fixture(scope="session")
def qwen_packed_none(qwen05b_packed) -> Path:
    return qwen05b_packed("none")


@pytest.fixture(scope="session")
def qwen_hf_tokenizer(qwen05b_gguf):
    """transformers' tokenizer converted from the GGUF (the oracle; ~15 s)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(qwen05b_gguf.parent), gguf_file=qwen05b_gguf.name)
