// Shared device helpers: fixed-width types, bfloat16, warp/block reductions, the OCP MX element codecs
// (E4M3 / E5M2 / E2M3 / E3M2 / E2M1), the E8M0 scale and the KV-page vector formats.
//
// No system headers: the file compiles under NVRTC (CuPy's default) as well as nvcc. The codecs are the
// contract of docs/quant.md and decapybara/model/quant: encode rounds to nearest even and saturates to the
// max normal; the MX scale is 2^(floor(log2 amax) - emax_elem), clamped to E8M0 [-127, 127], code 0 for an
// all-zero block and 0xFF (NaN) for a block holding NaN or inf.
#pragma once
#include "pdl.cuh"
#include "silu.cuh"

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

#define FULL_MASK 0xffffffffu
#define NEG_INF (__int_as_float(0xff800000))
#define POS_INF (__int_as_float(0x7f800000))
#define QNAN (__int_as_float(0x7fc00000))

// Dynamic shared memory of a kernel, 16-byte aligned (overridable, e.g. by a host emulator).
#ifndef DYN_SMEM_DECL
#define DYN_SMEM_DECL(name) extern __shared__ __align__(16) unsigned char name[]
#endif

// ---- scalar helpers ----------------------------------------------------------------------------------
__device__ __forceinline__ float bf16_to_f32(u16 b) { return __uint_as_float(((u32)b) << 16); }

// float32 -> bfloat16 bits, round to nearest even; NaN -> 0x7FC0 (as kv_codec.f32_to_bf16_bits).
__device__ __forceinline__ u16 f32_to_bf16(float x) {
  const u32 u = __float_as_uint(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)0x7fc0u;
  return (u16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// out[i] = v as float32, or (out_bf16) as bf16 bits rounded to nearest even: a kernel whose rows may feed only
// skinny products, which round x to bf16 as they stage it (decapybara/backend/cupy_ops.py `_bf16_out`).
__device__ __forceinline__ void store_out(void* out, int out_bf16, i64 i, float v) {
  if (out_bf16)
    ((u16*)out)[i] = f32_to_bf16(v);
  else
    ((float*)out)[i] = v;
}

// qwen3_5's attention output gate in the kernel that finishes an attention output (the decode kernels' final
// items, attention_reduce): element (t, h, d) of out [T, H, D] is o itself where gate is null (float32), else
// o * sigmoid(gate[t * st + h * sh + d]) as decode_ops' sigmoid_mul_rows computes it after a float32 output,
// stored as float32 or bf16 bits (bf16: out_bf16, for a product that stages bf16 x). The same bits as the two
// launches. `value` loads the gate element (0 without a gate) so that a kernel can ask for it before the work
// that produces o, `store` takes it.
struct OutGate {
  const float* gate;
  i64 st, sh;
  int bf16;
  __device__ __forceinline__ float value(i64 t, int h, int d) const {
    return gate == nullptr ? 0.0f : gate[t * st + h * sh + d];
  }
  __device__ __forceinline__ void store(void* out, i64 t, int h, int H, int D, int d, float o, float gv) const {
    const i64 i = (t * H + h) * (i64)D + d;
    if (gate == nullptr)
      ((float*)out)[i] = o;
    else
      store_out(out, bf16, i, mul_as_cupy(o, sigmoid_f(gv)));
  }
};

__device__ __forceinline__ bool is_nonfinite(float x) {
  return (__float_as_uint(x) & 0x7f800000u) == 0x7f800000u;
}

// 2^n as a float for n in [-126, 127] (exact, built from the exponent field).
__device__ __forceinline__ float pow2i(int n) { return __int_as_float((n + 127) << 23); }

// floor(log2 |x|) for a normal float; -127 for zero and subnormals (callers clamp above that).
__device__ __forceinline__ int floor_log2(float a) {
  return (int)((__float_as_uint(a) >> 23) & 0xffu) - 127;
}

// ---- reductions ----------------------------------------------------------------------------------------
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
  return v;
}

// Sum over the whole block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
// `scratch` holds 33 floats of shared memory; the call ends with a barrier, so scratch may be reused.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = warp_sum(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float t = lane < nwarps ? scratch[lane] : 0.0f;
    t = warp_sum(t);
    if (lane == 0) scratch[32] = t;
  }
  __syncthreads();
  const float total = scratch[32];
  __syncthreads();
  return total;
}

// ---- MX element formats ----------------------------------------------------------------------------------
// EB exponent bits, MB mantissa bits. E4M3: only S.1111.111 is NaN; E5M2: IEEE specials; others all finite.
template <int EB, int MB>
struct MxElem {
  static constexpr int BITS = 1 + EB + MB;
  static constexpr int BIAS = (1 << (EB - 1)) - 1;
  static constexpr bool IS_E4M3 = (EB == 4 && MB == 3);
  static constexpr bool IS_E5M2 = (EB == 5 && MB == 2);
  static constexpr u32 MAG_MASK = (1u << (EB + MB)) - 1u;
  static constexpr u32 MAX_CODE = IS_E4M3 ? 0x7Eu : IS_E5M2 ? 0x7Bu : MAG_MASK;  // the max normal
  static constexpr int EMAX = IS_E4M3 ? 8 : IS_E5M2 ? 15 : ((1 << EB) - 1 - BIAS);
};

// code -> value (float32, exact).
template <int EB, int MB>
__device__ __forceinline__ float mx_decode(u32 code) {
  typedef MxElem<EB, MB> F;
  const u32 mag = code & F::MAG_MASK;
  const bool neg = (code >> (EB + MB)) & 1u;
  const int e = (int)(mag >> MB);
  const u32 f = mag & ((1u << MB) - 1u);
  float v;
  if (F::IS_E4M3 && mag == 0x7Fu) {
    v = QNAN;
  } else if (F::IS_E5M2 && e == 31) {
    v = f ? QNAN : POS_INF;
  } else {
    const u32 sig = e ? (f | (1u << MB)) : f;
    v = (float)sig * pow2i((e ? e : 1) - F::BIAS - MB);
  }
  return neg ? -v : v;
}

// value (already divided by the block scale, finite) -> code: round to nearest even, saturate to max normal.
// NOTE: a * 2^(MB - e) is exact (power-of-two scaling), so rintf sees the same number numpy compares with its
// float64 midpoints; code = ((e + bias) << MB) + r - 2^MB covers subnormals and a carry into the next binade.
template <int EB, int MB>
__device__ __forceinline__ u32 mx_encode(float q) {
  typedef MxElem<EB, MB> F;
  const u32 sign = __float_as_uint(q) >> 31;
  const float a = fabsf(q);
  u32 mag;
  if (a >= mx_decode<EB, MB>(F::MAX_CODE)) {
    mag = F::MAX_CODE;
  } else {
    int e = floor_log2(a);
    if (e < 1 - F::BIAS) e = 1 - F::BIAS;
    const float r = rintf(a * pow2i(MB - e));
    mag = (u32)((e + F::BIAS) << MB) + (u32)r - (1u << MB);
  }
  return (sign << (EB + MB)) | mag;
}

// E8M0 scale code of a block from its amax (largest |x|) and whether it holds NaN / inf.
__device__ __forceinline__ u32 e8m0_select(float amax, bool nonfinite, int emax_elem) {
  if (nonfinite) return 0xFFu;
  if (!(amax > 0.0f)) return 0u;
  int s = floor_log2(amax) - emax_elem;
  s = s < -127 ? -127 : (s > 127 ? 127 : s);
  return (u32)(s + 127);
}

// 2^(code - 127); code 0 is the subnormal 2^-127, 0xFF is NaN.
__device__ __forceinline__ float e8m0_value(u32 code) {
  if (code == 0xFFu) return QNAN;
  if (code == 0u) return __int_as_float(0x00400000);
  return __int_as_float((int)(code << 23));
}

// ---- packed codes ------------------------------------------------------------------------------------------
// Code i of a packed row (docs/quant.md): FP8 one per byte; FP4 two per byte, element 2j in the low nibble;
// FP6 four per three bytes, little-endian 24-bit word c0 | c1 << 6 | c2 << 12 | c3 << 18.
template <int BITS>
__device__ __forceinline__ u32 load_code(const u8* __restrict__ row, int i) {
  if constexpr (BITS == 8) {
    return row[i];
  } else if constexpr (BITS == 4) {
    const u32 b = row[i >> 1];
    return (i & 1) ? (b >> 4) : (b & 15u);
  } else {
    static_assert(BITS == 6, "packed codes are 8, 6 or 4 bits");
    const u8* g = row + (i >> 2) * 3;
    const u32 w = (u32)g[0] | ((u32)g[1] << 8) | ((u32)g[2] << 16);
    return (w >> (6 * (i & 3))) & 63u;
  }
}

// ---- KV page vectors -------------------------------------------------------------------------------------
// One vector = one token of one KV head along head_dim D. BITS 32: float [D]; 16: bf16 bits [D];
// 8 / 6 / 4: MXFP8 (E4M3) / MXFP6 (E2M3) / MXFP4 (E2M1) codes [Dp * BITS / 8] + E8M0 scales [Dp / 32],
// Dp = D rounded up to 32 (padding elements are zeros, code 0).
template <int BITS> struct KVElem;
template <> struct KVElem<8> { static constexpr int EB = 4, MB = 3; };
template <> struct KVElem<6> { static constexpr int EB = 2, MB = 3; };
template <> struct KVElem<4> { static constexpr int EB = 2, MB = 1; };

__host__ __device__ constexpr int kv_padded(int d) { return (d + 31) / 32 * 32; }
// Elements (BITS 32 / 16) or bytes (MX) of the codes of one vector.
__host__ __device__ constexpr int kv_code_stride(int bits, int d) {
  return bits >= 16 ? d : kv_padded(d) * bits / 8;
}
__host__ __device__ constexpr int kv_scale_stride(int d) { return kv_padded(d) / 32; }

// Element d of vector `vi` as float32.
template <int BITS>
__device__ __forceinline__ float kv_load(const void* __restrict__ codes, const u8* __restrict__ scales,
                                         i64 vi, int D, int d) {
  if constexpr (BITS == 32) {
    return ((const float*)codes)[vi * D + d];
  } else if constexpr (BITS == 16) {
    return bf16_to_f32(((const u16*)codes)[vi * D + d]);
  } else {
    typedef KVElem<BITS> E;
    const u8* row = (const u8*)codes + vi * kv_code_stride(BITS, D);
    const float s = e8m0_value(scales[vi * kv_scale_stride(D) + (d >> 5)]);
    return mx_decode<E::EB, E::MB>(load_code<BITS>(row, d)) * s;
  }
}

// Elements d0 .. d0 + 7 of vector `vi` as float32 (d0 and D multiples of 8): one 16 / 8 / 6 / 4-byte load of
// codes per group, one scale byte (8 consecutive elements never straddle a 32-block).
template <int BITS>
__device__ __forceinline__ void kv_load8(const void* __restrict__ codes, const u8* __restrict__ scales, i64 vi,
                                         int D, int d0, float* __restrict__ dst) {
  if constexpr (BITS == 32) {
    const float4* src = (const float4*)((const float*)codes + vi * D + d0);
    const float4 a = src[0], b = src[1];
    dst[0] = a.x; dst[1] = a.y; dst[2] = a.z; dst[3] = a.w;
    dst[4] = b.x; dst[5] = b.y; dst[6] = b.z; dst[7] = b.w;
  } else if constexpr (BITS == 16) {
    const uint4 w = *(const uint4*)((const u16*)codes + vi * D + d0);
    const u32 ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      dst[2 * i] = __uint_as_float(ws[i] << 16);
      dst[2 * i + 1] = __uint_as_float(ws[i] & 0xffff0000u);
    }
  } else {
    typedef KVElem<BITS> E;
    const u8* row = (const u8*)codes + vi * kv_code_stride(BITS, D);
    const float s = e8m0_value(scales[vi * kv_scale_stride(D) + (d0 >> 5)]);
    u32 c[8];
    if constexpr (BITS == 8) {
      const uint2 w = *(const uint2*)(row + d0);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        c[i] = (w.x >> (8 * i)) & 0xffu;
        c[i + 4] = (w.y >> (8 * i)) & 0xffu;
      }
    } else if constexpr (BITS == 4) {
      const u32 w = *(const u32*)(row + (d0 >> 1));
#pragma unroll
      for (int i = 0; i < 8; ++i) c[i] = (w >> (4 * i)) & 15u;
    } else {
      static_assert(BITS == 6, "KV bits are 32, 16, 8, 6 or 4");
      const u16* h = (const u16*)(row + d0 / 4 * 3);  // 6 bytes, 2-byte aligned
      const u32 lo = (u32)h[0] | ((u32)h[1] << 16);    // bytes 0..3
      const u32 hi = h[2];                              // bytes 4..5
      const u32 w0 = lo & 0xffffffu, w1 = (lo >> 24) | (hi << 8);  // two 24-bit little-endian words
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        c[i] = (w0 >> (6 * i)) & 63u;
        c[i + 4] = (w1 >> (6 * i)) & 63u;
      }
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) dst[i] = mx_decode<E::EB, E::MB>(c[i]) * s;
  }
}
