// Per-tensor gradient statistics (grad_stats.cuh): the sum of squares (of every value, so NaN or
// Inf once one is), the count of non-finite values and the largest finite |x|.
//
// grad_stats_f32 / grad_stats_bf16: a persistent grid strides over chunks of STATS_CHUNK
// elements of up to STATS_MAX tensors; tensor t owns chunks [first[t], first[t + 1]); thread i of
// a chunk takes the groups of 8 at 8 * (i + u * STATS_THREADS), u < STATS_UNROLL. Each block's
// statistics of each tensor go to its StatsPartial slot of the launch (grad_stats.cuh): of slot set
// `counter->micro` with a counter (one set per micro-step: a launch at a micro-step >= sets
// measures nothing), of set 0 without.
// grad_stats_finish: block j turns job j of its table (one tensor's slots of one set of one
// launch) into three doubles {sumsq, nonfinite, maxabs} at out + 3 * (row * row_stride + column),
// summing the slots in float64 (thread k takes slots k, k + STATS_THREADS, ... in order, then a
// fixed tree). It runs once a step is complete: a job whose set is written at micro-step `micro`
// is finished only when the counter's last completed step had that micro-step (micro < done), so
// a set left over from an earlier, longer step is never read.
#include "grad_stats.cuh"

enum : u32 { STATS_MAX = 16 };

struct GradStats {  // passed by value (__grid_constant__)
  u64 x[STATS_MAX], n[STATS_MAX];
  u32 first[STATS_MAX + 1];
  u32 count;
  StatsPartial* partials;      // sets x count x gridDim.x slots
  const SeedCounter* counter;  // null: set 0
  u32 sets;
};

template <typename T> __device__ __forceinline__ void grad_stats(const GradStats& m) {
  const u32 set = m.counter ? m.counter->micro : 0u;  // the same in every block
  if (set >= m.sets) return;
  const u32 total = m.first[m.count];
  __shared__ StatsPartial warps[STATS_MAX * STATS_WARPS];
  StatsStream st{m.partials + (u64)set * m.count * gridDim.x, warps, 0u, StatsAcc{}};
  u32 t = 0;
  for (u32 c = blockIdx.x; c < total; c += gridDim.x) {
    while (c >= m.first[t + 1]) ++t;
    st.advance(t);
    const T* x = (const T*)m.x[t];
    const u64 n = m.n[t], base = (u64)(c - m.first[t]) * STATS_CHUNK;
    const bool vec = aligned16(m.x[t]);
#pragma unroll
    for (int u = 0; u < STATS_UNROLL; ++u) {
      const u64 e = base + GROUP_ELEMS * (threadIdx.x + u * STATS_THREADS);
      if (e < n) {
        const u32 count = n - e >= GROUP_ELEMS ? GROUP_ELEMS : (u32)(n - e);
        float v[8];
        if (vec && count == GROUP_ELEMS) load8<true>(x + e, count, v);
        else load8<false>(x + e, count, v);
        st.acc.add8(v);
      }
    }
  }
  st.advance(m.count);
  __syncthreads();
  st.flush(m.count);
}

extern "C" __global__ void __launch_bounds__(STATS_THREADS) grad_stats_f32(const __grid_constant__ GradStats m) {
  grad_stats<float>(m);
}

extern "C" __global__ void __launch_bounds__(STATS_THREADS) grad_stats_bf16(const __grid_constant__ GradStats m) {
  grad_stats<bf16_t>(m);
}

struct StatsJob {  // one tensor's statistics of one slot set of one launch (a table in device memory)
  u64 partials;    // its first slot
  u32 slots, column, row, micro;  // micro: the micro-step at which the launch writes the set
};

extern "C" __global__ void __launch_bounds__(STATS_THREADS)
grad_stats_finish(const StatsJob* __restrict__ jobs, u32 count, double* __restrict__ out, u32 row_stride,
                  const SeedCounter* __restrict__ counter) {
  if (blockIdx.x >= count) return;
  const StatsJob job = jobs[blockIdx.x];
  if (counter && job.micro >= counter->done) return;
  const StatsPartial* p = (const StatsPartial*)job.partials;
  double s = 0.0, c = 0.0, mx = 0.0;
  for (u32 k = threadIdx.x; k < job.slots; k += STATS_THREADS) {
    const StatsPartial q = p[k];
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
  if (threadIdx.x == 0) {
    double* o = out + 3 * ((u64)job.row * row_stride + job.column);
    o[0] = sh[0][0];
    o[1] = sh[1][0];
    o[2] = sh[2][0];
  }
}
