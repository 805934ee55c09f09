// wgmma.cuh: the Hopper warpgroup MMA (PTX `wgmma.mma_async`, sm_90a) as used by the INT4 GEMM:
// D[64, R] (fp32, registers) += A[64, 16] (bf16, registers) x B[16, R] (bf16, shared memory), for
// R = 16, 32, 64, 128; plus the fence / commit / wait that order it.
//
// Registers. A warpgroup is 4 consecutive warps (warp % 4 = its quarter). Warp q holds rows 16q..16q+15
// of A and of D in exactly the fragment layout of mma.m16n8k16 (lane = 4g + t):
//   A: a[0] = (row g, k 2t..2t+1), a[1] = (row g + 8, k 2t..), a[2] = (row g, k 2t+8..), a[3] = (row
//      g + 8, k 2t+8..);
//   D: for each 8-column block i of R: d[4i + 0, 1] = (row g, columns 8i + 2t, +1), d[4i + 2, 3] =
//      (row g + 8, the same columns).
// So a warp's dequantised INT4 tile pair (gemv_int4.cuh) is its A operand unchanged.
//
// B in shared memory, "K-major" (each of the R columns of B is 16 contiguous k values), named by a
// descriptor (PTX ISA, "Matrix Descriptor Format"; sw128_desc below for the 128-byte swizzle): the
// start address, the leading and stride byte offsets (LBO, SBO), each >> 4, and the swizzle mode (bits
// 62-63: 0 none, 1 128-byte). Without swizzle: core matrices of 8 columns (rows of x) x 8 k, 128 contiguous bytes; LBO steps
// to the next 8 k, SBO to the next 8 columns. With the 128-byte swizzle (gemm_int4_ws.cuh, as a TMA
// box writes it): each column's 64 k values are one 128-byte row, 16-byte chunk c at c ^ (row % 8),
// 8-row atoms 1024 bytes apart (SBO 1024, LBO unused); a k16 step starts 32 bytes further.
//
// Ordering (PTX ISA, wgmma): wgmma_fence() before the first wgmma that reads registers written since
// the last one; wgmma_commit() closes a group of issued wgmmas; wgmma_wait<N>() returns when at most N
// groups are pending, after which D may be read -- through fence_operand(), which keeps the compiler
// from moving those reads above the wait. Shared memory written by ordinary stores or cp.async must be
// made visible to the wgmma's (async-proxy) reads with fence_proxy_async() before the barrier that
// publishes it.
#pragma once
#include "common.cuh"

namespace nq_wgmma {

// The descriptor of a K-major B with the 128-byte swizzle (header: SBO 1024, LBO 1), as two parts so a
// loop adds byte offsets to one base: sw128_desc_lo(addr) once, then sw128_desc(lo, offset), offset a
// multiple of 16 (a k16 step: 32). Shared addresses stay below 2^18, so the start field never carries.
NQ_DEVICE u32 sw128_desc_lo(u32 addr) { return ((addr >> 4) & 0x3FFFu) | (1u << 16); }
NQ_DEVICE u64 sw128_desc(u32 lo, u32 offset) {
  constexpr u32 hi = (1024 >> 4) | (1u << 30);
  return ((u64)hi << 32) | (lo + (offset >> 4));
}

#ifdef NQ_HOST_EMU
// The emulator computes each wgmma when it is issued (emu/simt.h): the ordering calls have nothing to do.
NQ_DEVICE void wgmma_fence() {}
NQ_DEVICE void wgmma_commit() {}
template <int N>
NQ_DEVICE void wgmma_wait() {}
NQ_DEVICE void fence_operand(float&) {}
NQ_DEVICE void fence_proxy_async() {}
template <int R>
struct Wgmma {
  static NQ_DEVICE void mma(float (&d)[R / 2], const u32 (&a)[4], u64 desc, int accumulate) {
    nq_emu::wgmma_bf16(d, R, a, desc, accumulate != 0);
  }
};
#else
NQ_DEVICE void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
NQ_DEVICE void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
NQ_DEVICE void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
NQ_DEVICE void fence_operand(float& r) { asm volatile("" : "+f"(r)::"memory"); }
NQ_DEVICE void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// m64 nR k16, bf16 x bf16 -> fp32; accumulate = 0 overwrites d (D = A B), else D += A B.
template <int R>
struct Wgmma;
template <>
struct Wgmma<16> {
  static NQ_DEVICE void mma(float (&d)[8], const u32 (&a)[4], u64 desc, int accumulate) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, %13, 0; "
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7 "
        "}, {%8, %9, %10, %11}, %12, p, 1, 1, 0; }"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
          "+f"(d[6]), "+f"(d[7])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(accumulate));
  }
};
template <>
struct Wgmma<32> {
  static NQ_DEVICE void mma(float (&d)[16], const u32 (&a)[4], u64 desc, int accumulate) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, %21, 0; "
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15 "
        "}, {%16, %17, %18, %19}, %20, p, 1, 1, 0; }"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
          "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
          "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(accumulate));
  }
};
template <>
struct Wgmma<64> {
  static NQ_DEVICE void mma(float (&d)[32], const u32 (&a)[4], u64 desc, int accumulate) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, %37, 0; "
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31 "
        "}, {%32, %33, %34, %35}, %36, p, 1, 1, 0; }"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
          "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
          "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
          "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
          "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(accumulate));
  }
};

template <>
struct Wgmma<128> {
  static NQ_DEVICE void mma(float (&d)[64], const u32 (&a)[4], u64 desc, int accumulate) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, %69, 0; "
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63 "
        "}, {%64, %65, %66, %67}, %68, p, 1, 1, 0; }"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
          "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
          "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
          "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
          "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),
          "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]),
          "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]),
          "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]),
          "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(accumulate));
  }
};

#endif  // NQ_HOST_EMU

}  // namespace nq_wgmma
