"""Options checked, the container opened once, the backend built: the steps generate, chat and serve share.

    opts = LoadOptions(...); opts.check()          # every option, before anything is read
    kw = check_sampling(...)                        # sampling options, before anything is read
    with open_container(path) as f:                 # header, index, metadata: parsed and checked once
        limit = check_max_model_len(f, opts.max_model_len)
        pipe = Pipeline.from_file(f, None)          # tokenizer (built once), chat template, defaults
        ids = prompt_ids(pipe, text, limit)         # a prompt too long is refused here: no weight read
        pipe.backend, threads = load_backend(f, opts, pipe.tokenizer)   # the weights, same open file

Nothing here imports torch at module level (the CLI's --help stays fast).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .errors import UsageError
from .inputs import text_arg

__all__ = ["LoadOptions", "DTYPES", "BACKENDS", "DEFAULT_SPECULATION", "open_container", "context_window",
           "check_max_model_len", "check_sampling", "prompt_ids", "load_backend", "describe_threads"]

DTYPES = ("float32", "bfloat16")
BACKENDS = ("reference", "engine")

# Speculation left out, by backend: on only where it measurably gains. Reference backend (CPU), real
# 0.5B RTN, 1 thread (the cpu_threads rule with another job on one of 2 cores), greedy, 48 tokens:
# ngram:4 decoded a code edit (rename a variable in a 12-line function) at 1.99x plain decoding
# (2.72 vs 1.37 tok/s) but a new function (the demo's is_prime request) at 0.67x (1.10 vs 1.65
# tok/s): off, `--speculate ngram` for answers that copy the prompt. (Command and figures:
# packages/nanoqwen-cli/README.md.) The CUDA engine, real 0.5B RTN at batch 1, greedy (`nanoqwen-cli
# bench --workload code-edit --workload free-form`, bench/RESULTS.md): ngram:4 at 2.83x on code edits
# and 1.23x on free-form text, a gain on both: on. A drafter that finds no match drafts nothing and
# the step goes ahead as a plain overlapped decode step.
DEFAULT_SPECULATION: dict[str, str | None] = {"reference": None, "engine": "ngram:4"}


@dataclass(frozen=True)
class LoadOptions:
    """How to build the backend: the device/backend options shared by generate, chat and serve."""

    device: str = "cpu"
    backend: str | None = None       # None: engine on cuda, reference on cpu
    dtype: str | None = None         # reference matmul dtype
    threads: int | None = None       # None: nanoqwen_runtime.cpu_threads' rule on the CPU
    kv_memory: str | None = None     # engine
    eager: bool = False              # engine
    overlap: bool = True             # engine: EngineConfig.overlap (--no-overlap)
    max_model_len: int | None = None
    verify: bool = True
    speculate: str | None = None     # --speculate text; None: the backend's default; "off": none
    prefix_cache: bool = True        # prefix caching of either backend (--no-prefix-cache)

    def resolved_backend(self) -> str:
        return self.backend or ("engine" if self.device.startswith("cuda") else "reference")

    def check(self) -> None:
        """Refuse bad values and combinations (exit 2) before anything is loaded."""
        dev = self.device
        if dev != "cpu" and not (dev == "cuda" or (dev.startswith("cuda:") and dev[5:].isdigit())):
            raise UsageError(f"--device must be cpu, cuda or cuda:N, got {dev!r}")
        if self.backend is not None and self.backend not in BACKENDS:
            raise UsageError(f"--backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise UsageError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.threads is not None and self.threads < 1:
            raise UsageError(f"--threads must be >= 1, got {self.threads}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise UsageError(f"--max-model-len must be >= 2, got {self.max_model_len}")
        backend = self.resolved_backend()
        if backend != "engine" and (self.kv_memory is not None or self.eager or not self.overlap):
            raise UsageError("--kv-memory, --eager and --no-overlap are engine options (--device cuda or "
                             "--backend engine)")
        if backend == "engine" and not dev.startswith("cuda"):
            raise UsageError("--backend engine runs on a CUDA GPU only; use --device cuda")
        if self.kv_memory is not None:
            self.kv_memory_bytes()
        self.speculation()

    def kv_memory_bytes(self) -> int | None:
        from nanoqwen_runtime.engine.config import parse_bytes

        try:
            return parse_bytes(self.kv_memory) if self.kv_memory else None
        except ValueError as e:
            raise UsageError(f"--kv-memory: {e}") from None

    def speculation(self):
        """The --speculate value as a `SpeculationConfig` (None: off); left out, the backend's
        `DEFAULT_SPECULATION`. A bad value: UsageError."""
        from nanoqwen_runtime.speculative import SpeculationConfig

        text = self.speculate
        if text is None:
            text = DEFAULT_SPECULATION[self.resolved_backend()]
        try:
            return SpeculationConfig.parse(text)
        except ValueError as e:
            raise UsageError(f"--speculate: {e}") from None


def open_container(path: Path):
    """The container opened and its header, index and metadata checked (a `NanoqwenFile`, to use as a
    context manager); no tensor is read. A bad file raises what errors.py maps (exit 1)."""
    import nanoqwen_format as nqf

    return nqf.open(path)


def context_window(f) -> int:
    """The model's max_position_embeddings, from an open container's metadata (no tensor is read)."""
    return int(f.config["max_position_embeddings"])


def check_max_model_len(f, max_model_len: int | None) -> int:
    """The context the backend will have: `max_model_len` (refused past the model's window, exit 2)
    or the model's window."""
    limit = context_window(f)
    if max_model_len is None:
        return limit
    if max_model_len > limit:
        raise UsageError(f"--max-model-len must be <= {limit} (this model's context window), "
                         f"got {max_model_len}")
    return max_model_len


def check_sampling(temperature, top_p, top_k, max_tokens, seed, stop) -> dict:
    """Validate sampling options before the (slow) model load, so mistakes fail fast (exit 2)."""
    from nanoqwen_runtime.sampling_params import SamplingParams  # torch-free: no import wait

    stop = tuple(text_arg(s, "--stop") for s in stop) if stop else None
    kw = {"temperature": temperature, "top_p": top_p, "top_k": top_k, "max_tokens": max_tokens, "seed": seed,
          "stop": stop}
    SamplingParams(**{k: v for k, v in kw.items() if v is not None})  # SamplingError: exit 2
    return kw


def prompt_ids(pipe, text: str, limit: int | None = None) -> list[int]:
    """The prompt's token ids; a prompt the context (`limit`, default the backend's) cannot hold with
    one generated token is refused with both lengths (exit 2), the same way on every backend and
    before anything is printed (with `limit`, before the weights are read)."""
    ids = pipe.tokenizer.encode(text)
    limit = pipe.backend.max_context if limit is None else limit
    if len(ids) >= limit:
        raise UsageError(f"the prompt has {len(ids)} tokens but the context window is {limit} tokens "
                         "(prompt plus at least one generated token must fit); shorten the prompt")
    return ids


def describe_threads(choice) -> str:
    return f"{choice.threads} CPU thread{'s' * (choice.threads != 1)} ({choice.why})"


def load_backend(f, opts: LoadOptions, tokenizer=None):
    """Read the weights from the open container `f` and build the backend; returns (backend,
    ThreadChoice or None). On the CPU torch's threads follow `--threads` or cpu_threads' rule."""
    import torch
    from nanoqwen_runtime.backend import ReferenceBackend, resolve_device
    from nanoqwen_runtime.cpu_threads import ThreadChoice, apply_threads

    dev = resolve_device(opts.device)  # BackendError when there is no GPU: exit 1
    if dev.type == "cpu":
        threads = apply_threads(opts.threads)
    elif opts.threads is not None:
        torch.set_num_threads(opts.threads)
        threads = ThreadChoice(opts.threads, "--threads")
    else:
        threads = None
    if opts.resolved_backend() == "engine":
        from nanoqwen_runtime.engine.backend import EngineBackend
        from nanoqwen_runtime.engine.config import EngineConfig

        cfg = EngineConfig(device=opts.device, mode="eager" if opts.eager else "graph",
                           kv_memory_bytes=opts.kv_memory_bytes(), max_model_len=opts.max_model_len,
                           verify=opts.verify, speculation=opts.speculation(),
                           prefix_caching=opts.prefix_cache, overlap=opts.overlap)
        return EngineBackend.from_file(f, cfg, tokenizer=tokenizer), threads
    name = opts.dtype or ("bfloat16" if dev.type == "cuda" else "float32")
    backend = ReferenceBackend.from_file(f, device=opts.device, dtype=getattr(torch, name),
                                         verify=opts.verify, max_context=opts.max_model_len,
                                         speculation=opts.speculation(), prefix_caching=opts.prefix_cache)
    return backend, threads
