// dst = SR((a + b) * scale) elementwise in float32 (add, then multiply); dst may alias a exactly.
// Element i uses the noise of index index_offset + i.
#include "sr.cuh"

// Measured best on H200: 2 groups of 8 per thread and iteration, and an explicit minimum of 1 block
// per SM in __launch_bounds__ (ptxas then schedules with ~80 registers instead of capping at 64).
enum { ADD_UNROLL = 2, ADD_MIN_BLOCKS = 1 };

template <typename D, typename A, typename B> struct AddSr {
  D* dst;
  const A* a;
  const B* __restrict__ b;
  float scale;
  uint2 key;
  u64 offset;

  template <int U, bool VEC> __device__ __forceinline__ void run(const u64 (&e)[U], u32 count) const {
    float x[U][8], y[U][8];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      load8<VEC>(a + e[u], count, x[u]);
      load8<VEC>(b + e[u], count, y[u]);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int k = 0; k < 8; ++k) x[u][k] = __fmul_rn(__fadd_rn(x[u][k], y[u][k]), scale);
      store8<VEC>(dst + e[u], count, x[u], group_noise<D>(key, offset + e[u]));
    }
  }
};

template <typename D, typename A, typename B>
__device__ __forceinline__ void add_sr(D* dst, const A* a, const B* __restrict__ b, float scale, u64 seed,
                                       u64 index_offset, u64 n) {
  AddSr<D, A, B> f{dst, a, b, scale, sr_key(seed), index_offset};
  for_each_group<ADD_UNROLL>(f, n, aligned16((u64)dst | (u64)a | (u64)b));
}

#define ADD_SR_KERNEL(DN, D, AN, A, BN, B)                                                              \
  extern "C" __global__ void __launch_bounds__(256, ADD_MIN_BLOCKS)                                                    \
  add_sr_##DN##_##AN##_##BN(D* dst, const A* a, const B* __restrict__ b, float scale, u64 seed,       \
                            u64 index_offset, u64 n) {                                                 \
    add_sr<D, A, B>(dst, a, b, scale, seed, index_offset, n);                                          \
  }

ADD_SR_KERNEL(f32, float, f32, float, f32, float)
ADD_SR_KERNEL(f32, float, f32, float, bf16, bf16_t)
ADD_SR_KERNEL(f32, float, bf16, bf16_t, f32, float)
ADD_SR_KERNEL(f32, float, bf16, bf16_t, bf16, bf16_t)
ADD_SR_KERNEL(bf16, bf16_t, f32, float, f32, float)
ADD_SR_KERNEL(bf16, bf16_t, f32, float, bf16, bf16_t)
ADD_SR_KERNEL(bf16, bf16_t, bf16, bf16_t, f32, float)
ADD_SR_KERNEL(bf16, bf16_t, bf16, bf16_t, bf16, bf16_t)

// ---- multi-tensor add_sr: one launch for up to MULTI_MAX tensors (a layer's gradients) ----------
// Tensor t owns blocks [first_block[t], first_block[t + 1]) and runs exactly the single-tensor
// loop on them, with its own seed and index offset: results equal separate add_sr launches.
enum : u32 { MULTI_MAX = 16 };

struct MultiAddSr {  // passed by value (__grid_constant__): 848 bytes of kernel parameters
  u64 dst[MULTI_MAX], a[MULTI_MAX], b[MULTI_MAX], seed[MULTI_MAX], offset[MULTI_MAX], n[MULTI_MAX];
  u32 first_block[MULTI_MAX + 1];
  u32 count;
  float scale;
};

template <typename D, typename A, typename B> __device__ __forceinline__ void add_sr_multi(const MultiAddSr& m) {
  const u32 blk = blockIdx.x;
  u32 t = 0;
  while (t + 1 < m.count && blk >= m.first_block[t + 1]) ++t;
  const u32 b0 = m.first_block[t];
  AddSr<D, A, B> f{(D*)m.dst[t], (const A*)m.a[t], (const B*)m.b[t], m.scale, sr_key(m.seed[t]), m.offset[t]};
  for_each_group_in<ADD_UNROLL>(f, m.n[t], aligned16(m.dst[t] | m.a[t] | m.b[t]), blk - b0,
                                m.first_block[t + 1] - b0);
}

#define ADD_SR_MULTI_KERNEL(DN, D, AN, A, BN, B)                                                        \
  extern "C" __global__ void __launch_bounds__(256, ADD_MIN_BLOCKS)                                     \
  add_sr_multi_##DN##_##AN##_##BN(const __grid_constant__ MultiAddSr m) {                             \
    add_sr_multi<D, A, B>(m);                                                                          \
  }

ADD_SR_MULTI_KERNEL(f32, float, f32, float, f32, float)
ADD_SR_MULTI_KERNEL(f32, float, f32, float, bf16, bf16_t)
ADD_SR_MULTI_KERNEL(bf16, bf16_t, bf16, bf16_t, f32, float)
ADD_SR_MULTI_KERNEL(bf16, bf16_t, bf16, bf16_t, bf16, bf16_t)
