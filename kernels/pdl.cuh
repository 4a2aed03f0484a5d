// Programmatic dependent launch (sm_90+): a kernel launched with the programmatic-stream-serialization
// attribute (decapybara/backend/pdl.py) may start while the kernel before it in the stream still runs, once
// every block of that kernel has called pdl_trigger() (or exited). It must call pdl_wait() before it reads
// anything the earlier kernel writes, or writes anything the earlier kernel reads: pdl_wait() returns when
// the earlier kernel has completed and its memory is visible. Both are no-ops on older GPUs, under a plain
// launch (pdl_wait() returns at once: the stream already ordered the kernels) and in the host emulator.
//
// The skinny GEMM uses it to have its first weight loads in flight before the small kernel that produces
// its x (a norm, a gate) has finished: weights are never written by a decode step.
#pragma once

__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
