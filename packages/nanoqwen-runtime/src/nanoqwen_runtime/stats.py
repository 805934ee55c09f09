"""A snapshot of an engine's counters, read between steps by whoever drives it (the server's
`/metrics`, `nanoqwen-cli bench`).

Both engines provide it through `stats()`: the CUDA `Engine` (engine/engine.py) and the reference
engine that the CPU server runs. Counters (`*_total`, `preemptions`, `prefix_*`, `spec_*`) only grow
from the engine's creation; gauges (`running`, `waiting`, `kv_blocks_*`) describe this moment.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["EngineStats"]


@dataclass(frozen=True)
class EngineStats:
    running: int                     # sequences holding KV blocks (prefilling or decoding)
    waiting: int                     # submitted, not yet admitted (or preempted, waiting again)
    kv_blocks_total: int             # blocks in the pool
    kv_blocks_used: int              # blocks referenced by live sequences
    kv_blocks_cached: int = 0        # unreferenced blocks still holding a reusable prefix (evictable)
    preemptions: int = 0             # sequences preempted since creation
    prefix_queried_tokens: int = 0   # prompt tokens looked up in the prefix cache
    prefix_hit_tokens: int = 0       # of those, taken from the cache instead of prefilled
    prefix_reused_tokens: int = 0    # of the rest, copied from cached blocks at a shifted position
    spec_steps: int = 0              # verify steps that carried at least one drafted token
    spec_drafted_tokens: int = 0     # tokens proposed by the drafter
    spec_accepted_tokens: int = 0    # drafted tokens the model accepted

    @property
    def kv_blocks_free(self) -> int:
        """Blocks a new sequence can take now (cached prefix blocks count as free: they are evicted)."""
        return self.kv_blocks_total - self.kv_blocks_used

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_queried_tokens if self.prefix_queried_tokens else 0.0

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_accepted_tokens / self.spec_drafted_tokens if self.spec_drafted_tokens else 0.0

    @property
    def spec_mean_accepted(self) -> float:
        """Mean drafted tokens accepted per verify step that carried a draft."""
        return self.spec_accepted_tokens / self.spec_steps if self.spec_steps else 0.0
