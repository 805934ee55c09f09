"""ReferenceEngine: continuous batching on the plain-torch model, with the CUDA engine's request API.

Tokens are checked against the plainest oracle, HF's uncached greedy forward on the same weights
(`hf_greedy`): in fp32 the paged forward differs from HF only in summation order (test_reference.py
derives 2e-5 relative), far below the top-2 logit gaps of the tiny random model, so greedy tokens
must be equal whatever the batch, chunking or preemption.
"""

from __future__ import annotations

import pytest
import torch
from engine_testkit import hf_greedy, reference_engine
from nanoqwen_runtime.engine import FinishEvent, FinishReason, Request, TokenEvent
from nanoqwen_runtime.reference_engine import ReferenceEngineConfig
from nanoqwen_runtime.sampling import SamplingParams
from nanoqwen_runtime.stats import EngineStats
from nanoqwen_runtime.testing import engine_events, tiny_config


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    vocab = tiny_config()["vocab_size"]
    return [torch.randint(0, vocab, (int(n_tok),), generator=g).tolist()
            for n_tok in torch.randint(3, 40, (n,), generator=g)]


def test_batched_requests_match_hf_greedy(tiny_int4, model, hf):
    eng = reference_engine(tiny_int4, model, prefill_chunk=7)
    ps = prompts(4, seed=5)
    reqs = [Request(p, SamplingParams(max_tokens=6), request_id=f"r{i}", ignore_eos=True)
            for i, p in enumerate(ps)]
    toks, fins = engine_events(eng, reqs)
    for i, p in enumerate(ps):
        assert toks[f"r{i}"] == hf_greedy(hf, p, 6)
        assert fins[f"r{i}"].reason is FinishReason.LENGTH
        assert fins[f"r{i}"].num_prompt_tokens == len(p)
    assert eng.kv_blocks_used() == 0 and not eng.has_work
    assert eng.num_steps["prefill"] >= 2 and eng.num_steps["decode"] >= 5  # chunked prefill, then decode


def test_request_joins_mid_run(tiny_int4, model, hf):
    """A request submitted between steps joins the running batch and still gets the oracle's tokens."""
    eng = reference_engine(tiny_int4, model)
    a, b = prompts(2, seed=9)
    eng.submit(Request(a, SamplingParams(max_tokens=8), request_id="a", ignore_eos=True))
    got: dict[str, list[int]] = {"a": [], "b": []}
    steps = 0
    while eng.has_work:
        if steps == 3:
            eng.submit(Request(b, SamplingParams(max_tokens=5), request_id="b", ignore_eos=True))
            assert eng.stats().waiting == 1 and eng.stats().running == 1
        for ev in eng.step():
            if isinstance(ev, TokenEvent):
                got[ev.request].append(ev.token_id)
        steps += 1
    assert got["a"] == hf_greedy(hf, a, 8)
    assert got["b"] == hf_greedy(hf, b, 5)


def test_preemption_under_a_small_pool_keeps_tokens(tiny_int4, model, hf):
    """A pool too small for all sequences at once forces preemption; recomputed sequences go on exactly."""
    # tiny model: 2 layers x 2 (K,V) x 2 heads x 32 x 4 B = 1 KiB a token, 4 KiB a 4-token block.
    # 12 blocks (1 padding) hold 44 tokens; 4 sequences of up to 39 + 12 tokens need far more.
    eng = reference_engine(tiny_int4, model, kv_memory_bytes=12 * 4096, block_size=4)
    assert eng.num_blocks == 12
    ps = [p[:10] for p in prompts(4, seed=3)]
    reqs = [Request(p, SamplingParams(max_tokens=12), request_id=f"r{i}", ignore_eos=True)
            for i, p in enumerate(ps)]
    toks, fins = engine_events(eng, reqs)
    assert eng.stats().preemptions > 0
    for i, p in enumerate(ps):
        assert toks[f"r{i}"] == hf_greedy(hf, p, 12)
    assert sum(f.num_preemptions for f in fins.values()) == eng.stats().preemptions
    assert eng.kv_blocks_used() == 0


def test_abort_frees_blocks_and_stats(tiny_int4, model):
    eng = reference_engine(tiny_int4, model)
    p = prompts(1, seed=1)[0]
    eng.submit(Request(p, SamplingParams(max_tokens=50), request_id="x", ignore_eos=True))
    eng.submit(Request(p, SamplingParams(max_tokens=50), request_id="queued", ignore_eos=True))
    eng.step()
    eng.step()
    st = eng.stats()
    assert isinstance(st, EngineStats) and st.kv_blocks_used > 0 and st.running + st.waiting == 2
    assert st.kv_blocks_total == eng.num_blocks - 1  # the scheduler's padding block is not usable
    fin = eng.abort("x")
    assert isinstance(fin, FinishEvent) and fin.reason is FinishReason.ABORTED
    assert eng.abort("x") is None  # not live any more
    assert eng.abort("queued").reason is FinishReason.ABORTED
    eng.check_accounting()
    assert eng.kv_blocks_used() == 0 and not eng.has_work
    assert eng.stats().kv_blocks_free == eng.stats().kv_blocks_total


def test_text_stop_strings_and_eos(tiny_int4, model):
    eng = reference_engine(tiny_int4, model)
    tok = eng.tokenizer
    p = tok.encode("def add(a, b):\n    return")
    toks, fins = engine_events(eng, [Request(p, SamplingParams(max_tokens=24), request_id="t",
                                             ignore_eos=True)])
    events = []
    eng2 = reference_engine(tiny_int4, model)
    text = tok.decode(toks["t"], skip_special_tokens=True)
    assert len(text) >= 6, text
    stop = text[3:6]
    eng2.submit(Request(p, SamplingParams(max_tokens=24, stop=(stop,)), request_id="s", ignore_eos=True))
    while eng2.has_work:
        events.extend(eng2.step())
    shown = "".join(e.text for e in events)
    fin = events[-1]
    assert isinstance(fin, FinishEvent) and fin.reason is FinishReason.STOP
    assert shown == text[: text.find(stop)]
    # EOS: the first generated token made the only EOS id ends the request with no text
    first = toks["t"][0]
    _, f = engine_events(eng2, [Request(p, SamplingParams(max_tokens=5), request_id="e",
                                        eos_ids=frozenset({first}))])
    assert f["e"].reason is FinishReason.EOS and f["e"].num_generated == 1


def test_seeded_sampling_repeats(tiny_int4, model):
    eng = reference_engine(tiny_int4, model)
    p = prompts(1, seed=4)[0]
    params = SamplingParams(temperature=1.1, top_k=40, seed=7, max_tokens=10)
    runs = [engine_events(eng, [Request(p, params, request_id=str(i), ignore_eos=True)])[0][str(i)]
            for i in range(2)]
    other = engine_events(eng, [Request(p, params.with_(seed=8), request_id="o", ignore_eos=True)])[0]["o"]
    assert runs[0] == runs[1] and runs[0] != other


def test_refusals(tiny_int4, model):
    eng = reference_engine(tiny_int4, model, max_model_len=32)
    long = Request(list(range(40)), SamplingParams(max_tokens=4))
    ev = eng.submit(long)
    assert ev.reason is FinishReason.REFUSED and "context limit is 32" in ev.detail
    bad = eng.submit(Request([10**6], SamplingParams(max_tokens=4)))
    assert bad.reason is FinishReason.REFUSED and "token ids outside" in bad.detail
    assert not eng.has_work
    # max_tokens past the context runs until the context is full
    _, f = engine_events(eng, [Request(list(range(20)), SamplingParams(max_tokens=100), request_id="c",
                                       ignore_eos=True)])
    assert f["c"].reason is FinishReason.CONTEXT and f["c"].num_generated == 12


def test_config_is_validated():
    with pytest.raises(ValueError, match="max_batch must be a positive int"):
        ReferenceEngineConfig(max_batch=0)
