// gemv_loop_v2.cuh: the INT4 GEMV's inner loop with fewer SASS instructions per tile-column, for
// the compute-ceiling kernels `gemv_compute_g128_{sym,asym}_v2[u1]` of
// ceilings.cu. Not a model kernel: the production loop is csrc/gemv_int4.cuh's, whose helpers this file
// reuses (lop3_and_or, mma_bf16, neg_zero_pair). The arithmetic is bit-for-bit that of gemv_int4's
// compute_col for G = 128: per tile-column the same 8 mma.m16n8k16, in the same order, on the same A
// fragments (the exact (q - z) in bf16), from a zero fragment; then the same 4 fp32 fmas with the
// same fp32 scales into the running accumulator, tile-column after tile-column. What changes is only
// what surrounds that math (SASS counts: decode_ceilings.py's `sass` section):
//
// 1. No zeroed B fragment for the lanes whose batch row g >= M. gemv_int4 reads x only where g < M
//    (`if (xrow) b = LDS`), which ptxas compiles, per 32-column word, to 2 CS2R (zeroing b) plus a
//    branch (BSSY/BRA/BSYNC) around a recomputation of the load's address: 8 CS2R and most of the
//    ~50 address/branch instructions per tile-column of gemv_compute_g128_sym. Here those lanes read
//    row M - 1 (a staged row) instead. That is harmless: lane
//    (g, t)'s b registers are column n = g of the mma's B; column n of B only reaches column n of C,
//    i.e. the outputs y[m = n] with n >= M, which are never written. Every written output sees
//    exactly the B values it saw before.
// 2. U tile-columns per loop trip; the trip's shared-memory addresses are derived from one index and
//    every load inside it is at a constant offset (the register pipeline of gemv_int4 is left to
//    ptxas, which hoists every load of a trip to its top anyway).
// 3. U = 2: the scales of 2 consecutive tile-columns of a row in one 4-byte load (the package stores
//    scales [N, K / G] row-major, so they are adjacent in global memory too), widened to fp32 by one
//    shift (low half) and one AND (high half): the same fp32 values as (u16 bits) << 16.
// 4. (asym) Each zero point turned into the bf16x2 pair -(128 + z) by one PRMT: the bytes
//    {z, 0xC3, z, 0xC3}, which is neg_zero_pair(z) for every byte z.
// 5. The (128 + q) - (128 + z) as add.rn.bf16x2 instead of fma.rn.bf16x2(v, 1.0, -(128 + z)): the
//    product by 1.0 is exact, so both round the same exact sum once and give the same bits, for every
//    input. (ptxas already turns gemv_int4's asym fma into HADD2; its sym one stays an HFMA2 with 1.0
//    held in a register.)
//
// Shared memory the loop reads, per warp (the caller fills it; ceilings.cu's gemv_compute_v2 does):
//   w   uint4 [KC][2 tiles][32 lanes]   the lane's 16 bytes of each tile (its ld.global.v4 in gemv_int4)
//   sz  per weight row (8 tile 0 rows g, then 8 of tile 1) a record: KC bf16 scales, then KC zero
//       bytes, tile-columns in order: row g of tile 1 is S1 bytes after row g of tile 0, and a row's
//       zeros Z bytes after its scales (compile-time offsets; the zeros advance 1 byte per
//       tile-column, the scales 2, so they take two addresses)
// and x staged by nq_gemv::stage_x (permuted, row stride K + XPAD) for rows 0..M-1.
#pragma once
#include "gemv_int4.cuh"

namespace nq_gemv_v2 {
using namespace nq_gemv;

// fp32 value of the bf16 scale in the low (slot 0) or high (slot 1) half of a 32-bit word: exactly
// ScaleBF16::to_f32 of that half.
template <int SLOT>
NQ_DEVICE float scale_half(u32 s2) {
  if constexpr (SLOT == 0) return __uint_as_float(s2 << 16);
  else return __uint_as_float(s2 & 0xffff0000u);
}

// neg_zero_pair(byte K of z4): bytes {z, 0xC3, z, 0xC3}, taking 0xC3 from byte 0 of c3 (a register).
// c3 is PRMT's first source and z4 its second (bytes 4..7): ptxas keeps the selector an immediate.
template <int K>
NQ_DEVICE u32 neg_zero_pair_byte(u32 z4, u32 c3) {
  return __byte_perm(c3, z4, (4 + K) | (0 << 4) | ((4 + K) << 8) | (0 << 12));
}

// nibble pair j of a word -> bf16x2 (q - z) for columns 2t + 8j + {0, 1}: nq_gemv::dq with the
// subtraction as an add (header, 5.).
NQ_DEVICE u32 dq_add(u32 word, int j, u32 negzz) {
  u32 d;
  const u32 v = lop3_and_or(word >> (4 * j), 0x000f000fu, 0x43004300u);  // bf16x2 (128 + q, 128 + q')
  asm("add.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(v), "r"(negzz));
  return d;
}

// Shared-memory loads at 32-bit shared addresses (+ a constant offset folded into the instruction), so
// that no generic-to-shared conversion is left in the loop. (`volatile` keeps their order in the PTX;
// ptxas still hoists them all to the top of a loop trip.)
template <int OFF>
NQ_DEVICE uint4 lds128(u32 a) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4 + %5];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(a), "n"(OFF));
  return v;
}
template <int OFF>
NQ_DEVICE u32 lds32(u32 a) {
  u32 v;
  asm volatile("ld.shared.u32 %0, [%1 + %2];" : "=r"(v) : "r"(a), "n"(OFF));
  return v;
}
template <int OFF>
NQ_DEVICE u32 lds16(u32 a) {
  u16 v;
  asm volatile("ld.shared.u16 %0, [%1 + %2];" : "=h"(v) : "r"(a), "n"(OFF));
  return v;
}

template <int OFF>
NQ_DEVICE u32 lds8(u32 a) {
  u32 v;
  asm volatile("ld.shared.u8 %0, [%1 + %2];" : "=r"(v) : "r"(a), "n"(OFF));
  return v;
}

// One tile-column of a warp's tile pair: gemv_int4's compute_col for G = 128, x read at shared address
// xa (this tile-column's 128 staged columns of the lane's row, never masked) + XOFF bytes. acc[0..1]:
// y[2t, 2t+1] of row g of tile 0, acc[2..3]: of tile 1.
template <int XOFF>
NQ_DEVICE void tile_column(float (&acc)[4], const uint4& w0v, const uint4& w1v, float sc0, float sc1, u32 nz0,
                           u32 nz1, u32 xa) {
  const u32 w0[4] = {w0v.x, w0v.y, w0v.z, w0v.w};
  const u32 w1[4] = {w1v.x, w1v.y, w1v.z, w1v.w};
  float c[4] = {0.f, 0.f, 0.f, 0.f};
  uint4 b[4];
  b[0] = lds128<XOFF>(xa);
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    // the next word's x goes out before this word's mma (one load in flight ahead, as in gemv_int4)
    if (w == 0) b[1] = lds128<XOFF + 64>(xa);
    if (w == 1) b[2] = lds128<XOFF + 128>(xa);
    if (w == 2) b[3] = lds128<XOFF + 192>(xa);
    mma_bf16(c, dq_add(w0[w], 0, nz0), dq_add(w1[w], 0, nz1), dq_add(w0[w], 1, nz0), dq_add(w1[w], 1, nz1),
             b[w].x, b[w].y);
    mma_bf16(c, dq_add(w0[w], 2, nz0), dq_add(w1[w], 2, nz1), dq_add(w0[w], 3, nz0), dq_add(w1[w], 3, nz1),
             b[w].z, b[w].w);
  }
  acc[0] = fmaf(c[0], sc0, acc[0]);
  acc[1] = fmaf(c[1], sc0, acc[1]);
  acc[2] = fmaf(c[2], sc1, acc[2]);
  acc[3] = fmaf(c[3], sc1, acc[3]);
}

// U (1 or 2) tile-columns tc0 .. tc0 + U - 1 (tc0 % U == 0) of the warp's tile pair, accumulated into
// acc in order. Shared addresses of tile-column tc0: wa the lane's weight words (w layout above, +
// 16 lane); sa row g's scale of tile 0 (tile 1's at + S1); za - Z row g's zero point of tile 0 (tile
// 1's at + S1); xa the lane's staged x row (clamped to M - 1) + 8t. c3: a per-lane register whose
// byte 0 is 0xC3 (asym).
template <int U, bool ASYM, int S1, int Z>
NQ_DEVICE void tile_columns(float (&acc)[4], u32 wa, u32 sa, u32 za, u32 xa, u32 c3) {
  static_assert(U == 1 || U == 2, "U is 1 or 2 (U = 4 spills under the 64-register cap)");
  // scales of tile-columns tc0 (low half) and tc0 + 1 (high half) of rows g of tiles 0 and 1
  const u32 s0 = U == 2 ? lds32<0>(sa) : lds16<0>(sa);
  const u32 s1 = U == 2 ? lds32<S1>(sa) : lds16<S1>(sa);
  u32 z0 = 0u, z1 = 0u;  // zero points of tile-columns tc0 .. tc0 + U - 1, one byte each
  if constexpr (ASYM) {
    z0 = U == 2 ? lds16<Z>(za) : lds8<Z>(za);
    z1 = U == 2 ? lds16<S1 + Z>(za) : lds8<S1 + Z>(za);
  }
  const u32 nzs = neg_zero_pair(8u);
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const uint4 w0 = u == 0 ? lds128<0>(wa) : lds128<1024>(wa);     // tile 0
    const uint4 w1 = u == 0 ? lds128<512>(wa) : lds128<1536>(wa);   // tile 1
    const float sc0 = u == 0 ? scale_half<0>(s0) : scale_half<1>(s0);
    const float sc1 = u == 0 ? scale_half<0>(s1) : scale_half<1>(s1);
    const u32 nz0 = !ASYM ? nzs : u == 0 ? neg_zero_pair_byte<0>(z0, c3) : neg_zero_pair_byte<1>(z0, c3);
    const u32 nz1 = !ASYM ? nzs : u == 0 ? neg_zero_pair_byte<0>(z1, c3) : neg_zero_pair_byte<1>(z1, c3);
    if (u == 0) tile_column<0>(acc, w0, w1, sc0, sc1, nz0, nz1, xa);
    else tile_column<256>(acc, w0, w1, sc0, sc1, nz0, nz1, xa);
  }
}

}  // namespace nq_gemv_v2
