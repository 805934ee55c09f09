// emu/simt.h: the kernels' CUDA source compiled for the CPU, to test what they compute where there is
// no GPU (nanoqwen_kernels.testing.emu). Included before every kernel header (g++ -include) with
// NQ_HOST_EMU defined; the kernel headers then take the `#ifdef NQ_HOST_EMU` branch of each PTX wrapper, which
// calls the functions declared here.
//
// The model. Every CTA of a launch runs on its own OS thread, all of them at once (so a persistent
// kernel's CTAs are co-resident and may wait on each other, as on the GPU). The CTA's threads are
// fibers (ucontext) on that OS thread, switched only where a CUDA thread could be held up by others:
// warp-collective operations (shuffles, mma.sync, __syncwarp), __syncthreads, mbarrier waits,
// __nanosleep, and at random points (atomics, fences, acquire loads) so that the threads of a CTA
// interleave in many orders. A random quarter of the warps run at an eighth of the others' pace, and
// now and then a CTA's OS thread pauses (a slow SM): other warps and CTAs run ahead, counters fill in
// other orders than the natural one. `__shared__` is `thread_local` (one OS thread per CTA: per-CTA storage),
// global memory is the process's memory (CPU tensors), atomics are the host's.
//
// What is modelled and what is not:
// - mma.sync m16n8k16 (bf16, f16 in; f32 accumulate) gathers the 32 lanes' fragments and computes
//   D = A B + C in double, rounded once to f32 (the GPU's internal order and precision are not
//   specified; tests on the emulator compare with tolerances, or kernels against kernels).
// - Bulk copies (cp.async.bulk) complete LATE: the bytes land in shared memory and the mbarrier's
//   transaction count drops at a random later point (a wait on the barrier, or the scheduler), so a
//   kernel that reads a slot before waiting for it reads stale bytes and fails its test.
// - cp.async (16 bytes, `src_bytes` < 16 zero-filling the rest, 0 reading nothing) completes LATE too,
//   at random later scheduling points or when its thread waits (cp.async.wait_all); the mbarrier
//   arrival of cp.async.mbarrier.arrive.noinc comes once every cp.async its thread issued before it
//   has landed. A CTA that ends with a cp.async (or its arrival) still in flight is an error.
// - Named barriers (bar.sync id, n; id 1..15) release once n threads have arrived, whichever they are
//   (threads that never reach one, as a producer warp, are simply not counted); a barrier used with
//   two different counts in one phase is an error.
// - ldmatrix (.x4, .x4.trans) gathers the 16-byte rows the 32 lanes address and hands out the PTX ISA
//   fragments (lane l: row l / 4, elements 2 (l % 4) and +1 of each 8x8 matrix; .trans: the column).
//   Shared addresses of the dynamic shared memory (`__cvta_generic_to_shared` in the kernels'
//   smem_addr) are offsets in a window of their own, checked on every ldmatrix and cp.async.
// - Cross-CTA memory is the host's (x86: TSO, atomics sequentially consistent), stronger than the
//   GPU's model: the emulator finds work-split, indexing, ordering-by-counter and deadlock bugs, not
//   missing fences. L1 incoherence is not modelled (ld.cg is a plain load, a scheduling point).
// - Fast-math intrinsics (__expf, __sincosf, rsqrtf) are the host's precise functions, and the host
//   compiler does not contract a * b + c into an fma (-ffp-contract=off) where nvcc may: two kernels
//   bitwise equal here can differ on the GPU by how ptxas fused their multiply-adds.
// - A launch that makes no progress for `timeout_s` (a deadlock, CTAs spinning on a counter that never
//   fills, threads waiting on an mbarrier phase that never completes: a wait is a spin, not progress)
//   is reported as an error, not hung; so are lanes of a warp meeting in different
//   collectives, a write past the launch's dynamic shared memory, an argument whose size differs from
//   the kernel's parameter, and misused mbarriers / bulk copies. A spin loop with no scheduling point
//   at all (no load through a wrapper, no __nanosleep) cannot be interrupted.
// - TMA 2D tensor copies complete late as bulk copies do, reading the box when they are issued; their
//   tensor maps are the emulator's own encoding (emu.tensor_map_2d), not the driver's. wgmma computes
//   at issue, per warp (a warp's D rows need only its own A rows), in double rounded once to f32; only
//   the K-major 128-byte-swizzle B descriptor is modelled (any other is an error).
// - Not modelled: static `__shared__` variables start at zero (thread_local), not undefined; bulk
//   copies are accepted into dynamic shared memory only; every CTA of a grid runs at once (a grid that
//   could not be co-resident on the GPU still runs; the launchers check residency themselves).
#pragma once

#include <math.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#define __device__
#define __global__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ thread_local
#define __grid_constant__

struct EmuDim3 {
  unsigned x = 1, y = 1, z = 1;
};
struct uint2 {
  unsigned x, y;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
struct float2 {
  float x, y;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline float2 make_float2(float x, float y) { return {x, y}; }

namespace nq_emu {

struct Fiber;
extern thread_local Fiber* g_fiber;   // the running CUDA thread
extern thread_local EmuDim3 g_block_idx, g_grid_dim, g_block_dim;
const EmuDim3& thread_idx();

// scheduling points
void yield_maybe();                 // a random switch (atomics, fences, acquire loads)
void load_point();                  // a rarer one (loads of data other CTAs write: ld.cg)
void nanosleep_yield();             // __nanosleep: let the other threads of the CTA run
void syncwarp();                    // the warp's 32 lanes meet
void syncthreads();                 // the CTA's live threads meet
void warp_exchange(const void* mine, void* all, int bytes);  // all[lane] = each lane's `mine`, then meet

// mbarriers and bulk copies (the 32-bit "shared address" is a handle the CTA hands out)
unsigned smem_handle(const void* p);
void mbar_init(unsigned bar, unsigned count);
void mbar_arrive(unsigned bar, unsigned tx_bytes);
bool mbar_test_wait(unsigned bar, unsigned parity);  // completes due copies first
void mbar_wait(unsigned bar, unsigned parity);
void bulk_copy_g2s(unsigned dst, const void* src, unsigned bytes, unsigned bar);

// numbers
float bf16_bits_to_f32(unsigned short b);
unsigned short f32_to_bf16_rn(float f);
float f16_bits_to_f32(unsigned short h);
unsigned short f32_to_f16_rn(float f);
void mma_m16n8k16(float* c, const unsigned* a, const unsigned* b, bool f16);
int lane_id();  // the running thread's lane (its warp's fiber index, whatever the block's shape)

unsigned char* dynamic_smem();  // the CTA's dynamic shared memory (NQ_DYNAMIC_SMEM), poisoned with 0xA5

// cp.async, named barriers, ldmatrix (dynamic shared memory through window addresses)
unsigned smem_window_addr(const void* p);  // the shared address of a byte of the dynamic shared memory
void cp_async_16(unsigned dst, const void* src, unsigned src_bytes);  // zero-fills past src_bytes
void cp_async_arrive_noinc(unsigned bar);  // `bar`: an mbarrier handle (smem_handle)
void cp_async_wait_all();
void named_barrier(unsigned id, unsigned threads);  // bar.sync id, threads
void ldmatrix_x4(unsigned* r, unsigned addr, bool trans);
// A naturally aligned `bytes`-byte word of the dynamic shared memory at window address `addr` (ld.shared)
const void* smem_window_ptr(unsigned addr, unsigned bytes);

// TMA and the warpgroup MMA (the wgmma INT4 GEMM, gemm_int4_ws.cuh)
// A 2D tiled tensor copy (cp.async.bulk.tensor.2d): the box at (column c0, row c1) of `map` (the
// emulator's tensor map, nanoqwen_kernels.testing.emu.tensor_map_2d) into shared memory at window
// address dst, elements past the matrix read as zeros, the 128-byte swizzle applied by address (bits
// 4-6 ^= bits 7-9), completing LATE as `bytes` of transactions on mbarrier `bar`, as a bulk copy.
void tma_load_2d(unsigned dst, const void* map, int c0, int c1, unsigned bar);
// wgmma.mma_async m64nRk16, bf16 x bf16 -> f32, A in registers (the warp's 16 rows in the mma.m16n8k16
// fragment layout), B [16, R] in shared memory through a K-major descriptor with the 128-byte swizzle;
// d (R / 2 floats per thread) = A B (+ d when `accumulate`), computed at issue (fence / commit / wait
// are then no-ops: the emulator is more ordered than the GPU).
void wgmma_bf16(float* d, int R, const unsigned* a, unsigned long long desc, bool accumulate);

// The kernels of a build: each family's emulator unit registers its extern "C" entry points by name,
// with a trampoline that unpacks cuLaunchKernel-style argument pointers into the parameters.
struct Registration {
  const char* name;
  void* fn;
  void (*call)(void* fn, void** args);
  int nargs;
  const unsigned* arg_bytes;  // sizeof each parameter: the launcher's arguments are checked against it
};
void register_entries(const Registration* regs, int n);
template <class... A, std::size_t... I>
void call_with(void (*f)(A...), void** args, std::index_sequence<I...>) {
  f(*static_cast<std::remove_cv_t<std::remove_reference_t<A>>*>(args[I])...);
}
template <class... A>
void call_entry(void* fn, void** args) {
  call_with(reinterpret_cast<void (*)(A...)>(fn), args, std::index_sequence_for<A...>{});
}
template <class... A>
struct ArgBytes {
  static constexpr unsigned value[sizeof...(A) + 1] = {(unsigned)sizeof(A)..., 0u};
};
template <class... A>
Registration entry(const char* name, void (*f)(A...)) {
  return {name, reinterpret_cast<void*>(f), &call_entry<A...>, (int)sizeof...(A), ArgBytes<A...>::value};
}
struct Registrar {
  Registrar(const Registration* regs, int n) { register_entries(regs, n); }
};

}  // namespace nq_emu

#define threadIdx (::nq_emu::thread_idx())
#define blockIdx (::nq_emu::g_block_idx)
#define gridDim (::nq_emu::g_grid_dim)
#define blockDim (::nq_emu::g_block_dim)

inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }

inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline unsigned __float_as_uint(float f) {
  unsigned u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float __int_as_float(int i) { return __uint_as_float((unsigned)i); }
inline int __float_as_int(float f) { return (int)__float_as_uint(f); }
inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((unsigned long long)a * b) >> 32); }
inline float __fmul_rn(float a, float b) { return a * b; }  // compiled with -ffp-contract=off
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __expf(float x) { return std::exp(x); }
inline void __sincosf(float x, float* s, float* c) {
  *s = std::sin(x);
  *c = std::cos(x);
}
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
// PTX prmt (default mode): byte i of the result is byte (s >> 4i) & 7 of {y, x} (x = bytes 0..3)
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  const unsigned long long v = ((unsigned long long)y << 32) | x;
  unsigned r = 0;
  for (int i = 0; i < 4; ++i) r |= (unsigned)((v >> (8 * ((s >> (4 * i)) & 7))) & 0xff) << (8 * i);
  return r;
}

inline void __syncthreads() { nq_emu::syncthreads(); }
inline void __syncwarp(unsigned = 0xffffffffu) { nq_emu::syncwarp(); }
inline void __threadfence() {
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  nq_emu::yield_maybe();
}
inline void __nanosleep(unsigned) { nq_emu::nanosleep_yield(); }

template <class T>
inline T __shfl_sync(unsigned, T v, int src) {
  T all[32];
  nq_emu::warp_exchange(&v, all, sizeof(T));
  return all[src & 31];
}
template <class T>
inline T __shfl_up_sync(unsigned, T v, unsigned delta) {
  T all[32];
  nq_emu::warp_exchange(&v, all, sizeof(T));
  const int lane = nq_emu::lane_id();
  return lane >= (int)delta ? all[lane - delta] : v;
}
template <class T>
inline T __shfl_down_sync(unsigned, T v, unsigned delta) {
  T all[32];
  nq_emu::warp_exchange(&v, all, sizeof(T));
  const int lane = nq_emu::lane_id();
  return lane + (int)delta < 32 ? all[lane + delta] : v;
}
inline unsigned __ballot_sync(unsigned, int pred) {
  int all[32];
  const int mine = pred != 0;
  nq_emu::warp_exchange(&mine, all, sizeof mine);
  unsigned bits = 0;
  for (int i = 0; i < 32; ++i) bits |= (unsigned)all[i] << i;
  return bits;
}
inline int __ffs(int x) { return x == 0 ? 0 : __builtin_ctz((unsigned)x) + 1; }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }
// ex2.approx.ftz.f32: 2^x with subnormal inputs and results flushed to (signed) zero; the host's exact
// exp2f stands for the SFU's approximation (relative error ~2^-22)
namespace nq_emu {
inline float ex2_approx_ftz(float x) {
  if (std::fpclassify(x) == FP_SUBNORMAL) x = 0.f;
  const float y = std::exp2(x);
  return std::fpclassify(y) == FP_SUBNORMAL ? 0.f : y;
}
}  // namespace nq_emu
template <class T>
inline T __shfl_xor_sync(unsigned, T v, int mask) {
  T all[32];
  nq_emu::warp_exchange(&v, all, sizeof(T));
  return all[nq_emu::lane_id() ^ (mask & 31)];
}

inline int atomicAdd(int* p, int v) {
  nq_emu::yield_maybe();
  return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}
inline unsigned atomicAdd(unsigned* p, unsigned v) {
  nq_emu::yield_maybe();
  return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}
inline float atomicAdd(float* p, float v) {
  nq_emu::yield_maybe();
  unsigned* u = reinterpret_cast<unsigned*>(p);
  unsigned old = __atomic_load_n(u, __ATOMIC_SEQ_CST);
  while (!__atomic_compare_exchange_n(u, &old, __float_as_uint(__uint_as_float(old) + v), false, __ATOMIC_SEQ_CST,
                                      __ATOMIC_SEQ_CST)) {
  }
  return __uint_as_float(old);
}
