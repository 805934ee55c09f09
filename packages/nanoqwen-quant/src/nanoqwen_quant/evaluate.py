"""Perplexity of a `.nanoqwen` container on a text, with nanoqwen_model's plain-torch forward.

The text is tokenized with the container's own tokenizer (`tokenizers`, from the tokenizer.json in
the metadata), cut into non-overlapping windows of `seq_len` tokens (a shorter last window is kept),
and every token after the first of its window is scored: `tokens` = sum over windows of (len - 1),
`perplexity` = exp(mean NLL). The forward runs layer by layer over all windows, dequantizing one
layer's weights at a time (int4 / int8 through nanoqwen_format's numpy references), so memory is
the activations plus one layer. Weights are widened to f32, so every linear is fp32 (the forward
computes in the weight's dtype): the same numbers on CPU and CUDA up to fp32 summation order.

Windows of equal length are one flat token batch for the forward (`dense_attend(n, seq_len)`,
positions 0..seq_len-1 in each), processed EVAL_BATCH windows at a time to bound the attention
scores' memory.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import nanoqwen_format as nqf
import nanoqwen_model.forward as fwd
import numpy as np
import torch
from nanoqwen_model.config import Qwen2Config

from .options import UsageError, resolve_device

EVAL_BATCH = 4  # windows per forward call


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


def perplexity(model: str | Path, text: str, seq_len: int = 1024, max_tokens: int | None = None,
               device: str = "auto", text_name: str = "") -> EvalResult:
    """Perplexity of `model` on `text` (see module docstring). UsageError for seq_len < 2, max_tokens < 2
    or a device string other than auto / cpu / cuda[:N]; DeviceError when CUDA is asked for and absent."""
    from tokenizers import Tokenizer

    if seq_len < 2:
        raise UsageError(f"seq_len (--seq-len) must be >= 2, got {seq_len}")
    if max_tokens is not None and max_tokens < 2:
        raise UsageError(f"max_tokens (--max-tokens) must be >= 2, got {max_tokens}")
    dev = resolve_device(device)
    t0 = time.perf_counter()
    with nqf.open(model) as f:
        cfg = Qwen2Config.from_metadata(f.config)
        tok = Tokenizer.from_str(f.tokenizer_json)
        ids = tok.encode(text, add_special_tokens=False).ids
        if max_tokens is not None:
            ids = ids[:max_tokens]
        if len(ids) < 2:
            raise ValueError("the evaluation text has fewer than 2 tokens")
        windows = [ids[s:s + seq_len] for s in range(0, len(ids), seq_len)]
        windows = [w for w in windows if len(w) >= 2]
        # batches of equal-length windows: the full ones EVAL_BATCH at a time, then the short tail
        full = [w for w in windows if len(w) == seq_len]
        batches = [torch.tensor(full[b:b + EVAL_BATCH], dtype=torch.long)
                   for b in range(0, len(full), EVAL_BATCH)]
        batches += [torch.tensor([w], dtype=torch.long) for w in windows if len(w) != seq_len]
        emb = load_f32(f, "embed_tokens", dev)
        hs = [emb[b.reshape(-1).to(dev)] for b in batches]  # f32 [n * t, hidden] each
        head = {"final_norm": load_f32(f, "final_norm", dev),
                "lm_head": load_f32(f, "lm_head", dev) if "lm_head" in f.records else emb}
        del emb
        inv_freq = fwd.rope_inv_freq(cfg.head_dim, cfg.rope_theta, dev)
        for i in range(cfg.num_hidden_layers):
            w = {k: load_f32(f, f"layers.{i}.{k}", dev) for k in fwd.LAYER_TENSORS}
            for j, b in enumerate(batches):
                n, t = b.shape
                positions = torch.arange(t, device=dev).repeat(n)
                hs[j] = fwd.decoder_layer(cfg, hs[j], w, positions, inv_freq, fwd.dense_attend(n, t), i)
        total_nll, total_tok = 0.0, 0
        for b, h in zip(batches, hs, strict=True):
            n, t = b.shape
            # position p of each window predicts token p + 1: score rows 0..t-2 against tokens 1..t-1
            hidden = h.view(n, t, -1)[:, :-1].reshape(n * (t - 1), -1)
            nll = fwd.token_nll(cfg, head, hidden, b[:, 1:].reshape(-1).to(dev))
            total_nll += float(nll.double().sum())
            total_tok += nll.numel()
    mean = total_nll / total_tok
    return EvalResult(perplexity=math.exp(mean), tokens=total_tok, nll=mean, windows=len(windows),
                      seq_len=seq_len, seconds=time.perf_counter() - t0, device=str(dev), model=str(model),
                      text=text_name)
