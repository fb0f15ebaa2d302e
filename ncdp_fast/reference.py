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


def clip_factors(sq_norms, max_norm):
    """min(1, C / ||g||) in float64; a zero norm gives factor 1."""
    norms = np.sqrt(np.asarray(sq_norms, dtype=np.float64))
    return np.array([1.0 if n <= max_norm else max_norm / n for n in norms]), norms


def clip_and_noise(grads, *, max_norm, noise_multiplier, seed, offset=0,
                   reduction="sum", expected_batch_size=None):
    """DESIGN.md kernel 1 (dense), in float64: returns ``(grad, norms)``.

    ``grad = (sum_i g_i min(1, C/||g_i||) + sigma C xi) / denom`` with ``xi`` the
    stream's first ``p`` normals at ``offset`` and ``denom`` 1 ("sum") or
    ``expected_batch_size`` ("mean").  Rows must be finite.
    """
    g = np.asarray(grads, dtype=np.float64)
    B, p = g.shape
    sq = np.array([sum(float(v) * float(v) for v in row) for row in g])
    factors, norms = clip_factors(sq, max_norm)
    total = np.zeros(p)
    for i in range(B):
        total += factors[i] * g[i]
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
    """
    K, d = np.shape(backprops)[-1], np.shape(activations)[-1]
    flat = per_sample_linear_grads(activations, backprops, bias=bias)
    total, norms = clip_and_noise(flat, max_norm=max_norm, noise_multiplier=noise_multiplier,
                                  seed=seed, offset=offset, reduction=reduction,
                                  expected_batch_size=expected_batch_size)
    gw = total[:K * d].reshape(K, d)
    gb = total[K * d:] if bias else None
    return gw, gb, norms


def clip_and_noise_layers(flat_blocks, *, max_norm, noise_multiplier, seed, offset=0,
                          reduction="sum", expected_batch_size=None):
    """Several parameters sharing one clip factor per sample: concatenate the
    per-sample blocks (B, p_l) in order and clip the whole row; returns the list of
    per-block results and the total norms."""
    flat = np.concatenate([np.asarray(b, dtype=np.float64) for b in flat_blocks], axis=1)
    total, norms = clip_and_noise(flat, max_norm=max_norm, noise_multiplier=noise_multiplier,
                                  seed=seed, offset=offset, reduction=reduction,
                                  expected_batch_size=expected_batch_size)
    out, start = [], 0
    for b in flat_blocks:
        out.append(total[start:start + np.shape(b)[1]])
        start += np.shape(b)[1]
    return out, norms
