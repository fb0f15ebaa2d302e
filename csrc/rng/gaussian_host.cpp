// Python-facing wrappers of the Gaussian fills: validation, device guard, errors.
#include <string>

#include "common/cuda_check.h"
#include "rng/gaussian.h"

namespace ncdp {

void launch_fill_gaussian(std::uintptr_t out, std::int64_t count, int dtype, std::uint64_t seed,
                          std::uint64_t offset, double scale, bool accumulate, double post,
                          std::uintptr_t stream) {
  refuse_graph_capture(stream, "fill_gaussian");
  require_non_negative(count, "count");
  const std::size_t element = dtype_size(dtype);
  require_pointer(out, count > 0, element, "out");
  if (count == 0) return;
  DeviceGuard guard(out, "out");
  if (dtype == kDtypeFloat32) {
    kernels::launch_fill_gaussian(typed<float>(out), count, seed, offset, scale, post,
                                  accumulate, as_stream(stream));
  } else {
    kernels::launch_fill_gaussian(typed<double>(out), count, seed, offset, scale, post,
                                  accumulate, as_stream(stream));
  }
  check_launch("fill_gaussian");
}

void launch_finish_gaussian_segments(const std::vector<std::uintptr_t>& dst,
                                     const std::vector<std::uintptr_t>& src,
                                     const std::vector<std::int64_t>& count,
                                     const std::vector<std::uint64_t>& offset,
                                     const std::vector<int>& src_dtype,
                                     const std::vector<int>& dst_dtype, std::uint64_t seed,
                                     double scale, double post, std::uintptr_t stream) {
  refuse_graph_capture(stream, "finish_gaussian_segments");
  const std::size_t n = dst.size();
  if (src.size() != n || count.size() != n || offset.size() != n || src_dtype.size() != n ||
      dst_dtype.size() != n) {
    throw std::invalid_argument(
        "ncdp_fast: finish_gaussian_segments: dst, src, count, offset, src_dtype and dst_dtype "
        "must have one entry a segment, got " + std::to_string(n) + ", " +
        std::to_string(src.size()) + ", " + std::to_string(count.size()) + ", " +
        std::to_string(offset.size()) + ", " + std::to_string(src_dtype.size()) + " and " +
        std::to_string(dst_dtype.size()));
  }
  std::uintptr_t device_ptr = 0;
  for (std::size_t s = 0; s < n; ++s) {
    require_non_negative(count[s], "count");
    const bool ok_types = src_dtype[s] == dst_dtype[s] ||
                          (src_dtype[s] == kDtypeFloat64 && dst_dtype[s] == kDtypeFloat32);
    const std::size_t src_element = dtype_size(src_dtype[s]);
    const std::size_t dst_element = dtype_size(dst_dtype[s]);
    if (!ok_types) {
      throw std::invalid_argument(
          "ncdp_fast: finish_gaussian_segments: segment " + std::to_string(s) +
          ": (src_dtype, dst_dtype) must be (0, 0), (1, 1) or (1, 0), got (" +
          std::to_string(src_dtype[s]) + ", " + std::to_string(dst_dtype[s]) + ")");
    }
    require_pointer(dst[s], count[s] > 0, dst_element, "dst");
    require_pointer(src[s], count[s] > 0, src_element, "src");
    if (src[s] == dst[s] && src_dtype[s] != dst_dtype[s] && count[s] > 0) {
      throw std::invalid_argument("ncdp_fast: finish_gaussian_segments: segment " +
                                  std::to_string(s) +
                                  ": an in-place finish (src == dst) needs one dtype");
    }
    if (device_ptr == 0 && count[s] > 0) device_ptr = dst[s];
  }
  if (device_ptr == 0) return;
  DeviceGuard guard(device_ptr, "dst");
  kernels::GaussianSegments table{};
  auto flush = [&] {
    kernels::launch_finish_gaussian_segments(table, seed, scale, post, as_stream(stream));
    check_launch("finish_gaussian_segments");
    table.count = 0;
  };
  for (std::size_t s = 0; s < n; ++s) {
    if (count[s] == 0) continue;
    const auto types = src_dtype[s] != dst_dtype[s] ? kernels::kSegmentFloat64ToFloat32
                       : dst_dtype[s] == kDtypeFloat32 ? kernels::kSegmentFloat32
                                                       : kernels::kSegmentFloat64;
    kernels::append_gaussian_segment(table, typed<void>(dst[s]), typed<const void>(src[s]),
                                     count[s], offset[s], types);
    if (table.count == kernels::kMaxGaussianSegments) flush();
  }
  if (table.count > 0) flush();
}

}  // namespace ncdp
