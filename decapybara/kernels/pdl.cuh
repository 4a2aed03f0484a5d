// Programmatic dependent launch (sm_90+): a kernel launched with the programmatic-stream-serialization
// attribute (decapybara/backend/pdl.py) may start while the kernel before it in the stream still runs, once
// every block of that kernel has called pdl_trigger() (or exited). pdl_wait() returns when the kernel before
// has completed and its memory is visible. Kernels here that trigger at their start do so before their own
// wait, so a launched kernel may run alongside several earlier ones: before pdl_wait() it may only read data
// that no kernel of the current step writes (persistent weights; the DeltaNet state, written only by the same
// layer's kernel of an earlier step or by host-ordered copies between steps) and must write nothing. Both are
// no-ops on older GPUs, under a plain launch (pdl_wait() returns at once: the stream already ordered the
// kernels) and in the host emulator.
//
// The skinny GEMM uses it to have its first weight loads in flight before the small kernel that produces
// its x (a norm, a gate) has finished.
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

// The start of an overlapped kernel that has nothing to load before its wait: let the next kernel launch,
// then wait for the one before.
__device__ __forceinline__ void pdl_begin() {
  pdl_trigger();
  pdl_wait();
}
