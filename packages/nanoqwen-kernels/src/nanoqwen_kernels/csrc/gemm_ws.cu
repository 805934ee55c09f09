// gemm_ws.cu: extern "C" entry points of the warp-specialised wgmma INT4 GEMM (decode batches, M <= 64;
// the algorithm is in gemm_int4_ws.cuh).
//
//   gemm_ws_int4_g{32,64,128}_{sym,asym}[_f16s]_n{2,4,8,16}
//       NT = 2, 4, 8, 16 n-tiles of 8 activation rows per M block (the wgmma's N = 16, 32, 64, 128);
//       `_f16s`: fp16 scales (layout int4-g{G}-tile8x128-f16s-v1), else bf16 (as the GEMV's names).
//   gemm_ws_int4_g{32,64,128}_{sym,asym}[_f16s]_n16_sk
//       the prefill plan's stream-K launch (gemm_int4_ws.cuh): grid (blocks, 1, 1), kc = units per block.
//
// Launch (nanoqwen_kernels/gemm.py): grid (ceil(M / (8 NT)), ceil(N / 128), S), WsWarps<8 NT>::THREADS
// threads (NT <= 8: 640, 16 consumer warps in two sets + a producer warpgroup; NT = 16: 288, 8 consumer
// warps + a producer warp), dynamic shared memory gemm.ws_shared_bytes(plan). Arguments: x, qweight, scales,
// zeros|0, bias|0, out, ws|0, counters|0, M, N, K, kc, the CUtensorMaps of x and
// of the packed weights (by value: gemm.gemm_int4 makes them).
#include "gemm_int4_ws.cuh"

using namespace nq_gemm_ws;

#define NQ_GEMM_WS_ENTRY(NAME, G, ASYM, NT, ST, STREAM_K)                                             \
  extern "C" __global__ void __launch_bounds__(WsWarps<8 * NT>::THREADS, 1)                         \
      NAME(const bf16_t* __restrict__ x, const uint4* __restrict__ qweight,                           \
           const u16* __restrict__ scales, const u8* __restrict__ zeros,                              \
           const bf16_t* __restrict__ bias, bf16_t* __restrict__ out, float* __restrict__ ws,         \
           int* __restrict__ counters, int M, int N, int K, int kc,                                      \
           const __grid_constant__ TmaMap xmap, const __grid_constant__ TmaMap wmap) {                \
    gemm_int4_ws<G, ASYM, NT, ST, STREAM_K>(x, qweight, scales, zeros, bias, out, ws, counters, M, N, K, kc, &xmap, &wmap); \
  }

#define NQ_GEMM_WS_NT(NAME, G, ASYM, ST)               \
  NQ_GEMM_WS_ENTRY(NAME##_n2, G, ASYM, 2, ST, false)  \
  NQ_GEMM_WS_ENTRY(NAME##_n4, G, ASYM, 4, ST, false)  \
  NQ_GEMM_WS_ENTRY(NAME##_n8, G, ASYM, 8, ST, false)  \
  NQ_GEMM_WS_ENTRY(NAME##_n16, G, ASYM, 16, ST, false) \
  NQ_GEMM_WS_ENTRY(NAME##_n16_sk, G, ASYM, 16, ST, true)

#define NQ_GEMM_WS_G(G)                                                  \
  NQ_GEMM_WS_NT(gemm_ws_int4_g##G##_sym, G, false, nq_gemv::ScaleBF16)     \
  NQ_GEMM_WS_NT(gemm_ws_int4_g##G##_asym, G, true, nq_gemv::ScaleBF16)     \
  NQ_GEMM_WS_NT(gemm_ws_int4_g##G##_sym_f16s, G, false, nq_gemv::ScaleF16) \
  NQ_GEMM_WS_NT(gemm_ws_int4_g##G##_asym_f16s, G, true, nq_gemv::ScaleF16)

NQ_GEMM_WS_G(128)
NQ_GEMM_WS_G(64)
NQ_GEMM_WS_G(32)
