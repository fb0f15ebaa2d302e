// The clip rule every backend applies (ncdp_fast/reference.py clip_bound and
// clip_factors are its specification; docs/privacy.md, "The clip bound in
// floating point", derives it). The factor is taken against an upper bound on
// the norm *as the kernels compute it*, not against the computed norm, so that
// a sample's contribution stays <= C after every rounding, and it is applied
// in float64: cast to float32 first, a factor below 1.2e-38 would turn into a
// low-precision denormal or 0.
#pragma once
#include <cmath>
#include <cstdint>

#include "common/host_device.h"
#include "common/philox.cuh"  // philox::detail: +, *, / that nvcc never contracts

namespace ncdp {

struct ClipRule {
  double max_norm;       // C
  std::int64_t terms;    // float64 multiply-adds in one sample's squared norm
  std::int64_t seq_len;  // T of a factored sequence block, 1 otherwise
  double unit;           // unit roundoff of the data dtype (2^-24 or 2^-53)
};

// The unit roundoff of the data dtype (reference.unit_roundoff).
template <typename Real>
constexpr double unit_roundoff() {
  return sizeof(Real) == sizeof(float) ? 0x1p-24 : 0x1p-53;
}

// reference.clip_bound, operation for operation. spread (E) is 0 except for
// factored sequence blocks. Every + and * goes through philox::detail (_rn
// intrinsics on the device): nvcc contracts a*b+c into one FMA by default, and
// a fused sq + ge*ge or b + k*E rounds once where the reference rounds twice,
// so the factor would differ in the last bit (issue 24: 106/2000 factors for
// float32 sequence blocks at T = 16). tests/test_ptx_fma.py guards the PTX.
// sqrt is correctly rounded on the device without an intrinsic (sqrt.rn.f64).
NCDP_HOST_DEVICE double clip_bound(double sq, double spread, const ClipRule& rule) {
  using philox::detail::add;
  using philox::detail::mul;
  const double g = mul(static_cast<double>(rule.terms + 4), 0x1p-52);
  // (sqrt(g) E)^2 rather than g E^2: E may be large enough for E^2 to overflow.
  const double ge = mul(std::sqrt(g), spread);
  const double seq = static_cast<double>(rule.seq_len + 2);
  const double b =
      mul(add(std::sqrt(add(sq, mul(ge, ge))), mul(mul(seq, 0x1p-52), spread)), add(1.0, g));
  return mul(add(b, mul(mul(mul(2.0, seq), rule.unit), spread)), add(1.0, mul(4.0, rule.unit)));
}

// 0 when the bound is not finite (a non-finite row: dropped or raised on by
// the Python layer), 1 when it is <= C, C / bound otherwise.
NCDP_HOST_DEVICE double clip_factor(double sq, double spread, const ClipRule& rule) {
  const double bound = clip_bound(sq, spread, rule);
  if (!std::isfinite(bound)) return 0.0;
  return bound <= rule.max_norm ? 1.0 : philox::detail::divide(rule.max_norm, bound);
}

}  // namespace ncdp
