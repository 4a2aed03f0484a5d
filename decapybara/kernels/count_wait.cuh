// Counts in global memory that blocks of one persistent kernel wait on (mx_gemv.cu's product chains,
// bench/chain_bound.cu): a block counts itself done with a piece of work (`block_count_done`: the block's barrier,
// then one release add by thread 0, which the barrier makes cover every thread's earlier stores), and a block
// waits for a count (`block_wait_count`: thread 0 polls with acquire loads, then the block's barrier, which
// orders every thread's later loads after the acquire), the pattern of a cooperative grid's barrier without its
// full fences.
#pragma once

__device__ __forceinline__ unsigned int ld_acquire_u32(const unsigned int* p) {
  unsigned int v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// Thread 0 polls until *counter >= target or *err is set; past `timeout` clock cycles from the first count short of
// the target (blocks that cannot all be resident) it sets *err and stops. Returns the count thread 0 saw last
// (the other threads: 0), after the block's barrier.
__device__ __forceinline__ unsigned int block_wait_count(const unsigned int* counter, unsigned int target,
                                                         unsigned int* err, long long timeout) {
  unsigned int got = 0;
  if (threadIdx.x == 0) {
    long long t0 = -1;
    while ((got = ld_acquire_u32(counter)) < target && !ld_acquire_u32(err)) {
      const long long t = clock64();
      if (t0 < 0) {
        t0 = t;
      } else if (t - t0 > timeout) {
        atomicExch(err, 1u);
        break;
      }
    }
  }
  __syncthreads();
  return got;
}

// Thread 0 (the caller's only): its block counts itself finished in *counter; true for the last of `blocks`, after
// a fence, so that what it then writes (e.g. the counts zeroed for the next launch) follows every block's counts.
__device__ __forceinline__ bool last_block_done(unsigned int* counter, unsigned int blocks) {
  __threadfence();
  const bool last = atomicAdd(counter, 1u) == blocks - 1;
  if (last) __threadfence();
  return last;
}

// The block's barrier, then *counter += 1 by thread 0 as a release.
__device__ __forceinline__ void block_count_done(unsigned int* counter) {
  __syncthreads();
  if (threadIdx.x == 0) asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(counter), "r"(1u) : "memory");
}
