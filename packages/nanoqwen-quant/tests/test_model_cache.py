"""Model names (nanoqwen_quant.model_cache / model_fetch) without any download: what each spelling of a
model parses to, which GGUF of a repo a tag picks, the cache file names of recipes, and the cache's
listing and removal rules. The fetches themselves run against a local Hub mirror in
packages/nanoqwen-cli/tests/test_models_by_name.py."""

from __future__ import annotations

import pytest
from nanoqwen_quant.model_cache import (
    ModelNameError,
    ModelNotCachedError,
    cached_models,
    file_size,
    find_cached,
    parse_model,
    remove,
)
from nanoqwen_quant.model_fetch import ModelFetchError, pick_gguf, recipe_label
from nanoqwen_quant.options import PackOptions

GGUF_HEAD = b"GGUF" + (3).to_bytes(4, "little")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOQWEN_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "models"


def test_local_paths_win_and_are_told_apart_by_their_bytes(tmp_path):
    (tmp_path / "m.gguf").write_bytes(GGUF_HEAD)
    (tmp_path / "m.nanoqwen").write_bytes(b"\x89NQWEN\r\n")
    (tmp_path / "owner").mkdir()
    (tmp_path / "owner" / "name").mkdir()  # a folder spelled like a hub id: the folder wins
    assert parse_model(str(tmp_path / "m.gguf")).kind == "gguf"
    assert parse_model(str(tmp_path / "m.nanoqwen")).kind == "container"
    got = parse_model(str(tmp_path / "owner" / "name"))
    assert got.kind == "folder" and got.path == tmp_path / "owner" / "name"


@pytest.mark.parametrize("text, repo, revision, file, quant, recipe", [
    ("Qwen/Qwen2.5-Coder-0.5B-Instruct", "Qwen/Qwen2.5-Coder-0.5B-Instruct", None, None, None, None),
    ("Qwen/Qwen2.5-Coder-0.5B-Instruct@v1.0", "Qwen/Qwen2.5-Coder-0.5B-Instruct", "v1.0", None, None, None),
    ("user/repo:Q4_K_M", "user/repo", None, None, "Q4_K_M", None),
    ("user/repo:model-q8_0.gguf", "user/repo", None, "model-q8_0.gguf", None, None),
    ("user/repo:rtn", "user/repo", None, None, None, "rtn"),
    ("user/repo:Q8_0:gptq", "user/repo", None, None, "Q8_0", "gptq"),
    ("user/repo@abc:model.gguf:none", "user/repo", "abc", "model.gguf", None, "none"),
])
def test_hub_ids(text, repo, revision, file, quant, recipe):
    m = parse_model(text)
    assert (m.kind, m.repo, m.revision, m.file, m.quant, m.recipe) == ("hub", repo, revision, file, quant,
                                                                       recipe)


@pytest.mark.parametrize("text, match", [
    ("missing.nanoqwen", "missing.nanoqwen: no such file or folder"),
    ("./nope/x", "no such file or folder"),
    ("justaword", "no such file or folder"),
    ("a/b/c", "not a Hugging Face id"),
    ("user/repo:Q4 K", "the tag 'Q4 K' is not a .gguf file name, a GGUF quant type"),
    ("user/repo:a.gguf:Q8_0", "at most one file or quant tag and one recipe"),
])
def test_names_that_name_nothing_are_refused(text, match):
    with pytest.raises(ModelNameError, match=match):
        parse_model(text)


FILES = ["config.json", "README.md", "qwen-q4_k_m.gguf", "qwen-q8_0.gguf", "sub/qwen-Q4_0.gguf"]


@pytest.mark.parametrize("text, files, picked", [
    ("u/r:qwen-q8_0.gguf", FILES, "qwen-q8_0.gguf"),
    ("u/r:Q4_K_M", FILES, "qwen-q4_k_m.gguf"),        # case-insensitive, as llama.cpp's -hf
    ("u/r:q4_0", FILES, "sub/qwen-Q4_0.gguf"),
    ("u/r", ["config.json", "model.safetensors", "x.gguf"], None),  # safetensors + config: the checkpoint
    ("u/r", ["README.md", "only.gguf"], "only.gguf"),
])
def test_pick_gguf(text, files, picked):
    assert pick_gguf(parse_model(text), files) == picked


@pytest.mark.parametrize("text, files, match", [
    ("u/r:missing.gguf", FILES, "u/r has no file missing.gguf"),
    ("u/r:Q2_K", FILES, "no GGUF file of quant type Q2_K"),
    ("u/r", FILES, "holds 3 GGUF files: pick one with u/r:QUANT"),
    ("u/r", ["README.md"], "nothing to pack"),
])
def test_pick_gguf_refusals_name_the_files(text, files, match):
    with pytest.raises(ModelFetchError, match=match):
        pick_gguf(parse_model(text), files)


def test_recipe_labels():
    assert recipe_label(PackOptions(method="rtn")) == "rtn"
    assert recipe_label(PackOptions(method="gptq")) == "gptq"
    assert recipe_label(PackOptions(method="import")) == "import"
    assert recipe_label(PackOptions(method="none")) == "none"
    custom = PackOptions(method="rtn", group_size=64, symmetric=True, clip=True)
    assert recipe_label(custom) == "rtn-g64-sym-clip"
    assert recipe_label(PackOptions(method="rtn", lm_head="int8")) == "rtn-lmint8"
    calibrated = recipe_label(PackOptions(method="gptq", calib_tokens=4096))
    assert calibrated.startswith("gptq-calib-") and calibrated != recipe_label(PackOptions(method="gptq",
                                                                                          calib_tokens=8192))


def test_cache_names_lookups_and_removal(cache):
    name = parse_model("Qwen/Coder:Q8_0")
    assert name.cache_path("rtn") == cache / "Qwen--Coder--Q8_0--rtn.nanoqwen"
    assert find_cached(name) is None
    cache.mkdir(parents=True)
    for recipe in ("rtn", "import"):
        name.cache_path(recipe).write_bytes(b"x" * 10)
    (cache / "Qwen--Coder--Q8_0--rtn.nanoqwen.partial-1-ab").write_bytes(b"")  # a pack in progress
    assert find_cached(name) == name.cache_path("import")  # no recipe asked: import first
    assert find_cached(parse_model("Qwen/Coder:Q8_0:rtn")) == name.cache_path("rtn")
    listed = cached_models()
    assert [(m.name, m.recipe, m.nbytes) for m in listed] == [("Qwen/Coder:Q8_0", "import", 10),
                                                               ("Qwen/Coder:Q8_0", "rtn", 10)]
    with pytest.raises(ModelNotCachedError, match="2 cached recipes; give one of Qwen/Coder:Q8_0:import, "
                                                  "Qwen/Coder:Q8_0:rtn"):
        remove("Qwen/Coder:Q8_0")
    assert [m.full_name for m in remove("Qwen/Coder:Q8_0:rtn")] == ["Qwen/Coder:Q8_0:rtn"]
    assert not name.cache_path("rtn").exists() and name.cache_path("import").exists()
    assert [m.full_name for m in remove("Qwen/Coder:Q8_0")] == ["Qwen/Coder:Q8_0:import"]  # now the only one
    with pytest.raises(ModelNotCachedError, match="Qwen/Coder: not in the model cache .* \\(cached: none\\)"):
        remove("Qwen/Coder")


def test_local_sources_are_keyed_by_path_size_and_time(tmp_path, cache):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(GGUF_HEAD)
    first = parse_model(str(gguf)).cache_path("rtn")
    assert first.parent == cache and first.name.startswith("local--model--")
    gguf.write_bytes(GGUF_HEAD + b"more")  # edited: a different container
    assert parse_model(str(gguf)).cache_path("rtn") != first


def test_file_size():
    assert [file_size(n) for n in (512, 35_000, 480_000_000, 1_234_000_000)] == ["512 B", "35 kB", "480 MB",
                                                                                  "1.2 GB"]
