"""INT4 linear layers: decode GEMV (M = 1..8) on tensor cores, and the prefill path (dequantize + cuBLAS).

Weights are in the `int4-g{G}-tile8x128-v1` layout of DESIGN.md, or its fp16-scale variant
`int4-g{G}-tile8x128-f16s-v1` (imported GPTQ/AWQ checkpoints), held on the GPU as an `Int4Weight`
(the three parts of nanoqwen_format's QuantizedTensor as torch tensors; the scales' torch dtype,
bfloat16 or float16, picks the kernel: `_f16s` entry points for float16). The decode kernel reads them
as they are stored; see csrc/gemv_int4.cuh for how.

Plan, then run: `plan_gemv(N, K, device)` fixes the split-K factor for a shape (a pure function of
the shape and the SM count, so the same call always launches the same grid); `GemvWorkspace` is the
fp32 partial-sum buffer and the per-block counters that split-K needs, allocated once for the largest
shape and shared by every GEMV on a stream (the counters return to zero at the end of each launch).
`gemv_int4` itself allocates nothing and never synchronises: it is CUDA-graph capturable.

    y[M, N] = x[M, K] @ W[N, K]^T + bias[N]          (bf16 in and out, fp32 accumulation)

`gemv_int4_qkv_rope` is the qkv GEMV with `layer_ops.qkv_rope_kv_write` as its epilogue (one launch
instead of two for a decode layer's attention input; the same bits).

Two more fusions take a decode layer's add + RMSNorm launches into its GEMVs (csrc/gemv_int4.cuh):
a `ResidualEpilogue` (o_proj, down) adds the GEMV's output into the residual stream instead of storing
it, and writes the new residual's sums of squares per 128 columns; a `NormPrologue` (qkv, gate_up)
makes the GEMV's input RMSNorm(residual) * weight from those sums while staging it. Between them the
norm's statistics travel as fp32 [M, ceil(H / 128)] (`norm_stats_shape`), so no block reads a whole
row for its norm.

An `AttentionMerge` (o_proj, with the residual epilogue) takes the attention's split combine into the
GEMV's staging: its input is an attention output whose split rows are still fp32 partials, merged as the
combine kernel would (the same bits), so a decode layer launches five kernels instead of six.

`gemv_int8` is the same decode product for the INT8 row-major layout of the `--lm-head int8` option
(csrc/gemv_int8.cuh; `Int8Weight`, G = 64 or 128, no bias, no split-K).
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import torch

from . import layer_ops
from .launch import check, i32, launch, ptr, require_sm90

FAMILY = "gemv"
MAX_M = 8
ROWS_PER_BLOCK = 128  # nq_gemv::ROWS_PER_BLOCK: 8 warps x 16 rows
THREADS = 256
XPAD = 32  # nq_gemv::XPAD
# Blocks per SM that split-K aims for, by kernel (`plan_shape`), measured on the H200 at the 7B
# decode shapes (gemv_ab.py --target-blocks, deleted in a6a4922):
# - g128, plain input (4 blocks of 8 warps resident at 64 registers): 3, i.e. fewer and longer blocks
#   than a full wave (qkv 14 -> 10 splits: 0.91x the time, asym), unless that leaves a shape unsplit
#   where 4 would split it (gate_up: 1 split took 1.03x the time of 2): then 4;
# - g128, SiLU input (down; the exact loop at 128 registers, 2 blocks resident): 2 (19 -> 9 splits
#   with the exact loop: 0.83x the time, asym);
# - g32 / g64 (3 blocks resident; not re-tuned): TARGET_BLOCKS_PER_SM.
TARGET_BLOCKS_PER_SM = 4
# Most tile-columns one block stages: M = 8 rows x 48 x 128 bf16 = 96 KB of shared memory, so two
# blocks still fit an SM for any K (Qwen2.5-32B's down projection has K = 27648: 216 tile-columns).
KC_MAX = 48
SCALE_DTYPES = (torch.bfloat16, torch.float16)  # Int4Weight.scales: layouts int4-...-v1 / int4-...-f16s-v1


@dataclasses.dataclass(frozen=True)
class Int4Weight:
    """An INT4 weight on the GPU. qweight: int32 [N/8, K/128, 32, 4] (the uint32 words, same bits);
    scales: bf16 [N, K/G], or float16 for the `-f16s` layout; zeros: uint8 [N, K/G] (asymmetric; 0..15,
    0..16 with fp16 scales) or None (symmetric, zero point 8)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    n: int
    k: int
    group_size: int

    def __post_init__(self) -> None:
        n, k, g = self.n, self.k, self.group_size
        if g not in (32, 64, 128):
            raise ValueError(f"group_size must be 32, 64 or 128, got {g}")
        if n % 8 or k % 128 or n <= 0 or k <= 0:
            raise ValueError(f"INT4 tile layout needs N % 8 == 0 and K % 128 == 0, got [{n}, {k}]")
        dev = self.qweight.device
        check(self.qweight, "qweight", torch.int32, (n // 8, k // 128, 32, 4), dev)
        if self.scales.dtype not in SCALE_DTYPES:
            raise ValueError(f"scales must be bfloat16 or float16, got {self.scales.dtype}")
        check(self.scales, "scales", self.scales.dtype, (n, k // g), dev, align=8)
        if self.zeros is not None:
            check(self.zeros, "zeros", torch.uint8, (n, k // g), dev, align=4)

    @property
    def symmetric(self) -> bool:
        return self.zeros is None

    @property
    def f16_scales(self) -> bool:
        return self.scales.dtype == torch.float16

    @classmethod
    def from_quantized(cls, qt, device: torch.device | str = "cuda") -> Int4Weight:
        """Upload a nanoqwen_format QuantizedTensor (encoding "int4", bf16 or fp16 scales)."""
        if qt.encoding != "int4":
            raise ValueError(f"expected an int4 QuantizedTensor, got encoding {qt.encoding!r}")
        n, k = qt.shape
        qweight = torch.from_numpy(np.ascontiguousarray(qt.qweight).view(np.int32)).to(device)
        scales = torch.from_numpy(np.ascontiguousarray(qt.scales))  # np.float16 (f16s) or bf16 bits
        if qt.scale_dtype == "bf16":
            scales = scales.view(torch.bfloat16)
        scales = scales.to(device)
        zeros = None if qt.zeros is None else torch.from_numpy(np.ascontiguousarray(qt.zeros)).to(device)
        return cls(qweight, scales, zeros, n, k, qt.group_size)

    def kernel_suffix(self) -> str:
        """`g{G}_{sym|asym}[_f16s]`: the part of the kernel names (csrc/gemv.cu) this weight picks."""
        return f"g{self.group_size}_{'sym' if self.symmetric else 'asym'}{'_f16s' if self.f16_scales else ''}"

    def nbytes(self) -> int:
        """Bytes the GEMV must read: packed weights + scales (+ zeros)."""
        total = self.qweight.numel() * 4 + self.scales.numel() * 2
        return total + (self.zeros.numel() if self.zeros is not None else 0)


@dataclasses.dataclass(frozen=True)
class GemvPlan:
    """Grid of one GEMV shape: `splits` blocks along K, each over `kc` tile-columns (128 columns)."""

    n: int
    k: int
    splits: int
    kc: int

    @property
    def blocks_n(self) -> int:
        return -(-self.n // ROWS_PER_BLOCK)

    @property
    def counters(self) -> int:
        """Split-K arrival counters the launch uses (one per row block; allocated even unsplit)."""
        return self.blocks_n

    def shared_bytes(self, m: int) -> int:
        return m * (self.kc * 128 + XPAD) * 2

    def launch_shared_bytes(self, m: int, merge_head_dim: int = 0) -> int:
        """Dynamic shared memory of one launch at M = m: x, then the merge prologue's scratch
        (`merge_head_dim` > 0)."""
        merge = merge_shared_bytes(m, self.kc, merge_head_dim) if merge_head_dim else 0
        return self.shared_bytes(m) + merge

    def workspace_floats(self, m: int) -> int:
        return self.splits * m * self.n if self.splits > 1 else 0


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.cache
def plan_shape(n: int, k: int, sm_count: int, target_blocks_per_sm: int | None = None, *,
               silu_input: bool = False, group_size: int = 128) -> GemvPlan:
    """Split K only as far as needed to give about `target_blocks_per_sm` blocks per SM (and so that
    one block stages at most KC_MAX tile-columns of the activations). None: the target measured for
    the kernel that runs (see TARGET_BLOCKS_PER_SM)."""
    if target_blocks_per_sm is not None:
        return _split_for(n, k, sm_count, target_blocks_per_sm)
    if group_size != 128:
        return _split_for(n, k, sm_count, TARGET_BLOCKS_PER_SM)
    if silu_input:
        return _split_for(n, k, sm_count, 2)
    fewer = _split_for(n, k, sm_count, 3)
    full = _split_for(n, k, sm_count, 4)
    return full if fewer.splits == 1 and full.splits > 1 else fewer


def _split_for(n: int, k: int, sm_count: int, target_blocks_per_sm: int) -> GemvPlan:
    kt = k // 128
    blocks_n = -(-n // ROWS_PER_BLOCK)
    want = max(1, min(kt, round(sm_count * target_blocks_per_sm / blocks_n)))
    kc = min(-(-kt // want), KC_MAX)
    return GemvPlan(n, k, -(-kt // kc), kc)


def plan_gemv(
    n: int, k: int, device: torch.device | None = None, target_blocks_per_sm: int | None = None, *,
    silu_input: bool = False, group_size: int = 128,
) -> GemvPlan:
    """The plan of one shape on `device` (default: the current CUDA device): `plan_shape` with the
    device's SM count, for the kernel that runs it: `silu_input` (the down projection's fused SiLU*mul
    input) and the weight's `group_size`. `target_blocks_per_sm` is for benchmarks of other split-K
    targets."""
    device = device or torch.device("cuda", torch.cuda.current_device())
    return plan_shape(n, k, _sm_count(require_sm90(device)), target_blocks_per_sm, silu_input=silu_input,
                      group_size=group_size)


@dataclasses.dataclass
class GemvWorkspace:
    """Split-K scratch shared by all GEMVs on one stream: fp32 partials and zeroed int32 counters."""

    partials: torch.Tensor
    counters: torch.Tensor

    @classmethod
    def allocate(cls, plans, device: torch.device, max_m: int = MAX_M) -> GemvWorkspace:
        plans = list(plans)
        floats = max([p.workspace_floats(max_m) for p in plans] + [1])
        blocks = max([p.counters for p in plans] + [1])
        return cls(
            torch.empty(floats, dtype=torch.float32, device=device),
            torch.zeros(blocks, dtype=torch.int32, device=device),
        )


def norm_stats_shape(m: int, h: int) -> tuple[int, int]:
    """Shape of the norm statistics of m residual rows of h columns: fp32 [m, ceil(h / 128)] (one sum of
    squares per row and 128-column block of the GEMV that wrote them)."""
    return (m, -(-h // ROWS_PER_BLOCK))


@dataclasses.dataclass(frozen=True)
class NormPrologue:
    """The GEMV's input as RMSNorm of the residual stream (the `_norm` kernels): the launcher's x is
    the residual [M, K], and the GEMV multiplies bf16(x * rsqrt(sum_b stats[m, b] / K + eps) * weight),
    `layer_ops.rms_norm`'s arithmetic on the sums of squares that a `ResidualEpilogue` left behind.

    weight: bf16 [K]; stats: fp32 `norm_stats_shape(M, K)` (a GEMV's residual epilogue); eps: the norm's
    epsilon."""

    weight: torch.Tensor
    stats: torch.Tensor
    eps: float


@dataclasses.dataclass(frozen=True)
class ResidualEpilogue:
    """The GEMV's output added into the residual stream (the `_resid` kernels) instead of stored:
    residual <- bf16(residual + bf16(y)) (the update of `layer_ops.fused_add_rms_norm`), and
    stats[m, b] <- the sum of squares of the new residual[m] over columns 128 b .. 128 b + 127.

    residual: bf16 [M, N], updated in place; stats: fp32 `norm_stats_shape(M, N)`, written."""

    residual: torch.Tensor
    stats: torch.Tensor


# Most attention splits the merge prologue takes (csrc/gemv_int4.cuh MERGE_MAX_SPLITS); the head dims
# it is built for (the `_merge_hd{64,128}_resid` entry points).
MERGE_MAX_SPLITS = 16
MERGE_HEAD_DIMS = (64, 128)


@dataclasses.dataclass(frozen=True)
class AttentionMerge:
    """The o projection's input as the output of an attention launch whose split rows are not merged yet
    (`attention.PagedAttentionPlan.run(..., defer_merge=True)`, then `plan.merge_input()` gives this; the
    `_merge_resid` kernels):
    x is the attention output [M, n_heads * head_dim], final in the rows (token, head) of at most
    `fuse_max_splits` splits, and the GEMV merges the others from the plan's fp32 partials while it
    stages them, with the combine kernel's arithmetic (the same bits), so the combine launch goes.

    work_o: fp32 [num_splits, work_rows, n_heads, head_dim]; work_lse: fp32 [num_splits, work_rows,
    n_heads]; work_splits: int32 [work_rows, n_heads] (all written by the attention launch);
    num_splits <= MERGE_MAX_SPLITS; head_dim in MERGE_HEAD_DIMS."""

    work_o: torch.Tensor
    work_lse: torch.Tensor
    work_splits: torch.Tensor
    fuse_max_splits: int

    @property
    def head_dim(self) -> int:
        return self.work_o.shape[3]


def merge_shared_bytes(m: int, kc: int, head_dim: int) -> int:
    """Shared memory the merge prologue takes after the staged x: per (row, head) of a
    block's kc tile-columns, MERGE_MAX_SPLITS weights, 1 / sum and the split count (4 bytes each)."""
    return m * (kc * 128 // head_dim) * (MERGE_MAX_SPLITS + 2) * 4


def _merge_args(merge: AttentionMerge, m: int, k: int, dev: torch.device) -> tuple:
    if not isinstance(merge, AttentionMerge):
        raise TypeError(f"merge must be an AttentionMerge, got {type(merge).__name__}")
    if merge.work_o.dim() != 4 or merge.work_o.shape[3] not in MERGE_HEAD_DIMS:
        raise ValueError(f"merge.work_o must be fp32 [splits, rows, heads, head_dim in {MERGE_HEAD_DIMS}], "
                         f"got {list(merge.work_o.shape)}")
    s, rows, heads, hd = merge.work_o.shape
    if not 1 <= s <= MERGE_MAX_SPLITS:
        raise ValueError(f"the merge prologue takes plans of at most {MERGE_MAX_SPLITS} splits, got {s} "
                         "(launch the combine kernel instead)")
    if heads * hd != k:
        raise ValueError(f"x has {k} columns; the attention partials have {heads} heads x {hd}")
    if m > rows:
        raise ValueError(f"x has {m} rows, the attention plan's work buffers {rows}")
    check(merge.work_o, "merge.work_o", torch.float32, (s, rows, heads, hd), dev)
    check(merge.work_lse, "merge.work_lse", torch.float32, (s, rows, heads), dev, align=4)
    check(merge.work_splits, "merge.work_splits", torch.int32, (rows, heads), dev, align=4)
    if not 1 <= merge.fuse_max_splits:
        raise ValueError(f"merge.fuse_max_splits must be >= 1, got {merge.fuse_max_splits}")
    return (ptr(merge.work_o), ptr(merge.work_lse), ptr(merge.work_splits), i32(rows),
            i32(merge.fuse_max_splits))


def _norm_args(norm: NormPrologue, m: int, k: int, dev: torch.device) -> tuple:
    check(norm.weight, "norm.weight", torch.bfloat16, (k,), dev)
    check(norm.stats, "norm.stats", torch.float32, norm_stats_shape(m, k), dev, align=4)
    return ptr(norm.weight), ptr(norm.stats), np.float32(norm.eps), i32(norm.stats.shape[1])


def _residual_args(res: ResidualEpilogue, x: torch.Tensor, m: int, n: int, dev: torch.device) -> tuple:
    check(res.residual, "residual.residual", torch.bfloat16, (m, n), dev, align=2)
    check(res.stats, "residual.stats", torch.float32, norm_stats_shape(m, n), dev, align=4)
    if _overlaps(res.residual, x):
        raise ValueError("residual.residual overlaps x: the kernel reads x while it updates the residual")
    return ptr(res.residual), ptr(res.stats)


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _check_x(x: torch.Tensor, k: int, name: str = "x") -> int:
    check(x, name, torch.bfloat16, (None, k))
    m = x.shape[0]
    if not 1 <= m <= MAX_M:
        raise ValueError(f"{name}: GEMV takes 1..{MAX_M} rows, got {m} (use linear_int4_prefill)")
    return m


def gemv_int4(
    x: torch.Tensor,
    weight: Int4Weight,
    out: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    workspace: GemvWorkspace | None = None,
    plan: GemvPlan | None = None,
    silu_mul_input: bool = False,
    family: str = FAMILY,
    *,
    norm: NormPrologue | None = None,
    residual: ResidualEpilogue | None = None,
    merge: AttentionMerge | None = None,
) -> torch.Tensor | None:
    """out[M, N] = x[M, K] @ W^T (+ bias), M = 1..8, bf16, on the current stream.

    x: bf16 [M, K] contiguous; or, with `silu_mul_input`, the gate_up output [M, 2K] from which the
    kernel computes silu(gate) * up while staging it (fused MLP activation); or, with `norm`, the
    residual stream, normalised while staging (`NormPrologue`; not with `silu_mul_input`). weight:
    Int4Weight [N, K]; bias: bf16 [N] or None; out: bf16 [M, N] (written completely), or None with
    `residual`, which adds y into the residual stream instead (`ResidualEpilogue`; not with `norm`).
    merge: x is an attention output whose split rows this launch merges while staging them
    (`AttentionMerge`; with `residual` only: the o projection). workspace: required when the plan
    splits K (plan.splits > 1). family: the registry entry to launch
    from (benchmarks register compile-option variants of "gemv" under other names). Returns out.
    """
    n, k = weight.n, weight.k
    dev = weight.qweight.device
    index = require_sm90(dev)
    if norm is not None and (silu_mul_input or residual is not None):
        raise ValueError("a norm prologue takes a plain input and stores y: "
                         "not with silu_mul_input or residual")
    if merge is not None and (residual is None or silu_mul_input):
        raise ValueError("the merge prologue is the o projection's: a plain input and the residual epilogue")
    if (out is None) != (residual is not None):
        raise ValueError("pass out, or residual (the output then goes into the residual stream), not both")
    if silu_mul_input:
        check(x, "x", torch.bfloat16, (None, 2 * k), dev)
        m = x.shape[0]
        if not 1 <= m <= MAX_M:
            raise ValueError(f"x: GEMV takes 1..{MAX_M} rows, got {m}")
    else:
        m = _check_x(x, k)
        check(x, "x", torch.bfloat16, (m, k), dev)
    if out is not None:
        check(out, "out", torch.bfloat16, (m, n), dev, align=2)
    if bias is not None:
        check(bias, "bias", torch.bfloat16, (n,), dev, align=2)
    extra = ()
    if norm is not None:
        extra = _norm_args(norm, m, k, dev)
    elif residual is not None:
        extra = _residual_args(residual, x, m, n, dev)
    plan = plan or plan_gemv(n, k, dev, silu_input=silu_mul_input, group_size=weight.group_size)
    ws_ptr, cnt_ptr = _split_workspace(plan, weight, m, workspace)
    merged = ""
    if merge is not None:
        extra += _merge_args(merge, m, k, dev)
        merged = f"_merge_hd{merge.head_dim}"
    shared = plan.launch_shared_bytes(m, merge.head_dim if merge is not None else 0)
    name = (f"gemv_int4_{weight.kernel_suffix()}{'_silu' if silu_mul_input else ''}"
            f"{'_norm' if norm is not None else ''}{merged}{'_resid' if residual is not None else ''}")
    args = (
        ptr(x), ptr(weight.qweight), ptr(weight.scales), ptr(weight.zeros), ptr(bias), ptr(out),
        ws_ptr, cnt_ptr, i32(m), i32(n), i32(k), i32(plan.kc), *extra,
    )  # fmt: skip
    launch(family, name, index, (plan.blocks_n, plan.splits, 1), (THREADS, 1, 1), args, shared)
    return out


def _split_workspace(plan: GemvPlan, weight: Int4Weight, m: int, workspace: GemvWorkspace | None):
    """The (partials, counters) pointers a launch of `plan` needs (0, 0 unsplit); refuses a plan of
    another shape and a missing, too small or foreign workspace."""
    if (plan.n, plan.k) != (weight.n, weight.k):
        raise ValueError(f"plan is for [{plan.n}, {plan.k}], weight is [{weight.n}, {weight.k}]")
    if plan.splits == 1:
        return np.uint64(0), np.uint64(0)
    if workspace is None:
        raise ValueError(f"this shape splits K {plan.splits} ways: pass a GemvWorkspace")
    if workspace.partials.numel() < plan.workspace_floats(m) or workspace.counters.numel() < plan.blocks_n:
        raise ValueError("GemvWorkspace too small for this shape; allocate it from all plans")
    if workspace.partials.device != weight.qweight.device:
        raise ValueError("GemvWorkspace is on another device")
    return ptr(workspace.partials), ptr(workspace.counters)


# head_dim values the fused qkv epilogue takes: a 128-row block must hold whole heads
ROPE_HEAD_DIMS = (32, 64, 128)


def gemv_int4_qkv_rope(
    x: torch.Tensor,
    weight: Int4Weight,
    bias: torch.Tensor | None,
    shape: layer_ops.AttentionShape,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    inv_freq: torch.Tensor,
    q_out: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    workspace: GemvWorkspace | None = None,
    plan: GemvPlan | None = None,
    family: str = FAMILY,
    *,
    norm: NormPrologue | None = None,
) -> torch.Tensor:
    """The qkv projection of M = 1..8 decode rows and what follows it, in one launch: the GEMV
    qkv = x @ Wqkv^T + bias, then `layer_ops.qkv_rope_kv_write` on it as the GEMV's epilogue (RoPE on
    q and k, q to q_out, k and v into the paged cache at slot_mapping; < 0 skips). The same bits as
    those two launches; qkv itself is not written.

    x: bf16 [M, K]; weight: Int4Weight [(Hq + 2 Hkv) D, K]; bias: bf16 [N] or None; shape: a
    `layer_ops.AttentionShape` (n_heads, n_kv_heads, head_dim; head_dim in ROPE_HEAD_DIMS);
    positions, slot_mapping: int32 [M]; inv_freq: fp32 [D / 2]; q_out: bf16 [M, Hq, D]; k_cache,
    v_cache: bf16 [num_blocks, Hkv, block_size, D]. workspace, plan, norm (x is then the residual
    stream: the `_norm_rope` kernels), family: as in `gemv_int4`. Returns q_out."""
    n, k = weight.n, weight.k
    dev = weight.qweight.device
    index = require_sm90(dev)
    hq, hkv, d = shape.n_heads, shape.n_kv_heads, shape.head_dim
    if d not in ROPE_HEAD_DIMS:
        raise ValueError(f"the fused qkv epilogue needs head_dim in {ROPE_HEAD_DIMS}, got {d}")
    if n != (hq + 2 * hkv) * d:
        raise ValueError(f"qkv weight has {n} rows, the heads need (Hq + 2 Hkv) D = {(hq + 2 * hkv) * d}")
    m = _check_x(x, k)
    check(x, "x", torch.bfloat16, (m, k), dev)
    if bias is not None:
        check(bias, "bias", torch.bfloat16, (n,), dev, align=2)
    layer_ops.check_rope_kv_args(shape, m, positions, slot_mapping, inv_freq, q_out, k_cache, v_cache, dev)
    extra = () if norm is None else _norm_args(norm, m, k, dev)
    plan = plan or plan_gemv(n, k, dev, group_size=weight.group_size)
    ws_ptr, cnt_ptr = _split_workspace(plan, weight, m, workspace)
    args = (
        ptr(x), ptr(weight.qweight), ptr(weight.scales), ptr(weight.zeros), ptr(bias), ws_ptr, cnt_ptr,
        i32(m), i32(n), i32(k), i32(plan.kc), ptr(positions), ptr(slot_mapping), ptr(inv_freq),
        ptr(q_out), ptr(k_cache), ptr(v_cache), i32(hq), i32(hkv), i32(d), i32(k_cache.shape[2]), *extra,
    )  # fmt: skip
    name = f"gemv_int4_{weight.kernel_suffix()}{'_norm' if norm is not None else ''}_rope"
    launch(family, name, index, (plan.blocks_n, plan.splits, 1), (THREADS, 1, 1), args,
           plan.launch_shared_bytes(m))
    return q_out


INT8_GROUP_SIZES = (64, 128)  # a 64-column chunk of the kernel must lie inside one group
INT8_ROWS_PER_BLOCK = 128  # nq_gemv8::ROWS_PER_BLOCK
INT8_XPAD = 8  # nq_gemv8::XPAD


@dataclasses.dataclass(frozen=True)
class Int8Weight:
    """An INT8 weight on the GPU (layout `int8-g{G}-rowmajor-v1`): qweight int8 [N, K], scales bf16
    [N, K/G]; w = q * s, symmetric. G must be 64 or 128 for the kernel; K a multiple of 64."""

    qweight: torch.Tensor
    scales: torch.Tensor
    n: int
    k: int
    group_size: int

    def __post_init__(self) -> None:
        n, k, g = self.n, self.k, self.group_size
        if g not in INT8_GROUP_SIZES:
            raise ValueError(f"the INT8 GEMV supports group sizes {INT8_GROUP_SIZES}, got {g} "
                             "(re-pack the lm_head with --group-size 64 or 128, or use --lm-head bf16/int4)")
        if k % g or k % 64 or n <= 0 or k <= 0:
            raise ValueError(f"INT8 GEMV needs K % 64 == 0 and K % G == 0, got [{n}, {k}], G = {g}")
        dev = self.qweight.device
        check(self.qweight, "qweight", torch.int8, (n, k), dev)
        check(self.scales, "scales", torch.bfloat16, (n, k // g), dev, align=2)

    @classmethod
    def from_quantized(cls, qt, device: torch.device | str = "cuda") -> Int8Weight:
        """Upload a nanoqwen_format QuantizedTensor (encoding "int8")."""
        if qt.encoding != "int8":
            raise ValueError(f"expected an int8 QuantizedTensor, got encoding {qt.encoding!r}")
        n, k = qt.shape
        qweight = torch.from_numpy(np.ascontiguousarray(qt.qweight)).to(device)
        scales = torch.from_numpy(np.ascontiguousarray(qt.scales)).view(torch.bfloat16).to(device)
        return cls(qweight, scales, n, k, qt.group_size)

    def nbytes(self) -> int:
        """Bytes the GEMV must read: int8 weights + bf16 scales."""
        return self.qweight.numel() + self.scales.numel() * 2


def int8_shared_bytes(m: int, k: int) -> int:
    """Dynamic shared memory of gemv_int8: x staged as M rows of K + 8 fp16."""
    return m * (k + INT8_XPAD) * 2


def gemv_int8(
    x: torch.Tensor, weight: Int8Weight, out: torch.Tensor, family: str = FAMILY
) -> torch.Tensor:
    """out[M, N] = x[M, K] @ W^T, M = 1..8, bf16 in and out, fp32 accumulation, on the current stream.

    x: bf16 [M, K] contiguous; weight: Int8Weight [N, K]; out: bf16 [M, N] (written completely).
    family: as in gemv_int4. Allocates nothing, never synchronises: graph-capturable. Returns out."""
    n, k = weight.n, weight.k
    dev = weight.qweight.device
    index = require_sm90(dev)
    m = _check_x(x, k)
    check(x, "x", torch.bfloat16, (m, k), dev)
    check(out, "out", torch.bfloat16, (m, n), dev, align=2)
    args = (ptr(x), ptr(weight.qweight), ptr(weight.scales), ptr(out), i32(m), i32(n), i32(k))
    grid = (-(-n // INT8_ROWS_PER_BLOCK), 1, 1)
    launch(family, f"gemv_int8_g{weight.group_size}", index, grid, (THREADS, 1, 1), args,
           int8_shared_bytes(m, k))
    return out


def dequantize_int4(weight: Int4Weight, out: torch.Tensor, *,
                    max_blocks: int | None = None) -> torch.Tensor:
    """out[N, K] (bf16, preallocated) = bf16((q - z) * s): the dense weight, rounded once. max_blocks: at
    most this many blocks of 256 threads (the kernel strides over the tiles), e.g. to leave most SMs to a
    GEMM on another stream; default 16 per SM."""
    dev = weight.qweight.device
    index = require_sm90(dev)
    check(out, "out", torch.bfloat16, (weight.n, weight.k), dev)
    if max_blocks is not None and max_blocks < 1:
        raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
    tiles = (weight.n // 8) * (weight.k // 128)
    blocks = min(-(-tiles // 8), _sm_count(index) * 16, max_blocks or tiles)
    args = (
        ptr(weight.qweight),
        ptr(weight.scales),
        ptr(weight.zeros),
        ptr(out),
        i32(weight.n),
        i32(weight.k),
    )
    launch(FAMILY, f"dequant_int4_{weight.kernel_suffix()}", index, (blocks, 1, 1), (256, 1, 1), args)
    return out


def linear_int4_prefill(
    x: torch.Tensor,
    weight: Int4Weight,
    out: torch.Tensor,
    dense_scratch: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[T, N] = x[T, K] @ W^T (+ bias) for any T: dequantize into `dense_scratch` (bf16 [N, K],
    preallocated, reusable across layers), then one cuBLAS GEMM (torch.addmm / torch.mm, fp32
    accumulation)."""
    check(x, "x", torch.bfloat16, (None, weight.k), weight.qweight.device)
    check(out, "out", torch.bfloat16, (x.shape[0], weight.n), weight.qweight.device)
    dequantize_int4(weight, dense_scratch)
    if bias is None:
        torch.mm(x, dense_scratch.t(), out=out)
    else:
        torch.addmm(bias, x, dense_scratch.t(), out=out)
    return out
