"""Random, well-scaled Qwen2 decoder-layer weights under HF checkpoint names.

For tests and benchmarks that need a checkpoint of a given geometry without a real model: linear
weights ~ N(0, 1/fan_in) so activations keep their scale through the layers, norms near 1, small
biases; never zeros. All tensors are bf16 [out_features, in_features] like an HF safetensors file.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def random_layer(config: Mapping[str, Any], i: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """HF-named bf16 weights of decoder layer `i` of a Qwen2 `config` (config.json keys), drawn from
    `generator` in a fixed order (so a seed reproduces the same checkpoint)."""
    h, inter = config["hidden_size"], config["intermediate_size"]
    d = h // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * d
    p = f"model.layers.{i}."

    def rnd(*shape, scale):
        return (torch.randn(*shape, generator=generator) * scale).to(torch.bfloat16)

    return {
        p + "input_layernorm.weight": 1 + rnd(h, scale=0.1),
        p + "post_attention_layernorm.weight": 1 + rnd(h, scale=0.1),
        p + "self_attn.q_proj.weight": rnd(h, h, scale=h ** -0.5),
        p + "self_attn.q_proj.bias": rnd(h, scale=0.1),
        p + "self_attn.k_proj.weight": rnd(kv, h, scale=h ** -0.5),
        p + "self_attn.k_proj.bias": rnd(kv, scale=0.1),
        p + "self_attn.v_proj.weight": rnd(kv, h, scale=h ** -0.5),
        p + "self_attn.v_proj.bias": rnd(kv, scale=0.1),
        p + "self_attn.o_proj.weight": rnd(h, h, scale=h ** -0.5),
        p + "mlp.gate_proj.weight": rnd(inter, h, scale=h ** -0.5),
        p + "mlp.up_proj.weight": rnd(inter, h, scale=h ** -0.5),
        p + "mlp.down_proj.weight": rnd(h, inter, scale=inter ** -0.5),
    }
