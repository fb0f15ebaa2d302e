// CPU emulation of the CUDA features the kernels of csrc/ use, so that their
// own source runs in CI on a machine without a GPU (docs/architecture.md,
// "Testing the CUDA code without a GPU"). Force-included (-include) before
// every .cu compiled with the host compiler.
//
// Model: one OS thread per CUDA thread (a persistent pool); the blocks of a
// launch run one at a time in a seeded random order, the threads of a block
// all at once. __syncthreads, warp shuffles and ballots, and counted named
// barriers are real barriers: a thread waits until its phase completes. They
// abort on what the hardware would leave undefined or hang on: a barrier phase
// reached with different thread counts, every live thread of a block waiting
// (deadlock, e.g. a barrier some threads skip), threads exiting with barrier
// phases left open, a partial warp in a warp intrinsic, an invalid launch
// shape, and, as a last resort, a watchdog.
//
// __shared__ variables are function statics; before each block the launcher
// fills them all with 0xff bytes (NaN in every float and double,
// -1 in every integer), so a read of shared memory the block did not write
// yields a poisoned value instead of a zero or the previous block's data. The
// launch's dynamic shared memory (NCDP_DYNAMIC_SHARED) is one buffer of the
// launch's size, poisoned the same way before each block; a launch asking for
// more than 48 KiB fails unless cudaFuncSetAttribute raised its kernel's limit
// (up to sm_90's 227 KiB), as on the hardware.
//
// cp.async (NCDP_CP_ASYNC16, common/launch.cuh) is deferred as the hardware may
// defer it: its 16 destination bytes are poisoned when the copy is issued (the
// source is read then) and written when an NCDP_CP_ASYNC_WAIT leaves at most N
// of the thread's committed groups pending; copies not yet committed wait for
// their commit.
// So a read of the destination before its wait sees the poison, and a read by
// another thread without a __syncthreads after the wait is a data race.
//
// Under ThreadSanitizer the emulator adds no ordering the hardware does not
// give: its own locks and the pool's hand-off are hidden from the race
// detector; a barrier orders a thread's writes before it for every waiter after
// it, and nothing else (bar.arrive releases without acquiring), so a missing
// __syncthreads shows up as a data race; shuffles and ballots exchange values
// but order no memory, as on the hardware; and every CUDA thread of every block
// is its own TSan fiber, so the blocks of a launch are concurrent to the
// detector (nothing orders one block after another; the launch's end orders
// them all before what follows), although they run one after another.
#pragma once
#define NCDP_CPU_EMULATION 1

#include <math.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <mutex>
#include <random>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <elf.h>
#include <limits.h>
#include <map>
#include <link.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <unistd.h>

// The runtime API of the host code (cudaStream_t, errors, the emulated device).
#include "cuda_emu_runtime.h"

// ---------------------------------------------------------------------------
// Keywords and built-in types.

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __grid_constant__
// Blocks run one at a time, so one instance per kernel instantiation is
// block-local storage shared by exactly the threads of the running block. The
// launcher finds them all in the symbol table (shared_variables()): g++ drops
// a section attribute on statics of function templates, so no marker survives.
#define __shared__ static

struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1)
      : x(x_), y(y_), z(z_) {}
};
struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(16) double2 {
  double x, y;
};

#if defined(__SANITIZE_THREAD__)
// The barrier's own bookkeeping is invisible to the race detector (its mutex
// neither synchronizes nor is checked); the barrier's meaning is stated with
// explicit release / acquire annotations instead.
extern "C" {
void AnnotateIgnoreSyncBegin(const char* file, int line);
void AnnotateIgnoreSyncEnd(const char* file, int line);
void AnnotateIgnoreReadsBegin(const char* file, int line);
void AnnotateIgnoreReadsEnd(const char* file, int line);
void AnnotateIgnoreWritesBegin(const char* file, int line);
void AnnotateIgnoreWritesEnd(const char* file, int line);
void __tsan_java_alloc(unsigned long ptr, unsigned long size);
void __tsan_java_free(unsigned long ptr, unsigned long size);
void __tsan_acquire(void* addr);
void __tsan_release(void* addr);
void* __tsan_get_current_fiber(void);
void* __tsan_create_fiber(unsigned flags);
void __tsan_destroy_fiber(void* fiber);
void __tsan_switch_to_fiber(void* fiber, unsigned flags);
void __tsan_set_fiber_name(void* fiber, const char* name);
}
// __tsan_switch_to_fiber's flag: the switch itself orders nothing.
#define NCDP_EMU_FIBER_NO_SYNC 1u
#define NCDP_EMU_HIDDEN_BEGIN()                 \
  (AnnotateIgnoreSyncBegin(__FILE__, __LINE__), \
   AnnotateIgnoreReadsBegin(__FILE__, __LINE__), AnnotateIgnoreWritesBegin(__FILE__, __LINE__))
#define NCDP_EMU_HIDDEN_END()                                                            \
  (AnnotateIgnoreWritesEnd(__FILE__, __LINE__), AnnotateIgnoreReadsEnd(__FILE__, __LINE__), \
   AnnotateIgnoreSyncEnd(__FILE__, __LINE__))
#define NCDP_EMU_ACQUIRE(addr) __tsan_acquire(addr)
#define NCDP_EMU_RELEASE(addr) __tsan_release(addr)
#else
#define NCDP_EMU_HIDDEN_BEGIN() ((void)0)
#define NCDP_EMU_HIDDEN_END() ((void)0)
#define NCDP_EMU_ACQUIRE(addr) ((void)(addr))
#define NCDP_EMU_RELEASE(addr) ((void)(addr))
#endif

// Code the sanitizers must not see: the pool's hand-off between the launching
// thread and the workers (under ThreadSanitizer it would order the blocks of a
// launch, and it runs outside any fiber) and the poisoning of shared memory
// (the launching thread's writes, which TSan must not count as accesses).
#define NCDP_EMU_UNSANITIZED __attribute__((no_sanitize("address", "thread", "undefined")))

namespace ncdp_emu {

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;
// Barrier ids 0..15 as on the hardware; 0 is __syncthreads'.
constexpr int kNamedBarriers = 16;
// Every byte of shared memory at the start of a block: NaN in any float or
// double at any offset, so an unwritten value poisons every sum it reaches.
constexpr unsigned char kSharedPoison = 0xff;

[[noreturn]] inline void fatal(const char* format, ...) __attribute__((format(printf, 1, 2)));
[[noreturn]] inline void fatal(const char* format, ...) {
  std::fprintf(stderr, "ncdp_emu: FATAL: ");
  va_list args;
  va_start(args, format);
  std::vfprintf(stderr, format, args);
  va_end(args);
  std::fprintf(stderr, "\n");
  std::fflush(stderr);
  std::abort();
}

// Seconds a barrier may wait before the watchdog aborts (NCDP_EMU_WATCHDOG_S):
// a backstop only, real deadlocks are detected exactly.
inline double watchdog_seconds() {
  static const double seconds = [] {
    const char* text = std::getenv("NCDP_EMU_WATCHDOG_S");
    return text != nullptr ? std::atof(text) : 600.0;
  }();
  return seconds;
}

// The generator of block orders (and, under ThreadSanitizer, of the order in
// which a block's fibers are created): NCDP_EMU_SEED, or one from the OS that
// is printed so that a failing run can be repeated.
inline std::uint64_t next_random() {
  static std::mutex mutex;
  static std::uint64_t state = [] {
    const char* text = std::getenv("NCDP_EMU_SEED");
    std::uint64_t seed = 0;
    if (text != nullptr && *text != '\0') {
      seed = std::strtoull(text, nullptr, 0);
    } else {
      std::random_device device;
      seed = (static_cast<std::uint64_t>(device()) << 32) ^ device();
      std::fprintf(stderr, "ncdp_emu: block order seed %llu (NCDP_EMU_SEED repeats it)\n",
                   static_cast<unsigned long long>(seed));
    }
    return seed;
  }();
  std::uint64_t z;
  {
    std::lock_guard<std::mutex> lock(mutex);
    z = (state += 0x9e3779b97f4a7c15ull);  // splitmix64
  }
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// A uniformly random permutation of 0 .. n-1 (Fisher-Yates).
inline std::vector<int> random_order(int n) {
  std::vector<int> order(static_cast<std::size_t>(n));
  for (int i = 0; i < n; ++i) order[static_cast<std::size_t>(i)] = i;
  for (int i = n - 1; i > 0; --i) {
    const int j = static_cast<int>(next_random() % static_cast<std::uint64_t>(i + 1));
    std::swap(order[static_cast<std::size_t>(i)], order[static_cast<std::size_t>(j)]);
  }
  return order;
}

struct Block;

// One counted barrier: a phase completes when `expected` arrivals (sync or
// arrive) have been counted; syncing threads wait for their phase.
struct Barrier {
  std::mutex mutex;
  std::condition_variable cv;
  int arrived = 0;
  int expected = 0;
  int waiters = 0;
  std::uint64_t generation = 0;
  // Happens-before tokens, one per phase modulo 4: a phase's waiters acquire
  // only what was released for that phase (a thread already arriving at the
  // next phase must not leak its newer writes to a slow waiter of this one).
  char tokens[4] = {};
};

// One cp.async: its destination and the 16 source bytes read at its issue.
struct PendingCopy {
  unsigned char* destination;
  unsigned char bytes[16];
};

struct ThreadState {
  // This thread's cp.async copies: issued since the last commit, then the
  // committed groups, oldest first.
  std::vector<PendingCopy> open_copies;
  std::vector<std::vector<PendingCopy>> committed_copies;
  dim3 thread_idx;
  dim3 block_idx;
  dim3 block_dim;
  dim3 grid_dim;
  int linear = 0;
  // Warp exchanges this thread has made in the current block; every lane of a
  // warp makes the same sequence, so its parity picks the same slot buffer.
  std::uint64_t exchanges = 0;
  Block* block = nullptr;
};

// Heap-allocated for the whole launch: TSan keys its sync objects by address,
// so a block reusing another's barriers would inherit its happens-before.
struct Block {
  dim3 block_idx;
  int threads = 0;
  Barrier named[kNamedBarriers];
  std::vector<std::unique_ptr<Barrier>> warp_barriers;
  std::vector<std::uint64_t> warp_slots;  // [warps, 2, 32]: double-buffered
  std::vector<ThreadState> states;        // [threads]
  char start = 0;                         // released by the launcher
  std::function<void(int)> job;           // runs thread t of this block
  // Threads waiting at a barrier plus threads that have returned; relaxed
  // atomics only, so the race detector sees no synchronization through them.
  std::atomic<int> inactive{0};
  std::atomic<int> blocked{0};
};

// The running CUDA thread's state. Every fiber on one OS thread shares this
// pointer, so it is only written hidden from the race detector.
inline thread_local ThreadState* t_state = nullptr;

inline void check_deadlock(Block& block, int inactive, const char* where) {
  if (inactive == block.threads && block.blocked.load(std::memory_order_relaxed) > 0) {
    fatal("deadlock in block (%u, %u, %u) at %s: every live thread waits at a barrier that "
          "cannot complete (a barrier not reached by all of its threads?)",
          block.block_idx.x, block.block_idx.y, block.block_idx.z, where);
  }
}

// A barrier's thread count must fit the block.
inline void check_thread_count(const Block& block, int expected, const char* what, int id) {
  if (expected <= 0 || expected > block.threads) {
    fatal("%s %d: thread count %d outside 1..%d (the block's size)", what, id, expected,
          block.threads);
  }
}

// The first arrival of a phase sets its count; every later one must agree.
inline void join_phase(Barrier& b, const Block& block, int expected, const char* what, int id) {
  if (b.arrived == 0) {
    b.expected = expected;
  } else if (b.expected != expected) {
    fatal("%s %d in block (%u, %u, %u): thread %d arrives expecting %d threads, but this phase "
          "expects %d",
          what, id, block.block_idx.x, block.block_idx.y, block.block_idx.z, t_state->linear,
          expected, b.expected);
  }
}

#if defined(NCDP_EMU_COOPERATIVE)
// Cooperative mode (the emulated device of the Python module): the threads of
// a block are coroutines on the launching thread, switched only where a thread
// waits at a barrier (__syncthreads, a named barrier, a warp exchange). One OS
// thread per CUDA thread, meeting through condition variables, cost about a
// millisecond per barrier on two cores; a switch here costs about a
// microsecond. What the sanitizer tier checks (races, orderings) needs the
// threaded model; this mode keeps its exact barrier semantics, its deadlock
// detection (a whole pass in which no thread arrives, completes a phase or
// returns), the block order and the shared-memory poisoning.
// Switches stacks: saves the callee-saved registers on the current stack and
// the stack pointer in *from, then resumes the stack `to` (x86-64 System V;
// elsewhere ucontext, whose switches also swap the signal mask, a system call).
#if defined(__x86_64__)
__attribute__((naked, noinline)) static void switch_stacks(void** /*from*/, void* /*to*/) {
  asm volatile(
      "pushq %rbp\n pushq %rbx\n pushq %r12\n pushq %r13\n pushq %r14\n pushq %r15\n"
      "movq %rsp, (%rdi)\n movq %rsi, %rsp\n"
      "popq %r15\n popq %r14\n popq %r13\n popq %r12\n popq %rbx\n popq %rbp\n ret\n");
}
#endif

class Coroutines {
 public:
  static constexpr std::size_t kStackBytes = 256 * 1024;

  static Coroutines& instance() {
    static Coroutines coroutines;
    return coroutines;
  }

  // Runs job(t) for every t < threads to its end.
  void run(int threads, const std::function<void(int)>& job, Block& block) {
    while (static_cast<int>(stacks_.size()) < threads) {
      stacks_.emplace_back(new char[kStackBytes]);
      saved_.push_back(nullptr);
#if !defined(__x86_64__)
      contexts_.emplace_back();
#endif
    }
    job_ = &job;
    done_.assign(static_cast<std::size_t>(threads), false);
    for (int t = 0; t < threads; ++t) start(t);
    int finished = 0;
    while (finished < threads) {
      progress_ = false;
      for (int t = 0; t < threads; ++t) {
        if (done_[static_cast<std::size_t>(t)]) continue;
        current_ = t;
        t_state = &block.states[static_cast<std::size_t>(t)];
        resume(t);
        if (done_[static_cast<std::size_t>(t)]) ++finished;
      }
      if (!progress_ && finished < threads) {
        fatal("deadlock in block (%u, %u, %u): every live thread waits at a barrier that "
              "cannot complete (a barrier not reached by all of its threads?)",
              block.block_idx.x, block.block_idx.y, block.block_idx.z);
      }
    }
    t_state = nullptr;
  }

  // Back to the scheduler; the calling thread is resumed in the next pass.
  void yield() { suspend(current_); }
  void progressed() { progress_ = true; }

 private:
  static void entry() {
    Coroutines& self = instance();
    const int t = self.current_;
    (*self.job_)(t);
    self.done_[static_cast<std::size_t>(t)] = true;
    self.progress_ = true;
#if defined(__x86_64__)
    self.suspend(t);  // never resumed
    __builtin_unreachable();
#endif
  }  // ucontext: uc_link returns to the scheduler

#if defined(__x86_64__)
  // A fresh stack as switch_stacks leaves a suspended one: six saved
  // registers, then entry() as the return address, with the stack pointer at
  // entry() 8 bytes off a 16-byte boundary, as after a call.
  void start(int t) {
    char* top = stacks_[static_cast<std::size_t>(t)].get() + kStackBytes;
    auto* slot = reinterpret_cast<void**>(reinterpret_cast<std::uintptr_t>(top) & ~std::uintptr_t{15});
    *--slot = nullptr;                                   // entry()'s return address: none
    *--slot = reinterpret_cast<void*>(&Coroutines::entry);
    for (int r = 0; r < 6; ++r) *--slot = nullptr;       // rbp rbx r12 r13 r14 r15
    saved_[static_cast<std::size_t>(t)] = slot;
  }
  void resume(int t) { switch_stacks(&scheduler_, saved_[static_cast<std::size_t>(t)]); }
  void suspend(int t) { switch_stacks(&saved_[static_cast<std::size_t>(t)], scheduler_); }
  void* scheduler_ = nullptr;
#else
  void start(int t) {
    ucontext_t& context = contexts_[static_cast<std::size_t>(t)];
    getcontext(&context);
    context.uc_stack.ss_sp = stacks_[static_cast<std::size_t>(t)].get();
    context.uc_stack.ss_size = kStackBytes;
    context.uc_link = &scheduler_;
    makecontext(&context, &Coroutines::entry, 0);
  }
  void resume(int t) { swapcontext(&scheduler_, &contexts_[static_cast<std::size_t>(t)]); }
  void suspend(int t) { swapcontext(&contexts_[static_cast<std::size_t>(t)], &scheduler_); }
  std::vector<ucontext_t> contexts_;
  ucontext_t scheduler_{};
#endif

  std::vector<std::unique_ptr<char[]>> stacks_;
  std::vector<void*> saved_;
  std::vector<bool> done_;
  const std::function<void(int)>* job_ = nullptr;
  int current_ = 0;
  bool progress_ = false;
};

inline void barrier_arrive(Barrier& b, int expected, bool wait, bool /*orders_memory*/,
                           const char* what, int id) {
  Block& block = *t_state->block;
  check_thread_count(block, expected, what, id);
  join_phase(b, block, expected, what, id);
  Coroutines& coroutines = Coroutines::instance();
  coroutines.progressed();
  const std::uint64_t generation = b.generation;
  if (++b.arrived == b.expected) {
    b.arrived = 0;
    ++b.generation;
  } else if (wait) {
    ThreadState* const self = t_state;
    while (b.generation == generation) coroutines.yield();
    t_state = self;
  }
}
#else
// Counts this thread at barrier `b` for a phase of `expected` threads; with
// `wait`, returns once the phase is complete. With `orders_memory`, the
// thread's writes before it happen before every waiter's code after it (a
// block barrier); without, the phase only exchanges values (a shuffle).
inline void barrier_arrive(Barrier& b, int expected, bool wait, bool orders_memory,
                           const char* what, int id) {
  Block& block = *t_state->block;
  check_thread_count(block, expected, what, id);
  // A shuffle's caller has hidden the whole exchange already.
  if (orders_memory) NCDP_EMU_HIDDEN_BEGIN();
  std::unique_lock<std::mutex> lock(b.mutex);
  const std::uint64_t generation = b.generation;
  if (orders_memory) {
    NCDP_EMU_HIDDEN_END();
    NCDP_EMU_RELEASE(&b.tokens[generation & 3]);
    NCDP_EMU_HIDDEN_BEGIN();
  }
  join_phase(b, block, expected, what, id);
  if (++b.arrived == b.expected) {
    b.arrived = 0;
    ++b.generation;
    block.blocked.fetch_sub(b.waiters, std::memory_order_relaxed);
    block.inactive.fetch_sub(b.waiters, std::memory_order_relaxed);
    b.waiters = 0;
    b.cv.notify_all();
  } else if (wait) {
    ++b.waiters;
    block.blocked.fetch_add(1, std::memory_order_relaxed);
    check_deadlock(block, block.inactive.fetch_add(1, std::memory_order_relaxed) + 1, what);
    const auto start = std::chrono::steady_clock::now();
    while (b.generation == generation) {
      if (b.cv.wait_for(lock, std::chrono::milliseconds(200)) == std::cv_status::timeout) {
        check_deadlock(block, block.inactive.load(std::memory_order_relaxed), what);
        const std::chrono::duration<double> waited = std::chrono::steady_clock::now() - start;
        if (waited.count() > watchdog_seconds()) {
          fatal("watchdog: thread %d waited %.0f s at %s %d", t_state->linear, waited.count(),
                what, id);
        }
      }
    }
  }
  lock.unlock();
  if (orders_memory) {
    NCDP_EMU_HIDDEN_END();
    if (wait) NCDP_EMU_ACQUIRE(&b.tokens[generation & 3]);
  }
}
#endif  // NCDP_EMU_COOPERATIVE

inline void syncthreads() {
  barrier_arrive(t_state->block->named[0], t_state->block->threads, true, true, "__syncthreads",
                 0);
}

inline void named_barrier(int id, int threads, bool wait) {
  if (id <= 0 || id >= kNamedBarriers) fatal("named barrier id %d outside 1..15", id);
  if (threads % kWarpSize != 0) fatal("named barrier %d: %d threads, not whole warps", id, threads);
  barrier_arrive(t_state->block->named[id], threads, wait, true, wait ? "bar.sync" : "bar.arrive",
                 id);
}

// ---- Warp intrinsics: every lane writes its value to the warp's slots, the
// warp meets, each lane reads. Exchanges alternate between two slot buffers, so
// one meeting per exchange suffices: a lane can only write a buffer again two
// exchanges later, after a meeting that every lane reached after reading it.
// The hardware gives a shuffle no memory ordering (unlike __syncwarp), so the
// whole exchange, slots and meeting, is hidden from the race detector and
// orders nothing for it.
inline int lane_id() { return t_state->linear % kWarpSize; }

inline std::uint64_t* next_warp_slots() {
  const std::size_t warp = static_cast<std::size_t>(t_state->linear / kWarpSize);
  const std::size_t buffer = static_cast<std::size_t>(t_state->exchanges++ & 1u);
  return &t_state->block->warp_slots[(warp * 2 + buffer) * kWarpSize];
}

inline void warp_meet(unsigned mask, const char* what) {
  Block& block = *t_state->block;
  if (mask != kFullMask) fatal("%s with mask 0x%08x: only full-warp masks are emulated", what, mask);
  const int warp = t_state->linear / kWarpSize;
  if ((warp + 1) * kWarpSize > block.threads) {
    fatal("%s in a partial warp (block of %d threads)", what, block.threads);
  }
  barrier_arrive(*block.warp_barriers[static_cast<std::size_t>(warp)], kWarpSize, true, false,
                 what, warp);
}

// Every lane's 8-byte word after the warp has met: out[lane] = mine of lane.
inline void exchange_words(unsigned mask, std::uint64_t mine, std::uint64_t (&out)[kWarpSize],
                           const char* what) {
  std::uint64_t* slots = next_warp_slots();
  NCDP_EMU_HIDDEN_BEGIN();
  slots[lane_id()] = mine;
  warp_meet(mask, what);
  for (int lane = 0; lane < kWarpSize; ++lane) out[lane] = slots[lane];
  NCDP_EMU_HIDDEN_END();
}

// Every lane's value of the warp, out[lane] (one rendezvous; a warp-wide
// operation such as common/mma_f64.cuh's reads the lanes it needs from it).
template <typename T>
void exchange_all(unsigned mask, T value, T (&out)[kWarpSize], const char* what) {
  static_assert(sizeof(T) <= sizeof(std::uint64_t) && std::is_trivially_copyable<T>::value,
                "exchanged values are at most 8 bytes");
  std::uint64_t mine = 0;
  std::memcpy(&mine, &value, sizeof(T));
  std::uint64_t words[kWarpSize];
  exchange_words(mask, mine, words, what);
  for (int lane = 0; lane < kWarpSize; ++lane) std::memcpy(&out[lane], &words[lane], sizeof(T));
}

// Lane `source`'s value (a shuffle).
template <typename T>
T exchange(unsigned mask, T value, int source, const char* what) {
  T all[kWarpSize];
  exchange_all(mask, value, all, what);
  return all[source];
}

inline void check_width(int width, const char* what) {
  if (width <= 0 || width > kWarpSize || (width & (width - 1)) != 0) {
    fatal("%s: width %d is not a power of two in 1..32", what, width);
  }
}

template <typename T>
T shfl_sync(unsigned mask, T value, int src_lane, int width) {
  check_width(width, "__shfl_sync");
  const int lane = lane_id();
  const int base = lane & ~(width - 1);
  return exchange(mask, value, base + (src_lane & (width - 1)), "__shfl_sync");
}

template <typename T>
T shfl_down_sync(unsigned mask, T value, unsigned delta, int width) {
  check_width(width, "__shfl_down_sync");
  const int lane = lane_id();
  const int in_segment = (lane & (width - 1)) + static_cast<int>(delta);
  return exchange(mask, value, in_segment < width ? lane + static_cast<int>(delta) : lane,
                  "__shfl_down_sync");
}

template <typename T>
T shfl_up_sync(unsigned mask, T value, unsigned delta, int width) {
  check_width(width, "__shfl_up_sync");
  const int lane = lane_id();
  const int in_segment = (lane & (width - 1)) - static_cast<int>(delta);
  return exchange(mask, value, in_segment >= 0 ? lane - static_cast<int>(delta) : lane,
                  "__shfl_up_sync");
}

template <typename T>
T shfl_xor_sync(unsigned mask, T value, int lane_mask, int width) {
  check_width(width, "__shfl_xor_sync");
  const int lane = lane_id();
  const int source = lane ^ lane_mask;
  const bool same_segment = (source & ~(width - 1)) == (lane & ~(width - 1));
  return exchange(mask, value, same_segment && source < kWarpSize ? source : lane,
                  "__shfl_xor_sync");
}

inline unsigned ballot_sync(unsigned mask, int predicate) {
  std::uint64_t words[kWarpSize];
  exchange_words(mask, predicate != 0 ? 1u : 0u, words, "__ballot_sync");
  unsigned bits = 0;
  for (int lane = 0; lane < kWarpSize; ++lane) bits |= static_cast<unsigned>(words[lane]) << lane;
  return bits;
}

// ---- Memory that starts over.

// Makes ThreadSanitizer forget every access to [begin, begin + bytes), as for
// newly allocated memory. AnnotateNewMemory is a no-op in this runtime; the
// Java heap hooks are the interface that resets shadow memory (allocation
// resets it, and freeing at once drops the block record allocation made).
NCDP_EMU_UNSANITIZED inline void forget_accesses(char* begin, std::size_t bytes) {
#if defined(__SANITIZE_THREAD__)
  // The hooks work on 8-byte granules.
  const std::uintptr_t lo = reinterpret_cast<std::uintptr_t>(begin) & ~std::uintptr_t{7};
  const std::uintptr_t hi = (reinterpret_cast<std::uintptr_t>(begin) + bytes + 7) & ~std::uintptr_t{7};
  if (hi > lo) {
    __tsan_java_alloc(lo, hi - lo);
    __tsan_java_free(lo, hi - lo);
  }
#else
  (void)begin;
  (void)bytes;
#endif
}

// ---- Shared memory.

struct SharedVariable {
  char* address;
  std::size_t bytes;
};

// Whether a symbol is a __shared__ variable: a function-local static (_ZZ) of
// a function in csrc's namespace ncdp::kernels or in an anonymous namespace of
// a file of its own (the tier's probe). Device code has no other function-local
// statics; host code's (ncdp::l2_cache_bytes's cache, the launcher registry)
// live outside ncdp::kernels, and the emulator's own in ncdp_emu.
inline bool is_shared_symbol(const char* name) {
  return std::strncmp(name, "_ZZN4ncdp7kernels", 17) == 0 ||
         std::strncmp(name, "_ZZN12_GLOBAL__N_1", 18) == 0;
}

// The loaded object (executable or shared library) that holds this code, and
// so the kernels: its load address and the file to read its symbols from.
struct LoadedObject {
  std::uintptr_t bias = 0;
  std::string path;
};

inline LoadedObject object_of_this_code() {
  struct Search {
    std::uintptr_t address;
    LoadedObject found;
    bool hit;
  } search{reinterpret_cast<std::uintptr_t>(&object_of_this_code), {}, false};
  dl_iterate_phdr(
      [](dl_phdr_info* info, std::size_t, void* data) {
        auto* s = static_cast<Search*>(data);
        for (int i = 0; i < info->dlpi_phnum; ++i) {
          const ElfW(Phdr)& segment = info->dlpi_phdr[i];
          const std::uintptr_t start = info->dlpi_addr + segment.p_vaddr;
          if (segment.p_type == PT_LOAD && s->address >= start &&
              s->address < start + segment.p_memsz) {
            s->found.bias = info->dlpi_addr;
            // The executable has an empty name here (Python's extension
            // modules have their path).
            s->found.path = (info->dlpi_name != nullptr && info->dlpi_name[0] != '\0')
                                ? info->dlpi_name
                                : "/proc/self/exe";
            s->hit = true;
            return 1;
          }
        }
        return 0;
      },
      &search);
  if (!search.hit) fatal("cannot find the loaded object that holds the emulated kernels");
  return search.found;
}

// Every __shared__ variable of the object holding the kernels (the tier's
// driver, or the Python module of the emulated device), read once from its
// symbol table (the build keeps it: not stripped).
inline const std::vector<SharedVariable>& shared_variables() {
  static const std::vector<SharedVariable> variables = [] {
    const LoadedObject object = object_of_this_code();
    const std::uintptr_t bias = object.bias;
    std::FILE* file = std::fopen(object.path.c_str(), "rb");
    if (file == nullptr) fatal("cannot read %s to find the __shared__ variables", object.path.c_str());
    std::vector<char> image;
    char chunk[1 << 16];
    for (std::size_t n; (n = std::fread(chunk, 1, sizeof(chunk), file)) > 0;) {
      image.insert(image.end(), chunk, chunk + n);
    }
    std::fclose(file);
    std::vector<SharedVariable> found;
    bool has_symtab = false;
    const auto* header = reinterpret_cast<const Elf64_Ehdr*>(image.data());
    const auto* sections = reinterpret_cast<const Elf64_Shdr*>(image.data() + header->e_shoff);
    for (int i = 0; i < header->e_shnum; ++i) {
      if (sections[i].sh_type != SHT_SYMTAB) continue;
      has_symtab = true;
      const char* names = image.data() + sections[sections[i].sh_link].sh_offset;
      const auto* symbols = reinterpret_cast<const Elf64_Sym*>(image.data() + sections[i].sh_offset);
      const std::size_t count = sections[i].sh_size / sizeof(Elf64_Sym);
      for (std::size_t k = 0; k < count; ++k) {
        const Elf64_Sym& symbol = symbols[k];
        if (ELF64_ST_TYPE(symbol.st_info) != STT_OBJECT || symbol.st_size == 0 ||
            symbol.st_shndx == SHN_UNDEF || !is_shared_symbol(names + symbol.st_name)) {
          continue;
        }
        found.push_back({reinterpret_cast<char*>(bias + symbol.st_value),
                         static_cast<std::size_t>(symbol.st_size)});
      }
    }
    if (!has_symtab) {
      fatal("%s has no symbol table: __shared__ variables cannot be found to poison them "
            "(build the emulation without stripping)", object.path.c_str());
    }
    return found;
  }();
  return variables;
}

// Fills every __shared__ variable of the program with kSharedPoison. Under
// ThreadSanitizer the previous block's accesses are forgotten first: the next
// block's memory is new, not shared with the blocks before it.
NCDP_EMU_UNSANITIZED inline void poison_bytes(char* address, std::size_t bytes) {
#if defined(NCDP_EMU_COOPERATIVE)
  // No sanitizer in this mode: memset, at a fraction of the byte loop's cost
  // (that loop was half the module's time on many-block launches).
  std::memset(address, kSharedPoison, bytes);
#else
  forget_accesses(address, bytes);
  // Volatile: a plain loop may become a call to memset, which the sanitizers
  // intercept and check.
  volatile unsigned char* byte = reinterpret_cast<volatile unsigned char*>(address);
  for (std::size_t i = 0; i < bytes; ++i) byte[i] = kSharedPoison;
#endif
}

NCDP_EMU_UNSANITIZED inline void poison_shared_memory() {
  for (const SharedVariable& variable : shared_variables()) {
    poison_bytes(variable.address, variable.bytes);
  }
}

// ---- Dynamic shared memory and cp.async.

// The running launch's dynamic shared memory (one launch runs at a time):
// written by the launcher before a block's start, which its threads acquire.
struct DynamicShared {
  unsigned char* base = nullptr;
  std::size_t bytes = 0;
};
inline DynamicShared& dynamic_shared() {
  static DynamicShared memory;
  return memory;
}

// Fills the launch's dynamic shared memory with kSharedPoison before a block.
inline void poison_dynamic_shared() {
  const DynamicShared& memory = dynamic_shared();
  if (memory.bytes != 0) poison_bytes(reinterpret_cast<char*>(memory.base), memory.bytes);
}

// Whether [address, address + bytes) is shared memory: the launch's dynamic
// buffer or a __shared__ variable (a cp.async destination must be).
inline bool is_shared_range(const void* address, std::size_t bytes) {
  const auto* begin = static_cast<const unsigned char*>(address);
  const DynamicShared& memory = dynamic_shared();
  if (memory.bytes != 0 && begin >= memory.base && begin + bytes <= memory.base + memory.bytes) {
    return true;
  }
  for (const SharedVariable& variable : shared_variables()) {
    const auto* start = reinterpret_cast<const unsigned char*>(variable.address);
    if (begin >= start && begin + bytes <= start + variable.bytes) return true;
  }
  return false;
}

// cp.async.cg.shared.global of 16 bytes: the source read now, the destination
// poisoned now and written at the cp_async_wait that completes its group.
inline void cp_async16(void* destination, const void* source) {
  if (reinterpret_cast<std::uintptr_t>(destination) % 16 != 0 ||
      reinterpret_cast<std::uintptr_t>(source) % 16 != 0) {
    fatal("cp.async of 16 bytes from %p to %p: both addresses must be 16-byte aligned", source,
          destination);
  }
  if (!is_shared_range(destination, 16)) {
    fatal("cp.async to %p: the destination is not shared memory", destination);
  }
  PendingCopy copy;
  copy.destination = static_cast<unsigned char*>(destination);
  std::memcpy(copy.bytes, source, sizeof(copy.bytes));
  volatile unsigned char* byte = copy.destination;
  for (std::size_t i = 0; i < sizeof(copy.bytes); ++i) byte[i] = kSharedPoison;
  t_state->open_copies.push_back(copy);
}

// cp.async.commit_group: the copies issued since the last commit become a group
// (an empty one if there were none, as in PTX).
inline void cp_async_commit() {
  ThreadState& state = *t_state;
  state.committed_copies.push_back(std::move(state.open_copies));
  state.open_copies.clear();
}

// cp.async.wait_group `pending`: the thread's oldest committed groups complete
// until at most `pending` remain.
inline void cp_async_wait(int pending) {
  ThreadState& state = *t_state;
  std::vector<std::vector<PendingCopy>>& groups = state.committed_copies;
  std::size_t done = 0;
  while (groups.size() - done > static_cast<std::size_t>(pending)) {
    for (const PendingCopy& copy : groups[done]) {
      std::memcpy(copy.destination, copy.bytes, sizeof(copy.bytes));
    }
    ++done;
  }
  groups.erase(groups.begin(), groups.begin() + static_cast<std::ptrdiff_t>(done));
}

// ---- Launches.

inline bool check_launch_shape(const dim3& grid, const dim3& block, std::size_t shared_bytes,
                               std::size_t shared_limit) {
  const std::uint64_t threads = static_cast<std::uint64_t>(block.x) * block.y * block.z;
  const bool ok = grid.x >= 1 && grid.y >= 1 && grid.z >= 1 && grid.x <= 2147483647u &&
                  grid.y <= 65535u && grid.z <= 65535u && block.x >= 1 && block.y >= 1 &&
                  block.z >= 1 && block.x <= 1024u && block.y <= 1024u && block.z <= 64u &&
                  threads <= 1024u && shared_bytes <= shared_limit;
  if (!ok) {
#if defined(NCDP_EMU_MODULE)
    // The emulated device of the Python module reports it as the hardware
    // does: the launch does not run and cudaGetLastError returns the error.
    record(cudaErrorInvalidConfiguration);
    return false;
#else
    fatal("invalid launch: grid (%u, %u, %u), block (%u, %u, %u), %zu bytes of dynamic shared "
          "memory (the kernel's limit: %zu)",
          grid.x, grid.y, grid.z, block.x, block.y, block.z, shared_bytes, shared_limit);
#endif
  }
  return true;
}

NCDP_EMU_UNSANITIZED inline void futex_wait(std::uint32_t* word, std::uint32_t expected) {
  syscall(SYS_futex, word, FUTEX_WAIT_PRIVATE, expected, nullptr, nullptr, 0);
}

NCDP_EMU_UNSANITIZED inline void futex_wake_all(std::uint32_t* word) {
  syscall(SYS_futex, word, FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
}

// Worker threads kept across blocks and launches (creating 256 threads per
// block dominated the run time under ThreadSanitizer). Worker t runs thread t
// of each block in turn, under ThreadSanitizer as that thread's fiber. The
// hand-off is atomics and futexes in unsanitized code: invisible to the race
// detector, so it orders neither the launching thread after a block nor one
// block after another.
class Pool {
 public:
  // Stack a fiber may use below the worker's frame (see work()).
  static constexpr std::size_t kFiberStackBytes = 64 * 1024;

  using Job = std::function<void(int)>;

  static Pool& instance() {
    static Pool pool;
    return pool;
  }

  // Runs job(t) on workers 0 .. threads-1 (under ThreadSanitizer as fibers[t],
  // or as the worker's own thread if null, after acquiring `start`) and
  // returns when all have finished.
  NCDP_EMU_UNSANITIZED void run(int threads, const Job& job, void* const* fibers, char* start) {
    const std::uint32_t generation = __atomic_load_n(&generation_, __ATOMIC_RELAXED);
    while (static_cast<int>(workers_.size()) < threads) {
      spawn(static_cast<int>(workers_.size()), generation);
    }
    job_ = &job;
    fibers_ = fibers;
    start_ = start;
    active_ = threads;
    // Every worker checks in, active or not, so none can still be reading this
    // run's job when the next run replaces it.
    __atomic_store_n(&remaining_, static_cast<std::uint32_t>(workers_.size()), __ATOMIC_RELAXED);
    __atomic_store_n(&generation_, generation + 1, __ATOMIC_RELEASE);
    futex_wake_all(&generation_);
    for (;;) {
      const std::uint32_t left = __atomic_load_n(&remaining_, __ATOMIC_ACQUIRE);
      if (left == 0) break;
      futex_wait(&remaining_, left);
    }
  }

  NCDP_EMU_UNSANITIZED ~Pool() {
    __atomic_store_n(&stop_, true, __ATOMIC_RELAXED);
    __atomic_add_fetch(&generation_, 1, __ATOMIC_RELEASE);
    futex_wake_all(&generation_);
    for (std::thread& worker : workers_) worker.join();
  }

 private:
  void spawn(int index, std::uint32_t generation) {
    workers_.emplace_back([this, index, generation] { work(index, generation); });
  }

  NCDP_EMU_UNSANITIZED void work(int index, std::uint32_t seen) {
#if defined(__SANITIZE_THREAD__)
    void* const own = __tsan_get_current_fiber();
    // Written by this thread's TSan start-up, read by each of its fibers.
    forget_accesses(reinterpret_cast<char*>(&t_state), sizeof(t_state));
#endif
    for (;;) {
      std::uint32_t generation;
      while ((generation = __atomic_load_n(&generation_, __ATOMIC_ACQUIRE)) == seen) {
        futex_wait(&generation_, seen);
      }
      seen = generation;
      if (__atomic_load_n(&stop_, __ATOMIC_RELAXED)) return;
      if (index < active_) {
#if defined(__SANITIZE_THREAD__)
        // The identities of one worker share its stack, which is each CUDA
        // thread's private memory; forgetting the previous one's accesses
        // there keeps them from being reported as races with this one.
        char* const frame = static_cast<char*>(__builtin_frame_address(0));
        forget_accesses(frame - kFiberStackBytes, kFiberStackBytes);
        // Switched here, in a frame TSan does not instrument, so that the
        // fiber's shadow call stack starts and ends balanced.
        if (fibers_ != nullptr) __tsan_switch_to_fiber(fibers_[index], NCDP_EMU_FIBER_NO_SYNC);
        // Before the job is touched: a reused identity knows nothing of what
        // the launching thread did since its last block.
        __tsan_acquire(start_);
        (*job_)(index);
        if (fibers_ != nullptr) __tsan_switch_to_fiber(own, NCDP_EMU_FIBER_NO_SYNC);
#else
        (*job_)(index);
#endif
      }
      if (__atomic_sub_fetch(&remaining_, 1, __ATOMIC_ACQ_REL) == 0) futex_wake_all(&remaining_);
    }
  }

  std::vector<std::thread> workers_;
  const Job* job_ = nullptr;
  void* const* fibers_ = nullptr;
  char* start_ = nullptr;
  int active_ = 0;
  std::uint32_t generation_ = 0;
  std::uint32_t remaining_ = 0;
  bool stop_ = false;
};

#if defined(__SANITIZE_THREAD__)
// TSan identities of CUDA threads, kept across launches: creating fibers cost
// more than running the kernels, and destroying one while a launch runs let
// the next one created inherit its history (measured: a race between blocks
// went unreported). Reusing a fiber in a later launch adds no ordering that the
// launch boundary does not already give. Within a launch, the block at run
// position p uses set p mod (kMaxFibers / threads): distinct identities for
// that many blocks; in longer launches blocks that far apart in the run order
// are ordered and their races are missed. The cap trades coverage for time:
// creating a fiber costs milliseconds (page faults of its state), and with
// 2048 instead of 512 the tier's TSan cases ran 60 s instead of 41 s (20 s
// before fibers) on 2 loaded cores; TSan dies past 8128 threads anyway.
class Fibers {
 public:
  static constexpr int kMaxFibers = 512;

  static Fibers& instance() {
    static Fibers fibers;
    return fibers;
  }

  // The `threads` fibers of run position `position`; null for the workers'
  // own threads, which serve as the first set (most launches have one or two
  // blocks, and creating fibers is the tier's largest cost under TSan).
  void* const* set(int position, int threads) {
    const int sets = std::max(1, kMaxFibers / threads);
    if (position % sets == 0) return nullptr;
    std::vector<void*>& fibers = sets_[{threads, position % sets}];
    if (fibers.empty()) {
      // Created in a random order: TSan has 256 thread slots and a thread
      // taking over a slot inherits the history of its previous owner, so
      // which threads of a launch of more than about 200 threads share a slot
      // (and whose races are missed) varies with the seed.
      fibers.assign(static_cast<std::size_t>(threads), nullptr);
      for (const int t : random_order(threads)) {
        fibers[static_cast<std::size_t>(t)] = __tsan_create_fiber(0);
      }
    }
    return fibers.data();
  }

 private:
  std::map<std::pair<int, int>, std::vector<void*>> sets_;
};
#endif

// Runs body() as every thread of every block of the grid, one block at a time
// in a random order.
template <typename Body>
void run_grid(const dim3& grid, const dim3& block_dim, std::size_t shared_bytes,
              std::size_t shared_limit, const Body& body) {
  if (!check_launch_shape(grid, block_dim, shared_bytes, shared_limit)) return;
  // One launch at a time: the pool and the __shared__ variables serve one
  // block, and a process may launch from several host threads.
  static std::mutex launch_mutex;
  std::lock_guard<std::mutex> one_launch(launch_mutex);
  // The launch's dynamic shared memory, of exactly its size (16-byte granules):
  // an access past it is out of bounds for the sanitizers, as on the device.
  const std::size_t dynamic_bytes = (shared_bytes + 15) / 16 * 16;
  std::unique_ptr<unsigned char, decltype(&std::free)> dynamic(
      dynamic_bytes != 0 ? static_cast<unsigned char*>(std::aligned_alloc(16, dynamic_bytes))
                         : nullptr,
      &std::free);
  dynamic_shared() = DynamicShared{dynamic.get(), dynamic_bytes};
  struct Unset {
    ~Unset() { dynamic_shared() = DynamicShared{}; }
  } unset;
  const int threads = static_cast<int>(block_dim.x * block_dim.y * block_dim.z);
  const int warps = (threads + kWarpSize - 1) / kWarpSize;
  const std::uint64_t count = static_cast<std::uint64_t>(grid.x) * grid.y * grid.z;
  if (count > static_cast<std::uint64_t>(INT_MAX)) fatal("grid of %llu blocks", (unsigned long long)count);
  // The launch's end, which every thread's writes happen before; on the heap,
  // like the blocks, so that no earlier launch's sync object sits at its address.
  std::unique_ptr<char> launch_end(new char(0));
  std::vector<std::unique_ptr<Block>> blocks;
  blocks.reserve(static_cast<std::size_t>(count));
  for (std::uint64_t b = 0; b < count; ++b) {
    std::unique_ptr<Block> block(new Block());
    block->block_idx = dim3(static_cast<unsigned>(b % grid.x),
                            static_cast<unsigned>((b / grid.x) % grid.y),
                            static_cast<unsigned>(b / (static_cast<std::uint64_t>(grid.x) * grid.y)));
    block->threads = threads;
    for (int w = 0; w < warps; ++w) block->warp_barriers.emplace_back(new Barrier());
    block->warp_slots.assign(static_cast<std::size_t>(warps) * 2 * kWarpSize, 0u);
    block->states.resize(static_cast<std::size_t>(threads));
    for (int t = 0; t < threads; ++t) {
      ThreadState& state = block->states[static_cast<std::size_t>(t)];
      state.thread_idx = dim3(t % block_dim.x, (t / block_dim.x) % block_dim.y,
                              t / (block_dim.x * block_dim.y));
      state.block_idx = block->block_idx;
      state.block_dim = block_dim;
      state.grid_dim = grid;
      state.linear = t;
      state.block = block.get();
    }
    blocks.push_back(std::move(block));
  }
  int position = 0;
  for (const int b : random_order(static_cast<int>(count))) {
    Block& block = *blocks[static_cast<std::size_t>(b)];
    poison_shared_memory();
    poison_dynamic_shared();
    // Kept to the launch's end (freeing it is a write).
    char* const end = launch_end.get();
    block.job = [&block, end, &body](int t) {
      ThreadState* state = &block.states[static_cast<std::size_t>(t)];
      NCDP_EMU_HIDDEN_BEGIN();
      t_state = state;
      NCDP_EMU_HIDDEN_END();
      body();
      check_deadlock(block, block.inactive.fetch_add(1, std::memory_order_relaxed) + 1,
                     "thread exit");
      NCDP_EMU_RELEASE(end);
      NCDP_EMU_HIDDEN_BEGIN();
      t_state = nullptr;
      NCDP_EMU_HIDDEN_END();
    };
#if defined(__SANITIZE_THREAD__)
    void* const* fibers = Fibers::instance().set(position, threads);
    for (int t = 0; fibers != nullptr && t < threads; ++t) {
      char name[64];
      std::snprintf(name, sizeof(name), "block (%u, %u, %u) thread %d", block.block_idx.x,
                    block.block_idx.y, block.block_idx.z, t);
      __tsan_set_fiber_name(fibers[t], name);
    }
#else
    void* const* fibers = nullptr;
#endif
    ++position;
    // The block's start: everything this thread did so far happens before it,
    // and nothing of the blocks before it in this launch.
    NCDP_EMU_RELEASE(&block.start);
#if defined(NCDP_EMU_COOPERATIVE)
    (void)fibers;
    Coroutines::instance().run(threads, block.job, block);
#else
    Pool::instance().run(threads, block.job, fibers, &block.start);
#endif
    NCDP_EMU_HIDDEN_BEGIN();
    for (int id = 0; id < kNamedBarriers; ++id) {
      if (block.named[id].arrived != 0) {
        fatal("block (%u, %u, %u) ended with %d arrivals pending at barrier %d (expected %d)",
              block.block_idx.x, block.block_idx.y, block.block_idx.z, block.named[id].arrived,
              id, block.named[id].expected);
      }
    }
    NCDP_EMU_HIDDEN_END();
  }
  NCDP_EMU_ACQUIRE(launch_end.get());
}

template <typename... Params>
struct Launch {
  void (*kernel)(Params...);
  dim3 grid;
  dim3 block;
  std::size_t shared_bytes;

  template <typename... Args>
  void operator()(Args&&... args) const {
    static_assert(sizeof...(Args) == sizeof...(Params), "kernel argument count");
    // Converted once, as the launch would copy them into parameter space;
    // every thread then receives its own copies.
    const std::tuple<std::decay_t<Params>...> params(std::forward<Args>(args)...);
    run_grid(grid, block, shared_bytes,
             dynamic_shared_limit(reinterpret_cast<const void*>(kernel)),
             [&] { std::apply(kernel, params); });
  }
};

template <typename... Params>
Launch<Params...> make_launch(void (*kernel)(Params...), dim3 grid, dim3 block,
                              std::size_t shared_bytes, cudaStream_t /*stream*/) {
  return Launch<Params...>{kernel, grid, block, shared_bytes};
}

}  // namespace ncdp_emu

// ---------------------------------------------------------------------------
// The CUDA names the kernels use.

#define threadIdx (::ncdp_emu::t_state->thread_idx)
#define blockIdx (::ncdp_emu::t_state->block_idx)
#define blockDim (::ncdp_emu::t_state->block_dim)
#define gridDim (::ncdp_emu::t_state->grid_dim)

inline void __syncthreads() { ::ncdp_emu::syncthreads(); }
// Ordering inside a block comes from the barriers that follow a fence in these
// kernels (they order memory in the emulator), so the fence only has to stop
// the compiler from moving accesses across it.
inline void __threadfence_block() { std::atomic_signal_fence(std::memory_order_seq_cst); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline unsigned int atomicAdd(unsigned int* address, unsigned int value) {
  return __atomic_fetch_add(address, value, __ATOMIC_ACQ_REL);
}
inline unsigned long long atomicAdd(unsigned long long* address, unsigned long long value) {
  return __atomic_fetch_add(address, value, __ATOMIC_ACQ_REL);
}
// An L2 load on the device (past the SM's L1, which is not coherent across SMs).
template <typename T>
T __ldcg(const T* address) {
  return *address;
}
inline void __nanosleep(unsigned int) {}
[[noreturn]] inline void __trap() { ::ncdp_emu::fatal("a kernel trapped (__trap)"); }

template <typename T>
T __shfl_sync(unsigned mask, T value, int src_lane, int width = 32) {
  return ::ncdp_emu::shfl_sync(mask, value, src_lane, width);
}
template <typename T>
T __shfl_down_sync(unsigned mask, T value, unsigned delta, int width = 32) {
  return ::ncdp_emu::shfl_down_sync(mask, value, delta, width);
}
template <typename T>
T __shfl_up_sync(unsigned mask, T value, unsigned delta, int width = 32) {
  return ::ncdp_emu::shfl_up_sync(mask, value, delta, width);
}
template <typename T>
T __shfl_xor_sync(unsigned mask, T value, int lane_mask, int width = 32) {
  return ::ncdp_emu::shfl_xor_sync(mask, value, lane_mask, width);
}
inline unsigned __ballot_sync(unsigned mask, int predicate) {
  return ::ncdp_emu::ballot_sync(mask, predicate);
}

// ---- Arithmetic intrinsics: host versions of the device intrinsics the
// kernels call.
inline int __ffs(int x) { return __builtin_ffs(x); }
// The high word of a 32 x 32-bit product (Philox's rounds, common/philox.cuh).
inline unsigned int __umulhi(unsigned int a, unsigned int b) {
  return static_cast<unsigned int>((static_cast<unsigned long long>(a) * b) >> 32);
}

// common/launch.cuh's hooks.
#define NCDP_LAUNCH(grid, block, shared_bytes, stream, ...) \
  ::ncdp_emu::make_launch(&__VA_ARGS__, (grid), (block), (shared_bytes), (stream))
// The blocks of a launch run one after another here, so a block never waits
// on a flag another block has yet to set (clip/dense_one_pass.cu hands its
// work out in ticket order for that reason); the flags and counters are still
// atomics, so that the sanitizers see the hand-over within a block.
#define NCDP_LOAD_ACQUIRE_GPU(ptr) __atomic_load_n((ptr), __ATOMIC_ACQUIRE)
#define NCDP_STORE_RELEASE_GPU(ptr, value) __atomic_store_n((ptr), (value), __ATOMIC_RELEASE)
// The launch's dynamic shared memory as an array of `type` (common/launch.cuh).
#define NCDP_DYNAMIC_SHARED(type, name) \
  type* const name = reinterpret_cast<type*>(::ncdp_emu::dynamic_shared().base)
#define NCDP_CP_ASYNC16(shared_destination, global_source) \
  ::ncdp_emu::cp_async16((shared_destination), (global_source))
#define NCDP_CP_ASYNC_COMMIT() ::ncdp_emu::cp_async_commit()
#define NCDP_CP_ASYNC_WAIT(pending) ::ncdp_emu::cp_async_wait(pending)
#define NCDP_NAMED_BARRIER_SYNC(id, threads) ::ncdp_emu::named_barrier((id), (threads), true)
#define NCDP_NAMED_BARRIER_ARRIVE(id, threads) ::ncdp_emu::named_barrier((id), (threads), false)
