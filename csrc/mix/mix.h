// Kernel 2 of DESIGN.md: Poisson / hierarchical subsampling with averaging.
// ncdp_fast/reference.py ("Kernel 2") is the specification of the sampler.
//
// The population is G groups in CSR form: group k holds the example ids
// members[group_ptr[k] .. group_ptr[k+1]) (increasing), or, with members == 0,
// the ids group_ptr[k] .. group_ptr[k+1]-1. Output row r draws from sub-stream
// sid = 1 + offset + r * row_stride (uint64 arithmetic):
//   * with select_rate, uniforms 0 .. G-1 pick the groups (group k iff
//     u_k < select_rate[k]) and the walk starts at uniform G; without it every
//     group is taken and the walk starts at uniform 0;
//   * the selected groups are walked in increasing k, continuing one sequence
//     of uniforms: with q = walk_rate[k], gap = floor(log(u) / log1p(-q))
//     members are skipped, the next one is selected, and the group ends with
//     the uniform whose step passes its last member (an empty group still
//     spends that one uniform; q == 0 selects nothing).
// A row's members come out group by group, increasing within a group. Rates
// are the caller's to validate (select_rate in [0, 1], walk_rate in (0, 1]);
// out-of-range rates end walks, they never index outside a group. Every group
// must hold fewer than 2^53 members.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace ncdp {

// ---- Python-facing wrappers (pointers as integers, dtype 0 = float32,
// 1 = float64, stream a cudaStream_t as an integer; members and select_rate
// may be 0). Sizes are validated, empty work returns at once, CUDA errors raise.

// counts[r] = number of examples row r selects, r < rows.
void launch_sample_counts(std::uintptr_t group_ptr,  // [G + 1] int64
                          std::uintptr_t members,    // [group_ptr[G]] int64, or 0
                          std::int64_t G,
                          std::uintptr_t select_rate,  // [G] float64, or 0
                          std::uintptr_t walk_rate,    // [G] float64
                          std::int64_t rows, std::int64_t row_stride, std::uint64_t seed,
                          std::uint64_t offset,
                          std::uintptr_t counts,  // [rows] int64
                          std::uintptr_t stream);

// indices[indptr[r] .. indptr[r+1]) = the ids row r selects, in sampler order;
// indptr is the exclusive prefix sum of launch_sample_counts' counts (a row
// never writes beyond indptr[r+1]).
void launch_sample_fill(std::uintptr_t group_ptr, std::uintptr_t members, std::int64_t G,
                        std::uintptr_t select_rate, std::uintptr_t walk_rate, std::int64_t rows,
                        std::int64_t row_stride, std::uint64_t seed, std::uint64_t offset,
                        std::uintptr_t indptr,   // [rows + 1] int64
                        std::uintptr_t indices,  // [indptr[rows]] int64
                        std::uintptr_t stream);

// Row r (row_stride d + K, noise base b = offset + r (d + K)):
//   out_x[r, j] = inv_m * sum_i c_i features[i, j] + noise_std_x * normal(seed, b + j),
//   out_y[r, k] = inv_m * sum_i y_i[k]             + noise_std_y * normal(seed, b + d + k),
// over the ids i that row r selects; c_i = the clip factor of clip/clip_rule.cuh
// (terms = d, the dtype's unit; norm in float64; c_i x_i formed in float64 and
// rounded once; clip_x <= 0: c_i = 1), y_i = onehot(labels[i]) or
// soft_labels[i]. Sums in the dtype (rows in sampler order), scaled and noised
// in float64, rounded once. counts[r] = number selected. Consumes rows (d + K)
// main-stream draws. Ids must be in [0, n).
void launch_mix_rows(std::uintptr_t features,  // [n, d], dtype
                     int dtype, std::int64_t n, std::int64_t d,
                     std::uintptr_t labels,       // [n] int64 (used when soft_labels == 0)
                     std::uintptr_t soft_labels,  // [n, K], dtype, or 0
                     std::int64_t K, std::uintptr_t group_ptr, std::uintptr_t members,
                     std::int64_t G, std::uintptr_t select_rate, std::uintptr_t walk_rate,
                     std::int64_t rows, std::uint64_t seed, std::uint64_t offset, double inv_m,
                     double clip_x, double noise_std_x, double noise_std_y,
                     std::uintptr_t out_x,   // [rows, d], dtype
                     std::uintptr_t out_y,   // [rows, K], dtype
                     std::uintptr_t counts,  // [rows] int64
                     std::uintptr_t stream);

// ---- Typed launchers (kernels + launch code in mix.cu). They assume validated
// arguments and the right current device.
namespace kernels {

struct GroupSampling {
  const std::int64_t* group_ptr;  // [G + 1]
  const std::int64_t* members;    // [group_ptr[G]] or nullptr (identity)
  std::int64_t G;
  const double* select_rate;  // [G] or nullptr (every group)
  const double* walk_rate;    // [G]
};

void launch_sample_counts(const GroupSampling& sampling, std::int64_t rows,
                          std::uint64_t row_stride, std::uint64_t seed, std::uint64_t offset,
                          std::int64_t* counts,  // [rows]
                          cudaStream_t stream);

void launch_sample_fill(const GroupSampling& sampling, std::int64_t rows,
                        std::uint64_t row_stride, std::uint64_t seed, std::uint64_t offset,
                        const std::int64_t* indptr,  // [rows + 1]
                        std::int64_t* indices,       // [indptr[rows]] or nullptr when empty
                        cudaStream_t stream);

template <typename Real>
void launch_mix_rows(const Real* features,  // [n, d]
                     std::int64_t n, std::int64_t d,
                     const std::int64_t* labels,  // [n] (hard labels) or nullptr
                     const Real* soft_labels,     // [n, K] or nullptr
                     std::int64_t K, const GroupSampling& sampling, std::int64_t rows,
                     std::uint64_t seed, std::uint64_t offset, double inv_m, double clip_x,
                     double noise_std_x, double noise_std_y,
                     Real* out_x,           // [rows, d]
                     Real* out_y,           // [rows, K]
                     std::int64_t* counts,  // [rows]
                     cudaStream_t stream);

}  // namespace kernels
}  // namespace ncdp
