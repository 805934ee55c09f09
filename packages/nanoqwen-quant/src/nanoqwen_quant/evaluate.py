"""Perplexity of a `.nanoqwen` container on a text, and its greedy next-token agreement with a reference
container (the `--method none` pack of the same source), with nanoqwen_model's plain-torch forward.

The text is tokenized with the container's own tokenizer (`tokenizers`, from the tokenizer.json in
the metadata), cut into non-overlapping windows of `seq_len` tokens (a shorter last window is kept),
and every token after the first of its window is scored: `tokens` = sum over windows of (len - 1),
`perplexity` = exp(mean NLL). The forward runs layer by layer over all windows, dequantizing one
layer's weights at a time (int4 / int8 through nanoqwen_format's numpy references), so memory is
the activations plus one layer. Weights are widened to f32, so every linear is fp32 (the forward
computes in the weight's dtype): the same numbers on CPU and CUDA up to fp32 summation order.

Agreement (teacher-forced top-1): at every scored position both models see the same true prefix; the
share of positions where the model's argmax token equals the reference's. It is what a user of greedy
decoding feels: each disagreement is a point where the quantized model would write another token.
Ties inside a model's own logits go to the lowest token id (torch.argmax), the same rule for both.

The quantization does not import the runtime: on `--device cuda` this same torch forward runs on the
GPU (fp32 matmuls, TF32 off), which takes seconds for the 1.5B.

Windows of equal length are one flat token batch for the forward (`dense_attend(n, seq_len)`,
positions 0..seq_len-1 in each), processed EVAL_BATCH windows at a time to bound the attention
scores' memory.
"""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import nanoqwen_format as nqf
import nanoqwen_model.forward as fwd
import numpy as np
import torch
import torch.nn.functional as F
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
    reference: str | None = None  # the reference container, when agreement was measured
    reference_perplexity: float | None = None
    agreement: float | None = None  # share of scored positions whose argmax equals the reference's
    ppl_delta: float | None = None  # perplexity / reference_perplexity - 1

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


@dataclass
class Scores:
    """One model's pass over a text's windows: summed NLL, scored tokens, the argmax token of every
    scored position (int64 [tokens], CPU), and what identifies the token stream (the tokenizer's
    sha256, the window length) so that two Scores are only compared on the same tokens."""

    model: str
    nll_sum: float
    tokens: int
    argmax: torch.Tensor
    windows: int
    seq_len: int
    tokens_key: str  # sha256 of the tokenizer json and the token ids

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll_sum / self.tokens)


def _windows(tok_ids: list[int], seq_len: int) -> tuple[list[torch.Tensor], int]:
    """Token windows as batches of equal length: the full ones EVAL_BATCH at a time, then the short tail."""
    windows = [tok_ids[s:s + seq_len] for s in range(0, len(tok_ids), seq_len)]
    windows = [w for w in windows if len(w) >= 2]
    full = [w for w in windows if len(w) == seq_len]
    batches = [torch.tensor(full[b:b + EVAL_BATCH], dtype=torch.long)
               for b in range(0, len(full), EVAL_BATCH)]
    batches += [torch.tensor([w], dtype=torch.long) for w in windows if len(w) != seq_len]
    return batches, len(windows)


def _forward_scores(f, cfg: Qwen2Config, batches: list[torch.Tensor], dev: torch.device,
                    chunk: int = 512) -> tuple[float, int, torch.Tensor]:
    """Forward one open container over `batches` (layer by layer) -> summed NLL and argmax tokens."""
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
        del w
    total_nll, total_tok, argmax = 0.0, 0, []
    for b, h in zip(batches, hs, strict=True):
        n, t = b.shape
        # position p of each window predicts token p + 1: score rows 0..t-2 against tokens 1..t-1
        hidden = h.view(n, t, -1)[:, :-1].reshape(n * (t - 1), -1)
        targets = b[:, 1:].reshape(-1).to(dev)
        for s in range(0, hidden.shape[0], chunk):
            lg = fwd.logits(cfg, head, hidden[s:s + chunk])
            total_nll += float(F.cross_entropy(lg, targets[s:s + chunk], reduction="sum").double())
            argmax.append(lg.argmax(-1).cpu())
        total_tok += hidden.shape[0]
    return total_nll, total_tok, torch.cat(argmax)


def _tokenize(f, text: str, max_tokens: int | None) -> list[int]:
    from tokenizers import Tokenizer

    ids = Tokenizer.from_str(f.tokenizer_json).encode(text, add_special_tokens=False).ids
    if max_tokens is not None:
        ids = ids[:max_tokens]
    if len(ids) < 2:
        raise ValueError("the evaluation text has fewer than 2 tokens")
    return ids


def score(model: str | Path, text: str, seq_len: int = 1024, max_tokens: int | None = None,
          device: str = "auto") -> Scores:
    """Run `model` over `text` once (module docstring). UsageError for seq_len < 2, max_tokens < 2 or a
    bad device string; DeviceError when CUDA is asked for and absent."""
    if seq_len < 2:
        raise UsageError(f"seq_len (--seq-len) must be >= 2, got {seq_len}")
    if max_tokens is not None and max_tokens < 2:
        raise UsageError(f"max_tokens (--max-tokens) must be >= 2, got {max_tokens}")
    dev = resolve_device(device)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 matmuls: the CPU's numbers up to sum order
    with torch.no_grad(), nqf.open(model) as f:
        cfg = Qwen2Config.from_metadata(f.config)
        ids = _tokenize(f, text, max_tokens)
        key = hashlib.sha256(f.tokenizer_json.encode() + np.asarray(ids, dtype=np.int64).tobytes())
        key = key.hexdigest()
        batches, n_windows = _windows(ids, seq_len)
        nll, n, argmax = _forward_scores(f, cfg, batches, dev)
    return Scores(str(model), nll, n, argmax, n_windows, seq_len, key)


def evaluate(model: str | Path, text: str, reference: str | Path | Scores | None = None, seq_len: int = 1024,
             max_tokens: int | None = None, device: str = "auto", text_name: str = "") -> EvalResult:
    """Perplexity of `model` on `text` and, with `reference` (a container, or its `score` on the same
    text), the reference's perplexity and the greedy agreement between the two (module docstring).
    Errors as `score`; ValueError when the reference saw other tokens (another tokenizer: give the
    --method none pack of the same source)."""
    t0 = time.perf_counter()
    dev = resolve_device(device)
    sc = score(model, text, seq_len, max_tokens, device)
    res = EvalResult(perplexity=sc.perplexity, tokens=sc.tokens, nll=sc.nll_sum / sc.tokens,
                     windows=sc.windows, seq_len=seq_len, seconds=0.0, device=str(dev), model=str(model),
                     text=text_name)
    if reference is not None:
        ref = reference
        if not isinstance(ref, Scores):
            ref = score(reference, text, seq_len, max_tokens, device)
        if ref.tokens_key != sc.tokens_key or ref.seq_len != sc.seq_len:
            raise ValueError(f"reference {ref.model} was scored on other tokens than {model} (another "
                             "tokenizer, text or window): give the --method none pack of the same source")
        res.reference = ref.model
        res.reference_perplexity = ref.perplexity
        res.agreement = agreement(sc.argmax, ref.argmax)
        res.ppl_delta = res.perplexity / res.reference_perplexity - 1
    res.seconds = time.perf_counter() - t0
    return res


def agreement(pred: torch.Tensor, ref: torch.Tensor) -> float:
    """Share of positions where two argmax sequences agree. pred, ref int [T] (same T >= 1)."""
    if pred.shape != ref.shape or pred.ndim != 1 or pred.numel() == 0:
        raise ValueError(f"agreement needs two non-empty [T] token sequences, got {list(pred.shape)} and "
                         f"{list(ref.shape)}")
    return float((pred == ref).double().mean())


def perplexity(model: str | Path, text: str, seq_len: int = 1024, max_tokens: int | None = None,
               device: str = "auto", text_name: str = "") -> EvalResult:
    """`evaluate` without a reference: perplexity only."""
    return evaluate(model, text, None, seq_len, max_tokens, device, text_name)
