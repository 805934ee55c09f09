"""The logprob work of one CUDA engine step, read off its plan (nanoqwen_runtime.logprobs says what
the values are; `ModelRunner._logprobs` computes them on the device)."""

from __future__ import annotations

from typing import NamedTuple

from .metadata import plan_rows, sampled_rows
from .scheduler import StepPlan

__all__ = ["StepLogprobs", "step_logprobs"]


class StepLogprobs(NamedTuple):
    """The logprob work of one CUDA engine step (built from its plan only when some row asked).

    rows: the step's rows (`metadata.plan_rows` order, = rows of its logits) whose sampled token wants
      its logprob; k: the largest top-k among them; prompt: prefill chunks whose positions give prompt
      logprobs, as (plan index, flat token row of the chunk's first position, positions m, the chunk's
      first position, target ids [m]: the prompt token after each position).
    """

    rows: list[int]
    k: int
    prompt: list[tuple[int, int, int, int, list[int]]]


def step_logprobs(plan: StepPlan) -> StepLogprobs | None:
    """What `plan` (an engine StepPlan) computes in logprobs, or None when no row asked (no cost)."""
    rows: list[int] = []
    prompt: list[tuple[int, int, int, int, list[int]]] = []
    k = 0
    flat = 0
    sampling = {r for rs in sampled_rows(plan).values() for r in rs}
    for r, (i, start, q) in enumerate(plan_rows(plan)):
        s = plan.seqs[i]
        want = s.request.logprobs
        if want is not None:
            if plan.sample[i] and r in sampling:
                rows.append(r)
                k = max(k, want)
            if (plan.kind == "prefill" and s.request.prompt_logprobs and s.num_generated == 0
                    and start < s.num_prompt - 1):
                m = min(start + q, s.num_prompt - 1) - start
                prompt.append((i, flat, m, start, s.tokens[start + 1:start + 1 + m]))
                k = max(k, want)
        flat += q
    if not rows and not prompt:
        return None
    return StepLogprobs(rows, k, prompt)
