"""The engine's op set in plain torch (backend "torch"): the same calls, buffers and paged KV layout as
the CUDA kernel backend, so the whole engine (scheduler, step metadata, paged cache, sampling rules)
runs and is tested on the CPU.

The math is nanoqwen-model's (RMSNorm, RoPE, attention, sampling); what this backend adds is the
engine's rounding. Numerics follow the kernels, not the fp32 reference: the residual stream is bf16 (the fused
add+RMSNorm kernel rounds the sum to bf16 and stores it back), norms/RoPE/softmax are fp32 inside,
linear layers compute in fp32 from bf16 inputs and round the output to bf16. INT4 weights are
dequantized once, on first use, and cached (this backend is for correctness, not speed).

Every op writes into a caller-provided `out` buffer (the engine preallocates them), which is how the
kernel backend works too. This backend runs eagerly only (it reads step lengths on the host).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from nanoqwen_model import Qwen2Config
from nanoqwen_model.forward import apply_rope, causal_attention, rms_norm, rope_inv_freq
from nanoqwen_model.sampling import sample

from .residual import NormedInput, ResidualUpdate
from .weights import DenseLinear, Linear


class TorchOps:
    name = "torch"
    graph_capturable = False

    def __init__(self, geom: Qwen2Config, device: torch.device):
        self.device = device
        self.vocab_size = geom.vocab_size
        self.inv_freq = rope_inv_freq(geom.head_dim, geom.rope_theta, device)
        self._dense: dict[int, torch.Tensor] = {}

    # ---- elementwise / norms --------------------------------------------------------------------
    def embed(self, ids: torch.Tensor, table: torch.Tensor, out: torch.Tensor) -> None:
        """ids int32 [T] -> out bf16 [T, H]."""
        out.copy_(table[ids.long()])

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float, out: torch.Tensor) -> None:
        out.copy_(rms_norm(x, w, eps).to(out.dtype))

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float,
                     out: torch.Tensor) -> None:
        """residual <- bf16(x + residual); out <- rms_norm(residual) * w."""
        residual.copy_((x.float() + residual.float()).to(residual.dtype))
        self.rms_norm(residual, w, eps, out)

    def norm(self, x: NormedInput) -> torch.Tensor:
        """Materialise x into x.out: fused add + RMSNorm when its update is pending, else RMSNorm."""
        if x.update.pending is not None:
            self.add_rms_norm(x.update.pending, x.residual, x.weight, x.eps, x.out)
        else:
            self.rms_norm(x.residual, x.weight, x.eps, x.out)
        return x.out

    def mlp_down(self, gate_up: torch.Tensor, act: torch.Tensor, down: Linear, out: torch.Tensor,
                 residual: torch.Tensor) -> ResidualUpdate:
        """out = down(silu(gate) * up), through the [T, I] scratch `act`; its add into `residual` is left
        to the next norm (pending)."""
        self.silu_mul(gate_up, act)
        return self.linear_residual(act, down, out, residual)

    def silu_mul(self, gate_up: torch.Tensor, out: torch.Tensor) -> None:
        """gate_up bf16 [T, 2I] -> out bf16 [T, I] = silu(gate) * up."""
        i = out.shape[1]
        g = gate_up[:, :i].float()
        out.copy_((F.silu(g) * gate_up[:, i:].float()).to(out.dtype))

    # ---- linear ----------------------------------------------------------------------------------
    def _weight(self, lin: Linear) -> torch.Tensor:
        if isinstance(lin, DenseLinear):
            return lin.weight
        key = id(lin)
        w = self._dense.get(key)
        if w is None:
            w = lin.dequantize()
            self._dense[key] = w
        return w

    def linear(self, x: torch.Tensor | NormedInput, lin: Linear, out: torch.Tensor,
               bias: torch.Tensor | None = None) -> None:
        """x bf16 [T, K] (or a NormedInput, materialised first) -> out [T, N] (bf16, or f32 for logits)
        = x @ W.T (+ bias)."""
        if isinstance(x, NormedInput):
            x = self.norm(x)
        y = F.linear(x.float(), self._weight(lin).float(), None if bias is None else bias.float())
        out.copy_(y.to(out.dtype))

    def linear_residual(self, x: torch.Tensor, lin: Linear, out: torch.Tensor, residual: torch.Tensor,
                        merge=None) -> ResidualUpdate:
        """residual += x @ W.T, as out = x @ W.T with the add pending (the next norm makes it). merge: always
        None here (this backend's attention returns merged rows; the kernel backend's may not)."""
        if merge is not None:
            raise ValueError("the torch backend's attention output is merged: no merge to take")
        self.linear(x, lin, out)
        return ResidualUpdate(pending=out)

    # ---- attention block -------------------------------------------------------------------------
    def qkv_projection(self, x: torch.Tensor | NormedInput, qkv_w: Linear, bias: torch.Tensor | None,
                       qkv: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, q_out: torch.Tensor, n_heads: int,
                       n_kv: int) -> None:
        """The attention block's input: qkv = x @ Wqkv^T + bias into the [T, (Hq+2Hkv)D] scratch (x a
        NormedInput: materialised first), then `qkv_rope_kv_write` (q_out and the paged K/V)."""
        self.linear(x, qkv_w, qkv, bias=bias)
        self.qkv_rope_kv_write(qkv, positions, slot_mapping, k_cache, v_cache, q_out, n_heads, n_kv)

    def qkv_rope_kv_write(self, qkv: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                          k_cache: torch.Tensor, v_cache: torch.Tensor, q_out: torch.Tensor,
                          n_heads: int, n_kv: int) -> None:
        """qkv bf16 [T, (Hq+2Hkv)D] (bias already added) -> q_out bf16 [T, Hq, D] roped; roped K and V
        written to the pages: k_cache/v_cache [num_blocks, Hkv, bs, D] at slot_mapping[t] (<0: skip)."""
        T = qkv.shape[0]
        d = q_out.shape[-1]
        qd, kd = n_heads * d, n_kv * d
        q = apply_rope(qkv[:, :qd].view(T, n_heads, d), positions, self.inv_freq)
        kr = apply_rope(qkv[:, qd:qd + kd].view(T, n_kv, d), positions, self.inv_freq).to(k_cache.dtype)
        v = qkv[:, qd + kd:].view(T, n_kv, d)
        q_out.copy_(q.to(q_out.dtype))
        bs = k_cache.shape[2]
        slots = slot_mapping.long()
        keep = slots >= 0
        blocks, offs = slots[keep] // bs, slots[keep] % bs
        k_cache[blocks, :, offs] = kr[keep]
        v_cache[blocks, :, offs] = v[keep].to(v_cache.dtype)

    def attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  query_start: torch.Tensor, context_lens: torch.Tensor, page_table: torch.Tensor,
                  out: torch.Tensor, num_rows: int) -> None:
        """Paged causal attention, prefill or decode. q bf16 [T, Hq, D] -> out bf16 [T, Hq*D].
        Row b's queries are q[query_start[b]:query_start[b+1]], the last of its context_lens[b] tokens."""
        hkv, bs, d = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
        qs = query_start.tolist()
        ctxs = context_lens.tolist()
        for b in range(num_rows):
            s0, s1, ctx = qs[b], qs[b + 1], ctxs[b]
            npages = -(-ctx // bs)
            pages = page_table[b, :npages].long()
            k = k_cache[pages].permute(0, 2, 1, 3).reshape(npages * bs, hkv, d)[:ctx]
            v = v_cache[pages].permute(0, 2, 1, 3).reshape(npages * bs, hkv, d)[:ctx]
            o = causal_attention(q[s0:s1], k, v, torch.arange(ctx - (s1 - s0), ctx))
            out[s0:s1] = o.to(out.dtype)

    # ---- sampling --------------------------------------------------------------------------------
    def logits_range(self, logits: torch.Tensor, out_min: torch.Tensor, out_max: torch.Tensor) -> None:
        """logits bf16 [B, V] -> out_min, out_max bf16 [B]: each row's extremes (NaN if it holds one)."""
        torch.aminmax(logits, dim=-1, out=(out_min, out_max))

    def sample(self, logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
               top_k: torch.Tensor, seed: torch.Tensor, offset: torch.Tensor, out: torch.Tensor) -> None:
        """logits [B, Vp] -> out int32 [B]. Greedy (argmax, lowest id on ties) where temperature
        is 0; otherwise temperature -> top-k -> top-p -> one draw from a generator seeded by
        (seed, offset), so a row's draw depends only on its own seed and token index. A row with
        NaN/+Inf among its V logits, or no finite one, gets token 0 (torch's multinomial would raise on
        it): the engine reads the row's range (`logits_range`, taken before the token mask) and never
        emits that token. -inf is where the token mask forbids a token (token_mask.py): such a token
        has zero probability."""
        for b in range(logits.shape[0]):
            row = logits[b, : self.vocab_size]
            if bool(torch.isnan(row).any() or torch.isposinf(row).any() or not torch.isfinite(row).any()):
                out[b] = 0
                continue
            gen = torch.Generator().manual_seed((int(seed[b]) * 0x9E3779B97F4A7C15 + int(offset[b])) % 2**63)
            out[b] = sample(logits[b], float(temperature[b]), int(top_k[b]), float(top_p[b]), gen)
