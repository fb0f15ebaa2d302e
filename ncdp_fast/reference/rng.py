"""Philox4x32-10 and the stream's normals: the random-number contract.

Random-number contract (DESIGN.md, "Random numbers"):

* Philox4x32-10 with key ``(seed mod 2^32, seed >> 32)`` and counter
  ``(b mod 2^32, b >> 32, 0, 0)`` produces block ``b`` of four 32-bit words; the
  stream is the concatenation of blocks, so word ``w`` is element ``w % 4`` of
  block ``w // 4``.  The last two counter words are reserved (zero).
* A *draw* is one 32-bit word.  Offsets count draws.
* Normal variate ``j`` of stream ``(seed, offset)`` belongs to the Box--Muller
  pair ``p = k // 2`` of draw ``k = offset + j``; the normal is
  ``z_even = r cos(2 pi u2)`` when ``k`` is even and ``z_odd = r sin(2 pi u2)``
  when it is odd, ``r = sqrt(-2 ln u1)``, computed in float64 and rounded once
  to the output dtype.  ``count`` normals consume ``count`` draws, so disjoint
  offset ranges give independent noise (the two members of a pair are
  independent exact normals under Box--Muller).
* The pair's words.  With ``m = p >> 1`` and ``h = 2 (p & 1)``:

  - its draws ``(a, b)`` are words ``h, h+1`` of *main block* ``m`` (draws
    ``2p``, ``2p+1``);
  - ``(y, v)`` are words ``h, h+1`` of its *companion block* ``2^63 + m``;
  - ``(x0, x1)`` are words ``h, h+1`` of its *deep block* ``2^62 + m``, read
    only when ``a < 2^21``.

  The two pairs of a main block share its companion and deep blocks, each
  reading its own half.  Then ``u2 = ((v + 0.5) + b 2^32) / 2^64``, and

  - if ``a >= 2^21``: ``u1 = ((y + 0.5) + a 2^32) / 2^64``;
  - else (probability 2^-11 per pair):
    ``u1 = ((((x1 + 0.5) + x0 2^32) + y 2^64) + a 2^96) / 2^128``,

  summed in float64 in exactly that order (each product by a power of two is
  exact, so a fused multiply-add gives the same bits).  u1 lies in
  ``[2^-129, 1]`` and u2 in ``(0, 1]`` (the top ~2^-54 of each rounds to 1.0:
  radius 0, angle 2 pi).
* Block ranges.  Draws address blocks below ``2^62`` (a draw index is below
  ``2^64``), deep blocks ``[2^62, 2^63)`` and companion blocks
  ``[2^63, 2^63 + 2^62)`` (``m < 2^62``): disjoint, and below ``2^64``, so no
  index wraps.  Sub-streams have non-zero counter words 2-3 and never meet
  any of them.  Companion and deep blocks are never a draw of any consumer:
  the Poisson samplers and every offset computation are unchanged by them.
* Why these widths: u1 sits on a grid of cells each as probable as it is wide
  -- width 2^-64 on ``[2^-11, 1)`` (one cell per ``(a, y)``, ``a >= 2^21``)
  and 2^-128 below (one per ``(a, y, x0, x1)``, ``a < 2^21``) -- and takes its
  cell's midpoint, rounded by the sums above.  Where ``a >= 2^21`` the 64 bits
  already hold 53 significant ones, all that float64 keeps; below, the deep
  words keep the grid 2^-128 down to the smallest u1, ``2^-129`` (all words
  zero), so ``|z| <= sqrt(258 ln 2) = GAUSSIAN_TAIL_BOUND ~ 13.37``.  With
  32-bit u1 the bound was 6.7637 and a record whose clipped contribution sits
  on one coordinate made outputs impossible without it (issue 23, item 5); the
  accountant now charges the truncation (``ncdp_fast.privacy.truncation``) of
  the lowest cell, u1 < 2^-128, of mass 2^-128 per pair: that charge is below
  1e-20 for any realistic run.  u2 only sets the angle; 64 bits keep it as
  fine as u1's top bits.
* Cost: a main and a companion block per two pairs, 0.5 Philox blocks per
  normal, plus a deep block for one main block in about 1024.  (The former
  contract read a whole extra block per pair, 0.75 blocks per normal.)
"""
from __future__ import annotations

import numpy as np

MASK32 = 0xFFFFFFFF
PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9
PHILOX_W1 = 0xBB67AE85
TWO_POW_32 = 4294967296.0
TWO_POW_64 = 18446744073709551616.0
INV_TWO_POW_64 = 2.0 ** -64
INV_TWO_POW_128 = 2.0 ** -128
# Block index offsets of main block m's companion and deep blocks, and the
# leading draw below which a pair reads its deep block (module docstring).
COMPANION_BLOCK = 1 << 63
DEEP_BLOCK = 1 << 62
DEEP_BELOW = 1 << 21
# Probability that u1 falls in its lowest cell [0, 2^-128): the ideal Gaussian
# pair mass that the sampler folds onto its largest radius, charged per pair by
# the accountant (ncdp_fast.privacy.truncation).
GAUSSIAN_TRUNCATION_MASS = 2.0 ** -128
# The largest |z| the sampler can return before rounding to the output dtype:
# the radius of the smallest u1, 2^-129 (cos(2 pi u2) rounds to 1 at u2 near 0).
GAUSSIAN_TAIL_BOUND = float(np.sqrt(-2.0 * np.log(2.0 ** -129)))


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


def _block(key, b):
    """Block ``b`` of the main stream of ``key``: counter words 2-3 zero."""
    return philox4x32_10(key, (b & MASK32, b >> 32, 0, 0))


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
            cache = _block(key, b)
            cache_block = b
        out[j] = cache[w & 3]
    return out


def uniforms_of_words(a, b, y, v, x0, x1):
    """``(u1, u2)`` of a pair's draws ``a, b``, its companion words ``y, v`` and
    its deep words ``x0, x1`` (read only when ``a < DEEP_BELOW``)."""
    u2 = ((float(v) + 0.5) + float(b) * TWO_POW_32) * INV_TWO_POW_64
    if a >= DEEP_BELOW:
        return ((float(y) + 0.5) + float(a) * TWO_POW_32) * INV_TWO_POW_64, u2
    u1 = (((float(x1) + 0.5) + float(x0) * TWO_POW_32) + float(y) * TWO_POW_64) \
        + float(a) * (TWO_POW_64 * TWO_POW_32)
    return u1 * INV_TWO_POW_128, u2


def pair_uniforms(seed, pair):
    """The float64 uniforms ``(u1, u2)`` of Box--Muller pair ``pair`` (module docstring)."""
    key = (seed & MASK32, seed >> 32)
    m, h = pair >> 1, 2 * (pair & 1)
    main, comp = _block(key, m), _block(key, COMPANION_BLOCK + m)
    deep = _block(key, DEEP_BLOCK + m) if main[h] < DEEP_BELOW else (None,) * 4
    return uniforms_of_words(main[h], main[h + 1], comp[h], comp[h + 1], deep[h], deep[h + 1])


def box_muller(u1, u2, odd):
    """``r cos(2 pi u2)`` (``odd`` false) or ``r sin(2 pi u2)``, ``r = sqrt(-2 ln u1)``."""
    r = np.sqrt(-2.0 * np.log(u1))
    return r * (np.sin(2.0 * np.pi * u2) if odd else np.cos(2.0 * np.pi * u2))


def gaussian(count, *, seed, offset=0, dtype=np.float32):
    """The stream's normals ``offset .. offset+count-1`` (see module docstring)."""
    seed, offset = check_seed_offset(seed, offset)
    out = np.empty(count, dtype=np.float64)
    for j in range(count):
        k = offset + j
        out[j] = box_muller(*pair_uniforms(seed, k >> 1), k & 1)
    return out.astype(dtype)


def finish_gaussian_segments(segments, *, seed, scale, post):
    """The finishes of several noisy sums: for each (src, offset) of ``segments``,
    ``post * (src + scale * normals(seed, offset .. offset + len(src) - 1))`` in
    float64 (the caller rounds it once to its output's dtype).  src: 1-D,
    float32 or float64; each segment consumes len(src) draws at its offset."""
    return [post * (np.asarray(src, dtype=np.float64)
                    + scale * gaussian(len(src), seed=seed, offset=offset, dtype=np.float64))
            for src, offset in segments]
