"""Slow, obviously correct NumPy versions of every kernel.

These are the specification the numba and CUDA kernels are tested against; they
favour clarity over speed (plain loops, float64 everywhere) and must never be
used on a hot path.

Random-number contract (DESIGN.md, "Random numbers"):

* Philox4x32-10 with key ``(seed mod 2^32, seed >> 32)`` and counter
  ``(b mod 2^32, b >> 32, 0, 0)`` produces block ``b`` of four 32-bit words; the
  stream is the concatenation of blocks, so word ``w`` is element ``w % 4`` of
  block ``w // 4``.  The last two counter words are reserved (zero).
* A *draw* is one 32-bit word.  Offsets count draws.
* Normal variate ``j`` of stream ``(seed, offset)`` uses the pair of words
  ``k = offset + j`` and its partner ``k ^ 1`` -- i.e. words ``2*(k//2)`` and
  ``2*(k//2)+1``.  With ``u1, u2`` those words converted to uniforms in (0, 1) as
  ``(w + 0.5) / 2^32`` in float64, Box--Muller gives
  ``r = sqrt(-2 ln u1)``, ``z_even = r cos(2 pi u2)``, ``z_odd = r sin(2 pi u2)``;
  the normal is ``z_even`` when ``k`` is even and ``z_odd`` when it is odd,
  computed in float64 and rounded once to the output dtype.  ``count`` normals
  consume ``count`` draws, so disjoint offset ranges give independent noise.
  (32-bit uniforms truncate the tails at |z| <= 6.66.)
"""
from __future__ import annotations

import math
import struct

import numpy as np

MASK32 = 0xFFFFFFFF
PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9
PHILOX_W1 = 0xBB67AE85
TWO_POW_32 = 4294967296.0


def philox4x32_10(key, counter):
    """One Philox4x32-10 block: ``key`` (2 uint32), ``counter`` (4 uint32) -> 4 uint32."""
    k0, k1 = (int(k) & MASK32 for k in key)
    c0, c1, c2, c3 = (int(c) & MASK32 for c in counter)
    for rnd in range(10):
        if rnd:
            k0 = (k0 + PHILOX_W0) & MASK32
            k1 = (k1 + PHILOX_W1) & MASK32
        p0 = PHILOX_M0 * c0
        p1 = PHILOX_M1 * c2
        hi0, lo0 = p0 >> 32, p0 & MASK32
        hi1, lo1 = p1 >> 32, p1 & MASK32
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return (c0, c1, c2, c3)


def _check_seed_offset(seed, offset):
    seed, offset = int(seed), int(offset)
    if not 0 <= seed < 2**64:
        raise ValueError(f"seed: expected an integer in [0, 2**64), got {seed}")
    if not 0 <= offset < 2**64:
        raise ValueError(f"offset: expected an integer in [0, 2**64), got {offset}")
    return seed, offset


def philox_words(count, *, seed, offset=0):
    """Draws ``offset .. offset+count-1`` of the stream as a uint32 array."""
    seed, offset = _check_seed_offset(seed, offset)
    key = (seed & MASK32, seed >> 32)
    out = np.empty(count, dtype=np.uint32)
    cache_block, cache = -1, None
    for j in range(count):
        w = offset + j
        b = w >> 2
        if b != cache_block:
            cache = philox4x32_10(key, (b & MASK32, (b >> 32) & MASK32, 0, 0))
            cache_block = b
        out[j] = cache[w & 3]
    return out


def gaussian(count, *, seed, offset=0, dtype=np.float32):
    """The stream's normals ``offset .. offset+count-1`` (see module docstring)."""
    seed, offset = _check_seed_offset(seed, offset)
    out = np.empty(count, dtype=np.float64)
    for j in range(count):
        k = offset + j
        pair = philox_words(2, seed=seed, offset=k & ~1)
        u1 = (float(pair[0]) + 0.5) / TWO_POW_32
        u2 = (float(pair[1]) + 0.5) / TWO_POW_32
        r = np.sqrt(-2.0 * np.log(u1))
        out[j] = r * (np.sin(2.0 * np.pi * u2) if k & 1 else np.cos(2.0 * np.pi * u2))
    return out.astype(dtype)


U64 = 2.0 ** -53   # unit roundoff of float64


def unit_roundoff(dtype) -> float:
    """u of the data dtype: 2^-24 for float32, 2^-53 for float64."""
    return float(np.finfo(np.dtype(dtype)).eps) / 2


def clip_bound(sq_norms, *, unit, terms, spread=None, seq_len=1):
    """Upper bound on the L2 norm of a sample's gradient *as the kernels compute it*.

    The clip rule is applied to this bound, not to the computed norm, so that a
    sample's contribution stays <= C after every rounding (docs/privacy.md,
    "The clip bound in floating point").  With ``gamma = (terms + 4) 2^-52``
    (``terms``: float64 multiply-adds in one sample's squared norm) and
    ``E = spread`` (``sum_t ||g_t|| (||a_t|| + bias)`` for a factored sequence
    block, else 0), the true norm is at most
    ``(sqrt(sq + gamma E^2) + (T+2) 2^-52 E) (1 + gamma)`` (Higham's bound on the
    float64 norm), and the kernels' own sum over the T positions in the data
    dtype adds ``2 (T+2) u E``; four more roundings of the data dtype (the
    factor, the product, the output) give the final ``(1 + 4u)``.
    """
    sq = np.asarray(sq_norms, dtype=np.float64)
    e = np.zeros_like(sq) if spread is None else np.asarray(spread, dtype=np.float64)
    g = (terms + 4) * 2.0 ** -52
    with np.errstate(over="ignore", invalid="ignore"):
        # (sqrt(g) E)^2 rather than g E^2: E may be large enough for E^2 to overflow.
        b = (np.sqrt(sq + (np.sqrt(g) * e) ** 2) + (seq_len + 2) * 2.0 ** -52 * e) * (1.0 + g)
        return (b + 2.0 * (seq_len + 2) * unit * e) * (1.0 + 4.0 * unit)


def clip_factors(sq_norms, max_norm, *, unit=U64, terms=0, spread=None, seq_len=1):
    """Per-sample factors and norms (float64): the rule every backend applies.

    ``norms = sqrt(sq)``; with ``b`` = :func:`clip_bound`, the factor is 0 where
    ``b`` is not finite (the row is non-finite: dropped or raised on), 1 where
    ``b <= C`` and ``C / b`` otherwise.  A zero row has factor 1.  This is
    ``min(1, C/||g||)`` of DESIGN.md kernel 1 tightened by the rounding margin
    (relative ``~(terms + 4u) ...``, about 3e-7 in float32), so that the
    computed contribution never exceeds C.
    """
    norms = np.sqrt(np.asarray(sq_norms, dtype=np.float64))
    bound = clip_bound(sq_norms, unit=unit, terms=terms, spread=spread, seq_len=seq_len)
    factors = np.array([0.0 if not np.isfinite(b) else 1.0 if b <= max_norm else max_norm / b
                        for b in bound.ravel()]).reshape(bound.shape)
    return factors, norms


def linear_spread(activations, backprops, bias=True):
    """E_i = sum_t ||g_it|| (||a_it|| + [bias]) of a factored sequence block
    (:func:`clip_bound`), zeros when T == 1 (no sum over positions)."""
    a = np.asarray(activations, dtype=np.float64)
    g = np.asarray(backprops, dtype=np.float64)
    if a.ndim == 2 or a.shape[1] <= 1:
        return np.zeros(a.shape[0])
    na = np.sqrt((a * a).sum(axis=2))
    ng = np.sqrt((g * g).sum(axis=2))
    return (ng * (na + (1.0 if bias else 0.0))).sum(axis=1)


def linear_terms(d, K, T, bias=True):
    """``terms`` of :func:`clip_bound` for a linear block (either norm route)."""
    return d + K + T * T + T + (K if bias else 0)


def clip_and_noise(grads, *, max_norm, noise_multiplier, seed, offset=0,
                   reduction="sum", expected_batch_size=None, dtype=None, factors=None):
    """DESIGN.md kernel 1 (dense), in float64: returns ``(grad, norms)``.

    ``grad = (sum_i g_i f_i + sigma C xi) / denom`` with ``f`` from
    :func:`clip_factors` (``terms = p``, ``u`` of ``dtype``, default the
    gradients' own dtype), ``xi`` the stream's first ``p`` normals at ``offset``
    and ``denom`` 1 ("sum") or ``expected_batch_size`` ("mean").  Rows must be
    finite.  ``factors`` overrides the rule (the factored ops pass theirs).
    """
    dtype = np.asarray(grads).dtype if dtype is None else np.dtype(dtype)
    g = np.asarray(grads, dtype=np.float64)
    B, p = g.shape
    sq = np.array([sum(float(v) * float(v) for v in row) for row in g])
    f, norms = clip_factors(sq, max_norm, unit=unit_roundoff(dtype), terms=p)
    if factors is not None:
        f = factors
    total = np.zeros(p)
    for i in range(B):
        total += f[i] * g[i]
    total += noise_multiplier * max_norm * gaussian(p, seed=seed, offset=offset, dtype=np.float64)
    if reduction == "mean":
        total /= expected_batch_size
    return total, norms


def per_sample_linear_grads(activations, backprops, bias=True):
    """Explicit per-sample gradients of a linear layer, flattened to (B, K*d [+K]).

    ``G_i = sum_t g_it a_it^T`` (K x d) and, with a bias, ``sum_t g_it`` (K,).
    """
    a = np.asarray(activations, dtype=np.float64)
    g = np.asarray(backprops, dtype=np.float64)
    if a.ndim == 2:
        a, g = a[:, None, :], g[:, None, :]
    rows = []
    for i in range(a.shape[0]):
        w = sum(np.outer(g[i, t], a[i, t]) for t in range(a.shape[1])) if a.shape[1] else \
            np.zeros((g.shape[2], a.shape[2]))
        parts = [np.ravel(w)]
        if bias:
            parts.append(g[i].sum(axis=0))
        rows.append(np.concatenate(parts))
    width = g.shape[2] * a.shape[2] + (g.shape[2] if bias else 0)
    return np.array(rows).reshape(a.shape[0], width)


def clip_and_noise_linear(activations, backprops, *, max_norm, noise_multiplier, bias=True,
                          seed, offset=0, reduction="sum", expected_batch_size=None):
    """Kernel 1 (factored) through explicit per-sample gradients, in float64.

    Returns ``(grad_weight (K, d), grad_bias (K,) or None, norms (B,))``; the noise
    for the weight is draws ``offset .. offset+K*d-1`` (row-major), then the bias.
    The factors follow :func:`clip_factors` with the factored op's ``terms``,
    spread and sequence length, in the activations' dtype.
    """
    dtype = np.asarray(activations).dtype
    K, d = np.shape(backprops)[-1], np.shape(activations)[-1]
    T = np.shape(activations)[1] if np.ndim(activations) == 3 else 1
    flat = per_sample_linear_grads(activations, backprops, bias=bias)
    sq = (flat * flat).sum(axis=1)
    factors, _ = clip_factors(sq, max_norm, unit=unit_roundoff(dtype),
                              terms=linear_terms(d, K, T, bias),
                              spread=linear_spread(activations, backprops, bias), seq_len=T)
    total, norms = clip_and_noise(flat, max_norm=max_norm, noise_multiplier=noise_multiplier,
                                  seed=seed, offset=offset, reduction=reduction,
                                  expected_batch_size=expected_batch_size, factors=factors)
    gw = total[:K * d].reshape(K, d)
    gb = total[K * d:] if bias else None
    return gw, gb, norms


def clip_and_noise_layers(blocks, *, max_norm, noise_multiplier, seed, offset=0,
                          reduction="sum", expected_batch_size=None):
    """Several parameters sharing one clip factor per sample, as the op takes them:
    each block is a dense per-sample gradient (B, ...) or a linear layer
    ``(activations, backprops[, bias])``.  The per-sample blocks are flattened and
    concatenated in order and the whole row is clipped with :func:`clip_factors`
    (``terms`` and spread summed over blocks, ``seq_len`` the longest sequence);
    returns the list of flat per-block results and the total norms."""
    flat, terms, spread, seq_len, dtype = [], 0, None, 1, None
    for b in blocks:
        if isinstance(b, (tuple, list)):
            a, g = b[0], b[1]
            bias = bool(b[2]) if len(b) == 3 else True
            flat.append(per_sample_linear_grads(a, g, bias=bias))
            T = np.shape(a)[1] if np.ndim(a) == 3 else 1
            terms += linear_terms(np.shape(a)[-1], np.shape(g)[-1], T, bias)
            e = linear_spread(a, g, bias)
            spread = e if spread is None else spread + e
            seq_len = max(seq_len, T)
            dtype = np.asarray(a).dtype
        else:
            b = np.asarray(b)
            flat.append(b.reshape(b.shape[0], -1).astype(np.float64))
            terms += flat[-1].shape[1]
            dtype = b.dtype
    flat_all = np.concatenate(flat, axis=1)
    factors, _ = clip_factors((flat_all * flat_all).sum(axis=1), max_norm,
                              unit=unit_roundoff(dtype), terms=terms, spread=spread,
                              seq_len=seq_len)
    total, norms = clip_and_noise(flat_all, max_norm=max_norm, noise_multiplier=noise_multiplier,
                                  seed=seed, offset=offset, reduction=reduction,
                                  expected_batch_size=expected_batch_size, factors=factors)
    out, start = [], 0
    for f in flat:
        out.append(total[start:start + f.shape[1]])
        start += f.shape[1]
    return out, norms


# --------------------------------------------------------------------------
# Kernel 2: Poisson / hierarchical subsampling with averaging (DESIGN.md).
#
# Sampling draws never come from the main stream (counter words 2-3 zero) but
# from *sub-streams*: sub-stream ``sid >= 1`` is Philox with counter
# ``(b lo, b hi, sid lo, sid hi)``.  A *uniform* is a pair of sub-stream words
# (2j, 2j+1) turned into a 53-bit float in (0, 1):
#     u_j = ((w_2j >> 5) * 2^26 + (w_2j+1 >> 6) + 0.5) / 2^53.
#
# Output row t of a mix call at (seed, offset) with d features and K classes:
#   * its Gaussian noise is main-stream normals offset + t(d+K) + c, c < d for x,
#     then d <= c < d+K for y: the call consumes T(d+K) draws;
#   * its sampling uses sub-stream sid = 1 + offset + t(d+K), so a row range
#     [t0, t1) run alone with offset' = offset + t0(d+K) reproduces those rows,
#     and calls whose noise ranges are disjoint never share a sub-stream;
#   * hierarchical sampling spends uniforms 0..K-1 on the classes (class k is
#     selected iff u_k < p_k), then, class by class in increasing k, walks the
#     class's members (in increasing example index) by geometric skipping;
#     Poisson sampling walks all n examples as one class, from uniform 0;
#   * geometric skipping with rate q: gap = floor(log(u) / log1p(-q)) unselected
#     members are skipped, then one is selected; stops when past the end.
#     Exactly the Bernoulli(q) process (P(gap >= g) = (1-q)^g).  log and log1p
#     are sampler_log / sampler_log1p below, not the platform's libm: a one-ulp
#     difference between two libms (or the GPU's) can move floor() across an
#     integer and change a membership.
# A DP-SGD batch plan (poisson_batches) walks all n examples for step s with
# sub-stream sid = 1 + offset + s and advances the offset by ``steps``.
# --------------------------------------------------------------------------

TWO_POW_53 = 9007199254740992.0


def substream_words(count, *, seed, sid):
    """Words 0 .. count-1 of sub-stream ``sid`` (uint32 array)."""
    seed, _ = _check_seed_offset(seed, 0)
    key = (seed & MASK32, seed >> 32)
    out = np.empty(count, dtype=np.uint32)
    for w in range(count):
        b = w >> 2
        out[w] = philox4x32_10(key, (b & MASK32, b >> 32, sid & MASK32, sid >> 32))[w & 3]
    return out


class _Uniforms:
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
_LN2_HI = 6.93147180369123816490e-01    # 0x3fe62e42fee00000
_LN2_LO = 1.90821492927058770002e-10    # 0x3dea39ef35793c76
# R(z) = LG1 z + ... + LG7 z^7 ~ (log(1+f) - 2s) / s with z = s^2, |s| <= 0.1716
# (fdlibm's Remez fit, error below 2^-58.45).
_LG1 = 6.666666666666735130e-01
_LG2 = 3.999999999940941908e-01
_LG3 = 2.857142874366239149e-01
_LG4 = 2.222219843214978396e-01
_LG5 = 1.818357216161805012e-01
_LG6 = 1.531383769920937332e-01
_LG7 = 1.479819860511658591e-01
_TWO_POW_54 = 18014398509481984.0
_MANTISSA = (1 << 52) - 1
# Mantissa bits of fdlibm's split point ~sqrt(2) (high word 0x6a09c): above it the
# mantissa is taken with exponent -1, so that m = x / 2^k lies in [0.7071, 1.4142).
_SQRT2_MANTISSA = 0x6a09c00000000


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
        x *= _TWO_POW_54
        k = -54
    bits = _f64_bits(x)
    k += (bits >> 52) - 1023
    mantissa = bits & _MANTISSA
    half = 1 if mantissa >= _SQRT2_MANTISSA else 0
    f = _f64_from_bits(mantissa | ((1023 - half) << 52)) - 1.0
    k += half
    s = f / (2.0 + f)
    z = s * s
    w = z * z
    r = z * (_LG1 + w * (_LG3 + w * (_LG5 + w * _LG7))) + w * (_LG2 + w * (_LG4 + w * _LG6))
    hfsq = 0.5 * f * f
    dk = float(k)
    return dk * _LN2_HI - ((hfsq - (s * (hfsq + r) + dk * _LN2_LO)) - f)


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
            groups.append(_walk(_Uniforms(seed, 1 + offset + t * row_stride), n, q))
        return groups
    K = num_classes
    p = np.broadcast_to(np.asarray(class_rate, dtype=np.float64), (K,))
    members = [np.flatnonzero(labels == k) for k in range(K)]
    for t in range(num_samples):
        uni = _Uniforms(seed, 1 + offset + t * row_stride)
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


# --------------------------------------------------------------------------
# Kernel 3: Hadamard-product NTK Gram (DESIGN.md).  The slow, obviously
# correct version forms the Jacobian J (n x #params) explicitly by hand-written
# backpropagation, one example and one output at a time, and returns
# mean_o J_o J_o^T (neural-tangents' trace over the output axis).
# --------------------------------------------------------------------------

def _activation(name):
    from scipy.special import erf, expit
    sqrt2, sqrtpi = np.sqrt(2.0), np.sqrt(np.pi)
    table = {
        "relu": (lambda z: np.maximum(z, 0.0), lambda z: (z > 0).astype(float)),
        "tanh": (np.tanh, lambda z: 1.0 - np.tanh(z) ** 2),
        "erf": (erf, lambda z: 2.0 / sqrtpi * np.exp(-z * z)),
        "gelu": (lambda z: 0.5 * z * (1.0 + erf(z / sqrt2)),
                 lambda z: 0.5 * (1.0 + erf(z / sqrt2)) + z * np.exp(-0.5 * z * z) / np.sqrt(2 * np.pi)),
        "softplus": (lambda z: np.logaddexp(0.0, z), expit),
        "identity": (lambda z: z, lambda z: np.ones_like(z)),
    }
    return table[name]


def ntk_jacobian(x, weights, biases=None, activation="relu", parameterization="standard"):
    """J of shape (n, K_out, #params): d f_o(x_i) / d theta, theta = (W_1, b_1, ..., W_L, b_L)
    flattened layer by layer (weight row-major, then bias)."""
    phi, dphi = _activation(activation)
    X = np.asarray(x, dtype=np.float64)
    Ws = [np.asarray(w, dtype=np.float64) for w in weights]
    bs = [None if biases is None or biases[i] is None else np.asarray(biases[i], np.float64)
          for i in range(len(Ws))]
    L = len(Ws)
    scale = [1.0 / np.sqrt(W.shape[1]) if parameterization == "ntk" else 1.0 for W in Ws]
    K_out = Ws[-1].shape[0]
    rows = []
    for i in range(X.shape[0]):
        F = [X[i]]
        Z = []
        for l in range(L):
            z = scale[l] * Ws[l] @ F[-1] + (bs[l] if bs[l] is not None else 0.0)
            Z.append(z)
            if l < L - 1:
                F.append(phi(z))
        per_out = []
        for o in range(K_out):
            B = [None] * L
            B[L - 1] = np.eye(K_out)[o]
            for l in range(L - 2, -1, -1):
                B[l] = dphi(Z[l]) * (scale[l + 1] * Ws[l + 1].T @ B[l + 1])
            grads = []
            for l in range(L):
                grads.append(scale[l] * np.outer(B[l], F[l]).ravel())
                if bs[l] is not None:
                    grads.append(B[l])
            per_out.append(np.concatenate(grads))
        rows.append(per_out)
    return np.array(rows)


def ntk_gram(x, weights, biases=None, activation="relu", x2=None, parameterization="standard"):
    """K(x, x2) = mean over outputs of J_o(x) J_o(x2)^T, in float64."""
    J1 = ntk_jacobian(x, weights, biases, activation, parameterization)
    J2 = J1 if x2 is None else ntk_jacobian(x2, weights, biases, activation, parameterization)
    return np.einsum("iop,jop->ij", J1, J2) / J1.shape[1]
