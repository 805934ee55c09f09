"""Perplexity of a `.nanoqwen` container on a text, with the plain-torch Qwen2 forward of `qwen2.py`.

The text is tokenized with the container's own tokenizer (`tokenizers`, from the tokenizer.json in
the metadata), cut into non-overlapping windows of `seq_len` tokens (a shorter last window is kept),
and every token after the first of its window is scored: `tokens` = sum over windows of (len - 1),
`perplexity` = exp(mean NLL). The forward runs layer by layer over all windows, dequantizing one
layer's weights at a time (int4 / int8 through nanoqwen_format's numpy references), so memory is
the activations plus one layer. fp32 math, CPU or CUDA.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from . import qwen2
from .config import Qwen2Config


@dataclass
class EvalResult:
    perplexity: float
    tokens: int
    nll: float  # mean negative log-likelihood (nats/token)
    windows: int
    seq_len: int
    seconds: float
    device: str
    model: str
    text: str

    def to_dict(self) -> dict:
        return asdict(self)


def load_f32(f, name: str, device: torch.device) -> torch.Tensor:
    """A container tensor as f32 on `device` (int4/int8 dequantized, bf16 widened)."""
    rec = f.records[name]
    if rec.encoding in ("int4", "int8"):
        a = f.dequantize(name)
        return torch.from_numpy(np.ascontiguousarray(a)).to(device)
    a = f.array(name)
    if a.dtype == np.uint16:
        return torch.from_numpy(np.array(a)).view(torch.bfloat16).to(device).float()
    return torch.from_numpy(np.array(a, dtype=np.float32)).to(device)


def config_from_container(meta: dict) -> Qwen2Config:
    c = dict(meta["config"])
    c.pop("architecture", None)
    return Qwen2Config(**c)


def perplexity(model: str | Path, text: str, seq_len: int = 1024, max_tokens: int | None = None,
               device: str = "auto", text_name: str = "") -> EvalResult:
    """Perplexity of `model` on `text` (see module docstring)."""
    import nanoqwen_format as nqf
    from tokenizers import Tokenizer

    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       ("cpu" if device == "auto" else device))
    t0 = time.perf_counter()
    with nqf.open(model) as f:
        cfg = config_from_container(f.metadata)
        tok = Tokenizer.from_str(f.tokenizer_json)
        ids = tok.encode(text, add_special_tokens=False).ids
        if max_tokens is not None:
            ids = ids[:max_tokens]
        if len(ids) < 2:
            raise ValueError("the evaluation text has fewer than 2 tokens")
        windows = [ids[s:s + seq_len] for s in range(0, len(ids), seq_len)]
        windows = [w for w in windows if len(w) >= 2]
        full = [w for w in windows if len(w) == seq_len]
        tail = [w for w in windows if len(w) != seq_len]
        total_nll, total_tok = 0.0, 0
        emb = load_f32(f, "embed_tokens", dev)
        head = load_f32(f, "lm_head", dev) if "lm_head" in f.records else emb
        groups = [torch.tensor(full, dtype=torch.long)] if full else []
        groups += [torch.tensor([w], dtype=torch.long) for w in tail]
        xs = [emb[g.to(dev)] for g in groups]
        if head is not emb:
            del emb
        rope = qwen2.rope_cos_sin(seq_len, cfg.head_dim, cfg.rope_theta, dev)
        for i in range(cfg.num_hidden_layers):
            p = f"layers.{i}."
            w = {k: load_f32(f, p + k, dev) for k in ("input_norm", "qkv", "qkv_bias", "o_proj",
                                                      "post_attn_norm", "gate_up", "down")}
            for j, x in enumerate(xs):
                xs[j] = torch.cat([qwen2.decoder_layer(cfg, x[b:b + 4], w, rope)
                                   for b in range(0, x.shape[0], 4)])
        norm = load_f32(f, "final_norm", dev)
        for g, x in zip(groups, xs, strict=True):
            nll = qwen2.token_nll(x[:, :-1], norm, head, g[:, 1:].to(dev), cfg.rms_norm_eps)
            total_nll += float(nll.double().sum())
            total_tok += nll.numel()
    mean = total_nll / total_tok
    return EvalResult(perplexity=math.exp(mean), tokens=total_tok, nll=mean, windows=len(windows),
                      seq_len=seq_len, seconds=time.perf_counter() - t0, device=str(dev), model=str(model),
                      text=text_name)
