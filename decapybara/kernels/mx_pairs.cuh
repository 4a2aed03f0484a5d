// Microscaled codes -> bf16x2 pairs in registers, the operands of bf16 tensor-core MMAs (mx_gemv.cu's
// weights, decapybara/kernels/attn_decode.cu's quantised KV pages).
//
// A code becomes a bf16 by moving its bits into place: the magnitude of an E2M1 / E2M3 code lands on the low
// bits of the bf16 exponent and the high bits of its mantissa (value * 2^-126), an E4M3 magnitude likewise
// (value * 2^-120), subnormal codes included (they become bf16 subnormals of the same scaled value), the sign
// on bit 15. One bf16x2 FMA by the block's factor (`mx_factor16`) then gives the exact product. The factor
// carries a further 2^-64 so that it stays a normal bf16 for any E8M0 code s <= 192 (E2M1 / E2M3) or 198
// (E4M3), i.e. blocks up to 2^65 (weights and KV of any real model); callers scale the other operand by 2^64.
#pragma once

// a * b elementwise on bf16x2 (exact here: one factor is a power of two, or an E4M3 times an E2M1 value).
__device__ __forceinline__ unsigned int mx_bfma2(unsigned int a, unsigned int b) {
  unsigned int d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
  return d;
}

// E8M0 code s -> the bf16 bits (low 16) of the factor 2^(s - 127 + OFF - 64): OFF = 120 for E4M3 codes, 126
// for E2M1 / E2M3. s = 255 gives a quiet NaN, a factor past the bf16 range infinity.
template <int OFF>
__device__ __forceinline__ unsigned int mx_factor16(unsigned int s) {
  if (s == 255u) return 0x7FC0u;
  const int e = (int)s + (OFF - 64);  // biased exponent of 2^(s - 127 + OFF - 64)
  return e > 254 ? 0x7F80u : (unsigned int)e << 7;
}

// E4M3: word v = codes c0..c3 (byte i = c_i) -> p02 = (c0, c2), p13 = (c1, c3), times the factor pair f.
__device__ __forceinline__ void e4m3_pairs(unsigned int v, unsigned int f, unsigned int& p02, unsigned int& p13) {
  const unsigned int M = 0x07F007F0u, S = 0x80008000u;
  p02 = mx_bfma2(((v << 4) & M) | ((v << 8) & S), f);
  p13 = mx_bfma2(((v >> 4) & M) | (v & S), f);
}

// E2M1: word v = codes c0..c7 (nibble i = c_i) -> a[r] = (c_r, c_{r+4}) as bf16x2 of value * 2^-126 (the
// subnormal codes +-0.5 as bf16 subnormals), unscaled.
__device__ __forceinline__ void e2m1_pairs_raw(unsigned int v, unsigned int (&a)[4]) {
  const unsigned int M = 0x01C001C0u, S = 0x80008000u;
  a[0] = ((v << 6) & M) | ((v << 12) & S);
  a[1] = ((v << 2) & M) | ((v << 8) & S);
  a[2] = ((v >> 2) & M) | ((v << 4) & S);
  a[3] = ((v >> 6) & M) | (v & S);
}

// E2M1: the same pairs times f.
__device__ __forceinline__ void e2m1_pairs(unsigned int v, unsigned int f, unsigned int (&a)[4]) {
  e2m1_pairs_raw(v, a);
#pragma unroll
  for (int r = 0; r < 4; ++r) a[r] = mx_bfma2(a[r], f);
}

// E2M1, split-field layout (weights only: decapybara/backend/gemv_plan.py `e2m1_split_words` packs it): each
// 16-bit half h of w holds codes c_{4h}..c_{4h+3} as four 3-bit magnitudes at bits 0-2, 3-5, 6-8, 9-11 and
// their signs at bits 13, 12, 15, 14 -> the same a[r] = (c_r, c_{r+4}), times f, as e2m1_pairs on the plain
// word. a[2] needs no shift, a[1] one, a[3] two; a[0] = ((w << 6) & M) | ((w << 2) & S) is computed as one
// multiply of its fields (w & 0x20072007) by 2^6 + 2^2 (the two terms overlap only at bits 18-21, whose carry
// stops below bit 22). 14 instructions a word with the FMAs, instead of 20; no field crosses a 16-bit half.
// The pairs unscaled (value * 2^-126, as e2m1_pairs_raw):
__device__ __forceinline__ void e2m1_pairs_split_raw(unsigned int w, unsigned int (&a)[4]) {
  const unsigned int M = 0x01C001C0u, S = 0x80008000u;
  a[0] = ((w & 0x20072007u) * 68u) & (M | S);
  a[1] = (w << 3) & (M | S);
  a[2] = w & (M | S);
  a[3] = ((w >> 3) & M) | ((w << 1) & S);
}

// and times f:
__device__ __forceinline__ void e2m1_pairs_split(unsigned int w, unsigned int f, unsigned int (&a)[4]) {
  e2m1_pairs_split_raw(w, a);
#pragma unroll
  for (int r = 0; r < 4; ++r) a[r] = mx_bfma2(a[r], f);
}

// E2M3: two groups A, B of four 6-bit codes (24-bit little-endian c0 | c1 << 6 | c2 << 12 | c3 << 18) given
// as g01 = bytes (A0, A1, B0, B1) and g23 = bytes (A1, A2, B1, B2) -> a[r] = (A c_r, B c_r), times f.
__device__ __forceinline__ void e2m3_pairs(unsigned int g01, unsigned int g23, unsigned int f,
                                           unsigned int (&a)[4]) {
  const unsigned int M = 0x01F001F0u, S = 0x80008000u;
  a[0] = mx_bfma2(((g01 << 4) & M) | ((g01 << 10) & S), f);
  a[1] = mx_bfma2(((g01 >> 2) & M) | ((g01 << 4) & S), f);
  a[2] = mx_bfma2((g23 & M) | ((g23 << 6) & S), f);
  a[3] = mx_bfma2(((g23 >> 6) & M) | (g23 & S), f);
}

// (g01, g23) of e2m3_pairs from two 24-bit groups in the low bytes of a and b (their top bytes unused).
__device__ __forceinline__ void e2m3_groups(unsigned int a, unsigned int b, unsigned int& g01, unsigned int& g23) {
  g01 = __byte_perm(a, b, 0x5410);
  g23 = __byte_perm(a, b, 0x6521);
}
