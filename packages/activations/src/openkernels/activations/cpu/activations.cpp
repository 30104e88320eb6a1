// Fused activation kernels for CPU: unary act(x), gated act(g) * l, and their backward passes.
//
// Plain C++17 + OpenMP, no torch headers; openkernels.shared.cpu_build compiles it on first use with
// -O3 -march=native. Every inner loop is straight-line code the compiler vectorizes (exp and erfc are
// written here for that: libm calls would not vectorize). Math runs in float32 and rounds once to the
// output dtype; the 16-bit GELU forwards read their float32 results from a table of every input.
// Rows may have any stride; columns are contiguous. Large float32 / bfloat16 outputs are written with
// streaming stores (AVX2 or AVX-512), which skip the read an ordinary store makes of each line it writes.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

// OK_INLINE / OK_NOINLINE, OK_STREAM, bits / from_bits, the bfloat16 and float16 conversions,
// resident(), stream_line() and fence(): shared with the other families (openkernels-shared).
#include "openkernels_cpu.h"

namespace {

enum Dtype { kF32 = 0, kBF16 = 1, kF16 = 2 };
// Activation codes: spec.Act's values (test_codes.py checks them).
enum Act { kSilu = 0, kGelu = 1, kGeluTanh = 2, kGeluQuick = 3, kReluSquared = 4, kSigmoid = 5 };

constexpr int64_t kBlock = 512;             // f16 staging buffers (floats): a block's buffers fit in L1
constexpr int64_t kSerialBelow = 32 * 1024;  // elements; smaller calls lose more to fork/join than they gain
// Output bytes from which stores bypass the cache (streaming stores). An ordinary store first reads the
// line it writes (read-for-ownership): a unary op moves 3 bytes for the 2 it needs, a gated forward 4
// for 3. An output this large does not stay in a 32 MB L3 for the next op anyway; smaller ones do, and
// the next op reading them from cache gains more than streaming saves (measured from 2 to 16 MB).
constexpr int64_t kStreamFrom = int64_t(32) << 20;

// abs_min, clamp_abs and exp_sum / exp_ come from openkernels_cpu.h (the attention decode kernel
// uses them too).

// s = sigmoid(z) = 1 / (1 + e), e = exp(-z), and its complement 1 - s = e s, both without cancellation
// (1 - s would lose all digits for z >> 0). For z << 0, e overflows to inf and s to 0, not NaN.
OK_INLINE void sigmoid(float z, float& s, float& sc) {
  float e = exp_(-z);
  s = 1.0f / (1.0f + e);
  sc = z > 0.0f ? e * s : 1.0f - s;
}

// Phi(-a) (the standard normal CDF) and exp(-a^2/2) for 0 <= a <= 15, about 3e-7 relative down to where
// exp flushes (a > 13.2: 0, the exact values are subnormal). With z = a / sqrt(2): Phi(-a) = erfc(z) / 2
// = exp(-z^2) t Q(t), t = 1 / (1 + z/2), Q of degree 8 fitted to erfcx(z) / (2t) on z in [0, 10.7]
// (iteratively reweighted least squares on the relative error: 4e-8; Q(0) = 1 / (4 sqrt(pi)) gives
// the right asymptote). The exponent z^2 = a^2/2 reaches 88, where one fp32 rounding would cost 4e-6
// relative, so it is kept as an exact hi + lo pair (FMA gives the rounding error of a*a).
OK_INLINE void normal_tail(float a, float& tail, float& gauss) {
  float aa = a * a;
  gauss = exp_sum(-0.5f * aa, -0.5f * std::fma(a, a, -aa));
  float t = 1.0f / std::fma(0.353553391f, a, 1.0f);
  float q = -0.0296071031f;
  q = std::fma(q, t, 0.142642367f);
  q = std::fma(q, t, -0.244335989f);
  q = std::fma(q, t, 0.139877078f);
  q = std::fma(q, t, -0.013894916f);
  q = std::fma(q, t, 0.101590147f);
  q = std::fma(q, t, 0.121489424f);
  q = std::fma(q, t, 0.141196252f);
  q = std::fma(q, t, 0.141042718f);
  tail = gauss * t * q;
}

// v, or x itself when x is NaN: exp_ turns NaN into a number, and sigmoid has no final product by x to
// carry it. Integer masks, as for GELU's Phi below, rather than a float select.
OK_INLINE float keep_nan(float x, float v) {
  const uint32_t nan = uint32_t(int32_t(0x7f800000u - (bits(x) & 0x7fffffffu)) >> 31);  // all ones for NaN
  return from_bits((bits(v) & ~nan) | (bits(x) & nan));
}

// f = act(x) and df = act'(x). Callers that use one of them let the compiler drop the other.
// Clamped copies xc of x keep x^2 finite where the result no longer depends on x; each result ends
// with a product by x itself, which carries NaN (and gives NaN at x = +-inf where the reference does),
// or, for sigmoid, passes x's NaN through keep_nan.
template <int A>
OK_INLINE void act_both(float x, float& f, float& df) {
  if constexpr (A == kSilu || A == kGeluQuick) {
    const float k = A == kSilu ? 1.0f : 1.702f;  // x sigmoid(k x)
    float s, sc;
    sigmoid(k * x, s, sc);
    f = x * s;
    df = s + x * (k * s * sc);
  } else if constexpr (A == kGelu) {  // x Phi(x)
    float tail, gauss;  // Phi(-|x|), exp(-x^2/2)
    normal_tail(abs_min(x, 15.0f), tail, gauss);
    // Phi(x) = tail for x < 0, else 1 - tail, selected on the sign bit with integer masks: GCC 12
    // treats the float select `x < 0 ? a : b` here as control flow and left every GELU loop scalar.
    uint32_t neg = uint32_t(int32_t(bits(x)) >> 31);  // all ones when the sign bit is set
    float cdf = from_bits((bits(tail) & neg) | (bits(1.0f - tail) & ~neg));
    f = x * cdf;
    df = cdf + x * (0.398942280f * gauss);  // Phi(x) + x phi(x)
  } else if constexpr (A == kGeluTanh) {
    // 0.5 (1 + tanh(u)) = sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3); 1 - tanh(u)^2 = 4 s (1 - s).
    const float c1 = 1.59576912f, c3 = 0.0713548162f;  // 2 sqrt(2/pi), 2 sqrt(2/pi) 0.044715
    float xc = clamp_abs(x, 20.0f);  // beyond, s is exactly 0 or 1 in fp32
    float x2 = xc * xc;
    float s, sc;
    sigmoid(xc * std::fma(c3, x2, c1), s, sc);
    f = x * s;
    df = s + x * (s * sc * std::fma(3.0f * c3, x2, c1));
  } else if constexpr (A == kReluSquared) {  // relu(x)^2; `x < 0 ? 0 : x` keeps NaN
    float r = x < 0.0f ? 0.0f : x;
    f = r * r;
    df = 2.0f * r;
  } else if constexpr (A == kSigmoid) {  // s = sigmoid(x), s' = s (1 - s)
    float s, sc;
    sigmoid(x, s, sc);
    f = keep_nan(x, s);
    df = keep_nan(x, s * sc);
  } else {
    static_assert(A != A, "unknown activation code (spec.Act)");
  }
}

template <int A>
OK_INLINE float act(float x) {
  float f, df;
  act_both<A>(x, f, df);
  return f;
}

template <int A>
OK_INLINE float act_grad(float x) {
  float f, df;
  act_both<A>(x, f, df);
  return df;
}

// ---- dtypes. f32 and bf16 convert inline, inside the vectorized loops. F16C's conversions do not
// auto-vectorize from scalar code, so f16 rows go through float buffers and the f32 loops ----

template <int D>
struct Elem;

template <>
struct Elem<kF32> {
  using T = float;
  static OK_INLINE float load(float v) { return v; }
  static OK_INLINE float store(float v) { return v; }
};

template <>
struct Elem<kBF16> {
  using T = uint16_t;
  static OK_INLINE float load(uint16_t h) { return bf16_load(h); }
  static OK_INLINE uint16_t store(float v) { return bf16_store(v); }  // nearest even, NaN stays NaN
};

template <>
struct Elem<kF16> {
  using T = uint16_t;
};

// ---- streaming stores ----

// y[i] = f(i) for i in [0, m): ordinary stores, or (NT) streaming ones, for which y is 64-byte aligned and
// m a whole number of lines. Each line is computed into v (a register once vectorized), then streamed.
template <bool NT, class U, class F>
OK_INLINE void put(U* __restrict y, int64_t m, F&& f) {
  if constexpr (NT) {
    constexpr int kLine = 64 / sizeof(U);
    for (int64_t i = 0; i < m; i += kLine) {
      alignas(64) U v[kLine];
#pragma GCC unroll 1  // left a loop for the vectorizer: fully unrolled, relu^2's select stays scalar
      for (int k = 0; k < kLine; ++k) v[k] = f(i + k);
      stream_line(y + i, v);
    }
  } else {
    for (int64_t i = 0; i < m; ++i) y[i] = f(i);
  }
}

// Runs body(c0, c1, nt) on the parts of the row segment y[0, m): with streaming, its whole 64-byte lines
// with nt = std::true_type and the partial lines at either end with ordinary stores; else all of it.
template <class U, class F>
OK_INLINE void split_lines(bool stream, const U* y, int64_t m, F&& body) {
  constexpr int64_t kLine = 64 / sizeof(U);
  int64_t a = m, b = m;  // [a, b): the whole lines
  if (stream) {
    a = std::min(m, int64_t(-reinterpret_cast<uintptr_t>(y) & 63) / int64_t(sizeof(U)));
    b = a + (m - a) / kLine * kLine;
  }
  if (a > 0) body(int64_t(0), a, std::false_type{});
  if (b > a) body(a, b, std::true_type{});
  if (m > b) body(b, m, std::false_type{});
}

// ---- the four ops. Each has `loop<D, A, NT>` over one contiguous run of elements (D: f32 or bf16; NT:
// streaming stores) and `tile<D, A>`, which runs it on the row segment [c0, c1) of the output columns ----

struct Job {
  const void* x;
  int64_t x_stride;
  const void* dy;
  int64_t dy_stride;
  void* out;  // out (forward) or grad_in (backward), contiguous
  int64_t out_stride;
  int64_t g_off, l_off;  // gated: column offsets of the activated half g and the linear half l
  bool stream;           // f32 / bf16 outputs through streaming stores (set by run_tiles)
};

template <int D>
using T = typename Elem<D>::T;

template <int D>
OK_INLINE const T<D>* row(const void* base, int64_t r, int64_t stride) {
  return static_cast<const T<D>*>(base) + r * stride;
}

template <int D>
OK_INLINE T<D>* row(void* base, int64_t r, int64_t stride) {
  return static_cast<T<D>*>(base) + r * stride;
}

struct UnaryFwd {  // y = act(x)
  template <int D, int A, bool NT = false>
  OK_NOINLINE static void loop(const T<D>* __restrict x, T<D>* __restrict y, int64_t m) {
    using E = Elem<D>;
    put<NT>(y, m, [&](int64_t i) { return E::store(act<A>(E::load(x[i]))); });
  }

  // A 16-bit x takes one of 65536 values, so act(x) can be read from a table of all of them, filled on
  // first use by the float32 loop: the same results as computing them. A lookup costs about as much as
  // a sigmoid, so only the GELUs (erfc; cubic and sigmoid) use it.
  template <int D, int A>
  static const float* table() {
    static const float* values = [] {
      float* x = new float[65536];
      float* y = new float[65536];
      for (uint32_t h = 0; h < 65536; ++h) {
        const uint16_t code = uint16_t(h);
        if constexpr (D == kBF16) x[h] = Elem<kBF16>::load(code);
        else f16_to_float(&code, x + h, 1);
      }
      loop<kF32, A>(x, y, 65536);
      delete[] x;
      return y;
    }();
    return values;
  }
  template <int D, bool NT = false>  // D: the output, bf16 or f32 (an f16 staging buffer)
  OK_NOINLINE static void lookup(const float* __restrict table, const uint16_t* __restrict x, T<D>* __restrict y,
                                 int64_t m) {
    put<NT>(y, m, [&](int64_t i) { return Elem<D>::store(table[x[i]]); });
  }

  template <int D, int A>
  static void tile(const Job& j, int64_t r, int64_t c0, int64_t c1) {
    const T<D>* x = row<D>(j.x, r, j.x_stride) + c0;
    T<D>* y = row<D>(j.out, r, j.out_stride) + c0;
    if constexpr (D == kF32 || (A != kGelu && A != kGeluTanh)) {
      if constexpr (D == kF16) {
        alignas(64) float xb[kBlock], yb[kBlock];
        for (int64_t c = 0; c < c1 - c0; c += kBlock) {
          const int64_t m = std::min(kBlock, c1 - c0 - c);
          f16_to_float(x + c, xb, m);
          loop<kF32, A>(xb, yb, m);
          float_to_f16(yb, y + c, m);
        }
      } else {
        split_lines(j.stream, y, c1 - c0, [&](int64_t a, int64_t b, auto nt) {
          loop<D, A, decltype(nt)::value>(x + a, y + a, b - a);
        });
      }
    } else if constexpr (D == kBF16) {
      split_lines(j.stream, y, c1 - c0, [&](int64_t a, int64_t b, auto nt) {
        lookup<kBF16, decltype(nt)::value>(table<D, A>(), x + a, y + a, b - a);
      });
    } else {
      alignas(64) float yb[kBlock];
      for (int64_t c = 0; c < c1 - c0; c += kBlock) {
        const int64_t m = std::min(kBlock, c1 - c0 - c);
        lookup<kF32>(table<D, A>(), x + c, yb, m);
        float_to_f16(yb, y + c, m);
      }
    }
  }
};

// Tile body shared by the two-input, one-output ops (unary backward, gated forward): fp16
// goes through float staging blocks (F16C conversions), the other dtypes run Op's loop in
// place, streaming whole cache lines when `stream` is set.
template <class Op, int D, int A>
static void two_in_one_out(bool stream, const T<D>* a, const T<D>* b, T<D>* out, int64_t n) {
  if constexpr (D == kF16) {
    alignas(64) float ab[kBlock], bb[kBlock], ob[kBlock];
    for (int64_t c = 0; c < n; c += kBlock) {
      const int64_t m = std::min(kBlock, n - c);
      f16_to_float(a + c, ab, m);
      f16_to_float(b + c, bb, m);
      Op::template loop<kF32, A>(ab, bb, ob, m);
      float_to_f16(ob, out + c, m);
    }
  } else {
    split_lines(stream, out, n, [&](int64_t lo, int64_t hi, auto nt) {
      Op::template loop<D, A, decltype(nt)::value>(a + lo, b + lo, out + lo, hi - lo);
    });
  }
}

struct UnaryBwd {  // dx = dy act'(x)
  template <int D, int A, bool NT = false>
  OK_NOINLINE static void loop(const T<D>* __restrict dy, const T<D>* __restrict x, T<D>* __restrict dx, int64_t m) {
    using E = Elem<D>;
    put<NT>(dx, m, [&](int64_t i) { return E::store(E::load(dy[i]) * act_grad<A>(E::load(x[i]))); });
  }
  template <int D, int A>
  static void tile(const Job& j, int64_t r, int64_t c0, int64_t c1) {
    const T<D>* dy = row<D>(j.dy, r, j.dy_stride) + c0;
    const T<D>* x = row<D>(j.x, r, j.x_stride) + c0;
    T<D>* dx = row<D>(j.out, r, j.out_stride) + c0;
    two_in_one_out<UnaryBwd, D, A>(j.stream, dy, x, dx, c1 - c0);
  }
};

struct GatedFwd {  // y = act(g) l
  template <int D, int A, bool NT = false>
  OK_NOINLINE static void loop(const T<D>* __restrict g, const T<D>* __restrict l, T<D>* __restrict y, int64_t m) {
    using E = Elem<D>;
    put<NT>(y, m, [&](int64_t i) { return E::store(act<A>(E::load(g[i])) * E::load(l[i])); });
  }
  template <int D, int A>
  static void tile(const Job& j, int64_t r, int64_t c0, int64_t c1) {
    const T<D>* g = row<D>(j.x, r, j.x_stride) + j.g_off + c0;
    const T<D>* l = row<D>(j.x, r, j.x_stride) + j.l_off + c0;
    T<D>* y = row<D>(j.out, r, j.out_stride) + c0;
    two_in_one_out<GatedFwd, D, A>(j.stream, g, l, y, c1 - c0);
  }
};

struct GatedBwd {  // dg = dy l act'(g), dl = dy act(g)
  template <int D, int A, bool NT = false>
  OK_NOINLINE static void loop(const T<D>* __restrict dy, const T<D>* __restrict g, const T<D>* __restrict l,
                   T<D>* __restrict dg, T<D>* __restrict dl, int64_t m) {
    using E = Elem<D>;
    auto both = [&](int64_t i, T<D>& dgi, T<D>& dli) {
      float f, df;
      act_both<A>(E::load(g[i]), f, df);
      const float y = E::load(dy[i]);
      dgi = E::store(y * E::load(l[i]) * df);
      dli = E::store(y * f);
    };
    if constexpr (NT) {  // put() with two outputs
      constexpr int kLine = 64 / sizeof(T<D>);
      for (int64_t i = 0; i < m; i += kLine) {
        alignas(64) T<D> vg[kLine], vl[kLine];
#pragma GCC unroll 1  // as in put()
        for (int k = 0; k < kLine; ++k) both(i + k, vg[k], vl[k]);
        stream_line(dg + i, vg);
        stream_line(dl + i, vl);
      }
    } else {
      for (int64_t i = 0; i < m; ++i) both(i, dg[i], dl[i]);
    }
  }
  template <int D, int A>
  static void tile(const Job& j, int64_t r, int64_t c0, int64_t c1) {
    const T<D>* dy = row<D>(j.dy, r, j.dy_stride) + c0;
    const T<D>* g = row<D>(j.x, r, j.x_stride) + j.g_off + c0;
    const T<D>* l = row<D>(j.x, r, j.x_stride) + j.l_off + c0;
    T<D>* dg = row<D>(j.out, r, j.out_stride) + j.g_off + c0;
    T<D>* dl = row<D>(j.out, r, j.out_stride) + j.l_off + c0;
    if constexpr (D == kF16) {
      alignas(64) float yb[kBlock], gb[kBlock], lb[kBlock], dgb[kBlock], dlb[kBlock];
      for (int64_t c = 0; c < c1 - c0; c += kBlock) {
        const int64_t m = std::min(kBlock, c1 - c0 - c);
        f16_to_float(dy + c, yb, m);
        f16_to_float(g + c, gb, m);
        f16_to_float(l + c, lb, m);
        loop<kF32, A>(yb, gb, lb, dgb, dlb, m);
        float_to_f16(dgb, dg + c, m);
        float_to_f16(dlb, dl + c, m);
      }
    } else {
      // The lines split on dg's alignment; dl streams too only where it has the same alignment.
      const bool stream = j.stream && (j.l_off - j.g_off) * int64_t(sizeof(T<D>)) % 64 == 0;
      split_lines(stream, dg, c1 - c0, [&](int64_t a, int64_t b, auto nt) {
        loop<D, A, decltype(nt)::value>(dy + a, g + a, l + a, dg + a, dl + a, b - a);
      });
    }
  }
};

// Runs Op::tile<D, A> over rows x column chunks. Rows are the unit of work; with fewer than 4 rows per
// thread, rows are also split into column chunks (multiples of 64 elements, at least ~kBlock wide).
template <class Op, int D, int A>
void run_tiles(Job j, int64_t rows, int64_t cols, int num_threads) {
  int64_t chunks = 1;
  const int64_t want = 4 * int64_t(num_threads);
  if (num_threads > 1 && rows < want) chunks = std::min((want + rows - 1) / rows, (cols + kBlock - 1) / kBlock);
  const int64_t width = ((cols + chunks - 1) / chunks + 63) / 64 * 64;
  chunks = (cols + width - 1) / width;
  const int64_t tiles = rows * chunks;
  const bool parallel = num_threads > 1 && tiles > 1 && rows * cols >= kSerialBelow;
#if defined(OK_STREAM)
  const int64_t bytes = rows * j.out_stride * int64_t(sizeof(T<D>));
  j.stream = D != kF16 && bytes >= kStreamFrom && resident(static_cast<char*>(j.out) + bytes - 1);
#endif
#pragma omp parallel num_threads(num_threads) if (parallel)
  {
#pragma omp for schedule(static) nowait
    for (int64_t t = 0; t < tiles; ++t) {
      const int64_t r = t / chunks, c0 = (t % chunks) * width;
      Op::template tile<D, A>(j, r, c0, std::min(cols, c0 + width));
    }
    fence(j.stream);  // streaming stores are weakly ordered: complete them before the region ends
  }
}

template <class Op, int D>
int dispatch_act(const Job& j, int64_t rows, int64_t cols, int act, int num_threads) {
  switch (act) {
    case kSilu: run_tiles<Op, D, kSilu>(j, rows, cols, num_threads); return 0;
    case kGelu: run_tiles<Op, D, kGelu>(j, rows, cols, num_threads); return 0;
    case kGeluTanh: run_tiles<Op, D, kGeluTanh>(j, rows, cols, num_threads); return 0;
    case kGeluQuick: run_tiles<Op, D, kGeluQuick>(j, rows, cols, num_threads); return 0;
    case kReluSquared: run_tiles<Op, D, kReluSquared>(j, rows, cols, num_threads); return 0;
    case kSigmoid: run_tiles<Op, D, kSigmoid>(j, rows, cols, num_threads); return 0;
  }
  return -1;
}

// Returns 0, or -1 for an unknown dtype or activation code.
template <class Op>
int dispatch(const Job& j, int64_t rows, int64_t cols, int dtype, int act, int num_threads) {
  switch (dtype) {
    case kF32: return dispatch_act<Op, kF32>(j, rows, cols, act, num_threads);
    case kBF16: return dispatch_act<Op, kBF16>(j, rows, cols, act, num_threads);
    case kF16: return dispatch_act<Op, kF16>(j, rows, cols, act, num_threads);
  }
  return -1;
}

}  // namespace

// Strides are in elements; out / grad_in are contiguous. Gated ops: x has 2d columns, halves
// a = x[:, :d], b = x[:, d:]; act_first != 0 activates a, else b. Each returns 0, or -1 for a bad code.
extern "C" {

int ok_unary_fwd(const void* x, int64_t x_stride, void* out, int64_t rows, int64_t n, int dtype, int act,
                 int num_threads) {
  const Job j{x, x_stride, nullptr, 0, out, n, 0, 0, false};
  return dispatch<UnaryFwd>(j, rows, n, dtype, act, num_threads);
}

int ok_unary_bwd(const void* dy, int64_t dy_stride, const void* x, int64_t x_stride, void* dx, int64_t rows,
                 int64_t n, int dtype, int act, int num_threads) {
  const Job j{x, x_stride, dy, dy_stride, dx, n, 0, 0, false};
  return dispatch<UnaryBwd>(j, rows, n, dtype, act, num_threads);
}

int ok_gated_fwd(const void* x, int64_t x_stride, void* out, int64_t rows, int64_t d, int dtype, int act,
                 int act_first, int num_threads) {
  const Job j{x, x_stride, nullptr, 0, out, d, act_first ? 0 : d, act_first ? d : 0, false};
  return dispatch<GatedFwd>(j, rows, d, dtype, act, num_threads);
}

int ok_gated_bwd(const void* dy, int64_t dy_stride, const void* x, int64_t x_stride, void* dx, int64_t rows,
                 int64_t d, int dtype, int act, int act_first, int num_threads) {
  const Job j{x, x_stride, dy, dy_stride, dx, 2 * d, act_first ? 0 : d, act_first ? d : 0, false};
  return dispatch<GatedBwd>(j, rows, d, dtype, act, num_threads);
}

// Packed entries: every argument in one 64-bit slot, for openkernels.shared.replay's C side.
int ok_unary_fwd_packed(const int64_t* a) {
  return ok_unary_fwd(reinterpret_cast<const void*>(a[0]), a[1], reinterpret_cast<void*>(a[2]), a[3], a[4],
                      static_cast<int>(a[5]), static_cast<int>(a[6]), static_cast<int>(a[7]));
}

int ok_gated_fwd_packed(const int64_t* a) {
  return ok_gated_fwd(reinterpret_cast<const void*>(a[0]), a[1], reinterpret_cast<void*>(a[2]), a[3], a[4],
                      static_cast<int>(a[5]), static_cast<int>(a[6]), static_cast<int>(a[7]), static_cast<int>(a[8]));
}

int ok_unary_bwd_packed(const int64_t* a) {
  return ok_unary_bwd(reinterpret_cast<const void*>(a[0]), a[1], reinterpret_cast<const void*>(a[2]), a[3],
                      reinterpret_cast<void*>(a[4]), a[5], a[6], static_cast<int>(a[7]), static_cast<int>(a[8]),
                      static_cast<int>(a[9]));
}

int ok_gated_bwd_packed(const int64_t* a) {
  return ok_gated_bwd(reinterpret_cast<const void*>(a[0]), a[1], reinterpret_cast<const void*>(a[2]), a[3],
                      reinterpret_cast<void*>(a[4]), a[5], a[6], static_cast<int>(a[7]), static_cast<int>(a[8]),
                      static_cast<int>(a[9]), static_cast<int>(a[10]));
}

}  // extern "C"
