#include <algorithm>
#include <cmath>

#include "clip/clip_noise.h"
#include "common/block_reduce.cuh"
#include "common/launch.cuh"
#include "common/launch_config.h"
#include "common/vector_io.cuh"
#include "rng/gaussian.h"

namespace ncdp {
namespace kernels {
namespace {

// ---------------------------------------------------------------------------
// Sizing constants.

// Weighted row sums: each thread owns 4 consecutive columns (one 16-byte float4
// load per row); rows are split into slabs until the grid holds about 4 waves
// of resident threads on the target GPU, but never fewer than 8 rows per slab
// (the partial rows are extra traffic for the final pass).
constexpr std::int64_t kColumnsPerThread = 4;
constexpr std::int64_t kRowSumTargetThreads = kTargetSMs * kResidentThreadsPerSM * 4;
constexpr std::int64_t kRowSumMinRowsPerSlab = 8;
// gridDim.y / gridDim.z limit.
constexpr std::int64_t kMaxSlabs = 65535;

// Norms from Grams: samples are cut into row slices until about this many
// blocks (8 a SM of the target GPU) share the cells, so that B = 16..32
// samples still load from every SM.
constexpr std::int64_t kNormSliceTargetBlocks = kTargetSMs * 8;
// ... but no slice under this many cells (4 a thread): a smaller one is mostly
// its block's fixed cost.
constexpr std::int64_t kNormSliceMinCells = 1024;

// Linear-layer norms: 16 x 16 thread tiles, each thread one entry of a tile of
// dot products, contraction staged through shared memory 32 elements at a time.
constexpr int kDotTile = 16;
constexpr int kDotDepth = 32;

// Clipped linear GEMM: 64 x 64 output tiles (k x j), 16 rows of the B*T
// reduction per shared-memory stage, 256 threads each computing 4 x 4 outputs
// strided by 16 (conflict-free shared reads, coalesced stores).
constexpr int kGemmTile = 64;
constexpr int kGemmDepth = 16;
constexpr int kGemmMicro = 4;
constexpr int kGemmThreadsPerSide = kGemmTile / kGemmMicro;
static_assert(kGemmThreadsPerSide * kGemmThreadsPerSide == kBlockThreads, "16 x 16 threads");
static_assert(kDotTile * kDotTile == kBlockThreads, "16 x 16 threads");
// About 2 waves of GEMM blocks (some 4 resident per SM); at least 16 stages per slab.
constexpr std::int64_t kGemmTargetBlocks = kTargetSMs * 4 * 2;
constexpr std::int64_t kGemmMinRowsPerSlab = 16 * kGemmDepth;

// ---------------------------------------------------------------------------
// Dense rows.

// dst[w] (=, or +=) sum of squares of segment w % segments of row w / segments,
// segments being consecutive runs of segment_len columns. One block per
// (row, segment), grid-striding; the standalone op uses one segment per row.
template <typename Real>
__global__ void __launch_bounds__(kBlockThreads) row_sq_norms_kernel(
    const Real* __restrict__ grads,  // [rows, p]
    std::int64_t rows, std::int64_t p, std::int64_t segments, std::int64_t segment_len,
    double* __restrict__ dst,  // [rows, segments]
    bool accumulate) {
  __shared__ double scratch[kBlockThreads / 32];
  const std::int64_t work = rows * segments;
  for (std::int64_t w = blockIdx.x; w < work; w += gridDim.x) {
    const std::int64_t row = w / segments;
    const std::int64_t begin = (w % segments) * segment_len;
    const std::int64_t length = std::min(segment_len, p - begin);
    double sum = thread_sum_of_squares(grads + row * p + begin, length,
                                       static_cast<int>(threadIdx.x), kBlockThreads);
    sum = block_sum<kBlockThreads>(sum, scratch);
    if (threadIdx.x == 0) dst[w] = accumulate ? dst[w] + sum : sum;
  }
}

// An upper bound on ||x_t|| from a float32 Gram's computed diagonal entry
// (reference.gram32_root_bound): the largest root of
// (1 - gamma) r^2 - 2 eta1 r - (eta0 + diag).
__device__ __forceinline__ double gram32_root_bound(double diag, const double (&r)[3]) {
  const double scale = (1.0 + kGram32RootMargin) / (1.0 - r[0]);
  return (r[1] + sqrt(r[1] * r[1] + (1.0 - r[0]) * (r[2] + diag))) * scale;
}

// The float32 Grams' largest effect on a layer's Hadamard sum
// (reference.gram32_error) from E >= sum_t (|a_t| + b) |g_t|, A1 >= sum_t
// (|a_t| + b) and B1 >= sum_t |g_t|.
__device__ __forceinline__ double gram32_error(double E, double A1, double B1, double T,
                                               const GramRounding& r) {
  const double gw = r.w[0], e1w = r.w[1], e0w = r.w[2];
  const double gv = r.v[0], e1v = r.v[1], e0v = r.v[2];
  const double i = gw * E * E + 2.0 * e1w * E * B1 + e0w * B1 * B1;
  const double ii = 2.0 * gw * E * A1 + e1w * (2.0 * T * E + 2.0 * A1 * B1) + 2.0 * e0w * T * B1;
  const double iii = gw * A1 * A1 + 2.0 * e1w * T * A1 + e0w * T * T;
  const double iv = gv * E * E + 2.0 * e1v * E * A1 + e0v * A1 * A1;
  return ((1.0 + gv) * i + e1v * ii + e0v * iii + iv) * (1.0 + kGram32ErrorMargin);
}

// Pass 1 of the norms from Grams: block (i, s) sums slice s (rows
// [s R, (s + 1) R) of T) of sample i's Grams: the Hadamard sum of the slice's
// cells and its diagonal entries' five sums, each a fixed-order block tree,
// into partials[i, s, 0..5]. Slices spread the samples over every SM (one
// block a sample left most of a GPU idle at B = 16..32 with 8 warps an SM).
// Float32 Grams (rounding.enabled) take their diagonal roots as the model's
// upper bounds; float64 ones as they are.
template <typename Gram>
__global__ void __launch_bounds__(kBlockThreads) linear_norm_partials_kernel(
    const Gram* __restrict__ w,  // [w_count, T, T]
    const Gram* __restrict__ v,  // [samples, T, T]
    std::int64_t samples, std::int64_t w_count, std::int64_t T, std::int64_t slices,
    std::int64_t rows_per_slice, double bias, GramRounding rounding,
    double* __restrict__ partials) {  // [samples, slices, kNormPartials]
  __shared__ double scratch[kBlockThreads / 32 * kNormPartials];
  const int tid = static_cast<int>(threadIdx.x);
  for (std::int64_t work = blockIdx.x; work < samples * slices; work += gridDim.x) {
    const std::int64_t i = work / slices;
    const std::int64_t t0 = (work % slices) * rows_per_slice;
    const std::int64_t t1 = t0 + rows_per_slice < T ? t0 + rows_per_slice : T;
    // W_i is W[i mod w_count]: w_count = B when the layers read one input (q, k, v).
    const Gram* wi = w + (i % w_count) * T * T;
    const Gram* vi = v + i * T * T;
    // (Hadamard sum, tr W, tr V, E = sum_t y_t (x_t + bias), sum_t (x_t + bias),
    // sum_t y_t) of the slice, x_t and y_t the diagonal's roots.
    double sums[kNormPartials] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
    for (std::int64_t c = t0 * T + tid; c < t1 * T; c += kBlockThreads) {
      sums[0] += (static_cast<double>(wi[c]) + bias) * static_cast<double>(vi[c]);
    }
    for (std::int64_t t = t0 + tid; t < t1; t += kBlockThreads) {
      const double wt = wi[t * (T + 1)], vt = vi[t * (T + 1)];
      sums[1] += wt;
      sums[2] += vt;
      if (rounding.enabled) {
        const double x = gram32_root_bound(wt, rounding.w) + bias;
        const double y = gram32_root_bound(vt, rounding.v);
        sums[3] += y * x;
        sums[4] += x;
        sums[5] += y;
      } else {
        sums[3] += sqrt(vt) * (sqrt(wt) + bias);
      }
    }
    block_sums<kBlockThreads>(sums, scratch);
    if (tid == 0) {
      for (int k = 0; k < kNormPartials; ++k) partials[kNormPartials * work + k] = sums[k];
    }
  }
}

// Pass 2: a warp a sample b (sample i = l * B + b of layer l): each layer's
// slices summed by the warp (lane j adds slices j, j + 32, ... in order, then
// warp_sum's fixed tree), the layers' totals added in layer order by lane 0;
// with float32 Grams each layer's norm gains its gram32_error. One thread a
// sample walked layers * slices partials one after another: 32 threads on the
// whole device for BERT-base (B 32), each waiting on 36 dependent loads, 11.7
// us a launch on the H200 (30 launches, 0.35 ms a step, 2026-11-30), where the
// partials (B layers slices 48 bytes, L2-resident) take a round trip or two.
__global__ void __launch_bounds__(kBlockThreads) linear_norms_from_partials_kernel(
    const double* __restrict__ partials,  // [layers * B, slices, kNormPartials]
    std::int64_t B, std::int64_t layers, std::int64_t T, std::int64_t slices,
    GramRounding rounding,
    double* __restrict__ sq,  // [B]
    bool accumulate,
    double* __restrict__ spread,  // [B] or nullptr
    double* __restrict__ sizes) {  // [layers * B, 2] or nullptr
  constexpr std::int64_t kWarps = kBlockThreads / 32;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * kWarps;
  // Whole warps run the loop together (B is uniform): warp_sum needs every lane.
  for (std::int64_t b = static_cast<std::int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; b < B;
       b += stride) {
    double norm_total = 0.0, spread_total = 0.0;
    for (std::int64_t l = 0; l < layers; ++l) {
      const std::int64_t i = l * B + b;
      // (Hadamard sum, tr W, tr V, E, A1, B1) of layer l, as pass 1 names them.
      double part[kNormPartials] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
      for (std::int64_t s = lane; s < slices; s += 32) {
        const double* p = partials + kNormPartials * (i * slices + s);
#pragma unroll
        for (int k = 0; k < kNormPartials; ++k) part[k] += p[k];
      }
#pragma unroll
      for (int k = 0; k < kNormPartials; ++k) part[k] = warp_sum(part[k]);
      if (lane == 0) {
        double norm = part[0];
        if (rounding.enabled) {
          norm += gram32_error(part[3], part[4], part[5], static_cast<double>(T), rounding);
        }
        norm_total += norm;
        spread_total += part[3];
        if (sizes != nullptr) {
          sizes[2 * i] = part[1];
          sizes[2 * i + 1] = part[2];
        }
      }
    }
    if (lane == 0) {
      sq[b] = accumulate ? sq[b] + norm_total : norm_total;
      if (spread != nullptr) spread[b] += spread_total;
    }
  }
}

// One rule for every row (the dense op's factors).
struct OneClipRule {
  ClipRule rule;
  NCDP_HOST_DEVICE const ClipRule& operator()(std::int64_t) const { return rule; }
};

// For row r = g B + i (sample i of group g): norms[g * group_stride + i] =
// sqrt(sq_r), sq_r = scale^2 sum_s sq_partials[r, s] (segments summed in
// order), factors[g * group_stride + i] its clip factor (clip/clip_rule.cuh,
// group g's rule, with scale spread[r] or 0), weights[r] = that factor times
// scale where given. `scale` is the clip op's grad_scale (blocks holding
// gradients / s: each sample's norm is s times theirs); each product is
// rounded on its own, as the element-wise ops it replaces were (two kernels
// of host time a step, issue 36), and scale 1 leaves every value as it is.
// Rules: OneClipRule, or ClipRuleTable (per-layer clipping: a parameter's
// rule a group, one launch for all, not one a parameter).
template <typename Rules>
__global__ void __launch_bounds__(kBlockThreads) clip_factors_kernel(
    const double* __restrict__ sq_partials,  // [rows, segments]
    const double* __restrict__ spread,       // [rows] or nullptr
    std::int64_t B, std::int64_t rows, std::int64_t segments, Rules rules, double scale,
    double* __restrict__ factors,  // group g's [B] at factors + g * group_stride
    double* __restrict__ norms,    // group g's [B] at norms + g * group_stride
    std::int64_t group_stride,
    double* __restrict__ weights) {  // [rows] or nullptr
  const double scale_sq = philox::detail::mul(scale, scale);
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       r < rows; r += stride) {
    const std::int64_t g = r / B;
    const std::int64_t at = g * group_stride + (r - g * B);
    double sq = 0.0;
    for (std::int64_t s = 0; s < segments; ++s) sq += sq_partials[r * segments + s];
    sq = philox::detail::mul(sq, scale_sq);
    norms[at] = sqrt(sq);
    const double e = spread != nullptr ? philox::detail::mul(spread[r], scale) : 0.0;
    const double factor = clip_factor(sq, e, rules(g));
    factors[at] = factor;
    if (weights != nullptr) weights[r] = philox::detail::mul(factor, scale);
  }
}

// partials[s, j] (=, or += across chunks) sum over the rows r of slab s of
// factors[r] * grads[r, j], in float64 (the factor may be far below the
// smallest normal float). Block (x, s) covers 256 column groups of
// 4 columns of slab s; a thread walks its slab's rows down its 4 columns, so
// each row read is coalesced. kAligned: every group of 4 starts on a 16-byte
// boundary (base aligned and p a multiple of the vector width).
template <typename Real, bool kAligned>
__global__ void __launch_bounds__(kBlockThreads) weighted_row_sum_partials_kernel(
    const Real* __restrict__ grads,      // [rows, p]
    const double* __restrict__ factors,  // [rows]
    std::int64_t rows, std::int64_t p, std::int64_t rows_per_slab,
    double* __restrict__ partials,  // [slabs, p], slabs = gridDim.y
    bool accumulate) {
  const std::int64_t slab = blockIdx.y;
  const std::int64_t row_begin = slab * rows_per_slab;
  const std::int64_t row_end = std::min(rows, row_begin + rows_per_slab);
  const std::int64_t groups = (p + kColumnsPerThread - 1) / kColumnsPerThread;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t group = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       group < groups; group += stride) {
    const std::int64_t column = group * kColumnsPerThread;
    const std::int64_t remaining = p - column;
    const int width = remaining < kColumnsPerThread ? static_cast<int>(remaining)
                                                    : static_cast<int>(kColumnsPerThread);
    double* dst = partials + slab * p + column;
    // Loops over q are fully unrolled with `q < width` as a predicate, so the
    // small arrays stay in registers (a runtime bound would index them in
    // local memory).
    double acc[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) acc[q] = (accumulate && q < width) ? dst[q] : 0.0;
#pragma unroll 4
    for (std::int64_t r = row_begin; r < row_end; ++r) {
      const double factor = factors[r];
      // Rows with factor 0 are dropped, not multiplied: they may hold NaN.
      const bool keep = factor != 0.0;
      const Real* src = grads + r * p + column;
      Real v[4];
      if (kAligned && width == 4) {
        load4_aligned(src, v);
      } else {
#pragma unroll
        for (int q = 0; q < 4; ++q) v[q] = q < width ? src[q] : Real(0);
      }
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[q] += keep ? factor * static_cast<double>(v[q]) : 0.0;
    }
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      if (q < width) dst[q] = acc[q];
    }
  }
}

template <typename Real>
void launch_weighted_row_sum_partials(const Real* grads,      // [rows, p]
                                      const double* factors,  // [rows]
                                      std::int64_t rows, std::int64_t p, std::int64_t slabs,
                                      double* partials,  // [slabs, p]
                                      bool accumulate, cudaStream_t stream) {
  const std::int64_t rows_per_slab = std::max<std::int64_t>(1, ceil_div(rows, slabs));
  const dim3 grid(grid_blocks(ceil_div(p, kColumnsPerThread), kBlockThreads),
                  static_cast<unsigned int>(slabs));
  const bool aligned = is_aligned16(grads) && p % Vec16<Real>::kWidth == 0;
  if (aligned) {
    NCDP_LAUNCH(grid, kBlockThreads, 0, stream, weighted_row_sum_partials_kernel<Real, true>)(
        grads, factors, rows, p, rows_per_slab, partials, accumulate);
  } else {
    NCDP_LAUNCH(grid, kBlockThreads, 0, stream, weighted_row_sum_partials_kernel<Real, false>)(
        grads, factors, rows, p, rows_per_slab, partials, accumulate);
  }
}

// ---------------------------------------------------------------------------
// Factored (linear-layer) norms.

// A read-only matrix view with arbitrary strides: the direct method contracts
// over t, i.e. works on the transposes of the [T, K] and [T, d] blocks.
template <typename Real>
struct StridedMatrix {
  const Real* data;
  std::int64_t rows;
  std::int64_t cols;
  std::int64_t row_stride;
  std::int64_t col_stride;
};

// Copies X[r0 : r0+16, c0 : c0+32] into a shared tile, zero outside X. Threads
// walk the tile along whichever dimension is contiguous in memory, so that the
// global reads are coalesced in both the Gram (rows contiguous) and the direct
// (columns contiguous) layouts.
template <typename Real>
__device__ __forceinline__ void stage_tile(const StridedMatrix<Real>& x, std::int64_t r0,
                                           std::int64_t c0,
                                           Real (*tile)[kDotDepth + 1]) {  // [16][33]
  for (int e = threadIdx.x; e < kDotTile * kDotDepth; e += kBlockThreads) {
    const bool along_cols = x.col_stride == 1;
    const int r = along_cols ? e / kDotDepth : e % kDotTile;
    const int c = along_cols ? e % kDotDepth : e / kDotTile;
    const std::int64_t gr = r0 + r;
    const std::int64_t gc = c0 + c;
    tile[r][c] = (gr < x.rows && gc < x.cols) ? x.data[gr * x.row_stride + gc * x.col_stride]
                                              : Real(0);
  }
}

// sum_c X[r0 + ty, c] * Y[s0 + tx, c] in double, ty = threadIdx.x / 16,
// tx = threadIdx.x % 16: one entry of a 16 x 16 tile of X Y^T per thread (rows
// beyond the end count as zero). X and Y have the same number of columns. All
// threads of the block must call it.
template <typename Real>
__device__ __forceinline__ double tile_dot(const StridedMatrix<Real>& x, std::int64_t r0,
                           const StridedMatrix<Real>& y, std::int64_t s0,
                           Real (*x_tile)[kDotDepth + 1],   // shared [16][33]
                           Real (*y_tile)[kDotDepth + 1]) {  // shared [16][33]
  const int ty = threadIdx.x / kDotTile;
  const int tx = threadIdx.x % kDotTile;
  double acc = 0.0;
  for (std::int64_t c0 = 0; c0 < x.cols; c0 += kDotDepth) {
    // The previous stage (or the previous call) may still be reading the tiles.
    __syncthreads();
    stage_tile(x, r0, c0, x_tile);
    stage_tile(y, s0, c0, y_tile);
    __syncthreads();
#pragma unroll 8
    for (int c = 0; c < kDotDepth; ++c) {
      acc += static_cast<double>(x_tile[ty][c]) * static_cast<double>(y_tile[tx][c]);
    }
  }
  return acc;
}

__device__ __forceinline__ void store_sum(double* dst, double value, bool accumulate) {
  *dst = accumulate ? *dst + value : value;
}

// T == 1: ||g_i a_i^T||_F^2 = ||g_i||^2 ||a_i||^2, plus ||g_i||^2 for the bias;
// with sizes, also the two factors themselves, which the clip op reads with its
// counts to decide whether the clipped sum must rebalance: one launch where
// the two row-norm launches and the element-wise ops that combined them were
// seven kernels a layer (issue 36: a linear head's private step is host time).
// The product and the sum are rounded one at a time, as the ops they replace.
template <typename Real>
__global__ void __launch_bounds__(kBlockThreads) linear_sq_norms_rank1_kernel(
    const Real* __restrict__ acts,   // [B, d]
    const Real* __restrict__ grads,  // [B, K]
    std::int64_t B, std::int64_t d, std::int64_t K, bool bias,
    double* __restrict__ sq,  // [B]
    bool accumulate,
    double* __restrict__ sizes) {  // [B, 2] = (||a_i||^2, ||g_i||^2), or nullptr
  __shared__ double scratch[kBlockThreads / 32];
  const int tid = static_cast<int>(threadIdx.x);
  for (std::int64_t i = blockIdx.x; i < B; i += gridDim.x) {
    const double a_sq = block_sum<kBlockThreads>(
        thread_sum_of_squares(acts + i * d, d, tid, kBlockThreads), scratch);
    const double g_sq = block_sum<kBlockThreads>(
        thread_sum_of_squares(grads + i * K, K, tid, kBlockThreads), scratch);
    if (tid == 0) {
      const double product = philox::detail::mul(a_sq, g_sq);
      store_sum(sq + i, bias ? philox::detail::add(product, g_sq) : product, accumulate);
      if (sizes != nullptr) {
        sizes[2 * i] = a_sq;
        sizes[2 * i + 1] = g_sq;
      }
    }
  }
}

// Gram form, cheaper when 2 T^2 <= K d:
// ||G_i||_F^2 = sum_{t,s} (a_it . a_is)(g_it . g_is), bias ||sum_t g_it||^2 = sum_{t,s} g_it . g_is.
// Only tile pairs (tt <= ss) are formed; off-diagonal pairs count twice.
// Resident blocks the two tiled norm kernels ask ptxas for: with the block
// size alone it aimed at 4 blocks (64 registers) and spilled 48-64 bytes in
// the tile loops at sm_90 (bench/kernel_resources.py); at 3 blocks (<= 85
// registers) they fit without spills. direct<float> already fits in 80 without
// a hint and spills 8 bytes with it, so it gets none (0: no minimum).
template <typename Real, bool kGram>
constexpr int kTiledNormMinBlocks = (kGram || sizeof(Real) == sizeof(double)) ? 3 : 0;

template <typename Real>
__global__ void __launch_bounds__(kBlockThreads, (kTiledNormMinBlocks<Real, true>)) linear_sq_norms_gram_kernel(
    const Real* __restrict__ acts,   // [B, T, d]
    const Real* __restrict__ grads,  // [B, T, K]
    std::int64_t B, std::int64_t T, std::int64_t d, std::int64_t K, bool bias,
    double* __restrict__ sq,  // [B]
    bool accumulate) {
  __shared__ Real x_tile[kDotTile][kDotDepth + 1];
  __shared__ Real y_tile[kDotTile][kDotDepth + 1];
  __shared__ double scratch[kBlockThreads / 32];
  const std::int64_t tiles = (T + kDotTile - 1) / kDotTile;
  for (std::int64_t i = blockIdx.x; i < B; i += gridDim.x) {
    const StridedMatrix<Real> a{acts + i * T * d, T, d, d, 1};
    const StridedMatrix<Real> g{grads + i * T * K, T, K, K, 1};
    double weight_sq = 0.0;
    double bias_sq = 0.0;
    for (std::int64_t tt = 0; tt < tiles; ++tt) {
      for (std::int64_t ss = tt; ss < tiles; ++ss) {
        const double aa = tile_dot(a, tt * kDotTile, a, ss * kDotTile, x_tile, y_tile);
        const double gg = tile_dot(g, tt * kDotTile, g, ss * kDotTile, x_tile, y_tile);
        const double multiplicity = tt == ss ? 1.0 : 2.0;
        weight_sq += multiplicity * aa * gg;
        bias_sq += multiplicity * gg;
      }
    }
    const double total =
        block_sum<kBlockThreads>(weight_sq + (bias ? bias_sq : 0.0), scratch);
    if (threadIdx.x == 0) store_sum(sq + i, total, accumulate);
  }
}

// Direct form, cheaper when 2 T^2 > K d: form G_i = g_i^T a_i tile by tile
// (each thread one (k, j) entry, summed over t) and add up the squares; the bias
// term sums each column of g_i over t.
template <typename Real>
__global__ void __launch_bounds__(kBlockThreads, (kTiledNormMinBlocks<Real, false>)) linear_sq_norms_direct_kernel(
    const Real* __restrict__ acts,   // [B, T, d]
    const Real* __restrict__ grads,  // [B, T, K]
    std::int64_t B, std::int64_t T, std::int64_t d, std::int64_t K, bool bias,
    double* __restrict__ sq,  // [B]
    bool accumulate) {
  __shared__ Real x_tile[kDotTile][kDotDepth + 1];
  __shared__ Real y_tile[kDotTile][kDotDepth + 1];
  __shared__ double scratch[kBlockThreads / 32];
  const std::int64_t k_tiles = (K + kDotTile - 1) / kDotTile;
  const std::int64_t j_tiles = (d + kDotTile - 1) / kDotTile;
  for (std::int64_t i = blockIdx.x; i < B; i += gridDim.x) {
    const Real* a_i = acts + i * T * d;
    const Real* g_i = grads + i * T * K;
    const StridedMatrix<Real> g_transposed{g_i, K, T, 1, K};  // (k, t)
    const StridedMatrix<Real> a_transposed{a_i, d, T, 1, d};  // (j, t)
    double weight_sq = 0.0;
    for (std::int64_t kt = 0; kt < k_tiles; ++kt) {
      for (std::int64_t jt = 0; jt < j_tiles; ++jt) {
        const double entry = tile_dot(g_transposed, kt * kDotTile, a_transposed, jt * kDotTile,
                                      x_tile, y_tile);
        weight_sq += entry * entry;
      }
    }
    double bias_sq = 0.0;
    if (bias) {
      for (std::int64_t k = threadIdx.x; k < K; k += kBlockThreads) {
        double column_sum = 0.0;
        for (std::int64_t t = 0; t < T; ++t) column_sum += static_cast<double>(g_i[t * K + k]);
        bias_sq += column_sum * column_sum;
      }
    }
    const double total = block_sum<kBlockThreads>(weight_sq + bias_sq, scratch);
    if (threadIdx.x == 0) store_sum(sq + i, total, accumulate);
  }
}

// ---------------------------------------------------------------------------
// Clipped linear sum: (factors (.) g)^T a as one GEMM over the R = B*T rows.

// weight_partials[s, k, j] = sum over the rows r of slab s of
// factors[r / T] * grads[r, k] * acts[r, j]; with bias, column j = d of the
// tile is a virtual column of ones in `acts`, whose results go to
// bias_partials[s, k]. Block (x, y, s): output tile (k0, j0) = (64 y, 64 x) of
// slab s; the factor is applied while staging g (in float64, rounded once to
// Real), so the inner loop is a plain FMA micro-kernel. Accumulates in Real,
// rows in increasing order.
template <typename Real>
__global__ void __launch_bounds__(kBlockThreads) clipped_linear_gemm_kernel(
    const Real* __restrict__ acts,       // [R, d]
    const Real* __restrict__ grads,      // [R, K]
    const double* __restrict__ factors,  // [R / T]
    std::int64_t R, std::int64_t T, std::int64_t d, std::int64_t K, bool bias,
    std::int64_t rows_per_slab,
    Real* __restrict__ weight_partials,  // [slabs, K, d], slabs = gridDim.z
    Real* __restrict__ bias_partials) {  // [slabs, K] (only with bias)
  __shared__ Real g_tile[kGemmDepth][kGemmTile];
  __shared__ Real a_tile[kGemmDepth][kGemmTile];
  __shared__ double row_factor[kGemmDepth];
  const int ty = static_cast<int>(threadIdx.x) / kGemmThreadsPerSide;
  const int tx = static_cast<int>(threadIdx.x) % kGemmThreadsPerSide;
  const std::int64_t k0 = static_cast<std::int64_t>(blockIdx.y) * kGemmTile;
  const std::int64_t j0 = static_cast<std::int64_t>(blockIdx.x) * kGemmTile;
  const std::int64_t slab = blockIdx.z;
  const std::int64_t row_begin = slab * rows_per_slab;
  const std::int64_t row_end = std::min(R, row_begin + rows_per_slab);

  Real acc[kGemmMicro][kGemmMicro];
#pragma unroll
  for (int m = 0; m < kGemmMicro; ++m) {
#pragma unroll
    for (int n = 0; n < kGemmMicro; ++n) acc[m][n] = Real(0);
  }

  for (std::int64_t r0 = row_begin; r0 < row_end; r0 += kGemmDepth) {
    // One 64-bit division per row of the stage instead of one per element.
    // (Safe to overwrite: every thread finished reading row_factor before the
    // previous stage's second barrier.)
    if (threadIdx.x < kGemmDepth) {
      const std::int64_t r = r0 + threadIdx.x;
      row_factor[threadIdx.x] = r < row_end ? factors[r / T] : 0.0;
    }
    __syncthreads();
    for (int e = threadIdx.x; e < kGemmDepth * kGemmTile; e += kBlockThreads) {
      const int rr = e / kGemmTile;
      const int cc = e % kGemmTile;
      const std::int64_t r = r0 + rr;
      const double f = row_factor[rr];
      // A zero factor drops the sample (and pads past row_end): its g and a may
      // hold NaN, and 0 * NaN is NaN, so neither is read.
      const bool keep = f != 0.0;
      const std::int64_t k = k0 + cc;
      const std::int64_t j = j0 + cc;
      g_tile[rr][cc] =
          (keep && k < K) ? static_cast<Real>(f * static_cast<double>(grads[r * K + k])) : Real(0);
      Real a = Real(0);
      if (keep) {
        if (j < d) {
          a = acts[r * d + j];
        } else if (bias && j == d) {
          a = Real(1);
        }
      }
      a_tile[rr][cc] = a;
    }
    __syncthreads();
#pragma unroll
    for (int rr = 0; rr < kGemmDepth; ++rr) {
      Real gv[kGemmMicro];
      Real av[kGemmMicro];
#pragma unroll
      for (int m = 0; m < kGemmMicro; ++m) gv[m] = g_tile[rr][ty + kGemmThreadsPerSide * m];
#pragma unroll
      for (int n = 0; n < kGemmMicro; ++n) av[n] = a_tile[rr][tx + kGemmThreadsPerSide * n];
#pragma unroll
      for (int m = 0; m < kGemmMicro; ++m) {
#pragma unroll
        for (int n = 0; n < kGemmMicro; ++n) acc[m][n] += gv[m] * av[n];
      }
    }
  }

#pragma unroll
  for (int m = 0; m < kGemmMicro; ++m) {
    const std::int64_t k = k0 + ty + kGemmThreadsPerSide * m;
    if (k >= K) continue;
#pragma unroll
    for (int n = 0; n < kGemmMicro; ++n) {
      const std::int64_t j = j0 + tx + kGemmThreadsPerSide * n;
      if (j < d) {
        weight_partials[(slab * K + k) * d + j] = acc[m][n];
      } else if (bias && j == d) {
        bias_partials[slab * K + k] = acc[m][n];
      }
    }
  }
}

}  // namespace

// ---------------------------------------------------------------------------
// Launchers.

// out[i, j] = x[i, j] * factors[i] in float64, rounded once to Real. A thread
// a 16-byte vector of a row (kAligned: every row starts on a 16-byte boundary,
// m a multiple of the vector width) or an element, grid-striding. Why: torch's
// multiply of float32 by float64 into float32 takes its mixed-dtype path, one
// element a thread with casts: 14 us a BERT-base operand (12.6 MB in, 12.6
// out, 1.8 TB/s) on the H200 (2026-11-30), 74 of them a step.
template <typename Real, bool kAligned>
__global__ void __launch_bounds__(kBlockThreads) scale_rows_kernel(
    const Real* __restrict__ x,          // [B, m]
    const double* __restrict__ factors,  // [B]
    std::int64_t B, std::int64_t m,
    Real* __restrict__ out) {  // [B, m]
  constexpr int kWidth = kAligned ? Vec16<Real>::kWidth : 1;
  const std::int64_t per_row = m / kWidth;
  const std::int64_t total = B * per_row;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t v = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       v < total; v += stride) {
    const std::int64_t i = v / per_row;
    const double f = factors[i];
    const std::int64_t at = v * kWidth;  // row i, column (v % per_row) * kWidth
    if constexpr (kAligned) {
      typename Vec16<Real>::type in = *reinterpret_cast<const typename Vec16<Real>::type*>(x + at);
      Real* lanes = reinterpret_cast<Real*>(&in);
#pragma unroll
      for (int q = 0; q < kWidth; ++q) {
        lanes[q] = static_cast<Real>(f * static_cast<double>(lanes[q]));
      }
      *reinterpret_cast<typename Vec16<Real>::type*>(out + at) = in;
    } else {
      out[at] = static_cast<Real>(f * static_cast<double>(x[at]));
    }
  }
}

template <typename Real>
void launch_scale_rows(const Real* x, const double* factors, std::int64_t B, std::int64_t m,
                       Real* out, cudaStream_t stream) {
  if (B <= 0 || m <= 0) return;
  constexpr int kWidth = Vec16<Real>::kWidth;
  if (is_aligned16(x) && is_aligned16(out) && m % kWidth == 0) {
    NCDP_LAUNCH(grid_blocks(B * (m / kWidth), kBlockThreads), kBlockThreads, 0, stream,
                scale_rows_kernel<Real, true>)(x, factors, B, m, out);
  } else {
    NCDP_LAUNCH(grid_blocks(B * m, kBlockThreads), kBlockThreads, 0, stream,
                scale_rows_kernel<Real, false>)(x, factors, B, m, out);
  }
}

template <typename Real>
void launch_row_sq_norms(const Real* grads, std::int64_t B, std::int64_t p, double* sq,
                         bool accumulate, cudaStream_t stream) {
  if (B <= 0) return;
  NCDP_LAUNCH(grid_blocks(B, 1), kBlockThreads, 0, stream, row_sq_norms_kernel<Real>)(
      grads, B, p, /*segments=*/1, /*segment_len=*/p, sq, accumulate);
}

std::int64_t linear_norm_slices(std::int64_t B, std::int64_t layers, std::int64_t T) {
  const std::int64_t samples = B * layers;
  if (samples <= 0 || T <= 0) return 0;
  const std::int64_t max_slices = std::max<std::int64_t>(1, T * T / kNormSliceMinCells);
  return std::min({T, max_slices, ceil_div(kNormSliceTargetBlocks, samples)});
}

std::int64_t linear_norms_from_grams_workspace_bytes(std::int64_t B, std::int64_t layers,
                                                     std::int64_t T) {
  const std::int64_t slices = linear_norm_slices(B, layers, T);
  return align_bytes(B * layers * slices * kNormPartials * std::int64_t{sizeof(double)});
}

GramRounding gram32_rounding(std::int64_t w_length, std::int64_t v_length) {
  // reference.gram32_rounding: each constant correctly rounded from its formula.
  const auto model = [](std::int64_t n, double (&r)[3]) {
    const double nu = static_cast<double>(n) * 0x1p-24;
    r[0] = nu / (1.0 - nu);
    r[1] = 0x1p-125 * std::sqrt(static_cast<double>(n));
    r[2] = static_cast<double>(n) * 0x1p-124;
  };
  GramRounding r{};
  r.enabled = true;
  model(w_length, r.w);
  model(v_length, r.v);
  return r;
}

template <typename Gram>
void launch_linear_norms_from_grams(const Gram* w, const Gram* v, std::int64_t B,
                                    std::int64_t layers, std::int64_t T, bool bias,
                                    bool shared_w, const GramRounding& rounding, double* sq,
                                    bool accumulate, double* spread, double* sizes,
                                    void* workspace, cudaStream_t stream) {
  if (B <= 0) return;
  // T = 0 or no layers: no partials, and the finish writes empty sums (0).
  const std::int64_t slices = linear_norm_slices(B, layers, T);
  const std::int64_t rows_per_slice = slices > 0 ? ceil_div(T, slices) : 0;
  const std::int64_t used = slices > 0 ? ceil_div(T, rows_per_slice) : 0;
  double* partials = static_cast<double*>(workspace);
  if (used > 0) {
    NCDP_LAUNCH(grid_blocks(B * layers * used, 1), kBlockThreads, 0, stream,
                linear_norm_partials_kernel<Gram>)(w, v, B * layers, shared_w ? B : B * layers,
                                                   T, used, rows_per_slice, bias ? 1.0 : 0.0,
                                                   rounding, partials);
  }
  // A warp a sample.
  NCDP_LAUNCH(grid_blocks(B, kBlockThreads / 32), kBlockThreads, 0, stream,
              linear_norms_from_partials_kernel)(partials, B, layers, T, used, rounding, sq,
                                                 accumulate, spread, sizes);
}

#define NCDP_INSTANTIATE_NORMS_FROM_GRAMS(Gram)                                              \
  template void launch_linear_norms_from_grams<Gram>(                                        \
      const Gram*, const Gram*, std::int64_t, std::int64_t, std::int64_t, bool, bool,        \
      const GramRounding&, double*, bool, double*, double*, void*, cudaStream_t);
NCDP_INSTANTIATE_NORMS_FROM_GRAMS(float)
NCDP_INSTANTIATE_NORMS_FROM_GRAMS(double)
#undef NCDP_INSTANTIATE_NORMS_FROM_GRAMS

void launch_clip_factors(const double* sq, const double* spread, std::int64_t B,
                         const ClipRuleTable& rules, double scale, double* factors,
                         double* norms, std::int64_t group_stride, double* weights,
                         cudaStream_t stream) {
  const std::int64_t rows = static_cast<std::int64_t>(rules.count) * B;
  if (rows <= 0) return;
  NCDP_LAUNCH(grid_blocks(rows, kBlockThreads), kBlockThreads, 0, stream,
              clip_factors_kernel<ClipRuleTable>)(
      sq, spread, B, rows, /*segments=*/1, rules, scale, factors, norms, group_stride, weights);
}

std::int64_t weighted_row_sum_slabs(std::int64_t B, std::int64_t p) {
  if (B <= 0 || p <= 0) return 0;
  const std::int64_t column_threads =
      ceil_div(ceil_div(p, kColumnsPerThread), kBlockThreads) * kBlockThreads;
  std::int64_t slabs = ceil_div(kRowSumTargetThreads, column_threads);
  slabs = std::min(slabs, ceil_div(B, kRowSumMinRowsPerSlab));
  slabs = std::min(slabs, kMaxSlabs);
  return std::max<std::int64_t>(slabs, 1);
}

std::int64_t weighted_row_sum_workspace_bytes(std::int64_t B, std::int64_t p) {
  return align_bytes(weighted_row_sum_slabs(B, p) * p * std::int64_t{sizeof(double)});
}

template <typename Real, typename Out>
void launch_weighted_row_sum_noise(const Real* grads, const double* factors, std::int64_t B,
                                   std::int64_t p, double noise_std, double inv_denom,
                                   std::uint64_t seed, std::uint64_t offset, Out* out,
                                   void* workspace, cudaStream_t stream) {
  if (p <= 0) return;
  const std::int64_t slabs = weighted_row_sum_slabs(B, p);
  double* partials = static_cast<double*>(workspace);
  if (slabs > 0) {
    launch_weighted_row_sum_partials(grads, factors, B, p, slabs, partials,
                                     /*accumulate=*/false, stream);
  }
  launch_slab_sum_plus_gaussian<double, Out>(partials, slabs, p, noise_std, inv_denom, seed,
                                             offset, out, stream);
}

ClipNoiseRowsLayout clip_noise_rows_layout(std::int64_t B, std::int64_t p) {
  ClipNoiseRowsLayout layout{};
  layout.norm_segments = std::max<std::int64_t>(1, ceil_div(p, kDenseNormSegment));
  layout.slabs = weighted_row_sum_slabs(B, p);
  layout.factors_offset = 0;
  layout.sq_partials_offset = layout.factors_offset + align_bytes(B * sizeof(double));
  layout.partials_offset =
      layout.sq_partials_offset + align_bytes(B * layout.norm_segments * sizeof(double));
  layout.flags_offset =
      layout.partials_offset + align_bytes(layout.slabs * p * std::int64_t{sizeof(double)});
  layout.total_bytes = layout.flags_offset + align_bytes(one_pass_flag_words(B) * 4);
  return layout;
}

template <typename Real>
void launch_clip_noise_rows(const Real* grads, std::int64_t B, std::int64_t p, double max_norm,
                            double noise_std, double inv_denom, std::uint64_t seed,
                            std::uint64_t offset, Real* out, double* norms, void* workspace,
                            std::int64_t l2_bytes, std::int64_t one_pass_blocks,
                            cudaStream_t stream) {
  const ClipNoiseRowsLayout layout = clip_noise_rows_layout(B, p);
  const ClipRule rule{max_norm, p, 1, unit_roundoff<Real>()};
  if (one_pass_blocks != 0 &&
      launch_clip_noise_rows_one_pass(grads, B, p, rule, noise_std, inv_denom, seed, offset, out,
                                      norms, layout, workspace, l2_bytes, one_pass_blocks,
                                      stream)) {
    return;
  }
  char* base = static_cast<char*>(workspace);
  double* factors = reinterpret_cast<double*>(base + layout.factors_offset);
  double* sq_partials = reinterpret_cast<double*>(base + layout.sq_partials_offset);
  double* partials = reinterpret_cast<double*>(base + layout.partials_offset);

  // Rows go in chunks of about half the L2: the norms pass pulls a chunk from
  // DRAM and the weighted-sum pass over the same rows then hits L2, so the
  // gradients cross the DRAM bus once. Chunk partials accumulate into the same
  // slab rows, in chunk order.
  const std::int64_t row_bytes = p * static_cast<std::int64_t>(sizeof(Real));
  std::int64_t chunk_rows = B;
  if (l2_bytes > 0 && row_bytes > 0) {
    chunk_rows = std::max<std::int64_t>(1, (l2_bytes / 2) / row_bytes);
  }
  // With several chunks every chunk reads and writes all slab partials, so
  // they must stay in the L2 beside the chunk (a quarter of it): with the
  // one-pass sizing (11 slabs at (1024, 409600) float32, 36 MB of partials, 64
  // chunks of a 50 MiB L2) they moved 2.75 bytes per gradient byte, mostly
  // through DRAM (bench/dense_traffic.py), where the first GPU run measured the
  // op at 0.14 of the read limit.
  std::int64_t slabs = layout.slabs;
  if (chunk_rows < B) {
    const std::int64_t fit = (l2_bytes / 4) / (p * std::int64_t{sizeof(double)});
    slabs = std::max<std::int64_t>(1, std::min(slabs, fit));
  }
  for (std::int64_t r0 = 0; r0 < B; r0 += chunk_rows) {
    const std::int64_t rows = std::min(chunk_rows, B - r0);
    NCDP_LAUNCH(grid_blocks(rows * layout.norm_segments, 1), kBlockThreads, 0, stream,
        row_sq_norms_kernel<Real>)(
            grads + r0 * p, rows, p, layout.norm_segments, kDenseNormSegment,
            sq_partials + r0 * layout.norm_segments, /*accumulate=*/false);
    NCDP_LAUNCH(grid_blocks(rows, kBlockThreads), kBlockThreads, 0, stream,
                clip_factors_kernel<OneClipRule>)(
        sq_partials + r0 * layout.norm_segments, nullptr, rows, rows, layout.norm_segments,
        OneClipRule{rule}, /*scale=*/1.0, factors + r0, norms + r0, /*group_stride=*/0,
        /*weights=*/nullptr);
    if (p > 0) {
      launch_weighted_row_sum_partials(grads + r0 * p, factors + r0, rows, p, slabs, partials,
                                       /*accumulate=*/r0 > 0, stream);
    }
  }
  launch_slab_sum_plus_gaussian<double, Real>(partials, slabs, p, noise_std, inv_denom, seed,
                                              offset, out, stream);
}

template <typename Real>
void launch_linear_sq_norms(const Real* acts, const Real* grads, std::int64_t B, std::int64_t T,
                            std::int64_t d, std::int64_t K, bool bias, double* sq,
                            bool accumulate, double* sizes, cudaStream_t stream) {
  if (B <= 0) return;
  const unsigned int blocks = grid_blocks(B, 1);
  if (T == 1) {
    NCDP_LAUNCH(blocks, kBlockThreads, 0, stream, linear_sq_norms_rank1_kernel<Real>)(
        acts, grads, B, d, K, bias, sq, accumulate, sizes);
  } else if (2.0 * static_cast<double>(T) * static_cast<double>(T) <=
             static_cast<double>(K) * static_cast<double>(d)) {
    NCDP_LAUNCH(blocks, kBlockThreads, 0, stream, linear_sq_norms_gram_kernel<Real>)(
        acts, grads, B, T, d, K, bias, sq, accumulate);
  } else {
    NCDP_LAUNCH(blocks, kBlockThreads, 0, stream, linear_sq_norms_direct_kernel<Real>)(
        acts, grads, B, T, d, K, bias, sq, accumulate);
  }
}

std::int64_t clipped_linear_sum_slabs(std::int64_t rows, std::int64_t d, std::int64_t K) {
  if (rows <= 0 || K <= 0) return 0;
  // d + 1: the bias column, counted whether or not it is used.
  const std::int64_t tiles = ceil_div(d + 1, kGemmTile) * ceil_div(K, kGemmTile);
  std::int64_t slabs = ceil_div(kGemmTargetBlocks, tiles);
  slabs = std::min(slabs, ceil_div(rows, kGemmMinRowsPerSlab));
  slabs = std::min(slabs, kMaxSlabs);
  return std::max<std::int64_t>(slabs, 1);
}

std::int64_t clipped_linear_sum_layout_bytes(std::int64_t slabs, std::int64_t d, std::int64_t K,
                                             std::int64_t element_bytes) {
  // One slab needs no workspace: the GEMM writes straight into gw / gb.
  if (slabs <= 1) return 0;
  return align_bytes(slabs * K * d * element_bytes) + align_bytes(slabs * K * element_bytes);
}

std::int64_t clipped_linear_sum_slabs_within(std::int64_t rows, std::int64_t d, std::int64_t K,
                                             std::int64_t workspace_bytes,
                                             std::int64_t element_bytes) {
  std::int64_t slabs = clipped_linear_sum_slabs(rows, d, K);
  if (slabs <= 1) return slabs;
  // The regions are padded to 256 bytes, so slabs * (K d + K) elements is a
  // lower bound on the layout: start there and step down to what fits exactly.
  slabs = std::min(slabs, workspace_bytes / ((K * d + K) * element_bytes));
  while (slabs > 1 && clipped_linear_sum_layout_bytes(slabs, d, K, element_bytes) >
                          workspace_bytes) {
    --slabs;
  }
  return std::max<std::int64_t>(slabs, 1);
}

template <typename Real>
void launch_clipped_linear_sum(const Real* acts, const Real* grads, const double* factors,
                               std::int64_t B, std::int64_t T, std::int64_t d, std::int64_t K,
                               double noise_std, double inv_denom, std::uint64_t seed,
                               std::uint64_t offset, Real* gw, Real* gb, void* workspace,
                               std::int64_t workspace_bytes, cudaStream_t stream) {
  if (K <= 0) return;
  const bool bias = gb != nullptr;
  const std::int64_t R = B * T;
  const std::int64_t weight_count = K * d;

  // With 0 or 1 slabs the GEMM writes its sums into gw / gb and the noise is
  // added in place.
  const std::int64_t slabs =
      clipped_linear_sum_slabs_within(R, d, K, workspace_bytes, sizeof(Real));
  Real* weight_partials = gw;
  Real* bias_partials = gb;
  if (slabs > 1) {
    char* base = static_cast<char*>(workspace);
    weight_partials = reinterpret_cast<Real*>(base);
    bias_partials = reinterpret_cast<Real*>(base + align_bytes(slabs * weight_count *
                                                               static_cast<std::int64_t>(
                                                                   sizeof(Real))));
  }

  if (slabs > 0) {
    const std::int64_t columns = d + (bias ? 1 : 0);
    const std::int64_t rows_per_slab = ceil_div(ceil_div(R, slabs), kGemmDepth) * kGemmDepth;
    const dim3 grid(static_cast<unsigned int>(ceil_div(columns, kGemmTile)),
                    static_cast<unsigned int>(ceil_div(K, kGemmTile)),
                    static_cast<unsigned int>(slabs));
    NCDP_LAUNCH(grid, kBlockThreads, 0, stream, clipped_linear_gemm_kernel<Real>)(
        acts, grads, factors, R, T, d, K, bias, rows_per_slab, weight_partials, bias_partials);
  }
  launch_slab_sum_plus_gaussian<Real, Real>(weight_partials, slabs, weight_count, noise_std,
                                            inv_denom, seed, offset, gw, stream);
  if (bias) {
    launch_slab_sum_plus_gaussian<Real, Real>(bias_partials, slabs, K, noise_std, inv_denom,
                                              seed, offset + static_cast<std::uint64_t>(weight_count),
                                              gb, stream);
  }
}

// ---------------------------------------------------------------------------
// Instantiations.

#define NCDP_INSTANTIATE_CLIP(Real)                                                           \
  template void launch_row_sq_norms<Real>(const Real*, std::int64_t, std::int64_t, double*,    \
                                          bool, cudaStream_t);                                 \
  template void launch_scale_rows<Real>(const Real*, const double*, std::int64_t, std::int64_t, \
                                        Real*, cudaStream_t);                                  \
  template void launch_weighted_row_sum_noise<Real, Real>(                                     \
      const Real*, const double*, std::int64_t, std::int64_t, double, double, std::uint64_t,   \
      std::uint64_t, Real*, void*, cudaStream_t);                                              \
  template void launch_clip_noise_rows<Real>(const Real*, std::int64_t, std::int64_t, double,  \
                                             double, double, std::uint64_t, std::uint64_t,     \
                                             Real*, double*, void*, std::int64_t,              \
                                             std::int64_t, cudaStream_t);                      \
  template void launch_linear_sq_norms<Real>(const Real*, const Real*, std::int64_t,           \
                                             std::int64_t, std::int64_t, std::int64_t, bool,   \
                                             double*, bool, double*, cudaStream_t);            \
  template void launch_clipped_linear_sum<Real>(                                               \
      const Real*, const Real*, const double*, std::int64_t, std::int64_t, std::int64_t,       \
      std::int64_t, double, double, std::uint64_t, std::uint64_t, Real*, Real*, void*,         \
      std::int64_t, cudaStream_t);

NCDP_INSTANTIATE_CLIP(float)
NCDP_INSTANTIATE_CLIP(double)
#undef NCDP_INSTANTIATE_CLIP
template void launch_weighted_row_sum_noise<float, double>(
    const float*, const double*, std::int64_t, std::int64_t, double, double, std::uint64_t,
    std::uint64_t, double*, void*, cudaStream_t);

}  // namespace kernels
}  // namespace ncdp
