#include "rng/gaussian.h"

#include "common/launch.cuh"
#include "common/launch_config.h"
#include "common/philox.cuh"

namespace ncdp {
namespace kernels {
namespace {

// Five resident blocks an SM (62% occupancy at 48 registers): the normals'
// strict float64 operations (philox.cuh, "The normals") would otherwise take
// 61 registers and four blocks; capped, ptxas spills 4 bytes in the slab
// kernels and none in the finish (sm_90, bench/kernel_resources.py).
constexpr int kGaussianMinBlocks = 5;

// One thread per Philox block of the range: stream indices offset .. offset+p-1
// cover ceil((phase + p) / 4) blocks (phase = offset % 4), and a thread turns its
// block's four words into four normals at once (two Box-Muller pairs) instead
// of recomputing the block per element.
template <typename Partial, typename Real>
__global__ void __launch_bounds__(kBlockThreads, kGaussianMinBlocks) slab_sum_plus_gaussian_kernel(
    // Not __restrict__: `partials` is `out` when fill_gaussian accumulates in
    // place (each element is read, then written, by the same thread).
    const Partial* partials,  // [slabs, p]
    std::int64_t slabs, std::int64_t p, double noise_std, double inv_denom, std::uint64_t seed,
    std::uint64_t offset,
    Real* out) {  // [p]
  const std::int64_t phase = static_cast<std::int64_t>(offset & 3);
  const std::int64_t num_philox_blocks = (phase + p + 3) / 4;
  const std::uint64_t first_philox_block = offset >> 2;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       t < num_philox_blocks; t += stride) {
    double z[4] = {0.0, 0.0, 0.0, 0.0};
    // Without noise the transcendentals are skipped (noise_std * z would be 0 anyway).
    if (noise_std != 0.0) {
      philox::normals_of_block(seed, first_philox_block + static_cast<std::uint64_t>(t), z);
    }
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const std::int64_t j = 4 * t + q - phase;
      if (j < 0 || j >= p) continue;
      Partial sum = Partial(0);
      for (std::int64_t s = 0; s < slabs; ++s) sum += partials[s * p + j];
      // Without slabs (a fill) no sum is added: the twin's own operations.
      out[j] = static_cast<Real>(
          slabs > 0 ? philox::finish_normal(static_cast<double>(sum), noise_std, z[q], inv_denom)
                    : philox::fill_normal(noise_std, z[q], inv_denom));
    }
  }
}

// The segments' Philox blocks side by side, one thread a block as above;
// the thread's segment is the last whose first block is at most its index (a
// binary search of the by-value table: empty segments own no block).
__global__ void __launch_bounds__(kBlockThreads, kGaussianMinBlocks)
    finish_gaussian_segments_kernel(const GaussianSegments table, std::uint64_t seed, double scale,
                                    double post) {
  const std::int64_t total = table.first_block[table.count];
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       t < total; t += stride) {
    int lo = 0, hi = table.count - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (table.first_block[mid] <= t) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    const int s = lo;
    const std::int64_t u = t - table.first_block[s];
    const std::uint64_t offset = table.offset[s];
    const std::int64_t phase = static_cast<std::int64_t>(offset & 3);
    double z[4] = {0.0, 0.0, 0.0, 0.0};
    if (scale != 0.0) {
      philox::normals_of_block(seed, (offset >> 2) + static_cast<std::uint64_t>(u), z);
    }
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const std::int64_t j = 4 * u + q - phase;
      if (j < 0 || j >= table.size[s]) continue;
      // The same operations as slab_sum_plus_gaussian_kernel with one slab.
      if (table.types[s] == kSegmentFloat32) {
        const double src = static_cast<const float*>(table.src[s])[j];
        static_cast<float*>(table.dst[s])[j] =
            static_cast<float>(philox::finish_normal(src, scale, z[q], post));
      } else {
        const double value =
            philox::finish_normal(static_cast<const double*>(table.src[s])[j], scale, z[q], post);
        if (table.types[s] == kSegmentFloat64) {
          static_cast<double*>(table.dst[s])[j] = value;
        } else {
          static_cast<float*>(table.dst[s])[j] = static_cast<float>(value);
        }
      }
    }
  }
}

}  // namespace

void launch_finish_gaussian_segments(const GaussianSegments& table, std::uint64_t seed,
                                     double scale, double post, cudaStream_t stream) {
  if (table.count <= 0) return;
  const std::int64_t total = table.first_block[table.count];
  if (total <= 0) return;
  NCDP_LAUNCH(grid_blocks(total, kBlockThreads), kBlockThreads, 0, stream,
              finish_gaussian_segments_kernel)(table, seed, scale, post);
}

template <typename Partial, typename Real>
void launch_slab_sum_plus_gaussian(const Partial* partials, std::int64_t slabs, std::int64_t p,
                                   double noise_std, double inv_denom, std::uint64_t seed,
                                   std::uint64_t offset, Real* out, cudaStream_t stream) {
  if (p <= 0) return;
  const std::int64_t num_philox_blocks = (static_cast<std::int64_t>(offset & 3) + p + 3) / 4;
  NCDP_LAUNCH(grid_blocks(num_philox_blocks, kBlockThreads), kBlockThreads, 0, stream,
      slab_sum_plus_gaussian_kernel<Partial, Real>)(
          partials, slabs, p, noise_std, inv_denom, seed, offset, out);
}

template <typename Real>
void launch_fill_gaussian(Real* out, std::int64_t count, std::uint64_t seed, std::uint64_t offset,
                          double scale, double post, bool accumulate, cudaStream_t stream) {
  // Accumulating is an in-place finish with `out` as the single slab; `post`
  // is the finish's inv_denom, applied in double before the one rounding.
  launch_slab_sum_plus_gaussian<Real, Real>(accumulate ? out : nullptr, accumulate ? 1 : 0,
                                            count, scale, post, seed, offset, out, stream);
}

#define NCDP_INSTANTIATE_SLAB_SUM(Partial, Real)                                            \
  template void launch_slab_sum_plus_gaussian<Partial, Real>(                               \
      const Partial*, std::int64_t, std::int64_t, double, double, std::uint64_t,            \
      std::uint64_t, Real*, cudaStream_t);
NCDP_INSTANTIATE_SLAB_SUM(float, float)
NCDP_INSTANTIATE_SLAB_SUM(double, double)
NCDP_INSTANTIATE_SLAB_SUM(double, float)
#undef NCDP_INSTANTIATE_SLAB_SUM
template void launch_fill_gaussian<float>(float*, std::int64_t, std::uint64_t, std::uint64_t,
                                          double, double, bool, cudaStream_t);
template void launch_fill_gaussian<double>(double*, std::int64_t, std::uint64_t, std::uint64_t,
                                           double, double, bool, cudaStream_t);

}  // namespace kernels
}  // namespace ncdp
