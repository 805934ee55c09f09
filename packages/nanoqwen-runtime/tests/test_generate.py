"""Pipeline: streamed text, stop conditions, seeds, batching and statistics (tiny random model)."""

from __future__ import annotations

import pytest
import torch
from nanoqwen_runtime import Pipeline, SamplingParams
from nanoqwen_runtime.backend import ContextLengthError


@pytest.fixture(scope="module")
def pipe(tiny_int4) -> Pipeline:
    return Pipeline.load(tiny_int4, device="cpu", dtype=torch.float32)


PROMPTS = ["def add(a, b):\n    return", "import os\nclass Foo:", "print('héllo 😀')"]


def test_stream_text_is_the_decoded_tokens(pipe):
    params = SamplingParams(temperature=0.9, seed=3, max_tokens=20)
    pieces: dict[int, list[str]] = {0: [], 1: [], 2: []}
    results = {}
    for ev in pipe.stream(PROMPTS, params):
        pieces[ev.index].append(ev.text)
        if ev.result is not None:
            results[ev.index] = ev.result
    for i in range(3):
        r = results[i]
        assert "".join(pieces[i]) == r.text
        visible = [t for t in r.token_ids if t not in pipe.eos_ids]
        assert r.text == pipe.tokenizer.decode(visible)
        assert r.prompt_tokens == len(pipe.tokenizer.encode(PROMPTS[i]))
        assert 1 <= r.generated_tokens <= 20
        assert r.finish_reason in ("eos", "length")
        assert r.ttft_s > 0 and (r.generated_tokens == 1 or r.decode_tok_s > 0)


def test_batch_equals_one_by_one_greedy(pipe):
    params = SamplingParams(max_tokens=12)
    together = pipe.generate(PROMPTS, params)
    alone = [pipe.generate([p], params)[0] for p in PROMPTS]
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]


def test_seeded_sampling_repeats(pipe):
    p = SamplingParams(temperature=1.2, top_k=50, top_p=0.95, seed=11, max_tokens=16)
    a = pipe.generate(PROMPTS[:1], p)[0]
    b = pipe.generate(PROMPTS[:1], p)[0]
    c = pipe.generate(PROMPTS[:1], p.with_(seed=12))[0]
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_stop_string_ends_generation_and_is_not_shown(pipe):
    base = pipe.generate(PROMPTS[:1], SamplingParams(max_tokens=24))[0]
    text = base.text
    assert len(text) >= 6, text
    stop = text[3:6]
    r = pipe.generate(PROMPTS[:1], SamplingParams(max_tokens=24, stop=(stop,)))[0]
    assert r.finish_reason == "stop"
    assert r.text == text[: text.find(stop)]
    assert r.generated_tokens <= base.generated_tokens


def test_eos_ids_come_from_the_container(pipe):
    assert pipe.eos_ids == frozenset(pipe.backend.config.eos_token_id)
    assert pipe.sampling_params().max_tokens == 32  # the container's generation defaults
    with pytest.raises(ValueError, match="top_p"):
        pipe.sampling_params(top_p=2.0)


def test_chat_prompt_and_context_refusal(pipe):
    prompt = pipe.chat_prompt([{"role": "user", "content": "hi"}])
    assert prompt.endswith("<|im_start|>assistant\n")
    with pytest.raises(ContextLengthError, match="context window is 256 tokens"):
        pipe.generate(["x" * 10_000], SamplingParams(max_tokens=4))
