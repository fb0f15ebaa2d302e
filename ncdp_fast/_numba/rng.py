"""Philox4x32-10 and its normals on the CPU (numba).

The contract is written out in :mod:`ncdp_fast.reference`; this module must agree
with it to one float32 ulp.  Every integer is kept in uint64 explicitly: numba
promotes mixed signed/unsigned arithmetic to float64, which would silently
corrupt the bit mixing.
"""
from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from ._dispatch import sized_kernel

_M32 = np.uint64(0xFFFFFFFF)
_M0 = np.uint64(0xD2511F53)
_M1 = np.uint64(0xCD9E8D57)
_W0 = np.uint64(0x9E3779B9)
_W1 = np.uint64(0xBB67AE85)
_S32 = np.uint64(32)
_INV_2_32 = 1.0 / 4294967296.0
_TWO_PI = 2.0 * math.pi


@njit(cache=True, inline="always")
def philox4x32_10(k0, k1, c0, c1, c2, c3):
    """One Philox4x32-10 block: key words k0, k1 and counter words c0..c3 (uint64
    holding 32-bit values) -> four 32-bit words."""
    for rnd in range(10):
        if rnd > 0:
            k0 = (k0 + _W0) & _M32
            k1 = (k1 + _W1) & _M32
        p0 = _M0 * c0
        p1 = _M1 * c2
        n0 = ((p1 >> _S32) ^ c1 ^ k0) & _M32
        n2 = ((p0 >> _S32) ^ c3 ^ k1) & _M32
        c1 = p1 & _M32
        c3 = p0 & _M32
        c0 = n0
        c2 = n2
    return c0, c1, c2, c3


@njit(cache=True, inline="always")
def philox_block(seed, block):
    """Block ``block`` of the stream keyed by ``seed`` (both uint64): key (seed lo,
    seed hi), counter (block lo, block hi, 0, 0)."""
    zero = np.uint64(0)
    return philox4x32_10(seed & _M32, seed >> _S32, block & _M32, block >> _S32, zero, zero)


# reference.COMPANION_BLOCK, DEEP_BLOCK, DEEP_BELOW.
_COMPANION_BLOCK = np.uint64(1 << 63)
_DEEP_BLOCK = np.uint64(1 << 62)
_DEEP_BELOW = np.uint64(1 << 21)
_TWO_32 = 4294967296.0
_TWO_64 = 18446744073709551616.0
_TWO_96 = _TWO_64 * _TWO_32
_INV_2_64 = 2.0 ** -64
_INV_2_128 = 2.0 ** -128
# A pair whose draw a is below _DEEP_BELOW has a 64-bit sum (y + 0.5) + a 2^32
# below 2^53, which rounds to at most 2^53: its u1_64 is at most 2^-11, and any
# other pair's at least 2^-11.  So u1_64 <= _DEEP_U1 finds every deep pair (and
# a = 2^21, y = 0, whose sum rounds down to 2^53: rechecked on its words).
_DEEP_U1 = 2.0 ** -11


@njit(cache=True, inline="always")
def _u1_64(a, y):
    return ((np.float64(y) + 0.5) + np.float64(a) * _TWO_32) * _INV_2_64


@njit(cache=True, inline="always")
def _u2(b, v):
    return ((np.float64(v) + 0.5) + np.float64(b) * _TWO_32) * _INV_2_64


@njit(cache=True, inline="always")
def uniforms_of_words(a, b, y, v, x0, x1):
    """reference.uniforms_of_words: ``(u1, u2)`` of a pair's draws a, b, companion
    words y, v and deep words x0, x1 (uint64 holding 32-bit values; x0, x1 only
    read when ``a < 2^21``), the same sums in order."""
    if a >= _DEEP_BELOW:
        return _u1_64(a, y), _u2(b, v)
    u1 = (((np.float64(x1) + 0.5) + np.float64(x0) * _TWO_32) + np.float64(y) * _TWO_64) \
        + np.float64(a) * _TWO_96
    return u1 * _INV_2_128, _u2(b, v)


@njit(cache=True)
def pair_uniforms(seed, pair):
    """reference.pair_uniforms (seed, pair: uint64): the deep block only when read."""
    m = pair >> np.uint64(1)
    w = philox_block(seed, m)
    c = philox_block(seed, _COMPANION_BLOCK + m)
    h = 2 * np.int64(pair & np.uint64(1))
    a = w[h]
    x0 = x1 = np.uint64(0)
    if a < _DEEP_BELOW:
        d = philox_block(seed, _DEEP_BLOCK + m)
        x0, x1 = d[h], d[h + 1]
    return uniforms_of_words(a, w[h + 1], c[h], c[h + 1], x0, x1)


@intrinsic
def _bits_of(typingctx, x):
    """The IEEE bits of a float64 as uint64 (an LLVM bitcast: vectorizes)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(64))
    return types.uint64(types.float64), codegen


@intrinsic
def _float_of(typingctx, x):
    """The float64 whose IEEE bits are the uint64 ``x``."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.DoubleType())
    return types.float64(types.uint64), codegen


# log(u) for normal positive float64 u, the algorithm and coefficients of
# fdlibm's e_log.c (u = 2^k m with m in [sqrt(2)/2, sqrt(2)), log(1+f) from
# s = f/(2+f)), written without branches so the loop over a tile vectorizes:
# NumPy's log is a separate single-threaded pass, and numba's np.log a scalar
# libm call.  u1 >= 2^-129 is never subnormal, zero or non-finite, the only
# inputs that need e_log.c's branches.  Measured against np.log over 10^6
# values spread over [2^-129, 1]: at most 1 float64 ulp apart.
_LN2_HI, _LN2_LO = 6.93147180369123816490e-01, 1.90821492927058770002e-10
_LG1, _LG2, _LG3 = 6.666666666666735130e-01, 3.999999999940941908e-01, 2.857142874366239149e-01
_LG4, _LG5 = 2.222219843214978396e-01, 1.818357216161805012e-01
_LG6, _LG7 = 1.531383769920937332e-01, 1.479819860511658591e-01
_MANTISSA = np.uint64(0x000FFFFFFFFFFFFF)
_EXP_ONE = np.uint64(0x3FF0000000000000)
_S52 = np.uint64(52)
_SQRT2 = 1.4142135623730951


@njit(cache=True, inline="always", error_model="numpy")
def log_normal(u):
    """ln(u) for a normal (not subnormal) positive finite float64 ``u``."""
    b = _bits_of(u)
    m = _float_of((b & _MANTISSA) | _EXP_ONE)     # u = 2^k m, m in [1, 2)
    big = np.int64(m > _SQRT2)
    m = m * (1.0 - 0.5 * big)                      # exact: m in [sqrt(2)/2, sqrt(2))
    dk = np.float64(np.int64(b >> _S52) - 1023 + big)
    f = m - 1.0
    hfsq = 0.5 * f * f
    s = f / (2.0 + f)
    z = s * s
    w = z * z
    r = z * (_LG1 + w * (_LG3 + w * (_LG5 + w * _LG7))) + w * (_LG2 + w * (_LG4 + w * _LG6))
    return dk * _LN2_HI - ((hfsq - (s * (hfsq + r) + dk * _LN2_LO)) - f)


# Cody-Waite reduction by pi/2 (two-part constant) and the sin/cos kernel
# polynomials on [-pi/4, pi/4], as in fdlibm (k_sin.c, k_cos.c, e_rem_pio2.c),
# branch-free for the same reason; measured against np.cos/np.sin of the same
# float64 argument over 10^7 stream uniforms: at most 1 float64 ulp apart.
_PIO2_1 = 1.57079632673412561417e+00
_PIO2_1T = 6.07710050650619224932e-11
_INVPIO2 = 6.36619772367581382433e-01
_S1, _S2, _S3 = -1.66666666666666324348e-01, 8.33333333332248946124e-03, -1.98412698298579493134e-04
_S4, _S5, _S6 = 2.75573137070700676789e-06, -2.50507602534068634195e-08, 1.58969099521155010221e-10
_C1, _C2, _C3 = 4.16666666666666019037e-02, -1.38888888888741095749e-03, 2.48015872894767294178e-05
_C4, _C5, _C6 = -2.75573143513906633035e-07, 2.08757232129817482790e-09, -1.13596475577881948265e-11


@njit(cache=True, inline="always", error_model="numpy")
def cos_sin_2pi(u2):
    """``(cos(2 pi u2), sin(2 pi u2))`` of the reference's rounded angle 2 pi u2."""
    t = _TWO_PI * u2
    q = np.floor(t * _INVPIO2 + 0.5)
    x = (t - q * _PIO2_1) - q * _PIO2_1T         # |x| <= pi/4, error << ulp(x)
    zz = x * x
    sn = x + (zz * x) * (_S1 + zz * (_S2 + zz * (_S3 + zz * (_S4 + zz * (_S5 + zz * _S6)))))
    rc = zz * (_C1 + zz * (_C2 + zz * (_C3 + zz * (_C4 + zz * (_C5 + zz * _C6)))))
    hz = 0.5 * zz
    w = 1.0 - hz
    cs = w + (((1.0 - w) - hz) + zz * rc)
    k = np.int64(q)
    odd = k & 1                                  # quadrant: swap sin/cos and fix signs,
    a = cs * (1 - odd) + sn * odd                # by exact 0/1 products, not branches
    b = sn * (1 - odd) + cs * odd
    return a * (1 - 2 * (((k + 1) >> 1) & 1)), b * (1 - 2 * ((k >> 1) & 1))


# Pairs per tile: one task of the parallel loop.  Each tile runs three simple
# loops over its pairs (uniforms, radius, angle and store), each of which LLVM
# vectorizes; one fused loop per pair did not vectorize and was 2.2x slower.
# Two float64 temporaries of 16 KB stay in the L1/L2 cache.
_TILE = 2048
# Pairs per run of the search for deep pairs (see _add_gaussian): a run holds
# one with probability about 1/16.  Measured per 2^23 pairs on one core: runs
# of 128 0.6 ms, of 64 0.8 ms, of 32 4.1 ms, a scalar search of every pair
# 5.2 ms (the Philox loop: 35 ms).
_SCAN = 128


@njit(cache=True, inline="always", error_model="numpy")
def _store(out, j, z, scale, accumulate, post):
    if accumulate:
        out[j] = post * (out[j] + scale * z)
    else:
        out[j] = post * (scale * z)


@njit(cache=True, inline="always", error_model="numpy")
def _store_edge(out, j, r, u2, scale, accumulate, post):
    """The lanes of a pair (normals j, j + 1) that land in out."""
    c, s = cos_sin_2pi(u2)
    n = out.shape[0]
    if 0 <= j < n:
        _store(out, j, r * c, scale, accumulate, post)
    if 0 <= j + 1 < n:
        _store(out, j + 1, r * s, scale, accumulate, post)


def _gaussian_work(out, *_):
    return 16 * out.shape[0]


@sized_kernel(_gaussian_work, error_model="numpy")
def _add_gaussian(out, seed, offset, scale, accumulate, post):
    """The body of :func:`add_gaussian`; ``offset`` uint64, ``len(out) > 0``.

    Positions are relative to the even pair ``base`` at or below the first
    pair, so no index passes int64 even where the offset is near 2^64; only the
    Philox counters are absolute (uint64).  Normal j is lane ``(j + lead) & 1``
    of relative pair ``(j + lead) >> 1``, ``lead = offset - 2 base``.
    """
    n = out.shape[0]
    base = (offset >> np.uint64(1)) & ~np.uint64(1)
    lead = np.int64(offset - np.uint64(2) * base)          # 0 .. 3
    npairs = (lead + n + 1) >> 1
    npairs += npairs & 1                                    # whole Philox blocks
    ntiles = (npairs + _TILE - 1) // _TILE
    for t in prange(ntiles):
        lo = t * _TILE
        m = min(_TILE, npairs - lo)                         # even
        u1 = np.empty(m)
        u2 = np.empty(m)
        # Uniforms: a main block and its companion serve two pairs, u1 from 64
        # bits; the pairs that read a deep block (one in 2048) are redone below.
        for h in range(m >> 1):
            blk = (base >> np.uint64(1)) + np.uint64((lo >> 1) + h)
            w = philox_block(seed, blk)
            c = philox_block(seed, _COMPANION_BLOCK + blk)
            u1[2 * h], u2[2 * h] = _u1_64(w[0], c[0]), _u2(w[1], c[1])
            u1[2 * h + 1], u2[2 * h + 1] = _u1_64(w[2], c[2]), _u2(w[3], c[3])
        # Found by a count over runs of _SCAN pairs, which vectorizes, and a
        # scalar search only in a run that has one (timings at _SCAN).
        for k in range(0, m, _SCAN):
            e = min(k + _SCAN, m)
            hits = 0
            for i in range(k, e):
                hits += np.int64(u1[i] <= _DEEP_U1)
            if hits:
                for i in range(k, e):
                    if u1[i] <= _DEEP_U1:
                        u1[i], u2[i] = pair_uniforms(seed, base + np.uint64(lo + i))
        for i in range(m):
            u1[i] = np.sqrt(-2.0 * log_normal(u1[i]))       # the radius r, in place
        # Pairs whose two normals both land in out: j = 2 (lo + i) - lead >= 0
        # and j + 1 <= n - 1.  The rest (at most one at each end of out, plus
        # the padding to whole blocks) store the lanes that land.
        i_lo = min(m, max(0, (lead + 1) // 2 - lo))
        i_hi = max(i_lo, min(m, (n + lead - 2) // 2 - lo + 1))
        # Views from the first whole pair, indexed from 0: numba adds a
        # negative-index wraparound branch to any signed index it cannot prove
        # non-negative, which kept this loop scalar (1.3x slower in this kernel,
        # 2.3x with the accumulate test inside the loop).
        j0 = 2 * (lo + i_lo) - lead
        seg = out[j0:j0 + 2 * (i_hi - i_lo)]
        r = u1[i_lo:i_hi]
        v = u2[i_lo:i_hi]
        if accumulate:
            for i in range(i_hi - i_lo):
                c, s = cos_sin_2pi(v[i])
                seg[2 * i] = post * (seg[2 * i] + scale * (r[i] * c))
                seg[2 * i + 1] = post * (seg[2 * i + 1] + scale * (r[i] * s))
        else:
            for i in range(i_hi - i_lo):
                c, s = cos_sin_2pi(v[i])
                seg[2 * i] = post * (scale * (r[i] * c))
                seg[2 * i + 1] = post * (scale * (r[i] * s))
        # The pairs before and after those (none in a middle tile).  Two short
        # loops, not one pass over the tile that skips the middle: that form
        # kept the loops above from vectorizing (measured 1.7x slower).
        for i in range(i_lo):
            _store_edge(out, 2 * (lo + i) - lead, u1[i], u2[i], scale, accumulate, post)
        for i in range(i_hi, m):
            _store_edge(out, 2 * (lo + i) - lead, u1[i], u2[i], scale, accumulate, post)


def add_gaussian(out, seed, offset, scale, accumulate, post):
    """``out[j] = post * ([out[j] +] scale * normal(seed, offset + j))``, j < len(out).

    out: 1-D float32/float64 array (C-contiguous), overwritten, or added to when
    ``accumulate``; seed, offset: uint64; scale, post: float64.  Consumes
    ``len(out)`` draws.  Computed in float64 and rounded once to out's dtype,
    which is what lets the finishing step of every noisy reduction (sum, add
    noise, divide by the expected batch size) share this loop.

    Each normal is computed from its own index alone, with the same IEEE
    operations whichever tile, lane or thread computes it (no fast-math), so
    any split of a range (ranks, chunks, the serial and parallel twins) gives
    the same bits.  log, sin and cos are the branch-free fdlibm forms above,
    each within a float64 ulp of libm, hence within one float32 ulp of the
    reference; the CUDA kernels compute them, and the store, in the same
    operations (csrc/common/philox.cuh, "The normals"): the same bits.
    """
    if out.shape[0]:
        _add_gaussian(out, np.uint64(seed), np.uint64(offset), float(scale), bool(accumulate),
                      float(post))


def finish_gaussian_segments(segments, seed, scale, post):
    """The finishes of several noisy sums, the CUDA kernel's twin: for each
    ``(dst, src, offset)`` of ``segments``, ``dst[j] = post * (src[j] + scale *
    normal(seed, offset + j))`` in float64, rounded once to dst's dtype.

    dst: 1-D float32/float64 (C-contiguous); src: dst itself (in place), or a
    float64 array of its length (a float64 accumulator finishing into a
    float32 output); seed: uint64; offset: int; scale, post: float64.  Each
    segment consumes len(dst) draws at its offset: the same values as one
    :func:`add_gaussian` a segment."""
    for dst, src, offset in segments:
        if src is dst:
            add_gaussian(dst, seed, offset, scale, True, post)
        else:
            acc = np.array(src, dtype=np.float64)       # a copy: src is the caller's
            add_gaussian(acc, seed, offset, scale, True, post)
            dst[...] = acc
