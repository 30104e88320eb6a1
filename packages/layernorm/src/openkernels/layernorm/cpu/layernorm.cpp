// Fused RMSNorm / LayerNorm kernels for CPU: residual add, forward and backward.
//
// Plain C++17 + OpenMP, no torch headers; openkernels.shared.cpu_build compiles it on first use with
// -O3 -march=native. The math follows reference.py: h = round_{h dtype}(x + residual), statistics
// and the affine math in the accumulator type A (float, or double when x is float64), each output
// rounded once to its own dtype.
//
// Every tensor has its own dtype code. A row is processed in chunks of kChunk elements: each input
// chunk is converted into an A buffer by a loop chosen once per tensor, the math runs on A buffers
// (they stay in L1 / L2), and outputs are converted on store. Rows are the unit of parallel work
// (OpenMP, static schedule); a row is read from memory once (its second and third passes hit the
// per-thread row buffer in cache). Row strides are in elements and may be anything; columns are
// contiguous. Large float32 / bfloat16 / float16 outputs use streaming stores (AVX2 / AVX-512) when
// their pages are resident; large fresh ones get transparent huge pages first (prepare_output; set
// OPENKERNELS_CPU_HUGEPAGES=0 to leave their pages to the system).
//
// LayerNorm's variance: per chunk (in L1) the shifted sums about the chunk's rounded mean, merged across
// chunks in double (Chan et al.): centered, so no cancellation, and no second pass over the row. A row
// of float x read in place (no residual, no conversion) is summed in one pass about its first value
// instead, and again about its mean when that first value turns out far from it (first_value_stats).
// dweight / dbias: each thread sums its static block of rows into its own partials (A over 32 rows,
// then double); the partials are added in thread order. No atomics: the result depends only on the
// team size.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__linux__)
#include <sys/mman.h>  // madvise (prepare_output)
#endif
#if defined(_OPENMP)
#include <omp.h>
#endif

// OK_INLINE / OK_NOINLINE, OK_STREAM, bits / from_bits, the bfloat16 and float16 conversions,
// resident(), stream_line() and fence(): shared with the other families (openkernels-shared).
#include "openkernels_cpu.h"

namespace {

enum Dtype { kF32 = 0, kBF16 = 1, kF16 = 2, kF64 = 3 };

constexpr int64_t kChunk = 1024;             // elements per staging chunk: a few of them fit in L1
constexpr int64_t kSerialBelow = 32 * 1024;  // elements; smaller calls lose more to fork/join than they gain
// Output bytes from which stores bypass the cache. An ordinary store first reads the line it writes;
// an output this large does not stay in a 32 MB L3 for the next op anyway.
constexpr int64_t kStreamFrom = int64_t(32) << 20;
// Output bytes from which a fresh output is given transparent huge pages (prepare_output).
constexpr int64_t kHugeFrom = int64_t(4) << 20;

template <class A>
constexpr int acc_code() {
  return sizeof(A) == 8 ? kF64 : kF32;
}

OK_INLINE int64_t elem_size(int code) { return code == kF64 ? 8 : code == kF32 ? 4 : 2; }

OK_INLINE const char* at(const void* base, int64_t r, int64_t stride, int code) {
  return static_cast<const char*>(base) + r * stride * elem_size(code);
}

OK_INLINE char* at(void* base, int64_t r, int64_t stride, int code) {
  return static_cast<char*>(base) + r * stride * elem_size(code);
}

// ---- loading a chunk into the accumulator type ----

OK_NOINLINE void bf16_to_float(const uint16_t* __restrict src, float* __restrict dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = bf16_load(src[i]);
}

void load(int code, const char* src, float* __restrict dst, int64_t n) {
  switch (code) {
    case kF32: std::memcpy(dst, src, size_t(n) * 4); return;
    case kBF16: bf16_to_float(reinterpret_cast<const uint16_t*>(src), dst, n); return;
    case kF16: f16_to_float(reinterpret_cast<const uint16_t*>(src), dst, n); return;
  }
}

// The float64 path (x is float64) is for exactness (gradcheck), not speed: plain loops.
void load(int code, const char* src, double* __restrict dst, int64_t n) {
  switch (code) {
    case kF64: std::memcpy(dst, src, size_t(n) * 8); return;
    case kF32: {
      auto s = reinterpret_cast<const float*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = s[i];
      return;
    }
    case kBF16: {
      auto s = reinterpret_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = bf16_load(s[i]);
      return;
    }
    case kF16: {
      auto s = reinterpret_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) dst[i] = f16_load(s[i]);
      return;
    }
  }
}

// ---- rounding a chunk to a narrower dtype in place (h = round_{h dtype}(x + residual)) ----

OK_NOINLINE void round_bf16(float* __restrict p, int64_t n) {
  for (int64_t i = 0; i < n; ++i) p[i] = bf16_load(bf16_store(p[i]));
}

void round_to(int code, float* __restrict p, int64_t n) {
  if (code == kBF16) {
    round_bf16(p, n);
  } else if (code == kF16) {
    alignas(64) uint16_t tmp[kChunk];
    for (int64_t c = 0; c < n; c += kChunk) {
      const int64_t m = std::min(kChunk, n - c);
      float_to_f16(p + c, tmp, m);
      f16_to_float(tmp, p + c, m);
    }
  }
}

// torch converts float64 to a 16-bit type through float32 (c10::BFloat16 / c10::Half take a float).
void round_to(int code, double* __restrict p, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float f = float(p[i]);
    p[i] = code == kF32 ? f : code == kBF16 ? bf16_load(bf16_store(f)) : code == kF16 ? f16_load(f16_store(f)) : p[i];
  }
}

// ---- storing, optionally with streaming stores ----

// dst[i] = g(i) for i < n. With `stream`, dst's whole 64-byte lines are computed into an aligned line
// (a register once vectorized) and streamed; the partial lines at either end take ordinary stores.
template <class U, class G>
OK_INLINE void put(bool stream, U* __restrict dst, int64_t n, G&& g) {
  constexpr int64_t kLine = 64 / sizeof(U);
  int64_t a = n, b = n;  // [a, b): whole lines
#if defined(OK_STREAM)
  if (stream) {
    a = std::min(n, int64_t(-reinterpret_cast<uintptr_t>(dst) & 63) / int64_t(sizeof(U)));
    b = a + (n - a) / kLine * kLine;
  }
#else
  (void)stream;
#endif
  for (int64_t i = 0; i < a; ++i) dst[i] = g(i);
  for (int64_t i = a; i < b; i += kLine) {
    alignas(64) U v[kLine];
#pragma GCC unroll 1  // left a loop for the vectorizer
    for (int64_t k = 0; k < kLine; ++k) v[k] = g(i + k);
    stream_line(dst + i, v);
  }
  for (int64_t i = b; i < n; ++i) dst[i] = g(i);
}

// Generic store of an A chunk into dtype `code` (no streaming for float64 / through float64).
void store(int code, const float* __restrict src, char* dst, int64_t n, bool stream) {
  switch (code) {
    case kF32: put(stream, reinterpret_cast<float*>(dst), n, [&](int64_t i) { return src[i]; }); return;
    case kBF16: put(stream, reinterpret_cast<uint16_t*>(dst), n, [&](int64_t i) { return bf16_store(src[i]); }); return;
    case kF16: {
      auto d = reinterpret_cast<uint16_t*>(dst);
      const int64_t a = stream ? std::min(n, int64_t(-reinterpret_cast<uintptr_t>(d) & 63) / 2) : n;
      const int64_t b = a + (n - a) / 32 * 32;
      float_to_f16(src, d, a);
      for (int64_t i = a; i < b; i += 32) {
        alignas(64) uint16_t v[32];
        float_to_f16(src + i, v, 32);
        stream_line(d + i, v);
      }
      float_to_f16(src + b, d + b, n - b);
      return;
    }
  }
}

void store(int code, const double* __restrict src, char* dst, int64_t n, bool) {
  switch (code) {
    case kF64: std::memcpy(dst, src, size_t(n) * 8); return;
    case kF32: {
      auto d = reinterpret_cast<float*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = float(src[i]);
      return;
    }
    case kBF16: {
      auto d = reinterpret_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = bf16_store(float(src[i]));
      return;
    }
    case kF16: {
      auto d = reinterpret_cast<uint16_t*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = f16_store(float(src[i]));
      return;
    }
  }
}

// dst (dtype D, or the runtime `code` when D < 0) [i] = f(i) for i < n <= kChunk. float32 and bfloat16
// convert inline; float16 and the float64 path go through an A staging chunk.
constexpr int kAny = -1;

template <class A, int D, class F>
OK_INLINE void emit(bool stream, char* dst, int64_t n, int code, F&& f) {
  if constexpr (D == kF32) {
    put(stream, reinterpret_cast<float*>(dst), n, f);
  } else if constexpr (D == kBF16) {
    put(stream, reinterpret_cast<uint16_t*>(dst), n, [&](int64_t i) { return bf16_store(f(i)); });
  } else {
    alignas(64) A y[kChunk];
    for (int64_t i = 0; i < n; ++i) y[i] = f(i);
    store(D == kAny ? code : D, y, dst, n, stream);
  }
}

// ---- reductions over one chunk (vectorized: several partial sums), summed across chunks in double ----
// kLanes independent partial sums (four AVX2 vectors of float): one accumulator would make each pass a
// chain of dependent vector adds, latency- rather than throughput-bound (a 384-column row: 48 adds of
// 4 cycles each per pass).
constexpr int kLanes = 32;

// The sum of the partial sums, pairwise (halving vector adds, not a serial chain of kLanes scalar adds).
template <class A>
OK_INLINE A fold(A* acc) {
  for (int w = kLanes / 2; w >= 1; w /= 2) {
#pragma omp simd
    for (int j = 0; j < w; ++j) acc[j] += acc[j + w];
  }
  return acc[0];
}

template <class A>
OK_NOINLINE A sum_of(const A* __restrict p, int64_t n) {
  A acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
#pragma omp simd
    for (int j = 0; j < kLanes; ++j) acc[j] += p[i + j];
  }
  A s = 0;
  for (; i < n; ++i) s += p[i];
  return s + fold(acc);
}

// sum(d^2) with d = p - center, and with kLinear sum(d) too, into *sum_d (the shifted-data sums: exact
// differences near the center). One loop for both: without kLinear the linear sums compile away.
template <class A, bool kLinear = true>
OK_NOINLINE A centered_sums(const A* __restrict p, A center, int64_t n, A* sum_d) {
  A sq[kLanes] = {}, lin[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
#pragma omp simd
    for (int j = 0; j < kLanes; ++j) {
      const A d = p[i + j] - center;
      sq[j] += d * d;
      if constexpr (kLinear) lin[j] += d;
    }
  }
  A s = 0, t = 0;
  for (; i < n; ++i) {
    const A d = p[i] - center;
    s += d * d;
    if constexpr (kLinear) t += d;
  }
  if constexpr (kLinear) *sum_d = t + fold(lin);
  return s + fold(sq);
}

template <class A>
OK_INLINE A sum_sq(const A* __restrict p, A center, int64_t n) {
  return centered_sums<A, false>(p, center, n, nullptr);
}

// centered_sums of two rows at once (p about cp, q about cq), each row's lanes and fold as
// centered_sums's, so each result is bitwise the one-row call's: two rows' chains of dependent adds
// interleave (a 384-column row alone is a latency chain, not a throughput bound).
template <class A>
OK_NOINLINE void centered_sums2(const A* __restrict p, A cp, const A* __restrict q, A cq, int64_t n, A* ss,
                                A* sum_d) {
  A sqp[kLanes] = {}, linp[kLanes] = {}, sqq[kLanes] = {}, linq[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
#pragma omp simd
    for (int j = 0; j < kLanes; ++j) {
      const A d = p[i + j] - cp, e = q[i + j] - cq;
      sqp[j] += d * d;
      linp[j] += d;
      sqq[j] += e * e;
      linq[j] += e;
    }
  }
  A s0 = 0, t0 = 0, s1 = 0, t1 = 0;
  for (; i < n; ++i) {
    const A d = p[i] - cp, e = q[i] - cq;
    s0 += d * d;
    t0 += d;
    s1 += e * e;
    t1 += e;
  }
  sum_d[0] = t0 + fold(linp);
  ss[0] = s0 + fold(sqp);
  sum_d[1] = t1 + fold(linq);
  ss[1] = s1 + fold(sqq);
}

// Per-thread scratch that outlives the call (no page faults on reuse): slot k of the calling thread.
template <class T>
T* scratch(int slot, int64_t n) {
  thread_local std::vector<char> buffers[5];
  std::vector<char>& b = buffers[slot];
  const size_t need = size_t(n) * sizeof(T) + 64;
  if (b.size() < need) b.resize(need);
  return reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(b.data()) + 63) & ~uintptr_t(63));
}

// The OpenMP team's size and this thread's place in it (one thread, 0, without OpenMP).
#if defined(_OPENMP)
OK_INLINE int team_size() { return omp_get_num_threads(); }
OK_INLINE int thread_id() { return omp_get_thread_num(); }
#else
OK_INLINE int team_size() { return 1; }
OK_INLINE int thread_id() { return 0; }
#endif

// A large output whose pages were never touched (glibc serves large allocations with fresh mmap pages)
// costs one page fault per 4 KiB on first store, each zeroing its page: on this kind of machine that
// is several times the kernel's own time. Asking for transparent huge pages on the output's 2 MiB
// aligned interior (before the first store; THP in "madvise" mode honours just that) makes it one
// fault per 2 MiB. Only the range inside the tensor is advised, and only when its first huge page is
// not resident (touched memory, e.g. reused from the heap, is left alone). The advice is a hint: a
// failure (no THP, a special mapping) changes nothing.
void prepare_output(void* base, int code, int64_t rows, int64_t cols) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t(2) << 20;
  if (base == nullptr || rows * cols * elem_size(code) < kHugeFrom) return;
  const char* opt = std::getenv("OPENKERNELS_CPU_HUGEPAGES");  // "0": leave the pages to the system
  if (opt != nullptr && opt[0] == '0' && opt[1] == 0) return;
  const int64_t bytes = rows * cols * elem_size(code);
  const uintptr_t lo = (reinterpret_cast<uintptr_t>(base) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t hi = (reinterpret_cast<uintptr_t>(base) + uintptr_t(bytes)) & ~(kHuge - 1);
  if (hi <= lo || resident(reinterpret_cast<void*>(lo))) return;
  madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);
#else
  (void)base, (void)code, (void)rows, (void)cols;
#endif
}

bool should_stream(void* base, int code, int64_t rows, int64_t cols) {
#if defined(OK_STREAM)
  if (base == nullptr || code == kF64) return false;
  const int64_t bytes = rows * cols * elem_size(code);
  return bytes >= kStreamFrom && resident(static_cast<char*>(base) + bytes - 1);
#else
  (void)base, (void)code, (void)rows, (void)cols;
  return false;
#endif
}

// ================================ forward ================================

// h is `const A*`, or (S = uint16_t) bfloat16 x itself, converted on the fly.
template <class A>
using AffineFn = void (*)(const void*, const A*, const A*, A, A, char*, int64_t, bool, int);

// Run-time choices of compile-time instances: `make` gets each flag (or the output dtype code)
// as a std::integral_constant and returns the instance for it; every choice is one such call.
template <class Make>
auto pick_flags(bool a, bool b, Make make) {
  using T = std::true_type;
  using F = std::false_type;
  if (a && b) return make(T{}, T{});
  if (a) return make(T{}, F{});
  if (b) return make(F{}, T{});
  return make(F{}, F{});
}

// The output conversion: specialized per dtype code on the float path, generic (kAny) on double.
template <class A, class Make>
auto pick_code(int code, Make make) {
  if constexpr (std::is_same_v<A, float>) {
    if (code == kF32) return make(std::integral_constant<int, kF32>{});
    if (code == kBF16) return make(std::integral_constant<int, kBF16>{});
    return make(std::integral_constant<int, kF16>{});
  }
  return make(std::integral_constant<int, kAny>{});
}

// out = (h - mean) * rstd [* w] [+ b], converted to out's dtype.
template <class A, class S, int D, bool W, bool B>
OK_NOINLINE void affine(const void* hv, const A* __restrict w, const A* __restrict b, A mean, A rstd, char* out,
                        int64_t n, bool stream, int code) {
  const S* __restrict h = static_cast<const S*>(hv);
  emit<A, D>(stream, out, n, code, [&](int64_t i) {
    A v;
    if constexpr (std::is_same_v<S, uint16_t>) v = (bf16_load(h[i]) - mean) * rstd;
    else v = (h[i] - mean) * rstd;
    if constexpr (W) v = v * w[i];
    if constexpr (B) v = v + b[i];
    return v;
  });
}

template <class A, class S>
AffineFn<A> pick_affine(int code, bool w, bool b) {
  return pick_code<A>(code, [&](auto d) {
    return pick_flags(w, b, [](auto W, auto B) -> AffineFn<A> {
      return affine<A, S, decltype(d)::value, decltype(W)::value, decltype(B)::value>;
    });
  });
}

template <class A>
AffineFn<A> pick_affine(int code, bool w, bool b, bool bf16_src) {
  if constexpr (std::is_same_v<A, float>) {
    if (bf16_src) return pick_affine<A, uint16_t>(code, w, b);
  }
  return pick_affine<A, A>(code, w, b);
}

// dst[i] = src[i] converted to A; returns sum(dst) or (SQ) sum(dst^2). One pass: the converted chunk
// is summed while it is in registers.
template <bool SQ, class U, class Cvt>
OK_INLINE float convert_sum(const U* __restrict src, float* __restrict dst, int64_t n, Cvt&& cvt) {
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
#pragma omp simd
    for (int j = 0; j < kLanes; ++j) {
      const float v = cvt(src[i + j]);
      dst[i + j] = v;
      acc[j] += SQ ? v * v : v;
    }
  }
  float s = 0.0f;
  for (; i < n; ++i) {
    const float v = cvt(src[i]);
    dst[i] = v;
    s += SQ ? v * v : v;
  }
  return s + fold(acc);
}

template <bool SQ>
OK_NOINLINE float load_sum(int code, const char* src, float* __restrict dst, int64_t n) {
  switch (code) {
    case kF32: return convert_sum<SQ>(reinterpret_cast<const float*>(src), dst, n, [](float v) { return v; });
    case kBF16: return convert_sum<SQ>(reinterpret_cast<const uint16_t*>(src), dst, n, bf16_load);
  }
  load(code, src, dst, n);
  return SQ ? sum_sq<float>(dst, 0.0f, n) : sum_of<float>(dst, n);
}

template <bool SQ>
double load_sum(int code, const char* src, double* __restrict dst, int64_t n) {
  load(code, src, dst, n);
  return SQ ? sum_sq<double>(dst, 0.0, n) : sum_of<double>(dst, n);
}

template <class A>
OK_NOINLINE void add_to(A* __restrict h, const A* __restrict r, int64_t n) {
  for (int64_t i = 0; i < n; ++i) h[i] += r[i];
}

// h = x + r with x and r already in A: one pass and no staging copies. Copying each chunk in first
// (memcpy) cost more than the rest of the row's work together on the AMD EPYC dev VM (glibc's
// rep-movsb copy: 18% of the profile against 3% for a compute pass, 384-column rows).
template <class A>
OK_NOINLINE void add_rows(const A* __restrict x, const A* __restrict r, A* __restrict h, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) h[i] = x[i] + r[i];
}

// h = x + r and, in the same pass, sum((h - center)^2) (returned) and with kLinear sum(h - center)
// (into *sum_d): the row's sums taken while h is written, instead of two more passes over it.
// center = x[0] + r[0] (LayerNorm: the row's first value, see first_value_stats) or 0 (RMSNorm).
template <class A, bool kLinear>
OK_NOINLINE A add_rows_sums(const A* __restrict x, const A* __restrict r, A* __restrict h, int64_t n, A center,
                            A* sum_d) {
  A sq[kLanes] = {}, lin[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
#pragma omp simd
    for (int j = 0; j < kLanes; ++j) {
      const A v = x[i + j] + r[i + j];
      h[i + j] = v;
      const A d = v - center;
      sq[j] += d * d;
      if constexpr (kLinear) lin[j] += d;
    }
  }
  A s = 0, t = 0;
  for (; i < n; ++i) {
    const A v = x[i] + r[i];
    h[i] = v;
    const A d = v - center;
    s += d * d;
    if constexpr (kLinear) t += d;
  }
  if constexpr (kLinear) *sum_d = t + fold(lin);
  return s + fold(sq);
}

// The same for bfloat16 x, residual and h: h = round_bf16(x + r) in float, one pass instead of two
// conversions, an add and a rounding pass.
OK_NOINLINE void add_rows_bf16(const uint16_t* __restrict x, const uint16_t* __restrict r, float* __restrict h,
                               int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) h[i] = bf16_load(bf16_store(bf16_load(x[i]) + bf16_load(r[i])));
}

// h[i] = make(i) (a float) for i < n, and sum((h - center)^2) (returned) and sum(h - center) (into
// *sum_d) while h is in registers: a short row's staging pass and its LayerNorm sums in one.
template <class Make>
OK_INLINE float staged_sums(float* __restrict h, int64_t n, float center, float* sum_d, Make&& make) {
  float sq[kLanes] = {}, lin[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
#pragma omp simd
    for (int j = 0; j < kLanes; ++j) {
      const float v = make(i + j);
      h[i + j] = v;
      const float d = v - center;
      sq[j] += d * d;
      lin[j] += d;
    }
  }
  float s = 0.0f, t = 0.0f;
  for (; i < n; ++i) {
    const float v = make(i);
    h[i] = v;
    const float d = v - center;
    s += d * d;
    t += d;
  }
  *sum_d = t + fold(lin);
  return s + fold(sq);
}

// bfloat16 x (and residual, h rounded to bfloat16) of one chunk: staged as float with the sums above.
OK_NOINLINE float bf16_row_sums(const uint16_t* __restrict x, const uint16_t* __restrict r, float* __restrict h,
                                int64_t n, float center, float* sum_d) {
  if (r == nullptr) return staged_sums(h, n, center, sum_d, [&](int64_t i) { return bf16_load(x[i]); });
  return staged_sums(h, n, center, sum_d,
                     [&](int64_t i) { return bf16_load(bf16_store(bf16_load(x[i]) + bf16_load(r[i]))); });
}

// A short row's LayerNorm statistics from its sums ss = sum((h - c)^2) and sum_d = sum(h - c) about
// its first value c, in A (a serial chain of latencies: double math in it costs as much as a pass): the
// mean, and N * variance. A row whose first value lies more than 4 standard deviations from its mean
// (or whose sums are not finite) is summed again about its mean while it is in L1 (as
// first_value_stats does for long rows).
template <class A>
OK_INLINE void short_row_stats(const A* __restrict h, int64_t m, A center, A ss, A sum_d, double& mean,
                               double& m2) {
  const A inv = A(1) / A(m);
  A dc = sum_d * inv;
  if (!(dc * dc <= A(16) * (ss * inv - dc * dc))) {
    center += dc;
    ss = centered_sums<A>(h, center, m, &sum_d);
    dc = sum_d * inv;
  }
  mean = double(center + dc);
  m2 = double(std::max(A(0), ss - A(m) * dc * dc));
}

struct Fwd {
  const void* x;
  int64_t x_stride;
  int x_code;
  const void* res;  // nullable
  int64_t res_stride;
  int res_code;
  const void* w;  // A[N] (weight + weight_offset), nullable
  const void* b;  // A[N], nullable
  void* out;      // contiguous
  int out_code;
  void* res_out;  // contiguous, nullable
  int res_out_code;
  void* mean;  // A[M], nullable
  void* rstd;  // A[M]
  int h_code;
  int64_t M, N;
  double eps;
  bool rms;
};

// h is x converted (16-bit x, no residual, no rounding): no row buffer, see fwd_row.
template <class A>
bool refetches(const Fwd& f) {
  constexpr int kAcc = acc_code<A>();
  return f.res == nullptr && f.x_code != kAcc && (f.h_code == kAcc || f.h_code == f.x_code);
}

// ... and pass 2 reads bfloat16 x itself (a row of more than one chunk).
template <class A>
bool reads_bf16(const Fwd& f) {
  return refetches<A>(f) && f.x_code == kBF16 && f.N > kChunk;
}

// LayerNorm statistics of a row h[0..N) from its sums about c = h[0], taken in one pass: in, sum_d =
// sum(h - c) and sum_sq = sum((h - c)^2); out, the mean and N * variance. Sums about a center c lose
// about (mean - c)^2 / variance of the variance's digits (at most N, as h[0] is one of the values);
// a row whose first value lies more than 4 standard deviations from its mean (or whose sums are not
// finite) is summed again about its mean, a second pass over a row that is still in cache.
template <class A>
void first_value_stats(const A* h, int64_t N, double& sum_d, double& sum_sq) {
  A center = h[0];
  double dc = sum_d / double(N);
  if (!(dc * dc <= 16.0 * (sum_sq / double(N) - dc * dc))) {
    center = A(double(center) + dc);
    sum_d = sum_sq = 0.0;
    for (int64_t c = 0; c < N; c += kChunk) {
      A d;
      sum_sq += double(centered_sums<A>(h + c, center, std::min(kChunk, N - c), &d));
      sum_d += double(d);
    }
    dc = sum_d / double(N);
  }
  sum_d = double(center) + dc;                          // the mean
  sum_sq = std::max(0.0, sum_sq - double(N) * dc * dc);  // N * variance
}

// One row. hb: a row buffer of N (unused when h is x itself), tb: a chunk buffer.
template <class A>
void fwd_row(const Fwd& f, AffineFn<A> affine_fn, int64_t r, A* __restrict hb, A* __restrict tb, bool stream_out,
             bool stream_res) {
  constexpr int kAcc = acc_code<A>();
  const int64_t N = f.N;
  const char* x = at(f.x, r, f.x_stride, f.x_code);
  const char* res = f.res ? at(f.res, r, f.res_stride, f.res_code) : nullptr;
  char* ro = f.res_out ? at(f.res_out, r, N, f.res_out_code) : nullptr;
  char* out = at(f.out, r, N, f.out_code);
  // h rounds to its dtype unless it already is that dtype's value (no residual, x of that dtype).
  const bool round = f.h_code != kAcc && (res != nullptr || f.x_code != f.h_code);
  const bool alias = res == nullptr && f.x_code == kAcc && !round;  // h is x itself
  // x converted (16-bit x): no row buffer. Pass 1 converts each chunk of x into tb (in L1) and sums it
  // there; pass 2 converts again (bfloat16: inside affine, a shift; float16: into tb) rather than keep
  // a row of A that would live in L2.
  const bool refetch = refetches<A>(f);
  const bool direct = reads_bf16<A>(f);
  const A* h = alias ? reinterpret_cast<const A*>(x) : hb;

  // Pass 1: h (into hb), residual_out, and sum(h^2) (RMSNorm) or, per chunk while it is in L1, sum(h)
  // and the sum of squares about the chunk's mean, merged across chunks in double (Chan et al.): the
  // variance comes from centered sums without a second pass over the row.
  double s = 0.0, cnt = 0.0, mu = 0.0, m2 = 0.0;
  // LayerNorm of a row read in place (float x, no residual): one pass from memory, each chunk summed
  // about the row's first value; see first_value_stats.
  const bool one_pass = alias && !f.rms && N > 0;
  for (int64_t c = 0; c < N; c += kChunk) {
    const int64_t m = std::min(kChunk, N - c);
    const char* xc = x + c * elem_size(f.x_code);
    const A* hc = refetch ? tb : h + c;
    if (one_pass) {
      A sum_d;
      const A ss = centered_sums<A>(hc, h[0], m, &sum_d);
      if (m == N) {
        short_row_stats<A>(hc, m, h[0], ss, sum_d, mu, m2);  // a short row: its statistics in A
      } else {
        m2 += double(ss);
        mu += double(sum_d);
      }
      if (ro) store(f.res_out_code, hc, ro + c * elem_size(f.res_out_code), m, stream_res);
      continue;
    }
    const char* rc0 = res ? res + c * elem_size(f.res_code) : nullptr;
    if (rc0 && !round && f.x_code == kAcc && f.res_code == kAcc && (f.rms || m == N)) {
      // A row of one chunk (LayerNorm; RMSNorm any) with a residual in A: h and its sums in one pass.
      const A* xa = reinterpret_cast<const A*>(xc);
      const A* ra = reinterpret_cast<const A*>(rc0);
      if (f.rms) {
        s += double(add_rows_sums<A, false>(xa, ra, hb + c, m, A(0), nullptr));
      } else {
        const A center = xa[0] + ra[0];
        A sum_d;
        const A ss = add_rows_sums<A, true>(xa, ra, hb + c, m, center, &sum_d);
        short_row_stats<A>(hb + c, m, center, ss, sum_d, mu, m2);
      }
      if (ro) store(f.res_out_code, hb + c, ro + c * elem_size(f.res_out_code), m, stream_res);
      continue;
    }
    if constexpr (std::is_same_v<A, float>) {
      // bfloat16 LayerNorm rows of one chunk, x alone (staged into tb) or x + residual rounded to a
      // bfloat16 h (into hb): staged and summed about the first value in one pass.
      const bool bf16_x = f.x_code == kBF16 && !f.rms && m == N;
      const bool alone = bf16_x && refetch;
      const bool with_res = bf16_x && rc0 && f.res_code == kBF16 && f.h_code == kBF16;
      if (alone || with_res) {
        const uint16_t* xb = reinterpret_cast<const uint16_t*>(xc);
        const uint16_t* rb = with_res ? reinterpret_cast<const uint16_t*>(rc0) : nullptr;
        float* dst = alone ? tb : hb + c;
        const float center = rb ? bf16_load(bf16_store(bf16_load(xb[0]) + bf16_load(rb[0]))) : bf16_load(xb[0]);
        float sum_d;
        const float ss = bf16_row_sums(xb, rb, dst, m, center, &sum_d);
        short_row_stats<float>(dst, m, center, ss, sum_d, mu, m2);
        if (ro) store(f.res_out_code, dst, ro + c * elem_size(f.res_out_code), m, stream_res);
        continue;
      }
    }
    double sc;  // sum(h) or sum(h^2) of the chunk
    if (alias) {
      sc = f.rms ? double(sum_sq<A>(hc, A(0), m)) : double(sum_of<A>(hc, m));
    } else if (refetch) {
      sc = f.rms ? double(load_sum<true>(f.x_code, xc, tb, m)) : double(load_sum<false>(f.x_code, xc, tb, m));
    } else {
      const char* rc = res ? res + c * elem_size(f.res_code) : nullptr;
      bool rounded = false;
      if (rc && f.x_code == kAcc && f.res_code == kAcc) {
        add_rows<A>(reinterpret_cast<const A*>(xc), reinterpret_cast<const A*>(rc), hb + c, m);
      } else if (rc && f.x_code == kBF16 && f.res_code == kBF16 && f.h_code == kBF16 && std::is_same_v<A, float>) {
        if constexpr (std::is_same_v<A, float>) add_rows_bf16(reinterpret_cast<const uint16_t*>(xc),
                                                               reinterpret_cast<const uint16_t*>(rc), hb + c, m);
        rounded = true;
      } else {
        load(f.x_code, xc, hb + c, m);
        if (rc) {
          load(f.res_code, rc, tb, m);
          add_to(hb + c, tb, m);
        }
      }
      if (round && !rounded) round_to(f.h_code, hb + c, m);
      sc = f.rms ? double(sum_sq<A>(hc, A(0), m)) : double(sum_of<A>(hc, m));
    }
    if (ro) store(f.res_out_code, hc, ro + c * elem_size(f.res_out_code), m, stream_res);
    if (f.rms) {
      s += sc;
    } else if (m == N) {
      // One chunk (short rows, e.g. 384 columns, with a residual): the centered sums below with the
      // scalar math in A and no merge. The row's statistics are a serial chain of latencies
      // (reductions, divides, sqrt): double conversions and divides in it cost as much as a pass.
      const A inv = A(1) / A(m);
      const A center = A(sc) * inv;
      A sum_d;
      const A ss = centered_sums<A>(hc, center, m, &sum_d);
      const A dc = sum_d * inv;
      mu = double(center + dc);
      m2 = double(std::max(A(0), ss - A(m) * dc * dc));
    } else {
      // sum((h - center)^2) = m2_c + m (mean_c - center)^2, with mean_c - center = sum(h - center) / m
      // exactly: the rounded sum(h) only picks the center.
      const A center = A(sc / double(m));
      A sum_d;
      const double ss = double(centered_sums<A>(hc, center, m, &sum_d));
      const double dc = double(sum_d) / double(m);
      const double mean_c = double(center) + dc;
      const double m2_c = std::max(0.0, ss - double(m) * dc * dc);
      const double n1 = cnt + double(m), delta = mean_c - mu;
      mu += delta * double(m) / n1;
      m2 += m2_c + delta * delta * cnt * double(m) / n1;
      cnt = n1;
    }
  }
  if (one_pass && N > kChunk) first_value_stats<A>(h, N, mu, m2);
  A mean = 0, var;
  if (f.rms) {
    var = A(s / double(N));  // mean(h^2)
  } else {
    mean = A(mu);
    var = A(m2 / double(N));
  }
  const A rstd = A(1) / std::sqrt(var + A(f.eps));
  static_cast<A*>(f.rstd)[r] = rstd;
  if (f.mean) static_cast<A*>(f.mean)[r] = mean;

  // Pass 2: y.
  const A* w = static_cast<const A*>(f.w);
  const A* b = static_cast<const A*>(f.b);
  for (int64_t c = 0; c < N; c += kChunk) {
    const int64_t m = std::min(kChunk, N - c);
    const void* hc = h + c;
    if (direct) {
      hc = x + c * 2;
    } else if (refetch) {
      if (N > kChunk) load(f.x_code, x + c * elem_size(f.x_code), tb, m);  // else tb still holds the row
      hc = tb;
    }
    affine_fn(hc, w ? w + c : nullptr, b ? b + c : nullptr, mean, rstd, out + c * elem_size(f.out_code), m,
              stream_out, f.out_code);
  }
}

// LayerNorm rows of x in A read in place (no residual, one chunk: 384 columns, MiniLM's) two at a
// time: the same math as fwd_row's one-pass path, each row's results bitwise the same, with the two
// rows' reductions and statistics (chains of latencies) side by side.
template <class A>
bool short_pairs(const Fwd& f) {
  constexpr int kAcc = acc_code<A>();
  const bool alias = f.res == nullptr && f.x_code == kAcc && (f.h_code == kAcc || f.h_code == f.x_code);
  return alias && !f.rms && f.res_out == nullptr && f.N > 0 && f.N <= kChunk && f.M >= 2;
}

template <class A>
void fwd_short_pair(const Fwd& f, AffineFn<A> affine_fn, int64_t r, bool stream_out) {
  const int64_t N = f.N;
  const A* h[2] = {reinterpret_cast<const A*>(at(f.x, r, f.x_stride, f.x_code)),
                   reinterpret_cast<const A*>(at(f.x, r + 1, f.x_stride, f.x_code))};
  A ss[2], sum_d[2];
  centered_sums2<A>(h[0], h[0][0], h[1], h[1][0], N, ss, sum_d);
  A mean[2], rstd[2];
  for (int k = 0; k < 2; ++k) {
    double mu, m2;
    short_row_stats<A>(h[k], N, h[k][0], ss[k], sum_d[k], mu, m2);
    mean[k] = A(mu);
    rstd[k] = A(1) / std::sqrt(A(m2 / double(N)) + A(f.eps));
    static_cast<A*>(f.rstd)[r + k] = rstd[k];
    if (f.mean) static_cast<A*>(f.mean)[r + k] = mean[k];
  }
  const A* w = static_cast<const A*>(f.w);
  const A* b = static_cast<const A*>(f.b);
  for (int k = 0; k < 2; ++k) {
    affine_fn(h[k], w, b, mean[k], rstd[k], at(f.out, r + k, N, f.out_code), N, stream_out, f.out_code);
  }
}

template <class A>
void run_fwd(const Fwd& f, int num_threads) {
  constexpr int kAcc = acc_code<A>();
  const bool stream_out = should_stream(f.out, f.out_code, f.M, f.N);
  const bool stream_res = should_stream(f.res_out, f.res_out_code, f.M, f.N);
  prepare_output(f.out, f.out_code, f.M, f.N);
  prepare_output(f.res_out, f.res_out_code, f.M, f.N);
  const bool parallel = num_threads > 1 && f.M > 1 && f.M * f.N >= kSerialBelow;
  // fwd_row's row buffer: h when it is not x itself nor x converted chunk by chunk (see `refetch`).
  const bool need_hb = f.res != nullptr || (f.h_code != kAcc && f.x_code != f.h_code);
  const AffineFn<A> affine_fn = pick_affine<A>(f.out_code, f.w != nullptr, f.b != nullptr, reads_bf16<A>(f));
  const bool pairs = short_pairs<A>(f);
#pragma omp parallel num_threads(num_threads) if (parallel)
  {
    A* hb = need_hb ? scratch<A>(0, f.N) : nullptr;
    A* tb = scratch<A>(2, kChunk);
    if (pairs) {
#pragma omp for schedule(static) nowait
      for (int64_t r = 0; r < f.M - 1; r += 2) fwd_short_pair<A>(f, affine_fn, r, stream_out);
      if (f.M % 2 && thread_id() == team_size() - 1) fwd_row<A>(f, affine_fn, f.M - 1, hb, tb, stream_out, stream_res);
    } else {
#pragma omp for schedule(static) nowait
      for (int64_t r = 0; r < f.M; ++r) fwd_row<A>(f, affine_fn, r, hb, tb, stream_out, stream_res);
    }
    fence(stream_out || stream_res);
  }
}

// ================================ backward ================================

struct Bwd {
  const void* dy;
  int64_t dy_stride;
  int dy_code;
  const void* h;
  int64_t h_stride;
  int h_code;
  const void* w;     // A[N] (weight + weight_offset), nullable
  const void* mean;  // A[M], nullable (0)
  const void* rstd;  // A[M]
  const void* dh_out;  // nullable
  int64_t dh_out_stride;
  int dh_out_code;
  void* dh;  // contiguous
  int dh_code;
  void* dw;  // A[N], nullable
  void* db;  // A[N], nullable
  int64_t M, N;
  bool rms;
};

constexpr int64_t kFlushRows = 32;  // rows summed into the A partials before they go into the double ones

// Pass 1 over a chunk: xhat (into xh), sum(wg xhat) and sum(wg) with wg = dy w, and this thread's
// dweight / dbias partials.
template <class A, bool W, bool DW, bool DB>
OK_NOINLINE void bwd_stats(const A* __restrict h, const A* __restrict dy, const A* __restrict w, A mean, A rstd,
                           A* __restrict xh, A* __restrict pdw, A* __restrict pdb, int64_t n, A& s_gx, A& s_g) {
  A a = 0, b = 0;
#pragma omp simd reduction(+ : a, b)
  for (int64_t i = 0; i < n; ++i) {
    const A xhat = (h[i] - mean) * rstd;
    xh[i] = xhat;
    const A g = W ? dy[i] * w[i] : dy[i];
    a += g * xhat;
    b += g;
    if constexpr (DW) pdw[i] += dy[i] * xhat;
    if constexpr (DB) pdb[i] += dy[i];
  }
  s_gx = a;
  s_g = b;
}

template <class A>
using GradFn = void (*)(const A*, const A*, const A*, const A*, A, A, A, char*, int64_t, bool, int);

// Pass 2: dh = rstd ((wg - xhat c_gx) - c_g) [+ dh_out], converted to dh's dtype.
template <class A, int D, bool W, bool ADD>
OK_NOINLINE void bwd_grad(const A* __restrict xh, const A* __restrict dy, const A* __restrict w,
                          const A* __restrict add, A rstd, A c_gx, A c_g, char* out, int64_t n, bool stream,
                          int code) {
  emit<A, D>(stream, out, n, code, [&](int64_t i) {
    const A g = W ? dy[i] * w[i] : dy[i];
    A v = rstd * ((g - xh[i] * c_gx) - c_g);
    if constexpr (ADD) v = v + add[i];
    return v;
  });
}

template <class A>
GradFn<A> pick_grad(int code, bool w, bool add) {
  return pick_code<A>(code, [&](auto d) {
    return pick_flags(w, add, [](auto W, auto ADD) -> GradFn<A> {
      return bwd_grad<A, decltype(d)::value, decltype(W)::value, decltype(ADD)::value>;
    });
  });
}

struct Scratch {
  void *xb, *gb, *tb, *pdw, *pdb;
};

template <class A, bool W, bool DW, bool DB>
void bwd_row(const Bwd& k, GradFn<A> grad_fn, int64_t r, const Scratch& sc, bool stream) {
  constexpr int kAcc = acc_code<A>();
  const int64_t N = k.N;
  A* xb = static_cast<A*>(sc.xb);
  A* gb = static_cast<A*>(sc.gb);
  A* tb = static_cast<A*>(sc.tb);
  A* pdw = static_cast<A*>(sc.pdw);
  A* pdb = static_cast<A*>(sc.pdb);
  const char* dyr = at(k.dy, r, k.dy_stride, k.dy_code);
  const char* hr = at(k.h, r, k.h_stride, k.h_code);
  const char* dho = k.dh_out ? at(k.dh_out, r, k.dh_out_stride, k.dh_out_code) : nullptr;
  char* dh = at(k.dh, r, N, k.dh_code);
  const A* w = static_cast<const A*>(k.w);
  const A mean = k.mean ? static_cast<const A*>(k.mean)[r] : A(0);
  const A rstd = static_cast<const A*>(k.rstd)[r];
  const A* dy = k.dy_code == kAcc ? reinterpret_cast<const A*>(dyr) : gb;  // dy itself, or converted into gb

  // Pass 1: xhat (into xb), dy (into gb), the two row sums and the dweight / dbias partials.
  double s_gx = 0.0, s_g = 0.0;
  for (int64_t c = 0; c < N; c += kChunk) {
    const int64_t m = std::min(kChunk, N - c);
    const A* h = reinterpret_cast<const A*>(hr) + c;
    if (k.h_code != kAcc) {
      load(k.h_code, hr + c * elem_size(k.h_code), tb, m);
      h = tb;
    }
    if (k.dy_code != kAcc) load(k.dy_code, dyr + c * elem_size(k.dy_code), gb + c, m);
    A a, b;
    bwd_stats<A, W, DW, DB>(h, dy + c, W ? w + c : nullptr, mean, rstd, xb + c, DW ? pdw + c : nullptr,
                            DB ? pdb + c : nullptr, m, a, b);
    s_gx += double(a);
    s_g += double(b);
  }
  const A c_gx = A(s_gx / double(N));
  const A c_g = k.rms ? A(0) : A(s_g / double(N));  // (v - 0) == v: RMSNorm takes the same path

  // Pass 2: dh. dh_out goes through tb first, so dh may be dh_out itself.
  for (int64_t c = 0; c < N; c += kChunk) {
    const int64_t m = std::min(kChunk, N - c);
    if (dho) load(k.dh_out_code, dho + c * elem_size(k.dh_out_code), tb, m);
    grad_fn(xb + c, dy + c, W ? w + c : nullptr, tb, rstd, c_gx, c_g, dh + c * elem_size(k.dh_code), m, stream,
            k.dh_code);
  }
}

template <class A>
using BwdRow = void (*)(const Bwd&, GradFn<A>, int64_t, const Scratch&, bool);

template <class A, bool W>
BwdRow<A> pick_row(bool dw, bool db) {
  return pick_flags(dw, db, [](auto DW, auto DB) -> BwdRow<A> {
    return bwd_row<A, W, decltype(DW)::value, decltype(DB)::value>;
  });
}

template <class A>
OK_NOINLINE void flush(A* __restrict p, double* __restrict q, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    q[i] += double(p[i]);
    p[i] = A(0);
  }
}

template <class A>
void run_bwd(const Bwd& k, int num_threads) {
  const int64_t N = k.N;
  const bool stream = should_stream(k.dh, k.dh_code, k.M, N);
  prepare_output(k.dh, k.dh_code, k.M, N);
  const bool parallel = num_threads > 1 && k.M * N >= kSerialBelow;
  const bool partials = k.dw != nullptr || k.db != nullptr;
  const BwdRow<A> row = k.w ? pick_row<A, true>(k.dw, k.db) : pick_row<A, false>(k.dw, k.db);
  const GradFn<A> grad_fn = pick_grad<A>(k.dh_code, k.w != nullptr, k.dh_out != nullptr);
  // Double partials of thread t: part[2tN, (2t+1)N) for dweight, then N for dbias. The team has at
  // most num_threads; its size fixes the row partition, so the summation order.
  double* part = partials ? scratch<double>(4, 2 * int64_t(parallel ? num_threads : 1) * N) : nullptr;
  int team = 1;
#pragma omp parallel num_threads(num_threads) if (parallel)
  {
    const int nt = team_size(), t = thread_id();
    if (t == 0) team = nt;
    Scratch sc{scratch<A>(0, N), scratch<A>(1, k.dy_code == acc_code<A>() ? 0 : N), scratch<A>(2, kChunk),
               nullptr, nullptr};
    double* qdw = partials ? part + 2 * int64_t(t) * N : nullptr;  // then qdb = qdw + N
    if (partials) {
      std::fill(qdw, qdw + 2 * N, 0.0);
      A* p = scratch<A>(3, 2 * N);  // A partials over up to kFlushRows rows
      std::fill(p, p + 2 * N, A(0));
      sc.pdw = p;
      sc.pdb = p + N;
    }
    const int64_t r0 = k.M * t / nt, r1 = k.M * (t + 1) / nt;  // static partition
    for (int64_t r = r0; r < r1; ++r) {
      row(k, grad_fn, r, sc, stream);
      if (partials && ((r - r0) % kFlushRows == kFlushRows - 1 || r == r1 - 1))
        flush(static_cast<A*>(sc.pdw), qdw, 2 * N);  // pdw, pdb and qdw, qdb are adjacent
    }
    fence(stream);
  }
  if (partials) {  // fixed order over threads: deterministic
    A* dw = static_cast<A*>(k.dw);
    A* db = static_cast<A*>(k.db);
#pragma omp parallel for num_threads(num_threads) if (parallel && N >= 8192) schedule(static)
    for (int64_t j = 0; j < N; ++j) {
      double a = 0.0, b = 0.0;
      for (int t = 0; t < team; ++t) {
        a += part[2 * int64_t(t) * N + j];
        b += part[(2 * int64_t(t) + 1) * N + j];
      }
      if (dw) dw[j] = A(a);
      if (db) db[j] = A(b);
    }
  }
}

bool valid(int code, bool f64) { return code == kF32 || code == kBF16 || code == kF16 || (f64 && code == kF64); }

}  // namespace

// Strides are in elements; out / residual_out / dh are contiguous (M, N); mean, rstd, weight, bias,
// dweight, dbias are in the accumulator type (float64 when x (forward) or rstd (backward) is, else
// float32), weight already holds weight + weight_offset. Null pointers: absent. Dtype codes: 0 float32,
// 1 bfloat16, 2 float16, 3 float64 (float64 only on the float64 path). Returns 0, or -1 for a bad code.
extern "C" {

int ok_norm_fwd(const void* x, int64_t x_stride, int x_code, const void* res, int64_t res_stride, int res_code,
                const void* w, const void* b, void* out, int out_code, void* res_out, int res_out_code, void* mean,
                void* rstd, int h_code, int64_t M, int64_t N, double eps, int rms, int num_threads) {
  const bool f64 = x_code == kF64;
  if (!valid(x_code, f64) || !valid(out_code, f64) || !valid(h_code, f64) || (res && !valid(res_code, f64)) ||
      (res_out && !valid(res_out_code, f64)))
    return -1;
  const Fwd f{x,       x_stride,     x_code, res,  res_stride, res_code, w, b, out, out_code,
              res_out, res_out_code, mean,   rstd, h_code,     M,        N, eps, rms != 0};
  if (f64) run_fwd<double>(f, num_threads);
  else run_fwd<float>(f, num_threads);
  return 0;
}

int ok_norm_bwd(const void* dy, int64_t dy_stride, int dy_code, const void* h, int64_t h_stride, int h_code,
                const void* w, const void* mean, const void* rstd, const void* dh_out, int64_t dh_out_stride,
                int dh_out_code, void* dh, int dh_code, void* dw, void* db, int64_t M, int64_t N, int rms,
                int f64, int num_threads) {
  if (!valid(dy_code, f64) || !valid(h_code, f64) || !valid(dh_code, f64) || (dh_out && !valid(dh_out_code, f64)))
    return -1;
  const Bwd k{dy, dy_stride, dy_code, h, h_stride, h_code, w, mean, rstd, dh_out, dh_out_stride, dh_out_code,
              dh, dh_code,   dw,      db, M, N, rms != 0};
  if (f64) run_bwd<double>(k, num_threads);
  else run_bwd<float>(k, num_threads);
  return 0;
}

// Packed entry: every argument in one 64-bit slot (eps as its bits), for
// openkernels.shared.replay's C side.
int ok_norm_fwd_packed(const int64_t* a) {
  double eps;
  std::memcpy(&eps, &a[17], sizeof eps);
  auto p = [a](int i) { return reinterpret_cast<void*>(a[i]); };
  auto i32 = [a](int i) { return static_cast<int>(a[i]); };
  return ok_norm_fwd(p(0), a[1], i32(2), p(3), a[4], i32(5), p(6), p(7), p(8), i32(9), p(10), i32(11), p(12), p(13),
                     i32(14), a[15], a[16], eps, i32(18), i32(19));
}

int ok_norm_bwd_packed(const int64_t* a) {
  auto p = [a](int i) { return reinterpret_cast<void*>(a[i]); };
  auto i32 = [a](int i) { return static_cast<int>(a[i]); };
  return ok_norm_bwd(p(0), a[1], i32(2), p(3), a[4], i32(5), p(6), p(7), p(8), p(9), a[10], i32(11), p(12), i32(13),
                     p(14), p(15), a[16], a[17], i32(18), i32(19), i32(20));
}

}  // extern "C"
