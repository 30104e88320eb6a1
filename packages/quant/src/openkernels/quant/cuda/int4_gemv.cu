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

namespace {

constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr int kKindZeros = 0, kKindSymmetric = 1, kKindNf4 = 2;

__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }

__device__ __forceinline__ uint32_t float_bits(float v) {
  uint32_t u;
  memcpy(&u, &v, 4);
  return u;
}
__device__ __forceinline__ float bits_float(uint32_t u) {
  float v;
  memcpy(&v, &u, 4);
  return v;
}

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
