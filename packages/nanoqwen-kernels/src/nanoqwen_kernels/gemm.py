"""INT4 GEMM on tensor cores for M > 8 rows: decode batches (9..64) and prefill chunks (any M).

Same weights (`gemv.Int4Weight`, layout `int4-g{G}-tile8x128-v1`), same exact dequantisation and fp32
accumulation as the decode GEMV (`gemv.gemv_int4`); each dequantised weight fragment is multiplied by
the activation rows of a whole M block. Two kernels: the mma.sync one (csrc/gemm_int4.cuh, any M, also
with a fused SiLU*mul input) and a warp-specialised one on Hopper's wgmma fed by TMA
(csrc/gemm_int4_ws.cuh; `GemmPlan.kernel`), which the measured plans of M <= 64 mostly pick
(`MEASURED_PLANS`). The wgmma kernel also runs M blocks of 128 rows for prefill (`plan_gemm_prefill`,
NT = 16: each dequantised tile reused over 128 tokens; the weights scaled to bf16 before the MMA, as
dequantise + cuBLAS multiplies them), split along K up to 128 rows and stream-K above where it pays
(`prefill_stream_k_pays`).

    y[M, N] = x[M, K] @ W[N, K]^T + bias[N]          (bf16 in and out, fp32 accumulation)

Plan, then run: `plan_gemm(N, K, M)` picks, for M <= 64, the kernel, its M block (R = 16, 32 or 64
rows: n-tiles NT = R / 8; fewer rows than the M class means several M blocks, the later ones finding the
weights in L2) and the split-K factor: measured per shape (`MEASURED_PLANS`), else modelled; a pure
function of the shape, the M class and the SM count (cached). M > 64 without the prefill plan runs
ceil(M / 64) mma.sync M blocks of 64 rows and never splits K. The split-K scratch is a
`gemv.GemvWorkspace`, allocated from the GEMM plans, each sized for its M class (`allocate_workspace`);
the GEMV and the GEMM may share one per stream when it is sized for both. `gemm_int4` allocates nothing and
never synchronises: graph-capturable.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import torch

from . import cuda_driver
from . import gemv as _gemv
from .gemv import GemvWorkspace, Int4Weight
from .launch import check, i32, launch, ptr, require_sm90

# plan.kernel -> (kernel family, threads per block: nq_gemm::THREADS, nq_gemm_ws::WsWarps<R>::THREADS
# for R <= 64; WS_PREFILL_THREADS at R = 128)
KERNELS = {"mma": ("gemm", 256), "wgmma": ("gemm_ws", 640)}
WS_PREFILL_NT = 16  # the wgmma kernel's M blocks of 128 rows (prefill: a dequantised tile per 128 tokens)
WS_PREFILL_THREADS = 384
WS_PREFILL_ROWS = 8 * WS_PREFILL_NT  # its M block; up to this many rows the prefill plan splits K
MBLOCK = 64  # rows of x per M block at NT = 8 (the largest kernel)
ROWS_PER_BLOCK = 128  # nq_gemm::ROWS_PER_BLOCK: 8 warps x 16 weight rows
CHUNK_COLS = 2 * 128  # nq_gemm::CH tile-columns of activations staged per chunk
XPAD = 8  # nq_gemm::XPAD
MAX_SHARED_BYTES = 227 * 1024  # per block on sm_90


def ws_shared_bytes(rows: int, kc: int, group_size: int, asym: bool) -> int:
    """Dynamic shared memory of the wgmma kernel (nq_gemm_ws::WsRing): 128 bytes of mbarriers, the
    scale (and zero) table of 128 rows x kc tile-columns, up to 1023 bytes to the next 1024-byte
    boundary, then NBUF slots of x (rows x 128 bf16) and 16 weight tiles (8 KB)."""
    nbuf = 4 if rows >= 128 else 6 if rows >= 64 else 8
    table = 128 * kc * (128 // group_size) * (3 if asym else 2)
    return 128 + table + 1023 + nbuf * (rows * 256 + 16 * 512)


def blocks_per_sm(group_size: int, n_tiles: int) -> int:
    """Resident blocks per SM of a kernel (csrc/gemm.cu NQ_GEMM_MIN_BLOCKS: what its registers allow);
    the split-K planner aims for about one full wave of them."""
    return 2 if n_tiles == 2 or (n_tiles == 4 and group_size == 128) else 1


def n_tiles_for(m: int) -> int:
    """n-tiles of 8 activation rows per M block for an M-row product: 2 (M <= 16), 4 (<= 32), 8."""
    if m < 1:
        raise ValueError(f"GEMM needs at least one row, got M = {m}")
    return 2 if m <= 16 else 4 if m <= 32 else 8


@dataclasses.dataclass(frozen=True)
class GemmPlan:
    """Launch shape of one (N, K, M class): `n_tiles` (NT: M blocks of 8 NT rows), `splits` blocks
    along K (only for a bounded M class), each over `kc` tile-columns of 128. `max_m`: the largest M the
    plan serves (16, 32, 64, and 128 for the wgmma kernel at NT = 16: one M block of max_m rows, or
    max_m / (8 NT) smaller ones), or None for any M (any number of M blocks, K unsplit)."""

    n: int
    k: int
    group_size: int
    n_tiles: int
    splits: int
    kc: int
    max_m: int | None
    kernel: str = "mma"  # "mma": gemm_int4.cuh (mma.sync); "wgmma": gemm_int4_ws.cuh
    # the prefill plan above 128 rows: this many blocks share the (M block, row block, tile-column) units
    # evenly (stream-K, gemm_int4_ws.cuh); 0: one block per tile (and K split)
    stream_k_blocks: int = 0

    def __post_init__(self) -> None:
        kt = self.k // 128
        if self.kernel not in KERNELS:
            raise ValueError(f"GemmPlan: kernel {self.kernel!r} is not one of {sorted(KERNELS)}")
        prefill = self.kernel == "wgmma" and self.n_tiles == WS_PREFILL_NT
        if self.kernel == "wgmma" and self.max_m is None and not prefill:
            raise ValueError("GemmPlan: the wgmma kernel at NT <= 8 serves M <= 64 (max_m 16, 32 or 64); "
                             f"more rows take NT = {WS_PREFILL_NT}")
        classes = (16, 32, 64, 128) if prefill else (16, 32, 64)
        if (self.n_tiles not in (2, 4, 8) and not prefill) or (self.max_m is not None
                                                               and self.max_m not in classes):
            raise ValueError(f"GemmPlan: n_tiles {self.n_tiles} does not serve max_m {self.max_m}")
        if self.max_m is not None and self.max_m < 8 * self.n_tiles:
            raise ValueError(f"GemmPlan: M blocks of {8 * self.n_tiles} rows for M <= {self.max_m}: use "
                             f"n_tiles {self.max_m // 8}")
        if self.splits < 1 or self.splits * self.kc < kt or (self.splits - 1) * self.kc >= kt:
            raise ValueError(
                f"GemmPlan: {self.splits} splits of {self.kc} tile-columns do not cover K / 128 = "
                f"{kt} exactly once"
            )
        if self.splits > 1 and self.max_m is None:
            raise ValueError("GemmPlan: split-K needs a bounded M class (max_m 16, 32, 64 or 128): its "
                             "[S, M, N] scratch is sized for max_m rows")
        if self.stream_k_blocks and not (prefill and self.max_m is None and self.splits == 1):
            raise ValueError("GemmPlan: stream-K is the prefill plan's above 128 rows (NT 16, any M, "
                             "unsplit)")

    @classmethod
    def of(cls, n: int, k: int, group_size: int, n_tiles: int, max_m: int | None,
           splits: int = 1, kernel: str = "mma") -> GemmPlan:
        """M blocks of 8 `n_tiles` rows for the class `max_m`, split about `splits` ways along K
        (`with_splits`; 1: unsplit), on `kernel`."""
        return cls(n, k, group_size, n_tiles, 1, k // 128, max_m, kernel).with_splits(splits)

    @property
    def blocks_n(self) -> int:
        return -(-self.n // ROWS_PER_BLOCK)

    @property
    def rows_per_mblock(self) -> int:
        return 8 * self.n_tiles

    def m_blocks(self, m: int) -> int:
        return -(-m // self.rows_per_mblock)

    def shared_bytes(self, silu: bool) -> int:
        """Dynamic shared memory. mma: two activation chunk buffers (plain input), or one + the raw gate
        and up rows of the next chunk (silu input). wgmma: the mbarriers and the slot ring
        (nq_gemm_ws::WsRing)."""
        if self.kernel == "wgmma":  # the table's zero points counted: the launcher has the exact figure
            return ws_shared_bytes(self.rows_per_mblock, self.kc, self.group_size, True)
        return (3 if silu else 2) * self.rows_per_mblock * (CHUNK_COLS + XPAD) * 2

    @property
    def threads(self) -> int:
        if self.kernel == "wgmma" and self.n_tiles == WS_PREFILL_NT:
            return WS_PREFILL_THREADS
        return KERNELS[self.kernel][1]

    @property
    def needs_workspace(self) -> bool:
        return self.splits > 1 or self.stream_k_blocks > 0

    def workspace_floats(self, m: int) -> int:
        """Split-K: fp32 partials [S, M, N]. Stream-K: two 128 x 128 partial tiles per block, any M."""
        if self.stream_k_blocks:
            return 2 * self.stream_k_blocks * WS_PREFILL_ROWS * ROWS_PER_BLOCK
        return self.splits * m * self.n if self.splits > 1 else 0

    @property
    def counters(self) -> int:
        """Arrival counters the launch uses: split-K one per (M block, row block) tile, stream-K one per
        block."""
        if self.stream_k_blocks:
            return self.stream_k_blocks
        return self.m_blocks(self.max_m) * self.blocks_n if self.splits > 1 else 0

    def units(self, m: int) -> int:
        """(M block, row block, tile-column) units of an M-row product."""
        return self.m_blocks(m) * self.blocks_n * (self.k // 128)

    def units_per_block(self, m: int) -> int:
        """Stream-K: each block's share of `units(m)` (the last block's may be smaller)."""
        return -(-self.units(m) // self.grid(m)[0])

    def grid(self, m: int) -> tuple[int, int, int]:
        if self.stream_k_blocks:
            return (min(self.stream_k_blocks, self.units(m)), 1, 1)
        return (self.m_blocks(m), self.blocks_n, self.splits)

    def with_splits(self, splits: int) -> GemmPlan:
        """This plan split about `splits` ways along K instead (benchmarks, tests): kc = ceil(K/128 /
        splits) tile-columns per split, so the count used is ceil(K/128 / kc), at most one split per
        tile-column and no empty one. Splitting needs a bounded M class (max_m set)."""
        kt = self.k // 128
        kc = -(-kt // min(max(1, splits), kt))
        return dataclasses.replace(self, splits=-(-kt // kc), kc=kc)


def m_class(m: int) -> int | None:
    """The plan class of an M-row product: 16, 32, 64 (one M block of that many rows) or None (M > 64)."""
    nt = n_tiles_for(m)
    return None if m > MBLOCK else 8 * nt


def split_cost(blocks_n: int, kt: int, splits: int, slots: int, max_m: int) -> int:
    """Modelled time of a split-K plan of one M block, in tile-columns of one block: waves x
    (tile-columns per block + the fp32 partials it writes and the last block reads back when split:
    128 rows x M x 8 bytes against a tile-column's 8 KB of packed weights = M / 8 tile-columns). Waves
    count whole rounds of `slots` resident blocks: the blocks of a plan all take the same time, so a
    partial wave costs a full one (gate_up at M = 16 on 264 slots: 296 blocks unsplit = 2 waves of 28,
    4 splits = 5 waves of 7 + 2)."""
    kc = -(-kt // splits)
    s = -(-kt // kc)
    waves = -(-blocks_n * s // slots)
    return waves * (kc + (max_m // 8 if s > 1 else 0))


# The plan of each M class of the test models' linears (Qwen2.5-Coder 7B, 1.5B, 0.5B; plain input,
# g128): the fastest of every kernel x M-block rows (8 NT) x K splits that fits, measured at the class's
# top M on asymmetric weights (`python -m nanoqwen_bench.kernels.sweep_gemm_plans --model 7b,1.5b,0.5b`,
# H100 80GB HBM3, 2026-12-07; bench/RESULTS.md; swept again with programmatic launch, which moved the
# 1.5B's qkv and o at M <= 32 and its gate_up at 16 from mma.sync to wgmma: 1.07-1.45x per launch, engine
# 1.09x / 1.07x at batch 16 / 32). Keyed by SM count, they also serve the H200 (132 SMs,
# faster HBM), where they were not re-measured. Where plans differ by less than the run's noise the
# table still names the faster one. Key: (sm_count, n, k, group_size, max_m); value: (kernel, n_tiles,
# splits).
MEASURED_PLANS = {
    # 7B: qkv, o, gate_up, down
    (132, 4608, 3584, 128, 16): ("wgmma", 2, 3), (132, 4608, 3584, 128, 32): ("wgmma", 4, 3),
    (132, 4608, 3584, 128, 64): ("wgmma", 4, 1),
    (132, 3584, 3584, 128, 16): ("wgmma", 2, 4), (132, 3584, 3584, 128, 32): ("wgmma", 2, 2),
    (132, 3584, 3584, 128, 64): ("wgmma", 2, 1),
    (132, 37888, 3584, 128, 16): ("wgmma", 2, 1), (132, 37888, 3584, 128, 32): ("wgmma", 4, 1),
    (132, 37888, 3584, 128, 64): ("wgmma", 8, 1),
    (132, 3584, 18944, 128, 16): ("wgmma", 2, 4), (132, 3584, 18944, 128, 32): ("wgmma", 4, 4),
    (132, 3584, 18944, 128, 64): ("wgmma", 8, 4),
    # 1.5B
    (132, 2048, 1536, 128, 16): ("wgmma", 2, 4), (132, 2048, 1536, 128, 32): ("wgmma", 2, 3),
    (132, 2048, 1536, 128, 64): ("wgmma", 2, 1),
    (132, 1536, 1536, 128, 16): ("wgmma", 2, 4), (132, 1536, 1536, 128, 32): ("wgmma", 2, 4),
    (132, 1536, 1536, 128, 64): ("wgmma", 2, 1),
    (132, 17920, 1536, 128, 16): ("wgmma", 2, 1), (132, 17920, 1536, 128, 32): ("wgmma", 4, 1),
    (132, 17920, 1536, 128, 64): ("wgmma", 8, 1),
    (132, 1536, 8960, 128, 16): ("wgmma", 2, 8), (132, 1536, 8960, 128, 32): ("wgmma", 2, 4),
    (132, 1536, 8960, 128, 64): ("wgmma", 4, 4),
    # 0.5B
    (132, 1152, 896, 128, 16): ("wgmma", 2, 1), (132, 1152, 896, 128, 32): ("wgmma", 2, 1),
    (132, 1152, 896, 128, 64): ("wgmma", 2, 1),
    (132, 896, 896, 128, 16): ("wgmma", 2, 1), (132, 896, 896, 128, 32): ("wgmma", 2, 1),
    (132, 896, 896, 128, 64): ("wgmma", 2, 1),
    (132, 9728, 896, 128, 16): ("wgmma", 2, 1), (132, 9728, 896, 128, 32): ("wgmma", 4, 1),
    (132, 9728, 896, 128, 64): ("wgmma", 8, 1),
    (132, 896, 4864, 128, 16): ("wgmma", 2, 8), (132, 896, 4864, 128, 32): ("wgmma", 2, 8),
    (132, 896, 4864, 128, 64): ("wgmma", 2, 4),
}  # fmt: skip


@functools.cache
def plan_gemm_shape(n: int, k: int, group_size: int, max_m: int | None, sm_count: int,
                    silu_input: bool = False) -> GemmPlan:
    """The plan of an M class (`max_m` 16, 32, 64, or None for M > 64: unsplit 64-row M blocks). A
    plain-input shape in MEASURED_PLANS gets its measured kernel, M-block rows and K splits. Otherwise
    (other shapes and group sizes, another SM count, the SiLU*mul input, which only the mma.sync kernel
    takes) one mma.sync M block of `max_m` rows, split along K by the split count with the least
    `split_cost` on `sm_count` x `blocks_per_sm` resident blocks (ties: fewer splits)."""
    if max_m not in (16, 32, 64, None):
        raise ValueError(f"max_m must be 16, 32, 64 or None, got {max_m}")
    kt = k // 128
    if max_m is None:
        return GemmPlan.of(n, k, group_size, 8, None)
    measured = None if silu_input else MEASURED_PLANS.get((sm_count, n, k, group_size, max_m))
    if measured is not None:
        kernel, n_tiles, splits = measured
        return GemmPlan.of(n, k, group_size, n_tiles, max_m, splits, kernel=kernel)
    nt = max_m // 8
    blocks_n = -(-n // ROWS_PER_BLOCK)
    slots = sm_count * blocks_per_sm(group_size, nt)
    best = min(range(1, min(kt, 64) + 1), key=lambda s: (split_cost(blocks_n, kt, s, slots, max_m), s))
    return GemmPlan.of(n, k, group_size, nt, max_m, best)


def plan_gemm(n: int, k: int, m: int, group_size: int = 128, device: torch.device | None = None, *,
              silu_input: bool = False) -> GemmPlan:
    """The plan for an M-row product on `device` (default: the current CUDA device); `silu_input`: for
    the fused SiLU*mul input."""
    device = device or torch.device("cuda", torch.cuda.current_device())
    return plan_gemm_shape(n, k, group_size, m_class(m), _gemv._sm_count(require_sm90(device)), silu_input)


def plan_gemm_prefill(n: int, k: int, m: int, group_size: int, sm_count: int) -> GemmPlan:
    """The wgmma kernel's plan at NT = 16 for an M > 64 product: M blocks of 128 rows, so that each
    dequantised weight tile is reused over 128 tokens. Up to 128 rows one M block, split along K until
    the row blocks x splits about fill `sm_count` SMs (one block per SM: its ring takes most of the
    shared memory); above, ceil(M / 128) M blocks, K unsplit, one block per tile or, where
    `prefill_stream_k_pays`, `sm_count` blocks sharing the units evenly (stream-K). Raises ValueError
    where the scale table and the ring do not fit in shared memory (small groups over a long unsplit
    K)."""
    plan, shared = _prefill_plan_and_shared(n, k, m, group_size, sm_count)
    if shared > MAX_SHARED_BYTES:
        raise ValueError(f"plan_gemm_prefill: [{n}, {k}] g{group_size} at M = {m} needs {shared} B of "
                         f"shared memory (> {MAX_SHARED_BYTES})")
    return plan


def prefill_plan_if_fits(n: int, k: int, m: int, group_size: int, sm_count: int) -> GemmPlan | None:
    """`plan_gemm_prefill`'s plan, or None where its scale table and ring do not fit in shared memory."""
    plan, shared = _prefill_plan_and_shared(n, k, m, group_size, sm_count)
    return plan if shared <= MAX_SHARED_BYTES else None


@functools.cache  # a pure function of its integers; the engine asks once per linear and row count
def _prefill_plan_and_shared(n: int, k: int, m: int, group_size: int, sm_count: int) -> tuple[GemmPlan, int]:
    if m <= MBLOCK:
        raise ValueError(f"plan_gemm_prefill serves M > {MBLOCK}, got M = {m}")
    kt = k // 128
    if m <= WS_PREFILL_ROWS:
        blocks_n = -(-n // ROWS_PER_BLOCK)
        splits = min(kt, max(1, sm_count // blocks_n))
        plan = GemmPlan.of(n, k, group_size, WS_PREFILL_NT, WS_PREFILL_ROWS, splits, kernel="wgmma")
    else:
        plan = GemmPlan.of(n, k, group_size, WS_PREFILL_NT, None, 1, kernel="wgmma")
        if prefill_stream_k_pays(plan, m, sm_count):
            plan = dataclasses.replace(plan, stream_k_blocks=sm_count)
    return plan, ws_shared_bytes(plan.rows_per_mblock, plan.kc, group_size, True)


# Stream-K's cost per block beyond its units, in tile-columns of one block, fitted to the prefill plan
# on the 7B shapes at M = 256 and 512 (H100, 2026-12-07; bench/RESULTS.md): a fixed part (the segment
# ends: the drain of the wgmmas, the partial's round trip, the last block's sum) and a part per
# tile-column of the longest segment (its scale table, loaded while the tensor cores wait).
STREAM_K_FIXED_COST = 10.0
STREAM_K_TABLE_COST = 0.2


def prefill_stream_k_pays(plan: GemmPlan, m: int, sm_count: int) -> bool:
    """Whether the stream-K launch of `plan` (the prefill plan above 128 rows, one block per tile) beats
    it at M rows: the tiles' whole waves x K / 128 tile-columns against each block's share of the units
    plus its measured extra cost. Tiles that fill the waves keep one block each (7B gate_up at M = 512:
    9.0 waves); a last wave that leaves SMs idle goes stream-K (7B qkv at M = 512: 144 tiles on 132 SMs;
    down at M = 256: 56)."""
    kt = plan.k // 128
    tiles = plan.m_blocks(m) * plan.blocks_n
    per_block = -(-plan.units(m) // sm_count)
    extra = STREAM_K_FIXED_COST + STREAM_K_TABLE_COST * min(per_block, kt)
    return per_block + extra < -(-tiles // sm_count) * kt


def plans_for_shapes(shapes, group_size: int, sm_count: int) -> list[GemmPlan]:
    """Every plan of the given (N, K) shapes: all M classes, plain and SiLU input, and the prefill
    plans (`plan_gemm_prefill`, M <= 128 and above) where they fit: what `allocate_workspace` sizes
    from."""
    plans = [plan_gemm_shape(n, k, group_size, c, sm_count, silu)
             for n, k in shapes for c in (16, 32, 64, None) for silu in (False, True)]
    for n, k in shapes:
        for m in (WS_PREFILL_ROWS, WS_PREFILL_ROWS + 1):
            plan = prefill_plan_if_fits(n, k, m, group_size, sm_count)
            if plan is not None:
                plans.append(plan)
                if m > WS_PREFILL_ROWS:  # and its stream-K launch (some M takes it), any M
                    plans.append(dataclasses.replace(plan, stream_k_blocks=sm_count))
    return plans


def allocate_workspace(plans, device: torch.device) -> GemvWorkspace:
    """Split-K scratch for these GEMM plans: fp32 partials for the largest [S, max_m, N] among the split
    plans (each sized for its own M class), zeroed counters."""
    plans = list(plans)
    floats = max([p.workspace_floats(p.max_m) for p in plans if p.needs_workspace] + [1])
    blocks = max([p.counters for p in plans] + [1])
    return GemvWorkspace(torch.empty(floats, dtype=torch.float32, device=device),
                         torch.zeros(blocks, dtype=torch.int32, device=device))


def gemm_int4(
    x: torch.Tensor,
    weight: Int4Weight,
    out: torch.Tensor,
    bias: torch.Tensor | None = None,
    workspace: GemvWorkspace | None = None,
    plan: GemmPlan | None = None,
    silu_mul_input: bool = False,
    family: str | None = None,
) -> torch.Tensor:
    """out[M, N] = x[M, K] @ W^T (+ bias), any M >= 1 (meant for M > 8), bf16, on the current stream.

    x: bf16 [M, K] contiguous; or, with `silu_mul_input`, the gate_up output [M, 2K] (the kernel
    multiplies silu(gate) * up, rounded to bf16, as it stages it). weight: Int4Weight [N, K]; bias:
    bf16 [N] or None; out: bf16 [M, N], written completely (nothing outside it). plan: from
    `plan_gemm` for this M (default: made here); workspace: required when the plan splits K.
    family: the registry entry to launch from (default: the plan's kernel's; benchmarks may register
    variants). Returns out.
    """
    n, k = weight.n, weight.k
    dev = weight.qweight.device
    index = require_sm90(dev)
    check(x, "x", torch.bfloat16, (None, 2 * k if silu_mul_input else k), dev)
    m = x.shape[0]
    if m < 1:
        raise ValueError("x: GEMM needs at least one row")
    check(out, "out", torch.bfloat16, (m, n), dev, align=2)
    if bias is not None:
        check(bias, "bias", torch.bfloat16, (n,), dev, align=2)
    plan = plan or plan_gemm(n, k, m, weight.group_size, dev, silu_input=silu_mul_input)
    if (plan.n, plan.k, plan.group_size) != (n, k, weight.group_size):
        raise ValueError(
            f"plan is for [{plan.n}, {plan.k}] g{plan.group_size}, weight is [{n}, {k}] g{weight.group_size}"
        )
    if plan.max_m is not None and m > plan.max_m:
        raise ValueError(f"plan serves M <= {plan.max_m}, got M = {m}: use plan_gemm(N, K, M)")
    if plan.kernel == "wgmma" and silu_mul_input:
        raise ValueError("the wgmma GEMM takes a plain input: run silu_mul first")
    ws_ptr = cnt_ptr = np.uint64(0)
    if plan.needs_workspace:
        if workspace is None:
            raise ValueError(f"this plan splits K {plan.splits} ways or runs stream-K: pass a workspace "
                             "(allocate_workspace)")
        small = workspace.partials.numel() < plan.workspace_floats(m)
        if small or workspace.counters.numel() < plan.counters:
            raise ValueError("GEMM workspace too small for this shape; allocate it from all plans")
        if workspace.partials.device != dev:
            raise ValueError("GEMM workspace is on another device")
        ws_ptr, cnt_ptr = ptr(workspace.partials), ptr(workspace.counters)
    name = kernel_name(weight.kernel_suffix(), silu_mul_input, plan.n_tiles, plan.kernel,
                       plan.stream_k_blocks > 0)
    kc = plan.units_per_block(m) if plan.stream_k_blocks else plan.kc  # stream-K: units per block
    args = (
        ptr(x), ptr(weight.qweight), ptr(weight.scales), ptr(weight.zeros), ptr(bias), ptr(out),
        ws_ptr, cnt_ptr, i32(m), i32(n), i32(k), i32(kc),
    )  # fmt: skip
    shared = plan.shared_bytes(silu_mul_input)
    if plan.kernel == "wgmma":  # tensor maps of x and of the weights (by value, the last arguments)
        if weight.zeros is None:  # plan.shared_bytes counts a zero-point table; symmetric weights have none
            shared = ws_shared_bytes(plan.rows_per_mblock, plan.kc, plan.group_size, False)
        if shared > MAX_SHARED_BYTES:
            raise ValueError(f"wgmma GEMM plan needs {shared} B of shared memory (> {MAX_SHARED_BYTES}): "
                             "split K more")
        if x.data_ptr() % 16:
            raise ValueError("x: the wgmma GEMM needs a 16-byte-aligned x (TMA)")
        # x: boxes of [8 NT rows, 64 columns], 128-byte swizzle; the packed weights as [N / 8 row-tiles,
        # K / 128 * 512 bytes] of u64: boxes of the block's 16 tiles of one tile-column (512 bytes each)
        args += (cuda_driver.tensor_map_2d_bf16(x.data_ptr(), m, k, plan.rows_per_mblock, 64),
                 cuda_driver.tensor_map_2d(weight.qweight.data_ptr(), n // 8, k // 128 * 64, 16, 64,
                                           cuda_driver.CU_TENSOR_MAP_DATA_TYPE_UINT64,
                                           cuda_driver.CU_TENSOR_MAP_SWIZZLE_NONE))
    launch(family or KERNELS[plan.kernel][0], name, index, plan.grid(m), (plan.threads, 1, 1), args, shared)
    return out


def kernel_name(suffix: str, silu: bool, n_tiles: int, kernel: str = "mma", stream_k: bool = False) -> str:
    """Entry point for an `Int4Weight.kernel_suffix()` (e.g. "g128_sym", "g128_asym_f16s")."""
    if kernel == "wgmma":
        return f"gemm_ws_int4_{suffix}_n{n_tiles}{'_sk' if stream_k else ''}"
    return f"gemm_int4_{suffix}{'_silu' if silu else ''}_n{n_tiles}"


def gemm_bytes(weight: Int4Weight, m: int) -> int:
    """Bytes the GEMM must move at least: packed weights + scales (+ zeros), x [M, K] and out [M, N]
    (bf16), each once."""
    return weight.nbytes() + 2 * m * (weight.k + weight.n)
