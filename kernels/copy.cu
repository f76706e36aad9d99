// Copy nbytes bytes from src to dst with the GPU's cores (16-byte loads and stores where both ends
// allow it). The gradient managers use it instead of a copy engine for the shard copies they queue
// among their kernels: a copy engine is one queue that every stream of the process shares.
#include "philox.cuh"

extern "C" __global__ void __launch_bounds__(256) copy_u8(void* dst, const void* src, u64 nbytes) {
  u8* d = static_cast<u8*>(dst);
  const u8* s = static_cast<const u8*>(src);
  const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x, stride = (u64)gridDim.x * blockDim.x;
  if ((((u64)d | (u64)s) & 15u) == 0) {
    const u64 nvec = nbytes >> 4;
    for (u64 i = tid; i < nvec; i += stride) reinterpret_cast<uint4*>(d)[i] = reinterpret_cast<const uint4*>(s)[i];
    for (u64 j = (nvec << 4) + tid; j < nbytes; j += stride) d[j] = s[j];
  } else {
    for (u64 j = tid; j < nbytes; j += stride) d[j] = s[j];
  }
}
