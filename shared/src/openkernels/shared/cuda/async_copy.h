// cp.async (global -> shared memory, per thread, in commit groups) and dynamic shared memory
// for the families' CUDA C++ kernels, with their CPU-emulation twins (cuda_emulation.h: a copy
// lands only at the wait that covers its group). Include after the CUDA headers or
// cuda_emulation.h; openkernels.shared.cuda_build puts this folder on the include path of
// every build (nvcc, ptxas checks, emulation) and its headers' digest in the cache key.
#pragma once

#include <stdint.h>

#ifndef OK_CUDA_EMULATION
#include <mutex>  // ok_opt_in_dynamic_shared
#include <tuple>
#include <vector>
#endif

#ifdef OK_CUDA_EMULATION
// OK_DYNAMIC_SHARED comes from cuda_emulation.h.
template <int BYTES, bool STREAM = false>
__device__ __forceinline__ void ok_copy_async(void* smem, const void* gmem) {
  ok_emu::copy_async(smem, gmem, BYTES);
}
__device__ __forceinline__ void ok_copy_async_commit() { ok_emu::copy_async_commit(); }
template <int N>
__device__ __forceinline__ void ok_copy_async_wait_group() {
  ok_emu::copy_async_wait_group(N);
}
__device__ __forceinline__ void ok_copy_async_wait_all() { ok_emu::copy_async_wait_all(); }
#else
// The kernel's dynamic shared memory as `unsigned char name[]`, 16-byte aligned.
#define OK_DYNAMIC_SHARED(name) extern __shared__ __align__(16) unsigned char name[]

// BYTES (4, 8 or 16) from global to shared memory. STREAM: 16 bytes read once, kept out of
// L1 (cp.async.cg). No L2 cache-policy hint: with `createpolicy` + `.L2::cache_hint` inside
// the asm, ptxas 13.0 gave some kernels an odd uniform register for the 64-bit policy
// descriptor (LDGSTS ... desc[UR1]), an illegal instruction on the H100 (quant's tc ring
// kernel, 2026-12-05; the family tests' SASS check guards it).
template <int BYTES, bool STREAM = false>
__device__ __forceinline__ void ok_copy_async(void* smem, const void* gmem) {
  const uint32_t dst = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  if constexpr (STREAM) {
    static_assert(BYTES == 16, "cp.async.cg copies 16 bytes");
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(gmem) : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(dst), "l"(gmem), "n"(BYTES) : "memory");
  }
}
__device__ __forceinline__ void ok_copy_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// Every committed group of this thread but the newest N has landed.
template <int N>
__device__ __forceinline__ void ok_copy_async_wait_group() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void ok_copy_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }
#endif

// Host side: `kernel`'s opt-in to at least `bytes` of dynamic shared memory (static plus dynamic
// past 48 KB needs it), asked of the driver only where this process has not yet opted the kernel
// in to that much on the current device (a launch past the size set fails, so a larger size asks
// again). cudaFuncSetAttribute at every launch cost ~1 us of host time a call (H100, quant's NF4
// split GEMV, 2026-12-07).
template <typename Kernel>
cudaError_t ok_opt_in_dynamic_shared(Kernel kernel, int bytes) {
#ifdef OK_CUDA_EMULATION
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
#else
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  const void* key = reinterpret_cast<const void*>(kernel);
  static std::mutex mutex;
  static std::vector<std::tuple<const void*, int, int>> granted;  // (kernel, device, bytes)
  std::lock_guard<std::mutex> lock(mutex);
  for (const auto& [k, d, b] : granted) {
    if (k == key && d == device && b >= bytes) return cudaSuccess;
  }
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err == cudaSuccess) granted.emplace_back(key, device, bytes);
  return err;
#endif
}
