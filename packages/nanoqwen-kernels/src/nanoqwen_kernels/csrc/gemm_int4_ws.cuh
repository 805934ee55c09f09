// gemm_int4_ws.cuh: the INT4 GEMM of decode batches (M = 9..64, R = 16/32/64 rows per M block) and of
// prefill (R = 128) on Hopper's warpgroup MMA, with a producer warp: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), W in `int4-g{G}-tile8x128-v1` (docs/DESIGN.md),
// bf16 activations, fp32 accumulation (ST: bf16 or fp16 scales, as the GEMV). At R <= 64 each group's
// (q - z) products are summed unscaled in fp32, then added to an accumulator times the fp32 scale, as in
// gemm_int4.cuh; the two consumer sets (below) keep one accumulator each, over the even and the odd
// tile-columns, added at the end: the order of a 2-way K split, within the same tolerance. At R = 128
// (WsPrefillConsumer) the weights are scaled before the MMA, rounded to bf16: the dense weight of the
// dequantise + cuBLAS path, its tolerance.
//
// Why: the mma.sync GEMM is latency-bound at M = 64 -- one block of 8 warps per SM, ~380 instructions
// per warp per tile-column of which half are addresses, guards and the activation staging, a block
// barrier per chunk. Here one producer warp issues the ring's copies and the consumers dequantise the
// next group while the previous group's wgmmas run.
//
// Block (R <= 64): 20 warps. Warps 0..15 are four consumer warpgroups in two sets of 8 warps (set p =
// warps 8p..8p + 7); warp 16 is the producer (warps 17..19 only complete its warpgroup, which gives
// registers to the consumers: setmaxnreg). R = 128: 12 warps, one consumer set (warps 0..7: a 64-float
// accumulator and two stages of A registers per thread) and the producer warpgroup (WsWarps).
// At R = 128 each dequantised weight tile feeds 128 tokens: prefill's compute-bound M without a
// dequantisation pass over the whole weight.
//   Producer: walks the block's tile-columns and fills a ring of NBUF shared-memory slots with the
//     copy engine, one slot per tile-column, completing on the slot's `full` mbarrier (lane 0 posts
//     the bytes to expect): x by two 2D TMA copies (a CUtensorMap of x [M, K], boxes of R rows x 64
//     columns, 128-byte swizzle; rows >= M read as zeros), the 16 weight tiles by one 2D TMA copy (a
//     CUtensorMap of the packed weights as [N / 8 row-tiles, K / 128 x 512 bytes]; row-tiles >= N / 8
//     read as zeros). It waits on the slot's `empty` mbarrier (8 arrivals: one per warp of the set that
//     reads it) before refilling it. (Measured before, 7B gate_up at M = 64: 16-byte cp.async from the
//     producer warp for everything, scales included, took 134 of the kernel's 179 us in copies alone;
//     16 bulk copies of one 512-byte tile each per stage, ~0.65 us per stage at every M.) Slot contents:
//       X  R rows x 128 columns of x as two [R, 64] boxes in wgmma's K-major 128-byte-swizzle layout
//          (row r's 128 bytes at 128 r, 16-byte chunk c at position c ^ (r % 8); each box 1024-aligned).
//       W  the block's 16 weight tiles of the tile-column, 512 bytes each, as in global memory.
//   Scales and zero points of the block's rows and K range are loaded once, by the consumers, into a
//   [128, kc * G / 128] table before the main loop (they are weights).
//   Consumers: set p takes the tile-columns rel = p (mod 2). In a set, warp w owns tile pair w (16
//     rows: rows g and g + 8 of tiles 2w, 2w + 1), so each warpgroup's 64 rows are the A operand of
//     `wgmma.m64nRk16` in registers (the GEMV's dequantised words, unchanged), B is the slot's X. Per
//     quantization group: dequantise its KS = G / 16 k16 steps, issue KS wgmmas into a fresh fragment
//     (the first overwrites it), commit, wait for them (wait_group 0), fold the fragment into acc with
//     its rows' scales, and release the slot (empty arrive) after its last group. Waiting before the
//     next group's dequantisation is what keeps ptxas from serialising every wgmma (C7513: it does not
//     follow the A registers through a wait_group 1 -- measured, the four 7B linears at M = 64: 163 us
//     with wait_group 1, 140 with wait_group 0); the two sets
//     (four warpgroups) overlap one another's dequantisation and tensor work instead. At the end set 1
//     adds its sums into set 0's through the drained ring, and set 0 stores.
//   Consumers at R = 128 (WsPrefillConsumer, one set): the same A rows, scaled to bf16 before the MMA,
//     so that all wgmmas accumulate into acc; two half tile-column stages of A registers in flight
//     (wait_group 1), no wait per group: 1.17-1.30x the per-group fragments on the four 7B linears at
//     M = 128..512 (H100, bench/RESULTS.md).
//
// Timing probes (wrong outputs; tests never build them), each a -D option: NQ_GEMM_WS_PROBE_NO_MMA (the
// consumers' steps without the wgmmas), NQ_GEMM_WS_PROBE_COPY_ONLY (the ring's copies and barriers
// only), NQ_GEMM_WS_PROBE_X_ONCE (x copied into each slot at its first fill only: the activations' L2
// reads gone, the ceiling of sharing them between blocks), NQ_GEMM_WS_PROBE_NO_MAINLOOP (no copies and
// no consumer steps: the per-block prologue -- barrier init, setmaxnreg, the scale / zero table -- and
// epilogue alone). NQ_GEMM_WS_PROBE_CLOCKS keeps the outputs and records when each block passes each
// phase (R <= 64 launches; the WsClock slots below).
//
// Split-K: as gemm_int4.cuh (fp32 partials [S, M, N], an arrival counter per (M block, row block),
// the last block sums in split order); set 0 synchronises with named barrier 1 (256 threads), all the
// consumers with named barrier 2 (512), the producer having left.
//
// Launch (gemm.py, kernel family "gemm_ws"): grid (ceil(M / R), ceil(N / 128), S) (stream-K, `_n16_sk`:
// (blocks, 1, 1), kc = units per block), WsWarps<R>::THREADS threads,
// dynamic shared memory gemm.ws_shared_bytes (the layout WsRing names), then the tensor maps of x and of
// the packed weights as the last two arguments.
#pragma once
#include "gemm_int4.cuh"
#include "mbarrier.cuh"
#include "wgmma.cuh"

namespace nq_gemm_ws {

using nq_gemm::smem_addr;
using nq_gemv::dq;
using nq_gemv::neg_zero_pair;

// The block's warps, by R (activation rows per M block: the wgmma's N).
// R <= 64: two sets of 8 consumer warps on the same 128 rows (measured 4-9% faster than one set at
// M = 16..64: twice the warps to hide one another's latencies), and a whole producer warpgroup
// (setmaxnreg works per warpgroup), of which one warp copies. setmaxnreg.inc only takes registers that
// a setmaxnreg.dec of the block gave back: the block is launched with 65536 / THREADS per thread,
// rounded down to 8 (96 at 640 threads), and a consumer asking for more than the producer warpgroup
// returned waits forever (measured: a hang at 120). 128 x (96 - 24) returned, 512 x (112 - 96) taken.
// (ptxas compiles the whole kernel within the launch's 96.)
// R = 128 (prefill: each dequantised tile reused over 128 tokens): one set of 8 consumer warps, whose
// accumulator (64 fp32) and two stages of A (2 x 16) need more registers than 640 threads leave: 384 threads,
// launched at 168 registers (3 warps on each SM sub-partition's 16K), the producer warpgroup going
// down to 40 and the consumers up to 232: 256 x (232 - 168) taken, 128 x (168 - 40) returned.
template <int R>
struct WsWarps {
  static constexpr int KSETS = R <= 64 ? 2 : 1;
  static constexpr int SET_WARPS = 8;  // one set: 8 warps x 16 rows = ROWS_PER_BLOCK
  static constexpr int CONSUMER_WARPS = SET_WARPS * KSETS;
  static constexpr int CONSUMERS = CONSUMER_WARPS * 32;
  static constexpr int THREADS = CONSUMERS + 128;
  static constexpr int PRODUCER_REGS = R <= 64 ? 24 : 40, CONSUMER_REGS = R <= 64 ? 112 : 232;
  static constexpr int LAUNCH_REGS = 65536 / THREADS / 8 * 8 < 168 ? 65536 / THREADS / 8 * 8 : 168;
  static_assert(CONSUMERS * (CONSUMER_REGS - LAUNCH_REGS) <= 128 * (LAUNCH_REGS - PRODUCER_REGS),
                "setmaxnreg: the consumers take more registers than the producer gives back");
};
// Quantization groups per consumer step: one. With two consumer sets ptxas fits two in the launch's 96
// registers at R = 16 only (R = 32 spills 8 bytes, R = 64 88). Experiments: NQ_GEMM_WS_BATCH sets it for
// every R, NQ_GEMM_WS_BATCH_R16 for R = 16 alone (the unspilled case; not yet timed with two sets);
// NQ_GEMM_WS_INTERLEAVE issues each group's wgmmas before the next group of the step is dequantised
// (no C7511 / C7512 serialisation at R = 16, SASS checked).
template <int R>
struct GroupsPerStep {
#if defined(NQ_GEMM_WS_BATCH)
  static constexpr int value = NQ_GEMM_WS_BATCH;
#elif defined(NQ_GEMM_WS_BATCH_R16)
  static constexpr int value = R == 16 ? NQ_GEMM_WS_BATCH_R16 : 1;
#else
  static constexpr int value = 1;
#endif
};
constexpr int ROWS_PER_BLOCK = 128;

// Shared memory: the 2 NBUF mbarriers (full, then empty), the scale table (u16 [128, KGB]) and the
// zero table (u8 [128, KGB], asymmetric only; KGB = kc * 128 / G), then, from the next 1024-byte
// boundary (the swizzle atom), NBUF slots of SLOT bytes.
template <int R>
struct WsRing {
  static constexpr int X = 0;
  static constexpr int XBOX = R * 128;  // one [R, 64] bf16 box
  static constexpr int W = 2 * XBOX;
  static constexpr int SLOT = W + 16 * 512;  // a multiple of 1024
  static constexpr int NBUF = R >= 128 ? 4 : R >= 64 ? 6 : 8;
  static constexpr int BARS = 128;
  static NQ_DEVICE int table_bytes(int kgb, bool asym) { return ROWS_PER_BLOCK * kgb * (asym ? 3 : 2); }
};

#ifdef NQ_GEMM_WS_PROBE_CLOCKS
// The clocks probe: per block (linear index < 1024) 16 u64 of the last launch, read back by bench_gemm
// (module global nq_gemm_ws_clocks): %globaltimer (ns) at entry and exit, the SM's clock64 at each phase.
enum WsClock {
  CK_GT_ENTRY, CK_ENTRY, CK_INIT, CK_TABLE, CK_FIRST_FULL, CK_RUN, CK_REDUCE, CK_END, CK_GT_END, CK_SMID,
  CK_PRODUCER_END, CK_SET1_RUN, CK_SLOTS = 16
};
extern "C" {  // an unmangled name, for cuModuleGetGlobal
__device__ unsigned long long nq_gemm_ws_clocks[1024 * CK_SLOTS];
}
NQ_DEVICE void ws_clock(int slot, u64 v) {
  const unsigned b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  if (b < 1024) nq_gemm_ws_clocks[b * CK_SLOTS + slot] = v;
}
NQ_DEVICE u64 ws_clock64() {
  u64 t;
  asm volatile("mov.u64 %0, %%clock64;" : "=l"(t));
  return t;
}
NQ_DEVICE u64 ws_globaltimer() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
NQ_DEVICE u64 ws_smid() {
  unsigned v;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(v));
  return v;
}
#define NQ_WS_CLOCK(cond, slot, value) \
  do {                                \
    if (cond) ws_clock(slot, value);  \
  } while (0)
#else
#define NQ_WS_CLOCK(cond, slot, value) \
  do {                                \
  } while (0)
#endif

// By-value kernel parameter: a CUtensorMap (cuda_driver.tensor_map_2d).
struct alignas(64) TmaMap {
  unsigned char bytes[128];
};

// 2D TMA copy of the box at (column c0, row c1) of `map` into shared memory at dst (1024-aligned for the
// 128-byte swizzle), completing as transactions on bar.
NQ_DEVICE void tma_load_2d(u32 dst, const TmaMap* map, int c0, int c1, unsigned long long* bar) {
#ifdef NQ_HOST_EMU
  nq_emu::tma_load_2d(dst, map->bytes, c0, c1, mbar_smem_addr(bar));
#else
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], "
      "[%4];" ::"r"(dst),
      "l"(map), "r"(c0), "r"(c1), "r"(mbar_smem_addr(bar))
      : "memory");
#endif
}

#ifdef NQ_HOST_EMU  // shared and read-only global loads as plain loads (emu/simt.h)
NQ_DEVICE u32 lds32(u32 a) { return *static_cast<const u32*>(nq_emu::smem_window_ptr(a, 4)); }
NQ_DEVICE u32 lds16(u32 a) { return *static_cast<const u16*>(nq_emu::smem_window_ptr(a, 2)); }
NQ_DEVICE u32 lds8(u32 a) { return *static_cast<const u8*>(nq_emu::smem_window_ptr(a, 1)); }
NQ_DEVICE u16 ldg_nc_u16(const u16* p) { return *p; }
NQ_DEVICE u32 ldg_nc_u8(const u8* p) { return *p; }
template <int CONSUMERS>
NQ_DEVICE void consumer_sync() { nq_emu::named_barrier(2, CONSUMERS); }
template <int REGS>
NQ_DEVICE void setmaxnreg_dec() {}
template <int REGS>
NQ_DEVICE void setmaxnreg_inc() {}
#else

NQ_DEVICE u32 lds32(u32 a) {
  u32 v;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(a));
  return v;
}
NQ_DEVICE u32 lds16(u32 a) {
  u16 v;
  asm volatile("ld.shared.u16 %0, [%1];" : "=h"(v) : "r"(a));
  return v;
}
NQ_DEVICE u32 lds8(u32 a) {
  u32 v;
  asm volatile("ld.shared.u8 %0, [%1];" : "=r"(v) : "r"(a));
  return v;
}
// read-only global loads (weights' scales and zero points)
NQ_DEVICE u16 ldg_nc_u16(const u16* p) {
  u16 v;
  asm volatile("ld.global.nc.u16 %0, [%1];" : "=h"(v) : "l"(p));
  return v;
}
NQ_DEVICE u32 ldg_nc_u8(const u8* p) {
  u32 v;
  asm volatile("ld.global.nc.u8 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}

// All the consumers' barrier (named barrier 2; set 0 alone: barrier 1, nq_gemm::finish_tile's).
template <int CONSUMERS>
NQ_DEVICE void consumer_sync() { asm volatile("bar.sync 2, %0;" ::"n"(CONSUMERS) : "memory"); }
// The producer warpgroup gives registers back; the consumers take them (setmaxnreg, per warpgroup).
template <int REGS>
NQ_DEVICE void setmaxnreg_dec() { asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(REGS)); }
template <int REGS>
NQ_DEVICE void setmaxnreg_inc() { asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(REGS)); }
#endif  // NQ_HOST_EMU
static_assert(WsWarps<64>::SET_WARPS * 32 == nq_gemm::THREADS,
              "finish_tile's named barrier counts one consumer set");

// The consumer warps' state and steps: P quantization groups per step, each step self-contained --
// dequantise the P groups into P A register sets, issue their wgmmas into P fresh fragments, commit,
// wait for all of them (wait_group 0: no register of an in-flight wgmma is written, so ptxas does not
// serialise the wgmmas, C7513), fold them into acc with their rows' scales and release the slots whose
// last group they were. A consumer set's groups are numbered li = 0, 1, ... over its tile-columns rel =
// first + stride i (gi = li % GPT), so with G = 128 a step spans P slots.
// What every consumer warp holds: its accumulator, where the ring, its barriers and the scale / zero
// tables are (kgb: a table row's length), its lane, its tile pair in the set and its two table rows.
template <int R>
struct WsConsumerState {
  float acc[R / 2];
  u32 ring, stab, ztab;
  unsigned long long *full, *empty;
  int kgb, lane, warp, lr0, lr1;

  NQ_DEVICE void init(u32 ring_, u32 stab_, u32 ztab_, unsigned long long* full_, unsigned long long* empty_, int kgb_,
                      int lane_, int warp_, int lr0_, int lr1_) {
    ring = ring_, stab = stab_, ztab = ztab_, full = full_, empty = empty_, kgb = kgb_, lane = lane_, warp = warp_;
    lr0 = lr0_, lr1 = lr1_;
#pragma unroll
    for (int i = 0; i < R / 2; ++i) acc[i] = 0.f;
  }
  // The bf16 pairs that subtract the zero points of table entries e0 and e1 (8 when symmetric).
  NQ_DEVICE void zero_pairs(bool asym, u32 e0, u32 e1, u32& nz0, u32& nz1) const {
    if (asym) {
      nz0 = neg_zero_pair(lds8(ztab + e0));
      nz1 = neg_zero_pair(lds8(ztab + e1));
    } else {
      nz0 = nz1 = neg_zero_pair(8u);
    }
  }
};

template <int G, bool ASYM, int NT, typename ST, int P>
struct WsConsumer : WsConsumerState<8 * NT> {
  static constexpr int R = 8 * NT, GPT = 128 / G, KS = G / 16;
  using RG = WsRing<R>;
  using S = WsConsumerState<R>;
  using S::acc, S::ring, S::stab, S::full, S::empty, S::kgb, S::lane, S::warp, S::lr0, S::lr1, S::zero_pairs;
  float f[P][R / 2];
  u32 a[P][KS][4];

  int first = 0, stride = 1;  // the tile-columns rel = first + stride i are this consumer set's
  // Local groups li0 .. li0 + Q - 1 (Q <= P).
  template <int Q>
  NQ_DEVICE void step(int li0) {
    u64 desc[Q][KS];
    float s0[Q], s1[Q];
#pragma unroll
    for (int p = 0; p < Q; ++p) {
      const int li = li0 + p, rel = first + stride * (li / GPT), gi = li % GPT, gg = rel * GPT + gi;
      const int s = rel % RG::NBUF;
      if (gi == 0 || p == 0) mbar_wait(&full[s], (rel / RG::NBUF) & 1);
      const u32 slot = ring + (u32)(s * RG::SLOT);
      // the group's 2 x KS / 2 words of the lane's two tiles
      u32 w0[KS / 2], w1[KS / 2];
#pragma unroll
      for (int wi = 0; wi < KS / 2; ++wi) {
        w0[wi] = lds32(slot + RG::W + (2 * warp) * 512 + lane * 16 + 4 * (gi * (KS / 2) + wi));
        w1[wi] = lds32(slot + RG::W + (2 * warp + 1) * 512 + lane * 16 + 4 * (gi * (KS / 2) + wi));
      }
      const u32 e0 = (u32)(lr0 * kgb + gg), e1 = (u32)(lr1 * kgb + gg);
      s0[p] = ST::to_f32((u16)lds16(stab + 2 * e0));
      s1[p] = ST::to_f32((u16)lds16(stab + 2 * e1));
      u32 nz0, nz1;
      zero_pairs(ASYM, e0, e1, nz0, nz1);
#pragma unroll
      for (int wi = 0; wi < KS / 2; ++wi) {
        a[p][2 * wi][0] = dq(w0[wi], 0, nz0);
        a[p][2 * wi][1] = dq(w1[wi], 0, nz1);
        a[p][2 * wi][2] = dq(w0[wi], 1, nz0);
        a[p][2 * wi][3] = dq(w1[wi], 1, nz1);
        a[p][2 * wi + 1][0] = dq(w0[wi], 2, nz0);
        a[p][2 * wi + 1][1] = dq(w1[wi], 2, nz1);
        a[p][2 * wi + 1][2] = dq(w0[wi], 3, nz0);
        a[p][2 * wi + 1][3] = dq(w1[wi], 3, nz1);
      }
      const u32 desc_lo = nq_wgmma::sw128_desc_lo(slot + RG::X);
#pragma unroll
      for (int k = 0; k < KS; ++k) {
        const int j = gi * KS + k;
        desc[p][k] = nq_wgmma::sw128_desc(desc_lo, (u32)((j >> 2) * RG::XBOX + (j & 3) * 32));
      }
#if defined(NQ_GEMM_WS_INTERLEAVE) && !defined(NQ_GEMM_WS_PROBE_NO_MMA)
      // experiment: issue this group's wgmmas before dequantising the next group of the step
      nq_wgmma::wgmma_fence();
#pragma unroll
      for (int k = 0; k < KS; ++k) nq_wgmma::Wgmma<R>::mma(f[p], a[p][k], desc[p][k], k);
#endif
    }
#ifdef NQ_GEMM_WS_PROBE_NO_MMA  // timing probe (wrong outputs): everything but the tensor-core work
#pragma unroll
    for (int p = 0; p < Q; ++p)
#pragma unroll
      for (int k = 0; k < KS; ++k)
        f[p][k % (R / 2)] += __uint_as_float(a[p][k][0] ^ a[p][k][1] ^ a[p][k][2] ^ a[p][k][3] ^ (u32)desc[p][k]);
#else
#ifndef NQ_GEMM_WS_INTERLEAVE
    nq_wgmma::wgmma_fence();
#pragma unroll
    for (int p = 0; p < Q; ++p)
#pragma unroll
      for (int k = 0; k < KS; ++k) nq_wgmma::Wgmma<R>::mma(f[p], a[p][k], desc[p][k], k);
#endif
    nq_wgmma::wgmma_commit();
    nq_wgmma::wgmma_wait<0>();
#endif
#pragma unroll
    for (int p = 0; p < Q; ++p) {
#pragma unroll
      for (int i = 0; i < R / 2; ++i) nq_wgmma::fence_operand(f[p][i]);
#pragma unroll
      for (int i = 0; i < NT; ++i) {
        acc[4 * i + 0] = fmaf(f[p][4 * i + 0], s0[p], acc[4 * i + 0]);
        acc[4 * i + 1] = fmaf(f[p][4 * i + 1], s0[p], acc[4 * i + 1]);
        acc[4 * i + 2] = fmaf(f[p][4 * i + 2], s1[p], acc[4 * i + 2]);
        acc[4 * i + 3] = fmaf(f[p][4 * i + 3], s1[p], acc[4 * i + 3]);
      }
    }
    __syncwarp();
    if (lane == 0) {
#pragma unroll
      for (int p = 0; p < Q; ++p) {
        const int li = li0 + p;
        if (li % GPT == GPT - 1) mbar_arrive(&empty[(first + stride * (li / GPT)) % RG::NBUF]);
      }
    }
  }

  NQ_DEVICE void run(int ntc, int first_, int stride_) {
    first = first_, stride = stride_;
#ifdef NQ_GEMM_WS_PROBE_COPY_ONLY  // timing probe (wrong outputs): the ring's copies and barriers only
    for (int rel = first; rel < ntc; rel += stride) {
      mbar_wait(&full[rel % RG::NBUF], (rel / RG::NBUF) & 1);
      __syncwarp();
      if (lane == 0) mbar_arrive(&empty[rel % RG::NBUF]);
    }
    if (ntc >= 0) return;  // always: the code below stays compiled
#endif
#ifdef NQ_GEMM_WS_PROBE_CLOCKS
    if (first < ntc) mbar_wait(&full[first % RG::NBUF], 0);  // the set's first slot (waited again below)
    NQ_WS_CLOCK(threadIdx.x == 0, CK_FIRST_FULL, ws_clock64());
#endif
    const int ngroups = (ntc - first + stride - 1) / stride * GPT;
    int li = 0;
    for (; li + P <= ngroups; li += P) step<P>(li);
    for (; li < ngroups; ++li) step<1>(li);
  }
};

// round((q - z) s) for the pair v = (q - z) (exact in bf16) and the scale's bits. (q - z) s is exact in
// fp32 (5 x 11 significant bits), so both forms round once.
template <typename ST>
NQ_DEVICE u32 scale_bf16x2(u32 v, u16 sbits, ST) {
  const float s = ST::to_f32(sbits);
  return f32x2_to_bf16x2(bf16x2_lo(v) * s, bf16x2_hi(v) * s);
}
#ifndef NQ_HOST_EMU
NQ_DEVICE u32 scale_bf16x2(u32 v, u16 sbits, nq_gemv::ScaleBF16) {
  u32 d;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(v), "r"((u32)sbits * 0x10001u));
  return d;
}
#endif

// The R = 128 (prefill) consumer warps. Each weight is dequantised and scaled to bf16 as the A operand
// -- round((q - z) s), the dense weight that the dequantise + cuBLAS path multiplies, rounded the same
// way -- so every wgmma accumulates into the one fp32 accumulator and nothing waits per quantization
// group. A stage is half a tile-column (4 k16 steps, one X box); its A registers are double-buffered
// (two stages in flight, the loop unrolled by two so each buffer keeps its registers) and
// wait_group 1 after a stage's commit retires the stage before, whose buffer the next stage rewrites and
// whose slot is released after its second half.
template <int G, bool ASYM, typename ST>
struct WsPrefillConsumer : WsConsumerState<128> {
  static constexpr int R = 128, GPT = 128 / G, STEPS = 4;  // k16 steps per stage
  using RG = WsRing<R>;
  using Stage = u32[STEPS][4];

  // Unit it of the block's sequence (its ring slot it % NBUF), k16 steps 4 h .. 4 h + 3 = words 2 h,
  // 2 h + 1 of the lane's two tiles, X box h; the table holds the segment's tile-columns from unit it0.
  NQ_DEVICE void stage(int it, int h, int it0, Stage& a) {
    const int s = it % RG::NBUF;
    if (h == 0) mbar_wait(&full[s], (it / RG::NBUF) & 1);
    const u32 slot = ring + (u32)(s * RG::SLOT);
#pragma unroll
    for (int wi = 0; wi < 2; ++wi) {
      const int wd = 2 * h + wi;
      const u32 w0 = lds32(slot + RG::W + (2 * warp) * 512 + lane * 16 + 4 * wd);
      const u32 w1 = lds32(slot + RG::W + (2 * warp + 1) * 512 + lane * 16 + 4 * wd);
      const int gg = (it - it0) * GPT + 32 * wd / G;
      const u32 e0 = (u32)(lr0 * kgb + gg), e1 = (u32)(lr1 * kgb + gg);
      const u16 s0 = (u16)lds16(stab + 2 * e0), s1 = (u16)lds16(stab + 2 * e1);
      u32 nz0, nz1;
      zero_pairs(ASYM, e0, e1, nz0, nz1);
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        a[2 * wi + j][0] = scale_bf16x2(dq(w0, 2 * j, nz0), s0, ST{});
        a[2 * wi + j][1] = scale_bf16x2(dq(w1, 2 * j, nz1), s1, ST{});
        a[2 * wi + j][2] = scale_bf16x2(dq(w0, 2 * j + 1, nz0), s0, ST{});
        a[2 * wi + j][3] = scale_bf16x2(dq(w1, 2 * j + 1, nz1), s1, ST{});
      }
    }
    const u32 x_box = slot + RG::X + (u32)(h * RG::XBOX);
    const u32 desc_lo = nq_wgmma::sw128_desc_lo(x_box);
#ifdef NQ_GEMM_WS_PROBE_NO_MMA  // timing probe (wrong outputs): everything but the tensor-core work
#pragma unroll
    for (int k = 0; k < STEPS; ++k)
      acc[k] += __uint_as_float(a[k][0] ^ a[k][1] ^ a[k][2] ^ a[k][3] ^ (x_box + 32 * k));
#else
    nq_wgmma::wgmma_fence();
#pragma unroll
    for (int k = 0; k < STEPS; ++k) nq_wgmma::Wgmma<R>::mma(acc, a[k], nq_wgmma::sw128_desc(desc_lo, 32 * k), 1);
    nq_wgmma::wgmma_commit();
    nq_wgmma::wgmma_wait<1>();  // the stage before retired: its A buffer and (h == 0) its unit free
#endif
    if (h == 0 && it > 0) {
      __syncwarp();
      if (lane == 0) mbar_arrive(&empty[(it - 1) % RG::NBUF]);
    }
  }

  // Units it0 .. it0 + n - 1 into a zeroed acc; all their wgmmas complete on return.
  NQ_DEVICE void run(int it0, int n) {
#pragma unroll
    for (int i = 0; i < R / 2; ++i) acc[i] = 0.f;
#ifdef NQ_GEMM_WS_PROBE_COPY_ONLY  // timing probe (wrong outputs): the ring's copies and barriers only
    for (int it = it0; it < it0 + n; ++it) {
      mbar_wait(&full[it % RG::NBUF], (it / RG::NBUF) & 1);
      __syncwarp();
      if (lane == 0) mbar_arrive(&empty[it % RG::NBUF]);
    }
    if (n >= 0) return;  // always: the code below stays compiled
#endif
    Stage a0, a1;
    for (int it = it0; it < it0 + n; ++it) {
      stage(it, 0, it0, a0);
      stage(it, 1, it0, a1);
    }
    nq_wgmma::wgmma_wait<0>();
#pragma unroll
    for (int i = 0; i < R / 2; ++i) nq_wgmma::fence_operand(acc[i]);
  }
};

template <bool B, typename T, typename F>
struct Pick {
  using type = T;
};
template <typename T, typename F>
struct Pick<false, T, F> {
  using type = F;
};

// Stream-K (the prefill plan above 128 rows: gemm_ws_int4_*_n16_sk): the launch's (M block, row
// block) tiles of KT tile-columns each, tile = row block * M blocks + M block, are one sequence of
// units (tile, tile-column); block b takes units [b upc, (b + 1) upc) (upc: the kc argument), so every
// SM has the same work at any M. Its producer streams them through the ring without a break; its
// consumers take them a tile segment at a time: the segment's scale table, the wgmma stages, then the
// segment's end. A whole tile is stored as it is. A tile shared by blocks leaves one fp32 partial per
// block in ws: block c's slot 2c + (0 if the segment starts at c's first unit, else 1), 64 floats x
// 256 threads, each thread's accumulator as it holds it; the tile's first block's counter counts the
// arrivals (counters[c]: a block is the first of at most one shared tile, its last segment), and the
// last to arrive sums the partials in block order, adds the bias, stores, and resets the counter.
NQ_DEVICE int stream_k_slot(int c, int seg_first_unit, int upc) { return 2 * c + (seg_first_unit != c * upc); }

template <int G, bool ASYM, int NT, typename ST, bool STREAM_K>
NQ_DEVICE void gemm_int4_ws(const bf16_t* __restrict__ x, const uint4* __restrict__ qweight,
                            const u16* __restrict__ scales, const u8* __restrict__ zeros,
                            const bf16_t* __restrict__ bias, bf16_t* __restrict__ out, float* __restrict__ ws,
                            int* __restrict__ counters, int M, int N, int K, int kc, const TmaMap* xmap,
                            const TmaMap* wmap) {
  constexpr int R = 8 * NT;     // activation rows per M block: the wgmma's N
  constexpr int GPT = 128 / G;  // quantization groups per tile-column
  using RG = WsRing<R>;
  using WW = WsWarps<R>;
  constexpr int KSETS = WW::KSETS, SET_WARPS = WW::SET_WARPS, CONSUMER_WARPS = WW::CONSUMER_WARPS;
  constexpr int CONSUMERS = WW::CONSUMERS;
  constexpr int NBUF = RG::NBUF;
  static_assert(!STREAM_K || R == 128, "stream-K: the prefill plan's 128-row M blocks only");
  NQ_DYNAMIC_SMEM(smem_raw, 128);
  unsigned long long* full = reinterpret_cast<unsigned long long*>(smem_raw);
  unsigned long long* empty = full + NBUF;

  const int KT = K / 128, NTL = N / 8, KG = K / G;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  // Split-K: this block's tile (blockIdx.x, blockIdx.y) over tile-columns [tc_begin, tc_begin + ntc).
  // Stream-K: units [u_begin, u_end) of the launch's sequence.
  const int m_blocks = (M + R - 1) / R;
  const int upc = kc, u_begin = blockIdx.x * upc, u_end = min(m_blocks * ((N + 127) / 128) * KT, u_begin + upc);
  const int split = blockIdx.z;
  const int tc_begin = split * kc, ntc = min(KT, tc_begin + kc) - tc_begin;
  const int kgb = (STREAM_K ? min(kc, KT) : kc) * GPT;  // table row length
  const u32 base = smem_addr(smem_raw);
  const u32 stab = base + RG::BARS, ztab = stab + ROWS_PER_BLOCK * kgb * 2;
  const u32 ring = (stab + (u32)RG::table_bytes(kgb, ASYM) + 1023u) & ~1023u;

  NQ_WS_CLOCK(threadIdx.x == 0 && !STREAM_K, CK_GT_ENTRY, ws_globaltimer());
  NQ_WS_CLOCK(threadIdx.x == 0 && !STREAM_K, CK_ENTRY, ws_clock64());
  pdl_launch_dependents();
  if (threadIdx.x == 0) {
    for (int s = 0; s < NBUF; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], SET_WARPS);
    }
    mbar_fence_init();
  }
  __syncthreads();
  NQ_WS_CLOCK(threadIdx.x == 0 && !STREAM_K, CK_INIT, ws_clock64());

  if (warp >= CONSUMER_WARPS) {  // ---------------- producer ----------------
    setmaxnreg_dec<WW::PRODUCER_REGS>();
    if (warp != CONSUMER_WARPS) return;
    constexpr u32 bytes = 2 * RG::XBOX + 16 * 512;  // whole boxes: rows past M or N arrive as zeros
#ifdef NQ_GEMM_WS_PROBE_X_ONCE  // timing probe (wrong outputs): each slot's x copied at its first fill only
    auto copies_x = [](int rel) { return rel < NBUF; };
#else
    auto copies_x = [](int) { return true; };
#endif
#ifdef NQ_GEMM_WS_PROBE_NO_MAINLOOP  // timing probe (wrong outputs): no copies, no main loop
    if (ntc >= 0) return;
#endif
    if (lane == 0) {
      const int n_units = STREAM_K ? u_end - u_begin : ntc;
      // unit rel's tile-column, M block and row block
      auto unit = [&](int rel, int& tc, int& mb, int& rb) {
        tc = tc_begin + rel, mb = blockIdx.x, rb = blockIdx.y;
        if constexpr (STREAM_K) {
          const int u = u_begin + rel, tile = u / KT;
          tc = u - tile * KT, mb = tile % m_blocks, rb = tile / m_blocks;
        }
      };
      // unit rel's weights into its slot (16 row-tiles x 512 B), after the slot's last reader freed it
      auto load_weights = [&](int rel, int tc, int rb) {
        const int s = rel % NBUF;
        mbar_wait(&empty[s], ((rel / NBUF) & 1) ^ 1);  // the first NBUF: a fresh barrier, no wait
        mbar_arrive_expect_tx(&full[s], copies_x(rel) ? bytes : 16 * 512);
        tma_load_2d(ring + (u32)(s * RG::SLOT) + RG::W, wmap, tc * 64, rb * (ROWS_PER_BLOCK / 8), &full[s]);
      };
      // The first NBUF slots' weights go out before pdl_wait (weights only: the previous kernel may
      // still run), every x after it.
      const int ahead = min(n_units, NBUF);
      for (int rel = 0; rel < ahead; ++rel) {
        int tc, mb, rb;
        unit(rel, tc, mb, rb);
        load_weights(rel, tc, rb);
      }
      pdl_wait();
      for (int rel = 0; rel < n_units; ++rel) {
        int tc, mb, rb;
        unit(rel, tc, mb, rb);
        if (rel >= ahead) load_weights(rel, tc, rb);
        if (!copies_x(rel)) continue;
        const u32 slot = ring + (u32)((rel % NBUF) * RG::SLOT);
        tma_load_2d(slot + RG::X, xmap, tc * 128, mb * R, &full[rel % NBUF]);
        tma_load_2d(slot + RG::X + RG::XBOX, xmap, tc * 128 + 64, mb * R, &full[rel % NBUF]);
      }
    }
    NQ_WS_CLOCK(lane == 0 && !STREAM_K, CK_PRODUCER_END, ws_clock64());
    return;
  }

  // ---------------- consumers ----------------
  setmaxnreg_inc<WW::CONSUMER_REGS>();
  // The scale / zero tables of rows [row_base, + 128) (rows past N: the last row, never stored) and
  // tile-columns [tc_first, + n), TB entries per thread in flight: the loads of a batch are all issued
  // before its stores (one volatile store per load made it one HBM round trip per entry: ~14 us per
  // block on the 7B qkv, measured).
  auto load_table = [&](int row_base, int tc_first, int n) {
    constexpr int TB = 8;
    const int per_row = n * GPT, total = ROWS_PER_BLOCK * per_row;
    u16* st16 = reinterpret_cast<u16*>(smem_raw + (stab - base));
    u8* zt8 = smem_raw + (ztab - base);
    for (int i0 = threadIdx.x; i0 < total; i0 += CONSUMERS * TB) {
      u16 sv[TB];
      u8 zv[TB];
#pragma unroll
      for (int b = 0; b < TB; ++b) {
        const int i = min(i0 + b * CONSUMERS, total - 1);
        const int r = i / per_row, j = i - r * per_row;
        const i64 e = (i64)min(row_base + r, N - 1) * KG + tc_first * GPT + j;
        sv[b] = ldg_nc_u16(scales + e);
        if constexpr (ASYM) zv[b] = (u8)ldg_nc_u8(zeros + e);
      }
#pragma unroll
      for (int b = 0; b < TB; ++b) {
        const int i = i0 + b * CONSUMERS;
        if (i < total) {
          const int r = i / per_row, j = i - r * per_row;
          st16[r * kgb + j] = sv[b];
          if constexpr (ASYM) zt8[r * kgb + j] = zv[b];
        }
      }
    }
  };
  const int g = lane >> 2, t = lane & 3;
  const int kset = warp / SET_WARPS, wq = warp % SET_WARPS;  // consumer set, tile pair
  const int lr0 = 16 * wq + g, lr1 = lr0 + 8;                // local rows (table rows)
  // this thread's two weight rows of the row block at row_base
  auto rows_of = [&](int row_base, int& row0, int& row1, bool& has0, bool& has1) {
    const int tr0 = row_base / 8 + 2 * wq, tr1 = tr0 + 1;
    has0 = tr0 < NTL, has1 = tr1 < NTL;
    row0 = 8 * tr0 + g, row1 = 8 * tr1 + g;
  };

  if constexpr (STREAM_K) {
    pdl_wait();  // before any store (the scale tables come later, per segment)
    WsPrefillConsumer<G, ASYM, ST> c;
    c.init(ring, stab, ztab, full, empty, kgb, lane, wq, lr0, lr1);
    for (int u = u_begin, seg = 0; u < u_end; u += seg) {  // one tile segment [u, u + seg) at a time
      const int tile = u / KT, tc0 = u - tile * KT;
      seg = min(u_end, (tile + 1) * KT) - u;
      const int mb = tile % m_blocks, row_base = (tile / m_blocks) * ROWS_PER_BLOCK, m0 = mb * R;
      consumer_sync<CONSUMERS>();  // every warp is done with the previous segment's table
      load_table(row_base, tc0, seg);
      consumer_sync<CONSUMERS>();
#ifndef NQ_GEMM_WS_PROBE_NO_MAINLOOP
      c.run(u - u_begin, seg);
#endif
      int row0, row1;
      bool has0, has1;
      rows_of(row_base, row0, row1, has0, has1);
      const int rows_valid = min(R, M - m0);
      if (seg < KT) {  // a tile shared by blocks: the partial, then the last to arrive finishes it
        const int c0 = tile * KT / upc, c1 = ((tile + 1) * KT - 1) / upc;
        float* mine = ws + (i64)stream_k_slot(blockIdx.x, u, upc) * (R / 2) * CONSUMERS;
#pragma unroll
        for (int i = 0; i < R / 2; ++i) mine[i * CONSUMERS + threadIdx.x] = c.acc[i];
        __threadfence();
        consumer_sync<CONSUMERS>();
        __shared__ int is_last;
        if (threadIdx.x == 0) is_last = atomicAdd(counters + c0, 1) == c1 - c0;
        consumer_sync<CONSUMERS>();
        if (!is_last) continue;
        __threadfence();
        for (int cb = c0; cb <= c1; ++cb) {  // ((p_c0 + p_c0+1) + ...): block order
          const float* p = ws + (i64)stream_k_slot(cb, cb == c0 ? tile * KT : cb * upc, upc) * (R / 2) * CONSUMERS;
#pragma unroll
          for (int i = 0; i < R / 2; ++i) {
            const float v = ld_cg_f32(p + i * CONSUMERS + threadIdx.x);
            c.acc[i] = cb == c0 ? v : c.acc[i] + v;
          }
        }
        if (threadIdx.x == 0) counters[c0] = 0;  // every partial arrived: ready for the next launch
      }
      nq_gemm::finish_tile<NT, true>(c.acc, bias, out, nullptr, nullptr, M, N, 1, 0, m0, rows_valid, row_base,
                                     row0, row1, has0, has1, t);
    }
    return;
  }

  const int m0 = blockIdx.x * R, rows_valid = min(R, M - m0);
  const int row_base = blockIdx.y * ROWS_PER_BLOCK;
  load_table(row_base, tc_begin, ntc);  // scales and zero points: before pdl_wait
  pdl_wait();                            // before any store
  consumer_sync<CONSUMERS>();
  NQ_WS_CLOCK(threadIdx.x == 0, CK_TABLE, ws_clock64());
  NQ_WS_CLOCK(threadIdx.x == 0, CK_SMID, ws_smid());
  int row0, row1;
  bool has0, has1;
  rows_of(row_base, row0, row1, has0, has1);

  typename Pick<R == 128, WsPrefillConsumer<G, ASYM, ST>, WsConsumer<G, ASYM, NT, ST, GroupsPerStep<R>::value>>::type c;
  c.init(ring, stab, ztab, full, empty, kgb, lane, wq, lr0, lr1);
#ifndef NQ_GEMM_WS_PROBE_NO_MAINLOOP
  if constexpr (R == 128) {
    c.run(0, ntc);
  } else {
    c.run(ntc, kset, KSETS);
  }
#endif
  NQ_WS_CLOCK(threadIdx.x == 0, CK_RUN, ws_clock64());
  NQ_WS_CLOCK(threadIdx.x == SET_WARPS * 32, CK_SET1_RUN, ws_clock64());
  static_assert(KSETS == 1 || KSETS == 2, "the sets' sums are added pairwise");
  if constexpr (KSETS == 2) {  // set 1's sums into set 0's, through the ring (drained: every slot's
    constexpr int NA = R / 2;  // copies were waited for)
    consumer_sync<CONSUMERS>();
    float* red = reinterpret_cast<float*>(smem_raw + (ring - base));
    if (kset == 1) {
#pragma unroll
      for (int i = 0; i < NA; ++i) red[(wq * NA + i) * 32 + lane] = c.acc[i];
    }
    consumer_sync<CONSUMERS>();
    if (kset == 1) return;
#pragma unroll
    for (int i = 0; i < NA; ++i) c.acc[i] += red[(wq * NA + i) * 32 + lane];
  }
  NQ_WS_CLOCK(threadIdx.x == 0, CK_REDUCE, ws_clock64());
  nq_gemm::finish_tile<NT, true>(c.acc, bias, out, ws, counters, M, N, gridDim.z, split, m0, rows_valid, row_base,
                                 row0, row1, has0, has1, t);
  NQ_WS_CLOCK(threadIdx.x == 0, CK_END, ws_clock64());
  NQ_WS_CLOCK(threadIdx.x == 0, CK_GT_END, ws_globaltimer());
}

}  // namespace nq_gemm_ws
