// Kernel 3 of DESIGN.md: the empirical NTK Gram as a sum of Hadamard products,
//   K[i, j] = sum_l (F_l[i] . F2_l[j]) * (B_l[i] . B2_l[j]),
// with F_l the inputs of layer l and B_l its back-propagated output gradients
// (both computed and scaled by the Python layer). A term without F (bias terms)
// contributes B_l[i] . B2_l[j] alone. The two n x n2 factors of a term never
// exist in memory: each output tile forms them in registers and multiplies them
// there. Deterministic (fixed summation order, no atomics).
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

namespace ncdp {

// ---- Python-facing wrapper (pointers as integers, dtype 0 = float32,
// 1 = float64, stream a cudaStream_t as an integer). Sizes are validated, an
// empty K returns at once, CUDA errors raise.
//
// Term l is (f[l], f2[l], b_ptrs[l], b2_ptrs[l]), all row-major contiguous, of
// the input dtype:
//   f[l]       [n, a[l]]   unless constant_one[l]; 0 only when empty
//   f2[l]      [n2, a[l]]  likewise
//   b_ptrs[l]  [n, b[l]]
//   b2_ptrs[l] [n2, b[l]]
// constant_one[l] marks the constant-1 factor of a bias term (F . F2 = 1): then
// f[l] and f2[l] must be 0 and a[l] 0. The flag is explicit because a null
// pointer cannot tell it apart from a real F of width 0 (torch gives empty
// tensors data pointer 0), whose term is zero. Terms that add zero (b[l] = 0,
// or a[l] = 0 without constant_one[l]) are skipped.
// out [n, n2] of out_dtype = K. accumulate_f64 accumulates the tile products and
// the Hadamard sum in float64 for float32 inputs too (float64 inputs always do);
// otherwise float32 inputs accumulate in float32. symmetric: x2 is x (f2 == f,
// b2_ptrs == b_ptrs, n2 == n, checked); only tiles on and above the diagonal are
// computed and each entry is written to K[i, j] and K[j, i], so K is exactly
// symmetric. L = 0 gives K = 0.
void launch_hadamard_gram(const std::vector<std::uintptr_t>& f,
                          const std::vector<std::int64_t>& a,
                          const std::vector<bool>& constant_one,
                          const std::vector<std::uintptr_t>& b_ptrs,
                          const std::vector<std::int64_t>& b,
                          const std::vector<std::uintptr_t>& f2,
                          const std::vector<std::uintptr_t>& b2_ptrs, std::int64_t n,
                          std::int64_t n2, int dtype, bool symmetric, bool accumulate_f64,
                          std::uintptr_t out,  // [n, n2], out_dtype
                          int out_dtype, std::uintptr_t stream);

// ---- Typed launcher (kernel + launch code in hadamard_gram.cu). It assumes
// validated arguments and the right current device.
namespace kernels {

// Output rows (and columns) per thread block: 128 with float32 accumulators
// (8 x 8 per thread), 64 with float64 ones (4 x 4 per thread, each value twice
// the registers). The host wrapper sizes the grid check by it.
constexpr std::int64_t hadamard_gram_tile(bool double_accumulate) {
  return double_accumulate ? 64 : 128;
}

// Terms per launch: they travel as one kernel parameter, which must stay under
// the 4 KB that every architecture accepts. Longer lists are split over
// launches, each later one adding its terms to `out` (read back in Out, so a
// float32 out is rounded once per 64 terms).
constexpr std::int64_t kMaxGramTermsPerLaunch = 64;

template <typename Real>
struct GramTerm {
  // nullptr only for the constant-1 factor: the wrapper drops terms whose F is
  // empty, so a null F never stands for one of width 0.
  const Real* f;   // [n, a], or nullptr for the constant-1 factor
  const Real* f2;  // [n2, a], nullptr with f
  const Real* b;   // [n, b_width]
  const Real* b2;  // [n2, b_width]
  std::int64_t a;
  std::int64_t b_width;
};

// out = sum over terms[0 .. count) as above, accumulated in Acc. n, n2 > 0;
// count >= 0; symmetric implies n2 == n and f2 == f, b2 == b in every term.
template <typename Real, typename Acc, typename Out>
void launch_hadamard_gram(const GramTerm<Real>* terms,  // [count], host memory
                          std::int64_t count, std::int64_t n, std::int64_t n2, bool symmetric,
                          Out* out,  // [n, n2]
                          cudaStream_t stream);

}  // namespace kernels
}  // namespace ncdp
