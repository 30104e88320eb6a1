// Programmatic dependent launch (sm_90): a kernel launched with the attribute
// cudaLaunchAttributeProgrammaticStreamSerialization may start while the kernel before it in the
// stream is finishing; it reads what that kernel wrote, and writes anything, only after
// ok_grid_dependency_wait(). What it reads that no earlier kernel writes (constant weights) it may
// fetch before, e.g. into L2 with ok_prefetch_l2. ok_launch_dependents() lets the next such
// kernel start early in turn. With their CPU-emulation twins (no-ops: the emulation runs launches
// one after another). Before sm_90 the wait and the trigger compile to nothing (the launchers
// send no such launch there); the prefetch is sm_20's.
#pragma once

#ifdef OK_CUDA_EMULATION
__device__ __forceinline__ void ok_grid_dependency_wait() {}
__device__ __forceinline__ void ok_launch_dependents() {}
__device__ __forceinline__ void ok_prefetch_l2(const void*) {}
#else
__device__ __forceinline__ void ok_grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void ok_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
// The 128-byte line holding `p` into L2 (no register written, nothing waited for).
__device__ __forceinline__ void ok_prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p)); }
#endif
