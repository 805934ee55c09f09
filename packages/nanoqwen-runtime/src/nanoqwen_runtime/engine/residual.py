"""The residual stream between a decoder layer's linears, as the model step hands it from op to op.

A Qwen2 layer is, twice: `residual += linear(x)`, then `x = RMSNorm(residual) * w` feeds the next
linear. The kernel backend can fuse both halves into the GEMVs around them (nanoqwen_kernels.gemv:
a residual epilogue on o_proj / down, a norm prologue on qkv / gate_up), so the model step does not
launch the add and the norm itself. It describes them with two values instead:

- `ResidualUpdate`, returned by the ops that feed the residual stream (`linear_residual`,
  `mlp_down`): either the sublayer's output still `pending` (the next norm adds it, as
  fused_add_rms_norm does), or the residual already updated, with the `stats` the next norm needs
  when the producer computed them (the fused GEMV epilogue's sums of squares);
- `NormedInput`: "RMSNorm(residual, after update) * weight", the input of the next linear, not yet
  computed. The op that consumes it either fuses it into its input staging or first materialises
  it into `out` (`ops.norm`).

Each backend decides per call what it can fuse; the torch reference backend never does (its ops
keep the add pending and normalise into `out`), so both compute the same function.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ResidualUpdate:
    """What a linear feeding the residual stream left behind. pending: bf16 [T, H], its output not yet
    added to the residual (None: already added); stats: fp32 [T, ceil(H / 128)], the new residual's
    sums of squares per 128 columns (only when already added, by a fused epilogue or the post-attention
    block kernel)."""

    pending: torch.Tensor | None = None
    stats: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.pending is not None and self.stats is not None:
            raise ValueError("a pending update has no statistics of the residual yet")


NO_UPDATE = ResidualUpdate()  # the residual holds its final value (the embeddings, before layer 0)


@dataclass(frozen=True)
class NormedInput:
    """RMSNorm(residual + update.pending) * weight (update.pending None: of the residual as it is), the
    input of the next linear. residual: bf16 [T, H]; weight: bf16 [H]; out: bf16 [T, H], where the
    value goes when it is materialised rather than fused."""

    residual: torch.Tensor
    update: ResidualUpdate
    weight: torch.Tensor
    eps: float
    out: torch.Tensor

    @property
    def rows(self) -> int:
        return self.residual.shape[0]
