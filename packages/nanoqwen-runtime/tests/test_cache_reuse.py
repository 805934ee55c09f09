"""Shifted reuse of cached K/V (engine/blocks.py `find_shifted`, kv_cache.py `shift_kv`; the engines'
`cache_reuse`): an editor's fill-in-the-middle prompts, where the code below the cursor comes again
after a prefix that changed.

Prompts: A = X + Y + tail, then B = X + Z + Y + tail (Z: 5 tokens typed at the cursor). B's exact
prefix is X (4 blocks of 16); Y's blocks that A computed (6 blocks, 96 tokens) reappear 5 positions
later. With `cache_reuse` on, B takes those 96 tokens' K/V by a rotated copy and computes Z and the
tail in one prefill step, two rows around the copied span (a budget that ends at the span splits it
into two steps, with the same tokens and K/V).

The oracle for the copy: layer 0's keys and values do not depend on the context (the token's own
embedding, projected, then rotated to its position), so at layer 0 the copied K/V must equal what an
exact prefill of B computes, within the rounding of one more rotation in the pool's dtype. From
layer 1 on they carry A's context and differ: the approximation is real, and so nothing from the first
copied token on may enter the exact prefix cache, which a third request proves.
"""

from __future__ import annotations

import random

import pytest
import torch
from engine_testkit import TINY, cpu_config
from nanoqwen_model.forward import apply_rope, rope_inv_freq
from nanoqwen_runtime.engine import Engine, Request
from nanoqwen_runtime.engine.blocks import BlockManager
from nanoqwen_runtime.engine.metadata import build_step_inputs, plan_rows, sampled_rows
from nanoqwen_runtime.engine.scheduler import Scheduler
from nanoqwen_runtime.engine.sequence import FinishReason
from nanoqwen_runtime.engine.synthetic import write_container
from nanoqwen_runtime.kv_cache import BlockAllocator, KVShift, shift_kv
from nanoqwen_runtime.reference import ReferenceModel
from nanoqwen_runtime.reference_engine import ReferenceEngine, ReferenceEngineConfig
from nanoqwen_runtime.sampling import SamplingParams

BS = 16
rng = random.Random(7)
X = [rng.randrange(10, 500) for _ in range(64)]
Y = [rng.randrange(10, 500) for _ in range(100)]
Z = [rng.randrange(10, 500) for _ in range(5)]
TAIL = [11, 12, 13]
A = X + Y + TAIL
B = X + Z + Y + TAIL
Y_AT = len(X) + len(Z)  # where Y starts in B
REUSED = 96  # Y's tokens in A's full blocks 4..9


def ulp_of(dtype) -> float:
    """The pool dtype's unit roundoff relative to the largest entry (2^-24 fp32, 2^-8 bf16), doubled."""
    return 2**-23 if dtype == torch.float32 else 2**-7


def rotation_bound(dtype, max_pos: int) -> float:
    """A key rotated to p then by delta, against one rotated to p + delta, relative to the largest key.
    Angles are f32(position) * inv_freq (inv_freq <= 1): each product rounds by 2^-24 of its size, so
    the two angles differ by at most 2^-24 * (p + delta + (p + delta)) <= 2^-23 * max_pos radians, and
    the rotation moves an entry by at most that times the largest key; cos and sin add an ulp each; then
    the two roundings of the stored key to the pool's dtype."""
    return 2**-23 * max_pos + 4 * 2**-24 + 2 * ulp_of(dtype)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return write_container(tmp_path_factory.mktemp("reuse") / "tiny.nanoqwen", TINY, seed=3)


def req(ids, rid, max_tokens=2):
    return Request(list(ids), SamplingParams(temperature=0.0, max_tokens=max_tokens), rid, ignore_eos=True)


def finish(engine, rid):
    for _ in engine.generate([]):
        pass
    assert not engine.has_work, rid


def reference(path, cache_reuse):
    model = ReferenceModel.from_file(path, device="cpu", dtype=torch.float32)
    config = ReferenceEngineConfig(block_size=BS, prefill_chunk=256, cache_reuse=cache_reuse)
    return ReferenceEngine(model, config)


def kernel_engine(path, cache_reuse):
    return Engine.from_file(path, cpu_config(prefill_chunk=256, cache_reuse=cache_reuse))


@pytest.fixture(scope="module")
def cuda_path(tmp_path_factory):
    """The 0.5B's layer geometry, two layers, random INT4 weights: what the kernels run."""
    from nanoqwen_model.config import QWEN25_CODER_05B

    path = tmp_path_factory.mktemp("reuse-gpu") / "05b-2l.nanoqwen"
    return write_container(path, QWEN25_CODER_05B.with_(num_hidden_layers=2), seed=4, device="cuda")


def cuda_engine(path, cache_reuse):
    """The CUDA engine (kernels, CUDA graphs, overlap)."""
    from nanoqwen_runtime.engine import EngineConfig

    return Engine.from_file(path, EngineConfig(kv_memory_bytes=1 << 30, max_model_len=1024,
                                               prefill_chunk=256, cache_reuse=cache_reuse))


def pool_of(engine) -> torch.Tensor:
    return engine.cache.pool if isinstance(engine, ReferenceEngine) else engine.runner.kv


def layer_rows(engine, blocks, positions, layer):
    """(K, V) f32 [T, Hkv, D] of `positions` in the page table `blocks`, at `layer`."""
    pool = pool_of(engine)
    b = torch.tensor([blocks[p // BS] for p in positions], device=pool.device)
    o = torch.tensor([p % BS for p in positions], device=pool.device)
    return pool[layer, 0][b, :, o].float().cpu(), pool[layer, 1][b, :, o].float().cpu()


def admit_b(engine):
    """Submit B after A ran to completion, run its first step; B's sequence."""
    assert engine.submit(req(A, "a")) is None
    finish(engine, "a")
    assert engine.submit(req(B, "b")) is None
    engine.step()
    (seq,) = engine.scheduler.running
    return seq


@pytest.mark.parametrize("make", [reference, kernel_engine,
                                  pytest.param(cuda_engine, marks=pytest.mark.gpu)],
                         ids=["reference", "engine", "cuda"])
def test_copied_kv_is_the_exact_kv_at_layer_0(request, make):
    path = request.getfixturevalue("cuda_path" if make is cuda_engine else "tiny_path")
    exact = make(path, 0)
    assert exact.submit(req(B, "b")) is None
    exact.step()  # B's whole prompt in one prefill chunk
    (want,) = exact.scheduler.running
    assert want.num_computed == len(B)

    engine = make(path, 32)
    before = engine.stats()
    seq = admit_b(engine)
    st = engine.stats()
    assert st.prefix_reused_tokens - before.prefix_reused_tokens == REUSED
    assert engine.num_steps["prefill"] == 2  # A's, then B's: Z and the tail in one step, the span skipped
    assert seq.num_computed == len(B) and seq.num_generated == 1
    assert seq.first_shifted_block == Y_AT // BS and seq.reused_span is None
    span = range(Y_AT, Y_AT + REUSED)
    k_got, v_got = layer_rows(engine, seq.blocks, span, 0)
    k_want, v_want = layer_rows(exact, want.blocks, span, 0)
    tol = rotation_bound(pool_of(engine).dtype, len(B)) * float(k_want.abs().max())
    assert float((k_got - k_want).abs().max()) <= tol
    assert float((v_got - v_want).abs().max()) <= ulp_of(pool_of(engine).dtype) * float(v_want.abs().max())
    if pool_of(engine).dtype == torch.float32:  # layer 1 remembers A's context: an approximation
        k1_got, _ = layer_rows(engine, seq.blocks, span, 1)
        k1_want, _ = layer_rows(exact, want.blocks, span, 1)
        assert float((k1_got - k1_want).abs().max()) > 100 * tol
    finish(engine, "b")
    engine.check_accounting()


def test_copied_blocks_never_enter_the_exact_cache(tiny_path):
    engine = reference(tiny_path, 32)
    admit_b(engine)
    finish(engine, "b")
    before = engine.stats()
    assert engine.submit(req(B, "b-again")) is None
    engine.step()
    st = engine.stats()
    # B's blocks from Y_AT // BS on held copied (or later) K/V: the exact hit stops at X; Y is copied
    # again from A's blocks
    assert st.prefix_hit_tokens - before.prefix_hit_tokens == len(X)
    assert st.prefix_reused_tokens - before.prefix_reused_tokens == REUSED
    finish(engine, "b-again")
    engine.check_accounting()


def test_reuse_off_below_the_minimum_and_when_disabled(tiny_path):
    for cache_reuse in (0, REUSED + BS):
        engine = reference(tiny_path, cache_reuse)
        seq = admit_b(engine)
        assert engine.stats().prefix_reused_tokens == 0
        assert seq.num_computed == len(B) and seq.first_shifted_block is None  # all computed, exactly
        finish(engine, "b")


def test_generation_completes_with_reuse_on_both_engines(tiny_path):
    for make in (reference, kernel_engine):
        engine = make(tiny_path, 32)
        for ids, rid in ((A, "a"), (B, "b")):
            got = [ev.token_id for ev in engine.generate([req(ids, rid, max_tokens=6)])
                   if getattr(ev, "token_id", None) is not None]
            assert len(got) == 6, rid
        assert engine.stats().prefix_reused_tokens == REUSED
        engine.check_accounting()


# ---- the block manager and the scheduler, without a model ---------------------------------------------
def scheduler(cache_reuse, num_blocks=64, prefill_chunk=256):
    bm = BlockManager(BlockAllocator(num_blocks), num_blocks, BS)
    return Scheduler(bm, max_batch=4, max_model_len=512, prefill_chunk=prefill_chunk, admit_watermark=0.0,
                     cache_reuse=cache_reuse)


def run_prefill_then_finish(sched, ids):
    """Run `ids` through prefill with a fake model (no K/V: only the scheduler's bookkeeping), one token
    generated, then finish it. The plans of its prefill steps."""
    seq = sched.add(req(ids, "x", max_tokens=1))
    plans = []
    while not plans or not plans[-1].sample[0]:
        plans.append(sched.schedule())
        sched.commit(plans[-1], {seq.seq_id: 99} if plans[-1].sample[0] else {})
    sched.finish(seq, FinishReason.LENGTH)
    return seq, plans


def test_scheduler_skips_the_copied_span_in_one_step():
    sched = scheduler(32)
    run_prefill_then_finish(sched, A)
    seq = sched.add(req(B, "b", max_tokens=1))
    plan = sched.schedule()
    tail = len(B) - Y_AT - REUSED
    assert (plan.start_pos, plan.query_lens, plan.sample) == ([len(X)], [len(Z) + tail], [True])
    assert plan.skips == [(Y_AT, Y_AT + REUSED)] and plan.end_pos(0) == len(B)
    assert plan_rows(plan) == [(0, len(X), len(Z)), (0, Y_AT + REUSED, tail)]
    assert sampled_rows(plan) == {0: [1]}
    assert plan.step_tokens(0) == B[len(X):]
    inputs = build_step_inputs(plan, block_size=BS, max_pages=16, padding_block=63)
    after = range(Y_AT + REUSED, len(B))
    assert inputs.positions.tolist() == [*range(len(X), Y_AT), *after]
    assert inputs.input_ids.tolist() == B[len(X):Y_AT] + B[Y_AT + REUSED:]
    assert inputs.query_start.tolist() == [0, len(Z), len(Z) + tail]
    assert inputs.context_lens.tolist() == [Y_AT, len(B)] and inputs.sample_rows.tolist() == [len(Z) - 1,
                                                                                            len(Z) + tail - 1]
    assert inputs.offset.tolist() == [0, 0]  # the second row samples the first generated token
    assert inputs.page_table[:, : -(-Y_AT // BS)].tolist() == [seq.blocks[: -(-Y_AT // BS)]] * 2  # its pages
    slots = [seq.blocks[p // BS] * BS + p % BS for p in inputs.positions.tolist()]
    assert inputs.slot_mapping.tolist() == slots
    (shift,) = sched.pending_shifts
    assert shift.delta == len(Z) and len(shift.src_slots) == len(shift.dst_slots) == REUSED
    dst_blocks = [seq.blocks[p // BS] for p in range(Y_AT, Y_AT + REUSED)]
    assert [d // BS for d in shift.dst_slots] == dst_blocks
    sched.commit(plan, {seq.seq_id: 99})
    assert seq.num_computed == len(B) and seq.reused_span is None and seq.tokens[-1] == 99
    # from the copied span on, B's blocks are keyed apart: an exact lookup of B stops at X
    assert len(seq.block_keys) == len(B) // BS and seq.first_shifted_block == Y_AT // BS
    assert len(sched.blocks.lookup(B, len(B) - 1)[0]) == len(X) // BS
    sched.blocks.check(sched.live())


def test_a_budget_that_ends_before_the_tail_splits_the_chunk():
    """A 16-token budget: B2's chunk computes Z and the first 11 tokens after the span (no sample),
    the next step the rest, which samples."""
    tail = [rng.randrange(10, 500) for _ in range(40)]
    sched = scheduler(32, prefill_chunk=16)
    run_prefill_then_finish(sched, X + Y + tail)
    b2 = X + Z + Y + tail
    seq = sched.add(req(b2, "b2", max_tokens=1))
    plan = sched.schedule()
    ((a, b),) = plan.skips  # Y and A's tail blocks, copied
    assert a == Y_AT and b - a >= REUSED
    assert plan_rows(plan) == [(0, len(X), len(Z)), (0, b, 16 - len(Z))] and plan.sample == [False]
    sched.commit(plan, {})
    assert seq.num_computed == b + 16 - len(Z) < len(b2) and seq.reused_span is None
    plan = sched.schedule()
    assert plan_rows(plan) == [(0, seq.num_computed, len(b2) - seq.num_computed)] and plan.sample == [True]
    assert not plan.skips
    sched.commit(plan, {seq.seq_id: 99})
    assert seq.num_computed == len(b2)
    sched.blocks.check(sched.live())


def test_a_full_batch_leaves_no_row_for_the_tail():
    """max_batch 1: B is the step's only row, so its chunk stops at the copied span (no second row)."""
    sched = scheduler(32)
    run_prefill_then_finish(sched, A)
    sched.max_batch = 1
    seq = sched.add(req(B, "b", max_tokens=1))
    plan = sched.schedule()
    assert plan_rows(plan) == [(0, len(X), len(Z))] and not plan.skips and plan.sample == [False]
    sched.commit(plan, {})
    assert seq.num_computed == Y_AT + REUSED and seq.reused_span is None


def test_one_step_and_three_give_the_same_tokens_and_kv(tiny_path):
    """B prefilled in one step (two rows around the copied span) against a budget of len(Z) tokens,
    which ends at the span (Z in one step, the 7 tokens after the span in two more): the same greedy
    tokens, and the same K/V at the last layer at every computed position. Each row computes the same
    thing in both (the same keys at the same positions); only the matmuls' batch shape differs, which
    may change fp32 summation order: each of the at most 6 stages from the embeddings to layer 1's K/V
    (qkv, attention, o, gate_up, down, qkv) rounds dot products of at most 2^9 terms (K = 384), at
    most 2^9 * 2^-24 each, so they agree within 6 * 2^-15 < 2^-12 of the largest entry."""
    outs = []
    for chunk in (256, len(Z)):
        model = ReferenceModel.from_file(tiny_path, device="cpu", dtype=torch.float32)
        engine = ReferenceEngine(model, ReferenceEngineConfig(block_size=BS, prefill_chunk=max(chunk, BS),
                                                              cache_reuse=32))
        list(engine.generate([req(A, "a", max_tokens=1)]))
        prefills = engine.num_steps["prefill"]
        if chunk < BS:  # the budget stops at the span: only with a chunk of exactly len(Z) tokens
            engine.scheduler.prefill_chunk = chunk
        assert engine.submit(req(B, "b", max_tokens=6)) is None
        toks = []
        while engine.num_steps["decode"] == 0:  # B's prefill steps (their last samples a token)
            toks += [ev.token_id for ev in engine.step() if getattr(ev, "token_id", None) is not None]
        (seq,) = engine.scheduler.running
        computed = [p for p in range(len(X), len(B)) if not Y_AT <= p < Y_AT + REUSED]
        k, v = layer_rows(engine, seq.blocks, computed, TINY.num_hidden_layers - 1)
        toks += [ev.token_id for ev in engine.generate([]) if getattr(ev, "token_id", None) is not None]
        outs.append((engine.num_steps["prefill"] - prefills, toks, k, v))
    (steps1, toks1, k1, v1), (steps2, toks2, k2, v2) = outs
    assert (steps1, steps2) == (1, 3)
    assert toks1 == toks2 and len(toks1) == 6
    for got, want in ((k2, k1), (v2, v1)):
        assert float((got - want).abs().max()) <= 2**-12 * float(want.abs().max())


def test_copied_blocks_can_be_copied_again():
    """The cursor moves on: C shows the code below it once more, at yet another position, and only B's
    blocks, themselves copied, hold it block-aligned there: C copies them (the chain llama-server's
    slots make), and its exact hit still stops at X."""
    sched = scheduler(32)
    run_prefill_then_finish(sched, A)
    b = sched.add(req(B, "b", max_tokens=1))
    while b.num_computed < len(B):
        plan = sched.schedule()
        sched.commit(plan, {b.seq_id: 99} if plan.sample[0] else {})
    b_blocks = list(b.blocks)
    sched.finish(b, FinishReason.LENGTH)
    sched.pending_shifts.clear()
    w = [rng.randrange(10, 500) for _ in range(7)]
    c_ids = X + w + B[Y_AT + 11:Y_AT + 11 + 80] + TAIL  # the text of B's blocks 5..9
    c = sched.add(req(c_ids, "c", max_tokens=1))
    sched.schedule()
    (shift,) = sched.pending_shifts
    src_blocks = {s // BS for s in shift.src_slots}
    assert src_blocks == set(b_blocks[5:10]) and len(shift.src_slots) == 80
    assert c.num_computed == len(X)  # the exact hit
    sched.blocks.check(sched.live())


def test_a_run_never_reaches_the_last_prompt_token():
    sched = scheduler(32)
    run_prefill_then_finish(sched, A)
    z11 = [rng.randrange(10, 500) for _ in range(11)]
    ids = X + z11 + Y[:96]  # Y's 6 cached blocks would end on the last prompt token
    seq = sched.add(req(ids, "c", max_tokens=1))
    plan = sched.schedule()
    (shift,) = sched.pending_shifts
    assert len(shift.src_slots) == 5 * BS  # one block fewer: a token is left to compute
    assert plan_rows(plan)[-1] == (0, len(X) + 11 + 5 * BS, BS) and plan.sample == [True]
    sched.commit(plan, {seq.seq_id: 99})
    assert seq.num_computed == len(ids)


def test_a_waiting_request_is_searched_once_while_the_cache_stays_the_same():
    """A request that waits for pages is planned again every step; its shifted-run search (about a
    microsecond per prompt token) runs again only when a block enters or leaves the cache."""
    sched = scheduler(32, num_blocks=40)
    run_prefill_then_finish(sched, A)
    searched = []
    find_shifted = sched.blocks.find_shifted

    def counting(tokens, start, end, min_tokens):
        if len(tokens) == len(B):
            searched.append(sched.blocks.cache_version)
        return find_shifted(tokens, start, end, min_tokens)

    sched.blocks.find_shifted = counting
    long = sched.add(req([rng.randrange(10, 500) for _ in range(470)], "long", max_tokens=40))
    waiting = None
    for step in range(12):
        if step == 3:
            waiting = sched.add(req(B, "b", max_tokens=1))
        plan = sched.schedule()
        assert waiting not in plan.seqs  # it waits for pages throughout
        sched.commit(plan, {long.seq_id: 99} if plan.sample[0] else {})
    assert sched.waiting[0] is waiting and plan.kind == "decode"
    assert len(searched) == 1  # 9 steps planned it; nothing entered or left the cache
    version = sched.blocks.cache_version
    while sched.blocks.cache_version == version:  # the long request's next full block is cached
        plan = sched.schedule()
        sched.commit(plan, {long.seq_id: 99})
    sched.schedule()
    assert len(searched) >= 2 and sorted(set(searched)) == searched  # again, once per cache version


def test_shift_kv_rotates_keys_to_their_new_positions():
    gen = torch.Generator().manual_seed(0)
    layers, blocks, heads, d = 2, 6, 2, 64
    inv_freq = rope_inv_freq(d, 1e6)
    raw = torch.randn(40, layers * heads, d, generator=gen)
    for dtype in (torch.float32, torch.bfloat16):
        pool = torch.full((layers, 2, blocks, heads, BS, d), float("nan"), dtype=dtype)
        src_pos, dst_pos, delta = list(range(3, 43)), list(range(40, 80)), 37  # overlapping blocks
        src = [p for p in src_pos]  # slots = positions: a page table 0, 1, 2, ...
        rot = apply_rope(raw, torch.tensor(src_pos), inv_freq).reshape(40, layers, heads, d)
        vals = torch.randn(40, layers, heads, d, generator=gen)
        for j, p in enumerate(src):
            pool[:, 0, p // BS, :, p % BS] = rot[j].to(dtype)
            pool[:, 1, p // BS, :, p % BS] = vals[j].to(dtype)
        shift_kv(pool, KVShift(src, [p for p in dst_pos], delta), inv_freq)
        want = apply_rope(raw, torch.tensor(dst_pos), inv_freq).reshape(40, layers, heads, d)
        for j, p in enumerate(dst_pos):
            got_k = pool[:, 0, p // BS, :, p % BS].float()
            bound = rotation_bound(dtype, max(dst_pos)) * float(want.abs().max())
            assert float((got_k - want[j]).abs().max()) <= bound, (dtype, p)
            assert torch.equal(pool[:, 1, p // BS, :, p % BS], vals[j].to(dtype))
    with pytest.raises(ValueError, match="as many sources"):
        shift_kv(pool, KVShift([1, 2], [3], 1), inv_freq)
