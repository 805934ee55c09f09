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

NQ_DEVICE u32 xor4(uint4 v) { return v.x ^ v.y ^ v.z ^ v.w; }

// grid (blocks), block 256. data: [n_vec] 16-byte vectors; sink: one u32, XOR-accumulated.
extern "C" __global__ void __launch_bounds__(256) read_xor_u32x4(const uint4* __restrict__ data, u64 n_vec,
                                                                u32* __restrict__ sink) {
  const u64 stride = (u64)gridDim.x * blockDim.x;
  u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
  u32 acc = 0;
  for (; i + 3 * stride < n_vec; i += 4 * stride) {
    const uint4 a = ld_stream_v4(data + i);
    const uint4 b = ld_stream_v4(data + i + stride);
    const uint4 c = ld_stream_v4(data + i + 2 * stride);
    const uint4 d = ld_stream_v4(data + i + 3 * stride);
    acc ^= xor4(a) ^ xor4(b) ^ xor4(c) ^ xor4(d);
  }
  for (; i < n_vec; i += stride) acc ^= xor4(ld_stream_v4(data + i));
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, o);
  if ((threadIdx.x & 31) == 0) asm volatile("red.global.xor.b32 [%0], %1;" ::"l"(sink), "r"(acc) : "memory");
}

NQ_DEVICE u64 globaltimer_ns() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// grid (1), block 1. Returns once `ns` nanoseconds of the global timer have passed (sleeping 1 us
// between reads, so the waiting thread takes no issue slots from anything else).
extern "C" __global__ void __launch_bounds__(32) spin_ns(u64 ns) {
  const u64 t0 = globaltimer_ns();
  while (globaltimer_ns() - t0 < ns) asm volatile("nanosleep.u32 1000;" ::: "memory");
}

// grid (blocks), block 128. Thread t of the grid issues bulk prefetches of chunks t, t + S, ... of
// [data, data + nbytes) (chunk and nbytes multiples of 16, data 16-byte aligned; the last chunk is
// cut at nbytes). evict_last != 0 attaches an L2 evict_last policy (createpolicy, fraction 1.0).
extern "C" __global__ void __launch_bounds__(128) l2_prefetch(const unsigned char* __restrict__ data, u64 nbytes,
                                                              u32 chunk, int evict_last) {
  u64 policy;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
  const u64 stride = (u64)gridDim.x * blockDim.x * chunk;
  for (u64 off = ((u64)blockIdx.x * blockDim.x + threadIdx.x) * chunk; off < nbytes; off += stride) {
    const u32 size = (u32)(nbytes - off < chunk ? nbytes - off : chunk);
    if (evict_last) {
      asm volatile("cp.async.bulk.prefetch.L2.global.L2::cache_hint [%0], %1, %2;" ::"l"(data + off), "r"(size),
                   "l"(policy) : "memory");
    } else {
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(data + off), "r"(size) : "memory");
    }
  }
}
