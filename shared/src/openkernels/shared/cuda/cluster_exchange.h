// A thread-block cluster's one-shot exchange through distributed shared memory, pushed rather
// than pulled: each CTA stores its values straight into every peer's shared memory with
// st.async, which counts the bytes on the peer's mbarrier, and waits on its own mbarrier until
// every peer's bytes have landed. No cluster-wide barrier on the critical path (only the
// relaxed arrive at the start that makes the barriers' initialisation visible) and no barrier
// before exit: a CTA has received everything addressed to it before it reads it, and reads
// no peer's memory. The same barriers count bulk copies from global memory (ok_bulk_copy).
// With their CPU-emulation twins (cuda_emulation.h). sm_90.
//
//   __shared__ OkBarrier full;                     // one per exchange (one phase each)
//   if (threadIdx.x == 0) ok_barrier_init(&full, 1);
//   ok_fence_barrier_init(); ok_cluster_arrive_relaxed();
//   ... the CTA's own work ...
//   ok_cluster_wait();                             // every peer's barrier is initialised
//   if (threadIdx.x == 0) ok_barrier_arrive_expect_tx(&full, bytes every peer sends here);
//   ok_store_remote(value, &slots[my_rank * ...], &full, peer);  // to each peer, itself included
//   ok_barrier_wait(&full, 0);
#pragma once

#include <stdint.h>

#ifdef OK_CUDA_EMULATION
using OkBarrier = ok_emu::Mbarrier;
__device__ __forceinline__ void ok_barrier_init(OkBarrier* bar, int count) { ok_emu::mbarrier_init(bar, count); }
__device__ __forceinline__ void ok_fence_barrier_init() {}
__device__ __forceinline__ void ok_cluster_arrive_relaxed() { ok_emu::cluster_arrive(); }
__device__ __forceinline__ void ok_cluster_wait() { ok_emu::cluster_wait(); }
__device__ __forceinline__ void ok_barrier_arrive_expect_tx(OkBarrier* bar, uint32_t bytes) {
  ok_emu::mbarrier_arrive_expect_tx(bar, bytes);
}
__device__ __forceinline__ void ok_barrier_wait(OkBarrier* bar, uint32_t parity) { ok_emu::mbarrier_wait(bar, parity); }
__device__ __forceinline__ void ok_barrier_arrive(OkBarrier* bar) { ok_emu::mbarrier_arrive(bar); }
__device__ __forceinline__ void ok_store_remote(const float4& value, void* slot, OkBarrier* bar, uint32_t peer) {
  ok_emu::store_remote(&value, sizeof(value), slot, bar, peer);
}
__device__ __forceinline__ void ok_bulk_copy(void* smem, const void* gmem, uint32_t bytes, OkBarrier* bar) {
  ok_emu::bulk_copy(smem, gmem, bytes, bar);
}
#else
using OkBarrier = uint64_t;  // an mbarrier: 8 bytes of shared memory, 8-byte aligned

__device__ __forceinline__ uint32_t ok_shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// `count` arrivals (besides the transaction bytes) complete a phase.
__device__ __forceinline__ void ok_barrier_init(OkBarrier* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(ok_shared_address(bar)), "r"(count) : "memory");
}
// Makes the initialisation visible to the cluster (peers' complete_tx) before the arrive.
__device__ __forceinline__ void ok_fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void ok_cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void ok_cluster_wait() { asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory"); }
// One arrival, and `bytes` more to land before the phase completes.
__device__ __forceinline__ void ok_barrier_arrive_expect_tx(OkBarrier* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(ok_shared_address(bar)), "r"(bytes)
               : "memory");
}
// One arrival (no transaction bytes), release at CTA scope: what this thread read or wrote
// before it is ordered before whatever follows a wait on the phase (a ring's "stage free").
__device__ __forceinline__ void ok_barrier_arrive(OkBarrier* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(ok_shared_address(bar)) : "memory");
}
// Until the phase of this parity has completed; acquire at cluster scope (the peers' st.async
// release their bytes with their complete_tx).
__device__ __forceinline__ void ok_barrier_wait(OkBarrier* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "OK_BARRIER_WAIT_%=:\n"
      "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra OK_BARRIER_WAIT_%=;\n"
      "}\n" ::"r"(ok_shared_address(bar)),
      "r"(parity)
      : "memory");
}
// 16 bytes into CTA `peer`'s copy of `slot` (this CTA's address of a 16-byte aligned __shared__
// variable), counted on the peer's copy of `bar`.
__device__ __forceinline__ void ok_store_remote(const float4& value, void* slot, OkBarrier* bar, uint32_t peer) {
  uint32_t remote_slot, remote_bar;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote_slot) : "r"(ok_shared_address(slot)), "r"(peer));
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote_bar) : "r"(ok_shared_address(bar)), "r"(peer));
  asm volatile(
      "st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];\n" ::"r"(remote_slot),
      "f"(value.x), "f"(value.y), "f"(value.z), "f"(value.w), "r"(remote_bar)
      : "memory");
}
// `bytes` (a multiple of 16; both addresses 16-byte aligned) from global memory into this
// CTA's shared memory by the TMA unit (cp.async.bulk, one instruction for the whole range),
// counted on this CTA's `bar`: the issuing thread arrives with expect_tx first (or after: the
// phase waits for both), every reader waits on the barrier.
__device__ __forceinline__ void ok_bulk_copy(void* smem, const void* gmem, uint32_t bytes, OkBarrier* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                   ok_shared_address(smem)),
               "l"(gmem), "r"(bytes), "r"(ok_shared_address(bar))
               : "memory");
}
#endif
