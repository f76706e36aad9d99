// Gradient statistics (grad_stats.cu; the multi-tensor add_sr computes them in passing): for each
// tensor the sum of squares, the count of non-finite values and the largest finite |x|.
//
// Each thread sums its elements' squares in float32 (fused multiply-add) in the order it visits
// them; each warp keeps
// its lanes' values for the tensor in hand and, when the block moves on to the next tensor of the
// launch, combines them by a fixed tree (lanes i and i + h for h = 16 .. 1) into one StatsPartial
// slot: slot (t * gridDim.x + block) * STATS_WARPS + warp of the launch's partials. No shared
// memory, no barrier: the accumulation kernel keeps streaming. Every warp writes one slot for every
// tensor of its launch (zeros for a tensor its block never reached), so tensor t's statistics are
// the gridDim.x * STATS_WARPS consecutive slots from t * gridDim.x * STATS_WARPS, which
// grad_stats_finish sums in a fixed order. The order of every addition is fixed by the launch
// shape, which is the same from run to run on a GPU (the persistent grid is the resident one).
#pragma once
#include "sr.cuh"

enum : u32 { STATS_THREADS = 256, STATS_UNROLL = 2, STATS_WARPS = STATS_THREADS / 32,
             STATS_CHUNK = STATS_THREADS * STATS_UNROLL * GROUP_ELEMS };

struct StatsPartial {  // one warp's statistics of one tensor (16 bytes)
  float sumsq;
  u32 nonfinite;
  float maxabs;
  u32 pad;
};

struct StatsAcc {  // one thread's statistics of the current tensor
  float s = 0.0f, m = 0.0f, c = 0.0f;  // the count in float: exact to 2^24, far above a thread's share

  // the first `count` of v, in order. Only float operations: the SR kernels that call this keep
  // the integer pipes busy with Philox, so integer work here would slow them down
  __device__ __forceinline__ void add8(const float (&v)[8], u32 count) {
#pragma unroll
    for (u32 k = 0; k < 8; ++k) {
      if (k < count) {
        s = fmaf(v[k], v[k], s);
        const float a = fabsf(v[k]);
        const bool finite = a <= __int_as_float(0x7f7fffff);  // NaN compares false
        m = fmaxf(m, finite ? a : 0.0f);
        c += finite ? 0.0f : 1.0f;
      }
    }
  }
};

// One warp's statistics over the tensors of a launch, in order: slots [0, done) are written, acc
// holds tensor done's. Every lane calls advance() and finish() with the same arguments.
struct StatsStream {
  StatsPartial* base;  // the launch's partials; null: no statistics
  u32 done;
  StatsAcc acc;

  __device__ __forceinline__ void write() {
    float s = acc.s, m = acc.m;
    u32 c = (u32)acc.c;
#pragma unroll
    for (u32 h = 16; h > 0; h >>= 1) {
      s = __fadd_rn(s, __shfl_down_sync(0xffffffffu, s, h));
      c += __shfl_down_sync(0xffffffffu, c, h);
      m = fmaxf(m, __shfl_down_sync(0xffffffffu, m, h));
    }
    if ((threadIdx.x & 31u) == 0)
      base[((u64)done * gridDim.x + blockIdx.x) * STATS_WARPS + (threadIdx.x >> 5)] = StatsPartial{s, c, m, 0u};
    acc = StatsAcc{};
    ++done;
  }

  // the block now works on tensor t: the slots of the tensors before it are written
  __device__ __forceinline__ void advance(u32 t) {
    if (base)
      while (done < t) write();
  }
};
