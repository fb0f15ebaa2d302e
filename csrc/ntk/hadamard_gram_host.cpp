// Python-facing wrapper of the Hadamard-product NTK Gram: argument validation,
// the device guard, dtype dispatch and launch error checks. Shapes are in
// hadamard_gram.h.
#include <cuda_runtime_api.h>

#include <limits>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "common/cuda_check.h"
#include "common/launch_config.h"
#include "ntk/hadamard_gram.h"

namespace ncdp {
namespace {

std::string element_name(const char* name, std::size_t l) {
  return std::string(name) + "[" + std::to_string(l) + "]";
}

void require_length(std::size_t length, std::size_t expected, const char* name) {
  if (length != expected) {
    throw std::invalid_argument(std::string("ncdp_fast: ") + name + " has " +
                                std::to_string(length) + " entries, f has " +
                                std::to_string(expected) + " (one per term)");
  }
}

std::string hex(std::uintptr_t ptr) {
  std::ostringstream text;
  text << "0x" << std::hex << ptr;
  return text.str();
}

// The terms the kernel must visit: a term with an empty contraction (b[l] = 0,
// or a[l] = 0 with an F factor) adds zero and is dropped, so that the kernel
// only ever sees null F pointers for constant-1 factors.
template <typename Real>
std::vector<kernels::GramTerm<Real>> contributing_terms(
    const std::vector<std::uintptr_t>& f, const std::vector<std::int64_t>& a,
    const std::vector<bool>& constant_one, const std::vector<std::uintptr_t>& b_ptrs,
    const std::vector<std::int64_t>& b, const std::vector<std::uintptr_t>& f2,
    const std::vector<std::uintptr_t>& b2_ptrs) {
  std::vector<kernels::GramTerm<Real>> terms;
  terms.reserve(f.size());
  for (std::size_t l = 0; l < f.size(); ++l) {
    const bool has_f = !constant_one[l];
    if (b[l] == 0 || (has_f && a[l] == 0)) continue;
    terms.push_back(kernels::GramTerm<Real>{
        has_f ? typed<const Real>(f[l]) : nullptr,
        has_f ? typed<const Real>(f2[l]) : nullptr,
        typed<const Real>(b_ptrs[l]), typed<const Real>(b2_ptrs[l]),
        has_f ? a[l] : 0, b[l]});
  }
  return terms;
}

template <typename Real, typename Acc>
void launch_typed(const std::vector<kernels::GramTerm<Real>>& terms, std::int64_t n,
                  std::int64_t n2, bool symmetric, std::uintptr_t out, int out_dtype,
                  cudaStream_t stream) {
  const auto count = static_cast<std::int64_t>(terms.size());
  if (out_dtype == kDtypeFloat32) {
    kernels::launch_hadamard_gram<Real, Acc, float>(terms.data(), count, n, n2, symmetric,
                                                    typed<float>(out), stream);
  } else {
    kernels::launch_hadamard_gram<Real, Acc, double>(terms.data(), count, n, n2, symmetric,
                                                     typed<double>(out), stream);
  }
}

}  // namespace

void launch_hadamard_gram(const std::vector<std::uintptr_t>& f,
                          const std::vector<std::int64_t>& a,
                          const std::vector<bool>& constant_one,
                          const std::vector<std::uintptr_t>& b_ptrs,
                          const std::vector<std::int64_t>& b,
                          const std::vector<std::uintptr_t>& f2,
                          const std::vector<std::uintptr_t>& b2_ptrs, std::int64_t n,
                          std::int64_t n2, int dtype, bool symmetric, bool accumulate_f64,
                          std::uintptr_t out, int out_dtype, std::uintptr_t stream) {
  const std::size_t terms = f.size();
  require_length(a.size(), terms, "a");
  require_length(constant_one.size(), terms, "constant_one");
  require_length(b_ptrs.size(), terms, "b_ptrs");
  require_length(b.size(), terms, "b");
  require_length(f2.size(), terms, "f2");
  require_length(b2_ptrs.size(), terms, "b2_ptrs");
  require_non_negative(n, "n");
  require_non_negative(n2, "n2");
  const std::size_t element = dtype_size(dtype);
  if (out_dtype != kDtypeFloat32 && out_dtype != kDtypeFloat64) {
    throw std::invalid_argument("ncdp_fast: out_dtype must be 0 (float32) or 1 (float64), got " +
                                std::to_string(out_dtype));
  }
  const std::size_t out_element = dtype_size(out_dtype);
  if (symmetric && n2 != n) {
    throw std::invalid_argument("ncdp_fast: symmetric needs n2 == n, got n = " +
                                std::to_string(n) + ", n2 = " + std::to_string(n2));
  }

  for (std::size_t l = 0; l < terms; ++l) {
    const std::string b_name = element_name("b", l);
    require_non_negative(b[l], b_name.c_str());
    const std::int64_t b_count = checked_mul(n, b[l], "n * b[l]");
    const std::int64_t b2_count = checked_mul(n2, b[l], "n2 * b[l]");
    require_pointer(b_ptrs[l], b_count > 0, element, element_name("b_ptrs", l).c_str());
    require_pointer(b2_ptrs[l], b2_count > 0, element, element_name("b2_ptrs", l).c_str());
    if (constant_one[l]) {
      if (f[l] != 0 || f2[l] != 0 || a[l] != 0) {
        throw std::invalid_argument(
            "ncdp_fast: " + element_name("constant_one", l) + " is set (the constant-1 factor "
            "of a bias term, which has no data), so " + element_name("f", l) + ", " +
            element_name("f2", l) + " and " + element_name("a", l) + " must be 0, got " +
            hex(f[l]) + ", " + hex(f2[l]) + " and " + std::to_string(a[l]));
      }
    } else {
      // A real F, possibly of width 0: its pointers may be 0 only when empty.
      const std::string a_name = element_name("a", l);
      require_non_negative(a[l], a_name.c_str());
      const std::int64_t f_count = checked_mul(n, a[l], "n * a[l]");
      const std::int64_t f2_count = checked_mul(n2, a[l], "n2 * a[l]");
      require_pointer(f[l], f_count > 0, element, element_name("f", l).c_str());
      require_pointer(f2[l], f2_count > 0, element, element_name("f2", l).c_str());
    }
    if (symmetric && (f2[l] != f[l] || b2_ptrs[l] != b_ptrs[l])) {
      throw std::invalid_argument("ncdp_fast: symmetric needs f2 == f and b2_ptrs == b_ptrs; "
                                  "term " + std::to_string(l) + " differs");
    }
  }

  const std::int64_t out_count = checked_mul(n, n2, "n * n2");
  require_pointer(out, out_count > 0, out_element, "out");
  // One block per output tile, numbered along gridDim.x.
  const bool double_accumulate = accumulate_f64 || dtype == kDtypeFloat64;
  const std::int64_t tile = kernels::hadamard_gram_tile(double_accumulate);
  const std::int64_t tiles_i = ceil_div(n, tile);
  const std::int64_t tiles_j = ceil_div(n2, tile);
  const std::int64_t blocks = symmetric ? checked_mul(tiles_i, tiles_i + 1, "tiles") / 2
                                        : checked_mul(tiles_i, tiles_j, "tiles");
  if (blocks > std::numeric_limits<int>::max()) {
    throw std::invalid_argument("ncdp_fast: K of " + std::to_string(n) + " x " +
                                std::to_string(n2) + " needs " + std::to_string(blocks) +
                                " tiles, more than one launch holds (2^31 - 1)");
  }
  if (out_count == 0) return;

  // The launch runs on the device of the first buffer in argument order.
  std::uintptr_t first = 0;
  std::string first_name;
  const std::pair<const std::vector<std::uintptr_t>*, const char*> inputs[] = {
      {&f, "f"}, {&b_ptrs, "b_ptrs"}, {&f2, "f2"}, {&b2_ptrs, "b2_ptrs"}};
  for (const auto& [pointers, name] : inputs) {
    for (std::size_t l = 0; l < pointers->size() && first == 0; ++l) {
      if ((*pointers)[l] != 0) {
        first = (*pointers)[l];
        first_name = element_name(name, l);
      }
    }
  }
  if (first == 0) {
    first = out;
    first_name = "out";
  }
  DeviceGuard guard(first, first_name.c_str());

  const cudaStream_t cuda_stream = as_stream(stream);
  if (dtype == kDtypeFloat32) {
    const auto typed_terms =
        contributing_terms<float>(f, a, constant_one, b_ptrs, b, f2, b2_ptrs);
    if (accumulate_f64) {
      launch_typed<float, double>(typed_terms, n, n2, symmetric, out, out_dtype, cuda_stream);
    } else {
      launch_typed<float, float>(typed_terms, n, n2, symmetric, out, out_dtype, cuda_stream);
    }
  } else {
    const auto typed_terms =
        contributing_terms<double>(f, a, constant_one, b_ptrs, b, f2, b2_ptrs);
    launch_typed<double, double>(typed_terms, n, n2, symmetric, out, out_dtype, cuda_stream);
  }
  check_launch("hadamard_gram");
}

}  // namespace ncdp
