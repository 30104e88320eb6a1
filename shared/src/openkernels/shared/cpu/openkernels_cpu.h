// Low-level helpers shared by the openkernels CPU kernels (activations.cpp, layernorm.cpp, ...).
//
// Header-only C++17, shipped by openkernels-shared; openkernels.shared.cpu_build puts this directory
// on every compile's include path (-I) and hashes its headers into the build cache key, so editing
// this file rebuilds every library on next use. Everything sits in an anonymous namespace: each
// kernel source is its own shared library, and internal linkage keeps these out of its exported
// symbols (only the extern "C" entry points are) and lets the compiler inline or drop them freely.
// Only what every family does identically lives here, down to NaN and rounding: dtype codes,
// tuning constants and store loops stay with each family.

#ifndef OPENKERNELS_CPU_H_
#define OPENKERNELS_CPU_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__F16C__) || defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
// Streaming stores (64-byte lines that bypass the cache) need AVX2 or AVX-512.
#if defined(__AVX2__) || defined(__AVX512F__)
#define OK_STREAM 1
#endif
#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

#define OK_INLINE inline __attribute__((always_inline))
#define OK_NOINLINE __attribute__((noinline))  // one copy of a vectorized loop, shared by its callers

namespace {

OK_INLINE uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

OK_INLINE float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// ---- bfloat16: plain integer code, which the compiler vectorizes inside the callers' loops ----

OK_INLINE float bf16_load(uint16_t h) { return from_bits(uint32_t(h) << 16); }

// Round to nearest even; NaN keeps its sign and becomes a quiet NaN (rounding could carry it to inf).
OK_INLINE uint16_t bf16_store(float v) {
  uint32_t u = bits(v);
  uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return uint16_t(v != v ? (u >> 16) | 0x40u : rounded);
}

// ---- float16 (F16C: its conversions do not auto-vectorize from scalar code, so whole runs convert
// through float buffers with the 8-wide instructions) ----

OK_INLINE float f16_load(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  _Float16 v;
  std::memcpy(&v, &h, 2);
  return float(v);
#endif
}

OK_INLINE uint16_t f16_store(float f) {  // nearest even
#if defined(__F16C__)
  return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  _Float16 v = _Float16(f);
  uint16_t h;
  std::memcpy(&h, &v, 2);
  return h;
#endif
}

// Not inline: one out-of-line copy per library, called from every f16 staging loop. [[maybe_unused]]:
// a source that includes this header without converting float16 compiles without a warning.
[[maybe_unused]] void f16_to_float(const uint16_t* __restrict src, float* __restrict dst, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = f16_load(src[i]);
}

[[maybe_unused]] void float_to_f16(const float* __restrict src, uint16_t* __restrict dst, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  constexpr int kRne = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), kRne));
#endif
  for (; i < n; ++i) dst[i] = f16_store(src[i]);
}

// ---- rows of a dtype code (0 float32, 1 bfloat16, 2 float16) to and from float32 (attention) ----

inline void row_to_float(const void* src, int dtype, float* __restrict dst, int64_t n) {
  if (dtype == 0) {
    std::memcpy(dst, src, size_t(n) * 4);
  } else if (dtype == 1) {
    const uint16_t* s = static_cast<const uint16_t*>(src);
    for (int64_t i = 0; i < n; ++i) dst[i] = bf16_load(s[i]);
  } else {
    f16_to_float(static_cast<const uint16_t*>(src), dst, n);
  }
}

inline void row_from_float(const float* __restrict src, int dtype, void* dst, int64_t n) {
  if (dtype == 0) {
    std::memcpy(dst, src, size_t(n) * 4);
  } else if (dtype == 1) {
    uint16_t* d = static_cast<uint16_t*>(dst);
    for (int64_t i = 0; i < n; ++i) d[i] = bf16_store(src[i]);
  } else {
    float_to_f16(src, static_cast<uint16_t*>(dst), n);
  }
}

// ---- exp (activations, attention decode) ----

// min(|x|, c) and x clamped to [-c, c], for c > 0, by an integer min on the magnitude bits: compilers
// do not turn float selects into min/max (NaN rules) and emit several mask instructions instead.
// NaN becomes c or +-c: callers carry NaN themselves (the activations through a final product with x).
OK_INLINE float abs_min(float x, float c) { return from_bits(std::min(bits(x) & 0x7fffffffu, bits(c))); }

OK_INLINE float clamp_abs(float x, float c) { return from_bits((bits(x) & 0x80000000u) | bits(abs_min(x, c))); }

// exp(a + b) for -150 <= a + b <= 89, |b| <= 2, about 1 ulp in the normal range; results below 2^-126
// flush to 0 and results from about 88.4 on are inf. a + b = n ln2 + r with |r| <= ln2/2 (Cody-Waite: ln2
// split in two so n ln2_hi is exact); b is added only after n ln2 was taken off a, so a large a with a
// small correction b loses nothing to rounding. exp(r) = 1 + r + r^2 R(r), R of degree 4 fitted for
// relative error (3e-9). 2^n is built in the exponent field: n + 127 <= 0 gives 0, n = 128 gives inf.
OK_INLINE float exp_sum(float a, float b) {
  const float shifter = 12582912.0f;  // 1.5 * 2^23: adding it rounds (a + b) / ln2 into the low bits
  float k = std::fma(a + b, 1.44269504f, shifter);
  float n = k - shifter;
  float r = std::fma(n, -0.693145751953125f, a) + b;
  r = std::fma(n, -1.42860682030941723e-6f, r);
  float p = 0.00138131445f;
  p = std::fma(p, r, 0.00836941883f);
  p = std::fma(p, r, 0.0416684568f);
  p = std::fma(p, r, 0.166665148f);
  p = std::fma(p, r, 0.499999931f);
  p = std::fma(p, r, 1.0f);
  p = std::fma(p, r, 1.0f);
  int32_t biased = std::max(int32_t(bits(k) - bits(shifter)) + 127, 0);  // n + 127
  return p * from_bits(uint32_t(biased) << 23);
}

// exp(x) for any x (NaN gives a number: callers carry NaN themselves).
// x + (-0) == x for every x, so the compiler drops the additions.
OK_INLINE float exp_(float x) { return exp_sum(clamp_abs(x, 89.0f), -0.0f); }

// ---- streaming stores ----

// Whether the page holding p was touched before. The first store to a fresh page faults and the kernel
// zeroes the page, which leaves it in cache: ordinary stores then cost no extra read, and streaming ones
// are slower (2-10% measured on the activations). glibc gives large allocations fresh pages (mmap).
[[maybe_unused]] bool resident(const void* p) {
#if defined(__linux__)
  const uintptr_t page = uintptr_t(sysconf(_SC_PAGESIZE));
  unsigned char in_core = 0;
  return mincore(reinterpret_cast<void*>(uintptr_t(p) & ~(page - 1)), 1, &in_core) == 0 && (in_core & 1);
#else
  return p != nullptr;  // no cheap test: assume memory an allocator reuses
#endif
}

// One 64-byte line from v to dst, both 64-byte aligned, bypassing the cache.
OK_INLINE void stream_line(void* dst, const void* v) {
#if defined(__AVX512F__)
  _mm512_stream_si512(static_cast<__m512i*>(dst), _mm512_load_si512(v));
#elif defined(__AVX2__)
  auto d = static_cast<__m256i*>(dst);
  auto s = static_cast<const __m256i*>(v);
  _mm256_stream_si256(d, _mm256_load_si256(s));
  _mm256_stream_si256(d + 1, _mm256_load_si256(s + 1));
#else
  std::memcpy(dst, v, 64);  // not reached: streaming needs AVX2 (OK_STREAM)
#endif
}

// Streaming stores are weakly ordered: a parallel region that made any completes them before it ends.
OK_INLINE void fence(bool any_stream) {
#if defined(OK_STREAM)
  if (any_stream) _mm_sfence();
#else
  (void)any_stream;
#endif
}

}  // namespace

#endif  // OPENKERNELS_CPU_H_
