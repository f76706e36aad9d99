// Element types, float conversions, stochastic rounding and the grid-stride driver shared by the
// elementwise kernels. bf16 values are bit patterns converted with integer arithmetic.
#pragma once
#include "philox.cuh"

struct bf16_t {  // a bf16 value as its bit pattern
  u16 bits;
};

__device__ constexpr bool rounds_sr(float*) { return false; }  // stored exactly
__device__ constexpr bool rounds_sr(bf16_t*) { return true; }  // stored with SR

// v's bits u rounded to bf16 with the 16-bit noise r, in the top half of the result: u + r (+ u's
// bit 16 when rn is 1: with r = 0x7fff that is round to nearest even). NaN stays a (quiet) NaN with
// its sign; Inf stays Inf; overflow past the largest bf16 gives Inf.
__device__ __forceinline__ u32 sr_word(float v, u32 r, u32 rn) {
  const u32 u = __float_as_uint(v);
  return v != v ? u | 0x00400000u : u + r + ((u >> 16) & rn);
}
__device__ __forceinline__ u32 bf16_sr_bits(float v, u32 r, u32 rn) { return sr_word(v, r, rn) >> 16; }

// v as a T with the 16-bit noise r: exact for fp32, rounded for bf16.
template <typename T> __device__ __forceinline__ T round_as(float v, u32 r, u32 rn);
template <> __device__ __forceinline__ float round_as<float>(float v, u32, u32) { return v; }
template <> __device__ __forceinline__ bf16_t round_as<bf16_t>(float v, u32 r, u32 rn) {
  return bf16_t{(u16)bf16_sr_bits(v, r, rn)};
}

// ---- noise -----------------------------------------------------------------------------------
__device__ __forceinline__ uint2 sr_key(u64 seed) { return make_uint2((u32)seed, (u32)(seed >> 32)); }

__device__ __forceinline__ uint4 sr_words(uint2 key, u64 g) {
  return philox4x32_10(make_uint4((u32)g, (u32)(g >> 32), 0u, 0u), key);
}

// How one launch rounds a tensor to bf16: with the Philox noise of `key` plus `shift` in every 16-bit
// half (SR: shift 0; low-discrepancy SR: micro-step * LD_STEP), or to nearest even (rn = 1).
struct Rounding {
  uint2 key;
  u32 shift, rn;
};
__device__ __forceinline__ Rounding seed_rounding(u64 seed) { return Rounding{sr_key(seed), 0u, 0u}; }

// A gradient manager's rounding state in device memory, read by the kernels when they run (so that
// a replayed CUDA graph draws fresh noise): docs/design.md's per-use seed of (layer, lane = 2 * tensor +
// phase) at the counter's step and micro-step; `mode` picks SR, low-discrepancy SR (the seed of
// micro-step 0, shifted by micro * LD_STEP) or round to nearest. kernels/seed_counter.cu updates it.
enum : u32 { ROUND_SR = 0, ROUND_LDSR = 1, ROUND_RN = 2, LD_STEP = 40503 };  // 40503 = round(0.618... * 2^16)
struct SeedCounter {
  u64 base;
  u32 step, micro, mode;
  u32 done;  // the micro-steps of the last completed step (0 before one): grad_stats_finish reads it
};

__device__ __forceinline__ Rounding counter_rounding(const SeedCounter* c, u32 layer, u32 lane) {
  const u32 ld = c->mode == ROUND_LDSR;
  const uint4 w = philox4x32_10(make_uint4(c->step, ld ? 0u : c->micro, layer, lane), sr_key(c->base));
  return Rounding{make_uint2(w.x, w.y), ld ? (c->micro * LD_STEP) & 0xffffu : 0u, c->mode == ROUND_RN ? 1u : 0u};
}

// `seed`'s rounding, or with a counter the per-use rounding of (layer, lane): computed once per
// block (all threads of the block must call this).
__device__ __forceinline__ Rounding block_rounding(u64 seed, const SeedCounter* counter, u32 layer, u32 lane) {
  if (!counter) return seed_rounding(seed);
  __shared__ Rounding s;
  if (threadIdx.x == 0) s = counter_rounding(counter, layer, lane);
  __syncthreads();
  return s;
}

__device__ __forceinline__ u32 sel4(u32 h, u32 a, u32 b, u32 c, u32 d) {
  return h < 2u ? (h ? b : a) : (h == 2u ? c : d);
}

// Noise of the 8 elements with indices first..first+7, packed like one Philox output: element k
// is the low half of word k/2 for even k, the high half for odd k. When first % 8 != 0 the 8
// elements straddle two Philox groups: the 16 halves of both are shifted by first % 8.
__device__ __forceinline__ uint4 sr_noise8(uint2 key, u64 first) {
  const u64 g = first >> 3;
  const u32 s = (u32)first & 7u;
  const uint4 w0 = sr_words(key, g);
  if (s == 0u) return w0;
  const uint4 w1 = sr_words(key, g + 1);
  const u32 h = s >> 1, sh = (s & 1u) * 16u;
  const u32 x0 = sel4(h, w0.x, w0.y, w0.z, w0.w), x1 = sel4(h, w0.y, w0.z, w0.w, w1.x);
  const u32 x2 = sel4(h, w0.z, w0.w, w1.x, w1.y), x3 = sel4(h, w0.w, w1.x, w1.y, w1.z);
  const u32 x4 = sel4(h, w1.x, w1.y, w1.z, w1.w);
  return make_uint4(__funnelshift_r(x0, x1, sh), __funnelshift_r(x1, x2, sh), __funnelshift_r(x2, x3, sh),
                    __funnelshift_r(x3, x4, sh));
}

// (w's low half + s) mod 2^16 | (w's high half + s) mod 2^16 << 16, for s < 2^16.
__device__ __forceinline__ u32 add_halves(u32 w, u32 s) { return ((w & 0xffff0000u) + (s << 16)) | ((w + s) & 0xffffu); }
__device__ __forceinline__ uint4 add_halves4(uint4 r, u32 s) {
  return make_uint4(add_halves(r.x, s), add_halves(r.y, s), add_halves(r.z, s), add_halves(r.w, s));
}

// Noise for a group stored as D: none (and no Philox work) for fp32 and round to nearest.
template <typename D> __device__ __forceinline__ uint4 group_noise(const Rounding& rd, u64 first) {
  if constexpr (rounds_sr((D*)nullptr)) {
    if (rd.rn) return make_uint4(0x7fff7fffu, 0x7fff7fffu, 0x7fff7fffu, 0x7fff7fffu);
    const uint4 r = sr_noise8(rd.key, first);
    return rd.shift ? add_halves4(r, rd.shift) : r;
  } else {
    return make_uint4(0u, 0u, 0u, 0u);
  }
}

__device__ __forceinline__ u32 noise_half(uint4 r, int k) {
  const u32 w = k < 2 ? r.x : k < 4 ? r.y : k < 6 ? r.z : r.w;
  return (k & 1) ? w >> 16 : w & 0xffffu;
}

// ---- groups of 8 elements in registers ---------------------------------------------------------
// Elements per group: one Philox call's noise (sr_noise8), one 16-byte bf16 load or two fp32 ones.
// The host sizes grids from it (lowgrad/cuda/kernels.py reads it here); the code below is for 8.
enum : u32 { GROUP_ELEMS = 8 };
__device__ __forceinline__ void unpack_bf16x2(u32 w, float& lo, float& hi) {
  lo = __uint_as_float(w << 16);
  hi = __uint_as_float(w & 0xffff0000u);
}

// 8 elements of T as loaded, before conversion (16 bytes of registers for bf16, 32 for fp32), so
// that many loads can be in flight without holding converted floats.
template <typename T> struct Raw8;
template <> struct Raw8<bf16_t> { uint4 q; };
template <> struct Raw8<float> { float4 lo, hi; };

// VEC: 8 elements from a 16-byte aligned address with 16-byte loads; else the first `count`
// elements one by one, the rest 0.
template <bool VEC> __device__ __forceinline__ Raw8<bf16_t> load_raw8(const bf16_t* p, u32 count) {
  if constexpr (VEC) {
    return {*reinterpret_cast<const uint4*>(p)};
  } else {
    u32 h[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) h[k] = (u32)k < count ? (u32)p[k].bits : 0u;
    return {make_uint4(h[0] | h[1] << 16, h[2] | h[3] << 16, h[4] | h[5] << 16, h[6] | h[7] << 16)};
  }
}
template <bool VEC> __device__ __forceinline__ Raw8<float> load_raw8(const float* p, u32 count) {
  if constexpr (VEC) {
    return {reinterpret_cast<const float4*>(p)[0], reinterpret_cast<const float4*>(p)[1]};
  } else {
    float v[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = (u32)k < count ? p[k] : 0.0f;
    return {make_float4(v[0], v[1], v[2], v[3]), make_float4(v[4], v[5], v[6], v[7])};
  }
}

__device__ __forceinline__ void to_f32x8(const Raw8<bf16_t>& r, float (&v)[8]) {
  unpack_bf16x2(r.q.x, v[0], v[1]); unpack_bf16x2(r.q.y, v[2], v[3]);
  unpack_bf16x2(r.q.z, v[4], v[5]); unpack_bf16x2(r.q.w, v[6], v[7]);
}
__device__ __forceinline__ void to_f32x8(const Raw8<float>& r, float (&v)[8]) {
  v[0] = r.lo.x; v[1] = r.lo.y; v[2] = r.lo.z; v[3] = r.lo.w;
  v[4] = r.hi.x; v[5] = r.hi.y; v[6] = r.hi.z; v[7] = r.hi.w;
}

// load_raw8, converted to float.
template <bool VEC, typename T> __device__ __forceinline__ void load8(const T* p, u32 count, float (&v)[8]) {
  to_f32x8(load_raw8<VEC>(p, count), v);
}

// The top halves of two words as one bf16 pair (one byte permute instead of two shifts and an or).
__device__ __forceinline__ u32 top_halves(u32 lo, u32 hi) { return __byte_perm(lo, hi, 0x7632); }

__device__ __forceinline__ u32 pack_bf16x2_sr(float lo, float hi, u32 r, u32 rn) {
  return top_halves(sr_word(lo, r & 0xffffu, rn), sr_word(hi, r >> 16, rn));
}

// pack_bf16x2_sr with SR noise (rn 0) for two finite values: no NaN test. Overflow past the
// largest bf16 still carries into Inf, as in bf16_sr_bits. SHIFT: the noise halves shifted by s
// (add_halves(r, s), folded into the adds: r + s's low half, r + (s << 16)'s high half).
template <bool SHIFT>
__device__ __forceinline__ u32 pack_bf16x2_sr_finite(float lo, float hi, u32 r, u32 s) {
  const u32 rlo = SHIFT ? (r + s) & 0xffffu : r & 0xffffu, rhi = SHIFT ? (r + (s << 16)) >> 16 : r >> 16;
  return top_halves(__float_as_uint(lo) + rlo, __float_as_uint(hi) + rhi);
}

__device__ __forceinline__ bool finite(float x) { return fabsf(x) <= __int_as_float(0x7f7fffff); }  // NaN: false

// Whether the 8 values are finite, by one sum: a NaN or Inf makes it NaN or Inf. A sum that
// overflows from finite values also says "no", which only sends the group to the general path.
__device__ __forceinline__ bool finite8(const float (&v)[8]) {
  return finite(__fadd_rn(__fadd_rn(__fadd_rn(v[0], v[1]), __fadd_rn(v[2], v[3])),
                          __fadd_rn(__fadd_rn(v[4], v[5]), __fadd_rn(v[6], v[7]))));
}

__device__ __forceinline__ void store8_vec(float* p, const float (&v)[8], uint4, u32) {
  reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
}
__device__ __forceinline__ void store8_vec(bf16_t* p, const float (&v)[8], uint4 r, u32 rn) {
  *reinterpret_cast<uint4*>(p) = make_uint4(pack_bf16x2_sr(v[0], v[1], r.x, rn), pack_bf16x2_sr(v[2], v[3], r.y, rn),
                                            pack_bf16x2_sr(v[4], v[5], r.z, rn), pack_bf16x2_sr(v[6], v[7], r.w, rn));
}

// Round the group with noise r (group_noise of rd) and rd.rn, and store it: VEC as one 16-byte
// aligned group, else the first `count` elements one by one.
template <bool VEC, typename T>
__device__ __forceinline__ void store8(T* p, u32 count, const float (&v)[8], const Rounding& rd, u64 first) {
  const uint4 r = group_noise<T>(rd, first);
  if constexpr (VEC) {
    store8_vec(p, v, r, rd.rn);
  } else {
#pragma unroll
    for (int k = 0; k < 8; ++k)
      if ((u32)k < count) p[k] = round_as<T>(v[k], noise_half(r, k), rd.rn);
  }
}

__device__ __forceinline__ bool aligned16(u64 bits) { return (bits & 15u) == 0; }

// Grid-stride loop over the groups of 8 consecutive elements of [0, n). `f.run<U, VEC>(e, count)`
// handles U groups starting at elements e[0..U): VEC (all pointers 16-byte aligned, checked by the
// caller) with full groups, U at a time for several independent loads in flight; else one group
// with `count` valid elements. The partial tail group goes to thread 0.
// for_each_group_in runs the loop on blocks [0, nblocks) numbered `block` (a slice of a larger
// grid: the multi-tensor kernels give each tensor its own range of blocks).
template <int U, typename F>
__device__ __forceinline__ void for_each_group_in(F& f, u64 n, bool vec, u32 block, u32 nblocks) {
  const u64 tid = (u64)block * blockDim.x + threadIdx.x, stride = (u64)nblocks * blockDim.x;
  const u64 full = n / GROUP_ELEMS;
  u64 q = tid;
  if (vec) {
    for (; q + (U - 1) * stride < full; q += U * stride) {
      u64 e[U];
#pragma unroll
      for (int u = 0; u < U; ++u) e[u] = GROUP_ELEMS * (q + u * stride);
      f.template run<U, true>(e, GROUP_ELEMS);
    }
    for (; q < full; q += stride) {
      const u64 e[1] = {GROUP_ELEMS * q};
      f.template run<1, true>(e, GROUP_ELEMS);
    }
  } else {
    for (; q < full; q += stride) {
      const u64 e[1] = {GROUP_ELEMS * q};
      f.template run<1, false>(e, GROUP_ELEMS);
    }
  }
  if (tid == 0 && (n % GROUP_ELEMS)) {
    const u64 e[1] = {GROUP_ELEMS * full};
    f.template run<1, false>(e, (u32)(n % GROUP_ELEMS));
  }
}

template <int U, typename F> __device__ __forceinline__ void for_each_group(F& f, u64 n, bool vec) {
  for_each_group_in<U>(f, n, vec, blockIdx.x, gridDim.x);
}
