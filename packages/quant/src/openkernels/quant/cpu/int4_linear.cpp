// 4-bit weight-only linear layer for CPU: y = x @ W^T (+ bias) with W dequantized on the fly, and the
// plain dequantization W -> (N, K). The packed layout is format.py's: qweight (N, K/2) bytes, column 2j in
// the low nibble of byte j; scales / zeros (K/group_size, N) in float16 or bfloat16.
//
// Plain C++17 + OpenMP, no torch headers; openkernels.shared.cpu_build compiles it on first use with
// -O3 -march=native. SIMD code uses GCC / Clang vector extensions (8 floats: one AVX register, two NEON
// ones), which compile on x86 and aarch64 alike; only the nibble decoding has AVX2 intrinsics, under
// #if defined(__AVX2__), next to a plain loop that does the same. The bfloat16 kernels (OK_BF16_DOT,
// AVX512-BF16) have no plain twin: without them bfloat16 x takes the float32 kernels.
//
// x is staged in float32, each 32-column block of a group in the order in which the decoder produces
// the codes' values (column_of), so that decoding never interleaves. A group whose size is not a
// multiple of 32 is padded to one, with zeros in x and zero bytes decoded from a padded copy of its
// last bytes: the padding adds value * 0 = 0, exactly.
//
// The weight is (q - z) s, or level * s for nf4, with q - z taken in float32 as the reference takes
// it (exact for the integer zeros of format.py; any other float zero, such as a GPTQ v1 zero of 16,
// rounds as there): the dequantization and the dequantized blocks below are the reference's weights
// bit for bit.
//
// Two schedules, both accumulating in float32 and rounding once to the output dtype:
//  - few rows of x (M <= kGemvMaxM; bfloat16 x with AVX512-BF16: M < kBf16MinM): each 32-code block
//    of W is decoded in registers, q - z or the NF4 level, and multiplied straight into every row of
//    x; the scale multiplies each group's sum.
//    Decoding is the cost here (half a byte of weight per multiply-add). Summing q x and z x apart
//    saves the subtractions (5% at most, measured), but its float32 error follows |q x| and |z x|
//    instead of |(q - z) x|, up to ~15 times larger: beyond the error contract
//    (reference.linear_error_bound).
//  - more rows: scales and zeros go to a float32 table of (s, z) pairs first; blocks of kNB rows of W
//    are dequantized, kKC columns at a time, into a float buffer that a register-blocked kernel runs
//    every row of x against (below). bfloat16 x, where the compiler targets AVX512-BF16 (OK_BF16_DOT):
//    the blocks are dequantized to bfloat16 instead and multiplied by vdpbf16ps, W rounded to x's
//    dtype as on the GPUs' tensor cores (the error contract's weight term); float32 and float16 x
//    keep the float32 kernel (float16 x would lose 3 bits to bfloat16, which the contract does not
//    allow).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <new>
#include <type_traits>

#include "openkernels_cpu.h"

namespace {

enum Dtype { kF32 = 0, kBF16 = 1, kF16 = 2 };
enum Kind { kInt4Zeros = 0, kInt4Sym = 1, kNf4 = 2 };

// Rows of x up to which the weight is decoded in registers: the dequantized-block kernel works on 8
// rows at a time, and took longer up to M = 6, as long at 7, less from 8 (measured).
constexpr int64_t kGemvMaxM = 6;
constexpr int kNR = 6;            // W rows of a register tile (by 16 x rows): 12 accumulators (AVX2: 16)
constexpr int64_t kNB = 24;       // rows of W dequantized at a time
constexpr int64_t kKC = 512;      // columns dequantized at a time, a multiple of 32 (256: 2-5% slower)
constexpr int64_t kSerialBelow = int64_t(1) << 18;  // multiply-adds; smaller calls lose to fork/join
// The bfloat16 kernels (OK_BF16_DOT): the rows of bfloat16 x from which they run instead of the GEMV
// (which took 1.3-1.4x their time at M = 4, 2.1x at 6, 1.07-1.15x at 3, 0.6x at 2; measured at
// 4096 x 4096 and 11008 x 4096, int4 and NF4); columns of W dequantized at a time (a multiple of 32); W rows
// of a register tile by 16 rows of x (24 by 8): 24 accumulators of the 32 AVX-512 registers.
constexpr int64_t kBf16MinM = 4;
static_assert(kBf16MinM > 1 && kBf16MinM <= kGemvMaxM + 1, "M = 1 keeps the GEMV; M > kGemvMaxM has no GEMV");
constexpr int64_t kKC16 = 512;
constexpr int kNR16 = 12;
// Pairs from one row of the bfloat16 weight buffer to the next: 64 bytes past kKC16 / 2, so that the
// rows a register tile broadcasts from do not share cache sets (unpadded 2 KB and 4 KB strides, 1024
// and 2048 columns, took 2x and 5x as long at M = 7).
constexpr int64_t kLdw = kKC16 / 2 + 16;

// vdpbf16ps on 8-float registers, and vpermw for the bfloat16 weight tables.
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define OK_BF16_DOT 1
#else
#define OK_BF16_DOT 0
#endif

typedef float v8 __attribute__((vector_size(32)));

#define OK_INLINE_LAMBDA __attribute__((always_inline))

OK_INLINE v8 load8(const float* p) {
  v8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

OK_INLINE void store8(float* p, v8 v) { std::memcpy(p, &v, sizeof v); }

OK_INLINE v8 splat(float f) { return v8{f, f, f, f, f, f, f, f}; }

OK_INLINE float hsum(v8 v) { return ((v[0] + v[4]) + (v[2] + v[6])) + ((v[1] + v[5]) + (v[3] + v[7])); }

// Storage aligned to a cache line, uninitialized (every user writes before it reads).
template <class T>
struct Aligned {
  T* p = nullptr;
  explicit Aligned(int64_t n) {
    p = static_cast<T*>(::operator new(size_t(std::max<int64_t>(n, 1)) * sizeof(T), std::align_val_t(64)));
  }
  Aligned(const Aligned&) = delete;
  Aligned& operator=(const Aligned&) = delete;
  ~Aligned() { ::operator delete(p, std::align_val_t(64)); }
};
using Floats = Aligned<float>;

// ---- problem description ----

struct Shape {
  int64_t M, N, K, gs;
  int64_t G;   // groups per row
  int64_t GP;  // staged columns of a group: gs rounded up to 32
  int64_t FB;  // whole 32-column blocks per group
  int64_t TB;  // bytes of the partial last block (0..15)
  int64_t BG;  // blocks per group, FB + (TB > 0)
  int64_t KP;  // columns of a staged x row: G * GP
  Shape(int64_t m, int64_t n, int64_t k, int64_t g) : M(m), N(n), K(k), gs(g) {
    G = gs > 0 ? K / gs : 0;
    GP = (gs + 31) / 32 * 32;
    FB = gs / 32;
    TB = (gs % 32) / 2;
    BG = FB + (TB > 0);
    KP = G * GP;
  }
};

// The raw scale and zero tables, as passed in.
struct Params {
  const uint16_t* s;
  int64_t s_stride;
  const uint16_t* z;  // nullptr unless kind is kInt4Zeros
  int64_t z_stride;
  bool bf16;
};

struct Weight {
  const uint8_t* q;
  int64_t q_stride;
  Params raw;        // the scales and zeros as passed in
  const float* sz;   // (G, N, 2) float32: scale s and zero z (8 for int4 symmetric, 0 for nf4)
  const float* nf4;  // the 16 NF4 levels (format.NF4_VALUES as float32)
  OK_INLINE const uint8_t* row(int64_t n) const { return q + n * q_stride; }
};

OK_INLINE float half(const uint16_t* p, bool bf16) { return bf16 ? bf16_load(*p) : f16_load(*p); }

// sz[2n], sz[2n + 1] = s, z for row g of the tables (n < N), or z = `zero` when there are no zeros.
void convert_params(const Params& p, int64_t g, int64_t N, float zero, float* __restrict sz, float* __restrict tmp) {
  auto convert = [&](const uint16_t* src, float* dst) {
    if (p.bf16) {
      for (int64_t n = 0; n < N; ++n) dst[n] = bf16_load(src[n]);
    } else {
      f16_to_float(src, dst, N);
    }
  };
  float* s = tmp;
  float* z = tmp + N;
  convert(p.s + g * p.s_stride, s);
  if (p.z) {
    convert(p.z + g * p.z_stride, z);
  } else {
    for (int64_t n = 0; n < N; ++n) z[n] = zero;
  }
  for (int64_t n = 0; n < N; ++n) sz[2 * n] = s[n], sz[2 * n + 1] = z[n];
}

// ---- decoding one block: 16 bytes (32 codes) -> 32 floats, table[code], in a fixed order ----

// The column (0..31 within the block; the code of column c is nibble c % 2 of byte c / 2) whose value
// block() returns at position p, which is the order x is staged in, so that decoders never interleave:
//   int4: the 16 low nibbles, then the 16 high ones (columns 0, 2, .., 30, 1, 3, .., 31);
//   nf4:  per 8 columns, the even ones then the odd ones (0, 2, 4, 6, 1, 3, 5, 7, 8, ..).
constexpr int column_of(int kind, int p) {
  return kind == kNf4 ? (p & ~7) + 2 * (p & 3) + ((p >> 2) & 1) : (p < 16 ? 2 * p : 2 * (p - 16) + 1);
}

OK_INLINE int code_of(const uint8_t* bytes, int c) { return c & 1 ? bytes[c >> 1] >> 4 : bytes[c >> 1] & 15; }

// The value of each code: nf4, the NF4 levels; int4, the code minus the zero z (8 lanes of it), as
// the reference computes it: float(q) - z in float32.
template <int KIND>
struct Decoder {
  float table[16];  // nf4 levels (int4: the codes themselves)
  explicit Decoder(const float* nf4) {
    for (int i = 0; i < 16; ++i) table[i] = KIND == kNf4 ? nf4[i] : float(i);
#if defined(__AVX2__)
    if constexpr (KIND == kNf4) {
      alignas(16) uint8_t b[4][16];
      for (int i = 0; i < 16; ++i)
        for (int k = 0; k < 4; ++k) b[k][i] = uint8_t(bits(table[i]) >> (8 * k));
      for (int k = 0; k < 4; ++k)
        t[k] = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(b[k])));
    }
#endif
  }
#if defined(__AVX2__)
  // nf4: byte k of the 16 levels' float32 bits, in both 128-bit lanes.
  __m256i t[4];
  OK_INLINE void block(const uint8_t* p, v8 w[4], v8 z) const {
    if constexpr (KIND != kNf4) {
      // Bytes widen from memory to 32-bit lanes (2 shuffles per 32 codes), the nibbles split there
      // and convert, and the zero comes off (byte lookups as for nf4: 8 shuffles, 30% slower).
      const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
      const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
      const __m256i m = _mm256_set1_epi32(15);
      w[0] = (v8)_mm256_cvtepi32_ps(_mm256_and_si256(b0, m)) - z;
      w[1] = (v8)_mm256_cvtepi32_ps(_mm256_and_si256(b1, m)) - z;
      w[2] = (v8)_mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4)) - z;
      w[3] = (v8)_mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4)) - z;
    } else {
      (void)z;
      nf4_block(p, w);
    }
  }
  // int4: the codes themselves (the zero is taken off the sums instead, see gemv_tile).
  OK_INLINE void codes(const uint8_t* p, v8 w[4]) const {
    const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
    const __m256i m = _mm256_set1_epi32(15);
    w[0] = (v8)_mm256_cvtepi32_ps(_mm256_and_si256(b0, m));
    w[1] = (v8)_mm256_cvtepi32_ps(_mm256_and_si256(b1, m));
    w[2] = (v8)_mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4));
    w[3] = (v8)_mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4));
  }
  OK_INLINE void nf4_block(const uint8_t* p, v8 w[4]) const {
    // In-lane byte lookups build the levels' floats byte by byte, and unpacks put the bytes
    // together: fewer shuffles than 8-entry permutes and blends (1.6x faster, measured).
    const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i m = _mm256_set1_epi8(15);
    // Lane 0: the low nibbles of the 16 bytes, lane 1: the high ones.
    const __m256i c =
        _mm256_blend_epi32(_mm256_and_si256(v, m), _mm256_and_si256(_mm256_srli_epi16(v, 4), m), 0xf0);
    const __m256i b0 = _mm256_shuffle_epi8(t[0], c), b1 = _mm256_shuffle_epi8(t[1], c);
    const __m256i b2 = _mm256_shuffle_epi8(t[2], c), b3 = _mm256_shuffle_epi8(t[3], c);
    const __m256i lo01 = _mm256_unpacklo_epi8(b0, b1), hi01 = _mm256_unpackhi_epi8(b0, b1);
    const __m256i lo23 = _mm256_unpacklo_epi8(b2, b3), hi23 = _mm256_unpackhi_epi8(b2, b3);
    // Codes 0-3 of each lane, 4-7, 8-11, 12-15: column_of(kNf4, .)'s order.
    w[0] = (v8)_mm256_castsi256_ps(_mm256_unpacklo_epi16(lo01, lo23));
    w[1] = (v8)_mm256_castsi256_ps(_mm256_unpackhi_epi16(lo01, lo23));
    w[2] = (v8)_mm256_castsi256_ps(_mm256_unpacklo_epi16(hi01, hi23));
    w[3] = (v8)_mm256_castsi256_ps(_mm256_unpackhi_epi16(hi01, hi23));
  }
#else
  OK_INLINE void block(const uint8_t* p, v8 w[4], v8 z) const {
    alignas(32) float f[32];
    for (int i = 0; i < 32; ++i) f[i] = table[code_of(p, column_of(KIND, i))];
    for (int i = 0; i < 4; ++i) w[i] = KIND == kNf4 ? load8(f + 8 * i) : load8(f + 8 * i) - z;
  }
  OK_INLINE void codes(const uint8_t* p, v8 w[4]) const { block(p, w, splat(0.0f)); }
#endif
};

// ---- staging x: float32 rows of KP columns, each 32-column block in column_of(KIND, .)'s order ----

template <int KIND, class Load>
OK_INLINE void stage_row(const Shape& sh, Load ld, float* __restrict dst) {
  for (int64_t g = 0; g < sh.G; ++g) {
    const int64_t c0 = g * sh.gs;
    float* d = dst + g * sh.GP;
    for (int64_t b = 0; b < sh.FB; ++b)
      for (int p = 0; p < 32; ++p) d[32 * b + p] = ld(c0 + 32 * b + column_of(KIND, p));
    if (sh.TB) {  // the partial block: columns past the group's end read as zeros
      const int64_t c = c0 + 32 * sh.FB;
      for (int p = 0; p < 32; ++p)
        d[32 * sh.FB + p] = column_of(KIND, p) < 2 * sh.TB ? ld(c + column_of(KIND, p)) : 0.0f;
    }
  }
}

template <int KIND>
OK_NOINLINE void stage_f32(const Shape& sh, const float* __restrict x, float* __restrict dst) {
  stage_row<KIND>(sh, [&](int64_t c) { return x[c]; }, dst);
}

template <int KIND>
OK_NOINLINE void stage_bf16(const Shape& sh, const uint16_t* __restrict x, float* __restrict dst) {
  stage_row<KIND>(sh, [&](int64_t c) { return bf16_load(x[c]); }, dst);
}

// One row of x -> dst (KP floats).
template <int KIND>
void stage(const Shape& sh, int dtype, const void* xrow, float* tmp, float* dst) {
  if (dtype == kF32) {
    stage_f32<KIND>(sh, static_cast<const float*>(xrow), dst);
  } else if (dtype == kBF16) {
    stage_bf16<KIND>(sh, static_cast<const uint16_t*>(xrow), dst);
  } else {  // F16C converts whole runs: stage from a float copy
    f16_to_float(static_cast<const uint16_t*>(xrow), tmp, sh.K);
    stage_f32<KIND>(sh, tmp, dst);
  }
}

// ---- writing results ----

void store(int dtype, void* out, int64_t offset, const float* v, int64_t n) {
  if (dtype == kF32) {
    std::memcpy(static_cast<float*>(out) + offset, v, size_t(n) * sizeof(float));
  } else if (dtype == kBF16) {
    uint16_t* o = static_cast<uint16_t*>(out) + offset;
    for (int64_t i = 0; i < n; ++i) o[i] = bf16_store(v[i]);
  } else {
    float_to_f16(v, static_cast<uint16_t*>(out) + offset, n);
  }
}

struct Linear {
  Shape sh;
  Weight wt;
  const float* bias;  // (N,) float32 or nullptr
  void* out;          // (M, N) contiguous, x's dtype
  int dtype;
};

// ---- few rows of x: decode in registers ----

// out[i, n0 + j] for i < MR (= M), j < NR, from staged rows xp (row stride KP). Scales and zeros are
// read as passed in (a float32 table of them, written and read back, took 15% of a call at M = 1).
// FOLD (int4, every sum of x finite): the products take the codes themselves and the zero comes off
// each group's sum as zero * sum(x over the group) (xs, per row of x and group): one subtraction per
// group and output instead of one per code (M=1 4096 x 4096 on the 2-core machine: 10% less time).
// An infinite x would give inf - inf there, where (code - zero) * inf is +-inf or NaN: such calls
// subtract per code.
template <int KIND, int MR, int NR, bool FOLD>
OK_NOINLINE void gemv_tile(const Linear& L, const float* __restrict xp, const float* __restrict xs, int64_t n0) {
  const Shape& sh = L.sh;
  const Params& p = L.wt.raw;
  const Decoder<KIND> dec(L.wt.nf4);
  const uint8_t* qrow[NR];
  const uint8_t* next[NR];  // the rows of the thread's next tile (n0 + NR on)
  for (int j = 0; j < NR; ++j) {
    qrow[j] = L.wt.row(n0 + j);
    next[j] = n0 + NR + j < sh.N ? L.wt.row(n0 + NR + j) : nullptr;
  }
  v8 tot[MR][NR] = {};
  float zsum[MR][NR] = {};  // int4: sum over groups of scale * zero * sum(x over the group)
  for (int64_t g = 0; g < sh.G; ++g) {
    float sc[NR];
    v8 zq[NR];
    for (int j = 0; j < NR; ++j) {
      sc[j] = half(p.s + g * p.s_stride + n0 + j, p.bf16);
      const float z = KIND == kInt4Zeros ? half(p.z + g * p.z_stride + n0 + j, p.bf16) : 8.0f;
      zq[j] = splat(z);
      if constexpr (FOLD)
        for (int i = 0; i < MR; ++i) zsum[i][j] += sc[j] * z * xs[i * sh.G + g];
    }
    const float* xg = xp + g * sh.GP;
    const int64_t gb = g * (sh.gs / 2);
    // The hardware prefetchers lose the 4 interleaved row streams at every 2 KB row end: reading
    // from memory (not L3) took twice as long. Ask for the next tile's bytes one tile ahead.
    for (int j = 0; j < NR; ++j)
      if (next[j])
        for (int64_t b = 0; b < sh.gs / 2; b += 64) __builtin_prefetch(next[j] + gb + b, 0, 3);
    // With 4 outputs or fewer, two accumulators each: the chains through them are two multiply-adds
    // per block instead of four (FMA latency 4, 2 per cycle: 8 chains keep the units busy).
    constexpr bool kTwo = MR * NR <= 4;
    v8 acc0[MR][NR] = {}, acc1[MR][NR] = {};
    auto block = [&](const uint8_t* const* bytes, const float* xb) OK_INLINE_LAMBDA {
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) {
        v8 w[4];
        if constexpr (FOLD) dec.codes(bytes[j], w);
        else dec.block(bytes[j], w, zq[j]);
#pragma GCC unroll 4
        for (int i = 0; i < MR; ++i) {
          const float* xr = xb + i * sh.KP;
          v8& second = kTwo ? acc1[i][j] : acc0[i][j];
          acc0[i][j] += w[0] * load8(xr);
          second += w[1] * load8(xr + 8);
          acc0[i][j] += w[2] * load8(xr + 16);
          second += w[3] * load8(xr + 24);
        }
      }
    };
    for (int64_t b = 0; b < sh.FB; ++b) {
      const uint8_t* bytes[NR];
      for (int j = 0; j < NR; ++j) bytes[j] = qrow[j] + gb + 16 * b;
      block(bytes, xg + 32 * b);
    }
    if (sh.TB) {  // the partial last block, from zero-padded copies
      alignas(16) uint8_t pad[NR][16] = {};
      const uint8_t* bytes[NR];
      for (int j = 0; j < NR; ++j) {
        std::memcpy(pad[j], qrow[j] + gb + 16 * sh.FB, size_t(sh.TB));
        bytes[j] = pad[j];
      }
      block(bytes, xg + 32 * sh.FB);
    }
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) tot[i][j] += splat(sc[j]) * (acc0[i][j] + acc1[i][j]);
  }
  for (int i = 0; i < MR; ++i) {
    float y[NR];
    for (int j = 0; j < NR; ++j) y[j] = hsum(tot[i][j]) - zsum[i][j] + (L.bias ? L.bias[n0 + j] : 0.0f);
    store(L.dtype, L.out, i * sh.N + n0, y, NR);
  }
}

// Output rows [n0, n0 + rows) (rows <= 4) for every row of x (M <= kGemvMaxM): tiles of 4 rows of W
// for one row of x, 2 for 2, else 1.
template <int KIND, bool FOLD>
void gemv_unit(const Linear& L, const float* xp, const float* xs, int64_t n0, int64_t rows) {
  const int64_t M = L.sh.M;
  for (int64_t n = n0; n < n0 + rows;) {
    const int64_t left = n0 + rows - n;
    if (M == 1 && left >= 4) {
      gemv_tile<KIND, 1, 4, FOLD>(L, xp, xs, n), n += 4;
    } else if (M == 2 && left >= 2) {
      gemv_tile<KIND, 2, 2, FOLD>(L, xp, xs, n), n += 2;
    } else {
      switch (M) {
        case 1: gemv_tile<KIND, 1, 1, FOLD>(L, xp, xs, n); break;
        case 2: gemv_tile<KIND, 2, 1, FOLD>(L, xp, xs, n); break;
        case 3: gemv_tile<KIND, 3, 1, FOLD>(L, xp, xs, n); break;
        case 4: gemv_tile<KIND, 4, 1, FOLD>(L, xp, xs, n); break;
        case 5: gemv_tile<KIND, 5, 1, FOLD>(L, xp, xs, n); break;
        default: gemv_tile<KIND, 6, 1, FOLD>(L, xp, xs, n); break;
      }
      n += 1;
    }
  }
}

static_assert(kGemvMaxM == 6, "gemv_unit dispatches up to 6 rows of x");

// ---- more rows of x: dequantize a block of W into a buffer, register-blocked product ----
//
// x is staged transposed, in panels of kPanel rows: panel[k][r] (r < kPanel contiguous), so that a
// vector holds one column of 8 rows. The kernel keeps a tile of C^T (kNR rows of W by 16 rows of x,
// or 2 kNR by 8 for the last 8 rows) in 12 registers; per column it loads 2 vectors of x and
// broadcasts kNR weights: 8 loads per 12 multiply-adds. A thread takes a block of kNB rows of W at a
// time, whole: per chunk of kKC columns it dequantizes the block into a buffer (48 KB) and runs every
// row of x against it, the partial sums staying in a small C^T buffer. (Chunks outermost, for all of
// a thread's blocks, would keep a chunk of x in L2, but then each row of W is read a chunk at a time
// with the thread's other rows in between, too far apart for the prefetchers and the TLB: measured
// slower from M = 8 to 256.)

constexpr int64_t kPanel = 8;

// wbuf[r][0, len) (row stride kKC) = W[n0 + r, columns c0 .. c0 + len in staging order], exactly
// (q - z) * s; rows past N are zeros. c0 and len are multiples of 32.
template <int KIND>
OK_NOINLINE void dequantize_block(const Linear& L, int64_t n0, int64_t c0, int64_t len, float* __restrict wbuf) {
  const Shape& sh = L.sh;
  alignas(16) uint8_t pad[16] = {};
  const Decoder<KIND> dec(L.wt.nf4);
  for (int64_t r = 0; r < kNB; ++r) {
    float* dst = wbuf + r * kKC;
    const int64_t n = n0 + r;
    if (n >= sh.N) {
      std::memset(dst, 0, size_t(len) * sizeof(float));
      continue;
    }
    const uint8_t* qrow = L.wt.row(n);
    {  // Ask for this row's next chunk, or the next block's first one: the rows are read a chunk
       // (256 bytes) at a time, too short for the hardware prefetchers (15-20% at M = 8 to 16).
      const int64_t c1 = c0 + kKC < sh.KP ? c0 + kKC : 0;
      const uint8_t* next = c1 ? qrow : (n + kNB < sh.N ? L.wt.row(n + kNB) : nullptr);
      const int64_t g1 = c1 / sh.GP, first = g1 * (sh.gs / 2) + (c1 - g1 * sh.GP) / 2;
      const int64_t last = std::min(sh.K / 2, first + kKC / 2);
      for (int64_t o = first; next && o < last; o += 64) __builtin_prefetch(next + o, 0, 3);
    }
    int64_t g = c0 / 32 / sh.BG, b = c0 / 32 % sh.BG;  // group and block of column c0
    for (int64_t k = 0; k < len; g += 1, b = 0) {
      const v8 sv = splat(L.wt.sz[2 * (g * sh.N + n)]);
      const v8 zq = splat(L.wt.sz[2 * (g * sh.N + n) + 1]);
      for (; b < sh.BG && k < len; ++b, k += 32) {
        const uint8_t* p = qrow + g * (sh.gs / 2) + 16 * b;
        if (b == sh.FB) p = static_cast<const uint8_t*>(std::memcpy(pad, p, size_t(sh.TB)));  // partial block
        v8 w[4];
        dec.block(p, w, zq);
        for (int i = 0; i < 4; ++i) store8(dst + k + 8 * i, w[i] * sv);
      }
    }
  }
}

// ct[j * ldc + 8 v + r] += sum_k x_v[k * kPanel + r] * w[j * kKC + k] for j < NR, v < MV, r < 8:
// MV panels of x (8 rows each) against NR rows of the weight buffer, over len columns. MV * NR = 12
// accumulators: 16 rows of x by 6 of W, or 8 by 12.
template <int MV, int NR>
OK_NOINLINE void micro_kernel(const float* __restrict x0, const float* __restrict x1, const float* __restrict w,
                              int64_t len, float* __restrict ct, int64_t ldc) {
  v8 a[NR][MV];
#pragma GCC unroll 12
  for (int j = 0; j < NR; ++j)
#pragma GCC unroll 2
    for (int v = 0; v < MV; ++v) a[j][v] = load8(ct + j * ldc + 8 * v);
  for (int64_t k = 0; k < len; ++k) {
    v8 xv[MV];
    xv[0] = load8(x0 + k * kPanel);
    if constexpr (MV == 2) xv[1] = load8(x1 + k * kPanel);
#pragma GCC unroll 12
    for (int j = 0; j < NR; ++j) {
      const v8 b = splat(w[j * kKC + k]);
#pragma GCC unroll 2
      for (int v = 0; v < MV; ++v) a[j][v] += xv[v] * b;
    }
  }
#pragma GCC unroll 12
  for (int j = 0; j < NR; ++j)
#pragma GCC unroll 2
    for (int v = 0; v < MV; ++v) store8(ct + j * ldc + 8 * v, a[j][v]);
}

static_assert(kNB % (2 * kNR) == 0 && kKC % 32 == 0, "blocks hold whole slivers and whole 32-column blocks");

// One chunk of a unit: W rows [n0, n0 + kNB) against staged rows [r0, r1) (multiples of kPanel, in
// the staged pass); partial sums in ct[j * ldc + r - r0].
template <int KIND>
void gemm_chunk(const Linear& L, const float* panels, int64_t c0, int64_t len, int64_t n0, int64_t r0, int64_t r1,
                float* wbuf, float* ct, int64_t ldc) {
  dequantize_block<KIND>(L, n0, c0, len, wbuf);
  const int64_t panel_size = kPanel * L.sh.KP;
  int64_t r = r0;
  for (; r + 2 * kPanel <= r1; r += 2 * kPanel) {  // 16 rows of x by 6 of W
    const float* x = panels + (r / kPanel) * panel_size + c0 * kPanel;
    for (int64_t j = 0; j < kNB && n0 + j < L.sh.N; j += kNR)
      micro_kernel<2, kNR>(x, x + panel_size, wbuf + j * kKC, len, ct + j * ldc + (r - r0), ldc);
  }
  if (r < r1) {  // 8 rows of x by 12 of W
    const float* x = panels + (r / kPanel) * panel_size + c0 * kPanel;
    for (int64_t j = 0; j < kNB && n0 + j < L.sh.N; j += 2 * kNR)
      micro_kernel<1, 2 * kNR>(x, x, wbuf + j * kKC, len, ct + j * ldc + (r - r0), ldc);
  }
}

// Rows [0, rows) of x (row stride x_stride elements) -> transposed panels (zeros past `rows`):
// panel p holds rows 8p .. 8p + 7, column k' (staging order) at [k' * kPanel, k' * kPanel + 8).
template <int KIND>
void stage_panel(const Shape& sh, int dtype, const char* x, int64_t x_stride, int64_t rows, int64_t p, float* tmp,
                 float* row, float* panel) {
  const int64_t elem = dtype == kF32 ? 4 : 2;
  for (int64_t r = 0; r < kPanel; ++r) {
    const int64_t m = p * kPanel + r;
    if (m < rows) {
      stage<KIND>(sh, dtype, x + m * x_stride * elem, tmp, row);
      for (int64_t k = 0; k < sh.KP; ++k) panel[k * kPanel + r] = row[k];
    } else {
      for (int64_t k = 0; k < sh.KP; ++k) panel[k * kPanel + r] = 0.0f;
    }
  }
}

// ---- more rows of bfloat16 x with AVX512-BF16: W rounded to bfloat16, vdpbf16ps ----
//
// The same blocks and units as above, in bfloat16: each block of W is dequantized as the dequantize
// op's 16-bit table path does it ((q - z) s or level * s in float32, rounded once to bfloat16) and
// x goes into panels of 8 rows as it is, no conversion: panel[k][r] is the 32-bit pair (x[r][2k],
// x[r][2k + 1]), columns in their own order. vdpbf16ps multiplies 8 such pairs (8 rows of x) by one
// broadcast pair of W and adds both products to 8 float32 sums: twice the multiply-adds of an FMA
// per instruction, at the same rate on this machine (Zen 4, measured: 2 ymm per cycle, or 1 zmm;
// ymm keeps 8-row panels). Rounding W to x's dtype is the error contract's weight term
// (reference.linear_error_bound), what the GPUs' tensor-core paths do; bf16 x bf16 products are exact
// in float32. The instruction treats subnormal inputs as zero and flushes subnormal sums (weights or
// x below 2^-126 in magnitude, which the contract does not cover).

#if OK_BF16_DOT
static_assert(kNB % (2 * kNR16) == 0 && kKC16 % 32 == 0, "blocks hold whole tiles and whole 32-column blocks");

// The 16 values of one group of one row of W, (code - z) s or level * s in float32 as the reference
// computes them, rounded to bfloat16: words 0-15 of a vpermw table (the dequantize op's values).
template <int KIND>
OK_INLINE __m512i bf16_table(float s, float z, const __m512 levels) {
  const __m512 v = KIND == kNf4 ? _mm512_mul_ps(levels, _mm512_set1_ps(s))
                                : _mm512_mul_ps(_mm512_sub_ps(levels, _mm512_set1_ps(z)), _mm512_set1_ps(s));
  return _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(v));
}

// wbuf[r][0, len / 2) (row stride kLdw pairs) = W[n0 + r, c0 .. c0 + len) in bfloat16 pairs, in
// column order; rows past N are zeros. c0 and len are even (K and the group size are).
template <int KIND>
OK_NOINLINE void dequantize_block_bf16(const Linear& L, int64_t n0, int64_t c0, int64_t len,
                                       uint32_t* __restrict wbuf) {
  const Shape& sh = L.sh;
  const __m512 levels = KIND == kNf4 ? _mm512_loadu_ps(L.wt.nf4)
                                     : _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i low = _mm512_set1_epi32(0x0f);
  const __m512i high = _mm512_set1_epi32(0xf0 << 12);  // the high nibble, moved to bits 16-19
  const int64_t g0 = c0 / sh.gs;  // the group of column c0 (a division per group: 1/5 of this function)
  for (int64_t r = 0; r < kNB; ++r) {
    uint32_t* dst = wbuf + r * kLdw;
    const int64_t n = n0 + r;
    if (n >= sh.N) {
      std::memset(dst, 0, size_t(len / 2) * sizeof(uint32_t));
      continue;
    }
    const uint8_t* qrow = L.wt.row(n) + c0 / 2;
    {  // as dequantize_block: this row's next chunk, or the next block's first one
      const int64_t c1 = c0 + kKC16 < sh.K ? c0 + kKC16 : 0;
      const uint8_t* next = c1 ? L.wt.row(n) + c1 / 2 : (n + kNB < sh.N ? L.wt.row(n + kNB) : nullptr);
      const int64_t bytes = std::min(kKC16, sh.K - c1) / 2;
      for (int64_t o = 0; next && o < bytes; o += 64) __builtin_prefetch(next + o, 0, 3);
    }
    for (int64_t k = 0, g = g0; k < len; ++g) {  // one group (or the part of it in the chunk) at a time
      const int64_t end = std::min(len, (g + 1) * sh.gs - c0);
      const float* sz = L.wt.sz + 2 * (g * sh.N + n);
      const __m512i lut = bf16_table<KIND>(sz[0], sz[1], levels);
      if (sh.gs % 32 == 0) {
        for (; k < end; k += 32) {
          // byte j -> 32-bit lane j: low nibble in bits 0-3 (word 2j), high nibble in bits 16-19
          const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qrow + k / 2)));
          const __m512i idx =
              _mm512_or_si512(_mm512_and_si512(d, low), _mm512_and_si512(_mm512_slli_epi32(d, 12), high));
          _mm512_storeu_si512(dst + k / 2, _mm512_permutexvar_epi16(idx, lut));
        }
      } else {  // groups of any even size: byte by byte (the tests' shapes, not a fast path)
        alignas(64) uint16_t t[32];
        _mm512_store_si512(t, lut);
        for (; k < end; k += 2) dst[k / 2] = t[qrow[k / 2] & 15] | uint32_t(t[qrow[k / 2] >> 4]) << 16;
      }
    }
  }
}

// ct[j * ldc + 8 v + r] += sum_k x_v[k][r] . w[j][k] (pairs) for j < NR, v < MV, r < 8: MV panels of
// x against NR rows of the weight buffer, over `pairs` pairs of columns; MV * NR = 24 accumulators.
template <int MV, int NR>
OK_NOINLINE void micro_kernel_bf16(const uint32_t* __restrict x0, const uint32_t* __restrict x1,
                                   const uint32_t* __restrict w, int64_t pairs, float* __restrict ct, int64_t ldc) {
  __m256 a[NR][MV];
#pragma GCC unroll 24
  for (int j = 0; j < NR; ++j)
#pragma GCC unroll 2
    for (int v = 0; v < MV; ++v) a[j][v] = _mm256_loadu_ps(ct + j * ldc + 8 * v);
  for (int64_t k = 0; k < pairs; ++k) {
    __m256bh xv[MV];
    xv[0] = (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x0 + k * kPanel));
    if constexpr (MV == 2) xv[1] = (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x1 + k * kPanel));
#pragma GCC unroll 24
    for (int j = 0; j < NR; ++j) {
      const __m256bh b = (__m256bh)_mm256_set1_epi32(int(w[j * kLdw + k]));
#pragma GCC unroll 2
      for (int v = 0; v < MV; ++v) a[j][v] = _mm256_dpbf16_ps(a[j][v], xv[v], b);
    }
  }
#pragma GCC unroll 24
  for (int j = 0; j < NR; ++j)
#pragma GCC unroll 2
    for (int v = 0; v < MV; ++v) _mm256_storeu_ps(ct + j * ldc + 8 * v, a[j][v]);
}

// As gemm_chunk, in bfloat16: columns [c0, c0 + len) of W rows [n0, n0 + kNB) against staged rows
// [r0, r1).
template <int KIND>
void gemm_chunk_bf16(const Linear& L, const uint32_t* panels, int64_t c0, int64_t len, int64_t n0, int64_t r0,
                     int64_t r1, uint32_t* wbuf, float* ct, int64_t ldc) {
  dequantize_block_bf16<KIND>(L, n0, c0, len, wbuf);
  const int64_t panel_size = kPanel * (L.sh.K / 2);
  int64_t r = r0;
  for (; r + 2 * kPanel <= r1; r += 2 * kPanel) {  // 16 rows of x by 12 of W
    const uint32_t* x = panels + (r / kPanel) * panel_size + c0 / 2 * kPanel;
    for (int64_t j = 0; j < kNB && n0 + j < L.sh.N; j += kNR16)
      micro_kernel_bf16<2, kNR16>(x, x + panel_size, wbuf + j * kLdw, len / 2, ct + j * ldc + (r - r0), ldc);
  }
  if (r < r1) {  // 8 rows of x by 24 of W
    const uint32_t* x = panels + (r / kPanel) * panel_size + c0 / 2 * kPanel;
    micro_kernel_bf16<1, 2 * kNR16>(x, x, wbuf, len / 2, ct + (r - r0), ldc);
  }
}

// Rows [0, rows) of bfloat16 x (row stride x_stride elements) -> panel p of pairs (zeros past `rows`).
OK_NOINLINE void stage_panel_bf16(const Shape& sh, const uint16_t* x, int64_t x_stride, int64_t rows, int64_t p,
                                  uint32_t* __restrict panel) {
  const int64_t pairs = sh.K / 2;
  for (int64_t r = 0; r < kPanel; ++r) {
    const int64_t m = p * kPanel + r;
    if (m >= rows) {
      for (int64_t k = 0; k < pairs; ++k) panel[k * kPanel + r] = 0;
      continue;
    }
    const uint16_t* src = x + m * x_stride;
    for (int64_t k = 0; k < pairs; ++k) std::memcpy(panel + k * kPanel + r, src + 2 * k, sizeof(uint32_t));
  }
}
#endif  // OK_BF16_DOT

// More rows of x (M > kGemvMaxM, or bfloat16 x from kBf16MinM): units of kNB rows of W by m_block
// rows of x, chunks of their columns dequantized into a buffer and multiplied by staged panels of x.
// BF16: bfloat16 x, the vdpbf16ps kernels above; else float32.
template <int KIND, bool BF16>
void gemm(const Linear& L, const Params& params, const char* xb, int64_t x_stride, bool parallel, int threads) {
  const Shape& sh = L.sh;
  const int64_t elem = L.dtype == kF32 ? 4 : 2;
  using Word = std::conditional_t<BF16, uint32_t, float>;  // staged x and the weight buffer: bf16 pairs or floats
  const int64_t width = BF16 ? sh.K / 2 : sh.KP;            // words of a staged row of x
  const int64_t kc = BF16 ? kKC16 : kKC, cols_k = BF16 ? sh.K : sh.KP;
  // Rows of x per pass (a multiple of 8, at most 256 and ~16 MB of panels), each pass split into
  // blocks of rows (m_block) when there are few blocks of W rows to share between threads.
  const int64_t n_units = (sh.N + kNB - 1) / kNB;
  const int64_t most =
      std::max<int64_t>(16, std::min<int64_t>(256, (int64_t(1) << 22) / std::max<int64_t>(width, 1)) / 16 * 16);
  const int64_t pass_rows = std::min(most, (sh.M + kPanel - 1) / kPanel * kPanel);
  int64_t m_block = pass_rows;
  if (n_units < 4 * threads) {
    const int64_t want = (4 * threads + n_units - 1) / n_units;
    m_block = std::min(pass_rows, std::max<int64_t>(32, ((pass_rows + want - 1) / want + 15) / 16 * 16));
  }
  Floats sz(2 * sh.G * sh.N);
  Aligned<Word> xp(pass_rows * width);  // transposed panels of x
  Linear LW = L;
  LW.wt.sz = sz.p;
#pragma omp parallel num_threads(threads) if (parallel)
  {
    {
      Floats tmp(2 * sh.N);
#pragma omp for schedule(static)
      for (int64_t g = 0; g < sh.G; ++g)
        convert_params(params, g, sh.N, KIND == kInt4Sym ? 8.0f : 0.0f, sz.p + 2 * g * sh.N, tmp.p);
    }
    Floats tmp(L.dtype == kF16 ? sh.K : 0);
    Floats row(BF16 ? 0 : sh.KP);
    Aligned<Word> wbuf(kNB * (BF16 ? kLdw : kc));
    Floats ct(kNB * m_block);  // C^T of a unit: kNB rows of W x m_block rows of x
    for (int64_t m_base = 0; m_base < sh.M; m_base += pass_rows) {
      const int64_t rows = std::min(pass_rows, sh.M - m_base);
      const int64_t padded = (rows + kPanel - 1) / kPanel * kPanel;
      const int64_t m_units = (padded + m_block - 1) / m_block;
#pragma omp for schedule(static)
      for (int64_t p = 0; p < padded / kPanel; ++p) {
#if OK_BF16_DOT
        if constexpr (BF16)
          stage_panel_bf16(sh, reinterpret_cast<const uint16_t*>(xb) + m_base * x_stride, x_stride, rows, p,
                           xp.p + p * kPanel * width);
        else
#endif
          stage_panel<KIND>(sh, L.dtype, xb + m_base * x_stride * elem, x_stride, rows, p, tmp.p, row.p,
                            xp.p + p * kPanel * width);
      }
      const int64_t units = n_units * m_units, chunk = std::max<int64_t>(1, units / (8 * threads));
      auto unit = [&](int64_t u) {
        const int64_t n0 = (u % n_units) * kNB, r0 = (u / n_units) * m_block;
        const int64_t r1 = std::min(padded, r0 + m_block), ldc = r1 - r0;
        std::memset(ct.p, 0, size_t(kNB * ldc) * sizeof(float));
        for (int64_t c0 = 0; c0 < cols_k; c0 += kc) {
          const int64_t len = std::min(kc, cols_k - c0);
#if OK_BF16_DOT
          if constexpr (BF16) gemm_chunk_bf16<KIND>(LW, xp.p, c0, len, n0, r0, r1, wbuf.p, ct.p, ldc);
          else
#endif
            gemm_chunk<KIND>(LW, xp.p, c0, len, n0, r0, r1, wbuf.p, ct.p, ldc);
        }
        // out[m_base + r, n0 + j] = C^T[j, r] + bias[n0 + j]
        const int64_t cols = std::min(kNB, sh.N - n0);
        float y[kNB];
        for (int64_t r = r0; r < std::min(rows, r1); ++r) {
          for (int64_t j = 0; j < cols; ++j) y[j] = ct.p[j * ldc + r - r0] + (L.bias ? L.bias[n0 + j] : 0.0f);
          store(L.dtype, L.out, (m_base + r) * sh.N + n0, y, cols);
        }
      };
      if constexpr (BF16) {
        // Chunks that shrink to one unit at the end: the float32 kernel's fixed ones (10 units of
        // ~0.1 ms at M = 128) left a thread idle for up to 1 ms of an 11 ms call.
#pragma omp for schedule(guided)
        for (int64_t u = 0; u < units; ++u) unit(u);
      } else {
#pragma omp for schedule(dynamic, chunk)  // as for gemv
        for (int64_t u = 0; u < units; ++u) unit(u);
      }
    }
  }
}

template <int KIND>
void linear(Linear L, const Params& params, const void* x, int64_t x_stride, int num_threads) {
  const Shape& sh = L.sh;
  const char* xb = static_cast<const char*>(x);
  const int64_t elem = L.dtype == kF32 ? 4 : 2;
  const bool parallel = num_threads > 1 && sh.M * sh.N * std::max<int64_t>(sh.K, 1) >= kSerialBelow;
  const int threads = parallel ? num_threads : 1;
  if (sh.M <= kGemvMaxM && !(OK_BF16_DOT && L.dtype == kBF16 && sh.M >= kBf16MinM)) {
    const int64_t n_units = (sh.N + 3) / 4;  // 4 rows of W each
    const int64_t chunk = std::max<int64_t>(1, n_units / (8 * threads));
    Floats xp(sh.M * sh.KP);
    Floats xs(sh.M * sh.G);  // sum of each group of each staged row (int4's zeros, see gemv_tile)
    bool finite[kGemvMaxM];
#pragma omp parallel num_threads(threads) if (parallel)
    {
      Floats tmp(L.dtype == kF16 ? sh.K : 0);
#pragma omp for schedule(static)
      for (int64_t m = 0; m < sh.M; ++m) {
        float* row = xp.p + m * sh.KP;
        stage<KIND>(sh, L.dtype, xb + m * x_stride * elem, tmp.p, row);
        finite[m] = true;
        for (int64_t g = 0; g < sh.G; ++g) {
          float t = 0.0f;
          for (int64_t k = 0; k < sh.GP; ++k) t += row[g * sh.GP + k];
          xs.p[m * sh.G + g] = t;
          finite[m] = finite[m] && std::isfinite(t);
        }
      }
      const bool fold = KIND != kNf4 && std::all_of(finite, finite + sh.M, [](bool f) { return f; });
      // Dynamic chunks of consecutive units: a thread that the OS or a busy neighbour holds up
      // leaves its share to the others (on a shared 2-core machine the static split often waited),
      // while each thread still reads runs of rows (and prefetches the next tile of its chunk).
#pragma omp for schedule(dynamic, chunk)
      for (int64_t u = 0; u < n_units; ++u) {
        const int64_t rows = std::min<int64_t>(4, sh.N - 4 * u);
        if (fold) gemv_unit<KIND, KIND != kNf4>(L, xp.p, xs.p, 4 * u, rows);
        else gemv_unit<KIND, false>(L, xp.p, xs.p, 4 * u, rows);
      }
    }
    return;
  }
#if OK_BF16_DOT
  if (L.dtype == kBF16) return gemm<KIND, true>(L, params, xb, x_stride, parallel, threads);
#endif
  gemm<KIND, false>(L, params, xb, x_stride, parallel, threads);
}

// ---- dequantization ----

template <int KIND>
OK_NOINLINE void dequantize_row(const Shape& sh, const Params& p, int64_t n, const uint8_t* q, const float* nf4,
                                float* __restrict row) {
  for (int64_t g = 0; g < sh.G; ++g) {
    const float s = half(p.s + g * p.s_stride + n, p.bf16);
    const uint8_t* b = q + g * (sh.gs / 2);
    float* r = row + g * sh.gs;
    if constexpr (KIND == kNf4) {
      for (int64_t j = 0; j < sh.gs / 2; ++j) {
        r[2 * j] = nf4[b[j] & 15] * s;
        r[2 * j + 1] = nf4[b[j] >> 4] * s;
      }
    } else {
      const float z = KIND == kInt4Zeros ? half(p.z + g * p.z_stride + n, p.bf16) : 8.0f;
      for (int64_t j = 0; j < sh.gs / 2; ++j) {  // (q - z) * s, as the reference computes it
        r[2 * j] = (float(b[j] & 15) - z) * s;
        r[2 * j + 1] = (float(b[j] >> 4) - z) * s;
      }
    }
  }
}

#if defined(__AVX512BW__)
// A row into a 16-bit dtype (bfloat16 or float16) through a table: each group's 16 values (code - z)
// s, or level * s, are computed and rounded once, as the float path computes and rounds them, into a
// 16-entry table of 16-bit words; then every 16 bytes of codes (32 columns) are 32 word indices in
// column order (low nibble, high nibble, per byte) and one vpermw reads their values. The same bits
// as dequantize_row + store, several times faster (the float path decodes, then converts in a second
// pass). Groups of a multiple of 32 columns only (the caller checks).
template <int KIND>
OK_NOINLINE void dequantize_row_16bit(const Shape& sh, const Params& p, int64_t n, const uint8_t* q, const float* nf4,
                                      uint16_t* __restrict row, int dtype) {
  alignas(64) float values[16];
  alignas(64) uint16_t table[32] = {};
  const __m512i low = _mm512_set1_epi32(0x0f);
  const __m512i high = _mm512_set1_epi32(0xf0 << 12);  // the high nibble, moved to bits 16-19
  for (int64_t g = 0; g < sh.G; ++g) {
    const float s = half(p.s + g * p.s_stride + n, p.bf16);
    if constexpr (KIND == kNf4) {
      for (int c = 0; c < 16; ++c) values[c] = nf4[c] * s;
    } else {
      const float z = KIND == kInt4Zeros ? half(p.z + g * p.z_stride + n, p.bf16) : 8.0f;
      for (int c = 0; c < 16; ++c) values[c] = (float(c) - z) * s;
    }
    if (dtype == kBF16) {
      for (int c = 0; c < 16; ++c) table[c] = bf16_store(values[c]);
    } else {
      float_to_f16(values, table, 16);
    }
    const __m512i lut = _mm512_load_si512(table);
    const uint8_t* b = q + g * (sh.gs / 2);
    uint16_t* r = row + g * sh.gs;
    for (int64_t j = 0; j < sh.gs / 2; j += 16) {
      // byte j -> 32-bit lane j: low nibble in bits 0-3 (word 2j), high nibble in bits 16-19 (word 2j + 1)
      const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + j)));
      const __m512i idx = _mm512_or_si512(_mm512_and_si512(d, low), _mm512_and_si512(_mm512_slli_epi32(d, 12), high));
      _mm512_storeu_si512(r + 2 * j, _mm512_permutexvar_epi16(idx, lut));
    }
  }
}
#endif

template <int KIND>
void dequantize(const Shape& sh, const Params& p, const uint8_t* q, int64_t q_stride, const float* nf4, void* out,
                int dtype, int num_threads) {
  const bool parallel = num_threads > 1 && sh.N * sh.K >= kSerialBelow;
#if defined(__AVX512BW__)
  if (dtype != kF32 && sh.gs % 32 == 0) {
#pragma omp parallel for schedule(static) num_threads(parallel ? num_threads : 1) if (parallel)
    for (int64_t n = 0; n < sh.N; ++n)
      dequantize_row_16bit<KIND>(sh, p, n, q + n * q_stride, nf4, static_cast<uint16_t*>(out) + n * sh.K, dtype);
    return;
  }
#endif
#pragma omp parallel num_threads(parallel ? num_threads : 1) if (parallel)
  {
    Floats tmp(dtype == kF32 ? 0 : sh.K);
#pragma omp for schedule(static)
    for (int64_t n = 0; n < sh.N; ++n) {
      float* row = dtype == kF32 ? static_cast<float*>(out) + n * sh.K : tmp.p;
      dequantize_row<KIND>(sh, p, n, q + n * q_stride, nf4, row);
      if (dtype != kF32) store(dtype, out, n * sh.K, row, sh.K);
    }
  }
}

bool valid(const Shape& sh, int dtype, int kind, const Params& p) {
  return (dtype == kF32 || dtype == kBF16 || dtype == kF16) && kind >= kInt4Zeros && kind <= kNf4 && sh.gs > 0 &&
         sh.gs % 2 == 0 && sh.K % sh.gs == 0 && (kind == kInt4Zeros) == (p.z != nullptr);
}

}  // namespace

// Strides are in elements; x and the scale / zero tables have unit column stride, out is contiguous.
// dtype codes: 0 float32, 1 bfloat16, 2 float16 (x and out); s_bf16: scales and zeros in bfloat16, else
// float16. kind: 0 int4 with zeros (z given), 1 int4 symmetric (zero 8), 2 nf4 (nf4: the 16 float32
// levels). bias: (N,) float32 or null. Each returns 0, or -1 for a bad code, group size or zeros pointer.
extern "C" {

int ok_int4_linear(const void* x, int64_t x_stride, const uint8_t* q, int64_t q_stride, const uint16_t* s,
                   int64_t s_stride, const uint16_t* z, int64_t z_stride, int s_bf16, const float* nf4,
                   const float* bias, void* out, int64_t M, int64_t N, int64_t K, int64_t group_size, int dtype,
                   int kind, int num_threads) {
  const Params params{s, s_stride, z, z_stride, s_bf16 != 0};
  const Linear L{Shape(M, N, K, group_size), Weight{q, q_stride, params, nullptr, nf4}, bias, out, dtype};
  if (!valid(L.sh, dtype, kind, params)) return -1;
  switch (kind) {
    case kInt4Zeros: linear<kInt4Zeros>(L, params, x, x_stride, num_threads); break;
    case kInt4Sym: linear<kInt4Sym>(L, params, x, x_stride, num_threads); break;
    default: linear<kNf4>(L, params, x, x_stride, num_threads); break;
  }
  return 0;
}

// The smallest M from which bfloat16 x runs the vdpbf16ps kernels (W rounded to bfloat16), or 0 where
// this build has none (no AVX512-BF16): what the Python side tells its callers and tests.
int ok_int4_bf16_min_rows(void) { return OK_BF16_DOT ? int(kBf16MinM) : 0; }

// Packed entry: every argument in one 64-bit slot, for openkernels.shared.replay's C side.
int ok_int4_linear_packed(const int64_t* a) {
  auto p = [a](int i) { return reinterpret_cast<const void*>(a[i]); };
  auto i32 = [a](int i) { return static_cast<int>(a[i]); };
  return ok_int4_linear(p(0), a[1], static_cast<const uint8_t*>(p(2)), a[3], static_cast<const uint16_t*>(p(4)), a[5],
                        static_cast<const uint16_t*>(p(6)), a[7], i32(8), static_cast<const float*>(p(9)),
                        static_cast<const float*>(p(10)), reinterpret_cast<void*>(a[11]), a[12], a[13], a[14], a[15],
                        i32(16), i32(17), i32(18));
}

int ok_int4_dequantize(const uint8_t* q, int64_t q_stride, const uint16_t* s, int64_t s_stride, const uint16_t* z,
                       int64_t z_stride, int s_bf16, const float* nf4, void* out, int64_t N, int64_t K,
                       int64_t group_size, int dtype, int kind, int num_threads) {
  const Shape sh(1, N, K, group_size);
  const Params params{s, s_stride, z, z_stride, s_bf16 != 0};
  if (!valid(sh, dtype, kind, params)) return -1;
  switch (kind) {
    case kInt4Zeros: dequantize<kInt4Zeros>(sh, params, q, q_stride, nf4, out, dtype, num_threads); break;
    case kInt4Sym: dequantize<kInt4Sym>(sh, params, q, q_stride, nf4, out, dtype, num_threads); break;
    default: dequantize<kNf4>(sh, params, q, q_stride, nf4, out, dtype, num_threads); break;
  }
  return 0;
}

}  // extern "C"
