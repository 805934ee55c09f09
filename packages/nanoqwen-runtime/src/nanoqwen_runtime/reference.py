"""The reference Qwen2 model over the paged KV cache: `nanoqwen_model.forward` with a paged `attend`.

This is the oracle the CUDA engine is tested against and the backend that runs where no GPU exists.
The math is the repo's one Qwen2 forward (nanoqwen-model, itself checked against HF transformers);
this module adds only what paging needs: weights read from a container, and an `attend` that writes
each step's keys and values into the page pool and attends over each sequence's whole context read
back through its page table (kv_cache.py has the diagram).

Weights: each tensor's checksum is checked as it is read, and NaN/Inf in its bf16 values or scales is
refused (integrity.py; `verify=False` skips both). bf16 tensors are used as stored; INT4/INT8 tensors
are dequantized once at load with nanoqwen_format's numpy reference and kept in `dtype` (the matmul
dtype: bf16 or f32). Norms and biases are fp32. One `forward` runs one step for B sequences:
`query_lens[b]` new tokens of sequence b (a prefill chunk, or 1 token in decode), flattened into one
[T] token batch. K/V are stored in the pool's dtype (fp32 by default on the reference backend, bf16 in
the engine).
"""

from __future__ import annotations

from collections.abc import Mapping
from os import PathLike

import nanoqwen_format as nqf
import torch
from nanoqwen_model import Qwen2Config
from nanoqwen_model.forward import causal_attention, forward, rope_inv_freq

from .container import opened
from .integrity import WeightError, check_finite
from .kv_cache import PagedKVCache, StepMetadata

__all__ = ["ReferenceModel", "load_weights", "WeightError", "PagedAttend"]


def load_weights(path: str | PathLike | nqf.NanoqwenFile, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str = "cpu", *, verify: bool = True
                 ) -> tuple[Qwen2Config, dict[str, torch.Tensor]]:
    """Read config and every weight of a container; quantized tensors are dequantized (once) to `dtype`.

    path: the container's path, or a `nanoqwen_format.NanoqwenFile` the caller opened (and closes):
    then the file is not opened and parsed again.
    Returns (config, {name: tensor}) with norms and biases in fp32 and matrices in `dtype`.
    verify (default): each tensor's checksum is checked as it is read (nanoqwen_format.ChecksumError
    naming it), and NaN/Inf in a bf16 tensor or in the scales of a quantized one is refused
    (`NonFiniteWeightError`) before it is dequantized (integrity.py).
    """
    with opened(path) as f:
        cfg = Qwen2Config.from_metadata(f.config)
        names = list(cfg.tensor_shapes(with_lm_head="lm_head" in f.records))
        if "lm_head" not in names and not cfg.tie_word_embeddings:
            raise WeightError("container has no lm_head and the config does not tie embeddings")
        weights: dict[str, torch.Tensor] = {}
        for name in names:
            if name not in f.records:
                raise WeightError(f"container is missing tensor {name!r}")
            rec = f.records[name]
            if verify:
                f.verify_tensor(name)
            if rec.encoding in ("bf16", "f16", "f32"):
                t = torch.from_numpy(f.array(name).copy())
                if rec.encoding == "bf16":
                    t = t.view(torch.bfloat16)
                if verify:
                    check_finite([(name, "", t)], f.path)
            else:
                if verify and rec.is_quantized:
                    qt = f.quantized(name)
                    scales = torch.from_numpy(qt.scales.copy())  # fp16 values (-f16s) or bf16 bits
                    if qt.scale_dtype == "bf16":
                        scales = scales.view(torch.bfloat16)
                    check_finite([(name, "scales", scales)], f.path)
                t = torch.from_numpy(f.dequantize(name))
            weights[name] = t.to(device=device, dtype=torch.float32 if t.dim() == 1 else dtype)
    return cfg, weights


class PagedAttend:
    """`attend` over a paged cache for one step (`nanoqwen_model.forward.Attend`).

    Per layer: the step's new keys/values go to their slots (`meta.slot_mapping`); then the queries of
    sequence b (rows query_start[b] .. query_start[b] + query_lens[b] of the flat batch) attend to its
    context_lens[b] cached tokens, causally: a query at position p sees positions <= p."""

    def __init__(self, cache: PagedKVCache, meta: StepMetadata):
        self.cache, self.meta = cache, meta
        self.slots = meta.slot_mapping.to(cache.device)
        self.positions = meta.positions.to(cache.device)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.cache.write(layer, k, v, self.slots)
        bs = self.cache.spec.block_size
        out, start = [], 0
        for b, (qlen, ctx) in enumerate(zip(self.meta.query_lens_host, self.meta.context_lens_host,
                                           strict=True)):
            pages = self.meta.page_table[b, : -(-ctx // bs)].to(self.cache.device).long()
            kc, vc = self.cache.gather(layer, pages, ctx)  # [Hkv, ctx, D]
            rows = slice(start, start + qlen)
            kc, vc = kc.transpose(0, 1), vc.transpose(0, 1)  # [ctx, Hkv, D]
            out.append(causal_attention(q[rows], kc, vc, self.positions[rows]))
            start += qlen
        return torch.cat(out, dim=0)


class ReferenceModel:
    """Qwen2 decoder over a `PagedKVCache`. Not an nn.Module: weights are plain tensors, no autograd."""

    def __init__(self, config: Qwen2Config, weights: Mapping[str, torch.Tensor],
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.bfloat16):
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        if "lm_head" not in weights and not config.tie_word_embeddings:
            raise WeightError("no lm_head weight and the config does not tie embeddings")
        w: dict[str, torch.Tensor] = {}
        for name, shape in config.tensor_shapes(with_lm_head="lm_head" in weights).items():
            if name not in weights:
                raise WeightError(f"missing weight {name!r}")
            t = weights[name]
            if tuple(t.shape) != shape:
                raise WeightError(f"weight {name!r} has shape {tuple(t.shape)}, expected {shape}")
            w[name] = t.to(device=self.device, dtype=torch.float32 if t.dim() == 1 else dtype).contiguous()
        self.w = w
        self.inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, self.device)

    @classmethod
    def from_file(cls, path: str | PathLike | nqf.NanoqwenFile, device: torch.device | str = "cpu",
                  dtype: torch.dtype = torch.bfloat16, *, verify: bool = True) -> ReferenceModel:
        """Load a container, by path or opened (`load_weights`; `verify=False` skips its checksum and
        finite checks)."""
        cfg, weights = load_weights(path, dtype=dtype, device=device, verify=verify)
        return cls(cfg, weights, device=device, dtype=dtype)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, meta: StepMetadata, cache: PagedKVCache,
                all_logits: bool = False) -> torch.Tensor:
        """One step. tokens: int64 [T] (sequence after sequence, `meta.query_lens` each).

        Returns f32 logits [B, vocab] of each sequence's last new token, or [T, vocab] with all_logits.
        The caller has already appended the tokens to the sequences' pages (`build_step_metadata`).
        """
        if tokens.dim() != 1 or tokens.numel() != sum(meta.query_lens_host):
            raise ValueError(f"tokens must be [sum(query_lens)] = [{sum(meta.query_lens_host)}], "
                             f"got {tuple(tokens.shape)}")
        if max(meta.context_lens_host) > self.config.max_position_embeddings:
            raise ValueError(f"context of {max(meta.context_lens_host)} tokens exceeds the model's "
                             f"{self.config.max_position_embeddings}")
        rows = None if all_logits else torch.cumsum(meta.query_lens.long(), 0) - 1
        return forward(self.config, self.w, tokens.to(self.device), meta.positions, PagedAttend(cache, meta),
                       rows=rows, inv_freq=self.inv_freq)
