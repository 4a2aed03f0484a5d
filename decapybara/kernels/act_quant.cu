// Dynamic MXFP8 activation quantiser: x [R, K] (fp32 / bf16 / f16) -> E4M3 codes u8 [R, Kp] and E8M0 scales
// u8 [R, Kp / 32], Kp = K rounded up to 32; the same bytes as decapybara.model.quant.quantize(x, "mxfp8").
//
// One warp per 32-element block, one element per lane; amax by a butterfly max (__shfl_xor_sync).
// Scale (OCP MX v1.0 6.3): code = clamp(floor(log2 amax) - 8 + 127, 0, 254) = max(E - 8, 0) with E the
// float32 biased exponent of amax (0 for zero and subnormal amax, which land on code 0 either way); a block
// holding NaN or inf gets scale 0xFF and codes 0. Elements: x * 2^(127 - code) is exact (|result| < 512
// or tiny enough that any rounding lands on zero), then round-to-nearest-even to E4M3 with saturation to
// +-448 by the hardware conversion (cvt.rn.satfinite.e4m3x2.f32, sm_89 and later); the sign of zero is kept.
// Devices before sm_89 (Ampere), and builds with AQ_SOFT set (so Hopper tests can check it), round in software
// (`e4m3_rne`): the same bytes.

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
#include "act_kind.cuh"

#ifndef AQ_SOFT
#define AQ_SOFT 0  // 1: the software rounding below on every device
#endif
#if AQ_SOFT || (defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890)
#define AQ_SOFT_PATH 1
#else
#define AQ_SOFT_PATH 0
#endif

// q (finite, |q| < 512 as the quantiser scales it) -> E4M3 bits, round to nearest even, saturating to
// +-448 (0x7E / 0xFE), sign of zero kept: what cvt.rn.satfinite.e4m3x2.f32 gives. Normal E4M3 values are
// 2^(E - 7) (1 + m / 8) for fields E 1..15 (m 0..6 at E 15), subnormal ones m 2^-9; scaling by a power of two is
// exact, so one rounding to an integer (nearest even) picks the code.
__device__ __forceinline__ u8 e4m3_rne(float q) {
    const u8 sign = (__float_as_uint(q) >> 24) & 0x80u;
    const float a = fabsf(q);
    u32 mag;
    if (a >= 448.f) {
        mag = 0x7Eu;
    } else if (a < 0.015625f) {  // below 2^-6: subnormal codes m 2^-9 (m 8 is 2^-6, the first normal code)
        mag = (u32)__float2int_rn(a * 512.f);
    } else {
        const int e = (int)(__float_as_uint(a) >> 23) - 127;                     // -6 .. 8
        const int m = __float2int_rn(a * __uint_as_float((u32)(130 - e) << 23));  // a 2^(3 - e): 8 .. 16
        mag = (u32)((e + 7) * 8 + m - 8);  // m 16 carries into the exponent; a < 448 keeps mag <= 0x7E
    }
    return (u8)(sign | mag);
}


extern "C" __global__ void act_quant_mxfp8(const void* x, int kind, long long ldx, int R, int K, int Kp, u8* codes,
                                           u8* scales) {
    const long long warp = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31, nb = Kp >> 5;
    if (warp >= (long long)R * nb) return;  // whole warps exit together
    const long long r = warp / nb;
    const int b = (int)(warp % nb), k = b * 32 + lane;
    const float v = k < K ? load_kind(x, kind, r * ldx + k) : 0.f;
    const u32 bits = __float_as_uint(v) & 0x7FFFFFFFu;
    const bool bad = __any_sync(0xFFFFFFFFu, bits >= 0x7F800000u);  // NaN or inf anywhere in the block
    u32 amax = bits;  // ordered as integers for non-negative floats
    for (int o = 16; o; o >>= 1) amax = max(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, o));
    const int e = (int)(amax >> 23);
    const u32 sc = bad ? 255u : (u32)max(e - 8, 0);
    u8 code = 0;
    if (!bad) {
        const float q = v * __uint_as_float((254u - sc) << 23);  // 2^(127 - sc), exact
#if AQ_SOFT_PATH
        code = e4m3_rne(q);
#else
        u16 pair;
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(0.f), "f"(q));
        code = (u8)(pair & 0xFFu);
#endif
    }
    codes[r * Kp + k] = code;
    if (lane == 0) scales[r * nb + b] = (u8)sc;
}
