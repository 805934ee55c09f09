"""CPU tests of prefix caching (engine/blocks.py) and of the scheduler's verify steps, on a fake model.

The fake model stands in for the GPU as in test_engine_scheduler.py, but its K/V tag is a function of
the CONTENT the slot must hold: the hash of the token prefix ending at that position. Sharing a cached
block is right exactly when its content is the same prefix, so a block handed to the wrong sequence,
evicted while in use, written after it was cached, or left stale by a speculation rollback shows up as
a wrong tag when some later row "attends" over it. The fake's next token is a deterministic function
of the context (a copy of the token 8 back, with some noise), so runs with and without the cache or
speculation must produce the same tokens exactly, and the copying gives the n-gram drafter hits.

Then the engine on the torch op backend (tiny synthetic container, bounds of test_engine_cpu.py):
logits with the cache against the fp32 reference, greedy tokens with and without it, preemption with
shared blocks, eviction, and the stats that prove the cache-hit path ran.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from engine_testkit import LOGIT_ATOL, NEAR_TIE, TINY, assert_same_until_near_tie, cpu_config, run_engine
from nanoqwen_runtime.engine import Engine, EngineConfig, Request, TokenEvent
from nanoqwen_runtime.engine.agreement import reference_decode, teacher_forced
from nanoqwen_runtime.engine.blocks import block_key
from nanoqwen_runtime.engine.metadata import build_step_inputs, plan_rows
from nanoqwen_runtime.engine.scheduler import BlockManager, FinishReason, Scheduler, SeqStatus
from nanoqwen_runtime.engine.synthetic import write_container
from nanoqwen_runtime.kv_cache import BlockAllocator
from nanoqwen_runtime.reference import ReferenceModel
from nanoqwen_runtime.sampling import SamplingParams

EOS = 7


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_container(tmp_path_factory.mktemp("prefix") / "tiny.nanoqwen", TINY, seed=1)


# ---- the content-tagged fake model --------------------------------------------------------------------
def make(num_blocks=64, block_size=4, max_batch=8, max_model_len=256, chunk=32, watermark=0.0, caching=True,
         speculation=None):
    bm = BlockManager(BlockAllocator(num_blocks), num_blocks, block_size, prefix_caching=caching)
    return Scheduler(bm, max_batch=max_batch, max_model_len=max_model_len, prefill_chunk=chunk,
                     admit_watermark=watermark, speculation=speculation)


def fake_next(ctx: list[int], noisy: bool = True) -> int:
    """The fake's greedy token after `ctx`: a copy of the token 8 back (drafts hit); when `noisy`,
    every fifth context (by hash) something else."""
    h = hash(tuple(ctx))
    if len(ctx) < 8 or (noisy and h % 5 == 0):
        return 100 + h % 50
    return ctx[-8]


class ContentModel:
    def __init__(self, sched: Scheduler, buckets=(1, 2, 4, 8, 16), noisy: bool = True):
        bm = sched.blocks
        self.noisy = noisy
        self.sched, self.buckets, self.bs = sched, buckets, bm.block_size
        self.max_pages = -(-sched.max_model_len // self.bs)
        self.pool = np.zeros((bm.num_blocks, self.bs), np.int64)
        self.tokens_computed = {"prefill": 0, "decode": 0}

    def step(self, plan) -> dict[int, int | list[int]]:
        rows = plan_rows(plan)
        pad_to = next(b for b in self.buckets if b >= len(rows)) if plan.kind == "decode" else None
        inp = build_step_inputs(plan, block_size=self.bs, max_pages=self.max_pages,
                                padding_block=self.sched.blocks.padding_block, pad_to=pad_to)
        self.tokens_computed[plan.kind] += plan.num_tokens
        qs = inp.query_start
        ctx_tokens = []
        for b, (i, _, _) in enumerate(rows):  # writes first (the model writes K/V before attention)
            ctx = (plan.seqs[i].tokens[:plan.start_pos[i]] + plan.step_tokens(i))[:int(inp.context_lens[b])]
            ctx_tokens.append(ctx)
            for t in range(qs[b], qs[b + 1]):
                p = int(inp.positions[t])
                assert int(inp.input_ids[t]) == ctx[p]
                self.pool[inp.page_table[b, p // self.bs], p % self.bs] = hash(tuple(ctx[:p + 1]))
        for b, ctx in enumerate(ctx_tokens):  # "attention": every row reads its whole context
            for p in range(len(ctx)):
                got = self.pool[inp.page_table[b, p // self.bs], p % self.bs]
                assert got == hash(tuple(ctx[:p + 1])), (plan.seqs[rows[b][0]].seq_id, p)
        out: dict[int, int | list[int]] = {}
        for b, (i, _, _) in enumerate(rows):
            seq = plan.seqs[i]
            if plan.sample[i]:
                tok = fake_next(ctx_tokens[b], self.noisy)
                if plan.drafts and plan.drafts[i]:
                    out.setdefault(seq.seq_id, []).append(tok)
                else:
                    out[seq.seq_id] = tok
        return out


def emit_and_finish(sched: Scheduler, received) -> None:
    """The engine's emission rule: tokens one at a time, the first one that ends the request is the
    last kept."""
    for seq in received:
        new = seq.tokens[len(seq.tokens) - seq.num_new_tokens:]
        del seq.tokens[len(seq.tokens) - seq.num_new_tokens:]
        for tok in new:
            seq.tokens.append(tok)
            reason = None
            if tok == EOS:
                reason = FinishReason.EOS
            elif seq.num_generated >= seq.request.params.max_tokens:
                reason = FinishReason.LENGTH
            elif len(seq.tokens) >= sched.max_model_len:
                reason = FinishReason.CONTEXT
            if reason is not None:
                sched.finish(seq, reason)
                break


def run_all(sched: Scheduler, requests, arrive_every: int = 0, model: ContentModel | None = None
            ) -> tuple[dict[str, list[int]], ContentModel]:
    """Run to completion (requests joining one per `arrive_every` steps, or all at once); accounting
    checked after every step; generated tokens per request id."""
    model = model or ContentModel(sched)
    pending = list(requests)
    seqs = []
    steps = 0
    while pending or sched.has_work:
        if pending and (arrive_every == 0 or steps % arrive_every == 0):
            batch = pending if arrive_every == 0 else pending[:1]
            for r in batch:
                assert sched.refusal_reason(r) is None
                seqs.append(sched.add(r))
            pending = pending[len(batch):]
        plan = sched.schedule()
        if plan is not None:
            emit_and_finish(sched, sched.commit(plan, model.step(plan)))
        sched.blocks.check(sched.live())
        steps += 1
        assert steps < 20_000
    assert all(s.status is SeqStatus.FINISHED for s in seqs)
    assert sched.blocks.num_used == 0
    return {s.request.request_id: s.tokens[s.num_prompt:] for s in seqs}, model


def shared_prefix_requests(rng: random.Random, n: int, max_tokens=(1, 40)):
    prefixes = [[rng.randrange(100, 1000) for _ in range(rng.randrange(5, 60))] for _ in range(3)]
    reqs = []
    for i in range(n):
        pre = rng.choice(prefixes)
        tail = [rng.randrange(100, 1000) for _ in range(rng.choice([0, 1, rng.randrange(2, 20)]))]
        reqs.append(Request(pre + tail, SamplingParams(max_tokens=rng.randrange(*max_tokens)), str(i)))
    return reqs


# ---- block manager ----------------------------------------------------------------------------------
def test_refcounts_lru_eviction_and_collision_safety(monkeypatch):
    s = make(num_blocks=9, block_size=4, chunk=64)  # 8 usable blocks
    model = ContentModel(s)
    a = s.add(Request(list(range(100, 110)), SamplingParams(max_tokens=1)))  # 10 tokens: 2 full blocks
    plan = s.schedule()
    emit_and_finish(s, s.commit(plan, model.step(plan)))
    assert a.status is SeqStatus.FINISHED
    bm = s.blocks
    # a's 2 full blocks are cached; its third (10 tokens + 1 generated, partial) went back to the pool
    assert bm.num_used == 0 and bm.num_cached == 2 and bm.num_free == 8
    # two sequences share the cached prefix: reference counts 2, one copy of the blocks
    b = s.add(Request(list(range(100, 110)) + [5], SamplingParams(max_tokens=3)))
    c = s.add(Request(list(range(100, 109)), SamplingParams(max_tokens=3)))
    plan = s.schedule()
    assert plan.start_pos == [8, 8] and plan.query_lens == [3, 1]  # both start after 2 cached blocks
    assert b.blocks[:2] == c.blocks[:2] and bm._ref[b.blocks[0]] == 2 and bm.num_cached == 0
    assert s.prefix_hit_tokens == 16 and s.prefix_queried_tokens == 11 + 9 + 10
    emit_and_finish(s, s.commit(plan, model.step(plan)))
    shared = b.blocks[:2]
    s.finish(b, FinishReason.ABORTED)
    assert bm._ref[shared[0]] == 1 and bm.num_cached == 0
    bm.check(s.live())
    s.finish(c, FinishReason.ABORTED)
    bm.check(s.live())
    # LRU order: a sequence's blocks are released tail first, so its prefix is evicted last
    assert list(bm._evictable) == [shared[1], shared[0]]
    free = bm.allocator.num_free
    d = s.add(Request(list(range(500, 500 + 4 * (free + 1))), SamplingParams(max_tokens=1)))
    plan = s.schedule()
    assert shared[1] in d.blocks and list(bm._evictable) == [shared[0]] and bm.num_evictions == 1
    emit_and_finish(s, s.commit(plan, model.step(plan)))
    bm.check(s.live())
    # the prefix whose second block was evicted is now a 1-block hit
    assert bm.lookup(list(range(100, 110)), 9)[0] == [shared[0]]
    # a hash collision costs a miss, never a wrong block: make every key collide with shared[0]'s
    key0 = bm._meta[shared[0]][0]
    monkeypatch.setattr("nanoqwen_runtime.engine.blocks.block_key", lambda parent, toks: key0)
    assert bm.lookup(list(range(900, 912)), 11)[0] == []  # same key, other tokens: miss
    assert bm.lookup(list(range(100, 112)), 11)[0] == [shared[0]]  # real match; then parent differs
    monkeypatch.undo()
    assert len({block_key(b"x", [1, 2]), block_key(b"y", [1, 2]), block_key(b"x", [1, 3])}) == 3


def test_full_prompt_hit_still_computes_one_token():
    """A prompt made only of cached full blocks recomputes its last block: the step needs logits."""
    s = make(num_blocks=17, block_size=4)
    toks = list(range(200, 212))  # 3 full blocks
    _, model = run_all(s, [Request(toks, SamplingParams(max_tokens=2), "a")])
    seq = s.add(Request(toks, SamplingParams(max_tokens=2), "b"))
    plan = s.schedule()
    assert plan.start_pos == [8] and plan.query_lens == [4] and plan.sample == [True]
    assert s.prefix_hit_tokens == 8
    model.step(plan)
    assert seq.blocks[:2] == s.blocks.lookup(toks, 11)[0][:2]


@pytest.mark.parametrize("seed", [0, 1])
def test_shared_prefixes_continuous_batching_and_preemption(seed):
    """200 requests over 3 shared prefixes, arriving between steps, in a pool small enough to preempt
    and evict: identical tokens with and without the cache (the fake is deterministic), the content
    tags hold at every step, fewer prefill tokens computed with the cache, accounting after every step."""
    rng = random.Random(seed)
    reqs = shared_prefix_requests(rng, 200)
    plain, m_plain = run_all(make(num_blocks=41, max_batch=8, caching=False), reqs, arrive_every=2)
    sched = make(num_blocks=41, max_batch=8)
    cached, m_cached = run_all(sched, reqs, arrive_every=2)
    assert cached == plain
    assert sched.num_preemptions > 0 and sched.blocks.num_evictions > 0
    assert sched.prefix_hit_tokens > 0
    # an admission (a resume after preemption too) prefills at most its tokens minus the cached prefix
    # (less when preempted mid-prefill)
    assert m_cached.tokens_computed["prefill"] <= sched.prefix_queried_tokens - sched.prefix_hit_tokens
    assert m_cached.tokens_computed["prefill"] < m_plain.tokens_computed["prefill"]


# ---- the engine (torch op backend) ----------------------------------------------------------------
def _count_prefill(engine):
    counted = {"prefill": 0}
    run = engine._run

    def counting(plan, side_work=None):
        if plan.kind == "prefill":
            counted["prefill"] += plan.num_tokens
        return run(plan, side_work)

    engine._run = counting
    return counted


def test_engine_logits_with_cache_match_reference(tiny_path):
    """A request whose prompt shares 64 tokens (4 blocks) with an earlier one: its prefill starts after
    them (stats, and the prefill tokens computed), and every decode position's logits are within the
    engine's bound LOGIT_ATOL of the fp32 reference (teacher-forced), as without the cache; greedy
    choices equal the reference's where its top-2 gap is at least NEAR_TIE (test_engine_cpu.py)."""
    rng = np.random.default_rng(5)
    shared = [int(x) for x in rng.integers(10, 500, 64)]
    first = shared + [int(x) for x in rng.integers(10, 500, 9)]
    second = shared + [int(x) for x in rng.integers(10, 500, 13)]
    ref = reference_decode(ReferenceModel.from_file(tiny_path, dtype=torch.float32), [second], 10)
    for caching in (True, False):
        engine = Engine.from_file(tiny_path, cpu_config(prefix_caching=caching))
        counted = _count_prefill(engine)
        list(engine.generate([Request(first, SamplingParams(max_tokens=4), "warm", ignore_eos=True)]))
        before = counted["prefill"]
        run = teacher_forced(engine, [second], ref.tokens, batch=1)
        err = (run.logits[0] - ref.logits[0]).abs().amax(dim=-1)
        assert float(err.max()) <= LOGIT_ATOL, (caching, err)
        clear = ref.gap(0) >= NEAR_TIE
        assert [c for c, k in zip(run.chosen[0], clear, strict=True) if k] == \
            [t for t, k in zip(ref.tokens[0], clear, strict=True) if k]
        st = engine.stats()
        if caching:
            assert st.prefix_hit_tokens == 64 and st.prefix_queried_tokens == len(first) + len(second)
            assert counted["prefill"] - before == len(second) - 64
            assert st.kv_blocks_cached > 0 and st.prefix_hit_rate > 0
        else:
            assert st.prefix_hit_tokens == 0 and st.prefix_queried_tokens == 0 and st.kv_blocks_cached == 0
            assert counted["prefill"] - before == len(second)
        assert st.kv_blocks_used == 0 and st.running == 0 and st.waiting == 0


def test_engine_greedy_same_with_and_without_cache_under_preemption(tiny_path):
    """Six requests over two shared prefixes in a pool that forces preemption: greedy tokens equal to
    a roomy cache-less engine's until a near-tie; accounting holds after every step; the cache hit."""
    rng = np.random.default_rng(6)
    pre = [[int(x) for x in rng.integers(10, 500, 40)] for _ in range(2)]
    prompts = [pre[i % 2] + [int(x) for x in rng.integers(10, 500, 3 + i)] for i in range(6)]

    def reqs():
        return [Request(p, SamplingParams(max_tokens=16), str(i), ignore_eos=True)
                for i, p in enumerate(prompts)]

    gaps: dict[str, list[float]] = {}
    roomy, _ = run_engine(Engine.from_file(tiny_path, cpu_config(prefix_caching=False)), reqs(), gaps)
    engine = Engine.from_file(tiny_path, cpu_config(num_blocks=12, admit_watermark=0.0))
    got: dict[str, list[int]] = {}
    for r in reqs():
        assert engine.submit(r) is None
    while engine.has_work:
        for ev in engine.step():
            if isinstance(ev, TokenEvent):
                got.setdefault(ev.request, []).append(ev.token_id)
        engine.check_accounting()
    assert_same_until_near_tie(got, roomy, gaps)
    st = engine.stats()
    assert st.preemptions > 0 and st.prefix_hit_tokens >= 32
    assert st.kv_blocks_used == 0 and st.kv_blocks_cached > 0
    assert engine.blocks.num_evictions > 0


def test_engine_config_switch():
    with pytest.raises(ValueError, match="speculation"):
        EngineConfig(device="cpu", backend="torch", mode="eager", speculation="ngram")
    assert EngineConfig(device="cpu", backend="torch", mode="eager").prefix_caching is True
