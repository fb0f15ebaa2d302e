// Gaussian noise from the Philox stream (DESIGN.md, "Random numbers"): normal j
// of stream (seed, offset) is philox::normal_at(seed, offset + j), computed in
// float64 and rounded once to the output dtype.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace ncdp {

// Python-facing (pointers as integers, dtype 0 = float32, 1 = float64):
// out[j] = post * ([out[j] +] scale * normal(seed, offset + j)) for j < count,
// in double and rounded once (post: 1 / expected batch size on a ghost block's
// finishing step, else 1). Consumes `count` draws.
void launch_fill_gaussian(std::uintptr_t out,  // [count], dtype
                          std::int64_t count, int dtype, std::uint64_t seed,
                          std::uint64_t offset, double scale, bool accumulate, double post,
                          std::uintptr_t stream);

namespace kernels {

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
