// Philox4x32-10 (Random123), device side. No toolkit headers: NVRTC's built-ins only.
#pragma once

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

enum : u32 {
  PHILOX_M0 = 0xD2511F53u,  // multiplier of ctr[0]
  PHILOX_M1 = 0xCD9E8D57u,  // multiplier of ctr[2]
  PHILOX_W0 = 0x9E3779B9u,  // key[0] increment
  PHILOX_W1 = 0xBB67AE85u   // key[1] increment
};

// Ten rounds of Philox4x32 on counter c with key k; the key is bumped between rounds.
__device__ __forceinline__ uint4 philox4x32_10(uint4 c, uint2 k) {
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    if (round) {
      k.x += PHILOX_W0;
      k.y += PHILOX_W1;
    }
    const u32 lo0 = PHILOX_M0 * c.x, hi0 = __umulhi(PHILOX_M0, c.x);
    const u32 lo1 = PHILOX_M1 * c.z, hi1 = __umulhi(PHILOX_M1, c.z);
    c = make_uint4(hi1 ^ c.y ^ k.x, lo1, hi0 ^ c.w ^ k.y, lo0);
  }
  return c;
}
