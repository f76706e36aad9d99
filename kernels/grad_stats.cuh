// Gradient statistics of one chunk of STATS_CHUNK elements (grad_stats.cu; the multi-tensor
// add_sr computes them in passing): the sum of squares in float32, the non-finite count and the
// largest finite |x|, in an order fixed by the element index (see grad_stats.cu).
#pragma once
#include "sr.cuh"

enum : u32 { STATS_MAX = 16, STATS_THREADS = 256, STATS_UNROLL = 2, STATS_WARPS = STATS_THREADS / 32,
             STATS_CHUNK = STATS_THREADS * STATS_UNROLL * GROUP_ELEMS,
             STATS_EVERY_MICRO = 0xffffffffu };  // grad_stats_finish's when_micro: write at every micro-step

struct StatsPartial {  // one chunk's statistics (16 bytes)
  float sumsq;
  u32 nonfinite;
  float maxabs;
  u32 pad;
};

struct StatsAcc {  // one thread's statistics within a chunk
  float s = 0.0f, m = 0.0f;
  u32 c = 0;

  // the first `count` of v, in order: s += v * v (rounded product, then rounded sum)
  __device__ __forceinline__ void add8(const float (&v)[8], u32 count) {
#pragma unroll
    for (u32 k = 0; k < 8; ++k) {
      if (k < count) {
        s = __fadd_rn(s, __fmul_rn(v[k], v[k]));
        const float a = fabsf(v[k]);
        if (a <= __int_as_float(0x7f7fffff)) m = fmaxf(m, a);  // finite (NaN compares false)
        else ++c;
      }
    }
  }

  // the block's statistics into *out: a fixed tree within each warp (lanes i and i + h for
  // h = 16, 8, 4, 2, 1), then the same over the warps' results; every thread must call it
  __device__ __forceinline__ void store(StatsPartial* out) const {
    float ws = s, wm = m;
    u32 wc = c;
#pragma unroll
    for (u32 h = 16; h > 0; h >>= 1) {
      ws = __fadd_rn(ws, __shfl_down_sync(0xffffffffu, ws, h));
      wc += __shfl_down_sync(0xffffffffu, wc, h);
      wm = fmaxf(wm, __shfl_down_sync(0xffffffffu, wm, h));
    }
    __shared__ float sh_s[STATS_WARPS], sh_m[STATS_WARPS];
    __shared__ u32 sh_c[STATS_WARPS];
    const u32 lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    __syncthreads();  // the previous chunk's reads of the shared values are done
    if (lane == 0) {
      sh_s[warp] = ws;
      sh_c[warp] = wc;
      sh_m[warp] = wm;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      float bs[STATS_WARPS], bm[STATS_WARPS];
      u32 bc[STATS_WARPS];
#pragma unroll
      for (u32 w = 0; w < STATS_WARPS; ++w) bs[w] = sh_s[w], bc[w] = sh_c[w], bm[w] = sh_m[w];
#pragma unroll
      for (u32 h = STATS_WARPS / 2; h > 0; h >>= 1) {
#pragma unroll
        for (u32 w = 0; w < h; ++w) {
          bs[w] = __fadd_rn(bs[w], bs[w + h]);
          bc[w] += bc[w + h];
          bm[w] = fmaxf(bm[w], bm[w + h]);
        }
      }
      *out = StatsPartial{bs[0], bc[0], bm[0], 0u};
    }
  }
};
