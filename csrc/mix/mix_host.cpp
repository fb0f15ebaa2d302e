// Python-facing wrappers of the subsampling kernels: argument validation, the
// device guard, dtype dispatch and launch error checks. Shapes are in mix.h.
#include <cuda_runtime_api.h>

#include <cmath>
#include <string>

#include "common/cuda_check.h"
#include "mix/mix.h"

namespace ncdp {
namespace {

// The group description shared by every sampling launch; `used` is whether
// any row will read it (rows > 0).
kernels::GroupSampling sampling_arguments(std::uintptr_t group_ptr, std::uintptr_t members,
                                          std::int64_t G, std::uintptr_t select_rate,
                                          std::uintptr_t walk_rate, bool used) {
  require_non_negative(G, "G");
  const bool has_groups = used && G > 0;
  require_pointer(group_ptr, has_groups, sizeof(std::int64_t), "group_ptr");
  // members and select_rate are optional (0: identity members, every group).
  require_pointer(members, false, sizeof(std::int64_t), "members");
  require_pointer(select_rate, false, sizeof(double), "select_rate");
  require_pointer(walk_rate, has_groups, sizeof(double), "walk_rate");
  return kernels::GroupSampling{typed<const std::int64_t>(group_ptr),
                                typed<const std::int64_t>(members), G,
                                typed<const double>(select_rate), typed<const double>(walk_rate)};
}

void require_non_negative_real(double value, const char* name) {
  if (!(value >= 0.0) || !std::isfinite(value)) {
    throw std::invalid_argument(std::string("ncdp_fast: ") + name +
                                " must be finite and non-negative, got " + std::to_string(value));
  }
}

}  // namespace

void launch_sample_counts(std::uintptr_t group_ptr, std::uintptr_t members, std::int64_t G,
                          std::uintptr_t select_rate, std::uintptr_t walk_rate, std::int64_t rows,
                          std::int64_t row_stride, std::uint64_t seed, std::uint64_t offset,
                          std::uintptr_t counts, std::uintptr_t stream) {
  refuse_graph_capture(stream, "sample_counts");
  require_non_negative(rows, "rows");
  require_non_negative(row_stride, "row_stride");
  const kernels::GroupSampling sampling =
      sampling_arguments(group_ptr, members, G, select_rate, walk_rate, rows > 0);
  require_pointer(counts, rows > 0, sizeof(std::int64_t), "counts");
  if (rows == 0) return;
  DeviceGuard guard(counts, "counts");
  kernels::launch_sample_counts(sampling, rows, static_cast<std::uint64_t>(row_stride), seed,
                                offset, typed<std::int64_t>(counts), as_stream(stream));
  check_launch("sample_counts");
}

void launch_sample_fill(std::uintptr_t group_ptr, std::uintptr_t members, std::int64_t G,
                        std::uintptr_t select_rate, std::uintptr_t walk_rate, std::int64_t rows,
                        std::int64_t row_stride, std::uint64_t seed, std::uint64_t offset,
                        std::uintptr_t indptr, std::uintptr_t indices, std::uintptr_t stream) {
  refuse_graph_capture(stream, "sample_fill");
  require_non_negative(rows, "rows");
  require_non_negative(row_stride, "row_stride");
  const kernels::GroupSampling sampling =
      sampling_arguments(group_ptr, members, G, select_rate, walk_rate, rows > 0);
  require_pointer(indptr, rows > 0, sizeof(std::int64_t), "indptr");
  // indptr[rows] lives on the device: an empty `indices` (0) is accepted and
  // the kernel then writes nothing.
  require_pointer(indices, false, sizeof(std::int64_t), "indices");
  if (rows == 0) return;
  DeviceGuard guard(indptr, "indptr");
  kernels::launch_sample_fill(sampling, rows, static_cast<std::uint64_t>(row_stride), seed,
                              offset, typed<const std::int64_t>(indptr),
                              typed<std::int64_t>(indices), as_stream(stream));
  check_launch("sample_fill");
}

void launch_mix_rows(std::uintptr_t features, int dtype, std::int64_t n, std::int64_t d,
                     std::uintptr_t labels, std::uintptr_t soft_labels, std::int64_t K,
                     std::uintptr_t group_ptr, std::uintptr_t members, std::int64_t G,
                     std::uintptr_t select_rate, std::uintptr_t walk_rate, std::int64_t rows,
                     std::uint64_t seed, std::uint64_t offset, double inv_m, double clip_x,
                     double noise_std_x, double noise_std_y, std::uintptr_t out_x,
                     std::uintptr_t out_y, std::uintptr_t counts, std::uintptr_t stream) {
  refuse_graph_capture(stream, "mix_rows");
  require_non_negative(n, "n");
  require_non_negative(d, "d");
  require_non_negative(K, "K");
  require_non_negative(rows, "rows");
  const std::size_t element = dtype_size(dtype);
  const auto bytes = static_cast<std::int64_t>(element);
  std::int64_t row_stride = 0;
  if (__builtin_add_overflow(d, K, &row_stride)) {
    throw std::invalid_argument("ncdp_fast: d + K overflows int64");
  }
  checked_mul(checked_mul(n, d, "n * d"), bytes, "n * d bytes");
  checked_mul(checked_mul(n, K, "n * K"), bytes, "n * K bytes");
  checked_mul(checked_mul(rows, row_stride, "rows * (d + K)"), bytes, "rows * (d + K) bytes");
  if (std::isnan(clip_x)) throw std::invalid_argument("ncdp_fast: clip_x is NaN");
  if (!std::isfinite(inv_m)) {
    throw std::invalid_argument("ncdp_fast: inv_m must be finite, got " + std::to_string(inv_m));
  }
  require_non_negative_real(noise_std_x, "noise_std_x");
  require_non_negative_real(noise_std_y, "noise_std_y");
  const kernels::GroupSampling sampling =
      sampling_arguments(group_ptr, members, G, select_rate, walk_rate, rows > 0);
  const bool gathers = rows > 0 && n > 0;
  require_pointer(features, gathers && d > 0, element, "features");
  require_pointer(soft_labels, false, element, "soft_labels");
  require_pointer(labels, gathers && K > 0 && soft_labels == 0, sizeof(std::int64_t), "labels");
  require_pointer(out_x, rows > 0 && d > 0, element, "out_x");
  require_pointer(out_y, rows > 0 && K > 0, element, "out_y");
  require_pointer(counts, rows > 0, sizeof(std::int64_t), "counts");
  if (rows == 0) return;
  DeviceGuard guard(counts, "counts");
  if (dtype == kDtypeFloat32) {
    kernels::launch_mix_rows(typed<const float>(features), n, d, typed<const std::int64_t>(labels),
                             typed<const float>(soft_labels), K, sampling, rows, seed, offset,
                             inv_m, clip_x, noise_std_x, noise_std_y, typed<float>(out_x),
                             typed<float>(out_y), typed<std::int64_t>(counts), as_stream(stream));
  } else {
    kernels::launch_mix_rows(typed<const double>(features), n, d,
                             typed<const std::int64_t>(labels), typed<const double>(soft_labels),
                             K, sampling, rows, seed, offset, inv_m, clip_x, noise_std_x,
                             noise_std_y, typed<double>(out_x), typed<double>(out_y),
                             typed<std::int64_t>(counts), as_stream(stream));
  }
  check_launch("mix_rows");
}

}  // namespace ncdp
