// gemv.cu: extern "C" entry points of the INT4 linear family (algorithms in gemv_int4.cuh).
//
//   gemv_int4_g{32,64,128}_{sym,asym}[_f16s][_silu]
//                                              decode GEMV, M = 1..8; `_silu` takes gate_up [M, 2K]
//                                              and applies SiLU(gate) * up while staging x (fuses the
//                                              MLP activation into the down projection); `_f16s`: fp16
//                                              scales (layout int4-g{G}-tile8x128-f16s-v1), else bf16
//   gemv_int4_g{32,64,128}_{sym,asym}[_f16s]_rope
//                                              the qkv GEMV, M = 1..8, with qkv_rope_kv_write as its
//                                              epilogue: q to q_out, K/V into the paged cache
//   gemv_int4_g{32,64,128}_{sym,asym}[_f16s]{_norm,_norm_rope,_resid,_silu_resid}
//                                              the fused-layer GEMVs (below): RMSNorm of the residual
//                                              as the input, or y added into the residual
//   gemv_int4_g{32,64,128}_{sym,asym}[_f16s]_merge_hd{64,128}_resid
//                                              o_proj with the attention split merge as its input
//                                              prologue and the residual epilogue (below)
//   dequant_int4_g{32,64,128}_{sym,asym}[_f16s] INT4 -> dense bf16 [N, K] (prefill: + cuBLAS GEMM)
//   gemv_int8_g{64,128}                        decode GEMV, M = 1..8, INT8 row-major weights (the
//                                              `--lm-head int8` layout; gemv_int8.cuh)
//
// GEMV launch (nanoqwen_kernels/gemv.py): grid (ceil(N / 128), S), 256 threads, dynamic shared memory
// M * (kc * 128 + 32) * 2 bytes. Arguments: x, qweight, scales, zeros|0, bias|0, out, ws|0,
// counters|0, M, N, K, kc.
#include "gemv_int4.cuh"
#include "gemv_int8.cuh"

using namespace nq_gemv;

#define NQ_GEMV_BLOCKS(G, XMODE) \
  (G == 128 ? (XMODE == 1 ? NQ_GEMV_MIN_BLOCKS_G128_SILU : NQ_GEMV_MIN_BLOCKS_G128) : NQ_GEMV_MIN_BLOCKS)
// The parameter lists every GEMV entry point starts with (the launch arguments of gemv.py).
#define NQ_GEMV_PARAMS                                                                                \
  const bf16_t* __restrict__ x, const uint4* __restrict__ qweight, const u16* __restrict__ scales,    \
      const u8* __restrict__ zeros, const bf16_t* __restrict__ bias, bf16_t* __restrict__ out,        \
      float* __restrict__ ws, int* __restrict__ counters, int M, int N, int K, int kc
#define NQ_GEMV_ROPE_PARAMS                                                                           \
  const bf16_t* __restrict__ x, const uint4* __restrict__ qweight, const u16* __restrict__ scales,    \
      const u8* __restrict__ zeros, const bf16_t* __restrict__ bias, float* __restrict__ ws,          \
      int* __restrict__ counters, int M, int N, int K, int kc, const int* __restrict__ positions,      \
      const int* __restrict__ slot_mapping, const float* __restrict__ inv_freq,                       \
      bf16_t* __restrict__ q_out, bf16_t* __restrict__ k_cache, bf16_t* __restrict__ v_cache, int Hq, \
      int Hkv, int D, int block_size
#define NQ_GEMV_ENTRY_LOOP(NAME, G, ASYM, XMODE, ST, EXACT)                                           \
  extern "C" __global__ void __launch_bounds__(THREADS, NQ_GEMV_BLOCKS(G, XMODE))                     \
      NAME(NQ_GEMV_PARAMS) {                                                                           \
    gemv_int4<G, ASYM, XMODE, ST, (EXACT) || NQ_GEMV_EXACT_ALL>(x, qweight, scales, zeros, bias, out, ws, \
                                                                 counters, M, N, K, kc);               \
  }
#define NQ_GEMV_ENTRY(NAME, G, ASYM, XMODE, ST) NQ_GEMV_ENTRY_LOOP(NAME, G, ASYM, XMODE, ST, false)

// One tile-column per pipeline stage (two stages in flight; deeper stages measured slower on the H200)
// and the blocks per SM the register budget must allow, tuned on the H200, overridable with
// -D for benchmark variants. -DNQ_GEMV_EXACT_LOOP builds every kernel with the exact-trip-count main
// loop (gemv_int4.cuh's EXACT); without it only the kernels built
// with NQ_GEMV_ENTRY_LOOP(..., true) below have it: those where it measured faster and compiles without
// spills (nvcc 13.0; test_build.py holds every hot kernel to that).
#ifdef NQ_GEMV_EXACT_LOOP
#define NQ_GEMV_EXACT_ALL true
#else
#define NQ_GEMV_EXACT_ALL false
#endif
#ifndef NQ_GEMV_MIN_BLOCKS
#define NQ_GEMV_MIN_BLOCKS 3  // g32/g64 (plain and SiLU input): <= 85 registers, unspilled
#endif
#ifndef NQ_GEMV_MIN_BLOCKS_G128
#define NQ_GEMV_MIN_BLOCKS_G128 4  // plain-input g128: 64 registers, 4 blocks = 32 warps per SM
#endif
// g128 SiLU-input (down): 2 blocks per SM (<= 128 registers), where the per-column loop's exact form was
// unspilled (at 3 blocks it spilled 4-8 bytes, reloaded per iteration); measured 0.83x (asym) / 0.90x
// (sym) the time of the other loop at 3 blocks on the 7B down at M = 1, with plan_gemv's split target 2
// (gemv.py).
#ifndef NQ_GEMV_MIN_BLOCKS_G128_SILU
#define NQ_GEMV_MIN_BLOCKS_G128_SILU 2
#endif

NQ_GEMV_ENTRY(gemv_int4_g128_sym, 128, false, 0, ScaleBF16)
NQ_GEMV_ENTRY_LOOP(gemv_int4_g128_asym, 128, true, 0, ScaleBF16, true)  // the default recipe's layout
NQ_GEMV_ENTRY(gemv_int4_g64_sym, 64, false, 0, ScaleBF16)
NQ_GEMV_ENTRY(gemv_int4_g64_asym, 64, true, 0, ScaleBF16)
NQ_GEMV_ENTRY(gemv_int4_g32_sym, 32, false, 0, ScaleBF16)
NQ_GEMV_ENTRY(gemv_int4_g32_asym, 32, true, 0, ScaleBF16)
NQ_GEMV_ENTRY_LOOP(gemv_int4_g128_sym_silu, 128, false, 1, ScaleBF16, true)
NQ_GEMV_ENTRY_LOOP(gemv_int4_g128_asym_silu, 128, true, 1, ScaleBF16, true)
NQ_GEMV_ENTRY(gemv_int4_g64_sym_silu, 64, false, 1, ScaleBF16)
NQ_GEMV_ENTRY(gemv_int4_g64_asym_silu, 64, true, 1, ScaleBF16)
NQ_GEMV_ENTRY(gemv_int4_g32_sym_silu, 32, false, 1, ScaleBF16)
NQ_GEMV_ENTRY(gemv_int4_g32_asym_silu, 32, true, 1, ScaleBF16)
NQ_GEMV_ENTRY(gemv_int4_g128_sym_f16s, 128, false, 0, ScaleF16)
NQ_GEMV_ENTRY(gemv_int4_g128_asym_f16s, 128, true, 0, ScaleF16)
NQ_GEMV_ENTRY(gemv_int4_g64_sym_f16s, 64, false, 0, ScaleF16)
NQ_GEMV_ENTRY(gemv_int4_g64_asym_f16s, 64, true, 0, ScaleF16)
NQ_GEMV_ENTRY(gemv_int4_g32_sym_f16s, 32, false, 0, ScaleF16)
NQ_GEMV_ENTRY(gemv_int4_g32_asym_f16s, 32, true, 0, ScaleF16)
NQ_GEMV_ENTRY_LOOP(gemv_int4_g128_sym_f16s_silu, 128, false, 1, ScaleF16, true)
NQ_GEMV_ENTRY_LOOP(gemv_int4_g128_asym_f16s_silu, 128, true, 1, ScaleF16, true)
NQ_GEMV_ENTRY(gemv_int4_g64_sym_f16s_silu, 64, false, 1, ScaleF16)
NQ_GEMV_ENTRY(gemv_int4_g64_asym_f16s_silu, 64, true, 1, ScaleF16)
NQ_GEMV_ENTRY(gemv_int4_g32_sym_f16s_silu, 32, false, 1, ScaleF16)
NQ_GEMV_ENTRY(gemv_int4_g32_asym_f16s_silu, 32, true, 1, ScaleF16)

// The qkv GEMV with the RoPE / paged K/V write epilogue (gemv_int4.cuh, EPI = 1): plain input, every
// layout, the blocks per SM of the plain kernel of the layout; the per-column-guard loop everywhere (the
// exact loop spilled 12 bytes in g128 asym with the epilogue; on the qkv shape it measured 0.996 of the
// other loop's time). Launch as the GEMV, without out; extra arguments: positions,
// slot_mapping, inv_freq, q_out, k_cache, v_cache, Hq, Hkv, D, block_size.
#define NQ_GEMV_ROPE_ENTRY(NAME, G, ASYM, ST, EXACT)                                                   \
  extern "C" __global__ void __launch_bounds__(THREADS, NQ_GEMV_BLOCKS(G, 0))                          \
      NAME(NQ_GEMV_ROPE_PARAMS) {                                                                      \
    gemv_int4<G, ASYM, 0, ST, (EXACT) || NQ_GEMV_EXACT_ALL, 1>(                                       \
        x, qweight, scales, zeros, bias, nullptr, ws, counters, M, N, K, kc,                           \
        RopeKV{positions, slot_mapping, inv_freq, q_out, k_cache, v_cache, Hq, Hkv, D, block_size});   \
  }

NQ_GEMV_ROPE_ENTRY(gemv_int4_g128_sym_rope, 128, false, ScaleBF16, false)
NQ_GEMV_ROPE_ENTRY(gemv_int4_g128_asym_rope, 128, true, ScaleBF16, false)
NQ_GEMV_ROPE_ENTRY(gemv_int4_g64_sym_rope, 64, false, ScaleBF16, false)
NQ_GEMV_ROPE_ENTRY(gemv_int4_g64_asym_rope, 64, true, ScaleBF16, false)
NQ_GEMV_ROPE_ENTRY(gemv_int4_g32_sym_rope, 32, false, ScaleBF16, false)
NQ_GEMV_ROPE_ENTRY(gemv_int4_g32_asym_rope, 32, true, ScaleBF16, false)
NQ_GEMV_ROPE_ENTRY(gemv_int4_g128_sym_f16s_rope, 128, false, ScaleF16, false)
NQ_GEMV_ROPE_ENTRY(gemv_int4_g128_asym_f16s_rope, 128, true, ScaleF16, false)
NQ_GEMV_ROPE_ENTRY(gemv_int4_g64_sym_f16s_rope, 64, false, ScaleF16, false)
NQ_GEMV_ROPE_ENTRY(gemv_int4_g64_asym_f16s_rope, 64, true, ScaleF16, false)
NQ_GEMV_ROPE_ENTRY(gemv_int4_g32_sym_f16s_rope, 32, false, ScaleF16, false)
NQ_GEMV_ROPE_ENTRY(gemv_int4_g32_asym_f16s_rope, 32, true, ScaleF16, false)

// The fused-layer GEMVs (gemv_int4.cuh's header: the norm prologue and the residual epilogue), which
// take the add + RMSNorm launches out of a decode layer: `_norm` (gate_up: RMSNorm of the residual as
// the input), `_norm_rope` (qkv: the same input, the RoPE / K/V epilogue), `_resid` (o_proj: y added
// into the residual, its sums of squares written) and `_silu_resid` (down: SiLU*mul input, the same
// epilogue). Each is its own instantiation, so the kernels above are compiled exactly as without
// them. The loop of each: the one of the kernel it extends (the exact loop where that one has it and
// it stays spill-free, test_build.py). Launch as the GEMV; extra arguments after kc: `_norm` norm_w,
// norm_stats, norm_eps, norm_blocks; `_resid` / `_silu_resid` resid, resid_stats (out is 0); after
// block_size, `_norm_rope` the norm's four.
#define NQ_GEMV_NORM_ENTRY(NAME, G, ASYM, ST, EXACT)                                                   \
  extern "C" __global__ void __launch_bounds__(THREADS, NQ_GEMV_BLOCKS(G, 0))                          \
      NAME(NQ_GEMV_PARAMS, const bf16_t* __restrict__ norm_w,                                          \
           const float* __restrict__ norm_stats, float norm_eps, int norm_blocks) {                   \
    gemv_int4<G, ASYM, 0, ST, (EXACT) || NQ_GEMV_EXACT_ALL, 0, true>(                                 \
        x, qweight, scales, zeros, bias, out, ws, counters, M, N, K, kc, RopeKV{},                     \
        NormIn{norm_w, norm_stats, norm_eps, norm_blocks});                                            \
  }
#define NQ_GEMV_RESID_ENTRY(NAME, G, ASYM, XMODE, ST, EXACT)                                           \
  extern "C" __global__ void __launch_bounds__(THREADS, NQ_GEMV_BLOCKS(G, XMODE))                     \
      NAME(NQ_GEMV_PARAMS, bf16_t* __restrict__ resid,                                                 \
           float* __restrict__ resid_stats) {                                                          \
    gemv_int4<G, ASYM, XMODE, ST, (EXACT) || NQ_GEMV_EXACT_ALL, 2>(                                   \
        x, qweight, scales, zeros, bias, out, ws, counters, M, N, K, kc, RopeKV{}, NormIn{},           \
        ResidOut{resid, resid_stats});                                                                 \
  }
// `_merge_resid` (o_proj after an attention launch that left split rows: the merge as the input prologue,
// gemv_int4.cuh's XMODE 3, then the residual epilogue), one per head_dim (64, 128). Extra arguments after
// kc: resid, resid_stats, work_o, work_lse, work_splits, work_rows, fuse_max_splits; dynamic shared memory
// the GEMV's plus gemv.py's merge_shared_bytes.
#define NQ_GEMV_MERGE_ENTRY(NAME, G, ASYM, ST, HD)                                                     \
  extern "C" __global__ void __launch_bounds__(THREADS, NQ_GEMV_BLOCKS(G, 3))                          \
      NAME(NQ_GEMV_PARAMS, bf16_t* __restrict__ resid, float* __restrict__ resid_stats,                \
           const float* __restrict__ work_o, const float* __restrict__ work_lse,                       \
           const int* __restrict__ work_splits, int work_rows, int fuse_max_splits) {                  \
    gemv_int4<G, ASYM, 3, ST, NQ_GEMV_EXACT_ALL, 2, false, HD>(                                       \
        x, qweight, scales, zeros, bias, out, ws, counters, M, N, K, kc, RopeKV{}, NormIn{},           \
        ResidOut{resid, resid_stats}, MergeIn{work_o, work_lse, work_splits, work_rows, fuse_max_splits}); \
  }
#define NQ_GEMV_MERGE_ENTRIES(G, KIND, ASYM, SCALES, ST)                                               \
  NQ_GEMV_MERGE_ENTRY(gemv_int4_g##G##_##KIND##SCALES##_merge_hd128_resid, G, ASYM, ST, 128)           \
  NQ_GEMV_MERGE_ENTRY(gemv_int4_g##G##_##KIND##SCALES##_merge_hd64_resid, G, ASYM, ST, 64)
#define NQ_GEMV_NORM_ROPE_ENTRY(NAME, G, ASYM, ST, EXACT)                                              \
  extern "C" __global__ void __launch_bounds__(THREADS, NQ_GEMV_BLOCKS(G, 0))                          \
      NAME(NQ_GEMV_ROPE_PARAMS,                                                                        \
           const bf16_t* __restrict__ norm_w, const float* __restrict__ norm_stats, float norm_eps,    \
           int norm_blocks) {                                                                          \
    gemv_int4<G, ASYM, 0, ST, (EXACT) || NQ_GEMV_EXACT_ALL, 1, true>(                                 \
        x, qweight, scales, zeros, bias, nullptr, ws, counters, M, N, K, kc,                           \
        RopeKV{positions, slot_mapping, inv_freq, q_out, k_cache, v_cache, Hq, Hkv, D, block_size},    \
        NormIn{norm_w, norm_stats, norm_eps, norm_blocks});                                            \
  }

NQ_GEMV_NORM_ENTRY(gemv_int4_g128_sym_norm, 128, false, ScaleBF16, false)
NQ_GEMV_NORM_ENTRY(gemv_int4_g128_asym_norm, 128, true, ScaleBF16, true)
NQ_GEMV_NORM_ENTRY(gemv_int4_g64_sym_norm, 64, false, ScaleBF16, false)
NQ_GEMV_NORM_ENTRY(gemv_int4_g64_asym_norm, 64, true, ScaleBF16, false)
NQ_GEMV_NORM_ENTRY(gemv_int4_g32_sym_norm, 32, false, ScaleBF16, false)
NQ_GEMV_NORM_ENTRY(gemv_int4_g32_asym_norm, 32, true, ScaleBF16, false)
NQ_GEMV_NORM_ENTRY(gemv_int4_g128_sym_f16s_norm, 128, false, ScaleF16, false)
NQ_GEMV_NORM_ENTRY(gemv_int4_g128_asym_f16s_norm, 128, true, ScaleF16, false)
NQ_GEMV_NORM_ENTRY(gemv_int4_g64_sym_f16s_norm, 64, false, ScaleF16, false)
NQ_GEMV_NORM_ENTRY(gemv_int4_g64_asym_f16s_norm, 64, true, ScaleF16, false)
NQ_GEMV_NORM_ENTRY(gemv_int4_g32_sym_f16s_norm, 32, false, ScaleF16, false)
NQ_GEMV_NORM_ENTRY(gemv_int4_g32_asym_f16s_norm, 32, true, ScaleF16, false)
NQ_GEMV_RESID_ENTRY(gemv_int4_g128_sym_resid, 128, false, 0, ScaleBF16, false)
NQ_GEMV_RESID_ENTRY(gemv_int4_g128_asym_resid, 128, true, 0, ScaleBF16, false)
NQ_GEMV_RESID_ENTRY(gemv_int4_g64_sym_resid, 64, false, 0, ScaleBF16, false)
NQ_GEMV_RESID_ENTRY(gemv_int4_g64_asym_resid, 64, true, 0, ScaleBF16, false)
NQ_GEMV_RESID_ENTRY(gemv_int4_g32_sym_resid, 32, false, 0, ScaleBF16, false)
NQ_GEMV_RESID_ENTRY(gemv_int4_g32_asym_resid, 32, true, 0, ScaleBF16, false)
NQ_GEMV_RESID_ENTRY(gemv_int4_g128_sym_f16s_resid, 128, false, 0, ScaleF16, false)
NQ_GEMV_RESID_ENTRY(gemv_int4_g128_asym_f16s_resid, 128, true, 0, ScaleF16, false)
NQ_GEMV_RESID_ENTRY(gemv_int4_g64_sym_f16s_resid, 64, false, 0, ScaleF16, false)
NQ_GEMV_RESID_ENTRY(gemv_int4_g64_asym_f16s_resid, 64, true, 0, ScaleF16, false)
NQ_GEMV_RESID_ENTRY(gemv_int4_g32_sym_f16s_resid, 32, false, 0, ScaleF16, false)
NQ_GEMV_RESID_ENTRY(gemv_int4_g32_asym_f16s_resid, 32, true, 0, ScaleF16, false)
NQ_GEMV_RESID_ENTRY(gemv_int4_g128_sym_silu_resid, 128, false, 1, ScaleBF16, true)
NQ_GEMV_RESID_ENTRY(gemv_int4_g128_asym_silu_resid, 128, true, 1, ScaleBF16, true)
NQ_GEMV_RESID_ENTRY(gemv_int4_g64_sym_silu_resid, 64, false, 1, ScaleBF16, false)
NQ_GEMV_RESID_ENTRY(gemv_int4_g64_asym_silu_resid, 64, true, 1, ScaleBF16, false)
NQ_GEMV_RESID_ENTRY(gemv_int4_g32_sym_silu_resid, 32, false, 1, ScaleBF16, false)
NQ_GEMV_RESID_ENTRY(gemv_int4_g32_asym_silu_resid, 32, true, 1, ScaleBF16, false)
NQ_GEMV_RESID_ENTRY(gemv_int4_g128_sym_f16s_silu_resid, 128, false, 1, ScaleF16, true)
NQ_GEMV_RESID_ENTRY(gemv_int4_g128_asym_f16s_silu_resid, 128, true, 1, ScaleF16, true)
NQ_GEMV_RESID_ENTRY(gemv_int4_g64_sym_f16s_silu_resid, 64, false, 1, ScaleF16, false)
NQ_GEMV_RESID_ENTRY(gemv_int4_g64_asym_f16s_silu_resid, 64, true, 1, ScaleF16, false)
NQ_GEMV_RESID_ENTRY(gemv_int4_g32_sym_f16s_silu_resid, 32, false, 1, ScaleF16, false)
NQ_GEMV_RESID_ENTRY(gemv_int4_g32_asym_f16s_silu_resid, 32, true, 1, ScaleF16, false)
NQ_GEMV_NORM_ROPE_ENTRY(gemv_int4_g128_sym_norm_rope, 128, false, ScaleBF16, false)
NQ_GEMV_NORM_ROPE_ENTRY(gemv_int4_g128_asym_norm_rope, 128, true, ScaleBF16, false)
NQ_GEMV_NORM_ROPE_ENTRY(gemv_int4_g64_sym_norm_rope, 64, false, ScaleBF16, false)
NQ_GEMV_NORM_ROPE_ENTRY(gemv_int4_g64_asym_norm_rope, 64, true, ScaleBF16, false)
NQ_GEMV_NORM_ROPE_ENTRY(gemv_int4_g32_sym_norm_rope, 32, false, ScaleBF16, false)
NQ_GEMV_NORM_ROPE_ENTRY(gemv_int4_g32_asym_norm_rope, 32, true, ScaleBF16, false)
NQ_GEMV_NORM_ROPE_ENTRY(gemv_int4_g128_sym_f16s_norm_rope, 128, false, ScaleF16, false)
NQ_GEMV_NORM_ROPE_ENTRY(gemv_int4_g128_asym_f16s_norm_rope, 128, true, ScaleF16, false)
NQ_GEMV_NORM_ROPE_ENTRY(gemv_int4_g64_sym_f16s_norm_rope, 64, false, ScaleF16, false)
NQ_GEMV_NORM_ROPE_ENTRY(gemv_int4_g64_asym_f16s_norm_rope, 64, true, ScaleF16, false)
NQ_GEMV_NORM_ROPE_ENTRY(gemv_int4_g32_sym_f16s_norm_rope, 32, false, ScaleF16, false)
NQ_GEMV_NORM_ROPE_ENTRY(gemv_int4_g32_asym_f16s_norm_rope, 32, true, ScaleF16, false)

NQ_GEMV_MERGE_ENTRIES(128, sym, false, , ScaleBF16)
NQ_GEMV_MERGE_ENTRIES(128, asym, true, , ScaleBF16)
NQ_GEMV_MERGE_ENTRIES(64, sym, false, , ScaleBF16)
NQ_GEMV_MERGE_ENTRIES(64, asym, true, , ScaleBF16)
NQ_GEMV_MERGE_ENTRIES(32, sym, false, , ScaleBF16)
NQ_GEMV_MERGE_ENTRIES(32, asym, true, , ScaleBF16)
NQ_GEMV_MERGE_ENTRIES(128, sym, false, _f16s, ScaleF16)
NQ_GEMV_MERGE_ENTRIES(128, asym, true, _f16s, ScaleF16)
NQ_GEMV_MERGE_ENTRIES(64, sym, false, _f16s, ScaleF16)
NQ_GEMV_MERGE_ENTRIES(64, asym, true, _f16s, ScaleF16)
NQ_GEMV_MERGE_ENTRIES(32, sym, false, _f16s, ScaleF16)
NQ_GEMV_MERGE_ENTRIES(32, asym, true, _f16s, ScaleF16)

#define NQ_DEQUANT_ENTRY(NAME, G, ASYM, ST)                                                           \
  extern "C" __global__ void __launch_bounds__(256)                                                   \
      NAME(const uint4* __restrict__ qweight, const u16* __restrict__ scales,                        \
           const u8* __restrict__ zeros, bf16_t* __restrict__ out, int N, int K) {                    \
    pdl_entry();                                                                                      \
    dequant_int4<G, ASYM, ST>(qweight, scales, zeros, out, N, K);                                     \
  }

NQ_DEQUANT_ENTRY(dequant_int4_g128_sym, 128, false, ScaleBF16)
NQ_DEQUANT_ENTRY(dequant_int4_g128_asym, 128, true, ScaleBF16)
NQ_DEQUANT_ENTRY(dequant_int4_g64_sym, 64, false, ScaleBF16)
NQ_DEQUANT_ENTRY(dequant_int4_g64_asym, 64, true, ScaleBF16)
NQ_DEQUANT_ENTRY(dequant_int4_g32_sym, 32, false, ScaleBF16)
NQ_DEQUANT_ENTRY(dequant_int4_g32_asym, 32, true, ScaleBF16)
NQ_DEQUANT_ENTRY(dequant_int4_g128_sym_f16s, 128, false, ScaleF16)
NQ_DEQUANT_ENTRY(dequant_int4_g128_asym_f16s, 128, true, ScaleF16)
NQ_DEQUANT_ENTRY(dequant_int4_g64_sym_f16s, 64, false, ScaleF16)
NQ_DEQUANT_ENTRY(dequant_int4_g64_asym_f16s, 64, true, ScaleF16)
NQ_DEQUANT_ENTRY(dequant_int4_g32_sym_f16s, 32, false, ScaleF16)
NQ_DEQUANT_ENTRY(dequant_int4_g32_asym_f16s, 32, true, ScaleF16)

// Blocks per SM the INT8 GEMV's register budget must allow: 3 (72 registers). 4 (64 registers, 32 warps
// per SM) measured 3.7% slower on the H200 at M = 1.
#ifndef NQ_GEMV8_MIN_BLOCKS
#define NQ_GEMV8_MIN_BLOCKS 3
#endif

// INT8 decode GEMV (gemv_int8.cuh). Launch: grid ceil(N / 128), 256 threads, dynamic shared memory
// M * (K + 8) * 2 bytes. Arguments: x, qweight (int8 [N, K]), scales (bf16 [N, K / G]), out, M, N, K.
#define NQ_GEMV8_ENTRY(NAME, G)                                                                       \
  extern "C" __global__ void __launch_bounds__(nq_gemv8::THREADS, NQ_GEMV8_MIN_BLOCKS)                \
      NAME(const bf16_t* __restrict__ x, const uint4* __restrict__ qweight,                          \
           const bf16_t* __restrict__ scales, bf16_t* __restrict__ out, int M, int N, int K) {        \
    pdl_entry();                                                                                      \
    nq_gemv8::gemv_int8<G>(x, qweight, scales, out, M, N, K);                                         \
  }

NQ_GEMV8_ENTRY(gemv_int8_g128, 128)
NQ_GEMV8_ENTRY(gemv_int8_g64, 64)
