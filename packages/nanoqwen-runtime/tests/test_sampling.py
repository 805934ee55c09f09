"""Sampling parameters, the sampler's distributions and stop-string matching."""

from __future__ import annotations

import math

import pytest
import torch
from nanoqwen_runtime.sampling import Sampler, SamplingError, SamplingParams, StopMatcher


@pytest.mark.parametrize("kwargs,message", [
    ({"temperature": -0.5}, "temperature must be a finite number >= 0"),
    ({"temperature": math.nan}, "temperature"),
    ({"temperature": math.inf}, "temperature"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k must be an integer >= 0"),
    ({"top_k": 2.5}, "top_k"),
    ({"max_tokens": 0}, "max_tokens must be an integer >= 1"),
    ({"seed": -3}, "seed"),
    ({"stop": ("",)}, "stop strings must be non-empty"),
])
def test_invalid_params_are_rejected_clearly(kwargs, message):
    with pytest.raises(SamplingError, match=message):
        SamplingParams(**kwargs)


def test_stop_accepts_a_single_string():
    assert SamplingParams(stop="END").stop == ("END",)


def test_temperature_zero_is_greedy_and_ignores_seed():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    logits[417] = 50.0
    for seed in (1, 2, 3):
        assert Sampler(SamplingParams(temperature=0.0, seed=seed, top_k=5, top_p=0.3))(logits) == 417
    tie = torch.zeros(10)
    tie[3] = tie[7] = 1.0
    assert Sampler(SamplingParams())(tie) == 3  # ties go to the lowest id


def test_seed_reproducible_and_seeds_differ():
    logits = torch.randn(500, generator=torch.Generator().manual_seed(1))
    p = SamplingParams(temperature=1.0, seed=1234)
    a = _draws(Sampler(p), logits, 50)
    b = _draws(Sampler(p), logits, 50)
    c = _draws(Sampler(p.with_(seed=99)), logits, 50)
    assert a == b
    assert c != a


def _draws(sampler, logits, n):
    return [sampler(logits) for _ in range(n)]


def test_top_k_support_and_top_p_support():
    torch.manual_seed(0)
    logits = torch.randn(300)
    top5 = set(torch.topk(logits, 5).indices.tolist())
    s = Sampler(SamplingParams(temperature=2.0, top_k=5, seed=0))
    assert set(_draws(s, logits, 400)) <= top5
    # top_p: the smallest prefix of the sorted distribution whose mass reaches p
    probs = torch.softmax(logits, -1)
    order = torch.argsort(probs, descending=True)
    cum = torch.cumsum(probs[order], 0)
    n_keep = int((cum < 0.5).sum()) + 1
    nucleus = set(order[:n_keep].tolist())
    s = Sampler(SamplingParams(temperature=1.0, top_p=0.5, seed=0))
    got = set(_draws(s, logits, 600))
    assert got <= nucleus and len(got) >= min(3, n_keep)


def test_temperature_frequencies_follow_softmax():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5])
    t = 0.7
    s = Sampler(SamplingParams(temperature=t, seed=5))
    n = 6000
    counts = torch.bincount(torch.tensor(_draws(s, logits, n)), minlength=5).float() / n
    expect = torch.softmax(logits / t, -1)
    # a frequency over n = 6000 draws has standard deviation sqrt(p(1-p)/n) <= 0.0065; 0.025 is 3.9 of
    # them (a false alarm about once in 10^4 per token, 5 tokens)
    assert torch.allclose(counts, expect, atol=0.025), (counts, expect)


def test_tiny_top_p_keeps_one_token():
    logits = torch.tensor([0.0, 3.0, 1.0])
    s = Sampler(SamplingParams(temperature=5.0, top_p=1e-6, seed=0))
    assert set(_draws(s, logits, 50)) == {1}


def test_stop_matcher_across_pieces():
    m = StopMatcher(("<END>", "\n\n\n"))
    out = []
    for piece in ["abc", "<E", "N", "x", "<", "EN", "D>tail"]:
        text, stopped = m.push(piece)
        out.append(text)
        if stopped:
            break
    assert "".join(out) == "abc<ENx"
    assert m.stopped and m.push("more") == ("", True) and m.flush() == ""


def test_stop_matcher_releases_held_prefix_at_end():
    m = StopMatcher(("STOP",))
    assert m.push("abcST") == ("abc", False)
    assert m.push("O") == ("", False)
    assert m.flush() == "STO"
    assert StopMatcher(()).push("x") == ("x", False)
