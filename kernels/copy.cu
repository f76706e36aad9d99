// Copy nbytes bytes from src to dst with the GPU's cores (16-byte loads and stores where both ends
// allow it). The gradient managers use it instead of a copy engine for the shard copies they queue
// among their kernels: a copy engine is one queue that every stream of the process shares.
#include "copy.cuh"

extern "C" __global__ void __launch_bounds__(256) copy_u8(void* dst, const void* src, u64 nbytes) {
  copy_bytes(static_cast<u8*>(dst), static_cast<const u8*>(src), nbytes);
}
