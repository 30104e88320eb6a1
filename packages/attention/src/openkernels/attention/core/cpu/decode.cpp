// Attention of a few query tokens against an unquantized KV cache on the CPU (decode), in one call:
// the lengths are read here, not on the host, so the whole call replays (shared.replay), and no
// sequence's keys are gathered into a copy first.
//
// Plain C++17 + OpenMP, no torch headers; openkernels.shared.cpu_build compiles it on first use with
// -O3 -march=native. SIMD through GCC / Clang vector extensions (8 floats), as the quant kernel does.
//
// Semantics: reference.attention_kvcache_fwd for bits 16 without rotary. Sequence b has
// L = cache_seqlens[b] + seqlen_new keys (seqlen_new alone without cache_seqlens: plain attention of
// a few query rows, cpu/__init__.py), at slots start .. start + L - 1 of its storage (start =
// leftpad[b] or 0; a paged cache maps slot s to row s % page of page block_table[b, s / page]).
// Query row i sits at position p = i + L - Sq (bottom-right aligned) and sees key j when
// p - left <= j (left >= 0) and j <= p + right (right >= 0). Score = (q . k) scale, then
// softcap * tanh(score / softcap), minus slope * |p - j|; a row that sees no key gets out 0 and
// lse -inf. Math in float32; out rounded once to q's dtype; lse natural-log float32.
// A NaN score (from q or a visible key) makes its row's out and lse NaN, as the reference's
// softmax does; values are summed for every visible key, so a NaN value reaches the rows that see it.
//
// Work: one task per (sequence, KV head, split of the keys); a task takes the query rows of every
// query head of its group (G = Hq / Hkv heads x Sq tokens), so each key and value row is read and
// converted once per task. Keys go in blocks of kKeyBlock: scores, an online softmax per row, then
// the values. Splits (flash-decoding) keep both cores busy when there are fewer tasks than threads
// times four and the sequences are long; their partial (max, sum, acc) are merged at the end.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "openkernels_cpu.h"

namespace {

enum Dtype : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

constexpr int64_t kKeyBlock = 64;       // keys per block: a block's K or V rows fit in L1/L2
constexpr int64_t kSplitKeys = 512;     // fewest keys a split takes
constexpr int64_t kSerialBelow = 1 << 16;  // multiply-adds; smaller calls lose more to fork/join

typedef float v8 __attribute__((vector_size(32)));
// The products run kLanes wide: one AVX-512 register where there is one (each instruction does
// twice the work of an AVX2 one), else 8 floats. head_dim is a multiple of 16.
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float vec __attribute__((vector_size(4 * kLanes)));

template <typename V>
OK_INLINE V load(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

OK_INLINE v8 load8(const float* p) { return load<v8>(p); }


OK_INLINE float hsum(v8 a) { return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7])); }

#if defined(__AVX512F__)  // else vec is v8
OK_INLINE float hsum(vec a) {
  v8 parts[kLanes / 8];
  std::memcpy(parts, &a, sizeof a);
  return hsum(parts[0] + parts[1]);
}
#endif

// The eight sums of v8 halves of eight accumulators at once: out[i] = sum of a[i]'s lanes (with
// AVX, three rounds of pairwise adds instead of eight separate reductions).
OK_INLINE v8 hsum8(const vec* a) {
  v8 h[8];
  for (int i = 0; i < 8; ++i) {
    v8 parts[kLanes / 8];
    std::memcpy(parts, &a[i], sizeof a[i]);
    h[i] = parts[0];
    for (int p = 1; p < kLanes / 8; ++p) h[i] += parts[p];
  }
#if defined(__AVX__)
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(__m256(h[0]), __m256(h[1])), _mm256_hadd_ps(__m256(h[2]), __m256(h[3])));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(__m256(h[4]), __m256(h[5])), _mm256_hadd_ps(__m256(h[6]), __m256(h[7])));
  return v8(_mm256_permute2f128_ps(u0, u1, 0x20)) + v8(_mm256_permute2f128_ps(u0, u1, 0x31));
#else
  v8 out;
  for (int i = 0; i < 8; ++i) out[i] = hsum(h[i]);
  return out;
#endif
}

// Keys per step of `scores`: NR x kKeys sums in registers (AVX-512: 16 of its 32; AVX2: 8 of 16).
constexpr int kKeys = kLanes == 16 ? 4 : 2;

// s[r * stride + j] = q_r . k_j for NR query rows (q: rows of D floats) and keys j < n (rows of D
// floats at keys[j]); D a multiple of kLanes. NK keys a step: NR NK independent sums hide the
// FMA latency, each loaded chunk of a key serves NR rows and each chunk of q NK keys.
template <int NR, int NK>
OK_INLINE void score_step(const float* __restrict q, const float* const* keys, int64_t D, float* __restrict s,
                          int64_t stride) {
  vec a[NK][NR] = {};
  for (int64_t d = 0; d < D; d += kLanes) {
    vec x[NK];
    for (int c = 0; c < NK; ++c) x[c] = load<vec>(keys[c] + d);
    for (int r = 0; r < NR; ++r) {
      const vec y = load<vec>(q + r * D + d);
      for (int c = 0; c < NK; ++c) a[c][r] += y * x[c];
    }
  }
  if constexpr (NR == 4 && NK % 2 == 0) {
    for (int c = 0; c < NK; c += 2) {
      const vec pair[8] = {a[c][0], a[c][1], a[c][2], a[c][3], a[c + 1][0], a[c + 1][1], a[c + 1][2], a[c + 1][3]};
      const v8 sums = hsum8(pair);
      for (int r = 0; r < 4; ++r) {
        s[r * stride + c] = sums[r];
        s[r * stride + c + 1] = sums[4 + r];
      }
    }
  } else {
    for (int c = 0; c < NK; ++c)
      for (int r = 0; r < NR; ++r) s[r * stride + c] = hsum(a[c][r]);
  }
}

template <int NR>
void scores(const float* __restrict q, const float* const* keys, int64_t n, int64_t D, float* __restrict s,
            int64_t stride) {
  int64_t j = 0;
  for (; j + kKeys <= n; j += kKeys) score_step<NR, kKeys>(q, keys + j, D, s + j, stride);
  for (; j < n; ++j) score_step<NR, 1>(q, keys + j, D, s + j, stride);
}

// Vectors of a row each value load serves: NR rows x kTile accumulators stay in registers
// (AVX-512: 4 x 4 of its 32; AVX2: 4 x 2 of its 16).
constexpr int kTile = kLanes == 16 ? 4 : 2;

// acc_r[d0 .. d0 + kLanes NV) += sum_j p_r[j] v_j[...] for NR rows (acc rows D apart, p rows
// kKeyBlock apart) over keys j < n: each loaded chunk of a value row serves the NR rows.
template <int NR, int NV>
OK_INLINE void accumulate_tile(float* __restrict acc, const float* __restrict p, const float* const* values,
                               int64_t n, int64_t d0, int64_t D) {
  vec a[NR][NV];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NV; ++t) a[r][t] = load<vec>(acc + r * D + d0 + kLanes * t);
  for (int64_t j = 0; j < n; ++j) {
    const float* v = values[j] + d0;
    vec x[NV];
    for (int t = 0; t < NV; ++t) x[t] = load<vec>(v + kLanes * t);
    for (int r = 0; r < NR; ++r) {
      const vec w = vec{} + p[r * kKeyBlock + j];
      for (int t = 0; t < NV; ++t) a[r][t] += w * x[t];
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NV; ++t) std::memcpy(acc + r * D + d0 + kLanes * t, &a[r][t], sizeof(vec));
}

// acc rows (D floats each) += sum_j p_r[j] v_j (value rows at values[j]) for NR rows; D a
// multiple of kLanes.
template <int NR>
void accumulate(float* acc, const float* p, const float* const* values, int64_t n, int64_t D) {
  int64_t d = 0;
  for (; d + kTile * kLanes <= D; d += kTile * kLanes) accumulate_tile<NR, kTile>(acc, p, values, n, d, D);
  for (; d + kLanes <= D; d += kLanes) accumulate_tile<NR, 1>(acc, p, values, n, d, D);
}

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// max of x[0 .. n) (-inf when n = 0), and whether one is NaN (the max skips NaN).
OK_INLINE float max_of(const float* x, int64_t n, bool& has_nan) {
  v8 m = {kNegInf, kNegInf, kNegInf, kNegInf, kNegInf, kNegInf, kNegInf, kNegInf};
  v8 nan = {};
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const v8 v = load8(x + j);
    nan = (v != v) ? v8{} + 1.0f : nan;
    m = v > m ? v : m;
  }
  float best = kNegInf;
  for (int t = 0; t < 8; ++t) {
    best = m[t] > best ? m[t] : best;
    has_nan |= nan[t] != 0.0f;
  }
  for (; j < n; ++j) {
    has_nan |= x[j] != x[j];
    best = x[j] > best ? x[j] : best;
  }
  return best;
}

OK_INLINE float sum_of(const float* x, int64_t n) {
  v8 a = {};
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) a += load8(x + j);
  float s = hsum(a);
  for (; j < n; ++j) s += x[j];
  return s;
}

struct Side {  // one side (K or V) of the cache
  const char* data;
  int64_t s_row, s_token, s_head;  // bytes: per sequence row (or page), per token slot, per head
};

// What the decode kernel and the short backward both take: shapes, ALiBi slopes, scale, softcap
// and window. One struct, so both entry points fill it in one statement, alike.
struct AttentionArgs {
  const float* slopes;  // (B, Hq) or null
  int64_t slopes_sb;
  int64_t B, Sq, Hq, Hkv, D;
  float scale, softcap;
  int64_t left, right;
};

struct Problem : AttentionArgs {
  const char* q;
  int64_t q_sb, q_ss, q_sh;  // bytes
  Side k, v;
  const int32_t* seqlens;      // (B,) or null: no cached tokens (plain attention over seqlen_new keys)
  const int32_t* block_table;  // (B, cols) or null: a contiguous cache
  int64_t bt_stride, bt_cols, page, rows;  // page: slots per page (or the capacity); rows: pages (or B)
  const int32_t* leftpad;
  char* out;  // (B, Sq, Hq, D) contiguous
  float* lse;  // (B, Hq, Sq) contiguous
  int64_t seqlen_new;
  int q_dtype, kv_dtype;
  int64_t elt_q, elt_kv;  // bytes per element

  int64_t length(int64_t b) const { return (seqlens ? int64_t(seqlens[b]) : 0) + seqlen_new; }
  int64_t start(int64_t b) const { return leftpad ? int64_t(leftpad[b]) : 0; }
  // The address of key/value slot s of sequence b, head h.
  const char* row(const Side& side, int64_t b, int64_t s, int64_t h) const {
    int64_t r = b, t = s;
    if (block_table) {
      r = block_table[b * bt_stride + s / page];
      t = s % page;
    }
    return side.data + r * side.s_row + t * side.s_token + h * side.s_head;
  }
};

// Every sequence's slots inside its storage and every page it reads a real page: else the call is
// refused (status 2) before anything is read or written.
bool valid(const Problem& P) {
  for (int64_t b = 0; b < P.B; ++b) {
    const int64_t len = P.length(b), start = P.start(b);
    if ((P.seqlens && P.seqlens[b] < 0) || len < 0 || start < 0) return false;
    if (!P.block_table) {
      if (start + len > P.page) return false;
      continue;
    }
    if (len == 0) continue;
    const int64_t last_page = (start + len - 1) / P.page;
    if (last_page >= P.bt_cols) return false;
    for (int64_t c = start / P.page; c <= last_page; ++c) {
      const int32_t p = P.block_table[b * P.bt_stride + c];
      if (p < 0 || p >= P.rows) return false;
    }
  }
  return true;
}

struct Partial {  // one task's rows: running max, sum of exponentials, unnormalized output
  float* m;
  float* l;
  float* acc;  // (R, D)
  uint8_t* nan;
};

struct Scratch {
  std::vector<float> q, keys, values, scores;  // keys, values: a block's rows converted to float32
  const float* key_rows[kKeyBlock];  // each key's float32 row: in the cache itself or in `keys`
  const float* value_rows[kKeyBlock];
  void size(int64_t R, int64_t D) {
    q.resize(size_t(R * D));
    keys.resize(size_t(kKeyBlock * D));
    values.resize(size_t(kKeyBlock * D));
    scores.resize(size_t(R * kKeyBlock));
  }
};

// The float32 rows of slots s0 .. s0 + n - 1 of one side for head h: float32 caches are read in
// place (a copy would move the whole cache through memory once more), the others converted into buf.
void rows_of(const Problem& P, const Side& side, int64_t b, int64_t s0, int64_t h, int64_t n, float* buf,
             const float** rows) {
  for (int64_t j = 0; j < n; ++j) {
    const char* src = P.row(side, b, s0 + j, h);
    if (P.kv_dtype == kF32) {
      rows[j] = reinterpret_cast<const float*>(src);
    } else {
      row_to_float(src, P.kv_dtype, buf + j * P.D, P.D);
      rows[j] = buf + j * P.D;
    }
  }
}

void prefetch_rows(const Problem& P, int64_t b, int64_t s0, int64_t h, int64_t n) {
  const int64_t bytes = P.D * P.elt_kv;
  for (int64_t j = 0; j < n; ++j) {
    const char* k = P.row(P.k, b, s0 + j, h);
    const char* v = P.row(P.v, b, s0 + j, h);
    for (int64_t o = 0; o < bytes; o += 64) {
      __builtin_prefetch(k + o);
      __builtin_prefetch(v + o);
    }
  }
}

// Keys [k0, k1) of sequence b for the rows of KV head h; `out` starts empty (m -inf, l 0, acc 0).
void attend(const Problem& P, int64_t b, int64_t h, int64_t k0, int64_t k1, Scratch& S, const Partial& out) {
  const int64_t G = P.Hq / P.Hkv, R = G * P.Sq, D = P.D, L = P.length(b), start = P.start(b);
  float* qf = S.q.data();
  for (int64_t g = 0; g < G; ++g)
    for (int64_t i = 0; i < P.Sq; ++i)
      row_to_float(P.q + b * P.q_sb + i * P.q_ss + (h * G + g) * P.q_sh, P.q_dtype, qf + (g * P.Sq + i) * D, D);
  for (int64_t j0 = k0; j0 < k1; j0 += kKeyBlock) {
    const int64_t n = std::min(kKeyBlock, k1 - j0);
    // A head's rows are Hkv * D elements apart (often a page or more): the hardware prefetchers do
    // not follow them, so the next block's rows are asked for while this one computes.
    prefetch_rows(P, b, start + j0 + n, h, std::min(kKeyBlock, k1 - j0 - n));
    rows_of(P, P.k, b, start + j0, h, n, S.keys.data(), S.key_rows);
    float* sc = S.scores.data();
    // Keys past the last one a group of rows sees (a causal or right window) are not computed:
    // the mask below overwrites their scores and their p is 0.
    auto seen = [&](int64_t r0, int64_t nr) {
      if (P.right < 0) return n;
      int64_t last = 0;
      for (int64_t r = r0; r < r0 + nr; ++r) last = std::max(last, r % P.Sq + L - P.Sq + P.right + 1 - j0);
      return std::max<int64_t>(0, std::min(n, last));
    };
    int64_t r0 = 0;
    for (; r0 + 4 <= R; r0 += 4) scores<4>(qf + r0 * D, S.key_rows, seen(r0, 4), D, sc + r0 * kKeyBlock, kKeyBlock);
    for (; r0 < R; ++r0) scores<1>(qf + r0 * D, S.key_rows, seen(r0, 1), D, sc + r0 * kKeyBlock, kKeyBlock);
    for (int64_t r = 0; r < R; ++r) {
      const int64_t g = r / P.Sq, i = r % P.Sq, pos = i + L - P.Sq;
      const int64_t lo = P.left >= 0 ? pos - P.left : std::numeric_limits<int64_t>::min();
      const int64_t hi = P.right >= 0 ? pos + P.right : std::numeric_limits<int64_t>::max();
      const float slope = P.slopes ? P.slopes[b * P.slopes_sb + h * G + g] : 0.0f;
      float* s = sc + r * kKeyBlock;
      // The row's visible keys of the block: [jlo, jhi).
      const int64_t jlo = lo <= j0 ? 0 : std::min(n, lo - j0);
      const int64_t jhi = hi >= j0 + n - 1 ? n : std::max(jlo, hi - j0 + 1);
      for (int64_t j = 0; j < jlo; ++j) s[j] = kNegInf;
      for (int64_t j = jhi; j < n; ++j) s[j] = kNegInf;
      for (int64_t j = jlo; j < jhi; ++j) s[j] *= P.scale;
      if (P.softcap > 0)
        for (int64_t j = jlo; j < jhi; ++j) s[j] = P.softcap * std::tanh(s[j] / P.softcap);
      if (P.slopes)
        for (int64_t j = jlo; j < jhi; ++j) s[j] -= slope * float(std::abs(pos - (j0 + j)));
      bool has_nan = false;
      const float block_max = max_of(s + jlo, jhi - jlo, has_nan);
      if (has_nan) out.nan[r] = 1;
      const float m_new = std::max(out.m[r], block_max);
      if (m_new == kNegInf) {  // nothing visible yet: p = 0 everywhere
        for (int64_t j = 0; j < n; ++j) s[j] = 0.0f;
        continue;
      }
      // exp_ of -inf (a hidden key; the old max on the first visible block) is 0.
      const float alpha = exp_(out.m[r] - m_new);
      float sum;
      for (int64_t j = 0; j < n; ++j) s[j] = exp_(s[j] - m_new);
      sum = sum_of(s, n);
      out.l[r] = out.l[r] * alpha + sum;
      out.m[r] = m_new;
      if (alpha != 1.0f) {
        float* a = out.acc + r * D;
        for (int64_t d = 0; d < D; ++d) a[d] *= alpha;
      }
    }
    rows_of(P, P.v, b, start + j0, h, n, S.values.data(), S.value_rows);
    r0 = 0;
    for (; r0 + 4 <= R; r0 += 4) accumulate<4>(out.acc + r0 * D, sc + r0 * kKeyBlock, S.value_rows, seen(r0, 4), D);
    for (; r0 < R; ++r0) accumulate<1>(out.acc + r0 * D, sc + r0 * kKeyBlock, S.value_rows, seen(r0, 1), D);
  }
}

// The keys any row of a task sees: [lo, hi) within [0, L).
void visible_keys(const Problem& P, int64_t L, int64_t& lo, int64_t& hi) {
  const int64_t first = L - P.Sq, last = L - 1;  // positions of rows 0 and Sq - 1
  lo = P.left >= 0 ? std::max<int64_t>(0, first - P.left) : 0;
  hi = P.right >= 0 ? std::min<int64_t>(L, last + P.right + 1) : L;
  if (hi < lo) hi = lo;
}

int run(const Problem& P, int num_threads) {
  if (!valid(P)) return 2;
  const int64_t G = P.Hq / P.Hkv, R = G * P.Sq, D = P.D;
  int64_t max_len = 0, total = 0;
  for (int64_t b = 0; b < P.B; ++b) {
    max_len = std::max(max_len, P.length(b));
    total += P.length(b);
  }
  const int64_t units = P.B * P.Hkv;
  const bool parallel = num_threads > 1 && total * P.Hq * P.Sq * D >= kSerialBelow;
  const int threads = parallel ? num_threads : 1;
  int64_t splits = 1;
  if (units < 4 * threads) splits = std::max<int64_t>(1, std::min((4 * threads + units - 1) / units, max_len / kSplitKeys));
  const int64_t chunk = std::max<int64_t>(1, (max_len + splits - 1) / splits);
  const int64_t tasks = units * splits;
  std::vector<float> m(size_t(tasks * R), kNegInf), l(size_t(tasks * R), 0.0f), acc(size_t(tasks * R * D), 0.0f);
  std::vector<uint8_t> nan(size_t(tasks * R), 0);
#pragma omp parallel num_threads(threads) if (parallel)
  {
    Scratch S;
    S.size(R, D);
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < tasks; ++t) {
      const int64_t unit = t / splits, split = t % splits, b = unit / P.Hkv, h = unit % P.Hkv;
      int64_t lo, hi;
      visible_keys(P, P.length(b), lo, hi);
      lo = std::max(lo, split * chunk);
      hi = std::min(hi, (split + 1) * chunk);
      const Partial part{m.data() + t * R, l.data() + t * R, acc.data() + t * R * D, nan.data() + t * R};
      if (lo < hi) attend(P, b, h, lo, hi, S, part);
    }
  }
  // Merge the splits of each row and write it.
  std::vector<float> row(static_cast<size_t>(D));
  for (int64_t unit = 0; unit < units; ++unit) {
    const int64_t b = unit / P.Hkv, h = unit % P.Hkv;
    for (int64_t r = 0; r < R; ++r) {
      const int64_t g = r / P.Sq, i = r % P.Sq, hq = h * G + g;
      float M = kNegInf;
      bool is_nan = false;
      for (int64_t s = 0; s < splits; ++s) {
        const int64_t t = unit * splits + s;
        M = std::max(M, m[size_t(t * R + r)]);
        is_nan |= nan[size_t(t * R + r)] != 0;
      }
      float total_l = 0.0f;
      std::fill(row.begin(), row.end(), 0.0f);
      if (M != kNegInf) {
        for (int64_t s = 0; s < splits; ++s) {
          const int64_t t = unit * splits + s;
          const float ms = m[size_t(t * R + r)];
          if (ms == kNegInf) continue;
          const float w = exp_(ms - M);
          total_l += l[size_t(t * R + r)] * w;
          const float* a = acc.data() + (t * R + r) * D;
          for (int64_t d = 0; d < D; ++d) row[size_t(d)] += w * a[d];
        }
      }
      float lse = kNegInf;
      if (is_nan) {
        std::fill(row.begin(), row.end(), std::numeric_limits<float>::quiet_NaN());
        lse = std::numeric_limits<float>::quiet_NaN();
      } else if (total_l > 0.0f) {
        const float inv = 1.0f / total_l;
        for (int64_t d = 0; d < D; ++d) row[size_t(d)] *= inv;
        lse = M + std::log(total_l);
      }
      row_from_float(row.data(), P.q_dtype, P.out + ((b * P.Sq + i) * P.Hq + hq) * D * P.elt_q, D);
      P.lse[(b * P.Hq + hq) * P.Sq + i] = lse;
    }
  }
  return 0;
}

int64_t element_bytes(int dtype) { return dtype == kF32 ? 4 : 2; }

// ---- backward of plain attention with few query rows per KV head (no cache)
//
// One task per (sequence, KV head) owns the rows of its query heads (R = G x Sq <= kKeyBlock) and
// every key of its head, so dk and dv of a key are complete after one pass over the rows: no
// accumulation across tasks, deterministic. Per block of keys: s = q k^T, dp = dout v^T, p =
// exp(score - lse), ds = p (dp - Di) (times the softcap's derivative) scale; dq += ds k,
// dk = ds^T q, dv = p^T dout. Keys no row sees get zero gradients. Math in float32.
struct Grad : AttentionArgs {
  const char *q, *k, *v, *out, *dout;
  int64_t q_s[3], k_s[3], v_s[3], o_s[3], do_s[3];  // bytes: per sequence, token, head
  const float* lse;  // (B, Hq, Sq) contiguous
  char *dq, *dk, *dv;  // (B, Sq, Hq, D) and (B, Sk, Hkv, D) contiguous
  int64_t Sk;
  int dtype;
  int64_t elt;

  const char* at(const char* base, const int64_t* st, int64_t b, int64_t t, int64_t h) const {
    return base + b * st[0] + t * st[1] + h * st[2];
  }
};

struct GradScratch {
  std::vector<float> q, dout, dq, delta, keys, values, s, dp, dsT, pT, dk, dv;
  const float* key_rows[kKeyBlock];
  const float* value_rows[kKeyBlock];
  const float* q_rows[kKeyBlock];
  const float* dout_rows[kKeyBlock];
  void size(int64_t R, int64_t D) {
    for (auto* v : {&q, &dout, &dq}) v->assign(size_t(R * D), 0.0f);
    delta.assign(size_t(R), 0.0f);
    for (auto* v : {&keys, &values, &dk, &dv}) v->assign(size_t(kKeyBlock * D), 0.0f);
    for (auto* v : {&s, &dp, &dsT, &pT}) v->assign(size_t(kKeyBlock * kKeyBlock), 0.0f);
  }
};

void grad_task(const Grad& P, int64_t b, int64_t h, GradScratch& S) {
  const int64_t G = P.Hq / P.Hkv, R = G * P.Sq, D = P.D, L = P.Sk;
  std::vector<float> row(static_cast<size_t>(D));
  for (int64_t r = 0; r < R; ++r) {
    const int64_t g = r / P.Sq, i = r % P.Sq, hq = h * G + g;
    row_to_float(P.at(P.q, P.q_s, b, i, hq), P.dtype, S.q.data() + r * D, D);
    row_to_float(P.at(P.dout, P.do_s, b, i, hq), P.dtype, S.dout.data() + r * D, D);
    row_to_float(P.at(P.out, P.o_s, b, i, hq), P.dtype, row.data(), D);
    float di = 0.0f;
    for (int64_t d = 0; d < D; ++d) di += S.dout[size_t(r * D + d)] * row[size_t(d)];
    S.delta[size_t(r)] = di;
    S.q_rows[r] = S.q.data() + r * D;
    S.dout_rows[r] = S.dout.data() + r * D;
  }
  std::fill(S.dq.begin(), S.dq.end(), 0.0f);
  const int64_t first = L - P.Sq;  // position of query row 0 (bottom-right aligned)
  for (int64_t j0 = 0; j0 < L; j0 += kKeyBlock) {
    const int64_t n = std::min(kKeyBlock, L - j0);
    for (int64_t j = 0; j < n; ++j) {
      row_to_float(P.at(P.k, P.k_s, b, j0 + j, h), P.dtype, S.keys.data() + j * D, D);
      row_to_float(P.at(P.v, P.v_s, b, j0 + j, h), P.dtype, S.values.data() + j * D, D);
      S.key_rows[j] = S.keys.data() + j * D;
      S.value_rows[j] = S.values.data() + j * D;
    }
    float* s = S.s.data();
    float* dp = S.dp.data();
    int64_t r0 = 0;
    for (; r0 + 4 <= R; r0 += 4) {
      scores<4>(S.q.data() + r0 * D, S.key_rows, n, D, s + r0 * kKeyBlock, kKeyBlock);
      scores<4>(S.dout.data() + r0 * D, S.value_rows, n, D, dp + r0 * kKeyBlock, kKeyBlock);
    }
    for (; r0 < R; ++r0) {
      scores<1>(S.q.data() + r0 * D, S.key_rows, n, D, s + r0 * kKeyBlock, kKeyBlock);
      scores<1>(S.dout.data() + r0 * D, S.value_rows, n, D, dp + r0 * kKeyBlock, kKeyBlock);
    }
    // s becomes ds (rows kKeyBlock apart, for dq), dsT and pT its transposes (for dk, dv).
    for (int64_t r = 0; r < R; ++r) {
      const int64_t g = r / P.Sq, i = r % P.Sq, pos = first + i, hq = h * G + g;
      const float lse = P.lse[(b * P.Hq + hq) * P.Sq + i];
      const float slope = P.slopes ? P.slopes[b * P.slopes_sb + hq] : 0.0f;
      for (int64_t j = 0; j < n; ++j) {
        const int64_t key = j0 + j;
        const bool hidden = (P.left >= 0 && key < pos - P.left) || (P.right >= 0 && key > pos + P.right);
        float p = 0.0f, ds = 0.0f;
        if (!hidden) {
          float x = s[r * kKeyBlock + j] * P.scale, deriv = 1.0f;
          if (P.softcap > 0) {
            const float t = std::tanh(x / P.softcap);
            x = P.softcap * t;
            deriv = 1.0f - t * t;
          }
          if (P.slopes) x -= slope * float(std::abs(pos - key));
          const float z = x - lse;  // NaN (a NaN score or lse) stays NaN
          p = z != z ? z : exp_(z);
          ds = p * (dp[r * kKeyBlock + j] - S.delta[size_t(r)]) * deriv * P.scale;
        }
        s[r * kKeyBlock + j] = ds;
        S.dsT[size_t(j * kKeyBlock + r)] = ds;
        S.pT[size_t(j * kKeyBlock + r)] = p;
      }
    }
    r0 = 0;
    for (; r0 + 4 <= R; r0 += 4) accumulate<4>(S.dq.data() + r0 * D, s + r0 * kKeyBlock, S.key_rows, n, D);
    for (; r0 < R; ++r0) accumulate<1>(S.dq.data() + r0 * D, s + r0 * kKeyBlock, S.key_rows, n, D);
    std::fill(S.dk.begin(), S.dk.end(), 0.0f);
    std::fill(S.dv.begin(), S.dv.end(), 0.0f);
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
      accumulate<4>(S.dk.data() + j * D, S.dsT.data() + j * kKeyBlock, S.q_rows, R, D);
      accumulate<4>(S.dv.data() + j * D, S.pT.data() + j * kKeyBlock, S.dout_rows, R, D);
    }
    for (; j < n; ++j) {
      accumulate<1>(S.dk.data() + j * D, S.dsT.data() + j * kKeyBlock, S.q_rows, R, D);
      accumulate<1>(S.dv.data() + j * D, S.pT.data() + j * kKeyBlock, S.dout_rows, R, D);
    }
    for (j = 0; j < n; ++j) {
      const int64_t off = ((b * P.Sk + j0 + j) * P.Hkv + h) * D * P.elt;
      row_from_float(S.dk.data() + j * D, P.dtype, P.dk + off, D);
      row_from_float(S.dv.data() + j * D, P.dtype, P.dv + off, D);
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    const int64_t g = r / P.Sq, i = r % P.Sq;
    row_from_float(S.dq.data() + r * D, P.dtype, P.dq + ((b * P.Sq + i) * P.Hq + h * G + g) * D * P.elt, D);
  }
}

int run_grad(const Grad& P, int num_threads) {
  const int64_t units = P.B * P.Hkv, R = P.Hq / P.Hkv * P.Sq;
  const bool parallel = num_threads > 1 && units > 1 && P.B * P.Hq * P.Sq * P.Sk * P.D >= kSerialBelow * 64;
#pragma omp parallel num_threads(parallel ? num_threads : 1) if (parallel)
  {
    GradScratch S;
    S.size(R, P.D);
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < units; ++t) grad_task(P, t / P.Hkv, t % P.Hkv, S);
  }
  return 0;
}

// The slots of a packed call (shared.replay's C side: every argument in one 64-bit slot, doubles
// as their bits), read back as the entry point's argument types; both packed entries use it.
struct PackedArgs {
  const int64_t* a;
  template <class T = void>
  T* ptr(int i) const { return reinterpret_cast<T*>(a[i]); }
  int i32(int i) const { return static_cast<int>(a[i]); }
  double f64(int i) const {
    double x;
    std::memcpy(&x, &a[i], sizeof x);
    return x;
  }
};

}  // namespace

extern "C" {

// head_dim a multiple of 16. Returns 0, 1 (malformed arguments) or 2 (a length, left padding or page outside the cache).
// Strides in elements; q (B, Sq, Hq, D) and the cache sides have a unit last stride.
int ok_attention_decode(const void* q, int64_t q_sb, int64_t q_ss, int64_t q_sh, const void* k, int64_t k_sr,
                        int64_t k_st, int64_t k_sh, const void* v, int64_t v_sr, int64_t v_st, int64_t v_sh,
                        const int32_t* seqlens, const int32_t* block_table, int64_t bt_stride, int64_t bt_cols,
                        int64_t page, int64_t rows, const int32_t* leftpad, const float* slopes, int64_t slopes_sb,
                        void* out, float* lse, int64_t B, int64_t Sq, int64_t Hq, int64_t Hkv, int64_t D,
                        int64_t seqlen_new, double scale, double softcap, int64_t left, int64_t right, int q_dtype,
                        int kv_dtype, int num_threads) {
  if (B < 0 || Sq <= 0 || Hkv <= 0 || Hq % Hkv || D <= 0 || D % 16 || page <= 0 || q_dtype < 0 || q_dtype > 2 ||
      kv_dtype < 0 || kv_dtype > 2)
    return 1;
  Problem P;
  static_cast<AttentionArgs&>(P) =
      AttentionArgs{slopes, slopes_sb, B, Sq, Hq, Hkv, D, float(scale), float(softcap), left, right};
  P.elt_q = element_bytes(q_dtype);
  P.elt_kv = element_bytes(kv_dtype);
  P.q = static_cast<const char*>(q);
  P.q_sb = q_sb * P.elt_q;
  P.q_ss = q_ss * P.elt_q;
  P.q_sh = q_sh * P.elt_q;
  P.k = Side{static_cast<const char*>(k), k_sr * P.elt_kv, k_st * P.elt_kv, k_sh * P.elt_kv};
  P.v = Side{static_cast<const char*>(v), v_sr * P.elt_kv, v_st * P.elt_kv, v_sh * P.elt_kv};
  P.seqlens = seqlens;
  P.block_table = block_table;
  P.bt_stride = bt_stride;
  P.bt_cols = bt_cols;
  P.page = page;
  P.rows = rows;
  P.leftpad = leftpad;
  P.out = static_cast<char*>(out);
  P.lse = lse;
  P.seqlen_new = seqlen_new;
  P.q_dtype = q_dtype;
  P.kv_dtype = kv_dtype;
  return run(P, num_threads);
}

// Packed entry: every argument in one 64-bit slot (doubles as their bits), for shared.replay's C side.
int ok_attention_decode_packed(const int64_t* a) {
  const PackedArgs s{a};
  return ok_attention_decode(s.ptr(0), a[1], a[2], a[3], s.ptr(4), a[5], a[6], a[7], s.ptr(8), a[9], a[10], a[11],
                             s.ptr<const int32_t>(12), s.ptr<const int32_t>(13), a[14], a[15], a[16], a[17],
                             s.ptr<const int32_t>(18), s.ptr<const float>(19), a[20], s.ptr(21), s.ptr<float>(22),
                             a[23], a[24], a[25], a[26], a[27], a[28], s.f64(29), s.f64(30), a[31], a[32], s.i32(33),
                             s.i32(34), s.i32(35));
}

// The backward of plain attention (no cache) with G x Sq <= 64 query rows per KV head, head_dim
// a multiple of 16: q, k, v, out, dout any strides (elements) with a unit last one; lse (B, Hq, Sq)
// float32 contiguous; dq, dk, dv contiguous. Returns 0 or 1
// (malformed arguments).
int ok_attention_short_backward(const void* q, int64_t q_sb, int64_t q_ss, int64_t q_sh, const void* k, int64_t k_sb,
                                int64_t k_ss, int64_t k_sh, const void* v, int64_t v_sb, int64_t v_ss, int64_t v_sh,
                                const void* out, int64_t o_sb, int64_t o_ss, int64_t o_sh, const void* dout,
                                int64_t do_sb, int64_t do_ss, int64_t do_sh, const float* lse, const float* slopes,
                                int64_t slopes_sb, void* dq, void* dk, void* dv, int64_t B, int64_t Sq, int64_t Sk,
                                int64_t Hq, int64_t Hkv, int64_t D, double scale, double softcap, int64_t left,
                                int64_t right, int dtype, int num_threads) {
  if (B < 0 || Sq <= 0 || Sk <= 0 || Hkv <= 0 || Hq % Hkv || D <= 0 || D % 16 || dtype < 0 || dtype > 2 ||
      Hq / Hkv * Sq > kKeyBlock)
    return 1;
  Grad P;
  static_cast<AttentionArgs&>(P) =
      AttentionArgs{slopes, slopes_sb, B, Sq, Hq, Hkv, D, float(scale), float(softcap), left, right};
  P.elt = element_bytes(dtype);
  P.dtype = dtype;
  auto set = [&P](const void* src, const char*& dst, int64_t* st, int64_t s0, int64_t s1, int64_t s2) {
    dst = static_cast<const char*>(src);
    st[0] = s0 * P.elt;
    st[1] = s1 * P.elt;
    st[2] = s2 * P.elt;
  };
  set(q, P.q, P.q_s, q_sb, q_ss, q_sh);
  set(k, P.k, P.k_s, k_sb, k_ss, k_sh);
  set(v, P.v, P.v_s, v_sb, v_ss, v_sh);
  set(out, P.out, P.o_s, o_sb, o_ss, o_sh);
  set(dout, P.dout, P.do_s, do_sb, do_ss, do_sh);
  P.lse = lse;
  P.dq = static_cast<char*>(dq);
  P.dk = static_cast<char*>(dk);
  P.dv = static_cast<char*>(dv);
  P.Sk = Sk;
  return run_grad(P, num_threads);
}

int ok_attention_short_backward_packed(const int64_t* a) {
  const PackedArgs s{a};
  return ok_attention_short_backward(s.ptr(0), a[1], a[2], a[3], s.ptr(4), a[5], a[6], a[7], s.ptr(8), a[9], a[10],
                                     a[11], s.ptr(12), a[13], a[14], a[15], s.ptr(16), a[17], a[18], a[19],
                                     s.ptr<const float>(20), s.ptr<const float>(21), a[22], s.ptr(23), s.ptr(24),
                                     s.ptr(25), a[26], a[27], a[28], a[29], a[30], a[31], s.f64(32), s.f64(33), a[34],
                                     a[35], s.i32(36), s.i32(37));
}

}  // extern "C"
