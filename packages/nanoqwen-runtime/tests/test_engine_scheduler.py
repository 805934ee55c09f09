"""CPU tests of the engine's scheduler, block manager and step metadata.

A fake model stands in for the GPU: it writes a tag (seq id, position, token) into a fake KV pool at
the page/slot the step inputs name, and "attends" by checking that every cached position of every
sequence still holds its own tag. Any accounting slip (a page owned twice, a page freed while in use,
a stale page table, a padded row writing into a live page) shows up as a wrong tag.
"""

from __future__ import annotations

import random
import zlib

import numpy as np
import pytest
from nanoqwen_runtime.engine.metadata import build_step_inputs
from nanoqwen_runtime.engine.scheduler import (
    BlockManager,
    FinishReason,
    Request,
    Scheduler,
    SeqStatus,
)
from nanoqwen_runtime.kv_cache import BlockAllocator
from nanoqwen_runtime.sampling import SamplingParams

EOS = 7


def make(num_blocks=64, block_size=4, max_batch=8, max_model_len=256, chunk=32, watermark=0.0):
    bm = BlockManager(BlockAllocator(num_blocks), num_blocks, block_size)
    return Scheduler(bm, max_batch=max_batch, max_model_len=max_model_len, prefill_chunk=chunk,
                     admit_watermark=watermark)


class FakeModel:
    """Tags in a fake KV pool; checks every sequence's cached prefix at every step."""

    def __init__(self, sched: Scheduler, eos_prob: float, rng: random.Random, buckets=(1, 2, 4, 8, 16)):
        bm = sched.blocks
        self.sched, self.rng, self.eos_prob, self.buckets = sched, rng, eos_prob, buckets
        self.bs = bm.block_size
        self.max_pages = -(-sched.max_model_len // self.bs)
        self.pool = np.full((bm.num_blocks, self.bs), -1, np.int64)
        self.steps = 0

    @staticmethod
    def tag(seq_id, pos, tok):
        return (seq_id * 1_000_003 + pos) * 1009 + tok

    def inputs(self, plan):
        pad_to = None
        if plan.kind == "decode":
            pad_to = next(b for b in self.buckets if b >= len(plan.seqs))
        return build_step_inputs(plan, block_size=self.bs, max_pages=self.max_pages,
                                 padding_block=self.sched.blocks.padding_block, pad_to=pad_to)

    def compute(self, plan, inp, ids) -> None:
        """Write each new token's tag (token ids `ids`, the step's input ids as fed) at the page / slot
        the inputs name, then "attend": every real row reads its whole context, each position's tag
        naming the sequence's committed token there, or for the row's own position the id it was fed
        (the same token, once the host has committed it)."""
        qs = inp.query_start
        for b in range(inp.num_rows):
            for t in range(qs[b], qs[b + 1]):
                p = int(inp.positions[t])
                page = inp.page_table[b, p // self.bs]
                if b >= inp.num_real:
                    assert page == self.sched.blocks.padding_block
                    continue
                self.pool[page, p % self.bs] = self.tag(plan.seqs[b].seq_id, p, int(ids[t]))
        for b, seq in enumerate(plan.seqs):
            ctx = int(inp.context_lens[b])
            assert inp.positions[qs[b + 1] - 1] == ctx - 1
            for p in range(ctx):
                tok = int(ids[qs[b + 1] - 1]) if p == ctx - 1 else seq.tokens[p]
                if p < len(seq.tokens):
                    assert seq.tokens[p] == tok, (seq.seq_id, p)
                got = self.pool[inp.page_table[b, p // self.bs], p % self.bs]
                assert got == self.tag(seq.seq_id, p, tok), (seq.seq_id, p)
        self.steps += 1

    def sample(self, n: int) -> list[int]:
        return [EOS if self.rng.random() < self.eos_prob else 100 + self.rng.randrange(900) for _ in range(n)]

    def step(self, plan):
        inp = self.inputs(plan)
        self.compute(plan, inp, inp.input_ids)
        return {seq.seq_id: self.sample(1)[0] for seq, smp in zip(plan.seqs, plan.sample, strict=True) if smp}


def finish_checks(sched: Scheduler, received):
    for seq in received:
        sp = seq.request.params
        if seq.tokens[-1] == EOS:
            sched.finish(seq, FinishReason.EOS)
        elif seq.num_generated >= sp.max_tokens:
            sched.finish(seq, FinishReason.LENGTH)
        elif len(seq.tokens) >= sched.max_model_len:
            sched.finish(seq, FinishReason.CONTEXT)


def test_refusals_are_clear():
    s = make(num_blocks=9, block_size=4, max_model_len=64)
    assert "empty prompt" in s.refusal_reason(Request([]))
    assert "context limit" in s.refusal_reason(Request([1] * 64))
    # prompt + max_tokens over the limit runs to the context limit, so it needs the limit's pages
    assert "whole pool has 8" in s.refusal_reason(Request([1] * 10, SamplingParams(max_tokens=60)))
    assert make(num_blocks=17, block_size=4, max_model_len=64).refusal_reason(
        Request([1] * 10, SamplingParams(max_tokens=60))) is None
    assert "whole pool has 8" in s.refusal_reason(Request([1] * 30, SamplingParams(max_tokens=3)))
    assert "SamplingParams" in s.refusal_reason(Request([1], params={"top_p": 0.0}))
    assert s.refusal_reason(Request([1] * 20, SamplingParams(max_tokens=12))) is None


def test_prefill_then_decode_exact_blocks():
    s = make(num_blocks=32, block_size=4, chunk=8)
    seq = s.add(Request(list(range(1, 11)), SamplingParams(max_tokens=5), ignore_eos=True))
    model = FakeModel(s, 0.0, random.Random(0))
    plan = s.schedule()
    assert plan.kind == "prefill" and plan.query_lens == [8] and plan.sample == [False]
    assert len(seq.blocks) == 2
    s.commit(plan, model.step(plan))
    plan = s.schedule()
    assert plan.kind == "prefill" and plan.query_lens == [2] and plan.sample == [True]
    s.commit(plan, model.step(plan))
    assert seq.num_generated == 1 and seq.in_decode and len(seq.blocks) == 3
    plan = s.schedule()
    assert plan.kind == "decode" and plan.start_pos == [10]
    s.commit(plan, model.step(plan))
    assert len(seq.blocks) == 3  # 11 tokens cached + 1 new = 12 -> 3 pages
    s.finish(seq, FinishReason.LENGTH)
    assert s.blocks.num_used == 0 and s.blocks.num_free == 31
    s.blocks.check(s.live())


def test_preemption_resumes_and_keeps_tokens():
    # 6 usable blocks of 4 tokens; two sequences of 8-token prompts growing to 20 tokens each cannot
    # both be resident: the younger is preempted, recomputed later, and both finish with all tokens.
    s = make(num_blocks=7, block_size=4, chunk=64, max_model_len=32)
    rng = random.Random(1)
    model = FakeModel(s, 0.0, rng)
    seqs = [s.add(Request(list(range(1 + 10 * i, 9 + 10 * i)), SamplingParams(max_tokens=12)))
            for i in range(2)]
    steps = 0
    while s.has_work:
        plan = s.schedule()
        assert plan is not None
        finish_checks(s, s.commit(plan, model.step(plan)))
        s.blocks.check(s.live())
        steps += 1
        assert steps < 500
    assert s.num_preemptions >= 1
    assert all(q.status is SeqStatus.FINISHED and q.num_generated == 12 for q in seqs)
    assert s.blocks.num_used == 0


def test_padding_rows_only_touch_padding_block():
    s = make(num_blocks=40, block_size=4)
    model = FakeModel(s, 0.0, random.Random(2), buckets=(4, 8))
    for i in range(3):
        s.add(Request([5 + i] * 5, SamplingParams(max_tokens=4)))
    while s.has_work:
        plan = s.schedule()
        finish_checks(s, s.commit(plan, model.step(plan)))
    assert (model.pool[s.blocks.padding_block] == -1).all()  # padded rows skipped writing in the fake
    assert s.blocks.num_used == 0


@pytest.mark.parametrize("seed", [0, 1])
def test_randomized_1000_requests(seed):
    """1000 requests, random prompt/output lengths and sampling, arriving between steps; some ask for
    more than fits. Each completes or is refused with a reason; blocks return to zero; no sequence
    ever reads another's K/V."""
    rng = random.Random(seed)
    s = make(num_blocks=97, block_size=8, max_batch=16, max_model_len=512, chunk=96, watermark=0.02)
    model = FakeModel(s, eos_prob=0.02, rng=rng)
    pending = []
    for i in range(1000):
        n = rng.choice([1, 2, rng.randrange(3, 40), rng.randrange(40, 300), rng.randrange(300, 700)])
        sp = SamplingParams(max_tokens=rng.choice([1, rng.randrange(2, 60), rng.randrange(60, 400)]),
                            temperature=rng.choice([0.0, 0.7, 1.3]), top_p=rng.choice([1.0, 0.9]),
                            top_k=rng.choice([0, 40]), seed=rng.randrange(2**31))
        pending.append(Request([rng.randrange(100, 1000) for _ in range(n)], sp, request_id=str(i)))
    refused, done, seqs = [], [], []
    steps = 0
    while pending or s.has_work:
        for _ in range(rng.choice([0, 0, 1, 3, 8])):  # requests join between steps
            if pending:
                r = pending.pop(0)
                why = s.refusal_reason(r)
                if why:
                    refused.append((r, why))
                else:
                    seqs.append(s.add(r))
        plan = s.schedule()
        if plan is None:
            assert not s.has_work
            continue
        assert len(plan.seqs) <= 16
        received = s.commit(plan, model.step(plan))
        finish_checks(s, received)
        for q in received:
            if q.status is SeqStatus.FINISHED:
                done.append(q)
        s.blocks.check(s.live())
        steps += 1
        assert steps < 200_000
    assert len(done) + len(refused) == 1000
    assert refused and all(isinstance(why, str) and why for _, why in refused)
    assert all(q.status is SeqStatus.FINISHED for q in seqs)
    for q in done:
        assert q.finish_reason in (FinishReason.EOS, FinishReason.LENGTH, FinishReason.CONTEXT)
        if q.finish_reason is FinishReason.LENGTH:
            assert q.num_generated == q.request.params.max_tokens
        if q.finish_reason is FinishReason.CONTEXT:
            assert len(q.tokens) == 512 and q.num_generated < q.request.params.max_tokens
    assert s.blocks.num_used == 0 and s.blocks.num_free == s.blocks.usable_blocks
    assert s.num_preemptions > 0  # the pool is small enough that preemption is exercised


# ---- the overlapped decode: steps planned ahead (Scheduler.plan_ahead) ----------------------------------


class FakeDevice:
    """The engine's device for steps planned ahead: each step's inputs are built when it is queued (as
    the engine uploads them), and steps run in queue order, each either at once or only when it is
    read back (a slow device: the host has committed earlier steps, finished sequences and planned
    the next step meanwhile). A step planned ahead copies its rows' ids from the previous step's
    sampled tokens, as `ModelRunner.launch` does, and runs it with `FakeModel.compute` (the tag write and
    check, the row's own position checked against the id it was fed)."""

    def __init__(self, model: FakeModel, rng: random.Random):
        self.model, self.rng = model, rng
        self.queue: list[tuple[object, object, object]] = []  # (handle, plan, inputs)
        self.results: dict[object, list[int]] = {}
        self.last_rows: list[int] = []

    def launch(self, plan):
        inp = self.model.inputs(plan)
        handle = object()
        self.queue.append((handle, plan, inp))
        if self.rng.random() < 0.5:
            self._run_until(handle)
        return handle

    def result(self, handle) -> list[int]:
        self._run_until(handle)
        return self.results.pop(handle)

    def _run_until(self, handle) -> None:
        while handle not in self.results:
            h, plan, inp = self.queue.pop(0)
            self.results[h] = self._run(plan, inp)

    def _run(self, plan, inp) -> list[int]:
        ids = inp.input_ids.copy()
        if inp.feed_rows is not None:
            ids[:len(inp.feed_rows)] = [self.last_rows[r] for r in inp.feed_rows]
        self.model.compute(plan, inp, ids)
        self.last_rows = self.model.sample(len(plan.seqs))
        return self.last_rows


@pytest.mark.parametrize("seed,burst", [(0, False), (1, False), (2, True)])
def test_randomized_requests_with_steps_planned_ahead(seed, burst):
    """The engine's overlapped step loop (Engine.step) over 300 random requests with EOS, arrivals
    between steps, aborts and a pool small enough to preempt: each step after a plain decode step is
    planned ahead where `plan_ahead` allows, queued before the previous one is read back, and committed
    one step late. No sequence ever reads another's K/V (the tags, also at the rows of sequences that
    ended with a step in flight, whose pages are taken by others meanwhile); the accounting holds
    after every step; every request completes with exactly its tokens. `burst`: all requests arrive at
    once, so the batch stays full with requests waiting (steps still go ahead: `_admission_blocked`)."""
    rng = random.Random(seed)
    s = make(num_blocks=61, block_size=8, max_batch=16, max_model_len=256, chunk=64, watermark=0.02)
    dev = FakeDevice(FakeModel(s, eos_prob=0.03, rng=rng), rng)
    def request(i):
        n = rng.choice([1, rng.randrange(2, 40), rng.randrange(40, 200)])
        sp = SamplingParams(max_tokens=rng.choice([1, 2, rng.randrange(3, 40), rng.randrange(40, 120)]))
        return Request([rng.randrange(100, 1000) for _ in range(n)], sp, request_id=str(i))

    pending = [request(i) for i in range(300)]
    seqs, in_flight, ahead_steps, steps, decode_steps = [], None, 0, 0, 0
    while pending or s.has_work or in_flight:
        for _ in range(len(pending) if burst else rng.choice([0, 0, 0, 1, 4])):
            if pending:
                r = pending.pop(0)
                if s.refusal_reason(r) is None:
                    seqs.append(s.add(r))
        if s.running and rng.random() < 0.01:  # an abort between steps, maybe with a step in flight
            s.finish(rng.choice(s.running), FinishReason.ABORTED)
        cur, in_flight = in_flight, None
        if cur is None:
            plan = s.schedule()
            if plan is None:
                continue
            cur = (plan, dev.launch(plan))
        ahead = s.plan_ahead(cur[0])
        if ahead is not None:
            assert ahead.ahead and ahead.kind == "decode" and not ahead.has_drafts
            in_flight = (ahead, dev.launch(ahead))
            ahead_steps += 1
        plan, rows = cur[0], dev.result(cur[1])
        decode_steps += plan.kind == "decode"
        sampled = {q.seq_id: rows[i] for i, q in enumerate(plan.seqs)
                   if plan.sample[i] and q.status is SeqStatus.RUNNING}
        finish_checks(s, s.commit(plan, sampled))
        s.blocks.check(s.live())
        steps += 1
        assert steps < 100_000
    print(f"{ahead_steps} of {decode_steps} decode steps planned ahead ({steps} steps)")
    # arriving requests that can be admitted keep the steps synchronous (prefill and decode alternate),
    # and so do steps that would evict a cached block (the pool is small and the prefix cache fills it)
    assert ahead_steps > (0.15 * decode_steps if burst else 30)
    assert all(q.status is SeqStatus.FINISHED for q in seqs)
    for q in seqs:
        if q.finish_reason is FinishReason.LENGTH:
            assert q.num_generated == q.request.params.max_tokens
    assert s.blocks.num_used == 0 and s.num_preemptions > 0


def test_plan_ahead_refuses_what_schedule_would_plan_otherwise():
    """plan_ahead is None after a prefill step, while a request waits, after a verify step, when the
    pages for one more token are not free; it leaves out a sequence at its max_tokens."""
    s = make(num_blocks=9, block_size=4, chunk=64)
    model = FakeModel(s, 0.0, random.Random(0))
    a = s.add(Request([1, 2, 3], SamplingParams(max_tokens=10)))
    b = s.add(Request([4, 5, 6, 7], SamplingParams(max_tokens=2)))
    plan = s.schedule()
    assert plan.kind == "prefill" and s.plan_ahead(plan) is None
    s.commit(plan, model.step(plan))
    plan = s.schedule()
    assert plan.kind == "decode"
    ahead = s.plan_ahead(plan)
    # b's token in flight is its 2nd and last
    assert ahead.seqs == [a] and ahead.start_pos == [len(a.tokens)] and ahead.feed_rows == [0]
    assert len(a.blocks) == 2  # 3 prompt + 2 generated tokens: a second page
    c = s.add(Request([8], SamplingParams(max_tokens=3)))
    assert s.plan_ahead(plan) is None  # c waits: schedule() would admit it
    s.waiting.remove(c)
    used = s.blocks.num_free
    s.blocks.grow(b, 4 * (len(b.blocks) + used))  # b takes every free page
    assert s.plan_ahead(ahead) is None  # a would need a page


def test_plan_ahead_with_drafters_while_none_is_expected():
    """A sequence with a prompt-lookup drafter goes ahead while its drafter backs off (propose() returns []
    whatever the token, and changes nothing) or while its context as last committed has no n-gram match
    (`NgramDrafter.idle_at`: none expected). A match in the context, or a pending backoff (it starts at
    the next propose() call), keeps the step synchronous, so that `schedule()` drafts."""
    from nanoqwen_runtime.speculative import SpeculationConfig

    bm = BlockManager(BlockAllocator(32), 32, 4)
    s = Scheduler(bm, max_batch=8, max_model_len=128, prefill_chunk=64,
                  speculation=SpeculationConfig(k=2, window=1, min_acceptance=1.0, backoff_steps=3))
    seq = s.add(Request([1, 2, 3, 4], SamplingParams(max_tokens=40)))
    plan = s.schedule()
    s.commit(plan, {seq.seq_id: 7})  # context 1 2 3 4 7: 7 has no earlier occurrence
    plan = s.schedule()
    assert not plan.has_drafts and seq.drafter.idle_at(seq.num_generated + 1)
    ahead = s.plan_ahead(plan)
    assert ahead is not None and not ahead.has_drafts  # none expected: it goes ahead
    s.commit(plan, {seq.seq_id: 2})  # 1 2 3 4 7 2: the suffix "2" occurred, followed by 3
    assert not seq.drafter.idle_at(seq.num_generated + 1)
    assert s.plan_ahead(ahead) is None  # a draft is expected after it: synchronous
    s.commit(ahead, {seq.seq_id: 9})  # 1 2 3 4 7 2 9: no match again
    plan = s.schedule()
    assert not plan.has_drafts and s.plan_ahead(plan) is not None
    s.commit(plan, {seq.seq_id: 3})  # ... 9 3: "3" occurred, followed by 4
    plan = s.schedule()
    assert plan.drafts == [[4, 7]]  # what the synchronous step drafts (k = 2)
    assert s.plan_ahead(plan) is None  # a verify step: its tokens decide the next step
    s.commit(plan, {seq.seq_id: [5, 5, 5]})  # no draft accepted: the backoff is pending
    g = seq.num_generated
    assert not seq.drafter.idle_at(g + 1)  # pending, whatever the context holds
    plan = s.schedule()  # its propose() starts the backoff: no drafts for 3 generated tokens
    assert not plan.has_drafts
    assert seq.drafter.silent_at(g + 1) and seq.drafter.silent_at(g + 2) and not seq.drafter.silent_at(g + 3)
    ahead = s.plan_ahead(plan)
    assert ahead is not None
    s.commit(plan, {seq.seq_id: 4})  # ... 5 4: "4" occurred (followed by 7), but the drafter backs off
    after = s.plan_ahead(ahead)  # generated length g + 2: still backing off
    assert after is not None
    s.commit(ahead, {seq.seq_id: 7})  # ... 4 7: "4 7" occurred, followed by 2
    assert s.plan_ahead(after) is None  # at g + 3 the drafter may draft again, and a match is expected


def _decode_token(seq, pos: int) -> int:
    """A token that depends only on the request and its position (never EOS): both step loops of
    `_plans` produce the same tokens whatever their order of steps."""
    return 100 + zlib.crc32(f"{seq.request.request_id}/{pos}".encode()) % 900


def _plans(sched: Scheduler, waves, overlap: bool):
    """Run waves of requests (a wave is submitted at once, when the one before it has finished) through
    the engine's step loop, synchronous or with steps planned ahead (Engine.step's order: plan ahead
    before committing). Returns the steps as (kind, ((request_id, start, query_len), ...)), in the
    order they were queued."""
    plans = []
    for wave in waves:
        for r in wave:
            if sched.refusal_reason(r) is None:  # (the same in both loops)
                sched.add(r)
        in_flight = None
        while sched.has_work or in_flight:
            cur, in_flight = in_flight, None
            if cur is None:
                cur = sched.schedule()
                if cur is None:
                    break
                plans.append(cur)
            ahead = sched.plan_ahead(cur) if overlap else None
            if ahead is not None:
                plans.append(ahead)
                in_flight = ahead
            sampled = {s.seq_id: _decode_token(s, st + q) for s, st, q, smp
                       in zip(cur.seqs, cur.start_pos, cur.query_lens, cur.sample, strict=True)
                       if smp and s.status is SeqStatus.RUNNING}
            finish_checks(sched, sched.commit(cur, sampled))
            sched.blocks.check(sched.live())
    return [(p.kind, tuple((s.request.request_id, st, q) for s, st, q in
                           zip(p.seqs, p.start_pos, p.query_lens, strict=True))) for p in plans]


@pytest.mark.parametrize("seed", range(60))
def test_steps_planned_ahead_are_the_synchronous_steps(seed):
    """Differential: the same requests through the synchronous loop and the loop that plans steps ahead,
    with prefix caching on (prompts share prefixes; a second wave of requests extends the first wave's
    prompts, so it hits or misses cached blocks), a pool small enough to evict and to make requests
    wait, and no token ending a sequence (the one case where the steps may differ: a row in flight for
    a sequence that ended). The steps, their order, the prefix-cache hits, evictions and preemptions
    are equal. (Seed 0 is the case a review found: a step planned ahead evicted a cached block that
    the synchronous loop kept, because the pages of a sequence leaving were not yet released.)"""
    rng = random.Random(seed)
    if seed == 0:
        x = list(range(500, 508))
        waves = [[Request(x, SamplingParams(max_tokens=1), "P"),
                  Request([1, 2, 3], SamplingParams(max_tokens=7), "A"),
                  Request([4], SamplingParams(max_tokens=6), "B")],
                 [Request(x + [9], SamplingParams(max_tokens=1), "Q")]]
        kw = dict(num_blocks=6, block_size=4, max_batch=3, max_model_len=128, chunk=32)
    else:
        base = [rng.randrange(100, 1000) for _ in range(rng.randrange(8, 24))]

        def request(i):
            prompt = base[:rng.randrange(1, len(base) + 1)] + [rng.randrange(100, 1000)
                                                                for _ in range(rng.randrange(0, 6))]
            return Request(prompt, SamplingParams(max_tokens=rng.randrange(1, 14)), request_id=str(i))

        first = [request(i) for i in range(rng.randrange(3, 8))]
        waves = [first, [Request(r.prompt_tokens + [rng.randrange(100, 1000)], SamplingParams(max_tokens=2),
                                 request_id=f"{r.request_id}+") for r in first[:3]]]
        kw = dict(num_blocks=rng.randrange(7, 24), block_size=4, max_batch=rng.randrange(1, 5),
                  max_model_len=64, chunk=rng.choice([8, 16, 64]))
    runs = []
    for overlap in (False, True):
        s = make(**kw)
        fresh = [[Request(list(r.prompt_tokens), r.params, r.request_id, ignore_eos=True) for r in w]
                 for w in waves]
        runs.append((_plans(s, fresh, overlap), s.blocks.num_evictions, s.prefix_hit_tokens,
                     s.num_preemptions))
    (sync_plans, *sync_counts), (ahead_plans, *ahead_counts) = runs
    assert ahead_plans == sync_plans
    assert ahead_counts == sync_counts
