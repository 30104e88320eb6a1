// Helpers of quant's CUDA C++ kernels (int4_gemv.cu, int4_tc.cu): 16-bit <-> float, the
// magic numbers that turn a nibble into base + q in a 16-bit float, packed 16-bit arithmetic
// as the GPU rounds it, mma.m16n8k16 and its operands' byte permutes; each with its CPU-
// emulation twin (OK_CUDA_EMULATION: cuda_emulation.h). Include after the CUDA headers or
// cuda_emulation.h, inside the including file's anonymous namespace.
#pragma once

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

template <typename T>
struct MmaMagic;
template <>
struct MmaMagic<__nv_bfloat16> {
  static constexpr uint32_t kBits = 0x43004300u;  // 128 in both halves
  static constexpr float kBase = 128.f;
  static constexpr bool kBf16 = true;
};
template <>
struct MmaMagic<__half> {
  static constexpr uint32_t kBits = 0x64006400u;  // 1024 in both halves
  static constexpr float kBase = 1024.f;
  static constexpr bool kBf16 = false;
};

template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  const T a = from_float<T>(lo), b = from_float<T>(hi);
  uint16_t ua, ub;
  memcpy(&ua, &a, 2);
  memcpy(&ub, &b, 2);
  return static_cast<uint32_t>(ua) | (static_cast<uint32_t>(ub) << 16);
}

// Two packed values of T: the 16-bit halves of a 32-bit word as floats (the emulation's view),
// and, on the GPU, the word as the packed type (__nv_bfloat162 / __half2) and back.
template <typename T>
__device__ __forceinline__ float half_of(uint32_t w, int i) {
  T h;
  const uint16_t b = static_cast<uint16_t>(w >> (16 * i));
  memcpy(&h, &b, 2);
  return to_float(h);
}
#ifndef OK_CUDA_EMULATION
template <typename T>
using Packed2 = std::conditional_t<MmaMagic<T>::kBf16, __nv_bfloat162, __half2>;
template <typename T>
__device__ __forceinline__ Packed2<T> as_packed(uint32_t w) {
  Packed2<T> p;
  memcpy(&p, &w, 4);
  return p;
}
template <typename P>
__device__ __forceinline__ uint32_t as_word(P p) {
  uint32_t w;
  memcpy(&w, &p, 4);
  return w;
}
#endif

// (v - sub) * mul on two packed values of T, each operation rounded as the GPU's packed ops.
template <typename T>
__device__ __forceinline__ uint32_t sub_mul2(uint32_t v, uint32_t sub, uint32_t mul) {
#ifdef OK_CUDA_EMULATION
  float r[2];
  for (int i = 0; i < 2; ++i) r[i] = to_float(from_float<T>(half_of<T>(v, i) - half_of<T>(sub, i))) * half_of<T>(mul, i);
  return pack2<T>(r[0], r[1]);
#else
  return as_word(__hmul2(__hsub2(as_packed<T>(v), as_packed<T>(sub)), as_packed<T>(mul)));
#endif
}

template <typename T>
__device__ __forceinline__ void mma_16816(float* d, const uint32_t* a, const uint32_t* b) {
#ifdef OK_CUDA_EMULATION
  ok_emu::mma_m16n8k16(d, a, b, MmaMagic<T>::kBf16);
#else
  if constexpr (MmaMagic<T>::kBf16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
#endif
}

// (v & MASK) | BITS in one LOP3: written in C, the two constants take two LOP3s (the
// instruction holds one immediate), a third of the dequantization's instructions in the
// tensor-core GEMV's SASS; here ptxas keeps one constant in a register.
template <uint32_t MASK, uint32_t BITS>
__device__ __forceinline__ uint32_t and_or(uint32_t v) {
#ifdef OK_CUDA_EMULATION
  return (v & MASK) | BITS;
#else
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(v), "n"(MASK), "n"(BITS));  // 0xEA: (a & b) | c
  return d;
#endif
}

// Values i and j of 32 packed 16-bit values (16 words), as one register: i low, j high. One
// byte permute (i, j compile-time): bytes 0-3 of the first word, 4-7 of the second.
__device__ __forceinline__ uint32_t pick2(const uint32_t* words, int i, int j) {
  const unsigned selector = (i % 2 ? 0x32u : 0x10u) | ((j % 2 ? 0x76u : 0x54u) << 8);
  return __byte_perm(words[i / 2], words[j / 2], selector);
}

// v - sub on two packed values of T, rounded as the GPU's packed subtraction.
template <typename T>
__device__ __forceinline__ uint32_t sub2(uint32_t v, uint32_t sub) {
#ifdef OK_CUDA_EMULATION
  return pack2<T>(half_of<T>(v, 0) - half_of<T>(sub, 0), half_of<T>(v, 1) - half_of<T>(sub, 1));
#else
  return as_word(__hsub2(as_packed<T>(v), as_packed<T>(sub)));
#endif
}

// prmt.b32 in its default mode: byte n of the result is byte (selector nibble n & 7) of the 8
// bytes {a (0-3), b (4-7)}, or, where the nibble's bit 3 is set, that byte's sign bit copied
// over all 8 bits (CUDA's __byte_perm is documented for the low 3 bits only; the emulation's
// twin ignores bit 3).
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t selector) {
#ifdef OK_CUDA_EMULATION
  const uint64_t bytes = static_cast<uint64_t>(a) | (static_cast<uint64_t>(b) << 32);
  uint32_t out = 0;
  for (int n = 0; n < 4; ++n) {
    const uint32_t nibble = (selector >> (4 * n)) & 0xF;
    uint32_t byte = static_cast<uint32_t>(bytes >> (8 * (nibble & 7))) & 0xFF;
    if (nibble & 8) byte = (byte & 0x80) ? 0xFF : 0x00;
    out |= byte << (8 * n);
  }
  return out;
#else
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(selector));
  return d;
#endif
}

// v * mul on two packed values of T, rounded as the GPU's packed multiply.
template <typename T>
__device__ __forceinline__ uint32_t mul2(uint32_t v, uint32_t mul) {
#ifdef OK_CUDA_EMULATION
  return pack2<T>(half_of<T>(v, 0) * half_of<T>(mul, 0), half_of<T>(v, 1) * half_of<T>(mul, 1));
#else
  return as_word(__hmul2(as_packed<T>(v), as_packed<T>(mul)));
#endif
}

// The 16 NF4 levels (format.py's NF4_VALUES) rounded to T, as byte tables for prmt: kLowJ
// holds the low bytes of levels 4J .. 4J + 3 (byte i: level 4J + i), kHighJ their high
// bytes (scalars: a constexpr array indexed in device code would need device storage). test_gemv.py checks these words against NF4_VALUES.
template <typename T>
struct Nf4Table;
template <>
struct Nf4Table<__nv_bfloat16> {
  static constexpr uint32_t kLow0 = 0xCA063280u, kLow1 = 0x00BA3D92u, kLow2 = 0xAD7C25A3u, kLow3 = 0x803910E2u;
  static constexpr uint32_t kHigh0 = 0xBEBFBFBFu, kHigh1 = 0x00BDBEBEu, kHigh2 = 0x3E3E3E3Du, kHigh3 = 0x3F3F3F3Eu;
};
template <>
struct Nf4Table<__half> {
  static constexpr uint32_t kLow0 = 0x52339200u, kLow1 = 0x00D4EA8Du, kLow2 = 0x68E02618u, kLow3 = 0x00C9800Du;
  static constexpr uint32_t kHigh0 = 0xB6B8B9BCu, kHigh1 = 0x00ADB1B4u, kHigh2 = 0x3533312Du, kHigh3 = 0x3C393837u;
};

// Four NF4 codes of a 32-bit word of codes (nibbles 4 HALF .. 4 HALF + 3; HALF 0 or 1) ->
// two packed pairs of their levels in T: p0 = (level[nibble 0], level[nibble 1]), p1 =
// (level[2], level[3]) of the half, the first code in the low half. A register lookup, no
// memory: the selector (the nibbles' low 3 bits) reads the low and the high bytes of levels
// 0-7 and of 8-15 (four prmt), a mask of each nibble's bit 3 (one shift and one sign-
// replicating prmt) picks between the two (two LOP3), and two prmt interleave the low and
// high bytes into 16-bit values: 11 instructions per 4 codes, the shift shared by both halves.
template <typename T, int HALF>
__device__ __forceinline__ void nf4_levels(uint32_t word, uint32_t& p0, uint32_t& p1) {
  using Table = Nf4Table<T>;
  const uint32_t selector = (HALF ? word >> 16 : word) & 0x7777u;
  // Byte n of the mask: 0xFF where nibble 4 HALF + n has bit 3 set. Nibble 2i's bit 3 is bit 7
  // of (word << 4)'s byte i, nibble 2i + 1's is bit 7 of word's byte i.
  const uint32_t high_half = prmt(word, word << 4, HALF ? 0xBFAEu : 0x9D8Cu);
  const uint32_t low = (prmt(Table::kLow0, Table::kLow1, selector) & ~high_half) |
                       (prmt(Table::kLow2, Table::kLow3, selector) & high_half);
  const uint32_t high = (prmt(Table::kHigh0, Table::kHigh1, selector) & ~high_half) |
                        (prmt(Table::kHigh2, Table::kHigh3, selector) & high_half);
  p0 = prmt(low, high, 0x5140u);
  p1 = prmt(low, high, 0x7362u);
}
