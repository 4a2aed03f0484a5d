// silu and sigmoid in float32, one definition for the kernels that include common.cuh or act_kind.cuh
// (decode_ops' silu_mul_halves and mx_gemv's `_1s` epilogue must give the same bits).
#pragma once

__device__ __forceinline__ float silu_f(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float sigmoid_f(float x) { return 1.0f / (1.0f + expf(-x)); }
