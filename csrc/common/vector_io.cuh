// 16-byte global loads for bandwidth-bound kernels: float4 for float, double2
// for double. Callers check alignment (address % 16 == 0) before using them.
#pragma once
#include <cstdint>

#include "common/host_device.h"

namespace ncdp {

template <typename T>
struct Vec16;
template <>
struct Vec16<float> {
  using type = float4;
  static constexpr int kWidth = 4;
};
template <>
struct Vec16<double> {
  using type = double2;
  static constexpr int kWidth = 2;
};

__device__ __forceinline__ double sum_of_squares(float4 v) {
  const double x = v.x, y = v.y, z = v.z, w = v.w;
  return x * x + y * y + z * z + w * w;
}
__device__ __forceinline__ double sum_of_squares(double2 v) { return v.x * v.x + v.y * v.y; }

// Four consecutive elements starting at a 16-byte aligned address.
__device__ __forceinline__ void load4_aligned(const float* __restrict__ src, float out[4]) {
  const float4 v = *reinterpret_cast<const float4*>(src);
  out[0] = v.x;
  out[1] = v.y;
  out[2] = v.z;
  out[3] = v.w;
}
__device__ __forceinline__ void load4_aligned(const double* __restrict__ src, double out[4]) {
  const double2 lo = *reinterpret_cast<const double2*>(src);
  const double2 hi = *reinterpret_cast<const double2*>(src + 2);
  out[0] = lo.x;
  out[1] = lo.y;
  out[2] = hi.x;
  out[3] = hi.y;
}

// Host and device: launchers pick the vectorized kernel variant with it.
template <typename T>
NCDP_HOST_DEVICE bool is_aligned16(const T* ptr) {
  return (reinterpret_cast<std::uintptr_t>(ptr) & 15u) == 0;
}

// This thread's share of sum_k x[k]^2 over x[0..n), accumulated in double, for
// threads 0..num_threads-1 of a cooperating group. Peels the elements before
// the first 16-byte boundary so that the body uses vector loads whatever the
// row's alignment (rows of a [B, p] float matrix with p % 4 != 0 start at
// every alignment).
template <typename T>
__device__ __forceinline__ double thread_sum_of_squares(const T* __restrict__ x, std::int64_t n,
                                                        int thread, int num_threads) {
  using Vec = typename Vec16<T>::type;
  constexpr int kWidth = Vec16<T>::kWidth;
  const std::uintptr_t address = reinterpret_cast<std::uintptr_t>(x);
  std::int64_t head = static_cast<std::int64_t>(((16u - (address & 15u)) & 15u) / sizeof(T));
  if (head > n) head = n;
  double sum = 0.0;
  if (thread < head) {
    const double v = x[thread];
    sum += v * v;
  }
  const Vec* body = reinterpret_cast<const Vec*>(x + head);
  const std::int64_t num_vectors = (n - head) / kWidth;
#pragma unroll 4
  for (std::int64_t v = thread; v < num_vectors; v += num_threads) {
    sum += sum_of_squares(body[v]);
  }
  for (std::int64_t k = head + num_vectors * kWidth + thread; k < n; k += num_threads) {
    const double v = x[k];
    sum += v * v;
  }
  return sum;
}

}  // namespace ncdp
