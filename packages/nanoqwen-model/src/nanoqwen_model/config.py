"""`Qwen2Config`: the one description of a Qwen2 decoder in nanoqwen, and the strict parsers into it.

Every part of the stack reads the model's shape from this class: the packer (from an HF `config.json`
or GGUF metadata), the reference runtime, the CUDA engine and the benchmark (from the container's
`config` map), GPTQ calibration and perplexity evaluation. Field names are HF `config.json` keys.

Three sources, three parsers, one rule: **a value that is missing is an error unless its source
documents a default for it**, and then that default is used, written down in the tables below.

- `from_hf(config_json)`: defaults of transformers' `Qwen2Config` (`HF_DEFAULTS`). The geometry keys
  (hidden size, layers, heads, intermediate size, vocab size) have class defaults there too, but they
  describe one particular model (a Qwen1.5-7B-like shape), so a file without them is refused.
- `from_gguf(fields, ...)`: defaults of llama.cpp's GGUF loader for `qwen2` (`GGUF_DEFAULTS`); keys
  llama.cpp requires (context length, RMS epsilon, ...) are required here too.
- `from_metadata(config_map)`: the container's own `config` map (docs/DESIGN.md, "Metadata"). The
  packer writes every key, so there are no defaults: a missing key means a broken or foreign file.

The dense Qwen2 decoder is the only architecture accepted; MoE, VL, sliding-window and scaled-RoPE
variants are refused with `UnsupportedModelError` before any weight is read.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

__all__ = [
    "ConfigError", "UnsupportedModelError", "Qwen2Config", "HF_DEFAULTS", "GGUF_DEFAULTS",
    "QWEN25_CODER_7B", "QWEN25_CODER_15B", "QWEN25_CODER_05B", "QWEN25_CODER_GEOMETRIES",
]


class ConfigError(ValueError):
    """A model config is missing a key or has an impossible value."""


class UnsupportedModelError(ConfigError):
    """The checkpoint is not a dense Qwen2-family causal LM."""


# HF model types and architectures that are the dense Qwen2 decoder (Qwen2, Qwen2.5, Qwen2.5-Coder).
HF_MODEL_TYPES = ("qwen2",)
HF_ARCHITECTURES = ("Qwen2ForCausalLM",)
GGUF_ARCHITECTURES = ("qwen2",)

# transformers `Qwen2Config.__init__` defaults (configuration_qwen2.py). `num_key_value_heads` absent
# means multi-head attention (the docstring: "If it is not specified, will default to
# `num_attention_heads`"); `head_dim` absent means hidden_size // num_attention_heads (Qwen2Attention).
HF_DEFAULTS: dict[str, Any] = {
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": False,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
}

# llama.cpp's loader for LLM_ARCH_QWEN2 (llama-model.cpp / llama-hparams.h): `rope.freq_base` is
# optional with rope_freq_base_train = 10000; `attention.head_count_kv` is optional and defaults to
# `attention.head_count`. Context length, embedding length, block count, feed-forward length, head
# count and the RMS epsilon are read with required=true there, and are required here.
GGUF_DEFAULTS: dict[str, Any] = {"rope.freq_base": 10000.0}

_POSITIVE_INTS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "intermediate_size", "vocab_size", "max_position_embeddings")


@dataclass(frozen=True)
class Qwen2Config:
    """Shape and constants of a dense Qwen2 decoder. Field names are HF `config.json` keys.

    Derived once in `__post_init__`: `q_dim` = heads x head_dim (the attention width), `kv_dim` =
    KV heads x head_dim, `qkv_dim` = q_dim + 2 kv_dim (rows of the fused qkv weight), `group` = query
    heads per KV head (GQA).
    """

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_id: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    q_dim: int = field(init=False)
    kv_dim: int = field(init=False)
    qkv_dim: int = field(init=False)
    group: int = field(init=False)

    def __post_init__(self) -> None:
        for name in _POSITIVE_INTS:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ConfigError(f"model config: {name} must be a positive integer, got {v!r}")
        for name in ("rope_theta", "rms_norm_eps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
                raise ConfigError(f"model config: {name} must be a positive number, got {v!r}")
        if not isinstance(self.tie_word_embeddings, bool):
            raise ConfigError(f"model config: tie_word_embeddings must be a bool, got "
                              f"{self.tie_word_embeddings!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"model config: {self.num_attention_heads} query heads are not a multiple "
                              f"of {self.num_key_value_heads} KV heads")
        if self.head_dim % 2:
            raise ConfigError(f"model config: head_dim must be even for RoPE, got {self.head_dim}")
        eos = self.eos_token_id
        eos = (eos,) if isinstance(eos, int) else tuple(eos)
        for t in (*eos, self.bos_token_id, self.pad_token_id):
            if t is not None and (isinstance(t, bool) or not isinstance(t, int) or t < 0):
                raise ConfigError(f"model config: token ids must be integers >= 0, got {t!r}")
        object.__setattr__(self, "eos_token_id", eos)
        object.__setattr__(self, "rope_theta", float(self.rope_theta))
        object.__setattr__(self, "rms_norm_eps", float(self.rms_norm_eps))
        object.__setattr__(self, "q_dim", self.num_attention_heads * self.head_dim)
        object.__setattr__(self, "kv_dim", self.num_key_value_heads * self.head_dim)
        object.__setattr__(self, "qkv_dim", self.q_dim + 2 * self.kv_dim)
        object.__setattr__(self, "group", self.num_attention_heads // self.num_key_value_heads)

    # ---- shapes ----------------------------------------------------------------------------------
    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """[out_features, in_features] of the four fused linear weights of one layer."""
        h, i = self.hidden_size, self.intermediate_size
        return {"qkv": (self.qkv_dim, h), "o_proj": (h, self.q_dim), "gate_up": (2 * i, h), "down": (h, i)}

    def tensor_shapes(self, with_lm_head: bool | None = None) -> dict[str, tuple[int, ...]]:
        """Logical shape of every container tensor (docs/DESIGN.md names). `lm_head` is listed when
        `with_lm_head`, or by default when the embeddings are not tied."""
        h = self.hidden_size
        shapes: dict[str, tuple[int, ...]] = {"embed_tokens": (self.vocab_size, h)}
        lin = self.linear_shapes()
        for i in range(self.num_hidden_layers):
            p = f"layers.{i}."
            shapes.update({p + "input_norm": (h,), p + "qkv": lin["qkv"], p + "qkv_bias": (self.qkv_dim,),
                           p + "o_proj": lin["o_proj"], p + "post_attn_norm": (h,),
                           p + "gate_up": lin["gate_up"], p + "down": lin["down"]})
        shapes["final_norm"] = (h,)
        if with_lm_head if with_lm_head is not None else not self.tie_word_embeddings:
            shapes["lm_head"] = (self.vocab_size, h)
        return shapes

    def check_int4_layout(self) -> None:
        """Raise UnsupportedModelError unless every projection fits the INT4 tile layout of DESIGN.md
        (N % 8 == 0 and K % 128 == 0; true of every Qwen2 size from 0.5B to 32B)."""
        bad = [f"{n} [{o}, {i}]" for n, (o, i) in self.linear_shapes().items() if o % 8 or i % 128]
        if bad:
            raise UnsupportedModelError(f"projections {', '.join(bad)} do not fit the INT4 tile layout "
                                        "(out_features % 8 == 0, in_features % 128 == 0)")

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """K and V of one token over all layers (bf16 by default)."""
        return self.num_hidden_layers * 2 * self.kv_dim * dtype_bytes

    def with_(self, **changes) -> Qwen2Config:
        """A copy with some fields changed (derived fields are derived again)."""
        return replace(self, **changes)

    # ---- the container's `config` map --------------------------------------------------------------
    def to_metadata(self) -> dict[str, Any]:
        """The container's `config` map (DESIGN.md, "Metadata"); `from_metadata` inverts it."""
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.init}
        d["eos_token_id"] = list(self.eos_token_id)
        return {"architecture": "qwen2", **d}

    @classmethod
    def from_metadata(cls, config: Mapping[str, Any]) -> Qwen2Config:
        """From a container's `config` map. Every key the packer writes is required (no defaults)."""
        if not isinstance(config, Mapping):
            raise ConfigError(f"model config: expected a map, got {type(config).__name__}")
        arch = config.get("architecture")
        if arch != "qwen2":
            raise UnsupportedModelError(f"model config: architecture {arch!r} is not supported "
                                        "(only 'qwen2')")
        required = [f.name for f in fields(cls) if f.init]
        missing = [k for k in required if k not in config]
        if missing:
            raise ConfigError(f"model config: missing keys {missing} (the container's config map must "
                              "have every key of docs/DESIGN.md)")
        return cls(**{k: _plain(config[k], k) for k in required})

    # ---- sources ---------------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> Qwen2Config:
        """From an HF `config.json` map; HF_DEFAULTS fill only the keys transformers documents."""
        model_type = cfg.get("model_type")
        if model_type not in HF_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported: nanoqwen runs only {HF_MODEL_TYPES} "
                "(Qwen2 / Qwen2.5 / Qwen2.5-Coder dense models)")
        archs = cfg.get("architectures") or []
        if archs and not any(a in HF_ARCHITECTURES for a in archs):
            raise UnsupportedModelError(f"architectures {archs} are not supported: need {HF_ARCHITECTURES}")
        if cfg.get("rope_scaling"):
            raise UnsupportedModelError(f"rope_scaling {cfg['rope_scaling']!r} is not supported")
        rope = cfg.get("rope_parameters")  # transformers >= 5 writes rope_theta inside this map
        if rope:
            if rope.get("rope_type", "default") != "default":
                raise UnsupportedModelError(f"rope_parameters {rope!r} are not supported (default RoPE only)")
            cfg = {**cfg, "rope_theta": rope.get("rope_theta", cfg.get("rope_theta"))}
        if cfg.get("use_sliding_window"):
            raise UnsupportedModelError("use_sliding_window=true is not supported")
        if cfg.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {cfg['hidden_act']!r} is not supported (Qwen2: silu)")
        need = ["hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"]
        missing = [k for k in need if cfg.get(k) is None]
        if missing:
            raise ConfigError(f"config.json lacks the required keys {missing} (they have no Qwen2 default)")
        heads = _plain(cfg["num_attention_heads"], "num_attention_heads")
        hidden = _plain(cfg["hidden_size"], "hidden_size")
        value = {k: (cfg[k] if cfg.get(k) is not None else HF_DEFAULTS[k]) for k in HF_DEFAULTS}
        eos = value["eos_token_id"]
        return cls(
            hidden_size=hidden,
            num_hidden_layers=_plain(cfg["num_hidden_layers"], "num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=_plain(cfg.get("num_key_value_heads") or heads, "num_key_value_heads"),
            head_dim=_plain(cfg.get("head_dim") or _div(hidden, heads), "head_dim"),
            intermediate_size=_plain(cfg["intermediate_size"], "intermediate_size"),
            vocab_size=_plain(cfg["vocab_size"], "vocab_size"),
            rope_theta=_plain(value["rope_theta"], "rope_theta"),
            rms_norm_eps=_plain(value["rms_norm_eps"], "rms_norm_eps"),
            max_position_embeddings=_plain(value["max_position_embeddings"], "max_position_embeddings"),
            tie_word_embeddings=_plain(value["tie_word_embeddings"], "tie_word_embeddings"),
            eos_token_id=() if eos is None else _plain(eos, "eos_token_id"),
            bos_token_id=_plain(value["bos_token_id"], "bos_token_id"),
            pad_token_id=_plain(value["pad_token_id"], "pad_token_id"),
        )

    @classmethod
    def from_gguf(cls, fields_: Mapping[str, Any], *, vocab_size: int, tied: bool, eos: list[int],
                  bos: int | None, pad: int | None) -> Qwen2Config:
        """From GGUF key/values (`fields_`: key -> python value). Token ids and the vocabulary size
        come from the tokenizer and tensor table, which the caller reads."""
        arch = fields_.get("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise UnsupportedModelError(f"GGUF general.architecture {arch!r} is not supported: "
                                        f"nanoqwen runs only {GGUF_ARCHITECTURES}")
        a = f"{arch}."

        def get(key: str):
            if a + key in fields_:
                return fields_[a + key]
            if key in GGUF_DEFAULTS:
                return GGUF_DEFAULTS[key]
            raise ConfigError(f"GGUF metadata lacks the required key {a + key!r}")

        heads = int(get("attention.head_count"))
        hidden = int(get("embedding_length"))
        return cls(
            hidden_size=hidden,
            num_hidden_layers=int(get("block_count")),
            num_attention_heads=heads,
            num_key_value_heads=int(fields_.get(a + "attention.head_count_kv", heads)),
            head_dim=_div(hidden, heads),
            intermediate_size=int(get("feed_forward_length")),
            vocab_size=int(vocab_size),
            rope_theta=_f32_to_decimal(get("rope.freq_base")),
            rms_norm_eps=_f32_to_decimal(get("attention.layer_norm_rms_epsilon")),
            max_position_embeddings=int(get("context_length")),
            tie_word_embeddings=bool(tied),
            eos_token_id=tuple(int(e) for e in eos),
            bos_token_id=bos,
            pad_token_id=pad,
        )


def _plain(v: Any, name: str) -> Any:
    """Reject values of the wrong kind with the key's name (msgpack and JSON give ints, floats,
    bools, lists and None)."""
    if isinstance(v, list | tuple):
        return tuple(_plain(x, name) for x in v)
    if v is None or isinstance(v, bool | int | float):
        return v
    raise ConfigError(f"model config: {name} has a value of type {type(v).__name__}: {v!r}")


def _div(hidden: int, heads: int) -> int:
    if not isinstance(hidden, int) or not isinstance(heads, int) or heads <= 0 or hidden % heads:
        raise ConfigError(f"model config: hidden_size {hidden!r} is not a multiple of "
                          f"num_attention_heads {heads!r}, and head_dim is not given")
    return hidden // heads


def _f32_to_decimal(x: float) -> float:
    """GGUF stores floats as f32: 1e-6 reads back as 9.99999997e-07. The shortest decimal that rounds
    to the same f32 (7 significant digits suffice) is the value the HF config.json had."""
    return float(f"{float(x):.7g}")


# Qwen2.5-Coder-7B, 1.5B and 0.5B (../shared/TEST-MODELS.md): the synthetic engine models and the
# benchmarks' geometries.
QWEN25_CODER_7B = Qwen2Config(
    hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, head_dim=128,
    intermediate_size=18944, vocab_size=152064, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
    max_position_embeddings=32768, tie_word_embeddings=False, eos_token_id=(151645, 151643),
    bos_token_id=None, pad_token_id=151643)
QWEN25_CODER_15B = Qwen2Config(
    hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, head_dim=128,
    intermediate_size=8960, vocab_size=151936, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
    max_position_embeddings=32768, tie_word_embeddings=True, eos_token_id=(151645, 151643),
    bos_token_id=None, pad_token_id=151643)
QWEN25_CODER_05B = Qwen2Config(
    hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, head_dim=64,
    intermediate_size=4864, vocab_size=151936, rope_theta=1_000_000.0, rms_norm_eps=1e-6,
    max_position_embeddings=32768, tie_word_embeddings=True, eos_token_id=(151645, 151643),
    bos_token_id=None, pad_token_id=151643)
# by the names the benchmarks take (`nanoqwen-cli bench --geometry`, the kernel benches' --model)
QWEN25_CODER_GEOMETRIES = {"7b": QWEN25_CODER_7B, "1.5b": QWEN25_CODER_15B, "0.5b": QWEN25_CODER_05B}
