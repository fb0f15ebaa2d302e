// The one random stream of ncdp_fast (DESIGN.md, "Random numbers"): Philox4x32-10
// keyed by a 64-bit seed, addressed by a 64-bit word index. ncdp_fast/reference.py
// is the specification; the numba kernels implement the same formulas, so every
// helper here is usable from host code too (the host-side tests compile this
// header with a plain C++ compiler).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "common/host_device.h"

namespace ncdp {
namespace philox {

constexpr std::uint32_t kM0 = 0xD2511F53u;
constexpr std::uint32_t kM1 = 0xCD9E8D57u;
constexpr std::uint32_t kW0 = 0x9E3779B9u;
constexpr std::uint32_t kW1 = 0xBB67AE85u;
constexpr int kRounds = 10;
// Four 32-bit words per Philox block.
constexpr int kWordsPerBlock = 4;
// 2 * pi exactly as reference.py forms it (2.0 * np.pi), so the angle matches bit for bit.
constexpr double kTwoPi = 2.0 * 3.141592653589793;
constexpr double kTwoPow32 = 4294967296.0;

struct Block {
  std::uint32_t w[4];
};

// The 64-bit product of two words as (high, low) words. On the device from
// __umulhi and a 32-bit multiply, which ptxas fuses into one IMAD.WIDE.U32:
// written as a uint64_t product, the front end widened the whole round to
// 64-bit multiplies, xors and adds, and ptxas kept an add of a zero high word
// per product (two of a round's six instructions). The emulated device runs
// the device form (its __umulhi, tests/cuda_emu), the host build the other:
// both are held to the numba twin's words.
NCDP_HOST_DEVICE void mul_wide(std::uint32_t a, std::uint32_t b, std::uint32_t* hi,
                               std::uint32_t* lo) {
#if defined(__CUDA_ARCH__) || defined(NCDP_CPU_EMULATION)
  *hi = __umulhi(a, b);
  *lo = a * b;
#else
  const std::uint64_t p = static_cast<std::uint64_t>(a) * b;
  *hi = static_cast<std::uint32_t>(p >> 32);
  *lo = static_cast<std::uint32_t>(p);
#endif
}

// Philox4x32-10 of counter (c0..c3) under key (k0, k1).
NCDP_HOST_DEVICE Block philox4x32_10(std::uint32_t k0, std::uint32_t k1, std::uint32_t c0,
                                     std::uint32_t c1, std::uint32_t c2, std::uint32_t c3) {
NCDP_UNROLL
  for (int round = 0; round < kRounds; ++round) {
    if (round > 0) {
      k0 += kW0;
      k1 += kW1;
    }
    std::uint32_t hi0, lo0, hi1, lo1;
    mul_wide(kM0, c0, &hi0, &lo0);
    mul_wide(kM1, c2, &hi1, &lo1);
    const std::uint32_t n0 = hi1 ^ c1 ^ k0;
    const std::uint32_t n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
  }
  return Block{{c0, c1, c2, c3}};
}

// Block b of stream `seed`: key (seed mod 2^32, seed >> 32), counter (b mod 2^32, b >> 32, 0, 0).
NCDP_HOST_DEVICE Block stream_block(std::uint64_t seed, std::uint64_t block) {
  return philox4x32_10(static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32),
                       static_cast<std::uint32_t>(block), static_cast<std::uint32_t>(block >> 32),
                       0u, 0u);
}

// Draw (32-bit word) `index` of stream `seed`.
NCDP_HOST_DEVICE std::uint32_t word_at(std::uint64_t seed, std::uint64_t index) {
  return stream_block(seed, index >> 2).w[index & 3];
}

// Correctly rounded +, -, *, /, sqrt and exact bit moves, for every formula
// whose bits the numba twin must reproduce: on the device each goes through an
// explicit _rn intrinsic, which nvcc never contracts into an FMA (plain
// operators it would); the host build targets x86-64 without FMA
// instructions, so g++ cannot contract there.
namespace detail {
#if defined(__CUDA_ARCH__) && !defined(NCDP_CPU_EMULATION)
NCDP_HOST_DEVICE double add(double a, double b) { return __dadd_rn(a, b); }
NCDP_HOST_DEVICE double sub(double a, double b) { return __dsub_rn(a, b); }
NCDP_HOST_DEVICE double mul(double a, double b) { return __dmul_rn(a, b); }
NCDP_HOST_DEVICE double divide(double a, double b) { return __ddiv_rn(a, b); }
NCDP_HOST_DEVICE double sqrt_rn(double a) { return __dsqrt_rn(a); }
NCDP_HOST_DEVICE std::int64_t bits_of(double x) { return __double_as_longlong(x); }
NCDP_HOST_DEVICE double from_bits(std::int64_t b) { return __longlong_as_double(b); }
#else
NCDP_HOST_DEVICE double add(double a, double b) { return a + b; }
NCDP_HOST_DEVICE double sub(double a, double b) { return a - b; }
NCDP_HOST_DEVICE double mul(double a, double b) { return a * b; }
NCDP_HOST_DEVICE double divide(double a, double b) { return a / b; }
NCDP_HOST_DEVICE double sqrt_rn(double a) { return std::sqrt(a); }
NCDP_HOST_DEVICE std::int64_t bits_of(double x) {
  std::int64_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}
NCDP_HOST_DEVICE double from_bits(std::int64_t b) {
  double x;
  std::memcpy(&x, &b, sizeof x);
  return x;
}
#endif
}  // namespace detail

// Box-Muller pair `pair` (reference/rng.py) reads half h = pair & 1 of three
// blocks of m = pair >> 1: its draws (a, b) from main block m, words (y, v)
// from the companion block 2^63 + m, and, only when a < 2^21, words (x0, x1)
// from the deep block 2^62 + m. Draws stop below block 2^62, so no draw reads
// those two: u1 has 64 bits, 128 below 2^-11, so |z| <= sqrt(258 ln 2) ~ 13.37
// instead of 6.76 with a 32-bit u1 (issue 23, item 5).
constexpr std::uint64_t kCompanionBlock = std::uint64_t{1} << 63;
constexpr std::uint64_t kDeepBlock = std::uint64_t{1} << 62;
constexpr std::uint32_t kDeepBelow = std::uint32_t{1} << 21;
constexpr double kTwoPow64 = 18446744073709551616.0;
constexpr double kTwoPow96 = kTwoPow64 * kTwoPow32;
constexpr double kTwoPowM64 = 1.0 / kTwoPow64;
constexpr double kTwoPowM128 = kTwoPowM64 * kTwoPowM64;

// (u1, u2) of a pair's draws (a, b), companion words (y, v) and deep words
// (x0, x1), the last two unused when a >= kDeepBelow (reference.uniforms_of_words).
// The sums run in reference.py's order; every product is by a power of two and
// exact, so a contracted multiply-add rounds exactly as the separate operations.
NCDP_HOST_DEVICE void uniforms_of_words(std::uint32_t a, std::uint32_t b, std::uint32_t y,
                                        std::uint32_t v, std::uint32_t x0, std::uint32_t x1,
                                        double* u1, double* u2) {
  *u2 = ((static_cast<double>(v) + 0.5) + static_cast<double>(b) * kTwoPow32) * kTwoPowM64;
  if (a >= kDeepBelow) {
    *u1 = ((static_cast<double>(y) + 0.5) + static_cast<double>(a) * kTwoPow32) * kTwoPowM64;
  } else {
    *u1 = ((((static_cast<double>(x1) + 0.5) + static_cast<double>(x0) * kTwoPow32) +
            static_cast<double>(y) * kTwoPow64) +
           static_cast<double>(a) * kTwoPow96) * kTwoPowM128;
  }
}

// The half of block `x` that pair `pair` reads. Selects, not x.w[2 * (pair & 1)]:
// nvcc keeps an array indexed by a run-time value in local memory, not registers.
NCDP_HOST_DEVICE void pair_half(const Block& x, std::uint64_t pair, std::uint32_t* first,
                                std::uint32_t* second) {
  const bool high = (pair & 1) != 0;
  *first = high ? x.w[2] : x.w[0];
  *second = high ? x.w[3] : x.w[1];
}

// The blocks a pair always reads: main block m and its companion, computed
// once for both pairs of m.
struct PairBlocks {
  Block main;
  Block companion;
};

NCDP_HOST_DEVICE PairBlocks pair_blocks(std::uint64_t seed, std::uint64_t m) {
  return PairBlocks{stream_block(seed, m), stream_block(seed, kCompanionBlock + m)};
}

// (u1, u2) of pair `pair`, whose main block and companion are `blocks`
// (pair_blocks(seed, pair >> 1)); the deep block is computed here, only for a
// pair that reads it (probability 2^-11).
NCDP_HOST_DEVICE void pair_uniforms(std::uint64_t seed, std::uint64_t pair,
                                    const PairBlocks& blocks, double* u1, double* u2) {
  std::uint32_t a, b, y, v, x0 = 0, x1 = 0;
  pair_half(blocks.main, pair, &a, &b);
  pair_half(blocks.companion, pair, &y, &v);
  if (a < kDeepBelow) pair_half(stream_block(seed, kDeepBlock + (pair >> 1)), pair, &x0, &x1);
  uniforms_of_words(a, b, y, v, x0, x1, u1, u2);
}

// ---------------------------------------------------------------------------
// Sub-streams (reference.py, "Kernel 2"): sampling draws never touch the main
// stream. Sub-stream `sid` (>= 1) is Philox with counter (b lo, b hi, sid lo,
// sid hi); its uniform j is the pair of words (2j, 2j+1) as a 53-bit float.

constexpr double kTwoPow26 = 67108864.0;
constexpr double kTwoPow53 = 9007199254740992.0;

// Block b of sub-stream `sid` of stream `seed`.
NCDP_HOST_DEVICE Block substream_block(std::uint64_t seed, std::uint64_t sid, std::uint64_t block) {
  return philox4x32_10(static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32),
                       static_cast<std::uint32_t>(block), static_cast<std::uint32_t>(block >> 32),
                       static_cast<std::uint32_t>(sid), static_cast<std::uint32_t>(sid >> 32));
}

// ((w_even >> 5) * 2^26 + (w_odd >> 6) + 0.5) / 2^53 in float64, in (0, 1]
// (the top value rounds to 1.0). The product is exact and the integer sum below
// 2^53, so a fused multiply-add gives the same bits as reference.py.
NCDP_HOST_DEVICE double uniform53(std::uint32_t w_even, std::uint32_t w_odd) {
  return (static_cast<double>(w_even >> 5) * kTwoPow26 + static_cast<double>(w_odd >> 6) + 0.5) /
         kTwoPow53;
}

// Uniform `index` of sub-stream `sid`: words 2*index and 2*index+1, i.e. the
// first or the second half of block index / 2.
NCDP_HOST_DEVICE double substream_uniform(std::uint64_t seed, std::uint64_t sid,
                                          std::uint64_t index) {
  const Block b = substream_block(seed, sid, index >> 1);
  return (index & 1) ? uniform53(b.w[2], b.w[3]) : uniform53(b.w[0], b.w[1]);
}

// ---------------------------------------------------------------------------
// The sampler's logarithm (reference.sampler_log / sampler_log1p, fdlibm's
// e_log.c): geometric gaps floor(log(u) / log1p(-q)) must not depend on the
// device's or the host's libm, or a one-ulp difference moves a membership.
// Only exact bit manipulation and correctly rounded +, -, *, / in the order
// written (detail::, above).

constexpr double kTwoPow54 = 18014398509481984.0;
constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kMinNormal = 2.2250738585072014e-308;  // 2^-1022
constexpr std::int64_t kMantissaMask = (std::int64_t{1} << 52) - 1;
// fdlibm's split point ~sqrt(2) (high word 0x6a09c): mantissas above it are
// taken with exponent -1, so that m lies in [0.7071, 1.4142).
constexpr std::int64_t kSqrt2Mantissa = 0x6a09c00000000;

constexpr std::int64_t kExpOne = std::int64_t{0x3FF} << 52;

// The float64 constants of the log, sine and cosine (fdlibm's, the numba
// twin's; all have a non-zero low word). As literals each cost the device two
// uniform moves at every use (ptxas rematerialises them: there are too many to
// keep); from a __constant__ table one uniform load. The host and the emulated
// device read the constexpr.
struct RoundedConstants {
  // ln 2 = ln2_hi + ln2_lo; ln2_hi ends in 21 zero bits, so k * ln2_hi is exact.
  double ln2_hi, ln2_lo;
  // R(z) = Lg1 z + ... + Lg7 z^7 ~ (log(1+f) - 2s) / s, z = s^2 (e_log.c's Remez fit).
  double lg[7];
  // fl(2 pi) as reference.py forms it, and the Cody-Waite reduction by pi/2 (a
  // two-part constant).
  double two_pi, inv_pio2, pio2_hi, pio2_lo;
  // The kernel polynomials of sin and cos on [-pi/4, pi/4] (k_sin.c, k_cos.c).
  double sin[6], cos[6];
};
constexpr RoundedConstants kRoundedConstants = {
    6.93147180369123816490e-01,  // 0x3fe62e42fee00000
    1.90821492927058770002e-10,  // 0x3dea39ef35793c76
    {6.666666666666735130e-01, 3.999999999940941908e-01, 2.857142874366239149e-01,
     2.222219843214978396e-01, 1.818357216161805012e-01, 1.531383769920937332e-01,
     1.479819860511658591e-01},
    kTwoPi,
    6.36619772367581382433e-01,
    1.57079632673412561417e+00,
    6.07710050650619224932e-11,
    {-1.66666666666666324348e-01, 8.33333333332248946124e-03, -1.98412698298579493134e-04,
     2.75573137070700676789e-06, -2.50507602534068634195e-08, 1.58969099521155010221e-10},
    {4.16666666666666019037e-02, -1.38888888888741095749e-03, 2.48015872894767294178e-05,
     -2.75573143513906633035e-07, 2.08757232129817482790e-09, -1.13596475577881948265e-11}};
#if defined(__CUDACC__) && !defined(NCDP_CPU_EMULATION)
// One copy per translation unit (internal linkage), as the literals were.
static __constant__ RoundedConstants kDeviceRoundedConstants = kRoundedConstants;
#endif

NCDP_HOST_DEVICE const RoundedConstants& rounded_constants() {
#if defined(__CUDA_ARCH__) && !defined(NCDP_CPU_EMULATION)
  return kDeviceRoundedConstants;
#else
  return kRoundedConstants;
#endif
}

// e_log.c's log(2^k (1 + f)) for f in [sqrt(2)/2 - 1, sqrt(2) - 1) and dk = k:
// log(1 + f) from s = f / (2 + f) and the Remez fit, in its order. The
// sampler's log and the normals' share it (their reductions differ).
NCDP_HOST_DEVICE double log_of_reduced(double f, double dk) {
  using namespace detail;
  const double s = divide(f, add(2.0, f));
  const double z = mul(s, s);
  const double w = mul(z, z);
  const RoundedConstants& K = rounded_constants();
  const double* lg = K.lg;
  const double r =
      add(mul(z, add(lg[0], mul(w, add(lg[2], mul(w, add(lg[4], mul(w, lg[6]))))))),
          mul(w, add(lg[1], mul(w, add(lg[3], mul(w, lg[5]))))));
  const double hfsq = mul(mul(0.5, f), f);
  return sub(mul(dk, K.ln2_hi),
             sub(sub(hfsq, add(mul(s, add(hfsq, r)), mul(dk, K.ln2_lo))), f));
}

// log(x), < 1 ulp; log(0) = -inf, log(+inf) = +inf, log(x < 0) = log(NaN) = NaN.
NCDP_HOST_DEVICE double sampler_log(double x) {
  using namespace detail;
  if (!(x > 0.0)) return x == 0.0 ? -kInf : kNaN;
  if (x == kInf) return x;
  std::int64_t k = 0;
  if (x < kMinNormal) {  // subnormal: scale to normal, exactly
    x = mul(x, kTwoPow54);
    k = -54;
  }
  const std::int64_t bits = bits_of(x);
  k += (bits >> 52) - 1023;
  const std::int64_t mantissa = bits & kMantissaMask;
  const std::int64_t half = mantissa >= kSqrt2Mantissa ? 1 : 0;
  const double f = sub(from_bits(mantissa | ((1023 - half) << 52)), 1.0);
  k += half;
  return log_of_reduced(f, static_cast<double>(k));
}

// log(1 + x) for x >= -1, <= 2 ulp: u = 1 + x rounded, c = (1 + x) - u exactly
// (Fast2Sum), log(u) + c / u. -0 and 0 give +0, x = -1 gives -inf, NaN stays NaN.
NCDP_HOST_DEVICE double sampler_log1p(double x) {
  using namespace detail;
  const double u = add(1.0, x);
  if (u == 0.0) return -kInf;
  if (u == kInf) return u;
  const double c = x <= 1.0 ? sub(x, sub(u, 1.0)) : sub(1.0, sub(u, x));
  return add(sampler_log(u), divide(c, u));
}

// ---------------------------------------------------------------------------
// The normals (reference/rng.py, "Random-number contract"). Their logarithm,
// sine and cosine are the numba twin's (_numba/rng.py log_normal and
// cos_sin_2pi: fdlibm's e_log.c, e_rem_pio2.c, k_sin.c and k_cos.c without
// branches) in the same IEEE operations in the same order, each rounded on
// its own (detail::, never contracted), and so are the radius, the products
// and the finish: a CUDA kernel's normals are the numba kernel's bits, each
// within a float64 ulp of libm's log, sin and cos of the same argument (the
// reference's). They replaced the device's log, sin and cos (issue 36): one
// argument reduction for the pair's sine and cosine, no slow path for huge
// arguments (the angle is at most 2 pi), no stack frame.

// A small signed integer k as a double: k added to the bits of 1.5 2^52 (k
// borrows from or carries into the mantissa's top half only) is 1.5 2^52 + k,
// less 1.5 2^52 exactly; on the device one float64 add where a conversion
// would take a quarter-rate pipe.
constexpr std::int64_t kOneAndHalfTwoPow52Bits = std::int64_t{0x4338} << 48;
constexpr double kOneAndHalfTwoPow52 = 6755399441055744.0;
// kSqrt2's mantissa bits (0x3FF6A09E667F3BCD): for m in [1, 2), m > kSqrt2
// exactly when m's mantissa bits are above these.
constexpr std::int64_t kSqrt2Bits = 0x6A09E667F3BCD;

// ln(u) for a normal positive finite u (u1 >= 2^-129 always is). The twin
// halves m by the product m (1 - 0.5 big) and converts the exponent; both are
// exact, so setting the halved m's exponent bits and the integer trick above
// give its bits.
NCDP_HOST_DEVICE double log_normal(double u) {
  using namespace detail;
  const std::int64_t b = bits_of(u);
  const std::int64_t mantissa = b & kMantissaMask;  // u = 2^k m, m in [1, 2)
  const std::int64_t big = mantissa > kSqrt2Bits ? 1 : 0;
  const double m = from_bits(mantissa | (kExpOne - (big << 52)));  // m in [sqrt(2)/2, sqrt(2))
  const double dk = sub(from_bits(kOneAndHalfTwoPow52Bits + ((b >> 52) - 1023 + big)),
                        kOneAndHalfTwoPow52);
  return log_of_reduced(sub(m, 1.0), dk);
}

// (cos, sin) of the reference's rounded angle fl(2 pi u2), u2 in (0, 1]: the
// quadrant q of the reduction picks and signs the two kernel values (the twin
// by exact products with 0, 1 and -1; here by selects, to the same bits).
NCDP_HOST_DEVICE void cos_sin_2pi(double u2, double* c, double* s) {
  using namespace detail;
  const RoundedConstants& K = rounded_constants();
  const double* S = K.sin;
  const double* C = K.cos;
  const double t = mul(K.two_pi, u2);
  const double q = floor(add(mul(t, K.inv_pio2), 0.5));
  const double x = sub(sub(t, mul(q, K.pio2_hi)), mul(q, K.pio2_lo));  // |x| <= pi/4
  const double zz = mul(x, x);
  const double sn = add(x, mul(mul(zz, x),
                               add(S[0], mul(zz, add(S[1], mul(zz, add(S[2], mul(zz, add(S[3],
                                   mul(zz, add(S[4], mul(zz, S[5]))))))))))));
  const double rc = mul(zz, add(C[0], mul(zz, add(C[1], mul(zz, add(C[2], mul(zz, add(C[3],
                                    mul(zz, add(C[4], mul(zz, C[5])))))))))));
  const double hz = mul(0.5, zz);
  const double w = sub(1.0, hz);
  const double cs = add(w, add(sub(sub(1.0, w), hz), mul(zz, rc)));
  // The twin forms a = cs even + sn odd and b = sn even + cs odd from exact
  // 0/1 products, then signs them by products with +-1. cs >= cos(pi/4) is
  // positive and both are finite, so its a and b are cs and sn + 0 (the sum
  // with a zero product turns -0 into +0), picked by the quadrant's parity,
  // and its sign products are negations: the same bits with one add.
  const std::int64_t k = static_cast<std::int64_t>(q);
  const double sp = add(sn, 0.0);
  const bool odd = (k & 1) != 0;
  const double a = odd ? sp : cs;
  const double b = odd ? cs : sp;
  *c = (((k + 1) >> 1) & 1) != 0 ? -a : a;
  *s = ((k >> 1) & 1) != 0 ? -b : b;
}

// The Box-Muller radius sqrt(-2 ln u1).
NCDP_HOST_DEVICE double radius_of(double u1) {
  return detail::sqrt_rn(detail::mul(-2.0, log_normal(u1)));
}

// Radius sqrt(-2 ln u1) and (cos, sin)(2 pi u2) of pair `pair` (blocks as in
// pair_uniforms).
NCDP_HOST_DEVICE void box_muller_pair(std::uint64_t seed, std::uint64_t pair,
                                      const PairBlocks& blocks, double* radius, double* c,
                                      double* s) {
  double u1, u2;
  pair_uniforms(seed, pair, blocks, &u1, &u2);
  *radius = radius_of(u1);
  cos_sin_2pi(u2, c, s);
}

// The four normals of stream indices 4*block .. 4*block+3 (pairs 2*block and
// 2*block+1, whose draws are one Philox block); kernels that need consecutive
// normals use this so that the main and companion blocks are computed once.
// The two pairs go through each stage side by side: on the device each float64
// constant is then loaded once for both (a uniform register holds it), and the
// fill and finish kernels fit their 48 registers without a spill (pair by pair,
// the slab kernels spilled 4 bytes).
NCDP_HOST_DEVICE void normals_of_block(std::uint64_t seed, std::uint64_t block, double z[4]) {
  const PairBlocks blocks = pair_blocks(seed, block);
  double u1[2], u2[2], radius[2], c[2], s[2];
NCDP_UNROLL
  for (int h = 0; h < 2; ++h) pair_uniforms(seed, 2 * block + h, blocks, &u1[h], &u2[h]);
NCDP_UNROLL
  for (int h = 0; h < 2; ++h) radius[h] = radius_of(u1[h]);
NCDP_UNROLL
  for (int h = 0; h < 2; ++h) cos_sin_2pi(u2[h], &c[h], &s[h]);
NCDP_UNROLL
  for (int h = 0; h < 2; ++h) {
    z[2 * h] = detail::mul(radius[h], c[h]);
    z[2 * h + 1] = detail::mul(radius[h], s[h]);
  }
}

// Normal variate `index` of stream `seed` (index = offset + j), on its own.
NCDP_HOST_DEVICE double normal_at(std::uint64_t seed, std::uint64_t index) {
  double radius, c, s;
  box_muller_pair(seed, index >> 1, pair_blocks(seed, index >> 2), &radius, &c, &s);
  return detail::mul(radius, (index & 1) ? s : c);
}

// A noisy sum's finish, post (src + scale z), and a fill's, post (scale z):
// the numba twin's operations (_numba/rng.py _store), so its bits.
NCDP_HOST_DEVICE double finish_normal(double src, double scale, double z, double post) {
  return detail::mul(post, detail::add(src, detail::mul(scale, z)));
}
NCDP_HOST_DEVICE double fill_normal(double scale, double z, double post) {
  return detail::mul(post, detail::mul(scale, z));
}

}  // namespace philox
}  // namespace ncdp
