// block.cu: extern "C" entry points of the post-attention block kernel (block_int4.cuh).
//
//   post_attention_block_g128_{sym,asym}[_f16s][_qkv]
//       resid += attn @ Wo^T; gate_up = RMSNorm(resid) * w @ Wgu^T; resid += silu_mul(gate_up) @ Wd^T,
//       M = 1..2 decode rows, one persistent launch; `_qkv`: then the next layer's qkv projection with
//       its norm prologue and RoPE / paged K/V epilogue too; `_f16s`: fp16 scales
//       (int4-g128-tile8x128-f16s-v1), else bf16.
//
// Launch (nanoqwen_kernels/block.py): grid = one CTA per SM, block.BlockBuild.threads threads, dynamic
// shared memory BlockBuild.shared_bytes(M, max(Kq, H, I)). Arguments, the same for every entry point
// (the qkv ones 0 / null where there is no qkv op): attn, resid, gate_up, stats, pair_stats, norm_w,
// eps, ws, counters, M, H, I, Kq; (qweight, scales, zeros|0, W) of o_proj, gate_up, down and qkv;
// Nq, in_norm_w, qkv_bias|0, qkv_out, positions, slot_mapping, inv_freq, q_out, k_cache, v_cache, Hq,
// Hkv, D, block_size.
#include "block_int4.cuh"

using namespace nq_block;

#define NQ_BLOCK_ENTRY(NAME, ASYM, ST, QKV)                                                                   \
  extern "C" __global__ void __launch_bounds__(nq_block::THREADS, 1) NAME(                                    \
      const bf16_t* __restrict__ attn, bf16_t* resid, bf16_t* gate_up, float* stats, float* pair_stats,       \
      const bf16_t* __restrict__ norm_w, float eps, float* ws, int* counters, int M, int H, int I, int Kq,    \
      const uint4* __restrict__ qw0, const u16* __restrict__ sc0, const u8* __restrict__ z0, int w0,          \
      const uint4* __restrict__ qw1, const u16* __restrict__ sc1, const u8* __restrict__ z1, int w1,          \
      const uint4* __restrict__ qw2, const u16* __restrict__ sc2, const u8* __restrict__ z2, int w2,          \
      const uint4* __restrict__ qw3, const u16* __restrict__ sc3, const u8* __restrict__ z3, int w3, int Nq,  \
      const bf16_t* __restrict__ in_norm_w, const bf16_t* __restrict__ qkv_bias, bf16_t* qkv_out,             \
      const int* __restrict__ positions, const int* __restrict__ slot_mapping,                                \
      const float* __restrict__ inv_freq, bf16_t* q_out, bf16_t* k_cache, bf16_t* v_cache, int Hq, int Hkv,   \
      int D, int block_size) {                                                                                 \
    post_attention_block<ASYM, ST, QKV>(                                                                       \
        BlockArgs{attn, resid, gate_up, stats, pair_stats, norm_w, eps, ws, counters, M, in_norm_w, qkv_bias, \
                  qkv_out,                                                                                     \
                  RopeKV{positions, slot_mapping, inv_freq, q_out, k_cache, v_cache, Hq, Hkv, D, block_size}}, \
        make_op(qw0, sc0, z0, H, Kq, w0), make_op(qw1, sc1, z1, 2 * I, H, w1), make_op(qw2, sc2, z2, H, I, w2), \
        make_op(qw3, sc3, z3, QKV ? Nq : 16, H, QKV ? w3 : 1));                                                \
  }

NQ_BLOCK_ENTRY(post_attention_block_g128_sym, false, ScaleBF16, false)
NQ_BLOCK_ENTRY(post_attention_block_g128_asym, true, ScaleBF16, false)
NQ_BLOCK_ENTRY(post_attention_block_g128_sym_f16s, false, ScaleF16, false)
NQ_BLOCK_ENTRY(post_attention_block_g128_asym_f16s, true, ScaleF16, false)
NQ_BLOCK_ENTRY(post_attention_block_g128_sym_qkv, false, ScaleBF16, true)
NQ_BLOCK_ENTRY(post_attention_block_g128_asym_qkv, true, ScaleBF16, true)
NQ_BLOCK_ENTRY(post_attention_block_g128_sym_f16s_qkv, false, ScaleF16, true)
NQ_BLOCK_ENTRY(post_attention_block_g128_asym_f16s_qkv, true, ScaleF16, true)
