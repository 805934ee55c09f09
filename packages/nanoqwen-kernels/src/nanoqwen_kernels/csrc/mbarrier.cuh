// mbarrier.cuh: shared-memory mbarriers and the bulk (1D TMA) global -> shared copy that completes on
// them (sm_90). One definition for every kernel that pipelines through shared memory (the paged
// attention's KV ring, attention.cuh).
//
// An mbarrier phase completes when `count` threads have arrived and its transaction count is back at
// zero; waiters test the phase parity (0, 1, 0, ... for the 1st, 2nd, 3rd completion). A bulk copy
// posts its bytes as completed transactions on the barrier it names; the thread that arrives with
// mbar_arrive_expect_tx posts the bytes it expects in the same phase.
#pragma once
#include "common.cuh"

#ifdef NQ_HOST_EMU
// The emulator's mbarriers and bulk copies (emu/simt.h): a shared address is a handle of the CTA's.
NQ_DEVICE unsigned mbar_smem_addr(const void* p) { return nq_emu::smem_handle(p); }
NQ_DEVICE void mbar_init(unsigned long long* bar, unsigned count) { nq_emu::mbar_init(mbar_smem_addr(bar), count); }
NQ_DEVICE void mbar_fence_init() {}
NQ_DEVICE void mbar_arrive(unsigned long long* bar) { nq_emu::mbar_arrive(mbar_smem_addr(bar), 0); }
NQ_DEVICE void mbar_arrive_expect_tx(unsigned long long* bar, unsigned bytes) {
  nq_emu::mbar_arrive(mbar_smem_addr(bar), bytes);
}
NQ_DEVICE void mbar_wait(unsigned long long* bar, unsigned parity) { nq_emu::mbar_wait(mbar_smem_addr(bar), parity); }
NQ_DEVICE void bulk_copy_g2s(unsigned dst, const void* src, unsigned bytes, unsigned long long* bar) {
  nq_emu::bulk_copy_g2s(dst, src, bytes, mbar_smem_addr(bar));
}
NQ_DEVICE void fence_proxy_async_shared() {}
#else

NQ_DEVICE unsigned mbar_smem_addr(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }

NQ_DEVICE void mbar_init(unsigned long long* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(mbar_smem_addr(bar)), "r"(count) : "memory");
}

// After the initialising thread's mbar_init calls: makes the barriers' initial state visible to the
// async proxy (the bulk copies' complete_tx), as CUTLASS's fence_barrier_init does; then a block barrier.
NQ_DEVICE void mbar_fence_init() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }

NQ_DEVICE void mbar_arrive(unsigned long long* bar) {
  asm volatile("{\n\t.reg .b64 st;\n\tmbarrier.arrive.shared::cta.b64 st, [%0];\n\t}" ::"r"(mbar_smem_addr(bar))
               : "memory");
}

// Arrive (one of the phase's `count` arrivals) and expect `bytes` more of bulk-copy transactions.
NQ_DEVICE void mbar_arrive_expect_tx(unsigned long long* bar, unsigned bytes) {
  asm volatile("{\n\t.reg .b64 st;\n\tmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n\t}" ::"r"(
                   mbar_smem_addr(bar)),
               "r"(bytes)
               : "memory");
}

NQ_DEVICE void mbar_wait(unsigned long long* bar, unsigned parity) {
  asm volatile(
      "{\n\t.reg .pred done;\n"
      "WAIT_%=:\n\t"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n\t"
      "@!done bra WAIT_%=;\n\t}" ::"r"(mbar_smem_addr(bar)),
      "r"(parity)
      : "memory");
}

// Bulk copy of `bytes` (a multiple of 16; both addresses 16-byte aligned) from global to shared memory,
// completing as transactions on `bar`.
NQ_DEVICE void bulk_copy_g2s(unsigned dst, const void* src, unsigned bytes, unsigned long long* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(mbar_smem_addr(bar))
               : "memory");
}

// Orders this thread's earlier generic-proxy accesses of shared memory before later async-proxy ones
// (a bulk copy into a buffer the block has just read).
NQ_DEVICE void fence_proxy_async_shared() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
#endif  // NQ_HOST_EMU
