"""GPU tests of the CUDA engine (kernel backend, CUDA graphs) on synthetic weights, against the plain-torch
reference runtime. The real model is in test_engine_real_gpu.py.

Models: synthetic containers written here, with the exact per-layer shapes of Qwen2.5-Coder-7B
(hidden 3584, 28/4 heads x 128, intermediate 18944, vocab 152064, untied bf16 lm_head) but 2 layers,
so the reference (which dequantizes every tensor with nanoqwen_format's numpy code) loads in
seconds; and the full 24-layer Qwen2.5-Coder-0.5B geometry (tied embeddings, head_dim 64). The
benchmark runs the full 28-layer 7B geometry.

Bound: `engine.agreement` (see its header): at every teacher-forced position, max |engine -
reference| <= 2 x the distance of the engine's torch backend (same bf16 rounding points, plain torch
math) from the reference, plus one bf16 ulp; greedy choices equal wherever the reference's top-2 gap
is at least twice that bound. Random weights make near-ties common (top-2 gaps of random logits are
~exponential), so the argmax is checked at every clear position, not only up to the first near-tie.
"""

from __future__ import annotations

import random

import pytest
import torch
from nanoqwen_model import QWEN25_CODER_05B, QWEN25_CODER_7B
from nanoqwen_runtime.engine import Engine, EngineConfig, FinishEvent, Request, TokenEvent
from nanoqwen_runtime.engine.agreement import (
    greedy_agreement,
    noise_bound,
    reference_decode,
    teacher_forced,
    tie_free_prefix,
)
from nanoqwen_runtime.engine.scheduler import FinishReason
from nanoqwen_runtime.engine.synthetic import write_container
from nanoqwen_runtime.reference import ReferenceModel
from nanoqwen_runtime.sampling import SamplingParams

pytestmark = pytest.mark.gpu

STEPS = 12
GEOMS = {"7b-width-2layers": QWEN25_CODER_7B.with_(num_hidden_layers=2), "0.5b": QWEN25_CODER_05B}
# odd prompt lengths: 1 token, across a page boundary, one and two prefill chunks of 512 and a tail
LENGTHS = (1, 9, 16, 17, 100, 300, 513, 700)


@pytest.fixture(scope="module", params=list(GEOMS))
def container(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("gpu") / f"{request.param}.nanoqwen"
    write_container(path, GEOMS[request.param], seed=5, device="cuda")
    return request.param, path


def gpu_config(**kw):
    base = dict(kv_memory_bytes=2 << 30, max_model_len=4096, prefill_chunk=512)
    base.update(kw)
    return EngineConfig(**base)


def prompts_of(lengths, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 150000, (n,), generator=g).tolist() for n in lengths]


_ORACLE: dict = {}


def oracle(path, prompts, steps=STEPS):
    """(reference decode, per-prompt noise bound) for `prompts` on `path`, computed once."""
    key = (str(path), tuple(map(tuple, prompts)), steps)
    if key not in _ORACLE:
        model = ReferenceModel.from_file(path, device="cuda", dtype=torch.float32)
        ref = reference_decode(model, prompts, steps)
        del model
        twin_engine = Engine.from_file(path, gpu_config(backend="torch", mode="eager"))
        twin = teacher_forced(twin_engine, prompts, ref.tokens, batch=len(prompts))
        del twin_engine
        torch.cuda.empty_cache()
        _ORACLE[key] = (ref, [noise_bound(ref.logits[p], twin.logits[p]) for p in range(len(prompts))])
    return _ORACLE[key]


def check_against_reference(name, run, ref, bound):
    """Logits within the bound at every position; the engine's choice equals the reference's token
    wherever the reference's gap is at least twice the bound. Returns (worst fraction, decided)."""
    worst, decided = 0.0, 0
    for p in range(len(ref.tokens)):
        diff = (run.logits[p] - ref.logits[p]).abs().amax(dim=-1)
        worst = max(worst, float((diff / bound[p]).max()))
        assert bool((diff <= bound[p]).all()), f"{name} prompt {p}: {diff.tolist()} > {bound[p].tolist()}"
        clear = (ref.gap(p) >= 2 * bound[p]).cpu()
        for j in range(len(clear)):
            if clear[j]:
                assert run.chosen[p][j] == ref.tokens[p][j], f"{name} prompt {p} position {j}"
                decided += 1
    return worst, decided


# 64 prompts of 1..300 tokens: decode batches of 16, 32 and 64 rows (one graph bucket each)
BATCH_LENGTHS = tuple(1 + (37 * i) % 300 for i in range(64))


# Prefill chunks of 64 rows run the mma.sync INT4 GEMM, chunks of 128 / 200 rows the wgmma GEMM's
# prefill plan (128 rows: one M block split along K; 200: two M blocks), steps of more than
# INT4_PREFILL_GEMM_MAX_ROWS (the 64 prompts' chunks of 600 rows) dequantize into the scratch + cuBLAS
# (ops_kernels: the measured crossovers); decode batches of 16..64 are mma.sync GEMMs.
@pytest.mark.parametrize("batch,prefill_chunk", [(16, 64), (32, 200), (64, 128), (16, 600)])
def test_batched_decode_and_chunked_prefill_run_the_int4_gemm(container, batch, prefill_chunk):
    """Decode at batch 16 / 32 / 64 runs the INT4 GEMM and prefill chunks run the INT4 GEMMs (64 rows;
    128 or 200 rows on the wgmma prefill plan) or dequantize + cuBLAS (600 rows), with no bf16 copy of
    the weights, within the reference bound; the path counters say so (the graph of the batch's bucket:
    every layer linear is one INT4 GEMM launch, nothing else quantized runs)."""
    from nanoqwen_runtime.engine import ops_kernels

    name, path = container
    prompts = prompts_of(BATCH_LENGTHS, seed=7)  # all 64 at each batch size: one oracle
    ref, bound = oracle(path, prompts, steps=4)
    engine = Engine.from_file(path, gpu_config(prefill_chunk=prefill_chunk))
    assert not engine.config.dense_weight_cache and engine.memory_report().dense_cache_bytes == 0
    assert (engine.ops.scratch_bytes > 0) == (prefill_chunk > ops_kernels.INT4_PREFILL_GEMM_MAX_ROWS)
    engine.ops.paths.clear()
    run = teacher_forced(engine, prompts, ref.tokens, batch=batch)
    worst, decided = check_against_reference(f"{name}/int4-gemm/b{batch}/chunk{prefill_chunk}", run, ref,
                                             bound)
    print(f"\n[{name} batch {batch}, prefill chunk {prefill_chunk}, INT4 GEMM] worst position at "
          f"{worst:.2f} of its bound; {decided} decided")
    layers = engine.geom.num_hidden_layers
    graph = engine.runner.graph_paths[(batch, engine.runner.context_classes[0])]
    assert graph.get("int4_gemm") == 4 * layers, graph
    assert not {"gemv_int4", "dequant_gemm", "cublas_bf16_cache", "int4_gemm_wgmma128"} & set(graph), graph
    eager = engine.ops.paths  # prefill steps (eager) and the graph captures
    assert eager["cublas_bf16_cache"] == 0
    if prefill_chunk <= ops_kernels.INT4_GEMM_MAX_ROWS:
        assert eager["int4_gemm"] > 4 * layers and eager["dequant_gemm"] == eager["int4_gemm_wgmma128"] == 0
    elif prefill_chunk <= ops_kernels.INT4_PREFILL_GEMM_MAX_ROWS:  # the full chunks: the prefill plan
        assert eager["int4_gemm_wgmma128"] >= 4 * layers and eager["dequant_gemm"] == 0, dict(eager)
    else:  # the full chunks (600 rows) dequantize; shorter last chunks may be GEMMs
        assert eager["dequant_gemm"] >= 4 * layers, dict(eager)


@pytest.mark.parametrize("mode,batch", [("graph", 1), ("graph", 8), ("eager", 8)])
def test_teacher_forced_decode_matches_reference(container, mode, batch):
    """8 prompts of odd lengths, 12 decode steps each, one token per request per step, at batch 1
    and 8, against the reference at every position (module header)."""
    name, path = container
    prompts = prompts_of(LENGTHS, seed=3)
    ref, bound = oracle(path, prompts)
    engine = Engine.from_file(path, gpu_config(mode=mode))
    run = teacher_forced(engine, prompts, ref.tokens, batch=batch)
    if mode == "graph":
        replays = sum(engine.runner.replays.values())
        assert replays == run.decode_steps >= (len(prompts) // batch) * (STEPS - 1)
    worst, decided = check_against_reference(f"{name}/{mode}/b{batch}", run, ref, bound)
    print(f"\n[{name} {mode} batch {batch}] worst position at {worst:.2f} of its bound; argmax equal at all "
          f"{decided} clear positions of {len(prompts) * STEPS}")
    # random logits: about half the positions are clear of twice the bound; a quarter at the least
    assert decided >= len(prompts) * STEPS // 4
    assert engine.kv_blocks_used() == 0


def _forced_within_bound(container, batch: int, **option):
    """An engine with EngineConfig options, teacher-forced on the LENGTHS prompts at `batch` rows:
    within the reference bound at every position, a quarter of them decided at the least. Returns the
    engine and the path counts of its graph for the batch's bucket."""
    name, path = container
    prompts = prompts_of(LENGTHS, seed=3)
    ref, bound = oracle(path, prompts)
    engine = Engine.from_file(path, gpu_config(**option))
    run = teacher_forced(engine, prompts, ref.tokens, batch=batch)
    label = ",".join(f"{key}={value}" for key, value in option.items())
    worst, decided = check_against_reference(f"{name}/{label}/b{batch}", run, ref, bound)
    print(f"\n[{name} {label} batch {batch}] worst position at {worst:.2f} of its bound; "
          f"{decided} clear positions decided")
    assert decided >= len(prompts) * STEPS // 4
    return engine, engine.runner.graph_paths[(batch, engine.runner.context_classes[0])]


@pytest.mark.parametrize("batch", [1, 2, 8])
def test_attention_merge_in_o_proj_gives_the_same_logits(container, batch, monkeypatch):
    """The o_proj GEMV's merge of the split attention rows against the combine kernel (the engine with
    `KernelOps.fuses_attention_merge` forced off): contexts of 1-490 tokens, within the 512-token context
    class (decode plans of at most 16 splits) and most of them over 2 tiles (split), teacher-forced at 1,
    2 and 8 rows. The merge uses the combine kernel's arithmetic, so every logit must be bitwise equal;
    the graph of the batch's bucket deferred every layer's merge ("attention_merge_o_proj") and so
    launches one kernel fewer per layer."""
    from nanoqwen_runtime.engine.ops_kernels import KernelOps

    name, path = container
    prompts = prompts_of((130, 1, 480, 200, 129, 64, 300, 490), seed=5)
    forced = [[(7 * i + 13 * j) % 1000 + 10 for j in range(STEPS)] for i in range(len(prompts))]
    runs, engines = {}, {}
    for merge in ("combine", "o_proj"):
        with monkeypatch.context() as mp:
            if merge == "combine":
                mp.setattr(KernelOps, "fuses_attention_merge", lambda self, plan, o_proj, m: False)
            engines[merge] = Engine.from_file(path, gpu_config())
            runs[merge] = teacher_forced(engines[merge], prompts, forced, batch=batch)
    for p in range(len(prompts)):
        assert torch.equal(runs["o_proj"].logits[p], runs["combine"].logits[p]), f"{name} b{batch} prompt {p}"
    layers = engines["o_proj"].geom.num_hidden_layers
    key = (batch, engines["o_proj"].runner.context_classes[0])
    graph = engines["o_proj"].runner.graph_paths[key]
    assert graph.get("attention_merge_o_proj") == layers, graph
    assert "attention_merge_o_proj" not in engines["combine"].runner.graph_paths[key]
    assert engines["o_proj"].ops.decode_plans[key].can_defer_merge
    for e in engines.values():
        assert e.kv_blocks_used() == 0


@pytest.mark.parametrize("container", ["0.5b"], indirect=True)  # once, on the 24-layer 0.5B geometry
def test_reliability_1000_requests(container):
    """1000 requests, random lengths and sampling, some too large; a small pool forces preemption.
    Every request completes or is refused with a reason; blocks return to zero; memory does not grow."""
    _, path = container
    engine = Engine.from_file(path, gpu_config(num_blocks=400, max_model_len=2048, prefill_chunk=256))
    rng = random.Random(0)
    vocab = engine.geom.vocab_size

    def make(i):
        n = rng.choice([1, rng.randrange(2, 64), rng.randrange(64, 600), rng.randrange(1500, 3000)])
        p = SamplingParams(max_tokens=rng.choice([1, rng.randrange(2, 48), rng.randrange(48, 200)]),
                           temperature=rng.choice([0.0, 0.7, 1.0]), top_p=rng.choice([1.0, 0.9]),
                           top_k=rng.choice([0, 20]), seed=rng.randrange(2**31))
        return Request([rng.randrange(vocab) for _ in range(n)], p, str(i), ignore_eos=rng.random() < 0.5)

    # warm-up so that allocator caches are populated before the memory baseline
    list(engine.generate([make(-1 - j) for j in range(8)]))
    torch.cuda.synchronize()
    base_alloc = torch.cuda.memory_allocated()
    pending = [make(i) for i in range(1000)]
    done, refused = {}, {}
    while pending or engine.has_work:
        for _ in range(rng.choice([0, 1, 2, 8])):
            if pending:
                ev = engine.submit(pending.pop(0))
                if ev is not None:
                    refused[ev.request_id] = ev
        for ev in engine.step():
            if isinstance(ev, FinishEvent):
                done[ev.request_id] = ev
        engine.check_accounting()
    torch.cuda.synchronize()
    assert len(done) + len(refused) == 1000
    assert all(e.reason is FinishReason.REFUSED and e.detail for e in refused.values())
    ok = (FinishReason.EOS, FinishReason.LENGTH, FinishReason.CONTEXT)
    assert all(e.reason in ok for e in done.values())
    assert all(e.num_prompt_tokens + e.num_generated == 2048 for e in done.values()
               if e.reason is FinishReason.CONTEXT)
    assert engine.kv_blocks_used() == 0
    assert torch.cuda.memory_allocated() <= base_alloc
    preempt = sum(e.num_preemptions for e in done.values())
    print(f"\n[reliability] done {len(done)}, refused {len(refused)}, preemptions {preempt}, "
          f"steps {engine.num_steps}")
    assert refused and preempt > 0


@pytest.mark.parametrize("mode", ["graph", "eager"])
def test_overlap_gives_the_synchronous_tokens(container, mode):
    """EngineConfig.overlap: decode step n+1 queued before step n is read back, its token ids copied on
    the device from step n's sampled tokens (test_engine_overlap.py has the CPU cases: EOS, arrivals,
    preemption, speculation). Here the device side: pinned read-back buffers used in turn, the feed
    before the graph replay. Five requests leaving the batch at different lengths (never computed
    ahead: no row is added to a step, which could change its graph bucket), greedy and seeded
    sampling: the same steps with the same inputs as without overlap, so the tokens are EQUAL, and
    steps went ahead."""
    _, path = container
    prompts = prompts_of((1, 17, 100, 300, 9), seed=13)

    def run(overlap: bool):
        engine = Engine.from_file(path, gpu_config(mode=mode, overlap=overlap))
        for i, p in enumerate(prompts):
            sp = SamplingParams(max_tokens=6 + 5 * i, temperature=0.8 if i % 2 else 0.0, top_p=0.9, seed=i)
            assert engine.submit(Request(p, sp, f"r{i}", ignore_eos=True)) is None
        toks, fins = {}, {}
        while engine.has_work:
            for ev in engine.step():
                if isinstance(ev, TokenEvent):
                    toks.setdefault(ev.request, []).append(ev.token_id)
                else:
                    fins[ev.request_id] = ev
        torch.cuda.synchronize()
        assert engine.kv_blocks_used() == 0
        out = (toks, {k: (f.reason, f.num_generated) for k, f in fins.items()}, dict(engine.num_steps),
               engine.num_steps_ahead)
        del engine
        torch.cuda.empty_cache()
        return out

    toks_on, fins_on, steps_on, ahead_on = run(True)
    toks_off, fins_off, steps_off, ahead_off = run(False)
    assert toks_on == toks_off and fins_on == fins_off
    assert [fins_on[f"r{i}"] for i in range(5)] == [(FinishReason.LENGTH, 6 + 5 * i) for i in range(5)]
    assert steps_on == steps_off and ahead_off == 0 and ahead_on >= steps_on["decode"] // 2
    print(f"overlap[{mode}]: {ahead_on} of {steps_on['decode']} decode steps queued ahead, tokens equal")


# Not on the 0.5B geometry: it ties its embeddings, and its random-weight model repeats the prompt's last
# token, so no sampled token after the first is new and none can end a request at a
# decode step.
@pytest.mark.parametrize("container", ["7b-width-2layers"], indirect=True)
def test_overlap_with_eos_matches_the_reference(container):
    """EngineConfig.overlap where sequences end on a sampled token with the next step already queued:
    that step computes their dropped rows beside the others', in a batch a row larger than the
    synchronous engine's (maybe another graph bucket), so the other rows' logits may move in their last
    bits. Every row is still within the reference bound, so the tokens equal the reference's up to the
    first near-tie (twice the bound), and the block accounting holds after every event.

    Each EOS id is a reference token inside its prompt's tie-free prefix (`tie_free_prefix`: the tokens
    that any engine within the bound must choose exactly), so the request must end there with reason
    "eos". On these random-weight models most prompts meet a near-tie at their first or second token
    (measured: 7 tie-free tokens over 8 prompts of the 7B-width model), hence four prompts of
    each length, and only those with a token in their tie-free prefix that is new after the first get an
    EOS; the rest run to max_tokens."""
    _, path = container
    prompts = prompts_of(LENGTHS * 4, seed=3)
    ref, bound = oracle(path, prompts)
    free = [tie_free_prefix(ref, p, 2 * bound[p], STEPS) for p in range(len(prompts))]
    # the EOS: the first token of the tie-free prefix, from index 1 + p % 5 on, that does not occur before
    # it (its first occurrence ends the request, so a decode step must see it, not the prefill)
    eos = {}
    for p in range(len(prompts)):
        toks = ref.tokens[p]
        new = [j for j in range(1, free[p]) if toks[j] not in toks[:j]]
        if new:
            eos[p] = toks[next((j for j in new if j >= 1 + p % 5), new[-1])]
    assert len(eos) >= 3, f"only {len(eos)} of {len(prompts)} prompts have a new token in their tie-free " \
        f"prefix: {free}"
    engine = Engine.from_file(path, gpu_config(overlap=True))
    # the prompts with an EOS last, longest first: no step goes ahead while a request waits (prefill and
    # decode alternate then), so those admitted with the last prefill chunks end in the decode-only run
    order = [p for p in range(len(prompts)) if p not in eos]
    order += sorted(eos, key=lambda p: -len(prompts[p]))
    reqs = [Request(prompts[p], SamplingParams(max_tokens=STEPS), str(p),
                    eos_ids=frozenset({eos[p]} if p in eos else ())) for p in order]
    toks, fins = {}, {}
    for ev in engine.generate(reqs):
        if isinstance(ev, TokenEvent):
            toks.setdefault(ev.request, []).append(ev.token_id)
        else:
            fins[ev.request_id] = ev
        engine.check_accounting()
    assert engine.kv_blocks_used() == 0 and engine.num_steps_ahead > 0
    for p in range(len(prompts)):
        chosen = toks[str(p)]
        n, expected = greedy_agreement(chosen, ref, p, 2 * bound[p])
        assert n == expected, f"prompt {p}: token {n} differs from the reference before a near-tie"
        if p in eos:  # the reference's answer ends at the first occurrence of its EOS id
            end = ref.tokens[p].index(eos[p]) + 1
            assert len(chosen) == end and fins[str(p)].reason is FinishReason.EOS, p
        else:
            assert len(chosen) == STEPS and fins[str(p)].reason is FinishReason.LENGTH, p
    # the path under test ran: sequences ended on their token with the next step already queued
    assert engine.num_rows_dropped > 0
    print(f"\noverlap with EOS: {engine.num_steps_ahead} steps ahead, {len(eos)} requests ended on their "
          f"EOS, {engine.num_rows_dropped} rows dropped")


def test_int4_lm_head_matches_reference(tmp_path):
    """An `--lm-head int4` container (7B width, 2 layers): the INT4 lm_head (152,064 outputs) as one more
    decode GEMV at batches 1 and 3 (what `nanoqwen-cli bench`'s lm_head_ab times); teacher-forced decode
    within the noise bound, and the batch-1 graph ran the lm_head as a GEMV, not cuBLAS."""
    path = write_container(tmp_path / "int4-head.nanoqwen", GEOMS["7b-width-2layers"], seed=9, lm_head="int4",
                           device="cuda")
    prompts = prompts_of((300, 41, 7), seed=4)
    ref, bound = oracle(path, prompts, steps=8)
    engine = Engine.from_file(path, gpu_config())
    for batch in (3, 1):
        run = teacher_forced(engine, prompts, ref.tokens, batch=batch)
        worst, decided = check_against_reference(f"int4-head/b{batch}", run, ref, bound)
        assert decided >= len(prompts) * 8 // 4  # a quarter of the positions at the least, as below
    graph = engine.runner.graph_paths[(1, engine.runner.context_classes[0])]
    layers = engine.geom.num_hidden_layers
    assert graph.get("gemv_int4") == 4 * layers + 1, graph
    assert "cublas_bf16" not in graph and engine.kv_blocks_used() == 0


def test_int8_lm_head_matches_reference(tmp_path):
    """An `--lm-head int8` container (7B width, 2 layers) runs on the INT8 GEMV: teacher-forced decode
    of 3 prompts at batch 3 (lm_head rows M = 3) and batch 1 (M = 1), within the noise bound, which
    the torch backend measures with the same int8 head (dequantized)."""
    path = write_container(tmp_path / "int8-head.nanoqwen", GEOMS["7b-width-2layers"], seed=9, lm_head="int8",
                           device="cuda")
    prompts = prompts_of((300, 41, 7), seed=4)
    ref, bound = oracle(path, prompts, steps=8)
    engine = Engine.from_file(path, gpu_config())
    for batch in (3, 1):
        run = teacher_forced(engine, prompts, ref.tokens, batch=batch)
        worst, decided = check_against_reference(f"int8-head/b{batch}", run, ref, bound)
        print(f"\n[int8 lm_head, batch {batch}] worst position at {worst:.2f} of its bound; "
              f"argmax equal at {decided} clear positions")
        assert decided >= len(prompts) * 8 // 4  # a quarter of the positions at the least, as above
    paths = {k: v for k, v in engine.runner.graph_paths[(1, engine.runner.context_classes[0])].items()}
    assert paths.get("gemv_int8") == 1, paths  # the lm_head of a decode step is the INT8 GEMV
    assert engine.kv_blocks_used() == 0
