// bench.cu: kernels the benchmarks measure with, not kernels of the model (launched by nanoqwen-bench's
// nanoqwen_bench/gpu.py; built here, as op family "bench", because kernels compile from this folder).
//
//   read_xor_u32x4   reads a buffer once and nothing else: the read-only bandwidth ceiling that every
//                    decode roofline is measured against (a decode step reads weights and KV and
//                    writes almost nothing, so a device-to-device copy, half reads and half writes,
//                    is the wrong ceiling: cuBLAS's bf16 lm_head GEMV reads at 107% of it).
//   l2_prefetch      asks the L2 to fetch a byte range (cp.async.bulk.prefetch.L2, one bulk request per
//                    `chunk` bytes; optionally with an evict_last cache policy) and returns without
//                    waiting for it: the measurement behind a weight prefetch that runs ahead of the
//                    GEMVs (nanoqwen_bench.gpu.l2_prefetch launches it).
//   step_phases_u32x4  the ceiling of a persistent decode kernel: one grid, resident on every SM, reads
//                    a decode step's phases (one per op: qkv, attention's KV, o, gate_up, down, ...,
//                    lm_head) one after another, with a grid barrier between phases as each op waits for
//                    the whole previous one; optionally with each CTA asking the L2 for the head of its
//                    share of the next phase before it waits at the barrier (weights depend on no
//                    activation, so a persistent kernel can fetch them early). Measured against
//                    read_xor's bandwidth and against one launch per phase (nanoqwen_bench.kernels.
//                    persistent_ceiling).
//   step_phases_dataflow_u32x4  the same step's phases read by a producer / consumer pipeline that waits
//                    for no whole op: each CTA's bulk-copy ring runs ahead across phase ends, and its
//                    consumers wait only for the slices of the previous phase that each part of theirs
//                    depends on (arrival counters per group of CTAs), as a persistent decode kernel whose
//                    ops start on the input slices that are ready would.
//   spin_ns          one thread waits `ns` nanoseconds of %globaltimer: it holds a stream busy while
//                    the host queues work behind it, so that queued kernels then run back to back
//                    at the GPU's pace (the engine benchmark's per-op timing of eager steps).
//
// read_xor_u32x4: data is `n_vec` 16-byte vectors (16-byte aligned); launch with a grid that fills
// the chip (nanoqwen-bench's gpu.py: 8 blocks of 256 threads per SM, 2048 threads, the SM's limit).
// Thread t of the grid reads vectors t, t + S, t + 2S, ... (S = grid threads), four independent
// 16-byte loads per loop trip before any is used: 2048 threads x 64 bytes = 128 KB in flight per SM,
// several times the ~30 KB that Little's law asks for (HBM3e latency ~0.7 us x ~36 GB/s per SM).
// Consecutive threads read consecutive vectors (every warp load is 512 contiguous bytes), with the
// non-coherent, no-L1-allocate load the weight streams use. All words are XOR-folded into a value that
// each warp publishes with one `red.global.xor` into *sink: the loads feed a store, so the compiler
// cannot drop them, and the result is the XOR of every 32-bit word of the buffer (tests check it
// against numpy). Bytes read: 16 * n_vec; bytes written: 4 per warp (nothing, at several GiB).

#include "common.cuh"
#include "mbarrier.cuh"

#ifdef NQ_HOST_EMU
#include <chrono>
#endif

NQ_DEVICE u32 xor4(uint4 v) { return v.x ^ v.y ^ v.z ^ v.w; }

NQ_DEVICE void red_xor_u32(u32* p, u32 v) {
#ifdef NQ_HOST_EMU
  __atomic_fetch_xor(p, v, __ATOMIC_SEQ_CST);
#else
  asm volatile("red.global.xor.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
#endif
}

// Asks the L2 to fetch [p, p + bytes) (p 16-byte aligned, bytes a multiple of 16) and does not wait.
NQ_DEVICE void prefetch_l2(const void* p, u32 bytes) {
#ifndef NQ_HOST_EMU
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
#endif
}

// The XOR of the words of vectors i, i + stride, i + 2 stride, ... below `end`: four independent
// 16-byte loads per loop trip before any is used.
NQ_DEVICE u32 xor_strided(const uint4* __restrict__ data, u64 i, u64 end, u64 stride) {
  u32 acc = 0;
  for (; i + 3 * stride < end; i += 4 * stride) {
    const uint4 a = ld_stream_v4(data + i);
    const uint4 b = ld_stream_v4(data + i + stride);
    const uint4 c = ld_stream_v4(data + i + 2 * stride);
    const uint4 d = ld_stream_v4(data + i + 3 * stride);
    acc ^= xor4(a) ^ xor4(b) ^ xor4(c) ^ xor4(d);
  }
  for (; i < end; i += stride) acc ^= xor4(ld_stream_v4(data + i));
  return acc;
}

// *sink ^= the XOR of `acc` over the warp (one red per warp; every lane of the warp calls it).
NQ_DEVICE void publish_xor(u32* sink, u32 acc) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, o);
  if ((threadIdx.x & 31) == 0) red_xor_u32(sink, acc);
}

// grid (blocks), block 256. data: [n_vec] 16-byte vectors; sink: one u32, XOR-accumulated.
extern "C" __global__ void __launch_bounds__(256) read_xor_u32x4(const uint4* __restrict__ data, u64 n_vec,
                                                                u32* __restrict__ sink) {
  const u64 stride = (u64)gridDim.x * blockDim.x;
  const u32 acc = xor_strided(data, (u64)blockIdx.x * blockDim.x + threadIdx.x, n_vec, stride);
  publish_xor(sink, acc);
}

NQ_DEVICE u64 globaltimer_ns() {
#ifdef NQ_HOST_EMU
  return (u64)std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch()).count();
#else
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
#endif
}

// grid (1), block 1. Returns once `ns` nanoseconds of the global timer have passed (sleeping 1 us
// between reads, so the waiting thread takes no issue slots from anything else).
extern "C" __global__ void __launch_bounds__(32) spin_ns(u64 ns) {
  const u64 t0 = globaltimer_ns();
  while (globaltimer_ns() - t0 < ns) __nanosleep(1000);
}

// grid (blocks), block 128. Thread t of the grid issues bulk prefetches of chunks t, t + S, ... of
// [data, data + nbytes) (chunk and nbytes multiples of 16, data 16-byte aligned; the last chunk is
// cut at nbytes). evict_last != 0 attaches an L2 evict_last policy (createpolicy, fraction 1.0).
extern "C" __global__ void __launch_bounds__(128) l2_prefetch(const unsigned char* __restrict__ data, u64 nbytes,
                                                              u32 chunk, int evict_last) {
#ifndef NQ_HOST_EMU
  u64 policy;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
#endif
  const u64 stride = (u64)gridDim.x * blockDim.x * chunk;
  for (u64 off = ((u64)blockIdx.x * blockDim.x + threadIdx.x) * chunk; off < nbytes; off += stride) {
    const u32 size = (u32)(nbytes - off < chunk ? nbytes - off : chunk);
#ifdef NQ_HOST_EMU
    (void)size, (void)evict_last;
#else
    if (evict_last) {
      asm volatile("cp.async.bulk.prefetch.L2.global.L2::cache_hint [%0], %1, %2;" ::"l"(data + off), "r"(size),
                   "l"(policy) : "memory");
    } else {
      prefetch_l2(data + off, size);
    }
#endif
  }
}

// ---------------------------------------------------------------------------------------------------
// step_phases_u32x4: the persistent decode kernel's streaming ceiling.
//
// Phase p is the 16-byte vectors [bounds[p], bounds[p + 1]) of `data`. CTA b of the G CTAs reads the
// contiguous slice b of each phase (ceil(n / G) vectors: a GEMV's CTA owns contiguous columns), four
// independent 16-byte loads per thread per loop trip before any is used, as read_xor does, and
// XOR-folds them into *sink. After every phase but the last:
//   mode 0  nothing: the phases back to back (the ceiling of this partition without waits);
//   mode 1  a grid barrier: each op waits for all of the previous one, as a persistent decode kernel's
//           ops do (each needs the whole activation vector the previous op wrote);
//   mode 2  the same barrier, but before arriving each CTA asks the L2 for the first `prefetch_vec`
//           vectors of its slice of the next phase (cp.async.bulk.prefetch.L2 in 4 KB requests): the
//           next op's weights depend on nothing, so their fetch can cover the barrier's wait;
//   mode 3  (entry step_phases_preload_u32x4 only) the same barrier, but before arriving each thread
//           loads its first PRELOAD vectors of the next phase into registers (as a persistent kernel's
//           producer fills its shared-memory ring ahead of the op): their DRAM latency runs during the
//           wait. The registers held across the barrier take occupancy: a kernel of its own, so that
//           modes 0-2 keep 32 registers and 4 CTAs per SM.
// Every CTA must be resident (G <= SMs x blocks per SM): the barrier waits for all of them.
// bar: 2 u32, zero before the first launch (arrivals, generation); the barrier leaves the arrivals at
// 0, so launches can follow each other. check: null, or G u32 zeroed before this launch: CTA b stores
// p + 1 before barrier p, and after it counts into check_errors[0] every CTA still below p + 1 (a
// barrier that let a CTA through early).
// ---------------------------------------------------------------------------------------------------

NQ_DEVICE u32 ld_acquire_gpu_u32(const u32* p) {
#ifdef NQ_HOST_EMU
  nq_emu::load_point();
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
#else
  u32 v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
#endif
}

NQ_DEVICE void st_release_gpu_u32(u32* p, u32 v) {
#ifdef NQ_HOST_EMU
  __atomic_store_n(p, v, __ATOMIC_RELEASE);
#else
  asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
#endif
}

NQ_DEVICE u32 atom_add_acq_rel_gpu_u32(u32* p, u32 v) {
#ifdef NQ_HOST_EMU
  return __atomic_fetch_add(p, v, __ATOMIC_ACQ_REL);
#else
  u32 old;
  asm volatile("atom.add.acq_rel.gpu.global.u32 %0, [%1], %2;" : "=r"(old) : "l"(p), "r"(v) : "memory");
  return old;
#endif
}

// All CTAs of the grid meet: bar[0] counts arrivals, bar[1] is the generation the last arrival bumps.
NQ_DEVICE void grid_barrier(u32* bar, u32 nblocks) {
  __syncthreads();
  if (threadIdx.x == 0) {
    const u32 gen = ld_acquire_gpu_u32(bar + 1);
    __threadfence();
    if (atom_add_acq_rel_gpu_u32(bar, 1u) == nblocks - 1) {
      atom_add_acq_rel_gpu_u32(bar, 0u - nblocks);  // arrivals back to 0 before the generation moves
      st_release_gpu_u32(bar + 1, gen + 1);
    } else {
      while (ld_acquire_gpu_u32(bar + 1) == gen) __nanosleep(32);
    }
  }
  __syncthreads();
}

NQ_DEVICE u64 min_u64(u64 a, u64 b) { return a < b ? a : b; }

// The [begin, end) slice of CTA b out of G over n vectors starting at `base`.
NQ_DEVICE void phase_slice(u64 base, u64 n, u32 b, u32 G, u64& begin, u64& end) {
  const u64 per = (n + G - 1) / G;
  begin = base + min_u64((u64)b * per, n);
  end = base + min_u64((u64)(b + 1) * per, n);
}

// grid (G persistent CTAs), block 512. data: 16-byte vectors; bounds: [n_phases + 1] vector offsets,
// ascending; sink: one u32, XOR-accumulated; bar: [2] u32; check / check_errors: null or as above.
// PRELOAD: vectors per thread loaded before each barrier (mode 3), 0 for modes 0-2.
template <int PRELOAD>
NQ_DEVICE void step_phases(const uint4* __restrict__ data, const u64* __restrict__ bounds, int n_phases, int mode,
                           u64 prefetch_vec, u32* sink, u32* bar, u32* check, u32* check_errors) {
  const u32 G = gridDim.x, b = blockIdx.x, T = blockDim.x;
  u32 acc = 0;
  uint4 pre[PRELOAD > 0 ? PRELOAD : 1];  // mode 3: this thread's first vectors of the phase
  int npre = 0;
  for (int p = 0; p < n_phases; ++p) {
    u64 begin, end;
    phase_slice(bounds[p], bounds[p + 1] - bounds[p], b, G, begin, end);
#pragma unroll
    for (int k = 0; k < PRELOAD; ++k)
      if (k < npre) acc ^= xor4(pre[k]);
    acc ^= xor_strided(data, begin + threadIdx.x + (u64)npre * T, end, T);
    npre = 0;
    if (mode == 0 || p + 1 == n_phases) continue;
    u64 nb, ne;  // this CTA's slice of the next phase
    phase_slice(bounds[p + 1], bounds[p + 2] - bounds[p + 1], b, G, nb, ne);
    if (PRELOAD > 0 && mode == 3) {
#pragma unroll
      for (int k = 0; k < PRELOAD; ++k) {
        const u64 i = nb + threadIdx.x + (u64)k * T;
        if (i < ne) pre[k] = ld_stream_v4(data + i);
      }
      // a thread's preloaded vectors are nb + t, nb + t + T, ...: a prefix of its strided walk
      const u64 mine = ne > nb + threadIdx.x ? (ne - nb - threadIdx.x + T - 1) / T : 0;
      npre = (int)min_u64(mine, PRELOAD);
    }
    if (mode == 2) {
      const u64 pe = min_u64(ne, nb + prefetch_vec);
      constexpr u64 CHUNK_VEC = 256;  // 4 KB per prefetch request
      for (u64 c = nb + (u64)threadIdx.x * CHUNK_VEC; c < pe; c += (u64)T * CHUNK_VEC)
        prefetch_l2(data + c, (u32)(min_u64(CHUNK_VEC, pe - c) * 16));
    }
    if (check != nullptr && threadIdx.x == 0) st_release_gpu_u32(check + b, (u32)p + 1);
    grid_barrier(bar, G);
    if (check != nullptr && threadIdx.x == 0) {
      u32 early = 0;
      for (u32 c = 0; c < G; ++c) early += ld_acquire_gpu_u32(check + c) < (u32)p + 1;
      if (early) atomicAdd(check_errors, early);
    }
  }
  publish_xor(sink, acc);
}

extern "C" __global__ void __launch_bounds__(512) step_phases_u32x4(const uint4* __restrict__ data,
                                                                   const u64* __restrict__ bounds, int n_phases,
                                                                   int mode, u64 prefetch_vec, u32* sink,
                                                                   u32* bar, u32* check, u32* check_errors) {
  step_phases<0>(data, bounds, n_phases, mode, prefetch_vec, sink, bar, check, check_errors);
}

extern "C" __global__ void __launch_bounds__(512) step_phases_preload_u32x4(
    const uint4* __restrict__ data, const u64* __restrict__ bounds, int n_phases, int mode, u64 prefetch_vec,
    u32* sink, u32* bar, u32* check, u32* check_errors) {
  step_phases<4>(data, bounds, n_phases, mode, prefetch_vec, sink, bar, check, check_errors);
}

// ---------------------------------------------------------------------------------------------------
// step_phases_dataflow_u32x4: the ceiling of a decode kernel that waits for no whole op.
//
// The phases and each CTA's contiguous slice of a phase are step_phases_u32x4's. Warp 0 is a producer:
// its lane 0 walks the CTA's slices phase after phase and copies them, in pieces of up to DF_SLOT_VEC
// vectors, into a ring of `slots` shared-memory slots with bulk copies (cp.async.bulk) that complete on
// the slot's `full` mbarrier; it waits only for a free slot, never for another CTA, so the next op's
// weights stream in while this op still waits or works. The other 15 warps consume: they XOR each
// slot's words into the sink and free the slot.
//
// Dependencies. The CTAs form `groups` groups (CTA c is in group c * groups / G): a phase's group g is
// the slice of the next op's input that those CTAs write (a GEMV CTA owns contiguous output rows, and
// the next GEMV's K walks them in order). Each CTA's slice of a phase is cut into `groups` parts, part g
// being the weights that multiply input slice g; the consumers take the parts in the order g0, g0 + 1,
// ... (g0: the CTA's own group, whose input it has just written) and, in phase p > 0, wait before part
// g until counters[(p - 1) * groups + g] holds the group's size: every CTA of group g has finished
// phase p - 1. After its last part of phase p a CTA adds 1 to counters[p * groups + its group]. Every
// part is waited for, empty or not (every CTA of a GEMV needs all of its input). groups = 1: each op
// waits for the whole previous op, as at a grid barrier, but the ring still runs ahead across it.
// counters: [n_phases * groups] u32, zero before the launch. progress / check_errors: null, or [G] u32
// zeroed and one u32: a CTA stores p + 1 into progress[b] before it counts phase p, and after each wait
// the waiting CTA counts into check_errors every CTA of the group still below p (a wait that let it
// through early). Every CTA must be resident at once. Dynamic shared memory: slots * DF_SLOT_VEC * 16.
// ---------------------------------------------------------------------------------------------------

constexpr int DF_THREADS = 512;
constexpr int DF_CONSUMER_WARPS = DF_THREADS / 32 - 1;
constexpr int DF_MAX_SLOTS = 12;
constexpr u32 DF_SLOT_VEC = 1024;  // 16 KB per slot
constexpr int DF_CONSUMER_BARRIER = 1;

NQ_DEVICE void df_consumer_sync() {
#ifdef NQ_HOST_EMU
  nq_emu::named_barrier(DF_CONSUMER_BARRIER, 32 * DF_CONSUMER_WARPS);
#else
  asm volatile("bar.sync %0, %1;" ::"n"(DF_CONSUMER_BARRIER), "n"(32 * DF_CONSUMER_WARPS) : "memory");
#endif
}

// CTAs of group g out of `groups` over G CTAs: those c with c * groups / G == g.
NQ_DEVICE u32 df_group_begin(u32 g, u32 groups, u32 G) { return (u32)(((u64)g * G + groups - 1) / groups); }

// Calls part(p, g) at the start of every part and piece(v, n) for each of its pieces (n vectors from
// vector v), in the order both roles walk: phases in order, parts from the CTA's own group on.
template <typename Part, typename Piece>
NQ_DEVICE void df_walk(const u64* __restrict__ bounds, int n_phases, u32 groups, Part part, Piece piece) {
  const u32 G = gridDim.x, b = blockIdx.x, g0 = (u32)((u64)b * groups / G);
  for (int p = 0; p < n_phases; ++p) {
    u64 begin, end;
    phase_slice(bounds[p], bounds[p + 1] - bounds[p], b, G, begin, end);
    const u64 per = (end - begin + groups - 1) / groups;
    for (u32 i = 0; i < groups; ++i) {
      const u32 g = (g0 + i) % groups;
      part(p, g);
      const u64 pb = min_u64(begin + (u64)g * per, end), pe = min_u64(pb + per, end);
      for (u64 v = pb; v < pe; v += DF_SLOT_VEC) piece(v, (u32)min_u64(DF_SLOT_VEC, pe - v));
    }
  }
}

extern "C" __global__ void __launch_bounds__(DF_THREADS, 1) step_phases_dataflow_u32x4(
    const uint4* __restrict__ data, const u64* __restrict__ bounds, int n_phases, u32 groups, int slots,
    u32* counters, u32* sink, u32* progress, u32* check_errors) {
  NQ_DYNAMIC_SMEM(ring_bytes, 128);
  uint4* ring = reinterpret_cast<uint4*>(ring_bytes);
  __shared__ __align__(8) unsigned long long full[DF_MAX_SLOTS], empty[DF_MAX_SLOTS];
  const u32 G = gridDim.x, b = blockIdx.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    for (int s = 0; s < slots; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], DF_CONSUMER_WARPS);
    }
    mbar_fence_init();
  }
  __syncthreads();  // roles split below
  if (warp == 0) {
    if (lane != 0) return;
    u64 it = 0;
    df_walk(bounds, n_phases, groups, [](int, u32) {}, [&](u64 v, u32 n) {
      const int slot = (int)(it % slots);
      if (it >= (u64)slots) mbar_wait(&empty[slot], (u32)((it / slots - 1) & 1));
      mbar_arrive_expect_tx(&full[slot], n * 16);
      bulk_copy_g2s(mbar_smem_addr(ring + (u64)slot * DF_SLOT_VEC), data + v, n * 16, &full[slot]);
      ++it;
    });
    return;
  }
  const u32 ctid = threadIdx.x - 32;
  const u32 g_mine = (u32)((u64)b * groups / G);
  u64 it = 0;
  u32 acc = 0;
  int phase_done = -1;
  df_walk(bounds, n_phases, groups,
          [&](int p, u32 g) {
            if (p != phase_done + 1) {  // the first part of phase p: phase p - 1 is finished here
              df_consumer_sync();
              if (ctid == 0) {
                if (progress != nullptr) st_release_gpu_u32(progress + b, (u32)p);
                __threadfence();
                atom_add_acq_rel_gpu_u32(counters + (u64)(p - 1) * groups + g_mine, 1u);
              }
              phase_done = p - 1;
            }
            if (p == 0) return;
            const u32 c0 = df_group_begin(g, groups, G), c1 = df_group_begin(g + 1, groups, G);
            if (ctid == 0) {
              const u32* counter = counters + (u64)(p - 1) * groups + g;
              while (ld_acquire_gpu_u32(counter) < c1 - c0) __nanosleep(32);
              if (progress != nullptr) {
                u32 early = 0;
                for (u32 c = c0; c < c1; ++c) early += ld_acquire_gpu_u32(progress + c) < (u32)p;
                if (early) atomicAdd(check_errors, early);
              }
            }
            df_consumer_sync();
          },
          [&](u64, u32 n) {
            const int slot = (int)(it % slots);
            mbar_wait(&full[slot], (u32)((it / slots) & 1));
            const uint4* s = ring + (u64)slot * DF_SLOT_VEC;
            for (u32 v = ctid; v < n; v += 32 * DF_CONSUMER_WARPS) acc ^= xor4(s[v]);
            __syncwarp();
            if (lane == 0) {
              fence_proxy_async_shared();  // the slot's reads before the producer's next copy into it
              mbar_arrive(&empty[slot]);
            }
            ++it;
          });
  df_consumer_sync();  // the last phase: counted too, so that the counters end at the group sizes
  if (ctid == 0 && n_phases > 0) {
    if (progress != nullptr) st_release_gpu_u32(progress + b, (u32)n_phases);
    __threadfence();
    atom_add_acq_rel_gpu_u32(counters + (u64)(n_phases - 1) * groups + g_mine, 1u);
  }
  publish_xor(sink, acc);
}
