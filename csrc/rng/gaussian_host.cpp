// Python-facing wrapper of the Gaussian fill: validation, device guard, errors.
#include "common/cuda_check.h"
#include "rng/gaussian.h"

namespace ncdp {

void launch_fill_gaussian(std::uintptr_t out, std::int64_t count, int dtype, std::uint64_t seed,
                          std::uint64_t offset, double scale, bool accumulate, double post,
                          std::uintptr_t stream) {
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

}  // namespace ncdp
