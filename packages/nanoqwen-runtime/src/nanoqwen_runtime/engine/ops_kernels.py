"""The engine's op set on the nanoqwen_kernels launchers (backend "kernels", sm_90 only).

Same calls as `ops_torch.TorchOps`; every op launches on the current stream, allocates nothing and
never synchronises, so a whole decode step can be captured in a CUDA graph. Plans (GEMV split-K
shapes, attention split-KV launch shapes) are made once here, at engine start:

- linear, INT4 weight, M rows (the weights on the GPU are the container's tensors, nothing more):
    M <= 8                        one `gemv_int4` launch (bias fused)                path "gemv_int4"
    9 <= M <= INT4_GEMM_MAX_ROWS  one `gemm_int4` launch on the M class's plan       path "int4_gemm"
                                  (bias fused; decode batches, prefill chunks)
    M <= INT4_PREFILL_GEMM_MAX_ROWS  one `gemm_int4` launch on the wgmma kernel's   path "int4_gemm_wgmma128"
                                  prefill plan (`plan_gemm_prefill`: M blocks of 128 rows, K split up to
                                  128 rows), where the shape's plan fits in shared memory
    above, or no prefill plan     `linear_int4_prefill`: dequantize into one shared   path "dequant_gemm"
                                  bf16 scratch (the size of the largest layer linear,
                                  not a copy per weight) + cuBLAS
  The two constants are the crossovers of nanoqwen_bench.kernels.bench_gemm (the paths per M at the
  four 7B shapes); change them there, in one line each. An INT4 lm_head (larger than the scratch) takes
  `gemm_int4` above the prefill plan's rows.
  `dense_weight_cache=True` (explicit, off by default) keeps the old bf16 copy of every quantized
  linear for M > 8 (path "cublas_bf16_cache"); its memory cost is printed at load.
- linear, bf16 weight (the default lm_head): cuBLAS (`torch.mm`) into the preallocated output.
- MLP down projection: at M <= 8 the GEMV reads gate_up [M, 2I] and applies SiLU*mul while staging
  it (`silu_mul_input=True`), so the MLP is two launches; above 8 rows `silu_mul` runs first, then the
  plain linear (the SiLU-input GEMM recomputes the activation in every row block: 2x slower at
  M = 32 / 64).
- attention input: at M <= 8 the qkv GEMV applies RoPE and writes q and the paged K/V itself
  (`gemv_int4_qkv_rope`, path counter "qkv_rope_fused"); above, `linear` then `qkv_rope_kv_write`.
- the residual stream (residual.py): at M <= 8 the o_proj and down GEMVs add their output into the residual
  in their epilogue and leave its sums of squares in a small fp32 buffer of this backend
  (`ResidualEpilogue`, path counter "residual_epilogue"); the next qkv / gate_up GEMV makes RMSNorm of the
  residual as its input prologue from them (`NormPrologue`, "norm_prologue"). So a decode layer launches no
  add + RMSNorm: five launches, the four GEMVs and attention (the o_proj GEMV merges the split attention
  rows, below). Otherwise (more rows, or a
  linear that is not INT4) the add stays pending and the norm is one fused_add_rms_norm launch; layer 0's
  input norm and the final norm are plain `rms_norm` launches (nothing fused made their statistics, or
  nothing consumes them fused).
- attention: decode plans, one per graph bucket, planned for the longest context (`max_model_len`): one
  graph serves every length. A plan that would launch the combine kernel (and splits at most 16 ways)
  leaves the split rows to the o_proj GEMV, which merges them while staging its input (the same bits,
  path counter "attention_merge_o_proj"): five launches per decode layer. One prefill plan for chunks of
  up to `prefill_chunk` tokens.
- logits range: `torch.aminmax` per row into static buffers (the engine's NaN/Inf check of the logits).
- sampling: `sample_tokens` over the engine's static per-row parameter buffers (a `SamplingState`
  whose tensors ARE those buffers); the row's offset (tokens generated so far) is written each step.
"""

from __future__ import annotations

import collections

import torch
from nanoqwen_kernels import attention as kattn
from nanoqwen_kernels import gemm as kgemm
from nanoqwen_kernels import gemv as kgemv
from nanoqwen_kernels import launch as klaunch
from nanoqwen_kernels import layer_ops as kops
from nanoqwen_kernels import sampling as ksamp
from nanoqwen_model import Qwen2Config

from .config import EngineConfig
from .residual import NormedInput, ResidualUpdate
from .weights import DenseLinear, Int4Linear, Int8Linear, Linear

# Steps of more than 8 rows (module docstring). The crossovers bench_gemm measured on the four 7B
# linears of a layer (H100, 2026-12-07; bench/RESULTS.md): at M = 64 the INT4 GEMM (the measured plans)
# 128 us, dequantize + cuBLAS 411 us; at M = 128 / 256 / 512 the wgmma prefill plan 172 / 233 / 398 us,
# dequantize + cuBLAS 410 / 434 / 544 us; at M = 768 / 1,024 / 2,048 the wgmma plan (stream-K) 670 /
# 878 / 2,025 us, dequantize + cuBLAS 680 / 841 / 1,549 us.
INT4_GEMM_MAX_ROWS = 64
INT4_PREFILL_GEMM_MAX_ROWS = 512
FAMILIES = ("layer_ops", "gemv", "gemm", "attention", "sampling")


def _linears(weights) -> list[Linear]:
    return [weights.lm_head] + [x for lw in weights.layers for x in (lw.qkv, lw.o_proj, lw.gate_up, lw.down)]


class KernelOps:
    name = "kernels"
    graph_capturable = True

    def __init__(self, geom: Qwen2Config, cfg: EngineConfig, device: torch.device):
        self.device = device
        klaunch.require_sm90(device)
        self.g, self.cfg = geom, cfg
        self.shape = kops.AttentionShape(geom.num_attention_heads, geom.num_key_value_heads, geom.head_dim)
        self.inv_freq = kops.rope_inv_freq(geom.head_dim, geom.rope_theta, device)
        self.attn_geom = kattn.AttentionGeometry(geom.num_attention_heads, geom.num_key_value_heads,
                                                 geom.head_dim, cfg.block_size)
        H, I = geom.hidden_size, geom.intermediate_size
        shapes = {(geom.qkv_dim, H), (H, geom.q_dim), (2 * I, H), (H, I), (geom.vocab_size, H)}
        # GEMV plans by (N, K, SiLU input, group size 128 or not): the split target depends on the
        # kernel that runs (nanoqwen_kernels.gemv.plan_shape); the down projection is the SiLU-input one
        self.plans = {(n, k, silu, g128): kgemv.plan_gemv(n, k, device, silu_input=silu,
                                                          group_size=128 if g128 else 64)
                      for n, k in shapes for silu in (False, True) for g128 in (False, True)}
        self.workspace = kgemv.GemvWorkspace.allocate(self.plans.values(), device)
        # the GEMM's split-K scratch, for every M class and group size (plans are cached per shape)
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
        self._sms = sms
        self.gemm_workspace = kgemm.allocate_workspace(
            [p for g in (32, 64, 128) for p in kgemm.plans_for_shapes(shapes, g, sms)], device)
        # the residual epilogue's statistics of the new residual, read by the next norm prologue: one
        # buffer (each producer runs after the previous consumer on the stream)
        self._norm_stats = torch.empty(kgemv.MAX_M * kgemv.norm_stats_shape(1, H)[1], dtype=torch.float32,
                                       device=device)
        self._scratch: torch.Tensor | None = None
        self._layer_int4: list[Int4Linear] = []  # the layer linears on INT4 (check_weights)
        self._scratch_numel = max(n * k for n, k in shapes if (n, k) != (geom.vocab_size, H))
        self._kw: dict[int, kgemv.Int4Weight | kgemv.Int8Weight] = {}  # id(Linear) -> kernel view
        self._dense: dict[int, torch.Tensor] = {}  # id(quantized Linear) -> bf16 [N, K] (dense_weight_cache)
        self.decode_plans: dict[tuple[int, int], kattn.PagedAttentionPlan] = {}  # (bucket, context class)
        self.prefill_plan: kattn.PagedAttentionPlan | None = None
        self.sampling_state: ksamp.SamplingState | None = None
        self.max_context_len = 0
        # Linear launches by path, counted as they are issued (a graph's capture counts what each of its
        # replays runs; `ModelRunner.graph_paths` keeps that per graph): "gemv_int4", "gemv_int8"
        # (per 8-row launch), "int4_gemm" (9..64 rows, INT4 tensor-core GEMM, per launch),
        # "int4_gemm_wgmma128" (the wgmma GEMM's prefill plan, per launch), "cublas_bf16" (a bf16
        # weight), "cublas_bf16_cache" (the explicit bf16 copy of a quantized weight), "dequant_gemm"
        # (dequantize into scratch + cuBLAS); and, counted in "gemv_int4" too, "qkv_rope_fused" (a qkv
        # GEMV that also applied RoPE and wrote q and the paged K/V), "norm_prologue" (a GEMV whose input
        # was RMSNorm of the residual, made while staging) and "residual_epilogue" (a GEMV that added
        # its output into the residual).
        self.paths: collections.Counter[str] = collections.Counter()

    # ---- setup -------------------------------------------------------------------------------------
    def setup(self, *, max_context_len: int, max_rows: int, max_tokens: int, buckets, step_buffers,
              context_classes) -> None:
        """Make the attention plans (decode: one per bucket and context class) and bind the sampling
        state to the engine's static buffers."""
        self.max_context_len = max_context_len
        for b in sorted(set(buckets) | {max_rows}):
            for c in context_classes:
                self.decode_plans[(b, c)] = kattn.plan_decode(self.attn_geom, max_batch=b, max_context_len=c,
                                                              device=self.device)
        self.prefill_plan = kattn.plan_prefill(self.attn_geom, max_batch=max_rows,
                                               max_query_len=min(max_tokens, max_context_len),
                                               max_total_q=max_tokens, max_context_len=max_context_len,
                                               device=self.device)
        d = step_buffers.dev
        self.sampling_state = ksamp.SamplingState(d["temperature"], d["top_k"], d["top_p"], d["seed"],
                                                  d["offset"])
        if not self.cfg.dense_weight_cache and self._dequantizes(max_tokens):
            self._scratch = torch.empty(self._scratch_numel, dtype=torch.bfloat16, device=self.device)

    def _dequantizes(self, max_tokens: int) -> bool:
        """Whether a step of up to `max_tokens` rows can take the dequantize + cuBLAS path: above
        INT4_PREFILL_GEMM_MAX_ROWS, or a layer linear with no prefill plan at a row count it can see."""
        if max_tokens <= INT4_GEMM_MAX_ROWS:
            return False
        if max_tokens > INT4_PREFILL_GEMM_MAX_ROWS:
            return True
        rows = {min(max_tokens, kgemm.WS_PREFILL_ROWS), max_tokens}  # the prefill plan's two classes
        return any(self._prefill_plan(self._int4(lin), m) is None for lin in self._layer_int4 for m in rows)

    @property
    def scratch_bytes(self) -> int:
        """Device bytes of the dequantize scratch (one bf16 buffer the size of the largest layer linear;
        0 when no step can take the dequantize + cuBLAS path)."""
        return 0 if self._scratch is None else self._scratch.numel() * self._scratch.element_size()

    def warm_up(self) -> None:
        klaunch.warm_up(FAMILIES, self.device)

    def check_weights(self, weights) -> None:
        """Refuse what the kernels cannot run; build the bf16 weight cache when configured."""
        lins = _linears(weights)
        self._layer_int4 = [lin for lin in lins[1:] if isinstance(lin, Int4Linear)]
        for lin in lins:
            if isinstance(lin, Int8Linear):
                self._int8(lin)  # refuses a layout the INT8 GEMV cannot run (G = 32), before any work
        if self.cfg.dense_weight_cache:
            print(f"nanoqwen engine: dense_weight_cache=True keeps a bf16 copy of every quantized linear: "
                  f"{self.dense_cache_bytes(weights) / 1e9:.2f} GB more on the GPU (taken from the KV pool)")
            for lin in lins:
                if id(lin) in self._dense:
                    continue
                if isinstance(lin, Int4Linear):
                    dense = torch.empty(lin.n, lin.k, dtype=torch.bfloat16, device=self.device)
                    kgemv.dequantize_int4(self._int4(lin), dense)
                    self._dense[id(lin)] = dense
                elif isinstance(lin, Int8Linear):
                    self._dense[id(lin)] = lin.dequantize()

    @staticmethod
    def dense_cache_bytes(weights) -> int:
        quantized = (Int4Linear, Int8Linear)
        return sum(2 * lin.n * lin.k for lin in _linears(weights) if isinstance(lin, quantized))

    def _int8(self, lin: Int8Linear) -> kgemv.Int8Weight:
        w = self._kw.get(id(lin))
        if w is None:
            try:
                w = kgemv.Int8Weight(lin.qweight, lin.scales, lin.n, lin.k, lin.group_size)
            except ValueError as e:
                raise ValueError(f"int8 lm_head: {e}") from None
            self._kw[id(lin)] = w
        return w

    def _int4(self, lin: Int4Linear) -> kgemv.Int4Weight:
        w = self._kw.get(id(lin))
        if w is None:
            w = kgemv.Int4Weight(lin.qweight, lin.scales, lin.zeros, lin.n, lin.k, lin.group_size)
            self._kw[id(lin)] = w
        return w

    # ---- elementwise / norms -------------------------------------------------------------------------
    def embed(self, ids, table, out) -> None:
        kops.embedding_gather(ids, table, out)

    def rms_norm(self, x, w, eps, out) -> None:
        kops.rms_norm(x, w, out, eps)

    def add_rms_norm(self, x, residual, w, eps, out) -> None:
        kops.fused_add_rms_norm(x, residual, w, out, eps)

    def norm(self, x: NormedInput) -> torch.Tensor:
        """Materialise x into x.out: fused add + RMSNorm when its update is pending, else RMSNorm (the
        residual is already updated; its statistics, if any, are not needed)."""
        if x.update.pending is not None:
            self.add_rms_norm(x.update.pending, x.residual, x.weight, x.eps, x.out)
        else:
            self.rms_norm(x.residual, x.weight, x.eps, x.out)
        return x.out

    def fuses_norm(self, x: NormedInput, lin: Linear) -> bool:
        """Whether a linear on x makes the norm as its input prologue: an INT4 GEMV step whose residual a
        fused epilogue updated (its statistics are there)."""
        return (x.update.stats is not None and isinstance(lin, Int4Linear)
                and self.int4_path(x.rows) == "gemv_int4")

    def fuses_residual(self, lin: Linear, m: int) -> bool:
        """Whether `linear_residual` / `mlp_down` of m rows add into the residual in the GEMV's epilogue."""
        return isinstance(lin, Int4Linear) and self.int4_path(m) == "gemv_int4"

    def _norm_prologue(self, x: NormedInput) -> kgemv.NormPrologue:
        self.paths["norm_prologue"] += 1
        return kgemv.NormPrologue(x.weight, x.update.stats, x.eps)

    def _residual_epilogue(self, residual: torch.Tensor) -> tuple[kgemv.ResidualEpilogue, ResidualUpdate]:
        shape = kgemv.norm_stats_shape(*residual.shape)
        stats = self._norm_stats[: shape[0] * shape[1]].view(shape)
        self.paths["residual_epilogue"] += 1
        return kgemv.ResidualEpilogue(residual, stats), ResidualUpdate(stats=stats)

    def silu_mul(self, gate_up, out) -> None:
        kops.silu_mul(gate_up, out)

    # ---- linear ------------------------------------------------------------------------------------
    def linear(self, x: torch.Tensor | NormedInput, lin: Linear, out: torch.Tensor,
               bias: torch.Tensor | None = None) -> None:
        """out = x @ W^T (+ bias); x a NormedInput: the norm fused as the GEMV's prologue where
        `fuses_norm`, else materialised first."""
        if isinstance(x, NormedInput):
            if self.fuses_norm(x, lin):
                w = self._int4_gemv(lin)
                kgemv.gemv_int4(x.residual, w, out, bias, self.workspace, self._gemv_plan(w, False),
                                norm=self._norm_prologue(x))
                return
            x = self.norm(x)
        m = x.shape[0]
        if isinstance(lin, Int8Linear) and bias is not None:
            raise ValueError("the INT8 GEMV has no bias (it serves the lm_head)")
        # dense bf16 weights (a DenseLinear, or the cache of a quantized one for more than 8 rows): cuBLAS
        if isinstance(lin, DenseLinear):
            dense = lin.weight
        else:
            dense = self._dense.get(id(lin)) if m > kgemv.MAX_M else None
        if dense is not None:
            self.paths["cublas_bf16" if isinstance(lin, DenseLinear) else "cublas_bf16_cache"] += 1
            if bias is None:
                torch.mm(x, dense.t(), out=out)
            else:
                torch.addmm(bias, x, dense.t(), out=out)
            return
        if isinstance(lin, Int8Linear):  # the lm_head option: one GEMV launch per 8 rows
            w8 = self._int8(lin)
            self.paths["gemv_int8"] += -(-m // kgemv.MAX_M)
            for r in range(0, m, kgemv.MAX_M):
                e = min(m, r + kgemv.MAX_M)
                kgemv.gemv_int8(x[r:e], w8, out[r:e])
            return
        if not isinstance(lin, Int4Linear):
            raise TypeError(f"kernel backend: unsupported linear {type(lin).__name__}")
        path = self.int4_path(m)
        if path == "gemv_int4":
            w = self._int4_gemv(lin)
            kgemv.gemv_int4(x, w, out, bias, self.workspace, self._gemv_plan(w, False))
            return
        w = self._int4(lin)
        plan = self._prefill_plan(w, m) if path == "int4_gemm_wgmma128" else None
        if plan is not None:
            self.paths["int4_gemm_wgmma128"] += 1
            kgemm.gemm_int4(x, w, out, bias, self.gemm_workspace, plan)
        elif path == "int4_gemm" or lin.n * lin.k > self._scratch_numel:
            # (the scratch is sized for the layers' linears: an INT4 lm_head takes the GEMM)
            self.paths["int4_gemm"] += 1
            kgemm.gemm_int4(x, w, out, bias, self.gemm_workspace, self._gemm_plan(w, m))
        else:  # above INT4_PREFILL_GEMM_MAX_ROWS, or a shape whose prefill plan does not fit
            scratch = self._scratch[: lin.n * lin.k].view(lin.n, lin.k)
            self.paths["dequant_gemm"] += 1
            kgemv.linear_int4_prefill(x, w, out, scratch, bias)

    @staticmethod
    def int4_path(m: int) -> str:
        """Which INT4 linear path an M-row step takes (module docstring; the table's one place)."""
        if m <= kgemv.MAX_M:
            return "gemv_int4"
        if m <= INT4_GEMM_MAX_ROWS:
            return "int4_gemm"
        return "int4_gemm_wgmma128" if m <= INT4_PREFILL_GEMM_MAX_ROWS else "dequant_gemm"

    def _int4_gemv(self, lin: Int4Linear) -> kgemv.Int4Weight:
        """The kernel view of an INT4 linear about to run as a decode GEMV, counted as path "gemv_int4"."""
        self.paths["gemv_int4"] += 1
        return self._int4(lin)

    def _gemv_plan(self, w: kgemv.Int4Weight, silu_input: bool) -> kgemv.GemvPlan:
        return self.plans[(w.n, w.k, silu_input, w.group_size == 128)]

    def _gemm_plan(self, w: kgemv.Int4Weight, m: int) -> kgemm.GemmPlan:
        return kgemm.plan_gemm_shape(w.n, w.k, w.group_size, kgemm.m_class(m), self._sms)

    def _prefill_plan(self, w: kgemv.Int4Weight, m: int) -> kgemm.GemmPlan | None:
        """The wgmma kernel's prefill plan for an M > 64 product, or None where its scale table and
        ring do not fit in shared memory (small groups over a long K, unsplit above 128 rows). Per M:
        above 128 rows the plan's launch (a block per tile, or stream-K) depends on it; gemm caches it."""
        return kgemm.prefill_plan_if_fits(w.n, w.k, m, w.group_size, self._sms)

    def linear_residual(self, x: torch.Tensor, lin: Linear, out: torch.Tensor, residual: torch.Tensor,
                        merge: kgemv.AttentionMerge | None = None) -> ResidualUpdate:
        """residual += x @ W^T: added by the GEMV's epilogue where `fuses_residual` (out not written),
        else out = x @ W^T with the add pending (the next norm makes it). merge: what `attention_run` left
        to this GEMV (x is then its output, whose split rows the GEMV merges while staging them)."""
        if self.fuses_residual(lin, x.shape[0]):
            w = self._int4_gemv(lin)
            epilogue, update = self._residual_epilogue(residual)
            kgemv.gemv_int4(x, w, None, None, self.workspace, self._gemv_plan(w, False),
                            residual=epilogue, merge=merge)
            return update
        if merge is not None:  # attention_run defers only to a GEMV that fuses (fuses_attention_merge)
            raise AssertionError("an attention merge was left to an o projection that is not a fused GEMV")
        self.linear(x, lin, out)
        return ResidualUpdate(pending=out)

    def mlp_down(self, gate_up: torch.Tensor, act: torch.Tensor, down: Linear, out: torch.Tensor,
                 residual: torch.Tensor) -> ResidualUpdate:
        """residual += down(silu(gate) * up), as `linear_residual`; act is the [M, I] scratch used when
        the SiLU is not fused."""
        # Fused into the GEMV only (M <= 8), with the residual epilogue. Above 8 rows the SiLU-input
        # GEMM recomputes silu(gate) * up in every row block (28x for the 7B's down) and took twice the
        # plain kernel's time at M = 32 / 64: one silu_mul pass,
        # then the plain linear (INT4 GEMM or dequantize + cuBLAS).
        if self.fuses_silu_down(down, gate_up.shape[0]):
            w = self._int4_gemv(down)
            epilogue, update = self._residual_epilogue(residual)
            kgemv.gemv_int4(gate_up, w, None, None, self.workspace, self._gemv_plan(w, True),
                            silu_mul_input=True, residual=epilogue)
            return update
        kops.silu_mul(gate_up, act)
        return self.linear_residual(act, down, out, residual)

    def fuses_silu_down(self, down: Linear, m: int) -> bool:
        """Whether `mlp_down` of m rows applies SiLU*mul inside the down GEMV's input staging (an INT4
        GEMV step) rather than in a `silu_mul` pass first."""
        return isinstance(down, Int4Linear) and self.int4_path(m) == "gemv_int4"

    # ---- attention block -----------------------------------------------------------------------------
    def qkv_projection(self, x, qkv_w: Linear, bias, qkv, positions, slot_mapping, k_cache, v_cache, q_out,
                       n_heads, n_kv) -> None:
        """qkv = x @ Wqkv^T + bias, RoPE, q_out and the paged K/V (x: a tensor or a NormedInput). At
        M <= 8 on an INT4 weight: one `gemv_int4_qkv_rope` launch (the GEMV with qkv_rope_kv_write as
        its epilogue; qkv not written), counted as path "gemv_int4" and as "qkv_rope_fused", with the
        norm as its prologue where `fuses_norm`; otherwise `linear` + `qkv_rope_kv_write`."""
        rows = x.rows if isinstance(x, NormedInput) else x.shape[0]
        if self.fuses_qkv_rope(qkv_w, rows):
            w = self._int4_gemv(qkv_w)
            norm = None
            if isinstance(x, NormedInput):
                if self.fuses_norm(x, qkv_w):
                    norm, x = self._norm_prologue(x), x.residual
                else:
                    x = self.norm(x)
            self.paths["qkv_rope_fused"] += 1
            kgemv.gemv_int4_qkv_rope(x, w, bias, self.shape, positions, slot_mapping, self.inv_freq, q_out,
                                     k_cache, v_cache, self.workspace, self._gemv_plan(w, False),
                                     norm=norm)
            return
        self.linear(x, qkv_w, qkv, bias=bias)
        self.qkv_rope_kv_write(qkv, positions, slot_mapping, k_cache, v_cache, q_out, n_heads, n_kv)

    def fuses_qkv_rope(self, qkv_w: Linear, m: int) -> bool:
        """Whether `qkv_projection` of m rows is one fused launch (an INT4 GEMV step of a model whose
        head_dim the epilogue takes)."""
        return (isinstance(qkv_w, Int4Linear) and self.int4_path(m) == "gemv_int4"
                and self.shape.head_dim in kgemv.ROPE_HEAD_DIMS)

    def qkv_rope_kv_write(self, qkv, positions, slot_mapping, k_cache, v_cache, q_out, n_heads, n_kv) -> None:
        kops.qkv_rope_kv_write(qkv, self.shape, positions, slot_mapping, self.inv_freq, q_out, k_cache,
                               v_cache, None)

    def attention_plan(self, *, kind, query_start, context_lens, page_table, num_rows, num_tokens,
                       max_context_len):
        if kind == "decode":
            bucket = min(b for b, _ in self.decode_plans if b >= num_rows)
            plan = self.decode_plans[(bucket, max_context_len)]  # max_context_len is a context class
            return (plan, page_table[:num_rows], context_lens[:num_rows], None)
        return (self.prefill_plan, page_table[:num_rows], context_lens[:num_rows],
                query_start[: num_rows + 1])

    def attention_run(self, meta, q, k_cache, v_cache, out, o_proj: Linear | None = None
                      ) -> kgemv.AttentionMerge | None:
        """Attention into out [T, Hq * D]. With o_proj (the linear that takes out next, through
        `linear_residual`) and where `fuses_attention_merge`: the plan's combine kernel is not launched and
        the returned `AttentionMerge` goes to that linear, whose GEMV merges the split rows (the same
        bits; path counter "attention_merge_o_proj"). Else None."""
        plan, pt, cl, qsl = meta
        defer = o_proj is not None and self.fuses_attention_merge(plan, o_proj, q.shape[0])
        plan.run(q, k_cache, v_cache, pt, cl, qsl, out.view(q.shape), defer_merge=defer)
        if not defer:
            return None
        self.paths["attention_merge_o_proj"] += 1
        return plan.merge_input()

    def fuses_attention_merge(self, plan: kattn.PagedAttentionPlan, o_proj: Linear, m: int) -> bool:
        """Whether an attention run of m rows on `plan` leaves its split merge to the o projection's GEMV:
        a decode plan (one query row per sequence: what the merge was tested on; a prefill or verify
        chunk of <= 8 tokens launches the combine kernel) that launches the combine kernel and splits at
        most gemv.MERGE_MAX_SPLITS ways (`can_defer_merge`), and o_proj is a GEMV with the residual
        epilogue."""
        return plan.mode == "decode" and plan.can_defer_merge and self.fuses_residual(o_proj, m)

    # ---- sampling ------------------------------------------------------------------------------------
    def logits_range(self, logits, out_min, out_max) -> None:
        """Each row's smallest and largest logit (bf16 [B] each; NaN propagates): one torch reduction
        over B x V bf16 (0.3 MB at batch 1), capturable, into the engine's static read-back buffer.
        The sampler never faults on NaN (it ranks NaN lowest); the engine drops such a row's token."""
        torch.aminmax(logits, dim=-1, out=(out_min, out_max))

    def sample(self, logits, temperature, top_p, top_k, seed, offset, out) -> None:
        ksamp.sample_tokens(logits, self.sampling_state, out)
