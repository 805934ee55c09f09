// sampling.cu: extern "C" entry of GPU sampling (algorithm in sampling.cuh).
//
//   sample_tokens_bf16  grid (B), 1024 threads. logits: bf16 [B, V] (row stride ld; V and ld multiples
//                       of 8, rows 16-byte aligned); per row:
//                       temperature f32, top_k i32, top_p f32, seed i64, offset i64 (incremented);
//                       out: int32 [B].
#include "sampling.cuh"

using namespace nq_sample;

extern "C" __global__ void __launch_bounds__(THREADS) sample_tokens_bf16(
    const bf16_t* __restrict__ logits, long long ld, int V, const float* __restrict__ temperature,
    const int* __restrict__ top_k, const float* __restrict__ top_p, const long long* __restrict__ seeds,
    long long* __restrict__ offsets, int* __restrict__ out) {
  pdl_enter();
  const int b = blockIdx.x;
  RowParams p;
  p.temperature = temperature[b];
  p.top_k = top_k[b];
  p.top_p = top_p[b];
  p.seed = (u64)seeds[b];
  p.offset = (u64)offsets[b];
  __shared__ Smem sm;
  const int token = sample_row(logits + (i64)b * ld, V, p, sm);
  if (threadIdx.x == 0) {
    out[b] = token;
    offsets[b] = (long long)(p.offset + 1);
  }
}
