// bf16 tensor-core building blocks (sm_80+) of the attention kernels (attn_decode, attn_prefill): ldmatrix
// loads of 8x8 b16 tiles from shared memory, the mma.sync m16n8k16 bf16 MMA with float32 accumulators, and a
// float pair split into bf16 hi and lo terms (two MMAs carry ~16 bits of a float operand).
#pragma once
#include "common.cuh"

// four 8x8 b16 tiles from shared-window address a (lanes 8i..8i+7 address tile i's rows); `t`: transposed
__device__ __forceinline__ void ldsm4(u32 a, u32& r0, u32& r1, u32& r2, u32& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(a));
}
__device__ __forceinline__ void ldsm4t(u32 a, u32& r0, u32& r1, u32& r2, u32& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(a));
}
// d += A (16 x 16, row-major fragments a0..a3) B (16 x 8, column fragments b0, b1)
__device__ __forceinline__ void mma(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// (a, b) -> bf16x2 {a low, b high} of the rounded values, and of the remainders a - bf16(a), b - bf16(b).
__device__ __forceinline__ void split2(float a, float b, u32& hi, u32& lo) {
  const u16 ha = f32_to_bf16(a), hb = f32_to_bf16(b);
  hi = (u32)ha | ((u32)hb << 16);
  lo = (u32)f32_to_bf16(a - bf16_to_f32(ha)) | ((u32)f32_to_bf16(b - bf16_to_f32(hb)) << 16);
}
// split2's values for finite a, b by one cvt.rn.bf16x2 a term (deltanet_chunk; NaN becomes the canonical NaN)
__device__ __forceinline__ u32 bf16x2_rne(float a, float b) {  // {a low, b high}, rounded to nearest even
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(b), "f"(a));
  return r;
}
__device__ __forceinline__ void split2_cvt(float a, float b, u32& hi, u32& lo) {
  hi = bf16x2_rne(a, b);
  lo = bf16x2_rne(a - __uint_as_float(hi << 16), b - __uint_as_float(hi & 0xFFFF0000u));
}
