// layer_ops.cu: extern "C" entry points of the per-token layer ops (algorithms in layer_ops.cuh).
// Launch shapes are chosen by nanoqwen_kernels/layer_ops.py.
#include "layer_ops.cuh"

using namespace nq;

// grid (T), block 256. x, out: [T, H]; w: [H].
extern "C" __global__ void __launch_bounds__(256) rms_norm_bf16(const bf16_t* __restrict__ x,
                                                                const bf16_t* __restrict__ w,
                                                                bf16_t* __restrict__ out, int H, float eps) {
  pdl_entry();
  rms_norm_row(x, nullptr, w, out, H, eps);
}

// grid (T), block 256. residual <- bf16(x + residual); out <- rms_norm(residual) * w.
extern "C" __global__ void __launch_bounds__(256) fused_add_rms_norm_bf16(const bf16_t* __restrict__ x,
                                                                          bf16_t* __restrict__ residual,
                                                                          const bf16_t* __restrict__ w,
                                                                          bf16_t* __restrict__ out, int H,
                                                                          float eps) {
  pdl_entry();
  rms_norm_row(x, residual, w, out, H, eps);
}

// grid-stride over T * I / 8 vectors. gate_up: [T, 2I] (gate then up); out: [T, I]; I % 8 == 0.
extern "C" __global__ void __launch_bounds__(256) silu_mul_bf16(const bf16_t* __restrict__ gate_up,
                                                                bf16_t* __restrict__ out, int T, int I) {
  pdl_entry();
  const i64 nvec_row = I / 8, total = (i64)T * nvec_row;
  for (i64 v = blockIdx.x * (i64)blockDim.x + threadIdx.x; v < total; v += (i64)gridDim.x * blockDim.x) {
    const i64 t = v / nvec_row, c = v - t * nvec_row;
    const uint4 g = ld_v4(gate_up + t * 2 * I + c * 8);
    const uint4 u = ld_v4(gate_up + t * 2 * I + I + c * 8);
    const u32 ga[4] = {g.x, g.y, g.z, g.w}, ua[4] = {u.x, u.y, u.z, u.w};
    u32 o[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
      o[i] = f32x2_to_bf16x2(silu(bf16x2_lo(ga[i])) * bf16x2_lo(ua[i]),
                             silu(bf16x2_hi(ga[i])) * bf16x2_hi(ua[i]));
    *reinterpret_cast<uint4*>(out + t * I + c * 8) = make_uint4(o[0], o[1], o[2], o[3]);
  }
}

// grid (T), block 128. ids: int32 [T]; table: [V, H]; out: [T, H]; H % 8 == 0.
extern "C" __global__ void __launch_bounds__(128) embedding_gather_bf16(const int* __restrict__ ids,
                                                                        const bf16_t* __restrict__ table,
                                                                        bf16_t* __restrict__ out, int H,
                                                                        int V) {
  pdl_entry();
  const int t = blockIdx.x;
  const int id = ids[t];
  uint4* o = reinterpret_cast<uint4*>(out + (i64)t * H);
  if (id < 0 || id >= V) {
    for (int i = threadIdx.x; i < H / 8; i += blockDim.x) o[i] = make_uint4(~0u, ~0u, ~0u, ~0u);  // NaN
    return;
  }
  const uint4* src = reinterpret_cast<const uint4*>(table + (i64)id * H);
  for (int i = threadIdx.x; i < H / 8; i += blockDim.x) o[i] = src[i];
}

// grid (T), block 256. One token per block.
// qkv: [T, (Hq + 2*Hkv) * D] rows q heads, k heads, v heads; bias: same width or nullptr;
// positions, slot_mapping: int32 [T]; inv_freq: fp32 [D/2];
// q_out: [T, Hq, D]; k_cache, v_cache: [num_blocks, Hkv, block_size, D]. D % 4 == 0.
extern "C" __global__ void __launch_bounds__(256) qkv_rope_kv_write_bf16(
    const bf16_t* __restrict__ qkv, const bf16_t* __restrict__ bias, const int* __restrict__ positions,
    const int* __restrict__ slot_mapping, const float* __restrict__ inv_freq, bf16_t* __restrict__ q_out,
    bf16_t* __restrict__ k_cache, bf16_t* __restrict__ v_cache, int Hq, int Hkv, int D, int block_size) {
  pdl_entry();
  const int t = blockIdx.x;
  const int width = (Hq + 2 * Hkv) * D;
  const bf16_t* row = qkv + (i64)t * width;
  const float pos = (float)positions[t];
  const int slot = slot_mapping[t];
  const int half = D / 2, pairs = half / 2;  // each thread: 2 adjacent i, and their partners i + D/2
  i64 page_base = 0;
  if (slot >= 0) page_base = (i64)(slot / block_size) * Hkv * block_size * D + (i64)(slot % block_size) * D;

  // RoPE on q and k heads: (Hq + Hkv) heads x pairs threads.
  for (int idx = threadIdx.x; idx < (Hq + Hkv) * pairs; idx += blockDim.x) {
    const int h = idx / pairs, i = (idx - h * pairs) * 2;
    const int col = h * D + i;
    u32 a = *reinterpret_cast<const u32*>(row + col);
    u32 b = *reinterpret_cast<const u32*>(row + col + half);
    float a0 = bf16x2_lo(a), a1 = bf16x2_hi(a), b0 = bf16x2_lo(b), b1 = bf16x2_hi(b);
    if (bias) {
      const u32 ba = *reinterpret_cast<const u32*>(bias + col);
      const u32 bb = *reinterpret_cast<const u32*>(bias + col + half);
      // the bf16 model adds the bias in bf16: round the sum as it does
      a0 = bf16_to_f32(f32_to_bf16(a0 + bf16x2_lo(ba)));
      a1 = bf16_to_f32(f32_to_bf16(a1 + bf16x2_hi(ba)));
      b0 = bf16_to_f32(f32_to_bf16(b0 + bf16x2_lo(bb)));
      b1 = bf16_to_f32(f32_to_bf16(b1 + bf16x2_hi(bb)));
    }
    float s0, c0, s1, c1;
    rope_sincos(pos * inv_freq[i], &s0, &c0);
    rope_sincos(pos * inv_freq[i + 1], &s1, &c1);
    float ra0, rb0, ra1, rb1;
    rope_rotate(a0, b0, c0, s0, &ra0, &rb0);
    rope_rotate(a1, b1, c1, s1, &ra1, &rb1);
    const u32 oa = f32x2_to_bf16x2(ra0, ra1);
    const u32 ob = f32x2_to_bf16x2(rb0, rb1);
    if (h < Hq) {
      bf16_t* q = q_out + ((i64)t * Hq + h) * D;
      *reinterpret_cast<u32*>(q + i) = oa;
      *reinterpret_cast<u32*>(q + i + half) = ob;
    } else if (slot >= 0) {
      bf16_t* k = k_cache + page_base + (i64)(h - Hq) * block_size * D;
      *reinterpret_cast<u32*>(k + i) = oa;
      *reinterpret_cast<u32*>(k + i + half) = ob;
    }
  }
  // V heads: copy (+ bias) into the cache, 2 elements per thread step.
  if (slot >= 0) {
    for (int idx = threadIdx.x; idx < Hkv * half; idx += blockDim.x) {
      const int h = idx / half, i = (idx - h * half) * 2;
      const int col = (Hq + Hkv + h) * D + i;
      u32 v = *reinterpret_cast<const u32*>(row + col);
      if (bias) {
        const u32 bv = *reinterpret_cast<const u32*>(bias + col);
        v = f32x2_to_bf16x2(bf16x2_lo(v) + bf16x2_lo(bv), bf16x2_hi(v) + bf16x2_hi(bv));
      }
      *reinterpret_cast<u32*>(v_cache + page_base + (i64)h * block_size * D + i) = v;
    }
  }
}
