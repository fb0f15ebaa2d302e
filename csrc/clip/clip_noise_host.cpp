// Python-facing wrappers of the clipping kernels: argument validation, the device
// guard, dtype dispatch and launch error checks. Shapes are in clip_noise.h.
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "clip/clip_noise.h"
#include "common/cuda_check.h"
#include "common/device_info.h"
#include "common/launch_config.h"

namespace ncdp {
namespace {

void require_workspace(std::uintptr_t workspace, std::int64_t workspace_bytes,
                       std::int64_t needed, const char* op) {
  require_non_negative(workspace_bytes, "workspace_bytes");
  if (workspace_bytes < needed) {
    throw std::invalid_argument(std::string("ncdp_fast: ") + op + " needs " +
                                std::to_string(needed) + " workspace bytes, got " +
                                std::to_string(workspace_bytes));
  }
  require_pointer(workspace, needed > 0, sizeof(double), "workspace");
}

// The float32 Gram model's dot lengths (reference.GRAM32_MAX_LENGTH): n u < 1
// with room for its constants.
constexpr std::int64_t kMaxGram32Length = std::int64_t{1} << 20;

void require_gram32_length(std::int64_t n, const char* name) {
  if (n < 1 || n > kMaxGram32Length) {
    throw std::invalid_argument(std::string("ncdp_fast: ") + name +
                                ": expected a float32 Gram's dot length in [1, " +
                                std::to_string(kMaxGram32Length) + "], got " + std::to_string(n));
  }
}

}  // namespace

void launch_row_sq_norms(std::uintptr_t g, std::int64_t B, std::int64_t p, int dtype,
                         std::uintptr_t sq, bool accumulate, std::uintptr_t stream) {
  require_non_negative(B, "B");
  require_non_negative(p, "p");
  const std::size_t element = dtype_size(dtype);
  require_pointer(g, checked_mul(B, p, "B * p") > 0, element, "g");
  require_pointer(sq, B > 0, sizeof(double), "sq");
  if (B == 0) return;
  DeviceGuard guard(first_pointer({p > 0 ? g : 0, sq}), "g");
  if (dtype == kDtypeFloat32) {
    kernels::launch_row_sq_norms(typed<const float>(g), B, p, typed<double>(sq), accumulate,
                                 as_stream(stream));
  } else {
    kernels::launch_row_sq_norms(typed<const double>(g), B, p, typed<double>(sq), accumulate,
                                 as_stream(stream));
  }
  check_launch("row_sq_norms");
}

void launch_scale_rows(std::uintptr_t x, std::int64_t B, std::int64_t m, int dtype,
                       std::uintptr_t factors, std::uintptr_t out, std::uintptr_t stream) {
  require_non_negative(B, "B");
  require_non_negative(m, "m");
  const std::size_t element = dtype_size(dtype);
  const bool values = checked_mul(B, m, "B * m") > 0;
  require_pointer(x, values, element, "x");
  require_pointer(factors, values, sizeof(double), "factors");
  require_pointer(out, values, element, "out");
  if (!values) return;
  DeviceGuard guard(out, "out");
  if (dtype == kDtypeFloat32) {
    kernels::launch_scale_rows(typed<const float>(x), typed<const double>(factors), B, m,
                               typed<float>(out), as_stream(stream));
  } else {
    kernels::launch_scale_rows(typed<const double>(x), typed<const double>(factors), B, m,
                               typed<double>(out), as_stream(stream));
  }
  check_launch("scale_rows");
}

std::int64_t linear_norms_from_grams_workspace_bytes(std::int64_t B, std::int64_t layers,
                                                     std::int64_t T) {
  require_non_negative(B, "B");
  require_non_negative(layers, "layers");
  require_non_negative(T, "T");
  const std::int64_t samples = checked_mul(layers, B, "layers * B");
  checked_mul(samples, checked_mul(T, T, "T * T"), "layers * B * T * T");
  checked_mul(checked_mul(samples, T, "layers * B * T"),
              kernels::kNormPartials * std::int64_t{sizeof(double)},
              "partials bytes");
  return kernels::linear_norms_from_grams_workspace_bytes(B, layers, T);
}

void launch_linear_norms_from_grams(std::uintptr_t w, std::uintptr_t v, std::int64_t B,
                                    std::int64_t layers, std::int64_t T, bool bias,
                                    bool shared_w, int gram_dtype, std::int64_t w_length,
                                    std::int64_t v_length, std::uintptr_t sq, bool accumulate,
                                    std::uintptr_t spread, std::uintptr_t sizes,
                                    std::uintptr_t workspace, std::int64_t workspace_bytes,
                                    std::uintptr_t stream) {
  const std::int64_t needed = linear_norms_from_grams_workspace_bytes(B, layers, T);
  const std::size_t item = dtype_size(gram_dtype);
  kernels::GramRounding rounding{};
  if (gram_dtype == kDtypeFloat32) {
    require_gram32_length(w_length, "w_length");
    require_gram32_length(v_length, "v_length");
    rounding = kernels::gram32_rounding(w_length, v_length);
  }
  const std::int64_t cells = layers * B * T * T;
  require_pointer(w, cells > 0, item, "w");
  require_pointer(v, cells > 0, item, "v");
  require_pointer(sq, B > 0, sizeof(double), "sq");
  require_pointer(spread, false, sizeof(double), "spread");
  require_pointer(sizes, false, sizeof(double), "sizes");
  require_workspace(workspace, workspace_bytes, needed, "linear_norms_from_grams");
  if (B == 0) return;
  DeviceGuard guard(first_pointer({cells > 0 ? w : 0, cells > 0 ? v : 0, sq}), "w");
  double* spread_ptr = spread != 0 ? typed<double>(spread) : nullptr;
  double* sizes_ptr = sizes != 0 ? typed<double>(sizes) : nullptr;
  if (gram_dtype == kDtypeFloat32) {
    kernels::launch_linear_norms_from_grams(
        typed<const float>(w), typed<const float>(v), B, layers, T, bias, shared_w, rounding,
        typed<double>(sq), accumulate, spread_ptr, sizes_ptr, typed<void>(workspace),
        as_stream(stream));
  } else {
    kernels::launch_linear_norms_from_grams(
        typed<const double>(w), typed<const double>(v), B, layers, T, bias, shared_w, rounding,
        typed<double>(sq), accumulate, spread_ptr, sizes_ptr, typed<void>(workspace),
        as_stream(stream));
  }
  check_launch("linear_norms_from_grams");
}

void launch_clip_factor_groups(std::uintptr_t sq, std::uintptr_t spread, std::int64_t groups,
                               std::int64_t B, const std::vector<double>& max_norm,
                               const std::vector<std::int64_t>& terms,
                               const std::vector<std::int64_t>& seq_len, double unit,
                               std::uintptr_t out, std::int64_t stride, std::uintptr_t stream,
                               double scale, std::uintptr_t weights) {
  require_non_negative(groups, "groups");
  require_non_negative(B, "B");
  const auto n = static_cast<std::size_t>(groups);
  if (max_norm.size() != n || terms.size() != n || seq_len.size() != n) {
    throw std::invalid_argument(
        "ncdp_fast: clip_factor_groups: max_norm, terms and seq_len must have one entry a "
        "group (" + std::to_string(groups) + "), got " + std::to_string(max_norm.size()) +
        ", " + std::to_string(terms.size()) + " and " + std::to_string(seq_len.size()));
  }
  for (std::size_t g = 0; g < n; ++g) {
    require_non_negative(terms[g], "terms");
    // 0 is a sequence block with no positions (every gradient zero), as the
    // CPU path and reference.clip_factors take it; the rule reads seq_len + 2.
    require_non_negative(seq_len[g], "seq_len");
  }
  if (!(std::isfinite(scale) && scale > 0.0)) {
    throw std::invalid_argument("ncdp_fast: scale must be finite and positive, got " +
                                std::to_string(scale));
  }
  if (!(unit > 0.0 && unit < 1.0)) {
    throw std::invalid_argument("ncdp_fast: unit must be a unit roundoff in (0, 1), got " +
                                std::to_string(unit));
  }
  // Each group's factors and norms side by side, the groups apart: nothing
  // written twice.
  if (stride < 2 * B) {
    throw std::invalid_argument("ncdp_fast: clip_factor_groups: stride must be at least 2 B = " +
                                std::to_string(2 * B) + ", got " + std::to_string(stride));
  }
  const bool any = groups > 0 && B > 0;
  require_pointer(sq, any, sizeof(double), "sq");
  require_pointer(spread, false, sizeof(double), "spread");
  require_pointer(out, any, sizeof(double), "out");
  require_pointer(weights, false, sizeof(double), "weights");
  if (!any) return;
  DeviceGuard guard(sq, "sq");
  const double* sq_rows = typed<const double>(sq);
  const double* spread_rows = spread != 0 ? typed<const double>(spread) : nullptr;
  double* outs = typed<double>(out);
  double* weight_rows = weights != 0 ? typed<double>(weights) : nullptr;
  kernels::ClipRuleTable table{};
  table.unit = unit;
  for (std::int64_t g0 = 0; g0 < groups; g0 += kernels::kMaxClipGroups) {
    table.count = static_cast<int>(std::min<std::int64_t>(kernels::kMaxClipGroups, groups - g0));
    for (int k = 0; k < table.count; ++k) {
      table.max_norm[k] = max_norm[g0 + k];
      table.terms[k] = terms[g0 + k];
      table.seq_len[k] = seq_len[g0 + k];
    }
    const std::int64_t row0 = g0 * B;
    kernels::launch_clip_factors(sq_rows + row0, spread_rows ? spread_rows + row0 : nullptr, B,
                                 table, scale, outs + g0 * stride, outs + g0 * stride + B, stride,
                                 weight_rows ? weight_rows + row0 : nullptr, as_stream(stream));
    check_launch("clip_factor_groups");
  }
}

std::int64_t weighted_row_sum_workspace_bytes(std::int64_t B, std::int64_t p, int dtype) {
  require_non_negative(B, "B");
  require_non_negative(p, "p");
  dtype_size(dtype);  // validates the code; the partials are float64 whatever the dtype
  checked_mul(checked_mul(B, p, "B * p"), std::int64_t{sizeof(double)}, "B * p bytes");
  return kernels::weighted_row_sum_workspace_bytes(B, p);
}

void launch_weighted_row_sum_noise(std::uintptr_t g, std::int64_t B, std::int64_t p, int dtype,
                                   std::uintptr_t factors, double noise_std, double inv_denom,
                                   std::uint64_t seed, std::uint64_t offset, std::uintptr_t out,
                                   std::uintptr_t workspace, std::int64_t workspace_bytes,
                                   std::uintptr_t stream, int out_dtype) {
  refuse_graph_capture(stream, "weighted_row_sum_noise");
  const std::int64_t needed = weighted_row_sum_workspace_bytes(B, p, dtype);
  const std::size_t element = dtype_size(dtype);
  if (out_dtype == -1) out_dtype = dtype;
  if (out_dtype != dtype && out_dtype != kDtypeFloat64) {
    throw std::invalid_argument("ncdp_fast: weighted_row_sum_noise: out_dtype must be -1, dtype "
                                "or 1 (float64), got " + std::to_string(out_dtype));
  }
  require_pointer(g, B * p > 0, element, "g");
  require_pointer(factors, B > 0 && p > 0, sizeof(double), "factors");
  require_pointer(out, p > 0, dtype_size(out_dtype), "out");
  require_workspace(workspace, workspace_bytes, needed, "weighted_row_sum_noise");
  if (p == 0) return;
  DeviceGuard guard(first_pointer({B > 0 ? g : 0, out}), "g");
  if (dtype == kDtypeFloat32 && out_dtype == kDtypeFloat64) {
    kernels::launch_weighted_row_sum_noise(typed<const float>(g), typed<const double>(factors), B,
                                           p, noise_std, inv_denom, seed, offset,
                                           typed<double>(out), typed<void>(workspace),
                                           as_stream(stream));
  } else if (dtype == kDtypeFloat32) {
    kernels::launch_weighted_row_sum_noise(typed<const float>(g), typed<const double>(factors), B,
                                           p, noise_std, inv_denom, seed, offset,
                                           typed<float>(out), typed<void>(workspace),
                                           as_stream(stream));
  } else {
    kernels::launch_weighted_row_sum_noise(typed<const double>(g), typed<const double>(factors),
                                           B, p, noise_std, inv_denom, seed, offset,
                                           typed<double>(out), typed<void>(workspace),
                                           as_stream(stream));
  }
  check_launch("weighted_row_sum_noise");
}

std::int64_t clip_noise_rows_workspace_bytes(std::int64_t B, std::int64_t p, int dtype) {
  require_non_negative(B, "B");
  require_non_negative(p, "p");
  dtype_size(dtype);  // validates the code; the partials are float64 whatever the dtype
  checked_mul(checked_mul(B, p, "B * p"), std::int64_t{sizeof(double)}, "B * p bytes");
  return kernels::clip_noise_rows_layout(B, p).total_bytes;
}

// l2_bytes, or the current device's L2 size where it is negative.
static std::int64_t resolved_l2_bytes(std::int64_t l2_bytes) {
  if (l2_bytes >= 0) return l2_bytes;
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  return l2_cache_bytes(device);
}

std::vector<std::int64_t> clip_noise_rows_one_pass_plan(std::int64_t B, std::int64_t p, int dtype,
                                                        std::int64_t l2_bytes,
                                                        std::int64_t one_pass_blocks) {
  clip_noise_rows_workspace_bytes(B, p, dtype);  // validates B, p and dtype
  const std::int64_t l2 = resolved_l2_bytes(l2_bytes);
  const kernels::OnePassPlan plan =
      one_pass_blocks == 0 ? kernels::OnePassPlan{}
      : dtype == kDtypeFloat32
          ? kernels::resolve_clip_noise_rows_one_pass<float>(B, p, l2, one_pass_blocks)
          : kernels::resolve_clip_noise_rows_one_pass<double>(B, p, l2, one_pass_blocks);
  return {plan.blocks,   plan.columns, plan.rows,
          plan.row_blocks, plan.segments, plan.items,
          kernels::clip_noise_rows_layout(B, p).flags_offset};
}

void launch_clip_noise_rows(std::uintptr_t g, std::int64_t B, std::int64_t p, int dtype,
                            double max_norm, double noise_std, double inv_denom,
                            std::uint64_t seed, std::uint64_t offset, std::uintptr_t out,
                            std::uintptr_t norms, std::uintptr_t workspace,
                            std::int64_t workspace_bytes, std::uintptr_t stream,
                            std::int64_t l2_bytes, std::int64_t one_pass_blocks) {
  refuse_graph_capture(stream, "clip_noise_rows");
  const std::int64_t needed = clip_noise_rows_workspace_bytes(B, p, dtype);
  const std::size_t element = dtype_size(dtype);
  require_pointer(g, B * p > 0, element, "g");
  require_pointer(out, p > 0, element, "out");
  require_pointer(norms, B > 0, sizeof(double), "norms");
  require_workspace(workspace, workspace_bytes, needed, "clip_noise_rows");
  if (B == 0 && p == 0) return;
  DeviceGuard guard(first_pointer({B * p > 0 ? g : 0, out, norms}), "g");
  const std::int64_t l2 = resolved_l2_bytes(l2_bytes);
  if (dtype == kDtypeFloat32) {
    kernels::launch_clip_noise_rows(typed<const float>(g), B, p, max_norm, noise_std, inv_denom,
                                    seed, offset, typed<float>(out), typed<double>(norms),
                                    typed<void>(workspace), l2, one_pass_blocks,
                                    as_stream(stream));
  } else {
    kernels::launch_clip_noise_rows(typed<const double>(g), B, p, max_norm, noise_std, inv_denom,
                                    seed, offset, typed<double>(out), typed<double>(norms),
                                    typed<void>(workspace), l2, one_pass_blocks,
                                    as_stream(stream));
  }
  check_launch("clip_noise_rows");
}

void launch_linear_sq_norms(std::uintptr_t a, std::uintptr_t g, std::int64_t B, std::int64_t T,
                            std::int64_t d, std::int64_t K, int dtype, bool bias,
                            std::uintptr_t sq, bool accumulate, std::uintptr_t stream,
                            std::uintptr_t sizes) {
  require_non_negative(B, "B");
  require_non_negative(T, "T");
  if (sizes != 0 && T != 1) {
    throw std::invalid_argument("ncdp_fast: sizes: formed at T = 1 only (the rank-1 case), got T = " +
                                std::to_string(T));
  }
  require_non_negative(d, "d");
  require_non_negative(K, "K");
  const std::size_t element = dtype_size(dtype);
  const std::int64_t rows = checked_mul(B, T, "B * T");
  const std::int64_t a_count = checked_mul(rows, d, "B * T * d");
  const std::int64_t g_count = checked_mul(rows, K, "B * T * K");
  checked_mul(K, d, "K * d");
  require_pointer(a, a_count > 0, element, "a");
  require_pointer(g, g_count > 0, element, "g");
  require_pointer(sq, B > 0, sizeof(double), "sq");
  require_pointer(sizes, false, sizeof(double), "sizes");
  if (B == 0) return;
  DeviceGuard guard(first_pointer({a_count > 0 ? a : 0, g_count > 0 ? g : 0, sq}), "a");
  double* sizes_ptr = sizes != 0 ? typed<double>(sizes) : nullptr;
  if (dtype == kDtypeFloat32) {
    kernels::launch_linear_sq_norms(typed<const float>(a), typed<const float>(g), B, T, d, K,
                                    bias, typed<double>(sq), accumulate, sizes_ptr,
                                    as_stream(stream));
  } else {
    kernels::launch_linear_sq_norms(typed<const double>(a), typed<const double>(g), B, T, d, K,
                                    bias, typed<double>(sq), accumulate, sizes_ptr,
                                    as_stream(stream));
  }
  check_launch("linear_sq_norms");
}

std::int64_t clipped_linear_sum_workspace_bytes(std::int64_t B, std::int64_t T, std::int64_t d,
                                                std::int64_t K, int dtype) {
  require_non_negative(B, "B");
  require_non_negative(T, "T");
  require_non_negative(d, "d");
  require_non_negative(K, "K");
  const std::int64_t element = static_cast<std::int64_t>(dtype_size(dtype));
  const std::int64_t rows = checked_mul(B, T, "B * T");
  checked_mul(checked_mul(K, d + 1, "K * (d + 1)"), element, "K * (d + 1) bytes");
  const std::int64_t slabs = kernels::clipped_linear_sum_slabs(rows, d, K);
  checked_mul(checked_mul(slabs, K * (d + 1), "workspace elements"), element, "workspace bytes");
  return kernels::clipped_linear_sum_layout_bytes(slabs, d, K, element);
}

void launch_clipped_linear_sum(std::uintptr_t a, std::uintptr_t g, std::uintptr_t factors,
                               std::int64_t B, std::int64_t T, std::int64_t d, std::int64_t K,
                               int dtype, double noise_std, double inv_denom, std::uint64_t seed,
                               std::uint64_t offset, std::uintptr_t gw, std::uintptr_t gb,
                               std::uintptr_t stream, std::uintptr_t workspace,
                               std::int64_t workspace_bytes) {
  refuse_graph_capture(stream, "clipped_linear_sum");
  // Validates B, T, d, K and dtype, and the size arithmetic below.
  clipped_linear_sum_workspace_bytes(B, T, d, K, dtype);
  const std::size_t element = dtype_size(dtype);
  const std::int64_t rows = B * T;
  const std::int64_t weight_count = K * d;
  require_pointer(a, rows * d > 0 && K > 0, element, "a");
  require_pointer(g, rows * K > 0, element, "g");
  require_pointer(factors, rows > 0 && K > 0, sizeof(double), "factors");
  require_pointer(gw, weight_count > 0, element, "gw");
  require_pointer(gb, false, element, "gb");
  require_non_negative(workspace_bytes, "workspace_bytes");
  require_pointer(workspace, workspace_bytes > 0, sizeof(double), "workspace");
  // The GEMM puts 64-row tiles of K on gridDim.y (at most 65535).
  if ((K + 63) / 64 > 65535) {
    throw std::invalid_argument("ncdp_fast: K = " + std::to_string(K) +
                                " exceeds the clipped linear GEMM's grid (K <= 4194240)");
  }
  if (weight_count == 0 && gb == 0) return;
  if (K == 0) return;
  DeviceGuard guard(first_pointer({weight_count > 0 ? gw : 0, gb}), "gw");
  if (dtype == kDtypeFloat32) {
    kernels::launch_clipped_linear_sum(typed<const float>(a), typed<const float>(g),
                                       typed<const double>(factors), B, T, d, K, noise_std,
                                       inv_denom, seed, offset, typed<float>(gw),
                                       typed<float>(gb), typed<void>(workspace), workspace_bytes,
                                       as_stream(stream));
  } else {
    kernels::launch_clipped_linear_sum(typed<const double>(a), typed<const double>(g),
                                       typed<const double>(factors), B, T, d, K, noise_std,
                                       inv_denom, seed, offset, typed<double>(gw),
                                       typed<double>(gb), typed<void>(workspace),
                                       workspace_bytes, as_stream(stream));
  }
  check_launch("clipped_linear_sum");
}

std::int64_t norm_affine_workspace_bytes(std::int64_t B, std::int64_t rows) {
  require_non_negative(B, "B");
  require_non_negative(rows, "rows");
  return checked_mul(checked_mul(B, rows, "B * rows"), 2 * std::int64_t{sizeof(double)},
                     "statistics bytes");
}

void launch_norm_affine_grads(std::uintptr_t x, std::uintptr_t g, std::int64_t B,
                              std::int64_t rows, std::int64_t n, std::int64_t run, int dtype,
                              double eps, std::uintptr_t w, std::uintptr_t b,
                              std::uintptr_t workspace, std::int64_t workspace_bytes,
                              std::uintptr_t stream) {
  require_non_negative(n, "n");
  require_non_negative(run, "run");
  const std::int64_t needed = norm_affine_workspace_bytes(B, rows);
  if (rows > 0 && n == 0) {
    throw std::invalid_argument("ncdp_fast: n: expected rows of at least one value, got 0");
  }
  if (run > 0 && n % run != 0) {
    throw std::invalid_argument("ncdp_fast: run: expected a divisor of n = " + std::to_string(n) +
                                " (a row holds whole channels), got " + std::to_string(run));
  }
  if (!(std::isfinite(eps) && eps >= 0.0)) {
    throw std::invalid_argument("ncdp_fast: eps must be finite and non-negative, got " +
                                std::to_string(eps));
  }
  const std::size_t element = dtype_size(dtype);
  const std::int64_t count = checked_mul(checked_mul(B, rows, "B * rows"), n, "B * rows * n");
  const std::int64_t channels = run > 0 ? rows * (n / run) : n;
  const bool outputs = checked_mul(B, channels, "B * C") > 0;
  require_pointer(x, count > 0, element, "x");
  require_pointer(g, count > 0, element, "g");
  require_pointer(w, false, element, "w");
  require_pointer(b, false, element, "b");
  require_workspace(workspace, workspace_bytes, needed, "norm_affine_grads");
  if (B == 0 || !outputs) return;
  DeviceGuard guard(first_pointer({count > 0 ? x : 0, w, b}), "x");
  double* stats = typed<double>(workspace);
  if (dtype == kDtypeFloat32) {
    kernels::launch_norm_affine_grads(typed<const float>(x), typed<const float>(g), B, rows, n,
                                      run, eps, w != 0 ? typed<float>(w) : nullptr,
                                      b != 0 ? typed<float>(b) : nullptr, stats,
                                      as_stream(stream));
  } else {
    kernels::launch_norm_affine_grads(typed<const double>(x), typed<const double>(g), B, rows,
                                      n, run, eps, w != 0 ? typed<double>(w) : nullptr,
                                      b != 0 ? typed<double>(b) : nullptr, stats,
                                      as_stream(stream));
  }
  check_launch("norm_affine_grads");
}

}  // namespace ncdp

namespace ncdp {

std::int64_t gram_rows_f64_workspace_bytes(std::int64_t count, std::int64_t n, std::int64_t T,
                                           std::int64_t d) {
  require_non_negative(count, "count");
  require_non_negative(n, "n");
  require_non_negative(T, "T");
  require_non_negative(d, "d");
  // The partials' bytes, at most a range per resident block of the target,
  // checked before the kernels' unchecked product.
  const std::int64_t entries =
      checked_mul(checked_mul(count, n, "count * n"), checked_mul(T, T, "T * T"), "Gram entries");
  (void)checked_mul(entries, kTargetSMs * kResidentThreadsPerSM * std::int64_t{8},
                    "partial Gram bytes");
  return kernels::gram_rows_f64_workspace_bytes(count, n, T, d);
}

void launch_gram_rows_f64(const std::vector<std::uintptr_t>& x,
                          const std::vector<std::int64_t>& sample_strides,
                          const std::vector<std::int64_t>& row_strides, std::int64_t n,
                          std::int64_t T, std::int64_t d, std::uintptr_t out,
                          std::uintptr_t workspace, std::int64_t workspace_bytes,
                          std::uintptr_t stream) {
  require_non_negative(n, "n");
  require_non_negative(T, "T");
  require_non_negative(d, "d");
  const std::size_t count = x.size();
  if (count > static_cast<std::size_t>(kernels::kMaxGramSources)) {
    throw std::invalid_argument("ncdp_fast: x: expected at most " +
                                std::to_string(kernels::kMaxGramSources) +
                                " sources a launch, got " + std::to_string(count));
  }
  if (sample_strides.size() != count || row_strides.size() != count) {
    throw std::invalid_argument("ncdp_fast: sample_strides, row_strides: expected one of each "
                                "per source (" + std::to_string(count) + "), got " +
                                std::to_string(sample_strides.size()) + " and " +
                                std::to_string(row_strides.size()));
  }
  const std::int64_t grams = checked_mul(static_cast<std::int64_t>(count), n, "sources * n");
  const std::int64_t entries = checked_mul(grams, checked_mul(T, T, "T * T"), "out entries");
  require_pointer(out, entries > 0, sizeof(double), "out");
  kernels::GramSources src{};
  src.count = static_cast<int>(count);
  const bool values = checked_mul(checked_mul(n, T, "n * T"), d, "n * T * d") > 0;
  for (std::size_t s = 0; s < count; ++s) {
    const std::string name = "x[" + std::to_string(s) + "]";
    require_pointer(x[s], values, sizeof(float), name.c_str());
    // The kernel reads row t of sample i at i sample_stride + t row_stride,
    // values 0..d-1: rows must not overlap within a sample (its Gram would
    // still be defined, but no caller means that), and the strides must index
    // inside int64.
    if (values && (row_strides[s] < d || sample_strides[s] < 0)) {
      throw std::invalid_argument("ncdp_fast: row_strides[" + std::to_string(s) +
                                  "], sample_strides[" + std::to_string(s) +
                                  "]: expected a row stride >= d = " + std::to_string(d) +
                                  " and a non-negative sample stride, got " +
                                  std::to_string(row_strides[s]) + " and " +
                                  std::to_string(sample_strides[s]));
    }
    if (values) {
      (void)checked_mul(n, sample_strides[s], "n * sample_stride");
      (void)checked_mul(T, row_strides[s], "T * row_stride");
    }
    src.x[s] = typed<const float>(x[s]);
    src.sample_stride[s] = sample_strides[s];
    src.row_stride[s] = row_strides[s];
  }
  require_workspace(workspace, workspace_bytes,
                    gram_rows_f64_workspace_bytes(static_cast<std::int64_t>(count), n, T, d),
                    "gram_rows_f64");
  if (entries == 0) return;
  DeviceGuard guard(out, "out");
  kernels::launch_gram_rows_f64(src, n, T, d, typed<double>(out), typed<void>(workspace),
                                as_stream(stream));
  check_launch("gram_rows_f64");
}

}  // namespace ncdp
