// gemv_int4.cuh: y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for decode, M = 1..8, W in the INT4 layout
// `int4-g{G}-tile8x128-v1` (docs/DESIGN.md), bf16 activations, fp32 accumulation; and the same with
// fp16 scales (`int4-g{G}-tile8x128-f16s-v1`, imported GPTQ/AWQ checkpoints): the scale type is the
// template parameter ST (ScaleBF16 / ScaleF16), which only changes how a scale's 16 bits widen to f32
// (a shift for bf16, cvt.f32.f16 for fp16: both exact). Zero points may be 0..16 there: bf16(128 + q)
// - bf16(128 + z) is exact for any z < 128, so the kernels need nothing else.
//
// Data layout. qweight u32 [N/8, K/128, 32, 4]: one 8x128 tile is 512 contiguous bytes; lane L of a
// warp loads words [L, 0..3] with one 16-byte load. Lane L = 4g + t holds, in word w, row g of the
// tile and columns 32w + 2t + {0,1} + 8j in the nibbles j, j+4 (j = 0..3). `lop3(word >> 4j,
// 0x000f000f, 0x43004300)` turns them into a bf16x2 (128 + q, 128 + q'); subtracting 128 + z (exact in
// bf16) leaves the integers q - z.
//
// Tensor cores at M <= 8. We compute y^T = W x^T with mma.m16n8k16 (bf16 in, fp32 accumulate):
//   A (16x16, row-major) = 16 weight rows = two vertically adjacent tiles (rows g from tile 2p, rows
//     g + 8 from tile 2p + 1); the lane's own dequantized words ARE its A registers
//     {a0a1, a2a3, a4a5, a6a7} = {tile0 j, tile1 j, tile0 j+1, tile1 j+1} for j = 0 (k 0..15 of the
//     word's 32 columns) and j = 2 (k 16..31);
//   B (16x8) = x^T: b0b1 = x[m = g][k 2t, 2t+1], b2b3 = x[g][2t+8, 2t+9] -- read from shared memory,
//     where x is staged once per block in a permuted order so that one 16-byte load per lane gives
//     the four B words of one 32-column word (lanes g >= M read row M - 1: column n of B only reaches
//     column n of C, the outputs y[m = n], which are not written for n >= M);
//   C (16x8) = y^T: c0, c1 = y[m = 2t, 2t+1][row g of tile 0], c2, c3 = same for tile 1.
// A word's dequantized values are exact small integers, so each quantization group is accumulated
// unscaled in a fresh fragment and then added to the fp32 accumulator times the fp32 scale of the
// lane's rows: exactly the reference's (q - z) * s, summed in fp32.
//
// Why it is fast: the weights are the only large stream (0.5 B/weight); each is read once with a
// 16-byte L1-bypassing load, two tile-columns (4 loads) in flight per warp. The ALU work is the limit
// at HBM speed (this loop on weights already in shared memory consumes them at only ~1.03x (sym) /
// 1.14x (asym) the read bandwidth), so the loop is kept lean: per 2 weights one shift, one lop3 and one
// bf16x2 add (`dq`), per 128 weights one mma, no masked loads, one PRMT per zero point; 128-161 SASS
// instructions per tile-column (1 KiB of weights) over the g128 kernels (tests/test_gemv_sass_cpu.py
// holds them to a bound derived from this list).
// Split-K: when N alone gives too few blocks for 132 SMs, gridDim.y = S blocks share each block's
// rows, each over kc tile-columns; they write fp32 partials to a workspace [S, M, N] and the last
// block to finish (an atomic counter per block row, reset to 0 by that block: graph-replay safe)
// adds them in split order (deterministic), adds the bias and writes bf16.
//
// Block: 8 warps; warp w of block b owns rows 16 * (8b + w) .. +15 (N % 8 == 0: a half pair is masked).
//
// The norm prologue (NORM, the `_norm` and `_norm_rope` entry points): x is the residual stream [M, K]
// and the GEMV's input is RMSNorm(x) * w, made while staging:
// bf16(x * rs[m] * w) with rs[m] = rsqrt(sum_b stats[m, b] / K + eps), layer_ops.cuh's rms_norm_row
// arithmetic on a sum of squares that the kernel which last wrote x left in stats [M, K / 128] (the
// residual epilogue below), so no block reads a whole row for it. Same bits as rms_norm then the GEMV,
// except where the sum's order (per 128 columns, then across them) moves rs by an ulp.
// The residual epilogue (EPI = 2, the `_resid` and `_silu_resid` entry points): instead of storing y,
// the block adds y (bias added, rounded to bf16 as it would be stored) into the residual stream
// resid [M, N] in place, rounding the sum to bf16 as fused_add_rms_norm does,
// and writes each row's sum of squares of the new residual over its 128 columns to resid_stats
// [M, gridDim.x]: the add of fused_add_rms_norm, and the statistics the next GEMV's norm prologue needs.
// Together they take the two add + RMSNorm launches out of a decode layer.
// The attention merge prologue (XMODE 3, the `_merge_resid` entry points, with the residual epilogue: the
// o projection): x is the attention output, some of whose rows the attention launch left split in fp32
// partials; the staging merges them (stage_x_merged, the combine kernel's arithmetic: the same bits), so
// the combine kernel's launch goes. With it a decode layer is five launches.
//
// The qkv epilogue (EPI = 1, the `_rope` entry points): instead of storing y, the block's 128 bf16 outputs
// per row (bias added and rounded once, exactly as stored otherwise) are staged in shared memory and the
// block applies layer_ops.cu's qkv_rope_kv_write to them: RoPE on the q and k heads, q to q_out
// [M, Hq, D], k and v into the paged cache at slot_mapping[m] (< 0: not written). A 128-row block holds
// 128 / D whole heads (D divides 128), so both columns of every RoPE pair are in the block. Same
// arithmetic as the two kernels it replaces, so the same bits; one launch and no qkv round trip.
#pragma once
#include "common.cuh"
#include "layer_ops.cuh"

namespace nq_gemv {

constexpr int WARPS = 8;
constexpr int THREADS = WARPS * 32;
constexpr int ROWS_PER_BLOCK = WARPS * 16;
constexpr int XPAD = 32;  // bf16 elements of padding per staged x row: rows alternate bank halves

NQ_DEVICE u32 lop3_and_or(u32 a, u32 b, u32 c) {
#ifdef NQ_HOST_EMU
  return (a & b) | c;
#else
  u32 d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(b), "r"(c));  // (a & b) | c
  return d;
#endif
}

// (128 + q) - (128 + z) in bf16x2; `negzz` holds -(128 + z) in both halves. Exact (both operands are
// integers below 256), so the one rounding of add.rn changes nothing. (An fma by 1.0 gives the same
// bits, but for the symmetric kernels ptxas kept it an HFMA2 with 1.0 in a register.)
NQ_DEVICE u32 sub_zero(u32 v, u32 negzz) {
#ifdef NQ_HOST_EMU
  return f32x2_to_bf16x2(bf16x2_lo(v) + bf16x2_lo(negzz), bf16x2_hi(v) + bf16x2_hi(negzz));
#else
  u32 d;
  asm("add.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(v), "r"(negzz));
  return d;
#endif
}

// nibble pair j of a word -> bf16x2 (q - z) for columns 2t + 8j + {0, 1}
NQ_DEVICE u32 dq(u32 word, int j, u32 negzz) {
  return sub_zero(lop3_and_or(word >> (4 * j), 0x000f000fu, 0x43004300u), negzz);
}

NQ_DEVICE u32 neg_zero_pair(u32 z) {
  const u32 h = 0xC300u + z;  // bf16 of -(128 + z): sign | exponent 7 | mantissa z
  return h | (h << 16);
}

// neg_zero_pair(byte B of z4) in one PRMT: the bytes {z, 0xC3, z, 0xC3} (z < 128 is the whole mantissa
// of -(128 + z) in bf16). c3: a register whose byte 0 is 0xC3, PRMT's first source (bytes 0..3; z4 is
// bytes 4..7), so the byte selector stays an immediate.
template <int B>
NQ_DEVICE u32 neg_zero_pair_byte(u32 z4, u32 c3) {
  return __byte_perm(c3, z4, (4 + B) | ((4 + B) << 8));
}

NQ_DEVICE void mma_bf16(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
#ifdef NQ_HOST_EMU
  const u32 a[4] = {a0, a1, a2, a3}, b[2] = {b0, b1};
  nq_emu::mma_m16n8k16(c, a, b, false);
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
#endif
}

// The two scale types of the INT4 layouts: 16 bits per scale, widened exactly to f32.
struct ScaleBF16 {
  static NQ_DEVICE float to_f32(u16 bits) { return __uint_as_float(((u32)bits) << 16); }
};
struct ScaleF16 {
  static NQ_DEVICE float to_f32(u16 bits) {
#ifdef NQ_HOST_EMU
    return nq_emu::f16_bits_to_f32(bits);
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(bits));
    return f;
#endif
  }
};

template <int G>
struct ScaleBits {
  using type = u32;  // G = 128: one bf16, G = 64: two
};
template <>
struct ScaleBits<32> {
  using type = u64;  // four bf16
};

// Scales of G consecutive columns starting at the tile-column: GPT groups per tile = 128 / G.
template <int G>
struct GroupIO {
  static constexpr int GPT = 128 / G;
  // raw scale bits of groups (tc*GPT .. +GPT-1) of one row, packed little-endian (GPT * 16 bits)
  static NQ_DEVICE typename ScaleBits<G>::type load_scales(const u16* s_row, int tc) {
    if constexpr (GPT == 1) return (u32)s_row[tc];
    else if constexpr (GPT == 2) return *reinterpret_cast<const u32*>(s_row + 2 * tc);
    else return *reinterpret_cast<const u64*>(s_row + 4 * tc);
  }
  static NQ_DEVICE u32 load_zeros(const u8* z_row, int tc) {
    if constexpr (GPT == 1) return (u32)z_row[tc];
    else if constexpr (GPT == 2) return (u32)*reinterpret_cast<const u16*>(z_row + 2 * tc);
    else return *reinterpret_cast<const u32*>(z_row + 4 * tc);
  }
};

// Stage x[0:M, k0 : k0 + ncols] into shared memory, permuted within each 32-column chunk so that
// element (m, 32c + 2t + 8j + e) sits at xs[m * xs_stride + 32c + 8t + 2j + e].
// XMODE 0: x is [M, K]. XMODE 1: x is gate_up [M, 2K] and the staged value is bf16(silu(g) * u).
// XMODE 2 (the norm prologue): x is the residual [M, K] and the staged value is bf16(x * rs[m] * nw)
// (rs: the rows' RMS scales, nw: the norm weight [K]).
template <int XMODE>
NQ_DEVICE void stage_x(bf16_t* xs, int xs_stride, const bf16_t* __restrict__ x, int M, int K, int k0,
                       int ncols, const bf16_t* __restrict__ nw = nullptr, const float* rs = nullptr) {
  const int vec_per_row = ncols / 8;
  // unrolled 4 times, except the norm staging (XMODE 2): not unrolled (the first weight stage is live
  // across the staging with its scales: unrolled, ptxas spilled in the g128 asym kernels)
#pragma unroll(XMODE == 2 ? 1 : 4)
  for (int v = threadIdx.x; v < M * vec_per_row; v += blockDim.x) {
    const int m = v / vec_per_row, c8 = (v - m * vec_per_row) * 8;
    u32 w[4];
    if constexpr (XMODE == 0) {
      const uint4 a = ld_v4(x + (i64)m * K + k0 + c8);
      w[0] = a.x; w[1] = a.y; w[2] = a.z; w[3] = a.w;
    } else if constexpr (XMODE == 2) {
      const uint4 a = nq::scale_bf16x8(ld_v4(x + (i64)m * K + k0 + c8), ld_v4(nw + k0 + c8), rs[m]);
      w[0] = a.x; w[1] = a.y; w[2] = a.z; w[3] = a.w;
    } else {
      const uint4 g = ld_v4(x + (i64)m * 2 * K + k0 + c8);
      const uint4 u = ld_v4(x + (i64)m * 2 * K + K + k0 + c8);
      const u32 ga[4] = {g.x, g.y, g.z, g.w}, ua[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float g0 = bf16x2_lo(ga[i]), g1 = bf16x2_hi(ga[i]);
        w[i] = f32x2_to_bf16x2(g0 / (1.f + __expf(-g0)) * bf16x2_lo(ua[i]),
                               g1 / (1.f + __expf(-g1)) * bf16x2_hi(ua[i]));
      }
    }
    // the 8 columns c8 .. c8+7 of a chunk share j = (c8 % 32) / 8; word i holds t = i
    const int chunk = c8 & ~31, j = (c8 & 31) >> 3;
    u32* dst = reinterpret_cast<u32*>(xs + m * xs_stride + chunk + 2 * j);
#pragma unroll
    for (int i = 0; i < 4; ++i) dst[i * 4] = w[i];  // + 8t bf16 = 4t words
  }
}

// One tile-column of a warp's tile pair: dequantize the lane's words (w0v: tile 0, w1v: tile 1), multiply
// them by the staged x (xt: the tile-column's 128 staged columns of the lane's x row), scale each group
// and add into acc (the C fragment, header). s0 / s1, z0 / z1: the raw scale bits and zero points of the
// lane's rows g of tile 0 and tile 1; c3: neg_zero_pair_byte's per-lane register. The GEMV's inner step.
template <int G, bool ASYM, typename ST>
NQ_DEVICE void mma_tile_column(float (&acc)[4], const uint4& w0v, const uint4& w1v, typename ScaleBits<G>::type s0,
                               typename ScaleBits<G>::type s1, u32 z0, u32 z1, const bf16_t* xt, u32 c3) {
  constexpr int GPT = 128 / G;
  const u32 w0[4] = {w0v.x, w0v.y, w0v.z, w0v.w};
  const u32 w1[4] = {w1v.x, w1v.y, w1v.z, w1v.w};
#pragma unroll
  for (int gi = 0; gi < GPT; ++gi) {
    u32 nz0, nz1;
    if constexpr (ASYM) {
      nz0 = gi == 0 ? neg_zero_pair_byte<0>(z0, c3) : gi == 1 ? neg_zero_pair_byte<1>(z0, c3)
          : gi == 2 ? neg_zero_pair_byte<2>(z0, c3) : neg_zero_pair_byte<3>(z0, c3);
      nz1 = gi == 0 ? neg_zero_pair_byte<0>(z1, c3) : gi == 1 ? neg_zero_pair_byte<1>(z1, c3)
          : gi == 2 ? neg_zero_pair_byte<2>(z1, c3) : neg_zero_pair_byte<3>(z1, c3);
    } else {
      nz0 = nz1 = neg_zero_pair(8u);
    }
    float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int wi = 0; wi < 4 / GPT; ++wi) {
      const int w = gi * (4 / GPT) + wi;
      const uint4 b = *reinterpret_cast<const uint4*>(xt + 32 * w);
      mma_bf16(c, dq(w0[w], 0, nz0), dq(w1[w], 0, nz1), dq(w0[w], 1, nz0), dq(w1[w], 1, nz1), b.x, b.y);
      mma_bf16(c, dq(w0[w], 2, nz0), dq(w1[w], 2, nz1), dq(w0[w], 3, nz0), dq(w1[w], 3, nz1), b.z, b.w);
    }
    const float sc0 = ST::to_f32((u16)(s0 >> (16 * gi)));
    const float sc1 = ST::to_f32((u16)(s1 >> (16 * gi)));
    acc[0] = fmaf(c[0], sc0, acc[0]);
    acc[1] = fmaf(c[1], sc0, acc[1]);
    acc[2] = fmaf(c[2], sc1, acc[2]);
    acc[3] = fmaf(c[3], sc1, acc[3]);
  }
}

// One tile-column of one warp's tile pair in registers: a pipeline stage of the GEMV and the GEMM.
template <int G>
struct TileColumn {
  uint4 w0, w1;                          // the lane's 16 bytes of tile 0 and tile 1
  typename ScaleBits<G>::type s0, s1;    // raw scale bits of the lane's rows g (tile 0) and g (tile 1)
  u32 z0, z1;                            // their zero points (asymmetric; 0 otherwise, unused)
};

// Issue tile-column tc's loads into c, from the lane's row bases (w1p = w0p when there is no tile 1).
template <int G, bool ASYM>
NQ_DEVICE void load_tile_column(TileColumn<G>& c, const uint4* w0p, const uint4* w1p, const u16* s0p,
                                const u16* s1p, const u8* z0p, const u8* z1p, int tc) {
  c.w0 = ld_stream_v4(w0p + (i64)tc * 32);
  c.w1 = ld_stream_v4(w1p + (i64)tc * 32);
  c.s0 = GroupIO<G>::load_scales(s0p, tc);
  c.s1 = GroupIO<G>::load_scales(s1p, tc);
  if constexpr (ASYM) {
    c.z0 = GroupIO<G>::load_zeros(z0p, tc);
    c.z1 = GroupIO<G>::load_zeros(z1p, tc);
  } else {
    c.z0 = c.z1 = 0u;  // unused (zero point 8)
  }
}

NQ_DEVICE void store_gemv_out(const float (&acc)[4], const bf16_t* __restrict__ bias, bf16_t* __restrict__ out,
                              float* __restrict__ ws, int* __restrict__ counters, int M, int N);

// The qkv epilogue's arguments (EPI = 1): as layer_ops.cu's qkv_rope_kv_write; unused for EPI = 0.
struct RopeKV {
  const int* positions;     // [M]
  const int* slot_mapping;  // [M]: page * block_size + offset, < 0 skips the K/V write
  const float* inv_freq;    // [D / 2]
  bf16_t* q_out;            // [M, Hq, D]
  bf16_t* k_cache;          // [num_blocks, Hkv, block_size, D]
  bf16_t* v_cache;
  int Hq, Hkv, D, block_size;
};

// Column pair (c, c + D/2) (c < D/2) of head h of row m, from va, vb = bf16(y + bias) of those columns:
// RoPE on a q or k head (layer_ops.cu's qkv_rope_kv_write arithmetic, the shared rope_sincos /
// rope_rotate), q to q_out, k and v into the paged cache at slot_mapping[m] (< 0: not written). The qkv
// epilogue of the GEMV (EPI = 1).
NQ_DEVICE void rope_kv_write_pair(const RopeKV& rk, int m, int h, int c, bf16_t va, bf16_t vb) {
  const int D = rk.D, half = D / 2, Hq = rk.Hq, Hkv = rk.Hkv, bs = rk.block_size;
  const int slot = rk.slot_mapping[m];
  const i64 page_base = slot < 0 ? 0 : (i64)(slot / bs) * Hkv * bs * D + (i64)(slot % bs) * D;
  if (h < Hq + Hkv) {
    float si, co, ra, rb;
    nq::rope_sincos((float)rk.positions[m] * rk.inv_freq[c], &si, &co);
    nq::rope_rotate(bf16_to_f32(va), bf16_to_f32(vb), co, si, &ra, &rb);
    bf16_t* dst = h < Hq ? rk.q_out + ((i64)m * Hq + h) * D
                         : (slot >= 0 ? rk.k_cache + page_base + (i64)(h - Hq) * bs * D : nullptr);
    if (dst) {
      dst[c] = f32_to_bf16(ra);
      dst[c + half] = f32_to_bf16(rb);
    }
  } else if (slot >= 0) {
    bf16_t* dst = rk.v_cache + page_base + (i64)(h - Hq - Hkv) * bs * D;
    dst[c] = va;
    dst[c + half] = vb;
  }
}

// The norm prologue's arguments (NORM; header).
struct NormIn {
  const bf16_t* weight;  // [K]
  const float* stats;    // [M, stat_blocks]: sums of squares of x per 128 columns
  float eps;
  int stat_blocks;       // ceil(K / 128)
};

// The residual epilogue's arguments (EPI = 2; header).
struct ResidOut {
  bf16_t* resid;  // [M, N], updated in place
  float* stats;   // [M, gridDim.x], written
};

// rs[m] = rsqrt(sum_b stats[m, b] / K + eps) for m < M (warp m sums row m: lanes over b, then the
// butterfly; a fixed order). The caller synchronises before reading rs.
NQ_DEVICE void norm_scales(const NormIn& ni, int M, int K, float* rs) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (warp >= M) return;
  float s = 0.f;
#pragma unroll 1  // one or two trips (K <= 8192); unrolled, ptxas kept 16 loads live and spilled
  for (int b = lane; b < ni.stat_blocks; b += 32) {
    s += ni.stats[warp * ni.stat_blocks + b];
  }
  s = warp_sum(s);
  if (lane == 0) rs[warp] = rsqrtf(s / (float)K + ni.eps);
}

// The norm prologue's staging: the rows' RMS scales from ni.stats, then x staged as stage_x<2>. Not
// inlined: inlined, ptxas spilled 8 bytes inside the main loop of the g128 asym exact-loop kernel.
__device__ __noinline__ void stage_x_normed(bf16_t* xs, int xs_stride, const bf16_t* __restrict__ x, int M,
                                            int K, int k0, int ncols, NormIn ni) {
  __shared__ float rs[8];
  norm_scales(ni, M, K, rs);
  __syncthreads();
  stage_x<2>(xs, xs_stride, x, M, K, k0, ncols, ni.weight, rs);
}

// The attention merge prologue's arguments (XMODE 3; header): the split-KV partials of the attention
// launch before, as attention.cuh's Params names them.
struct MergeIn {
  const float* work_o;     // [num_splits, work_rows, n_heads, HD]: each split's row, normalised by its own sum
  const float* work_lse;   // [num_splits, work_rows, n_heads]: its log2-sum-exp (-inf: no token)
  const int* work_splits;  // [work_rows, n_heads]: the row's split count S (written every launch)
  int work_rows;           // the attention plan's max_total_q
  int fuse_max_splits;     // a row of S <= this many splits is final in x (unsplit, or merged in the kernel)
};

// Most splits the merge prologue takes (attention.py refuses a deferred merge for plans that can split
// further): its weights are staged in shared memory, MERGE_MAX_SPLITS per row. At most the combine
// kernel's split groups (2048 / HD = 16 at HD 128), so every group holds at most one split (below).
constexpr int MERGE_MAX_SPLITS = 16;

// The merge prologue's staging (XMODE 3, `_merge_resid` entry points): x is the attention output [M, K =
// n_heads * HD], whose rows (token m, head h) of S > fuse_max_splits splits the attention launch left as
// fp32 partials for the combine kernel. Staged as stage_x<0> stages x, except that those rows are merged
// here first, with the combine kernel's arithmetic (attention.cuh combine_splits):
//     weight_s = lse_s == -inf ? 0 : exp2f(lse_s - M),  M = max_s lse_s,  L = sum_s weight_s (s order),
//     o = sum over the 2048 / HD split groups in group order of fmaf(weight_s, O_s, 0) (one split per group
//         here: S <= MERGE_MAX_SPLITS <= 2048 / HD; an empty group adds +0),
//     x = bf16(o * (L > 0 ? 1 / L : 0)),
// so the same bits as the combine kernel's row, and no launch for it. Phase 1: one thread per (m, head)
// computes the weights and 1 / L into shared memory (merge); phase 2: each thread stages 4 columns,
// reading the S partial float4s of its row (4 loads in flight). Not inlined (as stage_x_normed: the first
// weight stage is live across it). ws_smem: the shared memory after the staged x, (MERGE_MAX_SPLITS + 2)
// words per (row m, head) of the block's columns (gemv.py's merge_shared_bytes).
template <int HD>
__device__ __noinline__ void stage_x_merged(bf16_t* xs, int xs_stride, const bf16_t* __restrict__ x, int M, int K,
                                            int k0, int ncols, MergeIn mi, float* ws_smem) {
  constexpr int NG = 2048 / HD;  // the combine kernel's split groups (COMBINE_THREADS / (HD / 4))
  static_assert(MERGE_MAX_SPLITS <= NG, "one split per combine group");
  const int n_heads = K / HD, heads = ncols / HD, pairs = M * heads;
  float* wt = ws_smem;                                   // [pairs][MERGE_MAX_SPLITS]
  float* inv_l = ws_smem + pairs * MERGE_MAX_SPLITS;     // [pairs]
  int* splits = reinterpret_cast<int*>(inv_l + pairs);   // [pairs]
  const i64 split_stride = (i64)mi.work_rows * n_heads;  // rows per split
  for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
    const int m = p / heads, head = k0 / HD + (p - m * heads);
    const i64 row = (i64)m * n_heads + head;
    // S <= the plan's num_splits <= MERGE_MAX_SPLITS (gemv.py checks the plan); min() only keeps the
    // shared-memory writes in bounds
    const int S = min(mi.work_splits[row], MERGE_MAX_SPLITS);
    splits[p] = S;
    if (S <= mi.fuse_max_splits) continue;
    float* w = wt + p * MERGE_MAX_SPLITS;
    float mx = NQ_NEG_INF;
#pragma unroll 4
    for (int s = 0; s < S; ++s) {
      w[s] = mi.work_lse[s * split_stride + row];
      mx = fmaxf(mx, w[s]);
    }
    float L = 0.f;
    for (int s = 0; s < S; ++s) {
      const float e = w[s] == NQ_NEG_INF ? 0.f : exp2f(w[s] - mx);
      w[s] = e;
      L += e;
    }
    inv_l[p] = L > 0.f ? 1.f / L : 0.f;  // context 0: every split empty, zeros
  }
  __syncthreads();
  const int vec_per_row = ncols / 4;
  for (int v = threadIdx.x; v < M * vec_per_row; v += blockDim.x) {
    const int m = v / vec_per_row, c4 = (v - m * vec_per_row) * 4;
    const int p = m * heads + c4 / HD, S = splits[p];
    u32 w0, w1;
    if (S <= mi.fuse_max_splits) {  // final: the attention kernel wrote it to x
      const uint2 a = *reinterpret_cast<const uint2*>(x + (i64)m * K + k0 + c4);
      w0 = a.x, w1 = a.y;
    } else {
      const i64 row = (i64)m * n_heads + (k0 + c4) / HD;
      const float* src = mi.work_o + row * HD + (k0 + c4) % HD;
      const float* wp = wt + p * MERGE_MAX_SPLITS;
      float o0 = 0.f, o1 = 0.f, o2 = 0.f, o3 = 0.f;
#pragma unroll 4
      for (int s = 0; s < S; ++s) {
        const float4 a = *reinterpret_cast<const float4*>(src + s * split_stride * HD);
        const float e = wp[s];
        const float t0 = fmaf(e, a.x, 0.f), t1 = fmaf(e, a.y, 0.f), t2 = fmaf(e, a.z, 0.f), t3 = fmaf(e, a.w, 0.f);
        if (s == 0) o0 = t0, o1 = t1, o2 = t2, o3 = t3;
        else o0 += t0, o1 += t1, o2 += t2, o3 += t3;
      }
      if (S < NG) o0 += 0.f, o1 += 0.f, o2 += 0.f, o3 += 0.f;  // the empty groups' parts (+0: no -0 left)
      const float inv = inv_l[p];
      w0 = f32x2_to_bf16x2(o0 * inv, o1 * inv);
      w1 = f32x2_to_bf16x2(o2 * inv, o3 * inv);
    }
    // stage_x's permutation: columns (c8 + 2i, c8 + 2i + 1) of an 8-column run go to word i (t = i) at a
    // stride of 4 words; these 4 columns are words i0, i0 + 1 of their run
    const int c8 = c4 & ~7, chunk = c8 & ~31, j = (c8 & 31) >> 3, i0 = (c4 & 7) >> 1;
    u32* dst = reinterpret_cast<u32*>(xs + m * xs_stride + chunk + 2 * j);
    dst[i0 * 4] = w0;
    dst[(i0 + 1) * 4] = w1;
  }
}

NQ_DEVICE void store_gemv_residual(float a0, float a1, float a2, float a3, const bf16_t* __restrict__ bias,
                                   float* __restrict__ ws, int* __restrict__ counters, int M, int N,
                                   ResidOut ro);
// The same, not inlined: for the plain-input kernels (inlined, ptxas spilled 8 bytes in the g128 asym
// ones at 64 registers); the SiLU-input ones inline it (not inlined, the g64 asym ones spilled 8 bytes
// at 85 registers).
__device__ __noinline__ void store_gemv_residual_call(float a0, float a1, float a2, float a3,
                                                      const bf16_t* __restrict__ bias, float* __restrict__ ws,
                                                      int* __restrict__ counters, int M, int N, ResidOut ro) {
  store_gemv_residual(a0, a1, a2, a3, bias, ws, counters, M, N, ro);
}

// Not inlined: its registers stay out of the main loop's allocation (inlined, ptxas spilled 8-12 bytes
// in the g32 asym and g128 asym fp16-scale kernels).
__device__ __noinline__ void store_gemv_rope(float a0, float a1, float a2, float a3, const bf16_t* __restrict__ bias,
                                             float* __restrict__ ws, int* __restrict__ counters, int M, int N,
                                             RopeKV rk);
NQ_DEVICE bool split_k_arrive(const float (&acc)[4], float* __restrict__ ws, int* __restrict__ counters, int M,
                              int N);
NQ_DEVICE float sum_splits(const float* __restrict__ ws, int M, int N, int S, int m, int n);

// scales: the raw 16-bit scale words, bf16 or fp16 as ST says. EXACT: an exact trip count (below), for
// the kernels where it compiles without spills (gemv.cu says which).
// EPI: 0 stores y (+ bias) to out; 1 is the qkv epilogue (header), with rk; 2 the residual epilogue,
// with ro (out unused). NORM: the norm prologue (XMODE 0 only), with ni. Separate instantiations (and
// entry points), so the kernels without them compile exactly as before: near the 64-register cap a
// run-time switch moved ptxas into spills in the main loop of the g128 asym kernels.
// XMODE 3: the attention merge prologue (stage_x_merged) for head_dim MERGE_HD, with mi.

template <int G, bool ASYM, int XMODE, typename ST, bool EXACT, int EPI = 0, bool NORM = false, int MERGE_HD = 0>
NQ_DEVICE void gemv_int4(const bf16_t* __restrict__ x, const uint4* __restrict__ qweight,
                         const u16* __restrict__ scales, const u8* __restrict__ zeros,
                         const bf16_t* __restrict__ bias, bf16_t* __restrict__ out, float* __restrict__ ws,
                         int* __restrict__ counters, int M, int N, int K, int kc, const RopeKV& rk = {},
                         const NormIn& ni = {}, const ResidOut& ro = {}, const MergeIn& mi = {}) {
  pdl_launch_dependents();
  NQ_DYNAMIC_SMEM(smem_raw, 16);
  bf16_t* xs = reinterpret_cast<bf16_t*>(smem_raw);
  const int KT = K / 128, NT = N / 8, KG = K / G;
  const int split = blockIdx.y;
  const int tc_begin = split * kc;
  const int tc_end = min(KT, tc_begin + kc);
  const int ncols = (tc_end - tc_begin) * 128;
  const int xs_stride = kc * 128 + XPAD;

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int pair = blockIdx.x * WARPS + warp;
  const int tr0 = 2 * pair, tr1 = 2 * pair + 1;
  const bool has0 = tr0 < NT, has1 = tr1 < NT;
  const int row0 = 8 * tr0 + g, row1 = 8 * (has1 ? tr1 : tr0) + g;
  const uint4* w0p = qweight + ((i64)tr0 * KT) * 32 + lane;
  const uint4* w1p = qweight + ((i64)(has1 ? tr1 : tr0) * KT) * 32 + lane;
  const u16* s0p = scales + (i64)row0 * KG;
  const u16* s1p = scales + (i64)row1 * KG;
  const u8* z0p = ASYM ? zeros + (i64)row0 * KG : nullptr;
  const u8* z1p = ASYM ? zeros + (i64)row1 * KG : nullptr;

  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  // B fragment rows: lane (g, t) holds column n = g of B, which only reaches column n of C, i.e. the
  // outputs y[m = g], never written for g >= M. So those lanes read the staged row M - 1 instead of
  // zeros: no masked load (which cost ptxas 2 CS2R and a branch per 32-column word), same outputs.
  const bf16_t* xsl = xs + min(g, M - 1) * xs_stride + 8 * t;
  // byte 0 = 0xC3 for neg_zero_pair_byte; the other bytes make it a per-lane value, so that ptxas
  // keeps it in a vector register (a literal would turn the PRMT selectors into registers instead)
  const u32 c3 = 0xC3u | ((u32)(M + lane) << 8);
  using ScaleT = typename ScaleBits<G>::type;
  auto compute_col = [&](const uint4& w0v, const uint4& w1v, ScaleT s0, ScaleT s1, u32 z0, u32 z1,
                         const bf16_t* xt) {
    mma_tile_column<G, ASYM, ST>(acc, w0v, w1v, s0, s1, z0, z1, xt, c3);
  };

  // Tile-column tc's loads: addresses from the row bases and tc alone (running pointers, tried, pushed
  // ptxas into spills under the 64-register cap).
  auto load = [&](TileColumn<G>& st, int tc) {
    load_tile_column<G, ASYM>(st, w0p, w1p, s0p, s1p, z0p, z1p, tc);
  };
  // tile-column j of the block (tc_begin + j)
  auto compute = [&](const TileColumn<G>& st, int j) {
    compute_col(st.w0, st.w1, st.s0, st.s1, st.z0, st.z1, xsl + j * 128);
  };

  // Register pipeline: two stages of one tile-column, ping-pong: the loads of the next column are in
  // flight while the current one is dequantised and multiplied.
  // The first stage's weight loads go out before x is staged: their latency overlaps the staging, and
  // with a programmatic launch the previous kernel's tail too (pdl_wait after them: weights only).
  // (Issuing the second stage here too measured 5-15% slower on the H200.)
  const bool work = has0 && tc_begin < tc_end;  // warp-uniform (a split past K has no columns)
  TileColumn<G> A, B;
  if (work) load(A, tc_begin);
  pdl_wait();
  if constexpr (NORM) {
    static_assert(XMODE == 0, "the norm prologue takes a plain input");
    stage_x_normed(xs, xs_stride, x, M, K, tc_begin * 128, ncols, ni);
  } else if constexpr (XMODE == 3) {
    stage_x_merged<MERGE_HD>(xs, xs_stride, x, M, K, tc_begin * 128, ncols, mi,
                             reinterpret_cast<float*>(xs + M * xs_stride));
  } else {
    stage_x<XMODE>(xs, xs_stride, x, M, K, tc_begin * 128, ncols);
  }
  __syncthreads();
  if (work && !EXACT) {
    // Per-column guards (warp-uniform): 150 (sym) / 160 (asym) SASS instructions per tile-column at
    // g128 (nvcc 13.0; 165.5 / 180.5 before the changes above), no spills.
    for (int tc = tc_begin; tc < tc_end; tc += 2) {
      if (tc + 1 < tc_end) load(B, tc + 1);
      compute(A, tc - tc_begin);
      if (tc + 2 < tc_end) load(A, tc + 2);
      if (tc + 1 < tc_end) compute(B, tc + 1 - tc_begin);
    }
  } else if (work) {
    // EXACT: an exact trip count, pairs of columns then the odd one, so that both columns' math is one
    // basic block (ptxas interleaves it): 131 (sym) / 151 (asym) instructions per tile-column at g128
    // (nvcc 13.0). On the H200 the g128 asym kernel took 0.996 / 0.983 / 0.925 of the loop above's time
    // on qkv / o / gate_up at M = 1. In most other kernels ptxas spills a few
    // bytes with it, reloaded at every iteration, which the hot-kernel rule (test_build.py) forbids:
    // gemv.cu turns it on per kernel, and -DNQ_GEMV_EXACT_LOOP everywhere.
    int tc = tc_begin;  // the next column to compute; stage A holds it
    for (; tc + 2 <= tc_end; tc += 2) {
      load(B, tc + 1);
      compute(A, tc - tc_begin);
      if (tc + 2 < tc_end) load(A, tc + 2);  // warp-uniform
      compute(B, tc + 1 - tc_begin);
    }
    if (tc < tc_end) compute(A, tc - tc_begin);
  }
  if constexpr (EPI == 0) store_gemv_out(acc, bias, out, ws, counters, M, N);
  else if constexpr (EPI == 1) store_gemv_rope(acc[0], acc[1], acc[2], acc[3], bias, ws, counters, M, N, rk);
  else if constexpr (XMODE == 0 || XMODE == 3)
    store_gemv_residual_call(acc[0], acc[1], acc[2], acc[3], bias, ws, counters, M, N, ro);
  else store_gemv_residual(acc[0], acc[1], acc[2], acc[3], bias, ws, counters, M, N, ro);
}

// Where lane (g, t) of warp w's accumulators go (store_gemv_out says which is which): output rows
// row0 = 8 tr0 + g and row1 = 8 tr1 + g (tr0/1 = 2 (8 blockIdx.x + w) (+1); has0/1: the row exists),
// activation rows m0 = 2t, m1 = 2t + 1. From a fresh read of the thread index (see store_gemv_out).
struct LaneOut {
  int row0, row1, m0, m1;
  bool has0, has1;
  static NQ_DEVICE LaneOut of(int N) {
#ifdef NQ_HOST_EMU
    const u32 tid = threadIdx.x;
#else
    u32 tid;
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));  // volatile: not merged with the kernel's read
#endif
    const int lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int tr0 = 2 * (blockIdx.x * WARPS + warp), tr1 = tr0 + 1;
    return {8 * tr0 + g, 8 * tr1 + g, 2 * t, 2 * t + 1, tr0 < N / 8, tr1 < N / 8};
  }
};

// The GEMV's epilogue: the fp32 accumulators of lane (g, t) of warp w -- acc[0..1]: y[2t, 2t+1] of row
// 8 tr0 + g, acc[2..3]: of row 8 tr1 + g, tr0/1 = 2 (8 blockIdx.x + w) (+1) -- plus the bias, to bf16
// out [M, N]; with a K split (gridDim.y = S > 1) as fp32 partials to ws [S, M, N], and the block row's
// last block to finish adds them in split order. Its indices are derived here, from a fresh read of
// the thread index, rather than kept live across the main loop (which made ptxas spill them at 64
// registers).
NQ_DEVICE void store_gemv_out(const float (&acc)[4], const bf16_t* __restrict__ bias, bf16_t* __restrict__ out,
                              float* __restrict__ ws, int* __restrict__ counters, int M, int N) {
  const int S = gridDim.y;
  if (S == 1) {
    const LaneOut L = LaneOut::of(N);
    const int row0 = L.row0, row1 = L.row1, m0 = L.m0, m1 = L.m1;
    const bool has0 = L.has0, has1 = L.has1;
    if (has0) {
      const float b0 = bias ? bf16_to_f32(bias[row0]) : 0.f;
      if (m0 < M) out[(i64)m0 * N + row0] = f32_to_bf16(acc[0] + b0);
      if (m1 < M) out[(i64)m1 * N + row0] = f32_to_bf16(acc[1] + b0);
    }
    if (has1) {
      const float b1 = bias ? bf16_to_f32(bias[row1]) : 0.f;
      if (m0 < M) out[(i64)m0 * N + row1] = f32_to_bf16(acc[2] + b1);
      if (m1 < M) out[(i64)m1 * N + row1] = f32_to_bf16(acc[3] + b1);
    }
    return;
  }
  if (!split_k_arrive(acc, ws, counters, M, N)) return;
  const int row_base = blockIdx.x * ROWS_PER_BLOCK;
  for (int idx = threadIdx.x; idx < M * ROWS_PER_BLOCK; idx += blockDim.x) {
    const int m = idx / ROWS_PER_BLOCK, n = row_base + (idx - m * ROWS_PER_BLOCK);
    if (n < N) out[(i64)m * N + n] = f32_to_bf16(sum_splits(ws, M, N, S, m, n) + (bias ? bf16_to_f32(bias[n]) : 0.f));
  }
  if (threadIdx.x == 0) counters[blockIdx.x] = 0;  // ready for the next launch (or graph replay)
}

// Split-K arrival: write this block's fp32 partials (acc of lane (g, t), as store_gemv_out reads them)
// to ws [S, M, N] and count the block row's arrivals. True in the block row's last block to arrive
// (block-uniform), which then sums the partials; it must reset counters[blockIdx.x] to 0.
NQ_DEVICE bool split_k_arrive(const float (&acc)[4], float* __restrict__ ws, int* __restrict__ counters, int M,
                              int N) {
  const LaneOut L = LaneOut::of(N);
  const int row0 = L.row0, row1 = L.row1, m0 = L.m0, m1 = L.m1, S = gridDim.y;
  const bool has0 = L.has0, has1 = L.has1;
  float* part = ws + (i64)blockIdx.y * M * N;
  if (has0) {
    if (m0 < M) part[(i64)m0 * N + row0] = acc[0];
    if (m1 < M) part[(i64)m1 * N + row0] = acc[1];
  }
  if (has1) {
    if (m0 < M) part[(i64)m0 * N + row1] = acc[2];
    if (m1 < M) part[(i64)m1 * N + row1] = acc[3];
  }
  __threadfence();
  __syncthreads();
  __shared__ int is_last;
  if (threadIdx.x == 0) is_last = atomicAdd(&counters[blockIdx.x], 1) == S - 1;
  __syncthreads();
  if (!is_last) return false;
  __threadfence();
  return true;
}

// y[m, n] without the bias: the S partials of ws [S, M, N] added in split order (deterministic), 8
// loads in flight at a time (the last block is on the launch's critical path: its L2 round trips must
// not be serialised).
NQ_DEVICE float sum_splits(const float* __restrict__ ws, int M, int N, int S, int m, int n) {
  const float* p = ws + (i64)m * N + n;
  const i64 split_stride = (i64)M * N;
  float sum = 0.f;
  int s = 0;
  for (; s + 8 <= S; s += 8) {
    float part[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) part[i] = ld_cg_f32(p + (s + i) * split_stride);
#pragma unroll
    for (int i = 0; i < 8; ++i) sum += part[i];
  }
  for (; s < S; ++s) sum += ld_cg_f32(p + s * split_stride);
  return sum;
}

// The residual epilogue (header). sq[m * 128 + r]: the square of the new residual of row m, block-local
// column r (0 where the column does not exist), summed per row by warp m in a fixed order.
NQ_DEVICE void store_gemv_residual(float a0, float a1, float a2, float a3, const bf16_t* __restrict__ bias,
                                   float* __restrict__ ws, int* __restrict__ counters, int M, int N,
                                   ResidOut ro) {
  __shared__ float sq[8 * ROWS_PER_BLOCK];  // M <= 8 (gemv.MAX_M)
  const float acc[4] = {a0, a1, a2, a3};
  const int S = gridDim.y, row_base = blockIdx.x * ROWS_PER_BLOCK;
  // y (fp32, bias added) into resid[m, n]: bf16(bf16(y) + resid), stored; returns its square
  auto add = [&](int m, int n, float y) {
    bf16_t* p = ro.resid + (i64)m * N + n;
    const bf16_t r = f32_to_bf16(bf16_to_f32(f32_to_bf16(y)) + bf16_to_f32(*p));
    *p = r;
    const float rf = bf16_to_f32(r);
    return rf * rf;
  };
  if (S == 1) {
    const LaneOut L = LaneOut::of(N);
    const int r0 = L.row0 - row_base, r1 = L.row1 - row_base;  // block-local rows
    const float b0 = (bias && L.has0) ? bf16_to_f32(bias[L.row0]) : 0.f;
    const float b1 = (bias && L.has1) ? bf16_to_f32(bias[L.row1]) : 0.f;
    sq[L.m0 * ROWS_PER_BLOCK + r0] = (L.has0 && L.m0 < M) ? add(L.m0, L.row0, acc[0] + b0) : 0.f;
    sq[L.m1 * ROWS_PER_BLOCK + r0] = (L.has0 && L.m1 < M) ? add(L.m1, L.row0, acc[1] + b0) : 0.f;
    sq[L.m0 * ROWS_PER_BLOCK + r1] = (L.has1 && L.m0 < M) ? add(L.m0, L.row1, acc[2] + b1) : 0.f;
    sq[L.m1 * ROWS_PER_BLOCK + r1] = (L.has1 && L.m1 < M) ? add(L.m1, L.row1, acc[3] + b1) : 0.f;
  } else {
    if (!split_k_arrive(acc, ws, counters, M, N)) return;
    for (int idx = threadIdx.x; idx < M * ROWS_PER_BLOCK; idx += blockDim.x) {
      const int m = idx / ROWS_PER_BLOCK, n = row_base + (idx - m * ROWS_PER_BLOCK);
      sq[idx] = n < N ? add(m, n, sum_splits(ws, M, N, S, m, n) + (bias ? bf16_to_f32(bias[n]) : 0.f)) : 0.f;
    }
    if (threadIdx.x == 0) counters[blockIdx.x] = 0;
  }
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (warp < M) {
    const float* row = sq + warp * ROWS_PER_BLOCK;
    float s = row[lane] + row[lane + 32];
    s += row[lane + 64];
    s += row[lane + 96];
    s = warp_sum(s);
    if (lane == 0) ro.stats[warp * gridDim.x + blockIdx.x] = s;
  }
}

// The qkv epilogue (EPI = 1; the header says what it does). vals: the block's bf16 outputs, row m of
// the block at vals[m * ROWS_PER_BLOCK ..], each bf16(y + bias) as store_gemv_out would store it.
__device__ __noinline__ void store_gemv_rope(float a0, float a1, float a2, float a3, const bf16_t* __restrict__ bias,
                                             float* __restrict__ ws, int* __restrict__ counters, int M, int N,
                                             RopeKV rk) {
  __shared__ bf16_t vals[8 * ROWS_PER_BLOCK];  // M <= 8 (gemv.MAX_M)
  const float acc[4] = {a0, a1, a2, a3};
  const int S = gridDim.y, row_base = blockIdx.x * ROWS_PER_BLOCK;
  if (S == 1) {
    const LaneOut L = LaneOut::of(N);
    const int r0 = L.row0 - row_base, r1 = L.row1 - row_base;  // block-local rows
    if (L.has0) {
      const float b0 = bias ? bf16_to_f32(bias[L.row0]) : 0.f;
      if (L.m0 < M) vals[L.m0 * ROWS_PER_BLOCK + r0] = f32_to_bf16(acc[0] + b0);
      if (L.m1 < M) vals[L.m1 * ROWS_PER_BLOCK + r0] = f32_to_bf16(acc[1] + b0);
    }
    if (L.has1) {
      const float b1 = bias ? bf16_to_f32(bias[L.row1]) : 0.f;
      if (L.m0 < M) vals[L.m0 * ROWS_PER_BLOCK + r1] = f32_to_bf16(acc[2] + b1);
      if (L.m1 < M) vals[L.m1 * ROWS_PER_BLOCK + r1] = f32_to_bf16(acc[3] + b1);
    }
  } else {
    if (!split_k_arrive(acc, ws, counters, M, N)) return;
    for (int idx = threadIdx.x; idx < M * ROWS_PER_BLOCK; idx += blockDim.x) {
      const int m = idx / ROWS_PER_BLOCK, nl = idx - m * ROWS_PER_BLOCK, n = row_base + nl;
      if (n < N) vals[idx] = f32_to_bf16(sum_splits(ws, M, N, S, m, n) + (bias ? bf16_to_f32(bias[n]) : 0.f));
    }
    if (threadIdx.x == 0) counters[blockIdx.x] = 0;
  }
  __syncthreads();
  // One thread per (row m, column pair (c, c + D/2) of a head of the block): 64 pairs per row.
  const int D = rk.D, half = D / 2;
  for (int idx = threadIdx.x; idx < M * (ROWS_PER_BLOCK / 2); idx += blockDim.x) {
    const int m = idx / (ROWS_PER_BLOCK / 2), p = idx - m * (ROWS_PER_BLOCK / 2);
    const int nl = (p / half) * D + p % half, n = row_base + nl;
    if (n >= N) continue;
    const int h = n / D;
    rope_kv_write_pair(rk, m, h, n - h * D, vals[m * ROWS_PER_BLOCK + nl], vals[m * ROWS_PER_BLOCK + nl + half]);
  }
}

// a[i] for a lane-dependent i in 0..3, as selects (a dynamic index would put `a` in local memory).
NQ_DEVICE u32 select4(const u32 (&a)[4], int i) {
  return i == 0 ? a[0] : i == 1 ? a[1] : i == 2 ? a[2] : a[3];
}

// Dequantize to a dense bf16 [N, K] matrix (prefill path: then a cuBLAS GEMM). One warp per tile,
// grid-stride. Each value is bf16((q - z) * s), rounded once (s widened from bf16 or fp16 by ST).
//
// Stores are the cost here (4 bytes written per byte read), so they are made full-width: in the tile
// layout lane (g, t) holds, for word w and nibble j, columns 32w + 8j + 2t and +1 of row g. A 4-lane
// transpose (3 shuffles per word) gives lane t the eight columns 32w + 8t .. +7 instead, which it
// writes as one 16-byte store; the 4 lanes of a row then write 64 contiguous bytes per word.
template <int G, bool ASYM, typename ST>
NQ_DEVICE void dequant_int4(const uint4* __restrict__ qweight, const u16* __restrict__ scales,
                            const u8* __restrict__ zeros, bf16_t* __restrict__ out, int N, int K) {
  const int KT = K / 128, KG = K / G;
  const i64 ntiles = (i64)(N / 8) * KT;
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const i64 warp0 = (blockIdx.x * (i64)blockDim.x + threadIdx.x) >> 5;
  const i64 nwarps = ((i64)gridDim.x * blockDim.x) >> 5;
  for (i64 tile = warp0; tile < ntiles; tile += nwarps) {
    const int tr = (int)(tile / KT), tc = (int)(tile - (i64)tr * KT);
    const uint4 v = ld_stream_v4(qweight + tile * 32 + lane);
    const u32 wv[4] = {v.x, v.y, v.z, v.w};
    const int row = 8 * tr + g;
    bf16_t* orow = out + (i64)row * K + tc * 128 + 8 * t;
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const int grp = (tc * 128 + 32 * w) / G;
      const float s = ST::to_f32(scales[(i64)row * KG + grp]);
      const float z = ASYM ? (float)zeros[(i64)row * KG + grp] : 8.f;
      u32 mine[4];  // mine[j]: columns 32w + 8j + 2t, +1
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const u32 p = lop3_and_or(wv[w] >> (4 * j), 0x000f000fu, 0x43004300u);
        mine[j] = f32x2_to_bf16x2((bf16x2_lo(p) - 128.f - z) * s, (bf16x2_hi(p) - 128.f - z) * s);
      }
      // Round r (1..3): lane t sends mine[(t + r) & 3] and receives from lane s = (t - r) & 3 of its
      // group that lane's mine[t], i.e. its columns 32w + 8t + 2s. recv[0] is the lane's own mine[t].
      // got[s] = recv[(t - s) & 3]. All indices are lane-dependent: 4-way selects, no local memory.
      u32 recv[4];
      recv[0] = select4(mine, t);
#pragma unroll
      for (int r = 1; r < 4; ++r)
        recv[r] = __shfl_sync(0xffffffffu, select4(mine, (t + r) & 3), (lane & ~3) | ((t - r) & 3));
      *reinterpret_cast<uint4*>(orow + 32 * w) =
          make_uint4(select4(recv, t), select4(recv, (t - 1) & 3), select4(recv, (t - 2) & 3),
                     select4(recv, (t - 3) & 3));
    }
  }
}

}  // namespace nq_gemv
