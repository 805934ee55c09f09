// gemm_int4_ws.cuh: the INT4 GEMM of decode batches (M = 9..64) on Hopper's warpgroup MMA, with a
// producer warp: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), W in `int4-g{G}-tile8x128-v1` (docs/DESIGN.md),
// bf16 activations, fp32 accumulation (ST: bf16 or fp16 scales, as the GEMV). Same arithmetic per
// output element as gemm_int4.cuh (each group's (q - z) products summed unscaled in fp32, then added
// to the accumulator times the fp32 scale); what differs is who moves the data and who waits for whom.
//
// Why (kernels NOTES.md, sessions 8-13): the mma.sync GEMM is latency-bound at M = 64 -- one block of
// 8 warps per SM, ~380 instructions per warp per tile-column of which half are addresses, guards and
// the activation staging, a block barrier per chunk -- and session 8's wgmma version waited for each
// group's wgmmas before dequantising the next and had every thread issue the ring's copies.
//
// Block: 12 warps. Warps 0..7 are two consumer warpgroups; warp 8 is the producer (warps 9..11 only
// complete its warpgroup, which gives its registers to the consumers: setmaxnreg).
//   Producer: walks the block's tile-columns and fills a ring of NBUF shared-memory slots with the
//     copy engine, one slot per tile-column, completing on the slot's `full` mbarrier (lane 0 posts
//     the bytes to expect): x by two 2D TMA copies (a CUtensorMap of x [M, K], boxes of R rows x 64
//     columns, 128-byte swizzle; rows >= M read as zeros), the 16 weight tiles by one 2D TMA copy (a
//     CUtensorMap of the packed weights as [N / 8 row-tiles, K / 128 x 512 bytes]; row-tiles >= N / 8
//     read as zeros). It waits on the slot's `empty` mbarrier (8 arrivals: one per consumer warp)
//     before refilling it. (Measured before, 7B gate_up at M = 64: 16-byte cp.async from the producer
//     warp for everything, scales included, took 134 of the kernel's 179 us in copies alone; 16 bulk
//     copies of one 512-byte tile each per stage, ~0.65 us per stage at every M.) Slot contents:
//       X  R rows x 128 columns of x as two [R, 64] boxes in wgmma's K-major 128-byte-swizzle layout
//          (row r's 128 bytes at 128 r, 16-byte chunk c at position c ^ (r % 8); each box 1024-aligned).
//       W  the block's 16 weight tiles of the tile-column, 512 bytes each, as in global memory.
//   Scales and zero points of the block's rows and K range are loaded once, by the consumers, into a
//   [128, kc * G / 128] table before the main loop (they are weights: read before the PDL wait).
//   Consumers: warp w owns tile pair w (16 rows: rows g and g + 8 of tiles 2w, 2w + 1), so warpgroup
//     h's 64 rows are the A operand of `wgmma.m64nRk16` in registers (the GEMV's dequantised words,
//     unchanged), B is the slot's X. Per quantization group: dequantise its KS = G / 16 k16 steps,
//     issue KS wgmmas into a fresh fragment f[b] (the first overwrites it), commit, and only then wait
//     for the *previous* group (wait_group 1) and fold its fragment into acc with its rows' scales.
//     Two fragments and two A register sets alternate (b = group parity, static: the stage loop is
//     unrolled by two). A slot is released (empty arrive) when the last group that reads it is folded.
//     (ptxas still reports the wgmmas serialised, C7513: it does not follow the A registers through
//     wait_group 1.)
//
// Split-K: as gemm_int4.cuh (fp32 partials [S, M, N], an arrival counter per (M block, row block),
// the last block sums in split order); the consumers synchronise among themselves with named barrier
// 1 (256 threads), the producer having left.
//
// Launch (gemm.py, kernel family "gemm_ws"): grid (ceil(M / R), ceil(N / 128), S), 384 threads,
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

constexpr int CONSUMER_WARPS = 8;
constexpr int CONSUMERS = CONSUMER_WARPS * 32;
// A whole producer warpgroup (setmaxnreg works per warpgroup), of which one warp copies: with 9 warps
// one SM sub-partition holds 3 and every thread gets at most 168 registers; with 12, the producer
// warpgroup gives registers back (40 each) and the consumers take 232.
constexpr int THREADS = CONSUMERS + 128;
constexpr int PRODUCER_REGS = 40, CONSUMER_REGS = 232;
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
  static constexpr int NBUF = R >= 64 ? 6 : 8;
  static constexpr int BARS = 128;
  static NQ_DEVICE int table_bytes(int kgb, bool asym) { return ROWS_PER_BLOCK * kgb * (asym ? 3 : 2); }
};

// By-value kernel parameter: a CUtensorMap (cuda_driver.tensor_map_2d).
struct alignas(64) TmaMap {
  unsigned char bytes[128];
};

// 2D TMA copy of the box at (column c0, row c1) of `map` into shared memory at dst (1024-aligned for the
// 128-byte swizzle), completing as transactions on bar.
NQ_DEVICE void tma_load_2d(u32 dst, const TmaMap* map, int c0, int c1, unsigned long long* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], "
      "[%4];" ::"r"(dst),
      "l"(map), "r"(c0), "r"(c1), "r"(mbar_smem_addr(bar))
      : "memory");
}

NQ_DEVICE uint4 lds128(u32 a) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
  return v;
}
NQ_DEVICE u64 lds64(u32 a) {
  u64 v;
  asm volatile("ld.shared.u64 %0, [%1];" : "=l"(v) : "r"(a));
  return v;
}
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

// The consumer warpgroups' barrier (named barrier 1; nq_gemm::finish_tile uses the same one).
static_assert(CONSUMERS == nq_gemm::THREADS, "finish_tile's named barrier counts the consumers");
NQ_DEVICE void consumer_sync() { asm volatile("bar.sync 1, %0;" ::"n"(CONSUMERS) : "memory"); }

// The consumer warps' state and steps (a struct, not lambdas: the fragment buffer index must be a
// template parameter, and NVRTC takes no generic lambdas).
template <int G, bool ASYM, int NT, typename ST>
struct WsConsumer {
  static constexpr int R = 8 * NT, GPT = 128 / G, KS = G / 16;
  using RG = WsRing<R>;
  float acc[R / 2];
  float f[2][R / 2];  // fresh per-group fragments, alternating (group parity)
  u32 a[2][KS][4];    // their A registers (a group's dequantised weights)
  float prev_s0, prev_s1;  // the group issued last, folded once the next one is issued
  int prev_release;        // slot to release after folding it (-1: none)
  u32 ring, stab, ztab;  // shared addresses: slot 0, scale table, zero table
  unsigned long long *full, *empty;
  int kgb, lane, warp, lr0, lr1;

  NQ_DEVICE void init(u32 ring_, u32 stab_, u32 ztab_, unsigned long long* full_, unsigned long long* empty_, int kgb_,
                      int lane_, int warp_, int lr0_, int lr1_) {
    ring = ring_, stab = stab_, ztab = ztab_, full = full_, empty = empty_, kgb = kgb_, lane = lane_, warp = warp_;
    lr0 = lr0_, lr1 = lr1_;
#pragma unroll
    for (int i = 0; i < R / 2; ++i) acc[i] = 0.f;
    // f[1] starts as zeros with zero scales: the first group's fold of "the previous one" adds
    // nothing, so every group waits and folds unconditionally (a conditional wait_group made ptxas
    // serialise every wgmma: C7513-C7515).
#pragma unroll
    for (int i = 0; i < R / 2; ++i) f[1][i] = 0.f;
    prev_s0 = prev_s1 = 0.f;
    prev_release = -1;
  }

  // Fold fragment f[B] (complete) into acc with scales (s0, s1), then release slot `release` if >= 0.
  template <int B>
  NQ_DEVICE void fold(float s0, float s1, int release) {
#pragma unroll
    for (int i = 0; i < R / 2; ++i) nq_wgmma::fence_operand(f[B][i]);
#pragma unroll
    for (int i = 0; i < NT; ++i) {
      acc[4 * i + 0] = fmaf(f[B][4 * i + 0], s0, acc[4 * i + 0]);
      acc[4 * i + 1] = fmaf(f[B][4 * i + 1], s0, acc[4 * i + 1]);
      acc[4 * i + 2] = fmaf(f[B][4 * i + 2], s1, acc[4 * i + 2]);
      acc[4 * i + 3] = fmaf(f[B][4 * i + 3], s1, acc[4 * i + 3]);
    }
    if (release >= 0) {
      __syncwarp();
      if (lane == 0) mbar_arrive(&empty[release]);
    }
  }

  // Group gi of the tile-column in slot s into buffer B: dequantise, issue its wgmmas, then wait for
  // and fold the previous group.
  template <int B>
  NQ_DEVICE void group(const u32 (&w0)[4], const u32 (&w1)[4], u32 zw0, u32 zw1, u64 sw0, u64 sw1, u32 x_addr,
                       int gi, int s) {
    u32 nz0, nz1;
    if constexpr (ASYM) {
      nz0 = neg_zero_pair((zw0 >> (8 * gi)) & 0xffu);
      nz1 = neg_zero_pair((zw1 >> (8 * gi)) & 0xffu);
    } else {
      nz0 = nz1 = neg_zero_pair(8u);
    }
#pragma unroll
    for (int wi = 0; wi < KS / 2; ++wi) {
      const int w = gi * (KS / 2) + wi;
      a[B][2 * wi][0] = dq(w0[w], 0, nz0);
      a[B][2 * wi][1] = dq(w1[w], 0, nz1);
      a[B][2 * wi][2] = dq(w0[w], 1, nz0);
      a[B][2 * wi][3] = dq(w1[w], 1, nz1);
      a[B][2 * wi + 1][0] = dq(w0[w], 2, nz0);
      a[B][2 * wi + 1][1] = dq(w1[w], 2, nz1);
      a[B][2 * wi + 1][2] = dq(w0[w], 3, nz0);
      a[B][2 * wi + 1][3] = dq(w1[w], 3, nz1);
    }
    // K-major, 128-byte swizzle: stride between 8-row groups (SBO) 1024 bytes, swizzle mode 1 (bits
    // 62-63); the k16 step j of the tile-column starts 32 (j % 4) bytes into box j / 4 (the hardware
    // applies the swizzle to the address it forms, as for CUTLASS's and DeepGEMM's K-major operands).
    constexpr u32 desc_hi = (1024 >> 4) | (1u << 30);
    u64 desc[KS];  // every input of the wgmmas defined before their fence
#pragma unroll
    for (int k = 0; k < KS; ++k) {
      const int j = gi * KS + k;
      const u32 start = x_addr + (u32)((j >> 2) * RG::XBOX + (j & 3) * 32);
      desc[k] = ((u64)desc_hi << 32) | ((start >> 4) & 0x3FFFu) | (1u << 16);
    }
#ifdef NQ_GEMM_WS_PROBE_NO_MMA  // timing probe (wrong outputs): everything but the tensor-core work
#pragma unroll
    for (int k = 0; k < KS; ++k) f[B][k % (R / 2)] += __uint_as_float(a[B][k][0] ^ a[B][k][1] ^ a[B][k][2] ^ a[B][k][3] ^ (u32)desc[k]);
#else
    nq_wgmma::wgmma_fence();
#pragma unroll
    for (int k = 0; k < KS; ++k) nq_wgmma::Wgmma<R>::mma(f[B], a[B][k], desc[k], k);
    nq_wgmma::wgmma_commit();
#endif
#ifdef NQ_GEMM_WS_PROBE_NO_MMA
#elif defined(NQ_GEMM_WS_WAIT0)  // experiment: no overlap of a group's wgmmas with the next dequantisation
    nq_wgmma::wgmma_wait<0>();
#else
    nq_wgmma::wgmma_wait<1>();
#endif
    // the previous group's A registers stay allocated until its wgmmas are known done (here)
#pragma unroll
    for (int k = 0; k < KS; ++k)
#pragma unroll
      for (int r = 0; r < 4; ++r) asm volatile("" : "+r"(a[B ^ 1][k][r])::"memory");
    fold<B ^ 1>(prev_s0, prev_s1, prev_release);
    prev_s0 = ST::to_f32((u16)(sw0 >> (16 * gi)));
    prev_s1 = ST::to_f32((u16)(sw1 >> (16 * gi)));
    prev_release = gi == GPT - 1 ? s : -1;
  }

  // Tile-column rel (slot rel % NBUF); its groups use buffers (B0 * GPT + gi) & 1, B0 = rel's parity.
  template <int B0>
  NQ_DEVICE void stage(int rel) {
    const int s = rel % RG::NBUF;
    mbar_wait(&full[s], (rel / RG::NBUF) & 1);
#ifdef NQ_GEMM_WS_PROBE_COPY_ONLY  // timing probe (wrong outputs): the ring's copies and barriers only
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[s]);
    if (rel < 0) group<B0>({}, {}, 0, 0, 0, 0, 0, 0, s);  // never: keeps the code compiled
    return;
#endif
    const u32 slot = ring + (u32)(s * RG::SLOT);
    const uint4 q0 = lds128(slot + RG::W + (2 * warp) * 512 + lane * 16);
    const uint4 q1 = lds128(slot + RG::W + (2 * warp + 1) * 512 + lane * 16);
    // this tile-column's GPT scales / zero points of rows lr0, lr1 from the tables
    u64 sw0, sw1;
    u32 zw0 = 0, zw1 = 0;
    const u32 e0 = (u32)(lr0 * kgb + rel * GPT), e1 = (u32)(lr1 * kgb + rel * GPT);
    if constexpr (GPT == 1) {
      sw0 = lds16(stab + 2 * e0), sw1 = lds16(stab + 2 * e1);
    } else if constexpr (GPT == 2) {
      sw0 = lds32(stab + 2 * e0), sw1 = lds32(stab + 2 * e1);
    } else {
      sw0 = lds64(stab + 2 * e0), sw1 = lds64(stab + 2 * e1);
    }
    if constexpr (ASYM) {
      if constexpr (GPT == 1) {
        zw0 = lds8(ztab + e0), zw1 = lds8(ztab + e1);
      } else if constexpr (GPT == 2) {
        zw0 = lds16(ztab + e0), zw1 = lds16(ztab + e1);
      } else {
        zw0 = lds32(ztab + e0), zw1 = lds32(ztab + e1);
      }
    }
    const u32 w0[4] = {q0.x, q0.y, q0.z, q0.w};
    const u32 w1[4] = {q1.x, q1.y, q1.z, q1.w};
    const u32 x_addr = slot + RG::X;
#pragma unroll
    for (int gi = 0; gi < GPT; ++gi) {
      if (((B0 * GPT + gi) & 1) == 0) group<0>(w0, w1, zw0, zw1, sw0, sw1, x_addr, gi, s);
      else group<1>(w0, w1, zw0, zw1, sw0, sw1, x_addr, gi, s);
    }
  }

  // After the last group (in buffer `last`): wait for it and fold it.
  NQ_DEVICE void finish(int last) {
    nq_wgmma::wgmma_wait<0>();
    if (last == 0) fold<0>(prev_s0, prev_s1, -1);
    else fold<1>(prev_s0, prev_s1, -1);
  }
};

template <int G, bool ASYM, int NT, typename ST>
NQ_DEVICE void gemm_int4_ws(const bf16_t* __restrict__ x, const uint4* __restrict__ qweight,
                            const u16* __restrict__ scales, const u8* __restrict__ zeros,
                            const bf16_t* __restrict__ bias, bf16_t* __restrict__ out, float* __restrict__ ws,
                            int* __restrict__ counters, int M, int N, int K, int kc, const TmaMap* xmap,
                            const TmaMap* wmap) {
  constexpr int R = 8 * NT;     // activation rows per M block: the wgmma's N
  constexpr int GPT = 128 / G;  // quantization groups per tile-column
  using RG = WsRing<R>;
  constexpr int NBUF = RG::NBUF;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  unsigned long long* full = reinterpret_cast<unsigned long long*>(smem_raw);
  unsigned long long* empty = full + NBUF;

  const int KT = K / 128, NTL = N / 8, KG = K / G;
  const int m0 = blockIdx.x * R, rows_valid = min(R, M - m0);
  const int split = blockIdx.z;
  const int tc_begin = split * kc, tc_end = min(KT, tc_begin + kc), ntc = tc_end - tc_begin;
  const int row_base = blockIdx.y * ROWS_PER_BLOCK, tile_base = row_base / 8;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int kgb = kc * GPT;  // table row length
  const u32 base = smem_addr(smem_raw);
  const u32 stab = base + RG::BARS, ztab = stab + ROWS_PER_BLOCK * kgb * 2;
  const u32 ring = (stab + (u32)RG::table_bytes(kgb, ASYM) + 1023u) & ~1023u;

  if (threadIdx.x == 0) {
    for (int s = 0; s < NBUF; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], CONSUMER_WARPS);
    }
    mbar_fence_init();
  }
  __syncthreads();

  if (warp >= CONSUMER_WARPS) {  // ---------------- producer ----------------
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(PRODUCER_REGS));
    if (warp != CONSUMER_WARPS) return;
    constexpr u32 bytes = 2 * RG::XBOX + 16 * 512;  // whole boxes: rows past M or N arrive as zeros
    pdl_wait();  // x is the previous kernel's output
    if (lane == 0) {
      for (int rel = 0; rel < ntc; ++rel) {
        const int s = rel % NBUF;
        mbar_wait(&empty[s], ((rel / NBUF) & 1) ^ 1);
        const u32 slot = ring + (u32)(s * RG::SLOT);
        const int tc = tc_begin + rel;
        mbar_arrive_expect_tx(&full[s], bytes);
        tma_load_2d(slot + RG::W, wmap, tc * 64, tile_base, &full[s]);  // 16 row-tiles x 512 bytes
        tma_load_2d(slot + RG::X, xmap, tc * 128, m0, &full[s]);
        tma_load_2d(slot + RG::X + RG::XBOX, xmap, tc * 128 + 64, m0, &full[s]);
      }
    }
    pdl_launch_dependents();
    return;
  }

  // ---------------- consumers ----------------
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(CONSUMER_REGS));
  // The scale / zero tables of the block's rows (rows past N: the last row, never stored), TB entries
  // per thread in flight: the loads of a batch are all issued before its stores (one volatile store
  // per load made it one HBM round trip per entry: ~14 us per block on the 7B qkv, measured).
  {
    constexpr int TB = 8;
    const int per_row = ntc * GPT, total = ROWS_PER_BLOCK * per_row;
    u16* st16 = reinterpret_cast<u16*>(smem_raw + (stab - base));
    u8* zt8 = smem_raw + (ztab - base);
    for (int i0 = threadIdx.x; i0 < total; i0 += CONSUMERS * TB) {
      u16 sv[TB];
      u8 zv[TB];
#pragma unroll
      for (int b = 0; b < TB; ++b) {
        const int i = min(i0 + b * CONSUMERS, total - 1);
        const int r = i / per_row, j = i - r * per_row;
        const i64 e = (i64)min(row_base + r, N - 1) * KG + tc_begin * GPT + j;
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
  }
  consumer_sync();
  const int g = lane >> 2, t = lane & 3;
  const int tr0 = tile_base + 2 * warp, tr1 = tr0 + 1;
  const bool has0 = tr0 < NTL, has1 = tr1 < NTL;
  const int row0 = 8 * tr0 + g, row1 = 8 * tr1 + g;
  const int lr0 = 16 * warp + g, lr1 = lr0 + 8;  // local rows (table rows)

  WsConsumer<G, ASYM, NT, ST> c;
  c.init(ring, stab, ztab, full, empty, kgb, lane, warp, lr0, lr1);
  for (int rel = 0; rel < ntc; rel += 2) {
    c.template stage<0>(rel);
    if (rel + 1 < ntc) c.template stage<1>(rel + 1);
  }
  c.finish((ntc * GPT - 1) & 1);
  pdl_launch_dependents();
  nq_gemm::finish_tile<NT, true>(c.acc, bias, out, ws, counters, M, N, gridDim.z, split, m0, rows_valid, row_base,
                                 row0, row1, has0, has1, t);
}

}  // namespace nq_gemm_ws
