// How fast can the tensor-core GEMV's access pattern read an int4 weight at M = 1?
// (issue 24: the H200 streams the weight at 0.48-0.53 of copy with the real kernel.)
//
// Standalone study, no PyTorch: each variant reads an N x K int4 weight (N x K/2 bytes) the way
// quant's int4_tc_kernel does (CTA of 8 warps over 16 TILES rows, chunks of 128 codes, warp w
// takes chunks w, w + 8, ..., each trip issues UNROLL chunks' 16-byte loads evict-first, then
// "math"), with the math replaced by `spin` dependent FMAs per loaded word (about 13 for the
// real kernel's dequantization and MMAs), so that the memory side can be timed apart:
//   layout  rows: the stored layout (a warp instruction reads 64 bytes of 8 rows);
//           packed: each (16-row tile, chunk) block contiguous, a warp instruction 512 bytes;
//   pipe    0: load, wait, math (the kernel today); 1: the next trip's loads issued before
//           this trip's math (registers double);
//   x       1: x's 64 bytes per lane and chunk read too (L2 hits, as the kernel does);
//   split   K over `split` CTAs (the -k2 configs, without the cluster exchange).
// Beside them a plain streaming read of the same bytes (the ceiling at this size) and a large
// device copy. Kernel time: a CUDA graph of launches rotating over >= 400 MB of weight copies.
//
//   nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/read_pattern benchmarks/studies/int4_read_pattern.cu
//   /tmp/read_pattern            # prints one table per shape

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(call)                                                                    \
  do {                                                                                 \
    cudaError_t e_ = (call);                                                           \
    if (e_ != cudaSuccess) {                                                           \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
      std::exit(1);                                                                    \
    }                                                                                  \
  } while (0)

constexpr int kWarps = 8;

__device__ __forceinline__ float spin_word(uint32_t v, int spin, float c1, float c2) {
  float f = __uint_as_float((v & 0x3f3f3f3fu) | 0x3f000000u);  // a normal float from the word
#pragma unroll 4
  for (int i = 0; i < spin; ++i) f = fmaf(f, c1, c2);
  return f;
}

template <int TILES, int UNROLL, bool PACKED>
__device__ __forceinline__ void load_trip(uint4 (&buf)[UNROLL][TILES][2], uint4 (&xb)[UNROLL][4],
                                          const uint8_t* __restrict__ w, const uint8_t* __restrict__ x, int64_t n0,
                                          int64_t first, int64_t c1, int64_t n_chunks, int64_t row_bytes, bool xload) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    const int64_t chunk = first + static_cast<int64_t>(u) * kWarps;
    if (chunk >= c1) continue;  // warp-uniform
#pragma unroll
    for (int tile = 0; tile < TILES; ++tile) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint8_t* p;
        if (PACKED) {
          p = w + ((n0 / 16 + tile) * n_chunks + chunk) * 1024 + h * 512 + lane * 16;
        } else {
          p = w + (n0 + 16 * tile + g + 8 * h) * row_bytes + chunk * 64 + 16 * t;
        }
        buf[u][tile][h] = __ldcs(reinterpret_cast<const uint4*>(p));
      }
    }
    if (xload) {
#pragma unroll
      for (int q = 0; q < 4; ++q) xb[u][q] = *reinterpret_cast<const uint4*>(x + chunk * 256 + 64 * t + 16 * q);
    }
  }
}

template <int TILES, int UNROLL>
__device__ __forceinline__ float math_trip(const uint4 (&buf)[UNROLL][TILES][2], const uint4 (&xb)[UNROLL][4],
                                           int64_t first, int64_t c1, int spin, float c1f, float c2f) {
  float acc = 0.f;
#pragma unroll
  for (int u = 0; u < UNROLL; ++u) {
    if (first + static_cast<int64_t>(u) * kWarps >= c1) continue;
    uint32_t xs = xb[u][0].x ^ xb[u][1].y ^ xb[u][2].z ^ xb[u][3].w;
#pragma unroll
    for (int tile = 0; tile < TILES; ++tile) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint4 v = buf[u][tile][h];
        acc += spin_word(v.x ^ xs, spin, c1f, c2f) + spin_word(v.y, spin, c1f, c2f) +
               spin_word(v.z, spin, c1f, c2f) + spin_word(v.w, spin, c1f, c2f);
      }
    }
  }
  return acc;
}

template <int TILES, int UNROLL, bool PACKED, bool PIPE>
__global__ void __launch_bounds__(kWarps * 32) tc_read(const uint8_t* __restrict__ w, const uint8_t* __restrict__ x,
                                                       int64_t n, int64_t k, int splits, int spin, float c1f,
                                                       float c2f, int xload, float* sink) {
  const int warp = threadIdx.x >> 5;
  const int rank = static_cast<int>(blockIdx.x % splits);
  const int64_t n0 = static_cast<int64_t>(blockIdx.x / splits) * 16 * TILES;
  const int64_t n_chunks = k / 128, per = (n_chunks + splits - 1) / splits;
  const int64_t c0 = per * rank < n_chunks ? per * rank : n_chunks, c1 = c0 + per < n_chunks ? c0 + per : n_chunks;
  const int64_t row_bytes = k / 2;
  float acc = 0.f;
  uint4 buf[UNROLL][TILES][2], xb[UNROLL][4] = {};
  if (!PIPE) {
    for (int64_t first = c0 + warp; first < c1; first += kWarps * UNROLL) {
      load_trip<TILES, UNROLL, PACKED>(buf, xb, w, x, n0, first, c1, n_chunks, row_bytes, xload);
      acc += math_trip<TILES, UNROLL>(buf, xb, first, c1, spin, c1f, c2f);
    }
  } else {
    uint4 nxt[UNROLL][TILES][2], nxb[UNROLL][4] = {};
    int64_t first = c0 + warp;
    if (first < c1) load_trip<TILES, UNROLL, PACKED>(buf, xb, w, x, n0, first, c1, n_chunks, row_bytes, xload);
    for (; first < c1; first += kWarps * UNROLL) {
      const int64_t next = first + kWarps * UNROLL;
      if (next < c1) load_trip<TILES, UNROLL, PACKED>(nxt, nxb, w, x, n0, next, c1, n_chunks, row_bytes, xload);
      acc += math_trip<TILES, UNROLL>(buf, xb, first, c1, spin, c1f, c2f);
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
#pragma unroll
        for (int q = 0; q < 4; ++q) xb[u][q] = nxb[u][q];
#pragma unroll
        for (int tile = 0; tile < TILES; ++tile) {
          buf[u][tile][0] = nxt[u][tile][0];
          buf[u][tile][1] = nxt[u][tile][1];
        }
      }
    }
  }
  if (acc == 1234.5f) sink[blockIdx.x * blockDim.x + threadIdx.x] = acc;  // never true: keeps the loads
}

template <int U>
__global__ void __launch_bounds__(256) stream_read(const uint4* __restrict__ w, int64_t n16, float* sink) {
  float acc = 0.f;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * 256 * U + threadIdx.x; i < n16;
       i += static_cast<int64_t>(gridDim.x) * 256 * U) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = i + u * 256 < n16 ? __ldcs(w + i + u * 256) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int u = 0; u < U; ++u) acc += __uint_as_float(((v[u].x ^ v[u].y ^ v[u].z ^ v[u].w) & 0x3f3f3f3fu) | 0x3f000000u);
  }
  if (acc == 1234.5f) sink[blockIdx.x * blockDim.x + threadIdx.x] = acc;
}

struct Variant {
  const char* name;
  int tiles, unroll, packed, pipe, split, spin, xload, occ;  // occ: CTAs per SM (shared memory holds it)
};

using Launch = void (*)(const uint8_t*, const uint8_t*, int64_t, int64_t, const Variant&, float*, cudaStream_t);

template <int TILES, int UNROLL, bool PACKED, bool PIPE>
void launch_tc(const uint8_t* w, const uint8_t* x, int64_t n, int64_t k, const Variant& v, float* sink,
               cudaStream_t s) {
  const int grid = static_cast<int>(n / (16 * TILES)) * v.split;
  // The real kernel's 117-183 registers allow two CTAs per SM; this one's fewer would allow more.
  const int smem = v.occ > 0 ? (227 << 10) / v.occ - (2 << 10) : 0;
  CHECK(cudaFuncSetAttribute(tc_read<TILES, UNROLL, PACKED, PIPE>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  tc_read<TILES, UNROLL, PACKED, PIPE><<<grid, kWarps * 32, smem, s>>>(w, x, n, k, v.split, v.spin, 0.999f, 0.001f,
                                                                    v.xload, sink);
}

Launch pick(const Variant& v) {
#define PICK(T, U)                                                                              \
  if (v.tiles == T && v.unroll == U) {                                                          \
    if (v.packed) return v.pipe ? launch_tc<T, U, true, true> : launch_tc<T, U, true, false>;    \
    return v.pipe ? launch_tc<T, U, false, true> : launch_tc<T, U, false, false>;               \
  }
  PICK(1, 2)
  PICK(2, 1)
  PICK(2, 2)
  PICK(4, 1)
#undef PICK
  return nullptr;
}

int main(int argc, char** argv) {
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  cudaStream_t s;
  CHECK(cudaStreamCreate(&s));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  float* sink;
  CHECK(cudaMalloc(&sink, 64 << 20));

  // The large-copy ceiling (bytes read + written).
  {
    const size_t bytes = size_t(1) << 30;
    void *a, *b;
    CHECK(cudaMalloc(&a, bytes));
    CHECK(cudaMalloc(&b, bytes));
    CHECK(cudaMemset(a, 1, bytes));
    std::vector<float> ts;
    for (int r = 0; r < 7; ++r) {
      CHECK(cudaEventRecord(e0, s));
      CHECK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, s));
      CHECK(cudaEventRecord(e1, s));
      CHECK(cudaEventSynchronize(e1));
      float ms;
      CHECK(cudaEventElapsedTime(&ms, e0, e1));
      ts.push_back(ms);
    }
    std::sort(ts.begin(), ts.end());
    std::printf("%s, %d SMs; copy 1 GiB: %.0f GB/s (read + write)\n", prop.name, sms, 2.0 * bytes / ts[3] / 1e6);
    CHECK(cudaFree(a));
    CHECK(cudaFree(b));
  }

  const int64_t shapes[][2] = {{8192, 8192}, {28672, 8192}, {2048, 8192}};
  for (const auto& shape : shapes) {
    const int64_t n = shape[0], k = shape[1];
    const size_t bytes = static_cast<size_t>(n) * k / 2;
    const int copies = static_cast<int>(std::max<size_t>(4, (size_t(400) << 20) / bytes + 1));
    std::vector<uint8_t*> ws(copies);
    for (auto& p : ws) {
      CHECK(cudaMalloc(&p, bytes));
      CHECK(cudaMemset(p, 0x5a, bytes));
    }
    uint8_t* x;
    CHECK(cudaMalloc(&x, k * 2));
    CHECK(cudaMemset(x, 0x11, k * 2));
    const int split_big = n >= 16384 ? 1 : 2;
    std::vector<Variant> variants;
    variants.push_back({"stream u4 (ceiling)", 0, 4, 0, 0, 0, 0, 0, 0});
    variants.push_back({"stream u8", 0, 8, 0, 0, 0, 0, 0, 0});
    for (int occ : {2, 4}) {
      variants.push_back({"tc", 4, 1, 0, 0, split_big, 0, 0, occ});
      variants.push_back({"tc", 4, 1, 1, 0, split_big, 0, 0, occ});
    }
    for (int spin : {0, 13}) {
      for (int xload : {0, 1}) {
        if (spin == 0 && xload == 1) continue;
        for (int packed : {0, 1}) {
          for (int pipe : {0, 1}) {
            variants.push_back({"tc", 4, 1, packed, pipe, split_big, spin, xload, 2});
            variants.push_back({"tc", 2, 2, packed, pipe, split_big, spin, xload, 2});
            if (n <= 8192) variants.push_back({"tc", 4, 1, packed, pipe, 1, spin, xload, 2});
            if (n <= 2048) variants.push_back({"tc", 1, 2, packed, pipe, 2, spin, xload, 2});
          }
        }
      }
    }
    std::printf("\nN x K = %lld x %lld (%.1f MB of codes), %d copies rotated\n", (long long)n, (long long)k, bytes / 1e6,
                copies);
    std::printf("%-22s %5s %6s %6s %5s %5s %5s %4s | %8s %8s\n", "variant", "tiles", "unroll", "layout", "pipe",
                "split", "spin", "occ", "us", "GB/s");
    for (const auto& v : variants) {
      const bool stream = v.tiles == 0;
      Launch launch = stream ? nullptr : pick(v);
      if (!stream && launch == nullptr) continue;
      auto one = [&](int c) {
        if (stream) {
          const int64_t n16 = static_cast<int64_t>(bytes / 16);
          const int grid = static_cast<int>(std::min<int64_t>((n16 + 256 * v.unroll - 1) / (256 * v.unroll), sms * 16));
          if (v.unroll == 4) stream_read<4><<<grid, 256, 0, s>>>(reinterpret_cast<const uint4*>(ws[c]), n16, sink);
          else stream_read<8><<<grid, 256, 0, s>>>(reinterpret_cast<const uint4*>(ws[c]), n16, sink);
        } else {
          launch(ws[c], x, n, k, v, sink, s);
        }
      };
      for (int c = 0; c < copies; ++c) one(c);  // warm-up
      CHECK(cudaStreamSynchronize(s));
      CHECK(cudaGetLastError());
      const int calls = copies * 4;
      cudaGraph_t graph;
      cudaGraphExec_t exec;
      CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
      for (int i = 0; i < calls; ++i) one(i % copies);
      CHECK(cudaStreamEndCapture(s, &graph));
      CHECK(cudaGraphInstantiate(&exec, graph, 0));
      CHECK(cudaGraphLaunch(exec, s));
      CHECK(cudaStreamSynchronize(s));
      std::vector<float> ts;
      for (int r = 0; r < 9; ++r) {
        CHECK(cudaEventRecord(e0, s));
        CHECK(cudaGraphLaunch(exec, s));
        CHECK(cudaEventRecord(e1, s));
        CHECK(cudaEventSynchronize(e1));
        float ms;
        CHECK(cudaEventElapsedTime(&ms, e0, e1));
        ts.push_back(ms * 1000.f / calls);
      }
      CHECK(cudaGraphExecDestroy(exec));
      CHECK(cudaGraphDestroy(graph));
      std::sort(ts.begin(), ts.end());
      const float us = ts[ts.size() / 2];
      std::printf("%-22s %5d %6d %6s %5d %5d %5d %4d | %8.2f %8.0f%s\n", stream ? v.name : "tc pattern", v.tiles,
                  v.unroll, stream ? "-" : (v.packed ? "packed" : "rows"), v.pipe, v.split, v.spin, v.occ, us,
                  bytes / us / 1e3,
                  v.xload ? "  (+x)" : "");
    }
    for (auto p : ws) CHECK(cudaFree(p));
    CHECK(cudaFree(x));
  }
  return 0;
}
