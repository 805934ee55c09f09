"""Turn a model name (model_cache.py) into a `.nanoqwen` file: use it, or find it in the cache, or fetch
it from the Hugging Face Hub with `huggingface_hub` and pack (or import) it into the cache.

    resolve("Qwen/Qwen2.5-Coder-0.5B-Instruct")   -> ~/.cache/nanoqwen/models/Qwen--...--rtn.nanoqwen

Order, so a second run touches no network: a `.nanoqwen` path is returned as it is; otherwise the cache
is looked up first (`model_cache.find_cached`); only on a miss is the source opened: a local GGUF file
or HF folder directly, a Hub id through one metadata request (`HfApi.model_info`: the commit and the
file list, which picks the files) and then the downloads (huggingface_hub's own progress bars on
stderr, its own cache under `$HF_HOME`).

Hub failures are one line each (`ModelFetchError`). When the Hub cannot be reached (no network,
`HF_HUB_OFFLINE=1`), the files already in huggingface_hub's cache are used; when they are not there
the error names the offline routes. huggingface_hub retries a failed request for about 25 s, printing a
line per try; the metadata request (which does not retry) runs first, so an unreachable Hub is known
before any download starts, and huggingface_hub's log is turned down to errors while it runs.

The recipe: the name's recipe tag (`:rtn`, `:gptq`, ...); otherwise a GPTQ/AWQ checkpoint or an
all-Q4_0 GGUF is imported exactly, and anything else is packed with `PackOptions`' default (GPTQ,
calibrated) when a CUDA GPU is present, or with RTN on the CPU: the calibrated layer loop takes about
2 minutes per layer of the 0.5B on a 2-core CPU (bench/quality/README.md), most of an hour before the
first token, where RTN takes seconds per layer. A line says which recipe was chosen and how to ask for
the other.
"""

from __future__ import annotations

import hashlib
import re
import sys
from collections.abc import Callable
from pathlib import Path

from .model_cache import FORMS, ModelName, file_size, find_cached, parse_model
from .options import PackOptions
from .pack import pack
from .sources import GGUFSource, hf_folder_source, hub_folder, is_quantized_source

Log = Callable[[str], None]
METADATA_TIMEOUT_S = 10.0
OFFLINE_ROUTES = ("offline, give a local GGUF file or Hugging Face folder, or a .nanoqwen file "
                  "(`nanoqwen-cli list` shows the cached models)")


class ModelFetchError(RuntimeError):
    """The Hub could not be reached, refused the request, or the repo or local file holds nothing this
    can pack."""


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def resolve(text: str, log: Log = _stderr) -> Path:
    """The `.nanoqwen` file that `text` names, fetched and packed into the cache when needed (what
    `nanoqwen-cli generate / chat / serve` run; `nanoqwen-quant pack` takes its recipe from its options
    and calls `open_named` itself). Raises ModelNameError / ModelFetchError (one line), or what `pack`
    raises."""
    name = parse_model(text)
    if name.kind == "container":
        return name.path
    cached = find_cached(name)
    if cached is not None:
        log(f"model: {cached} (cached)")
        return cached
    try:
        source = open_named(name, log)
    except (ValueError, RuntimeError) as e:
        # nanoqwen's refusal of a local file (SourceError, ConfigError, UnsupportedModelError) says what
        # is wrong but not with which file: the user passed a path, so name it
        if name.is_local and type(e).__module__.startswith("nanoqwen_"):
            raise ModelFetchError(f"{name.path} cannot be packed into a .nanoqwen: {type(e).__name__}: "
                                  f"{' '.join(str(e).split())}") from e
        raise
    opts = choose_recipe(name, source, log)
    target = name.cache_path(recipe_label(opts))
    target.parent.mkdir(parents=True, exist_ok=True)
    summary = pack_with_progress(source, target, opts, log)
    log(summary_line(summary))
    return target


def choose_recipe(name: ModelName, source, log: Log) -> PackOptions:
    """The `PackOptions` to pack `source` with (module docstring), validated: the name's recipe tag, or
    import for a quantized source, or GPTQ with a CUDA GPU and RTN without (saying so)."""
    if name.recipe is not None:
        opts = PackOptions(method=name.recipe)
    elif is_quantized_source(source):
        opts = PackOptions(method="import")
    else:
        import torch

        gpu = torch.cuda.is_available()
        opts = PackOptions(method="gptq" if gpu else "rtn")
        if not gpu:
            ask = (f"nanoqwen-quant pack {name.path} --method gptq" if name.is_local
                   else f"{name.display()}:gptq")
            log(f"recipe: rtn (no CUDA GPU here; GPTQ calibrates for about 2 minutes per layer on a "
                f"2-core CPU: ask for it with {ask})")
    opts.validate()
    opts.check_model(source.config)
    return opts


def open_named(name: ModelName, log: Log):
    """The `Source` of a GGUF file, HF folder or Hub id (downloading what it needs)."""
    if name.kind == "gguf":
        return GGUFSource(name.path)
    if name.kind == "folder":
        return hf_folder_source(name.path)
    local = fetch(name, log)
    if local.is_file():
        source = GGUFSource(local)
        source.spec = name.display()
        return source
    return hf_folder_source(local, spec=name.display())


# ----------------------------------------------------------------------------------------- the Hub
def _quiet_hub() -> None:
    """huggingface_hub's log down to errors: its retry lines and warnings are not for the user."""
    from huggingface_hub.utils import logging as hf_logging

    hf_logging.set_verbosity_error()


def _hub_error(name: ModelName, e: BaseException) -> ModelFetchError | None:
    """The one-line error of a Hub refusal (the Hub answered), or None when the Hub was not reached."""
    from huggingface_hub import errors

    repo = name.repo + (f"@{name.revision}" if name.revision else "")
    if isinstance(e, errors.OfflineModeIsEnabled):
        return None
    if isinstance(e, errors.GatedRepoError):
        return ModelFetchError(f"{repo} is gated on the Hugging Face Hub: accept its terms on the model "
                               "page and log in (hf auth login)")
    if isinstance(e, errors.RepositoryNotFoundError):
        return ModelFetchError(f"{repo}: no such model on the Hugging Face Hub (or it is private: log in "
                               "with hf auth login)")
    if isinstance(e, errors.RevisionNotFoundError):
        return ModelFetchError(f"{repo}: no such revision on the Hugging Face Hub")
    if isinstance(e, errors.HfHubHTTPError):
        status = getattr(getattr(e, "response", None), "status_code", "?")
        return ModelFetchError(f"{repo}: the Hugging Face Hub answered HTTP {status}")
    return None


def _unreachable(name: ModelName, e: BaseException) -> ModelFetchError:
    from huggingface_hub import constants, errors

    why = ("HF_HUB_OFFLINE is set" if isinstance(e, errors.OfflineModeIsEnabled)
           else " ".join(str(e).split()) or type(e).__name__)
    return ModelFetchError(f"cannot reach the Hugging Face Hub ({constants.ENDPOINT}: {why}) to fetch "
                           f"{name.display()}, and it is not in the cache; {OFFLINE_ROUTES}")


def fetch(name: ModelName, log: Log) -> Path:
    """Download what packing `name` needs: the local path of its GGUF file or of its HF snapshot folder."""
    from huggingface_hub import HfApi

    _quiet_hub()
    try:
        info = HfApi().model_info(name.repo, revision=name.revision, timeout=METADATA_TIMEOUT_S)
    except Exception as e:
        refused = _hub_error(name, e)
        if refused is not None:
            raise refused from None
        if not _network_error(e):
            raise
        return _from_hub_cache(name, e)
    files = [s.rfilename for s in info.siblings or []]
    gguf = pick_gguf(name, files)
    log(f"fetching {name.display()} ({gguf or 'safetensors'}) from the Hugging Face Hub at {info.sha[:12]}")
    # by the name's revision, not the commit: the cache then records the branch, which an offline run
    # (`_from_hub_cache`) looks the files up by
    return _download(name, gguf, name.revision)


def _network_error(e: BaseException) -> bool:
    """Whether `e` says the Hub was not reached (no network, a timeout, offline mode, not in the local
    cache with local_files_only), as opposed to a refusal or a problem with the files themselves."""
    from huggingface_hub import errors

    if isinstance(e, errors.OfflineModeIsEnabled | errors.LocalEntryNotFoundError | ConnectionError
                  | TimeoutError):
        return True
    return any(c.__module__.split(".")[0] in ("httpx", "httpx2", "requests", "urllib3")
               for c in type(e).__mro__)


def _download(name: ModelName, gguf: str | None, revision: str | None, local_only: bool = False) -> Path:
    """The GGUF file, or the snapshot folder of the safetensors checkpoint, in huggingface_hub's cache."""
    from huggingface_hub import hf_hub_download

    try:
        if gguf is not None:
            return Path(hf_hub_download(name.repo, gguf, revision=revision, local_files_only=local_only))
        return hub_folder(name.repo, revision, local_files_only=local_only)
    except Exception as e:
        refused = _hub_error(name, e)
        if refused is not None:
            raise refused from None
        if _network_error(e) and not local_only:
            raise _unreachable(name, e) from None
        raise


def _from_hub_cache(name: ModelName, cause: BaseException) -> Path:
    """The files of `name` already in huggingface_hub's cache (the Hub is unreachable), or the one-line
    error naming the offline routes."""
    try:
        return _download(name, name.file, name.revision, local_only=True)
    except Exception as e:
        if _network_error(e):
            raise _unreachable(name, cause) from None
        raise


def pick_gguf(name: ModelName, files: list[str]) -> str | None:
    """Which GGUF of the repo to fetch (None: the safetensors checkpoint). ModelFetchError when the
    name's file or quant tag matches none, or the repo holds several GGUFs and nothing picks one."""
    ggufs = sorted(f for f in files if f.endswith(".gguf"))
    listed = ", ".join(ggufs) or "none"
    if name.file is not None:
        if name.file not in files:
            raise ModelFetchError(f"{name.repo} has no file {name.file} (its GGUF files: {listed})")
        return name.file
    if name.quant is not None:
        pat = re.compile(rf"(^|[-_.]){re.escape(name.quant)}\.gguf$", re.IGNORECASE)
        hits = [f for f in ggufs if pat.search(f.rsplit("/", 1)[-1])]
        if len(hits) != 1:
            what = "no GGUF file" if not hits else f"{len(hits)} GGUF files"
            raise ModelFetchError(f"{name.repo}: {what} of quant type {name.quant} (its GGUF files: "
                                  f"{listed}); name one: {name.repo}:FILE.gguf")
        return hits[0]
    if "config.json" in files and any(f.endswith(".safetensors") for f in files):
        return None
    if len(ggufs) == 1:
        return ggufs[0]
    if ggufs:
        raise ModelFetchError(f"{name.repo} holds {len(ggufs)} GGUF files: pick one with {name.repo}:QUANT "
                              f"(such as Q4_K_M) or {name.repo}:FILE.gguf ({listed})")
    raise ModelFetchError(f"{name.repo} holds neither safetensors with a config.json nor a GGUF file: "
                          f"nothing to pack (a model is {FORMS})")


# ------------------------------------------------------------------------------------------ packing
def recipe_label(opts) -> str:
    """The cache name's recipe of a `PackOptions`: the method, then the options that differ from the
    defaults (group size, symmetry, clip, AWQ, lm_head, calibration text)."""
    d = PackOptions()
    if opts.method == "import":
        return "import"
    parts = [opts.method]
    if opts.method != "none" or opts.lm_head != "bf16":
        if opts.group_size != d.group_size:
            parts.append(f"g{opts.group_size}")
        if opts.symmetric != d.symmetric:
            parts.append("sym" if opts.symmetric else "asym")
    for flag in ("clip", "clip_act", "awq"):
        if getattr(opts, flag) != getattr(d, flag):
            parts.append(flag.replace("_", "") if getattr(opts, flag) else f"no{flag.replace('_', '')}")
    if opts.lm_head != d.lm_head:
        parts.append(f"lm{opts.lm_head}")
    if opts.calibrated and (opts.calib_paths or opts.calib_text not in (None, "chat")
                            or opts.calib_tokens != d.calib_tokens or opts.calib_seq_len != d.calib_seq_len):
        parts.append("calib-" + hashlib.sha256(repr((opts.calib_paths, opts.calib_text, opts.calib_tokens,
                                                          opts.calib_seq_len)).encode()).hexdigest()[:6])
    return "-".join(parts)


def pack_with_progress(source, out: Path, opts, log: Log):
    """`pack.pack` with a rich progress bar of the layers on stderr. Returns the PackSummary."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    err = Console(stderr=True)
    log(f"packing {source.spec} ({opts.method}) into {out}")
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn()]
    with Progress(*columns, console=err, transient=True, disable=not err.is_terminal) as bar:
        task = bar.add_task("layers", total=source.config.num_hidden_layers)

        def progress(stage: str, done: int, total: int) -> None:
            bar.update(task, description=stage, completed=done, total=total)

        return pack(source, out, opts, progress=progress, log=log)


def summary_line(s) -> str:
    """One line for a PackSummary: the file, its size, the time, the device and the worst layer error."""
    worst = [v["w_rel"] for e in s.layer_errors for v in e.values() if "w_rel" in v]
    err = f", worst layer weight error {max(worst):.2e}" if worst else ""
    return f"packed {s.out}: {file_size(s.nbytes)} in {s.seconds:.1f} s on {s.device}{err}"
