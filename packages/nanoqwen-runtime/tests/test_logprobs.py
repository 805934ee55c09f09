"""Logprobs on the reference engine (nanoqwen_runtime.logprobs): sampled-token and top-k logprobs, the
prompt's logprobs through chunked prefill, verified tokens of speculative steps, the prefix cache
skipped for prompt logprobs, refusals.

The oracle is HF's fp32 forward over the whole sequence (`hf_model`), log-softmaxed in fp64. The bound:
the reference engine's logits differ from HF's by at most 2e-5 of the largest |logit| (test_reference.py
derives it: fp32 summation order), and the log-softmax moves by at most twice the largest logit change
(log-sum-exp is 1-Lipschitz in the max norm), so |logprob - HF's| <= 2 * 2e-5 * max|logit|.
"""

from __future__ import annotations

import pytest
import torch
from engine_testkit import reference_engine
from nanoqwen_runtime.engine import FinishEvent, Request, TokenEvent
from nanoqwen_runtime.logprobs import MAX_TOP_LOGPROBS, PromptLogprobs, row_logprobs, unpack
from nanoqwen_runtime.reference import ReferenceModel
from nanoqwen_runtime.sampling import SamplingParams
from nanoqwen_runtime.speculative import SpeculationConfig
from nanoqwen_runtime.testing import tiny_config

REL = 2e-5  # the reference engine's logits vs HF's, relative to max |logit| (test_reference.py)


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    """f64 [len(ids), V]: HF's logits at every position of `ids`."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].double()


def bound(logits: torch.Tensor) -> float:
    return 2 * REL * float(logits.abs().max())


def run(eng, reqs):
    toks: dict = {}
    fins: dict = {}
    for ev in eng.generate(reqs):
        if isinstance(ev, TokenEvent):
            toks.setdefault(ev.request, []).append(ev)
        else:
            assert isinstance(ev, FinishEvent)
            fins[ev.request_id] = ev
    return toks, fins


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, tiny_config()["vocab_size"], (n,), generator=g).tolist()


def check_token(lp, token: int, want_row: torch.Tensor, k: int) -> None:
    """One TokenLogprobs against the oracle's log-softmax row (f64 [V])."""
    tol = 2 * REL * float(want_row.abs().max()) + 1e-6
    assert abs(lp.logprob - float(want_row[token])) <= tol
    assert len(lp.top_ids) == len(lp.top_logprobs) == k
    assert list(lp.top_logprobs) == sorted(lp.top_logprobs, reverse=True)
    for i, v in zip(lp.top_ids, lp.top_logprobs, strict=True):
        assert abs(v - float(want_row[i])) <= tol
    if k:  # the alternatives are the oracle's top k, up to near-ties at the cut
        assert float(want_row.topk(k).values[-1]) - tol <= lp.top_logprobs[-1]


def test_sampled_and_prompt_logprobs_match_hf(tiny_int4, model, hf):
    """Greedy and sampled requests in one batch, the prompt prefilled in chunks of 7 (so the prompt
    logprobs are gathered over three chunks): every value within the bound of HF's log-softmax."""
    eng = reference_engine(tiny_int4, model, prefill_chunk=7)
    p = prompt(17, seed=1)
    reqs = [Request(p, SamplingParams(max_tokens=5), request_id="greedy", ignore_eos=True, logprobs=3,
                    prompt_logprobs=True),
            Request(p, SamplingParams(temperature=1.0, top_k=5, seed=7, max_tokens=5), request_id="sampled",
                    ignore_eos=True, logprobs=MAX_TOP_LOGPROBS),
            Request(prompt(9, seed=2), SamplingParams(max_tokens=3), request_id="plain", ignore_eos=True)]
    toks, _ = run(eng, reqs)
    assert all(ev.logprobs is None and ev.prompt_logprobs is None for ev in toks["plain"])
    for rid, k in (("greedy", 3), ("sampled", MAX_TOP_LOGPROBS)):
        evs = toks[rid]
        ids = p + [ev.token_id for ev in evs]
        want = torch.log_softmax(hf_logits(hf, ids), dim=-1)
        for j, ev in enumerate(evs):
            check_token(ev.logprobs, ev.token_id, want[len(p) - 1 + j], k)
            if rid == "greedy":  # the sampled token is the top one; its logprob the first alternative's
                assert ev.logprobs.top_ids[0] == ev.token_id
                assert ev.logprobs.top_logprobs[0] == ev.logprobs.logprob
        assert [ev.prompt_logprobs is not None for ev in evs] == ([rid == "greedy"] + [False] * 4)
    pl = toks["greedy"][0].prompt_logprobs
    assert len(pl) == len(p) and pl[0] is None
    want = torch.log_softmax(hf_logits(hf, p), dim=-1)
    for t in range(1, len(p)):
        check_token(pl[t], p[t], want[t - 1], 3)


def test_verified_tokens_get_the_verification_logits(tiny_int4, model, hf):
    """Prompt-lookup speculation on a repetitive prompt: drafts are verified, and each committed token's
    logprob is that of its verify row (HF at the same position)."""
    eng = reference_engine(tiny_int4, model, speculation=SpeculationConfig(k=4, ngram_min=1))
    base = prompt(6, seed=3)
    p = base * 4
    toks, _ = run(eng, [Request(p, SamplingParams(max_tokens=24), request_id="r", ignore_eos=True,
                                logprobs=1)])
    assert eng.scheduler.spec_accepted_tokens > 0  # some tokens came from verified drafts
    evs = toks["r"]
    want = torch.log_softmax(hf_logits(hf, p + [ev.token_id for ev in evs]), dim=-1)
    for j, ev in enumerate(evs):
        check_token(ev.logprobs, ev.token_id, want[len(p) - 1 + j], 1)


def test_prompt_logprobs_skip_the_prefix_cache(tiny_int4, model, hf):
    eng = reference_engine(tiny_int4, model)
    p = prompt(40, seed=4)
    run(eng, [Request(p, SamplingParams(max_tokens=1), request_id="warm")])
    hit = eng.stats().prefix_hit_tokens
    assert hit == 0 and eng.blocks.num_cached >= 2  # the prompt's two full blocks are cached
    run(eng, [Request(p, SamplingParams(max_tokens=1), request_id="again")])
    assert eng.stats().prefix_hit_tokens == 32  # a plain request takes them
    queried = eng.stats().prefix_queried_tokens
    toks, _ = run(eng, [Request(p, SamplingParams(max_tokens=1), request_id="echo", logprobs=0,
                                prompt_logprobs=True)])
    assert eng.stats().prefix_hit_tokens == 32 and eng.stats().prefix_queried_tokens == queried
    pl = toks["echo"][0].prompt_logprobs
    want = torch.log_softmax(hf_logits(hf, p), dim=-1)
    for t in range(1, len(p)):
        check_token(pl[t], p[t], want[t - 1], 0)


def test_prompt_logprobs_refuse_a_gap():
    acc = PromptLogprobs(num_prompt=10, k=0)
    acc.add(0, torch.zeros(4, 1))
    with pytest.raises(AssertionError, match="prefix cache"):
        acc.add(6, torch.zeros(3, 1))
    with pytest.raises(AssertionError, match="4 of 9"):
        acc.result()


def test_row_logprobs_layout():
    logits = torch.tensor([[0.0, 1.0, 2.0, float("-inf")]])
    packed = row_logprobs(logits, torch.tensor([1]), 2, vocab_size=3)
    want = torch.log_softmax(torch.tensor([0.0, 1.0, 2.0]), 0)
    (lp,) = unpack(packed, 2)
    assert lp.top_ids == (2, 1)
    assert torch.allclose(torch.tensor([lp.logprob, *lp.top_logprobs]), want[[1, 2, 1]])
    assert unpack(packed, 1)[0].top_ids == (2,)


@pytest.mark.parametrize("kw,msg", [({"logprobs": 21}, "0..20"), ({"logprobs": -1}, "0..20"),
                                    ({"logprobs": True}, "0..20"),
                                    ({"prompt_logprobs": True}, "prompt_logprobs needs")])
def test_bad_logprob_requests_are_refused(tiny_int4, model, kw, msg):
    eng = reference_engine(tiny_int4, model)
    ev = eng.submit(Request([1, 2, 3], SamplingParams(max_tokens=2), **kw))
    assert ev is not None and ev.reason == "refused" and msg in ev.detail


# ---- the CUDA engine's logprob path, on the CPU (torch op backend, overlapped decode on) -------------
# Its bound against the fp32 reference: logits within LOGIT_ATOL (engine_testkit, derived in
# test_engine_cpu.py), so logprobs within 2 x LOGIT_ATOL (log-sum-exp is 1-Lipschitz in the max norm).


@pytest.fixture(scope="module")
def engine_path(tmp_path_factory):
    from engine_testkit import TINY
    from nanoqwen_runtime.engine.synthetic import write_container

    return write_container(tmp_path_factory.mktemp("lp") / "tiny.nanoqwen", TINY, seed=1)


def reference_logprobs(path, ids: list[int]) -> torch.Tensor:
    """f32 [len(ids), V]: the fp32 reference's log-softmax at every position of `ids` (one prefill)."""
    from nanoqwen_runtime.kv_cache import KVCacheSpec, PagedKVCache, build_step_metadata

    ref = ReferenceModel.from_file(path, dtype=torch.float32)
    cfg = ref.config
    cache = PagedKVCache(KVCacheSpec(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, 64, 16,
                                     dtype=torch.float32))
    seq = cache.new_sequence()
    meta = build_step_metadata([seq], [len(ids)])
    return torch.log_softmax(ref.forward(torch.tensor(ids), meta, cache, all_logits=True), dim=-1)


def test_engine_logprobs_match_reference(engine_path):
    from engine_testkit import LOGIT_ATOL, cpu_config
    from nanoqwen_runtime.engine import Engine

    eng = Engine.from_file(engine_path, cpu_config())  # prefill_chunk 48: the prompt of 70 in 2 chunks
    assert eng.config.overlap
    g = torch.Generator().manual_seed(5)
    p = torch.randint(10, 500, (70,), generator=g).tolist()
    q = torch.randint(10, 500, (9,), generator=g).tolist()
    reqs = [Request(q, SamplingParams(max_tokens=8), request_id="plain", ignore_eos=True),
            Request(p, SamplingParams(max_tokens=8), request_id="lp", ignore_eos=True, logprobs=5,
                    prompt_logprobs=True),
            Request(q, SamplingParams(temperature=0.8, seed=3, max_tokens=8), request_id="sampled",
                    ignore_eos=True, logprobs=0)]
    toks, _ = run(eng, reqs)
    assert eng.num_steps_ahead > 0  # decode steps were queued before their predecessor's read-back
    assert all(ev.logprobs is None for ev in toks["plain"])
    tol = 2 * LOGIT_ATOL
    for rid, prompt_ids, k in (("lp", p, 5), ("sampled", q, 0)):
        evs = toks[rid]
        want = reference_logprobs(engine_path, prompt_ids + [ev.token_id for ev in evs])
        for j, ev in enumerate(evs):
            row = want[len(prompt_ids) - 1 + j]
            assert abs(ev.logprobs.logprob - float(row[ev.token_id])) <= tol, (rid, j)
            assert len(ev.logprobs.top_ids) == k
            for i, v in zip(ev.logprobs.top_ids, ev.logprobs.top_logprobs, strict=True):
                assert abs(v - float(row[i])) <= tol
            assert list(ev.logprobs.top_logprobs) == sorted(ev.logprobs.top_logprobs, reverse=True)
    pl = toks["lp"][0].prompt_logprobs
    want = reference_logprobs(engine_path, p)
    assert len(pl) == len(p) and pl[0] is None
    for t in range(1, len(p)):
        assert abs(pl[t].logprob - float(want[t - 1, p[t]])) <= tol
        assert list(pl[t].top_logprobs) == sorted(pl[t].top_logprobs, reverse=True)
    assert eng.kv_blocks_used() == 0 and not eng._prompt_lp
    assert eng.num_logprob_requests == 0  # so the next steps build no logprob work at all
    eng.submit(Request(q, SamplingParams(max_tokens=4), request_id="late", logprobs=1))
    assert eng.num_logprob_requests == 1
    eng.abort("late")
    assert eng.num_logprob_requests == 0


def test_engine_verified_tokens_get_the_verification_logits(engine_path):
    """The CUDA engine's code path with prompt-lookup speculation: a verify step's committed tokens
    carry the logprobs of their own verify rows (the prompt repeats a random 6-gram; with this seed a
    draft is accepted, asserted)."""
    from engine_testkit import LOGIT_ATOL, cpu_config
    from nanoqwen_runtime.engine import Engine

    eng = Engine.from_file(engine_path, cpu_config(speculation=SpeculationConfig(k=4, ngram_min=1)))
    g = torch.Generator().manual_seed(2)
    p = torch.randint(10, 500, (6,), generator=g).tolist() * 4
    toks, _ = run(eng, [Request(p, SamplingParams(max_tokens=24), request_id="r", ignore_eos=True,
                                logprobs=1)])
    assert eng.scheduler.spec_accepted_tokens > 0
    evs = toks["r"]
    want = reference_logprobs(engine_path, p + [ev.token_id for ev in evs])
    for j, ev in enumerate(evs):
        assert abs(ev.logprobs.logprob - float(want[len(p) - 1 + j, ev.token_id])) <= 2 * LOGIT_ATOL, j
