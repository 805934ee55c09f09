// common.cuh: small device helpers shared by every nanoqwen kernel family.
//
// No CUDA toolkit header is included anywhere (NVRTC then needs no include path but csrc/): bf16 is
// carried as raw 16-bit patterns (`bf16_t`) or packed pairs in a 32-bit word (`bf16x2_t`), converted
// with shifts (bf16 -> f32 is exact) and `cvt.rn` PTX (f32 -> bf16, round to nearest even, like torch).
// Also: warp/block reductions, 16-byte streaming loads, and the Philox4x32-10 counter-based RNG used
// by the sampler (same constants as curand / torch's Philox).
#pragma once

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;
typedef u16 bf16_t;
typedef u32 bf16x2_t;

#define NQ_DEVICE __device__ __forceinline__
#define NQ_NEG_INF __int_as_float(0xff800000)

// A kernel's dynamic shared memory (`extern __shared__`), as `unsigned char name[]` aligned to `align`.
// NQ_HOST_EMU: the kernels compiled for the CPU (emu/simt.h, nanoqwen_kernels.testing.emu), where each
// PTX wrapper below takes its host branch.
#ifdef NQ_HOST_EMU
#define NQ_DYNAMIC_SMEM(name, align) unsigned char* name = ::nq_emu::dynamic_smem()
#else
#define NQ_DYNAMIC_SMEM(name, align) extern __shared__ __align__(align) unsigned char name[]
#endif

// Programmatic dependent launch (sm_90). launch.py launches the kernels of the families that
// specs.py marks `programmatic` with programmatic stream serialization: such a kernel may start while
// the kernel before it on the stream still runs. Each of their kernels calls pdl_launch_dependents() as
// it starts (the kernel after it may start now) and pdl_wait() (every earlier kernel on the stream has
// completed and its writes are visible) before it reads or writes any memory but the weights, scales,
// zero points and biases, which no kernel writes. Launched without the attribute, both are no-ops.
// The pair lets the next kernel's launch, block start and first weight loads overlap this kernel's tail.
NQ_DEVICE void pdl_launch_dependents() {
#ifndef NQ_HOST_EMU
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
NQ_DEVICE void pdl_wait() {
#ifndef NQ_HOST_EMU
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Both at a kernel's start: the kernels that read nothing before their inputs.
NQ_DEVICE void pdl_entry() {
  pdl_launch_dependents();
  pdl_wait();
}

NQ_DEVICE float bf16_to_f32(bf16_t b) { return __uint_as_float(((u32)b) << 16); }
NQ_DEVICE float bf16x2_lo(bf16x2_t v) { return __uint_as_float(v << 16); }
NQ_DEVICE float bf16x2_hi(bf16x2_t v) { return __uint_as_float(v & 0xffff0000u); }

NQ_DEVICE bf16_t f32_to_bf16(float f) {
#ifdef NQ_HOST_EMU
  return nq_emu::f32_to_bf16_rn(f);
#else
  bf16_t r;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
  return r;
#endif
}

// Pack two floats into a bf16x2 word: `lo` in bits 0..15 (the lower address), `hi` in bits 16..31.
NQ_DEVICE bf16x2_t f32x2_to_bf16x2(float lo, float hi) {
#ifdef NQ_HOST_EMU
  return (bf16x2_t)nq_emu::f32_to_bf16_rn(lo) | ((bf16x2_t)nq_emu::f32_to_bf16_rn(hi) << 16);
#else
  bf16x2_t r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
#endif
}

NQ_DEVICE float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

NQ_DEVICE float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Block-wide sum; every thread gets the result. `scratch` holds >= 32 floats; blockDim.x % 32 == 0.
NQ_DEVICE float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < nwarps ? scratch[lane] : 0.f;
  return warp_sum(v);
}

// 16-byte load that bypasses L1 allocation: weights are read exactly once per launch.
NQ_DEVICE uint4 ld_stream_v4(const void* p) {
#ifdef NQ_HOST_EMU
  return *reinterpret_cast<const uint4*>(p);
#else
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
#endif
}

NQ_DEVICE uint4 ld_v4(const void* p) { return *reinterpret_cast<const uint4*>(p); }

// Loads that bypass L1 (cached in L2 only): for data another block of the same launch wrote, read after
// an arrival counter said it is complete (a split-K or split-KV reduction); L1 is not coherent.
NQ_DEVICE float ld_cg_f32(const float* p) {
#ifdef NQ_HOST_EMU
  nq_emu::load_point();
  return *reinterpret_cast<const volatile float*>(p);
#else
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
#endif
}

NQ_DEVICE bf16_t ld_cg_bf16(const bf16_t* p) {
#ifdef NQ_HOST_EMU
  nq_emu::load_point();
  return *reinterpret_cast<const volatile bf16_t*>(p);
#else
  bf16_t v;
  asm volatile("ld.global.cg.u16 %0, [%1];" : "=h"(v) : "l"(p));
  return v;
#endif
}

NQ_DEVICE uint4 ld_cg_v4(const void* p) {
#ifdef NQ_HOST_EMU
  nq_emu::load_point();
  return *reinterpret_cast<const uint4*>(p);
#else
  uint4 v;
  asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
#endif
}

NQ_DEVICE float4 ld_cg_f32x4(const float* p) {
#ifdef NQ_HOST_EMU
  nq_emu::load_point();
  return *reinterpret_cast<const float4*>(p);
#else
  float4 v;
  asm volatile("ld.global.cg.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "l"(p));
  return v;
#endif
}

// ---------------------------------------------------------------------------------------------------
// Philox4x32-10 (Salmon et al. 2011; constants as in curand). counter: 4 words, key: 2 words.
// ---------------------------------------------------------------------------------------------------
struct Philox4 {
  u32 x, y, z, w;
};

NQ_DEVICE Philox4 philox4x32_10(Philox4 c, u32 k0, u32 k1) {
#pragma unroll
  for (int r = 0; r < 10; ++r) {
    const u32 lo0 = 0xD2511F53u * c.x, hi0 = __umulhi(0xD2511F53u, c.x);
    const u32 lo1 = 0xCD9E8D57u * c.z, hi1 = __umulhi(0xCD9E8D57u, c.z);
    Philox4 n;
    n.x = hi1 ^ c.y ^ k0;
    n.y = lo1;
    n.z = hi0 ^ c.w ^ k1;
    n.w = lo0;
    c = n;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return c;
}

// Uniform in (0, 1], never 0 (safe under log): 24 random bits.
NQ_DEVICE float u32_to_unit_open0(u32 v) { return ((v >> 8) + 1u) * (1.0f / 16777216.0f); }
