// Paged attention for decode and chunked prefill (sm_90a), one kernel family for both.
//
// What it computes. For every query row (token i of sequence b, query head h) and its KV head
// kvh = h / G (G = n_heads / n_kv_heads query heads per KV head):
//     pos = context_len[b] - query_len[b] + i                        (absolute position of the token)
//     out = softmax(q . K[0..pos]^T / sqrt(head_dim)) . V[0..pos]    (causal, fp32 accumulation)
// K and V come from the paged cache of DESIGN.md: k_cache / v_cache are
// [num_blocks, n_kv_heads, block_size, head_dim] bf16, and token p of sequence b lives in page
// page_table[b, p / block_size], slot p % block_size. Decode is query_len == 1.
//
// Work split. A CTA owns one (row tile, KV head, KV split, sequence). A row tile packs ROWS query rows
// of ONE KV head as (token, head-in-group) pairs, row r -> token r / G, head r % G, so every K/V tile
// is loaded once for all G query heads that share it (GQA) and fed to tensor cores (mma.sync
// m16n8k16 bf16, fp32 accumulate) as the B operand. Decode has G <= 16 rows per sequence: one 16-row
// MMA tile, and the 4 consumer warps split each KV tile's tokens between them instead (KV_WARPS = 4).
// Prefill has 4 warps x 16 rows and each warp sees the whole KV tile (KV_WARPS = 1). The KV range of
// a CTA (every token its last row may see) is cut into TILE-token tiles and those tiles into
// splits contiguous splits (flash-decoding), so one long sequence fills all SMs; the splits are merged
// by their log-sum-exp. The split count is chosen on the device from the actual context: a CTA group
// (row tile, KV head, sequence) with n tiles runs unsplit when n <= unsplit_max_tiles (the merge would
// cost more than the split saves) and else in S = min(num_splits, n) splits (the plan's num_splits is
// the most, fixed for the longest context a graph serves), split s taking tiles
// [s * n / S, (s + 1) * n / S); the CTAs of splits >= S exit at once. A captured graph
// thus serves every length up to the plan's maximum without paying at a short context for the splits
// of a long one.
//
// Pipeline (warp-specialized). Warp 0 is the producer: it reads the page table and copies whole KV
// tiles into an NSTAGES-deep shared-memory ring with 16-byte cp.async (XOR-swizzled rows so that
// ldmatrix is bank-conflict free). Token rows past the CTA's KV limit, and therefore every slot of a
// partial tail page that holds no token yet, are zero-filled (cp.async src-size 0) without touching
// global memory or the page table: stale or NaN cache contents never reach the math. Completion is
// signalled with cp.async.mbarrier.arrive.noinc on the stage's "full" mbarrier (count 32, one per
// producer lane); every consumer thread arrives on the stage's "empty" mbarrier when done reading.
// After the split-role branch nothing uses __syncthreads(): consumers synchronize among themselves
// with a named barrier (bar.sync 1, 32 * CONSUMER_WARPS) that the producer never reaches.
//
// Epilogue. Each consumer warp leaves (m, l, O) per row in shared memory (reusing the ring, which is
// drained by then); all consumer threads merge the KV_WARPS partial states in a fixed order (the
// result is bit-identical run to run) and write either the final bf16 row (one split) or an fp32 row
// normalized by its own sum plus its log2-sum-exp to the work buffers.
//
// Split merge. With 1 < S <= fuse_max_splits, each CTA then publishes its partial rows and counts itself
// on its group's arrival counter; the CTA that arrives last (whichever split it is) merges the S partial
// rows of its tile, in split order (so the result does not depend on which CTA was last), and resets
// the counter to 0 for the next launch or graph replay: no second kernel. With more splits one CTA's
// merge would be the launch's long pole (it reads S partial rows alone, ~0.7 us per dependent L2 round
// trip), so the groups with S > fuse_max_splits leave it to the combine kernel, one CTA per output row
// (launched only by plans that can split that far; it skips the rows already final). Split 0 writes
// each row's S to work_splits, which is how the combine kernel knows.
#pragma once

#include "common.cuh"  // bf16_t (raw bits: no toolkit headers), f32x2_to_bf16x2
#include "mbarrier.cuh"  // mbar_init, mbar_arrive, mbar_wait

// Prefill register budget (160 threads, 2 CTAs/SM: ptxas caps at 168 registers). Q fragments held in
// registers only fit with 16-token softmax steps (166 registers); re-reading Q from shared memory with
// 32-token steps (162 registers) measured faster on the H200 (174 vs 160 TFLOP/s at 4096 tokens), so
// that is the default; bench_attention.py --ablate builds the other corner.
#ifndef NQ_ATTN_PREFILL_QREGS
#define NQ_ATTN_PREFILL_QREGS 0
#endif
#ifndef NQ_ATTN_PREFILL_SUB
#define NQ_ATTN_PREFILL_SUB 32
#endif

namespace nq_attn {

constexpr int TILE = 64;           // KV tokens per pipeline stage
constexpr int CONSUMER_WARPS = 4;  // math warps per CTA; warp 0 is the producer on top of these
constexpr int THREADS = 32 * (CONSUMER_WARPS + 1);
constexpr int CONSUMER_BARRIER = 1;  // named barrier id (0 is __syncthreads)

struct Params {
  const bf16_t* q;           // [total_q, n_heads, head_dim], token stride q_stride (elements)
  const bf16_t* k_cache;     // [num_blocks, n_kv_heads, block_size, head_dim]
  const bf16_t* v_cache;     // same shape as k_cache
  const int* page_table;     // [B, page_table_stride]
  const int* context_lens;   // [B]: tokens in the cache, new ones included
  const int* qo_start;       // [B + 1]: row b's query tokens are q[qo_start[b] : qo_start[b + 1]]
  bf16_t* out;               // [total_q, n_heads, head_dim] contiguous (num_splits == 1)
  float* work_o;             // [num_splits, work_rows, n_heads, head_dim] (num_splits > 1)
  float* work_lse;           // [num_splits, work_rows, n_heads], log2 domain
  int* counters;             // [B, n_kv_heads, num_row_tiles] split arrivals: 0 between launches
  int* work_splits;          // [work_rows, n_heads]: the row's split count S, written by split 0
  long long q_stride;
  int page_table_stride;
  int work_rows;
  int n_heads;
  int n_kv_heads;
  int log2_block_size;
  int num_splits;
  int num_row_tiles;
  int unsplit_max_tiles;  // a context of at most this many KV tiles runs unsplit (the merge costs)
  int fuse_max_splits;  // most splits merged inside the kernel (<= FUSE_CAP); more: the combine kernel
  float scale_log2;  // softmax scale * log2(e)
};

constexpr int FUSE_CAP = 16;  // fuse_max_splits <= FUSE_CAP: the in-kernel merge holds S rows in registers

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// Shared address of a byte of the dynamic shared memory (on the emulator: of its address window).
__device__ __forceinline__ unsigned smem_addr(const void* p) {
#ifdef NQ_HOST_EMU
  return nq_emu::smem_window_addr(p);
#else
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
#endif
}

// 2^x on the SFU (ex2.approx: relative error ~2^-22, 2^-inf = +0), as flash attention does.
__device__ __forceinline__ float fast_exp2(float x) {
#ifdef NQ_HOST_EMU
  return nq_emu::ex2_approx_ftz(x);
#else
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#endif
}

// ---- cp.async, named barriers (the mbarriers are mbarrier.cuh's) --------------------------------------

// 16-byte async copy; src_bytes == 0 writes zeros and reads nothing.
#ifdef NQ_HOST_EMU
// The emulator's cp.async (completing late), arrive-on, named barrier (emu/simt.h).
__device__ __forceinline__ void cp_async_16_zfill(unsigned dst, const void* src, unsigned src_bytes) {
  nq_emu::cp_async_16(dst, src, src_bytes);
}
__device__ __forceinline__ void cp_async_arrive_noinc(unsigned long long* bar) {
  nq_emu::cp_async_arrive_noinc(mbar_smem_addr(bar));
}
__device__ __forceinline__ void cp_async_wait_all() { nq_emu::cp_async_wait_all(); }
__device__ __forceinline__ void consumer_sync() { nq_emu::named_barrier(CONSUMER_BARRIER, 32 * CONSUMER_WARPS); }
#else
__device__ __forceinline__ void cp_async_16_zfill(unsigned dst, const void* src, unsigned src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes)
               : "memory");
}

// The mbarrier receives one arrival once every cp.async this thread issued so far has landed.
__device__ __forceinline__ void cp_async_arrive_noinc(unsigned long long* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(smem_addr(bar)) : "memory");
}

__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

__device__ __forceinline__ void consumer_sync() {
  asm volatile("bar.sync %0, %1;" ::"n"(CONSUMER_BARRIER), "n"(32 * CONSUMER_WARPS) : "memory");
}
#endif  // NQ_HOST_EMU

// ---- tensor-core fragments ----------------------------------------------------------------------

__device__ __forceinline__ void ldmatrix_x4(unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3,
                                            unsigned addr) {
#ifdef NQ_HOST_EMU
  unsigned r[4];
  nq_emu::ldmatrix_x4(r, addr, false);
  r0 = r[0], r1 = r[1], r2 = r[2], r3 = r[3];
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
#endif
}

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3,
                                                  unsigned addr) {
#ifdef NQ_HOST_EMU
  unsigned r[4];
  nq_emu::ldmatrix_x4(r, addr, true);
  r0 = r[0], r1 = r[1], r2 = r[2], r3 = r[3];
#else
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
#endif
}

// d += a (16x16, row) * b (16x8, col), bf16 in, fp32 accumulate.
__device__ __forceinline__ void mma_bf16(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
#ifdef NQ_HOST_EMU
  const unsigned b[2] = {b0, b1};
  nq_emu::mma_m16n8k16(d, a, b, false);
#else
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// Byte offset of 16-byte chunk `chunk` of row `row` in a [rows, HD] bf16 tile (XOR swizzle: the 8 rows
// one ldmatrix phase reads sit in 8 different 16-byte bank groups).
template <int HD>
__device__ __forceinline__ unsigned tile_offset(int row, int chunk) {
  return (unsigned)(row * (HD * 2) + ((chunk ^ (row & 7)) << 4));
}

// ---- the CTA's share of the work ----------------------------------------------------------------

struct Work {
  int b, kvh, row_tile, row0, rows_total, qlen, ctx, qs, tile_begin, n_tiles, split, splits, kv_limit;
};

template <int ROW_WARPS>
__device__ __forceinline__ bool cta_work(const Params& p, Work& w) {
  constexpr int ROWS = 16 * ROW_WARPS;
  const int G = p.n_heads / p.n_kv_heads;
  w.b = blockIdx.z;
  w.kvh = blockIdx.y;
  w.split = blockIdx.x % p.num_splits;
  // Row tiles in reverse: under the causal mask the last rows have the most work, start them first.
  const int row_tile = w.row_tile = p.num_row_tiles - 1 - (int)(blockIdx.x / p.num_splits);
  w.qs = p.qo_start[w.b];
  w.qlen = p.qo_start[w.b + 1] - w.qs;
  w.ctx = p.context_lens[w.b];
  w.rows_total = w.qlen * G;
  w.row0 = row_tile * ROWS;
  if (w.row0 >= w.rows_total) return false;
  const int last_token = (min(w.row0 + ROWS, w.rows_total) - 1) / G;
  w.kv_limit = max(0, min(w.ctx, w.ctx - w.qlen + last_token + 1));
  // S = 1 for n <= unsplit_max_tiles, else min(num_splits, n): by the actual context, so
  // none is empty (a group with no live token, context 0, has one split of no tiles: zeros); even
  // partition: split s takes tiles [s * n / S, (s + 1) * n / S), none more than one tile longer.
  const int tiles = (w.kv_limit + TILE - 1) / TILE;
  w.splits = tiles <= p.unsplit_max_tiles ? 1 : min(p.num_splits, tiles);
  if (w.split >= w.splits) return false;
  w.tile_begin = (int)((long long)w.split * tiles / w.splits);
  w.n_tiles = (int)((long long)(w.split + 1) * tiles / w.splits) - w.tile_begin;
  return true;
}

// ---- producer warp ------------------------------------------------------------------------------

template <int HD, int NSTAGES>
__device__ __forceinline__ void produce(const Params& p, const Work& w, unsigned char* ring,
                                        unsigned long long* full, unsigned long long* empty, int lane) {
  constexpr int CHUNKS = HD / 8;             // 16-byte chunks per token row
  constexpr int ROWS_PER_PASS = 32 / CHUNKS;  // token rows one warp instruction covers
  constexpr int TILE_BYTES = TILE * HD * 2;
  const int bs_mask = (1 << p.log2_block_size) - 1;
  const int* pt = p.page_table + (long long)w.b * p.page_table_stride;
  const long long head_off = (long long)w.kvh << p.log2_block_size;  // in token rows
  const int chunk = lane % CHUNKS;
  for (int it = 0; it < w.n_tiles; ++it) {
    const int stage = it % NSTAGES;
    if (it >= NSTAGES) mbar_wait(&empty[stage], ((it / NSTAGES) - 1) & 1);
    const int tok0 = (w.tile_begin + it) * TILE;
    // Lane j holds the page id of the tile's j-th page (read only for pages holding a live token).
    const int first_page = tok0 >> p.log2_block_size;
    const int pages_in_tile = max(1, TILE >> p.log2_block_size);
    int page_id = 0;
    if (lane < pages_in_tile && ((first_page + lane) << p.log2_block_size) < w.kv_limit)
      page_id = pt[first_page + lane];
    const unsigned k_dst = smem_addr(ring + stage * 2 * TILE_BYTES);
    const unsigned v_dst = k_dst + TILE_BYTES;
#pragma unroll 4
    for (int r0 = 0; r0 < TILE; r0 += ROWS_PER_PASS) {
      const int row = r0 + lane / CHUNKS;
      const int tok = tok0 + row;
      const int page = __shfl_sync(0xffffffffu, page_id, (tok >> p.log2_block_size) - first_page);
      const bool live = tok < w.kv_limit;
      const long long elem =
          ((((long long)page * p.n_kv_heads) << p.log2_block_size) + head_off + (tok & bs_mask)) * HD +
          chunk * 8;
      const unsigned off = tile_offset<HD>(row, chunk);
      cp_async_16_zfill(k_dst + off, live ? p.k_cache + elem : p.k_cache, live ? 16u : 0u);
      cp_async_16_zfill(v_dst + off, live ? p.v_cache + elem : p.v_cache, live ? 16u : 0u);
    }
    cp_async_arrive_noinc(&full[stage]);
  }
  cp_async_wait_all();
}

// ---- consumer warps -----------------------------------------------------------------------------

// One consumer warp: 16 query rows against TPW tokens of every KV tile.
template <int HD, int NSTAGES, int ROW_WARPS, int KV_WARPS>
__device__ __forceinline__ void consume(const Params& p, const Work& w, unsigned char* ring,
                                        unsigned char* q_smem, unsigned long long* full,
                                        unsigned long long* empty, int cw, int lane, float* sm_ml) {
  constexpr int ROWS = 16 * ROW_WARPS;
  constexpr int TPW = TILE / KV_WARPS;  // tokens of a tile this warp handles
  constexpr int SUB = KV_WARPS == 1 ? NQ_ATTN_PREFILL_SUB : TPW;  // tokens per online-softmax step
  constexpr int NT = SUB / 8;                // score n-tiles per step
  constexpr int KS = HD / 16;           // k-steps of q . k
  constexpr int TILE_BYTES = TILE * HD * 2;
  constexpr int OSTRIDE = HD + 8;  // fp32 row stride of the epilogue buffer (pad: fewer bank conflicts)
  const int G = p.n_heads / p.n_kv_heads;
  const int row_warp = cw / KV_WARPS;
  const int kv_warp = cw % KV_WARPS;
  const int g = lane >> 2, t = lane & 3;

  // This warp's 16 query rows go to its own slice of the Q buffer (swizzled like the KV tiles) and
  // feed the MMAs through ldmatrix: holding them in registers would cost 2 * HD / 8 more per thread.
  // Every consumer warp has a private slice (decode warps share rows but copy them each), so no
  // barrier between warps is needed. Padding rows (past the last query) are zeros.
  unsigned char* q_warp = q_smem + cw * 16 * HD * 2;
#pragma unroll
  for (int i = lane; i < 16 * (HD / 8); i += 32) {
    const int rr = i / (HD / 8), c = i % (HD / 8);
    const int r = w.row0 + row_warp * 16 + rr;
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (r < w.rows_total)
      v = *reinterpret_cast<const uint4*>(p.q + (long long)(w.qs + r / G) * p.q_stride +
                                          (w.kvh * G + r % G) * HD + c * 8);
    *reinterpret_cast<uint4*>(q_warp + tile_offset<HD>(rr, c)) = v;
  }
  __syncwarp();
  const unsigned q_base = smem_addr(q_warp);
  // Prefill (KV_WARPS == 1) keeps the Q fragments in registers: each warp then reads only K and V from
  // shared memory, which is the bound there. Decode re-reads Q from shared memory per tile instead and
  // spends the registers on nothing: it is bound by HBM, not by shared memory.
  constexpr bool Q_IN_REGS = KV_WARPS == 1 && NQ_ATTN_PREFILL_QREGS;
  unsigned qreg[Q_IN_REGS ? KS : 1][4];
  if (Q_IN_REGS) {
#pragma unroll
    for (int ks = 0; ks < (Q_IN_REGS ? KS : 1); ++ks)
      ldmatrix_x4(qreg[ks][0], qreg[ks][1], qreg[ks][2], qreg[ks][3],
                  q_base + tile_offset<HD>((lane & 7) + (((lane >> 3) & 1) << 3), ks * 2 + (lane >> 4)));
  }
  int limit[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = w.row0 + row_warp * 16 + g + half * 8;
    limit[half] = r < w.rows_total ? w.ctx - w.qlen + r / G + 1 : w.kv_limit;  // padding: any finite row
  }

  float o[HD / 8][4];
#pragma unroll
  for (int j = 0; j < HD / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float m[2] = {neg_inf(), neg_inf()};
  float l[2] = {0.f, 0.f};

  for (int it = 0; it < w.n_tiles; ++it) {
    const int stage = it % NSTAGES;
    mbar_wait(&full[stage], (it / NSTAGES) & 1);
    const unsigned k_base = smem_addr(ring + stage * 2 * TILE_BYTES);
    const unsigned v_base = k_base + TILE_BYTES;
#pragma unroll 1
    for (int sub = 0; sub < TPW / SUB; ++sub) {
      const int trow0 = kv_warp * TPW + sub * SUB;  // first token row of this step inside the tile

      // S = Q K^T over this step's SUB tokens.
      float s[NT][4];
#pragma unroll
      for (int n = 0; n < NT; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) {
        unsigned qa[4];
        if (Q_IN_REGS) {
#pragma unroll
          for (int i = 0; i < 4; ++i) qa[i] = qreg[Q_IN_REGS ? ks : 0][i];
        } else {
          ldmatrix_x4(qa[0], qa[1], qa[2], qa[3],
                      q_base + tile_offset<HD>((lane & 7) + (((lane >> 3) & 1) << 3), ks * 2 + (lane >> 4)));
        }
#pragma unroll
        for (int np = 0; np < NT / 2; ++np) {
          const int row = trow0 + np * 16 + (lane & 7) + ((lane >> 4) << 3);
          const int chunk = ks * 2 + ((lane >> 3) & 1);
          unsigned b0, b1, b2, b3;
          ldmatrix_x4(b0, b1, b2, b3, k_base + tile_offset<HD>(row, chunk));
          mma_bf16(s[2 * np], qa, b0, b1);
          mma_bf16(s[2 * np + 1], qa, b2, b3);
        }
      }

      // Mask and online softmax (log2 domain). Row `half` owns s[n][2*half], s[n][2*half+1].
      const int tok_base = (w.tile_begin + it) * TILE + trow0 + 2 * t;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float mx = neg_inf();
#pragma unroll
        for (int n = 0; n < NT; ++n) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int tok = tok_base + n * 8 + e;
            const float v = tok < limit[half] ? s[n][2 * half + e] * p.scale_log2 : neg_inf();
            s[n][2 * half + e] = v;
            mx = fmaxf(mx, v);
          }
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m[half], mx);
        const float m_use = m_new == neg_inf() ? 0.f : m_new;  // a fully masked row so far stays at 0
        const float alpha = fast_exp2(m[half] - m_use);
        m[half] = m_new;
        float sum = 0.f;
#pragma unroll
        for (int n = 0; n < NT; ++n) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float pv = fast_exp2(s[n][2 * half + e] - m_use);
            s[n][2 * half + e] = pv;
            sum += pv;
          }
        }
        l[half] = l[half] * alpha + sum;
#pragma unroll
        for (int j = 0; j < HD / 8; ++j) {
          o[j][2 * half] *= alpha;
          o[j][2 * half + 1] *= alpha;
        }
      }

      // O += P V: P from the score registers (bf16), V fragments by transposing ldmatrix.
      unsigned pa[SUB / 16][4];
#pragma unroll
      for (int kk = 0; kk < SUB / 16; ++kk) {
        pa[kk][0] = f32x2_to_bf16x2(s[2 * kk][0], s[2 * kk][1]);
        pa[kk][1] = f32x2_to_bf16x2(s[2 * kk][2], s[2 * kk][3]);
        pa[kk][2] = f32x2_to_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
        pa[kk][3] = f32x2_to_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
      }
#pragma unroll
      for (int kk = 0; kk < SUB / 16; ++kk) {
        const int row = trow0 + kk * 16 + (lane & 7) + (((lane >> 3) & 1) << 3);
#pragma unroll
        for (int jp = 0; jp < HD / 16; ++jp) {
          unsigned b0, b1, b2, b3;
          ldmatrix_x4_trans(b0, b1, b2, b3, v_base + tile_offset<HD>(row, jp * 2 + (lane >> 4)));
          mma_bf16(o[2 * jp], pa[kk], b0, b1);
          mma_bf16(o[2 * jp + 1], pa[kk], b2, b3);
        }
      }
    }
    mbar_arrive(&empty[stage]);
  }

  // Epilogue part 1: full row sums, then (m, l, O) of this warp into shared memory.
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    l[half] += __shfl_xor_sync(0xffffffffu, l[half], 1);
    l[half] += __shfl_xor_sync(0xffffffffu, l[half], 2);
  }
  consumer_sync();  // every consumer warp is done reading the ring: reuse it for O
  float* sm_o = reinterpret_cast<float*>(ring) + kv_warp * ROWS * OSTRIDE;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = row_warp * 16 + g + half * 8;
    if (t == 0) {
      sm_ml[(kv_warp * ROWS + r) * 2] = m[half];
      sm_ml[(kv_warp * ROWS + r) * 2 + 1] = l[half];
    }
#pragma unroll
    for (int j = 0; j < HD / 8; ++j)
      *reinterpret_cast<float2*>(&sm_o[r * OSTRIDE + j * 8 + 2 * t]) =
          make_float2(o[j][2 * half], o[j][2 * half + 1]);
  }
}

// Epilogue part 2, all consumer threads: merge the KV_WARPS partial states of each row in a fixed
// order and write the row (bf16 final output, or fp32 partial + log2-sum-exp for the combine).
template <int HD, int ROW_WARPS, int KV_WARPS>
__device__ __forceinline__ void finalize(const Params& p, const Work& w, const float* sm_o,
                                         const float* sm_ml, int ctid) {
  constexpr int ROWS = 16 * ROW_WARPS;
  constexpr int OSTRIDE = HD + 8;
  constexpr int VEC = HD / 4;  // float4 columns per row
  const int G = p.n_heads / p.n_kv_heads;
  for (int i = ctid; i < ROWS * VEC; i += 32 * CONSUMER_WARPS) {
    const int r = i / VEC, c = (i % VEC) * 4;
    const int rg = w.row0 + r;
    if (rg >= w.rows_total) continue;
    const int tok = w.qs + rg / G, head = w.kvh * G + rg % G;
    float mx = neg_inf();
#pragma unroll
    for (int k = 0; k < KV_WARPS; ++k) mx = fmaxf(mx, sm_ml[(k * ROWS + r) * 2]);
    float L = 0.f, acc[4] = {0.f, 0.f, 0.f, 0.f};
    if (mx != neg_inf()) {
#pragma unroll
      for (int k = 0; k < KV_WARPS; ++k) {
        const float e = exp2f(sm_ml[(k * ROWS + r) * 2] - mx);
        L += e * sm_ml[(k * ROWS + r) * 2 + 1];
        const float4 v = *reinterpret_cast<const float4*>(&sm_o[(k * ROWS + r) * OSTRIDE + c]);
        acc[0] += e * v.x;
        acc[1] += e * v.y;
        acc[2] += e * v.z;
        acc[3] += e * v.w;
      }
    }
    const float inv = L > 0.f ? 1.f / L : 0.f;  // no live token for this row (context 0): zeros
    const long long row_off = (long long)tok * p.n_heads + head;
    if (w.splits == 1) {
      if (c == 0 && p.num_splits > 1) p.work_splits[row_off] = 1;  // final: the combine kernel skips it
      uint2 packed = make_uint2(f32x2_to_bf16x2(acc[0] * inv, acc[1] * inv), f32x2_to_bf16x2(acc[2] * inv, acc[3] * inv));
      *reinterpret_cast<uint2*>(p.out + row_off * HD + c) = packed;
    } else {
      const long long split_off = (long long)w.split * p.work_rows * p.n_heads;
      *reinterpret_cast<float4*>(p.work_o + (split_off + row_off) * HD + c) =
          make_float4(acc[0] * inv, acc[1] * inv, acc[2] * inv, acc[3] * inv);
      if (c == 0) {
        p.work_lse[split_off + row_off] = L > 0.f ? mx + log2f(L) : neg_inf();
        if (w.split == 0) p.work_splits[row_off] = w.splits;
      }
    }
  }
}

// In-kernel merge, part 1 (every consumer thread of every split CTA of a group with S <= fuse_max):
// count this CTA on its group's counter once its partial rows are written. True in the group's last
// CTA to arrive (uniform across the consumer warps), which has reset the counter to 0 and may then
// read every split's rows. The release/acquire pattern of CUTLASS's semaphores: the named barrier
// orders the CTA's stores before thread 0's acq_rel atomic at gpu scope (cumulative), and thread 0's
// acquire before the other threads' loads after the second barrier; no thread fences on its own.
__device__ __forceinline__ bool arrive_last_split(const Params& p, const Work& w, int ctid) {
  __shared__ int is_last;
  consumer_sync();
  if (ctid == 0) {
    int* counter = p.counters + ((long long)w.b * p.n_kv_heads + w.kvh) * p.num_row_tiles + w.row_tile;
    int prev;
#ifdef NQ_HOST_EMU
    prev = atomicAdd(counter, 1);  // the host's atomics are sequentially consistent
#else
    asm volatile("atom.acq_rel.gpu.global.add.s32 %0, [%1], 1;" : "=r"(prev) : "l"(counter) : "memory");
#endif
    is_last = prev == w.splits - 1;
    if (is_last) *counter = 0;  // every split has arrived: ready for the next launch (or graph replay)
  }
  consumer_sync();
  return is_last;
}

// In-kernel merge, part 2 (the last CTA's consumer threads): for each live row of the tile
//     out = sum_s 2^(lse_s - M) O_s / sum_s 2^(lse_s - M),   M = max_s lse_s,
// summed in split order (bit-identical whichever CTA is last). A split where the row saw no token
// (prefill's causal mask) has lse = -inf: weight 0. This CTA is the launch's long pole, so each thread
// issues all its loads at once (its float4 column of the S <= FUSE_CAP partial rows and their S lse)
// and merges in registers: one dependent L2 round trip per (row, column) item. ld.cg: other CTAs wrote
// these rows during this launch, and L1 is not coherent.
template <int HD, int ROWS>
__device__ __forceinline__ void merge_splits_in_cta(const Params& p, const Work& w, int ctid) {
  constexpr int VEC = HD / 4;  // float4 columns per row
  const int G = p.n_heads / p.n_kv_heads, S = w.splits;
  const int rows = min(ROWS, w.rows_total - w.row0);
  const long long split_stride = (long long)p.work_rows * p.n_heads;  // in rows
  for (int i = ctid; i < rows * VEC; i += 32 * CONSUMER_WARPS) {
    const int r = i / VEC, c = (i % VEC) * 4;
    const int rg = w.row0 + r;
    const long long row_off = (long long)(w.qs + rg / G) * p.n_heads + w.kvh * G + rg % G;
    float lse[FUSE_CAP];
    float4 v[FUSE_CAP];
#pragma unroll
    for (int s = 0; s < FUSE_CAP; ++s) {
      if (s < S) {
        lse[s] = ld_cg_f32(p.work_lse + s * split_stride + row_off);
        v[s] = ld_cg_f32x4(p.work_o + (s * split_stride + row_off) * HD + c);
      }
    }
    float mx = neg_inf();
#pragma unroll
    for (int s = 0; s < FUSE_CAP; ++s)
      if (s < S) mx = fmaxf(mx, lse[s]);
    float L = 0.f;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int s = 0; s < FUSE_CAP; ++s) {
      if (s < S) {
        const float e = lse[s] == neg_inf() ? 0.f : exp2f(lse[s] - mx);
        L += e;
        acc.x += e * v[s].x;
        acc.y += e * v[s].y;
        acc.z += e * v[s].z;
        acc.w += e * v[s].w;
      }
    }
    const float inv = L > 0.f ? 1.f / L : 0.f;
    *reinterpret_cast<uint2*>(p.out + row_off * HD + c) =
        make_uint2(f32x2_to_bf16x2(acc.x * inv, acc.y * inv), f32x2_to_bf16x2(acc.z * inv, acc.w * inv));
  }
}

template <int HD, int NSTAGES, int ROW_WARPS, int KV_WARPS>
__device__ __forceinline__ void paged_attention(const Params& p) {
  static_assert(ROW_WARPS * KV_WARPS == CONSUMER_WARPS, "consumer warp grid");
  static_assert(TILE % (16 * KV_WARPS) == 0, "tokens per warp must be a multiple of 16");
  constexpr int ROWS = 16 * ROW_WARPS;
  static_assert(KV_WARPS * ROWS * (HD + 8) * 4 <= NSTAGES * 2 * TILE * HD * 2, "epilogue fits the ring");
  // Dynamic shared memory: NSTAGES x (K tile, V tile), then CONSUMER_WARPS Q slices [16, HD].
  NQ_DYNAMIC_SMEM(ring, 128);
  __shared__ unsigned long long full[NSTAGES], empty[NSTAGES];
  __shared__ float sm_ml[KV_WARPS * ROWS * 2];

  Work w;
  if (!cta_work<ROW_WARPS>(p, w)) return;  // uniform across the CTA: a row tile past the query
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    for (int s = 0; s < NSTAGES; ++s) {
      mbar_init(&full[s], 32);
      mbar_init(&empty[s], 32 * CONSUMER_WARPS);
    }
  }
  __syncthreads();  // the last CTA-wide barrier: roles split below

  if (warp == 0) {
    produce<HD, NSTAGES>(p, w, ring, full, empty, lane);
  } else {
    consume<HD, NSTAGES, ROW_WARPS, KV_WARPS>(p, w, ring, ring + NSTAGES * 2 * TILE * HD * 2, full, empty,
                                               warp - 1, lane, sm_ml);
    consumer_sync();  // epilogue buffers complete
    const int ctid = threadIdx.x - 32;
    finalize<HD, ROW_WARPS, KV_WARPS>(p, w, reinterpret_cast<const float*>(ring), sm_ml, ctid);
    // few splits: the last to finish merges them here; more: the combine kernel does
    if (w.splits > 1 && w.splits <= p.fuse_max_splits && arrive_last_split(p, w, ctid))
      merge_splits_in_cta<HD, ROWS>(p, w, ctid);
  }
}

// The combine kernel, for rows of groups with S > fuse_max_splits splits (the others return at once):
// out = sum_s 2^(lse_s - M) O_s / sum_s 2^(lse_s - M), M = max_s lse_s, over the row's S splits.
// One CTA of COMBINE_THREADS per (token, head) row, so that the reads of all splits are in flight at
// once: thread i takes lse_i for the weights; then NG groups of HD / 4 threads (a float4 column each)
// sum every NG-th split, and the groups are added in a fixed order (bit-identical run to run). A split
// where the row saw no token (prefill's causal mask) carries lse = -inf (weight 0) and a zero row.
constexpr int COMBINE_THREADS = 512;
constexpr int MAX_SPLITS = 256;

template <int HD>
__device__ __forceinline__ void combine_splits(const Params& p, int total_q) {
  constexpr int LPR = HD / 4;                  // threads per row (one float4 each)
  constexpr int NG = COMBINE_THREADS / LPR;    // split groups
  __shared__ float weight[MAX_SPLITS];
  __shared__ float red[COMBINE_THREADS / 32];
  __shared__ float4 part[NG][LPR];
  const long long row = blockIdx.x;  // token * n_heads + head
  if (row >= (long long)total_q * p.n_heads) return;
  const int S = p.work_splits[row];
  if (S <= p.fuse_max_splits) return;  // unsplit, or merged by its last split: already final
  const int tid = threadIdx.x;
  const long long split_stride = (long long)p.work_rows * p.n_heads;
  float lse[(MAX_SPLITS + COMBINE_THREADS - 1) / COMBINE_THREADS];
  float mx = neg_inf();
#pragma unroll
  for (int k = 0; k < (MAX_SPLITS + COMBINE_THREADS - 1) / COMBINE_THREADS; ++k) {
    const int s = tid + k * COMBINE_THREADS;
    lse[k] = s < S ? p.work_lse[s * split_stride + row] : neg_inf();
    mx = fmaxf(mx, lse[k]);
  }
  mx = warp_max(mx);
  if ((tid & 31) == 0) red[tid >> 5] = mx;
  __syncthreads();
  mx = red[0];
#pragma unroll
  for (int k = 1; k < COMBINE_THREADS / 32; ++k) mx = fmaxf(mx, red[k]);
#pragma unroll
  for (int k = 0; k < (MAX_SPLITS + COMBINE_THREADS - 1) / COMBINE_THREADS; ++k) {
    const int s = tid + k * COMBINE_THREADS;
    if (s < S) weight[s] = lse[k] == neg_inf() ? 0.f : exp2f(lse[k] - mx);
  }
  __syncthreads();
  const int grp = tid / LPR, c = (tid % LPR) * 4;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 4
  for (int s = grp; s < S; s += NG) {
    const float e = weight[s];
    const float4 v = *reinterpret_cast<const float4*>(p.work_o + (s * split_stride + row) * HD + c);
    // fmaf, as the GPU compile contracted `acc += e * v` anyway: spelled out for the emulator (built
    // with -ffp-contract=off) and for the GEMV's merge prologue (gemv_int4.cuh stage_x_merged), which
    // makes the same bits
    acc.x = fmaf(e, v.x, acc.x);
    acc.y = fmaf(e, v.y, acc.y);
    acc.z = fmaf(e, v.z, acc.z);
    acc.w = fmaf(e, v.w, acc.w);
  }
  part[grp][tid % LPR] = acc;
  __syncthreads();
  if (tid < LPR) {
    float L = 0.f;
    for (int s = 0; s < S; ++s) L += weight[s];
    float4 o = part[0][tid];
#pragma unroll
    for (int g2 = 1; g2 < NG; ++g2) {
      o.x += part[g2][tid].x;
      o.y += part[g2][tid].y;
      o.z += part[g2][tid].z;
      o.w += part[g2][tid].w;
    }
    const float inv = L > 0.f ? 1.f / L : 0.f;  // context 0: every split empty, zeros
    *reinterpret_cast<uint2*>(p.out + row * HD + c) =
        make_uint2(f32x2_to_bf16x2(o.x * inv, o.y * inv), f32x2_to_bf16x2(o.z * inv, o.w * inv));
  }
}

}  // namespace nq_attn
