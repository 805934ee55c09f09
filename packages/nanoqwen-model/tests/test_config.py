"""`Qwen2Config`: strict parsing of the three sources, each with only its documented defaults."""

from __future__ import annotations

import pytest
from nanoqwen_model.config import (
    GGUF_DEFAULTS,
    HF_DEFAULTS,
    QWEN25_CODER_05B,
    QWEN25_CODER_7B,
    ConfigError,
    Qwen2Config,
    UnsupportedModelError,
)

HF_05B = {  # Qwen2.5-Coder-0.5B-Instruct's config.json (the keys that matter)
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896,
    "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
    "num_key_value_heads": 2, "max_position_embeddings": 32768, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "tie_word_embeddings": True, "vocab_size": 151936, "bos_token_id": 151643,
    "eos_token_id": 151645, "hidden_act": "silu", "use_sliding_window": False, "rope_scaling": None,
}

GGUF_05B = {
    "general.architecture": "qwen2", "qwen2.embedding_length": 896, "qwen2.block_count": 24,
    "qwen2.attention.head_count": 14, "qwen2.attention.head_count_kv": 2, "qwen2.feed_forward_length": 4864,
    "qwen2.rope.freq_base": 1000000.0, "qwen2.attention.layer_norm_rms_epsilon": 9.99999997e-07,
    "qwen2.context_length": 32768,
}


def gguf(fields):
    return Qwen2Config.from_gguf(fields, vocab_size=151936, tied=True, eos=[151645], bos=151643, pad=151643)


def test_hf_config_parses_to_the_05b_geometry():
    cfg = Qwen2Config.from_hf(HF_05B)
    assert cfg.with_(eos_token_id=QWEN25_CODER_05B.eos_token_id, bos_token_id=None,
                     pad_token_id=151643) == QWEN25_CODER_05B
    assert (cfg.head_dim, cfg.q_dim, cfg.kv_dim, cfg.qkv_dim, cfg.group) == (64, 896, 128, 1152, 7)
    assert cfg.eos_token_id == (151645,)


def test_gguf_and_hf_agree():
    from_hf = Qwen2Config.from_hf(HF_05B).with_(pad_token_id=151643)
    assert gguf(GGUF_05B) == from_hf
    assert gguf(GGUF_05B).rms_norm_eps == 1e-6  # the f32 value reads back as the config.json decimal


def test_metadata_round_trip_and_strictness():
    for cfg in (QWEN25_CODER_7B, QWEN25_CODER_05B):
        assert Qwen2Config.from_metadata(cfg.to_metadata()) == cfg
    meta = QWEN25_CODER_7B.to_metadata()
    for key in ("rope_theta", "head_dim", "rms_norm_eps", "tie_word_embeddings", "eos_token_id"):
        broken = {k: v for k, v in meta.items() if k != key}
        with pytest.raises(ConfigError, match=key):
            Qwen2Config.from_metadata(broken)
    with pytest.raises(UnsupportedModelError, match="llama"):
        Qwen2Config.from_metadata({**meta, "architecture": "llama"})
    with pytest.raises(ConfigError, match="hidden_size"):
        Qwen2Config.from_metadata({**meta, "hidden_size": "3584"})
    with pytest.raises(ConfigError, match="multiple"):
        Qwen2Config.from_metadata({**meta, "num_key_value_heads": 5})


def test_hf_defaults_are_transformers_defaults():
    """The defaults we fill in are the ones transformers itself uses for a missing key."""
    transformers = pytest.importorskip("transformers")
    ref = transformers.Qwen2Config()
    rope = getattr(ref, "rope_theta", None)
    if rope is None:  # transformers >= 5 keeps it in rope_parameters
        rope = ref.rope_parameters["rope_theta"]
    assert HF_DEFAULTS["rope_theta"] == rope
    for key in ("rms_norm_eps", "max_position_embeddings", "tie_word_embeddings"):
        assert HF_DEFAULTS[key] == getattr(ref, key), key
    minimal = {k: HF_05B[k] for k in ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                      "intermediate_size", "vocab_size")}
    cfg = Qwen2Config.from_hf(minimal)
    assert cfg.rope_theta == rope and cfg.num_key_value_heads == 14 and cfg.eos_token_id == ()


def test_hf_refuses_what_has_no_default_and_other_architectures():
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
        with pytest.raises(ConfigError, match=key):
            Qwen2Config.from_hf({k: v for k, v in HF_05B.items() if k != key})
    cases = (({"model_type": "llama"}, "llama"), ({"rope_scaling": {"type": "yarn"}}, "rope_scaling"),
             ({"use_sliding_window": True}, "sliding"), ({"hidden_act": "gelu"}, "gelu"),
             ({"architectures": ["Qwen2MoeForCausalLM"]}, "Moe"),
             ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6}}, "rope_parameters"))
    for bad, match in cases:
        with pytest.raises(UnsupportedModelError, match=match):
            Qwen2Config.from_hf({**HF_05B, **bad})


def test_gguf_defaults_and_required_keys():
    no_base = {k: v for k, v in GGUF_05B.items() if k != "qwen2.rope.freq_base"}
    assert gguf(no_base).rope_theta == GGUF_DEFAULTS["rope.freq_base"] == 10000.0
    no_kv = {k: v for k, v in GGUF_05B.items() if k != "qwen2.attention.head_count_kv"}
    assert gguf(no_kv).num_key_value_heads == 14
    for key in ("qwen2.attention.layer_norm_rms_epsilon", "qwen2.context_length", "qwen2.block_count"):
        with pytest.raises(ConfigError, match=key.split(".", 1)[1]):
            gguf({k: v for k, v in GGUF_05B.items() if k != key})
    with pytest.raises(UnsupportedModelError, match="llama"):
        gguf({**GGUF_05B, "general.architecture": "llama"})


def test_shapes_and_int4_layout():
    shapes = QWEN25_CODER_7B.tensor_shapes()
    assert shapes["layers.27.qkv"] == (4608, 3584) and shapes["lm_head"] == (152064, 3584)
    assert "lm_head" not in QWEN25_CODER_05B.tensor_shapes()
    assert len(QWEN25_CODER_05B.tensor_shapes(with_lm_head=True)) == 2 + 24 * 7 + 1
    QWEN25_CODER_7B.check_int4_layout()
    with pytest.raises(UnsupportedModelError, match="INT4"):
        QWEN25_CODER_7B.with_(intermediate_size=1000).check_int4_layout()
    assert QWEN25_CODER_7B.kv_bytes_per_token() == 28 * 2 * 512 * 2
