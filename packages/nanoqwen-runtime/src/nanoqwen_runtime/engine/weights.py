"""Device-resident weights of the engine: typed views over one device buffer (or separate tensors).

Each linear layer is one of three kinds, matching the container encodings of docs/DESIGN.md:

- `Int4Linear`: layout `int4-g{G}-tile8x128-v1`; qweight int32 [N/8, K/128, 32, 4] (the uint32 words
  viewed as int32: torch has no uint32 arithmetic, the kernels read raw bits), scales bf16 [N, K/G],
  zeros uint8 [N, K/G] or None (symmetric: implicit 8). Layout `int4-g{G}-tile8x128-f16s-v1`
  (imported GPTQ/AWQ checkpoints): the same with float16 scales and zero points 0..16; the scales'
  dtype is what every backend dispatches on.
- `Int8Linear`: layout `int8-g{G}-rowmajor-v1` (lm_head option); qweight int8 [N, K], scales bf16.
- `DenseLinear`: bf16 [N, K] (unquantized checkpoints, the default lm_head).

`nbytes` counts what a decode step reads from memory for the weight: the roofline in the benchmark
adds these up.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from nanoqwen_model import codec


@dataclass
class Int4Linear:
    qweight: torch.Tensor          # int32 [N/8, K/128, 32, 4]
    scales: torch.Tensor           # bf16 [N, K/G], or float16 (the -f16s layout)
    zeros: torch.Tensor | None     # uint8 [N, K/G] or None
    n: int
    k: int
    group_size: int

    @property
    def symmetric(self) -> bool:
        return self.zeros is None

    @property
    def nbytes(self) -> int:
        z = 0 if self.zeros is None else self.zeros.numel()
        return self.qweight.numel() * 4 + self.scales.numel() * 2 + z

    def dequantize(self) -> torch.Tensor:
        """bf16 [N, K] (torch reference of the tile layout; allocates)."""
        w = codec.dequantize_int4(self.qweight, self.scales, self.zeros, self.group_size)
        return w.to(torch.bfloat16)


@dataclass
class Int8Linear:
    qweight: torch.Tensor  # int8 [N, K]
    scales: torch.Tensor   # bf16 [N, K/G]
    n: int
    k: int
    group_size: int

    @property
    def nbytes(self) -> int:
        return self.qweight.numel() + self.scales.numel() * 2

    def dequantize(self) -> torch.Tensor:
        """bf16 [N, K] (allocates)."""
        return codec.dequantize_int8(self.qweight, self.scales, self.group_size).to(torch.bfloat16)


@dataclass
class DenseLinear:
    weight: torch.Tensor  # bf16 [N, K]

    @property
    def n(self) -> int:
        return self.weight.shape[0]

    @property
    def k(self) -> int:
        return self.weight.shape[1]

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * 2

    def dequantize(self) -> torch.Tensor:
        return self.weight


Linear = Int4Linear | Int8Linear | DenseLinear


@dataclass
class LayerWeights:
    input_norm: torch.Tensor      # bf16 [H]
    qkv: Linear                   # [(nh + 2 nkv) d, H]
    qkv_bias: torch.Tensor        # bf16 [(nh + 2 nkv) d]
    o_proj: Linear                # [H, nh d]
    post_attn_norm: torch.Tensor  # bf16 [H]
    gate_up: Linear               # [2 I, H]
    down: Linear                  # [H, I]


@dataclass
class ModelWeights:
    embed_tokens: torch.Tensor    # bf16 [V, H]
    layers: list[LayerWeights]
    final_norm: torch.Tensor      # bf16 [H]
    lm_head: Linear               # [V, H]; DenseLinear over embed_tokens when tied

    def decode_bytes(self) -> dict[str, int]:
        """Bytes one decode step reads for weights (batch 1): INT4 words, scales (+zeros), lm_head,
        norms and biases, and the one embedding row."""
        words = scales = other = 0
        for lw in self.layers:
            for lin in (lw.qkv, lw.o_proj, lw.gate_up, lw.down):
                if isinstance(lin, Int4Linear):
                    words += lin.qweight.numel() * 4
                    scales += lin.scales.numel() * 2 + (0 if lin.zeros is None else lin.zeros.numel())
                else:
                    other += lin.nbytes
            other += (lw.input_norm.numel() + lw.post_attn_norm.numel() + lw.qkv_bias.numel()) * 2
        other += self.final_norm.numel() * 2 + self.embed_tokens.shape[1] * 2
        return {"int4_words": words, "int4_scales": scales, "lm_head": self.lm_head.nbytes,
                "norms_bias_embed": other}
