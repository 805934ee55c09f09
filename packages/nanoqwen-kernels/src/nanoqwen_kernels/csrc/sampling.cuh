// sampling.cuh: next-token selection on the GPU from bf16 logits [B, V], V % 8 == 0 (16-byte loads;
// vocabularies are padded to a multiple of 8 or more), blocks of 1024 threads.
//
// Grid (B, C): the C blocks of a row each find the maximum of one contiguous chunk of it (pass 1
// below; about one 16-byte load per thread at V = 152064, C = 19), publish it, and count themselves
// on the row's arrival counter; the last to arrive takes the maximum of the C partials (a max, so the
// same whichever block is last), resets the counter for the next launch or graph replay, and finishes
// the row alone: greedy rows are done, sampled rows run the passes below over the whole row. One
// block per row had spent ~15 us streaming the row for the argmax alone.
//
// Greedy (temperature <= 0): argmax, ties to the lowest index (torch.argmax's rule); NaN never wins.
// Otherwise, in HF's order: temperature, top-k (0 = off), top-p (>= 1 = off) over the renormalised
// top-k distribution, then one inverse-CDF draw. No sort. Each bf16 logit maps to a 16-bit key whose
// unsigned order is the float order; thresholds keep ties, as HF's `scores < kth_value` masks do:
//   tau_k = the k-th largest key;
//   tau_p = the largest key whose tail mass sum(exp((l - lmax) / T) for keys >= tau_p) reaches
//           top_p of the mass above tau_k.
// Fast path: both thresholds almost always lie within 255 key steps (bf16 ulps) of the maximum, so a
// 255-bin histogram of the distance to the max key, filled by the few tokens that near (little
// atomic contention), gives them in one pass each. When a threshold lies deeper, an exact two-level
// radix select over the keys' high and low bytes takes over (slower: the high-byte bins are few and
// contended), so the result never depends on the fast path.
// Draw: u from Philox4x32-10 keyed by the row's 64-bit seed with counter (0, 0, offset); the row's
// int64 offset in device memory is incremented by every launch, so a replayed CUDA graph draws fresh
// numbers and (seed, offset) reproduces a draw. Each warp owns a contiguous chunk of the row; warp
// sums of the kept weights locate the warp holding u * Z, which rescans its chunk in index order.
// Cost per sampled row: 3-5 passes over 0.3 MB (V = 152064) from L2 by one SM; rows run in parallel.
#pragma once
#include "common.cuh"

namespace nq_sample {

constexpr int THREADS = 1024;
constexpr int MAX_CHUNKS = 32;  // blocks per row (sampling.py MAX_CHUNKS)
constexpr int WARPS = THREADS / 32;
constexpr int NEAR = 255;  // fast-path histogram bins: key distance 0 .. 254 below the max key

NQ_DEVICE u32 bf16_key(u32 b) {
  b &= 0xffffu;
  if ((b & 0x7fffu) > 0x7f80u) return 0u;  // NaN sorts below everything
  return (b & 0x8000u) ? (~b & 0xffffu) : (b | 0x8000u);
}

// (key, index) packed so that a larger u64 is a larger key, then a smaller index.
NQ_DEVICE u64 pack_best(u32 key, u32 idx) { return ((u64)key << 32) | (u64)(0xffffffffu - idx); }
NQ_DEVICE u32 best_index(u64 v) { return 0xffffffffu - (u32)(v & 0xffffffffu); }

NQ_DEVICE u64 warp_max_u64(u64 v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const u64 w = __shfl_xor_sync(0xffffffffu, v, o);
    v = w > v ? w : v;
  }
  return v;
}

struct Smem {
  float fbins[256];
  u32 ubins[256];
  u64 scratch64[WARPS];
  float scratchf[WARPS];
  float warp_mass[WARPS];
  int s_int;
  float s_float;
};

NQ_DEVICE u64 block_max_u64(u64 v, Smem& sm) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_max_u64(v);
  __syncthreads();
  if (lane == 0) sm.scratch64[warp] = v;
  __syncthreads();
  v = lane < WARPS ? sm.scratch64[lane] : 0ull;
  return warp_max_u64(v);
}

NQ_DEVICE float block_sum_f(float v, Smem& sm) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_sum(v);
  __syncthreads();
  if (lane == 0) sm.scratchf[warp] = v;
  __syncthreads();
  v = lane < WARPS ? sm.scratchf[lane] : 0.f;
  return warp_sum(v);
}

NQ_DEVICE void clear_bins(Smem& sm) {
  __syncthreads();
  for (int b = threadIdx.x; b < 256; b += blockDim.x) {
    sm.fbins[b] = 0.f;
    sm.ubins[b] = 0u;
  }
  __syncthreads();
}

// Apply f(index, bf16 bits) to every element, 8 per 16-byte load, four loads in flight per thread
// (one SM streams the row from L2: the loads must overlap).
// for_each_in: the same over the 16-byte vectors [v0, v1) of the row only.
template <typename F>
NQ_DEVICE void for_each_in(const bf16_t* row, int v0, int nvec, F f) {
  constexpr int DEPTH = 4;
  const uint4* rv = reinterpret_cast<const uint4*>(row);
  for (int v = v0 + threadIdx.x; v < nvec; v += DEPTH * THREADS) {
    uint4 a[DEPTH];
#pragma unroll
    for (int d = 0; d < DEPTH; ++d)
      if (v + d * THREADS < nvec) a[d] = rv[v + d * THREADS];
#pragma unroll
    for (int d = 0; d < DEPTH; ++d) {
      if (v + d * THREADS < nvec) {
        const int base = 8 * (v + d * THREADS);
        const u32 w[4] = {a[d].x, a[d].y, a[d].z, a[d].w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          f(base + 2 * i, w[i] & 0xffffu);
          f(base + 2 * i + 1, w[i] >> 16);
        }
      }
    }
  }
}

template <typename F>
NQ_DEVICE void for_each(const bf16_t* row, int V, F f) {
  for_each_in(row, 0, V / 8, f);
}

// Smallest bin index d (scanning d = 0, 1, ... i.e. from the largest keys down) whose cumulative
// count/mass reaches `target` and is non-empty; -1 if the bins 0..nbins-1 never reach it. `above`
// gets the cumulative value of bins before d. Run by thread 0 (nbins <= 256: cheap), broadcast.
template <typename T>
NQ_DEVICE int scan_bins(const T* bins, int nbins, T target, T* above, Smem& sm) {
  __syncthreads();
  if (threadIdx.x == 0) {
    T acc = 0;
    int found = -1;
    for (int d = 0; d < nbins; ++d) {
      if (bins[d] > 0 && acc + bins[d] >= target) {
        found = d;
        break;
      }
      acc += bins[d];
    }
    sm.s_int = found;
    sm.s_float = (float)acc;
  }
  __syncthreads();
  *above = (T)sm.s_float;
  return sm.s_int;
}

struct RowParams {
  float temperature;
  int top_k;
  float top_p;
  u64 seed;
  u64 offset;
};

// ---- pass 1: max key and its lowest index (the greedy answer) over vectors [v0, v1) of the row --------
NQ_DEVICE u64 chunk_best(const bf16_t* __restrict__ row, int v0, int v1, Smem& sm) {
  u64 best = 0;
  for_each_in(row, v0, v1, [&](int i, u32 b) {
    const u64 c = pack_best(bf16_key(b), (u32)i);
    best = c > best ? c : best;
  });
  return block_max_u64(best, sm);
}

// The row's token given `best`, the maximum of pass 1 over the whole row (block-uniform).
NQ_DEVICE int sample_row(const bf16_t* __restrict__ row, int V, RowParams p, u64 best, Smem& sm) {
  if (!(p.temperature > 0.f)) return (int)best_index(best);
  const u32 kmax = (u32)(best >> 32);
  const float lmax = bf16_to_f32((bf16_t)row[best_index(best)]);
  const float inv_t = 1.f / p.temperature;
  u32 tau = kmax >= 1u ? 1u : 0u;  // keep keys >= tau (key 0 = NaN is never kept unless all are NaN)
  if (kmax == 0u) return (int)best_index(best);

  // ---- top-k: tau_k = k-th largest key ------------------------------------------------------------
  if (p.top_k > 0 && p.top_k < V) {
    clear_bins(sm);
    for_each(row, V, [&](int, u32 b) {
      const u32 d = kmax - bf16_key(b);
      if (d < (u32)NEAR) atomicAdd(&sm.ubins[d], 1u);
    });
    u32 above;
    const int d = scan_bins<u32>(sm.ubins, NEAR, (u32)p.top_k, &above, sm);
    if (d >= 0) {
      tau = kmax - (u32)d;
    } else {  // exact two-level radix select over all keys
      clear_bins(sm);
      for_each(row, V, [&](int, u32 b) { atomicAdd(&sm.ubins[255 - (bf16_key(b) >> 8)], 1u); });
      const int hb = 255 - scan_bins<u32>(sm.ubins, 256, (u32)p.top_k, &above, sm);
      const u32 need = (u32)p.top_k - above;
      clear_bins(sm);
      for_each(row, V, [&](int, u32 b) {
        const u32 k = bf16_key(b);
        if ((int)(k >> 8) == hb) atomicAdd(&sm.ubins[255 - (k & 0xffu)], 1u);
      });
      const int lb = 255 - scan_bins<u32>(sm.ubins, 256, need, &above, sm);
      tau = max(tau, ((u32)hb << 8) | (u32)lb);
    }
  }

  // ---- top-p over the tempered distribution of keys >= tau ------------------------------------------
  if (p.top_p < 1.f) {
    clear_bins(sm);
    float z = 0.f;
    for_each(row, V, [&](int, u32 b) {
      const u32 k = bf16_key(b);
      if (k >= tau) {
        const float e = __expf((bf16_to_f32((bf16_t)b) - lmax) * inv_t);
        z += e;
        const u32 d = kmax - k;
        if (d < (u32)NEAR) atomicAdd(&sm.fbins[d], e);
      }
    });
    z = block_sum_f(z, sm);
    const float target = p.top_p * z;
    float above;
    const int d = scan_bins<float>(sm.fbins, NEAR, target, &above, sm);
    if (d >= 0) {
      tau = max(tau, kmax - (u32)d);
    } else {  // exact two-level radix select by mass
      clear_bins(sm);
      for_each(row, V, [&](int, u32 b) {
        const u32 k = bf16_key(b);
        if (k >= tau) atomicAdd(&sm.fbins[255 - (k >> 8)], __expf((bf16_to_f32((bf16_t)b) - lmax) * inv_t));
      });
      int hb = scan_bins<float>(sm.fbins, 256, target, &above, sm);
      hb = hb < 0 ? 0 : 255 - hb;  // rounding: the whole mass short of the target keeps everything
      const float need = target - above;
      clear_bins(sm);
      for_each(row, V, [&](int, u32 b) {
        const u32 k = bf16_key(b);
        if ((int)(k >> 8) == hb && k >= tau)
          atomicAdd(&sm.fbins[255 - (k & 0xffu)], __expf((bf16_to_f32((bf16_t)b) - lmax) * inv_t));
      });
      int lb = scan_bins<float>(sm.fbins, 256, need, &above, sm);
      lb = lb < 0 ? 0 : 255 - lb;
      tau = max(tau, ((u32)hb << 8) | (u32)lb);
    }
  }

  // ---- draw: inverse CDF over kept tokens in index order ---------------------------------------------
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nvec = V / 8;
  const int chunk = (nvec + WARPS - 1) / WARPS;  // vectors per warp, contiguous
  const int v0 = warp * chunk, v1 = min(nvec, v0 + chunk);
  const uint4* rv = reinterpret_cast<const uint4*>(row);
  auto vec_weights = [&](int v, float* e) {
    const uint4 a = rv[v];
    const u32 w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const u32 lo = w[i] & 0xffffu, hi = w[i] >> 16;
      e[2 * i] = bf16_key(lo) >= tau ? __expf((bf16_to_f32((bf16_t)lo) - lmax) * inv_t) : 0.f;
      e[2 * i + 1] = bf16_key(hi) >= tau ? __expf((bf16_to_f32((bf16_t)hi) - lmax) * inv_t) : 0.f;
    }
  };
  float wsum = 0.f;
  for (int v = v0 + lane; v < v1; v += 32) {
    float e[8];
    vec_weights(v, e);
#pragma unroll
    for (int i = 0; i < 8; ++i) wsum += e[i];
  }
  wsum = warp_sum(wsum);
  if (lane == 0) sm.warp_mass[warp] = wsum;
  __syncthreads();
  if (threadIdx.x == 0) {
    const Philox4 r = philox4x32_10({0u, 0u, (u32)p.offset, (u32)(p.offset >> 32)}, (u32)p.seed,
                                    (u32)(p.seed >> 32));
    float total = 0.f;
    for (int w = 0; w < WARPS; ++w) total += sm.warp_mass[w];
    float target = (float)(r.x >> 8) * (1.0f / 16777216.0f) * total;  // u in [0, 1)
    int chosen = -1;
    for (int w = 0; w < WARPS; ++w) {
      if (sm.warp_mass[w] > 0.f) {
        chosen = w;  // last non-empty warp, if rounding leaves target >= total
        if (target < sm.warp_mass[w]) break;
        target -= sm.warp_mass[w];
      }
    }
    sm.s_int = chosen;
    sm.s_float = target;
  }
  __syncthreads();
  const int chosen = sm.s_int;
  int token = (int)best_index(best);
  if (warp == chosen) {
    float target = sm.s_float;
    const int cv0 = chosen * chunk, cv1 = min(nvec, cv0 + chunk);
    int found = -1, last_kept = -1;
    for (int base = cv0; base < cv1 && found < 0; base += 32) {
      const int v = base + lane;
      float e[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      if (v < cv1) vec_weights(v, e);
      float s = 0.f;
      int my_last = -1;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        s += e[i];
        if (e[i] > 0.f) my_last = 8 * v + i;
      }
      float incl = s;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const float n = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += n;
      }
      const u32 hit = __ballot_sync(0xffffffffu, s > 0.f && target < incl);
      if (hit) {
        const int src = __ffs(hit) - 1;
        float t = target - (incl - s);
        int pick = my_last;
        for (int i = 0; i < 8; ++i) {
          if (e[i] > 0.f) {
            if (t < e[i]) {
              pick = 8 * v + i;
              break;
            }
            t -= e[i];
          }
        }
        found = __shfl_sync(0xffffffffu, pick, src);
      } else {
        target -= __shfl_sync(0xffffffffu, incl, 31);
        // float rounding can leave the target past the chunk's end: fall back to its last kept token
        const u32 nz = __ballot_sync(0xffffffffu, my_last >= 0);
        if (nz) last_kept = __shfl_sync(0xffffffffu, my_last, 31 - __clz(nz));
      }
    }
    if (found < 0) found = last_kept;
    if (lane == 0 && found >= 0) sm.s_int = found;
  }
  __syncthreads();
  if (chosen >= 0) token = sm.s_int;
  return token;
}

}  // namespace nq_sample
