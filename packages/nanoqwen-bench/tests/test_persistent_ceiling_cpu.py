"""The persistent-ceiling bench's model of a decode step (nanoqwen_bench.kernels.persistent_ceiling): its
phases are the ops in order, 5 per layer and lm_head, and their weight bytes are what the engine's own
count (`ModelWeights.decode_bytes`) says a step reads, less norms and the embedding row; the attention
phase is the layer's bf16 K and V at the context."""

from __future__ import annotations

import dataclasses

from nanoqwen_bench.kernels import persistent_ceiling as pc
from nanoqwen_model import QWEN25_CODER_7B
from nanoqwen_runtime.engine.synthetic import random_weights


def test_phases_are_the_engines_decode_bytes():
    g = dataclasses.replace(QWEN25_CODER_7B, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=64, intermediate_size=384, vocab_size=1000)
    phases = pc.step_phases_of(g, context=40)
    assert [op for op, _ in phases] == ["qkv", "attention", "o", "gate_up", "down"] * 2 + ["lm_head"]
    w = random_weights(g, "cpu").decode_bytes()
    bias = g.num_hidden_layers * (g.num_attention_heads + 2 * g.num_key_value_heads) * g.head_dim * 2
    weights = sum(b for op, b in phases if op != "attention")
    assert weights == w["int4_words"] + w["int4_scales"] + w["lm_head"] + bias
    kv = [b for op, b in phases if op == "attention"]
    assert kv == [40 * g.kv_bytes_per_token() // g.num_hidden_layers] * 2


def test_markdown_lists_every_variant_against_the_roofline():
    meta = {"device": "GPU", "date": "2026-12-07", "read_GBps": 3000.0, "command": "python -m x"}
    m = {"model": "7b", "blocks_per_sm": 4, "phases": 141, "step_bytes": 4_000_000_000,
         "roofline_s": 4e9 / 3e12,
         "variants": [{"name": "launches (one per phase)", "seconds": 2e-3, "frac_roofline": 0.667},
                      {"name": "back to back", "seconds": 1.4e-3, "frac_roofline": 0.952}],
         "us_per_phase_over_back_to_back": {"launches (one per phase)": 4.29}}
    text = "\n".join(pc.markdown(meta, [m]))
    assert "| 7b | 4 | 141 | 4000 | 1333 | launches (one per phase) | 2000 | 66.7% | 4.29 |" in text
    assert "| 7b | 4 | 141 | 4000 | 1333 | back to back | 1400 | 95.2% |  |" in text
