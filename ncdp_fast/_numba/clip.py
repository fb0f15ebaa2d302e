"""Fused per-sample clipping with noise on the CPU (DESIGN.md kernel 1).

Kernels take validated, C-contiguous NumPy arrays and write into outputs the op
layer allocated.  Summation order depends only on the shapes (a fixed number of
row slabs, never the thread count), so a result is bitwise reproducible on one
machine whatever ``NUMBA_NUM_THREADS`` is.
"""
from __future__ import annotations

import contextlib
import math

import numpy as np
from numba import njit, prange

from .._balance import BALANCED, RANGE_SLACK
from ..reference.clip import GRAM32_ERROR_MARGIN, GRAM32_ROOT_MARGIN, gram32_rounding
from ._dispatch import sized_kernel

from .rng import add_gaussian, finish_gaussian_segments


def unit_roundoff(dtype) -> float:
    """u of a float dtype: the relative rounding error of one operation."""
    return float(np.finfo(dtype).eps) / 2

# Rows are split into at most this many slabs, each summed into its own
# accumulator; slabs are combined in order at the end.  Fixed (not the thread
# count) so the rounding of the result does not depend on the machine's cores.
NUM_SLABS = 8

# Reassociation lets LLVM vectorize the float64 norm reduction; NaN/Inf
# semantics stay intact (no 'nnan'/'ninf'), which the non-finite policy needs.
_FM = {"reassoc", "contract", "nsz"}


@njit(cache=True, fastmath=_FM, inline="always")
def _dot(x, y):
    s = 0.0
    for j in range(x.shape[0]):
        s += np.float64(x[j]) * np.float64(y[j])
    return s


@njit(cache=True, fastmath=_FM, inline="always")
def _sq_norm(row):
    return _dot(row, row)


# Factors below this are applied to a float64 product instead of being cast to
# the data dtype first: a float32 factor under 2^-126 is a denormal with few
# significant bits (and 0 under 2^-149), which broke the clip bound.
TINY_FACTOR = 2.0 ** -60


@njit(cache=True, inline="always")
def safe_factor(sq, e, max_norm, terms, t_max, unit):
    """The clip rule of ``reference.clip_factors``: 1 if the rounding-aware bound
    on the computed norm is <= C, else C / bound; 0 when the bound is not finite
    (the op raises or drops such rows).  sq: float64 squared norm; e: the spread
    (0 for dense rows and 2-D linear inputs)."""
    g = (terms + 4) * 2.0 ** -52
    b = (math.sqrt(sq + (math.sqrt(g) * e) ** 2) + (t_max + 2) * 2.0 ** -52 * e) * (1.0 + g)
    b = (b + 2.0 * (t_max + 2) * unit * e) * (1.0 + 4.0 * unit)
    if not math.isfinite(b):
        return 0.0
    if b <= max_norm:
        return 1.0
    return max_norm / b


@sized_kernel(lambda sq, *_: 64 * sq.shape[0])
def _clip_factors(sq, spread, has_spread, max_norm, terms, t_max, unit, factors, norms):
    for i in prange(sq.shape[0]):
        norms[i] = math.sqrt(sq[i])
        e = spread[i] if has_spread else 0.0
        factors[i] = safe_factor(sq[i], e, max_norm, terms, t_max, unit)


def clip_factors(sq, spread, max_norm, terms, t_max, unit, factors, norms, scale=1.0,
                 weights=None):
    """norms = sqrt(s^2 sq); factors by :func:`safe_factor` of s^2 sq and s
    spread; weights = factors s where given; s = ``scale`` (the clip op's
    grad_scale), each product rounded on its own, as the device kernel.  sq,
    spread (or None), factors, norms, weights: [B] float64; terms, t_max:
    ints; unit: the data dtype's u."""
    if scale != 1.0:
        sq = sq * (scale * scale)
        spread = None if spread is None else spread * scale
    has = spread is not None
    _clip_factors(sq, spread if has else sq, has, float(max_norm), float(terms), float(t_max),
                  float(unit), factors, norms)
    if weights is not None:
        np.multiply(factors, scale, out=weights)


@sized_kernel(lambda sq, *_: 64 * sq.size)
def _clip_factor_groups(sq, spread, has_spread, max_norms, terms, t_maxes, unit, out, stride,
                        scale, weights, has_weights):
    G, B = sq.shape
    for r in prange(G * B):
        g, i = r // B, r % B
        out[g * stride + B + i] = math.sqrt(sq[g, i])
        e = spread[g, i] if has_spread else 0.0
        f = safe_factor(sq[g, i], e, max_norms[g], terms[g], t_maxes[g], unit)
        out[g * stride + i] = f
        if has_weights:
            weights[g, i] = f * scale


def clip_factor_groups(sq, spread, rules, unit, out, stride, scale=1.0, weights=None):
    """:func:`clip_factors` for G groups of rows in one call (the device's
    ``launch_clip_factor_groups``): group g's rows sq[g] on its own rule
    rules[g] = (max_norm, terms, t_max), its factors at out[g stride: g stride
    + B] and its norms after them; weights[g] = its factors times ``scale``
    where given.  sq, spread (or None), weights (or None): (G, B) float64;
    out: 1-D float64, stride >= 2 B."""
    if scale != 1.0:
        sq = sq * (scale * scale)
        spread = None if spread is None else spread * scale
    has, has_w = spread is not None, weights is not None
    _clip_factor_groups(sq, spread if has else sq, has,
                        np.array([c for c, _, _ in rules], dtype=np.float64),
                        np.array([t for _, t, _ in rules], dtype=np.float64),
                        np.array([T for _, _, T in rules], dtype=np.float64), float(unit), out,
                        int(stride), float(scale), weights if has_w else sq, has_w)


@sized_kernel(lambda g, *_: g.size, fastmath=_FM)
def row_sq_norms(g, sq, accumulate):
    """sq[i] (=|+=) sum_j g[i, j]^2 in float64.  g: [B, p]; sq: [B] float64."""
    for i in prange(g.shape[0]):
        s = _sq_norm(g[i])
        sq[i] = sq[i] + s if accumulate else s


@njit(cache=True, inline="always")
def _row_factor(g, i, factors, compute, max_norm, unit, norms):
    if compute:
        sq = _sq_norm(g[i])
        norms[i] = math.sqrt(sq)
        factors[i] = safe_factor(sq, 0.0, max_norm, g.shape[1], 1.0, unit)
    return factors[i]


@sized_kernel(lambda g, *_: g.size, fastmath=_FM)
def _slab_sums(g, factors, compute, max_norm, unit, norms, acc):
    """acc[s] = sum over the rows of slab s of factors[i] * g[i].

    With ``compute`` the factor of each row is derived from its norm right
    before the row is added, while the row is still in cache: the gradients
    stream from memory once.  Rows go in groups of four so the accumulator is
    read and written once per four rows, not once per row (for wide rows it
    lives in L2/L3 and its traffic would otherwise dominate).  norms and
    factors ([B] float64) are written when ``compute``.  A factor below
    ``TINY_FACTOR`` multiplies in float64 (one rounding to the data dtype).
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
            f0 = _row_factor(g, i, factors, compute, max_norm, unit, norms)
            if i + 4 <= hi:
                f1 = _row_factor(g, i + 1, factors, compute, max_norm, unit, norms)
                f2 = _row_factor(g, i + 2, factors, compute, max_norm, unit, norms)
                f3 = _row_factor(g, i + 3, factors, compute, max_norm, unit, norms)
                # A zero factor marks a dropped (non-finite) row (0 * NaN would
                # still poison the sum) and a tiny one needs a float64 product:
                # such groups go row by row below.
                if min(min(f0, f1), min(f2, f3)) >= TINY_FACTOR:
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
                row = g[r]
                if f >= TINY_FACTOR:
                    c = a.dtype.type(f)
                    for j in range(a.shape[0]):
                        a[j] += c * row[j]
                elif f != 0.0:
                    for j in range(a.shape[0]):
                        a[j] += a.dtype.type(f * np.float64(row[j]))
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
    _slab_sums(g, factors, True, max_norm, unit_roundoff(g.dtype), norms, acc)
    _finish(acc, B, noise_std, inv_denom, seed, offset, out)


def weighted_row_sum_noise(g, factors, noise_std, inv_denom, seed, offset, out):
    """``out = inv_denom * (sum_i factors[i] g_i + noise_std * xi)`` with given factors."""
    B, p = g.shape
    acc = _slab_buffer(B, p, g.dtype)
    _slab_sums(g, factors, False, 0.0, 0.0, factors, acc)
    _finish(acc, B, noise_std, inv_denom, seed, offset, out)


def _finish(acc, B, noise_std, inv_denom, seed, offset, out):
    if B == 0:
        acc[:] = 0
    _combine_slabs(acc, out)
    add_gaussian(out, np.uint64(seed), np.uint64(offset), float(noise_std), True, float(inv_denom))


@njit(cache=True, fastmath=_FM, inline="always")
def _dots4(x, t, s):
    """Row t of x dotted with rows s..s+3, float64: row t is loaded and widened
    once for four products (the Gram form's inner loop; 17-25% faster than one
    dot at a time at BERT's (8, 128, 768 | 3072) shapes)."""
    d0 = 0.0
    d1 = 0.0
    d2 = 0.0
    d3 = 0.0
    xt, y0, y1, y2, y3 = x[t], x[s], x[s + 1], x[s + 2], x[s + 3]
    for j in range(xt.shape[0]):
        v = np.float64(xt[j])
        d0 += v * np.float64(y0[j])
        d1 += v * np.float64(y1[j])
        d2 += v * np.float64(y2[j])
        d3 += v * np.float64(y3[j])
    return d0, d1, d2, d3


def _linear_norm_work(a, g, *_):
    B, T, d = a.shape
    K = g.shape[2]
    if T <= 1:
        return a.size + g.size
    return B * T * T * (d + K) // 2 if 2 * T * T <= K * d else B * T * K * d


def linear_sq_norms(a, g, bias, sq, accumulate, spread=None, sizes=None):
    """Squared norms of the per-sample gradients of a linear layer, float64
    (:func:`_linear_sq_norms`); with ``spread`` (B,) float64, also
    spread[i] += sum_t ||g_it|| (||a_it|| + [bias]) (:func:`linear_spread`),
    the scale of a sequence block's rounding, as the device route gives it
    from the same pass; with ``sizes`` (B, 2) float64, also sizes[i] =
    (||a_i||_F^2, ||g_i||_F^2), which tell the clipped sum whether it must
    rebalance (``_balance.layers_needing_balancing``)."""
    want = sizes is not None
    out = sizes if want else np.empty((0, 2))
    _linear_sq_norms(a, g, bias, sq, accumulate, out, want)
    if spread is not None and a.shape[1] > 1:      # reference.linear_spread: 0 at T = 1
        linear_spread(a, g, bias, spread, True)


def linear_sq_norms_group(a_list, g_list, bias, sq, spread, sizes, gram32=False,
                          accumulate=True, rows=False):
    """linear_sq_norms for L layers of one shape (the device twin stacks them
    to save launches; here each layer runs as it is): sq (+= with
    ``accumulate``, else =) the sum of the layers' squared norms, spread +=
    each one's (T > 1, where given), sizes[l] (L, B, 2) = layer l's operands'
    squared norms; ``rows``: sq, spread (L, B), layer l's into row l (=).
    ``gram32`` (the device twin's float32 Grams) changes nothing here: these
    norms are float64 sums of exact products, within the rule's ``terms``.
    Returns False: no norm came from float32 Grams."""
    for l, (a, g) in enumerate(zip(a_list, g_list)):
        linear_sq_norms(a, g, bias, sq[l] if rows else sq, (accumulate or l > 0) and not rows,
                        None if a.shape[1] == 1 or spread is None else
                        spread[l] if rows else spread, sizes[l])
    return False


@sized_kernel(_linear_norm_work, fastmath=_FM)
def _linear_sq_norms(a, g, bias, sq, accumulate, sizes, want_sizes):
    """Squared norms of the per-sample gradients of a linear layer, float64.

    a: [B, T, d] activations; g: [B, T, K] output gradients; sq: [B]; sizes:
    [B, 2] (written when ``want_sizes``): the operands' squared Frobenius norms.
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
        sa = 0.0
        sg = 0.0
        if T == 1:
            sa, sg = _sq_norm(ai[0]), _sq_norm(gi[0])
            total = sa * sg
        elif use_gram:
            for t in range(T):
                s = 0
                while s + 4 <= t:        # rows s..s+3 against row t, read once
                    a0, a1, a2, a3 = _dots4(ai, t, s)
                    g0, g1, g2, g3 = _dots4(gi, t, s)
                    total += 2.0 * (a0 * g0 + a1 * g1 + a2 * g2 + a3 * g3)
                    s += 4
                while s < t:
                    total += 2.0 * _dot(ai[t], ai[s]) * _dot(gi[t], gi[s])
                    s += 1
                na, ng = _sq_norm(ai[t]), _sq_norm(gi[t])
                total += na * ng
                sa += na
                sg += ng
        else:
            w = np.zeros((K, d))
            for t in range(T):
                for k in range(K):
                    gk = np.float64(gi[t, k])
                    for j in range(d):
                        w[k, j] += gk * np.float64(ai[t, j])
            for k in range(K):
                total += _sq_norm(w[k])
            if want_sizes:
                for t in range(T):
                    sa += _sq_norm(ai[t])
                    sg += _sq_norm(gi[t])
        if bias:
            for k in range(K):
                bk = 0.0
                for t in range(T):
                    bk += np.float64(gi[t, k])
                total += bk * bk
        sq[i] = sq[i] + total if accumulate else total
        if want_sizes:
            sizes[i, 0] = sa
            sizes[i, 1] = sg


def linear_norms_from_grams(w, v, bias, sq, accumulate, spread, sizes, layers,
                            shared_w=False, lengths=None):
    """The device route's last norm step, for the twins' parity (the CPU's own
    norm route never forms the Grams): per sample b of sq (B,) float64, over
    the ``layers`` stacked layers of w, v (layers * B, T, T) in order,
    sq[b] (=|+=) sum (W_i + bias) o V_i, spread[b] += sum_t sqrt(V_i[t,t])
    (sqrt(W_i[t,t]) + bias) (spread may be None), sizes[i] = (tr W_i, tr V_i)
    (sizes (layers * B, 2) or None); i = l * B + b; with ``shared_w`` w is the
    one input's (B, T, T) Grams (W_i = w[b]).  ``lengths = (d, K)``: w and v
    are float32 GEMMs of those dot lengths, and each layer's norm and spread
    are the upper bounds of ``reference.linear_norms_from_grams``."""
    rw = rv = (0.0, 0.0, 0.0)
    if lengths is not None:
        rw, rv = gram32_rounding(lengths[0]), gram32_rounding(lengths[1])
    _linear_norms_from_grams(w, v, 1.0 if bias else 0.0, sq, accumulate,
                             np.zeros(sq.shape[0]) if spread is None else spread,
                             np.zeros((v.shape[0], 2)) if sizes is None else sizes, layers,
                             sq.shape[0] if shared_w else v.shape[0], lengths is not None,
                             np.array(rw + rv, np.float64))


@njit(cache=True, fastmath=_FM, inline="always")
def _root_bound(diag, gamma, eta1, eta0):
    # reference.gram32_root_bound
    scale = (1.0 + GRAM32_ROOT_MARGIN) / (1.0 - gamma)
    return (eta1 + math.sqrt(eta1 * eta1 + (1.0 - gamma) * (eta0 + diag))) * scale


@njit(cache=True, fastmath=_FM, inline="always")
def _gram32_error(E, A1, B1, T, r):
    # reference.gram32_error, r = (gamma, eta1, eta0) of W then of V
    gw, e1w, e0w, gv, e1v, e0v = r[0], r[1], r[2], r[3], r[4], r[5]
    i = gw * E * E + 2.0 * e1w * E * B1 + e0w * B1 * B1
    ii = 2.0 * gw * E * A1 + e1w * (2.0 * T * E + 2.0 * A1 * B1) + 2.0 * e0w * T * B1
    iii = gw * A1 * A1 + 2.0 * e1w * T * A1 + e0w * T * T
    iv = gv * E * E + 2.0 * e1v * E * A1 + e0v * A1 * A1
    return ((1.0 + gv) * i + e1v * ii + e0v * iii + iv) * (1.0 + GRAM32_ERROR_MARGIN)


@sized_kernel(lambda w, v, *_: v.size, fastmath=_FM)
def _linear_norms_from_grams(w, v, one, sq, accumulate, spread, sizes, layers, w_count, gram32,
                             r):
    B = sq.shape[0]
    T = v.shape[1]
    for b in prange(B):
        total = 0.0
        scale = 0.0
        for l in range(layers):
            i = l * B + b
            k = i % w_count
            e = 0.0
            for t in range(T):
                for s in range(T):
                    e += (np.float64(w[k, t, s]) + one) * np.float64(v[i, t, s])
            tw = 0.0
            tv = 0.0
            big_e = 0.0
            a1 = 0.0
            b1 = 0.0
            for t in range(T):
                wt = np.float64(w[k, t, t])
                vt = np.float64(v[i, t, t])
                tw += wt
                tv += vt
                if gram32:
                    x = _root_bound(wt, r[0], r[1], r[2]) + one
                    y = _root_bound(vt, r[3], r[4], r[5])
                    big_e += y * x
                    a1 += x
                    b1 += y
                else:
                    big_e += math.sqrt(vt) * (math.sqrt(wt) + one)
            if gram32:
                e += _gram32_error(big_e, a1, b1, np.float64(T), r)
            total += e
            scale += big_e
            sizes[i, 0] = tw
            sizes[i, 1] = tv
        sq[b] = sq[b] + total if accumulate else total
        spread[b] += scale


@sized_kernel(lambda a, g, *_: a.size + g.size, fastmath=_FM)
def linear_spread(a, g, bias, spread, accumulate):
    """spread[i] (=|+=) sum_t ||g_it|| (||a_it|| + [bias]), float64: the scale of
    the rounding error of a sum over the T positions (``reference.clip_bound``).
    a: [B, T, d]; g: [B, T, K]; spread: [B] float64."""
    one = 1.0 if bias else 0.0
    for i in prange(a.shape[0]):
        e = 0.0
        for t in range(a.shape[1]):
            e += math.sqrt(_sq_norm(g[i, t])) * (math.sqrt(_sq_norm(a[i, t])) + one)
        spread[i] = spread[i] + e if accumulate else e


@njit(cache=True, fastmath=_FM, inline="always")
def _max_abs(x):
    m = 0.0
    for t in range(x.shape[0]):
        for j in range(x.shape[1]):
            m = max(m, abs(np.float64(x[t, j])))
    return m


@njit(cache=True, fastmath=_FM, inline="always")
def _norm_range(x):
    """``(lo, hi)`` with ``lo <= max|x| <= hi``, from the Frobenius norm
    (``max|x|`` lies in ``[||x|| / sqrt(n), ||x||]``), widened by 2^-8 for
    the sum's rounding.  A vectorized sum of squares: the max itself is a
    scalar loop, ~15x slower."""
    s = 0.0
    for t in range(x.shape[0]):
        s += _sq_norm(x[t])
    r = math.sqrt(s)
    return r / math.sqrt(max(1, x.size)) * (1.0 - RANGE_SLACK), r * (1.0 + RANGE_SLACK)


@njit(cache=True, fastmath=_FM, inline="always")
def _balanced(lo, hi):
    """Whether every value in [lo, hi] is 0-free and inside [2^-40, 2^40]."""
    return 1.0 / BALANCED <= lo and hi <= BALANCED


@sized_kernel(lambda a, g, *_: a.size + g.size, fastmath=_FM)
def _balance_exponents(a, g, factors, into_g, k):
    """k[i]: a power of two that multiplies the operand receiving the factor
    (g_i if ``into_g``, else a_i) while the other is divided by it, so that
    neither leaves the range where the data dtype rounds relatively: 0 unless
    f_i max|g_i| or max|a_i| is far from 1 (extreme inputs only).

    The maxima are formed only for a sample whose norms cannot rule that out
    (the answer is the same: the norms bound the maxima)."""
    for i in prange(a.shape[0]):
        k[i] = 0.0
        fi = factors[i]
        la, ha = _norm_range(a[i])
        lg, hg = _norm_range(g[i])
        if into_g:
            lg, hg = fi * lg, fi * hg
        else:
            la, ha = fi * la, fi * ha
        if _balanced(la, ha) and _balanced(lg, hg):
            continue
        ma = _max_abs(a[i])
        mg = _max_abs(g[i])
        u = fi * (mg if into_g else ma)             # the scaled operand
        v = ma if into_g else mg                    # the other one
        if u > 0.0 and v > 0.0 and not (1.0 / BALANCED <= u <= BALANCED
                                        and 1.0 / BALANCED <= v <= BALANCED):
            k[i] = np.floor(0.5 * (np.log2(v) - np.log2(u)))


@sized_kernel(lambda x, *_: x.size)
def _scale_rows(x, f, out):
    """out[i] = x[i] * f[i], the product in float64 rounded once to out's dtype:
    ``(x * f[:, None, None]).astype(x.dtype)`` without its float64 temporary
    (the same values, bit for bit).  x, out: [B, T, n]; f: [B] float64."""
    for i in prange(x.shape[0]):
        fi = f[i]
        for t in range(x.shape[1]):
            for j in range(x.shape[2]):
                out[i, t, j] = np.float64(x[i, t, j]) * fi


@njit(cache=True)
def _scaled_column_sums(x, f, out):
    """out[k] = sum_{i,t} x[i, t, k] * f[i], each product rounded to x's dtype as
    :func:`_scale_rows` does, summed in float64 row after row (numpy's
    ``cumsum(axis=0)[-1]`` of those rows, bit for bit; its ``sum`` adds a
    contiguous axis pairwise, so differs when K = 1), then rounded to out's
    dtype.  Serial: the order of the sum is fixed."""
    K = x.shape[2]
    acc = np.zeros(K)
    row = np.empty(K, x.dtype)
    for i in range(x.shape[0]):
        fi = f[i]
        for t in range(x.shape[1]):
            for k in range(K):
                row[k] = np.float64(x[i, t, k]) * fi
            for k in range(K):
                acc[k] += np.float64(row[k])
    for k in range(K):
        out[k] = acc[k]


def float32_gemm_scope(like):
    """The CUDA twin's TF32 switch around a step's clipped sums: nothing to
    switch for the CPU's BLAS (IEEE float32 always)."""
    return contextlib.nullcontext()


def clipped_linear_sum(a, g, factors, noise_std, inv_denom, seed, offset, gw, gb,
                       matmul=np.matmul, balance=True, finish=None, bias_gemv=None):
    """gw [K, d] = inv_denom*(sum_{i,t} f_i g_it a_it^T + noise_std*xi_w), and
    gb [K] likewise from ``sum_{i,t} f_i g_it`` (skipped when gb is None).

    One BLAS GEMM over the B*T rows; the factor is applied to whichever operand
    is narrower, so the temporary is the smaller of (B*T, K) and (B*T, d).  The
    factor multiplies in float64 and the product is rounded once: a float32
    factor would be a denormal below 2^-126.  When some sample is clipped, an
    exact power of two is moved between its operands if either would otherwise
    leave the well-scaled range (extreme inputs; see ``_balance_exponents``);
    ``balance=False`` skips that scan, for a caller that knows from the norms
    that no sample needs it (``_balance.layers_needing_balancing``).
    Noise: weight entries are draws offset + k*d + j, then the bias.
    ``matmul(x, y, out)`` is the caller library's GEMM (see ``_backend``).
    ``finish``: a list, or None; given, the noise is not added here: the
    weight's and the bias's finishes are appended to it as
    ``finish_gaussian_segments`` segments, for the caller to run with its
    other layers' (the CUDA twin's one launch).  ``bias_gemv``: the CUDA
    twin's (its GEMV bias); here every bias is summed in float64.
    """
    B, T, d = a.shape
    K = g.shape[2]
    dt = a.dtype
    g_in = g
    into_g = K <= d      # the factor goes to the narrower operand
    f = factors
    if balance and B and f.min() < 1.0:
        k = np.empty(B)
        _balance_exponents(a, g, f, into_g, k)
        if k.any():
            k = k.astype(np.int64)
            f = np.ldexp(f, k)
            if into_g:
                a = np.ldexp(a, -k[:, None, None]).astype(dt)
            else:
                g = np.ldexp(g, -k[:, None, None]).astype(dt)
    # The scaled operand is written in the data dtype directly (no float64
    # temporary of B*T*max(K, d) values: at the sizes of a transformer layer
    # that temporary cost more than the GEMM's other operand).
    if into_g:
        scaled = np.empty((B, T, K), dt)
        _scale_rows(g, np.ascontiguousarray(f), scaled)
        matmul(scaled.reshape(B * T, K).T, a.reshape(B * T, d), out=gw)
    else:
        scaled = np.empty((B, T, d), dt)
        _scale_rows(a, np.ascontiguousarray(f), scaled)
        matmul(g.reshape(B * T, K).T, scaled.reshape(B * T, d), out=gw)
    del scaled
    flat = gw.reshape(-1)
    segments = [] if finish is None else finish
    segments.append((flat, flat, int(offset)))
    if gb is not None:
        # The bias sums g_i times its true factor (no power of two moved), in
        # float64 (np.sum's pairwise float32 sum is good, float64 is better).
        if B:
            _scaled_column_sums(g_in, np.ascontiguousarray(factors, dtype=np.float64), gb)
        else:
            gb[:] = 0
        segments.append((gb, gb, int(offset) + K * d))
    if finish is None:
        finish_gaussian_segments(segments, seed, noise_std, inv_denom)


@sized_kernel(lambda x, out: out.size * x.shape[2])
def _gram_rows_f64(x, out):
    n, T, d = x.shape
    for i in prange(n):
        for t in range(T):
            for s in range(t, T):
                acc = 0.0
                for k in range(d):
                    acc += np.float64(x[i, t, k]) * np.float64(x[i, s, k])
                out[i, t, s] = acc
                out[i, s, t] = acc


def gram_rows_f64(x, out):
    """The device kernel's per-sample Grams (reference.gram_rows_f64): out (n,
    T, T) float64 = X_i X_i^T of x (n, T, d), float32 or float64, each entry
    the float64 sum of the exact products in k order (no reassociation), the
    upper triangle mirrored."""
    if out.size:
        _gram_rows_f64(x, out)


@sized_kernel(lambda x, *_: x.size, fastmath=_FM)
def _norm_affine_grads(x, g, run, eps, w, b):
    B, rows, n = x.shape
    per_row = n // run if run > 0 else 0
    for i in prange(B):
        means = np.empty(rows)
        rstds = np.empty(rows)
        for r in range(rows):
            s = 0.0
            for e in range(n):
                s += x[i, r, e]
            mean = s / n
            q = 0.0
            for e in range(n):
                c = x[i, r, e] - mean
                q += c * c
            means[r] = mean
            rstds[r] = 1.0 / math.sqrt(q / n + eps)
        if run > 0:
            for r in range(rows):
                for c in range(per_row):
                    sw = 0.0
                    sb = 0.0
                    for e in range(c * run, (c + 1) * run):
                        gv = float(g[i, r, e])
                        sw += gv * ((x[i, r, e] - means[r]) * rstds[r])
                        sb += gv
                    w[i, r * per_row + c] = sw
                    b[i, r * per_row + c] = sb
        else:
            for e in range(n):
                sw = 0.0
                sb = 0.0
                for r in range(rows):
                    gv = float(g[i, r, e])
                    sw += gv * ((x[i, r, e] - means[r]) * rstds[r])
                    sb += gv
                w[i, e] = sw
                b[i, e] = sb


def norm_affine_grads(x, g, run, eps, w, b, dims=None):
    """The device kernel's per-sample affine gradients of a normalisation layer
    (reference.norm_affine_grads): x, g (B, rows, n) C-contiguous float32 or
    float64 (or of any shape, read as ``dims`` = (B, rows, n) in row-major
    order, as the device's signature); w, b (B, C) in their dtype, or None
    (not formed).  Rows are normalised in float64 and the sums formed in
    float64, rounded once."""
    if dims is not None:
        x, g = x.reshape(dims), g.reshape(dims)
    B, _, n = x.shape
    C = n if run == 0 else x.shape[1] * (n // run)
    ww = np.empty((B, C)) if w is None or w.dtype != np.float64 else w
    bb = np.empty((B, C)) if b is None or b.dtype != np.float64 else b
    if B and C and x.shape[1]:
        _norm_affine_grads(x, g, int(run), float(eps), ww, bb)
    elif B and C:
        ww[...] = 0.0
        bb[...] = 0.0
    for out, acc in ((w, ww), (b, bb)):
        if out is not None and out is not acc:
            out[...] = acc
