"""The sampling reference: masks on small hand-checked cases, and the draw's distribution."""

from __future__ import annotations

import torch
from nanoqwen_model.sampling import greedy, sample, sampling_mask, sampling_probs


def test_masks_small_cases():
    logits = torch.tensor([3.0, 1.0, 2.0, 2.0, -1.0])
    assert sampling_mask(logits, 1.0, 2, 1.0).tolist() == [True, False, True, True, False]  # ties kept
    assert sampling_mask(logits, 1.0, 0, 0.01).tolist() == [True, False, False, False, False]
    # top-p over the survivors of top-k: mass of 3.0 alone is e^3/(e^3+2e^2) = 0.50 < 0.6, so the
    # tied 2.0s join
    assert sampling_mask(logits, 1.0, 3, 0.6).tolist() == [True, False, True, True, False]
    assert torch.allclose(sampling_probs(logits, 1.0, 0, 1.0), torch.softmax(logits.double(), 0))


def test_greedy_takes_lowest_id_on_ties():
    assert greedy(torch.tensor([1.0, 5.0, 5.0, 2.0])) == 1
    assert sample(torch.tensor([1.0, 5.0, 5.0]), 0.0, 0, 1.0, torch.Generator()) == 1


def test_draws_follow_the_reference_distribution():
    """20,000 seeded draws: each kept token's frequency within 5 standard deviations of its
    probability (sqrt(p(1-p)/n) <= 0.0036 at n = 20,000, so the bound is at most 0.018); masked
    tokens never drawn."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(50, generator=g) * 2
    probs = sampling_probs(logits, 0.8, 10, 0.9)
    n = 20_000
    gen = torch.Generator().manual_seed(1)
    counts = torch.bincount(torch.tensor([sample(logits, 0.8, 10, 0.9, gen) for _ in range(n)]), minlength=50)
    freq = counts.double() / n
    assert (counts[probs == 0] == 0).all()
    sd = (probs * (1 - probs) / n).sqrt()
    assert ((freq - probs).abs() <= 5 * sd + 1e-12).all()


def test_same_seed_same_tokens():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(2))
    a = [sample(logits, 1.0, 0, 0.95, torch.Generator().manual_seed(7)) for _ in range(3)]
    assert len(set(a)) == 1
