"""CPU tests of prompt-lookup speculative decoding in the engines (verify steps, rollback, stop rules).

1. The scheduler on the content-tagged fake model of test_prefix_cache.py (its K/V tags name the token
   prefix each slot must hold, its next token is a deterministic function of the context): tokens with
   speculation equal tokens without it exactly, drafts are accepted and rejected, rolled-back rows
   never leak into a later context, with prefix caching and preemption.
2. The CUDA engine's logic on the torch op backend (tiny synthetic container): greedy tokens equal to
   non-speculative greedy until a near-tie (bound of test_engine_cpu.py: NEAR_TIE = 2 x LOGIT_ATOL,
   since a verify row computes the same decode-row arithmetic as a plain step at that position, both
   within LOGIT_ATOL of the fp32 truth); EOS, stop strings, max_tokens and the context limit inside
   accepted drafts; temperature > 0 is not speculated.
3. The reference engine on the real Qwen2.5-Coder-0.5B (RTN INT4 container) on a code-edit prompt:
   tokens identical to non-speculative greedy, drafts accepted (stats).
"""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import numpy as np
import pytest
from engine_testkit import assert_same_until_near_tie, cpu_config, run_engine
from nanoqwen_runtime.engine import Engine, Request, TokenEvent
from nanoqwen_runtime.engine.scheduler import FinishReason
from nanoqwen_runtime.sampling import SamplingParams
from nanoqwen_runtime.speculative import SpeculationConfig

# the fake model and tiny container of test_prefix_cache.py (pytest imports test files
# with --import-mode=importlib, so a sibling is loaded by path)
_spec = importlib.util.spec_from_file_location("_prefix_cache_helpers",
                                               Path(__file__).with_name("test_prefix_cache.py"))
_pc = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_pc)
make, run_all, shared_prefix_requests = _pc.make, _pc.run_all, _pc.shared_prefix_requests
tiny_path = _pc.tiny_path  # the module-scoped fixture

SPEC = SpeculationConfig(k=4)


# ---- 1. scheduler + fake model ----------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1])
def test_fake_model_speculation_exact_with_cache_and_preemption(seed):
    rng = random.Random(seed)
    reqs = shared_prefix_requests(rng, 120, max_tokens=(1, 60))
    plain, _ = run_all(make(num_blocks=41, caching=False), reqs, arrive_every=3)
    sched = make(num_blocks=41, speculation=SPEC)
    spec, model = run_all(sched, reqs, arrive_every=3)
    assert spec == plain
    assert sched.spec_steps > 0 and 0 < sched.spec_accepted_tokens < sched.spec_drafted_tokens
    assert sched.num_preemptions > 0 and sched.prefix_hit_tokens > 0
    assert model.tokens_computed["decode"] > 0


def test_fake_model_eos_max_tokens_and_context_inside_drafts():
    """The fake copies the token 8 back: a prompt of two periods makes every draft right. EOS inside an
    accepted draft ends there; max_tokens and the context limit are never passed."""
    period = [101, 102, 103, 104, 105, 106, 107, 108]
    for eos_at, mt, mml in ((5, 40, 256), (None, 13, 256), (None, 100, 37)):
        p = list(period)
        if eos_at is not None:
            p[eos_at] = 7  # EOS of the fake (test_prefix_cache.EOS)
        sched = make(speculation=SPEC, max_model_len=mml)
        out, _ = run_all(sched, [Request(p * 2, SamplingParams(max_tokens=mt), "x")],
                         model=_pc.ContentModel(sched, noisy=False))
        plain_sched = make(max_model_len=mml)
        plain, _ = run_all(plain_sched, [Request(p * 2, SamplingParams(max_tokens=mt), "x")],
                           model=_pc.ContentModel(plain_sched, noisy=False))
        assert out == plain
        assert sched.spec_accepted_tokens > 0
        if eos_at is not None:
            assert out["x"] == p[:eos_at + 1]
        elif mml == 256:
            assert len(out["x"]) == mt
        else:
            assert len(out["x"]) == mml - 16


# ---- 2. the CUDA engine on the torch op backend ------------------------------------------------------
def _loop_prompt(n_rep=4):
    rng = np.random.default_rng(7)
    unit = [int(x) for x in rng.integers(10, 500, 12)]
    return unit * n_rep


def _steps_of(engine, requests):
    """Run; per request the tokens and, per engine step, how many tokens it emitted."""
    toks: dict[str, list[int]] = {}
    per_step: dict[str, list[int]] = {}
    fins = {}
    for r in requests:
        assert engine.submit(r) is None
    while engine.has_work:
        counts: dict[str, int] = {}
        for ev in engine.step():
            if isinstance(ev, TokenEvent):
                toks.setdefault(ev.request, []).append(ev.token_id)
                counts[ev.request] = counts.get(ev.request, 0) + 1
            else:
                fins[ev.request_id] = ev
        for rid, c in counts.items():
            per_step.setdefault(rid, []).append(c)
        engine.check_accounting()
    return toks, per_step, fins


def test_engine_speculation_matches_greedy_until_near_tie(tiny_path):
    rand = [int(x) for x in np.random.default_rng(8).integers(10, 500, 30)]
    prompts = [_loop_prompt(), _loop_prompt(3)[5:], rand]

    def reqs(spec):
        return [Request(p, SamplingParams(max_tokens=24), str(i), ignore_eos=True, speculation=spec)
                for i, p in enumerate(prompts)]

    gaps: dict[str, list[float]] = {}
    plain, _ = run_engine(Engine.from_file(tiny_path, cpu_config()), reqs(False), gaps)
    for batch_one in (True, False):
        engine = Engine.from_file(tiny_path, cpu_config())
        if batch_one:
            got = {}
            for r in reqs(SPEC):
                t, _, _ = _steps_of(engine, [r])
                got.update(t)
        else:
            got, _, _ = _steps_of(engine, reqs(SPEC))
        assert_same_until_near_tie(got, plain, gaps)
        st = engine.stats()
        assert st.spec_steps > 0 and st.spec_accepted_tokens > 0, st
        assert st.kv_blocks_used == 0


def _multi_token_index(per_step):
    """Index of a token emitted by a verify step that emitted more after it (or None)."""
    i = 0
    for c in per_step:
        if c > 1:
            return i
        i += c
    return None


def test_engine_stop_rules_inside_accepted_drafts(tiny_int4):
    """EOS id, stop string, max_tokens and context limit falling inside an accepted draft: the stream
    ends at that token, as without speculation (same tokens, same text, same reason)."""
    engine = Engine.from_file(tiny_int4, cpu_config(max_model_len=256))
    tok = engine.tokenizer
    prompt = tok.encode("abcabcabcabcabcabcabcabcabcabcabc")
    base = Request(prompt, SamplingParams(max_tokens=30), "x", ignore_eos=True, speculation=SPEC)
    toks, per_step, _ = _steps_of(engine, [base])
    m = _multi_token_index(per_step["x"])
    assert m is not None, per_step  # some verify step accepted a draft
    target = toks["x"][m]
    m = toks["x"].index(target)  # first occurrence: where an EOS/stop on it must end the stream
    cases = {
        "eos": dict(eos_ids=frozenset({target}), ignore_eos=False),
        "stop": dict(params=SamplingParams(max_tokens=30, stop=(tok.decode(toks["x"][m:m + 1]),))),
        "length": dict(params=SamplingParams(max_tokens=m + 1)),
    }
    for name, kw in cases.items():
        fields = dict(prompt_tokens=prompt, params=SamplingParams(max_tokens=30), request_id=name,
                      ignore_eos=True)
        fields.update(kw)
        results = []
        for spec in (SPEC, False):
            e = Engine.from_file(tiny_int4, cpu_config(max_model_len=256))
            evs = list(e.generate([Request(**fields, speculation=spec)]))
            fin = evs[-1]
            text = "".join(ev.text for ev in evs[:-1]) + fin.text
            results.append(([ev.token_id for ev in evs[:-1]], text, fin.reason, fin.tokens))
            assert e.stats().kv_blocks_used == 0
        assert results[0] == results[1], name
        assert results[0][2] == {"eos": FinishReason.EOS, "stop": FinishReason.STOP,
                                 "length": FinishReason.LENGTH}[name]
    # the context limit: the prompt plus m+1 tokens fill it exactly
    outs = []
    for spec in (SPEC, False):
        e = Engine.from_file(tiny_int4, cpu_config(max_model_len=len(prompt) + m + 1))
        evs = list(e.generate([Request(prompt, SamplingParams(max_tokens=30), "c", ignore_eos=True,
                                       speculation=spec)]))
        outs.append((evs[-1].reason, evs[-1].tokens))
    assert outs[0] == outs[1] and outs[0][0] is FinishReason.CONTEXT and len(outs[0][1]) == m + 1


def test_engine_sampled_requests_are_not_speculated(tiny_path):
    engine = Engine.from_file(tiny_path, cpu_config(speculation=SPEC))
    p = SamplingParams(max_tokens=20, temperature=0.8, seed=3)
    a, _ = run_engine(engine, [Request(_loop_prompt(), p, "s", ignore_eos=True)])
    assert engine.stats().spec_drafted_tokens == 0
    b, _ = run_engine(Engine.from_file(tiny_path, cpu_config()),
                      [Request(_loop_prompt(), p, "s", ignore_eos=True)])
    assert a == b  # the same seeded draws as without speculation
    # the engine default applies to greedy requests that leave speculation None
    run_engine(engine, [Request(_loop_prompt(), SamplingParams(max_tokens=20), "g", ignore_eos=True)])
    assert engine.stats().spec_drafted_tokens > 0
    bad = engine.submit(Request([5, 6], SamplingParams(max_tokens=2), "bad", speculation="ngram"))
    assert bad is not None and "SpeculationConfig" in bad.detail


# ---- 3. the reference engine on the real 0.5B ---------------------------------------------------------
# A function and the start of its copy: the model copies the body, so prompt-lookup drafts are accepted.
# Short on purpose (32 tokens, 6 generated): a decode step of the fp32 0.5B costs ~2 s on a 2-core CPU,
# so the whole test is one load (~10 s), one 32-token prefill and ~6 model steps (~30 s in all).
CODE_COPY_PROMPT = '''def clamp(x, lo, hi):
    return max(lo, min(x, hi))


# The same function again:
def clamp(x, lo, hi):
'''
MAX_TOKENS = 6


@pytest.mark.model
def test_reference_engine_real_model_speculation_is_exact(qwen05b_packed):
    """Greedy on the reference engine (fp32 matmuls, the oracle) with prompt-lookup speculation gives
    exactly the tokens of plain greedy decoding: every emitted token is the argmax after a context of
    emitted tokens, whether it came from a verify row or a plain step, and the rows of a verify step
    compute the same decode-row arithmetic (tokens compared for equality, no tolerance). One engine runs
    both (the speculative run reuses the prompt's cached K/V blocks)."""
    from nanoqwen_runtime.reference_engine import ReferenceEngine, ReferenceEngineConfig

    engine = ReferenceEngine.from_file(qwen05b_packed("rtn"), ReferenceEngineConfig(kv_memory_bytes=16 << 20))
    prompt = engine.tokenizer.encode(CODE_COPY_PROMPT)
    out = {}
    for spec in (False, SPEC):
        steps = engine.num_steps["decode"]
        evs = list(engine.generate([Request(prompt, SamplingParams(max_tokens=MAX_TOKENS), str(bool(spec)),
                                            ignore_eos=True, speculation=spec)]))
        out[bool(spec)] = (evs[-1].tokens, engine.num_steps["decode"] - steps)
    st = engine.stats()
    assert out[True][0] == out[False][0] and len(out[True][0]) == MAX_TOKENS
    body = prompt.index(out[False][0][0])  # the model copies the body (what makes the drafts right)
    assert prompt[body:body + MAX_TOKENS] == out[False][0]
    # the first token comes from the prefill; the body copy makes at least 3 of the other 5 drafted
    # tokens agree (measured: 4 of 4 in one verify step), so speculation needs fewer decode steps
    assert st.spec_steps > 0 and st.spec_accepted_tokens >= 3, st
    assert out[True][1] < out[False][1]
    # the second run finds every full block of its prompt but the last token's cached (16-token blocks)
    assert st.prefix_hit_tokens >= 16 * ((len(prompt) - 1) // 16)
