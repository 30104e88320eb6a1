// Runs a CUDA C++ kernel source on the CPU, for tests without a GPU: the CUDA counterpart of
// the Triton interpreter. Compiled as C++20 with -DOK_CUDA_EMULATION (cuda_build.load_emulated);
// a source includes this header instead of the CUDA ones under that macro.
//
// Model: each CTA runs on its own OS thread, its CUDA threads as fibers scheduled
// round-robin, each to its next stop. A warp-wide operation (shuffle, mma) waits for the 32
// lanes of its warp; __syncthreads and a cluster barrier's sync, arrive or wait for every
// thread of the CTA, at the same kind of stop: a kernel whose threads diverge on a barrier,
// or whose lanes do not all reach a warp-wide operation, aborts with a message. The
// CTAs of a cluster run at once and meet at a std::barrier; clusters run one after another.
// __shared__ variables are thread_local (one copy per CTA thread), and map_shared_rank finds a
// peer's copy by the variable's offset in this library's TLS block, the same in every thread.
// Dynamic shared memory starts filled with 0xff bytes, and cp.async copies land only at the
// cp.async.wait_group / wait_all that covers them: a read too early sees stale bytes.
// Memory is the host's: the kernels take CPU pointers. Not emulated: warps beyond the shuffles
// (no lockstep, no warp-level barriers), memory ordering weaker than the barriers', atomics,
// and anything that is not used by this project's sources.
#pragma once

#include <ucontext.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <tuple>
#include <vector>

// ---- language ------------------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static thread_local

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct uint2 {
  unsigned x, y;
};
struct uint4 {
  unsigned x, y, z, w;
};
struct float2 {
  float x, y;
};
inline float2 make_float2(float x, float y) { return {x, y}; }
struct alignas(16) float4 {
  float x, y, z, w;
};
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }

inline float rsqrtf(float v) { return 1.0f / std::sqrt(v); }
// Byte n of the result is byte (selector nibble n & 7) of the 8 bytes {x (0-3), y (4-7)}.
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned selector) {
  const uint64_t bytes = static_cast<uint64_t>(x) | (static_cast<uint64_t>(y) << 32);
  unsigned out = 0;
  for (int n = 0; n < 4; ++n) out |= static_cast<unsigned>((bytes >> (8 * ((selector >> (4 * n)) & 7))) & 0xFF) << (8 * n);
  return out;
}
inline uint4 __ldcs(const uint4* p) { return *p; }
inline uint4 __ldcg(const uint4* p) { return *p; }
inline void __stcs(uint4* p, uint4 v) { *p = v; }

// ---- 16-bit floats ------------------------------------------------------------------------
struct __nv_bfloat16 {
  uint16_t bits;
};
inline float __bfloat162float(__nv_bfloat16 v) {
  const uint32_t u = static_cast<uint32_t>(v.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return {static_cast<uint16_t>((u >> 16) | 0x40)};  // quiet NaN, sign kept
  u += 0x7FFFu + ((u >> 16) & 1u);  // round to nearest even
  return {static_cast<uint16_t>(u >> 16)};
}
struct __half {
  _Float16 value;
};
inline float __half2float(__half v) { return static_cast<float>(v.value); }
inline __half __float2half_rn(float f) { return {static_cast<_Float16>(f)}; }

// ---- runtime -------------------------------------------------------------------------------
enum cudaError_t { cudaSuccess = 0, cudaErrorInvalidValue = 1, cudaErrorInvalidConfiguration = 9 };
enum cudaFuncAttribute {
  cudaFuncAttributeMaxDynamicSharedMemorySize = 8,
  cudaFuncAttributeNonPortableClusterSizeAllowed = 16
};
enum cudaLaunchAttributeID {
  cudaLaunchAttributeClusterDimension = 4,
  cudaLaunchAttributeProgrammaticStreamSerialization = 5  // launches run one after another here anyway
};
using cudaStream_t = struct CUstream_st*;
struct cudaLaunchAttributeValue {
  struct {
    unsigned x, y, z;
  } clusterDim;
  int programmaticStreamSerializationAllowed;
};
struct cudaLaunchAttribute {
  cudaLaunchAttributeID id;
  cudaLaunchAttributeValue val;
};
struct cudaLaunchConfig_t {
  dim3 gridDim, blockDim;
  size_t dynamicSmemBytes;
  cudaStream_t stream;
  cudaLaunchAttribute* attrs;
  unsigned numAttrs;
};
inline cudaError_t cudaSetDevice(int) { return cudaSuccess; }
template <typename F>
cudaError_t cudaFuncSetAttribute(F, cudaFuncAttribute, int) {
  return cudaSuccess;
}

// Internal linkage for everything with state: GCC makes inline variables process-wide unique
// symbols, so two emulated libraries in one process would otherwise share one `cta` and one
// TLS anchor (and map a peer's shared memory through the other library's TLS block).
namespace ok_emu {
namespace {

// A fiber's saved context. x86-64: a stack pointer, switched by a few instructions that save
// the callee-saved registers (ucontext's swapcontext also saves the signal mask: a system
// call per switch, which made the emulated tests several times slower). Elsewhere ucontext.
#if defined(__x86_64__) && !defined(OK_EMU_UCONTEXT)
struct Context {
  void* sp = nullptr;
};
extern "C" void ok_emu_switch(void** save, void* load);
asm(R"(
  .text
  .p2align 4
  .hidden ok_emu_switch
  .type ok_emu_switch, @function
ok_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size ok_emu_switch, .-ok_emu_switch
)");
inline void switch_to(Context& save, Context& load) { ok_emu_switch(&save.sp, load.sp); }
inline void start(Context& context, char* stack, size_t bytes, void (*entry)()) {
  // Six zeroed registers, then `entry` for the `ret`: it starts as if called (rsp = 8 mod 16).
  auto top = reinterpret_cast<uintptr_t>(stack + bytes) & ~static_cast<uintptr_t>(15);
  auto* sp = reinterpret_cast<void**>(top - 64);
  for (int i = 0; i < 6; ++i) sp[i] = nullptr;
  sp[6] = reinterpret_cast<void*>(entry);
  sp[7] = nullptr;
  context.sp = sp;
}
#else
struct Context {
  ucontext_t uc;
};
inline void switch_to(Context& save, Context& load) { swapcontext(&save.uc, &load.uc); }
inline void start(Context& context, char* stack, size_t bytes, void (*entry)()) {
  getcontext(&context.uc);
  context.uc.uc_stack.ss_sp = stack;
  context.uc.uc_stack.ss_size = bytes;
  context.uc.uc_link = nullptr;
  makecontext(&context.uc, entry, 0);
}
#endif

// kWarp: a warp-wide operation (shuffle, mma): the 32 lanes of the fiber's warp meet there,
// other warps run on. kYield: a thread spinning on an mbarrier lets the others run and is run
// again. The others are CTA-wide: every fiber of the CTA meets there.
enum class Stop { kNone, kWarp, kYield, kBlock, kClusterSync, kClusterArrive, kClusterWait, kDone };
constexpr size_t kStackBytes = 128 * 1024;

struct Cluster {
  explicit Cluster(int n) : barrier(n), anchors(n) {}
  std::barrier<> barrier;
  std::vector<char*> anchors;  // each CTA's address of tls_anchor
  // Where this launch's bulk copies land (Mbarrier): at the first wait that sees their phase
  // complete (even launches), or at once (odd launches). Run a kernel twice and compare: the
  // first shows a read before the wait, the second a refill before the readers freed a stage.
  bool bulk_lands_at_issue = false;
};

struct Cta {
  int n_threads = 0, current = 0, rank = 0;
  unsigned block = 0, grid = 0;
  Cluster* cluster = nullptr;
  Context scheduler;
  std::vector<Context> contexts;
  std::vector<std::unique_ptr<char[]>> stacks;
  std::vector<Stop> stops;
  std::vector<uint64_t> exchange;  // one slot per thread: shuffles
  std::vector<uint32_t> fragments;  // 8 words per thread: warp-wide matrix operations
  // Dynamic shared memory (the launch's dynamicSmemBytes), filled with 0xff bytes (NaN in
  // every float type) so that a read of what was never written shows.
  std::unique_ptr<uint64_t[]> dynamic_shared;
  size_t dynamic_bytes = 0;
  // cp.async: each thread's copies wait here until a cp.async.wait_group / wait_all that
  // covers them, so a kernel that reads the destination too early reads the 0xff fill (or
  // the previous contents). Per thread: the committed groups, oldest first, then the open one.
  struct PendingCopy {
    void* dst;
    const void* src;
    size_t bytes;
  };
  using CopyGroup = std::vector<PendingCopy>;
  std::vector<std::vector<CopyGroup>> committed;
  std::vector<CopyGroup> pending;
  const std::function<void()>* body = nullptr;
};

thread_local Cta* cta = nullptr;
thread_local char tls_anchor = 0;

inline void fail(const char* what) {
  std::fprintf(stderr, "openkernels CUDA emulation: %s\n", what);
  std::abort();
}

inline void stop(Stop kind) {
  Cta* c = cta;
  c->stops[c->current] = kind;
  switch_to(c->contexts[c->current], c->scheduler);
}

inline void fiber_main() {
  (*cta->body)();
  stop(Stop::kDone);
}

inline void run_cta(Cta& c) {
  cta = &c;
  c.cluster->anchors[c.rank] = &tls_anchor;
  c.cluster->barrier.arrive_and_wait();  // every anchor is known before any kernel code runs
  c.contexts.resize(c.n_threads);
  c.stacks.resize(c.n_threads);
  c.stops.assign(c.n_threads, Stop::kNone);
  c.exchange.assign(c.n_threads, 0);
  c.fragments.assign(static_cast<size_t>(c.n_threads) * 8, 0);
  c.pending.assign(c.n_threads, {});
  c.committed.assign(c.n_threads, {});
  if (c.dynamic_bytes > 0) {
    c.dynamic_shared = std::unique_ptr<uint64_t[]>(new uint64_t[(c.dynamic_bytes + 7) / 8]);
    std::memset(c.dynamic_shared.get(), 0xff, (c.dynamic_bytes + 7) / 8 * 8);
  }
  for (int t = 0; t < c.n_threads; ++t) {
    c.stacks[t] = std::unique_ptr<char[]>(new char[kStackBytes]);  // untouched: pages only as used
    start(c.contexts[t], c.stacks[t].get(), kStackBytes, fiber_main);
  }
  std::barrier<>::arrival_token* token = nullptr;
  std::unique_ptr<std::barrier<>::arrival_token> held;
  for (;;) {
    // Run every fiber that may run until its next stop.
    for (int t = 0; t < c.n_threads; ++t) {
      if (c.stops[t] != Stop::kNone) continue;
      c.current = t;
      switch_to(c.scheduler, c.contexts[t]);
    }
    // Release the warps whose 32 lanes all wait at a warp-wide operation.
    bool released = false;
    for (int w = 0; w * 32 < c.n_threads; ++w) {
      int at_warp = 0, lanes = 0;
      for (int t = 32 * w; t < c.n_threads && t < 32 * w + 32; ++t, ++lanes) at_warp += c.stops[t] == Stop::kWarp;
      if (at_warp == lanes) {
        for (int t = 32 * w; t < 32 * w + lanes; ++t) c.stops[t] = Stop::kNone;
        released = true;
      } else if (at_warp > 0) {
        bool others_moving = false;
        for (int t = 32 * w; t < 32 * w + lanes; ++t)
          others_moving |= c.stops[t] == Stop::kNone || c.stops[t] == Stop::kYield;
        if (!others_moving) fail("a warp-wide operation (shuffle, mma) that some lanes of the warp do not reach");
      }
    }
    if (released) continue;
    // Threads spinning on an mbarrier run again once the others have had their turn (and the
    // cluster's other CTAs, on their own OS threads, a chance to deliver).
    bool yielded = false;
    for (Stop& s : c.stops) {
      if (s == Stop::kYield) {
        s = Stop::kNone;
        yielded = true;
      }
    }
    if (yielded) {
      std::this_thread::yield();
      continue;
    }
    const Stop kind = c.stops[0];
    for (Stop s : c.stops)
      if (s != kind) fail("the threads of a CTA stopped at different barriers (or some returned early)");
    if (kind == Stop::kDone) break;
    if (kind == Stop::kClusterSync) c.cluster->barrier.arrive_and_wait();
    if (kind == Stop::kClusterArrive) {
      if (token != nullptr) fail("barrier.cluster.arrive twice without a wait");
      held = std::make_unique<std::barrier<>::arrival_token>(c.cluster->barrier.arrive());
      token = held.get();
    }
    if (kind == Stop::kClusterWait) {
      if (token == nullptr) fail("barrier.cluster.wait without an arrive");
      c.cluster->barrier.wait(std::move(*token));
      token = nullptr;
      held.reset();
    }
    std::fill(c.stops.begin(), c.stops.end(), Stop::kNone);
  }
  if (token != nullptr) fail("a CTA exited between barrier.cluster.arrive and its wait");
  for (int t = 0; t < c.n_threads; ++t)
    if (!c.pending[t].empty() || !c.committed[t].empty()) fail("a thread exited with cp.async copies it never waited for");
  cta = nullptr;
}

// A shuffle: every lane of the warp publishes `value`, then reads lane `source(me)`.
template <typename T, typename Source>
T shuffle(T value, Source source) {
  static_assert(sizeof(T) <= 8, "one 8-byte slot");
  Cta* c = cta;
  const int me = c->current;
  uint64_t slot = 0;
  std::memcpy(&slot, &value, sizeof(T));
  c->exchange[me] = slot;
  stop(Stop::kWarp);
  const int peer = source(me);
  if ((peer >> 5) != (me >> 5) || peer >= c->n_threads) fail("a shuffle outside the warp");
  T out;
  std::memcpy(&out, &c->exchange[peer], sizeof(T));
  stop(Stop::kWarp);  // nobody overwrites a slot before every lane has read its peer's
  return out;
}

inline float half_bits_to_float(uint32_t bits, bool bf16) {
  if (bf16) return __bfloat162float(__nv_bfloat16{static_cast<uint16_t>(bits)});
  _Float16 h;
  const uint16_t b = static_cast<uint16_t>(bits);
  std::memcpy(&h, &b, 2);
  return static_cast<float>(h);
}

// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}: d += A (16x16) B (16x8), each lane holding
// PTX's fragments (group g = lane / 4, t = lane % 4): A regs 0-3 = rows (g, g+8, g, g+8) x
// columns (2t.., 2t.., 2t+8.., 2t+8..); B regs 0-1 = rows 2t.. and 2t+8.., column g; d[i] =
// row g + 8 (i >= 2), column 2t + (i & 1). Accumulated in double, rounded to float once.
inline void mma_m16n8k16(float* d, const uint32_t* a, const uint32_t* b, bool bf16) {
  Cta* c = cta;
  const int me = c->current, warp0 = me & ~31, lane = me & 31;
  for (int i = 0; i < 4; ++i) c->fragments[me * 8 + i] = a[i];
  for (int i = 0; i < 2; ++i) c->fragments[me * 8 + 4 + i] = b[i];
  stop(Stop::kWarp);
  auto element = [&](int owner, int reg, int half) {
    return half_bits_to_float(c->fragments[(warp0 + owner) * 8 + reg] >> (16 * half), bf16);
  };
  auto a_at = [&](int row, int col) { return element((row % 8) * 4 + (col % 8) / 2, (row >= 8) + 2 * (col >= 8), col & 1); };
  auto b_at = [&](int row, int col) { return element(col * 4 + (row % 8) / 2, 4 + (row >= 8), row & 1); };
  float out[4];
  for (int i = 0; i < 4; ++i) {
    const int row = lane / 4 + 8 * (i >= 2), col = 2 * (lane % 4) + (i & 1);
    double sum = d[i];
    for (int kk = 0; kk < 16; ++kk) sum += static_cast<double>(a_at(row, kk)) * b_at(kk, col);
    out[i] = static_cast<float>(sum);
  }
  stop(Stop::kWarp);  // every lane has read every fragment before any is overwritten
  for (int i = 0; i < 4; ++i) d[i] = out[i];
}

// cp.async (16 bytes, global -> shared) and cp.async.wait_all, per thread.
inline void copy_async(void* dst, const void* src, size_t bytes) {
  Cta* c = cta;
  const auto* base = reinterpret_cast<const char*>(c->dynamic_shared.get());
  const auto* at = static_cast<const char*>(dst);
  if (at < base || at + bytes > base + c->dynamic_bytes) fail("cp.async outside the dynamic shared memory");
  c->pending[c->current].push_back({dst, src, bytes});
}
inline void copy_async_commit() {
  Cta* c = cta;
  c->committed[c->current].push_back(std::move(c->pending[c->current]));
  c->pending[c->current].clear();
}
// cp.async.wait_group n: every committed group but the newest n has landed.
inline void copy_async_wait_group(int n) {
  Cta* c = cta;
  auto& groups = c->committed[c->current];
  while (static_cast<int>(groups.size()) > n) {
    for (const auto& copy : groups.front()) std::memcpy(copy.dst, copy.src, copy.bytes);
    groups.erase(groups.begin());
  }
}
inline void copy_async_wait_all() {
  copy_async_commit();
  copy_async_wait_group(0);
}
inline unsigned char* dynamic_shared() { return reinterpret_cast<unsigned char*>(cta->dynamic_shared.get()); }

inline void cluster_arrive() { stop(Stop::kClusterArrive); }
inline void cluster_wait() { stop(Stop::kClusterWait); }

// An mbarrier with transaction bytes (cluster_exchange.h): a phase completes when its
// arrivals and its expected bytes are all in, whatever their order (a peer's bytes may land
// before this CTA's expect_tx, as on the GPU). A mutex orders the peers' stores before the
// waiter's reads. One per CTA (a __shared__ variable is the CTA's OS thread's).
struct Mbarrier {
  std::mutex mutex;
  int count = 0, pending = 0;
  int64_t bytes = 0;  // expected minus landed
  unsigned phase = 0;
  bool ready = false;
  // cp.async.bulk copies counted here land at the first wait that sees their phase complete
  // (or at once: Cluster::bulk_lands_at_issue), so a kernel that reads their destination
  // without waiting on the barrier reads the 0xff fill (the fiber that issued them would
  // otherwise run on and hide the missing wait).
  using Copy = std::tuple<void*, const void*, size_t>;
  std::vector<Copy> in_flight, completed;
  void complete_if_done() {
    if (pending == 0 && bytes == 0) {
      completed.insert(completed.end(), in_flight.begin(), in_flight.end());
      in_flight.clear();
      ++phase;
      pending = count;
    }
  }
  void land() {
    for (const auto& [dst, src, n] : completed) std::memcpy(dst, src, n);
    completed.clear();
  }
};
inline void mbarrier_init(Mbarrier* bar, int count) {
  std::lock_guard<std::mutex> lock(bar->mutex);
  bar->count = bar->pending = count;
  bar->bytes = 0;
  bar->phase = 0;
  bar->ready = true;
}
inline void mbarrier_arrive_expect_tx(Mbarrier* bar, uint32_t bytes) {
  std::lock_guard<std::mutex> lock(bar->mutex);
  if (!bar->ready) fail("mbarrier.arrive.expect_tx on a barrier never initialised");
  bar->bytes += bytes;
  --bar->pending;
  bar->complete_if_done();
}
inline void mbarrier_arrive(Mbarrier* bar) {
  std::lock_guard<std::mutex> lock(bar->mutex);
  if (!bar->ready) fail("mbarrier.arrive on a barrier never initialised");
  if (bar->pending <= 0) fail("mbarrier.arrive past the phase's expected arrivals");
  --bar->pending;
  bar->complete_if_done();
}
// try_wait.parity in a loop: until the phase of this parity has completed.
inline void mbarrier_wait(Mbarrier* bar, uint32_t parity) {
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    // A kernel bug (a phase its waiter skipped, arrivals or bytes that never come) would spin
    // forever; the tests' problems finish in well under this.
    if (std::chrono::steady_clock::now() - start > std::chrono::seconds(30))
      fail("an mbarrier wait still spinning after 30 s: a phase skipped, or arrivals / bytes that never come");
    {
      std::lock_guard<std::mutex> lock(bar->mutex);
      if (!bar->ready) fail("mbarrier wait on a barrier never initialised");
      if ((bar->phase & 1u) != (parity & 1u)) {
        bar->land();
        return;
      }
    }
    stop(Stop::kYield);
  }
}
// st.async into CTA `peer`'s copy of `slot` (this CTA's address of a __shared__ variable),
// its bytes counted on the peer's copy of `bar`.
inline void store_remote(const void* value, size_t bytes, void* slot, Mbarrier* bar, unsigned peer) {
  Cluster* cl = cta->cluster;
  if (peer >= cl->anchors.size()) fail("st.async to a CTA outside the cluster");
  auto peer_copy = [&](void* p) { return cl->anchors[peer] + (static_cast<char*>(p) - &tls_anchor); };
  auto* remote_bar = reinterpret_cast<Mbarrier*>(peer_copy(bar));
  std::lock_guard<std::mutex> lock(remote_bar->mutex);
  if (!remote_bar->ready) fail("st.async to a peer whose mbarrier is not initialised (no cluster wait first?)");
  std::memcpy(peer_copy(slot), value, bytes);
  remote_bar->bytes -= static_cast<int64_t>(bytes);
  remote_bar->complete_if_done();
}

// cp.async.bulk global -> this CTA's dynamic shared memory, `bytes` (a multiple of 16, both
// addresses 16-byte aligned) counted on `bar` (the issuing CTA's): lands at a wait or at once
// (Cluster::bulk_lands_at_issue).
inline void bulk_copy(void* dst, const void* src, uint32_t bytes, Mbarrier* bar) {
  Cta* c = cta;
  const auto* base = reinterpret_cast<const char*>(c->dynamic_shared.get());
  const auto* at = static_cast<const char*>(dst);
  if (at < base || at + bytes > base + c->dynamic_bytes) fail("cp.async.bulk outside the dynamic shared memory");
  if (bytes == 0 || bytes % 16 != 0 || reinterpret_cast<uintptr_t>(dst) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(src) % 16 != 0)
    fail("cp.async.bulk: sizes and addresses must be multiples of 16 bytes");
  std::lock_guard<std::mutex> lock(bar->mutex);
  if (!bar->ready) fail("cp.async.bulk counted on a barrier never initialised");
  if (c->cluster->bulk_lands_at_issue)
    std::memcpy(dst, src, bytes);
  else
    bar->in_flight.emplace_back(dst, src, bytes);
  bar->bytes -= static_cast<int64_t>(bytes);
  bar->complete_if_done();
}

template <typename... Params, typename... Args>
cudaError_t launch(const cudaLaunchConfig_t* config, void (*kernel)(Params...), Args&&... args) {
  unsigned cluster_size = 1;
  for (unsigned i = 0; i < config->numAttrs; ++i)
    if (config->attrs[i].id == cudaLaunchAttributeClusterDimension) cluster_size = config->attrs[i].val.clusterDim.x;
  const unsigned grid = config->gridDim.x, threads = config->blockDim.x;
  if (cluster_size == 0 || grid % cluster_size != 0 || threads == 0 || threads > 1024 || threads % 32 != 0)
    return cudaErrorInvalidConfiguration;
  const std::function<void()> body = [=]() { kernel(static_cast<Params>(args)...); };
  static std::atomic<unsigned> launches{0};
  const bool lands_at_issue = (launches++ % 2) == 1;
  for (unsigned first = 0; first < grid; first += cluster_size) {
    Cluster cluster(static_cast<int>(cluster_size));
    cluster.bulk_lands_at_issue = lands_at_issue;
    std::vector<Cta> ctas(cluster_size);
    std::vector<std::thread> workers;
    for (unsigned r = 0; r < cluster_size; ++r) {
      Cta& c = ctas[r];
      c.n_threads = static_cast<int>(threads);
      c.rank = static_cast<int>(r);
      c.block = first + r;
      c.grid = grid;
      c.dynamic_bytes = config->dynamicSmemBytes;
      c.cluster = &cluster;
      c.body = &body;
      workers.emplace_back([&c]() { run_cta(c); });
    }
    for (auto& w : workers) w.join();
  }
  return cudaSuccess;
}

}  // namespace
}  // namespace ok_emu

// The kernel's dynamic shared memory as `unsigned char name[]` (CUDA: extern __shared__).
#define OK_DYNAMIC_SHARED(name) unsigned char* name = ::ok_emu::dynamic_shared()

#define threadIdx (dim3(static_cast<unsigned>(::ok_emu::cta->current)))
#define blockIdx (dim3(::ok_emu::cta->block))
// (blockDim and gridDim are not emulated: the launch config's fields carry those names.)

inline void __syncthreads() { ok_emu::stop(ok_emu::Stop::kBlock); }
// The emulation runs a warp's lanes one after another between stops: a warp-wide stop orders
// what each lane did before it with what any lane does after it.
inline void __syncwarp(unsigned = 0xffffffffu) { ok_emu::stop(ok_emu::Stop::kWarp); }
template <typename T>
T __shfl_xor_sync(unsigned, T value, int offset) {
  return ok_emu::shuffle(value, [offset](int me) { return me ^ offset; });
}
template <typename T>
T __shfl_sync(unsigned, T value, int lane) {
  return ok_emu::shuffle(value, [lane](int me) { return (me & ~31) | (lane & 31); });
}

template <typename... Params, typename... Args>
cudaError_t cudaLaunchKernelEx(const cudaLaunchConfig_t* config, void (*kernel)(Params...), Args&&... args) {
  return ok_emu::launch(config, kernel, std::forward<Args>(args)...);
}
// Every cluster of 1..16 CTAs schedules here (one at a time); a larger one does not.
template <typename... Params>
cudaError_t cudaOccupancyMaxActiveClusters(int* count, void (*)(Params...), const cudaLaunchConfig_t* config) {
  unsigned cluster_size = 1;
  for (unsigned i = 0; i < config->numAttrs; ++i)
    if (config->attrs[i].id == cudaLaunchAttributeClusterDimension) cluster_size = config->attrs[i].val.clusterDim.x;
  *count = cluster_size >= 1 && cluster_size <= 16 ? 1 : 0;
  return cudaSuccess;
}

namespace cooperative_groups {
struct cluster_group {
  unsigned num_blocks() const { return static_cast<unsigned>(::ok_emu::cta->cluster->anchors.size()); }
  unsigned block_rank() const { return static_cast<unsigned>(::ok_emu::cta->rank); }
  void sync() const { ::ok_emu::stop(::ok_emu::Stop::kClusterSync); }
  template <typename T>
  T* map_shared_rank(T* address, unsigned rank) const {
    // The same thread_local in the peer's thread: same offset from the TLS anchor.
    const auto offset = reinterpret_cast<char*>(address) - &::ok_emu::tls_anchor;
    return reinterpret_cast<T*>(::ok_emu::cta->cluster->anchors[rank] + offset);
  }
};
inline cluster_group this_cluster() { return {}; }
}  // namespace cooperative_groups
