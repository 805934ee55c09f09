"""The sampling reference: which tokens a sampler may return, with which probabilities, and one draw.

One definition for every sampler of nanoqwen: the reference runtime's per-sequence `Sampler`, the
engine's torch backend and the GPU sampling kernel's tests all use it.

    temperature 0            greedy: argmax, the lowest id on ties
    top_k > 0                keep logits >= the k-th largest (ties at the threshold are kept)
    top_p < 1                then keep logits >= the largest value whose tempered probability mass,
                             counted from the top over the survivors, reaches top_p
    draw                     softmax(logits / temperature) renormalised on what is kept

Probabilities are computed in fp64, so the mask does not depend on fp32 summation order.
"""

from __future__ import annotations

import torch

__all__ = ["greedy", "sampling_mask", "sampling_probs", "sample"]


def greedy(logits: torch.Tensor) -> int:
    """argmax of logits [V], the lowest id on ties."""
    return int(torch.argmax(logits))


def sampling_mask(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """bool [V]: the tokens a sampler may return for one row of logits [V] (temperature > 0)."""
    lf = logits.double()
    keep = torch.ones_like(lf, dtype=torch.bool)
    if 0 < top_k < lf.numel():
        kth = torch.topk(lf, top_k).values[-1]
        keep &= lf >= kth
    if top_p < 1.0:
        vals = torch.where(keep, lf, torch.full_like(lf, -float("inf")))
        sorted_vals, _ = torch.sort(vals, descending=True)
        mass = torch.exp((sorted_vals - sorted_vals[0]) / temperature)
        cum = torch.cumsum(mass, 0)
        pos = int(torch.searchsorted(cum, top_p * cum[-1]).clamp(max=cum.numel() - 1))
        keep &= lf >= sorted_vals[pos]
    return keep


def sampling_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """fp64 [V]: the distribution a sampler must draw from (temperature > 0)."""
    keep = sampling_mask(logits, temperature, top_k, top_p)
    lf = logits.double() / temperature
    return torch.softmax(torch.where(keep, lf, torch.full_like(lf, -float("inf"))), 0)


def sample(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
           generator: torch.Generator) -> int:
    """One token from logits [V]: greedy at temperature 0, else one draw from `sampling_probs` with
    `generator` (a CPU generator: the same seed gives the same token whatever device the logits are on)."""
    if temperature == 0.0:
        return greedy(logits)
    probs = sampling_probs(logits.detach().cpu(), temperature, top_k, top_p)
    return int(torch.multinomial(probs, 1, generator=generator))
