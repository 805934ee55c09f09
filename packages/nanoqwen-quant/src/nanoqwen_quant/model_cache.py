"""Models by name: what a user may type where a model is expected, and the cache of packed containers.

A model is named in one of four ways (`parse_model`):

    model.nanoqwen                            a packed container: used as it is
    model.gguf, ./Qwen2.5-Coder-0.5B/         a local GGUF file or Hugging Face folder: packed into the cache
    Qwen/Qwen2.5-Coder-0.5B-Instruct          a Hugging Face model id, fetched and packed (or imported)
    owner/name[@revision][:TAG]               TAG: a file of the repo (`:qwen2.5-coder-0.5b-q8_0.gguf`),
                                              a GGUF quant type picking that file (`:Q8_0`, as
                                              llama.cpp's `-hf user/repo:Q4_K_M`), or a recipe
                                              (`:rtn`, `:gptq`, `:none`, `:import`)

The cache is one folder: `$NANOQWEN_CACHE/models` (default `~/.cache/nanoqwen/models`). Each container is
one file named after what it was made from and how:

    <owner>--<name>[--<tag>]--<recipe>.nanoqwen        from the Hub (an `@revision` joins the tag)
    local--<stem>--<fingerprint>--<recipe>.nanoqwen    from a local GGUF file or HF folder

`<recipe>` is the pack method (`import`, `gptq`, `rtn`, `none`) followed by the options that differ from
`PackOptions`' defaults (`rtn-g64-sym`). The fingerprint of a local source is 8 hex digits of the sha256
of its absolute path, size and modification time (no byte of it is read), so an edited file is packed
anew. The packer writes atomically, so a cached file is complete. Hub downloads themselves stay in
huggingface_hub's cache (`$HF_HOME`, default `~/.cache/huggingface`).

This module imports neither torch nor huggingface_hub: listing and removing cached models is instant.
Fetching and packing, and the recipe part of a name (`model_fetch.recipe_label`), live in model_fetch.py.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

CACHE_ENV = "NANOQWEN_CACHE"
CONTAINER_SUFFIX = ".nanoqwen"
CONTAINER_MAGIC = b"\x89NQWEN\r\n"  # nanoqwen_format.spec.MAGIC (this module stays import-light)
GGUF_MAGIC = b"GGUF"
RECIPES = ("import", "gptq", "rtn", "none")
# without a recipe in the name, a cached container of any of these is taken, the first found
PREFERRED = RECIPES
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
_QUANT_TAG = re.compile(r"^[A-Za-z0-9_]+$")
FORMS = ("a .nanoqwen file, a local GGUF file or Hugging Face folder, or a Hugging Face id "
         "(owner/name[@revision][:file.gguf|:QUANT|:recipe])")


class ModelNameError(ValueError):
    """What the user typed names no model this module can find or make."""


class ModelNotCachedError(ModelNameError):
    """`remove`: no cached container has that name."""


def cache_root() -> Path:
    """`$NANOQWEN_CACHE`, default `~/.cache/nanoqwen` (shared with tools/testmodel.py's GGUF files)."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "nanoqwen")


def models_dir() -> Path:
    """The folder of cached containers."""
    return cache_root() / "models"


@dataclass(frozen=True)
class ModelName:
    """A parsed model argument. kind: "container" | "gguf" | "folder" (local paths) | "hub".

    hub: `repo` ("owner/name"), `revision` (None: the default branch), `file` (a GGUF in the repo),
    `quant` (a GGUF quant type to pick the file by), `recipe` (one of RECIPES, or None: the default)."""

    text: str
    kind: str
    path: Path | None = None
    repo: str | None = None
    revision: str | None = None
    file: str | None = None
    quant: str | None = None
    recipe: str | None = None

    @property
    def is_local(self) -> bool:
        return self.kind != "hub"

    def cache_stem(self) -> str:
        """The recipe-less part of the cache file name (module docstring)."""
        if self.kind == "hub":
            owner, name = self.repo.split("/")
            parts = [owner, name]
            tag = self.file or self.quant
            if tag:
                parts.append(_safe(tag.removesuffix(".gguf")))
            if self.revision:
                parts.append("at-" + _safe(self.revision))
            return "--".join(parts)
        return f"local--{_safe(self.path.name.removesuffix('.gguf'))}--{_fingerprint(self.path)}"

    def cache_path(self, recipe: str) -> Path:
        return models_dir() / f"{self.cache_stem()}--{recipe}{CONTAINER_SUFFIX}"

    def display(self) -> str:
        """The name as the user would type it to get this source again (without a recipe)."""
        if self.kind != "hub":
            return str(self.path)
        rev = f"@{self.revision}" if self.revision else ""
        tag = self.file or self.quant
        return f"{self.repo}{rev}{':' + tag if tag else ''}"


def _safe(text: str) -> str:
    """A file-name-safe form of a tag: `/` and other odd characters to `_`, no `--` inside."""
    out = re.sub(r"[^A-Za-z0-9_.@+-]", "_", text)
    return re.sub(r"-{2,}", "-", out)


def _fingerprint(path: Path) -> str:
    """8 hex digits of sha256(absolute path, size, mtime_ns) of a GGUF file, or of a folder's files."""
    path = path.absolute()
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    h = hashlib.sha256(str(path).encode())
    for f in files:
        st = f.stat()
        h.update(f"\0{f.name}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return h.hexdigest()[:8]


def _magic(path: Path, n: int) -> bytes:
    with open(path, "rb") as f:
        return f.read(n)


def parse_model(text: str) -> ModelName:
    """What `text` names (module docstring). A local path wins over a hub id of the same spelling.

    ModelNameError: a file that is neither a container nor a GGUF, or nothing this could be."""
    path = Path(os.path.expanduser(text))
    if path.is_file():
        head = _magic(path, len(CONTAINER_MAGIC))
        if head.startswith(GGUF_MAGIC):
            return ModelName(text, "gguf", path=path)
        # a .nanoqwen, or any file that is not a GGUF: the container reader says what is wrong with it
        return ModelName(text, "container", path=path)
    if path.is_dir():
        return ModelName(text, "folder", path=path)
    base, _, tag = text.partition(":")
    repo, _, revision = base.partition("@")
    if _HUB_ID.match(repo) and not text.startswith((".", "/", "~")):
        tags = tag.split(":") if tag else []
        recipe = tags.pop().lower() if tags and tags[-1].lower() in RECIPES else None
        if len(tags) > 1 or any(not t for t in tags):
            raise ModelNameError(f"{text}: give at most one file or quant tag and one recipe "
                                 "(owner/name[@revision][:file.gguf|:QUANT][:recipe])")
        t = tags[0] if tags else None
        if t is not None and not t.endswith(".gguf") and not _QUANT_TAG.match(t):
            raise ModelNameError(f"{text}: the tag {t!r} is not a .gguf file name, a GGUF quant type "
                                 f"(such as Q4_K_M) or a recipe ({', '.join(RECIPES)})")
        is_file = t is not None and t.endswith(".gguf")
        return ModelName(text, "hub", repo=repo, revision=revision or None, file=t if is_file else None,
                         quant=None if is_file else t, recipe=recipe)
    if text.endswith((CONTAINER_SUFFIX, ".gguf")) or "/" not in text or text.startswith((".", "/", "~")):
        raise ModelNameError(f"{text}: no such file or folder (a model is {FORMS})")
    raise ModelNameError(f"{text}: no such file or folder, and not a Hugging Face id (a model is {FORMS})")


def find_cached(name: ModelName) -> Path | None:
    """The cached container of `name`: of its recipe when it names one, else of the first of PREFERRED
    that is cached. None when there is none. Touches no network."""
    recipes = [name.recipe] if name.recipe else PREFERRED
    for recipe in recipes:
        p = name.cache_path(recipe)
        if p.is_file():
            return p
    return None


def file_size(nbytes: int) -> str:
    """A size as people read it: 1.2 GB, 480 MB, 35 kB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}" if nbytes < 10 * scale else f"{nbytes / scale:,.0f} {unit}"
    return f"{nbytes} B"


@dataclass(frozen=True)
class CachedModel:
    """One container in the cache: `name` as typed to get it (owner/name[:tag] or local:stem), `recipe`,
    size in bytes, path."""

    name: str
    recipe: str
    nbytes: int
    path: Path

    @property
    def full_name(self) -> str:
        """The name with its recipe, which `remove` and the commands accept to pick exactly this one."""
        return f"{self.name}:{self.recipe}"


def _describe_file(path: Path) -> CachedModel | None:
    parts = path.name.removesuffix(CONTAINER_SUFFIX).split("--")
    if len(parts) < 3:
        return None
    recipe = parts[-1]
    if parts[0] == "local":
        name = "local:" + "--".join(parts[1:-1])
    else:
        name = f"{parts[0]}/{parts[1]}" + (":" + "--".join(parts[2:-1]) if len(parts) > 3 else "")
    return CachedModel(name, recipe, path.stat().st_size, path)


def cached_models() -> list[CachedModel]:
    """Every container in the cache, by name. Files the packer is still writing (`*.partial-*`) and
    files not named by this module are left out."""
    folder = models_dir()
    if not folder.is_dir():
        return []
    found = [_describe_file(p) for p in sorted(folder.glob(f"*{CONTAINER_SUFFIX}")) if p.is_file()]
    return [m for m in found if m is not None]


def remove(name: str) -> list[CachedModel]:
    """Remove the cached container `name`: its full name (`owner/name:recipe`, as `cached_models` lists
    it), or its name without the recipe when only one recipe of it is cached, or its file name.
    Returns what was removed. ModelNotCachedError when nothing matches, or several do (naming them)."""
    models = cached_models()
    exact = [m for m in models if name in (m.full_name, m.path.name, str(m.path))]
    if not exact:
        exact = [m for m in models if m.name == name]
    if not exact:
        where = models_dir()
        listed = ", ".join(m.full_name for m in models) or "none"
        raise ModelNotCachedError(f"{name}: not in the model cache {where} (cached: {listed})")
    if len(exact) > 1:
        raise ModelNotCachedError(f"{name}: {len(exact)} cached recipes; give one of "
                                  f"{', '.join(m.full_name for m in exact)}")
    for m in exact:
        m.path.unlink()
    return exact
