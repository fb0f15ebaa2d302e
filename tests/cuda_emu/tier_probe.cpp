// Kernels that test the emulation tier itself (tests/test_cuda_emulation.py):
//
//   tier-probe block_sum   two back-to-back block_sum calls of
//                          common/block_reduce.cuh; exits 0 when both sums are
//                          exact. Built once against csrc/ and once against a
//                          copy whose first __syncthreads is removed: then
//                          ThreadSanitizer must report the race on the scratch.
//   tier-probe divergent   a __syncthreads one thread skips: must abort as a deadlock.
//   tier-probe mismatched  one named barrier phase reached with two thread
//                          counts: must abort.
//   tier-probe launch      a block of 2048 threads: must abort as an invalid launch.
//
// Three planted bugs the tier must report, each with its correct variant,
// which must run cleanly (exit 0) under both sanitizers:
//   blocks_racy / blocks_exact        every block adds its sum into one global
//                          total without atomics (a race between blocks, which
//                          ThreadSanitizer must report) / writes its own partial.
//   handoff_shuffle / handoff_barrier lane 0 stores to shared memory, lane 1
//                          loads after only a __shfl_sync (a race: a shuffle
//                          orders no memory) / after a __syncthreads.
//   shared_unwritten / shared_written one block leaves a shared slot unwritten
//                          and reads it; exits 1 when the sum is not exact (the
//                          poison must reach it) / every block writes every slot.
//
// Dynamic shared memory and cp.async (common/launch.cuh), each planted bug with
// its correct variant:
//   dynamic_unwritten / dynamic_written  as shared_*, in 64 KiB of dynamic
//                          shared memory (the kernel's limit raised first).
//   dynamic_limit          the same launch without raising the limit: must abort
//                          as an invalid launch.
//   async_unwaited / async_waited  each thread copies 16 bytes with cp.async and
//                          reads its neighbour's after a __syncthreads, without /
//                          with the wait: exits 1 when the data is not exact.
//   async_early / async_pipeline   a three-stage pipeline over 8 tiles that
//                          waits for one group too few / the right count.
//   async_no_barrier       the wait but no __syncthreads before reading another
//                          thread's copy: ThreadSanitizer must report the race.
//   async_misaligned, async_global  a source 8 bytes off alignment, a
//                          destination in global memory: must abort.
//
//   tier-probe leak        64 bytes allocated and lost: LeakSanitizer must
//                          report them (at exit, or served at the case's end).
//
//   tier-probe --serve     modes on stdin, one per line, in one process
//                          (serve.h): the tier's own check that a race is still
//                          reported after clean cases in a long-lived process.
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "common/block_reduce.cuh"
#include "common/launch.cuh"
#include "serve.h"

namespace {

constexpr int kThreads = 256;

__global__ void two_block_sums(const double* values,  // [2, kThreads]
                               double* sums) {        // [blocks, 2]
  __shared__ double scratch[kThreads / 32];
  for (int call = 0; call < 2; ++call) {
    const double total = ncdp::block_sum<kThreads>(values[call * kThreads + threadIdx.x], scratch);
    // One slot per block: the blocks of a launch are concurrent.
    if (threadIdx.x == 0) sums[blockIdx.x * 2 + call] = total;
  }
}

__global__ void divergent_barrier(int* flags) {  // [kThreads]
  if (threadIdx.x != 5) __syncthreads();
  flags[threadIdx.x] = 1;
}

__global__ void mismatched_named_barrier() {
  // Warp 0 alone cannot complete a phase of 64, so whichever side arrives
  // first, the other arrives in the same phase with another count.
  NCDP_NAMED_BARRIER_SYNC(1, threadIdx.x < 32 ? 64 : kThreads);
}

__global__ void no_op() {}

constexpr int kSmall = 64;
constexpr int kSmallBlocks = 3;

__global__ void block_totals(const double* values,  // [kSmallBlocks, kSmall]
                             double* totals,        // [kSmallBlocks]
                             int racy) {
  __shared__ double scratch[kSmall / 32];
  const double total =
      ncdp::block_sum<kSmall>(values[blockIdx.x * kSmall + threadIdx.x], scratch);
  if (threadIdx.x == 0) {
    if (racy) {
      totals[0] += total;
    } else {
      totals[blockIdx.x] = total;
    }
  }
}

__global__ void shuffle_handoff(double* out,  // [1]; one warp
                                int barrier) {
  __shared__ double slot;
  if (threadIdx.x == 0) slot = 42.0;
  // Every lane takes lane 0's value: the lanes meet, but no memory is ordered.
  const int zero = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x), 0);
  if (barrier) __syncthreads();
  if (threadIdx.x == 1) out[0] = slot + zero;
}

__global__ void partly_written_shared(double* sums,  // [kSmallBlocks]
                                      int complete) {
  __shared__ double slots[kSmall];
  // Block 1 forgets slot 0: a block that keeps the previous block's shared
  // memory (or zeros) can still produce the right sum.
  if (complete || blockIdx.x != 1 || threadIdx.x != 0) slots[threadIdx.x] = threadIdx.x + 1.0;
  __syncthreads();
  if (threadIdx.x == 0) {
    double sum = 0.0;
    for (int i = 0; i < kSmall; ++i) sum += slots[i];
    sums[blockIdx.x] = sum;
  }
}

// 64 KiB of dynamic shared memory: past the default 48 KiB.
constexpr int kDynamicBytes = 64 * 1024;
constexpr int kDynamicSlots = kDynamicBytes / static_cast<int>(sizeof(double));

__global__ void partly_written_dynamic(double* sums,  // [kSmallBlocks]
                                       int complete) {
  NCDP_DYNAMIC_SHARED(double, slots);  // [kDynamicSlots]
  for (int i = threadIdx.x; i < kDynamicSlots; i += kSmall) {
    // Block 1 forgets the last slot.
    if (complete || blockIdx.x != 1 || i != kDynamicSlots - 1) slots[i] = 1.0;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    double sum = 0.0;
    for (int i = 0; i < kDynamicSlots; ++i) sum += slots[i];
    sums[blockIdx.x] = sum;
  }
}

constexpr int kCopyThreads = 64;
constexpr int kCopyFloats = 4 * kCopyThreads;  // a tile: 16 bytes a thread

enum CopyMode { kWaited = 0, kUnwaited = 1, kNoBarrier = 2, kMisaligned = 3, kGlobal = 4 };

// Thread t copies its 16 bytes of the block's tile into dynamic shared memory,
// then writes thread t + 1's (a neighbour's copy: the barrier must order it).
__global__ void neighbour_copy(const float* source,  // [blocks, kCopyFloats] (+ 2 spare)
                               float* out,           // [blocks, kCopyFloats]
                               int mode) {
  NCDP_DYNAMIC_SHARED(float, tile);  // [kCopyFloats]
  const int t = static_cast<int>(threadIdx.x);
  const float* from = source + (blockIdx.x * kCopyFloats + 4 * t) + (mode == kMisaligned ? 2 : 0);
  float* to = mode == kGlobal ? out + blockIdx.x * kCopyFloats + 4 * t : tile + 4 * t;
  NCDP_CP_ASYNC16(to, from);
  NCDP_CP_ASYNC_COMMIT();
  if (mode != kUnwaited) NCDP_CP_ASYNC_WAIT(0);
  if (mode != kNoBarrier) __syncthreads();
  const int u = (t + 1) % kCopyThreads;
  for (int q = 0; q < 4; ++q) out[blockIdx.x * kCopyFloats + 4 * t + q] = tile[4 * u + q];
}

constexpr int kStages = 3;
constexpr int kTiles = 8;

// sums[b * kCopyFloats + j] = sum over the kTiles tiles of value j (read by
// thread j / 4 + 1's lane), tile i + 2 copied while tile i is read: at step i
// groups i, i + 1 and i + 2 are committed, so waiting until 2 are pending
// completes tile i; `early` waits until 3 are (none completes).
__global__ void pipelined_sums(const float* source,  // [blocks, kTiles, kCopyFloats]
                               float* sums,          // [blocks, kCopyFloats]
                               int early) {
  NCDP_DYNAMIC_SHARED(float, stages);  // [kStages, kCopyFloats]
  const int t = static_cast<int>(threadIdx.x);
  const float* tiles = source + static_cast<std::size_t>(blockIdx.x) * kTiles * kCopyFloats;
  for (int i = 0; i < kStages - 1; ++i) {
    NCDP_CP_ASYNC16(stages + i * kCopyFloats + 4 * t, tiles + i * kCopyFloats + 4 * t);
    NCDP_CP_ASYNC_COMMIT();
  }
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  const int u = (t + 1) % kCopyThreads;
  for (int i = 0; i < kTiles; ++i) {
    const int ahead = i + kStages - 1;
    if (ahead < kTiles) {
      NCDP_CP_ASYNC16(stages + (ahead % kStages) * kCopyFloats + 4 * t,
                      tiles + ahead * kCopyFloats + 4 * t);
    }
    NCDP_CP_ASYNC_COMMIT();  // an empty group past the last tile keeps the count
    if (early) {
      NCDP_CP_ASYNC_WAIT(kStages);
    } else {
      NCDP_CP_ASYNC_WAIT(kStages - 1);
    }
    __syncthreads();
    for (int q = 0; q < 4; ++q) acc[q] += stages[(i % kStages) * kCopyFloats + 4 * u + q];
    __syncthreads();  // stage i % kStages is refilled at step i + 1
  }
  for (int q = 0; q < 4; ++q) sums[blockIdx.x * kCopyFloats + 4 * t + q] = acc[q];
}

// 0 when every block's sum is `expected`; else says which block read
// unwritten shared memory and returns 1.
int check_block_sums(const char* mode, const double* sums, double expected) {
  for (int b = 0; b < kSmallBlocks; ++b) {
    if (sums[b] != expected) {
      std::fprintf(stderr, "%s: block %d read unwritten shared memory: sum %g, expected %g\n",
                   mode, b, sums[b], expected);
      return 1;
    }
  }
  return 0;
}

// Not inlined, so that no live frame still holds the pointer when it returns.
__attribute__((noinline)) void lose_memory() {
  char* volatile block = static_cast<char*>(std::malloc(64));
  block[0] = 1;
}

}  // namespace

// One mode: 0 when it ran as expected.
int run_mode(const char* mode) {
  if (std::strcmp(mode, "leak") == 0) {
    lose_memory();
    return 0;
  }
  if (std::strcmp(mode, "block_sum") == 0) {
    static double values[2 * kThreads];
    double sums[4] = {0.0, 0.0, 0.0, 0.0};
    double expected[2] = {0.0, 0.0};
    for (int i = 0; i < 2 * kThreads; ++i) {
      values[i] = (i % 7) - 3 + 0.5 * (i / kThreads);  // small integers: exact sums
      expected[i / kThreads] += values[i];
    }
    for (int repeat = 0; repeat < 4; ++repeat) {
      NCDP_LAUNCH(2, kThreads, 0, nullptr, two_block_sums)(values, sums);
      for (int b = 0; b < 2; ++b) {
        if (sums[2 * b] != expected[0] || sums[2 * b + 1] != expected[1]) {
          std::fprintf(stderr, "block_sum: block %d got %g %g, expected %g %g\n", b,
                       sums[2 * b], sums[2 * b + 1], expected[0], expected[1]);
          return 1;
        }
      }
    }
    return 0;
  }
  if (std::strcmp(mode, "divergent") == 0) {
    static int flags[kThreads];
    NCDP_LAUNCH(1, kThreads, 0, nullptr, divergent_barrier)(flags);
    return 0;
  }
  if (std::strcmp(mode, "mismatched") == 0) {
    NCDP_LAUNCH(1, kThreads, 0, nullptr, mismatched_named_barrier)();
    return 0;
  }
  if (std::strcmp(mode, "launch") == 0) {
    NCDP_LAUNCH(1, 2048, 0, nullptr, no_op)();
    return 0;
  }
  if (std::strcmp(mode, "blocks_racy") == 0 || std::strcmp(mode, "blocks_exact") == 0) {
    const int racy = std::strcmp(mode, "blocks_racy") == 0;
    static double values[kSmallBlocks * kSmall];
    double totals[kSmallBlocks] = {};
    double expected[kSmallBlocks] = {};
    for (int i = 0; i < kSmallBlocks * kSmall; ++i) {
      values[i] = (i % 5) - 2;  // small integers: exact sums in any order
      expected[racy ? 0 : i / kSmall] += values[i];
    }
    NCDP_LAUNCH(kSmallBlocks, kSmall, 0, nullptr, block_totals)(values, totals, racy);
    for (int b = 0; b < kSmallBlocks; ++b) {
      if (totals[b] != expected[b]) {
        std::fprintf(stderr, "%s: total %d is %g, expected %g\n", mode, b, totals[b], expected[b]);
        return 1;
      }
    }
    return 0;
  }
  if (std::strcmp(mode, "handoff_shuffle") == 0 || std::strcmp(mode, "handoff_barrier") == 0) {
    double out[1] = {0.0};
    NCDP_LAUNCH(1, 32, 0, nullptr, shuffle_handoff)(out, std::strcmp(mode, "handoff_barrier") == 0);
    if (out[0] != 42.0) {
      std::fprintf(stderr, "%s: got %g, expected 42\n", mode, out[0]);
      return 1;
    }
    return 0;
  }
  if (std::strcmp(mode, "shared_unwritten") == 0 || std::strcmp(mode, "shared_written") == 0) {
    double sums[kSmallBlocks] = {};
    NCDP_LAUNCH(kSmallBlocks, kSmall, 0, nullptr, partly_written_shared)(
        sums, std::strcmp(mode, "shared_written") == 0);
    return check_block_sums(mode, sums, kSmall * (kSmall + 1) / 2.0);
  }
  if (std::strcmp(mode, "dynamic_unwritten") == 0 || std::strcmp(mode, "dynamic_written") == 0 ||
      std::strcmp(mode, "dynamic_limit") == 0) {
    if (std::strcmp(mode, "dynamic_limit") != 0 &&
        cudaFuncSetAttribute(partly_written_dynamic, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             kDynamicBytes) != cudaSuccess) {
      std::fprintf(stderr, "%s: cudaFuncSetAttribute failed\n", mode);
      return 2;
    }
    double sums[kSmallBlocks] = {};
    NCDP_LAUNCH(kSmallBlocks, kSmall, kDynamicBytes, nullptr, partly_written_dynamic)(
        sums, std::strcmp(mode, "dynamic_unwritten") != 0);
    return check_block_sums(mode, sums, kDynamicSlots);
  }
  const struct {
    const char* name;
    int mode;
  } copies[] = {{"async_waited", kWaited},         {"async_unwaited", kUnwaited},
                {"async_no_barrier", kNoBarrier},  {"async_misaligned", kMisaligned},
                {"async_global", kGlobal}};
  for (const auto& copy : copies) {
    if (std::strcmp(mode, copy.name) != 0) continue;
    alignas(16) static float source[kSmallBlocks * kCopyFloats + 4];
    alignas(16) static float out[kSmallBlocks * kCopyFloats];
    for (int i = 0; i < kSmallBlocks * kCopyFloats + 4; ++i) source[i] = static_cast<float>(i);
    NCDP_LAUNCH(kSmallBlocks, kCopyThreads, kCopyFloats * sizeof(float), nullptr,
                neighbour_copy)(source, out, copy.mode);
    for (int b = 0; b < kSmallBlocks; ++b) {
      for (int j = 0; j < kCopyFloats; ++j) {
        const int from = b * kCopyFloats + (j + 4) % kCopyFloats;
        if (out[b * kCopyFloats + j] != source[from]) {
          std::fprintf(stderr, "%s: block %d value %d is %g, expected %g\n", mode, b, j,
                       out[b * kCopyFloats + j], source[from]);
          return 1;
        }
      }
    }
    return 0;
  }
  if (std::strcmp(mode, "async_pipeline") == 0 || std::strcmp(mode, "async_early") == 0) {
    alignas(16) static float source[kSmallBlocks * kTiles * kCopyFloats];
    alignas(16) static float sums[kSmallBlocks * kCopyFloats];
    for (int i = 0; i < kSmallBlocks * kTiles * kCopyFloats; ++i) {
      source[i] = static_cast<float>(i % 97);  // small integers: exact sums
    }
    NCDP_LAUNCH(kSmallBlocks, kCopyThreads, kStages * kCopyFloats * sizeof(float), nullptr,
                pipelined_sums)(source, sums, std::strcmp(mode, "async_early") == 0);
    for (int b = 0; b < kSmallBlocks; ++b) {
      for (int j = 0; j < kCopyFloats; ++j) {
        float expected = 0.0f;
        for (int i = 0; i < kTiles; ++i) {
          expected += source[(b * kTiles + i) * kCopyFloats + (j + 4) % kCopyFloats];
        }
        if (sums[b * kCopyFloats + j] != expected) {
          std::fprintf(stderr, "%s: block %d sum %d is %g, expected %g\n", mode, b, j,
                       sums[b * kCopyFloats + j], expected);
          return 1;
        }
      }
    }
    return 0;
  }
  std::fprintf(stderr,
               "usage: %s block_sum|divergent|mismatched|launch|blocks_racy|blocks_exact|"
               "handoff_shuffle|handoff_barrier|shared_unwritten|shared_written|"
               "dynamic_unwritten|dynamic_written|dynamic_limit|async_waited|async_unwaited|"
               "async_no_barrier|async_misaligned|async_global|async_pipeline|async_early|leak"
               " | --serve (modes on stdin)\n",
               "tier-probe");
  return 2;
}

int main(int argc, char** argv) {
  const char* mode = argc > 1 ? argv[1] : "";
  if (std::strcmp(mode, "--serve") == 0) {
    return ncdp_emu::serve([](const std::string& line) { return run_mode(line.c_str()); });
  }
  return run_mode(mode);
}
