"""The plain-torch forward against its oracle, HF transformers' Qwen2ForCausalLM, on a random model
in fp32; and the pieces the rest of nanoqwen builds on (chunked attention, the GPTQ stages).

Tolerance of the fp32-vs-fp32 comparisons (derived before measuring): both sides compute every op in
fp32 with the same formulas; only summation order and fused kernels differ. A dot product of length
K <= 256 in a different order moves by about sqrt(K) * 2^-24 ~ 1e-6 of the sum of |terms|. A logit
passes through 2 layers x 4 matmuls + attention + the head (~10 stages), each adding ~1e-6 relative
and RMSNorm re-scaling by O(1): about 1e-5 relative to the logit scale. Bound: 2e-5 x max |logit|.
"""

from __future__ import annotations

import pytest
import torch
from nanoqwen_model.config import Qwen2Config
from nanoqwen_model.forward import (
    apply_rope,
    attention_input,
    causal_attention,
    decoder_layer,
    dense_attend,
    forward,
    layer_weights,
    linear,
    mlp_input,
    rms_norm,
    rope_inv_freq,
    token_nll,
)

FP32_REL = 2e-5

CFG = Qwen2Config(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=32, intermediate_size=256, vocab_size=300, rope_theta=10000.0, rms_norm_eps=1e-6,
                  max_position_embeddings=256, tie_word_embeddings=False)


def random_weights(cfg: Qwen2Config, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = {}
    for name, shape in cfg.tensor_shapes().items():
        if len(shape) == 1:
            w[name] = (1.0 + 0.1 * torch.randn(shape, generator=g)) if "norm" in name else \
                0.5 * torch.randn(shape, generator=g)
        else:
            w[name] = torch.randn(shape, generator=g) / (shape[1] ** 0.5 if name != "embed_tokens" else 1.0)
    return w


def hf_model(cfg: Qwen2Config, w: dict[str, torch.Tensor]):
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.Qwen2Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta, tie_word_embeddings=False,
        attn_implementation="eager")
    model = transformers.Qwen2ForCausalLM(hf_cfg).float().eval()
    sd = {"model.embed_tokens.weight": w["embed_tokens"], "model.norm.weight": w["final_norm"],
          "lm_head.weight": w["lm_head"]}
    q, kv, i = cfg.q_dim, cfg.kv_dim, cfg.intermediate_size
    for layer in range(cfg.num_hidden_layers):
        p, m = f"layers.{layer}.", f"model.layers.{layer}."
        sd[m + "input_layernorm.weight"] = w[p + "input_norm"]
        sd[m + "post_attention_layernorm.weight"] = w[p + "post_attn_norm"]
        for name, lo, hi in (("q", 0, q), ("k", q, q + kv), ("v", q + kv, q + 2 * kv)):
            sd[m + f"self_attn.{name}_proj.weight"] = w[p + "qkv"][lo:hi]
            sd[m + f"self_attn.{name}_proj.bias"] = w[p + "qkv_bias"][lo:hi]
        sd[m + "self_attn.o_proj.weight"] = w[p + "o_proj"]
        sd[m + "mlp.gate_proj.weight"] = w[p + "gate_up"][:i]
        sd[m + "mlp.up_proj.weight"] = w[p + "gate_up"][i:]
        sd[m + "mlp.down_proj.weight"] = w[p + "down"]
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    return model


def test_forward_matches_hf():
    w = random_weights(CFG)
    hf = hf_model(CFG, w)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, CFG.vocab_size, (3, 37), generator=g)  # 3 sequences, odd length
    with torch.no_grad():
        want = hf(tokens).logits
        pos = torch.arange(37).repeat(3)
        got = forward(CFG, w, tokens.reshape(-1), pos, dense_attend(3, 37)).view(3, 37, -1)
    err = float((got - want).abs().max())
    assert err <= FP32_REL * float(want.abs().max()), err


def test_chunked_prefill_equals_whole_prompt():
    """A prompt run in chunks (queries at positions offset into a growing context, as a paged cache
    does) gives the logits of the whole prompt at once."""
    w = random_weights(CFG, seed=2)
    tokens = torch.randint(0, CFG.vocab_size, (40,), generator=torch.Generator().manual_seed(3))
    whole = forward(CFG, w, tokens, torch.arange(40), dense_attend(1, 40))
    ks, vs = {}, {}

    def cached_attend(layer, q, k, v):
        ks[layer] = torch.cat([ks.get(layer, k[:0]), k])
        vs[layer] = torch.cat([vs.get(layer, v[:0]), v])
        n = ks[layer].shape[0]
        return causal_attention(q, ks[layer], vs[layer], torch.arange(n - q.shape[0], n))

    chunks = ((0, 17), (17, 18), (18, 40))
    parts = [forward(CFG, w, tokens[a:b], torch.arange(a, b), cached_attend) for a, b in chunks]
    err = float((torch.cat(parts) - whole).abs().max())
    assert err <= FP32_REL * float(whole.abs().max()), err


def test_gptq_stages_compose_to_the_layer():
    w = random_weights(CFG, seed=4)
    lw = layer_weights(w, 1)
    h = torch.randn(2 * 9, CFG.hidden_size, generator=torch.Generator().manual_seed(5))
    pos = torch.arange(9).repeat(2)
    inv = rope_inv_freq(CFG.head_dim, CFG.rope_theta)
    attend = dense_attend(2, 9)
    a = attention_input(CFG, rms_norm(h, lw["input_norm"], CFG.rms_norm_eps), lw, pos, inv, attend, 1)
    h2 = h + linear(a, lw["o_proj"])
    m = mlp_input(CFG, rms_norm(h2, lw["post_attn_norm"], CFG.rms_norm_eps), lw["gate_up"])
    assert torch.equal(h2 + linear(m, lw["down"]), decoder_layer(CFG, h, lw, pos, inv, attend, 1))


def test_rope_is_a_rotation_and_matches_the_closed_form():
    inv = rope_inv_freq(64, 1e6)
    assert inv.dtype == torch.float32 and float(inv[0]) == 1.0
    x = torch.randn(5, 3, 64, generator=torch.Generator().manual_seed(6))
    pos = torch.tensor([0, 1, 7, 1000, 32767])
    y = apply_rope(x, pos, inv)
    assert torch.equal(y[0], x[0])  # position 0: identity
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-6)  # rotations keep the norm
    ang = pos[3].double() * inv[5].double()
    want = x[3, :, 5].double() * ang.cos() - x[3, :, 37].double() * ang.sin()
    assert torch.allclose(y[3, :, 5].double(), want, rtol=0, atol=1e-4)  # |x| ~ 3, fp32 angle ~1e3 rad


def test_token_nll_matches_cross_entropy_of_the_logits():
    w = random_weights(CFG, seed=7)
    h = torch.randn(700, CFG.hidden_size, generator=torch.Generator().manual_seed(8))
    targets = torch.randint(0, CFG.vocab_size, (700,))
    full = torch.nn.functional.cross_entropy(
        linear(rms_norm(h, w["final_norm"], CFG.rms_norm_eps), w["lm_head"]), targets, reduction="none")
    assert torch.allclose(token_nll(CFG, w, h, targets, chunk=256), full)


def test_bf16_weights_compute_in_bf16():
    """A bf16 weight makes the linear a bf16 matmul (as HF in bf16) and returns fp32."""
    x = torch.randn(4, 128)
    wt = torch.randn(16, 128).to(torch.bfloat16)
    y = linear(x, wt)
    assert y.dtype == torch.float32
    assert torch.equal(y, (x.to(torch.bfloat16) @ wt.t()).float())
