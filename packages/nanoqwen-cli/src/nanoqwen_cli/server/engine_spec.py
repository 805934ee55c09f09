"""What the engine process builds (`EngineSpec`) and what it tells the server once built (`EngineInfo`).

    serve_command (CLI options) --> EngineSpec (picklable) --spawn--> engine process: spec.build()
    engine process --> EngineInfo (picklable: description, context, vocabulary) --> HTTP process

The engine runs in a child process started with "spawn" (CUDA cannot survive a fork), so what crosses
is data: the spec is pickled to the child, which imports this module and calls `build()`; the child
answers with an `EngineInfo`, all the HTTP side ever reads of the engine besides its events and stats.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nanoqwen_runtime.speculative import SpeculationConfig

__all__ = ["EngineSpec", "EngineInfo", "describe_engine"]


@dataclass(frozen=True)
class EngineSpec:
    """The engine of `nanoqwen-cli serve`, as its options say.

    device "cpu" builds the plain-torch `ReferenceEngine` (fp32; max_batch defaults to 16), "cuda" or
    "cuda:N" the CUDA `Engine` (CUDA graphs unless `eager`; max_batch defaults to EngineConfig's).
    kv_memory_bytes None: each engine's default pool size. threads: torch's intra-op threads in the
    engine process (None: on the CPU nanoqwen_runtime.cpu_threads' rule, on cuda torch's default).
    """

    path: str
    device: str = "cpu"
    eager: bool = False
    overlap: bool = True  # EngineConfig.overlap (cuda; serve --no-overlap)
    kv_memory_bytes: int | None = None
    max_model_len: int | None = None
    max_batch: int | None = None
    verify: bool = True
    speculation: SpeculationConfig | None = None
    prefix_caching: bool = True
    cache_reuse: int = 0  # EngineConfig.cache_reuse (serve --cache-reuse)
    dense_weight_cache: bool = False
    threads: int | None = None

    def build(self) -> Any:
        """Load the engine (in the engine process). Raises what loading raises."""
        import torch

        if self.device.startswith("cuda"):
            if self.threads is not None:
                torch.set_num_threads(self.threads)
            from nanoqwen_runtime.engine import Engine, EngineConfig

            cfg = EngineConfig(device=self.device, mode="eager" if self.eager else "graph",
                               kv_memory_bytes=self.kv_memory_bytes, max_model_len=self.max_model_len,
                               verify=self.verify, speculation=self.speculation,
                               prefix_caching=self.prefix_caching, dense_weight_cache=self.dense_weight_cache,
                               overlap=self.overlap, cache_reuse=self.cache_reuse,
                               **({"max_batch": self.max_batch} if self.max_batch else {}))
            return Engine.from_file(self.path, cfg)
        from nanoqwen_runtime.cpu_threads import apply_threads
        from nanoqwen_runtime.reference_engine import ReferenceEngine, ReferenceEngineConfig

        threads = apply_threads(self.threads)
        kw = {"kv_memory_bytes": self.kv_memory_bytes} if self.kv_memory_bytes else {}
        engine = ReferenceEngine.from_file(
            self.path, ReferenceEngineConfig(max_batch=self.max_batch or 16, max_model_len=self.max_model_len,
                                             speculation=self.speculation, prefix_caching=self.prefix_caching,
                                             cache_reuse=self.cache_reuse, **kw),
            device=self.device, verify=self.verify)
        engine.name += f"; {threads.threads} CPU thread{'s' * (threads.threads != 1)} ({threads.why})"
        return engine


@dataclass(frozen=True)
class EngineInfo:
    """What the HTTP side knows of the loaded engine.

    description: what runs, in words (printed at start); max_model_len: the context window in tokens
    (prompt + generated); vocab_size: token ids a prompt may hold are 0..vocab_size-1.
    """

    description: str
    max_model_len: int
    vocab_size: int

    @classmethod
    def of(cls, engine: Any) -> EngineInfo:
        return cls(describe_engine(engine), int(engine.max_model_len), int(engine.geom.vocab_size))


def describe_engine(eng: Any) -> str:
    """What runs, in words: the engine's `name` (reference and test engines), or the CUDA engine's op
    backend and mode. KV blocks are the usable ones (the pool less its padding block), the figure
    /metrics gives as nanoqwen_kv_blocks_total."""
    if hasattr(eng, "name"):
        return eng.name
    c = eng.config
    return (f"CUDA engine ({c.backend} ops, {c.mode} mode) on {eng.device}, {eng.num_blocks} KV blocks of "
            f"{c.block_size} tokens")
