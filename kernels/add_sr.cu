// dst = SR((a + b) * scale) elementwise in float32 (add, then multiply), and dst = SR(a * scale);
// dst may alias a exactly. Element i uses the noise of index index_offset + i.
#include "grad_stats.cuh"

// Measured best on H200: 2 groups of 8 per thread and iteration, and an explicit minimum of 1 block
// per SM in __launch_bounds__ (ptxas then schedules with ~80 registers instead of capping at 64).
enum { ADD_UNROLL = 2, ADD_MIN_BLOCKS = 1 };

// What a watch sees of each group (a's values x, b's values y, before they are added): see() in
// full; or, in the fast path, before(u, ...) and, once the group is stored, after<SUM>(u, b,
// sum_finite) with b's group to read again (SUM: sum_finite says whether the group's a + b was
// finite, the add's own test).
struct NoWatch {
  __device__ __forceinline__ void see(const float (&)[8], const float (&)[8]) {}
  __device__ __forceinline__ void before(int, const float (&)[8], const float (&)[8]) {}
  template <bool SUM, typename B> __device__ __forceinline__ void after(int, const B*, bool) {}
};

// the gradient statistics of b (and of a, when a.base is set) of one warp's groups (grad_stats.cuh).
// In the fast path b's check for non-finite values waits until the group is stored: a branch on
// the sum of squares right after it would stall the warp on the multiply-add chain, and a group
// that needs the rare path reads its b values again (b is not written). Where the add tested its
// sum (SUM) that test picks the path, one instruction per group less: a non-finite b makes a + b
// non-finite, and rare() of finite values is maxabs8 with nothing counted, so the values are the
// same both ways for the groups the two tests route differently: a finite b sent to the rare path
// by a non-finite a or an overflowing sum, and a finite b whose squares overflow (t = +Inf) kept on
// the common path by a finite sum. a is written in place, so its rare path cannot wait.
template <int U> struct StatsWatch {
  StatsStream b, a;
  float t[U], g[U];
  __device__ __forceinline__ void see(const float (&x)[8], const float (&y)[8]) {
    b.acc.add8(y);
    if (a.base) a.acc.add8(x);
  }
  __device__ __forceinline__ void before(int u, const float (&x)[8], const float (&y)[8]) {
    t[u] = StatsAcc::sumsq8(y);
    g[u] = StatsAcc::maxabs8(y);
    if (a.base) a.acc.add8(x);
  }
  template <bool SUM, typename B> __device__ __forceinline__ void after(int u, const B* p, bool sum_finite) {
    if (SUM ? !sum_finite : !finite(t[u])) {
      float y[8];
      load8<true>(p, GROUP_ELEMS, y);
      g[u] = b.acc.rare(y);
    }
    b.acc.fold(t[u], g[u]);
  }
};

template <bool C, typename T, typename F> struct Pick {  // std::conditional (no standard library in NVRTC)
  using type = T;
};
template <typename T, typename F> struct Pick<false, T, F> {
  using type = F;
};

template <typename D, typename A, typename B> struct AddSr {
  D* dst;
  const A* a;
  const B* __restrict__ b;
  float scale;
  Rounding rd;
  u64 offset;

  template <int U, bool VEC> __device__ __forceinline__ void run(const u64 (&e)[U], u32 count) const {
    NoWatch w;
    run<U, VEC>(e, count, w);
  }

  // a's and b's values of the U groups, every load issued before any is used
  template <int U, bool VEC> __device__ __forceinline__ void load(const u64 (&e)[U], u32 count, float (&x)[U][8],
                                                                  float (&y)[U][8]) const {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      load8<VEC>(a + e[u], count, x[u]);
      load8<VEC>(b + e[u], count, y[u]);
    }
  }

  // w sees each group's a and b values (as float) before they are added, in element order
  template <int U, bool VEC, typename W> __device__ __forceinline__ void run(const u64 (&e)[U], u32 count, W& w) const {
    float x[U][8], y[U][8];
    load<U, VEC>(e, count, x, y);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      w.see(x[u], y[u]);
#pragma unroll
      for (int k = 0; k < 8; ++k) x[u][k] = __fmul_rn(__fadd_rn(x[u][k], y[u][k]), scale);
      store8<VEC>(dst + e[u], count, x[u], rd, offset + e[u]);
    }
  }

  // Whether run_fast computes this tensor's full aligned groups: SR (with or without a shift),
  // scale 1 (x * 1 is x, NaN included: the add already made it the canonical NaN) and a noise index
  // that is a multiple of 8 (each group one Philox call).
  __device__ __forceinline__ bool fast() const { return scale == 1.0f && !rd.rn && (offset & 7u) == 0; }

  // run<U, true>(e, GROUP_ELEMS, w) with fewer instructions per element, same bits: no multiply,
  // the NaN test once per group (finite8) instead of once per element, the shift (SHIFT: rd.shift
  // is not 0) folded into the noise's adds. The SR add issues close to the SM's instruction rate,
  // so each instruction per element costs time.
  template <int U, bool SHIFT, typename W> __device__ __forceinline__ void run_fast(const u64 (&e)[U], W& w) const {
    constexpr bool SUM = rounds_sr((D*)nullptr);  // the SR store tests the sum
    float x[U][8], y[U][8];
    bool sum_finite[U];
    load<U, true>(e, GROUP_ELEMS, x, y);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      w.before(u, x[u], y[u]);
#pragma unroll
      for (int k = 0; k < 8; ++k) x[u][k] = __fadd_rn(x[u][k], y[u][k]);
      sum_finite[u] = SUM && finite8(x[u]);
      if constexpr (SUM) {
        const uint4 r = sr_words(rd.key, (offset + e[u]) >> 3);
        const u32 sh = rd.shift;
        if (sum_finite[u])
          *reinterpret_cast<uint4*>(dst + e[u]) = make_uint4(
              pack_bf16x2_sr_finite<SHIFT>(x[u][0], x[u][1], r.x, sh),
              pack_bf16x2_sr_finite<SHIFT>(x[u][2], x[u][3], r.y, sh),
              pack_bf16x2_sr_finite<SHIFT>(x[u][4], x[u][5], r.z, sh),
              pack_bf16x2_sr_finite<SHIFT>(x[u][6], x[u][7], r.w, sh));
        else
          store8_vec(dst + e[u], x[u], SHIFT ? add_halves4(r, sh) : r, 0u);
      } else {
        store8_vec(dst + e[u], x[u], make_uint4(0u, 0u, 0u, 0u), 0u);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) w.template after<SUM>(u, b + e[u], sum_finite[u]);
  }
};

template <typename D, typename A, typename B>
__device__ __forceinline__ void add_sr(D* dst, const A* a, const B* __restrict__ b, float scale, u64 seed,
                                       u64 index_offset, u64 n) {
  AddSr<D, A, B> f{dst, a, b, scale, seed_rounding(seed), index_offset};
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

// ---- scale_sr: dst = SR(a * scale), the rounding of add_sr ---------------------------------------
template <typename D, typename A> struct ScaleSr {
  D* dst;
  const A* a;
  float scale;
  Rounding rd;
  u64 offset;

  template <int U, bool VEC> __device__ __forceinline__ void run(const u64 (&e)[U], u32 count) const {
    float x[U][8];
#pragma unroll
    for (int u = 0; u < U; ++u) load8<VEC>(a + e[u], count, x[u]);
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int k = 0; k < 8; ++k) x[u][k] = __fmul_rn(x[u][k], scale);
      store8<VEC>(dst + e[u], count, x[u], rd, offset + e[u]);
    }
  }
};

#define SCALE_SR_KERNEL(DN, D, AN, A)                                                                   \
  extern "C" __global__ void __launch_bounds__(256, ADD_MIN_BLOCKS)                                     \
  scale_sr_##DN##_##AN(D* dst, const A* a, float scale, u64 seed, u64 index_offset, u64 n) {           \
    ScaleSr<D, A> f{dst, a, scale, seed_rounding(seed), index_offset};                                 \
    for_each_group<ADD_UNROLL>(f, n, aligned16((u64)dst | (u64)a));                                    \
  }

SCALE_SR_KERNEL(f32, float, f32, float)
SCALE_SR_KERNEL(f32, float, bf16, bf16_t)
SCALE_SR_KERNEL(bf16, bf16_t, f32, float)
SCALE_SR_KERNEL(bf16, bf16_t, bf16, bf16_t)

// ---- multi-tensor add_sr: one launch for up to MULTI_MAX tensors (a layer's gradients) ----------
// A persistent grid (as many blocks as fit on the GPU at once) strides over chunks of
// CHUNK_THREADS * ADD_UNROLL groups of 8 elements; tensor t owns chunks [first[t], first[t + 1]).
// Every block moves the same bytes per chunk whatever the tensor sizes, so a layer of a dozen
// tensors of very different sizes runs like one large tensor (tools/bench_layer.py: 0.92 of copy
// bandwidth for a 282 MB layer, where one block range per tensor reached 0.70-0.83).
// Results equal separate add_sr launches (noise depends on the element index only). Tensor t's
// seed is seed[t], or with a counter the per-use rounding of (layer, lane = seed[t]) read when the
// kernel runs (sr.cuh).
// The host packs MultiAddSr by field name and splits tensors into chunks of CHUNK_ELEMS elements
// (lowgrad/cuda/kernels.py reads these constants here).
// add_sr_multi_stats_* also writes each block's statistics of each tensor's b (the gradient it
// consumes) at micro-step m >= 1 of the counter to its slot of set m of `stats`, and at micro-step
// 1 those of a (the shard, which then holds micro-step 0's gradient) to set 0: set m holds row m's
// (grad_stats.cuh; grad_stats_finish turns the slots into per-tensor values once the step is
// complete). b is measured at micro-steps 1 .. sets - 1 only (sets >= 1). Its threads take a
// chunk's elements as grad_stats' do.
enum : u32 { MULTI_MAX = 16, CHUNK_THREADS = 256, CHUNK_ELEMS = CHUNK_THREADS * ADD_UNROLL * GROUP_ELEMS };
static_assert(CHUNK_THREADS == STATS_THREADS && ADD_UNROLL == STATS_UNROLL, "a chunk is a grad_stats chunk");

struct MultiAddSr {  // passed by value (__grid_constant__): 880 bytes of kernel parameters
  u64 dst[MULTI_MAX], a[MULTI_MAX], b[MULTI_MAX], seed[MULTI_MAX], offset[MULTI_MAX], n[MULTI_MAX];
  u32 first[MULTI_MAX + 1];
  u32 count;
  float scale;
  const SeedCounter* counter;  // null: seed[t] is the seed
  u32 layer;
  StatsPartial* stats;  // add_sr_multi_stats_*: sets x count x gridDim.x slots
  u32 sets;
};

template <typename D, typename A, typename B, bool STATS>
__device__ __forceinline__ void add_sr_multi(const MultiAddSr& m) {
  __shared__ Rounding rds[MULTI_MAX];
  // the statistics' micro-step read beside the roundings, so that its latency overlaps theirs
  const bool measure_a = STATS && m.counter->micro == 1u;
  if (threadIdx.x < m.count)
    rds[threadIdx.x] = m.counter ? counter_rounding(m.counter, m.layer, (u32)m.seed[threadIdx.x])
                                 : seed_rounding(m.seed[threadIdx.x]);
  __syncthreads();
  constexpr int U = ADD_UNROLL;
  const u32 total = m.first[m.count];
  typename Pick<STATS, StatsWatch<U>, NoWatch>::type w{};
  __shared__ StatsPartial warps[STATS ? 2 * MULTI_MAX * STATS_WARPS : 1];
  if constexpr (STATS) {
    // b's set is picked at the end (flush): a pointer that depends on the micro-step here changes
    // ptxas' register allocation of the loop (96 registers instead of 80: 2 blocks per SM
    // instead of 3, 7% slower in run 43)
    w.b.base = m.stats;
    w.b.warps = warps;
    w.a.base = measure_a ? m.stats : nullptr;  // the same in every thread
    w.a.warps = warps + MULTI_MAX * STATS_WARPS;
  }
  u32 t = 0;
  for (u32 c = blockIdx.x; c < total; c += gridDim.x) {
    while (c >= m.first[t + 1]) ++t;
    if constexpr (STATS) {
      w.b.advance(t);
      w.a.advance(t);
    }
    const AddSr<D, A, B> f{(D*)m.dst[t], (const A*)m.a[t], (const B*)m.b[t], m.scale, rds[t], m.offset[t]};
    const u64 n = m.n[t], full = n / GROUP_ELEMS;
    const u64 g = (u64)(c - m.first[t]) * (U * CHUNK_THREADS) + threadIdx.x;
    const bool vec = aligned16(m.dst[t] | m.a[t] | m.b[t]);
    if (vec && g + (U - 1) * CHUNK_THREADS < full) {
      u64 e[U];
#pragma unroll
      for (int u = 0; u < U; ++u) e[u] = GROUP_ELEMS * (g + u * CHUNK_THREADS);
      if (f.fast() && f.rd.shift) f.template run_fast<U, true>(e, w);
      else if (f.fast()) f.template run_fast<U, false>(e, w);
      else f.template run<U, true>(e, GROUP_ELEMS, w);
    } else {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const u64 q = g + u * CHUNK_THREADS, e[1] = {GROUP_ELEMS * q};
        if (q < full) {
          if (vec) f.template run<1, true>(e, GROUP_ELEMS, w);
          else f.template run<1, false>(e, GROUP_ELEMS, w);
        } else if (q == full && (n & (GROUP_ELEMS - 1))) {
          f.template run<1, false>(e, (u32)(n & (GROUP_ELEMS - 1)), w);
        }
      }
    }
  }
  if constexpr (STATS) {
    const u32 micro = m.counter->micro;  // read before the warps' last sums, which hide its latency
    w.b.advance(m.count);
    w.a.advance(m.count);
    w.b.base = micro - 1u < m.sets - 1u ? m.stats + (u64)micro * m.count * gridDim.x : nullptr;
    __syncthreads();
    w.b.flush(m.count);
    w.a.flush(m.count);
  }
}

#define ADD_SR_MULTI_KERNEL(DN, D, AN, A, BN, B)                                                        \
  extern "C" __global__ void __launch_bounds__(CHUNK_THREADS, ADD_MIN_BLOCKS)                           \
  add_sr_multi_##DN##_##AN##_##BN(const __grid_constant__ MultiAddSr m) {                             \
    add_sr_multi<D, A, B, false>(m);                                                                   \
  }                                                                                                    \
  extern "C" __global__ void __launch_bounds__(CHUNK_THREADS, ADD_MIN_BLOCKS)                           \
  add_sr_multi_stats_##DN##_##AN##_##BN(const __grid_constant__ MultiAddSr m) {                       \
    add_sr_multi<D, A, B, true>(m);                                                                    \
  }

ADD_SR_MULTI_KERNEL(f32, float, f32, float, f32, float)
ADD_SR_MULTI_KERNEL(f32, float, f32, float, bf16, bf16_t)
ADD_SR_MULTI_KERNEL(bf16, bf16_t, bf16, bf16_t, f32, float)
ADD_SR_MULTI_KERNEL(bf16, bf16_t, bf16, bf16_t, bf16, bf16_t)
