// Shared memory by 32-bit shared-window addresses (the kernels' asynchronous copies and vector loads).
#pragma once

// the shared-window address of a pointer into shared memory (static or dynamic)
__device__ __forceinline__ unsigned int smem_u32(const void* p) { return (unsigned int)__cvta_generic_to_shared(p); }

// 16 bytes global -> shared, asynchronous: `bytes` of them copied, the rest zero-filled (0: all zeros)
__device__ __forceinline__ void cp_async16(unsigned int dst, const void* src, unsigned int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;"); }
// wait until at most N of this thread's committed groups are in flight
template <int N> __device__ __forceinline__ void cp_wait_groups() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

// 16 bytes of shared memory at a shared-window address
__device__ __forceinline__ uint4 ld_shared_v4(unsigned int addr) {
  uint4 r;
  asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "r"(addr)
               : "memory");
  return r;
}
