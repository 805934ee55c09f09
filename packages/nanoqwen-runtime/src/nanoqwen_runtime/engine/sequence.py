"""The request and sequence types the scheduler, the block manager and both engines share.

A `Request` is what a caller submits; the scheduler wraps it in a `Sequence` (its tokens, KV pages and
progress: see scheduler.py for the `num_computed` diagram) and ends it with a `FinishReason`. They live
apart from the scheduler so that the block manager (blocks.py), which the scheduler uses, can name a
`Sequence` without importing the scheduler back.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from ..sampling import SamplingParams
from ..speculative import NgramDrafter, SpeculationConfig

if TYPE_CHECKING:
    from ..grammar import Grammar, GrammarMatcher

__all__ = ["FinishReason", "SeqStatus", "Request", "Sequence"]


class FinishReason(enum.StrEnum):
    EOS = "eos"            # an end-of-sequence token was sampled
    STOP = "stop"          # a stop string appeared in the output
    LENGTH = "length"      # max_new_tokens reached
    CONTEXT = "context"    # the engine's context limit reached
    REFUSED = "refused"    # never admitted (reason in the event)
    ABORTED = "aborted"    # cancelled by the caller
    ERROR = "error"        # the model failed at run time (non-finite logits); no token emitted (detail)


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    """One generation request: prompt token ids and sampling settings (validated by `SamplingParams`).

    `params.seed=None` gets a fresh random seed when the engine accepts the request. `ignore_eos`
    keeps generating past EOS tokens (benchmarks use it to fix the output length); `eos_ids`
    replaces the model's EOS ids for this request. A request whose prompt + max_tokens exceeds the
    context limit runs until the context is full (finish reason "context"). `detokenize=False` leaves
    the events' text empty (the `Backend` adapter: its `Pipeline` decodes the tokens itself, once).
    `logprobs` (None: off; k in 0..20) and `prompt_logprobs`: what each token event carries
    (nanoqwen_runtime.logprobs); a request with `prompt_logprobs` never takes its prompt from the
    prefix cache.
    `grammar` constrains the sampled tokens to it (a token bitmask per step, grammar.py); such a request
    is never speculated (engine.py says how its masks join steps planned ahead).
    """

    prompt_tokens: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str | None = None
    ignore_eos: bool = False
    eos_ids: frozenset[int] | None = None
    detokenize: bool = True
    speculation: SpeculationConfig | Literal[False] | None = None
    logprobs: int | None = None
    prompt_logprobs: bool = False
    grammar: Grammar | None = None  # constrained decoding (grammar.py): sampled tokens follow it


@dataclass(eq=False)
class Sequence:
    """Scheduler state of one request. `tokens` = prompt + generated so far."""

    seq_id: int
    request: Request
    tokens: list[int]
    num_prompt: int
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    admitted_order: int = -1  # larger = admitted later (preempted first)
    seed: int = 0  # the request's seed, or a fresh random one when it gave None
    block_keys: list[bytes] = field(default_factory=list)  # prefix-cache keys of its first full blocks
    drafter: NgramDrafter | None = None  # prompt-lookup drafts (greedy requests with speculation)
    num_new_tokens: int = 0  # tokens the last `Scheduler.commit` appended (> 1 after a verify step)
    matcher: GrammarMatcher | None = None  # the request's grammar state (engine_base; never speculated)
    # shifted reuse (blocks.py): [start, end) holds K/V copied at admission, which prefill skips (a
    # chunk computes up to start, then on from end: StepPlan.skips; None when no such gap is left
    # ahead); first_shifted_block: the index
    # of the block holding the first copied token, from which on blocks are keyed in a chain exact
    # lookups never reach (None: no copy)
    reused_span: tuple[int, int] | None = None
    first_shifted_block: int | None = None

    @property
    def prefill_left(self) -> int:
        """Tokens left to compute: without the reused span when one lies ahead."""
        if self.reused_span is not None:
            return self.uncomputed - (self.reused_span[1] - self.reused_span[0])
        return self.uncomputed

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.num_prompt

    @property
    def uncomputed(self) -> int:
        return len(self.tokens) - self.num_computed

    @property
    def in_decode(self) -> bool:
        return self.status is SeqStatus.RUNNING and self.uncomputed == 1
