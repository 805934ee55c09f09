"""Constrained decoding on the GPU: the token-mask op on CUDA against the bit-by-bit reference
(odd sizes, a poisoned strided tail that must stay untouched), and the real 0.5B (RTN INT4) engine in
graph mode running constrained and unconstrained rows in one captured decode step: the JSON rows are
valid and end with EOS, the free row's tokens are those it gets alone, the decode steps replayed
graphs (the mask is read from the graph's input buffer), and the grammar kept them synchronous."""

from __future__ import annotations

import json

import pytest
import torch
from nanoqwen_runtime.engine import Engine, EngineConfig, Request
from nanoqwen_runtime.grammar import compile_json_schema
from nanoqwen_runtime.sampling import SamplingParams
from nanoqwen_runtime.testing import engine_events
from nanoqwen_runtime.token_mask import allowed_tokens, apply_token_bitmask_, bit_values, bitmask_words

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("B,V", [(1, 1), (3, 31), (5, 33), (7, 1001), (64, 151936), (2, 152064)])
def test_token_mask_on_cuda_matches_the_bit_loop(B, V):
    g = torch.Generator().manual_seed(B * 100003 + V)
    W = bitmask_words(V)
    masks = torch.randint(-2**31, 2**31 - 1, (B, W), generator=g, dtype=torch.int64).to(torch.int32)
    masks[0] = -1
    pad = 8
    host = torch.randn(B, V + pad, generator=g).to(torch.bfloat16)
    host[:, V:] = float("nan")  # poison past V: the op must not touch it
    want = host.clone()
    for b in range(1, min(B, 4)):  # the bit loop on a few rows (it is slow at 152k)
        ok = torch.zeros(V, dtype=torch.bool)
        ok[allowed_tokens(masks[b], V)] = True
        want[b, :V][~ok] = float("-inf")
    dev = host.cuda()
    apply_token_bitmask_(dev[:, :V], masks.cuda(), bit_values("cuda"))
    got = dev.cpu()
    assert torch.equal(got[0, :V], host[0, :V])
    for b in range(1, min(B, 4)):
        assert torch.equal(got[b, :V], want[b, :V]), b
    assert torch.isnan(got[:, V:]).all()
    # every row against the CPU op (the same op on the CPU: checked bit by bit in test_grammar.py)
    cpu = host.clone()
    apply_token_bitmask_(cpu[:, :V], masks)
    assert torch.equal(got[:, :V], cpu[:, :V])


@pytest.mark.model
def test_graph_captured_step_masks_constrained_rows(qwen05b_packed):
    cfg = EngineConfig(kv_memory_bytes=1 << 30, max_model_len=2048, prefill_chunk=512)
    engine = Engine.from_file(qwen05b_packed("rtn"), cfg)
    tok = engine.tokenizer
    grammar = compile_json_schema({"type": "object", "properties": {"ok": {"type": "boolean"},
                                                                    "n": {"enum": [1, 2, 3]}},
                                   "required": ["ok", "n"], "additionalProperties": False})
    prompt = tok.encode("<|im_start|>user\nGive me a JSON object.<|im_end|>\n<|im_start|>assistant\n")
    alone, _ = engine_events(engine, [Request(list(prompt), SamplingParams(max_tokens=24), request_id="a")])
    replays = sum(engine.runner.replays.values())
    reqs = [Request(list(prompt), SamplingParams(max_tokens=24), request_id="free")]
    reqs += [Request(list(prompt), SamplingParams(max_tokens=24, temperature=0.8, seed=i),
                     request_id=f"j{i}", grammar=grammar) for i in range(5)]
    toks, fins = engine_events(engine, reqs)
    # the same tokens up to a near-tie: a batch of 6 runs another graph bucket than a batch of 1
    assert toks["free"][:4] == alone["a"][:4]
    for i in range(5):
        assert fins[f"j{i}"].reason == "eos", fins[f"j{i}"]
        doc = json.loads(tok.decode(toks[f"j{i}"][:-1]))
        assert set(doc) == {"ok", "n"} and isinstance(doc["ok"], bool) and doc["n"] in (1, 2, 3)
    assert sum(engine.runner.replays.values()) > replays  # decode steps replayed captured graphs
    assert engine.num_masked_rows == sum(len(toks[f"j{i}"]) for i in range(5))
    assert engine.num_steps_ahead_masked > 0  # masks taken after the forward of steps planned ahead
    engine.check_accounting()
