"""Token log-probabilities: what a request asks for, how a step computes them, what an event carries.

The values are the log-softmax of the model's raw logits (before temperature, top-k and top-p: what
vLLM returns by default), computed in fp32 on the device that holds the logits:

    logits [R, V] (bf16 on the CUDA engine, f32 on the reference) --rows that asked--> f32 [n, V]
        --log_softmax--> gather(sampled token)             -> logprob of the token        [n, 1]
                     --> topk(k) (k = largest asked, <= 20) -> values [n, k], ids [n, k]
        packed as one f32 [n, 1 + 2k] array (ids < 2^24 are exact in f32): one device-to-host copy.

A request asks with `Request.logprobs = k` (0..MAX_TOP_LOGPROBS: the sampled token's logprob and its
k most likely alternatives) and, for the prompt's own logprobs (`echo` with logprobs on the
completions endpoint, which loglikelihood evaluations read), `Request.prompt_logprobs = True`: each
prompt token after the first gets the logprob the model gave it at the position before it, with the
same k alternatives. That needs the logits at every prompt position, which a prefill computes only
for the last one; such a request takes nothing from the prefix cache (the scheduler skips the lookup,
and the engines assert that its prompt logprobs arrive from position 0 on).

Rows nobody asked for cost nothing: a step whose rows all leave `logprobs` None runs no extra op.

Events: a `TokenEvent` of a request that asked carries `logprobs` (a `TokenLogprobs`); its first one
(index 0) also carries `prompt_logprobs` when asked: one entry per prompt token, None for the first.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["MAX_TOP_LOGPROBS", "TokenLogprobs", "PromptLogprobs", "row_logprobs", "unpack", "check_request"]

MAX_TOP_LOGPROBS = 20  # as OpenAI's top_logprobs (and vLLM's default max_logprobs)


class TokenLogprobs(NamedTuple):
    """One token's logprob and its top alternatives, most likely first (a NamedTuple: it crosses the
    server's process pipe cheaply)."""

    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


def check_request(logprobs: int | None, prompt_logprobs: bool) -> str | None:
    """Why a request's logprob settings are invalid, or None."""
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                 or not 0 <= logprobs <= MAX_TOP_LOGPROBS):
        return f"logprobs must be None or an integer in 0..{MAX_TOP_LOGPROBS}, got {logprobs!r}"
    if prompt_logprobs and logprobs is None:
        return "prompt_logprobs needs logprobs (the number of alternatives, 0..20)"
    return None


def row_logprobs(logits: torch.Tensor, targets: torch.Tensor, k: int, vocab_size: int) -> torch.Tensor:
    """Log-softmax of each row of `logits` ([n, >= V], any float dtype; columns V.. are ignored) at
    `targets` (int [n]) and its `k` largest values with their ids: f32 [n, 1 + 2k] laid out
    [logprob of target, top values (descending), top ids (as f32)]. Runs where the logits are."""
    lp = torch.log_softmax(logits[:, :vocab_size].float(), dim=-1)
    chosen = lp.gather(1, targets.to(lp.device).long().view(-1, 1))
    if k == 0:
        return chosen
    top = lp.topk(k, dim=-1)  # sorted, largest first
    return torch.cat([chosen, top.values, top.indices.float()], dim=1)


def unpack(packed, k: int) -> list[TokenLogprobs]:
    """`row_logprobs`' rows (a host array or tensor [n, 1 + 2K], K >= k) as `TokenLogprobs`, the top
    alternatives cut to the first `k`."""
    rows = packed.tolist() if hasattr(packed, "tolist") else packed
    out = []
    for r in rows:
        width = (len(r) - 1) // 2
        out.append(TokenLogprobs(r[0], tuple(int(i) for i in r[1 + width:1 + width + k]),
                                 tuple(r[1:1 + k])))
    return out


class PromptLogprobs:
    """The prompt logprobs of one sequence, gathered chunk by chunk during its prefill: position p's
    logits give prompt token p + 1 its logprob, for p in 0..num_prompt - 2."""

    def __init__(self, num_prompt: int, k: int):
        self.num_prompt = num_prompt
        self.k = k
        self.entries: list[TokenLogprobs] = []

    @property
    def next_position(self) -> int:
        return len(self.entries)

    @property
    def complete(self) -> bool:
        return len(self.entries) == self.num_prompt - 1

    def add(self, start: int, packed) -> None:
        """The rows of positions start.. of this prefill chunk (`row_logprobs` output). The chunks must
        cover the prompt from position 0 without a gap: a prefix-cache hit would skip positions."""
        if start == 0:  # a sequence preempted before its first token computes its prompt again
            self.entries = []
        if start != self.next_position:
            raise AssertionError(f"prompt logprobs: a chunk starts at position {start}, expected "
                                 f"{self.next_position} (was the prompt taken from the prefix cache?)")
        self.entries.extend(unpack(packed, self.k))

    def result(self) -> tuple[TokenLogprobs | None, ...]:
        """One entry per prompt token: None for the first (nothing precedes it), then each token's."""
        if not self.complete:
            raise AssertionError(f"prompt logprobs: {len(self.entries)} of {self.num_prompt - 1} positions")
        return (None, *self.entries)

    def rows_in_chunk(self, start: int, q: int) -> int:
        """How many of a chunk's q positions (from `start`) give a prompt logprob (those before the
        prompt's last position, whose logits choose the first generated token)."""
        return max(0, min(start + q, self.num_prompt - 1) - start)

