// layer_ops.cuh: the small per-token ops of a Qwen2 decoder layer, all bf16 in / bf16 out, fp32 inside.
//
// - rms_norm / fused_add_rms_norm: one block per token row of H elements, 16-byte vectors (H % 8 == 0).
//   The fused form adds the sublayer output into the residual stream (rounded to bf16, written back in
//   place, as the bf16 model does) and normalises the sum: one read of each input, one write of each
//   output, instead of an add kernel plus a norm kernel. The final norm is the same kernel.
// - silu_mul: gate_up [T, 2I] (gate columns first, then up, the fused GEMV's output) -> [T, I].
// - embedding_gather: ids [T] -> rows of the bf16 table; an out-of-range id writes a NaN row (loud,
//   never a read out of bounds).
// - qkv_rope_kv_write: one block per token: adds the q/k/v bias (optional; the GEMV can fuse it
//   instead), applies Qwen2 RoPE (rotate_half convention, cos/sin in fp32 from an fp32 inv_freq table)
//   to q and k, writes q to q_out [T, Hq, D] and k, v into the paged cache pages
//   [num_blocks, Hkv, block_size, D] at slot_mapping[t] (= page * block_size + offset; < 0 skips).
// All are memory-bound and tiny next to the GEMVs; they are written for one pass and coalesced access.
#pragma once
#include "common.cuh"

namespace nq {

// Sum of squares over a row held as uint4 vectors (8 bf16 each).
NQ_DEVICE float sumsq_bf16x8(uint4 v) {
  float s = 0.f;
  const u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float a = bf16x2_lo(w[i]), b = bf16x2_hi(w[i]);
    s = fmaf(a, a, s);
    s = fmaf(b, b, s);
  }
  return s;
}

NQ_DEVICE uint4 scale_bf16x8(uint4 v, uint4 wt, float rs) {
  const u32 a[4] = {v.x, v.y, v.z, v.w};
  const u32 g[4] = {wt.x, wt.y, wt.z, wt.w};
  u32 o[4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
    o[i] = f32x2_to_bf16x2(bf16x2_lo(a[i]) * rs * bf16x2_lo(g[i]), bf16x2_hi(a[i]) * rs * bf16x2_hi(g[i]));
  return make_uint4(o[0], o[1], o[2], o[3]);
}

NQ_DEVICE uint4 add_bf16x8(uint4 x, uint4 r) {
  const u32 a[4] = {x.x, x.y, x.z, x.w};
  const u32 b[4] = {r.x, r.y, r.z, r.w};
  u32 o[4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
    o[i] = f32x2_to_bf16x2(bf16x2_lo(a[i]) + bf16x2_lo(b[i]), bf16x2_hi(a[i]) + bf16x2_hi(b[i]));
  return make_uint4(o[0], o[1], o[2], o[3]);
}

// out[row] = x[row] * rsqrt(mean(x[row]^2) + eps) * w. If residual != nullptr, x is first replaced by
// bf16(x + residual), which is also stored back into residual. H % 8 == 0.
NQ_DEVICE void rms_norm_row(const bf16_t* __restrict__ x, bf16_t* __restrict__ residual,
                            const bf16_t* __restrict__ w, bf16_t* __restrict__ out, int H, float eps) {
  __shared__ float scratch[32];
  const int row = blockIdx.x;
  const int nvec = H / 8;
  const uint4* xv = reinterpret_cast<const uint4*>(x + (i64)row * H);
  uint4* rv = residual ? reinterpret_cast<uint4*>(residual + (i64)row * H) : nullptr;
  float ss = 0.f;
  for (int i = threadIdx.x; i < nvec; i += blockDim.x) {
    uint4 v = xv[i];
    if (rv) {
      v = add_bf16x8(v, rv[i]);
      rv[i] = v;
    }
    ss += sumsq_bf16x8(v);
  }
  ss = block_sum(ss, scratch);
  const float rs = rsqrtf(ss / (float)H + eps);
  const uint4* wv = reinterpret_cast<const uint4*>(w);
  uint4* ov = reinterpret_cast<uint4*>(out + (i64)row * H);
  for (int i = threadIdx.x; i < nvec; i += blockDim.x) {
    const uint4 v = rv ? rv[i] : xv[i];  // same thread wrote rv[i] above: ordered
    ov[i] = scale_bf16x8(v, wv[i], rs);
  }
}

// sin/cos of an fp32 angle (computed exactly as torch does: fp32 position * fp32 inv_freq). The angle
// is reduced modulo 2*pi in double (exact enough for any position), then the fast intrinsics run on
// |r| <= pi (abs error ~1e-6, far under bf16's resolution). sincosf itself would pull in its
// Payne-Hanek slow path for large angles, which needs a local-memory stack frame.
NQ_DEVICE void rope_sincos(float angle, float* s, float* c) {
  const double a = (double)angle;
  const double two_pi = 6.283185307179586476925286766559;
  const float r = (float)(a - rint(a * (1.0 / two_pi)) * two_pi);
  __sincosf(r, s, c);
}

// Qwen2 RoPE (rotate_half) of one column pair (a = column c, b = column c + D/2 of a head) by the angle
// whose cos/sin are co/si: a' = a co - b si, b' = b co + a si. Each product and the sum rounded on its
// own (no FMA contraction), so that every kernel applying it (qkv_rope_kv_write, the qkv GEMV's fused
// epilogue) gives the same bits.
NQ_DEVICE void rope_rotate(float a, float b, float co, float si, float* ra, float* rb) {
  *ra = __fsub_rn(__fmul_rn(a, co), __fmul_rn(b, si));
  *rb = __fadd_rn(__fmul_rn(b, co), __fmul_rn(a, si));
}

NQ_DEVICE float silu(float g) { return g / (1.f + __expf(-g)); }

}  // namespace nq
