"""The CUDA engine's logprobs (computed on the device after each step: nanoqwen_runtime.logprobs) on the
real Qwen2.5-Coder-0.5B (RTN INT4 g128), and where it was carried the real 1.5B-Instruct, against the
fp32 reference runtime, the oracle.

- Generated tokens: the engine (kernel backend, CUDA graphs, overlapped decode) decodes 4 chat prompts
  greedily with `logprobs=5`, alone (batch 1) and together (batch 4). Before the reference's first
  near-tie the engine's tokens are the reference's. At every position whose context equals the
  reference's (all tokens before it agree: past a near-tie too, as long as the engine chose as the
  reference did), each logprob (of the engine's token and of its alternatives) is within twice the
  logit noise bound of `engine.agreement` (`noise_bounds`: the torch backend's distance from the
  reference, doubled, plus one bf16 ulp): a log-softmax moves by at most twice the largest logit
  change (log-sum-exp is 1-Lipschitz in the max norm).
- Prompt logprobs (`prompt_logprobs`): each prompt position against the reference's prefill. The bound
  is derived the same way on the logprobs themselves: the torch backend's engine gives a second sample
  of the rounding noise, the kernels' distance is within twice its distance plus two bf16 ulps of the
  largest logit.
- Path: the decode steps replayed captured graphs and were queued ahead (overlap), so the logprobs
  came from the device op after a replay, not from an eager forward.

Fails under NANOQWEN_REQUIRE_GPU=1 where the model is missing (conftest), skips elsewhere.
"""

from __future__ import annotations

import pytest
import torch
from engine_testkit import gpu_reference, noise_bounds
from nanoqwen_runtime.engine import Engine, EngineConfig, Request, TokenEvent
from nanoqwen_runtime.engine.agreement import bf16_ulp, tie_free_prefix
from nanoqwen_runtime.generate import Pipeline
from nanoqwen_runtime.kv_cache import KVCacheSpec, PagedKVCache, build_step_metadata
from nanoqwen_runtime.reference import ReferenceModel
from nanoqwen_runtime.sampling import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.model]

STEPS = 16
K = 5
TASKS = ["is_prime(n)", "a function that reverses a linked list", "binary search over a sorted list",
         "an LRU cache class with get and put"]


@pytest.fixture(scope="module", params=["0.5b", "1.5b"])
def container(request, qwen05b_packed, qwen15b_packed):
    return (qwen05b_packed if request.param == "0.5b" else qwen15b_packed)("rtn")


@pytest.fixture(scope="module")
def prompts(container):
    pipe = Pipeline.from_container(container, backend=None)
    return [pipe.tokenizer.encode(pipe.chat_prompt([{"role": "user", "content": f"Write {t} in Python."}]))
            for t in TASKS]


@pytest.fixture(scope="module")
def reference(container, prompts):
    return gpu_reference(container, prompts, STEPS)


def engine_config(**kw) -> EngineConfig:
    base = dict(kv_memory_bytes=2 << 30, max_model_len=1024, prefill_chunk=1024, max_batch=8)
    base.update(kw)
    return EngineConfig(**base)


@pytest.fixture(scope="module")
def bound(container, prompts, reference):
    return noise_bounds(container, engine_config(backend="torch", mode="eager"), prompts, reference, 4)


@pytest.fixture(scope="module")
def engine(container):
    return Engine.from_file(container, engine_config())


def run(engine, prompts, batch: int, **req) -> dict[str, list[TokenEvent]]:
    out: dict[str, list[TokenEvent]] = {}
    for s in range(0, len(prompts), batch):
        reqs = [Request(prompts[p], SamplingParams(max_tokens=STEPS), request_id=str(p), ignore_eos=True,
                        logprobs=K, **req) for p in range(s, min(s + batch, len(prompts)))]
        for ev in engine.generate(reqs):
            if isinstance(ev, TokenEvent):
                out.setdefault(ev.request, []).append(ev)
    return out


@pytest.mark.parametrize("batch", [1, 4])
def test_decode_logprobs_match_reference(engine, prompts, reference, bound, batch):
    ahead, replays = engine.num_steps_ahead, sum(engine.runner.replays.values())
    out = run(engine, prompts, batch)
    assert engine.num_steps_ahead > ahead and sum(engine.runner.replays.values()) > replays
    compared = 0
    for p in range(len(prompts)):
        got = [ev.token_id for ev in out[str(p)]]
        ref_tokens = [int(t) for t in reference.tokens[p][:STEPS]]
        n_tie = tie_free_prefix(reference, p, 2 * bound[p], STEPS)
        assert got[:n_tie] == ref_tokens[:n_tie], p
        same = n_tie  # the positions whose context is the reference's: up to the first differing token
        while same < STEPS and got[same] == ref_tokens[same]:
            same += 1
        want = torch.log_softmax(reference.logits[p].float(), dim=-1).cpu()
        for j in range(min(STEPS, same + 1)):
            ev = out[str(p)][j]
            tol = 2 * float(bound[p][j])
            assert abs(ev.logprobs.logprob - float(want[j, ev.token_id])) <= tol, (p, j)
            assert list(ev.logprobs.top_logprobs) == sorted(ev.logprobs.top_logprobs, reverse=True)
            for i, v in zip(ev.logprobs.top_ids, ev.logprobs.top_logprobs, strict=True):
                assert abs(v - float(want[j, i])) <= tol, (p, j, i)
            compared += 1
    assert compared >= 8  # positions with the reference's context, over the 4 prompts


def reference_prompt_logprobs(container, ids: list[int]) -> torch.Tensor:
    ref = ReferenceModel.from_file(container, device="cuda", dtype=torch.float32)
    cfg = ref.config
    cache = PagedKVCache(KVCacheSpec(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                                     -(-len(ids) // 16) + 1, 16, dtype=torch.float32), device="cuda")
    seq = cache.new_sequence()
    meta = build_step_metadata([seq], [len(ids)], device="cuda")
    lg = ref.forward(torch.tensor(ids), meta, cache, all_logits=True)
    del ref
    return lg


def test_prompt_logprobs_match_reference(container, engine, prompts):
    ids = prompts[0]
    lg = reference_prompt_logprobs(container, ids)
    want = torch.log_softmax(lg, dim=-1).cpu()
    ulp = bf16_ulp(float(lg.abs().max()))
    twin = Engine.from_file(container, engine_config(backend="torch", mode="eager"))
    got_twin = run(twin, [ids], 1, prompt_logprobs=True)["0"][0].prompt_logprobs
    del twin
    torch.cuda.empty_cache()
    got = run(engine, [ids], 1, prompt_logprobs=True)["0"][0].prompt_logprobs
    assert len(got) == len(ids) and got[0] is None
    d_twin = max(abs(got_twin[t].logprob - float(want[t - 1, ids[t]])) for t in range(1, len(ids)))
    tol = 2 * d_twin + 2 * ulp
    for t in range(1, len(ids)):
        assert abs(got[t].logprob - float(want[t - 1, ids[t]])) <= tol, t
        assert list(got[t].top_logprobs) == sorted(got[t].top_logprobs, reverse=True)
