// Rotary position embedding of q and k on the CPU in one pass ("rotate half" convention), forward and
// its transpose (the backward): one C++ call for both tensors, so a call replays whole (shared.replay)
// instead of as a program of aten ops.
//
// Plain C++17 + OpenMP, no torch headers; openkernels.shared.cpu_build compiles it on first use.
// Semantics: reference.apply_rotary_fwd / apply_rotary_bwd. With h = R / 2, tables c = cos, s = sin of
// row (b, t): out[:h] = x1 c1 - x2 s1, out[h:R] = x2 c2 + x1 s2, out[R:] = x[R:]; the transpose uses
// (-s2, -s1) for (s1, s2). Math in float32, rounded once to x's dtype.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "openkernels_cpu.h"

namespace {

enum Dtype : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

int64_t element_bytes(int dtype) { return dtype == kF32 ? 4 : 2; }


struct Side {  // q or k: (B, S, H, D) input with a unit last stride, contiguous output
  const char* x;
  int64_t sb, ss, sh;  // bytes
  char* out;
  int64_t H;
};

struct Problem {
  Side q, k;
  const char *cos, *sin;
  int64_t tb, ts;  // table strides in bytes: per batch (0: broadcast), per token
  int64_t B, S, D, R;
  int x_dtype, t_dtype;
  bool transpose;
};

// Rotates the heads of token (b, t) of one side; c, s: the token's tables (R floats each).
void rotate_token(const Problem& P, const Side& side, int64_t b, int64_t t, const float* c, const float* s,
                  std::vector<float>& x, std::vector<float>& y) {
  const int64_t D = P.D, h = P.R / 2, xe = element_bytes(P.x_dtype);
  for (int64_t head = 0; head < side.H; ++head) {
    row_to_float(side.x + b * side.sb + t * side.ss + head * side.sh, P.x_dtype, x.data(), D);
    const float* x1 = x.data();
    const float* x2 = x.data() + h;
    float* y1 = y.data();
    float* y2 = y.data() + h;
    if (!P.transpose) {
      for (int64_t i = 0; i < h; ++i) {
        y1[i] = x1[i] * c[i] - x2[i] * s[i];
        y2[i] = x2[i] * c[h + i] + x1[i] * s[h + i];
      }
    } else {
      for (int64_t i = 0; i < h; ++i) {
        y1[i] = x1[i] * c[i] + x2[i] * s[h + i];
        y2[i] = x2[i] * c[h + i] - x1[i] * s[i];
      }
    }
    for (int64_t i = P.R; i < D; ++i) y[size_t(i)] = x[size_t(i)];
    row_from_float(y.data(), P.x_dtype, side.out + ((b * P.S + t) * side.H + head) * D * xe, D);
  }
}

int run(const Problem& P, int num_threads) {
  const int64_t tokens = P.B * P.S;
  const bool parallel = num_threads > 1 && tokens * (P.q.H + P.k.H) * P.D >= (1 << 16);
#pragma omp parallel num_threads(parallel ? num_threads : 1) if (parallel)
  {
    std::vector<float> x(size_t(P.D)), y(size_t(P.D)), c(size_t(P.R)), s(size_t(P.R));
#pragma omp for schedule(static)
    for (int64_t token = 0; token < tokens; ++token) {
      const int64_t b = token / P.S, t = token % P.S;
      row_to_float(P.cos + b * P.tb + t * P.ts, P.t_dtype, c.data(), P.R);
      row_to_float(P.sin + b * P.tb + t * P.ts, P.t_dtype, s.data(), P.R);
      rotate_token(P, P.q, b, t, c.data(), s.data(), x, y);
      rotate_token(P, P.k, b, t, c.data(), s.data(), x, y);
    }
  }
  return 0;
}

}  // namespace

extern "C" {

// q (B, S, Hq, D), k (B, S, Hk, D): strides in elements, unit last stride; outputs contiguous, of the
// inputs' dtype. cos, sin (Bc, S, R) of one dtype with a unit last stride (batch stride 0: one table for
// every sequence). R even, 0 < R <= D. Returns 0, or 1 for malformed arguments.
int ok_rotary(const void* q, int64_t q_sb, int64_t q_ss, int64_t q_sh, int64_t Hq, void* q_out, const void* k,
              int64_t k_sb, int64_t k_ss, int64_t k_sh, int64_t Hk, void* k_out, const void* cos, const void* sin,
              int64_t t_sb, int64_t t_ss, int64_t B, int64_t S, int64_t D, int64_t R, int x_dtype, int t_dtype,
              int transpose, int num_threads) {
  if (B < 0 || S < 0 || Hq < 0 || Hk < 0 || R <= 0 || R % 2 || R > D || x_dtype < 0 || x_dtype > 2 || t_dtype < 0 ||
      t_dtype > 2)
    return 1;
  const int64_t xe = element_bytes(x_dtype), te = element_bytes(t_dtype);
  Problem P;
  P.q = Side{static_cast<const char*>(q), q_sb * xe, q_ss * xe, q_sh * xe, static_cast<char*>(q_out), Hq};
  P.k = Side{static_cast<const char*>(k), k_sb * xe, k_ss * xe, k_sh * xe, static_cast<char*>(k_out), Hk};
  P.cos = static_cast<const char*>(cos);
  P.sin = static_cast<const char*>(sin);
  P.tb = t_sb * te;
  P.ts = t_ss * te;
  P.B = B;
  P.S = S;
  P.D = D;
  P.R = R;
  P.x_dtype = x_dtype;
  P.t_dtype = t_dtype;
  P.transpose = transpose != 0;
  return run(P, num_threads);
}

// Packed entry: every argument in one 64-bit slot, for shared.replay's C side.
int ok_rotary_packed(const int64_t* a) {
  auto p = [a](int i) { return reinterpret_cast<void*>(a[i]); };
  auto i32 = [a](int i) { return static_cast<int>(a[i]); };
  return ok_rotary(p(0), a[1], a[2], a[3], a[4], p(5), p(6), a[7], a[8], a[9], a[10], p(11), p(12), p(13), a[14],
                   a[15], a[16], a[17], a[18], a[19], i32(20), i32(21), i32(22), i32(23));
}

}  // extern "C"
