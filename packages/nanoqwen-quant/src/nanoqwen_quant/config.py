"""Qwen2 model configuration: the one architecture nanoqwen accepts, and the checks that refuse the rest.

Every source (HF config.json, GGUF metadata) is turned into a `Qwen2Config` before any weight is read,
so an unsupported model is refused with a clear `UnsupportedModelError` before any work is done. The
dataclass also checks the INT4 tile layout constraints of DESIGN.md (`N % 8 == 0`, `K % 128 == 0` for
every projection), which every Qwen2 / Qwen2.5 / Qwen2.5-Coder size from 0.5B to 32B meets.

`to_metadata()` gives the `config` map of the container, with HF `config.json` key names.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


class UnsupportedModelError(ValueError):
    """The checkpoint is not a dense Qwen2-family causal LM that nanoqwen can pack."""


# HF model types and architectures that are the dense Qwen2 decoder (Qwen2, Qwen2.5, Qwen2.5-Coder).
# Qwen2-MoE, Qwen2-VL, Qwen2-Audio and Qwen3 have other blocks and are refused.
HF_MODEL_TYPES = ("qwen2",)
HF_ARCHITECTURES = ("Qwen2ForCausalLM",)
GGUF_ARCHITECTURES = ("qwen2",)


@dataclass(frozen=True)
class Qwen2Config:
    """Geometry and constants of a Qwen2 decoder. Field names are HF `config.json` keys."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_id: list[int]
    pad_token_id: int | None
    head_dim: int = 0  # 0: derived as hidden_size // num_attention_heads (Qwen2 never sets it apart)
    architecture: str = "qwen2"
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        self.validate()

    # derived sizes ---------------------------------------------------------------------------
    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def qkv_size(self) -> int:
        return self.q_size + 2 * self.kv_size

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """[out_features, in_features] of the four fused linear weights of one layer."""
        return {
            "qkv": (self.qkv_size, self.hidden_size),
            "o_proj": (self.hidden_size, self.q_size),
            "gate_up": (2 * self.intermediate_size, self.hidden_size),
            "down": (self.hidden_size, self.intermediate_size),
        }

    def validate(self) -> None:
        problems = []
        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                     "intermediate_size", "vocab_size", "head_dim"):
            if int(getattr(self, name)) <= 0:
                problems.append(f"{name} must be positive, got {getattr(self, name)}")
        if not problems:
            if self.num_attention_heads % self.num_key_value_heads:
                problems.append("num_attention_heads must be a multiple of num_key_value_heads")
            if self.head_dim % 2:
                problems.append(f"head_dim must be even for RoPE, got {self.head_dim}")
            for name, (n, k) in self.linear_shapes().items():
                if n % 8 or k % 128:
                    problems.append(f"{name} [{n}, {k}] does not fit the INT4 tile layout (N%8, K%128)")
        if problems:
            raise UnsupportedModelError("unsupported Qwen2 geometry: " + "; ".join(problems))

    def to_metadata(self) -> dict:
        d = asdict(self)
        d.pop("extra")
        d["rope_theta"] = float(d["rope_theta"])
        d["rms_norm_eps"] = float(d["rms_norm_eps"])
        d["eos_token_id"] = [int(e) for e in d["eos_token_id"]]
        return d

    # constructors ----------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, cfg: dict) -> Qwen2Config:
        """Build from an HF `config.json` dict; raise UnsupportedModelError for anything not Qwen2."""
        model_type = cfg.get("model_type")
        archs = cfg.get("architectures") or []
        if model_type not in HF_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported: nanoqwen packs only {HF_MODEL_TYPES} "
                f"(Qwen2 / Qwen2.5 / Qwen2.5-Coder dense models)")
        if archs and not any(a in HF_ARCHITECTURES for a in archs):
            raise UnsupportedModelError(f"architectures {archs} are not supported: need {HF_ARCHITECTURES}")
        if cfg.get("rope_scaling"):
            raise UnsupportedModelError(f"rope_scaling {cfg['rope_scaling']!r} is not supported")
        if cfg.get("use_sliding_window"):
            raise UnsupportedModelError("use_sliding_window=true is not supported")
        eos = cfg.get("eos_token_id")
        eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        try:
            return cls(
                hidden_size=int(cfg["hidden_size"]),
                num_hidden_layers=int(cfg["num_hidden_layers"]),
                num_attention_heads=int(cfg["num_attention_heads"]),
                num_key_value_heads=int(cfg.get("num_key_value_heads", cfg["num_attention_heads"])),
                intermediate_size=int(cfg["intermediate_size"]),
                vocab_size=int(cfg["vocab_size"]),
                rope_theta=float(cfg.get("rope_theta", 10000.0)),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_id=eos,
                pad_token_id=cfg.get("pad_token_id"),
                head_dim=int(cfg.get("head_dim") or 0),
            )
        except KeyError as e:
            raise UnsupportedModelError(f"config.json lacks the required key {e.args[0]!r}") from None

    @classmethod
    def from_gguf_fields(cls, fields: dict, *, vocab_size: int, tied: bool, eos: list[int],
                         bos: int | None, pad: int | None) -> Qwen2Config:
        """Build from GGUF key/values (`fields`: key -> python value); refuse non-qwen2 archs."""
        arch = fields.get("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise UnsupportedModelError(
                f"GGUF general.architecture {arch!r} is not supported: "
                f"nanoqwen packs only {GGUF_ARCHITECTURES}")
        a = arch
        try:
            n_heads = int(fields[f"{a}.attention.head_count"])
            return cls(
                hidden_size=int(fields[f"{a}.embedding_length"]),
                num_hidden_layers=int(fields[f"{a}.block_count"]),
                num_attention_heads=n_heads,
                num_key_value_heads=int(fields.get(f"{a}.attention.head_count_kv", n_heads)),
                intermediate_size=int(fields[f"{a}.feed_forward_length"]),
                vocab_size=vocab_size,
                rope_theta=_f32_to_decimal(fields.get(f"{a}.rope.freq_base", 10000.0)),
                rms_norm_eps=_f32_to_decimal(fields.get(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
                max_position_embeddings=int(fields.get(f"{a}.context_length", 32768)),
                tie_word_embeddings=tied,
                bos_token_id=bos,
                eos_token_id=eos,
                pad_token_id=pad,
            )
        except KeyError as e:
            raise UnsupportedModelError(f"GGUF metadata lacks the required key {e.args[0]!r}") from None


def _f32_to_decimal(x: float) -> float:
    """GGUF stores floats as f32: 1e-6 reads back as 9.99999997e-07. The shortest decimal that rounds
    to the same f32 (7 significant digits suffice) is the value the HF config.json had."""
    return float(f"{float(x):.7g}")
