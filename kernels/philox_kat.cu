// Philox4x32-10 of n (counter, key) pairs, for device-vs-host known-answer tests.
#include "philox.cuh"

extern "C" __global__ void __launch_bounds__(256)
philox_kat(const u32* __restrict__ ctr, const u32* __restrict__ key, u32* __restrict__ out, u64 n) {
  const u64 stride = (u64)gridDim.x * blockDim.x;
  for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    const uint4 c = make_uint4(ctr[4 * i], ctr[4 * i + 1], ctr[4 * i + 2], ctr[4 * i + 3]);
    const uint4 w = philox4x32_10(c, make_uint2(key[2 * i], key[2 * i + 1]));
    out[4 * i] = w.x;
    out[4 * i + 1] = w.y;
    out[4 * i + 2] = w.z;
    out[4 * i + 3] = w.w;
  }
}
