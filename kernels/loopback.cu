// The loopback communicator's kernels: every rank of one process on one GPU, each on its own
// streams. Ranks meet in device memory (lowgrad/cuda/loopback.py packs these structs):
//   counters[W][W]       u64 per pair of ranks: meetings of rank a with rank b (monotonic), then one
//                        more word, the device copy of "failed" that the data kernels read (the
//                        status words live in host memory: one read per thread would cross PCIe);
//   table[W][LB_PTRS]    the device addresses each rank published at its latest sync;
//   status[LB_STATUS]    mapped pinned host memory: the host's abort request and the first error.
// A collective is sync (publish + wait for every rank) -> work reading peers' addresses from the
// table -> sync (every rank has finished reading before anyone reuses a buffer). All ranks issue
// the same collectives in the same order, so the k-th sync of every rank meets the others' k-th.
// A sync gives up when the host requests an abort, a peer left, or timeout_ns pass (0: never);
// it then records the error in status and in the device flag, and every later loopback kernel does
// nothing.
#include "copy.cuh"

// status words: the abort request (host), the error (first one wins), who waited, for whom,
// then one word per rank set when it left (LB_LEFT + rank, up to LB_MAX_WORLD ranks)
enum : u32 { LB_ABORT = 0, LB_ERROR = 1, LB_WAITER = 2, LB_PEER = 3, LB_LEFT = 4 };
enum : u32 { LB_ERR_TIMEOUT = 1, LB_ERR_ABORTED = 2, LB_ERR_LEFT = 3 };
enum : u32 { LB_PTRS = 16, LB_MAX_WORLD = 64, LB_STATUS = LB_LEFT + LB_MAX_WORLD };
// reduction ops: ncclRedOp_t codes
enum : u32 { LB_SUM = 0, LB_MAX = 2, LB_AVG = 4 };

__device__ __forceinline__ u64 now_ns() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ bool failed(const volatile u32* status) { return status[LB_ERROR] != 0; }
__device__ __forceinline__ bool flagged(u64 flag) { return *(const volatile u64*)flag != 0; }

__device__ void fail(volatile u32* status, volatile u64* flag, u32 error, u32 waiter, u32 peer) {
  *flag = 1;
  if (atomicCAS((u32*)&status[LB_ERROR], 0u, error) == 0u) {
    status[LB_WAITER] = waiter;
    status[LB_PEER] = peer;
  }
  __threadfence_system();
}

struct LoopbackSync {  // passed by value
  u64 counters, table, status;
  u64 ptrs[LB_PTRS];     // addresses to publish ...
  u32 entries[LB_PTRS];  // ... at these table entries
  u64 peers;             // bit q: meet rank q (this rank's bit is ignored)
  u32 nptrs, rank, world;
  u64 timeout_ns;
};

// One thread: publish this rank's addresses, count one meeting with each peer of the mask, then
// wait on the device until each of them has counted as many meetings with this rank.
// counters[a * world + b] counts the meetings of rank a with rank b (only a writes it), so ranks
// that meet in the same order (collectives: everyone; a group of sends and receives: its peers)
// find each other however the meetings of other pairs interleave, and a rank counts all its
// meetings before it waits for any (no cycle of waits).
extern "C" __global__ void __launch_bounds__(32) loopback_sync(const __grid_constant__ LoopbackSync s) {
  if (threadIdx.x != 0) return;
  volatile u32* status = (volatile u32*)s.status;
  volatile u64* counters = (volatile u64*)s.counters;
  volatile u64* flag = counters + (u64)s.world * s.world;
  if (failed(status)) {
    *flag = 1;
    return;
  }
  volatile u64* table = (volatile u64*)s.table;
  for (u32 i = 0; i < s.nptrs; ++i) table[s.entries[i]] = s.ptrs[i];
  __threadfence();  // this rank's writes (its buffers, its table entries) before its arrival
  u64 mine[LB_MAX_WORLD];
  for (u32 q = 0; q < s.world; ++q)
    if (q != s.rank && ((s.peers >> q) & 1ull)) mine[q] = atomicAdd((u64*)&counters[s.rank * s.world + q], 1ull) + 1;
  const u64 t0 = s.timeout_ns ? now_ns() : 0;
  for (u32 q = 0; q < s.world; ++q) {
    if (q == s.rank || !((s.peers >> q) & 1ull)) continue;
    while (counters[q * s.world + s.rank] < mine[q]) {
      if (status[LB_ABORT]) return fail(status, flag, LB_ERR_ABORTED, s.rank, q);
      if (status[LB_LEFT + q]) return fail(status, flag, LB_ERR_LEFT, s.rank, q);
      if (status[LB_ERROR]) {
        *flag = 1;
        return;
      }
      if (s.timeout_ns && now_ns() - t0 > s.timeout_ns) return fail(status, flag, LB_ERR_TIMEOUT, s.rank, q);
      __nanosleep(200);
    }
  }
  __threadfence();  // the peers' writes are visible to this rank's next kernels
}

// A delay of ns nanoseconds on the stream (the race hunter's jitter; a busy engine).
extern "C" __global__ void __launch_bounds__(32) loopback_delay(u64 ns) {
  if (threadIdx.x != 0) return;
  const u64 t0 = now_ns();
  while (now_ns() - t0 < ns) __nanosleep(1000);
}

// float <-> storage conversions of the reductions: one round-to-nearest-even at the end
__device__ __forceinline__ float load_f(const u16* p, u64 i, bool bf) {
  const u32 b = p[i];
  if (bf) return __uint_as_float(b << 16);
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((unsigned short)b));
  return f;
}
__device__ __forceinline__ u16 store_f(float v, bool bf) {
  if (bf) {
    const u32 u = __float_as_uint(v);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x40u);  // NaN stays a quiet NaN
    return (u16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
  unsigned short h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
  return h;
}
template <typename T> __device__ __forceinline__ T max_nan(T a, T b) { return (a > b || a != a) ? a : b; }

struct LoopbackReduce {  // passed by value
  u64 table, flag, dst;  // flag: the device copy of "failed" (after the counters)
  u64 offset, n;  // elements: every rank's input at table[q][slot] + offset, the result at dst + offset
  u32 slot, world, op;
  double scale;  // 1/world for avg (rounded to float for float accumulators)
};

// dst[offset + i] = op over ranks q = 0 .. world-1, in that order, of src_q[offset + i]; floats
// accumulate in fp32 (fp64 for fp64), avg multiplies the sum by scale, one rounding to the type;
// bytes wrap as uint8 and avg divides the wrapped sum (integer division). KIND: 0 native,
// 1 bf16 bits, 2 fp16 bits, 3 uint8.
template <typename T, typename Acc, int KIND> __device__ __forceinline__ Acc load_as(const T* s, u64 i) {
  if constexpr (KIND == 1 || KIND == 2) return load_f((const u16*)s, i, KIND == 1);
  else return (Acc)s[i];
}

template <typename T, typename Acc, int KIND> __device__ void reduce_body(const LoopbackReduce& r) {
  if (flagged(r.flag)) return;
  const u64* table = (const u64*)r.table;
  T* dst = (T*)r.dst + r.offset;
  const u64 stride = (u64)gridDim.x * blockDim.x;
  for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < r.n; i += stride) {
    Acc acc = load_as<T, Acc, KIND>((const T*)table[r.slot] + r.offset, i);
    for (u32 q = 1; q < r.world; ++q) {
      const Acc v = load_as<T, Acc, KIND>((const T*)table[q * LB_PTRS + r.slot] + r.offset, i);
      acc = r.op == LB_MAX ? max_nan(acc, v) : (Acc)(acc + v);
    }
    if (r.op == LB_AVG) acc = KIND == 3 ? (Acc)(acc / (Acc)r.world) : (Acc)(acc * (Acc)r.scale);
    if constexpr (KIND == 1 || KIND == 2) ((u16*)dst)[i] = store_f((float)acc, KIND == 1);
    else dst[i] = (T)acc;
  }
}

#define LOOPBACK_REDUCE(NAME, T, ACC, KIND)                                                             \
  extern "C" __global__ void __launch_bounds__(256) loopback_reduce_##NAME(const __grid_constant__ LoopbackReduce r) { \
    reduce_body<T, ACC, KIND>(r);                                                                      \
  }
LOOPBACK_REDUCE(bf16, u16, float, 1)
LOOPBACK_REDUCE(fp16, u16, float, 2)
LOOPBACK_REDUCE(fp32, float, float, 0)
LOOPBACK_REDUCE(fp64, double, double, 0)
LOOPBACK_REDUCE(byte, u8, u8, 3)

struct LoopbackCopy {  // passed by value
  u64 table, flag, dst;
  u64 src_offset, nbytes;  // bytes: from the address at table[entry], + src_offset, to dst
  u32 entry;
};

// A copy from a peer's published buffer (16-byte stores when both ends allow it).
extern "C" __global__ void __launch_bounds__(256) loopback_copy(const __grid_constant__ LoopbackCopy c) {
  if (flagged(c.flag)) return;
  copy_bytes((u8*)c.dst, (const u8*)((const u64*)c.table)[c.entry] + c.src_offset, c.nbytes);
}
