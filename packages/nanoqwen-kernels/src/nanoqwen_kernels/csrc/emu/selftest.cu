// emu/selftest.cu: small kernels for the emulator's own tests (tests/test_emu_cpu.py), each showing one
// thing the emulator models: a bulk copy that completes late, a wait that never ends (reported as an
// error, not a hang), warp shuffles, the tensor-core fragment layout, ldmatrix, cp.async (zero-fill,
// late completion) and named barriers. Not a model kernel; not in specs.py (the tests build it with
// `emu.library`).
#include "common.cuh"
#include "mbarrier.cuh"
#include "gemv_int4.cuh"
#include "attention.cuh"

// One thread copies src[0..3] into shared memory with a bulk copy; if `wait`, it waits on the
// mbarrier first; then it writes what shared memory holds to out[0..3].
extern "C" __global__ void selftest_bulk_copy(const uint4* src, unsigned* out, int wait) {
  NQ_DYNAMIC_SMEM(smem, 128);
  if (threadIdx.x != 0) return;
  __shared__ __align__(8) unsigned long long bar;
  mbar_init(&bar, 1);
  mbar_fence_init();
  mbar_arrive_expect_tx(&bar, 16);
  bulk_copy_g2s(mbar_smem_addr(smem), src, 16, &bar);
  if (wait) mbar_wait(&bar, 0);
  const uint4 v = *reinterpret_cast<const uint4*>(smem);
  out[0] = v.x;
  out[1] = v.y;
  out[2] = v.z;
  out[3] = v.w;
}

// Thread 0 of every CTA spins until *flag != 0, which nothing sets.
extern "C" __global__ void selftest_wait_forever(const int* flag) {
  if (threadIdx.x == 0) {
    while (*reinterpret_cast<const volatile int*>(flag) == 0) __nanosleep(100);
  }
  __syncthreads();
}

// out[lane] = the value of lane (lane ^ 5) (xor shuffle), out[32 + lane] = lane 31 - lane's (indexed).
extern "C" __global__ void selftest_shuffles(int* out) {
  const int lane = threadIdx.x & 31;
  out[lane] = __shfl_xor_sync(0xffffffffu, lane * 10, 5);
  out[32 + lane] = __shfl_sync(0xffffffffu, lane * 10, 31 - lane);
}

// One mma.m16n8k16 (bf16 in, f32 out) of A [16, 16] (row-major) by B [16, 8] (column-major as the
// fragments take it: B[k][n] at b[n * 16 + k]) plus C [16, 8] (row-major), each lane loading its own
// fragments as the PTX ISA lays them out; D [16, 8] row-major to d.
extern "C" __global__ void selftest_mma(const bf16_t* a, const bf16_t* b, const float* c, float* d) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  auto pair = [](bf16_t lo, bf16_t hi) { return (u32)lo | ((u32)hi << 16); };
  const u32 a0 = pair(a[g * 16 + 2 * t], a[g * 16 + 2 * t + 1]);
  const u32 a1 = pair(a[(g + 8) * 16 + 2 * t], a[(g + 8) * 16 + 2 * t + 1]);
  const u32 a2 = pair(a[g * 16 + 2 * t + 8], a[g * 16 + 2 * t + 9]);
  const u32 a3 = pair(a[(g + 8) * 16 + 2 * t + 8], a[(g + 8) * 16 + 2 * t + 9]);
  const u32 b0 = pair(b[g * 16 + 2 * t], b[g * 16 + 2 * t + 1]);
  const u32 b1 = pair(b[g * 16 + 2 * t + 8], b[g * 16 + 2 * t + 9]);
  float acc[4] = {c[g * 8 + 2 * t], c[g * 8 + 2 * t + 1], c[(g + 8) * 8 + 2 * t], c[(g + 8) * 8 + 2 * t + 1]};
  nq_gemv::mma_bf16(acc, a0, a1, a2, a3, b0, b1);
  d[g * 8 + 2 * t] = acc[0];
  d[g * 8 + 2 * t + 1] = acc[1];
  d[(g + 8) * 8 + 2 * t] = acc[2];
  d[(g + 8) * 8 + 2 * t + 1] = acc[3];
}

// Writes byte `at` of the dynamic shared memory (past the launch's size: the emulator reports it).
extern "C" __global__ void selftest_smem_write(int at) {
  NQ_DYNAMIC_SMEM(smem, 16);
  if (threadIdx.x == 0) smem[at] = 1;
}

// Lane 0 meets its warp in __syncwarp while the others shuffle: divergent collectives (reported).
extern "C" __global__ void selftest_divergent_collectives(int* out) {
  const int lane = threadIdx.x & 31;
  if (lane == 0) {
    __syncwarp();
    out[0] = 0;
  } else {
    out[lane] = __shfl_sync(0xffffffffu, lane, 1);
  }
}

// ldmatrix .x4 (.trans if `trans`) of four 8x8 bf16 matrices stacked as a [32, 8] matrix in shared
// memory (rows 8j..8j+7: matrix j), lane l addressing row l; out[l * 4 + j] = lane l's register j.
extern "C" __global__ void selftest_ldmatrix(const u32* src, u32* out, int trans) {
  NQ_DYNAMIC_SMEM(smem, 128);
  const int lane = threadIdx.x & 31;
  for (int i = lane; i < 128; i += 32) reinterpret_cast<u32*>(smem)[i] = src[i];
  __syncwarp();
  unsigned r[4];
  const unsigned addr = nq_attn::smem_addr(smem + lane * 16);
  if (trans) nq_attn::ldmatrix_x4_trans(r[0], r[1], r[2], r[3], addr);
  else nq_attn::ldmatrix_x4(r[0], r[1], r[2], r[3], addr);
  for (int j = 0; j < 4; ++j) out[lane * 4 + j] = r[j];
}

// Thread 0 copies 16 bytes from src into shared memory with one cp.async of `src_bytes` source bytes; if
// `wait`, it waits (cp.async.wait_all) before writing the 16 bytes shared memory holds to out[0..3]
// (then it waits anyway: a CTA may not end with a copy in flight).
extern "C" __global__ void selftest_cp_async(const uint4* src, unsigned* out, int src_bytes, int wait) {
  NQ_DYNAMIC_SMEM(smem, 128);
  if (threadIdx.x != 0) return;
  nq_attn::cp_async_16_zfill(nq_attn::smem_addr(smem), src, (unsigned)src_bytes);
  if (wait) nq_attn::cp_async_wait_all();
  const uint4 v = *reinterpret_cast<const uint4*>(smem);
  out[0] = v.x;
  out[1] = v.y;
  out[2] = v.z;
  out[3] = v.w;
  nq_attn::cp_async_wait_all();
}

// The attention's consumer barrier (bar.sync 1, 128) met by warps 1.. of the block while warp 0 exits:
// each thread t >= 32 writes t, meets the others, and reads what the thread 32 places ahead wrote.
// With 160 threads, warps 1-4 fill the barrier; with 128, it never fills (a deadlock, reported).
extern "C" __global__ void selftest_named_barrier(int* out) {
  NQ_DYNAMIC_SMEM(smem, 16);
  int* s = reinterpret_cast<int*>(smem);
  const int t = threadIdx.x;
  if (t < 32) return;  // the "producer" warp never reaches the barrier
  const int n = blockDim.x - 32;
  s[t - 32] = t;
  nq_attn::consumer_sync();
  out[t - 32] = s[(t - 32 + 32) % n];
}
