"""Prompt-lookup speculation and prefix caching in the CUDA engine on the real Qwen2.5-Coder-0.5B (RTN
INT4), kernel backend, CUDA graphs, against the fp32 reference (the oracle).

Eight code-edit prompts (nanoqwen_bench.workloads, chat template), 64 greedy tokens each. The
reference decodes them one token per step; the bound per position is `engine.agreement.noise_bound`
(twice the distance of the engine's torch backend from the reference, teacher-forced, plus one bf16
ulp), and a near-tie is a reference top-2 gap below twice it. Both free-running engine runs, with
speculation (k = 4) and without, must choose the reference's token at every position before the first
near-tie (`greedy_agreement`), so they equal each other there. Why the speculative run is held to the
same bound: a verify step runs each verified token as a decode row of its own (position p, context
p + 1, the same pages), so it computes the same arithmetic as a plain decode step at p; only the batch
bucket (8 rows instead of 1) changes the GEMV's row count and the attention plan's split, another
sample of the same rounding noise.

Path: the verify steps (5 rows at k = 4) replayed the bucket-8 graph, whose linears are INT4 GEMVs
(the M <= 8 path); drafts were accepted (stats). Prefix cache: a request sharing a 1K-token prefix
with an earlier one prefills only its tail (stats) and decodes the same tokens until a near-tie.

Where the model is missing this fails under NANOQWEN_REQUIRE_GPU=1 (`nox -s gpu_tests`) and skips
elsewhere.
"""

from __future__ import annotations

import pytest
import torch
from engine_testkit import gpu_reference, noise_bounds
from nanoqwen_bench.workloads import code_edit_prompts
from nanoqwen_runtime.engine import Engine, EngineConfig, Request, TokenEvent
from nanoqwen_runtime.engine.agreement import greedy_agreement, noise_bound, reference_decode, teacher_forced
from nanoqwen_runtime.generate import Pipeline
from nanoqwen_runtime.reference import ReferenceModel
from nanoqwen_runtime.sampling import SamplingParams
from nanoqwen_runtime.speculative import SpeculationConfig

pytestmark = [pytest.mark.gpu, pytest.mark.model]

STEPS = 64
N_PROMPTS = 8
SPEC = SpeculationConfig(k=4)


@pytest.fixture(scope="module")
def container(qwen05b_packed):
    return qwen05b_packed("rtn")


@pytest.fixture(scope="module")
def prompts(container):
    pipe = Pipeline.from_container(container, backend=None)
    return [pipe.tokenizer.encode(pipe.chat_prompt(p.chat_messages()))
            for p in code_edit_prompts(N_PROMPTS, seed=0)]


@pytest.fixture(scope="module")
def reference(container, prompts):
    return gpu_reference(container, prompts, STEPS)


def engine_config(**kw) -> EngineConfig:
    base = dict(kv_memory_bytes=4 << 30, max_model_len=2048, prefill_chunk=2048, max_batch=8)
    base.update(kw)
    return EngineConfig(**base)


@pytest.fixture(scope="module")
def bound(container, prompts, reference):
    return noise_bounds(container, engine_config(backend="torch", mode="eager"), prompts, reference,
                        N_PROMPTS)


def free_run(engine: Engine, prompts, spec) -> list[list[int]]:
    out = []
    for i, p in enumerate(prompts):  # batch 1: one request at a time
        evs = list(engine.generate([Request(p, SamplingParams(max_tokens=STEPS), str(i), ignore_eos=True,
                                            speculation=spec)]))
        out.append([e.token_id for e in evs if isinstance(e, TokenEvent)])
    return out


def test_speculative_greedy_matches_reference_until_near_tie(container, prompts, reference, bound):
    engine = Engine.from_file(container, engine_config(prefix_caching=False))
    runs = {}
    for spec in (False, SPEC):
        replays_before = engine.runner.replays.copy()
        runs[bool(spec)] = (free_run(engine, prompts, spec), engine.runner.replays - replays_before)
    st = engine.stats()
    assert st.spec_steps > 0 and st.spec_accepted_tokens > 0, st
    print(f"\n[real 0.5B rtn, code-edit x{N_PROMPTS}] drafted {st.spec_drafted_tokens}, accepted "
          f"{st.spec_accepted_tokens} ({st.spec_acceptance_rate:.2f}) in {st.spec_steps} verify steps, "
          f"mean accepted {st.spec_mean_accepted:.2f}")
    compared = {}
    for key, (toks, _) in runs.items():
        total = 0
        for p in range(len(prompts)):
            c, e = greedy_agreement(toks[p], reference, p, 2 * bound[p])
            assert c == e, (f"speculation={key} prompt {p}: engine chose {toks[p][c]} at {c}, reference "
                            f"{reference.tokens[p][c]} (gap {float(reference.gap(p)[c]):.3f})")
            total += c
        compared[key] = total
    assert compared[True] == compared[False] >= 32, compared
    # every verify step (1 + 1..4 rows at batch 1) replayed a graph of bucket 2, 4 or 8, whose linears
    # are one INT4 GEMV launch each (the M <= 8 path); plain steps replayed bucket 1
    spec_replays = runs[True][1]
    verify_keys = [k for k in spec_replays if k[0] > 1]
    assert all(k[0] <= 8 for k in verify_keys), spec_replays
    assert sum(spec_replays[k] for k in verify_keys) == st.spec_steps, spec_replays
    layers = engine.geom.num_hidden_layers
    for k in verify_keys:
        paths = engine.runner.graph_paths[k]
        assert paths["gemv_int4"] == 4 * layers and "int4_gemm" not in paths, paths
    assert sum(spec_replays.values()) < sum(runs[False][1].values())  # fewer decode steps


def test_prefix_cache_hit_decodes_the_same(container, prompts):
    """Prompts that share their first 1024 tokens with an earlier request (a long shared system prompt):
    the prefill starts after the cached blocks, and the logits at every teacher-forced position are
    within the engine's bound of the fp32 reference (`noise_bound`: twice the torch backend's distance
    plus one ulp), as without the cache. Logits, not greedy tokens: after 1024 tokens of a repeated
    prompt the first positions are often near-ties (the first H200 run decided 3 greedy positions in
    4 prompts), while the logit bound holds at every position."""
    engine = Engine.from_file(container, engine_config())
    pre = (prompts[1] * (1 + 1024 // len(prompts[1])))[:1024]
    list(engine.generate([Request(pre + prompts[2], SamplingParams(max_tokens=2), "warm", ignore_eos=True)]))
    reference = ReferenceModel.from_file(container, device="cuda", dtype=torch.float32)
    twin_engine = Engine.from_file(container,
                                   engine_config(backend="torch", mode="eager", prefix_caching=False))
    for i in (0, 3):
        p = pre + prompts[i]
        ref = reference_decode(reference, [p], 16)
        hits_before = engine.stats().prefix_hit_tokens
        run = teacher_forced(engine, [p], ref.tokens, batch=1)
        hits = engine.stats().prefix_hit_tokens - hits_before
        # 64 full blocks of the shared prefix, plus whole blocks of the chat template's system prompt
        assert hits >= 1024 and hits % 16 == 0, (i, hits)
        twin = teacher_forced(twin_engine, [p], ref.tokens, batch=1)
        bound = noise_bound(ref.logits[0], twin.logits[0])
        diff = (run.logits[0] - ref.logits[0]).abs().amax(dim=-1)
        assert bool((diff <= bound).all()), (i, (diff / bound).max().item())
        print(f"\n[prefix hit {hits} tokens, prompt {i}] worst position at {(diff / bound).max().item():.2f} "
              "of its bound")
