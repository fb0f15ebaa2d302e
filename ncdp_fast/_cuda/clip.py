"""Fused per-sample clipping with noise on CUDA: the signatures of ``_numba.clip``."""
from __future__ import annotations

import numpy as np

from .. import _arrays
from ._common import dtype_code, native, opt_ptr, ptr, stream, workspace
from .rng import add_gaussian  # also the finishing step of a ghost block, as _numba.clip


def row_sq_norms(g, sq, accumulate):
    B, p = g.shape
    native(g).launch_row_sq_norms(ptr(g), B, p, dtype_code(g), ptr(sq), bool(accumulate), stream(g))


def clip_factors(sq, spread, max_norm, terms, t_max, unit, factors, norms):
    # The rule of reference.clip_factors, in the kernel (clip/clip_rule.cuh).
    native(sq).launch_clip_factors(ptr(sq), opt_ptr(spread), sq.shape[0], float(max_norm), int(terms),
                           int(t_max), float(unit), ptr(factors), ptr(norms), stream(sq))


# The dense op's rows in one chunk (0), not in chunks of half the L2 (-1): the
# chunked form reads the gradients from DRAM once but launches 3 kernels a
# chunk, and bench/dense_traffic.py predicts it slower wherever it chunks (1.39
# against 0.88 ms at (1024, 409600) float32 at 5 us a launch; about even at
# 2 us).  bench_clip_dense times both on a GPU ("ncdp_chunked"), which decides.
DENSE_L2_BYTES = 0


def clip_noise_rows(g, max_norm, noise_std, inv_denom, seed, offset, out, norms, factors):
    # ``factors`` is unused: the fused launcher keeps them in its workspace.
    B, p = g.shape
    dt = dtype_code(g)
    C = native(g)
    nbytes = C.clip_noise_rows_workspace_bytes(B, p, dt)
    ws, ws_ptr = workspace(g, nbytes)
    C.launch_clip_noise_rows(ptr(g), B, p, dt, float(max_norm), float(noise_std),
                              float(inv_denom), int(seed), int(offset), ptr(out), ptr(norms),
                              ws_ptr, nbytes, stream(g), l2_bytes=DENSE_L2_BYTES)


def weighted_row_sum_noise(g, factors, noise_std, inv_denom, seed, offset, out):
    B, p = g.shape
    dt = dtype_code(g)
    C = native(g)
    nbytes = C.weighted_row_sum_workspace_bytes(B, p, dt)
    ws, ws_ptr = workspace(g, nbytes)
    C.launch_weighted_row_sum_noise(ptr(g), B, p, dt, ptr(factors), float(noise_std),
                                     float(inv_denom), int(seed), int(offset), ptr(out),
                                     ws_ptr, nbytes, stream(g))


# Float64 temporaries of one GEMM chunk, in bytes: bounds the extra memory of
# the norms whatever the batch (a GPT-2 head's (B, T, 50257) gradient would
# otherwise be copied to float64 whole).
GEMM_CHUNK_BYTES = _arrays.CHUNK_BYTES


def linear_sq_norms(a, g, bias, sq, accumulate, spread=None):
    """sq[i] (=|+=) ||g_i^T a_i||_F^2 (+ ||sum_t g_it||^2 with a bias), float64;
    with ``spread``, also spread[i] += sum_t ||g_it|| (||a_it|| + [bias]), the
    scale of a sequence block's rounding (reference.linear_spread; 0 at T = 1).

    a: (B, T, d), g: (B, T, K) device arrays (torch or CuPy); sq, spread: (B,)
    float64.
    The work is matrix products, so it goes to the vendor's batched GEMM
    (issue 36: the hand-written kernel, one block a sample on CUDA cores, was
    76% of a BERT step on the H200): the Gram route sums (a_t.a_s + [bias])
    (g_t.g_s) over t, s from A_i A_i^T and G_i G_i^T; the direct route forms
    G_i^T A_i (K x d).  The route is the numba twin's (Gram when 2 T^2 <= K d).
    Both in float64 -- a and g upcast exactly, FP64 GEMMs (FP64 tensor cores
    on Hopper; TF32 never applies to float64) -- so the norms stay within the
    rounding the clip rule's ``terms`` allows for either route
    (reference.linear_terms).  The spread comes from the same float64 copies
    (the Gram route's diagonals are the positions' squared norms): a separate
    pass upcast a and g again: 0.56 against 0.15 ms a BERT-base layer, 5 ms a
    step, by the GPU model of bench/report.py (GPU_MODEL; not yet measured).
    """
    B, T, d = a.shape
    K = g.shape[2]
    if T == 1:      # one position: nothing to spread (reference.linear_spread is 0)
        _rank1_sq_norms(a, g, bias, sq, accumulate)
        return
    gram = 2 * T * T <= K * d
    per_sample = 8 * (T * (d + K) + (2 * T * T if gram else K * d))
    if spread is not None and not gram:
        per_sample += 8 * T * max(d, K)         # the squares summed into the spread
    for lo, hi in _arrays.sample_chunks(B, per_sample, GEMM_CHUNK_BYTES):
        a64, g64 = _arrays.as_float64(a[lo:hi]), _arrays.as_float64(g[lo:hi])
        if gram:
            w = a64 @ a64.swapaxes(1, 2)
            v = g64 @ g64.swapaxes(1, 2)
            if spread is not None:
                _add_spread(spread, lo, hi, w.diagonal(0, 1, 2), v.diagonal(0, 1, 2), bias)
            if bias:
                w += 1.0
            w *= v
            e = w.sum(axis=(1, 2))
        else:
            if spread is not None:
                _add_spread(spread, lo, hi, (a64 * a64).sum(axis=2), (g64 * g64).sum(axis=2),
                            bias)
            w = g64.swapaxes(1, 2) @ a64
            w *= w
            e = w.sum(axis=(1, 2))
            if bias:
                s = g64.sum(axis=1)
                e += (s * s).sum(axis=1)
        if accumulate:
            sq[lo:hi] += e
        else:
            sq[lo:hi] = e


def _add_spread(spread, lo, hi, sa, sg, bias):
    """spread[lo:hi] += sum_t sqrt(sg_t) (sqrt(sa_t) + [bias]) from the positions'
    float64 squared norms sa, sg: (n, T)."""
    spread[lo:hi] += (sg ** 0.5 * (sa ** 0.5 + (1.0 if bias else 0.0))).sum(axis=1)


def _rank1_sq_norms(a, g, bias, sq, accumulate):
    """linear_sq_norms at T = 1, the numba twin's rank-1 case: ||g_i a_i^T||_F^2
    = ||a_i||^2 ||g_i||^2, plus ||g_i||^2 with a bias -- two float64 row
    reductions instead of the Gram route's batched 1 x 1 GEMMs (a linear head
    on the H200 ran slower on those than on the kernel they replaced)."""
    B, _, d = a.shape
    K = g.shape[2]
    for lo, hi in _arrays.sample_chunks(B, 8 * (d + K), GEMM_CHUNK_BYTES):
        a64, g64 = _arrays.as_float64(a[lo:hi, 0]), _arrays.as_float64(g[lo:hi, 0])
        sa, sg = (a64 * a64).sum(axis=1), (g64 * g64).sum(axis=1)
        e = sa * sg
        if bias:
            e += sg
        if accumulate:
            sq[lo:hi] += e
        else:
            sq[lo:hi] = e


def clipped_linear_sum(a, g, factors, noise_std, inv_denom, seed, offset, gw, gb, matmul=None):
    """gw [K, d] = inv_denom (sum_{i,t} f_i g_it a_it^T + noise_std xi_w), and
    gb [K] likewise from sum_{i,t} f_i g_it (skipped when gb is None).

    a: (B, T, d), g: (B, T, K) device arrays (torch or CuPy), float32 or
    float64; factors: (B,) float64 clip factors (each sample's clipped
    contribution); gw (K, d), gb (K,): outputs in the data dtype.  One vendor
    GEMM over the B*T rows (issue 36: the hand-written kernel was 13% of a
    BERT step on the H200), in float64: a and g upcast exactly, the factor
    folded into g in float64, so no product leaves float64's range whatever
    the float32 inputs (the numba twin, in float32 BLAS, moves powers of two
    between a sample's operands for that) and no TF32 ever applies.  The
    float64 sum takes the noise -- the stream's draws offset + k*d + j, then
    the bias -- and the division by the expected batch in ``add_gaussian``,
    then is rounded once to the data dtype.  Chunks of samples bound the
    float64 temporaries; ``matmul`` is the CPU path's BLAS hook, unused.
    """
    B, T, d = a.shape
    K = g.shape[2]
    io = _arrays.io_for(a)
    acc = io.zeros((K, d), np.float64)
    accb = io.zeros((K,), np.float64) if gb is not None else None
    for lo, hi in _arrays.sample_chunks(B, 8 * T * (2 * K + d), GEMM_CHUNK_BYTES):
        gf = _arrays.as_float64(g[lo:hi]) * factors[lo:hi, None, None]
        acc += gf.reshape(-1, K).T @ _arrays.as_float64(a[lo:hi]).reshape(-1, d)
        if accb is not None:
            accb += gf.sum(axis=(0, 1))
    add_gaussian(acc.reshape(-1), seed, offset, noise_std, True, inv_denom)
    gw[...] = acc
    if accb is not None:
        add_gaussian(accb, seed, offset + K * d, noise_std, True, inv_denom)
        gb[...] = accb
