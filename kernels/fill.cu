// Set nbytes bytes at dst to one byte value (0: zeros; 0xFF: NaN in every float dtype lowgrad
// uses): byte stores up to the first 16-byte boundary, 16-byte stores, byte tail.
#include "philox.cuh"

extern "C" __global__ void __launch_bounds__(256) fill_u8(void* dst, u64 nbytes, u32 byte) {
  u8* p = static_cast<u8*>(dst);
  const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x, stride = (u64)gridDim.x * blockDim.x;
  u64 head = (16u - ((u64)p & 15u)) & 15u;
  if (head > nbytes) head = nbytes;
  const u64 nvec = (nbytes - head) >> 4, tail = head + 16 * nvec;
  uint4* v = reinterpret_cast<uint4*>(p + head);
  const u8 b = static_cast<u8>(byte);
  const u32 w = 0x01010101u * b;
  const uint4 z = make_uint4(w, w, w, w);
  u64 i = tid;
  for (; i + stride < nvec; i += 2 * stride) {
    v[i] = z;
    v[i + stride] = z;
  }
  if (i < nvec) v[i] = z;
  for (u64 j = tid; j < head; j += stride) p[j] = b;
  for (u64 j = tail + tid; j < nbytes; j += stride) p[j] = b;
}
