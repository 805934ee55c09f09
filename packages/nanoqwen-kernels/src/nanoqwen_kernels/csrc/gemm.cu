// gemm.cu: extern "C" entry points of the INT4 GEMM (M > 8; the algorithm is in gemm_int4.cuh).
//
//   gemm_int4_g{32,64,128}_{sym,asym}[_f16s][_silu]_n{2,4,8}
//       NT = 2, 4, 8 n-tiles of 8 activation rows per M block (M <= 16, <= 32, any M: 64-row blocks);
//       `_silu` takes gate_up [M, 2K] and multiplies by silu(gate) * up (the fused MLP down input);
//       `_f16s`: fp16 scales (layout int4-g{G}-tile8x128-f16s-v1), else bf16 (as the GEMV's names).
//
// Launch (nanoqwen_kernels/gemm.py): grid (ceil(M / (8 NT)), ceil(N / 128), S), 256 threads, dynamic
// shared memory (silu ? 3 : 2) * 8 NT * (2 * 128 + 8) * 2 bytes. Arguments: x, qweight, scales,
// zeros|0, bias|0, out, ws|0, counters|0, M, N, K, kc.
#include "gemm_int4.cuh"

using namespace nq_gemm;

// Blocks per SM the register budget must allow, chosen so that no kernel spills (ptxas -v, checked in
// CPU CI): ptxas keeps the B fragments of a whole tile-column in flight, so the registers grow with
// NT and with the groups per tile-column: NT = 2 and g128 NT = 4 fit 128 registers (2 blocks of 8
// warps per SM), the others need up to 255 (1 block).
// -DNQ_GEMM_FORCE_MIN_BLOCKS=B builds every kernel for B blocks per SM (benchmark variants).
#ifdef NQ_GEMM_FORCE_MIN_BLOCKS
#define NQ_GEMM_MIN_BLOCKS(G, NT) NQ_GEMM_FORCE_MIN_BLOCKS
#else
#define NQ_GEMM_MIN_BLOCKS(G, NT) (((NT) == 2 || ((NT) == 4 && (G) == 128)) ? 2 : 1)
#endif

#define NQ_GEMM_ENTRY(NAME, G, ASYM, XMODE, NT, ST)                                                       \
  extern "C" __global__ void __launch_bounds__(THREADS, NQ_GEMM_MIN_BLOCKS(G, NT))                       \
      NAME(const bf16_t* __restrict__ x, const uint4* __restrict__ qweight,                          \
           const u16* __restrict__ scales, const u8* __restrict__ zeros,                              \
           const bf16_t* __restrict__ bias, bf16_t* __restrict__ out, float* __restrict__ ws,         \
           int* __restrict__ counters, int M, int N, int K, int kc) {                                 \
    pdl_entry();                                                                                      \
    gemm_int4<G, ASYM, XMODE, NT, ST>(x, qweight, scales, zeros, bias, out, ws, counters, M, N, K, kc);   \
  }

#define NQ_GEMM_NT(NAME, G, ASYM, XMODE, ST)       \
  NQ_GEMM_ENTRY(NAME##_n2, G, ASYM, XMODE, 2, ST) \
  NQ_GEMM_ENTRY(NAME##_n4, G, ASYM, XMODE, 4, ST) \
  NQ_GEMM_ENTRY(NAME##_n8, G, ASYM, XMODE, 8, ST)

#define NQ_GEMM_G(G)                                                         \
  NQ_GEMM_NT(gemm_int4_g##G##_sym, G, false, 0, nq_gemv::ScaleBF16)           \
  NQ_GEMM_NT(gemm_int4_g##G##_asym, G, true, 0, nq_gemv::ScaleBF16)           \
  NQ_GEMM_NT(gemm_int4_g##G##_sym_silu, G, false, 1, nq_gemv::ScaleBF16)      \
  NQ_GEMM_NT(gemm_int4_g##G##_asym_silu, G, true, 1, nq_gemv::ScaleBF16)      \
  NQ_GEMM_NT(gemm_int4_g##G##_sym_f16s, G, false, 0, nq_gemv::ScaleF16)       \
  NQ_GEMM_NT(gemm_int4_g##G##_asym_f16s, G, true, 0, nq_gemv::ScaleF16)       \
  NQ_GEMM_NT(gemm_int4_g##G##_sym_f16s_silu, G, false, 1, nq_gemv::ScaleF16)  \
  NQ_GEMM_NT(gemm_int4_g##G##_asym_f16s_silu, G, true, 1, nq_gemv::ScaleF16)

NQ_GEMM_G(128)
NQ_GEMM_G(64)
NQ_GEMM_G(32)
