// block.cu: extern "C" entry points of the post-attention block kernel (block_int4.cuh).
//
//   post_attention_block_g128_{sym,asym}[_f16s]
//       resid += attn @ Wo^T; gate_up = RMSNorm(resid) * w @ Wgu^T; resid += silu_mul(gate_up) @ Wd^T,
//       M = 1..2 decode rows, one persistent launch; `_f16s`: fp16 scales
//       (int4-g128-tile8x128-f16s-v1), else bf16.
//
// Launch (nanoqwen_kernels/block.py): grid = one CTA per SM, block.THREADS threads, dynamic shared
// memory block.shared_bytes(M, max(Kq, H, I)). Arguments: attn, resid, gate_up, stats, pair_stats,
// norm_w, eps, then (qweight, scales, zeros|0, W) of o_proj, gate_up and down, then ws, counters, M, H,
// I, Kq.
#include "block_int4.cuh"

using namespace nq_block;

#define NQ_BLOCK_ENTRY(NAME, ASYM, ST)                                                                      \
  extern "C" __global__ void __launch_bounds__(nq_block::THREADS, 1) NAME(                                            \
      const bf16_t* __restrict__ attn, bf16_t* resid, bf16_t* gate_up, float* stats, float* pair_stats,     \
      const bf16_t* __restrict__ norm_w, float eps, const uint4* __restrict__ qw0,                          \
      const u16* __restrict__ sc0, const u8* __restrict__ z0, int w0, const uint4* __restrict__ qw1,        \
      const u16* __restrict__ sc1, const u8* __restrict__ z1, int w1, const uint4* __restrict__ qw2,        \
      const u16* __restrict__ sc2, const u8* __restrict__ z2, int w2, float* ws, int* counters, int M,      \
      int H, int I, int Kq) {                                                                               \
    post_attention_block<ASYM, ST>(BlockArgs{attn, resid, gate_up, stats, pair_stats, norm_w, eps, ws, counters, M},   \
                                   make_op(qw0, sc0, z0, H, Kq, w0), make_op(qw1, sc1, z1, 2 * I, H, w1),   \
                                   make_op(qw2, sc2, z2, H, I, w2));                                        \
  }

NQ_BLOCK_ENTRY(post_attention_block_g128_sym, false, ScaleBF16)
NQ_BLOCK_ENTRY(post_attention_block_g128_asym, true, ScaleBF16)
NQ_BLOCK_ENTRY(post_attention_block_g128_sym_f16s, false, ScaleF16)
NQ_BLOCK_ENTRY(post_attention_block_g128_asym_f16s, true, ScaleF16)
