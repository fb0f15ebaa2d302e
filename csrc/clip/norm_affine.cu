// Per-sample gradients of a normalisation layer's affine parameters (clip
// family: the clip op's dense blocks of LayerNorm, GroupNorm and InstanceNorm
// layers). Two launches a layer where the torch composition was four kernels
// (the normalisation again, a product, two sums) that wrote and read xhat and
// the product in full: x crosses memory twice and g once.
#include <cmath>

#include "clip/clip_noise.h"
#include "common/block_reduce.cuh"
#include "common/launch.cuh"
#include "common/launch_config.h"

namespace ncdp {
namespace kernels {
namespace {

constexpr int kWarpsPerBlock = kBlockThreads / 32;
// Rows a thread of the column kernel reads before it adds them: independent
// loads in flight, which a GPU needs to reach its bandwidth.
constexpr int kColumnUnroll = 8;
// Warps of a column block, each summing every kRowGroups-th row of its 32
// columns: B n kRowGroups threads (196608 at BERT-base's B = 32, n = 768).
constexpr int kRowGroups = kBlockThreads / 32;

// stats[q] = (mean, rstd) of row q of x, rstd = 1 / sqrt(var + eps) with the
// biased variance (torch's layer and group norms): one warp a row, the mean
// and then the centred sum of squares, each lane-strided in float64 and added
// by a fixed shuffle tree.
template <typename Real>
__global__ void __launch_bounds__(kBlockThreads) norm_row_stats_kernel(
    const Real* __restrict__ x,  // [rows, n]
    std::int64_t rows, std::int64_t n, double eps,
    double* __restrict__ stats) {  // [rows, 2]
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * kWarpsPerBlock;
  for (std::int64_t q = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
       q < rows; q += warps) {
    const Real* row = x + q * n;
    double s = 0.0;
    for (std::int64_t e = lane; e < n; e += 32) s += static_cast<double>(row[e]);
    // Every lane holds the total after the tree and one broadcast.
    const double mean = __shfl_sync(0xffffffffu, warp_sum(s), 0) / static_cast<double>(n);
    double c2 = 0.0;
    for (std::int64_t e = lane; e < n; e += 32) {
      const double centred = static_cast<double>(row[e]) - mean;
      c2 += centred * centred;
    }
    c2 = warp_sum(c2);
    if (lane == 0) {
      stats[2 * q] = mean;
      stats[2 * q + 1] = 1.0 / sqrt(c2 / static_cast<double>(n) + eps);
    }
  }
}

// run == 0 (LayerNorm): w[i, e] = sum_r g[i, r, e] xhat[i, r, e] and b[i, e] =
// sum_r g[i, r, e]. A block covers 32 columns of one sample: warp k of its
// kRowGroups walks rows k, k + kRowGroups, ... (kColumnUnroll of them loaded
// ahead of their adds), its lanes the columns, so each row read is coalesced;
// the warps' float64 partial sums are added in warp order through shared
// memory (a fixed order: the same bits every run). Why: with a thread a
// column and every row, BERT-base's layers (B 32, n 768, rows 128) had 24576
// threads each walking 128 rows, 40 us a layer on the H200 (2026-11-30),
// where their 25 MB read in about 8.
template <typename Real>
__global__ void __launch_bounds__(kBlockThreads) norm_affine_columns_kernel(
    const Real* __restrict__ x,        // [B, rows, n]
    const Real* __restrict__ g,        // [B, rows, n]
    const double* __restrict__ stats,  // [B, rows, 2]
    std::int64_t B, std::int64_t rows, std::int64_t n,
    Real* __restrict__ w,   // [B, n] or nullptr
    Real* __restrict__ b) {  // [B, n] or nullptr
  __shared__ double part_w[kRowGroups][32];
  __shared__ double part_b[kRowGroups][32];
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int group = static_cast<int>(threadIdx.x) / 32;
  const std::int64_t tiles = ceil_div(n, std::int64_t{32});
  const std::int64_t work = B * tiles;
  // Uniform across the block: every thread reaches both barriers.
  for (std::int64_t t = blockIdx.x; t < work; t += gridDim.x) {
    const std::int64_t i = t / tiles;
    const std::int64_t e = (t % tiles) * 32 + lane;
    const bool active = e < n;
    double sw = 0.0;
    double sb = 0.0;
    if (active) {
      const Real* xi = x + i * rows * n + e;
      const Real* gi = g + i * rows * n + e;
      const double* si = stats + 2 * i * rows;
      for (std::int64_t r0 = group; r0 < rows; r0 += kRowGroups * kColumnUnroll) {
        double xv[kColumnUnroll];
        double gv[kColumnUnroll];
#pragma unroll
        for (int k = 0; k < kColumnUnroll; ++k) {
          const std::int64_t r = r0 + k * kRowGroups;
          const bool in = r < rows;
          xv[k] = in ? static_cast<double>(xi[r * n]) : 0.0;
          gv[k] = in ? static_cast<double>(gi[r * n]) : 0.0;
        }
#pragma unroll
        for (int k = 0; k < kColumnUnroll; ++k) {
          const std::int64_t r = r0 + k * kRowGroups;
          if (r < rows) {
            sw += gv[k] * ((xv[k] - si[2 * r]) * si[2 * r + 1]);
            sb += gv[k];
          }
        }
      }
    }
    part_w[group][lane] = sw;
    part_b[group][lane] = sb;
    __syncthreads();
    if (group == 0 && active) {
      double tw = 0.0;
      double tb = 0.0;
#pragma unroll
      for (int k = 0; k < kRowGroups; ++k) {
        tw += part_w[k][lane];
        tb += part_b[k][lane];
      }
      if (w != nullptr) w[i * n + e] = static_cast<Real>(tw);
      if (b != nullptr) b[i * n + e] = static_cast<Real>(tb);
    }
    __syncthreads();  // the partials are read before the next tile writes them
  }
}

// run > 0 (GroupNorm, InstanceNorm): channel c of sample i is the run of `run`
// values starting at c * run of the sample (its row q = c / (n / run)); one
// warp a (sample, channel), lane-strided float64 sums added by a fixed tree.
template <typename Real>
__global__ void __launch_bounds__(kBlockThreads) norm_affine_runs_kernel(
    const Real* __restrict__ x,        // [B, rows, n]
    const Real* __restrict__ g,        // [B, rows, n]
    const double* __restrict__ stats,  // [B, rows, 2]
    std::int64_t B, std::int64_t rows, std::int64_t n, std::int64_t run,
    Real* __restrict__ w,   // [B, C] or nullptr, C = rows n / run
    Real* __restrict__ b) {  // [B, C] or nullptr
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const std::int64_t per_row = n / run;
  const std::int64_t channels = rows * per_row;
  const std::int64_t work = B * channels;
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * kWarpsPerBlock;
  for (std::int64_t u = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
       u < work; u += warps) {
    const std::int64_t i = u / channels;
    const std::int64_t q = i * rows + (u % channels) / per_row;  // the stats' row
    const double mean = stats[2 * q];
    const double rstd = stats[2 * q + 1];
    const Real* xc = x + u * run;  // sample i's channel: values u * run .. of x
    const Real* gc = g + u * run;
    double sw = 0.0;
    double sb = 0.0;
    for (std::int64_t e = lane; e < run; e += 32) {
      const double gv = static_cast<double>(gc[e]);
      sw += gv * ((static_cast<double>(xc[e]) - mean) * rstd);
      sb += gv;
    }
    sw = warp_sum(sw);
    sb = warp_sum(sb);
    if (lane == 0) {
      if (w != nullptr) w[u] = static_cast<Real>(sw);
      if (b != nullptr) b[u] = static_cast<Real>(sb);
    }
  }
}

}  // namespace

template <typename Real>
void launch_norm_affine_grads(const Real* x, const Real* g, std::int64_t B, std::int64_t rows,
                              std::int64_t n, std::int64_t run, double eps, Real* w, Real* b,
                              double* stats, cudaStream_t stream) {
  if (B <= 0) return;
  const std::int64_t all_rows = B * rows;
  if (all_rows > 0) {
    NCDP_LAUNCH(grid_blocks(all_rows, kWarpsPerBlock), kBlockThreads, 0, stream,
                norm_row_stats_kernel<Real>)(x, all_rows, n, eps, stats);
  }
  if (run == 0) {
    NCDP_LAUNCH(grid_blocks(B * ceil_div(n, std::int64_t{32}), 1), kBlockThreads, 0, stream,
                norm_affine_columns_kernel<Real>)(x, g, stats, B, rows, n, w, b);
  } else if (all_rows > 0) {
    NCDP_LAUNCH(grid_blocks(B * rows * (n / run), kWarpsPerBlock), kBlockThreads, 0, stream,
                norm_affine_runs_kernel<Real>)(x, g, stats, B, rows, n, run, w, b);
  }
}

template void launch_norm_affine_grads<float>(const float*, const float*, std::int64_t,
                                              std::int64_t, std::int64_t, std::int64_t, double,
                                              float*, float*, double*, cudaStream_t);
template void launch_norm_affine_grads<double>(const double*, const double*, std::int64_t,
                                               std::int64_t, std::int64_t, std::int64_t, double,
                                               double*, double*, double*, cudaStream_t);

}  // namespace kernels
}  // namespace ncdp
