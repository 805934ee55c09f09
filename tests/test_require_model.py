"""A model test never passes vacuously: without the test model it skips with its reason, and where
the model is required (CI: NANOQWEN_REQUIRE_MODEL=1; `nox -s gpu_tests`: NANOQWEN_REQUIRE_GPU=1) it
fails. Each case runs pytest in a subprocess over a one-test file against an empty model cache."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

MODEL_TEST = '''
def test_uses_the_model(qwen05b_packed):
    assert qwen05b_packed("rtn").exists()
'''


# the repo's root conftest, loaded by a conftest in the temporary folder
CONFTEST = f'''
import importlib.util
spec = importlib.util.spec_from_file_location("nanoqwen_root_conftest", {str(ROOT / "conftest.py")!r})
root = importlib.util.module_from_spec(spec)
spec.loader.exec_module(root)
globals().update({{k: v for k, v in vars(root).items() if not k.startswith("__")}})
'''


def run_pytest(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    test = tmp_path / "test_needs_model.py"
    test.write_text(MODEL_TEST)
    full_env = {k: v for k, v in os.environ.items()
                if k not in ("NANOQWEN_REQUIRE_MODEL", "NANOQWEN_REQUIRE_GPU")}
    full_env.update(NANOQWEN_CACHE=str(tmp_path / "empty-cache"), **env)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(test)],
                          capture_output=True, text=True, cwd=tmp_path, env=full_env, timeout=300)


@pytest.mark.parametrize("env,outcome", [
    ({}, "1 skipped"),
    ({"NANOQWEN_REQUIRE_MODEL": "1"}, "1 failed"),
    ({"NANOQWEN_REQUIRE_GPU": "1"}, "1 failed"),
])
def test_missing_model_skips_or_fails(tmp_path, env, outcome):
    proc = run_pytest(tmp_path, **env)
    out = proc.stdout + proc.stderr
    assert outcome in out, out[-3000:]
    assert "test model not fetched" in out, out[-3000:]
    assert (proc.returncode == 0) == (outcome == "1 skipped"), out[-3000:]


def test_pack_cache_keeps_the_packs_other_checkouts_use(tmp_path):
    """Checkouts of other packer sources share the pack cache (the same ~/.cache/nanoqwen): a new pack
    prunes only packs no session has used for PACK_UNUSED_AFTER_S, never one in use elsewhere."""
    import importlib.util
    import time

    spec = importlib.util.spec_from_file_location("nanoqwen_root_conftest_prune", ROOT / "conftest.py")
    root = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(root)
    old, in_use, other = (tmp_path / f"qwen05b-rtn-{h}.nanoqwen" for h in ("aaaa", "bbbb", "cccc"))
    for p in (old, in_use, other):
        p.write_bytes(b"pack")
    days = time.time() - 5 * 24 * 3600
    for p in (old, in_use):
        os.utime(p, (days, days))
    (tmp_path / "qwen05b-none-dddd.nanoqwen").write_bytes(b"pack")  # another method: never matched
    os.utime(tmp_path / "qwen05b-none-dddd.nanoqwen", (days, days))
    root.used_pack(in_use)  # another checkout's session opened it just now
    deleted = root.prune_unused_packs(tmp_path, "qwen05b-rtn-*.nanoqwen")
    assert deleted == [old]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "qwen05b-none-dddd.nanoqwen", "qwen05b-rtn-bbbb.nanoqwen", "qwen05b-rtn-cccc.nanoqwen"]
