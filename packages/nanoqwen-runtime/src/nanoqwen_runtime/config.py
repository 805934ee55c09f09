"""Model configuration of the reference runtime, read from the container's `config` metadata map.

Key names are HF `config.json`'s (docs/DESIGN.md, "Metadata"). Derived sizes are computed once in
`__post_init__`; every field is checked so a malformed container fails here with the key's name, not
later with a shape error deep inside a matmul.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ModelConfig", "ConfigError"]


class ConfigError(ValueError):
    """The container's model config is missing a key or has an impossible value."""


@dataclass(frozen=True)
class ModelConfig:
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
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    # derived
    q_dim: int = field(init=False)
    kv_dim: int = field(init=False)
    qkv_dim: int = field(init=False)
    group: int = field(init=False)  # query heads per KV head (GQA)

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                     "head_dim", "intermediate_size", "vocab_size", "max_position_embeddings"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ConfigError(f"model config: {name} must be a positive integer, got {v!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"model config: {self.num_attention_heads} query heads are not a multiple of "
                              f"{self.num_key_value_heads} KV heads")
        if self.head_dim % 2:
            raise ConfigError(f"model config: head_dim must be even for RoPE, got {self.head_dim}")
        if not self.rope_theta > 0 or not self.rms_norm_eps > 0:
            raise ConfigError("model config: rope_theta and rms_norm_eps must be positive")
        object.__setattr__(self, "q_dim", self.num_attention_heads * self.head_dim)
        object.__setattr__(self, "kv_dim", self.num_key_value_heads * self.head_dim)
        object.__setattr__(self, "qkv_dim", self.q_dim + 2 * self.kv_dim)
        object.__setattr__(self, "group", self.num_attention_heads // self.num_key_value_heads)

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> ModelConfig:
        """From the container's `config` map (HF key names; `head_dim` derived when absent)."""
        arch = config.get("architecture", "qwen2")
        if arch != "qwen2":
            raise ConfigError(f"model config: architecture {arch!r} is not supported (only 'qwen2')")
        try:
            heads = int(config["num_attention_heads"])
            hidden = int(config["hidden_size"])
            eos = config.get("eos_token_id", [])
            eos = tuple(int(e) for e in (eos if isinstance(eos, list | tuple) else [eos]))
            return cls(
                hidden_size=hidden,
                num_hidden_layers=int(config["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(config["num_key_value_heads"]),
                head_dim=int(config.get("head_dim") or hidden // heads),
                intermediate_size=int(config["intermediate_size"]),
                vocab_size=int(config["vocab_size"]),
                rope_theta=float(config["rope_theta"]),
                rms_norm_eps=float(config["rms_norm_eps"]),
                max_position_embeddings=int(config["max_position_embeddings"]),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                eos_token_ids=eos,
                bos_token_id=config.get("bos_token_id"),
                pad_token_id=config.get("pad_token_id"),
            )
        except KeyError as e:
            raise ConfigError(f"model config: missing key {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"model config: bad value ({e})") from None
