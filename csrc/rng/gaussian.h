// Gaussian noise from the Philox stream (DESIGN.md, "Random numbers"): normal j
// of stream (seed, offset) is philox::normal_at(seed, offset + j), computed in
// float64 and rounded once to the output dtype.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

namespace ncdp {

// Python-facing (pointers as integers, dtype 0 = float32, 1 = float64):
// out[j] = post * ([out[j] +] scale * normal(seed, offset + j)) for j < count,
// in double and rounded once (post: 1 / expected batch size on a ghost block's
// finishing step, else 1). Consumes `count` draws.
void launch_fill_gaussian(std::uintptr_t out,  // [count], dtype
                          std::int64_t count, int dtype, std::uint64_t seed,
                          std::uint64_t offset, double scale, bool accumulate, double post,
                          std::uintptr_t stream);

// Python-facing: the finishes of several noisy sums in one launch (a private
// step's linear layers, issue 36: one launch instead of two a layer). For each
// segment s and j < count[s],
//   dst[s][j] = post * (src[s][j] + scale * normal(seed, offset[s] + j)),
// in double and rounded once to dst_dtype[s]: exactly launch_fill_gaussian
// with accumulate on src (in place when src[s] == dst[s]), and for a float64
// src and a float32 dst that value rounded once to float32. dtype pairs
// (src, dst): (0, 0), (1, 1), (1, 0). Every buffer lies on the device of the
// first non-empty dst (the caller's op allocated them together). Consumes
// count[s] draws at offset[s] for each s.
void launch_finish_gaussian_segments(const std::vector<std::uintptr_t>& dst,
                                     const std::vector<std::uintptr_t>& src,
                                     const std::vector<std::int64_t>& count,
                                     const std::vector<std::uint64_t>& offset,
                                     const std::vector<int>& src_dtype,
                                     const std::vector<int>& dst_dtype, std::uint64_t seed,
                                     double scale, double post, std::uintptr_t stream);

namespace kernels {

// Segments of one launch: the table is the kernel's by-value argument (about
// 2 KB, under the 4 KB parameter limit), so no table crosses to the device.
constexpr int kMaxGaussianSegments = 48;

// (src, dst) element types of a segment.
enum GaussianSegmentTypes : unsigned char {
  kSegmentFloat32 = 0,           // float32 -> float32
  kSegmentFloat64 = 1,           // float64 -> float64
  kSegmentFloat64ToFloat32 = 2,  // float64 -> float32
};

struct GaussianSegments {
  int count;                                     // segments used, <= kMaxGaussianSegments
  void* dst[kMaxGaussianSegments];               // [size[s]]
  const void* src[kMaxGaussianSegments];         // [size[s]]; may be dst[s]
  std::int64_t size[kMaxGaussianSegments];
  std::uint64_t offset[kMaxGaussianSegments];    // stream index of element 0
  // Philox blocks before segment s (a segment of n > 0 values at phase
  // offset % 4 covers (phase + n + 3) / 4 blocks; an empty one none);
  // first_block[count] is the launch's total.
  std::int64_t first_block[kMaxGaussianSegments + 1];
  unsigned char types[kMaxGaussianSegments];     // GaussianSegmentTypes
};

// Appends a segment of `size` > 0 values to a table with room for it (the
// host wrapper and the emulation tier's driver fill tables alike).
inline void append_gaussian_segment(GaussianSegments& table,
                                    void* dst,        // [size]
                                    const void* src,  // [size]
                                    std::int64_t size, std::uint64_t offset,
                                    GaussianSegmentTypes types) {
  const int k = table.count;
  if (k == 0) table.first_block[0] = 0;
  table.dst[k] = dst;
  table.src[k] = src;
  table.size[k] = size;
  table.offset[k] = offset;
  table.types[k] = types;
  table.first_block[k + 1] =
      table.first_block[k] + (static_cast<std::int64_t>(offset & 3) + size + 3) / 4;
  table.count = k + 1;
}

// The finish above for one table (count may be 0: nothing is launched).
void launch_finish_gaussian_segments(const GaussianSegments& table, std::uint64_t seed,
                                     double scale, double post, cudaStream_t stream);

// out[j] = post * (scale * normal(seed, offset + j) (+ out[j] when accumulate)),
// j < count.
template <typename Real>
void launch_fill_gaussian(Real* out,  // [count]
                          std::int64_t count, std::uint64_t seed, std::uint64_t offset,
                          double scale, double post, bool accumulate, cudaStream_t stream);

// The last step of every noisy sum (fill_gaussian, weighted row sums, the
// clipped linear GEMM): for j < p,
//   out[j] = inv_denom * (sum_{s < slabs} partials[s, j] + noise_std * normal(seed, offset + j)),
// the slab sum taken in Partial (Real, or double for the dense clip's float64
// partials) in slab order, the rest in double, rounded once to Real.
// slabs == 0 gives pure (scaled) noise. `partials` may be `out` itself when
// slabs == 1 (an in-place finish).
template <typename Partial, typename Real>
void launch_slab_sum_plus_gaussian(const Partial* partials,  // [slabs, p]
                                   std::int64_t slabs, std::int64_t p, double noise_std,
                                   double inv_denom, std::uint64_t seed, std::uint64_t offset,
                                   Real* out,  // [p]
                                   cudaStream_t stream);

}  // namespace kernels
}  // namespace ncdp
