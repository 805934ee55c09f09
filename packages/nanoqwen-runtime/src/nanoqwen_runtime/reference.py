"""Plain-torch reference Qwen2 model over the paged KV cache (gpt-fast style, no custom kernels).

This is the oracle the CUDA engine is tested against and the backend that runs where no GPU exists.
Weights come from a `.nanoqwen` container: bf16 tensors are used as stored, INT4/INT8 tensors are
dequantized once at load with `nanoqwen_format`'s numpy reference and kept in `dtype`.

One `forward` call runs one step for B sequences at once: `query_lens[b]` new tokens of sequence b
(a prefill chunk, or 1 token in decode), flattened into one [T] token batch. The new keys/values are
written into the pool through `slot_mapping`, then each sequence attends to its whole context read
back through its page table (see `kv_cache.py` for the diagram). Numerics:

- linear layers run in `dtype` (bf16 or f32); RMSNorm, RoPE, softmax and the residual stream in fp32;
- RoPE is Qwen2's non-interleaved `rotate_half` form with cos/sin computed in fp32 (DESIGN.md);
- attention: GQA (query head h reads KV head h // group), scale 1/sqrt(head_dim), causal inside the
  query chunk, fp32 scores and accumulation; K/V are stored in the pool's dtype (bf16 by default).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from os import PathLike

import torch
import torch.nn.functional as F

from .config import ModelConfig
from .kv_cache import PagedKVCache, StepMetadata

__all__ = ["ReferenceModel", "load_weights", "WeightError"]


class WeightError(ValueError):
    """A weight is missing from the container or has the wrong shape."""


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Logical shape of every tensor the model needs (DESIGN.md names). lm_head only when untied."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens": (cfg.vocab_size, h), "final_norm": (h,)}
    for layer in range(cfg.num_hidden_layers):
        p = f"layers.{layer}."
        shapes[p + "input_norm"] = (h,)
        shapes[p + "qkv"] = (cfg.qkv_dim, h)
        shapes[p + "qkv_bias"] = (cfg.qkv_dim,)
        shapes[p + "o_proj"] = (h, cfg.q_dim)
        shapes[p + "post_attn_norm"] = (h,)
        shapes[p + "gate_up"] = (2 * i, h)
        shapes[p + "down"] = (h, i)
    return shapes


def load_weights(path: str | PathLike, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str = "cpu") -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read config and every weight of a container; quantized tensors are dequantized (once) to `dtype`.

    Returns (config, {name: tensor}) with norms and biases in fp32 and matrices in `dtype`.
    """
    import nanoqwen_format as nqf

    with nqf.open(path) as f:
        cfg = ModelConfig.from_dict(f.config)
        shapes = expected_shapes(cfg)
        names = list(shapes)
        if "lm_head" in f.records:
            names.append("lm_head")
        elif not cfg.tie_word_embeddings:
            raise WeightError("container has no lm_head and the config does not tie embeddings")
        weights: dict[str, torch.Tensor] = {}
        for name in names:
            if name not in f.records:
                raise WeightError(f"container is missing tensor {name!r}")
            rec = f.records[name]
            if rec.encoding in ("bf16", "f16", "f32"):
                arr = f.array(name)
                t = torch.from_numpy(arr.copy())
                if rec.encoding == "bf16":
                    t = t.view(torch.bfloat16)
            else:
                t = torch.from_numpy(f.dequantize(name))
            want_dtype = torch.float32 if t.dim() == 1 else dtype
            weights[name] = t.to(device=device, dtype=want_dtype)
    return cfg, weights


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: f32 [T, hidden] -> f32 [T, hidden]."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


class ReferenceModel:
    """Qwen2 decoder over a `PagedKVCache`. Not an nn.Module: weights are plain tensors, no autograd."""

    def __init__(self, config: ModelConfig, weights: Mapping[str, torch.Tensor],
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16):
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        shapes = expected_shapes(config)
        if "lm_head" in weights:
            shapes["lm_head"] = (config.vocab_size, config.hidden_size)
        elif not config.tie_word_embeddings:
            raise WeightError("no lm_head weight and the config does not tie embeddings")
        w: dict[str, torch.Tensor] = {}
        for name, shape in shapes.items():
            if name not in weights:
                raise WeightError(f"missing weight {name!r}")
            t = weights[name]
            if tuple(t.shape) != shape:
                raise WeightError(f"weight {name!r} has shape {tuple(t.shape)}, expected {shape}")
            want = torch.float32 if t.dim() == 1 else dtype
            w[name] = t.to(device=self.device, dtype=want).contiguous()
        self.w = w
        self.lm_head = w.get("lm_head", w["embed_tokens"])
        d = config.head_dim
        self.inv_freq = config.rope_theta ** (-torch.arange(0, d, 2, dtype=torch.float64, device=self.device)
                                              / d)
        self.inv_freq = self.inv_freq.float()

    @classmethod
    def from_file(cls, path: str | PathLike, device: torch.device | str = "cpu",
                  dtype: torch.dtype = torch.bfloat16) -> ReferenceModel:
        cfg, weights = load_weights(path, dtype=dtype, device=device)
        return cls(cfg, weights, device=device, dtype=dtype)

    # ------------------------------------------------------------------ pieces
    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: f32 [T, heads, head_dim]; positions int64 [T] -> rotated f32 [T, heads, head_dim]."""
        ang = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]  # [T, d/2]
        cos = torch.cat([ang.cos(), ang.cos()], dim=-1)[:, None, :]
        sin = torch.cat([ang.sin(), ang.sin()], dim=-1)[:, None, :]
        half = x.shape[-1] // 2
        rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rot * sin

    def attention(self, layer: int, q: torch.Tensor, meta: StepMetadata, cache: PagedKVCache) -> torch.Tensor:
        """q: f32 [T, n_heads, head_dim] (roped) -> f32 [T, n_heads * head_dim]."""
        cfg = self.config
        hkv, g, d = cfg.num_key_value_heads, cfg.group, cfg.head_dim
        scale = 1.0 / math.sqrt(d)
        if max(meta.query_lens_host) == 1:
            return self._decode_attention(layer, q, meta, cache, scale)
        outs = []
        start = 0
        for b, (qlen, ctx) in enumerate(zip(meta.query_lens_host, meta.context_lens_host, strict=True)):
            qb = q[start:start + qlen]  # [qlen, H, d]
            start += qlen
            n_pages = -(-ctx // cache.spec.block_size)
            k, v = cache.gather(layer, meta.page_table[b, :n_pages].long(), ctx)  # [hkv, ctx, d]
            qh = qb.permute(1, 0, 2).reshape(hkv, g * qlen, d)
            s = torch.matmul(qh, k.float().transpose(1, 2)).view(hkv, g, qlen, ctx) * scale
            if qlen > 1:
                qpos = torch.arange(ctx - qlen, ctx, device=q.device)[:, None]
                kpos = torch.arange(ctx, device=q.device)[None, :]
                s = s.masked_fill(kpos > qpos, float("-inf"))
            p = torch.softmax(s, dim=-1).view(hkv, g * qlen, ctx)
            o = torch.matmul(p, v.float()).view(hkv * g, qlen, d).permute(1, 0, 2)
            outs.append(o.reshape(qlen, hkv * g * d))
        return torch.cat(outs, dim=0)

    def _decode_attention(self, layer: int, q: torch.Tensor, meta: StepMetadata, cache: PagedKVCache,
                          scale: float) -> torch.Tensor:
        """All sequences at once when each has one query token: q f32 [B, n_heads, d] -> [B, n_heads * d].

        Pages are gathered up to the longest context; keys past a sequence's context_len are masked.
        """
        cfg = self.config
        hkv, g, d = cfg.num_key_value_heads, cfg.group, cfg.head_dim
        bsz = q.shape[0]
        longest = max(meta.context_lens_host)
        n_pages = -(-longest // cache.spec.block_size)
        pages = meta.page_table[:, :n_pages].to(q.device).long()  # [B, P]
        kc, vc = cache.layer(layer)

        def gather(c: torch.Tensor) -> torch.Tensor:  # -> f32 [B, hkv, longest, d]
            x = c[pages].permute(0, 2, 1, 3, 4).reshape(bsz, hkv, n_pages * cache.spec.block_size, d)
            return x[:, :, :longest].float()

        k, v = gather(kc), gather(vc)
        s = torch.matmul(q.view(bsz, hkv, g, d), k.transpose(-1, -2)) * scale  # [B, hkv, g, L]
        ctx = meta.context_lens.to(q.device).long()
        pad = torch.arange(longest, device=q.device)[None, :] >= ctx[:, None]  # [B, L]
        s = s.masked_fill(pad[:, None, None, :], float("-inf"))
        o = torch.matmul(torch.softmax(s, dim=-1), v)  # [B, hkv, g, d]
        return o.reshape(bsz, hkv * g * d)

    def linear(self, x: torch.Tensor, name: str, bias: str | None = None) -> torch.Tensor:
        """x: f32 [T, in] -> f32 [T, out], computed in self.dtype."""
        b = self.w[bias].to(self.dtype) if bias else None
        return F.linear(x.to(self.dtype), self.w[name], b).float()

    # ------------------------------------------------------------------ step
    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, meta: StepMetadata, cache: PagedKVCache,
                all_logits: bool = False) -> torch.Tensor:
        """One step. tokens: int64 [T] (sequence after sequence, `meta.query_lens` each).

        Returns f32 logits [B, vocab] of each sequence's last new token, or [T, vocab] with all_logits.
        The caller has already appended the tokens to the sequences' pages (`build_step_metadata`).
        """
        cfg = self.config
        if tokens.dim() != 1 or tokens.numel() != sum(meta.query_lens_host):
            raise ValueError(f"tokens must be [sum(query_lens)] = [{sum(meta.query_lens_host)}], "
                             f"got {tuple(tokens.shape)}")
        if max(meta.context_lens_host) > cfg.max_position_embeddings:
            raise ValueError(f"context of {max(meta.context_lens_host)} tokens exceeds the model's "
                             f"{cfg.max_position_embeddings}")
        tokens = tokens.to(self.device)
        positions = meta.positions.to(self.device)
        slots = meta.slot_mapping.to(self.device)
        h = self.w["embed_tokens"][tokens].float()  # [T, hidden] residual stream in f32
        t = h.shape[0]
        hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        eps = cfg.rms_norm_eps
        for layer in range(cfg.num_hidden_layers):
            p = f"layers.{layer}."
            x = rms_norm(h, self.w[p + "input_norm"], eps)
            qkv = self.linear(x, p + "qkv", p + "qkv_bias")
            q = qkv[:, : cfg.q_dim].view(t, hq, d)
            k = qkv[:, cfg.q_dim: cfg.q_dim + cfg.kv_dim].view(t, hkv, d)
            v = qkv[:, cfg.q_dim + cfg.kv_dim:].view(t, hkv, d)
            q = self.rope(q, positions)
            k = self.rope(k, positions)
            cache.write(layer, k, v, slots)
            a = self.attention(layer, q, meta, cache)
            h = h + self.linear(a, p + "o_proj")
            x = rms_norm(h, self.w[p + "post_attn_norm"], eps)
            gu = self.linear(x, p + "gate_up")
            gate, up = gu[:, : cfg.intermediate_size], gu[:, cfg.intermediate_size:]
            h = h + self.linear(F.silu(gate) * up, p + "down")
        if not all_logits:
            last = torch.cumsum(meta.query_lens.to(self.device).long(), 0) - 1
            h = h[last]
        x = rms_norm(h, self.w["final_norm"], eps)
        return F.linear(x.to(self.dtype), self.lm_head).float()
