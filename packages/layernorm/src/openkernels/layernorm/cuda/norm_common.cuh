// What the layernorm family's CUDA C++ sources share (norm_cluster.cu, norm_push.cu):
// dtypes, 16-byte row vectors, streamed loads and stores, the launch flags and the clustered
// launch. Included once per source, after nothing else (it includes the CUDA headers or the
// CPU emulation's).
#pragma once
#ifdef OK_CUDA_EMULATION  // built for the CPU by the tests (openkernels.shared.cuda_build.load_emulated)
#include "cuda_emulation.h"
#else
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#endif
#include <stdint.h>
#include <string.h>

#include "async_copy.h"  // openkernels/shared/cuda: cp.async and dynamic shared memory

namespace cg = cooperative_groups;

namespace {

constexpr int kMaxCluster = 16;  // the non-portable cluster limit of sm_90
constexpr int kIsRms = 1, kHasResidual = 2, kStoreResidual = 4, kHasWeight = 8, kHasBias = 16;
// Backward flags (kIsRms and kHasWeight as above).
constexpr int kHasDhOut = 32, kWeightGrad = 64, kBiasGrad = 128;
// Launcher flag of both directions (the kernels never read it): the staged kernels.
constexpr int kStaged = 256;
constexpr size_t kMaxDynamicShared = 227 * 1024;  // sm_90's per-CTA limit

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }

// N elements of U in one aligned block: 16 bytes for the row's dtype, 16 or 32 for weights.
template <typename U, int N>
struct alignas(sizeof(U) * N) Vec {
  U v[N];
};

// 16 bytes of a row, streamed (read once, written once: keep them out of L1 and early out of L2).
template <typename V>
__device__ __forceinline__ V load_stream(const void* p) {
  static_assert(sizeof(V) == 16, "one 16-byte access");
  const uint4 raw = __ldcs(static_cast<const uint4*>(p));
  V v;
  memcpy(&v, &raw, 16);
  return v;
}
template <typename V>
__device__ __forceinline__ void store_stream(void* p, const V& v) {
  static_assert(sizeof(V) == 16, "one 16-byte access");
  uint4 raw;
  memcpy(&raw, &v, 16);
#ifdef OK_PLAIN_STORES  // a study's variant (benchmarks/studies/norm_cluster_variants.py)
  *static_cast<uint4*>(p) = raw;
#else
  __stcs(static_cast<uint4*>(p), raw);
#endif
}

// The per-kernel opt-ins a launch of `kernel` with this much dynamic shared memory in clusters
// of `cluster` needs: past 48 KiB of shared memory, static and dynamic together (asked for any
// dynamic size: the opt-in is remembered per kernel and device, and a launch of exactly 48 KiB
// dynamic beside the kernel's static parts and barriers failed without it, status 1, on an
// H100), past the portable cluster size.
template <typename... Params>
cudaError_t allow_launch(void (*kernel)(Params...), int cluster, size_t dynamic_shared) {
  if (dynamic_shared > 0) {
    cudaError_t err = ok_opt_in_dynamic_shared(kernel, static_cast<int>(dynamic_shared));
    if (err != cudaSuccess) return err;
  }
  if (cluster > 8) return cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  return cudaSuccess;
}

// A launch configuration over `ctas` CTAs of `threads` threads in clusters of `cluster`
// (`attribute`: its storage). A cluster of one launches without the attribute: every CTA of a
// plain launch is its own cluster of one on sm_90, and a plain launch schedules CTAs freely.
inline cudaLaunchConfig_t clustered_config(int cluster, int64_t ctas, int threads, size_t dynamic_shared,
                                           cudaStream_t stream, cudaLaunchAttribute& attribute) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(ctas), 1, 1);
  config.blockDim = dim3(static_cast<unsigned>(threads), 1, 1);
  config.dynamicSmemBytes = dynamic_shared;
  config.stream = stream;
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = cluster;
  attribute.val.clusterDim.y = 1;
  attribute.val.clusterDim.z = 1;
  config.attrs = &attribute;
  config.numAttrs = cluster > 1 ? 1 : 0;
  return config;
}

// One launch of `kernel` over `ctas` CTAs of `threads` threads in clusters of `cluster`.
template <typename... Params, typename... Args>
int launch_clustered(void (*kernel)(Params...), int cluster, int64_t ctas, int threads, size_t dynamic_shared,
                     cudaStream_t stream, Args... args) {
  cudaError_t err = allow_launch(kernel, cluster, dynamic_shared);
  if (err != cudaSuccess) return static_cast<int>(err);
  cudaLaunchAttribute attribute;
  const cudaLaunchConfig_t config = clustered_config(cluster, ctas, threads, dynamic_shared, stream, attribute);
  return static_cast<int>(cudaLaunchKernelEx(&config, kernel, static_cast<Params>(args)...));
}

// How many clusters of `cluster` CTAs of `kernel` the device holds at once: 0 where it cannot
// schedule such a cluster at all (a part whose GPCs have fewer free SMs than a non-portable
// cluster needs), or -(1000 + a cudaError_t).
template <typename... Params>
int active_clusters(void (*kernel)(Params...), int cluster, int threads, size_t dynamic_shared) {
  cudaError_t err = allow_launch(kernel, cluster, dynamic_shared);
  if (err != cudaSuccess) return -(1000 + static_cast<int>(err));
  cudaLaunchAttribute attribute;
  const cudaLaunchConfig_t config = clustered_config(cluster, cluster, threads, dynamic_shared, nullptr, attribute);
  int count = 0;
  err = cudaOccupancyMaxActiveClusters(&count, kernel, &config);
  return err == cudaSuccess ? count : -(1000 + static_cast<int>(err));
}

// Every forward kernel's signature (x, res, weight, bias, out, res_out, mean, rstd, n_cols,
// the four row strides, eps, weight_offset, flags).
template <typename T, typename W>
using FwdKernel = void (*)(const T*, const T*, const W*, const W*, T*, T*, float*, float*, int64_t, int64_t, int64_t,
                           int64_t, int64_t, float, float, int);

// Each source's forward kernel for a (threads, vectors per thread) shape and the launch's flags
// (nullptr: not built), and the dynamic shared memory it takes; defined by the source.
template <typename T, typename W>
FwdKernel<T, W> pick_fwd(int threads, int vpt, int flags, size_t& dynamic_shared);

// One forward over n_rows rows, a cluster of `cluster` CTAs per row.
template <typename T, typename W>
int fwd(int threads, int vpt, int cluster, int64_t n_rows, const void* x, const void* res, const void* weight,
        const void* bias, void* out, void* res_out, void* mean, void* rstd, int64_t n_cols, int64_t stride_x,
        int64_t stride_res, int64_t stride_out, int64_t stride_res_out, float eps, float weight_offset, int flags,
        cudaStream_t stream) {
  size_t shared = 0;
  FwdKernel<T, W> kernel = pick_fwd<T, W>(threads, vpt, flags, shared);
  if (kernel == nullptr || shared > kMaxDynamicShared) return -2;
  return launch_clustered(kernel, cluster, cluster * n_rows, threads, shared, stream, x, res, weight, bias, out, res_out,
                          mean, rstd, n_cols, stride_x, stride_res, stride_out, stride_res_out, eps, weight_offset,
                          flags);
}

// fwd's kernel: how many clusters of it the device holds at once (active_clusters), or -2.
template <typename T, typename W>
int fwd_clusters(int threads, int vpt, int cluster, int flags) {
  size_t shared = 0;
  FwdKernel<T, W> kernel = pick_fwd<T, W>(threads, vpt, flags, shared);
  if (kernel == nullptr || shared > kMaxDynamicShared) return -2;
  return active_clusters(kernel, cluster, threads, shared);
}

}  // namespace

// The stream is passed as an integer (the handle PyTorch gives): a constant to replay
// recordings, which key on the stream (openkernels.shared.replay), where a pointer argument
// would have to be a tensor's. dtype codes: 0 float32, 1 bfloat16, 2 float16; `weight_code` is the weight's and bias's
// (or 0 without them). Each entry returns 0, a cudaError_t, or -1 (dtypes), -2 (a shape this
// library was not built for), -3 (a cluster outside 1..16).
#define OK_NORM_CLUSTER_DTYPES(FN, ...)                                                                         \
  if (dtype_code == 1 && weight_code == 1) return FN<__nv_bfloat16, __nv_bfloat16>(__VA_ARGS__);              \
  if (dtype_code == 1 && weight_code == 0) return FN<__nv_bfloat16, float>(__VA_ARGS__);                      \
  if (dtype_code == 2 && weight_code == 2) return FN<__half, __half>(__VA_ARGS__);                            \
  if (dtype_code == 2 && weight_code == 0) return FN<__half, float>(__VA_ARGS__);                             \
  if (dtype_code == 0 && weight_code == 0) return FN<float, float>(__VA_ARGS__);                              \
  return -1;

// A source's forward host entry `name` (the dtype pair from the codes, then its own fwd<T, W>)
// and its packed twin `packed` (every argument in one 64-bit slot, doubles as their bits: what
// replayed calls run). Returns 0, a cudaError_t, -1 (dtypes), -2 (a shape the library was not
// built for), -3 (a cluster outside 1..16).
#define OK_NORM_FWD_ENTRIES(name, packed)                                                                      \
  extern "C" int name(int device, int dtype_code, int weight_code, int threads, int vpt, int cluster,          \
                      int64_t n_rows, const void* x, const void* res, const void* weight, const void* bias,     \
                      void* out, void* res_out, void* mean, void* rstd, int64_t n_cols, int64_t stride_x,       \
                      int64_t stride_res, int64_t stride_out, int64_t stride_res_out, double eps,               \
                      double weight_offset, int flags, int64_t stream) {                                        \
    if (cluster < 1 || cluster > kMaxCluster) return -3;                                                       \
    cudaError_t err = cudaSetDevice(device);                                                                   \
    if (err != cudaSuccess) return static_cast<int>(err);                                                      \
    OK_NORM_CLUSTER_DTYPES(fwd, threads, vpt, cluster, n_rows, x, res, weight, bias, out, res_out, mean, rstd,  \
                           n_cols, stride_x, stride_res, stride_out, stride_res_out, static_cast<float>(eps),   \
                           static_cast<float>(weight_offset), flags, reinterpret_cast<cudaStream_t>(stream))    \
  }                                                                                                             \
  extern "C" int packed(const int64_t* a) {                                                                     \
    double eps, offset;                                                                                         \
    memcpy(&eps, &a[20], sizeof eps);                                                                           \
    memcpy(&offset, &a[21], sizeof offset);                                                                     \
    auto p = [a](int i) { return reinterpret_cast<void*>(a[i]); };                                             \
    auto i32 = [a](int i) { return static_cast<int>(a[i]); };                                                  \
    return name(i32(0), i32(1), i32(2), i32(3), i32(4), i32(5), a[6], p(7), p(8), p(9), p(10), p(11), p(12),   \
                p(13), p(14), a[15], a[16], a[17], a[18], a[19], eps, offset, i32(22), a[23]);                  \
  }

// A source's `name(device, dtype_code, weight_code, threads, vpt, cluster, flags)`: how many
// clusters of `cluster` CTAs of the forward kernel those arguments launch the device holds at
// once (0: it cannot schedule them), or -1 (dtypes), -2 (a shape the library was not built
// for), -3 (a cluster outside 1..16), -(1000 + a cudaError_t). Asked once per device and kernel
// before a non-portable cluster (9-16 CTAs) is routed.
#define OK_NORM_FWD_CLUSTERS_ENTRY(name)                                                                     \
  extern "C" int name(int device, int dtype_code, int weight_code, int threads, int vpt, int cluster,         \
                      int flags) {                                                                             \
    if (cluster < 1 || cluster > kMaxCluster) return -3;                                                       \
    cudaError_t err = cudaSetDevice(device);                                                                   \
    if (err != cudaSuccess) return -(1000 + static_cast<int>(err));                                            \
    OK_NORM_CLUSTER_DTYPES(fwd_clusters, threads, vpt, cluster, flags)                                         \
  }
