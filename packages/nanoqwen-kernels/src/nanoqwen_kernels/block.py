"""The post-attention half of a decoder layer at M = 1..2 decode rows, in one persistent launch.

    resid   += attn @ Wo^T                          (o_proj; the GEMV's residual epilogue)
    gate_up  = (RMSNorm(resid) * w_norm) @ Wgu^T    (gate_up; the GEMV's norm prologue)
    resid   += (silu(gate) * up) @ Wdown^T          (down; SiLU input and the residual epilogue)
  and, with a `NextQkv` (the `_qkv` kernels), the next layer's attention input:
    qkv      = (RMSNorm(resid) * w_in) @ Wqkv^T + b, RoPE, q and the paged K/V written
                                                    (the qkv GEMV's norm prologue and epilogue)

The three GEMVs of `gemv.py` do the same in three launches; this kernel (csrc/block_int4.cuh) runs
them as one, one CTA per SM, each warp streaming its share of all three weights through a ring of bulk
copies that runs ahead across the ops' boundaries, and CTAs waiting for an op's last output on
counters in global memory (so every CTA must be resident at once: `post_attention_block` checks the
occupancy before it launches). It leaves the new residual's sums of squares per row and 128 columns,
fp32 `gemv.norm_stats_shape(M, H)`, as the GEMV's residual epilogue does: the next qkv GEMV's norm
prologue reads them.

Plan, then run: `plan_post_attention(H, I, Kq, device)` fixes the grid and each op's share of the
warps; `BlockWorkspace` holds the partial sums of pairs that two warps share and the counters, which
return to zero at the end of every launch. The launch allocates nothing and never synchronises: it is
CUDA-graph capturable. G = 128 only (bf16 or fp16 scales, symmetric or not); no bias.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from . import gemv, layer_ops
from .gemv import ROPE_HEAD_DIMS, XPAD, Int4Weight, norm_stats_shape
from .launch import check, f32, get_function, i32, launch, ptr, require_sm90

FAMILY = "block"
MAX_M = 2  # nq_block::MAX_M
TILE_BYTES = 512
PAIR_ROWS = 16  # a warp's output rows (two 8-row tiles)
MAX_OPS = 4  # nq_block::MAX_OPS
# nq_block's counters: op_done[4], the exit count, one per 128-column block of the residual, one per head
# of the qkv op, then one per pair
MAX_STAT_BLOCKS = 128
MAX_HEADS = 256
PAIR_COUNTERS = MAX_OPS + 1 + MAX_STAT_BLOCKS + MAX_HEADS


@dataclasses.dataclass(frozen=True)
class BlockBuild:
    """A build of the kernel (its compile-time shape, block_int4.cuh): warps per CTA, tile-columns per
    ring slot, slots per warp."""

    warps: int = 16
    chunk: int = 3
    ring: int = 3
    int8: bool = False  # the int8 tensor-core chunk step (csrc/block_int4.cuh, -DNQ_BLOCK_INT8_MMA=1)
    extra_options: tuple[str, ...] = ()  # e.g. ("-DNQ_BLOCK_STRESS_DELAY_NS=4000",): the tests' stress build

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def options(self) -> tuple[str, ...]:
        return (f"-DNQ_BLOCK_WARPS={self.warps}", f"-DNQ_BLOCK_CHUNK={self.chunk}",
                f"-DNQ_BLOCK_RING={self.ring}", *(("-DNQ_BLOCK_INT8_MMA=1",) if self.int8 else ()),
                *self.extra_options)

    def shared_bytes(self, m: int, k_max: int) -> int:
        """Dynamic shared memory: the warps' rings, then x staged as M rows of k_max + XPAD bf16, then (int8)
        the planes' table, gemv.PLANE_TAB_BYTES per 128 columns."""
        table = k_max // 128 * gemv.PLANE_TAB_BYTES if self.int8 else 0
        return self.warps * self.ring * 2 * self.chunk * TILE_BYTES + m * (k_max + XPAD) * 2 + table


# family name -> its build; "block" is specs.py's (the header's defaults). Benchmarks add variants with
# `register_build`.
BUILDS: dict[str, BlockBuild] = {FAMILY: BlockBuild()}
# the int8 build (`register_int8_mma`): 2 ring slots per warp, as the bf16 build's w20c3r2 / w16c4r2 (with
# 3 the 7B's M = 2 staging, its plane table and the rings pass the 227 KB of shared memory by 384 bytes)
INT8_MMA_FAMILY = "block_i8mma"
INT8_MMA_BUILD = BlockBuild(ring=2, int8=True)


def register_build(family: str, build: BlockBuild) -> None:
    """Register a compile-option build of the kernel as op family `family` (benchmarks)."""
    from . import specs
    from .build import KernelSpec

    specs.SPECS[family] = KernelSpec(family, ("block.cu",), build.options)
    BUILDS[family] = build


def register_int8_mma() -> str:
    """Register the int8 build (INT8_MMA_BUILD) as family INT8_MMA_FAMILY and return the family's name."""
    if INT8_MMA_FAMILY not in BUILDS:
        register_build(INT8_MMA_FAMILY, INT8_MMA_BUILD)
    return INT8_MMA_FAMILY


@dataclasses.dataclass(frozen=True)
class BlockPlan:
    """hidden: H; intermediate: I; q_dim: o_proj's K (Hq * D); grid: CTAs (one per SM); warps: how
    many warps share each op's work (o_proj, gate_up, down[, qkv]): min(warps in the grid, the op's pair
    count x tile-columns); family: the build that runs (`BUILDS`); qkv_dim: the next layer's qkv rows
    ((Hq + 2 Hkv) D) when the plan runs it too (the `_qkv` kernels), else None."""

    hidden: int
    intermediate: int
    q_dim: int
    grid: int
    warps: tuple[int, ...]
    family: str = FAMILY
    qkv_dim: int | None = None

    @property
    def build(self) -> BlockBuild:
        return BUILDS[self.family]

    @property
    def shapes(self) -> tuple[tuple[int, int], ...]:
        """(N, K) of o_proj, gate_up, down[, qkv]."""
        return _shapes(self.hidden, self.intermediate, self.q_dim, self.qkv_dim)

    @property
    def k_max(self) -> int:
        return max(k for _, k in self.shapes)

    @property
    def max_pairs(self) -> int:
        return max(n // PAIR_ROWS for n, _ in self.shapes)

    def shared_bytes(self, m: int) -> int:
        return self.build.shared_bytes(m, self.k_max)


def _shapes(h: int, i: int, q_dim: int, qkv_dim: int | None) -> tuple[tuple[int, int], ...]:
    ops = ((h, q_dim), (2 * i, h), (h, i))
    return ops + ((qkv_dim, h),) if qkv_dim is not None else ops


def plan_post_attention(hidden: int, intermediate: int, q_dim: int, device: torch.device,
                        sms: int | None = None, family: str = FAMILY, *,
                        qkv_dim: int | None = None) -> BlockPlan:
    """The plan for a layer of this geometry on `device` (one CTA per SM; `sms` overrides the count;
    family: which build, `BUILDS`); qkv_dim: also the next layer's qkv projection of that many rows."""
    if sms is None:
        sms = gemv._sm_count(require_sm90(device))
    for name, v in (("hidden", hidden), ("intermediate", intermediate), ("q_dim", q_dim)):
        if v <= 0 or v % 128:
            raise ValueError(f"{name} must be a positive multiple of 128, got {v}")
    if qkv_dim is not None and (qkv_dim <= 0 or qkv_dim % PAIR_ROWS):
        raise ValueError(f"qkv_dim must be a positive multiple of 16, got {qkv_dim}")
    if hidden > 128 * MAX_STAT_BLOCKS:
        raise ValueError(f"hidden {hidden} > {128 * MAX_STAT_BLOCKS}: more statistics blocks than the "
                         "kernel counts")
    total = sms * BUILDS[family].warps
    shapes = _shapes(hidden, intermediate, q_dim, qkv_dim)
    warps = tuple(min(total, (n // PAIR_ROWS) * (k // 128)) for n, k in shapes)
    for n, k in shapes:
        if (n // PAIR_ROWS) * (k // 128) * total >= 2**62:
            raise ValueError("shape too large for the kernel's work partition")
    return BlockPlan(hidden, intermediate, q_dim, sms, warps, family, qkv_dim)


@dataclasses.dataclass(frozen=True)
class BlockWorkspace:
    """partials: fp32 [grid x warps per CTA x 2 x 32] (the pieces of pairs two warps share); pair_stats:
    fp32 [MAX_M x H / 16] (the residual's sums of squares per pair, before their per-128 sums); qkv:
    bf16 [MAX_M x qkv_dim] (the qkv op's bf16(y + bias), where a head's pairs meet; empty without a qkv
    op); counters: int32 [PAIR_COUNTERS + max pairs], zero between launches (each launch leaves them at
    zero)."""

    partials: torch.Tensor
    pair_stats: torch.Tensor
    qkv: torch.Tensor
    counters: torch.Tensor

    @classmethod
    def allocate(cls, plan: BlockPlan, device: torch.device) -> BlockWorkspace:
        return cls(torch.empty(plan.grid * plan.build.warps * 64, dtype=torch.float32, device=device),
                   torch.empty(MAX_M * plan.hidden // PAIR_ROWS, dtype=torch.float32, device=device),
                   torch.empty(MAX_M * (plan.qkv_dim or 0), dtype=torch.bfloat16, device=device),
                   torch.zeros(PAIR_COUNTERS + plan.max_pairs, dtype=torch.int32, device=device))


@dataclasses.dataclass(frozen=True)
class NextQkv:
    """The next layer's qkv projection, run by the `_qkv` kernels after down: its input is RMSNorm of
    the final residual with `norm_weight` (the next layer's input norm), its epilogue the qkv GEMV's
    (`gemv.gemv_int4_qkv_rope`): bias, RoPE on q and k, q to q_out, k and v into the paged cache at
    slot_mapping (< 0: not written). weight: Int4Weight [(Hq + 2 Hkv) D, H] of the block's layout;
    bias: bf16 [N] or None; shape: layer_ops.AttentionShape (head_dim in gemv.ROPE_HEAD_DIMS);
    positions, slot_mapping: int32 [M]; inv_freq: fp32 [D / 2]; q_out: bf16 [M, Hq, D]; k_cache,
    v_cache: bf16 [num_blocks, Hkv, block_size, D]."""

    weight: Int4Weight
    bias: torch.Tensor | None
    norm_weight: torch.Tensor
    shape: layer_ops.AttentionShape
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    inv_freq: torch.Tensor
    q_out: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor


def check_layout(weights: tuple[Int4Weight, ...]) -> str:
    """The kernel that runs o_proj, gate_up and down (and qkv) of these layouts; refuses a group size
    other than 128 and weights that do not share one layout (symmetry, scale dtype)."""
    w0 = weights[0]
    for w in weights:
        if w.group_size != 128:
            raise ValueError(f"the post-attention block kernel takes group size 128 only, got {w.group_size}")
        if (w.symmetric, w.f16_scales) != (w0.symmetric, w0.f16_scales):
            raise ValueError("the block's INT4 weights must share one layout (symmetry and scale dtype)")
    return f"post_attention_block_g128_{'sym' if w0.symmetric else 'asym'}{'_f16s' if w0.f16_scales else ''}"


# the qkv op's launch arguments when there is none (block.cu: Nq, in_norm_w, qkv_bias, qkv_out,
# positions, slot_mapping, inv_freq, q_out, k_cache, v_cache, Hq, Hkv, D, block_size)
_NO_QKV_ARGS = (i32(0),) + (ptr(None),) * 9 + (i32(0),) * 4


def _next_qkv_args(nxt: NextQkv, plan: BlockPlan, workspace: BlockWorkspace, m: int, h: int,
                   dev: torch.device) -> tuple:
    """The qkv op's launch arguments (block.cu's order) after checking nxt against the plan."""
    shape, d = nxt.shape, nxt.shape.head_dim
    if d not in ROPE_HEAD_DIMS:
        raise ValueError(f"the qkv op needs head_dim in {ROPE_HEAD_DIMS}, got {d}")
    n = (shape.n_heads + 2 * shape.n_kv_heads) * d
    if (nxt.weight.n, nxt.weight.k) != (n, h) or plan.qkv_dim != n:
        raise ValueError(f"next qkv: weight is [{nxt.weight.n}, {nxt.weight.k}], the heads need [{n}, {h}] "
                         f"and the plan {plan.qkv_dim} rows")
    if n // d > MAX_HEADS:
        raise ValueError(f"next qkv: {n // d} heads > {MAX_HEADS}")
    check(nxt.norm_weight, "next.norm_weight", torch.bfloat16, (h,), dev)
    if nxt.bias is not None:
        check(nxt.bias, "next.bias", torch.bfloat16, (n,), dev, align=2)
    layer_ops.check_rope_kv_args(shape, m, nxt.positions, nxt.slot_mapping, nxt.inv_freq, nxt.q_out,
                                 nxt.k_cache, nxt.v_cache, dev)
    return (i32(n), ptr(nxt.norm_weight), ptr(nxt.bias), ptr(workspace.qkv), ptr(nxt.positions),
            ptr(nxt.slot_mapping), ptr(nxt.inv_freq), ptr(nxt.q_out), ptr(nxt.k_cache), ptr(nxt.v_cache),
            i32(shape.n_heads), i32(shape.n_kv_heads), i32(d), i32(nxt.k_cache.shape[2]))


@functools.cache
def _resident_blocks(family: str, kernel: str, index: int, shared: int) -> int:
    """CTAs of `kernel` one SM holds at once with `shared` bytes of dynamic shared memory."""
    import cupy

    fn = get_function(family, kernel, index)
    if fn.max_dynamic_shared_size_bytes < shared:
        fn.max_dynamic_shared_size_bytes = shared
    with cupy.cuda.Device(index):
        threads = BUILDS[family].threads
        return cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.kernel.ptr, threads, shared)


def post_attention_block(
    attn: torch.Tensor,
    o_proj: Int4Weight,
    norm_weight: torch.Tensor,
    eps: float,
    gate_up_w: Int4Weight,
    down: Int4Weight,
    residual: torch.Tensor,
    gate_up: torch.Tensor,
    stats: torch.Tensor,
    workspace: BlockWorkspace,
    plan: BlockPlan,
    *,
    next_qkv: NextQkv | None = None,
    pdl: bool = False,
) -> None:
    """One launch of the post-attention block on the current stream.

    attn: bf16 [M, Kq] (M = 1..2), the attention output; o_proj: Int4Weight [H, Kq]; norm_weight: bf16
    [H] (post-attention RMSNorm) and its eps; gate_up_w: Int4Weight [2I, H] (gate rows, then up rows);
    down: Int4Weight [H, I]; residual: bf16 [M, H], updated in place (o_proj's and down's outputs added);
    gate_up: bf16 [M, 2I], written (gate_up's output, down's input); stats: fp32
    `gemv.norm_stats_shape(M, H)`, written (the final residual's sums of squares per 128 columns).
    workspace / plan: from this plan. next_qkv: the next layer's qkv projection too (`NextQkv`; the
    plan must have its qkv_dim), the `_qkv` kernels.
    pdl: launch with programmatic dependent launch (the ring's first weight copies go out before the
    kernel waits for the previous one).
    """
    dev = attn.device
    index = require_sm90(dev)
    h, i, kq = plan.hidden, plan.intermediate, plan.q_dim
    named = (("o_proj", o_proj, (h, kq)), ("gate_up", gate_up_w, (2 * i, h)), ("down", down, (h, i)))
    for name, w, shape in named:
        if (w.n, w.k) != shape:
            raise ValueError(f"{name}: weight is [{w.n}, {w.k}], the plan needs {list(shape)}")
    if (next_qkv is None) != (plan.qkv_dim is None):
        raise ValueError("pass next_qkv exactly when the plan has a qkv op "
                         "(plan_post_attention(qkv_dim=...))")
    weights = (o_proj, gate_up_w, down)
    kernel = check_layout(weights + ((next_qkv.weight,) if next_qkv is not None else ())) + (
        "_qkv" if next_qkv is not None else "")
    check(attn, "attn", torch.bfloat16, (None, kq), dev)
    m = attn.shape[0]
    if not 1 <= m <= MAX_M:
        raise ValueError(f"attn: the post-attention block kernel takes 1..{MAX_M} rows, got {m}")
    check(norm_weight, "norm_weight", torch.bfloat16, (h,), dev)
    check(residual, "residual", torch.bfloat16, (m, h), dev)
    check(gate_up, "gate_up", torch.bfloat16, (m, 2 * i), dev)
    check(stats, "stats", torch.float32, norm_stats_shape(m, h), dev, align=4)
    build = plan.build
    if (workspace.partials.numel() < plan.grid * build.warps * 64
            or workspace.pair_stats.numel() < MAX_M * h // PAIR_ROWS
            or workspace.qkv.numel() < MAX_M * (plan.qkv_dim or 0)
            or workspace.counters.numel() < PAIR_COUNTERS + plan.max_pairs):
        raise ValueError("BlockWorkspace too small for this plan; allocate it from the plan")
    shared = plan.shared_bytes(m)
    resident = _resident_blocks(plan.family, kernel, index, shared)
    sms = gemv._sm_count(index)
    if resident * sms < plan.grid:
        raise RuntimeError(f"{kernel}: {plan.grid} CTAs must be resident at once, the GPU holds "
                           f"{resident} per SM x {sms} SMs")
    qkv_args = _NO_QKV_ARGS
    if next_qkv is not None:
        qkv_args = _next_qkv_args(next_qkv, plan, workspace, m, h, dev)
        weights += (next_qkv.weight,)
    weight_args = []
    for w, warps in zip(weights, plan.warps, strict=True):
        weight_args += [ptr(w.qweight), ptr(w.scales), ptr(w.zeros), i32(warps)]
    weight_args += [ptr(None), ptr(None), ptr(None), i32(0)] * (MAX_OPS - len(weights))
    args = (
        ptr(attn), ptr(residual), ptr(gate_up), ptr(stats), ptr(workspace.pair_stats), ptr(norm_weight),
        f32(eps), ptr(workspace.partials), ptr(workspace.counters), i32(m), i32(h), i32(i), i32(kq),
        *weight_args, *qkv_args,
    )  # fmt: skip
    launch(plan.family, kernel, index, (plan.grid, 1, 1), (build.threads, 1, 1), args, shared, pdl=pdl)
