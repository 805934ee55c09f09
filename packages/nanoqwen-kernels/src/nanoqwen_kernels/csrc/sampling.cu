// sampling.cu: extern "C" entry of GPU sampling (algorithm in sampling.cuh).
//
//   sample_tokens_bf16  grid (B, C <= MAX_CHUNKS), 1024 threads. logits: bf16 [B, V] (row stride ld; V
//                       and ld multiples of 8, rows 16-byte aligned); per row:
//                       temperature f32, top_k i32, top_p f32, seed i64, offset i64 (incremented);
//                       out: int32 [B]; partials: u64 [B, C] (chunk maxima, C > 1);
//                       counters: int32 [B], 0 between launches (C > 1).
#include "sampling.cuh"

using namespace nq_sample;

extern "C" __global__ void __launch_bounds__(THREADS) sample_tokens_bf16(
    const bf16_t* __restrict__ logits, long long ld, int V, const float* __restrict__ temperature,
    const int* __restrict__ top_k, const float* __restrict__ top_p, const long long* __restrict__ seeds,
    long long* __restrict__ offsets, int* __restrict__ out, unsigned long long* __restrict__ partials,
    int* __restrict__ counters) {
  pdl_entry();
  const int b = blockIdx.x, C = gridDim.y, c = blockIdx.y;
  const bf16_t* row = logits + (i64)b * ld;
  __shared__ Smem sm;
  const int nvec = V / 8;
  u64 best = chunk_best(row, (int)((i64)c * nvec / C), (int)((i64)(c + 1) * nvec / C), sm);
  if (C > 1) {  // publish this chunk's maximum; the row's last block to arrive goes on
    __shared__ int is_last;
    if (threadIdx.x == 0) {
      partials[(i64)b * C + c] = best;
      __threadfence();
      is_last = atomicAdd(&counters[b], 1) == C - 1;
      if (is_last) counters[b] = 0;  // every chunk has arrived: ready for the next launch (or replay)
    }
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    u64 part = 0;
    if (threadIdx.x < C) {
#ifdef NQ_HOST_EMU
      nq_emu::load_point();
      part = *reinterpret_cast<const volatile u64*>(partials + (i64)b * C + threadIdx.x);
#else
      asm volatile("ld.global.cg.u64 %0, [%1];" : "=l"(part) : "l"(partials + (i64)b * C + threadIdx.x));
#endif
    }
    best = block_max_u64(part, sm);
  }
  RowParams p;
  p.temperature = temperature[b];
  p.top_k = top_k[b];
  p.top_p = top_p[b];
  p.seed = (u64)seeds[b];
  p.offset = (u64)offsets[b];
  const int token = sample_row(row, V, p, best, sm);
  if (threadIdx.x == 0) {
    out[b] = token;
    offsets[b] = (long long)(p.offset + 1);
  }
}
