// emu/runtime.cpp: the CPU launch of a kernel compiled with emu/simt.h (see its header for the model):
// one OS thread per CTA, all CTAs at once; the CTA's threads are ucontext fibers switched at the
// scheduling points; mbarriers, bulk copies and cp.async with late completion; named barriers; ldmatrix;
// a watchdog for launches that stop making progress. Entry: `nq_emu_launch` (C ABI, called by
// nanoqwen_kernels/testing/emu.py through ctypes with cuLaunchKernel-style argument pointers).
#include "emu/simt.h"

#include <sched.h>
#include <sys/mman.h>
#include <ucontext.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <cstdio>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace nq_emu {

namespace {

constexpr size_t STACK_BYTES = 256 * 1024;  // per CUDA thread (mapped lazily)
enum State { RUNNABLE, WAIT_WARP, WAIT_CTA, WAIT_NAMED, SLEEPING, DONE };

struct WarpState {
  int arrived = 0, live = 0;
  unsigned gen = 0;
  int kind = 0;  // what the lanes of the current phase meet for: 1 __syncwarp, 2 + bytes an exchange
  alignas(16) unsigned char slots[32][64];
};
constexpr int SLOT_BYTES = 64;
constexpr unsigned CANARY = 64;  // bytes after the dynamic shared memory that must stay poisoned
// Shared addresses of the dynamic shared memory (smem_window_addr) are WINDOW + the byte offset: apart
// from the mbarrier handles (small integers), so that one passed for the other is caught.
constexpr unsigned WINDOW = 0x40000000u;
constexpr unsigned NAMED_BARRIERS = 16;

struct Mbar {
  unsigned count = 1, pending = 1, phase = 0;
  long long tx = 0;
};

struct Copy {
  void* dst;
  const void* src;
  unsigned bytes, bar;
};

// A thread's cp.async copies, in epochs closed by its cp.async.mbarrier.arrive.noinc: the arrival of an
// epoch is made once it and every earlier epoch of the thread have no copy in flight.
struct AsyncEpoch {
  int in_flight = 0;
  bool closed = false;
  unsigned bar = 0;
};

struct AsyncCopy {
  unsigned char* dst;
  const void* src;
  unsigned src_bytes;
  Fiber* owner;
  AsyncEpoch* epoch;
};

struct NamedBarrier {
  unsigned arrived = 0, count = 0, gen = 0;
};

struct Launch;

struct Cta {
  Launch* launch = nullptr;
  std::vector<Fiber*> fibers;
  ucontext_t sched;
  std::vector<WarpState> warps;
  std::vector<unsigned> warp_pace;  // a warp's threads run in 1 of `pace` scheduler rounds (1: every round)
  int bar_arrived = 0, live = 0;
  unsigned bar_gen = 0;
  std::vector<const void*> handles{nullptr};
  std::unordered_map<const void*, unsigned> handle_of;
  std::unordered_map<unsigned, Mbar> mbars;
  std::vector<Copy> copies;
  std::vector<AsyncCopy> async_copies;
  NamedBarrier named[NAMED_BARRIERS];
  std::mt19937_64 rng;
  unsigned char* smem = nullptr;
  size_t smem_bytes = 0;
  std::deque<std::vector<unsigned char>> staged;  // TMA boxes read at issue, until the launch ends
};

struct Launch {
  const Registration* entry;
  void** args;
  EmuDim3 grid, block;
  unsigned shared;
  double timeout_s;
  std::chrono::steady_clock::time_point start;
  std::atomic<unsigned long long> progress{0};  // fibers resumed that were not spinning
  std::atomic<long long> last_progress_ns{0};   // since start, when `progress` was last seen to move
  std::atomic<bool> abort{false};
  std::mutex mu;
  std::string error;

  void fail(const std::string& why) {
    std::lock_guard<std::mutex> g(mu);
    if (error.empty()) error = why;
    abort = true;
  }
};

thread_local Cta* g_cta = nullptr;

std::map<std::string, const Registration*>& registry() {
  static std::map<std::string, const Registration*> r;
  return r;
}

}  // namespace

struct Fiber {
  ucontext_t ctx;
  EmuDim3 tid;
  int lane = 0, warp = 0;
  State state = RUNNABLE;
  unsigned wait_gen = 0, wait_bar = 0;
  char* stack = nullptr;
  std::deque<AsyncEpoch> epochs;  // its cp.async copies in flight, and the arrivals waiting for them
};

thread_local Fiber* g_fiber = nullptr;
thread_local EmuDim3 g_block_idx, g_grid_dim, g_block_dim;

const EmuDim3& thread_idx() { return g_fiber->tid; }
int lane_id() { return g_fiber->lane; }

unsigned char* dynamic_smem() { return g_cta->smem; }

namespace {

void switch_out() { swapcontext(&g_fiber->ctx, &g_cta->sched); }

// One arrival (and tx_bytes more expected) on mbarrier `bar`; false (the launch failed) if there is none.
bool arrive_on(Cta& c, unsigned bar, unsigned tx_bytes) {
  auto it = c.mbars.find(bar);
  if (it == c.mbars.end()) {
    c.launch->fail("mbarrier arrive on a barrier that was never initialised");
    return false;
  }
  Mbar& m = it->second;
  m.tx += tx_bytes;
  if (m.pending == 0) {
    c.launch->fail("mbarrier: more arrivals than its count in one phase");
    return true;
  }
  if (--m.pending == 0 && m.tx == 0) {
    m.phase ^= 1;
    m.pending = m.count;
  }
  return true;
}

// The arrivals of a thread's cp.async epochs that have no copy in flight left, in order.
void drain_epochs(Cta& c, Fiber& f) {
  while (!f.epochs.empty() && f.epochs.front().in_flight == 0 && f.epochs.front().closed) {
    const unsigned bar = f.epochs.front().bar;
    f.epochs.pop_front();
    arrive_on(c, bar, 0);
  }
}

void complete_async(Cta& c, size_t i) {
  const AsyncCopy cp = c.async_copies[i];
  c.async_copies[i] = c.async_copies.back();
  c.async_copies.pop_back();
  std::memcpy(cp.dst, cp.src, cp.src_bytes);
  std::memset(cp.dst + cp.src_bytes, 0, 16 - cp.src_bytes);
  --cp.epoch->in_flight;
  drain_epochs(c, *cp.owner);
}

// A random batch of the CTA's cp.async copies lands (half of them at most, a quarter on average).
void complete_random_async(Cta& c) {
  if (c.async_copies.empty()) return;
  for (size_t k = c.rng() % (c.async_copies.size() / 2 + 1) + 1; k > 0 && !c.async_copies.empty(); --k)
    complete_async(c, c.rng() % c.async_copies.size());
}

void complete_copy(Cta& c, size_t i) {
  Copy cp = c.copies[i];
  c.copies[i] = c.copies.back();
  c.copies.pop_back();
  std::memcpy(cp.dst, cp.src, cp.bytes);
  auto it = c.mbars.find(cp.bar);
  if (it == c.mbars.end()) {
    c.launch->fail("bulk copy completing on an mbarrier that was never initialised");
    return;
  }
  Mbar& m = it->second;
  m.tx -= cp.bytes;
  if (m.pending == 0 && m.tx == 0) {
    m.phase ^= 1;
    m.pending = m.count;
  }
}

void complete_random_copy(Cta& c) {
  if (!c.copies.empty()) complete_copy(c, c.rng() % c.copies.size());
}

bool runnable(Cta& c, Fiber& f) {
  switch (f.state) {
    case RUNNABLE:
    case SLEEPING:
      return true;
    case WAIT_WARP:
      if (c.warps[f.warp].gen == f.wait_gen) return false;
      f.state = RUNNABLE;
      return true;
    case WAIT_CTA:
      if (c.bar_gen == f.wait_gen) return false;
      f.state = RUNNABLE;
      return true;
    case WAIT_NAMED:
      if (c.named[f.wait_bar].gen == f.wait_gen) return false;
      f.state = RUNNABLE;
      return true;
    default:
      return false;
  }
}

void release_barriers(Cta& c, WarpState& w) {
  if (w.arrived > 0 && w.arrived == w.live) {
    w.arrived = 0;
    ++w.gen;
  }
  if (c.bar_arrived > 0 && c.bar_arrived == c.live) {
    c.bar_arrived = 0;
    ++c.bar_gen;
  }
}

void fiber_main() {
  Cta& c = *g_cta;
  c.launch->entry->call(c.launch->entry->fn, c.launch->args);
  Fiber& f = *g_fiber;
  f.state = DONE;
  --c.live;
  WarpState& w = c.warps[f.warp];
  --w.live;
  std::memset(w.slots[f.lane], 0xA5, SLOT_BYTES);  // a shuffle from an exited lane reads the poison
  release_barriers(c, w);
}  // returns to uc_link: the scheduler

// The watchdog, run by every CTA's scheduler now and then: the launch fails when no fiber that was not
// spinning has run for `timeout_s` (a deadlock, or CTAs spinning on counters that never fill).
void check_progress(Launch& L, unsigned cta_index) {
  static thread_local unsigned long long seen = ~0ull;
  const long long now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                            std::chrono::steady_clock::now() - L.start).count();
  const unsigned long long p = L.progress.load(std::memory_order_relaxed);
  if (p != seen) {
    seen = p;
    L.last_progress_ns.store(now, std::memory_order_relaxed);
    return;
  }
  if (now - L.last_progress_ns.load(std::memory_order_relaxed) > (long long)(L.timeout_s * 1e9)) {
    char buf[200];
    std::snprintf(buf, sizeof buf, "no progress within %.0f s (CTA %u still running): a deadlock?", L.timeout_s,
                  cta_index);
    L.fail(buf);
  }
}

void run_cta(Launch& L, unsigned cta_index, unsigned long long seed) {
  Cta c;
  c.launch = &L;
  c.rng.seed(seed * 0x9E3779B97F4A7C15ull + cta_index);
  g_cta = &c;
  g_grid_dim = L.grid;
  g_block_dim = L.block;
  g_block_idx.x = cta_index % L.grid.x;
  g_block_idx.y = (cta_index / L.grid.x) % L.grid.y;
  g_block_idx.z = cta_index / (L.grid.x * L.grid.y);
  const unsigned n = L.block.x * L.block.y * L.block.z;
  std::vector<unsigned char> smem(L.shared + 128 + CANARY, 0xA5);  // poisoned: it starts undefined
  c.smem = reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(smem.data()) + 127) & ~uintptr_t(127));
  c.smem_bytes = L.shared;
  c.warps.resize((n + 31) / 32);
  for (size_t w = 0; w < c.warps.size(); ++w) c.warp_pace.push_back(c.rng() % 4 == 0 ? 8 : 1);  // slow warps
  char* stacks = static_cast<char*>(mmap(nullptr, STACK_BYTES * n, PROT_READ | PROT_WRITE,
                                         MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0));
  if (stacks == MAP_FAILED) {
    L.fail("cannot map the fiber stacks");
    return;
  }
  std::vector<Fiber> fibers(n);
  for (unsigned i = 0; i < n; ++i) {
    Fiber& f = fibers[i];
    f.tid.x = i % L.block.x;
    f.tid.y = (i / L.block.x) % L.block.y;
    f.tid.z = i / (L.block.x * L.block.y);
    f.lane = i % 32;
    f.warp = i / 32;
    f.stack = stacks + STACK_BYTES * i;
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = f.stack;
    f.ctx.uc_stack.ss_size = STACK_BYTES;
    f.ctx.uc_link = &c.sched;
    makecontext(&f.ctx, fiber_main, 0);
    c.fibers.push_back(&f);
    ++c.warps[f.warp].live;
  }
  c.live = n;
  unsigned long long rounds = 0;
  while (c.live > 0 && !L.abort) {
    bool ran = false, any_runnable = false, only_sleepers = true;
    const unsigned start = c.rng() % n;
    const unsigned long long round_bits = c.rng();
    for (unsigned k = 0; k < n && !L.abort; ++k) {
      Fiber& f = *c.fibers[(start + k) % n];
      if (!runnable(c, f)) continue;
      any_runnable = true;
      const unsigned pace = c.warp_pace[f.warp];
      if (pace > 1 && (round_bits >> (f.warp % 61)) % pace != 0) continue;  // a slow warp sits this round out
      if (f.state != SLEEPING) {
        only_sleepers = false;
        L.progress.fetch_add(1, std::memory_order_relaxed);
      }
      f.state = RUNNABLE;
      g_fiber = &f;
      swapcontext(&c.sched, &f.ctx);
      ran = true;
    }
    if (!c.copies.empty() && c.rng() % 4 == 0) complete_random_copy(c);
    if (!c.async_copies.empty() && c.rng() % 2 == 0) complete_random_async(c);
    if (!ran) {
      if (any_runnable) continue;  // only slow warps could run, and sat this round out
      if (!c.copies.empty()) {
        complete_random_copy(c);
        continue;
      }
      if (!c.async_copies.empty()) {
        complete_random_async(c);
        continue;
      }
      char buf[160];
      std::snprintf(buf, sizeof buf, "deadlock: every thread of CTA %u waits at a barrier that cannot fill",
                    cta_index);
      L.fail(buf);
      break;
    }
    // waiting on other CTAs (not on this one's copies, which land at the end of a round): let them run
    if (only_sleepers && c.copies.empty() && c.async_copies.empty()) sched_yield();
    if ((++rounds & 255) == 0) check_progress(L, cta_index);
  }
  bool arrivals_due = false;
  for (const Fiber& f : fibers) arrivals_due |= !f.epochs.empty() && f.epochs.back().closed;
  if (!L.abort && (!c.async_copies.empty() || arrivals_due)) {
    char buf[160];
    std::snprintf(buf, sizeof buf, "CTA %u ended with cp.async copies (or their mbarrier arrivals) in flight",
                  cta_index);
    L.fail(buf);
  }
  for (unsigned i = 0; i < CANARY && !L.abort; ++i) {
    if (c.smem[L.shared + i] != 0xA5) {
      char buf[160];
      std::snprintf(buf, sizeof buf, "CTA %u wrote past its %u bytes of dynamic shared memory", cta_index,
                    L.shared);
      L.fail(buf);
      break;
    }
  }
  munmap(stacks, STACK_BYTES * n);
  g_cta = nullptr;
  g_fiber = nullptr;
}

}  // namespace

// ---- scheduling points ----------------------------------------------------------------------------

// A random switch to another thread of the CTA (1 in 4), or now and then (1 in 64) a pause of the whole
// CTA's OS thread for up to 300 us: a slow SM, so that the other CTAs run ahead of it and counters fill
// in other orders than the natural one.
void yield_maybe() {
  const unsigned long long r = g_cta->rng();
  if (r % 64 == 1) std::this_thread::sleep_for(std::chrono::microseconds((r >> 8) % 300));
  if (r % 4 == 0) switch_out();
}

void load_point() {
  if (g_cta->rng() % 16 == 0) switch_out();
}

void nanosleep_yield() {
  g_fiber->state = SLEEPING;
  switch_out();
}

namespace {
// The warp's lanes meet: all of them for the same kind of collective (1: __syncwarp, 2 + bytes: an
// exchange of that many bytes); lanes meeting for different ones are a kernel bug (divergent
// collectives), which fails the launch.
void warp_meet(int kind) {
  Cta& c = *g_cta;
  Fiber& f = *g_fiber;
  WarpState& w = c.warps[f.warp];
  if (w.arrived == 0) {
    w.kind = kind;
  } else if (w.kind != kind) {
    c.launch->fail("lanes of a warp met in different collectives (__syncwarp, shuffles, mma.sync)");
  }
  if (++w.arrived == w.live) {
    w.arrived = 0;
    ++w.gen;
    return;
  }
  f.wait_gen = w.gen;
  f.state = WAIT_WARP;
  switch_out();
}
}  // namespace

void syncwarp() { warp_meet(1); }

void syncthreads() {
  Cta& c = *g_cta;
  Fiber& f = *g_fiber;
  if (++c.bar_arrived == c.live) {
    c.bar_arrived = 0;
    ++c.bar_gen;
    switch_out();  // the others resume in some order; so does this one
    return;
  }
  f.wait_gen = c.bar_gen;
  f.state = WAIT_CTA;
  switch_out();
}

void warp_exchange(const void* mine, void* all, int bytes) {
  Cta& c = *g_cta;
  Fiber& f = *g_fiber;
  WarpState& w = c.warps[f.warp];
  if (bytes > SLOT_BYTES) {
    c.launch->fail("warp exchange of more than 64 bytes");
    return;
  }
  std::memcpy(w.slots[f.lane], mine, bytes);
  warp_meet(2 + bytes);
  for (int i = 0; i < 32; ++i) std::memcpy(static_cast<char*>(all) + i * bytes, w.slots[i], bytes);
  warp_meet(2 + bytes);
}

// ---- mbarriers and bulk copies --------------------------------------------------------------------

unsigned smem_handle(const void* p) {
  Cta& c = *g_cta;
  auto it = c.handle_of.find(p);
  if (it != c.handle_of.end()) return it->second;
  const unsigned h = (unsigned)c.handles.size();
  c.handles.push_back(p);
  c.handle_of.emplace(p, h);
  return h;
}

void mbar_init(unsigned bar, unsigned count) {
  Mbar m;
  m.count = m.pending = count;
  g_cta->mbars[bar] = m;
}

void mbar_arrive(unsigned bar, unsigned tx_bytes) {
  if (!arrive_on(*g_cta, bar, tx_bytes)) switch_out();
}

bool mbar_test_wait(unsigned bar, unsigned parity) {
  Cta& c = *g_cta;
  auto it = c.mbars.find(bar);
  if (it == c.mbars.end()) {
    c.launch->fail("mbarrier wait on a barrier that was never initialised");
    return true;
  }
  return it->second.phase != (parity & 1);
}

void mbar_wait(unsigned bar, unsigned parity) {
  Cta& c = *g_cta;
  while (!mbar_test_wait(bar, parity)) {
    if (c.launch->abort) {
      switch_out();
      continue;
    }
    if (!c.copies.empty() && c.rng() % 2 == 0) complete_random_copy(c);
    else if (!c.async_copies.empty() && c.rng() % 2 == 0) complete_random_async(c);
    else nanosleep_yield();  // a spin, not progress: waiters that never see their phase time out
  }
}

void bulk_copy_g2s(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
  Cta& c = *g_cta;
  if (dst == 0 || dst >= c.handles.size()) {
    c.launch->fail("bulk copy to an address that is not shared memory");
    return;
  }
  void* d = const_cast<void*>(c.handles[dst]);
  const unsigned char* lo = c.smem;
  const bool in_dynamic = d >= lo && static_cast<unsigned char*>(d) + bytes <= lo + c.smem_bytes;
  if (!in_dynamic || bytes % 16 || reinterpret_cast<uintptr_t>(src) % 16 || reinterpret_cast<uintptr_t>(d) % 16) {
    c.launch->fail("bulk copy out of the dynamic shared memory, or not 16-byte aligned");
    return;
  }
  c.copies.push_back({d, src, bytes, bar});
  if (c.rng() % 4 == 0) complete_copy(c, c.copies.size() - 1);
}

// ---- cp.async, named barriers, ldmatrix -------------------------------------------------------------

unsigned smem_window_addr(const void* p) {
  Cta& c = *g_cta;
  const unsigned char* b = static_cast<const unsigned char*>(p);
  if (b < c.smem || b > c.smem + c.smem_bytes) {
    c.launch->fail("a shared address taken of memory outside the dynamic shared memory");
    return 0;
  }
  return WINDOW + (unsigned)(b - c.smem);
}

namespace {
// The bytes [addr, addr + bytes) of the dynamic shared memory, 16-byte aligned; null (the launch failed)
// if they are not.
unsigned char* window_bytes(Cta& c, unsigned addr, unsigned bytes, const char* what) {
  if (addr < WINDOW || addr % 16 || (size_t)(addr - WINDOW) + bytes > c.smem_bytes) {
    char buf[200];
    std::snprintf(buf, sizeof buf, "%s: shared address 0x%x is not a 16-byte aligned address of the %zu bytes "
                  "of dynamic shared memory", what, addr, c.smem_bytes);
    c.launch->fail(buf);
    return nullptr;
  }
  return c.smem + (addr - WINDOW);
}
}  // namespace

void cp_async_16(unsigned dst, const void* src, unsigned src_bytes) {
  Cta& c = *g_cta;
  Fiber& f = *g_fiber;
  unsigned char* d = window_bytes(c, dst, 16, "cp.async");
  if (d == nullptr) return;
  if (src_bytes > 16 || (src_bytes > 0 && reinterpret_cast<uintptr_t>(src) % 16)) {
    c.launch->fail("cp.async: src-size above 16 bytes, or a source not 16-byte aligned");
    return;
  }
  if (f.epochs.empty() || f.epochs.back().closed) f.epochs.emplace_back();
  AsyncEpoch* e = &f.epochs.back();  // deque: stays put while later epochs are added
  ++e->in_flight;
  c.async_copies.push_back({d, src, src_bytes, &f, e});
  if (c.rng() % 8 == 0) complete_async(c, c.async_copies.size() - 1);
}

void cp_async_arrive_noinc(unsigned bar) {
  Cta& c = *g_cta;
  Fiber& f = *g_fiber;
  if (f.epochs.empty() || f.epochs.back().closed) f.epochs.emplace_back();
  f.epochs.back().closed = true;
  f.epochs.back().bar = bar;
  drain_epochs(c, f);
}

void cp_async_wait_all() {
  Cta& c = *g_cta;
  for (size_t i = 0; i < c.async_copies.size();) {
    if (c.async_copies[i].owner == g_fiber) complete_async(c, i);  // swaps the last copy into slot i
    else ++i;
  }
  yield_maybe();
}

void named_barrier(unsigned id, unsigned threads) {
  Cta& c = *g_cta;
  Fiber& f = *g_fiber;
  if (id == 0 || id >= NAMED_BARRIERS || threads == 0 || threads % 32) {
    c.launch->fail("bar.sync: barrier id not in 1..15 (0 is __syncthreads) or a count not a multiple of 32");
    switch_out();
    return;
  }
  NamedBarrier& b = c.named[id];
  if (b.arrived == 0) {
    b.count = threads;
  } else if (b.count != threads) {
    c.launch->fail("bar.sync: one named barrier used with different thread counts in one phase");
  }
  if (++b.arrived == b.count) {
    b.arrived = 0;
    ++b.gen;
    switch_out();  // the others resume in some order; so does this one
    return;
  }
  f.wait_bar = id;
  f.wait_gen = b.gen;
  f.state = WAIT_NAMED;
  switch_out();
}

void ldmatrix_x4(unsigned* r, unsigned addr, bool trans) {
  Cta& c = *g_cta;
  struct Row {
    unsigned w[4];
  } mine, all[32];
  const unsigned char* p = window_bytes(c, addr, 16, "ldmatrix");
  if (p != nullptr) std::memcpy(&mine, p, 16);
  else std::memset(&mine, 0xA5, 16);
  warp_exchange(&mine, all, sizeof(Row));  // matrix j's row i is the row lane 8 j + i addresses
  const int lane = g_fiber->lane, g = lane >> 2, t = lane & 3;
  auto elem = [](const Row& row, int col) { return (row.w[col >> 1] >> (16 * (col & 1))) & 0xffffu; };
  for (int j = 0; j < 4; ++j) {
    if (!trans) r[j] = all[8 * j + g].w[t];  // row g, elements 2t and 2t + 1
    else r[j] = elem(all[8 * j + 2 * t], g) | (elem(all[8 * j + 2 * t + 1], g) << 16);  // column g, rows 2t, 2t + 1
  }
}

const void* smem_window_ptr(unsigned addr, unsigned bytes) {
  Cta& c = *g_cta;
  if (addr < WINDOW || addr % bytes || (size_t)(addr - WINDOW) + bytes > c.smem_bytes) {
    c.launch->fail("ld.shared: an address outside the dynamic shared memory, or misaligned");
    static const unsigned long long poison = 0xA5A5A5A5A5A5A5A5ull;
    return &poison;
  }
  return c.smem + (addr - WINDOW);
}

// ---- TMA and wgmma ----------------------------------------------------------------------------------

namespace {
// The 16 x 16 A operand held by a warp in the mma.m16n8k16 fragment layout (wgmma's A per warp too):
// lane L = 4g + t holds a[0] = (row g, k 2t..2t+1), a[1] = (row g + 8, the same k), a[2] = (row g,
// k 2t+8..2t+9), a[3] = (row g + 8, those k); `val(word, h)` is half h of a word as a number.
template <class Frag, class Val>
void a_tile(const Frag (&all)[32], Val val, double (&A)[16][16]) {
  for (int L = 0; L < 32; ++L) {
    const int g = L >> 2, t = L & 3;
    for (int h = 0; h < 2; ++h) {
      A[g][2 * t + h] = val(all[L].a[0], h);
      A[g + 8][2 * t + h] = val(all[L].a[1], h);
      A[g][2 * t + 8 + h] = val(all[L].a[2], h);
      A[g + 8][2 * t + 8 + h] = val(all[L].a[3], h);
    }
  }
}

// The emulator's tensor map (emu.py's tensor_map_2d writes the same fields, little-endian).
struct EmuTensorMap {
  unsigned long long magic, address, rows, cols, row_bytes;
  unsigned box_rows, box_cols, elem_bytes, swizzle;  // swizzle: 0 none, 3 128-byte
};
constexpr unsigned long long TENSOR_MAP_MAGIC = 0x4e51454d55544d32ull;  // "NQEMUTM2"

unsigned swizzle128(unsigned offset) { return offset ^ (((offset >> 7) & 7u) << 4); }
}  // namespace

void tma_load_2d(unsigned dst, const void* map_bytes, int c0, int c1, unsigned bar) {
  Cta& c = *g_cta;
  EmuTensorMap m;
  std::memcpy(&m, map_bytes, sizeof m);
  if (m.magic != TENSOR_MAP_MAGIC) {
    c.launch->fail("TMA copy with a tensor map the emulator did not make (emu.tensor_map_2d)");
    return;
  }
  const unsigned row_box = m.box_cols * m.elem_bytes, bytes = m.box_rows * row_box;
  if (m.swizzle != 0 && (m.swizzle != 3 || row_box != 128)) {
    c.launch->fail("TMA copy: only no swizzle, or the 128-byte swizzle of 128-byte box rows, is modelled");
    return;
  }
  unsigned char* d = window_bytes(c, dst, bytes, "TMA copy");
  if (d == nullptr) return;
  if (m.swizzle == 3 && (dst - WINDOW) % 1024) {
    c.launch->fail("TMA copy with the 128-byte swizzle to a shared address that is not 1024-byte aligned");
    return;
  }
  // the box as it lands: read now, written into shared memory when the copy completes
  c.staged.emplace_back(bytes, 0);
  unsigned char* box = c.staged.back().data();
  const unsigned char* base = reinterpret_cast<const unsigned char*>(m.address);
  for (unsigned r = 0; r < m.box_rows; ++r) {
    const long long row = (long long)c1 + r;
    for (unsigned e = 0; e < m.box_cols; ++e) {
      const long long col = (long long)c0 + e;
      unsigned off = r * row_box + e * m.elem_bytes;
      if (m.swizzle == 3) off = swizzle128((dst - WINDOW + off)) - (dst - WINDOW);
      if (row < 0 || col < 0 || (unsigned long long)row >= m.rows || (unsigned long long)col >= m.cols) continue;
      std::memcpy(box + off, base + row * m.row_bytes + col * m.elem_bytes, m.elem_bytes);
    }
  }
  c.copies.push_back({d, box, bytes, bar});
  if (c.rng() % 4 == 0) complete_copy(c, c.copies.size() - 1);
}

void wgmma_bf16(float* d, int R, const unsigned* a, unsigned long long desc, bool accumulate) {
  Cta& c = *g_cta;
  struct Frag {
    unsigned a[4];
  } mine, all[32];
  std::memcpy(mine.a, a, sizeof mine.a);
  warp_exchange(&mine, all, sizeof(Frag));
  const unsigned start = WINDOW + (unsigned)((desc & 0x3FFFull) << 4);
  const unsigned sbo = (unsigned)(((desc >> 32) & 0x3FFFull) << 4);
  if ((desc >> 62) != 1 || R % 8 || R > 256) {
    c.launch->fail("wgmma: only a K-major B with the 128-byte swizzle, R a multiple of 8 up to 256, is modelled");
    return;
  }
  auto bf = [](unsigned word, int half) { return (double)bf16_bits_to_f32((unsigned short)(half ? word >> 16 : word & 0xffff)); };
  double A[16][16];
  a_tile(all, bf, A);
  // B (k, n): column n's 16 k values, K-major: n / 8 atoms SBO apart, rows of 128 bytes, swizzled
  auto b_at = [&](int k, int n) -> double {
    const unsigned logical = start - WINDOW + (unsigned)((n / 8) * sbo + (n % 8) * 128 + 2 * k);
    const unsigned char* p = window_bytes(c, WINDOW + (swizzle128(logical) & ~15u), 16, "wgmma B");
    if (p == nullptr) return 0.0;
    unsigned short bits;
    std::memcpy(&bits, p + (swizzle128(logical) & 15u), 2);
    return (double)bf16_bits_to_f32(bits);
  };
  const int lane = g_fiber->lane, g = lane >> 2, t = lane & 3;
  for (int i = 0; i < R / 8; ++i) {
    for (int e = 0; e < 4; ++e) {
      const int row = e < 2 ? g : g + 8, col = 8 * i + 2 * t + (e & 1);
      double s = 0;
      for (int k = 0; k < 16; ++k) s += A[row][k] * b_at(k, col);
      d[4 * i + e] = (float)(s + (accumulate ? (double)d[4 * i + e] : 0.0));
    }
  }
}

// ---- numbers --------------------------------------------------------------------------------------

float bf16_bits_to_f32(unsigned short b) { return __uint_as_float((unsigned)b << 16); }

unsigned short f32_to_bf16_rn(float f) {
  const unsigned u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fff;  // NaN (cvt.rn.bf16.f32: canonical NaN)
  return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

float f16_bits_to_f32(unsigned short h) {
  const unsigned sign = (unsigned)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
  if (e == 0x1f) return __uint_as_float(sign | 0x7f800000u | (m << 13));
  if (e != 0) return __uint_as_float(sign | ((e + 112) << 23) | (m << 13));
  const float v = std::ldexp((float)m, -24);  // subnormal: exact
  return sign ? -v : v;
}

unsigned short f32_to_f16_rn(float f) {
  const unsigned u = __float_as_uint(f), sign = (u >> 16) & 0x8000;
  const float a = std::fabs(f);
  if (std::isnan(f)) return (unsigned short)(sign | 0x7e00);
  if (a >= 65520.0f) return (unsigned short)(sign | 0x7c00);  // rounds to infinity
  if (a < 6.103515625e-05f) {  // subnormal half: a multiple of 2^-24, round to nearest even
    const float q = std::nearbyint(a * 16777216.0f);
    return (unsigned short)(sign | (unsigned)q);
  }
  int e;
  const float fr = std::frexp(a, &e);  // a = fr 2^e, fr in [0.5, 1)
  float mant = std::nearbyint(fr * 2048.0f);  // 11 significant bits
  if (mant == 2048.0f) {
    mant = 1024.0f;
    ++e;
  }
  const unsigned he = (unsigned)(e - 1 + 15);
  if (he >= 31) return (unsigned short)(sign | 0x7c00);
  return (unsigned short)(sign | (he << 10) | ((unsigned)mant - 1024u));
}

void mma_m16n8k16(float* c, const unsigned* a, const unsigned* b, bool f16) {
  struct Frag {
    unsigned a[4], b[2];
  } mine, all[32];
  std::memcpy(mine.a, a, sizeof mine.a);
  std::memcpy(mine.b, b, sizeof mine.b);
  warp_exchange(&mine, all, sizeof(Frag));
  auto val = [f16](unsigned word, int half) {
    const unsigned short bits = (unsigned short)(half ? word >> 16 : word & 0xffff);
    return (double)(f16 ? f16_bits_to_f32(bits) : bf16_bits_to_f32(bits));
  };
  double A[16][16], B[16][8];
  a_tile(all, val, A);
  for (int L = 0; L < 32; ++L) {
    const int g = L >> 2, t = L & 3;
    for (int h = 0; h < 2; ++h) {
      B[2 * t + h][g] = val(all[L].b[0], h);
      B[2 * t + 8 + h][g] = val(all[L].b[1], h);
    }
  }
  const int lane = g_fiber->lane, g = lane >> 2, t = lane & 3;
  const int rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
  for (int i = 0; i < 4; ++i) {
    double s = 0;
    for (int k = 0; k < 16; ++k) s += A[rows[i]][k] * B[k][cols[i]];
    c[i] = (float)(s + (double)c[i]);
  }
}

void register_entries(const Registration* regs, int n) {
  for (int i = 0; i < n; ++i) registry()[regs[i].name] = &regs[i];
}

}  // namespace nq_emu

extern "C" int nq_emu_launch(const char* name, const unsigned* grid, const unsigned* block, unsigned shared,
                             void** args, int nargs, const unsigned* arg_bytes, unsigned long long seed,
                             double timeout_s, char* err, int errlen) {
  using namespace nq_emu;
  auto it = registry().find(name);
  if (it == registry().end()) {
    std::snprintf(err, errlen, "no kernel %s in this emulator build", name);
    return 1;
  }
  const Registration& reg = *it->second;
  if (nargs != reg.nargs) {
    std::snprintf(err, errlen, "%s takes %d arguments, the launcher passed %d", name, reg.nargs, nargs);
    return 1;
  }
  for (int i = 0; i < nargs; ++i) {
    if (arg_bytes[i] != reg.arg_bytes[i]) {
      std::snprintf(err, errlen, "%s: argument %d is %u bytes, the launcher passed %u", name, i, reg.arg_bytes[i],
                    arg_bytes[i]);
      return 1;
    }
  }
  Launch L;
  L.entry = &reg;
  L.args = args;
  L.grid = {grid[0], grid[1], grid[2]};
  L.block = {block[0], block[1], block[2]};
  L.shared = shared;
  L.timeout_s = timeout_s;
  L.start = std::chrono::steady_clock::now();
  const unsigned ctas = grid[0] * grid[1] * grid[2];
  std::vector<std::thread> threads;
  try {
    threads.reserve(ctas);
    for (unsigned i = 0; i < ctas; ++i) threads.emplace_back(run_cta, std::ref(L), i, seed);
  } catch (const std::exception& e) {
    L.fail(std::string("cannot start the CTAs' threads: ") + e.what());
  }
  for (auto& t : threads) t.join();
  if (!L.error.empty()) {
    std::snprintf(err, errlen, "%s (emulator seed %llu)", L.error.c_str(), seed);
    return 2;
  }
  return 0;
}
