"""Fixtures of the runtime tests.

- `tiny_bf16`, `tiny_int4`: tiny random containers (nanoqwen_runtime.testing), built once per session.
- `qwen_hf_tokenizer`: the HF oracle tokenizer of the real 0.5B (transformers' own GGUF conversion).
- `qwen_packed_none`: the real 0.5B packed with `nanoqwen-quant pack --method none` (bf16 weights),
  cached next to the GGUF under `packs/`, keyed by the GGUF hash and the sources of nanoqwen-quant and
  nanoqwen-format, so a changed packer never serves a stale container.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
from nanoqwen_runtime.testing import write_tiny_container


@pytest.fixture(scope="session")
def tiny_bf16(tmp_path_factory) -> Path:
    return write_tiny_container(tmp_path_factory.mktemp("tiny") / "tiny-bf16.nanoqwen", method="none", seed=1)


@pytest.fixture(scope="session")
def tiny_int4(tmp_path_factory) -> Path:
    return write_tiny_container(tmp_path_factory.mktemp("tiny") / "tiny-int4.nanoqwen", method="rtn", seed=2)


def _packer_fingerprint(gguf: Path, method: str) -> str:
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


def packed_container(gguf: Path, method: str) -> Path:
    """Pack the GGUF with `nanoqwen-quant pack --method METHOD` once; later calls reuse the file."""
    out = gguf.parent / "packs" / f"qwen05b-{method}-{_packer_fingerprint(gguf, method)}.nanoqwen"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        for stale in out.parent.glob(f"qwen05b-{method}-*.nanoqwen"):  # packed by an older packer
            stale.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "nanoqwen_quant.cli", "pack", str(gguf), "-o", str(out),
               "--method", method, "--device", "cpu"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}")
    return out


@pytest.fixture(scope="session")
def qwen_packed_none(qwen05b_gguf) -> Path:
    return packed_container(qwen05b_gguf, "none")


@pytest.fixture(scope="session")
def qwen_hf_tokenizer(qwen05b_gguf):
    """transformers' tokenizer converted from the GGUF (the oracle; ~15 s)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(qwen05b_gguf.parent), gguf_file=qwen05b_gguf.name)
