"""Synthetic Qwen2 weights with real geometry: random, well-scaled, never zeros.

Speed does not depend on weight values, and the 7B checkpoint cannot be downloaded here, so the GPU
tests and the benchmark build Qwen2.5-Coder-7B's (or 0.5B's) exact shapes from random numbers:

- INT4 linears: random 32-bit words are valid packed INT4 (every nibble is a value 0..15), so the
  packed words are drawn directly in the `int4-g{G}-tile8x128-v1` layout on the device; symmetric
  (zero point 8); scales make each dequantized weight matrix have std ~ 1/sqrt(K), so activations
  stay O(1) through the layers (the scale of each group varies by +-25%).
- norms 1 + 0.1 N(0,1); qkv bias 0.1 N(0,1); embedding N(0,1) and an untied bf16 lm_head
  N(0,1) * 2/sqrt(H), so logits have std ~2; tied: embedding N(0,1) * 4/sqrt(H) (logits std ~4).

`random_weights(geom, device)` builds the tensors directly on the device (seconds for 7B on a GPU).
`write_container(path, geom)` writes the same kind of model as a .nanoqwen (numpy, through
nanoqwen_format.Writer), for CPU tests and for comparing the engine with the reference runtime on one
container. The same seed gives the same weights on the same device type.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from nanoqwen_model import Qwen2Config

from .weights import DenseLinear, Int4Linear, Int8Linear, LayerWeights, Linear, ModelWeights

# Nibbles are drawn uniform on 0..15 and every 0 is replaced by 8: q - 8 then has mean exactly 0
# (uniform 0..15 has mean -0.5 around the zero point 8, a rank-one common mode that grows through
# the layers until every prompt ends in the same hidden state) and std sqrt(17.5) = 4.18.
QUANT_STD = 17.5 ** 0.5


def _gen(device: torch.device, seed: int) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def random_int4(n: int, k: int, device: torch.device, gen: torch.Generator, group_size: int = 128,
                std: float | None = None, symmetric: bool = True) -> Int4Linear:
    """Random INT4 linear [N, K] in the tile layout; dequantized std ~ `std` (1/sqrt(K)).

    symmetric=False adds a uint8 zero point [N, K/G] per group, drawn from {7, 8, 9} (zero-mean
    offsets around the codes' mean 8, so the layers' common mode stays small): the asymmetric layout
    of the default recipe, whose GEMVs also read the zero points."""
    if n % 8 or k % 128:
        raise ValueError(f"int4 tile layout needs N % 8 == 0 and K % 128 == 0, got [{n}, {k}]")
    std = std if std is not None else k ** -0.5
    words = torch.randint(0, 2**32, (n // 8, k // 128, 32, 4), generator=gen, device=device,
                          dtype=torch.int64)
    for p in range(8):  # nibble 0 -> 8 (zero-mean q - 8), one nibble position at a time (memory)
        zero = ((words >> (4 * p)) & 0xF) == 0
        words += zero.to(torch.int64) << (4 * p + 3)
    qweight = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # uint32 bits as int32
    base = std / QUANT_STD
    scales = base * (0.75 + 0.5 * torch.rand(n, k // group_size, generator=gen, device=device))
    zeros = None
    if not symmetric:
        zeros = torch.randint(7, 10, (n, k // group_size), generator=gen, device=device).to(torch.uint8)
    return Int4Linear(qweight, scales.to(torch.bfloat16), zeros, n, k, group_size)


def random_int8(n: int, k: int, device: torch.device, gen: torch.Generator, group_size: int = 128,
                std: float | None = None) -> Int8Linear:
    """Random symmetric INT8 linear [N, K], row-major (the lm_head option); dequantized std ~ `std`."""
    std = std if std is not None else k ** -0.5
    q = torch.randint(-127, 128, (n, k), generator=gen, device=device, dtype=torch.int8)
    base = std / (255**2 / 12) ** 0.5  # std of q uniform on -127..127
    scales = base * (0.75 + 0.5 * torch.rand(n, k // group_size, generator=gen, device=device))
    return Int8Linear(q, scales.to(torch.bfloat16), n, k, group_size)


def _normal(shape, scale: float, device, gen, shift: float = 0.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen, device=device) * scale + shift).to(torch.bfloat16)


def random_weights(geom: Qwen2Config, device: str | torch.device = "cuda", *, seed: int = 0,
                   lm_head: str = "bf16", group_size: int = 128, symmetric: bool = True) -> ModelWeights:
    """A whole model on `device`. lm_head: "bf16" (dense), "int4" or "int8"; tied geometry shares embed.
    symmetric=False: the decoder's INT4 linears get zero points (the default recipe's layout)."""
    device = torch.device(device)
    gen = _gen(device, seed)
    H, I = geom.hidden_size, geom.intermediate_size
    layers = []
    for _ in range(geom.num_hidden_layers):
        layers.append(LayerWeights(
            input_norm=_normal((H,), 0.1, device, gen, 1.0),
            qkv=random_int4(geom.qkv_dim, H, device, gen, group_size, symmetric=symmetric),
            qkv_bias=_normal((geom.qkv_dim,), 0.1, device, gen),
            o_proj=random_int4(H, geom.q_dim, device, gen, group_size, symmetric=symmetric),
            post_attn_norm=_normal((H,), 0.1, device, gen, 1.0),
            gate_up=random_int4(2 * I, H, device, gen, group_size, symmetric=symmetric),
            down=random_int4(H, I, device, gen, group_size, symmetric=symmetric),
        ))
    # Untied: embedding rows of unit std, so the token identity is strong in the residual stream.
    # Tied (the embedding is the lm_head): rows of std 4/sqrt(H), logits of std ~4; unit rows would
    # make every logit row a self-similarity spike (the model repeats its last token).
    embed = _normal((geom.vocab_size, H), 4.0 / H**0.5 if geom.tie_word_embeddings else 1.0, device, gen)
    head: Linear
    if geom.tie_word_embeddings:
        if lm_head != "bf16":
            raise ValueError("a tied geometry has a bf16 lm_head (the embedding)")
        head = DenseLinear(embed)
    elif lm_head == "bf16":
        head = DenseLinear(_normal((geom.vocab_size, H), 2.0 / H**0.5, device, gen))
    elif lm_head == "int4":
        head = random_int4(geom.vocab_size, H, device, gen, group_size, std=2.0 / H**0.5)
    elif lm_head == "int8":
        head = random_int8(geom.vocab_size, H, device, gen, group_size, std=2.0 / H**0.5)
    else:
        raise ValueError(f"lm_head must be 'bf16', 'int4' or 'int8', got {lm_head!r}")
    return ModelWeights(embed, layers, _normal((H,), 0.1, device, gen, 1.0), head)


def _bits16(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu").contiguous().view(torch.int16).numpy().view(np.uint16)


def _quantized(lin: Int4Linear):
    import nanoqwen_format as nqf

    qw = lin.qweight.detach().cpu().contiguous().numpy().view(np.uint32)
    return nqf.QuantizedTensor(qw, _bits16(lin.scales), None, (lin.n, lin.k), lin.group_size, True,
                               nqf.layout_tag("int4", lin.group_size), "int4")


def _quantized_int8(lin: Int8Linear):
    import nanoqwen_format as nqf

    qw = lin.qweight.detach().cpu().contiguous().numpy()
    return nqf.QuantizedTensor(qw, _bits16(lin.scales), None, (lin.n, lin.k), lin.group_size, True,
                               nqf.layout_tag("int8", lin.group_size), "int8")


def write_container(path: str | Path, geom: Qwen2Config, *, seed: int = 0, lm_head: str = "bf16",
                    group_size: int = 128, device: str | torch.device = "cpu",
                    tokenizer_json: str | None = None, chat_template: str | None = None) -> Path:
    """Write a synthetic .nanoqwen (weights from `random_weights` on `device`). Returns the path."""
    import nanoqwen_format as nqf

    w = random_weights(geom, device, seed=seed, lm_head=lm_head, group_size=group_size)
    path = Path(path)

    def add_linear(wr, name, lin: Linear):
        if isinstance(lin, Int4Linear):
            wr.add_quantized(name, _quantized(lin))
        elif isinstance(lin, Int8Linear):
            wr.add_quantized(name, _quantized_int8(lin))
        else:
            wr.add_array(name, _bits16(lin.weight), "bf16")

    with nqf.Writer(path) as wr:
        wr.add_array("embed_tokens", _bits16(w.embed_tokens))
        for i, lw in enumerate(w.layers):
            p = f"layers.{i}."
            wr.add_array(p + "input_norm", _bits16(lw.input_norm))
            add_linear(wr, p + "qkv", lw.qkv)
            wr.add_array(p + "qkv_bias", _bits16(lw.qkv_bias))
            add_linear(wr, p + "o_proj", lw.o_proj)
            wr.add_array(p + "post_attn_norm", _bits16(lw.post_attn_norm))
            add_linear(wr, p + "gate_up", lw.gate_up)
            add_linear(wr, p + "down", lw.down)
        wr.add_array("final_norm", _bits16(w.final_norm))
        if not geom.tie_word_embeddings:
            add_linear(wr, "lm_head", w.lm_head)
        meta = {
            "config": geom.to_metadata(),
            "generation": {"eos_token_ids": list(geom.eos_token_id), "temperature": 0.0, "top_p": 1.0,
                           "top_k": 0, "max_new_tokens": 256},
            "quantization": {"method": "synthetic", "bits": 4, "group_size": group_size, "symmetric": True,
                             "lm_head": lm_head},
            "provenance": {"source": f"synthetic:seed={seed}", "source_sha256": "", "tools": {}},
        }
        if tokenizer_json is not None:
            meta["tokenizer"] = tokenizer_json
        if chat_template is not None:
            meta["chat_template"] = chat_template
        wr.set_metadata(meta)
    return path
