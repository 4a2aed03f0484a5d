// A product's persistent weights asked of the L2 ahead of the product, while the latency-bound kernels before it
// (a decode step's DeltaNet recurrence, its attention) leave DRAM mostly idle (decapybara/backend/cupy_ops_extra.py
// `l2_ahead`, TUNE `l2_ahead`). It reads and writes nothing: each thread asks for `piece`-byte pieces of the two
// ranges (a product's codes and scales; addresses 16-byte aligned, a range's bytes rounded down to 16) with one
// bulk prefetch each, a cache hint that leaves every value as it was.
// Launched overlapped (pdl.cuh): it lets the next kernel launch at once and waits for the kernel before only at
// its end, so that a kernel after it that waits for it also waits for every kernel before it (reading only
// persistent weights before that wait is what pdl.cuh allows).
#include "pdl.cuh"

__device__ __forceinline__ void l2_range(const unsigned char* p, long long n, long long i0, long long stride, int piece) {
  n &= ~15ll;
  for (long long i = i0 * piece; i < n; i += stride * piece) {
    const long long left = n - i;
    const unsigned int sz = (unsigned int)(left < piece ? left : piece);
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p + i), "r"(sz) : "memory");
#else
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p + i));
    (void)sz;
#endif
  }
}

extern "C" __global__ void l2_ahead(const unsigned char* a, long long na, const unsigned char* b, long long nb,
                                    int piece) {
  pdl_trigger();
  const long long i0 = (long long)blockIdx.x * blockDim.x + threadIdx.x, stride = (long long)gridDim.x * blockDim.x;
  if (a) l2_range(a, na, i0, stride, piece);
  if (b) l2_range(b, nb, i0, stride, piece);
  pdl_wait();
}
