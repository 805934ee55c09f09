// block_int4.cuh: the post-attention half of a decoder layer at M = 1..MAX_M decode rows, as ONE
// persistent launch instead of three GEMVs (issue 13: a first step of the persistent decode kernel):
//
//   op 0  resid   += attn @ Wo^T                          o_proj, the residual epilogue
//   op 1  gate_up  = (RMSNorm(resid) * w_norm) @ Wgu^T    gate_up, the norm prologue
//   op 2  resid   += (silu(gate) * up) @ Wdown^T          down, SiLU input, the residual epilogue
//
// INT4 layout `int4-g128-tile8x128-v1` (or its fp16-scale variant), the GEMV's (gemv_int4.cuh, which
// also has the fragment math: `mma_tile_column` is this kernel's inner step too).
//
// Why one launch. A batch-1 GEMV launch pays a fixed ~4 us of ramp-up and drain (bench/kernels/
// CEILINGS.md, section 4) on top of its bytes; o_proj (6.4 MB) is more fixed cost than bytes. Here the
// weights of the three ops are one stream that never waits for an activation: each warp copies its
// next chunks of weights into its own shared-memory ring with bulk copies (1D TMA) as soon as a slot is
// free, whichever op they belong to, so while the warps wait for an op's last output (the dependency
// of the next op's input) the next op's first weights are already on their way.
//
// Work. Grid = one CTA per SM (co-resident: the launcher checks the occupancy; CTAs wait on each
// other), WARPS warps each. An op's work is its NP = N / 16 tile pairs (16 output rows, the GEMV's
// warp unit) x KT = K / 128 tile-columns: T = NP * KT "pair-columns" in pair-major order, cut into W
// equal contiguous ranges (W = min(warps in the grid, T); warp gw < W takes [T gw / W, T (gw + 1) / W)).
// So every warp streams the same number of bytes per op (no partial wave), and a range covers whole
// pairs in its middle and at most a partial pair at each end: a "piece". A pair done by one piece is
// finished by its warp directly; a pair cut into pieces has each piece's fp32 partial written to ws
// (slot 0: the piece that starts its warp's range, 1: the one that ends it), and the last of its
// pieces to arrive (an atomic counter per pair, reset by that warp) adds the partials in k order:
// deterministic, bitwise the same from run to run.
//
// Ring. Warp w owns RING slots of SLOT_BYTES: one slot holds up to CHUNK tile-columns of the pair's two
// tile rows (2 x CHUNK x 512 B; the tile row's tile-columns are contiguous in the layout, so one bulk
// copy per tile row). Lane 0 issues the copies and posts the bytes on the slot's mbarrier; the warp
// waits on its parity, computes, then refills the slot with the chunk RING ahead. The scales and zero
// points (1/32 of the bytes, strided by row) are ordinary loads, issued one chunk ahead into registers.
//
// Dependencies, with counters in global memory: op_done[op] counts finished pairs. Before op 1 (op 2)
// stages its input, thread 0 of every CTA waits until op_done[0] (op_done[1]) reaches that op's NP;
// the input is staged whole into shared memory (the GEMV's stage_x), as each op needs all of it. The
// last CTA to leave resets op_done. Data another CTA wrote in this launch is read past L1 (ld.cg: the
// staging of ops 1-3, the residual in the epilogues, the partials and per-pair statistics), after the
// wait that orders it: L1 is not coherent, and an SM may hold older lines of the residual or the
// statistics from an earlier op's staging.
//
// The int8 build (-DNQ_BLOCK_INT8_MMA=1, block.py's BlockBuild(int8=True)): each op's staged input is
// rewritten as the GEMV int8 build's two 8-bit planes of 16-bit block floating point (stage_x_planes,
// its table of per-group scales and sums after x) and the chunk step is the GEMV's mma_col_int8 on the
// int8 tensor cores: 3 instructions of dequantisation per 32-bit word instead of 11, so each warp's chain
// per chunk is shorter (the default build was latency-bound at 16 warps per SM: NOTES.md, session 23).
// Not the same bits as the bf16 build: x is rounded as the int8 GEMVs round it (gemv_int4.cuh).
//
// Epilogues. o_proj and down add y into the residual as the GEMV's residual epilogue does (bf16(bf16(y)
// + resid)) and write the new residual's sums of squares per row and 128 columns, stats [M, H / 128],
// as the GEMV's residual epilogue does (what the norm prologue of gate_up here, and of the next layer's
// qkv GEMV, reads: one load per lane): each pair's sum (a 16-lane butterfly) goes to pair_stats, and the
// last of a 128-column block's 8 pairs to finish (a counter per block) adds the 8 in pair order.
// gate_up stores bf16(y). No bias (Qwen2's o_proj, gate_up and down have none).
#pragma once
#include "gemv_int4.cuh"
#include "mbarrier.cuh"

namespace nq_block {
using namespace nq_gemv;

#ifndef NQ_BLOCK_WARPS
#define NQ_BLOCK_WARPS 16
#endif
#ifndef NQ_BLOCK_CHUNK
#define NQ_BLOCK_CHUNK 3
#endif
#ifndef NQ_BLOCK_RING
#define NQ_BLOCK_RING 3
#endif
#ifndef NQ_BLOCK_INT8_MMA
#define NQ_BLOCK_INT8_MMA 0
#endif
constexpr int WARPS = NQ_BLOCK_WARPS;
constexpr int THREADS = WARPS * 32;
constexpr int CHUNK = NQ_BLOCK_CHUNK;  // tile-columns per ring slot
constexpr int RING = NQ_BLOCK_RING;    // slots per warp
constexpr int TILE_BYTES = 512;
constexpr int SLOT_BYTES = 2 * CHUNK * TILE_BYTES;
constexpr bool I8 = NQ_BLOCK_INT8_MMA;  // the int8 tensor-core chunk step (header)
constexpr int MAX_M = 2;  // a pair's outputs, 16 rows x M, are one value per lane
constexpr int MAX_OPS = 4;  // o_proj, gate_up, down, and the next layer's qkv in the QKV kernels
// counters: op_done[MAX_OPS], the exit count, one arrival count per 128-column block of the residual
// (H <= 128 * MAX_STAT_BLOCKS), one per head of the qkv op (<= MAX_HEADS), then one per pair
constexpr int EXIT_COUNTER = MAX_OPS;
constexpr int BLOCK_COUNTERS = MAX_OPS + 1;
constexpr int MAX_STAT_BLOCKS = 128;
constexpr int HEAD_COUNTERS = BLOCK_COUNTERS + MAX_STAT_BLOCKS;
constexpr int MAX_HEADS = 256;
constexpr int PAIR_COUNTERS = HEAD_COUNTERS + MAX_HEADS;

struct Op {
  const uint4* qweight;
  const u16* scales;
  const u8* zeros;
  int N, K, KT, NP;  // NP = N / 16 tile pairs, KT = K / 128 tile-columns
  int T, W;          // T = NP * KT pair-columns, shared by warps 0 .. W - 1 of the grid
};

NQ_DEVICE Op make_op(const uint4* qw, const u16* s, const u8* z, int N, int K, int W) {
  return {qw, s, z, N, K, K / 128, N / 16, (N / 16) * (K / 128), W};
}

// First pair-column of warp gw's range (gw <= W; gw == W gives T).
NQ_DEVICE int range_start(const Op& o, int gw) { return (int)(((i64)o.T * gw) / o.W); }
// The warp whose range holds pair-column c.
NQ_DEVICE int range_owner(const Op& o, int c) { return (int)(((i64)(c + 1) * o.W - 1) / o.T); }
// The ws slot of warp gw's piece of pair p: 0 if its range starts inside p, else 1 (the range's end).
NQ_DEVICE int piece_slot(const Op& o, int gw, int p) { return range_start(o, gw) >= p * o.KT ? 0 : 1; }

// A warp's position in its stream of chunks over the ops: op (NOPS: past the end), the next
// chunk's pair p and first tile-column tc, and the pair-columns left of the warp's range in that op.
// Advanced by additions (a division only when it enters an op): it runs once per chunk, twice (the
// ring's issue cursor and the compute cursor).
struct Cursor {
  int op, p, tc, left;
  int kt;  // the op's K / 128, kept here: ops[] is in shared memory, behind every asm "memory" clobber
};

// Move c to its first op from c.op on with a non-empty range for warp gw.
template <int NOPS>
NQ_DEVICE void enter_op(Cursor& c, const Op* ops, int gw) {
  for (; c.op < NOPS; ++c.op) {
    const Op& o = ops[c.op];
    if (gw < o.W) {
      const int start = range_start(o, gw);
      c.left = range_start(o, gw + 1) - start;
      c.kt = o.KT;
      c.p = start / o.KT;
      c.tc = start - c.p * o.KT;
      if (c.left > 0) return;
    }
  }
}

// Tile-columns of the chunk at c (<= CHUNK; a chunk stays in one pair).
NQ_DEVICE int chunk_cols(const Cursor& c) { return min(min(CHUNK, c.kt - c.tc), c.left); }

template <int NOPS>
NQ_DEVICE void advance(Cursor& c, const Op* ops, int gw, int nc) {
  c.left -= nc;
  c.tc += nc;
  if (c.tc == c.kt) {
    c.tc = 0;
    ++c.p;
  }
  if (c.left == 0) {
    ++c.op;
    enter_op<NOPS>(c, ops, gw);
  }
}

// Lane 0: the chunk at c into ring slot `slot` (2 bulk copies, one per tile row; bytes posted on bar).
// A slot the warp has read from: every lane's fence_proxy_async_shared, then __syncwarp, first.
NQ_DEVICE void issue_chunk(const Cursor& c, const Op* ops, unsigned char* slot, unsigned long long* bar) {
  const int nc = chunk_cols(c);
  const unsigned char* src = reinterpret_cast<const unsigned char*>(ops[c.op].qweight) +
                             ((i64)(2 * c.p) * c.kt + c.tc) * TILE_BYTES;
  mbar_arrive_expect_tx(bar, 2 * nc * TILE_BYTES);
  bulk_copy_g2s(mbar_smem_addr(slot), src, nc * TILE_BYTES, bar);
  bulk_copy_g2s(mbar_smem_addr(slot + CHUNK * TILE_BYTES), src + (i64)c.kt * TILE_BYTES, nc * TILE_BYTES, bar);
}

// The scales (raw 16 bits, bf16 or fp16) and zero points of a chunk's tile-columns for the lane's rows
// g of tile 0 and tile 1 (G = 128: one group per tile-column).
struct ChunkScales {
  u32 s0[CHUNK], s1[CHUNK], z0[CHUNK], z1[CHUNK];
};

// scales / zeros: the op's tensors (zeros unused unless ASYM).
template <bool ASYM>
NQ_DEVICE void load_chunk_scales(ChunkScales& cs, const Cursor& c, const u16* scales, const u8* zeros, int g) {
  const int nc = chunk_cols(c);
  const i64 r0 = (i64)(16 * c.p + g) * c.kt + c.tc, r1 = r0 + 8 * (i64)c.kt;
#pragma unroll
  for (int j = 0; j < CHUNK; ++j) {
    if (j < nc) {
      cs.s0[j] = scales[r0 + j];
      cs.s1[j] = scales[r1 + j];
      if constexpr (ASYM) {
        cs.z0[j] = zeros[r0 + j];
        cs.z1[j] = zeros[r1 + j];
      } else {
        cs.z0[j] = cs.z1[j] = 0u;
      }
    }
  }
}

NQ_DEVICE int ld_acquire(const int* p) {
#ifdef NQ_HOST_EMU
  nq_emu::yield_maybe();
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
#else
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
#endif
}

struct BlockArgs {
  const bf16_t* attn;    // [M, Kq] (op 0's input)
  bf16_t* resid;         // [M, H], updated in place by ops 0 and 2
  bf16_t* gate_up;       // [M, 2I] (op 1's output, op 2's input)
  float* stats;          // [M, H / 128]: sums of squares of the new residual per 128 columns (ops 0, 2)
  float* pair_stats;     // [M, H / 16]: the same per pair (scratch)
  const bf16_t* norm_w;  // [H] the post-attention norm's weight
  float eps;
  float* ws;             // [warps in the grid, 2, 32] fp32 partials of cut pairs
  int* counters;         // [PAIR_COUNTERS + max NP], zero between launches
  int M;
  // the QKV kernels' op 3, the next layer's qkv: RMSNorm(resid) * in_norm_w @ Wqkv^T + bias, RoPE,
  // q to rk.q_out, K/V into the paged cache (the GEMV's qkv epilogue, rope_kv_write_pair)
  const bf16_t* in_norm_w;  // [H] the next layer's input norm
  const bf16_t* qkv_bias;   // [Nq] or null
  bf16_t* qkv_out;          // [M, Nq] bf16(y + bias) (scratch: a head's pairs meet there)
  RopeKV rk;
};

// A finished piece of pair p of op `op` (a0..a3: the warp's C fragment over the piece's tile-columns;
// whole: the piece is the whole pair). Adds the partials when the pair was cut, then the epilogue. Once
// per piece: not inlined, so that the chunk loop's code stays small (the arguments are plain values: a
// reference to the kernel's parameters would put them on a stack frame).
__device__ __noinline__ void finish_piece(const Op* ops, int op, int gw, int p, bool whole, float a0, float a1,
                                          float a2, float a3, float* ws, int* counters, bf16_t* resid,
                                          bf16_t* gate_up, float* stats, float* pair_stats, int M,
                                          const bf16_t* qkv_bias, bf16_t* qkv_out, RopeKV rk) {
  const Op& o = ops[op];
  const int lane = threadIdx.x & 31, m = lane >> 4, r = lane & 15;
  // lane (m, r) takes y[m][16 p + r]: lane 4 (r % 8) holds it in a[(r >= 8) * 2 + m] (C fragment, t = 0)
  const int src = 4 * (r & 7);
  const float v0 = __shfl_sync(0xffffffffu, a0, src), v1 = __shfl_sync(0xffffffffu, a1, src);
  const float v2 = __shfl_sync(0xffffffffu, a2, src), v3 = __shfl_sync(0xffffffffu, a3, src);
  float y = r < 8 ? (m == 0 ? v0 : v1) : (m == 0 ? v2 : v3);
  const bool mine = m < M;
  if (!whole) {
    ws[((i64)gw * 2 + piece_slot(o, gw, p)) * 32 + lane] = y;
    __threadfence();
    __syncwarp();
    const int first = range_owner(o, p * o.KT), pieces = range_owner(o, (p + 1) * o.KT - 1) - first + 1;
    int last = 0;
    if (lane == 0) last = atomicAdd(&counters[PAIR_COUNTERS + p], 1) == pieces - 1;
    if (!__shfl_sync(0xffffffffu, last, 0)) return;
    __threadfence();
    // the partials in k order, 8 loads in flight
    y = 0.f;
    for (int j0 = 0; j0 < pieces; j0 += 8) {
      float part[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int gj = first + j0 + j;
        part[j] = j0 + j < pieces ? ld_cg_f32(ws + ((i64)gj * 2 + piece_slot(o, gj, p)) * 32 + lane) : 0.f;
      }
#pragma unroll
      for (int j = 0; j < 8; ++j)
        if (j0 + j < pieces) y += part[j];
    }
    if (lane == 0) counters[PAIR_COUNTERS + p] = 0;  // ready for the next launch
  }
  const int n = 16 * p + r;
  if (op == 1) {
    if (mine) gate_up[(i64)m * o.N + n] = f32_to_bf16(y);
  } else if (op == 3) {
    // bf16(y + bias) as the GEMV's qkv epilogue stores it; the last of a head's D / 16 pairs to finish
    // (a counter per head) applies RoPE / the K/V write to the whole head
    if (mine) qkv_out[(i64)m * o.N + n] = f32_to_bf16(y + (qkv_bias ? bf16_to_f32(qkv_bias[n]) : 0.f));
    __threadfence();
    __syncwarp();
    const int D = rk.D, half = D / 2, h = 16 * p / D;
    int last = 0;
    if (lane == 0) last = atomicAdd(&counters[HEAD_COUNTERS + h], 1) == D / 16 - 1;
    if (__shfl_sync(0xffffffffu, last, 0)) {
      __threadfence();
      for (int idx = lane; idx < M * half; idx += 32) {
        const int mm = idx / half, c = idx - mm * half;
        const bf16_t* head = qkv_out + (i64)mm * o.N + h * D;
        rope_kv_write_pair(rk, mm, h, c, ld_cg_bf16(head + c), ld_cg_bf16(head + c + half));
      }
      if (lane == 0) counters[HEAD_COUNTERS + h] = 0;  // ready for the next launch
    }
  } else {
    float sq = 0.f;
    if (mine) {
      bf16_t* q = resid + (i64)m * o.N + n;
      const bf16_t nr = f32_to_bf16(bf16_to_f32(f32_to_bf16(y)) + bf16_to_f32(ld_cg_bf16(q)));
      *q = nr;
      sq = bf16_to_f32(nr) * bf16_to_f32(nr);
    }
#pragma unroll
    for (int off = 8; off > 0; off >>= 1) sq += __shfl_xor_sync(0xffffffffu, sq, off);  // within 16 lanes
    if (mine && r == 0) pair_stats[(i64)m * o.NP + p] = sq;
    __threadfence();
    __syncwarp();
    // the 128-column block's 8 pairs (N % 128 == 0 here): the last to finish writes the block's sum
    const int b = p >> 3;
    int last = 0;
    if (lane == 0) last = atomicAdd(&counters[BLOCK_COUNTERS + b], 1) == 7;
    if (__shfl_sync(0xffffffffu, last, 0)) {
      __threadfence();
      if (lane < M) {
        float part[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) part[i] = ld_cg_f32(pair_stats + (i64)lane * o.NP + 8 * b + i);
        float sum = 0.f;
#pragma unroll
        for (int i = 0; i < 8; ++i) sum += part[i];
        stats[(i64)lane * (o.N / 128) + b] = sum;
      }
      if (lane == 0) counters[BLOCK_COUNTERS + b] = 0;  // ready for the next op and launch
    }
  }
  __threadfence();
  __syncwarp();
  if (lane == 0) atomicAdd(&counters[op], 1);
}

template <bool ASYM, typename ST, bool QKV>
NQ_DEVICE void post_attention_block(const BlockArgs& a, Op op0, Op op1, Op op2, Op op3) {
  constexpr int NOPS = QKV ? 4 : 3;
  NQ_DYNAMIC_SMEM(smem_raw, 128);
  __shared__ Op ops[MAX_OPS];
  __shared__ __align__(8) unsigned long long full[WARPS][RING];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int gw = blockIdx.x * WARPS + warp;
  const int M = a.M;
  if (threadIdx.x == 0) {
    ops[0] = op0;
    ops[1] = op1;
    ops[2] = op2;
    ops[3] = op3;
    for (int i = 0; i < WARPS * RING; ++i) mbar_init(&full[i / RING][i % RING], 1);
    mbar_fence_init();
  }
  __syncthreads();
  unsigned char* ring = smem_raw + warp * RING * SLOT_BYTES;
  bf16_t* xs = reinterpret_cast<bf16_t*>(smem_raw + WARPS * RING * SLOT_BYTES);

  // The weight stream: the first RING chunks now; each later one when its slot frees up.
  Cursor ic{0, 0, 0, 0, 0};
  enter_op<NOPS>(ic, ops, gw);
  Cursor cc = ic;  // the chunk to compute next
  for (int s = 0; s < RING && ic.op < NOPS; ++s) {
    if (lane == 0) issue_chunk(ic, ops, ring + s * SLOT_BYTES, &full[warp][s]);
    advance<NOPS>(ic, ops, gw, chunk_cols(ic));
  }
  ChunkScales next;
  if (cc.op < NOPS) load_chunk_scales<ASYM>(next, cc, ops[cc.op].scales, ops[cc.op].zeros, g);
  // Only weights so far. Under PDL (common.cuh) this ran under the previous kernel's tail; from here on
  // the kernel reads what that kernel wrote (attn, the residual) and writes.
  pdl_wait();
  const u32 c3 = 0xC3u | ((u32)(M + lane) << 8);  // neg_zero_pair_byte's register (gemv_int4)
  int chunk = 0;  // chunks computed by this warp

  for (int op = 0; op < NOPS; ++op) {
    const Op& o = ops[op];
    // A CTA with no work in this op skips it: it neither waits nor stages. (Staging it late could read
    // the residual or the statistics after a later op of other CTAs rewrote them.)
    if (blockIdx.x * WARPS >= o.W) continue;
    // The op's input, whole, into xs (after every warp is done with the previous op's).
    __syncthreads();
    if (op > 0) {
      if (threadIdx.x == 0) {
        const int need = ops[op - 1].NP;
        while (ld_acquire(&a.counters[op - 1]) < need) __nanosleep(32);
      }
      __syncthreads();
    }
    const int xs_stride = o.K + XPAD;
    // (ops 1-3 read what other CTAs wrote in this launch: past L1, which may hold older lines of it)
    const int stat_blocks = ops[0].N / 128;
    if (op == 0) stage_x<0>(xs, xs_stride, a.attn, M, o.K, 0, o.K);
    else if (op == 1) stage_x_normed<true>(xs, xs_stride, a.resid, M, o.K, 0, o.K, NormIn{a.norm_w, a.stats, a.eps, stat_blocks});
    else if (op == 2) stage_x<1, true>(xs, xs_stride, a.gate_up, M, o.K, 0, o.K);
    else stage_x_normed<true>(xs, xs_stride, a.resid, M, o.K, 0, o.K, NormIn{a.in_norm_w, a.stats, a.eps, stat_blocks});
    __syncthreads();
    // I8: the planes over the staged x, the table after it (block.py's BlockBuild.shared_bytes)
    const u32* tabt = reinterpret_cast<const u32*>(xs + M * xs_stride) + 4 * t;  // the lane's rows m = 2t, 2t + 1
    if constexpr (I8) {
      stage_x_planes(xs, xs_stride, M, o.K, reinterpret_cast<u32*>(xs + M * xs_stride));
      __syncthreads();
    }

    const bf16_t* xsl = xs + min(g, M - 1) * xs_stride + 8 * t;
    const int kt = o.KT;
    const u16* scales = o.scales;  // in registers for the op's chunks (ops[] is behind asm clobbers)
    const u8* zeros = o.zeros;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    bool piece_from_0 = cc.tc == 0;  // the current piece starts at its pair's first tile-column
    while (cc.op == op) {
      const int p = cc.p, tc = cc.tc, nc = chunk_cols(cc);
      const bool piece_ends = tc + nc == kt || nc == cc.left;  // its pair, or the warp's range, ends
      const ChunkScales cur = next;
      advance<NOPS>(cc, ops, gw, nc);
      if (cc.op == op) load_chunk_scales<ASYM>(next, cc, scales, zeros, g);
      else if (cc.op < NOPS) load_chunk_scales<ASYM>(next, cc, ops[cc.op].scales, ops[cc.op].zeros, g);
      const int s = chunk % RING;
#ifdef NQ_BLOCK_STRESS_DELAY_NS
      // Test builds (test_block.py): a pseudo-random pause per chunk, so that pieces arrive, counters
      // fill and CTAs wait in other orders than the natural one. The outputs must not change.
      __nanosleep(((u32)(gw * 40503 + chunk * 2654435761u) >> 7) % NQ_BLOCK_STRESS_DELAY_NS);
#endif
      mbar_wait(&full[warp][s], (chunk / RING) & 1);
      const unsigned char* slot = ring + s * SLOT_BYTES + lane * 16;
#pragma unroll
      for (int j = 0; j < CHUNK; ++j) {
        if (j < nc) {
          const uint4 w0 = *reinterpret_cast<const uint4*>(slot + j * TILE_BYTES);
          const uint4 w1 = *reinterpret_cast<const uint4*>(slot + (CHUNK + j) * TILE_BYTES);
          if constexpr (I8)
            mma_col_int8(acc, w0, w1, ST::to_f32((u16)cur.s0[j]), ST::to_f32((u16)cur.s1[j]),
                         ASYM ? (int)cur.z0[j] : 8, ASYM ? (int)cur.z1[j] : 8, xsl + (tc + j) * 128,
                         tabt + (tc + j) * PLANE_TAB_WORDS);
          else
            mma_tile_column<128, ASYM, ST>(acc, w0, w1, cur.s0[j], cur.s1[j], cur.z0[j], cur.z1[j],
                                           xsl + (tc + j) * 128, c3);
        }
      }
      fence_proxy_async_shared();  // this lane's reads of the slot before the copy that refills it
      __syncwarp();
      if (ic.op < NOPS) {
        if (lane == 0) issue_chunk(ic, ops, ring + s * SLOT_BYTES, &full[warp][s]);
        advance<NOPS>(ic, ops, gw, chunk_cols(ic));
      }
      ++chunk;
      if (piece_ends) {
        finish_piece(ops, op, gw, p, piece_from_0 && tc + nc == kt, acc[0], acc[1], acc[2], acc[3], a.ws,
                     a.counters, a.resid, a.gate_up, a.stats, a.pair_stats, M, a.qkv_bias, a.qkv_out, a.rk);
        acc[0] = acc[1] = acc[2] = acc[3] = 0.f;
        piece_from_0 = true;  // the next piece, if any in this op, starts a pair
      }
    }
  }

  pdl_launch_dependents();
  // The last CTA out resets the op counters (every CTA is past its last wait).
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(&a.counters[EXIT_COUNTER], 1) == (int)gridDim.x - 1) {
      for (int i = 0; i < MAX_OPS; ++i) a.counters[i] = 0;
      a.counters[EXIT_COUNTER] = 0;
      __threadfence();
    }
  }
}

}  // namespace nq_block
