// gemv_int8.cuh: y[M, N] = x[M, K] @ W[N, K]^T for decode, M = 1..8, W in the INT8 layout
// `int8-g{G}-rowmajor-v1` (docs/DESIGN.md): q int8 [N, K] row-major, w = q * s[n, k / G], symmetric,
// G = 64 or 128. Built for the `--lm-head int8` option: one byte per weight, half the bf16 head's reads.
//
// Tensor cores as in gemv_int4.cuh (the weights are the mma A operand, 16 rows per warp; x^T is B,
// n = 8 = the largest M), but with fp16 inputs, because an int8 is exact in fp16 through the magic
// number 0x6400 and not in bf16 (8 significant bits cannot hold 1024 + u):
//   u = q + 128 (one XOR per word); prmt(word, 0x64646464) builds the f16x2 (1024 + u_i, 1024 + u_j);
//   one sub.f16x2 of 1152 leaves (q_i, q_j) exactly: 2.25 instructions per weight pair.
// x is staged in shared memory as fp16, each row m scaled by 2^-e_m (e_m >= 0 the smallest with
// max|x_m| * 2^-e_m <= 2^14): a bf16 value keeps all its bits in fp16 inside fp16's normal range, so
// the only change is that values below 2^-14 * 2^e_m lose low bits (relative to the row's largest
// |x|: < 2^-28 per product). The result is scaled back by 2^e_m: no overflow for any finite bf16 x.
//
// k permutation (the same for A and B, so the dot product is unchanged): in each 64-column chunk,
// lane t (= lane % 4) owns columns 16t .. 16t + 15 — one 16-byte load per weight row — and mma step s
// (0..3) feeds columns 16t + 4s + {0, 1} as the fragment's k = {2t, 2t + 1} and 16t + 4s + {2, 3} as
// k = {2t + 8, 2t + 9}. B for a lane is then 8 contiguous fp16 = one 16-byte shared load per two steps.
// A 64-column chunk lies inside one quantization group (G % 64 == 0), so each group is accumulated
// unscaled in a fresh fragment and added to the fp32 accumulator times the fp32 scale of the row.
//
// Block: 8 warps; warp w of block b owns rows 128b + 16w .. +15 (rows past N are read clamped and not
// written). Weights stream through a two-stage register pipeline, one chunk (1 KB per warp) per stage.
#pragma once
#include "common.cuh"

namespace nq_gemv8 {

constexpr int WARPS = 8;
constexpr int THREADS = WARPS * 32;
constexpr int ROWS_PER_BLOCK = WARPS * 16;
constexpr int XPAD = 8;  // fp16 elements of padding per staged x row: 16-byte B loads are conflict-free

NQ_DEVICE u32 prmt(u32 a, u32 b, u32 sel) {
#ifdef NQ_HOST_EMU
  return __byte_perm(a, b, sel);
#else
  u32 d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
#endif
}

// Bytes i, j of `wu` (u = q + 128) -> f16x2 (q_i, q_j), exact. sel = i | 4 << 4 | j << 8 | 4 << 12.
NQ_DEVICE u32 int8_pair_f16x2(u32 wu, u32 sel) {
  const u32 h = prmt(wu, 0x64646464u, sel);  // (1024 + u_i, 1024 + u_j)
#ifdef NQ_HOST_EMU
  return (u32)nq_emu::f32_to_f16_rn(nq_emu::f16_bits_to_f32(h & 0xffff) - 1152.f) |
         ((u32)nq_emu::f32_to_f16_rn(nq_emu::f16_bits_to_f32(h >> 16) - 1152.f) << 16);
#else
  u32 d;
  asm("sub.f16x2 %0, %1, %2;" : "=r"(d) : "r"(h), "r"(0x64806480u));  // - 1152 in both halves
  return d;
#endif
}

NQ_DEVICE void mma_f16(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
#ifdef NQ_HOST_EMU
  const u32 a[4] = {a0, a1, a2, a3}, b[2] = {b0, b1};
  nq_emu::mma_m16n8k16(c, a, b, true);
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}

NQ_DEVICE u32 f32x2_to_f16x2(float lo, float hi) {
#ifdef NQ_HOST_EMU
  return (u32)nq_emu::f32_to_f16_rn(lo) | ((u32)nq_emu::f32_to_f16_rn(hi) << 16);
#else
  u32 r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
#endif
}

// One 64-column chunk of the warp's 16 rows: w0 / w1 = this lane's 16 bytes of rows r0 / r1 (XORed),
// xb0 / xb1 = its 8 + 8 fp16 of x (columns 16t .. 16t + 15 of the chunk, row m = g).
NQ_DEVICE void chunk_mma(float* c, const uint4& w0, const uint4& w1, const uint4& xb0, const uint4& xb1) {
  const u32 a[4] = {w0.x, w0.y, w0.z, w0.w}, b[4] = {w1.x, w1.y, w1.z, w1.w};
  const u32 xv[8] = {xb0.x, xb0.y, xb0.z, xb0.w, xb1.x, xb1.y, xb1.z, xb1.w};
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    mma_f16(c, int8_pair_f16x2(a[s], 0x4140u), int8_pair_f16x2(b[s], 0x4140u), int8_pair_f16x2(a[s], 0x4342u),
            int8_pair_f16x2(b[s], 0x4342u), xv[2 * s], xv[2 * s + 1]);
  }
}

template <int G>
NQ_DEVICE void gemv_int8(const bf16_t* __restrict__ x, const uint4* __restrict__ qweight,
                         const bf16_t* __restrict__ scales, bf16_t* __restrict__ out, int M, int N, int K) {
  static_assert(G % 64 == 0, "a 64-column chunk must lie inside one group");
  NQ_DYNAMIC_SMEM(smem_raw, 16);
  u16* xs = reinterpret_cast<u16*>(smem_raw);  // [M][K + XPAD]: bf16 while staging, then scaled fp16
  __shared__ float row_max[WARPS][8];
  __shared__ float row_scale[8];  // 2^e_m
  const int xs_stride = K + XPAD;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, tid = threadIdx.x;
  const int g = lane >> 2, t = lane & 3;
  const int KC = K / 64, KG = K / G, U4_PER_ROW = K / 16;
  const int warp_row0 = blockIdx.x * ROWS_PER_BLOCK + warp * 16;
  const bool active = warp_row0 < N;  // warp-uniform
  const int r0 = warp_row0 + g, r1 = warp_row0 + 8 + g;
  const int rr0 = min(r0, N - 1), rr1 = min(r1, N - 1);  // clamped for reads
  const uint4* w0p = qweight + (i64)rr0 * U4_PER_ROW + t;  // chunk c: + 4c
  const uint4* w1p = qweight + (i64)rr1 * U4_PER_ROW + t;
  const bf16_t* s0p = scales + (i64)rr0 * KG;
  const bf16_t* s1p = scales + (i64)rr1 * KG;

  // The first chunk's weights go out before x is staged: their latency overlaps the staging.
  uint4 A0 = make_uint4(0, 0, 0, 0), A1 = A0, B0 = A0, B1 = A0;
  if (active) {
    A0 = ld_stream_v4(w0p);
    A1 = ld_stream_v4(w1p);
  }

  // Stage x as bf16 and find max|x| of every row.
  const int vec_per_row = K / 8;
#pragma unroll
  for (int m = 0; m < 8; ++m) {
    if (m >= M) break;
    float mx = 0.f;
    for (int v = tid; v < vec_per_row; v += THREADS) {
      const uint4 a = ld_v4(x + (i64)m * K + v * 8);
      const u32 w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) mx = fmaxf(mx, fmaxf(fabsf(bf16x2_lo(w[i])), fabsf(bf16x2_hi(w[i]))));
      *reinterpret_cast<uint4*>(xs + m * xs_stride + v * 8) = a;
    }
    mx = warp_max(mx);
    if (lane == 0) row_max[warp][m] = mx;
  }
  __syncthreads();
  if (tid < M) {
    float mx = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) mx = fmaxf(mx, row_max[w][tid]);
    // smallest e >= 0 with mx * 2^-e <= 2^14 (NaN/inf rows keep e = 0 and propagate)
    int e = 0;
    if (mx > 16384.f && mx <= 3.0e38f) e = (int)((__float_as_uint(mx) >> 23) & 0xffu) - 127 - 13;
    row_scale[tid] = __uint_as_float((u32)(127 + e) << 23);
  }
  __syncthreads();
#pragma unroll
  for (int m = 0; m < 8; ++m) {
    if (m >= M) break;
    const float inv = 1.f / row_scale[m];  // a power of two: exact
    for (int v = tid; v < vec_per_row; v += THREADS) {
      uint4* p = reinterpret_cast<uint4*>(xs + m * xs_stride + v * 8);
      const uint4 a = *p;
      const u32 w[4] = {a.x, a.y, a.z, a.w};
      u32 h[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) h[i] = f32x2_to_f16x2(bf16x2_lo(w[i]) * inv, bf16x2_hi(w[i]) * inv);
      *p = make_uint4(h[0], h[1], h[2], h[3]);
    }
  }
  __syncthreads();

  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  if (active) {
    const bool xrow = g < M;
    const u16* xl = xs + g * xs_stride + 16 * t;
    constexpr int CPG = G / 64;  // chunks per group
    for (int grp = 0; grp < KG; ++grp) {
      float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int j = 0; j < CPG; ++j) {
        const int ch = grp * CPG + j;
        if (ch + 1 < KC) {  // prefetch the next chunk while this one is multiplied
          B0 = ld_stream_v4(w0p + 4 * (ch + 1));
          B1 = ld_stream_v4(w1p + 4 * (ch + 1));
        }
        uint4 xb0 = make_uint4(0, 0, 0, 0), xb1 = xb0;
        if (xrow) {
          xb0 = *reinterpret_cast<const uint4*>(xl + 64 * ch);
          xb1 = *reinterpret_cast<const uint4*>(xl + 64 * ch + 8);
        }
        const uint4 f = make_uint4(0x80808080u, 0x80808080u, 0x80808080u, 0x80808080u);
        const uint4 u0 = make_uint4(A0.x ^ f.x, A0.y ^ f.y, A0.z ^ f.z, A0.w ^ f.w);
        const uint4 u1 = make_uint4(A1.x ^ f.x, A1.y ^ f.y, A1.z ^ f.z, A1.w ^ f.w);
        chunk_mma(c, u0, u1, xb0, xb1);
        A0 = B0;
        A1 = B1;
      }
      const float sc0 = bf16_to_f32(s0p[grp]), sc1 = bf16_to_f32(s1p[grp]);
      acc[0] = fmaf(c[0], sc0, acc[0]);
      acc[1] = fmaf(c[1], sc0, acc[1]);
      acc[2] = fmaf(c[2], sc1, acc[2]);
      acc[3] = fmaf(c[3], sc1, acc[3]);
    }
  }
  if (!active) return;
  // acc[0..1]: y[m = 2t, 2t + 1][r0]; acc[2..3]: the same m for r1
  const int m0 = 2 * t, m1 = 2 * t + 1;
  if (m0 < M) {
    const float sm = row_scale[m0];
    if (r0 < N) out[(i64)m0 * N + r0] = f32_to_bf16(acc[0] * sm);
    if (r1 < N) out[(i64)m0 * N + r1] = f32_to_bf16(acc[2] * sm);
  }
  if (m1 < M) {
    const float sm = row_scale[m1];
    if (r0 < N) out[(i64)m1 * N + r0] = f32_to_bf16(acc[1] * sm);
    if (r1 < N) out[(i64)m1 * N + r1] = f32_to_bf16(acc[3] * sm);
  }
}

}  // namespace nq_gemv8
