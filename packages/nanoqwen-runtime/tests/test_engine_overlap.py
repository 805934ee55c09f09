"""CPU tests of the overlapped decode (`EngineConfig.overlap`, engine.py's header): the engine queues
decode step n+1 before it reads step n back, and step n+1's rows take their token ids from step n's
sampled tokens on the device.

The oracle is the same engine without overlap: both run the same steps (`Scheduler.plan_ahead` plans
only what `schedule()` would plan after the commit) with the same inputs, so every request's tokens,
finish reason and count must be EQUAL, not close: greedy and seeded sampling (the RNG offset of a row
planned ahead counts the token it feeds), EOS (a sequence ended by its token computes one dropped row
more), max_tokens and the context limit (left out of the step planned ahead), arrivals while a step is
in flight, preemption (no step planned ahead then), aborts while a step is in flight, and speculation
(a step is planned ahead while no sequence is expected to get drafts: its drafter backs off, or its
context has no match; a match the token in flight gives is drafted a step later, so the verify steps
differ, not the tokens: each row's greedy token is the same). On this backend the extra row of a
sequence that ended with a step in flight changes no other row's bits (each row's math is its own);
on the GPU it may change the graph bucket, so test_engine_gpu.py compares those cases up to a
near-tie. Each test also asserts that steps were planned ahead (`Engine.num_steps_ahead`), so none of
them passes by never taking the path.
"""

from __future__ import annotations

import numpy as np
import pytest
from engine_testkit import TINY, cpu_config
from nanoqwen_runtime.engine import Engine, FinishEvent, Request, TokenEvent
from nanoqwen_runtime.engine.metadata import DeviceStepBuffers, build_step_inputs
from nanoqwen_runtime.engine.scheduler import FinishReason
from nanoqwen_runtime.engine.synthetic import write_container
from nanoqwen_runtime.sampling import SamplingParams
from nanoqwen_runtime.speculative import SpeculationConfig


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_container(tmp_path_factory.mktemp("overlap") / "tiny.nanoqwen", TINY, seed=3)


def _prompts(n: int, seed: int, lengths=(3, 9, 17, 30, 5, 12, 1, 24)) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(x) for x in rng.integers(10, 500, lengths[i % len(lengths)])] for i in range(n)]


def _drive(engine: Engine, requests: list[Request], *, late: list[Request] = (),
           abort_after: dict | None = None, late_every: int = 1):
    """Run to completion, submitting `late` one per `late_every` steps (from the first step on) and
    aborting request r once it has `abort_after[r]` tokens; checks the block accounting after every
    step. Returns ({request_id: tokens}, {request_id: FinishEvent})."""
    tokens: dict[str, list[int]] = {}
    fins: dict[str, FinishEvent] = {}
    for r in requests:
        assert engine.submit(r) is None
    late = list(late)
    abort_after = dict(abort_after or {})
    calls = 0
    while engine.has_work or late:
        if late and calls % late_every == 0:
            assert engine.submit(late.pop(0)) is None
        calls += 1
        for ev in engine.step():
            if isinstance(ev, TokenEvent):
                assert ev.request not in fins, f"{ev.request}: a token after its finish"
                tokens.setdefault(ev.request, []).append(ev.token_id)
                if abort_after.get(ev.request) == len(tokens[ev.request]):
                    del abort_after[ev.request]
                    fin = engine.abort(ev.request)
                    assert fin is not None and fin.reason is FinishReason.ABORTED
                    fins[fin.request_id] = fin
            else:
                fins[ev.request_id] = ev
        engine.check_accounting()
    assert engine.kv_blocks_used() == 0
    return tokens, fins


def _both(path, make_requests, config=None, **drive):
    """(overlap engine, its result, synchronous engine, its result) for the same requests."""
    out = []
    for overlap in (True, False):
        eng = Engine.from_file(path, cpu_config(overlap=overlap, **(config or {})))
        late = make_requests("late") if "late" in drive else []
        res = _drive(eng, make_requests("now"), late=late, abort_after=drive.get("abort_after"),
                     late_every=drive.get("late_every", 1))
        out += [eng, res]
    return out


def _assert_same(a, b):
    (ta, fa), (tb, fb) = a, b
    assert ta == tb
    assert fa.keys() == fb.keys()
    for rid in fa:
        assert (fa[rid].reason, fa[rid].num_generated, fa[rid].tokens) == \
               (fb[rid].reason, fb[rid].num_generated, fb[rid].tokens), rid


def test_fixed_lengths_greedy_and_sampled(tiny_path):
    """Requests of different lengths (each leaves the batch at its max_tokens: never computed ahead),
    greedy and seeded sampling mixed: the same tokens; no step more than without overlap."""
    prompts = _prompts(6, seed=1)

    def reqs(tag):
        return [Request(p, SamplingParams(max_tokens=4 + 3 * i, temperature=0.9 if i % 2 else 0.0,
                                          top_k=40 if i % 2 else 0, seed=100 + i),
                        f"{tag}{i}", ignore_eos=True)
                for i, p in enumerate(prompts)]

    eo, ro, es, rs = _both(tiny_path, reqs)
    _assert_same(ro, rs)
    assert eo.num_steps_ahead > 0 and es.num_steps_ahead == 0
    assert eo.num_steps == es.num_steps  # nothing computed that the synchronous engine did not compute
    assert any(len(set(t)) > 1 for t in ro[0].values())  # not a degenerate repeat


def test_eos_ends_a_sequence_with_a_step_in_flight(tiny_path):
    """EOS ids drawn from the model's own greedy output, so that sequences end on a token while the
    step after it is already queued: the same tokens and reasons; the extra rows cost at most one
    decode step per ending sequence."""
    prompts = _prompts(4, seed=2)
    probe = Engine.from_file(tiny_path, cpu_config())
    free, _ = _drive(probe, [Request(p, SamplingParams(max_tokens=12), str(i), ignore_eos=True)
                             for i, p in enumerate(prompts)])
    # each request's EOS: its own token at index 2 + i (the first occurrence ends it there or earlier)
    eos = {str(i): free[str(i)][2 + i] for i in range(len(prompts))}

    def reqs(tag):
        return [Request(p, SamplingParams(max_tokens=12), f"{tag}{i}", eos_ids=frozenset({eos[str(i)]}))
                for i, p in enumerate(prompts)]

    eo, ro, es, rs = _both(tiny_path, reqs)
    _assert_same(ro, rs)
    reasons = [f.reason for f in ro[1].values()]
    assert reasons.count(FinishReason.EOS) == len(prompts)
    assert eo.num_steps_ahead > 0 and eo.num_rows_dropped > 0 and es.num_rows_dropped == 0
    assert es.num_steps["decode"] <= eo.num_steps["decode"] <= es.num_steps["decode"] + len(prompts)


def test_context_limit_arrivals_and_preemption(tiny_path):
    """A request that runs into the context limit, requests arriving between steps (each arrival makes
    the next step a prefill: no step ahead while one waits), and a pool small enough to preempt."""
    prompts = _prompts(6, seed=3, lengths=(40, 20, 33, 8, 50, 12))

    def reqs(tag):
        rs = [Request(p, SamplingParams(max_tokens=30), f"{tag}{i}", ignore_eos=True)
              for i, p in enumerate(prompts)]
        return rs[:3] if tag == "now" else rs[3:]

    config = dict(num_blocks=14, admit_watermark=0.0, max_model_len=64)
    eo, ro, es, rs = _both(tiny_path, reqs, config, late=True)
    _assert_same(ro, rs)
    assert sum(f.num_preemptions for f in ro[1].values()) > 0
    assert FinishReason.CONTEXT in {f.reason for f in ro[1].values()}
    assert eo.num_steps_ahead > 0
    assert eo.num_steps == es.num_steps


def test_arrivals_while_a_step_is_in_flight(tiny_path):
    """Requests submitted every 4th step() call, while decode steps go ahead (a step is in flight when
    each arrives): the arrival makes the step after the one in flight synchronous (its prefill). The
    step in flight was queued before the request arrived, so the request joins one decode step later
    than in the synchronous engine (one decode step more in all); the same tokens."""
    prompts = _prompts(5, seed=6)
    seen_in_flight = []

    def reqs(tag):
        rs = [Request(p, SamplingParams(max_tokens=14), f"{tag}{i}", ignore_eos=True)
              for i, p in enumerate(prompts)]
        return rs[:1] if tag == "now" else rs[1:]

    real_submit = Engine.submit

    def submit(self, request):
        seen_in_flight.append(self._in_flight is not None)
        return real_submit(self, request)

    Engine.submit = submit
    try:
        eo, ro, es, rs = _both(tiny_path, reqs, late=True, late_every=4)
    finally:
        Engine.submit = real_submit
    _assert_same(ro, rs)
    assert eo.num_steps_ahead > 0 and eo.num_steps["prefill"] == es.num_steps["prefill"]
    assert any(seen_in_flight), "no request arrived while a step was in flight"


def test_abort_everything_with_a_step_in_flight_leaves_no_work(tiny_path):
    """Aborting every request while a step is in flight: `has_work` is False at once (the step's rows are
    all dropped), the engine takes new requests, and their tokens are the synchronous engine's."""
    eng = Engine.from_file(tiny_path, cpu_config(overlap=True))
    for i in range(2):
        req = Request([7 + i] * 5, SamplingParams(max_tokens=20), f"a{i}", ignore_eos=True)
        assert eng.submit(req) is None
    while eng.num_steps_ahead < 2:
        eng.step()
    assert eng._in_flight is not None and eng.has_work
    for i in range(2):
        assert eng.abort(f"a{i}").reason is FinishReason.ABORTED
    assert not eng.has_work and eng._in_flight is not None
    eng.check_accounting()
    req = [Request([11, 12, 13], SamplingParams(max_tokens=6), "b", ignore_eos=True)]
    got, _ = _drive(eng, req)
    want, _ = _drive(Engine.from_file(tiny_path, cpu_config()), req)
    assert got == want and len(got["b"]) == 6


def test_abort_while_a_step_is_in_flight(tiny_path):
    """A request aborted on receiving its 5th token, when (with overlap) its next step is already queued:
    no token after the abort, the others' tokens unchanged, its pages back."""
    prompts = _prompts(3, seed=4)

    def reqs(tag):
        return [Request(p, SamplingParams(max_tokens=15), f"{tag}{i}", ignore_eos=True)
                for i, p in enumerate(prompts)]

    eo, ro, es, rs = _both(tiny_path, reqs, abort_after={"now1": 5})
    _assert_same(ro, rs)
    assert len(ro[0]["now1"]) == 5 and ro[1]["now1"].reason is FinishReason.ABORTED
    assert eo.num_steps_ahead > 0


@pytest.mark.parametrize("batch", [2, 9])
def test_speculation_keeps_its_drafts(tiny_path, batch):
    """Greedy requests with prompt-lookup speculation. Batch 2: prompts holding 200 distinct tokens, so
    most generated tokens have a match and drafts are made; an acceptance floor no draft can meet
    (1.0, a window of 1) stops a drafter after any rejection for 6 tokens; steps go ahead through those
    backoffs and where a drafter's context has no match (`NgramDrafter.idle_at`), so the verify steps
    may fall elsewhere than without overlap: the same tokens, drafts made on both sides. Batch 9: a step
    of 9 rows has no room for drafts (VERIFY_MAX_ROWS = 8), so the steps go ahead once all nine decode:
    the same tokens as without overlap."""
    if batch == 2:
        spec = SpeculationConfig(k=3, min_acceptance=1.0, window=1, backoff_steps=6)
        rng = np.random.default_rng(5)
        prompts = [[int(x) for x in rng.permutation(np.arange(10, 500))[:200]] for _ in range(batch)]
    else:
        spec = SpeculationConfig(k=3)
        prompts = [[int(x) for x in np.random.default_rng(5 + i).integers(10, 40, 24)] for i in range(batch)]

    def reqs(tag):
        return [Request(p, SamplingParams(max_tokens=40), f"{tag}{i}", ignore_eos=True, speculation=spec)
                for i, p in enumerate(prompts)]

    eo, ro, es, rs = _both(tiny_path, reqs, dict(max_batch=16))
    _assert_same(ro, rs)
    so, ss = eo.stats(), es.stats()
    assert eo.num_steps_ahead > 0
    if batch == 2:
        assert so.spec_steps > 0 and ss.spec_steps > 0  # drafts were made, and steps went ahead between them


def test_a_drafter_without_matches_lets_every_step_go_ahead(tiny_path):
    """Speculation on, but the drafter's context never has a match (prompts of distinct tokens, and a
    model that makes its own tokens): every decode step after the first goes ahead, as with speculation
    off (a step does not wait for its token for the drafter's sake: no match, no draft),
    and the tokens are those of the synchronous engine."""
    rng = np.random.default_rng(30)  # a seed whose 24 generated tokens never repeat an earlier one
    prompts = [[int(x) for x in rng.permutation(np.arange(10, 500))[:20]] for _ in range(2)]
    spec = SpeculationConfig(k=3)

    def reqs(tag):
        return [Request(p, SamplingParams(max_tokens=12), f"{tag}{i}", ignore_eos=True, speculation=spec)
                for i, p in enumerate(prompts)]

    eo, ro, es, rs = _both(tiny_path, reqs, dict(max_batch=4))
    _assert_same(ro, rs)
    assert es.stats().spec_steps == eo.stats().spec_steps == 0  # the premise: no match, no draft
    assert eo.num_steps_ahead == eo.num_steps["decode"] - 1, (eo.num_steps_ahead, eo.num_steps)


def test_record_logits_keeps_steps_synchronous(tiny_path):
    """`record_logits` reads each step's logits after its commit: the next step must not be queued
    before (it would overwrite them), so nothing goes ahead."""
    eng = Engine.from_file(tiny_path, cpu_config(overlap=True))
    eng.record_logits = True
    _drive(eng, [Request([5, 6, 7], SamplingParams(max_tokens=6), "x", ignore_eos=True)])
    assert eng.num_steps_ahead == 0 and eng.num_steps["decode"] == 5


def test_a_step_planned_ahead_feeds_on_the_device(tiny_path):
    """The inputs of a step planned ahead: no host ids (0 until the device copies them), the previous
    step's rows to copy from, and RNG offsets that count the token being fed."""
    eng = Engine.from_file(tiny_path, cpu_config(overlap=True, max_batch=4))
    for i in range(3):
        req = Request([9 + i] * (4 + i), SamplingParams(max_tokens=3 + i), str(i), ignore_eos=True)
        assert eng.submit(req) is None
    sched = eng.scheduler
    plan = sched.schedule()  # the prefill of all three
    eng._complete(plan, eng._run(plan))
    plan = sched.schedule()
    assert plan.kind == "decode" and not plan.ahead
    ahead = sched.plan_ahead(plan)
    assert ahead is not None and ahead.ahead
    # request 0 (max_tokens 3) has 1 token: the decode step makes its 2nd, the step ahead its 3rd
    assert [s.request.request_id for s in ahead.seqs] == ["0", "1", "2"] and ahead.feed_rows == [0, 1, 2]
    assert ahead.start_pos == [len(s.tokens) for s in plan.seqs]
    kw = dict(block_size=16, max_pages=eng.max_pages, padding_block=eng.blocks.padding_block)
    inp, base = build_step_inputs(ahead, **kw), build_step_inputs(plan, **kw)
    assert (inp.input_ids == 0).all() and inp.feed_rows.tolist() == [0, 1, 2] and base.feed_rows is None
    assert (inp.positions == base.positions + 1).all() and (inp.offset == base.offset + 1).all()
    with pytest.raises(AssertionError, match="previous step"):
        ahead.step_tokens(0)
    # queued in the engine's order: the decode step, the step ahead, then the first read back; the step
    # after the one ahead leaves request 0 out (the step ahead makes its last token)
    first = eng._launch(plan)
    second = eng._launch(ahead)
    eng._complete(plan, first.launched.result())
    after = sched.plan_ahead(ahead)
    assert [s.request.request_id for s in after.seqs] == ["1", "2"] and after.feed_rows == [1, 2]
    eng._complete(ahead, second.launched.result())
    assert [s.num_generated for s in ahead.seqs] == [3, 3, 3]


def test_device_step_buffers_alternate_host_mirrors():
    """Two host mirrors used in turn: the second load does not overwrite what the first uploads."""
    import torch

    bufs = DeviceStepBuffers(max_tokens=8, max_rows=4, max_pages=3, device=torch.device("cpu"))
    from nanoqwen_runtime.engine.model import padding_inputs

    a = padding_inputs(2, 3, 0, 16)
    a.input_ids[:] = [11, 12]
    b = padding_inputs(2, 3, 0, 16)
    b.input_ids[:] = [21, 22]
    b.feed_rows = np.array([1, 0], np.int32)
    va = bufs.load(a)
    assert va["feed_rows"].numel() == 0 and va["input_ids"].tolist() == [11, 12]
    vb = bufs.load(b)
    assert vb["feed_rows"].tolist() == [1, 0] and vb["input_ids"].tolist() == [21, 22]
    assert bufs.hosts[0]["input_ids"][:2].tolist() == [11, 12]
    assert bufs.hosts[1]["input_ids"][:2].tolist() == [21, 22]
