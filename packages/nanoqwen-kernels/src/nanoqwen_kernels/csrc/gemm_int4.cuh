// gemm_int4.cuh: y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for M > 8 (decode batches of 9..64 rows and
// prefill chunks), W in the INT4 layout `int4-g{G}-tile8x128-v1` (docs/DESIGN.md), bf16 activations,
// fp32 accumulation (or its fp16-scale variant `-f16s-v1`: the template parameter ST, as in the GEMV).
// The GEMV of gemv_int4.cuh extended along M; its header explains the weight path.
//
// Weight path: exactly the GEMV's. Warp w of block b owns a tile pair (16 weight rows, rows g and g + 8
// of the two stacked 8x128 tiles): one 16-byte streaming load per tile and lane per tile-column (a
// register ring of NQ_GEMM_STAGES tile-columns keeps the next ones in flight), the
// same lop3 + bf16x2 fma dequantisation to the exact integers (q - z) (`nq_gemv::dq`), and those
// registers ARE the A operand of mma.m16n8k16. Each quantization group is accumulated unscaled in a
// fresh fragment, then added to the fp32 accumulator times the fp32 scale: the reference's (q - z) * s.
//
// Along M: one dequantised A fragment is multiplied by NT activation B fragments (n-tiles of 8 rows of
// x), NT = 2, 4, 8 for M <= 16, 32, 64, so the dequantisation is paid once per weight for up to 64
// rows. M > 64 (prefill): blockIdx.x walks 64-row M blocks, fastest, so the CTAs that read the same
// weight tiles are adjacent in launch order and the second and later ones find them in L2.
//
// Activations: staged per block into shared memory in chunks of CH tile-columns (CH * 128 columns of
// the R = 8 NT rows of the block's M block), row-major with a 16-byte pad per row (rows then start on
// banks 4 words apart: ldmatrix is conflict-free), read as B fragments with ldmatrix.x4: for the 32
// columns of one packed word w, matrices 0..3 are columns 32w + 0..7, 8..15, 16..23, 24..31, i.e.
// {b0b1, b2b3} of the word's first k16 step and of its second -- the same k order as the A registers
// (nibble pair j of word w holds columns 32w + 2t + 8j + {0, 1}). Rows >= M are zero-filled
// (cp.async with src-size 0), so they contribute nothing and are never stored.
//   XMODE 0: x [M, K]; chunk c + 1 is copied with cp.async (16 bytes per thread and copy) while chunk
//            c is multiplied (two buffers, one barrier per chunk).
//   XMODE 1: x is gate_up [M, 2K] and the input is bf16(silu(gate) * up): the raw gate and up rows of
//            the next chunk arrive by cp.async into a raw buffer while the current chunk is multiplied;
//            at the chunk boundary the block converts them into the (single) x buffer. Every row block
//            recomputes the whole activation this way: at M = 32 / 64 that took twice the plain
//            kernel's time, so the engine runs silu_mul + XMODE 0 instead.
//
// Split-K (M <= 64 only, so the scratch is bounded): as in the GEMV, gridDim.z = S blocks share each
// (M block, row block) tile, write their fp32 partials into [S, M, N] (rows m0.. of the M block), and
// the last to arrive (an atomic counter per tile, blockIdx.x * gridDim.y + blockIdx.y, reset by that
// block: graph-replay safe) sums the tile's partials in split order (deterministic), adds the bias,
// writes bf16. One M block of 8 NT >= M rows, or several smaller ones (NT = 4 for M = 33..64: two
// blocks per SM) each with its K splits.
//
// Launch (nanoqwen_kernels/gemm.py): grid (ceil(M / R), ceil(N / 128), S), 256 threads, dynamic shared
// memory (XMODE ? 3 : 2) * R * (CH * 128 + 8) * 2 bytes.
//
#pragma once
#include "gemv_int4.cuh"

// n-tiles whose fresh group fragments are live at a time (NT / NQ_GEMM_NH passes over each word).
// 8 = one pass: passes of 2 or 4 did not lower ptxas's register count (it keeps the whole tile-column's
// B fragments in flight either way) and re-dequantise each word.
#ifndef NQ_GEMM_NH
#define NQ_GEMM_NH 8
#endif
// Tile-columns of weights per warp in the register ring (loads in flight: D - 1 while one computes).
// 4: 3 x 1 KB per warp in flight; fits the register budgets of csrc/gemm.cu without spills (ptxas
// -v: NT = 2 83-116 registers for D = 2-4, NT = 8 176-203), more bytes in flight at 8 warps per SM.
#ifndef NQ_GEMM_STAGES
#define NQ_GEMM_STAGES(NT) 4
#endif

namespace nq_gemm {

using nq_gemv::dq;
using nq_gemv::GroupIO;
using nq_gemv::load_tile_column;
using nq_gemv::mma_bf16;
using nq_gemv::neg_zero_pair;
using nq_gemv::ScaleBits;
using nq_gemv::TileColumn;

constexpr int WARPS = 8;
constexpr int THREADS = WARPS * 32;
constexpr int ROWS_PER_BLOCK = WARPS * 16;  // weight rows (N) per block
constexpr int CH = 2;                       // tile-columns per staged activation chunk
constexpr int XPAD = 8;                     // bf16 of padding per staged row (16 bytes)
constexpr int XS = CH * 128 + XPAD;         // staged row stride, bf16

// The PTX wrappers below take their host branch on the emulator (common.cuh's NQ_HOST_EMU, emu/simt.h).
NQ_DEVICE u32 smem_addr(const void* p) {
#ifdef NQ_HOST_EMU
  return nq_emu::smem_window_addr(p);
#else
  u32 a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
#endif
}

// 16-byte global -> shared copy, L2 only; src_bytes = 0 writes 16 zero bytes (src is not read).
NQ_DEVICE void cp_async16(u32 dst, const void* src, int src_bytes) {
#ifdef NQ_HOST_EMU
  nq_emu::cp_async_16(dst, src, (unsigned)src_bytes);
#else
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes)
               : "memory");
#endif
}
#ifdef NQ_HOST_EMU
NQ_DEVICE void cp_async_commit() {}  // every wait here is for all groups
NQ_DEVICE void cp_async_wait_all() { nq_emu::cp_async_wait_all(); }
#else
NQ_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
NQ_DEVICE void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;" ::: "memory"); }
#endif

NQ_DEVICE void ldmatrix_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
#ifdef NQ_HOST_EMU
  u32 r[4];
  nq_emu::ldmatrix_x4(r, addr, false);
  r0 = r[0], r1 = r[1], r2 = r[2], r3 = r[3];
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
#endif
}

// cp.async one chunk: rows [0, R) x columns [col0, col0 + CH * 128) of a row-major bf16 source (row
// stride ld) into dst (R rows of XS). Rows >= rows_valid and columns >= ncols (past the end of the
// block's K range: the last chunk may be short) are zero-filled without reading the source.
template <int R>
NQ_DEVICE void stage_rows_async(bf16_t* dst, const bf16_t* __restrict__ src, i64 ld, int rows_valid,
                                int col0, int ncols) {
  constexpr int VPR = CH * 128 / 8;  // 16-byte vectors per staged row
  const u32 base = smem_addr(dst);
#pragma unroll 1  // unrolled, ptxas keeps every copy's address live across the mma loop (more registers)
  for (int i = 0; i < R * VPR / THREADS; ++i) {
    const int v = threadIdx.x + i * THREADS;
    const int r = v / VPR, c8 = (v % VPR) * 8;
    const bool ok = r < rows_valid && c8 < ncols;
    const bf16_t* s = ok ? src + r * ld + col0 + c8 : src;  // any valid address when zero-filling
    cp_async16(base + (u32)(r * XS + c8) * 2u, s, ok ? 16 : 0);
  }
}

// x chunk = bf16(silu(gate) * up) from the raw buffer (R gate rows, then R up rows), the whole chunk
// width (zero-filled columns give silu(0) * 0 = 0).
template <int R>
NQ_DEVICE void silu_mul_rows(bf16_t* xs, const bf16_t* raw) {
  constexpr int VPR = CH * 128 / 8;
#pragma unroll 1
  for (int i = 0; i < R * VPR / THREADS; ++i) {
    const int v = threadIdx.x + i * THREADS;
    const int r = v / VPR, c8 = (v % VPR) * 8;
    const uint4 g = *reinterpret_cast<const uint4*>(raw + r * XS + c8);
    const uint4 u = *reinterpret_cast<const uint4*>(raw + (R + r) * XS + c8);
    const u32 ga[4] = {g.x, g.y, g.z, g.w}, ua[4] = {u.x, u.y, u.z, u.w};
    u32 w[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float g0 = bf16x2_lo(ga[e]), g1 = bf16x2_hi(ga[e]);
      w[e] = f32x2_to_bf16x2(g0 / (1.f + __expf(-g0)) * bf16x2_lo(ua[e]),
                             g1 / (1.f + __expf(-g1)) * bf16x2_hi(ua[e]));
    }
    *reinterpret_cast<uint4*>(xs + r * XS + c8) = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

// Sum the S fp32 partials of weight rows [row_base, row_base + ROWS_PER_BLOCK) x activation rows
// [m0, m0 + rows) in split order, add the bias, write bf16: the last block of a tile to finish runs
// this (deterministic order). It is the launch's tail, so its L2 round trips must overlap: a thread
// takes RE elements at a time (THREADS apart: a warp's loads stay coalesced) and keeps RS splits of all
// of them in flight, ceil(S / RS) round trips per RE elements (one element and one split at a time took
// ~10 us at M = 64, S = 2: slower than no split). RE = 4, RS = 4: the widest batch with no spill in any
// GEMM entry. Each element's sum is ((0 + p_0) + p_1) + ..., in split order.
NQ_DEVICE void reduce_splits(const float* __restrict__ ws, const bf16_t* __restrict__ bias,
                             bf16_t* __restrict__ out, int M, int N, int S, int row_base, int m0, int rows) {
  constexpr int RE = 4, RS = 4;
  const i64 split_stride = (i64)M * N;
  const int total = rows * ROWS_PER_BLOCK;
  // element e of the tile: activation row m0 + e / ROWS_PER_BLOCK, weight row row_base + e % ROWS_PER_BLOCK
  auto offset = [&](int e, bool& ok) {
    const int mr = e / ROWS_PER_BLOCK, n = row_base + (e - mr * ROWS_PER_BLOCK);
    ok = e < total && n < N;
    return (i64)(m0 + mr) * N + n;
  };
  for (int e0 = threadIdx.x; e0 < total; e0 += THREADS * RE) {
    float sum[RE];
#pragma unroll
    for (int b = 0; b < RE; ++b) sum[b] = 0.f;
    for (int s = 0; s < S; s += RS) {
      float v[RS][RE];
#pragma unroll
      for (int u = 0; u < RS; ++u)
#pragma unroll
        for (int b = 0; b < RE; ++b) {
          bool ok;
          const i64 off = offset(e0 + b * THREADS, ok);
          if (ok && s + u < S) v[u][b] = ld_cg_f32(ws + (s + u) * split_stride + off);
        }
#pragma unroll
      for (int u = 0; u < RS; ++u)
#pragma unroll
        for (int b = 0; b < RE; ++b)
          if (s + u < S) sum[b] += v[u][b];  // v[u][b] unset only where the element is not stored
    }
#pragma unroll
    for (int b = 0; b < RE; ++b) {
      bool ok;
      const i64 off = offset(e0 + b * THREADS, ok);
      const int n = (int)(off % N);
      if (ok) out[off] = f32_to_bf16(sum[b] + (bias ? bf16_to_f32(bias[n]) : 0.f));
    }
  }
}

// The end of one (M block, row block, K split) tile. (gemm_int4 below keeps its own copy of this
// epilogue, inline, until a GPU measurement says moving it here leaves its speed alone: ptxas allocates
// its registers differently through the call.) acc: this thread's
// 4 NT fp32 sums, acc[4i + 0, 1] = y[m0 + 8i + 2t, +1][row0] and acc[4i + 2, 3] the same m for row1
// (mma.m16n8k16's and wgmma's D layout). S == 1: + bias, bf16, stored. Else the fp32 partials go to
// ws [S, M, N], and the tile's last block to arrive (its counter) sums them in split order. The 256
// threads that hold accumulators synchronise: the whole block (CONSUMERS_ONLY false) or named barrier 1
// (the wgmma kernel, whose producer warps have left).
template <int NT, bool CONSUMERS_ONLY>
NQ_DEVICE void finish_tile(const float* acc, const bf16_t* __restrict__ bias, bf16_t* __restrict__ out,
                           float* __restrict__ ws, int* __restrict__ counters, int M, int N, int S, int split,
                           int m0, int rows_valid, int row_base, int row0, int row1, bool has0, bool has1,
                           int t) {
  auto sync = [] {
#ifdef NQ_HOST_EMU
    if constexpr (CONSUMERS_ONLY) nq_emu::named_barrier(1, THREADS);
#else
    if constexpr (CONSUMERS_ONLY) asm volatile("bar.sync 1, %0;" ::"n"(THREADS) : "memory");
#endif
    else __syncthreads();
  };
  if (S == 1) {
    if (!has0) return;
    const float b0 = bias ? bf16_to_f32(bias[row0]) : 0.f;
    const float b1 = (bias && has1) ? bf16_to_f32(bias[row1]) : 0.f;
#pragma unroll
    for (int i = 0; i < NT; ++i) {
      const int ma = m0 + 8 * i + 2 * t, mb = ma + 1;
      if (ma < M) out[(i64)ma * N + row0] = f32_to_bf16(acc[4 * i + 0] + b0);
      if (mb < M) out[(i64)mb * N + row0] = f32_to_bf16(acc[4 * i + 1] + b0);
      if (has1 && ma < M) out[(i64)ma * N + row1] = f32_to_bf16(acc[4 * i + 2] + b1);
      if (has1 && mb < M) out[(i64)mb * N + row1] = f32_to_bf16(acc[4 * i + 3] + b1);
    }
    return;
  }
  float* part = ws + (i64)split * M * N;  // [S, M, N]: this M block's rows are m0..
  if (has0) {
#pragma unroll
    for (int i = 0; i < NT; ++i) {
      const int ma = m0 + 8 * i + 2 * t, mb = ma + 1;
      if (ma < M) part[(i64)ma * N + row0] = acc[4 * i + 0];
      if (mb < M) part[(i64)mb * N + row0] = acc[4 * i + 1];
      if (has1 && ma < M) part[(i64)ma * N + row1] = acc[4 * i + 2];
      if (has1 && mb < M) part[(i64)mb * N + row1] = acc[4 * i + 3];
    }
  }
  __threadfence();
  sync();
  __shared__ int is_last;
  int* counter = counters + blockIdx.x * gridDim.y + blockIdx.y;  // one per (M block, row block) tile
  if (threadIdx.x == 0) is_last = atomicAdd(counter, 1) == S - 1;
  sync();
  if (!is_last) return;
  __threadfence();
  reduce_splits(ws, bias, out, M, N, S, row_base, m0, rows_valid);
  if (threadIdx.x == 0) *counter = 0;  // ready for the next launch (or graph replay)
}

// scales: the raw 16-bit scale words, bf16 or fp16 as ST (nq_gemv::ScaleBF16 / ScaleF16) says.
template <int G, bool ASYM, int XMODE, int NT, typename ST>
NQ_DEVICE void gemm_int4(const bf16_t* __restrict__ x, const uint4* __restrict__ qweight,
                         const u16* __restrict__ scales, const u8* __restrict__ zeros,
                         const bf16_t* __restrict__ bias, bf16_t* __restrict__ out, float* __restrict__ ws,
                         int* __restrict__ counters, int M, int N, int K, int kc) {
  constexpr int R = 8 * NT;  // activation rows per M block
  constexpr int GPT = 128 / G;
  NQ_DYNAMIC_SMEM(smem_raw, 16);
  bf16_t* xbuf = reinterpret_cast<bf16_t*>(smem_raw);  // XMODE 0: two buffers; XMODE 1: one + raw
  bf16_t* raw = xbuf + R * XS;                          // XMODE 1: R gate rows, then R up rows

  const int KT = K / 128, NTL = N / 8, KG = K / G;
  const int m0 = blockIdx.x * R, rows_valid = min(R, M - m0);
  const int S = gridDim.z, split = blockIdx.z;
  const int tc_begin = split * kc, tc_end = min(KT, tc_begin + kc);
  const int nchunks = (tc_end - tc_begin + CH - 1) / CH;

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int pair = blockIdx.y * WARPS + warp;
  const int tr0 = 2 * pair, tr1 = 2 * pair + 1;
  const bool has0 = tr0 < NTL, has1 = tr1 < NTL;
  const int row0 = 8 * (has0 ? tr0 : 0) + g, row1 = 8 * (has1 ? tr1 : (has0 ? tr0 : 0)) + g;
  const uint4* w0p = qweight + ((i64)(row0 >> 3) * KT) * 32 + lane;
  const uint4* w1p = qweight + ((i64)(row1 >> 3) * KT) * 32 + lane;
  const u16* s0p = scales + (i64)row0 * KG;
  const u16* s1p = scales + (i64)row1 * KG;
  const u8* z0p = ASYM ? zeros + (i64)row0 * KG : nullptr;
  const u8* z1p = ASYM ? zeros + (i64)row1 * KG : nullptr;

  auto load = [&](TileColumn<G>& c, int tc) {  // a warp without rows (has0 false) loads nothing
    if (has0 && tc < tc_end) {
#ifndef NQ_GEMM_PROBE_NO_WLOAD
      load_tile_column<G, ASYM>(c, w0p, w1p, s0p, s1p, z0p, z1p, tc);  // w1p = w0p without tile 1
#else  // timing probe (wrong outputs): weights, scales and zeros made in registers, no global loads
      const u32 v = (u32)tc * 0x9e3779b9u + (u32)lane;
      c.w0 = make_uint4(v, v ^ 1u, v ^ 2u, v ^ 3u);
      c.w1 = make_uint4(v ^ 4u, v ^ 5u, v ^ 6u, v ^ 7u);
      c.s0 = c.s1 = (typename ScaleBits<G>::type)0x3c003c00u;
      c.z0 = c.z1 = 0x08080808u;
#endif
    }
  };

  // Activation chunks. x rows of this M block: XMODE 0 row stride K, XMODE 1 row stride 2K.
  const bf16_t* xm = x + (i64)m0 * (XMODE ? 2 * K : K);
  auto issue = [&](int c) {
    const int col0 = (tc_begin + c * CH) * 128, ncols = min(CH, tc_end - tc_begin - c * CH) * 128;
#if defined(NQ_GEMM_PROBE_NO_X) || defined(NQ_GEMM_PROBE_NO_XBAR)
    (void)col0; (void)ncols;  // timing probes (wrong outputs): no activation copies
    cp_async_commit();
    return;
#endif
    if constexpr (XMODE == 0) {
      stage_rows_async<R>(xbuf + (c & 1) * R * XS, xm, K, rows_valid, col0, ncols);
    } else {
      stage_rows_async<R>(raw, xm, 2 * K, rows_valid, col0, ncols);
      stage_rows_async<R>(raw + R * XS, xm + K, 2 * K, rows_valid, col0, ncols);
    }
    cp_async_commit();
  };
  // Called by every thread before the first tile-column of chunk c: afterwards chunk c is in the x
  // buffer the returned pointer names, and the copy of chunk c + 1 is in flight.
  auto enter_chunk = [&](int c) -> const bf16_t* {
#ifndef NQ_GEMM_PROBE_NO_XBAR  // timing probe: no copies (above) and no wait or barrier per chunk
    cp_async_wait_all();
    __syncthreads();  // chunk c visible to all; everyone is done with chunk c - 1
#endif
    if constexpr (XMODE == 0) {
      if (c + 1 < nchunks) issue(c + 1);  // into the buffer chunk c - 1 used
      return xbuf + (c & 1) * R * XS;
    } else {
      silu_mul_rows<R>(xbuf, raw);
      __syncthreads();  // x chunk written; raw free
      if (c + 1 < nchunks) issue(c + 1);
      return xbuf;
    }
  };

  float acc[NT][4];
#pragma unroll
  for (int i = 0; i < NT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
  // ldmatrix row address of this lane: row (lane & 7) of an n-tile, 8-column block (lane >> 3)
  const u32 lane_off = (u32)((lane & 7) * XS + 8 * (lane >> 3)) * 2u;

  // Passes of NH n-tiles (NQ_GEMM_NH): the fresh per-group fragments of NH n-tiles are live at a time.
  constexpr int NH = NT < NQ_GEMM_NH ? NT : NQ_GEMM_NH;
  auto compute = [&](const TileColumn<G>& c, const bf16_t* xb, int col) {
    const u32 w0[4] = {c.w0.x, c.w0.y, c.w0.z, c.w0.w};
    const u32 w1[4] = {c.w1.x, c.w1.y, c.w1.z, c.w1.w};
    const u32 xaddr = smem_addr(xb) + lane_off + (u32)col * 2u;
#pragma unroll
    for (int p = 0; p < NT / NH; ++p) {
#pragma unroll
      for (int gi = 0; gi < GPT; ++gi) {
        u32 nz0, nz1;
        if constexpr (ASYM) {
          nz0 = neg_zero_pair((c.z0 >> (8 * gi)) & 0xffu);
          nz1 = neg_zero_pair((c.z1 >> (8 * gi)) & 0xffu);
        } else {
          nz0 = nz1 = neg_zero_pair(8u);
        }
        float f[NH][4];
#pragma unroll
        for (int i = 0; i < NH; ++i) f[i][0] = f[i][1] = f[i][2] = f[i][3] = 0.f;
#pragma unroll
        for (int wi = 0; wi < 4 / GPT; ++wi) {
          const int w = gi * (4 / GPT) + wi;
          const u32 a0 = dq(w0[w], 0, nz0), a1 = dq(w1[w], 0, nz1), a2 = dq(w0[w], 1, nz0),
                    a3 = dq(w1[w], 1, nz1);
          const u32 a4 = dq(w0[w], 2, nz0), a5 = dq(w1[w], 2, nz1), a6 = dq(w0[w], 3, nz0),
                    a7 = dq(w1[w], 3, nz1);
#pragma unroll
          for (int i = 0; i < NH; ++i) {
            u32 b0, b1, b2, b3;
#ifndef NQ_GEMM_PROBE_NO_LDSM
            ldmatrix_x4(xaddr + (u32)((p * NH + i) * 8 * XS + 32 * w) * 2u, b0, b1, b2, b3);
#else  // timing probe (wrong outputs): B from registers, to time the kernel without its ldmatrix
            b0 = a0 + (u32)i; b1 = a2; b2 = a4 + xaddr; b3 = a6;
#endif
#ifndef NQ_GEMM_PROBE_NO_MMA
            mma_bf16(f[i], a0, a1, a2, a3, b0, b1);
            mma_bf16(f[i], a4, a5, a6, a7, b2, b3);
#else  // timing probe (wrong outputs): one FADD per mma keeps its operands live, no tensor-core work
            f[i][0] += __uint_as_float(a0 ^ a1 ^ b0);
            f[i][1] += __uint_as_float(a2 ^ a3 ^ b1);
            f[i][2] += __uint_as_float(a4 ^ a5 ^ b2);
            f[i][3] += __uint_as_float(a6 ^ a7 ^ b3);
#endif
          }
        }
        const float sc0 = ST::to_f32((u16)(c.s0 >> (16 * gi)));
        const float sc1 = ST::to_f32((u16)(c.s1 >> (16 * gi)));
#pragma unroll
        for (int i = 0; i < NH; ++i) {
          float* a = acc[p * NH + i];
          a[0] = fmaf(f[i][0], sc0, a[0]);
          a[1] = fmaf(f[i][1], sc0, a[1]);
          a[2] = fmaf(f[i][2], sc1, a[2]);
          a[3] = fmaf(f[i][3], sc1, a[3]);
        }
      }
    }
  };

  // Every warp walks every tile-column (the chunk barriers are block-wide); warps without rows skip
  // the loads and the math. A register ring of D tile-columns: the loads of the next D - 1 are in
  // flight while one is dequantised and multiplied (the GEMV's ping-pong is D = 2).
  auto step = [&](const TileColumn<G>& c, int tc, const bf16_t*& xb) {
    const int rel = tc - tc_begin;
    if (rel % CH == 0) xb = enter_chunk(rel / CH);
    if (has0) compute(c, xb, (rel % CH) * 128);
  };
  constexpr int D = NQ_GEMM_STAGES(NT);
  TileColumn<G> st[D];
#pragma unroll
  for (int d = 0; d < D - 1; ++d) load(st[d], tc_begin + d);  // the first stages' weights, before x is staged
  issue(0);
  const bf16_t* xb = xbuf;
  for (int tc = tc_begin; tc < tc_end; tc += D) {
#pragma unroll
    for (int d = 0; d < D; ++d) {
      load(st[(d + D - 1) % D], tc + d + D - 1);  // the slot step d - 1 has just used
      if (tc + d < tc_end) step(st[d], tc + d, xb);
    }
  }

  // acc[i][0..1]: y[m0 + 8i + 2t, +1][row0]; acc[i][2..3]: the same m for row1
  if (S == 1) {
    if (!has0) return;
    const float b0 = bias ? bf16_to_f32(bias[row0]) : 0.f;
    const float b1 = (bias && has1) ? bf16_to_f32(bias[row1]) : 0.f;
#pragma unroll
    for (int i = 0; i < NT; ++i) {
      const int ma = m0 + 8 * i + 2 * t, mb = ma + 1;
      if (ma < M) out[(i64)ma * N + row0] = f32_to_bf16(acc[i][0] + b0);
      if (mb < M) out[(i64)mb * N + row0] = f32_to_bf16(acc[i][1] + b0);
      if (has1 && ma < M) out[(i64)ma * N + row1] = f32_to_bf16(acc[i][2] + b1);
      if (has1 && mb < M) out[(i64)mb * N + row1] = f32_to_bf16(acc[i][3] + b1);
    }
    return;
  }
  float* part = ws + (i64)split * M * N;  // [S, M, N]: this M block's rows are m0..
  if (has0) {
#pragma unroll
    for (int i = 0; i < NT; ++i) {
      const int ma = m0 + 8 * i + 2 * t, mb = ma + 1;
      if (ma < M) part[(i64)ma * N + row0] = acc[i][0];
      if (mb < M) part[(i64)mb * N + row0] = acc[i][1];
      if (has1 && ma < M) part[(i64)ma * N + row1] = acc[i][2];
      if (has1 && mb < M) part[(i64)mb * N + row1] = acc[i][3];
    }
  }
  __threadfence();
  __syncthreads();
  __shared__ int is_last;
  int* counter = counters + blockIdx.x * gridDim.y + blockIdx.y;  // one per (M block, row block) tile
  if (threadIdx.x == 0) is_last = atomicAdd(counter, 1) == S - 1;
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  reduce_splits(ws, bias, out, M, N, S, blockIdx.y * ROWS_PER_BLOCK, m0, rows_valid);
  if (threadIdx.x == 0) *counter = 0;  // ready for the next launch (or graph replay)
}

}  // namespace nq_gemm
