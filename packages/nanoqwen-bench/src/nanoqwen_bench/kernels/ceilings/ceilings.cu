// ceilings.cu: the decode-ceiling measurement kernels (nanoqwen_bench.kernels.decode_ceilings runs them;
// its docstring says what each number means). Not model kernels: nothing in the package
// includes this file. Built by NVRTC for sm_90a with the package's csrc/ on the include path, so the
// GEMV compute loop below uses the very helpers of csrc/gemv_int4.cuh (dq, mma_bf16, stage_x, ...).
//
// 1. Launch cost in a replayed graph
//    empty_kernel / empty_kernel_args8   no work (the second takes 8 arguments like our GEMV launches)
//    dep_increment                       thread 0 of block 0 does counter[0] += 1: a real read-after-write
//                                        dependency from each kernel to the next (the final count checks
//                                        that every node ran)
//    stamp_kernel                        each block's thread 0 folds %globaltimer at its start into
//                                        stamps[2i] (atomicMin) and at its end into stamps[2i + 1]
//                                        (atomicMax): the timeline of N kernels, so the gap from one
//                                        kernel's last block to the next kernel's first block is read
//                                        directly
// 4. Streaming-read ceiling: reads a buffer once, returns the wrapping u32 sum of its words in *sink
//    (atomicAdd per warp: order-independent, checked against torch's int64 sum mod 2^32)
//    stream_bulk_ring    persistent CTAs; warp 0's lane 0 is the producer: it streams the CTA's chunks
//                        (chunk b, b + G, b + 2G, ... of `chunk_bytes` each) with cp.async.bulk (the 1D
//                        TMA bulk copy) into a ring of `stages` shared-memory slots, each completing on
//                        a `full` mbarrier (expect_tx); warps 1.. are consumers: they wait on `full`,
//                        read the slot with 16-byte LDS, sum it, and arrive on the slot's `empty`
//                        mbarrier (count = consumer warps), which the producer waits on before reuse.
//                        Bytes in flight per SM = CTAs per SM x stages x chunk_bytes.
//    stream_vec_u{U}     plain 16-byte non-coherent loads (ld_stream_v4, as the GEMV's weight loads):
//                        each thread issues U independent loads before the first use. Bytes in flight
//                        per SM = threads per SM x U x 16.
// 5. GEMV compute ceiling
//    gemv_compute_g128_{sym,asym}  the inner loop of gemv_int4 (G = 128, U = 1, the same two-stage
//                        ping-pong of load(B) / compute(A) / load(A) / compute(B) and the same
//                        per-tile-column fragment math: dq (lop3 + bf16x2 fma), 2 mma.m16n8k16 per
//                        32-column word, the scale fma), but its "loads" are 16-byte LDS from a weight
//                        tile held in shared memory (KC tile-columns, walked `reps` times) instead of
//                        LDG from HBM: the rate it reaches is the most the dequant + mma path can
//                        consume, in weight bytes per second.
//    gemv_compute_g128_{sym,asym}_v2[u1]  the same arithmetic with fewer instructions per tile-column
//                        (gemv_loop_v2.cuh): x rows >= M not masked, 2 (v2) or 1 (v2u1) tile-columns per
//                        loop trip at constant offsets; outputs bit for bit those of the kernels above
#include "gemv_int4.cuh"
#include "gemv_loop_v2.cuh"

using namespace nq_gemv;

NQ_DEVICE u64 global_ns() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

NQ_DEVICE u32 warp_sum_u32(u32 v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

NQ_DEVICE u32 sum4(uint4 v) { return v.x + v.y + v.z + v.w; }

// ---------------------------------------------------------------------------------------------------
// 1. launch cost
// ---------------------------------------------------------------------------------------------------

extern "C" __global__ void empty_kernel() {}

extern "C" __global__ void empty_kernel_args8(u64 a0, u64 a1, u64 a2, u64 a3, u64 a4, u64 a5, int n0,
                                              int n1) {}

extern "C" __global__ void dep_increment(u32* counter) {
  if (blockIdx.x == 0 && threadIdx.x == 0) counter[0] += 1u;
}

// stamps: u64 [2N], set to (~0, 0) pairs before the replay that is read.
extern "C" __global__ void stamp_kernel(u64* stamps, int i) {
  if (threadIdx.x == 0) atomicMin(&stamps[2 * i], global_ns());
  __syncthreads();
  if (threadIdx.x == 0) atomicMax(&stamps[2 * i + 1], global_ns());
}

// ---------------------------------------------------------------------------------------------------
// 4a. cp.async.bulk ring (TMA 1D bulk copies, mbarrier pipeline)
// ---------------------------------------------------------------------------------------------------

constexpr int RING_MAX_STAGES = 32;

NQ_DEVICE u32 smem_addr(const void* p) { return (u32)__cvta_generic_to_shared(p); }

NQ_DEVICE void mbar_init(u32 bar, u32 count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
NQ_DEVICE void mbar_expect_tx(u32 bar, u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
NQ_DEVICE void mbar_arrive(u32 bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
NQ_DEVICE bool mbar_try_wait(u32 bar, u32 parity) {
  u32 ok;
  asm volatile(
      "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
      : "=r"(ok)
      : "r"(bar), "r"(parity)
      : "memory");
  return ok != 0;
}
NQ_DEVICE void mbar_wait(u32 bar, u32 parity) {
  while (!mbar_try_wait(bar, parity)) {
  }
}
NQ_DEVICE void bulk_copy_g2s(u32 dst, const void* src, u32 bytes, u32 bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

// grid: persistent CTAs; block: 32 x (1 + consumer warps), at most 8 warps; dynamic shared memory:
// stages x chunk_bytes. data: n_chunks x chunk_bytes bytes (chunk_bytes a multiple of 16, data 16-byte
// aligned). sink: one u32, += the sum of every u32 word read.
extern "C" __global__ void __launch_bounds__(256) stream_bulk_ring(const unsigned char* __restrict__ data,
                                                                   u32 n_chunks, u32 chunk_bytes, int stages,
                                                                   u32* __restrict__ sink) {
  extern __shared__ __align__(128) unsigned char ring[];
  __shared__ __align__(8) u64 full[RING_MAX_STAGES];
  __shared__ __align__(8) u64 empty[RING_MAX_STAGES];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int consumers = (int)(blockDim.x >> 5) - 1;
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      mbar_init(smem_addr(&full[s]), 1);
      mbar_init(smem_addr(&empty[s]), consumers);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const u32 first = blockIdx.x, step = gridDim.x;
  const u32 mine = first < n_chunks ? (n_chunks - first + step - 1) / step : 0;
  u32 acc = 0;
  if (warp == 0) {
    if (lane == 0) {
      int s = 0;
      u32 k = 0;  // how many times slot s has been filled before
      for (u32 i = 0; i < mine; ++i) {
        if (k > 0) mbar_wait(smem_addr(&empty[s]), (k - 1) & 1u);
        const u32 bar = smem_addr(&full[s]);
        mbar_expect_tx(bar, chunk_bytes);
        bulk_copy_g2s(smem_addr(ring + (size_t)s * chunk_bytes), data + (u64)(first + i * step) * chunk_bytes,
                      chunk_bytes, bar);
        if (++s == stages) {
          s = 0;
          ++k;
        }
      }
    }
  } else {
    const u32 ct = threadIdx.x - 32, nct = (u32)consumers * 32, nvec = chunk_bytes / 16;
    int s = 0;
    u32 k = 0;
    for (u32 i = 0; i < mine; ++i) {
      mbar_wait(smem_addr(&full[s]), k & 1u);
      const uint4* src = reinterpret_cast<const uint4*>(ring + (size_t)s * chunk_bytes);
      for (u32 v = ct; v < nvec; v += nct) acc += sum4(src[v]);
      __syncwarp();
      if (lane == 0) mbar_arrive(smem_addr(&empty[s]));
      if (++s == stages) {
        s = 0;
        ++k;
      }
    }
  }
  acc = warp_sum_u32(acc);
  if (lane == 0 && warp > 0) atomicAdd(sink, acc);
}

// ---------------------------------------------------------------------------------------------------
// 4b. plain 16-byte loads, U in flight per thread
// ---------------------------------------------------------------------------------------------------

template <int U>
NQ_DEVICE void stream_vec(const uint4* __restrict__ data, u64 n_vec, u32* __restrict__ sink) {
  const u64 T = (u64)gridDim.x * blockDim.x;
  u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
  u32 acc = 0;
  for (; i + (U - 1) * T < n_vec; i += U * T) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = ld_stream_v4(data + i + u * T);
#pragma unroll
    for (int u = 0; u < U; ++u) acc += sum4(v[u]);
  }
  for (; i < n_vec; i += T) acc += sum4(ld_stream_v4(data + i));
  acc = warp_sum_u32(acc);
  if ((threadIdx.x & 31) == 0) atomicAdd(sink, acc);
}

// block 512; grid = SMs x CTAs per SM. U <= 12 fit two CTAs of 512 per SM (<= 64 registers).
#define NQ_STREAM_VEC(U, MINB)                                                                        \
  extern "C" __global__ void __launch_bounds__(512, MINB)                                            \
      stream_vec_u##U(const uint4* __restrict__ data, u64 n_vec, u32* __restrict__ sink) {          \
    stream_vec<U>(data, n_vec, sink);                                                                \
  }
NQ_STREAM_VEC(2, 2)
NQ_STREAM_VEC(4, 2)
NQ_STREAM_VEC(6, 2)
NQ_STREAM_VEC(8, 2)
NQ_STREAM_VEC(12, 2)
NQ_STREAM_VEC(16, 1)
NQ_STREAM_VEC(24, 1)

// ---------------------------------------------------------------------------------------------------
// 5. the GEMV's compute loop on weights resident in shared memory
// ---------------------------------------------------------------------------------------------------
//
// Block: 8 warps, warp w owns the tile pair (2w, 2w + 1) of a 128-row, K = 128 x KC weight (the same
// weight for every block, so every block's output must be identical). Shared memory, in order:
//   wsm  uint4 [8 warps][KC][2 tiles][32 lanes]    (the lane's 16 bytes of each tile, as it would load)
//   ssm  u16   [8 warps][KC][2 tiles][8 rows g]    (bf16 scale of row g of the tile, group = tile-column)
//   zsm  u8    [8 warps][KC][2 tiles][8 rows g]    (zero points; asym only)
//   xs   bf16  [M][KC * 128 + XPAD]                (stage_x's permuted copy of x, as gemv_int4)
// total: KC x 8 KB + KC x 256 B + KC x 128 B + M x (KC x 128 + 32) x 2 B.
// The loop walks total = reps x KC tile-columns (index i, tile-column i & (KC - 1): KC is a power of
// two), so no load is loop-invariant. out: fp32 [gridDim.x][M][128], every block writes its result.
// qweight/scales/zeros: the weight in the package layout (int4-g128-tile8x128-v1), N = 128, K = 128 KC.
// The compute kernels' weights in shared memory: the 16 tiles (8 warps' tile pairs) x KC tile-columns of
// the global [16, KC, 32 lanes] words, laid out [warp][tc][tile of the pair][lane] (uint4 each).
NQ_DEVICE void fill_weight_tiles(uint4* wsm, const uint4* __restrict__ qweight, int KC) {
  for (int idx = threadIdx.x; idx < 16 * KC * 32; idx += blockDim.x) {  // 16 tiles x KC x 32 lanes
    const int l = idx & 31, tc = (idx >> 5) % KC, tile = (idx >> 5) / KC;
    wsm[((tile >> 1) * KC + tc) * 64 + (tile & 1) * 32 + l] = qweight[((i64)tile * KC + tc) * 32 + l];
  }
}

// The compute kernels' output: block b's fp32 [M, 128] at out + b * M * 128; lane (g, t) of warp w
// holds y[2t, 2t + 1] of rows 16 w + g (acc[0..1]) and 16 w + g + 8 (acc[2..3]).
NQ_DEVICE void store_compute_out(const float (&acc)[4], float* __restrict__ out, int M, int warp, int g,
                                  int t) {
  float* o = out + (i64)blockIdx.x * M * 128;
  const int row0 = 16 * warp + g, row1 = row0 + 8, m0 = 2 * t, m1 = 2 * t + 1;
  if (m0 < M) {
    o[m0 * 128 + row0] = acc[0];
    o[m0 * 128 + row1] = acc[2];
  }
  if (m1 < M) {
    o[m1 * 128 + row0] = acc[1];
    o[m1 * 128 + row1] = acc[3];
  }
}

template <bool ASYM>
NQ_DEVICE void gemv_compute(const uint4* __restrict__ qweight, const u16* __restrict__ scales,
                            const u8* __restrict__ zeros, const bf16_t* __restrict__ x, float* __restrict__ out,
                            int M, int KC, int reps) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  uint4* wsm = reinterpret_cast<uint4*>(smem_raw);
  u16* ssm = reinterpret_cast<u16*>(smem_raw + (size_t)KC * 8192);
  u8* zsm = smem_raw + (size_t)KC * (8192 + 256);
  bf16_t* xs = reinterpret_cast<bf16_t*>(smem_raw + (size_t)KC * (8192 + 256 + 128));
  const int K = KC * 128, xs_stride = K + XPAD;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;

  // fill shared memory from the global weight (once; not part of the timed difference)
  fill_weight_tiles(wsm, qweight, KC);
  for (int idx = threadIdx.x; idx < 128 * KC; idx += blockDim.x) {  // rows x groups
    const int row = idx / KC, tc = idx - row * KC, tile = row >> 3, gg = row & 7;
    const int dst = (((tile >> 1) * KC + tc) * 2 + (tile & 1)) * 8 + gg;
    ssm[dst] = scales[(i64)row * KC + tc];
    if (ASYM) zsm[dst] = zeros[(i64)row * KC + tc];
  }
  stage_x<0>(xs, xs_stride, x, M, K, 0, K);
  __syncthreads();

  const uint4* wl = wsm + warp * KC * 64 + lane;
  const u16* sl = ssm + warp * KC * 16 + g;
  const u8* zl = zsm + warp * KC * 16 + g;
  const int kmask = KC - 1;
  struct St {
    uint4 w0, w1;
    u32 s0, s1, z0, z1;
  };
  auto load = [&](St& st, int i) {
    const int tc = i & kmask;
    st.w0 = wl[tc * 64];
    st.w1 = wl[tc * 64 + 32];
    st.s0 = (u32)sl[tc * 16];
    st.s1 = (u32)sl[tc * 16 + 8];
    if constexpr (ASYM) {
      st.z0 = (u32)zl[tc * 16];
      st.z1 = (u32)zl[tc * 16 + 8];
    } else {
      st.z0 = st.z1 = 0u;
    }
  };

  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  const bool xrow = g < M;
  const bf16_t* xsl = xs + g * xs_stride + 8 * t;
  // gemv_int4's compute_col for G = 128 (GPT = 1) before the masked-row fix (x rows g >= M masked to
  // zero), with today's shared `dq` (add.rn.bf16x2, the same bits as the fma by 1.0 it replaced): the
  // v1 that the v2 loops are checked against and measured over
  auto compute_col = [&](const St& st, int i) {
    const bf16_t* xt = xsl + (i & kmask) * 128;
    const u32 w0[4] = {st.w0.x, st.w0.y, st.w0.z, st.w0.w};
    const u32 w1[4] = {st.w1.x, st.w1.y, st.w1.z, st.w1.w};
    u32 nz0, nz1;
    if constexpr (ASYM) {
      nz0 = neg_zero_pair(st.z0 & 0xffu);
      nz1 = neg_zero_pair(st.z1 & 0xffu);
    } else {
      nz0 = nz1 = neg_zero_pair(8u);
    }
    float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      uint4 b = make_uint4(0, 0, 0, 0);
      if (xrow) b = *reinterpret_cast<const uint4*>(xt + 32 * w);
      mma_bf16(c, dq(w0[w], 0, nz0), dq(w1[w], 0, nz1), dq(w0[w], 1, nz0), dq(w1[w], 1, nz1), b.x, b.y);
      mma_bf16(c, dq(w0[w], 2, nz0), dq(w1[w], 2, nz1), dq(w0[w], 3, nz0), dq(w1[w], 3, nz1), b.z, b.w);
    }
    const float sc0 = ScaleBF16::to_f32((u16)st.s0);
    const float sc1 = ScaleBF16::to_f32((u16)st.s1);
    acc[0] = fmaf(c[0], sc0, acc[0]);
    acc[1] = fmaf(c[1], sc0, acc[1]);
    acc[2] = fmaf(c[2], sc1, acc[2]);
    acc[3] = fmaf(c[3], sc1, acc[3]);
  };

  const int total = reps * KC;  // even: KC >= 2
  St A, B;
  load(A, 0);
  for (int base = 0; base < total; base += 2) {
    load(B, base + 1);
    compute_col(A, base);
    load(A, base + 2);
    compute_col(B, base + 1);
  }

  store_compute_out(acc, out, M, warp, g, t);
}

// 4 blocks of 8 warps per SM, like gemv_int4_g128_sym (64 registers).
extern "C" __global__ void __launch_bounds__(256, 4)
    gemv_compute_g128_sym(const uint4* __restrict__ qweight, const u16* __restrict__ scales,
                          const u8* __restrict__ zeros, const bf16_t* __restrict__ x, float* __restrict__ out,
                          int M, int KC, int reps) {
  gemv_compute<false>(qweight, scales, zeros, x, out, M, KC, reps);
}
extern "C" __global__ void __launch_bounds__(256, 4)
    gemv_compute_g128_asym(const uint4* __restrict__ qweight, const u16* __restrict__ scales,
                           const u8* __restrict__ zeros, const bf16_t* __restrict__ x, float* __restrict__ out,
                           int M, int KC, int reps) {
  gemv_compute<true>(qweight, scales, zeros, x, out, M, KC, reps);
}

// ---------------------------------------------------------------------------------------------------
// 5b. the same loop with fewer instructions per tile-column (gemv_loop_v2.cuh says what changes and
//     why the result is bit-for-bit that of gemv_compute_g128_*: the GPU check compares them)
// ---------------------------------------------------------------------------------------------------
//
// Same arguments, grid, block and dynamic shared memory size as gemv_compute, but KC must be V2_KC
// (the layout's offsets are compile-time; another KC poisons the output with NaN). Shared memory:
//   wsm  uint4 [8 warps][KC][2 tiles][32 lanes]       as gemv_compute
//   szm  one record of 3 KC bytes per weight row r = 16 warp + 8 tile + g: [KC bf16 scales][KC zeros]
//        (each row's tile-columns in order, as the package's [N, K / 128] scales and zeros; the zeros
//        at a constant offset from the scales, so one address serves both), KC x 384 bytes in all
//   xs   bf16  [M][KC * 128 + XPAD]                   as gemv_compute
// The loop walks total = reps x KC tile-columns, U per trip (tile-columns (i & (KC - 1)) .. + U - 1):
// each trip derives its 3 shared addresses from i, every load at a constant offset. `_v2`: U = 2,
// `_v2u1`: U = 1 (fewer live registers: 46 against the 64 of U = 2, which spills a little in asym).
constexpr int V2_KC = 4;  // the KC the v2 kernels are built for (ceilings_micro.COMPUTE_KC)

template <bool ASYM, int U>
NQ_DEVICE void gemv_compute_v2(const uint4* __restrict__ qweight, const u16* __restrict__ scales,
                               const u8* __restrict__ zeros, const bf16_t* __restrict__ x,
                               float* __restrict__ out, int M, int KC, int reps) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  constexpr int REC = 3 * V2_KC;  // bytes per row record: scales, then zeros
  uint4* wsm = reinterpret_cast<uint4*>(smem_raw);
  unsigned char* szm = smem_raw + (size_t)KC * 8192;
  bf16_t* xs = reinterpret_cast<bf16_t*>(smem_raw + (size_t)KC * (8192 + 256 + 128));
  const int K = KC * 128, xs_stride = K + XPAD;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;

  fill_weight_tiles(wsm, qweight, KC);
  if (KC == V2_KC) {
    for (int idx = threadIdx.x; idx < 128 * V2_KC; idx += blockDim.x) {  // rows x groups
      const int row = idx / V2_KC, tc = idx - row * V2_KC;
      reinterpret_cast<u16*>(szm + row * REC)[tc] = scales[idx];
      if (ASYM) szm[row * REC + 2 * V2_KC + tc] = zeros[idx];
    }
  }
  stage_x<0>(xs, xs_stride, x, M, K, 0, K);
  __syncthreads();

  // 32-bit shared addresses of tile-column 0; tile-column tc adds tc x (1024, 2, 1, 256) bytes to the
  // weights, scales, zeros, x
  const u32 wa = smem_addr(wsm + warp * KC * 64 + lane);
  const u32 sa = smem_addr(szm + (warp * 16 + g) * REC);
  // rows g >= M read row M - 1: their mma columns n = g >= M are never written (gemv_loop_v2.cuh, 1.)
  const u32 xa = smem_addr(xs + min(g, M - 1) * xs_stride + 8 * t);
  // PRMT reads only byte 0 of c3 (0xC3). The rest is M + lane, so that c3 is a per-lane register: a
  // literal would become the PRMTs' immediate (their byte selectors then go to registers), a
  // warp-uniform value a uniform register (copied to a vector register before each PRMT).
  const u32 c3 = 0xC3u | ((u32)(M + lane) << 8);
  const int kmask = KC - 1;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  // i runs from -total to 0 (no register for the bound); total is a multiple of KC, so i & (KC - 1)
  // is still the tile-column, in the same order
  for (int i = -reps * KC; i < 0; i += U) {
    const u32 tc = i & kmask;
    nq_gemv_v2::tile_columns<U, ASYM, 8 * REC, 2 * V2_KC>(acc, wa + tc * 1024, sa + tc * 2, sa + tc,
                                                          xa + tc * 256, c3);
  }
  // checked after the loop, so that the compiler cannot assume KC == V2_KC inside it
  if (KC != V2_KC) acc[0] = acc[1] = acc[2] = acc[3] = __int_as_float(0x7fc00000);

  store_compute_out(acc, out, M, warp, g, t);
}

#define NQ_COMPUTE_V2(NAME, ASYM, U)                                                                    \
  extern "C" __global__ void __launch_bounds__(256, 4)                                                 \
      NAME(const uint4* __restrict__ qweight, const u16* __restrict__ scales, const u8* __restrict__ zeros, \
           const bf16_t* __restrict__ x, float* __restrict__ out, int M, int KC, int reps) {          \
    gemv_compute_v2<ASYM, U>(qweight, scales, zeros, x, out, M, KC, reps);                            \
  }
NQ_COMPUTE_V2(gemv_compute_g128_sym_v2, false, 2)
NQ_COMPUTE_V2(gemv_compute_g128_asym_v2, true, 2)
NQ_COMPUTE_V2(gemv_compute_g128_sym_v2u1, false, 1)
NQ_COMPUTE_V2(gemv_compute_g128_asym_v2u1, true, 1)
