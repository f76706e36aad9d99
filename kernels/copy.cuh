// The byte copy of copy.cu and the loopback's copy: a grid-stride loop over nbytes bytes, 16-byte
// loads and stores where both ends are 16-byte aligned, single bytes otherwise and for the tail.
#pragma once
#include "philox.cuh"

__device__ __forceinline__ void copy_bytes(u8* d, const u8* s, u64 nbytes) {
  const u64 tid = (u64)blockIdx.x * blockDim.x + threadIdx.x, stride = (u64)gridDim.x * blockDim.x;
  if ((((u64)d | (u64)s) & 15u) == 0) {
    const u64 nvec = nbytes >> 4;
    for (u64 i = tid; i < nvec; i += stride) reinterpret_cast<uint4*>(d)[i] = reinterpret_cast<const uint4*>(s)[i];
    for (u64 j = (nvec << 4) + tid; j < nbytes; j += stride) d[j] = s[j];
  } else {
    for (u64 j = tid; j < nbytes; j += stride) d[j] = s[j];
  }
}
