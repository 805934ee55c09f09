"""The reference model against HF transformers' Qwen2ForCausalLM on tiny random containers.

The same (dequantized) weights are loaded into transformers; our paged, batched, chunked forward must
give the same logits as HF's dense forward, for any block size and prefill chunking.
"""

from __future__ import annotations

import pytest
import torch
from engine_testkit import hf_greedy
from nanoqwen_model import ConfigError, Qwen2Config
from nanoqwen_runtime.backend import (
    BackendError,
    ContextLengthError,
    ReferenceBackend,
    TokenRequest,
    resolve_device,
)
from nanoqwen_runtime.kv_cache import KVCacheSpec, PagedKVCache, build_step_metadata
from nanoqwen_runtime.reference import ReferenceModel, WeightError, load_weights
from nanoqwen_runtime.sampling import SamplingParams
from nanoqwen_runtime.testing import hf_model, tiny_config

# Max |logit difference| / max |logit| allowed, by (matmul dtype, KV page dtype), derived for the
# 2-layer tiny model (K <= 256):
# - fp32 everywhere differs from HF only in summation order: ~10 matmul stages, each off by about
#   sqrt(K) * 2^-24 = 1e-6 of its scale, add to ~1e-5; bound 2e-5.
# - bf16 K/V pages: each stored key and value is rounded to bf16 (2^-9 relative); 4 rounded tensors
#   (K, V in 2 layers) give sqrt(4) x 2^-9 = 4e-3 of the attention output, and attention scores
#   q.k / sqrt(d) with |q||k| up to ~10 x sqrt(d) (the random qkv biases) amplify a key's error up to
#   ~5x through the softmax: 2e-2.
# - bf16 matmuls round each linear's input and output to bf16: 11 linears x 2 = 22 roundings of
#   2^-9, sqrt(22) x 2^-9 = 9e-3 of the logit scale as a random walk, plus the K/V term above: 5e-2.
TOLERANCE = {
    (torch.float32, torch.float32): 2e-5,
    (torch.float32, torch.bfloat16): 2e-2,
    (torch.bfloat16, torch.bfloat16): 5e-2,
}


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    vocab = tiny_config()["vocab_size"]
    return [torch.randint(0, vocab, (int(L),), generator=g).tolist()
            for L in torch.randint(3, 40, (n,), generator=g)]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("container", ["tiny_bf16", "tiny_int4"])
@pytest.mark.parametrize("dtype,kv_dtype", list(TOLERANCE))
def test_prefill_logits_match_hf(request, container, dtype, kv_dtype):
    path = request.getfixturevalue(container)
    hf = hf_model(path)
    model = ReferenceModel.from_file(path, dtype=dtype)
    cfg = model.config
    for ids in prompts(3):
        cache = PagedKVCache(KVCacheSpec(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                                         num_blocks=8, block_size=7, dtype=kv_dtype))
        meta = build_step_metadata([cache.new_sequence()], [len(ids)])
        ours = model.forward(torch.tensor(ids), meta, cache, all_logits=True)
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits[0]
        assert rel_err(ours, want) < TOLERANCE[(dtype, kv_dtype)]


@pytest.mark.parametrize("block_size,chunk", [(1, 1000), (5, 3), (16, 7)])
def test_batched_chunked_greedy_decode_matches_hf(tiny_int4, block_size, chunk):
    """Several sequences at once, prefill in chunks, paged decode: tokens and logits as HF's."""
    hf = hf_model(tiny_int4)
    backend = ReferenceBackend(ReferenceModel.from_file(tiny_int4, dtype=torch.float32),
                               block_size=block_size, prefill_chunk=chunk)
    ps = prompts(4, seed=block_size)
    steps = 6
    reqs = [TokenRequest(p, SamplingParams(max_tokens=steps)) for p in ps]
    got: dict[int, list[int]] = {i: [] for i in range(len(ps))}
    for events in backend.start(reqs):
        for ev in events:
            got[ev.request].append(ev.token_id)
    for i, p in enumerate(ps):
        assert got[i] == hf_greedy(hf, p, steps)


def test_decode_logits_match_hf_step_by_step(tiny_bf16):
    hf = hf_model(tiny_bf16)
    model = ReferenceModel.from_file(tiny_bf16, dtype=torch.float32)
    cfg = model.config
    cache = PagedKVCache(KVCacheSpec(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                                     num_blocks=40, block_size=4, dtype=torch.float32))
    ps = prompts(2, seed=3)
    seqs = [cache.new_sequence() for _ in ps]
    meta = build_step_metadata(seqs, [len(p) for p in ps])
    logits = model.forward(torch.tensor(ps[0] + ps[1]), meta, cache)
    toks = [list(p) for p in ps]
    for _ in range(5):
        nxt = logits.argmax(-1).tolist()
        for t, n in zip(toks, nxt, strict=True):
            t.append(n)
        with torch.no_grad():
            want = torch.stack([hf(torch.tensor([t])).logits[0, -1] for t in toks])
        meta = build_step_metadata(seqs, [1, 1])
        logits = model.forward(torch.tensor(nxt), meta, cache)
        assert rel_err(logits, want) < TOLERANCE[(torch.float32, torch.float32)]


def test_prompt_longer_than_context_is_refused(tiny_bf16):
    backend = ReferenceBackend.from_file(tiny_bf16)
    n = tiny_config()["max_position_embeddings"]
    with pytest.raises(ContextLengthError, match=f"prompt has {n} tokens but the context window is {n}"):
        backend.start([TokenRequest([1] * n)])
    limited = ReferenceBackend.from_file(tiny_bf16, max_context=20)
    with pytest.raises(ContextLengthError, match="context window is 20"):
        limited.start([TokenRequest([1] * 25)])
    # a fitting prompt generates until the context is full
    run = limited.start([TokenRequest([1] * 15, SamplingParams(max_tokens=50))])
    events = [e for step in run for e in step]
    assert len(events) == 5 and events[-1].finish_reason == "context"


def test_eos_and_max_tokens_finish(tiny_bf16):
    backend = ReferenceBackend.from_file(tiny_bf16)
    p = prompts(1, seed=9)[0]
    first = [e for s in backend.start([TokenRequest(p, SamplingParams(max_tokens=4))]) for e in s]
    assert [e.finish_reason for e in first] == [None, None, None, "length"]
    eos = first[2].token_id  # pretend the third token is an EOS id
    ended = [e for s in backend.start([TokenRequest(p, SamplingParams(max_tokens=4), frozenset({eos}))])
             for e in s]
    stop_at = next(i for i, e in enumerate(first) if e.token_id == eos)
    assert [e.token_id for e in ended] == [e.token_id for e in first[: stop_at + 1]]
    assert ended[-1].finish_reason == "eos"


def test_invalid_inputs(tiny_bf16, tmp_path):
    backend = ReferenceBackend.from_file(tiny_bf16)
    with pytest.raises(ValueError, match="out of range"):
        backend.start([TokenRequest([10**6])])
    with pytest.raises(ValueError, match="at least one prompt token"):
        TokenRequest([])
    with pytest.raises(BackendError, match="unknown device"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(BackendError, match="no CUDA GPU is available"):
            ReferenceBackend.from_file(tiny_bf16, device="cuda")
    cfg, weights = load_weights(tiny_bf16, dtype=torch.float32)
    del weights["layers.1.down"]
    with pytest.raises(WeightError, match="layers.1.down"):
        ReferenceModel(cfg, weights)
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        Qwen2Config.from_metadata({**tiny_config(), "num_key_value_heads": 0})
    with pytest.raises(ConfigError, match="hidden_size"):
        Qwen2Config.from_metadata({k: v for k, v in tiny_config().items() if k != "hidden_size"})
