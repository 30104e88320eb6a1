// RMSNorm / LayerNorm forward for long rows on Hopper (sm_90): one row per thread-block
// cluster, the row's partial statistics exchanged through distributed shared memory.
//
// Each CTA of a cluster of C holds one chunk of the row (THREADS * VPT vectors of 16 bytes) in
// registers: one read of x (and the residual), one write of y (and h). It reduces its chunk to
// (mean, M2 about that mean), publishes the pair in its shared memory, and after a cluster
// barrier every CTA merges the C pairs in rank order (Chan et al.): the same statistics in
// every CTA, the same on every run, no global counters and no second pass over the row.
//
// The backward does the same for the gradient's row sums (sum g * xhat, sum g): each cluster
// takes a run of rows, each CTA the same chunk of every row of the run, holding dy and h in
// registers across the exchange and the chunk's dweight / dbias sums in float32 registers
// over the run; it stores them once per cluster into a (clusters, N) partial buffer that the
// launcher sums in a fixed order (deterministic, no atomics).
//
// Built by openkernels.shared.cuda_build with nvcc into a shared library; the host entries
// ok_norm_fwd_cluster / ok_norm_bwd_cluster launch one kernel each with cudaLaunchKernelEx on
// the caller's stream.
// Contract (checked by the Python launcher, cuda/__init__.py): n_cols a multiple of the
// vector width; every row start and the weight and bias 16-byte aligned (32 for float32
// weights with 16-bit x); x, residual, out and residual_out one dtype; the statistics float32.

#include "norm_common.cuh"  // beside this file: dtypes, row vectors, flags, the clustered launch

namespace {

// The first column of a thread's i-th 16-byte vector in a chunk: vector i of the CTA covers
// THREADS consecutive vectors, thread-major (coalesced).
template <int THREADS, int VEC>
__device__ __forceinline__ int64_t vector_column(int64_t chunk_start, int i) {
  return chunk_start + (static_cast<int64_t>(i) * THREADS + threadIdx.x) * VEC;
}

template <int THREADS>
__device__ __forceinline__ float block_sum(float value, float* scratch) {
  // Fixed order (shuffle tree, then the warps' sums in index order): every thread gets the
  // same bits, run after run. `scratch` holds THREADS / 32 floats, used once per call site.
  for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(0xffffffffu, value, offset);
  const int warp = threadIdx.x >> 5;
  if ((threadIdx.x & 31) == 0) scratch[warp] = value;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < THREADS / 32; ++w) total += scratch[w];
  return total;
}

#ifdef OK_CUDA_EMULATION
__device__ __forceinline__ void cluster_arrive() { ok_emu::cluster_arrive(); }
__device__ __forceinline__ void cluster_wait() { ok_emu::cluster_wait(); }
#else
__device__ __forceinline__ void cluster_arrive() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
#endif


// The row's (mean, rstd) from every CTA's (chunk mean, chunk M2 about it): publish the pair,
// barrier (release / acquire over the cluster's shared memory), copy the C pairs in, arrive on
// a second barrier once they are read (a CTA's shared memory must outlive its peers' reads:
// the caller waits on it before exiting, when `exchange`), and merge them in rank order (Chan
// et al.): the same statistics in every CTA, the same on every run.
template <int CHUNK>
__device__ __forceinline__ float2 row_statistics(cg::cluster_group& cluster, int n_ranks, bool exchange,
                                                 float chunk_mean, float chunk_m2, int64_t n_cols, bool is_rms,
                                                 float eps, float2& published, float2* gathered) {
  if (threadIdx.x == 0) published = make_float2(chunk_mean, chunk_m2);
  if (exchange) cluster.sync(); else __syncthreads();
  if (threadIdx.x < n_ranks) gathered[threadIdx.x] = *cluster.map_shared_rank(&published, threadIdx.x);
  __syncthreads();
  if (exchange) cluster_arrive();
  float mean = 0.f, m2_total = 0.f, n_seen = 0.f;
  for (int r = 0; r < n_ranks; ++r) {
    const int64_t r_left = n_cols - static_cast<int64_t>(r) * CHUNK;
    const float n_r = static_cast<float>(r_left < CHUNK ? r_left : CHUNK);
    const float2 part = gathered[r];
    if (is_rms) {
      m2_total += part.y;
    } else {
      const float n_new = n_seen + n_r;
      const float delta = part.x - mean;
      mean += delta * (n_r / n_new);
      m2_total += part.y + delta * delta * (n_seen * n_r / n_new);
      n_seen = n_new;
    }
  }
  return make_float2(mean, rsqrtf(m2_total / static_cast<float>(n_cols) + eps));
}

template <typename T, typename W, int THREADS, int VPT>
__global__ void __launch_bounds__(THREADS) norm_fwd_cluster_kernel(
    const T* __restrict__ x, const T* __restrict__ res, const W* __restrict__ weight, const W* __restrict__ bias,
    T* __restrict__ out, T* __restrict__ res_out, float* __restrict__ mean_out, float* __restrict__ rstd_out,
    int64_t n_cols, int64_t stride_x, int64_t stride_res, int64_t stride_out, int64_t stride_res_out,
    float eps, float weight_offset, int flags) {
  constexpr int VEC = 16 / sizeof(T);
  constexpr int CHUNK = THREADS * VPT * VEC;
  using RowVec = Vec<T, VEC>;
  using WVec = Vec<W, VEC>;
  __shared__ float scratch[2][THREADS / 32];
  __shared__ float2 published;               // this CTA's (chunk mean, chunk M2)
  __shared__ float2 gathered[kMaxCluster];   // every CTA's, copied in

  cg::cluster_group cluster = cg::this_cluster();
  const int n_ranks = static_cast<int>(cluster.num_blocks());
  const int rank = static_cast<int>(cluster.block_rank());
  const int64_t row = blockIdx.x / n_ranks;
  const int64_t chunk_start = static_cast<int64_t>(rank) * CHUNK;
  const bool is_rms = flags & kIsRms;

  // Load the chunk; h = x + residual, rounded to T (the residual stream's dtype), kept in T.
  RowVec h[VPT];
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int64_t col = vector_column<THREADS, VEC>(chunk_start, i);
    if (col < n_cols) {
      h[i] = load_stream<RowVec>(x + row * stride_x + col);
      if (flags & kHasResidual) {
        const RowVec r = load_stream<RowVec>(res + row * stride_res + col);
#pragma unroll
        for (int e = 0; e < VEC; ++e) h[i].v[e] = from_float<T>(to_float(h[i].v[e]) + to_float(r.v[e]));
      }
      if (flags & kStoreResidual) store_stream(res_out + row * stride_res_out + col, h[i]);
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const float v = to_float(h[i].v[e]);
        sum += is_rms ? v * v : v;
      }
    } else {
#pragma unroll
      for (int e = 0; e < VEC; ++e) h[i].v[e] = from_float<T>(0.f);
    }
  }
  const int64_t left = n_cols - chunk_start;
  const float count = static_cast<float>(left < CHUNK ? left : CHUNK);
  float chunk_mean = 0.f, chunk_m2;
  if (is_rms) {
    chunk_m2 = block_sum<THREADS>(sum, scratch[0]);
  } else {  // M2 about the chunk's own mean: no cancellation on rows with a large mean
    chunk_mean = block_sum<THREADS>(sum, scratch[0]) / count;
    float m2 = 0.f;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int64_t col = vector_column<THREADS, VEC>(chunk_start, i);
      if (col < n_cols) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const float d = to_float(h[i].v[e]) - chunk_mean;
          m2 += d * d;
        }
      }
    }
    chunk_m2 = block_sum<THREADS>(m2, scratch[1]);
  }

  // Exchange the chunks' statistics over the cluster (a cluster of one: rows of one CTA,
  // launched without clusters, skips the cluster barriers); wait before exiting.
  const bool exchange = n_ranks > 1;
  const float2 stats =
      row_statistics<CHUNK>(cluster, n_ranks, exchange, chunk_mean, chunk_m2, n_cols, is_rms, eps, published, gathered);
  const float mean = stats.x, rstd = stats.y;
  if (rank == 0 && threadIdx.x == 0) {
    rstd_out[row] = rstd;
    if (!is_rms) mean_out[row] = mean;
  }

  // Normalize from registers; the weight and bias come from L2 (every row reads them).
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int64_t col = vector_column<THREADS, VEC>(chunk_start, i);
    if (col < n_cols) {
      WVec w, b;
      if (flags & kHasWeight) w = *reinterpret_cast<const WVec*>(weight + col);
      if (flags & kHasBias) b = *reinterpret_cast<const WVec*>(bias + col);
      RowVec y;
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        float v = (to_float(h[i].v[e]) - mean) * rstd;
        if (flags & kHasWeight) v *= to_float(w.v[e]) + weight_offset;
        if (flags & kHasBias) v += to_float(b.v[e]);
        y.v[e] = from_float<T>(v);
      }
      store_stream(out + row * stride_out + col, y);
    }
  }
  if (exchange) cluster_wait();
}

// The forward with the chunk STAGED in dynamic shared memory instead of registers: loaded by
// cp.async, it costs few registers, so an SM holds more CTAs and one CTA's loads overlap
// another's reductions and exchange (the register kernel holds 2-3 CTAs of 256 threads per
// SM at 16384 bf16 columns per CTA). Same steps and the same results, bit for bit.
template <typename T, typename W, int THREADS, int VPT>
__global__ void __launch_bounds__(THREADS) norm_fwd_staged_kernel(
    const T* __restrict__ x, const T* __restrict__ res, const W* __restrict__ weight, const W* __restrict__ bias,
    T* __restrict__ out, T* __restrict__ res_out, float* __restrict__ mean_out, float* __restrict__ rstd_out,
    int64_t n_cols, int64_t stride_x, int64_t stride_res, int64_t stride_out, int64_t stride_res_out,
    float eps, float weight_offset, int flags) {
  constexpr int VEC = 16 / sizeof(T);
  constexpr int CHUNK = THREADS * VPT * VEC;
  using RowVec = Vec<T, VEC>;
  using WVec = Vec<W, VEC>;
  __shared__ float scratch[2][THREADS / 32];
  __shared__ float2 published;               // this CTA's (chunk mean, chunk M2)
  __shared__ float2 gathered[kMaxCluster];   // every CTA's, copied in

  cg::cluster_group cluster = cg::this_cluster();
  const int n_ranks = static_cast<int>(cluster.num_blocks());
  const int rank = static_cast<int>(cluster.block_rank());
  const int64_t row = blockIdx.x / n_ranks;
  const int64_t chunk_start = static_cast<int64_t>(rank) * CHUNK;
  const bool is_rms = flags & kIsRms;
  const bool has_residual = flags & kHasResidual;

  // Vector i of this thread: stage[i * THREADS + thread]; the residual's chunk after x's.
  OK_DYNAMIC_SHARED(stage);
  RowVec* const h = reinterpret_cast<RowVec*>(stage) + threadIdx.x;
  const RowVec* const staged_res = h + THREADS * VPT;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int64_t col = vector_column<THREADS, VEC>(chunk_start, i);
    if (col < n_cols) {
      ok_copy_async<16, true>(&h[i * THREADS], x + row * stride_x + col);
      if (has_residual) ok_copy_async<16, true>(&h[(VPT + i) * THREADS], res + row * stride_res + col);
    }
  }
  ok_copy_async_wait_all();  // each thread reads back only its own vectors: no CTA barrier

  // h = x + residual, rounded to T (the residual stream's dtype), written over x.
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int64_t col = vector_column<THREADS, VEC>(chunk_start, i);
    if (col < n_cols) {
      RowVec hv = h[i * THREADS];
      if (has_residual) {
        const RowVec r = staged_res[i * THREADS];
#pragma unroll
        for (int e = 0; e < VEC; ++e) hv.v[e] = from_float<T>(to_float(hv.v[e]) + to_float(r.v[e]));
        h[i * THREADS] = hv;
      }
      if (flags & kStoreResidual) store_stream(res_out + row * stride_res_out + col, hv);
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const float v = to_float(hv.v[e]);
        sum += is_rms ? v * v : v;
      }
    }
  }
  const int64_t left = n_cols - chunk_start;
  const float count = static_cast<float>(left < CHUNK ? left : CHUNK);
  float chunk_mean = 0.f, chunk_m2;
  if (is_rms) {
    chunk_m2 = block_sum<THREADS>(sum, scratch[0]);
  } else {  // M2 about the chunk's own mean: no cancellation on rows with a large mean
    chunk_mean = block_sum<THREADS>(sum, scratch[0]) / count;
    float m2 = 0.f;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int64_t col = vector_column<THREADS, VEC>(chunk_start, i);
      if (col < n_cols) {
        const RowVec hv = h[i * THREADS];
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const float d = to_float(hv.v[e]) - chunk_mean;
          m2 += d * d;
        }
      }
    }
    chunk_m2 = block_sum<THREADS>(m2, scratch[1]);
  }

  // Exchange the chunks' statistics over the cluster (a cluster of one: rows of one CTA,
  // launched without clusters, skips the cluster barriers); wait before exiting.
  const bool exchange = n_ranks > 1;
  const float2 stats =
      row_statistics<CHUNK>(cluster, n_ranks, exchange, chunk_mean, chunk_m2, n_cols, is_rms, eps, published, gathered);
  const float mean = stats.x, rstd = stats.y;
  if (rank == 0 && threadIdx.x == 0) {
    rstd_out[row] = rstd;
    if (!is_rms) mean_out[row] = mean;
  }

  // Normalize from shared memory; the weight and bias come from L2 (every row reads them).
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int64_t col = vector_column<THREADS, VEC>(chunk_start, i);
    if (col < n_cols) {
      WVec w, b;
      if (flags & kHasWeight) w = *reinterpret_cast<const WVec*>(weight + col);
      if (flags & kHasBias) b = *reinterpret_cast<const WVec*>(bias + col);
      const RowVec hv = h[i * THREADS];
      RowVec y;
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        float v = (to_float(hv.v[e]) - mean) * rstd;
        if (flags & kHasWeight) v *= to_float(w.v[e]) + weight_offset;
        if (flags & kHasBias) v += to_float(b.v[e]);
        y.v[e] = from_float<T>(v);
      }
      store_stream(out + row * stride_out + col, y);
    }
  }
  if (exchange) cluster_wait();
}

template <typename T, typename W, int THREADS, int VPT>
__global__ void __launch_bounds__(THREADS) norm_bwd_cluster_kernel(
    const T* __restrict__ dy, const T* __restrict__ h, const W* __restrict__ weight,
    const float* __restrict__ mean_in, const float* __restrict__ rstd_in, const T* __restrict__ dh_out,
    T* __restrict__ dh, float* __restrict__ dw_part, float* __restrict__ db_part, int64_t n_rows, int64_t n_cols,
    int64_t stride_dy, int64_t stride_h, int64_t stride_dh_out, int64_t stride_dh, int64_t rows_per_cluster,
    float weight_offset, int flags) {
  constexpr int VEC = 16 / sizeof(T);
  constexpr int CHUNK = THREADS * VPT * VEC;
  using RowVec = Vec<T, VEC>;
  using WVec = Vec<W, VEC>;
  __shared__ float scratch[2][THREADS / 32];
  __shared__ float2 published[2];  // this CTA's (sum g * xhat, sum g), by row parity
  __shared__ float2 gathered[kMaxCluster];

  cg::cluster_group cluster = cg::this_cluster();
  const int n_ranks = static_cast<int>(cluster.num_blocks());
  const int rank = static_cast<int>(cluster.block_rank());
  const int64_t cluster_id = blockIdx.x / n_ranks;
  const int64_t first_row = cluster_id * rows_per_cluster;
  const int64_t end_row = first_row + rows_per_cluster < n_rows ? first_row + rows_per_cluster : n_rows;
  const int64_t chunk_start = static_cast<int64_t>(rank) * CHUNK;
  const bool is_rms = flags & kIsRms;
  const bool has_weight = flags & kHasWeight;
  const float inv_n = 1.f / static_cast<float>(n_cols);

  float dw_acc[VPT][VEC], db_acc[VPT][VEC];
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
#pragma unroll
    for (int e = 0; e < VEC; ++e) dw_acc[i][e] = db_acc[i][e] = 0.f;
  }

  for (int64_t row = first_row; row < end_row; ++row) {
    RowVec dy_v[VPT], h_v[VPT];
    const float rstd = rstd_in[row];
    const float mean = is_rms ? 0.f : mean_in[row];
    float c1 = 0.f, c2 = 0.f;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int64_t col = vector_column<THREADS, VEC>(chunk_start, i);
      if (col < n_cols) {
        dy_v[i] = load_stream<RowVec>(dy + row * stride_dy + col);
        h_v[i] = load_stream<RowVec>(h + row * stride_h + col);
        WVec w;
        if (has_weight) w = *reinterpret_cast<const WVec*>(weight + col);
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const float g = to_float(dy_v[i].v[e]) * (has_weight ? to_float(w.v[e]) + weight_offset : 1.f);
          c1 += g * ((to_float(h_v[i].v[e]) - mean) * rstd);
          c2 += g;
        }
      }
    }
    c1 = block_sum<THREADS>(c1, scratch[0]);
    if (!is_rms) c2 = block_sum<THREADS>(c2, scratch[1]);

    // Exchange, double-buffered by row parity: a CTA writes a slot again two rows later,
    // past the next cluster barrier, which its peers reach only after reading this one.
    const int slot = static_cast<int>((row - first_row) & 1);
    if (threadIdx.x == 0) published[slot] = make_float2(c1, c2);
    cluster.sync();
    if (threadIdx.x < n_ranks) gathered[threadIdx.x] = *cluster.map_shared_rank(&published[slot], threadIdx.x);
    __syncthreads();
    float sum_gx = 0.f, sum_g = 0.f;
    for (int r = 0; r < n_ranks; ++r) {
      sum_gx += gathered[r].x;
      sum_g += gathered[r].y;
    }
    const float a = sum_gx * inv_n, b = is_rms ? 0.f : sum_g * inv_n;

#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int64_t col = vector_column<THREADS, VEC>(chunk_start, i);
      if (col < n_cols) {
        WVec w;
        if (has_weight) w = *reinterpret_cast<const WVec*>(weight + col);
        RowVec extra, out;
        if (flags & kHasDhOut) extra = load_stream<RowVec>(dh_out + row * stride_dh_out + col);
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const float d = to_float(dy_v[i].v[e]);
          const float g = d * (has_weight ? to_float(w.v[e]) + weight_offset : 1.f);
          const float xhat = (to_float(h_v[i].v[e]) - mean) * rstd;
          float v = (g - xhat * a - b) * rstd;
          if (flags & kHasDhOut) v += to_float(extra.v[e]);
          out.v[e] = from_float<T>(v);
          dw_acc[i][e] += d * xhat;
          db_acc[i][e] += d;
        }
        store_stream(dh + row * stride_dh + col, out);
      }
    }
  }
  // Peers may still read this CTA's last slot: leave together.
  cluster.sync();
  const int64_t part_row = cluster_id * n_cols;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int64_t col = vector_column<THREADS, VEC>(chunk_start, i);
    if (col < n_cols) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        if (flags & kWeightGrad) dw_part[part_row + col + e] = dw_acc[i][e];
        if (flags & kBiasGrad) db_part[part_row + col + e] = db_acc[i][e];
      }
    }
  }
}

// The backward with dy and h STAGED in shared memory, two rows deep: while a row is reduced,
// exchanged and written, the next row's dy and h are already on their way (cp.async into the
// other stage), so an SM's loads do not stop at each row's cluster barrier; the registers
// hold only the dweight / dbias sums. Stage s of a CTA: dy's chunk, then h's, THREADS * VPT
// vectors each. Same steps and the same results as the register kernel, bit for bit.
template <typename T, typename W, int THREADS, int VPT>
__global__ void __launch_bounds__(THREADS) norm_bwd_staged_kernel(
    const T* __restrict__ dy, const T* __restrict__ h, const W* __restrict__ weight,
    const float* __restrict__ mean_in, const float* __restrict__ rstd_in, const T* __restrict__ dh_out,
    T* __restrict__ dh, float* __restrict__ dw_part, float* __restrict__ db_part, int64_t n_rows, int64_t n_cols,
    int64_t stride_dy, int64_t stride_h, int64_t stride_dh_out, int64_t stride_dh, int64_t rows_per_cluster,
    float weight_offset, int flags) {
  constexpr int VEC = 16 / sizeof(T);
  constexpr int CHUNK = THREADS * VPT * VEC;
  constexpr int STAGE = 2 * THREADS * VPT;  // vectors per stage: dy's, then h's
  using RowVec = Vec<T, VEC>;
  using WVec = Vec<W, VEC>;
  __shared__ float scratch[2][THREADS / 32];
  __shared__ float2 published[2];  // this CTA's (sum g * xhat, sum g), by row parity
  __shared__ float2 gathered[kMaxCluster];
  OK_DYNAMIC_SHARED(stage_bytes);
  // This thread's vector i of stage s: dy at [s * STAGE + i * THREADS], h VPT * THREADS after.
  RowVec* const mine = reinterpret_cast<RowVec*>(stage_bytes) + threadIdx.x;

  cg::cluster_group cluster = cg::this_cluster();
  const int n_ranks = static_cast<int>(cluster.num_blocks());
  const int rank = static_cast<int>(cluster.block_rank());
  const int64_t cluster_id = blockIdx.x / n_ranks;
  const int64_t first_row = cluster_id * rows_per_cluster;
  const int64_t end_row = first_row + rows_per_cluster < n_rows ? first_row + rows_per_cluster : n_rows;
  const int64_t chunk_start = static_cast<int64_t>(rank) * CHUNK;
  const bool is_rms = flags & kIsRms;
  const bool has_weight = flags & kHasWeight;
  const float inv_n = 1.f / static_cast<float>(n_cols);

  auto prefetch = [&](int64_t row, int s) {
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int64_t col = vector_column<THREADS, VEC>(chunk_start, i);
      if (col < n_cols) {
        ok_copy_async<16, true>(&mine[s * STAGE + i * THREADS], dy + row * stride_dy + col);
        ok_copy_async<16, true>(&mine[s * STAGE + (VPT + i) * THREADS], h + row * stride_h + col);
      }
    }
    ok_copy_async_commit();
  };

  float dw_acc[VPT][VEC], db_acc[VPT][VEC];
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
#pragma unroll
    for (int e = 0; e < VEC; ++e) dw_acc[i][e] = db_acc[i][e] = 0.f;
  }

  if (first_row < end_row) prefetch(first_row, 0);
  for (int64_t row = first_row; row < end_row; ++row) {
    const int s = static_cast<int>((row - first_row) & 1);
    // The next row into the other stage (this thread has read its own vectors of it, a row
    // ago), then wait for this row's copies only.
    if (row + 1 < end_row) {
      prefetch(row + 1, s ^ 1);
      ok_copy_async_wait_group<1>();
    } else {
      ok_copy_async_wait_group<0>();
    }
    const RowVec* const dy_s = mine + s * STAGE;
    const RowVec* const h_s = dy_s + VPT * THREADS;
    const float rstd = rstd_in[row];
    const float mean = is_rms ? 0.f : mean_in[row];
    float c1 = 0.f, c2 = 0.f;
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int64_t col = vector_column<THREADS, VEC>(chunk_start, i);
      if (col < n_cols) {
        const RowVec dy_v = dy_s[i * THREADS], h_v = h_s[i * THREADS];
        WVec w;
        if (has_weight) w = *reinterpret_cast<const WVec*>(weight + col);
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const float g = to_float(dy_v.v[e]) * (has_weight ? to_float(w.v[e]) + weight_offset : 1.f);
          c1 += g * ((to_float(h_v.v[e]) - mean) * rstd);
          c2 += g;
        }
      }
    }
    c1 = block_sum<THREADS>(c1, scratch[0]);
    if (!is_rms) c2 = block_sum<THREADS>(c2, scratch[1]);

    // Exchange, double-buffered by row parity (as in the register kernel).
    const int slot = static_cast<int>((row - first_row) & 1);
    if (threadIdx.x == 0) published[slot] = make_float2(c1, c2);
    cluster.sync();
    if (threadIdx.x < n_ranks) gathered[threadIdx.x] = *cluster.map_shared_rank(&published[slot], threadIdx.x);
    __syncthreads();
    float sum_gx = 0.f, sum_g = 0.f;
    for (int r = 0; r < n_ranks; ++r) {
      sum_gx += gathered[r].x;
      sum_g += gathered[r].y;
    }
    const float a = sum_gx * inv_n, b = is_rms ? 0.f : sum_g * inv_n;

#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      const int64_t col = vector_column<THREADS, VEC>(chunk_start, i);
      if (col < n_cols) {
        const RowVec dy_v = dy_s[i * THREADS], h_v = h_s[i * THREADS];
        WVec w;
        if (has_weight) w = *reinterpret_cast<const WVec*>(weight + col);
        RowVec extra, out;
        if (flags & kHasDhOut) extra = load_stream<RowVec>(dh_out + row * stride_dh_out + col);
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const float d = to_float(dy_v.v[e]);
          const float g = d * (has_weight ? to_float(w.v[e]) + weight_offset : 1.f);
          const float xhat = (to_float(h_v.v[e]) - mean) * rstd;
          float v = (g - xhat * a - b) * rstd;
          if (flags & kHasDhOut) v += to_float(extra.v[e]);
          out.v[e] = from_float<T>(v);
          dw_acc[i][e] += d * xhat;
          db_acc[i][e] += d;
        }
        store_stream(dh + row * stride_dh + col, out);
      }
    }
  }
  // Peers may still read this CTA's last slot: leave together.
  cluster.sync();
  const int64_t part_row = cluster_id * n_cols;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    const int64_t col = vector_column<THREADS, VEC>(chunk_start, i);
    if (col < n_cols) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        if (flags & kWeightGrad) dw_part[part_row + col + e] = dw_acc[i][e];
        if (flags & kBiasGrad) db_part[part_row + col + e] = db_acc[i][e];
      }
    }
  }
}


// The forward kernel of a (threads, vectors per thread) shape, or nullptr.
template <typename T, typename W, bool STAGED>
auto fwd_kernel(int threads, int vpt) -> decltype(&norm_fwd_cluster_kernel<T, W, 256, 4>) {
  if (threads == 128 && vpt == 2) return STAGED ? norm_fwd_staged_kernel<T, W, 128, 2> : norm_fwd_cluster_kernel<T, W, 128, 2>;
  if (threads == 256 && vpt == 2) return STAGED ? norm_fwd_staged_kernel<T, W, 256, 2> : norm_fwd_cluster_kernel<T, W, 256, 2>;
  if (threads == 256 && vpt == 4) return STAGED ? norm_fwd_staged_kernel<T, W, 256, 4> : norm_fwd_cluster_kernel<T, W, 256, 4>;
  if (threads == 256 && vpt == 8) return STAGED ? norm_fwd_staged_kernel<T, W, 256, 8> : norm_fwd_cluster_kernel<T, W, 256, 8>;
  if (threads == 512 && vpt == 8) return STAGED ? norm_fwd_staged_kernel<T, W, 512, 8> : norm_fwd_cluster_kernel<T, W, 512, 8>;
  if (threads == 512 && vpt == 16) return STAGED ? norm_fwd_staged_kernel<T, W, 512, 16> : norm_fwd_cluster_kernel<T, W, 512, 16>;
  return nullptr;
}

// The launch's kernel (kStaged: the chunk in dynamic shared memory, x's and the residual's, 16
// bytes per thread and vector each; else registers).
template <typename T, typename W>
FwdKernel<T, W> pick_fwd(int threads, int vpt, int flags, size_t& dynamic_shared) {
  const bool staged = flags & kStaged;
  dynamic_shared = staged ? static_cast<size_t>(threads) * vpt * 16 * ((flags & kHasResidual) ? 2 : 1) : 0;
  return staged ? fwd_kernel<T, W, true>(threads, vpt) : fwd_kernel<T, W, false>(threads, vpt);
}

// The backward's shapes: it holds dy and h (16 bytes each) and two float32 accumulators per
// element, so 2 vectors per thread (4 spill at 512 threads, run at 1 CTA per SM at 256).
template <typename T, typename W>
auto bwd_kernel(int threads, int vpt, bool staged) -> decltype(&norm_bwd_cluster_kernel<T, W, 256, 2>) {
  if (!staged && threads == 256 && vpt == 2) return norm_bwd_cluster_kernel<T, W, 256, 2>;
  if (!staged && threads == 512 && vpt == 2) return norm_bwd_cluster_kernel<T, W, 512, 2>;
  // Staged: only the float32 sums in registers, so 4 vectors per thread fit as well.
  if (staged && threads == 256 && vpt == 2) return norm_bwd_staged_kernel<T, W, 256, 2>;
  if (staged && threads == 512 && vpt == 2) return norm_bwd_staged_kernel<T, W, 512, 2>;
  if (staged && threads == 256 && vpt == 4) return norm_bwd_staged_kernel<T, W, 256, 4>;
  if (staged && threads == 512 && vpt == 4) return norm_bwd_staged_kernel<T, W, 512, 4>;
  return nullptr;
}

template <typename T, typename W>
int bwd(int threads, int vpt, int cluster, int64_t n_clusters, const void* dy, const void* h, const void* weight,
        const void* mean, const void* rstd, const void* dh_out, void* dh, void* dw_part, void* db_part,
        int64_t n_rows, int64_t n_cols, int64_t stride_dy, int64_t stride_h, int64_t stride_dh_out,
        int64_t stride_dh, int64_t rows_per_cluster, float weight_offset, int flags, cudaStream_t stream) {
  const bool staged = flags & kStaged;
  auto kernel = bwd_kernel<T, W>(threads, vpt, staged);
  if (kernel == nullptr) return -2;
  // Staged: two stages of dy's and h's chunks, 16 bytes per thread and vector each.
  const size_t shared = staged ? static_cast<size_t>(threads) * vpt * 16 * 4 : 0;
  if (shared > kMaxDynamicShared) return -2;
  return launch_clustered(kernel, cluster, cluster * n_clusters, threads, shared, stream, dy, h, weight, mean, rstd,
                          dh_out, dh, dw_part, db_part, n_rows, n_cols, stride_dy, stride_h, stride_dh_out,
                          stride_dh, rows_per_cluster, weight_offset, flags);
}

}  // namespace


// One forward. flags: kIsRms | kHasResidual | kStoreResidual | kHasWeight | kHasBias | kStaged.
OK_NORM_FWD_ENTRIES(ok_norm_fwd_cluster, ok_norm_fwd_cluster_packed)

// One backward over n_clusters clusters of rows_per_cluster rows each; dw_part / db_part are
// (n_clusters, n_cols) float32. flags: kIsRms | kHasWeight | kHasDhOut | kWeightGrad | kBiasGrad | kStaged.
extern "C" int ok_norm_bwd_cluster(int device, int dtype_code, int weight_code, int threads, int vpt, int cluster,
                                   int64_t n_clusters, const void* dy, const void* h, const void* weight,
                                   const void* mean, const void* rstd, const void* dh_out, void* dh, void* dw_part,
                                   void* db_part, int64_t n_rows, int64_t n_cols, int64_t stride_dy,
                                   int64_t stride_h, int64_t stride_dh_out, int64_t stride_dh,
                                   int64_t rows_per_cluster, double weight_offset, int flags, int64_t stream) {
  if (cluster < 1 || cluster > kMaxCluster) return -3;
  cudaError_t err = cudaSetDevice(device);
  if (err != cudaSuccess) return static_cast<int>(err);
  OK_NORM_CLUSTER_DTYPES(bwd, threads, vpt, cluster, n_clusters, dy, h, weight, mean, rstd, dh_out, dh, dw_part,
                         db_part, n_rows, n_cols, stride_dy, stride_h, stride_dh_out, stride_dh, rows_per_cluster,
                         static_cast<float>(weight_offset), flags, reinterpret_cast<cudaStream_t>(stream))
}

// Its packed twin: every argument in one 64-bit slot (doubles as their bits), what replayed
// calls run.
extern "C" int ok_norm_bwd_cluster_packed(const int64_t* a) {
  double offset;
  memcpy(&offset, &a[23], sizeof offset);
  auto p = [a](int i) { return reinterpret_cast<void*>(a[i]); };
  auto i32 = [a](int i) { return static_cast<int>(a[i]); };
  return ok_norm_bwd_cluster(i32(0), i32(1), i32(2), i32(3), i32(4), i32(5), a[6], p(7), p(8), p(9), p(10), p(11),
                             p(12), p(13), p(14), p(15), a[16], a[17], a[18], a[19], a[20], a[21], a[22], offset,
                             i32(24), a[25]);
}
