"""Philox4x32-10 and its normals on the CPU (numba).

The contract is written out in :mod:`ncdp_fast.reference`; this module must agree
with it to one float32 ulp.  Every integer is kept in uint64 explicitly: numba
promotes mixed signed/unsigned arithmetic to float64, which would silently
corrupt the bit mixing.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

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


@njit(cache=True, inline="always")
def box_muller(w0, w1):
    """Two float64 normals from two words (the contract's (even, odd) pair)."""
    u1 = (np.float64(w0) + 0.5) * _INV_2_32
    u2 = (np.float64(w1) + 0.5) * _INV_2_32
    r = math.sqrt(-2.0 * math.log(u1))
    return r * math.cos(_TWO_PI * u2), r * math.sin(_TWO_PI * u2)


@njit(cache=True)
def normal_at(seed, k):
    """Normal variate at absolute stream position ``k`` (uint64)."""
    w = philox_block(seed, k >> np.uint64(2))
    if (k >> np.uint64(1)) & np.uint64(1):
        z0, z1 = box_muller(w[2], w[3])
    else:
        z0, z1 = box_muller(w[0], w[1])
    return z1 if k & np.uint64(1) else z0


# Work is split into chunks of whole Philox blocks so each block is computed once.
_CHUNK = 4096


@njit(cache=True, parallel=True)
def add_gaussian(out, seed, offset, scale, accumulate, post):
    """``out[j] = post * ([out[j] +] scale * normal(seed, offset + j))``, j < len(out).

    out: 1-D float32/float64 array (C-contiguous), overwritten, or added to when
    ``accumulate``; seed, offset: uint64; scale, post: float64.  Consumes
    ``len(out)`` draws.  Computed in float64 and rounded once to out's dtype,
    which is what lets the finishing step of every noisy reduction (sum, add
    noise, divide by the expected batch size) share this loop.
    """
    n = out.shape[0]
    seed = np.uint64(seed)
    offset = np.uint64(offset)
    nchunks = (n + _CHUNK - 1) // _CHUNK
    for c in prange(nchunks):
        j0 = c * _CHUNK
        j1 = min(n, j0 + _CHUNK)
        j = j0
        while j < j1:
            k = offset + np.uint64(j)
            blk = k >> np.uint64(2)
            w = philox_block(seed, blk)
            za, zb = box_muller(w[0], w[1])
            zc, zd = box_muller(w[2], w[3])
            # Fill every position of this block that falls inside [j, j1).
            pos = k & np.uint64(3)
            while pos < np.uint64(4) and j < j1:
                if pos == np.uint64(0):
                    z = za
                elif pos == np.uint64(1):
                    z = zb
                elif pos == np.uint64(2):
                    z = zc
                else:
                    z = zd
                v = scale * z
                if accumulate:
                    v += np.float64(out[j])
                out[j] = v * post
                j += 1
                pos += np.uint64(1)
