"""Fused per-sample clipping with noise on the CPU (DESIGN.md kernel 1).

Kernels take validated, C-contiguous NumPy arrays and write into outputs the op
layer allocated.  Summation order depends only on the shapes (a fixed number of
row slabs, never the thread count), so a result is bitwise reproducible on one
machine whatever ``NUMBA_NUM_THREADS`` is.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from ._dispatch import sized_kernel

from .rng import add_gaussian

# Rows are split into at most this many slabs, each summed into its own
# accumulator; slabs are combined in order at the end.  Fixed (not the thread
# count) so the rounding of the result does not depend on the machine's cores.
NUM_SLABS = 8

# Reassociation lets LLVM vectorize the float64 norm reduction; NaN/Inf
# semantics stay intact (no 'nnan'/'ninf'), which the non-finite policy needs.
_FM = {"reassoc", "contract", "nsz"}


@njit(cache=True, fastmath=_FM, inline="always")
def _sq_norm(row):
    s = 0.0
    for j in range(row.shape[0]):
        v = np.float64(row[j])
        s += v * v
    return s


@njit(cache=True, inline="always")
def factor_from_sq(sq, max_norm):
    """min(1, C/||g||) from a float64 squared norm; 0 for a non-finite norm (the
    op raises or drops such rows), 1 for a zero row."""
    n = math.sqrt(sq)
    if not math.isfinite(n):
        return 0.0
    if n <= max_norm:
        return 1.0
    return max_norm / n


@sized_kernel(lambda sq, *_: 64 * sq.shape[0])
def clip_factors(sq, max_norm, factors, norms):
    """norms = sqrt(sq); factors = min(1, C/norm), 0 where not finite.  All [B] float64."""
    for i in prange(sq.shape[0]):
        norms[i] = math.sqrt(sq[i])
        factors[i] = factor_from_sq(sq[i], max_norm)


@sized_kernel(lambda g, *_: g.size, fastmath=_FM)
def row_sq_norms(g, sq, accumulate):
    """sq[i] (=|+=) sum_j g[i, j]^2 in float64.  g: [B, p]; sq: [B] float64."""
    for i in prange(g.shape[0]):
        s = _sq_norm(g[i])
        sq[i] = sq[i] + s if accumulate else s


@njit(cache=True, inline="always")
def _row_factor(g, i, factors, compute, max_norm, norms):
    if compute:
        sq = _sq_norm(g[i])
        norms[i] = math.sqrt(sq)
        factors[i] = factor_from_sq(sq, max_norm)
    return factors[i]


@sized_kernel(lambda g, *_: g.size, fastmath=_FM)
def _slab_sums(g, factors, compute, max_norm, norms, acc):
    """acc[s] = sum over the rows of slab s of factors[i] * g[i].

    With ``compute`` the factor of each row is derived from its norm right
    before the row is added, while the row is still in cache: the gradients
    stream from memory once.  Rows go in groups of four so the accumulator is
    read and written once per four rows, not once per row (for wide rows it
    lives in L2/L3 and its traffic would otherwise dominate).  norms and
    factors ([B] float64) are written when ``compute``.
    """
    B = g.shape[0]
    S = acc.shape[0]
    for s in prange(S):
        lo = (B * s) // S
        hi = (B * (s + 1)) // S
        a = acc[s]
        a[:] = 0
        i = lo
        while i < hi:
            f0 = _row_factor(g, i, factors, compute, max_norm, norms)
            if i + 4 <= hi:
                f1 = _row_factor(g, i + 1, factors, compute, max_norm, norms)
                f2 = _row_factor(g, i + 2, factors, compute, max_norm, norms)
                f3 = _row_factor(g, i + 3, factors, compute, max_norm, norms)
                # A zero factor marks a dropped (non-finite) row: 0 * NaN would
                # still poison the sum, so such groups go row by row below.
                if f0 != 0.0 and f1 != 0.0 and f2 != 0.0 and f3 != 0.0:
                    c0 = a.dtype.type(f0)
                    c1 = a.dtype.type(f1)
                    c2 = a.dtype.type(f2)
                    c3 = a.dtype.type(f3)
                    r0, r1, r2, r3 = g[i], g[i + 1], g[i + 2], g[i + 3]
                    for j in range(a.shape[0]):
                        a[j] += (c0 * r0[j] + c1 * r1[j]) + (c2 * r2[j] + c3 * r3[j])
                    i += 4
                    continue
            # Single row (tail of the slab, or a group holding a dropped row);
            # factors are already stored, so re-reading them is free.
            for r in range(i, min(i + 4, hi) if i + 4 <= hi else i + 1):
                f = factors[r]
                if f != 0.0:
                    c = a.dtype.type(f)
                    row = g[r]
                    for j in range(a.shape[0]):
                        a[j] += c * row[j]
            i = min(i + 4, hi) if i + 4 <= hi else i + 1


@sized_kernel(lambda acc, out: acc.size)
def _combine_slabs(acc, out):
    """out[j] = sum_s acc[s, j], in slab order, accumulated in float64."""
    S, p = acc.shape
    for j in prange(p):
        t = 0.0
        for s in range(S):
            t += np.float64(acc[s, j])
        out[j] = t


def _slab_buffer(B, p, dtype):
    return np.empty((max(1, min(B, NUM_SLABS)), p), dtype=dtype)


def clip_noise_rows(g, max_norm, noise_std, inv_denom, seed, offset, out, norms, factors):
    """Dense fused op: ``out = inv_denom * (sum_i f_i g_i + noise_std * xi)``.

    g: [B, p]; out: [p] (g's dtype); norms, factors: [B] float64 (written);
    xi: normals ``offset .. offset+p-1`` of ``seed``.  Non-finite rows get
    factor 0 (the op decides whether to raise).
    """
    B, p = g.shape
    acc = _slab_buffer(B, p, g.dtype)
    _slab_sums(g, factors, True, max_norm, norms, acc)
    _finish(acc, B, noise_std, inv_denom, seed, offset, out)


def weighted_row_sum_noise(g, factors, noise_std, inv_denom, seed, offset, out):
    """``out = inv_denom * (sum_i factors[i] g_i + noise_std * xi)`` with given factors."""
    B, p = g.shape
    acc = _slab_buffer(B, p, g.dtype)
    _slab_sums(g, factors, False, 0.0, factors, acc)
    _finish(acc, B, noise_std, inv_denom, seed, offset, out)


def _finish(acc, B, noise_std, inv_denom, seed, offset, out):
    if B == 0:
        acc[:] = 0
    _combine_slabs(acc, out)
    add_gaussian(out, np.uint64(seed), np.uint64(offset), float(noise_std), True, float(inv_denom))


def _linear_norm_work(a, g, *_):
    B, T, d = a.shape
    K = g.shape[2]
    if T <= 1:
        return a.size + g.size
    return B * T * T * (d + K) // 2 if 2 * T * T <= K * d else B * T * K * d


@sized_kernel(_linear_norm_work, fastmath=_FM)
def linear_sq_norms(a, g, bias, sq, accumulate):
    """Squared norms of the per-sample gradients of a linear layer, float64.

    a: [B, T, d] activations; g: [B, T, K] output gradients; sq: [B].
    ``||sum_t g_t a_t^T||_F^2`` is ``sum_{t,s} (a_t.a_s)(g_t.g_s)`` ("Gram", cost
    T^2 (d+K)) or the squared entries of the formed K x d matrix ("direct", cost
    T K d, memory K d); with a bias, ``||sum_t g_t||^2`` is added.  Gram is used
    when 2 T^2 <= K d (DESIGN.md's rule, shared with the CUDA kernel).
    """
    B, T, d = a.shape
    K = g.shape[2]
    use_gram = 2 * T * T <= K * d
    for i in prange(B):
        ai = a[i]
        gi = g[i]
        total = 0.0
        if T == 1:
            total = _sq_norm(ai[0]) * _sq_norm(gi[0])
        elif use_gram:
            for t in range(T):
                for s in range(t + 1):
                    da = 0.0
                    for j in range(d):
                        da += np.float64(ai[t, j]) * np.float64(ai[s, j])
                    dg = 0.0
                    for k in range(K):
                        dg += np.float64(gi[t, k]) * np.float64(gi[s, k])
                    total += da * dg if s == t else 2.0 * da * dg
        else:
            w = np.zeros((K, d))
            for t in range(T):
                for k in range(K):
                    gk = np.float64(gi[t, k])
                    for j in range(d):
                        w[k, j] += gk * np.float64(ai[t, j])
            for k in range(K):
                total += _sq_norm(w[k])
        if bias:
            for k in range(K):
                bk = 0.0
                for t in range(T):
                    bk += np.float64(gi[t, k])
                total += bk * bk
        sq[i] = sq[i] + total if accumulate else total


def clipped_linear_sum(a, g, factors, noise_std, inv_denom, seed, offset, gw, gb,
                       matmul=np.matmul):
    """gw [K, d] = inv_denom*(sum_{i,t} f_i g_it a_it^T + noise_std*xi_w), and
    gb [K] likewise from ``sum_{i,t} f_i g_it`` (skipped when gb is None).

    One BLAS GEMM over the B*T rows; the factor is applied to whichever operand
    is narrower, so the temporary is the smaller of (B*T, K) and (B*T, d).
    Noise: weight entries are draws offset + k*d + j, then the bias.
    ``matmul(x, y, out)`` is the caller library's GEMM (see ``_backend``).
    """
    B, T, d = a.shape
    K = g.shape[2]
    f = factors.astype(a.dtype)[:, None, None]
    a2 = a.reshape(B * T, d)
    g2 = g.reshape(B * T, K)
    if K <= d:
        gs = (g * f).reshape(B * T, K)
        matmul(gs.T, a2, out=gw)
    else:
        matmul(g2.T, (a * f).reshape(B * T, d), out=gw)
        gs = None
    add_gaussian(gw.reshape(-1), np.uint64(seed), np.uint64(offset), float(noise_std), True,
                 float(inv_denom))
    if gb is not None:
        if gs is None:
            gs = (g * f).reshape(B * T, K)
        # Column sums in float64 (np.sum's pairwise float32 sum is good, float64 is better).
        gb[:] = gs.sum(axis=0, dtype=np.float64)
        add_gaussian(gb, np.uint64(seed), np.uint64(offset) + np.uint64(K * d), float(noise_std),
                     True, float(inv_denom))
