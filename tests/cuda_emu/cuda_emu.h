// CPU emulation of the CUDA features the kernels of csrc/ use, so that their
// own source runs in CI on a machine without a GPU (docs/architecture.md,
// "Testing the CUDA code without a GPU"). Force-included (-include) before
// every .cu compiled with the host compiler.
//
// Model: one OS thread per CUDA thread; the blocks of a launch run one after
// another, the threads of a block all at once, so __shared__ variables (made
// function statics) are block-local storage. __syncthreads, warp shuffles and
// ballots, and counted named barriers are real barriers: a thread waits until
// its phase completes. They abort on what the hardware would leave undefined
// or hang on: a barrier phase reached with different thread counts, every live
// thread of a block waiting (deadlock, e.g. a barrier some threads skip),
// threads exiting with barrier phases left open, a partial warp in a warp
// intrinsic, an invalid launch shape, and, as a last resort, a watchdog.
//
// Under ThreadSanitizer the barriers' own mutexes are hidden from the race
// detector and replaced by exact happens-before annotations: a thread's writes
// before a barrier are ordered before every waiter's code after it, and
// nothing else (bar.arrive releases without acquiring), so a missing
// __syncthreads shows up as a data race instead of being masked by the
// emulator's locks.
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
#include <mutex>
#include <thread>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

// ---------------------------------------------------------------------------
// Keywords and built-in types.

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __grid_constant__
// Blocks run one at a time, so one instance per kernel instantiation is
// block-local storage shared by exactly the threads of the running block.
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
struct CUstream_st;
using cudaStream_t = CUstream_st*;

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
void __tsan_acquire(void* addr);
void __tsan_release(void* addr);
}
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

namespace ncdp_emu {

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;
// Barrier ids 0..15 as on the hardware; 0 is __syncthreads'.
constexpr int kNamedBarriers = 16;

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

struct Block {
  dim3 block_idx;
  int threads = 0;
  Barrier named[kNamedBarriers];
  std::vector<std::unique_ptr<Barrier>> warp_barriers;
  std::vector<std::uint64_t> warp_slots;  // [warps, 2, 32]: double-buffered
  // Threads waiting at a barrier plus threads that have returned; relaxed
  // atomics only, so the race detector sees no synchronization through them.
  std::atomic<int> inactive{0};
  std::atomic<int> blocked{0};
};

struct ThreadState {
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

inline thread_local ThreadState t_state;

inline void check_deadlock(Block& block, int inactive, const char* where) {
  if (inactive == block.threads && block.blocked.load(std::memory_order_relaxed) > 0) {
    fatal("deadlock in block (%u, %u, %u) at %s: every live thread waits at a barrier that "
          "cannot complete (a barrier not reached by all of its threads?)",
          block.block_idx.x, block.block_idx.y, block.block_idx.z, where);
  }
}

// Counts this thread at barrier `b` for a phase of `expected` threads; with
// `wait`, returns once the phase is complete.
inline void barrier_arrive(Barrier& b, int expected, bool wait, const char* what, int id) {
  Block& block = *t_state.block;
  if (expected <= 0 || expected > block.threads) {
    fatal("%s %d: thread count %d outside 1..%d (the block's size)", what, id, expected,
          block.threads);
  }
  NCDP_EMU_HIDDEN_BEGIN();
  std::unique_lock<std::mutex> lock(b.mutex);
  const std::uint64_t generation = b.generation;
  // This thread's writes so far are ordered before the waiters of this phase.
  NCDP_EMU_HIDDEN_END();
  NCDP_EMU_RELEASE(&b.tokens[generation & 3]);
  NCDP_EMU_HIDDEN_BEGIN();
  if (b.arrived == 0) {
    b.expected = expected;
  } else if (b.expected != expected) {
    fatal("%s %d in block (%u, %u, %u): thread %d arrives expecting %d threads, but this phase "
          "expects %d",
          what, id, block.block_idx.x, block.block_idx.y, block.block_idx.z, t_state.linear,
          expected, b.expected);
  }
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
          fatal("watchdog: thread %d waited %.0f s at %s %d", t_state.linear, waited.count(),
                what, id);
        }
      }
    }
  }
  lock.unlock();
  NCDP_EMU_HIDDEN_END();
  if (wait) NCDP_EMU_ACQUIRE(&b.tokens[generation & 3]);
}

inline void syncthreads() {
  barrier_arrive(t_state.block->named[0], t_state.block->threads, true, "__syncthreads", 0);
}

inline void named_barrier(int id, int threads, bool wait) {
  if (id <= 0 || id >= kNamedBarriers) fatal("named barrier id %d outside 1..15", id);
  if (threads % kWarpSize != 0) fatal("named barrier %d: %d threads, not whole warps", id, threads);
  barrier_arrive(t_state.block->named[id], threads, wait, wait ? "bar.sync" : "bar.arrive", id);
}

// ---- Warp intrinsics: every lane writes its value to the warp's slots, the
// warp meets, each lane reads. Exchanges alternate between two slot buffers, so
// one meeting per exchange suffices: a lane can only write a buffer again two
// exchanges later, after a meeting that every lane reached after reading it.
inline int lane_id() { return t_state.linear % kWarpSize; }

inline std::uint64_t* next_warp_slots() {
  const std::size_t warp = static_cast<std::size_t>(t_state.linear / kWarpSize);
  const std::size_t buffer = static_cast<std::size_t>(t_state.exchanges++ & 1u);
  return &t_state.block->warp_slots[(warp * 2 + buffer) * kWarpSize];
}

inline void warp_barrier(unsigned mask, const char* what) {
  Block& block = *t_state.block;
  if (mask != kFullMask) fatal("%s with mask 0x%08x: only full-warp masks are emulated", what, mask);
  const int warp = t_state.linear / kWarpSize;
  if ((warp + 1) * kWarpSize > block.threads) {
    fatal("%s in a partial warp (block of %d threads)", what, block.threads);
  }
  barrier_arrive(*block.warp_barriers[static_cast<std::size_t>(warp)], kWarpSize, true, what,
                 warp);
}

template <typename T>
T exchange(unsigned mask, T value, int source, const char* what) {
  static_assert(sizeof(T) <= sizeof(std::uint64_t) && std::is_trivially_copyable<T>::value,
                "shuffled values are at most 8 bytes");
  std::uint64_t* slots = next_warp_slots();
  std::uint64_t mine = 0;
  std::memcpy(&mine, &value, sizeof(T));
  slots[lane_id()] = mine;
  warp_barrier(mask, what);
  T out;
  std::memcpy(&out, &slots[source], sizeof(T));
  return out;
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
  std::uint64_t* slots = next_warp_slots();
  slots[lane_id()] = predicate != 0 ? 1u : 0u;
  warp_barrier(mask, "__ballot_sync");
  unsigned bits = 0;
  for (int lane = 0; lane < kWarpSize; ++lane) bits |= static_cast<unsigned>(slots[lane]) << lane;
  return bits;
}

// ---- Launches.

inline void check_launch_shape(const dim3& grid, const dim3& block, std::size_t shared_bytes) {
  const std::uint64_t threads = static_cast<std::uint64_t>(block.x) * block.y * block.z;
  const bool ok = grid.x >= 1 && grid.y >= 1 && grid.z >= 1 && grid.x <= 2147483647u &&
                  grid.y <= 65535u && grid.z <= 65535u && block.x >= 1 && block.y >= 1 &&
                  block.z >= 1 && block.x <= 1024u && block.y <= 1024u && block.z <= 64u &&
                  threads <= 1024u && shared_bytes <= 48u * 1024u;
  if (!ok) {
    fatal("invalid launch: grid (%u, %u, %u), block (%u, %u, %u), %zu bytes of dynamic shared "
          "memory",
          grid.x, grid.y, grid.z, block.x, block.y, block.z, shared_bytes);
  }
}

// Worker threads kept across blocks and launches (creating 256 threads per
// block dominated the run time under ThreadSanitizer). Worker t runs thread t
// of each block in turn; the pool's mutex orders one block after the other.
class Pool {
 public:
  static Pool& instance() {
    static Pool pool;
    return pool;
  }

  // Runs job(t) on workers 0 .. threads-1 and returns when all have finished.
  void run(int threads, const std::function<void(int)>& job) {
    std::unique_lock<std::mutex> lock(mutex_);
    while (static_cast<int>(workers_.size()) < threads) {
      const int index = static_cast<int>(workers_.size());
      workers_.emplace_back([this, index] { work(index); });
    }
    job_ = &job;
    active_ = threads;
    remaining_ = threads;
    ++generation_;
    start_.notify_all();
    done_.wait(lock, [this] { return remaining_ == 0; });
    job_ = nullptr;
  }

  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    start_.notify_all();
    for (std::thread& worker : workers_) worker.join();
  }

 private:
  void work(int index) {
    std::uint64_t seen = 0;
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      start_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      if (index >= active_) continue;
      const std::function<void(int)>* job = job_;
      lock.unlock();
      (*job)(index);
      lock.lock();
      if (--remaining_ == 0) done_.notify_one();
    }
  }

  std::mutex mutex_;
  std::condition_variable start_;
  std::condition_variable done_;
  std::vector<std::thread> workers_;
  const std::function<void(int)>* job_ = nullptr;
  std::uint64_t generation_ = 0;
  int active_ = 0;
  int remaining_ = 0;
  bool stop_ = false;
};

// Runs body() as every thread of every block of the grid, one block at a time.
template <typename Body>
void run_grid(const dim3& grid, const dim3& block_dim, std::size_t shared_bytes,
              const Body& body) {
  check_launch_shape(grid, block_dim, shared_bytes);
  const int threads = static_cast<int>(block_dim.x * block_dim.y * block_dim.z);
  const int warps = (threads + kWarpSize - 1) / kWarpSize;
  for (unsigned int bz = 0; bz < grid.z; ++bz) {
    for (unsigned int by = 0; by < grid.y; ++by) {
      for (unsigned int bx = 0; bx < grid.x; ++bx) {
        Block block;
        block.block_idx = dim3(bx, by, bz);
        block.threads = threads;
        for (int w = 0; w < warps; ++w) block.warp_barriers.emplace_back(new Barrier());
        block.warp_slots.assign(static_cast<std::size_t>(warps) * 2 * kWarpSize, 0u);
        const std::function<void(int)> job = [&](int t) {
          t_state.thread_idx = dim3(t % block_dim.x, (t / block_dim.x) % block_dim.y,
                                    t / (block_dim.x * block_dim.y));
          t_state.block_idx = block.block_idx;
          t_state.block_dim = block_dim;
          t_state.grid_dim = grid;
          t_state.linear = t;
          t_state.exchanges = 0;
          t_state.block = &block;
          body();
          check_deadlock(block, block.inactive.fetch_add(1, std::memory_order_relaxed) + 1,
                         "thread exit");
          t_state.block = nullptr;
        };
        Pool::instance().run(threads, job);
        for (int id = 0; id < kNamedBarriers; ++id) {
          if (block.named[id].arrived != 0) {
            fatal("block (%u, %u, %u) ended with %d arrivals pending at barrier %d (expected %d)",
                  bx, by, bz, block.named[id].arrived, id, block.named[id].expected);
          }
        }
      }
    }
  }
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
    run_grid(grid, block, shared_bytes, [&] { std::apply(kernel, params); });
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

#define threadIdx (::ncdp_emu::t_state.thread_idx)
#define blockIdx (::ncdp_emu::t_state.block_idx)
#define blockDim (::ncdp_emu::t_state.block_dim)
#define gridDim (::ncdp_emu::t_state.grid_dim)

inline void __syncthreads() { ::ncdp_emu::syncthreads(); }
// Ordering inside a block comes from the barriers that follow a fence in these
// kernels (they order memory in the emulator), so the fence only has to stop
// the compiler from moving accesses across it.
inline void __threadfence_block() { std::atomic_signal_fence(std::memory_order_seq_cst); }

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
inline int __ffs(int x) { return __builtin_ffs(x); }

// common/launch.cuh's hooks.
#define NCDP_LAUNCH(grid, block, shared_bytes, stream, ...) \
  ::ncdp_emu::make_launch(&__VA_ARGS__, (grid), (block), (shared_bytes), (stream))
#define NCDP_NAMED_BARRIER_SYNC(id, threads) ::ncdp_emu::named_barrier((id), (threads), true)
#define NCDP_NAMED_BARRIER_ARRIVE(id, threads) ::ncdp_emu::named_barrier((id), (threads), false)
