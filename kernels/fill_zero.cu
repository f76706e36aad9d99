// Zero nbytes bytes at dst: byte stores up to the first 16-byte boundary, 16-byte stores, byte tail.
#include "philox.cuh"

extern "C" __global__ void __launch_bounds__(256) fill_zero_u8(void* dst, u64 nbytes) {
  u8* p = static_cast<u8*>(dst);
  const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x, stride = (u64)gridDim.x * blockDim.x;
  u64 head = (16u - ((u64)p & 15u)) & 15u;
  if (head > nbytes) head = nbytes;
  const u64 nvec = (nbytes - head) >> 4, tail = head + 16 * nvec;
  uint4* v = reinterpret_cast<uint4*>(p + head);
  const uint4 z = make_uint4(0u, 0u, 0u, 0u);
  u64 i = tid;
  for (; i + stride < nvec; i += 2 * stride) {
    v[i] = z;
    v[i + stride] = z;
  }
  if (i < nvec) v[i] = z;
  for (u64 j = tid; j < head; j += stride) p[j] = 0;
  for (u64 j = tail + tid; j < nbytes; j += stride) p[j] = 0;
}
