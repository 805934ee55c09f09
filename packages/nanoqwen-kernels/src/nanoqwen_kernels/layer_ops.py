"""Launchers of the per-token layer ops (csrc/layer_ops.cu): norms, SiLU*mul, embedding, RoPE + KV write.

All take bf16 tensors on an sm_90 GPU, write into caller-provided outputs, launch on the current
torch stream, allocate nothing and never synchronise (CUDA-graph capturable).

Paged KV cache (DESIGN.md): layer l's K and V caches are `pool[l, 0]` and `pool[l, 1]`, each
[num_blocks, n_kv_heads, block_size, head_dim]. For a step over T tokens:

    token t:  position positions[t]        (its index in its own sequence)
              slot     slot_mapping[t]     = page * block_size + offset, page from the page table:
                                             page_table[b, positions[t] // block_size]; < 0: skip
"""

from __future__ import annotations

import dataclasses

import torch
from nanoqwen_model.forward import rope_inv_freq

from .launch import check, f32, i32, launch, ptr, require_sm90

# rope_inv_freq(head_dim, theta, device) -> fp32 [head_dim / 2]: the model's own (HF's fp32 formula),
# re-exported here because qkv_rope_kv_write takes its result.
__all__ = ["rms_norm", "fused_add_rms_norm", "silu_mul", "embedding_gather", "rope_inv_freq",
           "AttentionShape", "qkv_rope_kv_write"]

FAMILY = "layer_ops"


def _rows(x: torch.Tensor, name: str) -> tuple[int, int]:
    check(x, name, torch.bfloat16, (None, None))
    t, h = x.shape
    if h % 8:
        raise ValueError(f"{name}: hidden size must be a multiple of 8, got {h}")
    return t, h


def rms_norm(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, eps: float) -> torch.Tensor:
    """out[T, H] = x * rsqrt(mean(x^2) + eps) * weight. x, out: bf16 [T, H]; weight: bf16 [H]."""
    t, h = _rows(x, "x")
    index = require_sm90(x.device)
    check(weight, "weight", torch.bfloat16, (h,), x.device)
    check(out, "out", torch.bfloat16, (t, h), x.device)
    if t:
        launch(FAMILY, "rms_norm_bf16", index, (t, 1, 1), (256, 1, 1),
               (ptr(x), ptr(weight), ptr(out), i32(h), f32(eps)))  # fmt: skip
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, eps: float
) -> torch.Tensor:
    """residual <- bf16(x + residual) (in place); out <- rms_norm(residual) * weight.

    x, residual, out: bf16 [T, H]; weight: bf16 [H]. The final norm of the model is this op (or
    `rms_norm` when there is nothing to add)."""
    t, h = _rows(x, "x")
    index = require_sm90(x.device)
    check(residual, "residual", torch.bfloat16, (t, h), x.device)
    check(weight, "weight", torch.bfloat16, (h,), x.device)
    check(out, "out", torch.bfloat16, (t, h), x.device)
    if t:
        launch(FAMILY, "fused_add_rms_norm_bf16", index, (t, 1, 1), (256, 1, 1),
               (ptr(x), ptr(residual), ptr(weight), ptr(out), i32(h), f32(eps)))  # fmt: skip
    return out


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[T, I] = silu(gate_up[:, :I]) * gate_up[:, I:]. gate_up: bf16 [T, 2I]; I % 8 == 0."""
    t, two_i = _rows(gate_up, "gate_up")
    index = require_sm90(gate_up.device)
    inter = two_i // 2
    if inter % 8:
        raise ValueError(f"gate_up: intermediate size must be a multiple of 8, got {inter}")
    check(out, "out", torch.bfloat16, (t, inter), gate_up.device)
    vecs = t * inter // 8
    if vecs:
        blocks = min(-(-vecs // 256), 132 * 8)
        launch(FAMILY, "silu_mul_bf16", index, (blocks, 1, 1), (256, 1, 1),
               (ptr(gate_up), ptr(out), i32(t), i32(inter)))  # fmt: skip
    return out


def embedding_gather(ids: torch.Tensor, table: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out[T, H] = table[ids]. ids: int32 [T] (an id outside 0..V-1 gives a NaN row, never a bad
    read); table: bf16 [V, H]; out: bf16 [T, H]."""
    v, h = _rows(table, "table")
    index = require_sm90(table.device)
    check(ids, "ids", torch.int32, (None,), table.device, align=4)
    t = ids.shape[0]
    check(out, "out", torch.bfloat16, (t, h), table.device)
    if t:
        launch(FAMILY, "embedding_gather_bf16", index, (t, 1, 1), (128, 1, 1),
               (ptr(ids), ptr(table), ptr(out), i32(h), i32(v)))  # fmt: skip
    return out


@dataclasses.dataclass(frozen=True)
class AttentionShape:
    """Head counts of one model: q heads, KV heads (GQA), head dimension."""

    n_heads: int
    n_kv_heads: int
    head_dim: int

    @property
    def qkv_width(self) -> int:
        return (self.n_heads + 2 * self.n_kv_heads) * self.head_dim


def check_rope_kv_args(shape: AttentionShape, t: int, positions, slot_mapping, inv_freq, q_out, k_cache,
                       v_cache, dev: torch.device) -> None:
    """The checks of what RoPE + the paged K/V write of t tokens read and write (qkv_rope_kv_write, and
    the qkv GEMV that fuses it: `gemv.gemv_int4_qkv_rope`)."""
    hq, hkv, d = shape.n_heads, shape.n_kv_heads, shape.head_dim
    check(positions, "positions", torch.int32, (t,), dev, align=4)
    check(slot_mapping, "slot_mapping", torch.int32, (t,), dev, align=4)
    check(inv_freq, "inv_freq", torch.float32, (d // 2,), dev, align=4)
    check(q_out, "q_out", torch.bfloat16, (t, hq, d), dev)
    check(k_cache, "k_cache", torch.bfloat16, (None, hkv, None, d), dev)
    check(v_cache, "v_cache", torch.bfloat16, tuple(k_cache.shape), dev)


def qkv_rope_kv_write(
    qkv: torch.Tensor,
    shape: AttentionShape,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    inv_freq: torch.Tensor,
    q_out: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Add the q/k/v bias (if given), rotate q and k (Qwen2 RoPE), write q and the paged K/V.

    qkv: bf16 [T, (Hq + 2 Hkv) D] (q heads, k heads, v heads); bias: bf16 [(Hq + 2 Hkv) D] or None
    (None when the GEMV already added it); positions, slot_mapping: int32 [T] device buffers;
    inv_freq: fp32 [D/2] (`rope_inv_freq`); q_out: bf16 [T, Hq, D];
    k_cache, v_cache: bf16 [num_blocks, Hkv, block_size, D] (one layer's pages). Returns q_out.
    """
    dev = qkv.device
    index = require_sm90(dev)
    hq, hkv, d = shape.n_heads, shape.n_kv_heads, shape.head_dim
    if d % 4:
        raise ValueError(f"head_dim must be a multiple of 4, got {d}")
    check(qkv, "qkv", torch.bfloat16, (None, shape.qkv_width), dev)
    t = qkv.shape[0]
    check_rope_kv_args(shape, t, positions, slot_mapping, inv_freq, q_out, k_cache, v_cache, dev)
    if bias is not None:
        check(bias, "bias", torch.bfloat16, (shape.qkv_width,), dev, align=4)
    if t:
        args = (ptr(qkv), ptr(bias), ptr(positions), ptr(slot_mapping), ptr(inv_freq), ptr(q_out),
                ptr(k_cache), ptr(v_cache), i32(hq), i32(hkv), i32(d), i32(k_cache.shape[2]))  # fmt: skip
        launch(FAMILY, "qkv_rope_kv_write_bf16", index, (t, 1, 1), (256, 1, 1), args)
    return q_out
