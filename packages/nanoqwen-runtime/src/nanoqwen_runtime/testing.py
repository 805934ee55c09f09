"""Tiny random Qwen2 containers for tests (this package's, the CLI's, the engine's).

`write_tiny_container(path, ...)` writes a complete `.nanoqwen` file in well under a second: a small
Qwen2 geometry with random, well-scaled weights (never zeros), a hand-built byte-level BPE tokenizer
(256 byte tokens, a few dozen merges, the Qwen special tokens) and the Qwen chat template. Linear
weights are bf16 or INT4 (RTN through nanoqwen_format); `weights_of(path)` returns the same weights as
dequantized float32 tensors, in HF Qwen2 names, so tests can load them into transformers as an oracle.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from os import PathLike
from pathlib import Path

import numpy as np
import torch

from .tokenizer import bytes_to_unicode

__all__ = ["TINY_CONFIG", "tiny_config", "QWEN_CHAT_TEMPLATE", "tiny_tokenizer_json", "write_tiny_container",
           "hf_state_dict", "hf_model", "engine_events"]

# Multiples of 128 along every input dimension, so INT4 (tile 8x128) works.
TINY_CONFIG = {
    "architecture": "qwen2",
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 256,
    "vocab_size": 0,  # set from the tokenizer (bytes + merges + specials)
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
    # ids of <|endoftext|>, <|im_end|> (filled in by `tiny_config`)
}

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>"]

QWEN_CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "{%- else %}\n"
    "    {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == 'user') or (message.role == 'system' and not loop.first)"
    " or (message.role == 'assistant') %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)

QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")

_MERGE_WORDS = ["def", "return", "self", "import", "print", "class", " the", "in", "for", "    ", "()", "):"]


def tiny_tokenizer_json() -> str:
    """An HF tokenizer.json: Qwen2 pre-tokenizer, 256 byte tokens, merges spelling a few code words."""
    b2u = bytes_to_unicode()
    vocab = {b2u[b]: b for b in range(256)}
    merges: list[list[str]] = []
    for word in _MERGE_WORDS:
        chars = [b2u[b] for b in word.encode()]
        cur = chars[0]
        for c in chars[1:]:
            if cur + c not in vocab:
                merges.append([cur, c])
                vocab[cur + c] = len(vocab)
            cur = cur + c
    added = [{"id": len(vocab) + i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": s != "<tool_call>"} for i, s in enumerate(SPECIALS)]
    spec = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN2_PATTERN}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": merges},
    }
    return json.dumps(spec, ensure_ascii=False)


def tiny_config(overrides: dict | None = None) -> dict:
    """TINY_CONFIG with the vocabulary size and special-token ids of `tiny_tokenizer_json()`."""
    spec = json.loads(tiny_tokenizer_json())
    ids = {t["content"]: t["id"] for t in spec["added_tokens"]}
    cfg = {**TINY_CONFIG, "vocab_size": max(ids.values()) + 1, "bos_token_id": ids["<|endoftext|>"],
           "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]], "pad_token_id": ids["<|endoftext|>"]}
    cfg.update(overrides or {})
    return cfg


def _random_weights(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd, nq, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    qkv = (nq + 2 * nkv) * hd

    def mat(n, k):
        return torch.randn(n, k, generator=g) / k**0.5

    def norm(n):
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    w = {"embed_tokens": torch.randn(v, h, generator=g), "final_norm": norm(h), "lm_head": mat(v, h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        w[p + "input_norm"] = norm(h)
        w[p + "qkv"] = mat(qkv, h)
        w[p + "qkv_bias"] = 0.5 * torch.randn(qkv, generator=g)
        w[p + "o_proj"] = mat(h, nq * hd)
        w[p + "post_attn_norm"] = norm(h)
        w[p + "gate_up"] = mat(2 * inter, h)
        w[p + "down"] = mat(h, inter)
    return w


def write_tiny_container(path: str | PathLike, method: str = "none", seed: int = 0,
                         config_overrides: dict | None = None,
                         edit: Callable[[str, object], object] | None = None) -> Path:
    """Write a tiny random model. method: "none" (bf16 linears) or "rtn" (INT4, group 128, symmetric).

    `edit(name, value)`, when given, sees each tensor before it is written (a float32 array, or the
    `QuantizedTensor` of an INT4 linear) and returns what to write instead: tests plant NaN, Inf or
    huge values with it, under valid checksums."""
    import nanoqwen_format as nqf

    if method not in ("none", "rtn"):
        raise ValueError(f"method must be 'none' or 'rtn', got {method!r}")
    cfg = tiny_config(config_overrides)
    weights = _random_weights(cfg, seed)
    path = Path(path)
    with nqf.Writer(path) as w:
        for name, t in weights.items():
            a = t.float().numpy()
            is_linear = name.split(".")[-1] in ("qkv", "o_proj", "gate_up", "down")
            value = np.ascontiguousarray(a)
            if method == "rtn" and is_linear:
                value = nqf.int4.quantize_rtn(value, 128, True)
            if edit is not None:
                value = edit(name, value)
            if isinstance(value, nqf.QuantizedTensor):
                w.add_quantized(name, value)
            else:
                w.add_array(name, value, encoding="bf16")
        w.set_metadata({
            "config": cfg,
            "tokenizer": tiny_tokenizer_json(),
            "chat_template": QWEN_CHAT_TEMPLATE,
            "generation": {"eos_token_ids": list(cfg["eos_token_id"]), "temperature": 0.0, "top_p": 1.0,
                           "top_k": 0, "max_new_tokens": 32},
            "quantization": {"method": method, "bits": 16 if method == "none" else 4,
                             "group_size": None if method == "none" else 128,
                             "symmetric": None if method == "none" else True, "lm_head": "bf16"},
            "provenance": {"source": "nanoqwen_runtime.testing (random)", "source_sha256": "", "tools": {}},
        })
    return path


def hf_state_dict(path: str | PathLike) -> dict[str, torch.Tensor]:
    """The container's weights (dequantized, float32) under HF Qwen2ForCausalLM names."""
    import nanoqwen_format as nqf

    with nqf.open(path) as f:
        cfg = f.config

        def get(name: str) -> torch.Tensor:
            rec = f.records[name]
            if rec.encoding == "bf16":
                return torch.from_numpy(f.array(name).copy()).view(torch.bfloat16).float()
            if rec.encoding in ("f16", "f32"):
                return torch.from_numpy(f.array(name).copy()).float()
            return torch.from_numpy(f.dequantize(name))

        hd = cfg["head_dim"]
        q_dim = cfg["num_attention_heads"] * hd
        kv_dim = cfg["num_key_value_heads"] * hd
        inter = cfg["intermediate_size"]
        sd = {"model.embed_tokens.weight": get("embed_tokens"), "model.norm.weight": get("final_norm")}
        sd["lm_head.weight"] = get("lm_head") if "lm_head" in f.records else sd["model.embed_tokens.weight"]
        for i in range(cfg["num_hidden_layers"]):
            p, m = f"layers.{i}.", f"model.layers.{i}."
            sd[m + "input_layernorm.weight"] = get(p + "input_norm")
            sd[m + "post_attention_layernorm.weight"] = get(p + "post_attn_norm")
            qkv, b = get(p + "qkv"), get(p + "qkv_bias")
            for name, lo, hi in (("q", 0, q_dim), ("k", q_dim, q_dim + kv_dim),
                                 ("v", q_dim + kv_dim, q_dim + 2 * kv_dim)):
                sd[m + f"self_attn.{name}_proj.weight"] = qkv[lo:hi]
                sd[m + f"self_attn.{name}_proj.bias"] = b[lo:hi]
            sd[m + "self_attn.o_proj.weight"] = get(p + "o_proj")
            gu = get(p + "gate_up")
            sd[m + "mlp.gate_proj.weight"] = gu[:inter]
            sd[m + "mlp.up_proj.weight"] = gu[inter:]
            sd[m + "mlp.down_proj.weight"] = get(p + "down")
    return sd


def hf_model(path: str | PathLike):
    """transformers' Qwen2ForCausalLM (fp32, eager attention) holding the container's weights,
    dequantized: the oracle of the reference runtime on any container. Needs transformers."""
    import nanoqwen_format as nqf
    import transformers
    from nanoqwen_model import Qwen2Config

    with nqf.open(path) as f:
        cfg = Qwen2Config.from_metadata(f.config)
    hf_cfg = transformers.Qwen2Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_word_embeddings, attn_implementation="eager")
    model = transformers.Qwen2ForCausalLM(hf_cfg).float().eval()
    missing, unexpected = model.load_state_dict(hf_state_dict(path), strict=False)
    if unexpected or any("rotary" not in m for m in missing):
        raise RuntimeError(f"weights do not fit HF's Qwen2: missing {missing}, unexpected {unexpected}")
    return model


def engine_events(engine, requests) -> tuple[dict, dict]:
    """Run `requests` on an engine to the end: ({request_id: [token ids]}, {request_id: FinishEvent})."""
    from .events import TokenEvent

    toks: dict = {}
    fins: dict = {}
    for ev in engine.generate(requests):
        if isinstance(ev, TokenEvent):
            toks.setdefault(ev.request, []).append(ev.token_id)
        else:
            fins[ev.request_id] = ev
    return toks, fins
