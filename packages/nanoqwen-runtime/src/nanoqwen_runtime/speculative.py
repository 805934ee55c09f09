"""Prompt-lookup speculative decoding: n-gram drafts taken from the request's own tokens.

Coding requests copy a lot: an edited function repeats most of the function in the prompt. So the
tokens that followed the last occurrence of the current suffix are a good guess for what comes next
(prompt lookup decoding, as in vLLM's `ngram` speculator and llama.cpp's `lookup`). No draft model.

One verify step (in the engine, not here) runs the context's last token plus the draft, k+1 rows,
through the model; at batch 1 the INT4 GEMV reads the weights once for up to 8 rows, so the extra rows
are nearly free. `accept_greedy` turns the k+1 argmax tokens into what the step emits: the longest
agreeing prefix of the draft plus the model's own next token, which are exactly the tokens plain greedy
decoding would produce (each emitted token is the argmax after a context made only of emitted tokens).

Speculation is for greedy requests only: speculation is off for temperature > 0 (the greedy path is
exact; sampled requests are not speculated), never a silently different distribution.

Sequences here are token ids (ints). Nothing here imports torch.

    cfg = SpeculationConfig.parse("ngram:4")            # the CLI's --speculate value
    drafter = NgramDrafter(cfg, prompt_ids)              # one per request
    draft = drafter.propose(generated_ids, limit=max_tokens - len(generated_ids) - 1)
    emitted = accept_greedy(draft, argmax_of_the_k_plus_1_rows)
    drafter.record(len(draft), len(emitted) - 1)
"""

from __future__ import annotations

import math
import re
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["SpeculationConfig", "NgramDrafter", "accept_greedy", "MAX_DRAFT"]

# k+1 rows (last token + k drafts) must fit the engine's M <= 8 GEMV: k <= 7.
MAX_DRAFT = 7

_SPEC_RE = re.compile(r"ngram(?::([0-9]+))?")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class SpeculationConfig:
    """How a request drafts. Validated at construction (ValueError naming the field).

    k: most drafted tokens per verify step, 1..7 (k+1 rows fit the M <= 8 GEMV).
    ngram_max / ngram_min: suffix lengths tried, longest first (1 <= ngram_min <= ngram_max).
    min_acceptance: in [0, 1]; when the acceptance rate over the last `window` verify steps falls
        below it, the request stops drafting for `backoff_steps` generated tokens, then tries again.
    window: verify steps in the acceptance window (>= 1).
    backoff_steps: generated tokens (plain decode steps) without drafting after a backoff (>= 0).
    """

    k: int = 4
    ngram_max: int = 4
    ngram_min: int = 1
    min_acceptance: float = 0.2
    window: int = 8
    backoff_steps: int = 32

    def __post_init__(self) -> None:
        if not _is_int(self.k) or not 1 <= self.k <= MAX_DRAFT:
            raise ValueError(f"k must be an integer in 1..{MAX_DRAFT} (k+1 rows fit the M<=8 GEMV), "
                             f"got {self.k!r}")
        if not _is_int(self.ngram_min) or self.ngram_min < 1:
            raise ValueError(f"ngram_min must be an integer >= 1, got {self.ngram_min!r}")
        if not _is_int(self.ngram_max) or self.ngram_max < self.ngram_min:
            raise ValueError(f"ngram_max must be an integer >= ngram_min ({self.ngram_min}), "
                             f"got {self.ngram_max!r}")
        a = self.min_acceptance
        if isinstance(a, bool) or not isinstance(a, int | float) or not math.isfinite(a) or not 0 <= a <= 1:
            raise ValueError(f"min_acceptance must be a number in [0, 1], got {a!r}")
        if not _is_int(self.window) or self.window < 1:
            raise ValueError(f"window must be an integer >= 1, got {self.window!r}")
        if not _is_int(self.backoff_steps) or self.backoff_steps < 0:
            raise ValueError(f"backoff_steps must be an integer >= 0, got {self.backoff_steps!r}")

    @classmethod
    def parse(cls, text: str | None) -> SpeculationConfig | None:
        """'ngram' -> default k, 'ngram:6' -> k=6, None/'off'/'none' -> None; anything else ValueError
        with a clear message (the CLI's --speculate value)."""
        if text is None:
            return None
        if not isinstance(text, str):
            raise ValueError(f"speculation must be a string like 'ngram' or 'ngram:4', got {text!r}")
        if text in ("off", "none"):
            return None
        m = _SPEC_RE.fullmatch(text)
        if m is None:
            raise ValueError(f"unknown speculation {text!r}: expected 'ngram', 'ngram:K' "
                             f"(K = drafted tokens per step, 1..{MAX_DRAFT}) or 'off'")
        if m.group(1) is None:
            return cls()
        k = int(m.group(1))
        if not 1 <= k <= MAX_DRAFT:
            raise ValueError(f"speculation {text!r}: K must be in 1..{MAX_DRAFT} "
                             f"(K+1 rows fit the M<=8 GEMV), got {k}")
        return cls(k=k)

    def spec(self) -> str:
        """The `parse` string for this config's k (the other fields are not in the CLI syntax)."""
        return f"ngram:{self.k}"


class NgramDrafter:
    """Prompt-lookup drafts for one sequence (one instance per request).

    The context is prompt + generated. For each n in ngram_max..ngram_min the drafter looks up the
    context's last n tokens among the n-grams that END BEFORE the context's last token (so the suffix
    never matches itself, and every match has at least one token after it) and drafts the tokens that
    followed the most recent such occurrence, up to the end of the context. Matches may span the
    prompt/generated boundary.

    Lookups are O(ngram_max): an index maps each n-gram (a tuple) to the start of its most recent
    occurrence that has a follower. It is built on the first propose() (not at construction: the
    request's first token is not delayed by it), in C-speed bulk updates (~1 ms for a 4K-token prompt),
    and extended as the context grows (O(ngram_max) per token).
    """

    def __init__(self, config: SpeculationConfig, prompt: Sequence[int]):
        if not isinstance(config, SpeculationConfig):
            raise TypeError(f"config must be a SpeculationConfig, got {type(config).__name__}")
        self.config = config
        self._ctx: list[int] = list(prompt)
        self._indexed = 0  # tokens of _ctx whose arrival has been entered into _index
        self._index: dict[tuple[int, ...], int] = {}
        self._n_prompt = len(prompt)
        self._n_gen = 0
        self._window: deque[tuple[int, int]] = deque(maxlen=config.window)
        self._backoff_pending = False
        self._resume_at = -1  # drafting resumes once len(generated) >= this
        self.backoffs = 0     # times the drafter stopped drafting (for stats and tests)

    def _index_new_tokens(self) -> None:
        """Enter the tokens appended since the last call: token `end` gives the n-grams that end just
        before it (start end - n) a follower. Starts ascend, so a later occurrence overwrites."""
        ctx, index = self._ctx, self._index
        first, L = self._indexed, len(ctx)
        if first == L:
            return
        lo, hi = self.config.ngram_min, self.config.ngram_max
        if L - first <= 8:  # a decode step's few tokens: direct inserts beat building slices
            for end in range(max(first, lo), L):
                for n in range(lo, min(hi, end) + 1):
                    index[tuple(ctx[end - n:end])] = end - n
            self._indexed = L
            return
        for n in range(lo, hi + 1):
            s0, s1 = max(first, n) - n, L - n  # starts s0..s1-1 (follower index s + n in first..L-1)
            if s1 > s0:
                keys = zip(*(ctx[s0 + j:s1 + j] for j in range(n)), strict=True)
                index.update(zip(keys, range(s0, s1), strict=True))
        self._indexed = L

    def propose(self, generated: Sequence[int], limit: int) -> list[int]:
        """Up to min(k, limit) tokens predicted to follow prompt+generated: the most recent earlier
        occurrence of the longest matching suffix n-gram (n from ngram_max down to ngram_min), and the
        tokens after it. [] when nothing matches or the drafter is backing off.

        generated: every token generated so far for this request (the same growing sequence on each
        call; it may not shrink). limit: >= 0, the most tokens the caller can still take (room before
        max_tokens / the context length).
        """
        if not _is_int(limit) or limit < 0:
            raise ValueError(f"limit must be an integer >= 0, got {limit!r}")
        self._extend(generated)
        n_gen = self._n_gen
        if self._backoff_pending:
            self._backoff_pending = False
            self._resume_at = n_gen + self.config.backoff_steps
        if n_gen < self._resume_at:
            return []
        want = min(self.config.k, limit)
        if want == 0:
            return []
        return self._lookup(want)

    def observe(self, new_tokens: Sequence[int]) -> None:
        """Append the tokens generated since the last call, without drafting (the scheduler calls it at
        every commit, so that `idle_at` sees the context as committed; a later propose() gets the whole
        generated sequence as always and finds them there). O(len(new_tokens)): the index is brought up
        to date only when a lookup needs it. No backoff state changes."""
        self._ctx.extend(new_tokens)
        self._n_gen += len(new_tokens)

    def _extend(self, generated: Sequence[int]) -> None:
        n_gen = len(generated)
        if n_gen < self._n_gen:
            raise ValueError(f"generated shrank from {self._n_gen} to {n_gen} tokens: one NgramDrafter "
                             "per request, fed the request's whole generated sequence")
        if n_gen > self._n_gen:
            self._ctx.extend(generated[self._n_gen:])
            self._n_gen = n_gen

    def _lookup(self, want: int) -> list[int]:
        """The draft of up to `want` (>= 1) tokens for the context as it is: [] when no suffix matches."""
        self._index_new_tokens()
        ctx = self._ctx
        L = len(ctx)
        for n in range(min(self.config.ngram_max, L - 1), self.config.ngram_min - 1, -1):
            start = self._index.get(tuple(ctx[L - n:]))
            if start is not None:
                return ctx[start + n:start + n + want]
        return []

    def record(self, drafted: int, accepted: int) -> None:
        """Feedback after a verify step (adaptive backoff): `drafted` tokens were proposed, the first
        `accepted` of them were emitted (0 <= accepted <= drafted). When the window holds `window`
        steps and accepted/drafted over it is below min_acceptance, drafting stops for backoff_steps
        generated tokens and the window starts empty again."""
        if not _is_int(drafted) or not _is_int(accepted) or not 0 <= accepted <= drafted:
            raise ValueError(f"need integers 0 <= accepted <= drafted, got drafted={drafted!r} "
                             f"accepted={accepted!r}")
        if drafted == 0:
            return
        self._window.append((drafted, accepted))
        if len(self._window) < self.config.window:
            return
        d = sum(x for x, _ in self._window)
        a = sum(y for _, y in self._window)
        if a < self.config.min_acceptance * d:
            self._window.clear()
            self._backoff_pending = True
            self.backoffs += 1

    def silent_at(self, n_gen: int) -> bool:
        """True when propose() with `n_gen` generated tokens (>= the last call's) would return [] whatever
        those tokens are, and skipping that call changes nothing: it backs off through that length and
        no backoff is pending (a pending one starts at the next call's length; the tokens a skipped call
        would have appended to the context are appended by the next one). The engine's overlapped
        decode plans a step before its tokens are known only then (`Scheduler.plan_ahead`)."""
        return not self._backoff_pending and n_gen < self._resume_at

    def idle_at(self, n_gen: int) -> bool:
        """True when `silent_at(n_gen)`, or when the drafter expects no match then: the context as last
        seen (propose() or `observe`) ends in a suffix with no earlier occurrence, and no backoff is
        pending. The second case is a prediction, not a guarantee: the token still to come may give the
        suffix a match. The engine's overlapped decode plans a step ahead, without drafts, through either
        case (`Scheduler.plan_ahead`); a match the token in flight would have given is then drafted one
        step later, once it is committed (greedy verification emits the same tokens either way)."""
        return self.silent_at(n_gen) or (not self._backoff_pending and not self._lookup(1))

    @property
    def backing_off(self) -> bool:
        """True when the next propose() returns [] because of the adaptive backoff (as of the
        generated length seen by the last propose())."""
        return self._backoff_pending or self._n_gen < self._resume_at


def accept_greedy(draft: Sequence[int], argmax: Sequence[int]) -> list[int]:
    """Tokens a greedy verify step emits. argmax[i] is the model's greedy token after the context plus
    draft[:i] (len(argmax) == len(draft) + 1). Returns argmax[:j+1] where j is the length of the
    longest prefix with draft[i] == argmax[i]: the accepted drafts plus the model's own next token."""
    if len(argmax) != len(draft) + 1:
        raise ValueError(f"argmax must have len(draft) + 1 = {len(draft) + 1} entries, got {len(argmax)}")
    j = 0
    while j < len(draft) and draft[j] == argmax[j]:
        j += 1
    return list(argmax[:j + 1])
