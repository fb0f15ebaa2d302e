// Deterministic block-wide sums: a fixed shuffle tree inside each warp, then
// warp 0 adds the warp totals in warp order, so the result depends only on the
// block size and the inputs, never on scheduling (no atomics).
#pragma once

namespace ncdp {

template <typename T>
__device__ __forceinline__ T warp_sum(T value) {
#pragma unroll
  for (int delta = 16; delta > 0; delta >>= 1) {
    value += __shfl_down_sync(0xffffffffu, value, delta);
  }
  return value;
}

// Sum of `value` over the kThreads threads of the block; the result is valid in
// thread 0 only. Every thread must call it (it synchronizes the block).
// `scratch` is shared memory of kThreads / 32 elements; it may be reused by the
// next call straight away.
template <int kThreads, typename T>
__device__ __forceinline__ T block_sum(T value, T* scratch) {
  static_assert(kThreads % 32 == 0 && kThreads <= 1024, "whole warps, at most 32 of them");
  constexpr int kWarps = kThreads / 32;
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  value = warp_sum(value);
  // Warp 0 may still be reading the previous call's totals.
  __syncthreads();
  if (lane == 0) scratch[warp] = value;
  __syncthreads();
  if (warp == 0) {
    value = lane < kWarps ? scratch[lane] : T(0);
    value = warp_sum(value);
  }
  return value;
}

// block_sum of N values at once, each by the same tree (so each equals its
// own block_sum), with two barriers in all instead of two a value. The
// results are valid in thread 0 only; `scratch` holds kThreads / 32 * N
// elements.
template <int kThreads, int N, typename T>
__device__ __forceinline__ void block_sums(T (&values)[N], T* scratch) {
  static_assert(kThreads % 32 == 0 && kThreads <= 1024, "whole warps, at most 32 of them");
  constexpr int kWarps = kThreads / 32;
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
#pragma unroll
  for (int k = 0; k < N; ++k) values[k] = warp_sum(values[k]);
  __syncthreads();
  if (lane == 0) {
#pragma unroll
    for (int k = 0; k < N; ++k) scratch[warp * N + k] = values[k];
  }
  __syncthreads();
  if (warp == 0) {
#pragma unroll
    for (int k = 0; k < N; ++k) {
      values[k] = lane < kWarps ? scratch[lane * N + k] : T(0);
      values[k] = warp_sum(values[k]);
    }
  }
}

}  // namespace ncdp
