// Activations of one of three element kinds, addressed as (pointer, kind, index): the wrappers pass the kind
// at run time (decapybara/backend/cupy_ops_extra.py `kind`). Float32 math on load; round-to-nearest-even on
// store. Inline PTX conversions: included by the kernels the host emulator does not build (mx_gemv, moe,
// act_quant), never by common.cuh.
#pragma once
#include "silu.cuh"

#define KIND_F32 0
#define KIND_BF16 1
#define KIND_F16 2

__device__ __forceinline__ float h2f(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ unsigned short f2bf(float f) {
    unsigned short r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
}
__device__ __forceinline__ float load_kind(const void* p, int kind, long long i) {
    if (kind == KIND_F32) return ((const float*)p)[i];
    const unsigned short h = ((const unsigned short*)p)[i];
    return kind == KIND_BF16 ? __uint_as_float((unsigned int)h << 16) : h2f(h);
}
__device__ __forceinline__ void store_kind(void* p, int kind, long long i, float v) {
    if (kind == KIND_F32) { ((float*)p)[i] = v; return; }
    unsigned short h;
    if (kind == KIND_BF16) h = f2bf(v);
    else asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
    ((unsigned short*)p)[i] = h;
}
