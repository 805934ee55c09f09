"""`ReferenceBackend` as an adapter over `ReferenceEngine` (backend.py): prompt-lookup speculation and
prefix caching keep the greedy tokens exactly (fp32 reference, tokens compared for equality), the
prefix cache carries over from one start() to the next (a chat's next turn), `prefix_caching=False`
caches nothing, and the run is the shared `engine_run.EngineRun`."""

from __future__ import annotations

import torch
from nanoqwen_runtime.backend import ReferenceBackend, TokenRequest
from nanoqwen_runtime.engine_run import EngineRun
from nanoqwen_runtime.sampling import SamplingParams
from nanoqwen_runtime.speculative import SpeculationConfig

SPEC = SpeculationConfig.parse("ngram:4")
BLOCK = 16


def loop_prompt(n_rep: int = 4) -> list[int]:
    """A 12-token unit repeated: its n-grams recur, so the drafter has something to propose."""
    unit = torch.randint(10, 290, (12,), generator=torch.Generator().manual_seed(3)).tolist()
    return unit * n_rep


def run(backend: ReferenceBackend, prompts: list[list[int]], max_tokens: int = 10) -> list[list[int]]:
    r = backend.start([TokenRequest(p, SamplingParams(max_tokens=max_tokens)) for p in prompts])
    assert isinstance(r, EngineRun)  # the one adapter both backends use
    out: list[list[int]] = [[] for _ in prompts]
    for events in r:
        for ev in events:
            out[ev.request].append(ev.token_id)
    return out


def test_speculation_and_prefix_cache_keep_greedy_tokens(model):
    first = loop_prompt()                       # 48 tokens
    second = first[:40] + [7, 8, 9]             # shares 40 tokens: 2 full blocks of 16
    plain = ReferenceBackend(model, block_size=BLOCK, prefix_caching=False)
    fast = ReferenceBackend(model, block_size=BLOCK, speculation=SPEC)
    want = [run(plain, [first]), run(plain, [second])]
    got = [run(fast, [first]), run(fast, [second])]
    assert got == want
    assert plain.stats().prefix_hit_tokens == 0 and plain.stats().kv_blocks_cached == 0
    st = fast.stats()
    # the second start() reuses the first one's engine (its pool holds 43 + 10 tokens): its prompt
    # finds the 2 full blocks it shares with the first prompt; the first found nothing
    assert st.prefix_queried_tokens == len(first) + len(second)
    assert st.prefix_hit_tokens == BLOCK * (40 // BLOCK)
    # the loop prompt's n-grams recur, so the drafter proposed tokens (greedy requests: speculated)
    assert st.spec_steps > 0 and st.spec_drafted_tokens > 0
    assert st.spec_accepted_tokens <= st.spec_drafted_tokens
    assert st.kv_blocks_used == 0


def test_batched_requests_share_one_engine_and_match_alone(model):
    """Three requests in one start() give the tokens each gives alone (fp32: batch-invariant argmax
    on these well-separated logits is what test_reference checks against HF)."""
    prompts = [loop_prompt(2), loop_prompt(3)[5:], [11, 12, 13]]
    backend = ReferenceBackend(model, block_size=BLOCK, prefill_chunk=20, speculation=SPEC)
    together = run(backend, prompts, max_tokens=6)
    alone = [run(ReferenceBackend(model, block_size=BLOCK), [p], max_tokens=6)[0] for p in prompts]
    assert together == alone


def test_engine_kept_while_it_fits_and_doubled_when_not(model):
    backend = ReferenceBackend(model, block_size=BLOCK)
    short = TokenRequest(list(range(20, 40)), SamplingParams(max_tokens=4))      # 24 tokens: 2 blocks
    long = TokenRequest(list(range(20, 120)), SamplingParams(max_tokens=8))      # 108 tokens: 7 blocks
    first = backend.engine_for([short])
    assert first.blocks.usable_blocks == 2
    for _ in backend.start([short]):
        pass
    assert backend.engine_for([short]) is first                  # idle and big enough: kept
    grown = backend.engine_for([long])
    assert grown is not first and grown.blocks.usable_blocks == 7  # max(7, 2 x 2)
    assert backend.engine_for([short, short]) is not grown       # a batch of 2 needs a new engine
