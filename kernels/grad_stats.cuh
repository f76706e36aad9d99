// Gradient statistics (grad_stats.cu; the multi-tensor add_sr computes them in passing): for each
// tensor the sum of squares, the count of non-finite values and the largest finite |x|.
//
// Each thread sums its elements' squares in float32, a group of 8 at a time (StatsAcc::add8) in the
// order it visits them; each warp keeps its lanes' values for the tensor in hand and, when the block
// moves on to the next tensor of the launch, combines them by a fixed tree (lanes i and i + h for
// h = 16 .. 1) into its entry of the block's shared table (StatsStream). No barrier while the
// accumulation kernel streams: one at its end, after which thread t adds tensor t's warp entries in
// warp order into one StatsPartial slot, t * gridDim.x + block from the base of the launch's slot
// set (StatsStream::base: the micro-step's set). Every block writes a slot for every tensor of its
// launch (zeros for a tensor it never reached), so tensor t's statistics are the gridDim.x
// consecutive slots from t * gridDim.x of the set, which grad_stats_finish sums in a fixed order.
// The order of every addition is fixed by the launch shape, which is the same from run to run on a
// GPU (the persistent grid is the resident one).
#pragma once
#include "sr.cuh"

enum : u32 { STATS_THREADS = 256, STATS_UNROLL = 2, STATS_WARPS = STATS_THREADS / 32,
             STATS_CHUNK = STATS_THREADS * STATS_UNROLL * GROUP_ELEMS };

struct StatsPartial {  // one warp's or block's statistics of one tensor (16 bytes)
  float sumsq;
  u32 nonfinite;
  float maxabs;
  u32 pad;
};

struct StatsAcc {  // one thread's statistics of the current tensor
  float s = 0.0f, m = 0.0f;
  u32 c = 0u;

  // A group of 8 values (past a tensor's end 0, which changes nothing) is taken in two parts: its
  // sum of squares t (fused multiply-adds in element order) and largest |x| g, then fold(t, g).
  // t is finite exactly when every value is (short of an overflow of finite squares), so the
  // non-finite count and the largest *finite* |x| are worked out (rare()) only for a group whose t
  // is not (in the SR add's fast path into bf16: whose sum a + b is not, add_sr.cu): the common
  // group costs two instructions per value. The statistics ride inside the SR add, which issues
  // close to the SM's instruction rate.
  static __device__ __forceinline__ float sumsq8(const float (&v)[8]) {
    float t = __fmul_rn(v[0], v[0]);
#pragma unroll
    for (int k = 1; k < 8; ++k) t = fmaf(v[k], v[k], t);
    return t;
  }
  static __device__ __forceinline__ float maxabs8(const float (&v)[8]) {
    return fmaxf(fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3]))),
                 fmaxf(fmaxf(fabsf(v[4]), fabsf(v[5])), fmaxf(fabsf(v[6]), fabsf(v[7]))));
  }
  // the largest finite |x| of a group that may hold non-finite values, counting them (for finite
  // values: maxabs8, nothing counted)
  __device__ __forceinline__ float rare(const float (&v)[8]) {
    float g = 0.0f;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      if (finite(v[k])) g = fmaxf(g, fabsf(v[k]));
      else ++c;
    }
    return g;
  }
  __device__ __forceinline__ void fold(float t, float g) {
    s = __fadd_rn(s, t);
    m = fmaxf(m, g);
  }
  __device__ __forceinline__ void add8(const float (&v)[8]) {
    const float t = sumsq8(v);
    fold(t, finite(t) ? maxabs8(v) : rare(v));
  }
};

// One block's statistics over the tensors of a launch, in order: each warp's entries [0, done) of
// `warps` (STATS_WARPS per tensor, in shared memory) are written, acc holds tensor done's. Every
// thread calls advance() with the same arguments, then after one __syncthreads() flush().
struct StatsStream {
  StatsPartial* base;   // the launch's slot set; null: no statistics
  StatsPartial* warps;  // the block's shared table: [tensors of the launch][STATS_WARPS]
  u32 done;
  StatsAcc acc;

  __device__ __forceinline__ void write() {
    float s = acc.s, m = acc.m;
    u32 c = acc.c;
#pragma unroll
    for (u32 h = 16; h > 0; h >>= 1) {
      s = __fadd_rn(s, __shfl_down_sync(0xffffffffu, s, h));
      m = fmaxf(m, __shfl_down_sync(0xffffffffu, m, h));
    }
    if (__any_sync(0xffffffffu, c != 0u)) {  // non-finite values are rare: their sum is usually skipped
#pragma unroll
      for (u32 h = 16; h > 0; h >>= 1) c += __shfl_down_sync(0xffffffffu, c, h);
    }
    if ((threadIdx.x & 31u) == 0) warps[done * STATS_WARPS + (threadIdx.x >> 5)] = StatsPartial{s, c, m, 0u};
    acc = StatsAcc{};
    ++done;
  }

  // the block now works on tensor t: the entries of the tensors before it are written
  __device__ __forceinline__ void advance(u32 t) {
    if (base)
      while (done < t) write();
  }

  // after advance(count) and a barrier: thread t < count writes tensor t's slot
  __device__ __forceinline__ void flush(u32 count) const {
    if (!base || threadIdx.x >= count) return;
    float s = 0.0f, m = 0.0f;
    u32 c = 0u;
#pragma unroll
    for (u32 w = 0; w < STATS_WARPS; ++w) {
      const StatsPartial q = warps[threadIdx.x * STATS_WARPS + w];
      s = __fadd_rn(s, q.sumsq);
      c += q.nonfinite;
      m = fmaxf(m, q.maxabs);
    }
    base[(u64)threadIdx.x * gridDim.x + blockIdx.x] = StatsPartial{s, c, m, 0u};
  }
};
