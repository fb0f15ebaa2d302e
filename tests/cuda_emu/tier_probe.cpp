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
#include <cstdio>
#include <cstring>

#include "common/block_reduce.cuh"
#include "common/launch.cuh"

namespace {

constexpr int kThreads = 256;

__global__ void two_block_sums(const double* values,  // [2, kThreads]
                               double* sums) {        // [2]
  __shared__ double scratch[kThreads / 32];
  for (int call = 0; call < 2; ++call) {
    const double total = ncdp::block_sum<kThreads>(values[call * kThreads + threadIdx.x], scratch);
    if (threadIdx.x == 0) sums[call] = total;
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

}  // namespace

int main(int argc, char** argv) {
  const char* mode = argc > 1 ? argv[1] : "";
  if (std::strcmp(mode, "block_sum") == 0) {
    static double values[2 * kThreads];
    double sums[2] = {0.0, 0.0};
    double expected[2] = {0.0, 0.0};
    for (int i = 0; i < 2 * kThreads; ++i) {
      values[i] = (i % 7) - 3 + 0.5 * (i / kThreads);  // small integers: exact sums
      expected[i / kThreads] += values[i];
    }
    for (int repeat = 0; repeat < 4; ++repeat) {
      NCDP_LAUNCH(2, kThreads, 0, nullptr, two_block_sums)(values, sums);
      if (sums[0] != expected[0] || sums[1] != expected[1]) {
        std::fprintf(stderr, "block_sum: got %g %g, expected %g %g\n", sums[0], sums[1],
                     expected[0], expected[1]);
        return 1;
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
  std::fprintf(stderr, "usage: %s block_sum|divergent|mismatched|launch\n", argv[0]);
  return 2;
}
