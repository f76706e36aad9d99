// The 8-bit hop of `hierarchical` across the nodes (opt-in: cross_node_bits=8): int8 with one
// float32 scale per block of QBLOCK elements, rounded stochastically so that the receiver's sum stays
// unbiased; lowgrad/sr/reference.py's quantize_i8_sr and dequant_reduce_sr are the definition, these
// kernels follow them bit for bit.
//
// quantize_i8_sr: block b of x (elements b*QBLOCK .. b*QBLOCK+QBLOCK-1, the last one partial) gets
// scale s = amax / 127 (float32 division; amax the largest |x| of the block; NaN when the block holds
// a non-finite value, so that the receiver's sum is NaN and the step is skipped as non-finite) and
// q_i = clamp(floor(x_i / s + r_i * 2^-16), -127, 127), r_i the 16-bit noise of element index
// index_offset + i (plus the rounding's shift, mod 2^16; 0x8000 when it rounds to nearest); q = 0
// where s is 0 or NaN.
//
// dequant_reduce_sr: dst = SR((dst + sum over k != skip of q[k]_i * s[k]_block(i)) * scale), summed in
// float32 in shard order (each product and sum rounded to float32), rounded once as reduce_sr rounds.
#include "sr.cuh"

enum : u32 { QBLOCK = 128, QLANE = 4 };  // QBLOCK elements a warp, QLANE a lane
static_assert(QBLOCK == 32 * QLANE, "a warp quantizes one block");

__device__ __forceinline__ float as_f32(float v) { return v; }
__device__ __forceinline__ float as_f32(bf16_t v) { return __uint_as_float((u32)v.bits << 16); }

// The 16-bit noise that rounds element `index` (one Philox call for 8 indices from `index`).
__device__ __forceinline__ u32 element_noise(const Rounding& rd, uint4 w, int k) {
  return rd.rn ? 0x8000u : (noise_half(w, k) + rd.shift) & 0xffffu;
}

template <typename S>
__device__ __forceinline__ void quantize_i8_sr(signed char* __restrict__ q, float* __restrict__ scales,
                                               const S* __restrict__ x, u64 n, u64 seed, u64 index_offset,
                                               const SeedCounter* counter, u32 layer, u32 lane) {
  const Rounding rd = block_rounding(seed, counter, layer, lane);
  const u32 l = threadIdx.x & 31u, warps = blockDim.x >> 5;
  const u64 blocks = (n + QBLOCK - 1) / QBLOCK;
  for (u64 b = (u64)blockIdx.x * warps + (threadIdx.x >> 5); b < blocks; b += (u64)gridDim.x * warps) {
    const u64 first = b * QBLOCK + (u64)l * QLANE;
    float v[QLANE];
    float amax = 0.0f;
    bool bad = false;
#pragma unroll
    for (int k = 0; k < (int)QLANE; ++k) {
      v[k] = first + k < n ? as_f32(x[first + k]) : 0.0f;
      bad |= !isfinite(v[k]);
      amax = fmaxf(amax, fabsf(v[k]));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    bad = __any_sync(0xffffffffu, bad);
    const float s = bad ? __uint_as_float(0x7fc00000u) : __fdiv_rn(amax, 127.0f);
    if (l == 0) scales[b] = s;
    const uint4 w = sr_noise8(rd.key, index_offset + first);
#pragma unroll
    for (int k = 0; k < (int)QLANE; ++k) {
      if (first + k < n) {
        float t = 0.0f;
        if (s > 0.0f) {  // false for 0 and NaN
          const float u = __fmul_rn((float)element_noise(rd, w, k), 1.0f / 65536.0f);
          t = fminf(fmaxf(floorf(__fadd_rn(__fdiv_rn(v[k], s), u)), -127.0f), 127.0f);
        }
        q[first + k] = (signed char)(int)t;
      }
    }
  }
}

template <typename D>
__device__ __forceinline__ void dequant_reduce_sr(D* __restrict__ dst, const signed char* __restrict__ q,
                                                  const float* __restrict__ scales, u32 n_shards, int skip,
                                                  float scale, u64 seed, u64 index_offset, u64 n,
                                                  const SeedCounter* counter, u32 layer, u32 lane) {
  const Rounding rd = block_rounding(seed, counter, layer, lane);
  const u64 blocks = (n + QBLOCK - 1) / QBLOCK;
  for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
    float acc = as_f32(dst[i]);
    for (u32 m = 0; m < n_shards; ++m) {
      if ((int)m != skip) acc = __fadd_rn(acc, __fmul_rn((float)q[(u64)m * n + i], scales[(u64)m * blocks + i / QBLOCK]));
    }
    acc = __fmul_rn(acc, scale);
    const u32 r = rd.rn ? 0x7fffu : (noise_half(sr_noise8(rd.key, index_offset + i), 0) + rd.shift) & 0xffffu;
    dst[i] = round_as<D>(acc, r, rd.rn);
  }
}

#define QUANTIZE_KERNEL(SN, S)                                                                            \
  extern "C" __global__ void __launch_bounds__(256)                                                       \
  quantize_i8_sr_##SN(signed char* __restrict__ q, float* __restrict__ scales, const S* __restrict__ x,   \
                      u64 n, u64 seed, u64 index_offset, const SeedCounter* counter, u32 layer, u32 lane) { \
    quantize_i8_sr<S>(q, scales, x, n, seed, index_offset, counter, layer, lane);                         \
  }
#define DEQUANT_KERNEL(DN, D)                                                                                  \
  extern "C" __global__ void __launch_bounds__(256)                                                            \
  dequant_reduce_sr_##DN(D* __restrict__ dst, const signed char* __restrict__ q, const float* __restrict__ scales, \
                         u32 n_shards, int skip, float scale, u64 seed, u64 index_offset, u64 n,              \
                         const SeedCounter* counter, u32 layer, u32 lane) {                                    \
    dequant_reduce_sr<D>(dst, q, scales, n_shards, skip, scale, seed, index_offset, n, counter, layer, lane);   \
  }

QUANTIZE_KERNEL(f32, float)
QUANTIZE_KERNEL(bf16, bf16_t)
DEQUANT_KERNEL(f32, float)
DEQUANT_KERNEL(bf16, bf16_t)
