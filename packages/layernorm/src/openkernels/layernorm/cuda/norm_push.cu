// RMSNorm / LayerNorm forward for long rows on Hopper (sm_90), the default there for the row
// lengths it measured fastest at (cuda/__init__.py: push_config): one row per thread-block
// cluster, each CTA's chunk staged in shared memory, the per-warp statistics pushed into every
// CTA of the cluster (st.async counted on mbarriers). Its own library (a few shapes, built
// with nvcc on first use in seconds) beside norm_cluster.cu's forced-only kernels; the host
// entry ok_norm_fwd_push takes ok_norm_fwd_cluster's arguments.
// Contract (checked by the Python launcher): as norm_cluster.cu's forward.

#include "norm_common.cuh"  // beside this file: dtypes, row vectors, flags, the clustered launch

#include <type_traits>

#include "cluster_exchange.h"  // openkernels/shared/cuda: st.async into peers, mbarriers

#ifndef OK_PUSH_WLOAD
#define OK_PUSH_WLOAD 0
#endif
#ifndef OK_PUSH_WGROUP
#define OK_PUSH_WGROUP 1
#endif

namespace {

// Nsight Compute on an H100 (1024 x 65536 bf16 RMSNorm, docs/perf.md) put the staged kernel at
// 61% of DRAM throughput with L2 at 86% and twice QuACK's issued instructions; QuACK at 84% of
// DRAM. This kernel takes QuACK's steps: the chunk staged by cp.async, per-warp statistics
// pushed into every CTA of the cluster by st.async (cluster_exchange.h: no cluster-wide
// barrier after the start, none before exit, no CTA-wide barrier at all), the chunk
// normalized from shared memory, each pass compiled for the call's options (weight, bias,
// residual, RMS or not) so that no element pays a branch or a select.
// Each warp sends (count, mean, M2 about that mean) (RMSNorm: (count, 0, sum of squares)); every
// warp of every CTA merges the C x WARPS parts in the same order (lane l takes parts l, l + 32,
// ... in turn, then a butterfly whose merge puts the lower lane first), so every thread of the
// row gets the same bits, run after run.

// (n, mean, m2) += (nb, mean_b, m2b) (Chan et al.); an empty side leaves the other unchanged.
// With OK_PUSH_MERGE (on in the default build, cuda.PUSH_DEFAULT_FLAGS) one fast division
// (__fdividef: 2 ulp) instead of two IEEE ones: every warp runs these merges one after another
// on the row's critical path, between the exchange and the normalize pass (LayerNorm only;
// RMSNorm adds its parts).
__device__ __forceinline__ void chan_merge(float& n, float& mean, float& m2, float nb, float mean_b, float m2b) {
  const float total = n + nb;
  if (nb == 0.f) return;  // an empty part: nothing to add (its mean may be anything)
  const float delta = mean_b - mean;
#if defined(OK_PUSH_MERGE) && !defined(OK_CUDA_EMULATION)
  const float frac = __fdividef(nb, total);
  mean = fmaf(delta, frac, mean);
  m2 += m2b + delta * delta * (n * frac);
#else
  mean += delta * (nb / total);
  m2 += m2b + delta * delta * (n * nb / total);
#endif
  n = total;
}

__device__ __forceinline__ float warp_sum(float value) {
  for (int offset = 16; offset > 0; offset >>= 1) value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;  // the same bits in every lane: each step adds the same two values
}

// The row's (mean, rstd) from `n_parts` parts (n, mean, m2, -), the same bits in every lane.
__device__ __forceinline__ float2 merge_parts(const float4* parts, int n_parts, int64_t n_cols, bool is_rms,
                                              float eps) {
  const int lane = threadIdx.x & 31;
  if (is_rms) {
    float m2 = 0.f;
    for (int p = lane; p < n_parts; p += 32) m2 += parts[p].z;
    m2 = warp_sum(m2);
    return make_float2(0.f, rsqrtf(m2 / static_cast<float>(n_cols) + eps));
  }
#ifdef OK_PUSH_MERGE
  // Parts of one count (every warp of a row that fills its CTAs): the mean of the means, and M2
  // = the sum of the M2s + count x the sum of the means' squared deviations from it (Chan et
  // al.'s merge for equal counts): sums and one division, where the pairwise merges below chain
  // one division each, n_parts / 32 + 5 deep.
  const float n0 = parts[0].x;
  float unequal = 0.f;
  for (int p = lane; p < n_parts; p += 32) unequal += parts[p].x != n0 ? 1.f : 0.f;
  if (warp_sum(unequal) == 0.f && n0 > 0.f) {
    float sum = 0.f;
    for (int p = lane; p < n_parts; p += 32) sum += parts[p].y;
    const float row_mean = warp_sum(sum) / static_cast<float>(n_parts);
    float dev = 0.f;
    for (int p = lane; p < n_parts; p += 32) {
      const float d = parts[p].y - row_mean;
      dev += fmaf(n0 * d, d, parts[p].z);
    }
    return make_float2(row_mean, rsqrtf(warp_sum(dev) / static_cast<float>(n_cols) + eps));
  }
#endif
  float n = 0.f, mean = 0.f, m2 = 0.f;
  for (int p = lane; p < n_parts; p += 32) chan_merge(n, mean, m2, parts[p].x, parts[p].y, parts[p].z);
  for (int offset = 16; offset > 0; offset >>= 1) {
    float on = __shfl_xor_sync(0xffffffffu, n, offset);
    float omean = __shfl_xor_sync(0xffffffffu, mean, offset);
    float om2 = __shfl_xor_sync(0xffffffffu, m2, offset);
    if (lane & offset) {  // the lower lane's part first, in both lanes of the pair
      float t = n; n = on; on = t;
      t = mean; mean = omean; omean = t;
      t = m2; m2 = om2; om2 = t;
    }
    chan_merge(n, mean, m2, on, omean, om2);
  }
  return make_float2(mean, rsqrtf(m2 / static_cast<float>(n_cols) + eps));
}

// Two floats into two elements of T at `dst` (bf16 / fp16: one packed conversion).
template <typename T>
__device__ __forceinline__ void store_pair(T* dst, float a, float b) {
#ifdef OK_CUDA_EMULATION
  dst[0] = from_float<T>(a);
  dst[1] = from_float<T>(b);
#else
  if constexpr (sizeof(T) == 4) {
    dst[0] = a;
    dst[1] = b;
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 pair = __floats2bfloat162_rn(a, b);
    memcpy(dst, &pair, 4);
  } else {
    const __half2 pair = __floats2half2_rn(a, b);
    memcpy(dst, &pair, 4);
  }
#endif
}

// Elements e and e + 1 of a vector as floats. With OK_PUSH_TRIM (on in the default build,
// cuda.PUSH_DEFAULT_FLAGS; it also drops the add of a zero weight_offset, takes weight and bias
// in one FMA and LayerNorm's statistics in one pass), bfloat16 pairs come from their 32-bit
// word by one shift and one mask (the plain conversion takes a byte permute and a shift for
// the upper element); the same values either way.
template <typename T, int N>
__device__ __forceinline__ float2 pair_at(const Vec<T, N>& vec, int e) {
#ifdef OK_PUSH_TRIM
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    uint32_t word;
    memcpy(&word, &vec.v[e], 4);
    const uint32_t lo = word << 16, hi = word & 0xffff0000u;
    float2 pair;
    memcpy(&pair.x, &lo, 4);
    memcpy(&pair.y, &hi, 4);
    return pair;
  }
#endif
  return make_float2(to_float(vec.v[e]), to_float(vec.v[e + 1]));
}

template <bool B>
struct Flag {
  static constexpr bool value = B;
};

// The pushed kernel's first pass over its staged chunk, its options compiled in (the kernel
// picks the instance once: no per-element branches or selects): h = x + residual rounded to
// T written over x (and stored), the thread's (count, sum, -) (RMSNorm: (count, sum of
// squares, -); SHIFTED, LayerNorm in one pass: (count, sum of h - shift, sum of its squares)).
template <typename T, int THREADS, int VPT, bool RMS, bool RESIDUAL, bool STORE, bool SHIFTED = false>
__device__ __forceinline__ float4 push_sum_pass(Vec<T, 16 / sizeof(T)>* h, const Vec<T, 16 / sizeof(T)>* staged_res,
                                                T* res_out_at, int64_t left, float shift = 0.f) {
  constexpr int VEC = 16 / sizeof(T), STEP = THREADS * VEC;
  float sum = 0.f, sum2 = 0.f, count = 0.f;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    if (i * STEP < left) {
      Vec<T, VEC> hv = h[i * THREADS];
      if constexpr (RESIDUAL) {
        const Vec<T, VEC> r = staged_res[i * THREADS];
#pragma unroll
        for (int e = 0; e < VEC; e += 2) {
          const float2 a = pair_at(hv, e), b = pair_at(r, e);
          store_pair(&hv.v[e], a.x + b.x, a.y + b.y);
        }
        h[i * THREADS] = hv;
      }
      if constexpr (STORE) store_stream(res_out_at + i * STEP, hv);
#pragma unroll
      for (int e = 0; e < VEC; e += 2) {
        const float2 v = pair_at(hv, e);
        if constexpr (RMS) {
          sum = fmaf(v.x, v.x, sum);
          sum = fmaf(v.y, v.y, sum);
        } else if constexpr (SHIFTED) {
          const float dx = v.x - shift, dy = v.y - shift;
          sum += dx;
          sum2 = fmaf(dx, dx, sum2);
          sum += dy;
          sum2 = fmaf(dy, dy, sum2);
        } else {
          sum += v.x;
          sum += v.y;
        }
      }
      count += VEC;
    }
  }
  return make_float4(count, sum, sum2, 0.f);
}

// The thread's M2 about `mean` (LayerNorm's second pass, from shared memory).
template <typename T, int THREADS, int VPT>
__device__ __forceinline__ float push_m2_pass(const Vec<T, 16 / sizeof(T)>* h, int64_t left, float mean) {
  constexpr int VEC = 16 / sizeof(T), STEP = THREADS * VEC;
  float m2 = 0.f;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    if (i * STEP < left) {
      const Vec<T, VEC> hv = h[i * THREADS];
#pragma unroll
      for (int e = 0; e < VEC; e += 2) {
        const float2 v = pair_at(hv, e);
        const float dx = v.x - mean, dy = v.y - mean;
        m2 = fmaf(dx, dx, m2);
        m2 = fmaf(dy, dy, m2);
      }
    }
  }
  return m2;
}

// This thread's VPT vectors of a per-column parameter (the weight or the bias), loaded by
// predicated loads issued back to back (OK_PUSH_WLOAD): loaded inside the normalize loop, each
// vector's load sat behind the previous vector's `i * STEP < left` branch, so a thread waited
// for one L2 round trip per vector (8 in a row at the common shapes; SASS of the sm_90a build).
template <typename W, int VEC, int VPT>
struct ParamVecs {
  Vec<W, VEC> v[VPT];
};

template <typename W, int THREADS, int VPT, int VEC>
__device__ __forceinline__ void load_params(ParamVecs<W, VEC, VPT>& p, const W* at, int64_t left) {
  constexpr int STEP = THREADS * VEC;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    if (i * STEP < left) p.v[i] = *reinterpret_cast<const Vec<W, VEC>*>(at + i * STEP);
  }
}

// y = (h - mean) * rstd * (w + offset) + b from shared memory, options compiled in (OFFSET:
// weight_offset is not 0; HOISTED: the weight and bias already in `wv` / `bv`, else loaded here).
template <typename T, typename W, int THREADS, int VPT, bool RMS, bool WEIGHT, bool BIAS, bool OFFSET = true,
          bool HOISTED = false>
__device__ __forceinline__ void push_normalize(const Vec<T, 16 / sizeof(T)>* h, const W* weight_at, const W* bias_at,
                                               T* out_at, int64_t left, float mean, float rstd, float weight_offset,
                                               const ParamVecs<W, 16 / sizeof(T), VPT>& wv,
                                               const ParamVecs<W, 16 / sizeof(T), VPT>& bv) {
  constexpr int VEC = 16 / sizeof(T), STEP = THREADS * VEC;
  using WVec = Vec<W, VEC>;
#ifdef OK_PUSH_CENTER_FMA
  // (on in the default build since layernorm 0.11.14) LayerNorm's (h - mean) * rstd as one FMA,
  // h * rstd - mean * rstd: one instruction fewer per element; the product's rounding adds
  // |mean| * rstd * 2^-24, far below a 16-bit h's own ulp times rstd.
  const float centre = -mean * rstd;
#endif
  // Vector i's output from its weight and bias.
  auto emit = [&](int i, const WVec& w, const WVec& b) {
    const Vec<T, VEC> hv = h[i * THREADS];
    Vec<T, VEC> y;
#pragma unroll
    for (int e = 0; e < VEC; e += 2) {
      const float2 pair = pair_at(hv, e);
      float v[2] = {pair.x, pair.y};
      float2 wp = make_float2(0.f, 0.f), bp = wp;
      if constexpr (WEIGHT) wp = pair_at(w, e);
      if constexpr (BIAS) bp = pair_at(b, e);
      const float ws[2] = {wp.x, wp.y}, bs[2] = {bp.x, bp.y};
#pragma unroll
      for (int k = 0; k < 2; ++k) {
#ifdef OK_PUSH_CENTER_FMA
        v[k] = RMS ? v[k] * rstd : fmaf(v[k], rstd, centre);
#else
        v[k] = RMS ? v[k] * rstd : (v[k] - mean) * rstd;
#endif
#ifdef OK_PUSH_TRIM  // weight and bias in one FMA
        if constexpr (WEIGHT && BIAS) {
          v[k] = fmaf(v[k], OFFSET ? ws[k] + weight_offset : ws[k], bs[k]);
          continue;
        }
#endif
        if constexpr (WEIGHT) v[k] *= OFFSET ? ws[k] + weight_offset : ws[k];
        if constexpr (BIAS) v[k] += bs[k];
      }
      store_pair(&y.v[e], v[0], v[1]);
    }
    store_stream(out_at + i * STEP, y);
  };
  auto load = [&](int i, WVec& w, WVec& b) {
    if constexpr (WEIGHT) w = *reinterpret_cast<const WVec*>(weight_at + i * STEP);
    if constexpr (BIAS) b = *reinterpret_cast<const WVec*>(bias_at + i * STEP);
  };
  // Vectors whose weight and bias loads are issued together (OK_PUSH_WGROUP; 1, the default
  // build: each behind the previous vector's bounds branch).
  constexpr int GROUP = HOISTED || OK_PUSH_WGROUP > VPT ? VPT : OK_PUSH_WGROUP;
  if constexpr (GROUP == 1) {
#pragma unroll
    for (int i = 0; i < VPT; ++i) {
      if (i * STEP < left) {
        WVec w, b;
        load(i, w, b);
        emit(i, w, b);
      }
    }
  } else {
#pragma unroll
    for (int g = 0; g < VPT; g += GROUP) {
      WVec w[GROUP], b[GROUP];
#pragma unroll
      for (int j = 0; j < GROUP; ++j) {
        if constexpr (HOISTED) {
          w[j] = wv.v[g + j];
          b[j] = bv.v[g + j];
        } else if ((g + j) * STEP < left) {
          load(g + j, w[j], b[j]);
        }
      }
#pragma unroll
      for (int j = 0; j < GROUP; ++j) {
        if ((g + j) * STEP < left) emit(g + j, w[j], b[j]);
      }
    }
  }
}

// At least two CTAs of 256 threads per SM (at most 128 registers; the kernel takes 40-60).
// RMS_ONLY (OK_PUSH_BY_OP builds): an instance for RMSNorm calls alone, so that the registers
// LayerNorm's bias takes do not set its occupancy. STAGE_PARAMS (OK_PUSH_SMEM_PARAMS study
// builds, the generic instance without a residual): the chunk's weight and bias staged in
// shared memory by the same bulk copies as x, so the normalize pass reads all three there (no
// L2 round trip per vector, no registers held) at the cost of shared memory per CTA.
template <typename T, typename W, int THREADS, int VPT, bool RMS_ONLY = false, bool STAGE_PARAMS = false>
__global__ void __launch_bounds__(THREADS, THREADS <= 256 ? 2 : 1) norm_fwd_push_kernel(
    const T* __restrict__ x, const T* __restrict__ res, const W* __restrict__ weight, const W* __restrict__ bias,
    T* __restrict__ out, T* __restrict__ res_out, float* __restrict__ mean_out, float* __restrict__ rstd_out,
    int64_t n_cols, int64_t stride_x, int64_t stride_res, int64_t stride_out, int64_t stride_res_out,
    float eps, float weight_offset, int flags) {
  constexpr int VEC = 16 / sizeof(T);
  constexpr int CHUNK = THREADS * VPT * VEC;
  constexpr int WARPS = THREADS / 32;
  constexpr int STEP = THREADS * VEC;  // columns between a thread's vectors
  using RowVec = Vec<T, VEC>;
  __shared__ float4 parts[kMaxCluster * WARPS];  // (rank, warp) -> (n, mean, m2, -)
  __shared__ OkBarrier full;
#ifdef OK_PUSH_BULK
  __shared__ OkBarrier staged;  // the chunk's bulk copies land on it
#endif

  cg::cluster_group cluster = cg::this_cluster();
  const int n_ranks = static_cast<int>(cluster.num_blocks());
  const int rank = static_cast<int>(cluster.block_rank());
  const int64_t row = blockIdx.x / n_ranks;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const bool is_rms = RMS_ONLY || (flags & kIsRms);
  const bool has_residual = flags & kHasResidual;
  const bool exchange = n_ranks > 1;
#ifdef OK_PUSH_BULK
  if (threadIdx.x == 0) ok_barrier_init(&staged, 1);
#endif
  if (exchange) {
    if (threadIdx.x == 0) ok_barrier_init(&full, 1);
    ok_fence_barrier_init();
    ok_cluster_arrive_relaxed();
  }
#ifdef OK_PUSH_BULK
  if (!exchange) ok_fence_barrier_init();
  __syncthreads();  // every thread waits on `staged`: it is initialised before anyone does
#endif

  // This thread's first column; vector i is in the row when i * STEP < left.
  const int64_t col0 = static_cast<int64_t>(rank) * CHUNK + static_cast<int64_t>(threadIdx.x) * VEC;
  const int64_t left = n_cols - col0;
  // The weight and bias vectors in registers, loaded at OK_PUSH_WLOAD's point (2: before the
  // exchange, 3: while the chunk lands; 4: their lines asked into L1 before the exchange);
  // otherwise, or wider than 128 bytes a thread (float32 parameters of 8 vectors), loaded inside
  // the normalize loop. With OK_PUSH_BY_OP only the RMSNorm instance holds them: the generic
  // one (LayerNorm) would hold the bias too, 110-116 registers, and lost 10-35% that way (H200).
#ifdef OK_PUSH_BY_OP
  constexpr bool kHoistHere = RMS_ONLY;
#else
  constexpr bool kHoistHere = true;
#endif
  constexpr bool kHoist = kHoistHere && !STAGE_PARAMS && (OK_PUSH_WLOAD == 2 || OK_PUSH_WLOAD == 3) &&
                          sizeof(W) * VEC * VPT <= 128;
  const bool has_weight = flags & kHasWeight, has_bias = !RMS_ONLY && (flags & kHasBias);
  ParamVecs<W, VEC, VPT> wv, bv;
  auto load_weight_and_bias = [&](int point) {
#if OK_PUSH_WLOAD == 4 && !defined(OK_CUDA_EMULATION)
    // 4: no registers held; the weight's and bias's lines asked into L1 before the exchange.
    if (point == 2) {
#pragma unroll
      for (int i = 0; i < VPT; ++i) {
        if (i * STEP < left) {
          if (has_weight) asm volatile("prefetch.global.L1 [%0];" ::"l"(weight + col0 + i * STEP));
          if (has_bias) asm volatile("prefetch.global.L1 [%0];" ::"l"(bias + col0 + i * STEP));
        }
      }
    }
#endif
    if (!kHoist || point != OK_PUSH_WLOAD) return;
    if (has_weight) load_params<W, THREADS, VPT>(wv, weight + col0, left);
    if (has_bias) load_params<W, THREADS, VPT>(bv, bias + col0, left);
  };
  OK_DYNAMIC_SHARED(stage);
  RowVec* const h = reinterpret_cast<RowVec*>(stage) + threadIdx.x;  // vector i at h[i * THREADS]
  const RowVec* const staged_res = h + THREADS * VPT;
  // STAGE_PARAMS: the chunk's weight, then its bias (CHUNK elements of W each), after x.
  W* const staged_weight = reinterpret_cast<W*>(stage + THREADS * VPT * sizeof(RowVec));
#ifndef OK_PUSH_BULK
  static_assert(!STAGE_PARAMS, "the weight and bias are staged by bulk copies (OK_PUSH_BULK)");
#endif
#ifdef OK_PUSH_BULK
  // (On in the default build.) The CTA's chunk of x (and of the residual) in one bulk copy
  // each, issued by one thread (the TMA unit splits it), instead of a cp.async per thread and
  // 16 bytes with its address and bounds arithmetic. The shared layout is the chunk's own
  // order, as in the plain build below.
  if (threadIdx.x == 0) {
    const int64_t first = static_cast<int64_t>(rank) * CHUNK;
    const int64_t cols = n_cols - first < CHUNK ? n_cols - first : CHUNK;
    const uint32_t bytes = static_cast<uint32_t>(cols * static_cast<int64_t>(sizeof(T)));
    const uint32_t param_bytes = static_cast<uint32_t>(cols * static_cast<int64_t>(sizeof(W)));
    const uint32_t params = STAGE_PARAMS ? param_bytes * ((has_weight ? 1 : 0) + (has_bias ? 1 : 0)) : 0;
    ok_barrier_arrive_expect_tx(&staged, (has_residual ? 2 * bytes : bytes) + params);
    ok_bulk_copy(stage, x + row * stride_x + first, bytes, &staged);
    if (has_residual)
      ok_bulk_copy(stage + THREADS * VPT * sizeof(RowVec), res + row * stride_res + first, bytes, &staged);
    if constexpr (STAGE_PARAMS) {  // the pick leaves no residual beside them
      if (has_weight) ok_bulk_copy(staged_weight, weight + first, param_bytes, &staged);
      if (has_bias) ok_bulk_copy(staged_weight + CHUNK, bias + first, param_bytes, &staged);
    }
  }
  load_weight_and_bias(3);
  ok_barrier_wait(&staged, 0);
#else
  const T* const x_at = x + row * stride_x + col0;
  const T* const res_at = res + row * stride_res + col0;
#pragma unroll
  for (int i = 0; i < VPT; ++i) {
    if (i * STEP < left) {
      ok_copy_async<16, true>(&h[i * THREADS], x_at + i * STEP);
      if (has_residual) ok_copy_async<16, true>(&h[(VPT + i) * THREADS], res_at + i * STEP);
    }
  }
  load_weight_and_bias(3);
  ok_copy_async_wait_all();  // each thread reads back only its own vectors: no CTA barrier
#endif

  T* const res_out_at = res_out + row * stride_res_out + col0;
  const bool store = flags & kStoreResidual;
#ifdef OK_PUSH_TRIM
  // LayerNorm in one pass: each warp sums h - c and its squares about c, the first h of the
  // warp (lane 0's first element, x + residual rounded as the pass rounds it), sent to every
  // lane (lane 0 overwrites that element with h during its pass).
  constexpr bool kShifted = true;
  float shift = 0.f;
  if (!is_rms) {
    if (lane == 0) {
      shift = to_float(h[0].v[0]);
      if (has_residual) shift = to_float(from_float<T>(shift + to_float(staged_res[0].v[0])));
    }
    shift = __shfl_sync(0xffffffffu, shift, 0);
  }
#else
  constexpr bool kShifted = false;
  const float shift = 0.f;
#endif
  auto sum_pass = [&](auto rms, auto residual, auto stored) {
    constexpr bool rms_v = decltype(rms)::value;
    return push_sum_pass<T, THREADS, VPT, rms_v, decltype(residual)::value, decltype(stored)::value,
                         kShifted && !rms_v>(h, staged_res, res_out_at, left, shift);
  };
  auto by_stored = [&](auto rms, auto residual) {
    return store ? sum_pass(rms, residual, Flag<true>()) : sum_pass(rms, residual, Flag<false>());
  };
  auto by_residual = [&](auto rms) {
    return has_residual ? by_stored(rms, Flag<true>()) : by_stored(rms, Flag<false>());
  };
  const float4 counted = is_rms ? by_residual(Flag<true>()) : by_residual(Flag<false>());

  // This warp's part: RMSNorm (count, 0, sum of squares); LayerNorm (count, mean, M2 about
  // the warp's own mean: no cancellation on rows with a large mean).
  const float n_warp = warp_sum(counted.x);
  float4 part = make_float4(n_warp, 0.f, 0.f, 0.f);
  if (is_rms) {
    part.z = warp_sum(counted.y);
  } else if (kShifted) {
    // (mean, M2) from the shifted sums: M2 = S2 - S1^2 / n loses about (mean - c)^2 / variance
    // of its digits, so a warp whose shift lies more than 4 standard deviations from its mean
    // (an outlier first element; or sums that are not finite) takes M2 again about its mean
    // (a warp-uniform branch: every lane holds the same sums).
    const float s1 = warp_sum(counted.y), s2 = warp_sum(counted.z);
    // A warp past the row's end (a ragged last CTA) has no elements: its lane 0 read a stale
    // shared-memory word as the shift, which must not reach the part's mean (NaN * 0 is NaN).
    const float dc = n_warp > 0.f ? s1 / n_warp : 0.f;
    part.y = n_warp > 0.f ? shift + dc : 0.f;
    part.z = fmaxf(s2 - dc * s1, 0.f);
    if (!(dc * dc * n_warp <= 16.f * part.z)) part.z = warp_sum(push_m2_pass<T, THREADS, VPT>(h, left, part.y));
  } else {
    part.y = n_warp > 0.f ? warp_sum(counted.y) / n_warp : 0.f;
    part.z = warp_sum(push_m2_pass<T, THREADS, VPT>(h, left, part.y));
  }

  // Every CTA of the cluster gets every warp's part (a cluster of one: rows of one CTA,
  // launched without clusters, keeps them in its own shared memory).
  load_weight_and_bias(2);
  if (exchange) {
    ok_cluster_wait();  // every peer's barrier is initialised
    if (threadIdx.x == 0) ok_barrier_arrive_expect_tx(&full, static_cast<uint32_t>(n_ranks * WARPS * sizeof(float4)));
    if (lane < n_ranks) ok_store_remote(part, &parts[rank * WARPS + warp], &full, static_cast<uint32_t>(lane));
    ok_barrier_wait(&full, 0);
  } else {
    if (lane == 0) parts[warp] = part;
    __syncthreads();
  }
  const float2 stats = merge_parts(parts, n_ranks * WARPS, n_cols, is_rms, eps);
  const float mean = stats.x, rstd = stats.y;
  if (rank == 0 && threadIdx.x == 0) {
    rstd_out[row] = rstd;
    if (!is_rms) mean_out[row] = mean;
  }

  // Normalize from shared memory; the weight and bias come from L2 (every row reads them).
  // (STAGE_PARAMS: the same offsets into the staged chunk: this thread's first column in it.)
  const W* const weight_at = STAGE_PARAMS ? staged_weight + threadIdx.x * VEC : weight + col0;
  const W* const bias_at = STAGE_PARAMS ? staged_weight + CHUNK + threadIdx.x * VEC : bias + col0;
  T* const out_at = out + row * stride_out + col0;
  load_weight_and_bias(1);
  auto normalize_as = [&](auto rms, auto with_weight, auto with_bias, auto offset) {
    push_normalize<T, W, THREADS, VPT, decltype(rms)::value, decltype(with_weight)::value, decltype(with_bias)::value,
                   decltype(offset)::value, kHoist>(h, weight_at, bias_at, out_at, left, mean, rstd, weight_offset,
                                                    wv, bv);
  };
  auto normalize = [&](auto rms, auto with_weight, auto with_bias) {
#ifdef OK_PUSH_TRIM  // no add of a zero weight_offset per element
    if constexpr (decltype(with_weight)::value) {
      if (weight_offset == 0.f) return normalize_as(rms, with_weight, with_bias, Flag<false>());
    }
#endif
    normalize_as(rms, with_weight, with_bias, Flag<true>());
  };
  if (is_rms) {
    if (has_weight) normalize(Flag<true>(), Flag<true>(), Flag<false>());
    else normalize(Flag<true>(), Flag<false>(), Flag<false>());
  } else if (has_weight && has_bias) {
    normalize(Flag<false>(), Flag<true>(), Flag<true>());
  } else if (has_weight) {
    normalize(Flag<false>(), Flag<true>(), Flag<false>());
  } else if (has_bias) {
    normalize(Flag<false>(), Flag<false>(), Flag<true>());
  } else {
    normalize(Flag<false>(), Flag<false>(), Flag<false>());
  }
}

// The kernel of a shape (PUSH_SHAPES in cuda/__init__.py), or nullptr; it stages the x chunk
// and the residual's, 16 bytes per thread and vector each.
template <typename T, typename W>
FwdKernel<T, W> pick_fwd(int threads, int vpt, int flags, size_t& dynamic_shared) {
  dynamic_shared = static_cast<size_t>(threads) * vpt * 16 * ((flags & kHasResidual) ? 2 : 1);
#ifdef OK_PUSH_SMEM_PARAMS
  // The generic instance without a residual stages the weight and bias too, where they fit
  // (OK_PUSH_SMEM_PARAMS=2: the RMSNorm instance its weight as well, instead of holding it in
  // registers).
  const bool rms_only = (flags & kIsRms) && !(flags & kHasBias);
  const size_t params = static_cast<size_t>(threads) * vpt * (16 / sizeof(T)) * sizeof(W) * 2;
  if (!(flags & kHasResidual) && dynamic_shared + params <= kMaxDynamicShared) {
    dynamic_shared += params;
    if (!rms_only) {
      if (threads == 256 && vpt == 4) return norm_fwd_push_kernel<T, W, 256, 4, false, true>;
      if (threads == 256 && vpt == 8) return norm_fwd_push_kernel<T, W, 256, 8, false, true>;
      if (threads == 512 && vpt == 8) return norm_fwd_push_kernel<T, W, 512, 8, false, true>;
    }
#if OK_PUSH_SMEM_PARAMS == 2 && defined(OK_PUSH_BY_OP)
    if (rms_only) {
      if (threads == 256 && vpt == 4) return norm_fwd_push_kernel<T, W, 256, 4, true, true>;
      if (threads == 256 && vpt == 8) return norm_fwd_push_kernel<T, W, 256, 8, true, true>;
      if (threads == 512 && vpt == 8) return norm_fwd_push_kernel<T, W, 512, 8, true, true>;
    }
#endif
    dynamic_shared -= params;
  }
#endif
#ifdef OK_PUSH_BY_OP
  if ((flags & kIsRms) && !(flags & kHasBias)) {  // the RMSNorm instance has no bias pass
    if (threads == 256 && vpt == 4) return norm_fwd_push_kernel<T, W, 256, 4, true>;
    if (threads == 256 && vpt == 8) return norm_fwd_push_kernel<T, W, 256, 8, true>;
    if (threads == 512 && vpt == 8) return norm_fwd_push_kernel<T, W, 512, 8, true>;
  }
#endif
  if (threads == 256 && vpt == 4) return norm_fwd_push_kernel<T, W, 256, 4>;
  if (threads == 256 && vpt == 8) return norm_fwd_push_kernel<T, W, 256, 8>;
  if (threads == 512 && vpt == 8) return norm_fwd_push_kernel<T, W, 512, 8>;
  return nullptr;
}

}  // namespace

// One forward, ok_norm_fwd_cluster's arguments and answers (flags: kIsRms | kHasResidual |
// kStoreResidual | kHasWeight | kHasBias), and its packed twin.
OK_NORM_FWD_ENTRIES(ok_norm_fwd_push, ok_norm_fwd_push_packed)
OK_NORM_FWD_CLUSTERS_ENTRY(ok_norm_fwd_push_clusters)
