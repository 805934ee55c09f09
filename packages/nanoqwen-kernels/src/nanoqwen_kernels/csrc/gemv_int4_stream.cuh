// gemv_int4_stream.cuh: the "stream" variant of the decode GEMV: latency-oriented, no global split-K.
// y[M, N] = x[M, K] @ W[N, K]^T (+ bias), M = 1..8, W in `int4-g{G}-tile8x128-v1` (docs/DESIGN.md).
//
// Same fragment math as gemv_int4.cuh (tensor cores at M <= 8, weights as the mma A operand, x^T as B
// from the same permuted shared-memory staging, per-group fp32 scaling of an exact-integer fragment);
// only the work decomposition and the load schedule differ. Why a second schedule: the default kernel
// spends a nearly fixed ~6.5 us per launch on the small shapes (NOTES.md): one tile-column in flight
// per warp before x is staged, then global split-K (partials, fence, counter atomic, last-block
// reduction). Here:
//
//   - A block (8 warps) owns 8 / KW tile pairs (16 rows each) and ALL of K. The KW warps of one tile
//     pair split K into KW contiguous slices of tile-columns (warp w: pair w / KW, slice w % KW) and
//     meet in shared memory at the end: no workspace, no atomics, no second pass, deterministic (the
//     KW partial sums are added in slice order), and nothing to reset between graph replays.
//   - Each warp keeps a ring of D tile-columns of loads in registers (2 x 16-byte L1-bypassing loads
//     per tile-column: one per tile of the pair, plus its scales/zeros). The first D go out before x
//     is staged, so x's L2 round trip overlaps the weights' DRAM latency; afterwards the slot just
//     consumed is refilled with the tile-column D ahead, so D columns stay in flight.
//   - x[0:M, 0:K] is staged once per block (M * (K + XPAD) * 2 bytes of dynamic shared memory: 7 KB
//     for K = 3584, 37 KB for 18944 at M = 1), XCH 16-byte loads per thread issued before any is
//     stored; the gemv.py plan bounds the M it is used for by this size (`stream_max_m`).
//   - Registers: the ring holds D x (2 x 4 weight words + scales [+ zeros]); D = 4 needs ~100-128
//     registers (ptxas spills at 80), hence 2 blocks (16 warps) per SM: up to 16 x 4 KB of weights in
//     flight per SM, against ~26 KB that Little's law asks for at 4.3 TB/s and ~0.8 us.
//
// KW is a launch argument (1, 2, 4 or 8; the plan picks it so that there are enough blocks for the
// SMs), D a template argument. Requires KW <= K / 128 (every slice non-empty; the plan ensures it).
#pragma once
#include "gemv_int4.cuh"

namespace nq_gemv {

constexpr int STREAM_WARPS = 8;
constexpr int STREAM_THREADS = STREAM_WARPS * 32;

// Stage x[0:M, 0:K] into shared memory in stage_x's permuted order (element (m, 32c + 2t + 8j + e) at
// xs[m * xs_stride + 32c + 8t + 2j + e]), with CH 16-byte loads per thread (2 CH for the SiLU input)
// issued before any is stored: for K = 18944 the whole row is one round trip per thread, not ~9.
// XMODE 0: x is [M, K]. XMODE 1: x is gate_up [M, 2K] and the staged value is bf16(silu(g) * u).
template <int XMODE, int CH>
NQ_DEVICE void stage_x_deep(bf16_t* xs, int xs_stride, const bf16_t* __restrict__ x, int M, int K) {
  const int vec_per_row = K / 8, total = M * vec_per_row;
  for (int v0 = threadIdx.x; v0 < total; v0 += CH * blockDim.x) {
    uint4 a[CH], b[CH];
#pragma unroll
    for (int i = 0; i < CH; ++i) {
      const int v = v0 + i * blockDim.x;
      if (v < total) {
        const int m = v / vec_per_row, c8 = (v - m * vec_per_row) * 8;
        if constexpr (XMODE == 0) {
          a[i] = ld_v4(x + (i64)m * K + c8);
        } else {
          a[i] = ld_v4(x + (i64)m * 2 * K + c8);
          b[i] = ld_v4(x + (i64)m * 2 * K + K + c8);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < CH; ++i) {
      const int v = v0 + i * blockDim.x;
      if (v < total) {
        const int m = v / vec_per_row, c8 = (v - m * vec_per_row) * 8;
        u32 w[4];
        if constexpr (XMODE == 0) {
          w[0] = a[i].x; w[1] = a[i].y; w[2] = a[i].z; w[3] = a[i].w;
        } else {
          const u32 ga[4] = {a[i].x, a[i].y, a[i].z, a[i].w}, ua[4] = {b[i].x, b[i].y, b[i].z, b[i].w};
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float g0 = bf16x2_lo(ga[e]), g1 = bf16x2_hi(ga[e]);
            w[e] = f32x2_to_bf16x2(g0 / (1.f + __expf(-g0)) * bf16x2_lo(ua[e]),
                                   g1 / (1.f + __expf(-g1)) * bf16x2_hi(ua[e]));
          }
        }
        // the 8 columns c8 .. c8+7 of a 32-column chunk share j = (c8 % 32) / 8; word e holds t = e
        const int chunk = c8 & ~31, j = (c8 & 31) >> 3;
        u32* dst = reinterpret_cast<u32*>(xs + m * xs_stride + chunk + 2 * j);
#pragma unroll
        for (int e = 0; e < 4; ++e) dst[e * 4] = w[e];  // + 8t bf16 = 4t words
      }
    }
  }
}

template <int G, bool ASYM, int XMODE, int D, int XCH>
NQ_DEVICE void gemv_int4_stream(const bf16_t* __restrict__ x, const uint4* __restrict__ qweight,
                                const bf16_t* __restrict__ scales, const u8* __restrict__ zeros,
                                const bf16_t* __restrict__ bias, bf16_t* __restrict__ out, int M, int N,
                                int K, int kw) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ float red[STREAM_WARPS * 4 * 32];  // per-warp partial fragments, [warp][i][lane]
  bf16_t* xs = reinterpret_cast<bf16_t*>(smem_raw);
  constexpr int GPT = 128 / G;
  const int KT = K / 128, NT = N / 8, KG = K / G;
  const int xs_stride = K + XPAD;

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int pairs_per_block = STREAM_WARPS / kw;
  const int pslot = warp / kw, slice = warp - pslot * kw;
  const int pair = blockIdx.x * pairs_per_block + pslot;
  const int tr0 = 2 * pair, tr1 = 2 * pair + 1;
  const bool has0 = tr0 < NT, has1 = tr1 < NT;  // warp-uniform
  const int tc_lo = (slice * KT) / kw, tc_hi = ((slice + 1) * KT) / kw;
  const int row0 = 8 * tr0 + g, row1 = 8 * (has1 ? tr1 : tr0) + g;
  const uint4* w0p = qweight + ((i64)tr0 * KT) * 32 + lane;
  const uint4* w1p = qweight + ((i64)(has1 ? tr1 : tr0) * KT) * 32 + lane;
  const bf16_t* s0p = scales + (i64)row0 * KG;
  const bf16_t* s1p = scales + (i64)row1 * KG;
  const u8* z0p = ASYM ? zeros + (i64)row0 * KG : nullptr;
  const u8* z1p = ASYM ? zeros + (i64)row1 * KG : nullptr;

  // Ring slot u (a compile-time index after unrolling) <- tile-column tc of both tiles of the pair.
  Stage<G, ASYM, D> st;
  auto load = [&](int u, int tc) {
    st.w0[u] = ld_stream_v4(w0p + (i64)tc * 32);
    st.w1[u] = ld_stream_v4(w1p + (i64)tc * 32);  // = tile 0 again when there is no tile 1
    st.s0[u] = GroupIO<G>::load_scales(s0p, tc);
    st.s1[u] = GroupIO<G>::load_scales(s1p, tc);
    if constexpr (ASYM) {
      st.z0[u] = GroupIO<G>::load_zeros(z0p, tc);
      st.z1[u] = GroupIO<G>::load_zeros(z1p, tc);
    }
  };

  // acc[0..1]: y[2t, 2t+1][row0]; acc[2..3]: y[2t, 2t+1][row1] (the mma C fragment)
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  const bool xrow = g < M;
  const bf16_t* xsl = xs + g * xs_stride + 8 * t;
  // Identical to gemv_int4's compute() for one tile-column (tc_begin = 0: x is staged from column 0).
  auto compute = [&](int u, int tc) {
    const bf16_t* xt = xsl + tc * 128;
    const u32 w0[4] = {st.w0[u].x, st.w0[u].y, st.w0[u].z, st.w0[u].w};
    const u32 w1[4] = {st.w1[u].x, st.w1[u].y, st.w1[u].z, st.w1[u].w};
#pragma unroll
    for (int gi = 0; gi < GPT; ++gi) {
      u32 nz0, nz1;
      if constexpr (ASYM) {
        nz0 = neg_zero_pair((st.z0[u] >> (8 * gi)) & 0xffu);
        nz1 = neg_zero_pair((st.z1[u] >> (8 * gi)) & 0xffu);
      } else {
        nz0 = nz1 = neg_zero_pair(8u);
      }
      float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int wi = 0; wi < 4 / GPT; ++wi) {
        const int w = gi * (4 / GPT) + wi;
        uint4 b = make_uint4(0, 0, 0, 0);
        if (xrow) b = *reinterpret_cast<const uint4*>(xt + 32 * w);
        mma_bf16(c, dq(w0[w], 0, nz0), dq(w1[w], 0, nz1), dq(w0[w], 1, nz0), dq(w1[w], 1, nz1), b.x, b.y);
        mma_bf16(c, dq(w0[w], 2, nz0), dq(w1[w], 2, nz1), dq(w0[w], 3, nz0), dq(w1[w], 3, nz1), b.z, b.w);
      }
      const float sc0 = bf16_to_f32((bf16_t)(st.s0[u] >> (16 * gi)));
      const float sc1 = bf16_to_f32((bf16_t)(st.s1[u] >> (16 * gi)));
      acc[0] = fmaf(c[0], sc0, acc[0]);
      acc[1] = fmaf(c[1], sc0, acc[1]);
      acc[2] = fmaf(c[2], sc1, acc[2]);
      acc[3] = fmaf(c[3], sc1, acc[3]);
    }
  };

  // Prologue: the first D tile-columns of the slice in flight before x is staged.
  if (has0) {
#pragma unroll
    for (int u = 0; u < D; ++u)
      if (tc_lo + u < tc_hi) load(u, tc_lo + u);
  }
  stage_x_deep<XMODE, XMODE == 0 ? XCH : (XCH + 1) / 2>(xs, xs_stride, x, M, K);
  __syncthreads();
  if (has0) {
    for (int base = tc_lo; base < tc_hi; base += D) {
#pragma unroll
      for (int u = 0; u < D; ++u) {
        const int tc = base + u;
        if (tc < tc_hi) {
          compute(u, tc);
          if (tc + D < tc_hi) load(u, tc + D);  // refill the slot just consumed, D columns ahead
        }
      }
    }
  }

  // The KW slices of a pair meet in shared memory; the slice-0 warp adds them in slice order.
  float* r = red + warp * 128 + lane;
#pragma unroll
  for (int i = 0; i < 4; ++i) r[32 * i] = acc[i];
  __syncthreads();
  if (slice != 0 || !has0) return;
  float v[4] = {0.f, 0.f, 0.f, 0.f};
  for (int j = 0; j < kw; ++j) {
    const float* q = red + (warp + j) * 128 + lane;
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] += q[32 * i];
  }
  const int m0 = 2 * t, m1 = 2 * t + 1;
  const float b0 = bias ? bf16_to_f32(bias[row0]) : 0.f;
  if (m0 < M) out[(i64)m0 * N + row0] = f32_to_bf16(v[0] + b0);
  if (m1 < M) out[(i64)m1 * N + row0] = f32_to_bf16(v[1] + b0);
  if (has1) {
    const float b1 = bias ? bf16_to_f32(bias[row1]) : 0.f;
    if (m0 < M) out[(i64)m0 * N + row1] = f32_to_bf16(v[2] + b1);
    if (m1 < M) out[(i64)m1 * N + row1] = f32_to_bf16(v[3] + b1);
  }
}

}  // namespace nq_gemv
