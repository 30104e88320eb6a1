// int4 / NF4 weight-only GEMV for batch 1 (decode): out (N,) = W (N, K) x (K,) + bias, W in
// format.py's layout, read at the memory's pace.
//
// A CTA of 8 warps takes ROWS consecutive rows of W; its 256 threads split K in 16-byte chunks
// of the codes (32 columns, inside one group: group sizes are multiples of 32), so one pass
// over a row's bytes is one 16-byte load per thread and row, and many CTAs per SM keep enough
// bytes in flight. Per chunk a thread reads 32 values of x (L1: every CTA reads the same x),
// and for each of its ROWS rows turns the 32 codes into floats without a conversion
// instruction: nibble e of a 32-bit word (e <= 4; nibbles 5-7 come from word >> 12) OR'd into
// the bits of 2^(23 - 4e) reads 2^(23 - 4e) + q exactly, and one subtraction of
// 2^(23 - 4e) + zero leaves q - zero: a LOP3, a FADD and the FFMA with x per code. NF4 codes
// go through a 16-entry table held in the warp's registers (lane i holds level i & 15; one
// shuffle per code). The scale multiplies the chunk's sum once per row. The warps' sums meet
// in shared memory and are added in warp order (the same bits on every run).
//
// Built by openkernels.shared.cuda_build (nvcc, the device's arch) and, for tests, for the CPU
// emulation. Contract (checked by cuda/__init__.py): K a multiple of 32, the group size a
// multiple of 32 dividing K, qweight rows and x 16-byte aligned, scales (and zeros) rows of N
// entries with N a multiple of ROWS.

#ifdef OK_CUDA_EMULATION
#include "cuda_emulation.h"
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#endif
#include <stdint.h>
#include <string.h>
#include <type_traits>  // int4_mma_common.cuh: std::conditional_t

#include "async_copy.h"  // openkernels/shared/cuda: cp.async and dynamic shared memory

namespace {

#include "int4_mma_common.cuh"  // beside this file: conversions, the MMA and its operands

constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr int kKindZeros = 0, kKindSymmetric = 1, kKindNf4 = 2;

// 8 values of x (16 bytes of bf16 / fp16) as floats.
template <typename T>
__device__ __forceinline__ void load_x8(const T* p, float* out) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  T v[8];
  memcpy(v, &raw, 16);
#pragma unroll
  for (int i = 0; i < 8; ++i) out[i] = to_float(v[i]);
}

// sum_p (q_p - zero) * x[p] over the 8 nibbles of `word` (nibble p: column p).
__device__ __forceinline__ float dot_int4_word(uint32_t word, const float* x, const float* magic_minus) {
  // magic_minus[e] = 2^(23 - 4e) + zero. Nibbles 0-4 in place, 5-7 from word >> 12 (e = 2-4).
  const uint32_t hi = word >> 12;
  float acc = 0.f;
#pragma unroll
  for (int e = 0; e < 5; ++e) {
    const uint32_t bits = (word & (0xFu << (4 * e))) | float_bits(magic_minus[5 + e]);
    acc = fmaf(bits_float(bits) - magic_minus[e], x[e], acc);
  }
#pragma unroll
  for (int e = 2; e < 5; ++e) {
    const uint32_t bits = (hi & (0xFu << (4 * e))) | float_bits(magic_minus[5 + e]);
    acc = fmaf(bits_float(bits) - magic_minus[e], x[e + 3], acc);
  }
  return acc;
}

// sum_p NF4[q_p] * x[p]: lane i of the warp holds NF4[i & 15] in `level`.
__device__ __forceinline__ float dot_nf4_word(uint32_t word, const float* x, float level) {
  float acc = 0.f;
#pragma unroll
  for (int p = 0; p < 8; ++p) acc = fmaf(__shfl_sync(0xffffffffu, level, (word >> (4 * p)) & 0xF), x[p], acc);
  return acc;
}

template <typename S, int ROWS>
__device__ __forceinline__ void load_row_params(const S* p, float* out) {
  // ROWS consecutive entries of one group's row of scales (or zeros).
  S v[ROWS];
  if constexpr (ROWS * sizeof(S) == 16) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    memcpy(v, &raw, 16);
  } else {
    const uint2 raw = *reinterpret_cast<const uint2*>(p);
    memcpy(v, &raw, 8);
  }
#pragma unroll
  for (int r = 0; r < ROWS; ++r) out[r] = to_float(v[r]);
}

template <typename T, typename S, int ROWS, int KIND>
__global__ void __launch_bounds__(kThreads) int4_gemv_kernel(
    const T* __restrict__ x, const uint8_t* __restrict__ qweight, const S* __restrict__ scales,
    const S* __restrict__ zeros, const float* __restrict__ lut, const void* __restrict__ bias, int bias_code,
    T* __restrict__ out, int64_t n, int64_t k, int64_t stride_q, int64_t stride_s, int64_t group_size) {
  __shared__ float partial[kWarps][ROWS];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * ROWS;
  const int64_t n_chunks = k / 32;
  float level = 0.f;
  if (KIND == kKindNf4) level = lut[lane & 15];
  float acc[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) acc[r] = 0.f;

  // Every thread runs every step (the NF4 lookup is a shuffle of the whole warp); a thread
  // past K reads nothing and adds nothing.
  for (int64_t base = 0; base < n_chunks; base += kThreads) {
    const int64_t chunk = base + threadIdx.x;
    const bool active = chunk < n_chunks;
    const int64_t col = active ? chunk * 32 : 0;
    uint4 w[ROWS];
    float xv[32], s[ROWS], z[ROWS];
    if (active) {
#pragma unroll
      for (int r = 0; r < ROWS; ++r)
        w[r] = __ldcs(reinterpret_cast<const uint4*>(qweight + (n0 + r) * stride_q + col / 2));
#pragma unroll
      for (int i = 0; i < 4; ++i) load_x8(x + col + 8 * i, xv + 8 * i);
      const int64_t group = col / group_size;
      load_row_params<S, ROWS>(scales + group * stride_s + n0, s);
      if (KIND == kKindZeros) load_row_params<S, ROWS>(zeros + group * stride_s + n0, z);
    } else {
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        w[r] = uint4{0, 0, 0, 0};
        s[r] = z[r] = 0.f;
      }
#pragma unroll
      for (int i = 0; i < 32; ++i) xv[i] = 0.f;
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const uint32_t words[4] = {w[r].x, w[r].y, w[r].z, w[r].w};
      float dot = 0.f;
      if (KIND == kKindNf4) {
#pragma unroll
        for (int j = 0; j < 4; ++j) dot += dot_nf4_word(words[j], xv + 8 * j, level);
      } else {
        const float zero = KIND == kKindZeros ? z[r] : 8.f;
        float magic_minus[10];  // [0, 5): 2^(23 - 4e) + zero; [5, 10): 2^(23 - 4e)
#pragma unroll
        for (int e = 0; e < 5; ++e) {
          magic_minus[5 + e] = bits_float(static_cast<uint32_t>(150 - 4 * e) << 23);  // 2^(23 - 4e)
          magic_minus[e] = magic_minus[5 + e] + zero;
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) dot += dot_int4_word(words[j], xv + 8 * j, magic_minus);
      }
      acc[r] = fmaf(s[r], dot, acc[r]);
    }
  }

  // The warp's sums, then the CTA's in warp order.
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    float v = acc[r];
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    if (lane == 0) partial[warp][r] = v;
  }
  __syncthreads();
  if (threadIdx.x < ROWS && n0 + threadIdx.x < n) {
    const int r = threadIdx.x;
    float total = 0.f;
#pragma unroll
    for (int wi = 0; wi < kWarps; ++wi) total += partial[wi][r];
    if (bias_code == 1) total += static_cast<const float*>(bias)[n0 + r];
    if (bias_code == 2) total += to_float(static_cast<const __nv_bfloat16*>(bias)[n0 + r]);
    if (bias_code == 3) total += to_float(static_cast<const __half*>(bias)[n0 + r]);
    out[n0 + r] = from_float<T>(total);
  }
}

template <typename T, typename S, int ROWS>
int launch_kind(int kind, const void* x, const void* qweight, const void* scales, const void* zeros, const void* lut,
                const void* bias, int bias_code, void* out, int64_t n, int64_t k, int64_t stride_q, int64_t stride_s,
                int64_t group_size, cudaStream_t stream) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(n / ROWS), 1, 1);
  config.blockDim = dim3(kThreads, 1, 1);
  config.stream = stream;
  config.numAttrs = 0;
  auto args = [&](auto kernel) {
    return static_cast<int>(cudaLaunchKernelEx(
        &config, kernel, static_cast<const T*>(x), static_cast<const uint8_t*>(qweight),
        static_cast<const S*>(scales), static_cast<const S*>(zeros), static_cast<const float*>(lut), bias, bias_code,
        static_cast<T*>(out), n, k, stride_q, stride_s, group_size));
  };
  if (kind == kKindZeros) return args(int4_gemv_kernel<T, S, ROWS, kKindZeros>);
  if (kind == kKindSymmetric) return args(int4_gemv_kernel<T, S, ROWS, kKindSymmetric>);
  if (kind == kKindNf4) return args(int4_gemv_kernel<T, S, ROWS, kKindNf4>);
  return -1;
}

template <typename T, typename S>
int launch_rows(int rows, int kind, const void* x, const void* qweight, const void* scales, const void* zeros,
                const void* lut, const void* bias, int bias_code, void* out, int64_t n, int64_t k, int64_t stride_q,
                int64_t stride_s, int64_t group_size, cudaStream_t stream) {
  if (rows == 4)
    return launch_kind<T, S, 4>(kind, x, qweight, scales, zeros, lut, bias, bias_code, out, n, k, stride_q, stride_s,
                                group_size, stream);
  if (rows == 8)
    return launch_kind<T, S, 8>(kind, x, qweight, scales, zeros, lut, bias, bias_code, out, n, k, stride_q, stride_s,
                                group_size, stream);
  return -2;
}

// ---- one row of x, persistent: a grid of (SMs x CTAs per SM) walking blocks of rows --------
//
// The kernel above has each CTA issue one round of loads (ROWS 16-byte loads per thread at
// K = 8192), compute, reduce and exit: few bytes in flight per SM between rounds and an idle
// last wave. Here `grid` CTAs (the host passes SMs x CTAs per SM) take blocks of ROWS rows
// grid-stride (block b, b + grid, ...), and a thread's loads for the next DEPTH items (an item:
// one block's 16-byte chunk of each of its ROWS rows, with the chunk's scales and zeros) are
// issued before the current item's math: a ring of DEPTH + 1 register slots, indexed at
// compile time by unrolling the walk by DEPTH + 1. The weight goes through __ldcs (evict
// first: read once). Where K <= 32 x 256 (X_RESIDENT: one item per block), each thread's 32
// values of x are converted once and stay in registers for every block; past that a block
// takes ceil(K / 8192) items and x is read per item (L1). A block's sums: each warp reduces
// its ROWS partial sums by recursive halving (ROWS - 1 + log2(32 / ROWS) shuffles, not
// 5 ROWS), lane-group r ending with row r; the 8 warps' sums meet in shared memory (two
// buffers: one barrier per block) and ROWS threads add them in warp order, the same bits
// on every run. The codes' arithmetic is the kernel above's (NF4: one shuffle per code, the
// index unmasked: a shuffle reads bits 0-4 of it and lanes i, i + 16 hold the same level).
// Forced only (cuda/__init__.py's config "persistent...") pending its H200 numbers against the
// kernel above, which the default dispatch still runs. ptxas (sm_80 / sm_90, no spills): rows
// 2 and 4 at 113-128 registers (2 CTAs per SM), rows 8 x depth 1 at 195-255 (1 CTA per SM).

template <int ROWS>
struct GemvSlot {
  uint4 w[ROWS];           // the item's 16-byte chunk of each row
  uint32_t s[ROWS / 2];    // the chunk's group: ROWS scales (16-bit each, packed)
  uint32_t z[ROWS / 2];    // and zeros
};

// ROWS consecutive 16-bit entries of one group's row of scales (or zeros), raw.
template <int ROWS>
__device__ __forceinline__ void load_params_raw(const void* p, uint32_t* out) {
  if constexpr (ROWS == 8) {
    const uint4 v = *reinterpret_cast<const uint4*>(p);
    out[0] = v.x;
    out[1] = v.y;
    out[2] = v.z;
    out[3] = v.w;
  } else if constexpr (ROWS == 4) {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    out[0] = v.x;
    out[1] = v.y;
  } else {
    static_assert(ROWS == 2, "ROWS: 2, 4 or 8");
    out[0] = *reinterpret_cast<const uint32_t*>(p);
  }
}

template <typename S>
__device__ __forceinline__ float param_at(const uint32_t* raw, int r) {
  const uint16_t bits = static_cast<uint16_t>(raw[r / 2] >> (16 * (r % 2)));
  S v;
  memcpy(&v, &bits, 2);
  return to_float(v);
}

// Issue item (block, step)'s loads into `slot`; zeros where the thread's chunk is past K.
template <typename S, int ROWS, int KIND>
__device__ __forceinline__ void gemv_load_slot(GemvSlot<ROWS>& slot, const uint8_t* __restrict__ qweight,
                                               const S* __restrict__ scales, const S* __restrict__ zeros,
                                               int64_t block, int step, int64_t n_chunks, int64_t stride_q,
                                               int64_t stride_s, int chunks_per_group) {
  const int64_t chunk = static_cast<int64_t>(step) * kThreads + threadIdx.x;
  if (chunk < n_chunks) {
    const int64_t n0 = block * ROWS;
    const uint8_t* row = qweight + n0 * stride_q + chunk * 16;
#pragma unroll
    for (int r = 0; r < ROWS; ++r) slot.w[r] = __ldcs(reinterpret_cast<const uint4*>(row + r * stride_q));
    const int64_t offset = static_cast<int64_t>(static_cast<uint32_t>(chunk) / static_cast<uint32_t>(chunks_per_group)) *
                               stride_s + n0;
    load_params_raw<ROWS>(scales + offset, slot.s);
    if (KIND == kKindZeros) load_params_raw<ROWS>(zeros + offset, slot.z);
  } else {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) slot.w[r] = uint4{0, 0, 0, 0};
#pragma unroll
    for (int i = 0; i < ROWS / 2; ++i) slot.s[i] = slot.z[i] = 0;
  }
}

// acc[r] += scale_r * sum_p (q_rp - zero_r) x[p] (NF4: NF4[q_rp]) over the slot's chunk.
template <typename S, int ROWS, int KIND>
__device__ __forceinline__ void gemv_slot_math(const GemvSlot<ROWS>& slot, const float* xv, float level, float* acc) {
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const uint32_t words[4] = {slot.w[r].x, slot.w[r].y, slot.w[r].z, slot.w[r].w};
    float dot = 0.f;
    if (KIND == kKindNf4) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        float d = 0.f;
#pragma unroll
        for (int p = 0; p < 8; ++p)
          d = fmaf(__shfl_sync(0xffffffffu, level, static_cast<int>(words[j] >> (4 * p))), xv[8 * j + p], d);
        dot += d;
      }
    } else {
      const float zero = KIND == kKindZeros ? param_at<S>(slot.z, r) : 8.f;
      float magic_minus[10];  // as in int4_gemv_kernel
#pragma unroll
      for (int e = 0; e < 5; ++e) {
        magic_minus[5 + e] = bits_float(static_cast<uint32_t>(150 - 4 * e) << 23);
        magic_minus[e] = magic_minus[5 + e] + zero;
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) dot += dot_int4_word(words[j], xv + 8 * j, magic_minus);
    }
    acc[r] = fmaf(param_at<S>(slot.s, r), dot, acc[r]);
  }
}

// The warp's sums of ROWS rows by recursive halving: returns, in every lane, the warp's sum of
// row lane / (32 / ROWS).
template <int ROWS>
__device__ __forceinline__ float warp_reduce_rows(float* v, int lane) {
  int offset = 16;
#pragma unroll
  for (int half = ROWS / 2; half >= 1; half /= 2, offset /= 2) {
    const bool upper = (lane & offset) != 0;
#pragma unroll
    for (int i = 0; i < half; ++i) {
      const float send = upper ? v[i] : v[i + half];
      const float keep = upper ? v[i + half] : v[i];
      v[i] = keep + __shfl_xor_sync(0xffffffffu, send, offset);
    }
  }
#pragma unroll
  for (; offset > 0; offset /= 2) v[0] += __shfl_xor_sync(0xffffffffu, v[0], offset);
  return v[0];
}

// 2 CTAs of 256 threads per SM (128 registers) where the ring fits; 8 rows x 2 slots do not
// (ptxas spills at 128): one CTA per SM there.
template <int ROWS, int DEPTH>
constexpr int persistent_min_ctas() {
  return ROWS * (DEPTH + 1) <= 12 ? 2 : 1;
}

template <typename T, typename S, int ROWS, int DEPTH, int KIND, bool X_RESIDENT>
__global__ void __launch_bounds__(kThreads, persistent_min_ctas<ROWS, DEPTH>()) int4_gemv_persistent_kernel(
    const T* __restrict__ x, const uint8_t* __restrict__ qweight, const S* __restrict__ scales,
    const S* __restrict__ zeros, const float* __restrict__ lut, const void* __restrict__ bias, int bias_code,
    T* __restrict__ out, int64_t n, int64_t k, int64_t stride_q, int64_t stride_s, int64_t group_size, int grid) {
  __shared__ float partial[2][kWarps][ROWS];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t n_chunks = k / 32;
  const int chunks_per_group = static_cast<int>(group_size / 32);
  const int steps = X_RESIDENT ? 1 : static_cast<int>((n_chunks + kThreads - 1) / kThreads);
  const int64_t n_blocks = n / ROWS;
  const int64_t first = blockIdx.x;
  const int64_t items = first < n_blocks ? ((n_blocks - 1 - first) / grid + 1) * steps : 0;  // the same in every thread
  float level = 0.f;
  if (KIND == kKindNf4) level = lut[lane & 15];

  float xv[32];
  if (X_RESIDENT) {
    if (static_cast<int64_t>(threadIdx.x) < n_chunks) {
#pragma unroll
      for (int i = 0; i < 4; ++i) load_x8(x + 32 * threadIdx.x + 8 * i, xv + 8 * i);
    } else {
#pragma unroll
      for (int i = 0; i < 32; ++i) xv[i] = 0.f;
    }
  }

  GemvSlot<ROWS> slot[DEPTH + 1];
  int64_t load_block = first, math_block = first;
  int load_step = 0, math_step = 0, buffer = 0;
#pragma unroll
  for (int d = 0; d < DEPTH; ++d) {
    if (d < items) {
      gemv_load_slot<S, ROWS, KIND>(slot[d], qweight, scales, zeros, load_block, load_step, n_chunks, stride_q,
                                    stride_s, chunks_per_group);
      if (++load_step == steps) load_step = 0, load_block += grid;
    }
  }
  float acc[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) acc[r] = 0.f;

  for (int64_t base = 0; base < items; base += DEPTH + 1) {
#pragma unroll
    for (int u = 0; u <= DEPTH; ++u) {
      if (base + u >= items) break;  // the same in every thread
      if (base + u + DEPTH < items) {
        gemv_load_slot<S, ROWS, KIND>(slot[(u + DEPTH) % (DEPTH + 1)], qweight, scales, zeros, load_block,
                                      load_step, n_chunks, stride_q, stride_s, chunks_per_group);
        if (++load_step == steps) load_step = 0, load_block += grid;
      }
      const int64_t warp_chunk = static_cast<int64_t>(math_step) * kThreads + 32 * warp;
      if (!X_RESIDENT) {
        const int64_t chunk = warp_chunk + lane;
        if (chunk < n_chunks) {
#pragma unroll
          for (int i = 0; i < 4; ++i) load_x8(x + 32 * chunk + 8 * i, xv + 8 * i);
        } else {
#pragma unroll
          for (int i = 0; i < 32; ++i) xv[i] = 0.f;
        }
      }
      // A warp wholly past K skips the math (the same in all its lanes: its shuffles too).
      if (warp_chunk < n_chunks) gemv_slot_math<S, ROWS, KIND>(slot[u], xv, level, acc);
      if (math_step == steps - 1) {
        const float v = warp_reduce_rows<ROWS>(acc, lane);
        if ((lane & (32 / ROWS - 1)) == 0) partial[buffer][warp][lane / (32 / ROWS)] = v;
        __syncthreads();
        if (threadIdx.x < ROWS) {
          const int r = threadIdx.x;
          const int64_t row = math_block * ROWS + r;
          float total = 0.f;
#pragma unroll
          for (int wi = 0; wi < kWarps; ++wi) total += partial[buffer][wi][r];
          if (bias_code == 1) total += static_cast<const float*>(bias)[row];
          if (bias_code == 2) total += to_float(static_cast<const __nv_bfloat16*>(bias)[row]);
          if (bias_code == 3) total += to_float(static_cast<const __half*>(bias)[row]);
          out[row] = from_float<T>(total);
        }
        buffer ^= 1;
#pragma unroll
        for (int r = 0; r < ROWS; ++r) acc[r] = 0.f;
      }
      if (++math_step == steps) math_step = 0, math_block += grid;
    }
  }
}

template <typename T, typename S, int ROWS, int DEPTH>
int launch_persistent(int kind, const void* x, const void* qweight, const void* scales, const void* zeros,
                      const void* lut, const void* bias, int bias_code, void* out, int64_t n, int64_t k,
                      int64_t stride_q, int64_t stride_s, int64_t group_size, int grid, cudaStream_t stream) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(grid), 1, 1);
  config.blockDim = dim3(kThreads, 1, 1);
  config.stream = stream;
  config.numAttrs = 0;
  auto args = [&](auto kernel) {
    return static_cast<int>(cudaLaunchKernelEx(
        &config, kernel, static_cast<const T*>(x), static_cast<const uint8_t*>(qweight),
        static_cast<const S*>(scales), static_cast<const S*>(zeros), static_cast<const float*>(lut), bias, bias_code,
        static_cast<T*>(out), n, k, stride_q, stride_s, group_size, grid));
  };
  const bool resident = k / 32 <= kThreads;
#define OK_PERSISTENT(KIND)                                                                            \
  return resident ? args(int4_gemv_persistent_kernel<T, S, ROWS, DEPTH, KIND, true>)                   \
                  : args(int4_gemv_persistent_kernel<T, S, ROWS, DEPTH, KIND, false>)
  if (kind == kKindZeros) OK_PERSISTENT(kKindZeros);
  if (kind == kKindSymmetric) OK_PERSISTENT(kKindSymmetric);
  if (kind == kKindNf4) OK_PERSISTENT(kKindNf4);
#undef OK_PERSISTENT
  return -1;
}

// (rows, depth) pairs built: PERSISTENT_SHAPES in cuda/__init__.py.
template <typename T, typename S>
int launch_persistent_shape(int rows, int depth, int kind, const void* x, const void* qweight, const void* scales,
                            const void* zeros, const void* lut, const void* bias, int bias_code, void* out,
                            int64_t n, int64_t k, int64_t stride_q, int64_t stride_s, int64_t group_size, int grid,
                            cudaStream_t stream) {
#define OK_SHAPE(R, D)                                                                                         \
  if (rows == R && depth == D)                                                                                 \
    return launch_persistent<T, S, R, D>(kind, x, qweight, scales, zeros, lut, bias, bias_code, out, n, k,    \
                                         stride_q, stride_s, group_size, grid, stream);
  OK_SHAPE(2, 4)
  OK_SHAPE(4, 1)
  OK_SHAPE(4, 2)
  OK_SHAPE(8, 1)
#undef OK_SHAPE
  return -2;
}

// ---- small M (2-16 rows of x): tensor cores on codes in their stored order ----------------
//
// mma.m16n8k16 takes, in lane (g = lane / 4, t = lane % 4), the B (weight) pairs of rows k =
// 2t, 2t+1 and 2t+8, 2t+9 of column g, and the A (x) pairs of the same k for rows g and g+8.
// A dot product does not care which k is which as long as x and W agree, so each lane reads a
// contiguous 32-code window of its column (16 bytes: one load) and of x, and the eight k-steps
// of a 128-code chunk take their pairs from that window: step s uses codes (p, p+4) and
// (p+1, p+5) of word s / 2, p = 8 (s / 2) + 2 (s % 2). A LOP3 puts two of those nibbles in
// the two 16-bit halves of one register with the bits of 128 (bf16) or 1024 (fp16), so the
// register reads (base + q_a, base + q_b); one packed subtraction of base + zero and one
// packed multiply by the scale leave the weight pair in x's dtype, rounded once (the error
// contract's W term). The CTA's 8 warps split K; their sums meet in shared memory in order.

constexpr int kMmaWarps = 8;
constexpr int kMmaTiles = 4;                // n8 tiles per CTA: 32 columns of W
constexpr int kMmaCols = 8 * kMmaTiles;


template <typename T, typename S, int KIND>
__global__ void __launch_bounds__(kMmaWarps * 32) int4_mma_kernel(
    const T* __restrict__ x, const uint8_t* __restrict__ qweight, const S* __restrict__ scales,
    const S* __restrict__ zeros, const void* __restrict__ bias, int bias_code, T* __restrict__ out, int64_t m,
    int64_t n, int64_t k, int64_t stride_x, int64_t stride_q, int64_t stride_s, int64_t stride_out,
    int64_t group_size) {
  __shared__ float partial[kMmaWarps][32][kMmaTiles * 4];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * kMmaCols;
  const int64_t n_chunks = k / 128;
  float acc[kMmaTiles][4];
#pragma unroll
  for (int tile = 0; tile < kMmaTiles; ++tile) {
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[tile][i] = 0.f;
  }

  for (int64_t chunk = warp; chunk < n_chunks; chunk += kMmaWarps) {  // the same steps in every lane
    const int64_t k0 = chunk * 128 + 32 * t;                          // this lane's 32-code window
    uint4 codes[kMmaTiles];
    uint32_t sub[kMmaTiles], mul[kMmaTiles];
    const int64_t group = k0 / group_size;
#pragma unroll
    for (int tile = 0; tile < kMmaTiles; ++tile) {
      const int64_t col = n0 + 8 * tile + g;
      codes[tile] = __ldcs(reinterpret_cast<const uint4*>(qweight + col * stride_q + k0 / 2));
      const float zero = KIND == kKindZeros ? to_float(zeros[group * stride_s + col]) : 8.f;
      const float scale = to_float(scales[group * stride_s + col]);
      sub[tile] = pack2<T>(MmaMagic<T>::kBase + zero, MmaMagic<T>::kBase + zero);
      mul[tile] = pack2<T>(scale, scale);
    }
    uint32_t xw[2][16];  // rows g and g + 8 of x, the window's 32 values (zeros past M)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t row = g + 8 * h;
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        uint4 v = {0, 0, 0, 0};
        if (row < m) v = *reinterpret_cast<const uint4*>(x + row * stride_x + k0 + 8 * q);
        xw[h][4 * q] = v.x;
        xw[h][4 * q + 1] = v.y;
        xw[h][4 * q + 2] = v.z;
        xw[h][4 * q + 3] = v.w;
      }
    }
#pragma unroll
    for (int step = 0; step < 8; ++step) {
      const int word = step / 2, shift = (step % 2) * 8, p = 8 * word + 2 * (step % 2);
      const uint32_t a[4] = {pick2(xw[0], p, p + 4), pick2(xw[1], p, p + 4), pick2(xw[0], p + 1, p + 5),
                             pick2(xw[1], p + 1, p + 5)};
#pragma unroll
      for (int tile = 0; tile < kMmaTiles; ++tile) {
        const uint32_t words[4] = {codes[tile].x, codes[tile].y, codes[tile].z, codes[tile].w};
        const uint32_t wd = words[word];
        const uint32_t b[2] = {
            sub_mul2<T>(and_or<0x000F000Fu, MmaMagic<T>::kBits>(wd >> shift), sub[tile], mul[tile]),
            sub_mul2<T>(and_or<0x000F000Fu, MmaMagic<T>::kBits>(wd >> (shift + 4)), sub[tile], mul[tile])};
        mma_16816<T>(acc[tile], a, b);
      }
    }
  }

  // Lane (g, t) holds rows g and g + 8, columns 2t and 2t + 1 of each tile.
#pragma unroll
  for (int tile = 0; tile < kMmaTiles; ++tile) {
#pragma unroll
    for (int i = 0; i < 4; ++i) partial[warp][lane][4 * tile + i] = acc[tile][i];
  }
  __syncthreads();
  for (int o = threadIdx.x; o < 16 * kMmaCols; o += kMmaWarps * 32) {
    const int row = o / kMmaCols, col = o % kMmaCols;
    if (row >= m) continue;
    const int owner = (row % 8) * 4 + (col % 8) / 2, slot = 4 * (col / 8) + 2 * (row >= 8) + (col % 2);
    float total = 0.f;
#pragma unroll
    for (int wi = 0; wi < kMmaWarps; ++wi) total += partial[wi][owner][slot];
    const int64_t c = n0 + col;
    if (bias_code == 1) total += static_cast<const float*>(bias)[c];
    if (bias_code == 2) total += to_float(static_cast<const __nv_bfloat16*>(bias)[c]);
    if (bias_code == 3) total += to_float(static_cast<const __half*>(bias)[c]);
    out[row * stride_out + c] = from_float<T>(total);
  }
}

template <typename T, typename S>
int launch_mma(int kind, const void* x, const void* qweight, const void* scales, const void* zeros,
               const void* bias, int bias_code, void* out, int64_t m, int64_t n, int64_t k, int64_t stride_x,
               int64_t stride_q, int64_t stride_s, int64_t stride_out, int64_t group_size, cudaStream_t stream) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(n / kMmaCols), 1, 1);
  config.blockDim = dim3(kMmaWarps * 32, 1, 1);
  config.stream = stream;
  config.numAttrs = 0;
  auto run = [&](auto kernel) {
    return static_cast<int>(cudaLaunchKernelEx(
        &config, kernel, static_cast<const T*>(x), static_cast<const uint8_t*>(qweight),
        static_cast<const S*>(scales), static_cast<const S*>(zeros), bias, bias_code, static_cast<T*>(out), m, n, k,
        stride_x, stride_q, stride_s, stride_out, group_size));
  };
  if (kind == kKindZeros) return run(int4_mma_kernel<T, S, kKindZeros>);
  if (kind == kKindSymmetric) return run(int4_mma_kernel<T, S, kKindSymmetric>);
  return -1;
}

// ---- small M, persistent: a grid of (SMs x CTAs per SM) walking tiles of W's columns --------
//
// The kernel above gives each CTA one 32-column tile: each warp issues one 128-code chunk's
// loads (4 x 16 bytes of codes per lane), waits, computes, and the CTA exits after a
// reduction: few bytes in flight per SM and a last wave of idle SMs. Here `grid` CTAs (the
// host passes SMs x CTAs per SM: the emulation has no gridDim) take tiles of 8 x TILES
// columns grid-stride (tile b, b + grid, ...); the 8 warps still split K (warp w: chunks w,
// w + 8, ...), and a warp's walk is a list of items (tile, step; chunk = 8 step + w). Each
// thread copies its items' bytes (TILES 16-byte code windows, the group's TILES scales and
// zeros) with cp.async into its own slots of a DEPTH-stage ring in shared memory, DEPTH items
// ahead of the math, one commit group per item: the bytes in flight are not bounded by
// registers, and no barrier guards a stage (a thread reads back only what it copied, after
// cp.async.wait_group; it refills a stage after its math has consumed the stage's values).
// x's two 32-value windows (rows g, g + 8: an L2 hit) come into registers one item ahead;
// where K <= 1024 (one step) they are loaded once and kept for every tile. At the target
// shape (M = 16, K = 8192) x is 256 KB per CTA, more than the SM's shared memory, so past one
// step x is re-read per tile: TILES = 8 halves those reads per weight byte against TILES = 4
// (the kernel above). Every warp has the same number of items (ceil(K / 1024) per tile; a
// chunk past K copies nothing and skips the math, the same in the whole warp), so the CTA's
// barriers line up. Columns: the mma's B column g of n8 tile j is W's column n0 + TILES g + j,
// so a lane's TILES columns are contiguous and their scales (zeros) are one 8- or 16-byte
// copy. A tile's sums: each warp stores its fragments (16 bytes per lane and n8 tile: no bank
// conflicts), a barrier, the 256 threads add the 8 warps' values in warp order (the same bits
// on every run) and the bias; a barrier before the next tile's stores. Forced only
// (cuda/__init__.py's config "mma-persistent...") pending its H200 numbers against the kernel
// above, which the default dispatch still runs.


// A thread's 16-byte units per stage: TILES code windows, then the scales and zeros (2 x
// TILES 16-bit values: one unit for TILES = 4, two for 8). Unit u of thread i of stage s sits
// at ((s x kUnits + u) x 256 + i) x 16 bytes: a warp's 16-byte accesses are contiguous.
template <int TILES>
__host__ __device__ constexpr int mma_units() {
  return TILES + TILES / 4;
}

template <int TILES, int DEPTH>
constexpr size_t mma_ring_bytes() {
  return static_cast<size_t>(DEPTH) * mma_units<TILES>() * kMmaWarps * 32 * 16;
}

// One CTA per SM by registers (launch bounds 256 x 1): at 128 (2 CTAs per SM) the 32-column
// tiles spill (x's two register windows are 64 of them). ptxas (sm_80 / sm_90, no spills):
// 32 columns 160-172 registers, 64 columns 182-198. The ring: 20 KB per stage for 32 columns,
// 40 KB for 64 (shapes 32 x 4, 32 x 8, 64 x 2, 64 x 4: 80-160 KB, 64-128 KB of codes in flight).

__device__ __forceinline__ unsigned char* mma_unit(unsigned char* ring, int stage, int units, int unit) {
  return ring + ((static_cast<size_t>(stage) * units + unit) * (kMmaWarps * 32) + threadIdx.x) * 16;
}

// Copy item (tile, chunk)'s codes, scales and zeros into `stage` (nothing for a chunk past K).
template <typename S, int TILES, int KIND>
__device__ __forceinline__ void mma_issue(unsigned char* ring, int stage, const uint8_t* __restrict__ qweight,
                                          const S* __restrict__ scales, const S* __restrict__ zeros, int64_t tile,
                                          int64_t chunk, int lane, int64_t n_chunks, int64_t stride_q,
                                          int64_t stride_s, int64_t group_size) {
  constexpr int kUnits = mma_units<TILES>();
  if (chunk >= n_chunks) return;
  const int g = lane >> 2, t = lane & 3;
  const int64_t k0 = chunk * 128 + 32 * t;
  const int64_t c0 = tile * (8 * TILES) + TILES * g;  // the lane's first column
  const uint8_t* row = qweight + c0 * stride_q + k0 / 2;
#pragma unroll
  for (int j = 0; j < TILES; ++j) ok_copy_async<16, true>(mma_unit(ring, stage, kUnits, j), row + j * stride_q);
  const int64_t offset = (k0 / group_size) * stride_s + c0;
  unsigned char* params = mma_unit(ring, stage, kUnits, TILES);
  ok_copy_async<2 * TILES, false>(params, scales + offset);
  if (KIND == kKindZeros) {
    unsigned char* z = TILES == 8 ? mma_unit(ring, stage, kUnits, TILES + 1) : params + 8;
    ok_copy_async<2 * TILES, false>(z, zeros + offset);
  }
}

// x's rows g and g + 8 over the lane's 32-value window of `chunk` (zeros past M or K).
template <typename T>
__device__ __forceinline__ void mma_load_x(uint32_t (*xw)[16], const T* __restrict__ x, int64_t chunk, int lane,
                                           int64_t m, int64_t n_chunks, int64_t stride_x) {
  const int g = lane >> 2, t = lane & 3;
  const int64_t k0 = chunk * 128 + 32 * t;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t r = g + 8 * h;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      uint4 v = {0, 0, 0, 0};
      if (r < m && chunk < n_chunks) v = *reinterpret_cast<const uint4*>(x + r * stride_x + k0 + 8 * q);
      xw[h][4 * q] = v.x;
      xw[h][4 * q + 1] = v.y;
      xw[h][4 * q + 2] = v.z;
      xw[h][4 * q + 3] = v.w;
    }
  }
}

// acc[j] += x's 16 rows times n8 tile j over the stage's 128-code chunk.
template <typename T, typename S, int TILES, int KIND>
__device__ __forceinline__ void mma_stage_math(unsigned char* ring, int stage, const uint32_t (*xw)[16],
                                               float (*acc)[4]) {
  constexpr int kUnits = mma_units<TILES>();
  uint4 codes[TILES];
#pragma unroll
  for (int j = 0; j < TILES; ++j) codes[j] = *reinterpret_cast<const uint4*>(mma_unit(ring, stage, kUnits, j));
  uint32_t sraw[TILES / 2], zraw[TILES / 2];
  {
    const uint4 p = *reinterpret_cast<const uint4*>(mma_unit(ring, stage, kUnits, TILES));
    if constexpr (TILES == 8) {
      const uint4 q = KIND == kKindZeros ? *reinterpret_cast<const uint4*>(mma_unit(ring, stage, kUnits, TILES + 1))
                                         : uint4{0, 0, 0, 0};
      sraw[0] = p.x, sraw[1] = p.y, sraw[2] = p.z, sraw[3] = p.w;
      zraw[0] = q.x, zraw[1] = q.y, zraw[2] = q.z, zraw[3] = q.w;
    } else {
      sraw[0] = p.x, sraw[1] = p.y, zraw[0] = p.z, zraw[1] = p.w;
    }
  }
  uint32_t sub[TILES], mul[TILES];
#pragma unroll
  for (int j = 0; j < TILES; ++j) {
    const float zero = KIND == kKindZeros ? param_at<S>(zraw, j) : 8.f;
    const float scale = param_at<S>(sraw, j);
    sub[j] = pack2<T>(MmaMagic<T>::kBase + zero, MmaMagic<T>::kBase + zero);
    mul[j] = pack2<T>(scale, scale);
  }
#pragma unroll
  for (int step = 0; step < 8; ++step) {
    const int word = step / 2, shift = (step % 2) * 8, p = 8 * word + 2 * (step % 2);
    const uint32_t a[4] = {pick2(xw[0], p, p + 4), pick2(xw[1], p, p + 4), pick2(xw[0], p + 1, p + 5),
                           pick2(xw[1], p + 1, p + 5)};
#pragma unroll
    for (int j = 0; j < TILES; ++j) {
      const uint32_t words[4] = {codes[j].x, codes[j].y, codes[j].z, codes[j].w};
      const uint32_t wd = words[word];
      const uint32_t b[2] = {
          sub_mul2<T>(and_or<0x000F000Fu, MmaMagic<T>::kBits>(wd >> shift), sub[j], mul[j]),
          sub_mul2<T>(and_or<0x000F000Fu, MmaMagic<T>::kBits>(wd >> (shift + 4)), sub[j], mul[j])};
      mma_16816<T>(acc[j], a, b);
    }
  }
}

template <typename T, typename S, int KIND, int TILES, int DEPTH>
__global__ void __launch_bounds__(kMmaWarps * 32, 1)
    int4_mma_persistent_kernel(const T* __restrict__ x, const uint8_t* __restrict__ qweight,
                               const S* __restrict__ scales, const S* __restrict__ zeros,
                               const void* __restrict__ bias, int bias_code, T* __restrict__ out, int64_t m,
                               int64_t n, int64_t k, int64_t stride_x, int64_t stride_q, int64_t stride_s,
                               int64_t stride_out, int64_t group_size, int grid) {
  constexpr int kCols = 8 * TILES;
  OK_DYNAMIC_SHARED(ring);  // mma_ring_bytes<TILES, DEPTH>()
  // [warp][n8 tile][lane][register]: lane (g, t)'s sums of rows g, g + 8, mma columns 2t, 2t + 1.
  alignas(16) __shared__ float partial[kMmaWarps][TILES][32][4];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t n_chunks = k / 128;
  const int steps = static_cast<int>((n_chunks + kMmaWarps - 1) / kMmaWarps);
  const int64_t n_tiles = n / kCols;
  const int64_t first = blockIdx.x;
  const int64_t items = first < n_tiles ? ((n_tiles - 1 - first) / grid + 1) * steps : 0;  // the same in every thread

  int64_t load_tile = first, math_tile = first;
  int load_step = 0, math_step = 0, x_step = 0, stage = 0;
#pragma unroll
  for (int d = 0; d < DEPTH; ++d) {
    if (d < items) {
      mma_issue<S, TILES, KIND>(ring, d, qweight, scales, zeros, load_tile,
                                static_cast<int64_t>(load_step) * kMmaWarps + warp, lane, n_chunks, stride_q,
                                stride_s, group_size);
      if (++load_step == steps) load_step = 0, load_tile += grid;
    }
    ok_copy_async_commit();  // one group per item slot, empty or not: wait_group counts them
  }
  uint32_t xw[2][2][16];  // x's windows for the current item and the next
  mma_load_x<T>(xw[0], x, warp, lane, m, n_chunks, stride_x);
  if (steps == 1) {  // one step: x is the same for every tile
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int i = 0; i < 16; ++i) xw[1][h][i] = xw[0][h][i];
    }
  } else {
    x_step = 1;
  }
  float acc[TILES][4];
#pragma unroll
  for (int j = 0; j < TILES; ++j) {
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[j][i] = 0.f;
  }

  for (int64_t base = 0; base < items; base += 2) {
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int64_t item = base + u;
      if (item >= items) break;  // the same in every thread
      if (steps > 1 && item + 1 < items) {
        mma_load_x<T>(xw[(u + 1) % 2], x, static_cast<int64_t>(x_step) * kMmaWarps + warp, lane, m, n_chunks,
                      stride_x);
        if (++x_step == steps) x_step = 0;
      }
      ok_copy_async_wait_group<DEPTH - 1>();  // this item's group has landed
      // A warp whose chunk is past K skips the math (the same in all its lanes: the mma too).
      if (static_cast<int64_t>(math_step) * kMmaWarps + warp < n_chunks)
        mma_stage_math<T, S, TILES, KIND>(ring, stage, xw[u], acc);
      if (item + DEPTH < items) {  // refill the stage just consumed
        mma_issue<S, TILES, KIND>(ring, stage, qweight, scales, zeros, load_tile,
                                  static_cast<int64_t>(load_step) * kMmaWarps + warp, lane, n_chunks, stride_q,
                                  stride_s, group_size);
        if (++load_step == steps) load_step = 0, load_tile += grid;
      }
      ok_copy_async_commit();
      if (++stage == DEPTH) stage = 0;
      if (math_step == steps - 1) {
        __syncthreads();  // the previous tile's sums are read
#pragma unroll
        for (int j = 0; j < TILES; ++j) {
          *reinterpret_cast<uint4*>(partial[warp][j][lane]) =
              uint4{float_bits(acc[j][0]), float_bits(acc[j][1]), float_bits(acc[j][2]), float_bits(acc[j][3])};
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[j][i] = 0.f;
        }
        __syncthreads();
        const int64_t n0 = math_tile * kCols;
        // The tile's outputs in the order of `partial` (n8 tile, lane, register): no conflicts.
        for (int o = threadIdx.x; o < 16 * kCols; o += kMmaWarps * 32) {
          const int j = o / 128, owner = (o / 4) % 32, i = o % 4;
          const int row = (owner >> 2) + 8 * (i >> 1);
          if (row >= m) continue;
          const int64_t col = n0 + TILES * (2 * (owner & 3) + (i & 1)) + j;
          float total = 0.f;
#pragma unroll
          for (int wi = 0; wi < kMmaWarps; ++wi) total += partial[wi][j][owner][i];
          if (bias_code == 1) total += static_cast<const float*>(bias)[col];
          if (bias_code == 2) total += to_float(static_cast<const __nv_bfloat16*>(bias)[col]);
          if (bias_code == 3) total += to_float(static_cast<const __half*>(bias)[col]);
          out[row * stride_out + col] = from_float<T>(total);
        }
      }
      if (++math_step == steps) math_step = 0, math_tile += grid;
    }
  }
  ok_copy_async_wait_group<0>();  // the empty groups of the last items
}

template <typename T, typename S, int TILES, int DEPTH>
int launch_mma_persistent(int kind, const void* x, const void* qweight, const void* scales, const void* zeros,
                          const void* bias, int bias_code, void* out, int64_t m, int64_t n, int64_t k,
                          int64_t stride_x, int64_t stride_q, int64_t stride_s, int64_t stride_out,
                          int64_t group_size, int grid, cudaStream_t stream) {
  constexpr size_t kRing = mma_ring_bytes<TILES, DEPTH>();
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(grid), 1, 1);
  config.blockDim = dim3(kMmaWarps * 32, 1, 1);
  config.dynamicSmemBytes = kRing;
  config.stream = stream;
  config.numAttrs = 0;
  auto run = [&](auto kernel) {
    cudaError_t err = ok_opt_in_dynamic_shared(kernel, static_cast<int>(kRing));
    if (err != cudaSuccess) return static_cast<int>(err);
    return static_cast<int>(cudaLaunchKernelEx(
        &config, kernel, static_cast<const T*>(x), static_cast<const uint8_t*>(qweight),
        static_cast<const S*>(scales), static_cast<const S*>(zeros), bias, bias_code, static_cast<T*>(out), m, n, k,
        stride_x, stride_q, stride_s, stride_out, group_size, grid));
  };
  if (kind == kKindZeros) return run(int4_mma_persistent_kernel<T, S, kKindZeros, TILES, DEPTH>);
  if (kind == kKindSymmetric) return run(int4_mma_persistent_kernel<T, S, kKindSymmetric, TILES, DEPTH>);
  return -1;
}

// (columns per tile, depth) pairs built: MMA_PERSISTENT_SHAPES in cuda/__init__.py.
template <typename T, typename S>
int launch_mma_persistent_shape(int cols, int depth, int kind, const void* x, const void* qweight,
                                const void* scales, const void* zeros, const void* bias, int bias_code, void* out,
                                int64_t m, int64_t n, int64_t k, int64_t stride_x, int64_t stride_q,
                                int64_t stride_s, int64_t stride_out, int64_t group_size, int grid,
                                cudaStream_t stream) {
#define OK_SHAPE(C, D)                                                                                          \
  if (cols == C && depth == D)                                                                                  \
    return launch_mma_persistent<T, S, C / 8, D>(kind, x, qweight, scales, zeros, bias, bias_code, out, m, n, k, \
                                                 stride_x, stride_q, stride_s, stride_out, group_size, grid, stream);
  OK_SHAPE(32, 4)
  OK_SHAPE(32, 8)
  OK_SHAPE(64, 2)
  OK_SHAPE(64, 4)
#undef OK_SHAPE
  return -2;
}
}  // namespace

// out (N,) = W x + bias for one row of x. dtype codes: 1 bfloat16, 2 float16 (x, out: `x_code`;
// scales and zeros: `s_code`); kind 0 int4 with zeros, 1 symmetric int4, 2 NF4 (lut: the 16
// float32 levels); bias_code 0 none, 1 float32, 2 bfloat16, 3 float16. The stream is an integer
// (a constant to replay recordings). Returns 0, a cudaError_t, -1 (dtypes or kind), -2 (rows).
extern "C" int ok_int4_gemv(int device, int x_code, int s_code, int rows, int kind, const void* x,
                            const void* qweight, const void* scales, const void* zeros, const void* lut,
                            const void* bias, int bias_code, void* out, int64_t n, int64_t k, int64_t stride_q,
                            int64_t stride_s, int64_t group_size, int64_t stream) {
  cudaError_t err = cudaSetDevice(device);
  if (err != cudaSuccess) return static_cast<int>(err);
  auto s = reinterpret_cast<cudaStream_t>(stream);
#define OK_INT4_GEMV_ARGS rows, kind, x, qweight, scales, zeros, lut, bias, bias_code, out, n, k, stride_q, stride_s, \
                          group_size, s
  if (x_code == 1 && s_code == 1) return launch_rows<__nv_bfloat16, __nv_bfloat16>(OK_INT4_GEMV_ARGS);
  if (x_code == 1 && s_code == 2) return launch_rows<__nv_bfloat16, __half>(OK_INT4_GEMV_ARGS);
  if (x_code == 2 && s_code == 1) return launch_rows<__half, __nv_bfloat16>(OK_INT4_GEMV_ARGS);
  if (x_code == 2 && s_code == 2) return launch_rows<__half, __half>(OK_INT4_GEMV_ARGS);
#undef OK_INT4_GEMV_ARGS
  return -1;
}

// Every argument in one 64-bit slot: what replayed calls run.
extern "C" int ok_int4_gemv_packed(const int64_t* a) {
  auto p = [a](int i) { return reinterpret_cast<void*>(a[i]); };
  auto i32 = [a](int i) { return static_cast<int>(a[i]); };
  return ok_int4_gemv(i32(0), i32(1), i32(2), i32(3), i32(4), p(5), p(6), p(7), p(8), p(9), p(10), i32(11), p(12),
                      a[13], a[14], a[15], a[16], a[17], a[18]);
}

// The persistent GEMV (int4_gemv_persistent_kernel): ok_int4_gemv's arguments plus `depth`
// (items in flight ahead of the math) and `grid` (CTAs: SMs x CTAs per SM). Returns 0, a
// cudaError_t, -1 (dtypes or kind), -2 ((rows, depth) not built), -3 (grid < 1).
extern "C" int ok_int4_gemv_persistent(int device, int x_code, int s_code, int rows, int depth, int kind,
                                       const void* x, const void* qweight, const void* scales, const void* zeros,
                                       const void* lut, const void* bias, int bias_code, void* out, int64_t n,
                                       int64_t k, int64_t stride_q, int64_t stride_s, int64_t group_size,
                                       int64_t grid, int64_t stream) {
  cudaError_t err = cudaSetDevice(device);
  if (err != cudaSuccess) return static_cast<int>(err);
  if (grid < 1 || grid > 0x7fffffff) return -3;
  auto s = reinterpret_cast<cudaStream_t>(stream);
#define OK_PERSISTENT_ARGS rows, depth, kind, x, qweight, scales, zeros, lut, bias, bias_code, out, n, k, stride_q, \
                           stride_s, group_size, static_cast<int>(grid), s
  if (x_code == 1 && s_code == 1) return launch_persistent_shape<__nv_bfloat16, __nv_bfloat16>(OK_PERSISTENT_ARGS);
  if (x_code == 1 && s_code == 2) return launch_persistent_shape<__nv_bfloat16, __half>(OK_PERSISTENT_ARGS);
  if (x_code == 2 && s_code == 1) return launch_persistent_shape<__half, __nv_bfloat16>(OK_PERSISTENT_ARGS);
  if (x_code == 2 && s_code == 2) return launch_persistent_shape<__half, __half>(OK_PERSISTENT_ARGS);
#undef OK_PERSISTENT_ARGS
  return -1;
}

extern "C" int ok_int4_gemv_persistent_packed(const int64_t* a) {
  auto p = [a](int i) { return reinterpret_cast<void*>(a[i]); };
  auto i32 = [a](int i) { return static_cast<int>(a[i]); };
  return ok_int4_gemv_persistent(i32(0), i32(1), i32(2), i32(3), i32(4), i32(5), p(6), p(7), p(8), p(9), p(10),
                                 p(11), i32(12), p(13), a[14], a[15], a[16], a[17], a[18], a[19], a[20]);
}

// out (M, N) = x W^T + bias for 1-16 rows of x on tensor cores (int4 with zeros or symmetric;
// kind 2, NF4, is refused). Codes as ok_int4_gemv; N a multiple of 32, K of 128. Returns 0, a
// cudaError_t, -1 (dtypes or kind).
extern "C" int ok_int4_mma(int device, int x_code, int s_code, int kind, const void* x, const void* qweight,
                           const void* scales, const void* zeros, const void* bias, int bias_code, void* out,
                           int64_t m, int64_t n, int64_t k, int64_t stride_x, int64_t stride_q, int64_t stride_s,
                           int64_t stride_out, int64_t group_size, int64_t stream) {
  cudaError_t err = cudaSetDevice(device);
  if (err != cudaSuccess) return static_cast<int>(err);
  if (m < 1 || m > 16) return -1;
  auto s = reinterpret_cast<cudaStream_t>(stream);
#define OK_INT4_MMA_ARGS kind, x, qweight, scales, zeros, bias, bias_code, out, m, n, k, stride_x, stride_q, stride_s, \
                         stride_out, group_size, s
  if (x_code == 1 && s_code == 1) return launch_mma<__nv_bfloat16, __nv_bfloat16>(OK_INT4_MMA_ARGS);
  if (x_code == 1 && s_code == 2) return launch_mma<__nv_bfloat16, __half>(OK_INT4_MMA_ARGS);
  if (x_code == 2 && s_code == 1) return launch_mma<__half, __nv_bfloat16>(OK_INT4_MMA_ARGS);
  if (x_code == 2 && s_code == 2) return launch_mma<__half, __half>(OK_INT4_MMA_ARGS);
#undef OK_INT4_MMA_ARGS
  return -1;
}

extern "C" int ok_int4_mma_packed(const int64_t* a) {
  auto p = [a](int i) { return reinterpret_cast<void*>(a[i]); };
  auto i32 = [a](int i) { return static_cast<int>(a[i]); };
  return ok_int4_mma(i32(0), i32(1), i32(2), i32(3), p(4), p(5), p(6), p(7), p(8), i32(9), p(10), a[11], a[12],
                     a[13], a[14], a[15], a[16], a[17], a[18], a[19]);
}

// The persistent tensor-core kernel (int4_mma_persistent_kernel): ok_int4_mma's arguments plus
// `cols` (columns of W per tile: 32 or 64), `depth` (items in flight ahead of the math) and
// `grid` (CTAs: SMs x CTAs per SM). N a multiple of `cols`, K of 128, scales (and zeros) rows
// aligned to cols / 8 entries. Returns 0, a cudaError_t, -1 (dtypes, kind or M), -2 ((cols,
// depth) not built), -3 (grid < 1).
extern "C" int ok_int4_mma_persistent(int device, int x_code, int s_code, int kind, int cols, int depth,
                                      const void* x, const void* qweight, const void* scales, const void* zeros,
                                      const void* bias, int bias_code, void* out, int64_t m, int64_t n, int64_t k,
                                      int64_t stride_x, int64_t stride_q, int64_t stride_s, int64_t stride_out,
                                      int64_t group_size, int64_t grid, int64_t stream) {
  cudaError_t err = cudaSetDevice(device);
  if (err != cudaSuccess) return static_cast<int>(err);
  if (m < 1 || m > 16) return -1;
  if (grid < 1 || grid > 0x7fffffff) return -3;
  auto s = reinterpret_cast<cudaStream_t>(stream);
#define OK_MMA_PERSISTENT_ARGS cols, depth, kind, x, qweight, scales, zeros, bias, bias_code, out, m, n, k, stride_x, \
                               stride_q, stride_s, stride_out, group_size, static_cast<int>(grid), s
  if (x_code == 1 && s_code == 1) return launch_mma_persistent_shape<__nv_bfloat16, __nv_bfloat16>(OK_MMA_PERSISTENT_ARGS);
  if (x_code == 1 && s_code == 2) return launch_mma_persistent_shape<__nv_bfloat16, __half>(OK_MMA_PERSISTENT_ARGS);
  if (x_code == 2 && s_code == 1) return launch_mma_persistent_shape<__half, __nv_bfloat16>(OK_MMA_PERSISTENT_ARGS);
  if (x_code == 2 && s_code == 2) return launch_mma_persistent_shape<__half, __half>(OK_MMA_PERSISTENT_ARGS);
#undef OK_MMA_PERSISTENT_ARGS
  return -1;
}

extern "C" int ok_int4_mma_persistent_packed(const int64_t* a) {
  auto p = [a](int i) { return reinterpret_cast<void*>(a[i]); };
  auto i32 = [a](int i) { return static_cast<int>(a[i]); };
  return ok_int4_mma_persistent(i32(0), i32(1), i32(2), i32(3), i32(4), i32(5), p(6), p(7), p(8), p(9), p(10),
                                i32(11), p(12), a[13], a[14], a[15], a[16], a[17], a[18], a[19], a[20], a[21], a[22]);
}
