"""The token bitmask of constrained decoding, applied to logits before sampling (plain torch).

A bitmask row holds one bit per vocabulary token, packed little-endian into int32 words: token t is
allowed when bit t % 32 of word t // 32 is set. Shapes: logits float [B, V] (any float dtype, any
device, a strided view is fine), bitmask int32 [B, ceil(V / 32)]. A row of all ones (-1 words)
leaves its logits unchanged, so constrained and unconstrained rows share one batch (and one captured
CUDA graph: the ops below allocate from the graph's pool, read the mask buffer's fixed address and
never synchronise with the host).

    allowed[b, t] = (bitmask[b, t // 32] >> (t % 32)) & 1;   logits[b, t] = -inf where not allowed

This is the one implementation; the engine, the reference engine and the GPU test use it (the GPU test
checks it against `allowed_tokens`, the per-token loop below, on odd sizes).
"""

from __future__ import annotations

import torch

__all__ = ["bitmask_words", "bit_values", "apply_token_bitmask_", "allowed_tokens", "full_bitmask"]


def bitmask_words(vocab_size: int) -> int:
    """int32 words per bitmask row for a vocabulary of `vocab_size` tokens."""
    return (vocab_size + 31) // 32


def bit_values(device: torch.device | str = "cpu") -> torch.Tensor:
    """int32 [32]: 1 << k for k = 0..31 (bit 31 is INT32_MIN). Made once per device, outside a graph
    capture, and passed to `apply_token_bitmask_` (a capture may not copy from the host)."""
    return torch.tensor([(1 << k) - (1 << 32 if k == 31 else 0) for k in range(32)], dtype=torch.int32,
                        device=device)


def full_bitmask(rows: int, vocab_size: int, device: torch.device | str = "cpu", *,
                 pin_memory: bool = False) -> torch.Tensor:
    """int32 [rows, ceil(V/32)] of all ones: every token allowed."""
    return torch.full((rows, bitmask_words(vocab_size)), -1, dtype=torch.int32, device=device,
                      pin_memory=pin_memory)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, bits: torch.Tensor | None = None
                         ) -> torch.Tensor:
    """Set logits[b, t] to -inf where bitmask row b forbids token t (in place; returns `logits`).

    logits: float [B, V]; bitmask: int32 [B, W] with W >= ceil(V / 32) (bits past V are ignored);
    bits: `bit_values(logits.device)` (made here when None: not inside a graph capture)."""
    if logits.dim() != 2 or bitmask.dim() != 2 or bitmask.dtype != torch.int32:
        raise ValueError(f"expected logits [B, V] and an int32 bitmask [B, W], got {tuple(logits.shape)} "
                         f"and {bitmask.dtype} {tuple(bitmask.shape)}")
    B, V = logits.shape
    if bitmask.shape[0] != B or bitmask.shape[1] * 32 < V:
        raise ValueError(f"bitmask {tuple(bitmask.shape)} does not cover logits {tuple(logits.shape)}")
    if bits is None:
        bits = bit_values(logits.device)
    # three kernels: the bits (int32 [B, W, 32]), forbidden = bit == 0 (bool), the fill
    forbidden = torch.bitwise_and(bitmask.unsqueeze(-1), bits).eq(0).view(B, -1)[:, :V]
    logits.masked_fill_(forbidden, float("-inf"))
    return logits


def allowed_tokens(bitmask_row: torch.Tensor, vocab_size: int) -> list[int]:
    """The token ids a bitmask row allows, bit by bit (the tests' reference)."""
    words = [int(w) & 0xFFFFFFFF for w in bitmask_row.tolist()]
    return [t for t in range(vocab_size) if (words[t // 32] >> (t % 32)) & 1]
