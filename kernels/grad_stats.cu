// Per-tensor gradient statistics with a fixed reduction order: for each tensor the sum of squares
// (of every value, so NaN or Inf once one is), the count of non-finite values and the largest
// finite |x|. The order of every addition is fixed by the element index alone (not by the grid),
// so the results are the same bits from run to run, and the host twin
// (lowgrad/sr/grad_stats.py) reproduces them exactly.
//
// Stage 1 (grad_stats_f32 / grad_stats_bf16): a persistent grid strides over chunks of
// STATS_CHUNK elements; tensor t owns chunks [first[t], first[t + 1]). Thread i of a chunk takes
// the groups of 8 elements at 8 * i and 8 * (i + STATS_THREADS) and sums their squares in
// float32 in element order; the chunk's threads are combined by a fixed tree
// (StatsAcc::store, grad_stats.cuh) into partials[chunk]. The multi-tensor add_sr (add_sr.cu) computes the same partials for the
// gradient it consumes, in the same order, while it accumulates.
// Stage 2 (grad_stats_finish): block t sums the partials of tensor t in float64 (thread j takes
// partials j, j + STATS_THREADS, ... in order, then a fixed tree) and writes three doubles
// {sumsq, nonfinite, maxabs} at out + 3 * (row * row_stride + column[t]); row is row0, plus the
// seed counter's micro-step with add_micro, so a replayed graph writes the row of the micro-step it
// runs as; with when_micro other than STATS_EVERY_MICRO it writes only at that micro-step (the fused
// add_sr's statistics of the shard it reads, which hold micro-step 0's gradient at micro-step 1).
#include "grad_stats.cuh"

struct GradStats {  // passed by value (__grid_constant__)
  u64 x[STATS_MAX], n[STATS_MAX];
  u32 first[STATS_MAX + 1];
  u32 count;
  StatsPartial* partials;
};

template <typename T> __device__ __forceinline__ void grad_stats(const GradStats& m) {
  const u32 total = m.first[m.count];
  u32 t = 0;
  for (u32 c = blockIdx.x; c < total; c += gridDim.x) {
    while (c >= m.first[t + 1]) ++t;
    const T* x = (const T*)m.x[t];
    const u64 n = m.n[t], base = (u64)(c - m.first[t]) * STATS_CHUNK;
    const bool vec = aligned16(m.x[t]);
    StatsAcc acc;
#pragma unroll
    for (int u = 0; u < STATS_UNROLL; ++u) {
      const u64 e = base + GROUP_ELEMS * (threadIdx.x + u * STATS_THREADS);
      if (e < n) {
        const u32 count = n - e >= GROUP_ELEMS ? GROUP_ELEMS : (u32)(n - e);
        float v[8];
        if (vec && count == GROUP_ELEMS) load8<true>(x + e, count, v);
        else load8<false>(x + e, count, v);
        acc.add8(v, count);
      }
    }
    acc.store(m.partials + c);
  }
}

extern "C" __global__ void __launch_bounds__(STATS_THREADS) grad_stats_f32(const __grid_constant__ GradStats m) {
  grad_stats<float>(m);
}

extern "C" __global__ void __launch_bounds__(STATS_THREADS) grad_stats_bf16(const __grid_constant__ GradStats m) {
  grad_stats<bf16_t>(m);
}

struct StatsFinish {  // passed by value (__grid_constant__)
  const StatsPartial* partials;
  u32 first[STATS_MAX + 1];
  u32 count;
  u32 column[STATS_MAX];  // tensor t's column in the output rows
  double* out;
  u32 row0, rows, row_stride, add_micro, when_micro;  // a row >= rows is not written
  const SeedCounter* counter;  // read for add_micro and when_micro
};

extern "C" __global__ void __launch_bounds__(STATS_THREADS) grad_stats_finish(const __grid_constant__ StatsFinish f) {
  const u32 t = blockIdx.x;
  if (t >= f.count || (f.when_micro != STATS_EVERY_MICRO && f.counter->micro != f.when_micro)) return;
  double s = 0.0, c = 0.0, mx = 0.0;
  for (u32 p = f.first[t] + threadIdx.x; p < f.first[t + 1]; p += STATS_THREADS) {
    const StatsPartial q = f.partials[p];
    s = __dadd_rn(s, (double)q.sumsq);
    c = __dadd_rn(c, (double)q.nonfinite);
    mx = fmax(mx, (double)q.maxabs);
  }
  __shared__ double sh[3][STATS_THREADS];
  sh[0][threadIdx.x] = s;
  sh[1][threadIdx.x] = c;
  sh[2][threadIdx.x] = mx;
  __syncthreads();
  for (u32 h = STATS_THREADS / 2; h > 0; h >>= 1) {
    if (threadIdx.x < h) {
      sh[0][threadIdx.x] = __dadd_rn(sh[0][threadIdx.x], sh[0][threadIdx.x + h]);
      sh[1][threadIdx.x] = __dadd_rn(sh[1][threadIdx.x], sh[1][threadIdx.x + h]);
      sh[2][threadIdx.x] = fmax(sh[2][threadIdx.x], sh[2][threadIdx.x + h]);
    }
    __syncthreads();
  }
  const u32 row = f.row0 + (f.add_micro ? f.counter->micro : 0u);
  if (threadIdx.x == 0 && row < f.rows) {
    double* o = f.out + 3 * ((u64)row * f.row_stride + f.column[t]);
    o[0] = sh[0][0];
    o[1] = sh[1][0];
    o[2] = sh[2][0];
  }
}
