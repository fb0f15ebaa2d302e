"""DESIGN.md kernel 2: Poisson / hierarchical subsampling with averaging.

Sampling draws never come from the main stream (counter words 2-3 zero) but
from *sub-streams*: sub-stream ``sid >= 1`` is Philox with counter
``(b lo, b hi, sid lo, sid hi)``.  A *uniform* is a pair of sub-stream words
(2j, 2j+1) turned into a 53-bit float in (0, 1):
    u_j = ((w_2j >> 5) * 2^26 + (w_2j+1 >> 6) + 0.5) / 2^53.

Output row t of a mix call at (seed, offset) with d features and K classes:
  * its Gaussian noise is main-stream normals offset + t(d+K) + c, c < d for x,
    then d <= c < d+K for y: the call consumes T(d+K) draws;
  * its sampling uses sub-stream sid = 1 + offset + t(d+K), so a row range
    [t0, t1) run alone with offset' = offset + t0(d+K) reproduces those rows,
    and calls whose noise ranges are disjoint never share a sub-stream;
  * hierarchical sampling spends uniforms 0..K-1 on the classes (class k is
    selected iff u_k < p_k), then, class by class in increasing k, walks the
    class's members (in increasing example index) by geometric skipping;
    Poisson sampling walks all n examples as one class, from uniform 0;
  * geometric skipping with rate q: gap = floor(log(u) / log1p(-q)) unselected
    members are skipped, then one is selected; stops when past the end.
    Exactly the Bernoulli(q) process (P(gap >= g) = (1-q)^g).  log and log1p
    are sampler_log / sampler_log1p below, not the platform's libm: a one-ulp
    difference between two libms (or the GPU's) can move floor() across an
    integer and change a membership.
A DP-SGD batch plan (poisson_batches) walks all n examples for step s with
sub-stream sid = 1 + offset + s and advances the offset by ``steps``.
"""
from __future__ import annotations

import math
import struct

import numpy as np

from .clip import clip_factors, unit_roundoff
from .rng import MASK32, check_seed_offset, gaussian, philox4x32_10


TWO_POW_53 = 9007199254740992.0


def substream_words(count, *, seed, sid):
    """Words 0 .. count-1 of sub-stream ``sid`` (uint32 array)."""
    seed, _ = check_seed_offset(seed, 0)
    key = (seed & MASK32, seed >> 32)
    out = np.empty(count, dtype=np.uint32)
    for w in range(count):
        b = w >> 2
        out[w] = philox4x32_10(key, (b & MASK32, b >> 32, sid & MASK32, sid >> 32))[w & 3]
    return out


class Uniforms:
    """Sequential 53-bit uniforms of one sub-stream."""

    def __init__(self, seed, sid):
        self.seed, self.sid, self.j = seed, sid, 0

    def next(self):
        key = (self.seed & MASK32, self.seed >> 32)
        w0, w1 = (philox4x32_10(key, ((2 * self.j + k) >> 2 & MASK32, (2 * self.j + k) >> 34,
                                      self.sid & MASK32, self.sid >> 32))[(2 * self.j + k) & 3]
                  for k in (0, 1))
        self.j += 1
        return ((w0 >> 5) * 67108864.0 + (w1 >> 6) + 0.5) / TWO_POW_53


# ---- The sampler's logarithm: the same bits on every backend.
#
# fdlibm's e_log.c (Sun Microsystems, 1993; error < 1 ulp), restated on 64-bit
# integers and evaluated with +, -, *, / only, always in the order written and
# never fused into a multiply-add: each of those is correctly rounded by IEEE
# 754, and the exponent split is exact bit manipulation, so the C++
# (csrc/common/philox.cuh, also on the GPU) and numba (_numba/mix.py) copies
# give these bits wherever they run.  Python floats are IEEE doubles and
# CPython never contracts, which makes this the specification.

# ln 2 = LN2_HI + LN2_LO; LN2_HI ends in 21 zero bits, so k * LN2_HI is exact for
# every exponent k of a double.
LOG_LN2_HI = 6.93147180369123816490e-01    # 0x3fe62e42fee00000
LOG_LN2_LO = 1.90821492927058770002e-10    # 0x3dea39ef35793c76
# R(z) = LG1 z + ... + LG7 z^7 ~ (log(1+f) - 2s) / s with z = s^2, |s| <= 0.1716
# (fdlibm's Remez fit, error below 2^-58.45).
LOG_LG1 = 6.666666666666735130e-01
LOG_LG2 = 3.999999999940941908e-01
LOG_LG3 = 2.857142874366239149e-01
LOG_LG4 = 2.222219843214978396e-01
LOG_LG5 = 1.818357216161805012e-01
LOG_LG6 = 1.531383769920937332e-01
LOG_LG7 = 1.479819860511658591e-01
LOG_TWO_POW_54 = 18014398509481984.0
LOG_MANTISSA = (1 << 52) - 1
# Mantissa bits of fdlibm's split point ~sqrt(2) (high word 0x6a09c): above it the
# mantissa is taken with exponent -1, so that m = x / 2^k lies in [0.7071, 1.4142).
LOG_SQRT2_MANTISSA = 0x6a09c00000000


def _f64_bits(x):
    return struct.unpack("<Q", struct.pack("<d", x))[0]


def _f64_from_bits(b):
    return struct.unpack("<d", struct.pack("<Q", b))[0]


def sampler_log(x):
    """Natural log of a float, bit-identical on every backend (< 1 ulp, fdlibm).

    x = 2^k m with m in [sqrt(2)/2, sqrt(2)) by exact bit manipulation; with
    f = m - 1 (exact), s = f / (2 + f) and hfsq = f^2 / 2,
    log(x) = k ln2_hi - ((hfsq - (s (hfsq + R(s^2)) + k ln2_lo)) - f).
    log(0) = -inf, log(+inf) = +inf, log(x < 0) = log(NaN) = NaN.  (fdlibm
    switches to a cheaper form of the last line for most f; this always uses
    the one it states as the more accurate.)
    """
    x = float(x)
    if not x > 0.0:
        return -math.inf if x == 0.0 else math.nan
    if x == math.inf:
        return x
    k = 0
    if x < 2.0 ** -1022:                 # subnormal: scale to normal, exactly
        x *= LOG_TWO_POW_54
        k = -54
    bits = _f64_bits(x)
    k += (bits >> 52) - 1023
    mantissa = bits & LOG_MANTISSA
    half = 1 if mantissa >= LOG_SQRT2_MANTISSA else 0
    f = _f64_from_bits(mantissa | ((1023 - half) << 52)) - 1.0
    k += half
    s = f / (2.0 + f)
    z = s * s
    w = z * z
    r = z * (LOG_LG1 + w * (LOG_LG3 + w * (LOG_LG5 + w * LOG_LG7))) + w * (LOG_LG2 + w * (LOG_LG4 + w * LOG_LG6))
    hfsq = 0.5 * f * f
    dk = float(k)
    return dk * LOG_LN2_HI - ((hfsq - (s * (hfsq + r) + dk * LOG_LN2_LO)) - f)


def sampler_log1p(x):
    """log(1 + x) for x >= -1, bit-identical on every backend (<= 2 ulp).

    u = 1 + x rounded; c = (1 + x) - u exactly (Fast2Sum, the larger operand
    first); log(1 + x) = log(u) + log(1 + c/u) = sampler_log(u) + c/u, the
    neglected (c/u)^2/2 being below 2^-105.  So x = -0 and 0 give +0, tiny x
    gives x (u = 1, c = x), x = -1 gives -inf, x < -1 and NaN give NaN.
    """
    x = float(x)
    u = 1.0 + x
    if u == 0.0:
        return -math.inf
    if u == math.inf:
        return u
    c = x - (u - 1.0) if x <= 1.0 else 1.0 - (u - x)
    return sampler_log(u) + c / u


def _walk(uniforms, n_members, q):
    """Positions selected by the Bernoulli(q) process over n_members, by skipping."""
    picked, pos = [], -1
    log1mq = sampler_log1p(-q)
    while True:
        u = uniforms.next()
        gap = np.floor(sampler_log(u) / log1mq) if log1mq != 0 else np.inf
        # Gaps of 2^53 or more (or NaN) end the walk on every backend (mix.cu's cap).
        if not gap < 2.0 ** 53 or pos + 1 + gap >= n_members:
            return picked
        pos = int(pos + 1 + gap)
        picked.append(pos)


def sample_groups(labels, *, num_samples, mixup_degree, class_rate=None, num_classes=None,
                  seed, offset=0, row_stride=1):
    """Membership lists I_t of DESIGN.md kernel 2, in sampler order (selected
    classes in increasing k, increasing example id within a class).

    ``row_stride`` is the number of main-stream draws a row owns (d + K for
    ``mix``), which fixes its sub-stream id ``1 + offset + t * row_stride``.
    """
    labels = np.asarray(labels)
    n = labels.shape[0]
    m = mixup_degree
    groups = []
    if class_rate is None:
        q = m / n
        for t in range(num_samples):
            groups.append(_walk(Uniforms(seed, 1 + offset + t * row_stride), n, q))
        return groups
    K = num_classes
    p = np.broadcast_to(np.asarray(class_rate, dtype=np.float64), (K,))
    members = [np.flatnonzero(labels == k) for k in range(K)]
    for t in range(num_samples):
        uni = Uniforms(seed, 1 + offset + t * row_stride)
        chosen = [k for k in range(K) if uni.next() < p[k]]
        picked = []
        for k in chosen:
            q = m / (n * p[k])
            picked += [int(members[k][i]) for i in _walk(uni, len(members[k]), q)]
        groups.append(picked)
    return groups


def mix_from_groups(features, labels_onehot, groups, *, mixup_degree, noise_std_x, noise_std_y,
                    seed, offset=0, clip_x=None):
    """The dense formula of kernel 2 given the memberships, in float64:
    x_t = (1/m) sum_{i in I_t} clip(x_i) + s_x xi, y_t = (1/m) sum y_i + s_y xi'.

    clip(x_i) = f_i x_i with f_i from :func:`clip_factors` (``terms = d``, u of
    the features' dtype): the row clipped in that dtype has norm <= clip_x after
    rounding.  A row whose bound is not finite (a squared norm overflowing
    float64; the op refuses such features) gets f_i = 0.
    """
    dtype = np.result_type(np.asarray(features).dtype, np.float32)
    X = np.asarray(features, dtype=np.float64)
    Y = np.asarray(labels_onehot, dtype=np.float64)
    if clip_x is not None:
        sq = np.array([sum(float(v) * float(v) for v in row) for row in X])
        f, _ = clip_factors(sq, clip_x, unit=unit_roundoff(dtype), terms=X.shape[1])
        X = X * f[:, None]
    T, d, K = len(groups), X.shape[1], Y.shape[1]
    noise = gaussian(T * (d + K), seed=seed, offset=offset, dtype=np.float64).reshape(T, d + K)
    x = np.zeros((T, d))
    y = np.zeros((T, K))
    for t, g in enumerate(groups):
        if len(g):
            x[t] = X[g].sum(axis=0) / mixup_degree
            y[t] = Y[g].sum(axis=0) / mixup_degree
    return x + noise_std_x * noise[:, :d], y + noise_std_y * noise[:, d:]

