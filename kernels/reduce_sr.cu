// dst = SR(((accumulate ? dst : +0) + sum over k != skip of src[k]) * scale), summed in float32 in
// shard order; src holds n_shards consecutive blocks of n elements. Element i uses the noise of
// index index_offset + i; with a counter the rounding is the per-use one of (layer, lane) (sr.cuh).
#include "sr.cuh"

// Measured best on H200 (bf16, 8 shards): 2 groups of 8 per thread and iteration, 128 bytes of
// shard loads in flight per group, at least 2 blocks of 256 per SM (<= 128 registers).
enum { REDUCE_UNROLL = 2, REDUCE_MIN_BLOCKS = 2 };
enum : u32 { SHARD_BYTES = 128 };

template <typename D, typename S> struct ReduceSr {
  enum : u32 { CHUNK = SHARD_BYTES / (8 * sizeof(S)) };  // shards whose loads are issued together
  D* __restrict__ dst;
  const S* __restrict__ src;
  u32 active;  // shards summed: n_shards less the skipped one
  u32 skip;    // active shard m is shard m + (m >= skip); 0xffffffff for none
  float scale;
  int accumulate;
  Rounding rd;
  u64 offset, n;

  __device__ __forceinline__ const S* shard(u32 m) const { return src + (u64)(m + (m >= skip ? 1u : 0u)) * n; }

  template <int U, bool VEC> __device__ __forceinline__ void run(const u64 (&e)[U], u32 count) const {
    float acc[U][8];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (accumulate) {
        load8<VEC>(dst + e[u], count, acc[u]);
      } else {
#pragma unroll
        for (int k = 0; k < 8; ++k) acc[u][k] = 0.0f;
      }
    }
    // CHUNK shards' loads are issued together (kept unconverted to save registers); a partial last
    // chunk is predicated, not padded: adding +0 would turn an accumulated -0 into +0
    for (u32 m = 0; m < active; m += CHUNK) {
      Raw8<S> t[CHUNK][U];
#pragma unroll
      for (u32 j = 0; j < CHUNK; ++j) {
        if (m + j < active) {
          const S* p = shard(m + j);
#pragma unroll
          for (int u = 0; u < U; ++u) t[j][u] = load_raw8<VEC>(p + e[u], count);
        }
      }
#pragma unroll
      for (u32 j = 0; j < CHUNK; ++j) {
        if (m + j < active) {
#pragma unroll
          for (int u = 0; u < U; ++u) {
            float v[8];
            to_f32x8(t[j][u], v);
#pragma unroll
            for (int k = 0; k < 8; ++k) acc[u][k] = __fadd_rn(acc[u][k], v[k]);
          }
        }
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int k = 0; k < 8; ++k) acc[u][k] = __fmul_rn(acc[u][k], scale);
      store8<VEC>(dst + e[u], count, acc[u], rd, offset + e[u]);
    }
  }
};

template <typename D, typename S>
__device__ __forceinline__ void reduce_sr(D* __restrict__ dst, const S* __restrict__ src, u32 n_shards, int skip,
                                          float scale, int accumulate, u64 seed, u64 index_offset, u64 n,
                                          const SeedCounter* counter, u32 layer, u32 lane) {
  const Rounding rd = block_rounding(seed, counter, layer, lane);
  const bool skipping = skip >= 0 && (u32)skip < n_shards;
  ReduceSr<D, S> f{dst, src, n_shards - (skipping ? 1u : 0u), skipping ? (u32)skip : 0xffffffffu, scale, accumulate,
                   rd, index_offset, n};
  // every shard block must start 16-byte aligned too
  for_each_group<REDUCE_UNROLL>(f, n, aligned16((u64)dst | (u64)src | n * sizeof(S)));
}

#define REDUCE_SR_KERNEL(DN, D, SN, S)                                                                  \
  extern "C" __global__ void __launch_bounds__(256, REDUCE_MIN_BLOCKS)                                                    \
  reduce_sr_##DN##_##SN(D* __restrict__ dst, const S* __restrict__ src, u32 n_shards, int skip, float scale, \
                        int accumulate, u64 seed, u64 index_offset, u64 n, const SeedCounter* counter,   \
                        u32 layer, u32 lane) {                                                          \
    reduce_sr<D, S>(dst, src, n_shards, skip, scale, accumulate, seed, index_offset, n, counter, layer, lane); \
  }

REDUCE_SR_KERNEL(f32, float, f32, float)
REDUCE_SR_KERNEL(f32, float, bf16, bf16_t)
REDUCE_SR_KERNEL(bf16, bf16_t, f32, float)
REDUCE_SR_KERNEL(bf16, bf16_t, bf16, bf16_t)
