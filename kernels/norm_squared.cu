// Sum of squares in two stages, deterministic for a given launch shape (blockDim a power of two,
// at most 256). Stage 1: each block writes the sum of its threads' grid-stride partials (fixed
// tree) to partials[blockIdx.x]. Stage 2 (one block): out = (accumulate ? *out : 0) + sum of partials.
#include "sr.cuh"

enum { NORM_UNROLL = 2, NORM_BLOCK = 256 };

template <typename T, typename ACC> struct SumSquares {
  const T* __restrict__ x;
  ACC acc;

  template <int U, bool VEC> __device__ __forceinline__ void run(const u64 (&e)[U], u32 count) {
    float v[U][8];
#pragma unroll
    for (int u = 0; u < U; ++u) load8<VEC>(x + e[u], count, v[u]);
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int k = 0; k < 8; ++k) acc = fma((ACC)v[u][k], (ACC)v[u][k], acc);
  }
};

// Sum of every thread's v over the block, in a fixed order; the result is valid in thread 0.
template <typename ACC> __device__ __forceinline__ ACC block_sum(ACC v) {
  __shared__ ACC sh[NORM_BLOCK];
  const unsigned t = threadIdx.x;
  sh[t] = v;
  __syncthreads();
  for (unsigned s = blockDim.x >> 1; s > 0; s >>= 1) {
    if (t < s) sh[t] += sh[t + s];
    __syncthreads();
  }
  return sh[0];
}

template <typename T, typename ACC>
__device__ __forceinline__ void norm_squared(const T* __restrict__ x, u64 n, ACC* __restrict__ partials) {
  SumSquares<T, ACC> f{x, (ACC)0};
  for_each_group<NORM_UNROLL>(f, n, aligned16((u64)x));
  const ACC total = block_sum(f.acc);
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

template <typename ACC>
__device__ __forceinline__ void norm_squared_finish(const ACC* __restrict__ partials, u32 n_partials,
                                                    ACC* __restrict__ out, int accumulate) {
  ACC acc = 0;
  for (u32 i = threadIdx.x; i < n_partials; i += blockDim.x) acc += partials[i];
  const ACC total = block_sum(acc);
  if (threadIdx.x == 0) *out = (accumulate ? *out : (ACC)0) + total;
}

#define NORM_KERNEL(TN, T, AN, ACC)                                                                     \
  extern "C" __global__ void __launch_bounds__(NORM_BLOCK)                                             \
  norm_squared_##TN##_##AN(const T* __restrict__ x, u64 n, ACC* __restrict__ partials) {              \
    norm_squared<T, ACC>(x, n, partials);                                                              \
  }

NORM_KERNEL(f32, float, f32, float)
NORM_KERNEL(f32, float, f64, double)
NORM_KERNEL(bf16, bf16_t, f32, float)
NORM_KERNEL(bf16, bf16_t, f64, double)

extern "C" __global__ void __launch_bounds__(NORM_BLOCK)
norm_squared_finish_f32(const float* __restrict__ partials, u32 n_partials, float* __restrict__ out, int accumulate) {
  norm_squared_finish<float>(partials, n_partials, out, accumulate);
}

extern "C" __global__ void __launch_bounds__(NORM_BLOCK)
norm_squared_finish_f64(const double* __restrict__ partials, u32 n_partials, double* __restrict__ out,
                        int accumulate) {
  norm_squared_finish<double>(partials, n_partials, out, accumulate);
}
