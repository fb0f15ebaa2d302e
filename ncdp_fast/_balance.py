"""When a clipped sum must move powers of two between a sample's operands.

The factored clipped sum (``clipped_linear_sum``, both twins) multiplies the
clip factor f_i into one operand (the narrower) and runs one GEMM in the data
dtype.  Its rounding is relative -- the clip rule's ``(1 + 4u)`` margin covers
it -- only while each operand stays far from the dtype's denormals and
overflow; when f_i max|x_i| or the other operand's max leaves [2^-40, 2^40],
an exact power of two 2^k_i is moved between them (``exponents``).  That scan
reads both operands, so the clip ops decide first, from the per-sample
Frobenius norms the norm pass already formed (``linear_sq_norms(..., sizes)``),
whether any sample of a layer may need it (``layers_needing_balancing``); the
device reads that answer in the step's one host transfer.  The norms bound the
maxima (max|x| lies in [||x|| / sqrt(n), ||x||]), so "no" is exact: every k_i
would be 0.
"""
from __future__ import annotations

import numpy as np

# Operand maxima inside [2^-EXP, 2^EXP] round relatively in float32 and in
# float64 whatever the other operand (products stay normal or 0).
BALANCED_EXP = 40
BALANCED = 2.0 ** BALANCED_EXP
# Widening of a range formed from a float64 sum of squares, for its rounding.
RANGE_SLACK = 2.0 ** -8


def norm_range(sq, n):
    """(lo, hi) with lo <= max|x| <= hi for x of n values whose float64 sum of
    squares is ``sq`` (arrays, NumPy; n broadcasts against sq)."""
    r = np.sqrt(sq)
    return r / np.sqrt(np.maximum(1, n)) * (1.0 - RANGE_SLACK), r * (1.0 + RANGE_SLACK)


def _balanced(lo, hi):
    return (1.0 / BALANCED <= lo) & (hi <= BALANCED)


def layers_needing_balancing(factors, sizes, n_a, n_g, into_g, float32):
    """(L,) bool: whether ``exponents`` could give some sample of each of L
    linear layers k != 0 -- all layers at once, on the host, after the step's
    one transfer, while the device waits (72 layers of B = 32, BERT-base's:
    0.16 ms on this project's 2-core CPU, where a call per layer took 3.2 ms).

    factors: (B,) float64, the weights the sums receive (clip factor times
    any gradient scale); sizes: (L, B, 2) float64, each sample's ||a_i||_F^2
    and ||g_i||_F^2 per layer (``linear_sq_norms``); n_a = T d and n_g = T K:
    (L,) values per sample; into_g: (L,) bool, the factor goes to g (K <= d);
    ``float32``: the data dtype, where a zero sum of squares means a zero
    operand (float64 squares can underflow, so there it proves nothing).  As
    the kernels: no sample is rebalanced unless some factor is below 1."""
    factors = np.asarray(factors, np.float64)
    L = sizes.shape[0]
    if factors.size == 0 or not factors.min() < 1.0:
        return np.zeros(L, bool)
    n_a, n_g = np.asarray(n_a)[:, None], np.asarray(n_g)[:, None]
    into_g = np.asarray(into_g, bool)[:, None]
    with np.errstate(all="ignore"):     # inf sizes (float64 overflow) and 0 * inf: NaN
        fa = np.where(into_g, 1.0, factors)          # the scaled operand's factor, else 1
        fg = np.where(into_g, factors, 1.0)
        la, ha = norm_range(sizes[..., 0], n_a)
        lg, hg = norm_range(sizes[..., 1], n_g)
        need = ~(_balanced(fa * la, fa * ha) & _balanced(fg * lg, fg * hg))   # NaN: scan
    zero = factors == 0.0                                # u = 0: k = 0
    if float32:
        zero = zero | (sizes[..., 0] == 0.0) | (sizes[..., 1] == 0.0)
    return (need & ~zero).any(axis=1)


def weights_in_range(weights) -> bool:
    """Whether every weight (the host's (B,) float64 copy) is 0 or within
    [2^-40, 2^40]: rounded to float32 each is then within u of itself, and its
    products with an operand the norms prove well scaled stay normal or 0,
    so a clipped sum may weigh g's rows by the weights in the data dtype
    (``_cuda.clip.clipped_linear_sum``'s ``bias_gemv``)."""
    w = np.asarray(weights, np.float64)
    return bool(np.all((w == 0.0) | ((w >= 1.0 / BALANCED) & (w <= BALANCED))))


def exponents(xp, u, v):
    """k_i = floor((log2 v_i - log2 u_i) / 2), the power of two that brings the
    scaled operand's max u_i and the other's v_i to the same exponent, where
    either lies outside [2^-40, 2^40] and neither is 0; else 0.  u, v: (B,)
    float64 arrays of any library ``xp`` (numpy, torch, cupy)."""
    lo, hi = 1.0 / BALANCED, BALANCED
    inside = (u >= lo) & (u <= hi) & (v >= lo) & (v <= hi)
    move = (u > 0) & (v > 0) & ~inside
    safe_u = xp.where(move, u, xp.ones_like(u))
    safe_v = xp.where(move, v, xp.ones_like(v))
    return xp.where(move, xp.floor(0.5 * (xp.log2(safe_v) - xp.log2(safe_u))), xp.zeros_like(u))
