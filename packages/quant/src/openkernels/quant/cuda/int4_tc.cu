// int4 linear for 1-16 rows of x (decode) on tensor cores, W as mma.m16n8k16's A operand:
// W (N, K) in format.py's layout read at the memory's pace. Built by openkernels.shared.cuda_build
// (nvcc, the device's arch) and, for tests, for the CPU emulation; its own library, so that
// the default path's first call builds only these kernels. Contract (checked by
// cuda/__init__.py): K a multiple of 128, the group size of 32, N of 16 x tiles, qweight rows
// and x 16-byte aligned.

#ifdef OK_CUDA_EMULATION
#include "cuda_emulation.h"
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#endif
#include <stdint.h>
#include <type_traits>  // std::true_type; std::conditional_t (int4_mma_common.cuh)
#include <string.h>

#include "async_copy.h"        // openkernels/shared/cuda: dynamic shared memory
#include "cluster_exchange.h"  // openkernels/shared/cuda: mbarriers and bulk copies
#include "grid_dependency.h"   // openkernels/shared/cuda: programmatic dependent launch

namespace {

#include "int4_mma_common.cuh"  // beside this file: conversions, the MMA and its operands

// The NF4 build (-DOK_TC_NF4: cuda/__init__.py's second library, built on NF4's first call):
// the register and split kernels read each code as an NF4 level (nf4_levels) where this build
// reads int4; the dependent-launch and ring builds are left out of it (their launchers return
// -1). A library of its own, so that int4's first call compiles none of it.
#ifdef OK_TC_NF4
constexpr bool kNf4 = true;
#else
constexpr bool kNf4 = false;
#endif
// The NF4 build's register and split kernels read their pairs from a table in shared memory
// (nf4_lut_pairs) unless built with -DOK_TC_NF4_REGISTERS (the register lookup, nf4_levels).
#if defined(OK_TC_NF4) && !defined(OK_TC_NF4_REGISTERS)
constexpr bool kTcNf4Lut = true;
#else
constexpr bool kTcNf4Lut = false;
#endif

// NF4 pairs from a table in shared memory (the register kernel's NF4 build, where the register
// lookup left it issue-bound: 11 instructions per 4 codes against int4's ~5.5). A byte of codes
// (two NF4 codes, the low nibble first) indexes 256 packed pairs (level[b & 15], level[b >> 4])
// in T, so one 32-bit shared load gives an MMA register. The table is held 32 times, entry
// (b, lane) at word 32 b + lane, so that a warp's 32 loads fall in 32 different banks whatever
// its codes (one wavefront; a single copy would take ~3.5 on random codes): 32 KB per CTA,
// which the warps' sums overwrite at the end (the register kernel's static `nf4_lut`, the
// split kernel's dynamic shared memory). Per pair of codes: a prmt, a shift-and-add, the load.
constexpr int kNf4LutWords = 256 * 32;
constexpr int kNf4LutBytes = 4 * kNf4LutWords;
alignas(16) __shared__ uint32_t nf4_lut[kTcNf4Lut ? kNf4LutWords : 4];

// Every thread of the CTA fills its share of `lut` (kNf4LutWords words, 16-byte aligned, in
// shared memory); the caller syncs before the first lookup.
template <typename T>
__device__ __forceinline__ void nf4_lut_fill(uint32_t* lut, int thread, int threads) {
  for (int piece = thread; piece < kNf4LutWords / 4; piece += threads) {  // 4 lanes' copies of one entry
    uint32_t pair, unused;
    nf4_levels<T, 0>(static_cast<uint32_t>(piece >> 3), pair, unused);  // entry piece / 8: its byte's codes
    const uint4 four = {pair, pair, pair, pair};
    *reinterpret_cast<uint4*>(lut + 4 * piece) = four;
  }
}

// The lane's copy of entry 0 of `lut`: its shared-window address + 4 * lane (the emulation:
// the offset from `lut`).
__device__ __forceinline__ uint32_t nf4_lut_lane_at(const uint32_t* lut) {
#ifdef OK_CUDA_EMULATION
  return 4 * (threadIdx.x & 31);
#else
  return static_cast<uint32_t>(__cvta_generic_to_shared(lut)) + 4 * (threadIdx.x & 31);
#endif
}

// nf4_levels' p0 / p1 (the pairs of bytes 2 HALF and 2 HALF + 1 of `word`) read from the table
// at `lut`; `lane_at` from nf4_lut_lane_at(lut).
template <int HALF>
__device__ __forceinline__ void nf4_lut_pairs(const uint32_t* lut, uint32_t lane_at, uint32_t word, uint32_t& p0,
                                              uint32_t& p1) {
  // A prmt takes the byte out (the others 0), a shift-and-add makes its entry's address: on
  // sm_90 a shared-window address holds the CTA's rank in its cluster, a register, so an offset
  // or'd into a constant address would need an add of its own per load.
  const uint32_t at0 = (prmt(word, 0u, HALF ? 0x4442u : 0x4440u) << 7) + lane_at;
  const uint32_t at1 = (prmt(word, 0u, HALF ? 0x4443u : 0x4441u) << 7) + lane_at;
#ifdef OK_CUDA_EMULATION
  p0 = *reinterpret_cast<const uint32_t*>(reinterpret_cast<const char*>(lut) + at0);
  p1 = *reinterpret_cast<const uint32_t*>(reinterpret_cast<const char*>(lut) + at1);
#else
  (void)lut;
  asm("ld.shared.b32 %0, [%1];" : "=r"(p0) : "r"(at0));
  asm("ld.shared.b32 %0, [%1];" : "=r"(p1) : "r"(at1));
#endif
}

// ---- 1-16 rows of x, W as the A operand: a tensor-core GEMV --------------------------------
//
// The kernels of int4_gemv.cu turn every code into a float (GEMV: a LOP3, a FADD and an FFMA
// per code) or into a scaled 16-bit weight (int4_mma_kernel: W as the B operand, a packed
// subtraction and a packed multiply per pair), and issue-bound at M = 1 they stream the weight
// at about half the copy bandwidth. Here W is mma.m16n8k16's A operand (16 rows of W per tile)
// and x the B operand (n8: up to 8 rows of x per n8 tile; NB tiles: one, or two for 9-16 rows,
// where each dequantized A fragment feeds two MMAs), so one MMA takes 256 codes. A
// lane (g, t) holds A pairs of rows g and g + 8 at k = 2t, 2t+1, 2t+8, 2t+9 and B pairs of x's
// row g at the same k; as in int4_mma_kernel the k order inside a 128-code chunk is free, so
// a lane reads one contiguous 16-byte window (32 codes) of each of its two rows and x's 32
// values in the same order. Per 8 codes (one 32-bit word): three shifts and four LOP3s put
// two nibbles each in the halves of a register with the bits of 128 (bf16) or 1024 (fp16), so
// the register reads (base + q_a, base + q_b), and one packed subtraction of base + zero per
// register leaves q - zero exactly (small integers). Where the group size is a multiple of
// 128 a chunk is one group: its 8 MMAs start from zero and the chunk's fp32 sums take the
// scale once (one FFMA per accumulator: no per-code float op, the weight not rounded);
// otherwise (group 32, 64) the scale multiplies each pair before the MMA (W rounded to x's
// dtype once, the contract's weight term). Warp w takes chunks w, w + 8, ...; each trip
// issues UNROLL chunks' code loads (TILES x 2 x 16 bytes per lane each, evict-first) and x's
// windows before any math. The 8 warps' sums meet in shared memory and are added in warp
// order (the same bits on every run). Occupancy decides (the kernel is latency-bound): shapes
// past ~128 registers (one CTA of 8 warps per SM) measured 1.3-1.5x slower and are not built.
// A variant with a cp.async ring per warp was withdrawn: with the evict-first cache hint ptxas
// gave 4 of its 5 shapes an odd uniform register for the copy's 64-bit policy descriptor
// (LDGSTS ... desc[UR1]), an illegal instruction on the H100 (docs/perf.md).

constexpr int kTcWarps = 8;
constexpr int kTcMaxRows = 16;       // rows of x: two n8 tiles (the unsplit kernel without PDL)
constexpr int kTcSplitMaxRows = 8;   // the split and PDL builds: one n8 tile

// acc += one 128-code chunk's products for TILES 16-row tiles of W: `words` the lane's two
// 16-byte code windows per tile (rows g and g + 8), `scale` / `zero` those rows' values in the
// chunk's group (the lane's own group where a chunk spans several), `xw` x's 32-value windows
// (row 8 nb + g of x; zeros past M). SCALED: the chunk is one group (scale after the MMA); a
// template argument, not a run-time flag: as a flag it took a branch around every step's
// dequantization in the SASS, which also kept ptxas from interleaving the steps.
//
// LUT (the NF4 build): NF4 pairs read from the table at `lut` in shared memory (nf4_lut_pairs),
// instead of looked up in registers (nf4_levels).
template <typename T, int TILES, int NB, bool SCALED, bool LUT = false>
__device__ __forceinline__ void tc_chunk(float (&acc)[TILES][NB][4], const uint32_t (&words)[TILES][2][4],
                                         const float (&scale)[TILES][2], const float (&zero)[TILES][2],
                                         const uint32_t (&xw)[NB][16], const uint32_t* lut = nullptr) {
  constexpr bool chunk_scaled = SCALED;
  const uint32_t lane_at = LUT ? nf4_lut_lane_at(lut) : 0u;
  uint32_t b[NB][8][2];  // x's B pairs for the chunk's 8 steps (shared by every tile)
#pragma unroll
  for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
    for (int step = 0; step < 8; ++step) {
      if constexpr (kNf4) {  // the codes' own pairs: step s takes pairs 2 (s % 2), + 1 of word s / 2
        b[nb][step][0] = xw[nb][4 * (step / 2) + 2 * (step % 2)];
        b[nb][step][1] = xw[nb][4 * (step / 2) + 2 * (step % 2) + 1];
      } else {
        const int p = 8 * (step / 2) + 2 * (step % 2);
        b[nb][step][0] = pick2(xw[nb], p, p + 4);
        b[nb][step][1] = pick2(xw[nb], p + 1, p + 5);
      }
    }
  }
#pragma unroll
  for (int tile = 0; tile < TILES; ++tile) {
    uint32_t sub[2], mul[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      sub[h] = pack2<T>(MmaMagic<T>::kBase + zero[tile][h], MmaMagic<T>::kBase + zero[tile][h]);
      mul[h] = pack2<T>(scale[tile][h], scale[tile][h]);
    }
    float part[NB][4];
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
      for (int i = 0; i < 4; ++i) part[nb][i] = 0.f;
    }
#pragma unroll
    for (int step = 0; step < 8; ++step) {
      const int word = step / 2, shift = (step % 2) * 8;
      uint32_t a[4];  // rows g (k 2t, 2t+1), g + 8 (same k), g (2t+8, 2t+9), g + 8
      if constexpr (kNf4) {  // levels of codes 8 word + 4 (step % 2) .. + 3 of rows g and g + 8
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if constexpr (LUT) {
            if (step % 2) {
              nf4_lut_pairs<1>(lut, lane_at, words[tile][h][word], a[h], a[h + 2]);
            } else {
              nf4_lut_pairs<0>(lut, lane_at, words[tile][h][word], a[h], a[h + 2]);
            }
          } else if (step % 2) {
            nf4_levels<T, 1>(words[tile][h][word], a[h], a[h + 2]);
          } else {
            nf4_levels<T, 0>(words[tile][h][word], a[h], a[h + 2]);
          }
        }
        if (!chunk_scaled) {
#pragma unroll
          for (int r = 0; r < 4; ++r) a[r] = mul2<T>(a[r], mul[r % 2]);
        }
      } else {
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const int h = r % 2;
          const uint32_t v = and_or<0x000F000Fu, MmaMagic<T>::kBits>(words[tile][h][word] >> (shift + 4 * (r / 2)));
          a[r] = chunk_scaled ? sub2<T>(v, sub[h]) : sub_mul2<T>(v, sub[h], mul[h]);
        }
      }
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) mma_16816<T>(part[nb], a, b[nb][step]);
    }
    // part: rows g (i = 0, 1) and g + 8 (i = 2, 3) of the tile, x rows 2t, 2t+1 of tile nb.
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        acc[tile][nb][i] =
            chunk_scaled ? fmaf(scale[tile][i / 2], part[nb][i], acc[tile][nb][i]) : acc[tile][nb][i] + part[nb][i];
      }
    }
  }
}

// The 8 warps' sums (acc, per lane) into `partial` (kTcWarps x slots x 32 floats); a warp past
// the 8 (the ring kernel's producer) writes nothing.
template <int TILES, int NB>
__device__ __forceinline__ void tc_stage(float* partial, const float (&acc)[TILES][NB][4]) {
  constexpr int kSlots = TILES * NB * 4;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (warp >= kTcWarps) return;
#pragma unroll
  for (int tile = 0; tile < TILES; ++tile) {
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
      for (int i = 0; i < 4; ++i) partial[(warp * kSlots + (tile * NB + nb) * 4 + i) * 32 + lane] = acc[tile][nb][i];
    }
  }
}

// Output o (x row o / (16 TILES), W row o % (16 TILES) of the CTA's) summed over the warps'
// staged sums in warp order (the same bits on every run).
template <int TILES, int NB>
__device__ __forceinline__ float tc_warp_total(const float* partial, int o) {
  constexpr int kSlots = TILES * NB * 4;
  const int local = o % (16 * TILES), row = o / (16 * TILES);
  const int tile = local / 16, r = local % 16, nb = row / 8, cc = row % 8;
  const int owner = (r % 8) * 4 + cc / 2, slot = (tile * NB + nb) * 4 + 2 * (r >= 8) + cc % 2;
  float total = 0.f;
#pragma unroll
  for (int wi = 0; wi < kTcWarps; ++wi) total += partial[(wi * kSlots + slot) * 32 + owner];
  return total;
}

// out[row, c] = total + bias[c] (bias_code 0: none, 1: float32, 2: bfloat16, 3: float16).
template <typename T>
__device__ __forceinline__ void tc_store(float total, const void* bias, int bias_code, T* out, int64_t row, int64_t c,
                                         int64_t stride_out) {
  if (bias_code == 1) total += static_cast<const float*>(bias)[c];
  if (bias_code == 2) total += to_float(static_cast<const __nv_bfloat16*>(bias)[c]);
  if (bias_code == 3) total += to_float(static_cast<const __half*>(bias)[c]);
  out[row * stride_out + c] = from_float<T>(total);
}

// The 8 warps' sums added in warp order, the bias added, the CTA's 16 TILES columns of out
// written for every row of x. Every thread of the CTA calls it; a warp past the 8 (the ring
// kernel's producer) only meets the barrier.
template <typename T, int TILES, int NB>
__device__ __forceinline__ void tc_finish(float* partial, const float (&acc)[TILES][NB][4], const void* bias,
                                          int bias_code, T* out, int64_t m, int64_t n0, int64_t stride_out) {
  tc_stage<TILES, NB>(partial, acc);
  __syncthreads();
  if ((threadIdx.x >> 5) >= kTcWarps) return;
  for (int o = threadIdx.x; o < 16 * TILES * m; o += kTcWarps * 32) {
    tc_store<T>(tc_warp_total<TILES, NB>(partial, o), bias, bias_code, out, o / (16 * TILES), n0 + o % (16 * TILES),
                stride_out);
  }
}

template <typename T, int TILES, int NB>
__device__ __forceinline__ void tc_zero(float (&acc)[TILES][NB][4]) {
#pragma unroll
  for (int tile = 0; tile < TILES; ++tile) {
#pragma unroll
    for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[tile][nb][i] = 0.f;
    }
  }
}

// The gated builds (GATED, config's `act` > 0): x is a gated MLP's stacked gate / up output (M,
// 2K), gate in columns [0, K) and up in [K, 2K), and the GEMV's x is act(gate) * up, computed
// where x's windows are loaded (the activation's own launch and its pass over memory gone):
// in float32 and rounded once to x's dtype, as activations' *_and_mul kernels round it.
// act: 1 silu, 2 gelu (erf), 3 gelu (tanh approximation); cuda/__init__.py's _ACTS.
__device__ __forceinline__ float ok_exp(float v) {
#ifdef OK_CUDA_EMULATION
  return std::exp(v);
#else
  return __expf(v);
#endif
}

__device__ __forceinline__ float gated_value(float gate, float up, int act) {
  float a;
  if (act == 1) {
    a = gate / (1.f + ok_exp(-gate));
  } else if (act == 2) {
    a = 0.5f * gate * (1.f + erff(gate * 0.70710678118654752f));
  } else {  // 0.5 (1 + tanh(u)) == sigmoid(2 u)
    const float u = 0.7978845608028654f * (gate + 0.044715f * gate * gate * gate);
    a = gate / (1.f + ok_exp(-2.f * u));
  }
  return a * up;
}

// Eight values of act(gate) * up from 16-byte windows of gate and up (eight values of T each).
template <typename T>
__device__ __forceinline__ uint4 gated_window(uint4 gate, uint4 up, int act) {
  const uint32_t g[4] = {gate.x, gate.y, gate.z, gate.w}, u[4] = {up.x, up.y, up.z, up.w};
  uint32_t r[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    r[i] = pack2<T>(gated_value(half_of<T>(g[i], 0), half_of<T>(u[i], 0), act),
                    gated_value(half_of<T>(g[i], 1), half_of<T>(u[i], 1), act));
  }
  return {r[0], r[1], r[2], r[3]};
}

// The normed builds (prologue 4): x is a pre-norm decoder's hidden state and the GEMV's x is its
// RMSNorm, x * rstd * (weight + offset), rstd = 1 / sqrt(mean(x^2) + eps) per row; in float32,
// rounded once to x's dtype.
template <typename T>
__device__ __forceinline__ uint4 normed_window(uint4 x, uint4 weight, float rstd, float offset) {
  const uint32_t v[4] = {x.x, x.y, x.z, x.w}, w[4] = {weight.x, weight.y, weight.z, weight.w};
  uint32_t r[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    r[i] = pack2<T>(half_of<T>(v[i], 0) * rstd * (half_of<T>(w[i], 0) + offset),
                    half_of<T>(v[i], 1) * rstd * (half_of<T>(w[i], 1) + offset));
  }
  return {r[0], r[1], r[2], r[3]};
}

// The prologue builds (PRO 1 gated, 2 normed) compute the CTA's x into shared memory `xs` before
// the main loop, which then reads its windows from there: done where the windows are loaded,
// the math sat between each trip's loads and the next's (in-order issue), and the gated GEMV
// ran at half speed (H100, docs/perf.md). Every 16-byte window of the CTA's x once, all of a
// thread's loads issued before its math (kPrologueWindows per thread and round). The CTA's
// codes are prefetched into L2 first (tc_prefetch_codes), so that their DRAM latency passes
// under the prologue.
constexpr int kPrologueWindows = 4;
constexpr size_t kPrologueMaxBytes = 64 * 1024;  // x in shared memory: two CTAs per SM still fit

// L2 prefetches of the CTA's codes: rows [n0, n0 + 16 TILES) of chunks [c0, c1), stored rows or
// tiled (format.py's tile_codes: each tile's chunks contiguous).
__device__ __forceinline__ void tc_prefetch_codes(const uint8_t* qweight, bool tiled, int64_t n0, int tiles,
                                                  int64_t c0, int64_t c1, int64_t stride_q) {
  const int64_t line = 128;
  if (tiled) {
    const int64_t per_tile = (c1 - c0) * 1024 / line;
    for (int64_t l = threadIdx.x; l < tiles * per_tile; l += kTcWarps * 32)
      ok_prefetch_l2(qweight + (n0 / 16 + l / per_tile) * stride_q + c0 * 1024 + (l % per_tile) * line);
    return;
  }
  const int64_t per_row = ((c1 - c0) * 64 + line - 1) / line;
  for (int64_t l = threadIdx.x; l < 16 * tiles * per_row; l += kTcWarps * 32)
    ok_prefetch_l2(qweight + (n0 + l / per_row) * stride_q + c0 * 64 + (l % per_row) * line);
}

// xs[r, j] = act(gate[r, lo + j]) * up[r, lo + j] for rows r < rows, j < span (x: gate, up
// `up_offset` values after it).
template <typename T>
__device__ __forceinline__ void gated_prologue(const T* __restrict__ x, int64_t rows, int64_t stride_x,
                                               int64_t up_offset, int64_t lo, int64_t span, int act, T* xs) {
  const int64_t per_row = span / 8, total = rows * per_row;
  for (int64_t base = threadIdx.x; base < total; base += kTcWarps * 32 * kPrologueWindows) {
    uint4 gate[kPrologueWindows], up[kPrologueWindows];
#pragma unroll
    for (int s = 0; s < kPrologueWindows; ++s) {
      const int64_t i = base + s * kTcWarps * 32;
      if (i < total) {
        const T* at = x + (i / per_row) * stride_x + lo + 8 * (i % per_row);
        gate[s] = *reinterpret_cast<const uint4*>(at);
        up[s] = *reinterpret_cast<const uint4*>(at + up_offset);
      }
    }
#pragma unroll
    for (int s = 0; s < kPrologueWindows; ++s) {
      const int64_t i = base + s * kTcWarps * 32;
      if (i < total) *reinterpret_cast<uint4*>(xs + 8 * i) = gated_window<T>(gate[s], up[s], act);
    }
  }
}

// xs[r, :] = RMSNorm(x[r, :]) for rows r < rows (k <= kTcWarps * 32 * 8 * kPrologueWindows: one
// round of loads per row); the row's sum of squares in warp order (the same bits in every CTA).
template <typename T>
__device__ __forceinline__ void normed_prologue(const T* __restrict__ x, int64_t rows, int64_t stride_x, int64_t k,
                                                const T* __restrict__ norm_w, float eps, float offset,
                                                float (&scratch)[8][kTcWarps], T* xs) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int64_t r = 0; r < rows; ++r) {
    uint4 v[kPrologueWindows], w[kPrologueWindows];
    float sum = 0.f;
#pragma unroll
    for (int s = 0; s < kPrologueWindows; ++s) {
      const int64_t j = 8 * (threadIdx.x + s * kTcWarps * 32);
      if (j < k) {
        v[s] = *reinterpret_cast<const uint4*>(x + r * stride_x + j);
        w[s] = *reinterpret_cast<const uint4*>(norm_w + j);
      }
    }
#pragma unroll
    for (int s = 0; s < kPrologueWindows; ++s) {
      if (8 * (threadIdx.x + s * kTcWarps * 32) < k) {
        const uint32_t h[4] = {v[s].x, v[s].y, v[s].z, v[s].w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const float a = half_of<T>(h[i], 0), b = half_of<T>(h[i], 1);
          sum = fmaf(a, a, fmaf(b, b, sum));
        }
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (lane == 0) scratch[r][warp] = sum;
    __syncthreads();
    float total = 0.f;
#pragma unroll
    for (int i = 0; i < kTcWarps; ++i) total += scratch[r][i];
    const float rstd = rsqrtf(total / static_cast<float>(k) + eps);
#pragma unroll
    for (int s = 0; s < kPrologueWindows; ++s) {
      const int64_t j = 8 * (threadIdx.x + s * kTcWarps * 32);
      if (j < k) *reinterpret_cast<uint4*>(xs + r * k + j) = normed_window<T>(v[s], w[s], rstd, offset);
    }
  }
}

// Registers: each warp trip issues UNROLL chunks' loads (codes evict-first, scales, zeros,
// x) before their math. Warp w takes chunks c0 + w, c0 + w + 8, ... below c1.
//
// `tiled` (format.py's tiled layout): the codes of a (16-row tile, chunk) pair are 1024 contiguous
// bytes, in lane order (half h of lane l at h * 512 + 16 l), and stride_q is a tile's bytes; so a
// warp's 16-byte loads read 512 contiguous bytes where the stored rows give 64 bytes of 8 rows
// (a study measured the rows' pattern alone at 0.73-0.74 of a streaming read of the same bytes
// on an H100, the tiled one at 0.91-0.93: docs/perf.md). A warp-uniform switch: the same build
// reads both layouts.
//
// EVICT_FIRST: the codes' loads carry the evict-first hint (each byte is read once); the
// x-split build (two CTAs read the same codes, XT in int4_tc_kernel) loads them L2-cached
// instead, so that the second CTA's read can hit what the first one brought in.
template <typename T, typename S, int TILES, int NB, int UNROLL, bool EVICT_FIRST = true, bool LUT = false>
__device__ __forceinline__ void tc_accumulate(float (&acc)[TILES][NB][4], const T* __restrict__ x,
                                              const uint8_t* __restrict__ qweight, const S* __restrict__ scales,
                                              const S* __restrict__ zeros, int64_t m, int64_t n0, int64_t c0,
                                              int64_t c1, int64_t stride_x, int64_t stride_q, int64_t stride_s,
                                              int64_t group_size, bool tiled, const uint32_t* lut = nullptr) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const bool chunk_scaled = group_size % 128 == 0;
  // The lane's code bytes of (tile, h, chunk): base + tile * tile_step + h * half_step + chunk * chunk_step.
  const uint8_t* base = tiled ? qweight + (n0 / 16) * stride_q + 16 * lane : qweight + (n0 + g) * stride_q + 16 * t;
  const int64_t tile_step = tiled ? stride_q : 16 * stride_q, half_step = tiled ? 512 : 8 * stride_q;
  const int64_t chunk_step = tiled ? 1024 : 64;
  for (int64_t first = c0 + warp; first < c1; first += kTcWarps * UNROLL) {  // the same trips in every lane
    uint32_t words[UNROLL][TILES][2][4];
    float scale[UNROLL][TILES][2], zero[UNROLL][TILES][2];
    uint32_t xw[UNROLL][NB][16];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int64_t chunk = first + static_cast<int64_t>(u) * kTcWarps;
      if (chunk >= c1) continue;  // warp-uniform
      const int64_t k0 = chunk * 128 + 32 * t;  // this lane's 32-code window
      const int64_t group = k0 / group_size;
#pragma unroll
      for (int tile = 0; tile < TILES; ++tile) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int64_t row = n0 + 16 * tile + g + 8 * h;
          const uint4* at = reinterpret_cast<const uint4*>(base + tile * tile_step + h * half_step + chunk * chunk_step);
          const uint4 v = EVICT_FIRST ? __ldcs(at) : __ldcg(at);
          words[u][tile][h][0] = v.x;
          words[u][tile][h][1] = v.y;
          words[u][tile][h][2] = v.z;
          words[u][tile][h][3] = v.w;
          scale[u][tile][h] = to_float(scales[group * stride_s + row]);
          zero[u][tile][h] = zeros != nullptr ? to_float(zeros[group * stride_s + row]) : 8.f;
        }
      }
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) {
        const int64_t row = 8 * nb + g;
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          uint4 v = {0, 0, 0, 0};
          if (row < m) v = *reinterpret_cast<const uint4*>(x + row * stride_x + k0 + 8 * q);
          xw[u][nb][4 * q] = v.x;
          xw[u][nb][4 * q + 1] = v.y;
          xw[u][nb][4 * q + 2] = v.z;
          xw[u][nb][4 * q + 3] = v.w;
        }
      }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      if (first + static_cast<int64_t>(u) * kTcWarps >= c1) continue;
      if (chunk_scaled) {
        tc_chunk<T, TILES, NB, true, LUT>(acc, words[u], scale[u], zero[u], xw[u], lut);
      } else {
        tc_chunk<T, TILES, NB, false, LUT>(acc, words[u], scale[u], zero[u], xw[u], lut);
      }
    }
  }
}

// Launched as a programmatic dependent (`pdl`, config suffix "-p"; sm_90): while the kernel before
// it finishes, the CTA's codes for chunks [c0, c1) and their scales and zeros (constants: no kernel
// writes them) are fetched into L2, one 128-byte line per thread and step; then it waits for that
// kernel (x is its output, and `out` may be memory it still reads) and lets the next dependent
// start. The loads that follow hit L2 instead of waiting on DRAM after the launch.
template <bool PDL, typename S>
__device__ __forceinline__ void tc_prologue(const uint8_t* qweight, const S* scales, const S* zeros,
                                            int64_t n0, int rows, int64_t c0, int64_t c1, int64_t stride_q,
                                            int64_t stride_s, int64_t group_size, int threads) {
  if constexpr (!PDL) return;
  const int64_t line_bytes = 128, row_lines = ((c1 - c0) * 64 + line_bytes - 1) / line_bytes;
  for (int64_t l = threadIdx.x; l < rows * row_lines; l += threads) {
    const int64_t row = n0 + l / row_lines;
    ok_prefetch_l2(qweight + row * stride_q + c0 * 64 + (l % row_lines) * line_bytes);
  }
  const int64_t g0 = c0 * 128 / group_size, g1 = (c1 * 128 + group_size - 1) / group_size;
  for (int64_t g = g0 + threadIdx.x; g < g1; g += threads) {  // the CTA's rows of a group: <= 128 bytes
    ok_prefetch_l2(scales + g * stride_s + n0);
    if (zeros != nullptr) ok_prefetch_l2(zeros + g * stride_s + n0);
  }
  ok_grid_dependency_wait();
  ok_launch_dependents();
}

// CTAs of 8 warps per SM that ptxas must fit (registers <= 128 for 2): the kernel is latency-bound
// and occupancy decides; with the dequantization's steps interleaved (and_or, SCALED as a template
// argument) ptxas left to itself took 127-147 registers for one n8 tile and 156-211 for two.
// Two tiles of x stay unbounded (held to 128, t1-u2 spilled 244 bytes), and so do the split
// kernel's dependent-launch builds (forced only; t2-u2 spilled 8 bytes).
template <int TILES, int NB>
constexpr int kTcMinBlocks = NB == 1 ? 2 : 1;

// XT = 2 (config suffix "-x2", 9-16 rows of x): the x split. Two neighbouring CTAs take the same
// 16 TILES rows of W, each for its own 8 rows of x (one n8 tile), instead of one CTA taking both
// n8 tiles: twice the CTAs, each with one n8 tile's registers (two CTAs per SM), and the weight
// read twice from L2 but about once from DRAM (the pair runs at the same time).
//
// PRO (a prologue build, `act` > 0: gated_prologue for 1-3, normed_prologue for 4) computes x into
// dynamic shared memory first (rows x K values of T) and reads its windows from there: `act` the
// activation, `norm_w` / `norm_eps` / `norm_offset` the norm's weight, epsilon and offset.
template <typename T, typename S, int TILES, int NB, int UNROLL, bool PDL, int XT = 1, int PRO = 0>
__global__ void __launch_bounds__(kTcWarps * 32, kTcMinBlocks<TILES, NB>) int4_tc_kernel(
    const T* __restrict__ x, const uint8_t* __restrict__ qweight, const S* __restrict__ scales,
    const S* __restrict__ zeros, const void* __restrict__ bias, int bias_code, T* __restrict__ out, int64_t m,
    int64_t n, int64_t k, int64_t stride_x, int64_t stride_q, int64_t stride_s, int64_t stride_out,
    int64_t group_size, int tiled, int act, const T* __restrict__ norm_w, float norm_eps, float norm_offset) {
  static_assert(PRO == 0 || (NB == 1 && XT == 1 && !PDL), "a prologue build: one n8 tile of x, no PDL");
  static_assert(XT == 1 || NB == 1, "the x split runs one n8 tile of x per CTA");
  // The warps' sums at the end; in the NF4 build with the table (kTcNf4Lut) they overwrite the
  // table once every warp is past its last lookup (the two side by side would pass the 48 KB of
  // static shared memory: the sums take up to 32 KB).
  constexpr int kPartialWords = kTcWarps * TILES * NB * 4 * 32;
  static_assert(!kTcNf4Lut || kPartialWords <= kNf4LutWords, "the warps' sums fit in the NF4 table's place");
  __shared__ float own_partial[kTcNf4Lut ? 1 : kPartialWords];
  float* partial = kTcNf4Lut ? reinterpret_cast<float*>(nf4_lut) : own_partial;
  if constexpr (kTcNf4Lut) {
    nf4_lut_fill<T>(nf4_lut, threadIdx.x, kTcWarps * 32);
    __syncthreads();
  }
  const int64_t n0 = static_cast<int64_t>(blockIdx.x / XT) * 16 * TILES;
  const int64_t first_row = XT == 1 ? 0 : 8 * static_cast<int64_t>(blockIdx.x % XT);
  const int64_t rows = XT == 1 ? m : (m - first_row < 8 ? m - first_row : 8);
  tc_prologue<PDL, S>(qweight, scales, zeros, n0, 16 * TILES, 0, k / 128, stride_q, stride_s, group_size,
                      kTcWarps * 32);
  const T* xin = x + first_row * stride_x;
  int64_t stride_in = stride_x;
  if constexpr (PRO != 0) {
    OK_DYNAMIC_SHARED(dynamic);
    T* xs = reinterpret_cast<T*>(dynamic);
    tc_prefetch_codes(qweight, tiled != 0, n0, TILES, 0, k / 128, stride_q);
    if constexpr (PRO == 1) {
      gated_prologue<T>(x, rows, stride_x, k, 0, k, act, xs);
    } else {
      __shared__ float norm_scratch[8][kTcWarps];
      normed_prologue<T>(x, rows, stride_x, k, norm_w, norm_eps, norm_offset, norm_scratch, xs);
    }
    __syncthreads();
    xin = xs;
    stride_in = k;
  }
  float acc[TILES][NB][4];
  tc_zero<T, TILES, NB>(acc);
  tc_accumulate<T, S, TILES, NB, UNROLL, XT == 1, kTcNf4Lut>(acc, xin, qweight, scales, zeros, rows, n0, 0, k / 128,
                                                             stride_in, stride_q, stride_s, group_size, tiled != 0,
                                                             nf4_lut);
  if constexpr (kTcNf4Lut) __syncthreads();  // every lookup done before the sums overwrite the table
  tc_finish<T, TILES, NB>(partial, acc, bias, bias_code, out + first_row * stride_out, rows, n0, stride_out);
}

// ---- split K over a thread-block cluster (config "tc-...-k<splits>", sm_90) ----------------
//
// At N = 2048 a 16-row tile per CTA gives 128 CTAs, one per SM: at K = 8192 (the 1B model's
// down projection) each warp runs 4 trips of 2 chunks one after another, and the memory idles
// between them (10.3 us for 8.4 MB on an H100, a third of the bandwidth). Here the `splits`
// CTAs of a cluster (consecutive blocks) each take a contiguous 1 / splits of K's chunks, so
// that splits times the loads are in flight at once; each CTA adds its 8 warps' sums in warp
// order (as tc_finish) and pushes its 16 TILES x m totals into rank 0's shared memory
// (st.async, counted on rank 0's mbarrier: cluster_exchange.h); rank 0 adds the ranks' totals
// in rank order, the bias, and writes out (the same bits on every run). No global workspace,
// no atomics, nothing to zero between launches.
constexpr int kTcMaxSplits = 8;  // the portable cluster size

template <typename T, typename S, int TILES, int UNROLL, bool PDL, bool GATED = false>  // GATED: gated_prologue
__global__ void __launch_bounds__(kTcWarps * 32, PDL ? 1 : 2) int4_tc_split_kernel(
    const T* __restrict__ x, const uint8_t* __restrict__ qweight, const S* __restrict__ scales,
    const S* __restrict__ zeros, const void* __restrict__ bias, int bias_code, T* __restrict__ out, int64_t m,
    int64_t n, int64_t k, int64_t stride_x, int64_t stride_q, int64_t stride_s, int64_t stride_out,
    int64_t group_size, int splits, int tiled, int act) {
#if defined(OK_CUDA_EMULATION) || (defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900)  // clusters: sm_90
  constexpr int kOuts = 16 * TILES * kTcSplitMaxRows;  // a CTA's totals at most (16 TILES x 8 rows)
  constexpr int kPartialWords = kTcWarps * TILES * 4 * 32;
  // The NF4 table's build: the table in dynamic shared memory (32 KB; with `slots` past the
  // 48 KB of static shared memory), the warps' sums and the CTA's totals in its place once
  // every warp is past its last lookup.
  static_assert(!kTcNf4Lut || 4 * (kPartialWords + kOuts) <= kNf4LutBytes, "the sums fit in the table's place");
  OK_DYNAMIC_SHARED(dynamic);
  uint32_t* lut = reinterpret_cast<uint32_t*>(dynamic);
  __shared__ float4 own_sums4[kTcNf4Lut ? 1 : (kPartialWords + kOuts) / 4];
  float* partial = kTcNf4Lut ? reinterpret_cast<float*>(dynamic) : reinterpret_cast<float*>(own_sums4);
  float4* totals4 = reinterpret_cast<float4*>(partial + kPartialWords);  // this CTA's, by (x row, W row)
  __shared__ float4 slots[kTcMaxSplits * kOuts / 4];  // rank 0: every rank's totals
  float* totals = reinterpret_cast<float*>(totals4);
  __shared__ OkBarrier full;
  const int rank = static_cast<int>(blockIdx.x % splits);
  const int64_t n0 = static_cast<int64_t>(blockIdx.x / splits) * 16 * TILES;
  if (threadIdx.x == 0) ok_barrier_init(&full, 1);
  ok_fence_barrier_init();
  ok_cluster_arrive_relaxed();
  const int64_t n_chunks = k / 128, per = (n_chunks + splits - 1) / splits;
  const int64_t c0 = per * rank < n_chunks ? per * rank : n_chunks;
  const int64_t c1 = c0 + per < n_chunks ? c0 + per : n_chunks;
  tc_prologue<PDL, S>(qweight, scales, zeros, n0, 16 * TILES, c0, c1, stride_q, stride_s, group_size, kTcWarps * 32);
  if constexpr (kTcNf4Lut) {
    nf4_lut_fill<T>(lut, threadIdx.x, kTcWarps * 32);
    __syncthreads();
  }
  float acc[TILES][1][4];
  tc_zero<T, TILES, 1>(acc);
  const T* xin = x;
  int64_t stride_in = stride_x;
  if constexpr (GATED) {  // this rank's chunks of act(gate) * up into shared memory, after the table's place
    T* xs = reinterpret_cast<T*>(dynamic + (kTcNf4Lut ? kNf4LutBytes : 0));
    tc_prefetch_codes(qweight, tiled != 0, n0, TILES, c0, c1, stride_q);
    gated_prologue<T>(x, m, stride_x, k, c0 * 128, (c1 - c0) * 128, act, xs);
    __syncthreads();
    xin = xs - c0 * 128;  // indexed by absolute k below
    stride_in = (c1 - c0) * 128;
  }
  tc_accumulate<T, S, TILES, 1, UNROLL, true, kTcNf4Lut>(acc, xin, qweight, scales, zeros, m, n0, c0, c1, stride_in,
                                                         stride_q, stride_s, group_size, tiled != 0, lut);
  if constexpr (kTcNf4Lut) __syncthreads();  // every lookup done before the sums overwrite the table
  tc_stage<TILES, 1>(partial, acc);
  __syncthreads();
  const int outs = static_cast<int>(16 * TILES * m);  // a multiple of 16
  for (int o = threadIdx.x; o < outs; o += kTcWarps * 32) totals[o] = tc_warp_total<TILES, 1>(partial, o);
  __syncthreads();
  ok_cluster_wait();  // rank 0's barrier is initialised
  if (rank == 0 && threadIdx.x == 0) ok_barrier_arrive_expect_tx(&full, static_cast<uint32_t>(splits * outs * 4));
  for (int v = threadIdx.x; v < outs / 4; v += kTcWarps * 32) {
    ok_store_remote(totals4[v], &slots[rank * (kOuts / 4) + v], &full, 0);
  }
  if (rank != 0) return;  // rank 0 waits for every push before it exits
  ok_barrier_wait(&full, 0);
  const float* received = reinterpret_cast<const float*>(slots);
  for (int o = threadIdx.x; o < outs; o += kTcWarps * 32) {
    float total = 0.f;
    for (int r = 0; r < splits; ++r) total += received[r * kOuts + o];
    tc_store<T>(total, bias, bias_code, out, o / (16 * TILES), n0 + o % (16 * TILES), stride_out);
  }
#endif  // (an sm_80 build holds an empty kernel: the launcher sends no call there)
}

// ---- the same GEMV fed by a ring of bulk copies (a study's variant, config "tcr-...") ------
//
// int4_tc_kernel issues each warp trip's loads into registers and waits for them before its
// math: the warps of an SM load in bursts, and at M = 1 the H200 streams the weight at
// 0.44-0.53 of copy (docs/perf.md). Here a ninth warp (the producer) keeps STAGES stages of
// the CTA's data in flight in shared memory with bulk copies (cp.async.bulk, counted on a
// `full` mbarrier per stage): per stage 8 chunks (1024 codes) of each of the CTA's 16 TILES
// rows of W, their scales and zeros (group size a multiple of 128: one group per chunk), and
// x's 1024 values per row. The 8 consumer warps each take one chunk of a stage, copy their
// operands out of shared memory into registers, free the stage (an arrival on its `empty`
// barrier, which the producer waits on before it refills it) and run int4_tc_kernel's math
// (tc_chunk), so that loads never wait on math. The codes are format.py's tiled layout (quant
// 0.10.7; the stored rows took one bulk copy of 512 bytes per row and stage, 16-64 per stage
// from one warp, and ran slower than the register kernel on an H100): a tile's 8 chunks of a
// stage are 8 KB in one piece, one bulk copy, and a lane's 16-byte reads of them are
// consecutive in shared memory (no bank conflict).
constexpr int kRingChunks = kTcWarps;                 // chunks per stage: one per consumer warp
constexpr int kRingTileBytes = kRingChunks * 1024;    // a 16-row tile's codes of one stage

// Bytes of one stage in shared memory: codes, the scales' and zeros' group rows, x's rows.
template <typename T, typename S, int TILES>
__host__ __device__ constexpr size_t ring_stage_bytes(int64_t m) {
  return static_cast<size_t>(TILES) * kRingTileBytes + 2 * kRingChunks * 16 * TILES * sizeof(S) +
         static_cast<size_t>(m) * kRingChunks * 128 * sizeof(T);
}

template <typename T, typename S, int TILES, int STAGES>
__global__ void __launch_bounds__((kTcWarps + 1) * 32) int4_tc_ring_kernel(
    const T* __restrict__ x, const uint8_t* __restrict__ qweight, const S* __restrict__ scales,
    const S* __restrict__ zeros, const void* __restrict__ bias, int bias_code, T* __restrict__ out, int64_t m,
    int64_t n, int64_t k, int64_t stride_x, int64_t stride_q, int64_t stride_s, int64_t stride_out,
    int64_t group_size) {
#if defined(OK_CUDA_EMULATION) || (defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900)  // bulk copies: sm_90
  constexpr int ROWS = 16 * TILES;
  constexpr size_t kGroupBytes = ROWS * sizeof(S);  // one group's scales (or zeros) of the CTA's rows
  constexpr size_t kCodeBytes = static_cast<size_t>(TILES) * kRingTileBytes;
  constexpr size_t kXRowBytes = kRingChunks * 128 * sizeof(T);
  __shared__ float partial[kTcWarps * TILES * 4 * 32];
  __shared__ OkBarrier full[STAGES], empty[STAGES];
  OK_DYNAMIC_SHARED(ring);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int64_t n0 = static_cast<int64_t>(blockIdx.x) * ROWS;
  const int64_t n_chunks = k / 128, n_stages = (n_chunks + kRingChunks - 1) / kRingChunks;
  const size_t stage_bytes = ring_stage_bytes<T, S, TILES>(m);
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      ok_barrier_init(&full[s], 1);
      ok_barrier_init(&empty[s], kTcWarps);
    }
  }
  ok_fence_barrier_init();
  __syncthreads();  // every barrier is initialised before anyone waits on it
  float acc[TILES][1][4];
  tc_zero<T, TILES, 1>(acc);
  if (warp == kTcWarps) {  // the producer: each lane issues its share of a stage's copies
    for (int64_t j = 0; j < n_stages; ++j) {
      const int s = static_cast<int>(j % STAGES);
      if (j >= STAGES) ok_barrier_wait(&empty[s], static_cast<uint32_t>((j / STAGES - 1) & 1));
      const int64_t c0 = j * kRingChunks;
      const int chunks = static_cast<int>(n_chunks - c0 < kRingChunks ? n_chunks - c0 : kRingChunks);
      const int64_t g0 = c0 * 128 / group_size;
      const int groups = static_cast<int>((c0 + chunks) * 128 / group_size - g0 + ((c0 + chunks) * 128 % group_size != 0));
      const uint32_t tile_bytes = static_cast<uint32_t>(chunks) * 1024, x_bytes = static_cast<uint32_t>(chunks) * 128 * sizeof(T);
      const uint32_t bytes = TILES * tile_bytes + static_cast<uint32_t>(groups * kGroupBytes) * (zeros != nullptr ? 2 : 1) +
                             static_cast<uint32_t>(m) * x_bytes;
      unsigned char* stage = ring + s * stage_bytes;
      if (lane == 0) ok_barrier_arrive_expect_tx(&full[s], bytes);
      for (int tl = lane; tl < TILES; tl += 32)  // stride_q: a tile's bytes (tiled codes)
        ok_bulk_copy(stage + tl * kRingTileBytes, qweight + (n0 / 16 + tl) * stride_q + c0 * 1024, tile_bytes, &full[s]);
      unsigned char* scale_rows = stage + kCodeBytes;
      for (int gi = lane; gi < groups; gi += 32) {
        ok_bulk_copy(scale_rows + gi * kGroupBytes, scales + (g0 + gi) * stride_s + n0, kGroupBytes, &full[s]);
        if (zeros != nullptr)
          ok_bulk_copy(scale_rows + (kRingChunks + gi) * kGroupBytes, zeros + (g0 + gi) * stride_s + n0, kGroupBytes,
                       &full[s]);
      }
      unsigned char* x_rows = scale_rows + 2 * kRingChunks * kGroupBytes;
      for (int r = lane; r < m; r += 32)
        ok_bulk_copy(x_rows + r * kXRowBytes, x + r * stride_x + c0 * 128, x_bytes, &full[s]);
    }
  } else {  // a consumer: chunk `warp` of every stage
    constexpr bool chunk_scaled = true;  // the launcher takes group sizes that are multiples of 128 only
    for (int64_t j = 0; j < n_stages; ++j) {
      const int s = static_cast<int>(j % STAGES);
      const int64_t chunk = j * kRingChunks + warp;
      ok_barrier_wait(&full[s], static_cast<uint32_t>((j / STAGES) & 1));
      const unsigned char* stage = ring + s * stage_bytes;
      uint32_t words[TILES][2][4];
      float scale[TILES][2], zero[TILES][2];
      uint32_t xw[1][16];
      const bool mine = chunk < n_chunks;  // warp-uniform
      if (mine) {
        const int gi = static_cast<int>(chunk * 128 / group_size - (j * kRingChunks * 128) / group_size);
        const S* scale_row = reinterpret_cast<const S*>(stage + kCodeBytes + gi * kGroupBytes);
        const S* zero_row = reinterpret_cast<const S*>(stage + kCodeBytes + (kRingChunks + gi) * kGroupBytes);
#pragma unroll
        for (int tile = 0; tile < TILES; ++tile) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int r = 16 * tile + g + 8 * h;
            const uint4 v = *reinterpret_cast<const uint4*>(stage + tile * kRingTileBytes + warp * 1024 + h * 512 + 16 * lane);
            words[tile][h][0] = v.x;
            words[tile][h][1] = v.y;
            words[tile][h][2] = v.z;
            words[tile][h][3] = v.w;
            scale[tile][h] = to_float(scale_row[r]);
            zero[tile][h] = zeros != nullptr ? to_float(zero_row[r]) : 8.f;
          }
        }
        const unsigned char* x_row = stage + kCodeBytes + 2 * kRingChunks * kGroupBytes + g * kXRowBytes;
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          uint4 v = {0, 0, 0, 0};
          if (g < m) v = *reinterpret_cast<const uint4*>(x_row + (warp * 128 + 32 * t + 8 * q) * sizeof(T));
          xw[0][4 * q] = v.x;
          xw[0][4 * q + 1] = v.y;
          xw[0][4 * q + 2] = v.z;
          xw[0][4 * q + 3] = v.w;
        }
      }
      __syncwarp();  // every lane has its operands: the stage is free
      if (lane == 0) ok_barrier_arrive(&empty[s]);
      if (mine) tc_chunk<T, TILES, 1, chunk_scaled>(acc, words, scale, zero, xw);
    }
  }
  tc_finish<T, TILES, 1>(partial, acc, bias, bias_code, out, m, n0, stride_out);
#endif  // (an sm_80 build holds an empty kernel: the launcher sends no call there)
}

// (tiles, stages) pairs built: TCR_SHAPES in cuda/__init__.py.
template <typename T, typename S>
int launch_tc_ring(int tiles, int stages, const void* x, const void* qweight, const void* scales, const void* zeros,
                   const void* bias, int bias_code, void* out, int64_t m, int64_t n, int64_t k, int64_t stride_x,
                   int64_t stride_q, int64_t stride_s, int64_t stride_out, int64_t group_size, cudaStream_t stream) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(n / (16 * tiles)), 1, 1);
  config.blockDim = dim3((kTcWarps + 1) * 32, 1, 1);
  config.stream = stream;
  config.numAttrs = 0;
  auto run = [&](auto kernel, size_t stage_bytes) {
    config.dynamicSmemBytes = stages * stage_bytes;
    if (config.dynamicSmemBytes > 200 * 1024) return -3;  // the launcher's check missed it
    // Static plus dynamic shared memory past 48 KB needs the kernel's opt-in (the static part,
    // `partial` and the barriers, is 4-16 KB: 47 KB of stages alone already passes it).
    cudaError_t err = ok_opt_in_dynamic_shared(kernel, static_cast<int>(config.dynamicSmemBytes));
    if (err != cudaSuccess) return static_cast<int>(err);
    return static_cast<int>(cudaLaunchKernelEx(
        &config, kernel, static_cast<const T*>(x), static_cast<const uint8_t*>(qweight),
        static_cast<const S*>(scales), static_cast<const S*>(zeros), bias, bias_code, static_cast<T*>(out), m, n, k,
        stride_x, stride_q, stride_s, stride_out, group_size));
  };
  if (tiles == 1 && stages == 4) return run(int4_tc_ring_kernel<T, S, 1, 4>, ring_stage_bytes<T, S, 1>(m));
  if (tiles == 1 && stages == 8) return run(int4_tc_ring_kernel<T, S, 1, 8>, ring_stage_bytes<T, S, 1>(m));
  if (tiles == 2 && stages == 4) return run(int4_tc_ring_kernel<T, S, 2, 4>, ring_stage_bytes<T, S, 2>(m));
  if (tiles == 4 && stages == 2) return run(int4_tc_ring_kernel<T, S, 4, 2>, ring_stage_bytes<T, S, 4>(m));
  return -2;
}

// (tiles, unroll) pairs built: TC_SHAPES in cuda/__init__.py; up to 8 rows of x (one n8 tile), or
// 9-16 (two; no PDL build). `act` > 0: the gated builds (one n8 tile, neither PDL nor x split).
template <typename T, typename S>
int launch_tc(int tiles, int unroll, const void* x, const void* qweight, const void* scales, const void* zeros,
              const void* bias, int bias_code, void* out, int64_t m, int64_t n, int64_t k, int64_t stride_x,
              int64_t stride_q, int64_t stride_s, int64_t stride_out, int64_t group_size, int pdl, int tiled,
              int xtiles, int act, const void* norm_w, float norm_eps, float norm_offset, cudaStream_t stream) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(n / (16 * tiles) * xtiles), 1, 1);
  config.blockDim = dim3(kTcWarps * 32, 1, 1);
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = pdl ? 1 : 0;
  auto run = [&](auto kernel) {
    return static_cast<int>(cudaLaunchKernelEx(
        &config, kernel, static_cast<const T*>(x), static_cast<const uint8_t*>(qweight),
        static_cast<const S*>(scales), static_cast<const S*>(zeros), bias, bias_code, static_cast<T*>(out), m, n, k,
        stride_x, stride_q, stride_s, stride_out, group_size, tiled, act, static_cast<const T*>(norm_w), norm_eps,
        norm_offset));
  };
  if (act != 0) {  // the prologue builds (x in dynamic shared memory); none of NF4
    if (kNf4 || pdl || xtiles != 1 || m > kTcSplitMaxRows) return -1;
    if (act == 4 && k > kTcWarps * 32 * 8 * kPrologueWindows) return -1;  // normed_prologue's one round
    const size_t bytes = static_cast<size_t>(m) * k * sizeof(T);
    if (bytes > kPrologueMaxBytes) return -1;
    if constexpr (!kNf4) {
      auto run_pro = [&](auto kernel) {
        config.dynamicSmemBytes = bytes;
        const cudaError_t err = ok_opt_in_dynamic_shared(kernel, static_cast<int>(bytes));
        return err != cudaSuccess ? static_cast<int>(err) : run(kernel);
      };
      if (act == 4) {
        if (tiles == 1 && unroll == 2) return run_pro(int4_tc_kernel<T, S, 1, 1, 2, false, 1, 2>);
        if (tiles == 2 && unroll == 2) return run_pro(int4_tc_kernel<T, S, 2, 1, 2, false, 1, 2>);
        if (tiles == 4 && unroll == 1) return run_pro(int4_tc_kernel<T, S, 4, 1, 1, false, 1, 2>);
        return -2;
      }
      if (tiles == 1 && unroll == 2) return run_pro(int4_tc_kernel<T, S, 1, 1, 2, false, 1, 1>);
      if (tiles == 2 && unroll == 2) return run_pro(int4_tc_kernel<T, S, 2, 1, 2, false, 1, 1>);
      if (tiles == 4 && unroll == 1) return run_pro(int4_tc_kernel<T, S, 4, 1, 1, false, 1, 1>);
    }
    return -2;
  }
  auto build = [&](auto pdl_flag) {
    constexpr bool P = decltype(pdl_flag)::value;
    if (tiles == 1 && unroll == 2) return run(int4_tc_kernel<T, S, 1, 1, 2, P>);
    if (tiles == 2 && unroll == 2) return run(int4_tc_kernel<T, S, 2, 1, 2, P>);
    if (tiles == 4 && unroll == 1) return run(int4_tc_kernel<T, S, 4, 1, 1, P>);
    return -2;
  };
  if (xtiles == 2) {  // 9-16 rows, one n8 tile of x per CTA, two CTAs per 16 TILES rows of W
    if (pdl || m <= kTcSplitMaxRows) return -1;
    if (tiles == 1 && unroll == 2) return run(int4_tc_kernel<T, S, 1, 1, 2, false, 2>);
    if (tiles == 2 && unroll == 2) return run(int4_tc_kernel<T, S, 2, 1, 2, false, 2>);
    if (tiles == 4 && unroll == 1) return run(int4_tc_kernel<T, S, 4, 1, 1, false, 2>);
    return -2;
  }
  if (m > kTcSplitMaxRows) {  // two n8 tiles of x (9-16 rows): the same weight stream, twice the MMAs
    if (pdl) return -1;
    if (tiles == 1 && unroll == 2) return run(int4_tc_kernel<T, S, 1, 2, 2, false>);
    if (tiles == 2 && unroll == 2) return run(int4_tc_kernel<T, S, 2, 2, 2, false>);
    if (tiles == 4 && unroll == 1) return run(int4_tc_kernel<T, S, 4, 2, 1, false>);
    return -2;
  }
  if constexpr (kNf4) {  // no dependent-launch build of NF4
    return pdl ? -1 : build(std::false_type{});
  } else {
    return pdl ? build(std::true_type{}) : build(std::false_type{});
  }
}


// The split kernel over clusters of `splits` CTAs (2-8) along x: N / (16 tiles) x splits CTAs.
template <typename T, typename S>
int launch_tc_split(int tiles, int unroll, int splits, const void* x, const void* qweight, const void* scales,
                    const void* zeros, const void* bias, int bias_code, void* out, int64_t m, int64_t n, int64_t k,
                    int64_t stride_x, int64_t stride_q, int64_t stride_s, int64_t stride_out, int64_t group_size,
                    int pdl, int tiled, int act, cudaStream_t stream) {
  if (splits < 2 || splits > kTcMaxSplits || (act != 0 && pdl) || act == 4) return -1;  // no normed split build
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(n / (16 * tiles) * splits), 1, 1);
  config.blockDim = dim3(kTcWarps * 32, 1, 1);
  config.stream = stream;
  cudaLaunchAttribute attribute[2];
  attribute[0].id = cudaLaunchAttributeClusterDimension;
  attribute[0].val.clusterDim.x = static_cast<unsigned>(splits);
  attribute[0].val.clusterDim.y = 1;
  attribute[0].val.clusterDim.z = 1;
  attribute[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[1].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = pdl ? 2 : 1;
  const int64_t per = (k / 128 + splits - 1) / splits;  // a rank's chunks: the gated prologue's span
  const size_t pro_bytes = act != 0 ? static_cast<size_t>(m) * per * 128 * sizeof(T) : 0;
  if (pro_bytes > kPrologueMaxBytes) return -1;
  auto run = [&](auto kernel) {
    // The NF4 table in dynamic shared memory (with the static part past 48 KB, which needs the
    // kernel's opt-in), then a gated build's x.
    const size_t bytes = (kTcNf4Lut ? kNf4LutBytes : 0) + pro_bytes;
    if (bytes > 0) {
      config.dynamicSmemBytes = bytes;
      const cudaError_t err = ok_opt_in_dynamic_shared(kernel, static_cast<int>(bytes));
      if (err != cudaSuccess) return static_cast<int>(err);
    }
    return static_cast<int>(cudaLaunchKernelEx(
        &config, kernel, static_cast<const T*>(x), static_cast<const uint8_t*>(qweight),
        static_cast<const S*>(scales), static_cast<const S*>(zeros), bias, bias_code, static_cast<T*>(out), m, n, k,
        stride_x, stride_q, stride_s, stride_out, group_size, splits, tiled, act));
  };
  if (act != 0) {  // the gated builds: no dependent launch, no NF4
    if constexpr (kNf4) {
      return -1;
    } else {
      if (tiles == 1 && unroll == 2) return run(int4_tc_split_kernel<T, S, 1, 2, false, true>);
      if (tiles == 2 && unroll == 2) return run(int4_tc_split_kernel<T, S, 2, 2, false, true>);
      if (tiles == 4 && unroll == 1) return run(int4_tc_split_kernel<T, S, 4, 1, false, true>);
      return -2;
    }
  }
  auto build = [&](auto pdl_flag) {
    constexpr bool P = decltype(pdl_flag)::value;
    if (tiles == 1 && unroll == 2) return run(int4_tc_split_kernel<T, S, 1, 2, P>);
    if (tiles == 2 && unroll == 2) return run(int4_tc_split_kernel<T, S, 2, 2, P>);
    if (tiles == 4 && unroll == 1) return run(int4_tc_split_kernel<T, S, 4, 1, P>);
    return -2;
  };
  if constexpr (kNf4) {  // no dependent-launch build of NF4
    return pdl ? -1 : build(std::false_type{});
  } else {
    return pdl ? build(std::true_type{}) : build(std::false_type{});
  }
}

// The call's (x, scale) dtype pair as template arguments: launch(T{}, S{}) for the codes
// 1 (bfloat16) and 2 (float16); -1 for any other pair.
template <typename Launch>
int by_dtypes(int x_code, int s_code, Launch&& launch) {
  if (x_code == 1 && s_code == 1) return launch(__nv_bfloat16{}, __nv_bfloat16{});
  if (x_code == 1 && s_code == 2) return launch(__nv_bfloat16{}, __half{});
  if (x_code == 2 && s_code == 1) return launch(__half{}, __nv_bfloat16{});
  if (x_code == 2 && s_code == 2) return launch(__half{}, __half{});
  return -1;
}

// ok_int4_tc_ring's arguments from the replay's packed int64 array.
template <int (*Entry)(int, int, int, int, int, const void*, const void*, const void*, const void*, const void*, int,
                       void*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t)>
int from_packed(const int64_t* a) {
  auto p = [a](int i) { return reinterpret_cast<void*>(a[i]); };
  auto i32 = [a](int i) { return static_cast<int>(a[i]); };
  return Entry(i32(0), i32(1), i32(2), i32(3), i32(4), p(5), p(6), p(7), p(8), p(9), i32(10), p(11), a[12], a[13], a[14],
               a[15], a[16], a[17], a[18], a[19], a[20]);
}

}  // namespace

// out (M, N) = x W^T + bias for 1-16 rows of x (1-8 where split or PDL), W as the tensor cores' A operand
// (int4_tc_kernel; int4 with zeros, or symmetric where `zeros` is null; NF4 in the OK_TC_NF4 build,
// `zeros` ignored). `tiles` (16 rows of W
// each per CTA) and `unroll` (chunks per warp trip) pick a built shape; `splits` > 1 (2-8, sm_90)
// splits K over clusters of that many CTAs (int4_tc_split_kernel); `pdl` (sm_90) launches it as a
// programmatic dependent of the kernel before it (tc_prologue); `xtiles` 2 (9-16 rows of x, stored
// rows, neither split nor PDL) gives each n8 tile of x its own CTA (int4_tc_kernel's XT); `act`
// 1-3 (int4, up to 8 rows, neither PDL nor x split): x (M, 2K) holds a gated MLP's gate and up, and
// the product takes act(gate) * up (gated_value); `act` 4 (the same, and K not split): the
// product takes x's RMSNorm with weight `norm_w` (K values of x's dtype, 16-byte aligned),
// `norm_eps` and `norm_offset` (normed_window). N a multiple of 16 x tiles, K of 128, the group
// size of 32. Returns 0, a cudaError_t, -1 (dtypes, M, splits, xtiles or act), -2 (shape not
// built).
extern "C" int ok_int4_tc(int device, int x_code, int s_code, int tiles, int unroll, int splits, int pdl, int tiled,
                          int xtiles, int act, const void* x, const void* qweight, const void* scales, const void* zeros, const void* bias,
                          int bias_code, void* out, int64_t m, int64_t n, int64_t k, int64_t stride_x,
                          int64_t stride_q, int64_t stride_s, int64_t stride_out, int64_t group_size,
                          const void* norm_w, double norm_eps, double norm_offset, int64_t stream) {
  cudaError_t err = cudaSetDevice(device);
  if (err != cudaSuccess) return static_cast<int>(err);
  if (m < 1 || m > kTcMaxRows || (m > kTcSplitMaxRows && splits > 1)) return -1;
  if (xtiles != 1 && (xtiles != 2 || splits != 1 || pdl || tiled || m <= kTcSplitMaxRows)) return -1;
  if (tiled && pdl) return -1;  // the dependent launch's L2 prefetch walks the stored rows
  if (act < 0 || act > 4 || (act == 4 && norm_w == nullptr)) return -1;
  const auto s_ = reinterpret_cast<cudaStream_t>(stream);
  return by_dtypes(x_code, s_code, [&](auto t, auto s) {
    using T = decltype(t);
    using S = decltype(s);
    if (splits == 1) {
      return launch_tc<T, S>(tiles, unroll, x, qweight, scales, zeros, bias, bias_code, out, m, n, k, stride_x,
                             stride_q, stride_s, stride_out, group_size, pdl, tiled, xtiles, act, norm_w,
                             static_cast<float>(norm_eps), static_cast<float>(norm_offset), s_);
    }
    return launch_tc_split<T, S>(tiles, unroll, splits, x, qweight, scales, zeros, bias, bias_code, out, m, n, k,
                                 stride_x, stride_q, stride_s, stride_out, group_size, pdl, tiled, act, s_);
  });
}

// The same product through int4_tc_ring_kernel (`tiles`, `stages`: a built pair) on tiled codes
// (format.py's tile_codes; stride_q a tile's bytes), for group
// sizes that are multiples of 128, scale / zero rows and x rows 16-byte aligned. Returns as
// ok_int4_tc, or -3 (the stages do not fit in shared memory).
extern "C" int ok_int4_tc_ring(int device, int x_code, int s_code, int tiles, int stages, const void* x,
                               const void* qweight, const void* scales, const void* zeros, const void* bias,
                               int bias_code, void* out, int64_t m, int64_t n, int64_t k, int64_t stride_x,
                               int64_t stride_q, int64_t stride_s, int64_t stride_out, int64_t group_size,
                               int64_t stream) {
  cudaError_t err = cudaSetDevice(device);
  if (err != cudaSuccess) return static_cast<int>(err);
  if (m < 1 || m > 8 || group_size % 128 != 0) return -1;
#ifdef OK_TC_NF4
  return -1;  // no ring-fed build of NF4
#else
  return by_dtypes(x_code, s_code, [&](auto t, auto s) {
    return launch_tc_ring<decltype(t), decltype(s)>(tiles, stages, x, qweight, scales, zeros, bias, bias_code, out, m,
                                                    n, k, stride_x, stride_q, stride_s, stride_out, group_size,
                                                    reinterpret_cast<cudaStream_t>(stream));
  });
#endif
}

extern "C" int ok_int4_tc_packed(const int64_t* a) {
  auto p = [a](int i) { return reinterpret_cast<void*>(a[i]); };
  auto i32 = [a](int i) { return static_cast<int>(a[i]); };
  auto f64 = [a](int i) {
    double v;
    memcpy(&v, &a[i], 8);  // doubles travel as their bits (replay.observe_library)
    return v;
  };
  return ok_int4_tc(i32(0), i32(1), i32(2), i32(3), i32(4), i32(5), i32(6), i32(7), i32(8), i32(9), p(10), p(11), p(12),
                    p(13), p(14), i32(15), p(16), a[17], a[18], a[19], a[20], a[21], a[22], a[23], a[24], p(25), f64(26),
                    f64(27), a[28]);
}
extern "C" int ok_int4_tc_ring_packed(const int64_t* a) { return from_packed<ok_int4_tc_ring>(a); }
