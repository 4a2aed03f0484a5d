// Dynamic MXFP8 activation quantiser: x [R, K] (fp32 / bf16 / f16) -> E4M3 codes u8 [R, Kp] and E8M0 scales
// u8 [R, Kp / 32], Kp = K rounded up to 32; the same bytes as decapybara.model.quant.quantize(x, "mxfp8").
//
// One warp per 32-element block, one element per lane; amax by a butterfly max (__shfl_xor_sync).
// Scale (OCP MX v1.0 6.3): code = clamp(floor(log2 amax) - 8 + 127, 0, 254) = max(E - 8, 0) with E the
// float32 biased exponent of amax (0 for zero and subnormal amax, which land on code 0 either way); a block
// holding NaN or inf gets scale 0xFF and codes 0. Elements: x * 2^(127 - code) is exact (|result| < 512
// or tiny enough that any rounding lands on zero), then round-to-nearest-even to E4M3 with saturation to
// +-448 by the hardware conversion (cvt.rn.satfinite.e4m3x2.f32); the sign of zero is kept.

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;
#include "act_kind.cuh"


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
        u16 pair;
        asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(0.f), "f"(q));
        code = (u8)(pair & 0xFFu);
    }
    codes[r * Kp + k] = code;
    if (lane == 0) scales[r * nb + b] = (u8)sc;
}
