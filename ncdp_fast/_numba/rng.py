"""Philox4x32-10 and its normals on the CPU (numba).

The contract is written out in :mod:`ncdp_fast.reference`; this module must agree
with it to one float32 ulp.  Every integer is kept in uint64 explicitly: numba
promotes mixed signed/unsigned arithmetic to float64, which would silently
corrupt the bit mixing.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange  # noqa: F401 (prange in sized kernels)

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


_TAIL_BLOCK = np.uint64(1 << 63)
_TWO_32 = 4294967296.0
_TWO_64 = 18446744073709551616.0
_TWO_96 = _TWO_64 * _TWO_32
_INV_2_64 = 2.0 ** -64
_INV_2_128 = 2.0 ** -128


@njit(cache=True, inline="always")
def uniforms_of_words(a, b, x0, x1, x2, x3):
    """reference.uniforms_of_words: ``(u1, u2)`` of a pair's draws a, b and its tail
    block's words x0..x3 (uint64 holding 32-bit values), the same sums in order."""
    u1 = (((np.float64(x2) + 0.5) + np.float64(x1) * _TWO_32) + np.float64(x0) * _TWO_64) \
        + np.float64(a) * _TWO_96
    u2 = (np.float64(x3) + 0.5) + np.float64(b) * _TWO_32
    return u1 * _INV_2_128, u2 * _INV_2_64


@sized_kernel(lambda seed, first_pair, u1, u2: 16 * u1.shape[0])
def pair_uniforms(seed, first_pair, u1, u2):
    """Uniforms of Box-Muller pairs ``first_pair .. first_pair + len(u1) - 1``.

    Pair q's draws are stream words 2q and 2q+1; its 128-bit u1 and 64-bit u2
    add the words of tail block 2^63 + q, summed in float64 in the reference's
    order (ncdp_fast.reference.rng), so u1 is in [2^-129, 1] and log(u1) is
    finite.  seed, first_pair: uint64; u1, u2: float64 [len].
    """
    n = u1.shape[0]
    nblocks = (n + 1) // 2 + 1
    first_block = first_pair >> np.uint64(1)
    # Pairs of one Philox block (two pairs) are produced together.
    for b in prange(nblocks):
        blk = first_block + np.uint64(b)
        w = philox_block(seed, blk)
        for half in range(2):
            q = np.int64(2 * b + half) - np.int64(first_pair & np.uint64(1))
            if 0 <= q < n:
                x = philox_block(seed, _TAIL_BLOCK + first_pair + np.uint64(q))
                u1[q], u2[q] = uniforms_of_words(w[2 * half], w[2 * half + 1],
                                                 x[0], x[1], x[2], x[3])


# Cody-Waite reduction by pi/2 (two-part constant) and the sin/cos kernel
# polynomials on [-pi/4, pi/4], as in fdlibm (k_sin.c, k_cos.c, e_rem_pio2.c).
# Branch-free so LLVM vectorizes the loop: ~3 ns per pair against ~27 ns for
# NumPy's scalar cos + sin; measured against np.cos/np.sin of the same
# float64 argument over 10^7 stream uniforms: at most 1 float64 ulp apart, no
# float32 result differs.
_PIO2_1 = 1.57079632673412561417e+00
_PIO2_1T = 6.07710050650619224932e-11
_INVPIO2 = 6.36619772367581382433e-01
_S1, _S2, _S3 = -1.66666666666666324348e-01, 8.33333333332248946124e-03, -1.98412698298579493134e-04
_S4, _S5, _S6 = 2.75573137070700676789e-06, -2.50507602534068634195e-08, 1.58969099521155010221e-10
_C1, _C2, _C3 = 4.16666666666666019037e-02, -1.38888888888741095749e-03, 2.48015872894767294178e-05
_C4, _C5, _C6 = -2.75573143513906633035e-07, 2.08757232129817482790e-09, -1.13596475577881948265e-11


@sized_kernel(lambda r, u2, z: 16 * r.shape[0], fastmath={"contract"})
def box_muller_pairs(r, u2, z):
    """z[2i] = r[i] cos(2 pi u2[i]), z[2i+1] = r[i] sin(2 pi u2[i]) (float64)."""
    for i in prange(r.shape[0]):
        t = _TWO_PI * u2[i]                     # the same rounded angle as the reference
        q = np.floor(t * _INVPIO2 + 0.5)
        x = (t - q * _PIO2_1) - q * _PIO2_1T     # |x| <= pi/4, error << ulp(x)
        zz = x * x
        sn = x + (zz * x) * (_S1 + zz * (_S2 + zz * (_S3 + zz * (_S4 + zz * (_S5 + zz * _S6)))))
        rc = zz * (_C1 + zz * (_C2 + zz * (_C3 + zz * (_C4 + zz * (_C5 + zz * _C6)))))
        hz = 0.5 * zz
        w = 1.0 - hz
        cs = w + (((1.0 - w) - hz) + zz * rc)
        k = np.int64(q)
        odd = k & 1                              # quadrant: swap sin/cos and fix signs,
        a = cs * (1 - odd) + sn * odd            # by exact 0/1 products, not branches
        b = sn * (1 - odd) + cs * odd
        z[2 * i] = r[i] * (a * (1 - 2 * (((k + 1) >> 1) & 1)))
        z[2 * i + 1] = r[i] * (b * (1 - 2 * ((k >> 1) & 1)))


# Normals are produced in chunks of 2^20 (three float64 temporaries of 8 MB):
# large enough that the Philox and sin/cos kernels go parallel.
_CHUNK = 1 << 20


def add_gaussian(out, seed, offset, scale, accumulate, post):
    """``out[j] = post * ([out[j] +] scale * normal(seed, offset + j))``, j < len(out).

    out: 1-D float32/float64 array (C-contiguous), overwritten, or added to when
    ``accumulate``; seed, offset: uint64; scale, post: float64.  Consumes
    ``len(out)`` draws.  Computed in float64 and rounded once to out's dtype,
    which is what lets the finishing step of every noisy reduction (sum, add
    noise, divide by the expected batch size) share this loop.

    Philox words and sin/cos come from numba, log/sqrt from NumPy's vectorized
    loops; all within a float64 ulp or two of the reference's scalar libm
    calls, hence within one float32 ulp.
    """
    n = out.shape[0]
    seed = np.uint64(seed)
    for start in range(0, n, _CHUNK):
        m = min(_CHUNK, n - start)
        k = int(offset) + start
        skip = k & 1
        npairs = (skip + m + 1) >> 1
        u1 = np.empty(npairs)
        u2 = np.empty(npairs)
        pair_uniforms(seed, np.uint64(k >> 1), u1, u2)
        r = np.sqrt(-2.0 * np.log(u1))
        z = np.empty(2 * npairs)
        box_muller_pairs(r, u2, z)
        z = z[skip:skip + m]
        z *= scale
        seg = out[start:start + m]
        if accumulate:
            z += seg
        if post != 1.0:
            z *= post
        seg[:] = z
