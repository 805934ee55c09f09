"""Configuration of the CUDA engine: `EngineConfig`, everything the engine does not read from the file.

The model's shape is not here: it is the container's `config` map parsed into
`nanoqwen_model.Qwen2Config`, the one model description of the repo. `EngineConfig` holds the KV
memory budget, page size, batch limits, prefill chunk, graph or eager mode and op backend. Behaviour is
never read from a file name or an environment variable: the CLI builds an `EngineConfig` from its flags.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..speculative import SpeculationConfig
from .blocks import cache_reuse_error
from .scheduler import VERIFY_MAX_ROWS

# Decode batches are padded up to one of these sizes; one CUDA graph is captured per size. Powers of
# two keep the padding waste under 2x and the number of graphs (and their memory) small.
GRAPH_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)


@dataclass
class EngineConfig:
    """Engine knobs. Nothing here is read from the file; the CLI maps its flags onto these fields.

    KV pool size: `kv_memory_bytes` when given, otherwise `kv_memory_fraction` of the device memory
    that is free after the weights and the step workspace are allocated.
    """

    device: str = "cuda"
    # "kernels": nanoqwen_kernels launchers (the fast path, needs sm_90). "torch": plain-torch ops on the
    # same paged layout (CPU tests and debugging). Chosen explicitly; never switched behind your back.
    backend: str = "kernels"
    # "graph": decode steps replay a CUDA graph captured per batch bucket. "eager": launch every kernel
    # from Python each step (debugging; ~Python-bound).
    mode: str = "graph"
    block_size: int = 16
    kv_memory_bytes: int | None = None
    kv_memory_fraction: float = 0.90
    # Hard cap on the number of KV blocks (tests use it to force preemption); None = as many as fit.
    num_blocks: int | None = None
    max_batch: int = 64  # running sequences at most; == the largest graph bucket
    # Context limit per sequence (prompt + generated). None = the model's max_position_embeddings.
    max_model_len: int | None = None
    # Tokens per prefill step (summed over the sequences in it). 2048 keeps the GEMM path efficient and
    # the activation workspace at 2048 x 37888 bf16 (155 MB) for the 7B gate_up output.
    prefill_chunk: int = 2048
    # Admission keeps this fraction of blocks free for running sequences to grow into, so that a new
    # arrival does not immediately cause a preemption.
    admit_watermark: float = 0.01
    # Kernel backend, explicit option, off: keep a bf16 copy of every quantized linear and run steps
    # of more than 8 rows on it with cuBLAS (2 bytes per weight read, 13 GB more at 7B, printed at
    # load). Off, such steps run the INT4 GEMM on the container's tensors (ops_kernels.py: the
    # weights on the GPU are the container's bytes, the rest goes to the KV pool).
    dense_weight_cache: bool = False
    # Integrity at load (integrity.py): every tensor's checksum, hashed on a worker thread as the bytes
    # pass through the pinned staging buffers (overlapping the copies), and no NaN/Inf in norms,
    # embeddings, bf16 weights or scales. False (the CLI's --no-verify) skips both.
    verify: bool = True
    # Overlapped decode (engine.py's header): in a run of plain decode steps, plan and queue step n+1
    # before reading step n's tokens back (its rows take their ids from step n's output on the device),
    # so the host's work between steps (commit, events, planning, inputs) runs while the device
    # computes. The same tokens as without; a sequence ended by a sampled token (EOS, stop string)
    # computes one row more, which is dropped. On: it takes the engine's wall time per step from 0.81 to
    # 1.0 of the graph replay's at batch 1, 0.75 to 0.97 at batch 64 (`nanoqwen-cli bench`'s overlap_ab).
    overlap: bool = True
    seed: int = 0
    graph_buckets: tuple[int, ...] = GRAPH_BUCKETS
    # Decode graphs are captured per (bucket, context class): a step uses the smallest class holding
    # its longest context (the engine's max context is always the last class). The attention plan of
    # a class has the split count for that length; the kernel uses as many of those as the actual
    # context has 64-token tiles (none up to 2 tiles), but a class still fixes the CTAs launched and
    # whether the combine kernel runs (a 32K plan at batch 1 launches 4 x 64 CTAs, most of which exit
    # at once at a 128-token context).
    graph_context_classes: tuple[int, ...] = (512, 8192)
    # Prefix caching (engine/blocks.py): full KV blocks stay cached after their request ends, keyed by
    # their token prefix, and a new request starts after the longest cached prefix of its prompt.
    # Unreferenced cached blocks are evicted LRU when pages run out, so it never refuses or preempts
    # more than without it. False (the CLI's --no-prefix-cache) frees blocks at once.
    prefix_caching: bool = True
    # Shifted reuse of cached K/V (engine/blocks.py; llama-server's --cache-reuse): past a new prompt's
    # cached prefix, a run of at least this many tokens found in cached blocks at another position is
    # copied there with its keys rotated instead of computed again (fill-in-the-middle: the code below
    # the cursor). Approximate: those tokens keep the K/V of their old context; nothing computed from
    # them enters the prefix cache. 0: off (exact prefix caching only).
    cache_reuse: int = 0
    # Prompt-lookup speculative decoding for requests that leave `Request.speculation` None (greedy
    # requests only; speculation is off for temperature > 0). None: off unless a request asks.
    speculation: SpeculationConfig | None = None
    # Constrained decoding (grammar.py): every step applies a token bitmask to its logits before
    # sampling, read from a [rows, ceil(V/32)] int32 device buffer that the captured graphs read (rows
    # without a grammar hold all ones). False leaves the mask out of the step (bench A/B: the mask's
    # cost) and refuses requests with a grammar.
    token_mask: bool = True

    def __post_init__(self) -> None:
        if self.backend not in ("kernels", "torch"):
            raise ValueError(f"EngineConfig.backend must be 'kernels' or 'torch', got {self.backend!r}")
        if self.mode not in ("graph", "eager"):
            raise ValueError(f"EngineConfig.mode must be 'graph' or 'eager', got {self.mode!r}")
        if self.mode == "graph" and not self.device.startswith("cuda"):
            raise ValueError("EngineConfig.mode='graph' needs a CUDA device; use mode='eager' on the CPU")
        if self.backend == "kernels" and not self.device.startswith("cuda"):
            raise ValueError("EngineConfig.backend='kernels' needs a CUDA device; "
                             "use backend='torch' on the CPU")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if not 0.0 < self.kv_memory_fraction <= 0.98:
            raise ValueError(f"kv_memory_fraction must be in (0, 0.98], got {self.kv_memory_fraction}")
        if self.kv_memory_bytes is not None and self.kv_memory_bytes <= 0:
            raise ValueError(f"kv_memory_bytes must be positive, got {self.kv_memory_bytes}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (one is the padding block), got {self.num_blocks}")
        if self.max_batch <= 0 or self.max_batch > max(self.graph_buckets):
            raise ValueError(f"max_batch must be in 1..{max(self.graph_buckets)}, got {self.max_batch}")
        if self.prefill_chunk < self.block_size:
            raise ValueError(f"prefill_chunk ({self.prefill_chunk}) must be >= block_size "
                             f"({self.block_size})")
        why = cache_reuse_error(self.cache_reuse, self.prefix_caching)
        if why:
            raise ValueError(f"EngineConfig.{why}")
        if self.speculation is not None and not isinstance(self.speculation, SpeculationConfig):
            raise ValueError(f"EngineConfig.speculation must be a SpeculationConfig or None, "
                             f"got {self.speculation!r}")
        self.graph_buckets = tuple(sorted(b for b in self.graph_buckets if b <= self._bucket_cap()))

    def _bucket_cap(self) -> int:
        """Largest bucket kept: the batch limit rounded up to a power of two, and at least the rows of a
        verify step (a request may turn speculation on whatever the engine default)."""
        cap = 1
        while cap < max(self.max_batch, VERIFY_MAX_ROWS):
            cap *= 2
        return cap

    def context_classes(self, max_context: int) -> tuple[int, ...]:
        """Context classes below `max_context`, then `max_context` itself."""
        return tuple(sorted({c for c in self.graph_context_classes if c < max_context} | {max_context}))

    def bucket_for(self, batch: int) -> int:
        """Smallest graph bucket holding `batch` sequences."""
        for b in self.graph_buckets:
            if b >= batch:
                return b
        raise ValueError(f"batch {batch} exceeds the largest bucket {self.graph_buckets[-1]}")


def parse_bytes(text: str) -> int:
    """'24GiB', '500MB', '1.5G', '123456' -> bytes (binary units for Gi/Mi/Ki and bare G/M/K)."""
    s = text.strip().replace(" ", "")
    units = {"gib": 2**30, "mib": 2**20, "kib": 2**10, "gb": 10**9, "mb": 10**6, "kb": 10**3,
             "g": 2**30, "m": 2**20, "k": 2**10, "b": 1}
    low = s.lower()
    for suffix in sorted(units, key=len, reverse=True):
        if low.endswith(suffix):
            number = low[: -len(suffix)]
            try:
                value = float(number)
            except ValueError:
                break
            if value <= 0:
                break
            return int(value * units[suffix])
    try:
        value = int(s)
    except ValueError:
        raise ValueError(f"cannot parse a memory size from {text!r} "
                         "(examples: 24GiB, 500MB, 123456)") from None
    if value <= 0:
        raise ValueError(f"memory size must be positive, got {text!r}")
    return value
