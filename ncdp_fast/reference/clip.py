"""DESIGN.md kernel 1: the clip rule and fused clipping with noise, in float64."""
from __future__ import annotations

import math

import numpy as np

from .rng import gaussian


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


def clip_factor_groups(sq_norms, rules, *, unit=U64, spread=None, scale=1.0):
    """:func:`clip_factors` for G groups of rows, each on its own rule (the
    kernels' ``clip_factor_groups``: per-layer clipping, a group a parameter).

    sq_norms: (G, B) float64; rules: G ``(max_norm, terms, seq_len)``; spread:
    (G, B) or None; ``scale`` s (the op's grad_scale) applied as the kernels do,
    s^2 sq and s spread, each product rounded once.  Returns ``(factors, norms,
    weights)``, each (G, B) float64, weights = factors s."""
    sq = np.asarray(sq_norms, dtype=np.float64) * (scale * scale)
    e = None if spread is None else np.asarray(spread, dtype=np.float64) * scale
    factors, norms = np.empty_like(sq), np.empty_like(sq)
    for g, (c, terms, seq_len) in enumerate(rules):
        factors[g], norms[g] = clip_factors(sq[g], c, unit=unit, terms=terms,
                                            spread=None if e is None else e[g], seq_len=seq_len)
    return factors, norms, factors * scale


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


# The float32 Gram model (docs/privacy.md, "Norms from float32 Grams"): a dot
# product of n float32 values x, y computed by any order of IEEE float32
# multiply-adds (a GEMM, TF32 off) is within
#   gamma_n sum_k |x_k y_k| + eta1_n (||x|| + ||y||) + eta0_n
# of the exact one, gamma_n = n u / (1 - n u) (u = 2^-24, normal range),
# eta1_n = 2^-125 sqrt(n) (inputs below 2^-126 read as 0) and eta0_n =
# n 2^-124 (results below 2^-126 flushed to 0), each with a factor of 2 for
# the absolute errors' own growth.
GRAM32_UNIT = 2.0 ** -24
GRAM32_MAX_LENGTH = 1 << 20
# Margins over the float64 roundings of the bound's own arithmetic.
GRAM32_ROOT_MARGIN = 2.0 ** -40
GRAM32_ERROR_MARGIN = 2.0 ** -20


def gram32_rounding(n):
    """``(gamma, eta1, eta0)`` of a float32 Gram whose dot products have length
    ``n`` (1 <= n <= GRAM32_MAX_LENGTH), each correctly rounded from its
    formula (the kernels compute the same values)."""
    n = int(n)
    if not 1 <= n <= GRAM32_MAX_LENGTH:
        raise ValueError(f"n: expected a dot-product length in [1, {GRAM32_MAX_LENGTH}], got {n}")
    nu = n * GRAM32_UNIT
    return nu / (1.0 - nu), 2.0 ** -125 * math.sqrt(n), n * 2.0 ** -124


def gram32_root_bound(diag, rounding):
    """An upper bound on ||x_t|| from a float32 Gram's computed diagonal entry
    ``diag`` = fl(x_t . x_t) under ``rounding`` = (gamma, eta1, eta0): the
    largest root of (1 - gamma) r^2 - 2 eta1 r - (eta0 + diag)."""
    gamma, eta1, eta0 = rounding
    scale = (1.0 + GRAM32_ROOT_MARGIN) / (1.0 - gamma)
    return (eta1 + np.sqrt(eta1 * eta1 + (1.0 - gamma) * (eta0 + diag))) * scale


def gram32_error(E, A1, B1, T, rw, rv):
    """The largest |sum_{t,s} ((W'_ts + b) V'_ts - (W_ts + b) V_ts)| over float32
    Grams W', V' within the model of their exact W, V (``rw``, ``rv``: their
    (gamma, eta1, eta0)), from upper bounds E >= sum_t (|a_t| + b) |g_t|,
    A1 >= sum_t (|a_t| + b), B1 >= sum_t |g_t| (docs/privacy.md)."""
    gw, e1w, e0w = rw
    gv, e1v, e0v = rv
    i = gw * E * E + 2.0 * e1w * E * B1 + e0w * B1 * B1
    ii = 2.0 * gw * E * A1 + e1w * (2.0 * T * E + 2.0 * A1 * B1) + 2.0 * e0w * T * B1
    iii = gw * A1 * A1 + 2.0 * e1w * T * A1 + e0w * T * T
    iv = gv * E * E + 2.0 * e1v * E * A1 + e0v * A1 * A1
    return ((1.0 + gv) * i + e1v * ii + e0v * iii + iv) * (1.0 + GRAM32_ERROR_MARGIN)


def linear_norms_from_grams(w, v, bias, layers=1, shared_w=False, lengths=None):
    """A linear layer's per-sample squared gradient norms, spreads and operand
    sizes from its Grams (the device route's last step), one sample at a time.

    ``w``, ``v``: (layers * B, T, T) Grams ``A_i A_i^T`` and ``G_i G_i^T`` of
    ``layers`` layers stacked along the batch (sample ``i = l * B + b``); with
    ``shared_w`` the layers read one input and ``w`` is its (B, T, T) Grams
    (``W_i = w[b]``).
    Returns float64 ``(sq, spread, sizes)``: ``sq[b] = sum_l sum_{t,s}
    (W_i[t,s] + bias) V_i[t,s]`` (``||g_i^T [a_i, 1]||_F^2``), ``spread[b] =
    sum_l sum_t sqrt(V_i[t,t]) (sqrt(W_i[t,t]) + bias)`` (:func:`linear_spread`
    from the diagonals) and ``sizes[i] = (tr W_i, tr V_i)``, of shapes (B,),
    (B,) and (layers * B, 2).

    ``lengths = (d, K)``: the Grams are float32 GEMMs of dot lengths d (W) and
    K (V), not exact: each layer's norm is then an upper bound, the Hadamard
    sum plus :func:`gram32_error` of that layer, and its spread is formed from
    the diagonals' root bounds (:func:`gram32_root_bound`), so both bound the
    exact values the float64 route approximates (docs/privacy.md).
    """
    w = np.asarray(w, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    n, T = v.shape[0], v.shape[1]
    B = n // layers
    one = 1.0 if bias else 0.0
    rw = rv = None
    if lengths is not None:
        rw, rv = gram32_rounding(lengths[0]), gram32_rounding(lengths[1])
    sq, spread, sizes = np.zeros(B), np.zeros(B), np.zeros((n, 2))
    for i in range(n):
        wi = w[i % B] if shared_w else w[i]
        dw, dv = np.diagonal(wi), np.diagonal(v[i])
        hadamard = float(((wi + one) * v[i]).sum())
        sizes[i] = dw.sum(), dv.sum()
        if rw is None:
            sq[i % B] += hadamard
            spread[i % B] += float((np.sqrt(dv) * (np.sqrt(dw) + one)).sum())
            continue
        x, y = gram32_root_bound(dw, rw) + one, gram32_root_bound(dv, rv)
        E, A1, B1 = float((y * x).sum()), float(x.sum()), float(y.sum())
        sq[i % B] += hadamard + gram32_error(E, A1, B1, T, rw, rv)
        spread[i % B] += E
    return sq, spread, sizes


def norm_affine_grads(x, g, run, eps):
    """Per-sample gradients (w, b) of a normalisation layer's affine parameters
    ``y = w_c xhat + b_c``, float64 (B, C) each: ``w[i, c] = sum g xhat`` and
    ``b[i, c] = sum g`` over sample i's values of channel c.

    ``x``, ``g``: (B, rows, n), each row normalised on its own, ``xhat = (x -
    mean) / sqrt(var + eps)`` with the biased variance over the row (torch's
    layer and group norms).  ``run == 0`` (LayerNorm): value (r, e) is channel
    e, C = n; ``run > 0`` (GroupNorm: a row is a group of n / run channels of
    ``run`` consecutive values): channel r (n / run) + e // run."""
    x = np.asarray(x, dtype=np.float64)
    g = np.asarray(g, dtype=np.float64)
    B, rows, n = x.shape
    mean = x.mean(axis=2, keepdims=True) if n else np.zeros((B, rows, 1))
    var = ((x - mean) ** 2).mean(axis=2, keepdims=True) if n else np.zeros((B, rows, 1))
    xhat = (x - mean) / np.sqrt(var + eps)
    if run == 0:
        return (g * xhat).sum(axis=1), g.sum(axis=1)
    C = rows * (n // run)
    return ((g * xhat).reshape(B, C, run).sum(axis=2), g.reshape(B, C, run).sum(axis=2))


def gram_rows_f64(x):
    """Per-sample Gram matrices ``X_i X_i^T`` (n, T, T) float64 of rows ``x``
    (n, T, d), any float dtype: every product exact in float64 (float32
    values), summed over the d values in float64.  The device kernel
    (csrc/clip/gram_f64.cu) sums in its own order, within gamma_d of the sum
    of |products|."""
    x = np.asarray(x, dtype=np.float64)
    n, T, _ = x.shape
    out = np.zeros((n, T, T))
    for i in range(n):
        for t in range(T):
            for s in range(T):
                out[i, t, s] = math.fsum(x[i, t] * x[i, s])
    return out


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

