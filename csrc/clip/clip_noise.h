// Kernel 1 of DESIGN.md: per-sample clipping with Gaussian noise, dense rows and
// factored linear layers. Norms and clip factors are float64; every reduction is
// deterministic (fixed-order trees and slab sums, no floating-point atomics).
//
// Clip factors follow clip/clip_rule.cuh (reference.clip_factors): 1 if the
// rounding-aware bound of the row's norm is <= C, C / bound if it is finite and
// larger, 0 if it is not finite. Factors multiply rows in float64. Rows with
// factor 0 are skipped by the sums (their entries may be NaN, and 0 * NaN is
// NaN); the Python layer raises on them or reports them as dropped.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "clip/clip_rule.cuh"

namespace ncdp {

// ---- Python-facing wrappers (pointers as integers, dtype 0 = float32, 1 = float64,
// stream a cudaStream_t as an integer). Sizes are validated, empty work returns
// at once, CUDA errors raise.

// sq[i] (=, or += when accumulate) sum_j g[i, j]^2, accumulated in float64.
void launch_row_sq_norms(std::uintptr_t g,  // [B, p], dtype, row-major contiguous
                         std::int64_t B, std::int64_t p, int dtype,
                         std::uintptr_t sq,  // [B] float64
                         bool accumulate, std::uintptr_t stream);

// out[i, j] = x[i, j] * factors[i], each product formed in float64 and rounded
// once to dtype (the clipped GEMM's scaled operand, the numba twin's
// _scale_rows value for value): one read of x and one write of out, 16-byte
// accesses where both are aligned.
void launch_scale_rows(std::uintptr_t x,        // [B, m], dtype, row-major contiguous
                       std::int64_t B, std::int64_t m, int dtype,
                       std::uintptr_t factors,  // [B] float64
                       std::uintptr_t out,      // [B, m], dtype, row-major contiguous
                       std::uintptr_t stream);

std::int64_t linear_norms_from_grams_workspace_bytes(std::int64_t B, std::int64_t layers,
                                                     std::int64_t T);

// A linear layer's per-sample squared gradient norms from its two Grams
// (the device route forms W_i = A_i A_i^T and V_i = G_i G_i^T with the
// vendor's GEMM), for `layers` layers of one shape stacked along the
// batch (sample i = l * B + b); with shared_w the layers read one input (the
// q, k and v projections of an attention block) and W holds its B Grams once
// (W_i = W[b]). Per sample b, in float64, layers in order:
//   sq[b] (=, or += when accumulate) sum_l sum_{t,s} (W_i[t,s] + bias) V_i[t,s],
//   spread[b] += sum_l sum_t sqrt(V_i[t,t]) (sqrt(W_i[t,t]) + bias)  (if given),
//   sizes[i] = (sum_t W_i[t,t], sum_t V_i[t,t])                        (if given):
// the norm, the scale of its rounding (reference.linear_spread) and the
// operands' squared norms, in two launches instead of a dozen element-wise
// ops. The summation order depends on (B, layers, T) only.
// gram_dtype 1: float64 Grams. gram_dtype 0: float32 GEMMs of dot lengths
// w_length (d) and v_length (K) in [1, 2^20], TF32 off: each layer's norm is
// then the upper bound of reference.linear_norms_from_grams(lengths=(d, K))
// (the Hadamard sum plus the Grams' largest rounding effect) and its spread
// is formed from the diagonals' root bounds (docs/privacy.md).
void launch_linear_norms_from_grams(std::uintptr_t w,  // [(shared_w ? 1 : layers) * B, T, T]
                                    std::uintptr_t v,  // [layers * B, T, T], gram_dtype
                                    std::int64_t B, std::int64_t layers, std::int64_t T,
                                    bool bias, bool shared_w, int gram_dtype,
                                    std::int64_t w_length, std::int64_t v_length,
                                    std::uintptr_t sq,  // [B] float64
                                    bool accumulate,
                                    std::uintptr_t spread,  // [B] float64, or 0
                                    std::uintptr_t sizes,   // [layers * B, 2] float64, or 0
                                    std::uintptr_t workspace,  // ..._workspace_bytes
                                    std::int64_t workspace_bytes, std::uintptr_t stream);

// Groups of rows, each with its own rule (per-layer clipping: a group a
// parameter, its own bound and rounding terms; flat clipping: one group), in
// one launch a kMaxClipGroups groups. With s = scale (the clip op's
// grad_scale: the blocks hold gradients / s) and each product rounded on its
// own, for group g and sample i: the norm sqrt(s^2 sq[g, i]) at
// out[g * stride + B + i], the factor clip_factor(s^2 sq[g, i], s spread[g, i])
// of clip/clip_rule.cuh with (max_norm[g], terms[g], seq_len[g], unit) at
// out[g * stride + i], and weights[g, i] = that factor times s where weights
// is given. scale 1 gives the rule on sq and spread as they are.
void launch_clip_factor_groups(std::uintptr_t sq,      // [groups, B] float64
                               std::uintptr_t spread,  // [groups, B] float64, or 0 for E = 0
                               std::int64_t groups, std::int64_t B,
                               const std::vector<double>& max_norm,       // [groups]
                               const std::vector<std::int64_t>& terms,    // [groups]
                               const std::vector<std::int64_t>& seq_len,  // [groups]
                               double unit,
                               std::uintptr_t out,  // [groups, stride] float64, stride >= 2 B
                               std::int64_t stride, std::uintptr_t stream, double scale,
                               std::uintptr_t weights);  // [groups, B] float64, or 0

std::int64_t weighted_row_sum_workspace_bytes(std::int64_t B, std::int64_t p, int dtype);

// out[j] = inv_denom * (sum_i factors[i] * g[i, j] + noise_std * normal(seed, offset + j)),
// the sum in float64, rounded once to out_dtype (-1: dtype; or 1, float64: the
// sum before its finish, which the clip op adds with other blocks' in one
// launch, launch_finish_gaussian_segments). Consumes p draws. B = 0 gives pure
// noise.
void launch_weighted_row_sum_noise(std::uintptr_t g,  // [B, p], dtype
                                   std::int64_t B, std::int64_t p, int dtype,
                                   std::uintptr_t factors,  // [B] float64
                                   double noise_std, double inv_denom, std::uint64_t seed,
                                   std::uint64_t offset,
                                   std::uintptr_t out,        // [p], out_dtype
                                   std::uintptr_t workspace,  // weighted_row_sum_workspace_bytes
                                   std::int64_t workspace_bytes, std::uintptr_t stream,
                                   int out_dtype);

std::int64_t clip_noise_rows_workspace_bytes(std::int64_t B, std::int64_t p, int dtype);

// The one-pass form's split of launch_clip_noise_rows(..., l2_bytes,
// one_pass_blocks) on the current device: (blocks, columns a block, rows a row
// block, row blocks, norm segments a row, norm items a row block, byte offset
// of its flags in the workspace); blocks 0: the two-pass form runs instead.
std::vector<std::int64_t> clip_noise_rows_one_pass_plan(std::int64_t B, std::int64_t p, int dtype,
                                                        std::int64_t l2_bytes,
                                                        std::int64_t one_pass_blocks);

// The fused dense op: norms (pre-clip), clip factors (terms = p, the unit of
// the dtype), and out = inv_denom * (sum_i factor_i g_i + noise_std * xi),
// xi = normals offset .. offset+p-1, the sum in float64. l2_bytes < 0: rows
// in chunks of half the device's L2; 0: one chunk (two passes over DRAM; the
// benchmark's peer of the chunked form); > 0: chunks sized for that L2.
// one_pass_blocks != 0: the one-pass form (kernels::launch_clip_noise_rows),
// its row blocks sized by the device's L2 when l2_bytes < 0.
void launch_clip_noise_rows(std::uintptr_t g,  // [B, p], dtype
                            std::int64_t B, std::int64_t p, int dtype, double max_norm,
                            double noise_std, double inv_denom, std::uint64_t seed,
                            std::uint64_t offset,
                            std::uintptr_t out,        // [p], dtype
                            std::uintptr_t norms,      // [B] float64
                            std::uintptr_t workspace,  // clip_noise_rows_workspace_bytes
                            std::int64_t workspace_bytes, std::uintptr_t stream,
                            std::int64_t l2_bytes, std::int64_t one_pass_blocks);

// sq[i] (=, or += when accumulate) ||G_i||_F^2 (+ ||sum_t g_it||^2 with bias),
// G_i = sum_t g_it a_it^T, in float64. T = 1 is the 2-D case; there (only)
// sizes[i] = (||a_i||^2, ||g_i||^2) too, the operands' squared norms the clip
// op's rebalancing decision reads.
void launch_linear_sq_norms(std::uintptr_t a,  // [B, T, d], dtype
                            std::uintptr_t g,  // [B, T, K], dtype
                            std::int64_t B, std::int64_t T, std::int64_t d, std::int64_t K,
                            int dtype, bool bias,
                            std::uintptr_t sq,  // [B] float64
                            bool accumulate, std::uintptr_t stream,
                            std::uintptr_t sizes);  // [B, 2] float64 (T == 1), or 0

std::int64_t clipped_linear_sum_workspace_bytes(std::int64_t B, std::int64_t T, std::int64_t d,
                                                std::int64_t K, int dtype);

// gw[k, j] = inv_denom * (sum_{i,t} factors[i] g[i,t,k] a[i,t,j] + noise_std * normal(offset + k*d + j)),
// gb[k]    = inv_denom * (sum_{i,t} factors[i] g[i,t,k]          + noise_std * normal(offset + K*d + k)).
// Consumes K*d (+ K with bias) draws. The workspace is optional: with none the
// GEMM has one output tile per block and no split of the B*T reduction; with
// clipped_linear_sum_workspace_bytes of it the reduction is split across blocks
// (results then depend on the workspace size, deterministically).
void launch_clipped_linear_sum(std::uintptr_t a,        // [B, T, d], dtype
                               std::uintptr_t g,        // [B, T, K], dtype
                               std::uintptr_t factors,  // [B] float64
                               std::int64_t B, std::int64_t T, std::int64_t d, std::int64_t K,
                               int dtype, double noise_std, double inv_denom, std::uint64_t seed,
                               std::uint64_t offset,
                               std::uintptr_t gw,  // [K, d], dtype
                               std::uintptr_t gb,  // [K], dtype, or 0 without bias
                               std::uintptr_t stream,
                               std::uintptr_t workspace,  // optional, see above
                               std::int64_t workspace_bytes);

// Per-sample gradients of a normalisation layer's affine parameters, y = w_c
// xhat + b_c (clip/norm_affine.cu): sample i's input x_i and output gradient
// g_i are `rows` rows of n values, each row normalised on its own, xhat = (x -
// mean) / sqrt(var + eps) with the biased variance over the row, in float64.
// Channels: run == 0 (LayerNorm) the value (r, e) is channel e (C = n), summed
// over the rows; run > 0 (GroupNorm, InstanceNorm) a row is a group of n / run
// channels of `run` consecutive values, channel r (n / run) + e / run (C = rows
// n / run). w[i, c] = sum g xhat and b[i, c] = sum g over channel c's values of
// sample i, float64 sums in an order fixed by the shape, rounded once to dtype;
// w or b 0: not formed. The workspace holds the rows' (mean, rstd).
std::int64_t norm_affine_workspace_bytes(std::int64_t B, std::int64_t rows);

void launch_norm_affine_grads(std::uintptr_t x,  // [B, rows, n], dtype, contiguous
                              std::uintptr_t g,  // [B, rows, n], dtype, contiguous
                              std::int64_t B, std::int64_t rows, std::int64_t n,
                              std::int64_t run, int dtype, double eps,
                              std::uintptr_t w,  // [B, C], dtype, or 0
                              std::uintptr_t b,  // [B, C], dtype, or 0
                              std::uintptr_t workspace,  // norm_affine_workspace_bytes
                              std::int64_t workspace_bytes, std::uintptr_t stream);

// Float64 Gram matrices of float32 rows (clip/gram_f64.cu), the Gram route of
// the per-sample norms without float64 copies: source s (0 <= s < count) holds
// n samples of T rows of d contiguous float32 values, row t of sample i at
// x_s + i sample_stride_s + t row_stride_s (strides in elements); out[s n + i]
// = X X^T of that sample, every entry a float64 sum of the d exact products
// in an order the tensor cores fix (within gamma_d of the sum of |products|).
// A launch of few (sample, tile) jobs splits the d values into k-ranges whose
// partial Grams it adds in a fixed order; they need workspace.
std::int64_t gram_rows_f64_workspace_bytes(std::int64_t count, std::int64_t n, std::int64_t T,
                                           std::int64_t d);
void launch_gram_rows_f64(const std::vector<std::uintptr_t>& x,  // float32, see above
                          const std::vector<std::int64_t>& sample_strides,
                          const std::vector<std::int64_t>& row_strides,
                          std::int64_t n, std::int64_t T, std::int64_t d,
                          std::uintptr_t out,  // [count n, T, T] float64, contiguous
                          std::uintptr_t workspace,  // gram_rows_f64_workspace_bytes
                          std::int64_t workspace_bytes, std::uintptr_t stream);

// ---- Typed launchers (kernels + launch code in clip_noise.cu). They assume
// validated arguments, the right current device, and enough workspace.
namespace kernels {

template <typename Real>
void launch_row_sq_norms(const Real* grads,  // [B, p]
                         std::int64_t B, std::int64_t p,
                         double* sq,  // [B]
                         bool accumulate, cudaStream_t stream);

template <typename Real>
void launch_scale_rows(const Real* x,          // [B, m]
                       const double* factors,  // [B]
                       std::int64_t B, std::int64_t m,
                       Real* out,  // [B, m]
                       cudaStream_t stream);

// Row slices of each sample in the norms from Grams; 0 when there is nothing to sum.
std::int64_t linear_norm_slices(std::int64_t B, std::int64_t layers, std::int64_t T);
std::int64_t linear_norms_from_grams_workspace_bytes(std::int64_t B, std::int64_t layers,
                                                     std::int64_t T);

// Values each row slice of the norms from Grams sums (Hadamard sum, the two
// traces, E and the two root sums of the float32 Gram model).
constexpr int kNormPartials = 6;
// Margins of the float32 Gram model over its own float64 roundings
// (reference.GRAM32_ROOT_MARGIN, GRAM32_ERROR_MARGIN).
constexpr double kGram32RootMargin = 0x1p-40;
constexpr double kGram32ErrorMargin = 0x1p-20;

// The float32 Gram model of reference.gram32_rounding: (gamma, eta1, eta0)
// of W's dot products (length d) and V's (length K); disabled for float64
// Grams, whose rounding the clip rule's terms already cover.
struct GramRounding {
  bool enabled;
  double w[3];
  double v[3];
};

GramRounding gram32_rounding(std::int64_t w_length, std::int64_t v_length);

template <typename Gram>
void launch_linear_norms_from_grams(const Gram* w,  // [(shared_w ? 1 : layers) * B, T, T]
                                    const Gram* v,  // [layers * B, T, T]
                                    std::int64_t B, std::int64_t layers, std::int64_t T,
                                    bool bias, bool shared_w, const GramRounding& rounding,
                                    double* sq,  // [B]
                                    bool accumulate,
                                    double* spread,  // [B] or nullptr
                                    double* sizes,   // [layers * B, 2] or nullptr
                                    void* workspace,  // linear_norms_from_grams_workspace_bytes
                                    cudaStream_t stream);

// The rules of up to kMaxClipGroups groups of rows: one launch's by-value
// argument (3 kB of the 4 kB of kernel parameters), so a step's per-layer
// rules need no upload to the device (a host wait, issue 36).
constexpr int kMaxClipGroups = 128;
struct ClipRuleTable {
  int count;    // groups used, <= kMaxClipGroups
  double unit;  // the data dtype's, shared
  double max_norm[kMaxClipGroups];
  std::int64_t terms[kMaxClipGroups];
  std::int64_t seq_len[kMaxClipGroups];
  NCDP_HOST_DEVICE ClipRule operator()(std::int64_t g) const {
    return ClipRule{max_norm[g], terms[g], seq_len[g], unit};
  }
};

// launch_clip_factor_groups for one table: group g's factors at factors + g *
// group_stride, its norms at norms + g * group_stride.
void launch_clip_factors(const double* sq,      // [rules.count, B]
                         const double* spread,  // [rules.count, B] or nullptr (E = 0)
                         std::int64_t B, const ClipRuleTable& rules, double scale,
                         double* factors,  // group g's [B] at factors + g * group_stride
                         double* norms,    // group g's [B] at norms + g * group_stride
                         std::int64_t group_stride,
                         double* weights,  // [rules.count, B] or nullptr
                         cudaStream_t stream);

// Rows of a weighted row sum are split into this many slabs, each summed into
// its own float64 partial row; 0 when there is nothing to sum.
std::int64_t weighted_row_sum_slabs(std::int64_t B, std::int64_t p);
std::int64_t weighted_row_sum_workspace_bytes(std::int64_t B, std::int64_t p);

// Out: Real, or double (the float64 sum, for a later finish).
template <typename Real, typename Out>
void launch_weighted_row_sum_noise(const Real* grads,     // [B, p]
                                   const double* factors,  // [B]
                                   std::int64_t B, std::int64_t p, double noise_std,
                                   double inv_denom, std::uint64_t seed, std::uint64_t offset,
                                   Out* out,   // [p]
                                   void* workspace,  // weighted_row_sum_workspace_bytes
                                   cudaStream_t stream);

// The dense op's rows are cut into segments of this many columns for their
// norms (a chunk of a few long rows still spreads over many blocks: 16 values
// a thread of a 256-thread block); both forms of the op use it, so their norms
// agree bit for bit.
constexpr std::int64_t kDenseNormSegment = 4096;

// Byte offsets of the fused op's workspace regions (each 256-byte aligned):
// factors [B] float64 | squared-norm partials [B, norm_segments] float64 |
// slab partials [slabs, p] float64 (the one-pass form: its float64 sums [p]) |
// the one-pass form's flags (one_pass_flag_words(B) 32-bit words).
struct ClipNoiseRowsLayout {
  std::int64_t norm_segments;
  std::int64_t slabs;
  std::int64_t factors_offset;
  std::int64_t sq_partials_offset;
  std::int64_t partials_offset;
  std::int64_t flags_offset;
  std::int64_t total_bytes;
};
ClipNoiseRowsLayout clip_noise_rows_layout(std::int64_t B, std::int64_t p);

// l2_bytes: the device's L2 size, which sets the rows per chunk (0: one chunk)
// and the one-pass form's rows per row block. one_pass_blocks: 0 the two-pass
// forms; > 0 the one-pass form (dense_one_pass.cu) on at most that many
// blocks, < 0 on as many as the device holds at once; rows too wide for its
// grid (more than 4096 columns a block) take the two-pass form.
template <typename Real>
void launch_clip_noise_rows(const Real* grads,  // [B, p]
                            std::int64_t B, std::int64_t p, double max_norm, double noise_std,
                            double inv_denom, std::uint64_t seed, std::uint64_t offset,
                            Real* out,       // [p]
                            double* norms,   // [B]
                            void* workspace,  // clip_noise_rows_layout(...).total_bytes
                            std::int64_t l2_bytes, std::int64_t one_pass_blocks,
                            cudaStream_t stream);

// The one-pass form's split: `blocks` blocks own `columns` columns each; row
// blocks of `rows` rows; `segments` norm segments a row, taken `items` norm
// items a row block (up to 4 segments an item). blocks == 0: the rows do not
// fit the grid (or there is nothing to sum).
struct OnePassPlan {
  std::int64_t blocks;
  std::int64_t columns;
  std::int64_t rows;
  std::int64_t row_blocks;
  std::int64_t segments;
  std::int64_t items;
};
OnePassPlan plan_clip_noise_rows_one_pass(std::int64_t B, std::int64_t p,
                                          std::int64_t element_bytes, std::int64_t l2_bytes,
                                          std::int64_t blocks);
// The plan a launch takes: blocks < 0 as many as the device holds at once.
template <typename Real>
OnePassPlan resolve_clip_noise_rows_one_pass(std::int64_t B, std::int64_t p,
                                             std::int64_t l2_bytes, std::int64_t blocks);
// 32-bit words of the one-pass form's flags: done [B] | ready [B] | the ticket
// counter (64-bit).
std::int64_t one_pass_flag_words(std::int64_t B);

// The one-pass form; false (nothing launched) where its plan has no blocks.
template <typename Real>
bool launch_clip_noise_rows_one_pass(const Real* grads,  // [B, p]
                                     std::int64_t B, std::int64_t p, const ClipRule& rule,
                                     double noise_std, double inv_denom, std::uint64_t seed,
                                     std::uint64_t offset,
                                     Real* out,      // [p]
                                     double* norms,  // [B]
                                     const ClipNoiseRowsLayout& layout,
                                     void* workspace,  // layout.total_bytes
                                     std::int64_t l2_bytes, std::int64_t blocks,
                                     cudaStream_t stream);

template <typename Real>
void launch_linear_sq_norms(const Real* acts,   // [B, T, d]
                            const Real* grads,  // [B, T, K]
                            std::int64_t B, std::int64_t T, std::int64_t d, std::int64_t K,
                            bool bias,
                            double* sq,  // [B]
                            bool accumulate,
                            double* sizes,  // [B, 2] (T == 1 only), or nullptr
                            cudaStream_t stream);

// Slabs of the B*T reduction the clipped linear GEMM would like (0: no rows or
// no outputs); the same with and without bias, so one workspace size serves both.
std::int64_t clipped_linear_sum_slabs(std::int64_t rows, std::int64_t d, std::int64_t K);
// Bytes of workspace for `slabs` slabs: weight partials [slabs, K, d] | bias partials [slabs, K].
std::int64_t clipped_linear_sum_layout_bytes(std::int64_t slabs, std::int64_t d, std::int64_t K,
                                             std::int64_t element_bytes);

// Slabs the launcher uses with `workspace_bytes` of workspace: as many as it
// wants (clipped_linear_sum_slabs) and the workspace holds, at least 1.
std::int64_t clipped_linear_sum_slabs_within(std::int64_t rows, std::int64_t d, std::int64_t K,
                                             std::int64_t workspace_bytes,
                                             std::int64_t element_bytes);

template <typename Real>
void launch_clipped_linear_sum(const Real* acts,      // [B, T, d]
                               const Real* grads,     // [B, T, K]
                               const double* factors,  // [B]
                               std::int64_t B, std::int64_t T, std::int64_t d, std::int64_t K,
                               double noise_std, double inv_denom, std::uint64_t seed,
                               std::uint64_t offset,
                               Real* gw,  // [K, d]
                               Real* gb,  // [K] or nullptr
                               void* workspace, std::int64_t workspace_bytes,
                               cudaStream_t stream);

// clip/gram_f64.cu: up to kMaxGramSources sources of one shape a launch.
constexpr int kMaxGramSources = 8;
struct GramSources {
  int count;
  const float* x[kMaxGramSources];              // [n, T, d] with the strides below
  std::int64_t sample_stride[kMaxGramSources];  // elements between samples
  std::int64_t row_stride[kMaxGramSources];     // elements between rows (>= d)
};

// A launch's k-ranges: `splits` ranges of `depth` values (the last: the rest).
struct GramSplit {
  std::int64_t splits;
  std::int64_t depth;
};
// Of `jobs` (sample, tile) pairs of d values; a function of the shape alone
// (the compile-time target's SMs), so a shape's Grams have the same bits on
// every device.
GramSplit gram_rows_f64_split(std::int64_t jobs, std::int64_t d);
std::int64_t gram_rows_f64_workspace_bytes(std::int64_t count, std::int64_t n, std::int64_t T,
                                           std::int64_t d);

void launch_gram_rows_f64(const GramSources& src, std::int64_t n, std::int64_t T,
                          std::int64_t d,
                          double* out,      // [count n, T, T]
                          void* workspace,  // gram_rows_f64_workspace_bytes
                          cudaStream_t stream);

// clip/norm_affine.cu.
template <typename Real>
void launch_norm_affine_grads(const Real* x,  // [B, rows, n]
                              const Real* g,  // [B, rows, n]
                              std::int64_t B, std::int64_t rows, std::int64_t n,
                              std::int64_t run, double eps,
                              Real* w,         // [B, C] or nullptr
                              Real* b,         // [B, C] or nullptr
                              double* stats,   // [B, rows, 2]
                              cudaStream_t stream);

}  // namespace kernels
}  // namespace ncdp
