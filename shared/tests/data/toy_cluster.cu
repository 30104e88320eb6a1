// A toy kernel for the CUDA emulation's own test (shared/tests/test_cuda_build.py): every CTA
// of a cluster sums its threads' values (warp shuffles, then shared memory), publishes the
// sum, and after a cluster barrier adds its peers' sums read through map_shared_rank.
#ifdef OK_CUDA_EMULATION
#include "cuda_emulation.h"
#else
#include <cooperative_groups.h>
#include <cuda_runtime.h>
#endif
#include <stdint.h>

namespace cg = cooperative_groups;

__global__ void toy_cluster_sum(const float* in, float* out) {
  __shared__ float warp_sums[32];
  __shared__ float published;
  cg::cluster_group cluster = cg::this_cluster();
  float v = in[blockIdx.x * 64 + threadIdx.x];
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = v;
  __syncthreads();
  if (threadIdx.x == 0) published = warp_sums[0] + warp_sums[1];
  cluster.sync();
  float total = 0.f;
  for (unsigned r = 0; r < cluster.num_blocks(); ++r) total += *cluster.map_shared_rank(&published, r);
  cluster.sync();  // peers' shared memory read: leave together
  if (threadIdx.x == 0) out[blockIdx.x] = total;
}

// 64 threads per CTA, `ctas` CTAs in clusters of `cluster`.
extern "C" int toy_cluster_launch(const float* in, float* out, int ctas, int cluster) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(ctas, 1, 1);
  config.blockDim = dim3(64, 1, 1);
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeClusterDimension;
  attribute[0].val.clusterDim.x = cluster;
  attribute[0].val.clusterDim.y = 1;
  attribute[0].val.clusterDim.z = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  return static_cast<int>(cudaLaunchKernelEx(&config, toy_cluster_sum, in, out));
}
