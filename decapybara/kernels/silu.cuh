// silu and sigmoid in float32, and CuPy's float32 multiply, one definition for the kernels that include common.cuh
// or act_kind.cuh (decode_ops' silu_mul_halves and mx_gemv's `_1s` epilogue must give the same bits, and so must
// decode_ops' sigmoid_mul_rows and the attention kernels' gated output).
#pragma once

__device__ __forceinline__ float silu_f(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float sigmoid_f(float x) { return 1.0f / (1.0f + expf(-x)); }

// a * b as CuPy's float32 multiply computes it: CuPy builds its elementwise kernels with -ftz=true (subnormal
// inputs and results flush to signed zero), these kernels keep subnormals when nvcc builds them. The host
// emulator (no __CUDA_ARCH__; its CuPy is numpy) multiplies plainly.
__device__ __forceinline__ float mul_as_cupy(float a, float b) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("mul.rn.ftz.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return a * b;
#endif
}
