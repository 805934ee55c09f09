"""The engine's op set in plain torch (backend "torch"): the same calls, buffers and paged KV layout as
the CUDA kernel backend, so the whole engine (scheduler, step metadata, paged cache, sampling rules)
runs and is tested on the CPU.

Numerics follow the kernels, not the fp32 reference: the residual stream is bf16 (the fused
add+RMSNorm kernel rounds the sum to bf16 and stores it back), norms/RoPE/softmax are fp32 inside,
linear layers compute in fp32 from bf16 inputs and round the output to bf16. INT4 weights are
dequantized once, on first use, and cached (this backend is for correctness, not speed).

Every op writes into a caller-provided `out` buffer (the engine preallocates them), which is how the
kernel backend works too. This backend runs eagerly only (it reads step lengths on the host).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .weights import DenseLinear, Linear


class TorchOps:
    name = "torch"
    graph_capturable = False

    def __init__(self, *, head_dim: int, rope_theta: float, device: torch.device):
        self.device = device
        inv = rope_theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        self.inv_freq = inv.float().to(device)
        self._dense: dict[int, torch.Tensor] = {}

    # ---- elementwise / norms --------------------------------------------------------------------
    def embed(self, ids: torch.Tensor, table: torch.Tensor, out: torch.Tensor) -> None:
        """ids int32 [T] -> out bf16 [T, H]."""
        out.copy_(table[ids.long()])

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float, out: torch.Tensor) -> None:
        xf = x.float()
        out.copy_((xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(out.dtype))

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float,
                     out: torch.Tensor) -> None:
        """residual <- bf16(x + residual); out <- rms_norm(residual) * w."""
        residual.copy_((x.float() + residual.float()).to(residual.dtype))
        self.rms_norm(residual, w, eps, out)

    def mlp_down(self, gate_up: torch.Tensor, act: torch.Tensor, down: Linear, out: torch.Tensor) -> None:
        """out = down(silu(gate) * up), through the [T, I] scratch `act`."""
        self.silu_mul(gate_up, act)
        self.linear(act, down, out)

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

    def linear(self, x: torch.Tensor, lin: Linear, out: torch.Tensor,
               bias: torch.Tensor | None = None) -> None:
        """x bf16 [T, K] -> out [T, N] (bf16, or f32 for logits) = x @ W.T (+ bias)."""
        y = F.linear(x.float(), self._weight(lin).float(), None if bias is None else bias.float())
        out.copy_(y.to(out.dtype))

    # ---- attention block -------------------------------------------------------------------------
    def qkv_rope_kv_write(self, qkv: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                          k_cache: torch.Tensor, v_cache: torch.Tensor, q_out: torch.Tensor,
                          n_heads: int, n_kv: int) -> None:
        """qkv bf16 [T, (Hq+2Hkv)D] (bias already added) -> q_out bf16 [T, Hq, D] roped; roped K and V
        written to the pages: k_cache/v_cache [num_blocks, Hkv, bs, D] at slot_mapping[t] (<0: skip)."""
        T = qkv.shape[0]
        d = q_out.shape[-1]
        qd, kd = n_heads * d, n_kv * d
        q = qkv[:, :qd].float().view(T, n_heads, d)
        k = qkv[:, qd:qd + kd].float().view(T, n_kv, d)
        v = qkv[:, qd + kd:].view(T, n_kv, d)
        ang = positions.float()[:, None] * self.inv_freq[None, :]
        cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None, :]
        sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None, :]

        def rope(x):
            h = x.shape[-1] // 2
            return x * cos + torch.cat([-x[..., h:], x[..., :h]], -1) * sin

        q_out.copy_(rope(q).to(q_out.dtype))
        kr = rope(k).to(k_cache.dtype)
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
        hq, d = q.shape[1], q.shape[2]
        hkv, bs = k_cache.shape[1], k_cache.shape[2]
        g = hq // hkv
        scale = 1.0 / math.sqrt(d)
        qs = query_start.tolist()
        ctxs = context_lens.tolist()
        for b in range(num_rows):
            s0, s1, ctx = qs[b], qs[b + 1], ctxs[b]
            ql = s1 - s0
            npages = -(-ctx // bs)
            pages = page_table[b, :npages].long()
            k = k_cache[pages].permute(1, 0, 2, 3).reshape(hkv, npages * bs, d)[:, :ctx].float()
            v = v_cache[pages].permute(1, 0, 2, 3).reshape(hkv, npages * bs, d)[:, :ctx].float()
            qh = q[s0:s1].float().view(ql, hkv, g, d).permute(1, 2, 0, 3)  # [hkv, g, ql, d]
            sc = torch.einsum("hgqd,hkd->hgqk", qh, k) * scale
            qpos = torch.arange(ctx - ql, ctx)[:, None]
            sc = sc.masked_fill(torch.arange(ctx)[None, :] > qpos, float("-inf"))
            o = torch.einsum("hgqk,hkd->qhgd", torch.softmax(sc, -1), v).reshape(ql, hq * d)
            out[s0:s1] = o.to(out.dtype)

    # ---- sampling --------------------------------------------------------------------------------
    def sample(self, logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
               top_k: torch.Tensor, seed: torch.Tensor, offset: torch.Tensor, out: torch.Tensor) -> None:
        """logits f32 [B, V] -> out int32 [B]. Greedy (argmax, lowest id on ties) where temperature
        is 0; otherwise temperature -> top-k -> top-p -> one draw from a generator seeded by
        (seed, offset), so a row's draw depends only on its own seed and token index."""
        for b in range(logits.shape[0]):
            t = float(temperature[b])
            row = logits[b].float()
            if t == 0.0:
                out[b] = int(torch.argmax(row))
                continue
            x = row / t
            k = int(top_k[b])
            if 0 < k < x.numel():
                vals, idx = torch.topk(x, k)
            else:
                vals, idx = torch.sort(x, descending=True)
            probs = torch.softmax(vals, -1)
            p = float(top_p[b])
            if p < 1.0:
                cum = torch.cumsum(probs, -1)
                keep = max(1, int(((cum - probs) < p).sum()))
                probs, idx = probs[:keep], idx[:keep]
            gen = torch.Generator().manual_seed((int(seed[b]) * 0x9E3779B97F4A7C15 + int(offset[b])) % 2**63)
            out[b] = int(idx[torch.multinomial(probs.cpu(), 1, generator=gen)])
