// emu/simt.h: the kernels' CUDA source compiled for the CPU, to test what they compute where there is
// no GPU (nanoqwen_kernels.emu). Included before every kernel header (g++ -include) with NQ_HOST_EMU
// defined; the kernel headers then take the `#ifdef NQ_HOST_EMU` branch of each PTX wrapper, which
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
// - Cross-CTA memory is the host's (x86: TSO, atomics sequentially consistent), stronger than the
//   GPU's model: the emulator finds work-split, indexing, ordering-by-counter and deadlock bugs, not
//   missing fences. L1 incoherence is not modelled (ld.cg is a plain load, a scheduling point).
// - Fast-math intrinsics (__expf, __sincosf, rsqrtf) are the host's precise functions, and the host
//   compiler does not contract a * b + c into an fma (-ffp-contract=off) where nvcc may: two kernels
//   bitwise equal here can differ on the GPU by how ptxas fused their multiply-adds.
// - A launch that makes no progress for `timeout_s` (a deadlock, or CTAs spinning on a counter that
//   never fills) is reported as an error, not hung; so are lanes of a warp meeting in different
//   collectives, a write past the launch's dynamic shared memory, an argument whose size differs from
//   the kernel's parameter, and misused mbarriers / bulk copies. A spin loop with no scheduling point
//   at all (no load through a wrapper, no __nanosleep) cannot be interrupted.
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
