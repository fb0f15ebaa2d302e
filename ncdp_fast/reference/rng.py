"""Philox4x32-10 and the stream's normals: the random-number contract.

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


def check_seed_offset(seed, offset):
    seed, offset = int(seed), int(offset)
    if not 0 <= seed < 2**64:
        raise ValueError(f"seed: expected an integer in [0, 2**64), got {seed}")
    if not 0 <= offset < 2**64:
        raise ValueError(f"offset: expected an integer in [0, 2**64), got {offset}")
    return seed, offset


def philox_words(count, *, seed, offset=0):
    """Draws ``offset .. offset+count-1`` of the stream as a uint32 array."""
    seed, offset = check_seed_offset(seed, offset)
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
    seed, offset = check_seed_offset(seed, offset)
    out = np.empty(count, dtype=np.float64)
    for j in range(count):
        k = offset + j
        pair = philox_words(2, seed=seed, offset=k & ~1)
        u1 = (float(pair[0]) + 0.5) / TWO_POW_32
        u2 = (float(pair[1]) + 0.5) / TWO_POW_32
        r = np.sqrt(-2.0 * np.log(u1))
        out[j] = r * (np.sin(2.0 * np.pi * u2) if k & 1 else np.cos(2.0 * np.pi * u2))
    return out.astype(dtype)

