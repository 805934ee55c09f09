"""The prompt-lookup drafter (nanoqwen_runtime.speculative): n-gram matching, greedy acceptance,
adaptive backoff and the --speculate syntax. Pure Python: no model, no torch."""

from __future__ import annotations

import random

import pytest
from nanoqwen_runtime.speculative import MAX_DRAFT, NgramDrafter, SpeculationConfig, accept_greedy


def _brute_force(ctx: list[int], cfg: SpeculationConfig, limit: int) -> list[int]:
    """The specification written as a plain scan: longest n first, most recent earlier occurrence
    (one that ends before the last token), the tokens after it."""
    want = min(cfg.k, limit)
    if want == 0:
        return []
    L = len(ctx)
    for n in range(cfg.ngram_max, cfg.ngram_min - 1, -1):
        if n > L - 1:
            continue
        suffix = ctx[L - n:]
        for i in range(L - n - 1, -1, -1):
            if ctx[i:i + n] == suffix:
                return ctx[i + n:i + n + want]
    return []


# ----------------------------------------------------------------------------- matching


def test_longest_ngram_wins_over_a_more_recent_shorter_one():
    cfg = SpeculationConfig(k=3, ngram_max=3, ngram_min=1)
    # "1 2 3" occurs at 0 (followed by 10 11 12); "3" alone occurs later, followed by 20.
    prompt = [1, 2, 3, 10, 11, 12, 3, 20, 5, 1, 2, 3]
    assert NgramDrafter(cfg, prompt).propose([], limit=8) == [10, 11, 12]


def test_most_recent_occurrence_of_the_same_ngram():
    cfg = SpeculationConfig(k=2, ngram_max=2, ngram_min=2)
    prompt = [7, 8, 1, 1, 7, 8, 2, 2, 9, 7, 8]
    # "7 8" at 0 (-> 1 1) and at 4 (-> 2 2): the later one.
    assert NgramDrafter(cfg, prompt).propose([], limit=8) == [2, 2]


def test_falls_back_to_shorter_ngrams_and_returns_empty_when_nothing_matches():
    cfg = SpeculationConfig(k=4, ngram_max=4, ngram_min=2)
    # only the 2-gram "5 6" repeats
    d = NgramDrafter(cfg, [9, 5, 6, 40, 41, 3, 5, 6])
    assert d.propose([], limit=8) == [40, 41, 3, 5]
    # ngram_min=2: a lone repeated token is not enough
    d = NgramDrafter(cfg, [1, 2, 3, 4, 5, 3])
    assert d.propose([], limit=8) == []
    assert NgramDrafter(SpeculationConfig(ngram_min=1), [1, 2, 3, 4, 5, 3]).propose([], 8) == [4, 5, 3]


def test_suffix_does_not_match_itself():
    cfg = SpeculationConfig(k=4, ngram_max=3, ngram_min=1)
    # all tokens distinct: the only occurrence of each suffix is the suffix itself
    assert NgramDrafter(cfg, [1, 2, 3, 4, 5]).propose([], limit=4) == []
    assert NgramDrafter(cfg, [1]).propose([], limit=4) == []
    assert NgramDrafter(cfg, []).propose([], limit=4) == []


def test_overlapping_occurrence_and_draft_running_to_the_end_of_the_context():
    cfg = SpeculationConfig(k=4, ngram_max=2, ngram_min=1)
    # "a a a a": suffix "a a" last occurs at 1 (overlapping it), followed only by one "a"
    assert NgramDrafter(cfg, [5, 5, 5, 5]).propose([], limit=4) == [5]


def test_limit_caps_the_draft():
    cfg = SpeculationConfig(k=5, ngram_max=2, ngram_min=1)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2]
    d = NgramDrafter(cfg, prompt)
    assert d.propose([], limit=9) == [3, 4, 5, 6, 7]   # k
    assert d.propose([], limit=2) == [3, 4]            # limit
    assert d.propose([], limit=0) == []
    with pytest.raises(ValueError, match="limit"):
        d.propose([], limit=-1)


def test_match_across_the_prompt_generated_boundary():
    cfg = SpeculationConfig(k=3, ngram_max=3, ngram_min=3)
    d = NgramDrafter(cfg, [10, 11, 12, 13, 14, 15, 16, 10, 11])
    assert d.propose([], limit=8) == []          # "16 10 11" never occurred before... no 3-gram match
    # the suffix "10 11 12" spans the prompt's last two tokens and the first generated one
    assert d.propose([12], limit=8) == [13, 14, 15]
    # and a match that lies inside the generated text
    d = NgramDrafter(cfg, [1, 2])
    gen = [30, 31, 32, 33, 34, 99, 30, 31, 32]
    assert d.propose(gen, limit=8) == [33, 34, 99]


def test_incremental_calls_agree_with_one_call_and_with_a_brute_force_scan():
    rng = random.Random(1234)
    for trial in range(200):
        cfg = SpeculationConfig(k=rng.randint(1, MAX_DRAFT), ngram_max=rng.randint(1, 5), ngram_min=1)
        vocab = rng.randint(2, 6)  # a small vocabulary makes repeats (and overlaps) common
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 30))]
        gen = [rng.randrange(vocab) for _ in range(rng.randint(0, 30))]
        limit = rng.randint(0, 8)
        inc = NgramDrafter(cfg, prompt)
        for t in range(len(gen) + 1):  # one call per token, as an engine makes them
            got = inc.propose(gen[:t], limit)
            assert got == _brute_force(prompt + gen[:t], cfg, limit), (trial, t)
        assert NgramDrafter(cfg, prompt).propose(gen, limit) == _brute_force(prompt + gen, cfg, limit)


def test_observe_tells_whether_the_context_has_a_match_and_changes_no_draft():
    """observe() takes in new tokens without drafting: idle_at() is then True exactly when the context has
    no match (the brute-force scan's draft is empty), and propose() calls between observe() calls (given
    the whole generated sequence, as the scheduler gives it) return what a drafter fed by propose() alone
    returns. Random contexts over small vocabularies."""
    rng = random.Random(77)
    for trial in range(200):
        n_max = rng.randint(1, 5)
        cfg = SpeculationConfig(k=rng.randint(1, MAX_DRAFT), ngram_max=n_max, ngram_min=rng.randint(1, n_max))
        vocab = rng.randint(2, 12)
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 20))]
        gen = [rng.randrange(vocab) for _ in range(rng.randint(1, 20))]
        watched, plain = NgramDrafter(cfg, prompt), NgramDrafter(cfg, prompt)
        for t in range(1, len(gen) + 1):
            watched.observe(gen[t - 1:t])
            assert watched.idle_at(t) == (_brute_force(prompt + gen[:t], cfg, 1) == []), (trial, t)
            if rng.random() < 0.5:  # the engine drafts at some steps only
                assert watched.propose(gen[:t], 4) == plain.propose(gen[:t], 4), (trial, t)


def test_idle_at_is_false_while_a_backoff_is_pending():
    """A pending backoff starts at the next propose(): a step going ahead would skip that call and move
    the backoff's start, so idle_at() does not let it go ahead, whatever the context; once the backoff
    runs, idle_at() follows silent_at()."""
    cfg = SpeculationConfig(k=2, ngram_max=1, ngram_min=1, min_acceptance=1.0, window=1, backoff_steps=2)
    d = NgramDrafter(cfg, [1, 2, 3])
    d.observe([9])  # 1 2 3 9: no match
    assert d.idle_at(2)
    d.record(2, 0)  # the backoff is pending
    assert not d.idle_at(2) and not d.silent_at(2)
    assert d.propose([9], 4) == []  # the backoff starts here: generated lengths 1 and 2 draft nothing
    d.observe([1])  # 1 2 3 9 1: "1" occurred, followed by 2
    assert d.idle_at(2) and d.silent_at(2) and not d.idle_at(3)


def test_generated_may_not_shrink():
    d = NgramDrafter(SpeculationConfig(), [1, 2, 3])
    d.propose([4, 5], 4)
    with pytest.raises(ValueError, match="shrank"):
        d.propose([4], 4)


# ----------------------------------------------------------------------------- accept_greedy


def test_accept_greedy_all_none_partial():
    assert accept_greedy([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]   # all accepted + the bonus token
    assert accept_greedy([5, 6, 7], [9, 6, 7, 8]) == [9]            # none: the model's own token
    assert accept_greedy([5, 6, 7], [5, 1, 7, 8]) == [5, 1]         # partial: stops at the first miss
    assert accept_greedy([], [4]) == [4]                            # no draft: a plain decode step
    with pytest.raises(ValueError, match=r"len\(draft\) \+ 1"):
        accept_greedy([1, 2], [1, 2])


def test_accept_greedy_reproduces_greedy_decoding_of_a_toy_model():
    """Drive a deterministic toy 'model' (next token = a fixed function of the context) with and without
    drafts: the speculative tokens are exactly the greedy ones, whatever the drafts."""

    def model(ctx: list[int]) -> int:
        return (ctx[-1] * 7 + len(ctx) // 5) % 11 if len(ctx) % 3 else ctx[-2]

    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
    n_new = 60
    plain = list(prompt)
    while len(plain) < len(prompt) + n_new:
        plain.append(model(plain))

    for cfg in (SpeculationConfig(k=1), SpeculationConfig(k=4), SpeculationConfig(k=7, ngram_max=2)):
        drafter = NgramDrafter(cfg, prompt)
        ctx = list(prompt)
        while len(ctx) < len(prompt) + n_new:
            gen = ctx[len(prompt):]
            draft = drafter.propose(gen, limit=len(prompt) + n_new - len(ctx) - 1)
            argmax = [model(ctx + draft[:i]) for i in range(len(draft) + 1)]
            emitted = accept_greedy(draft, argmax)
            if draft:
                drafter.record(len(draft), len(emitted) - 1)
            ctx.extend(emitted)
        assert ctx == plain


# ----------------------------------------------------------------------------- adaptive backoff


def test_backoff_after_a_window_of_failures_then_recovery():
    cfg = SpeculationConfig(k=2, ngram_max=1, ngram_min=1, min_acceptance=0.5, window=3, backoff_steps=5)
    d = NgramDrafter(cfg, [1, 2, 1, 2, 1])
    gen: list[int] = []
    assert d.propose(gen, 4) == [2, 1]
    d.record(2, 0)
    d.record(2, 0)          # window not full yet: keep drafting
    assert d.propose(gen, 4) == [2, 1] and not d.backing_off
    d.record(2, 0)          # window full, 0/6 < 0.5: back off
    assert d.backoffs == 1 and d.backing_off
    for _ in range(5):      # 5 generated tokens without drafts
        assert d.propose(gen, 4) == []
        gen.append(2 if len(gen) % 2 == 0 else 1)
    assert d.propose(gen, 4) != [] and not d.backing_off   # recovered
    # the window restarted empty: two bad steps do not trip it again
    d.record(2, 0)
    d.record(2, 0)
    assert d.propose(gen, 4) != []


def test_good_acceptance_keeps_drafting_and_window_slides():
    cfg = SpeculationConfig(k=4, ngram_max=1, min_acceptance=0.125, window=4, backoff_steps=10)
    d = NgramDrafter(cfg, [1, 2, 1])
    for _ in range(20):
        d.record(4, 1)  # 1/4 >= 1/8
    assert d.backoffs == 0 and d.propose([], 4) != []
    # the window slides: after two failures the last four steps hold 2/16 = 1/8, exactly
    # min_acceptance, which is not below it; a third failure makes it 1/16 < 1/8
    d.record(4, 0)
    d.record(4, 0)
    assert d.backoffs == 0
    d.record(4, 0)
    assert d.backoffs == 1 and d.propose([], 4) == []


def test_record_validates_and_ignores_empty_steps():
    d = NgramDrafter(SpeculationConfig(window=1, min_acceptance=1.0), [1, 1])
    d.record(0, 0)  # a step without a draft is not a verify step: no effect
    assert d.backoffs == 0
    for bad in ((2, 3), (-1, 0), (2, -1), (2.0, 1)):
        with pytest.raises(ValueError, match="accepted <= drafted"):
            d.record(*bad)


# ----------------------------------------------------------------------------- config and parse


def test_parse():
    assert SpeculationConfig.parse(None) is None
    assert SpeculationConfig.parse("off") is None
    assert SpeculationConfig.parse("none") is None
    assert SpeculationConfig.parse("ngram") == SpeculationConfig()
    assert SpeculationConfig.parse("ngram:6") == SpeculationConfig(k=6)
    assert SpeculationConfig.parse("ngram:1").k == 1 and SpeculationConfig.parse("ngram:7").k == 7
    assert SpeculationConfig.parse(SpeculationConfig(k=3).spec()) == SpeculationConfig(k=3)


@pytest.mark.parametrize("text, match", [
    ("ngram:0", r"K must be in 1\.\.7"),
    ("ngram:8", r"K must be in 1\.\.7"),
    ("ngram:99999999999999999999", r"K must be in 1\.\.7"),
    ("ngram:", "unknown speculation"),
    ("ngram:-1", "unknown speculation"),
    ("ngram:+3", "unknown speculation"),
    ("ngram:2.5", "unknown speculation"),
    ("ngram:٣", "unknown speculation"),   # a non-ASCII digit
    ("NGRAM", "unknown speculation"),
    (" ngram", "unknown speculation"),
    ("eagle", "unknown speculation"),
    ("", "unknown speculation"),
    ("ngram:4:2", "unknown speculation"),
])
def test_parse_errors(text, match):
    with pytest.raises(ValueError, match=match):
        SpeculationConfig.parse(text)


def test_parse_rejects_non_strings():
    with pytest.raises(ValueError, match="must be a string"):
        SpeculationConfig.parse(4)  # type: ignore[arg-type]


@pytest.mark.parametrize("kwargs, match", [
    ({"k": 0}, "k must be"), ({"k": 8}, "k must be"), ({"k": True}, "k must be"),
    ({"ngram_min": 0}, "ngram_min"), ({"ngram_max": 2, "ngram_min": 3}, "ngram_max"),
    ({"min_acceptance": 1.5}, "min_acceptance"), ({"min_acceptance": float("nan")}, "min_acceptance"),
    ({"window": 0}, "window"), ({"backoff_steps": -1}, "backoff_steps"),
])
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SpeculationConfig(**kwargs)


def test_drafter_needs_a_config():
    with pytest.raises(TypeError, match="SpeculationConfig"):
        NgramDrafter("ngram", [1, 2])  # type: ignore[arg-type]
