// A fused norm consumer's row denominator (decapybara/backend/cupy_ops_extra.py `NormedRows`): sqrt(sum / K +
// eps) over the producer's `tiles` sums of squares q[0 .. tiles) of one row, by one warp in a fixed order (the
// same bits wherever it runs: mx_gemv.cu's consumers, gemv_small.cu's): lane-strided, the first two sums a lane
// loaded early (`norm_sums_first`, whose round trip may overlap other work), the rest added after them, then a
// butterfly.
#pragma once

struct NormSums {
  float a, b;  // sums lane and lane + 32 (zero where past the tiles or where the row is not the launch's)
};

__device__ __forceinline__ NormSums norm_sums_first(const float* q, int tiles, int lane, bool on) {
  return {on && lane < tiles ? q[lane] : 0.f, on && lane + 32 < tiles ? q[lane + 32] : 0.f};
}

// the row's denominator, in every lane
__device__ __forceinline__ float norm_denominator(NormSums first, const float* q, int tiles, int K, float eps,
                                                  int lane) {
  float s = first.a + first.b;
  for (int i = lane + 64; i < tiles; i += 32) s += q[i];
#pragma unroll
  for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  return sqrtf(s / (float)K + eps);
}
