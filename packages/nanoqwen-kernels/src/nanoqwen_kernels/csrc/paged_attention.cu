// Entry points of the paged attention family "attention" (the math is in attention.cuh). The file is
// not named attention.cu: NVRTC names the generated unit after the family, and a unit that includes
// a file of its own name is rejected as self-inclusion.
//
//   paged_attention_decode_hd{64,128}   one 16-row tile per (sequence, KV head): the G <= 16 query
//                                       heads of a KV head; 4 consumer warps split each KV tile
//   paged_attention_prefill_hd{64,128}  64-row tiles of (token, head) pairs; each consumer warp owns
//                                       16 rows and sees every KV tile (chunked prefill: causal
//                                       over the cached prefix plus the chunk itself)
//   paged_attention_combine_hd{64,128}  merges the rows split more than fuse_max_splits ways
// Fewer splits are merged inside the attention launch by the last split of each (row tile, KV head,
// sequence) to finish (attention.cuh); the combine kernel is launched only by plans that can split
// further, and skips the rows already final.
//
// Launch (nanoqwen_kernels.attention does it): attention grid (num_row_tiles * num_splits,
// n_kv_heads, B), 160 threads, dynamic shared memory (NSTAGES * 2 + 1) * 64 * head_dim * 2 bytes;
// combine grid total_q * n_heads (one CTA per output row), 512 threads. Arguments are plain scalars and
// pointers (the order of nq_attn::Params), so any launcher can pass them without a struct layout.
#include "attention.cuh"

#define NQ_ATTN_PARAMS                                                                                \
  const bf16_t *q, long long q_stride, const bf16_t *k_cache,                      \
      const bf16_t *v_cache, const int *page_table, int page_table_stride,                  \
      const int *context_lens, const int *qo_start, bf16_t *out, float *work_o,             \
      float *work_lse, int *counters, int *work_splits, int work_rows, int n_heads, int n_kv_heads, int log2_block_size,              \
      int num_splits, int num_row_tiles, int unsplit_max_tiles, int fuse_max_splits, float scale_log2

#define NQ_ATTN_FILL(p)                                                                                \
  nq_attn::Params p;                                                                                   \
  p.q = q;                                                                                             \
  p.q_stride = q_stride;                                                                               \
  p.k_cache = k_cache;                                                                                 \
  p.v_cache = v_cache;                                                                                 \
  p.page_table = page_table;                                                                           \
  p.page_table_stride = page_table_stride;                                                             \
  p.context_lens = context_lens;                                                                       \
  p.qo_start = qo_start;                                                                               \
  p.out = out;                                                                                         \
  p.work_o = work_o;                                                                                   \
  p.work_lse = work_lse;                                                                               \
  p.counters = counters;                                                                               \
  p.work_splits = work_splits;                                                                         \
  p.work_rows = work_rows;                                                                             \
  p.n_heads = n_heads;                                                                                 \
  p.n_kv_heads = n_kv_heads;                                                                           \
  p.log2_block_size = log2_block_size;                                                                 \
  p.num_splits = num_splits;                                                                           \
  p.num_row_tiles = num_row_tiles;                                                                     \
  p.unsplit_max_tiles = unsplit_max_tiles;                                                             \
  p.fuse_max_splits = fuse_max_splits;                                                                 \
  p.scale_log2 = scale_log2

#define NQ_ATTN_ENTRY(NAME, HD, NSTAGES, ROW_WARPS, KV_WARPS)                                          \
  extern "C" __global__ void __launch_bounds__(nq_attn::THREADS, 2) NAME(NQ_ATTN_PARAMS) {            \
    pdl_entry();                                                                                       \
    NQ_ATTN_FILL(p);                                                                                   \
    nq_attn::paged_attention<HD, NSTAGES, ROW_WARPS, KV_WARPS>(p);                                     \
  }

#define NQ_ATTN_COMBINE(NAME, HD)                                                                      \
  extern "C" __global__ void __launch_bounds__(nq_attn::COMBINE_THREADS)                              \
      NAME(NQ_ATTN_PARAMS, int total_q) {                                                              \
    pdl_entry();                                                                                       \
    NQ_ATTN_FILL(p);                                                                                   \
    nq_attn::combine_splits<HD>(p, total_q);                                                           \
  }

// Stages: 3 x 32 KiB at head_dim 128 and 4 x 16 KiB at 64, two CTAs per SM either way.
NQ_ATTN_ENTRY(paged_attention_decode_hd128, 128, 3, 1, 4)
NQ_ATTN_ENTRY(paged_attention_decode_hd64, 64, 4, 1, 4)
NQ_ATTN_ENTRY(paged_attention_prefill_hd128, 128, 3, 4, 1)
NQ_ATTN_ENTRY(paged_attention_prefill_hd64, 64, 4, 4, 1)
NQ_ATTN_COMBINE(paged_attention_combine_hd128, 128)
NQ_ATTN_COMBINE(paged_attention_combine_hd64, 64)
