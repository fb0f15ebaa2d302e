"""Fused per-sample clipping with noise on CUDA: the signatures of ``_numba.clip``."""
from __future__ import annotations

from .. import _arrays
from ._common import dtype_code, native, opt_ptr, ptr, stream, workspace
from .rng import add_gaussian  # noqa: F401  (the finishing step of a ghost block, as _numba.clip)


def row_sq_norms(g, sq, accumulate):
    B, p = g.shape
    native(g).launch_row_sq_norms(ptr(g), B, p, dtype_code(g), ptr(sq), bool(accumulate), stream(g))


def clip_factors(sq, spread, max_norm, terms, t_max, unit, factors, norms):
    # The rule of reference.clip_factors, in the kernel (clip/clip_rule.cuh).
    native(sq).launch_clip_factors(ptr(sq), opt_ptr(spread), sq.shape[0], float(max_norm), int(terms),
                           int(t_max), float(unit), ptr(factors), ptr(norms), stream(sq))


def linear_spread(a, g, bias, spread, accumulate):
    """spread[i] (=|+=) sum_t ||g_it|| (||a_it|| + [bias]) in float64 (reference.linear_spread)."""
    e = (_arrays.float64_norms(g) * (_arrays.float64_norms(a) + (1.0 if bias else 0.0))).sum(1)
    if accumulate:
        spread += e
    else:
        spread[:] = e


def clip_noise_rows(g, max_norm, noise_std, inv_denom, seed, offset, out, norms, factors):
    # ``factors`` is unused: the fused launcher keeps them in its workspace.
    B, p = g.shape
    dt = dtype_code(g)
    C = native(g)
    nbytes = C.clip_noise_rows_workspace_bytes(B, p, dt)
    ws, ws_ptr = workspace(g, nbytes)
    C.launch_clip_noise_rows(ptr(g), B, p, dt, float(max_norm), float(noise_std),
                              float(inv_denom), int(seed), int(offset), ptr(out), ptr(norms),
                              ws_ptr, nbytes, stream(g))


def weighted_row_sum_noise(g, factors, noise_std, inv_denom, seed, offset, out):
    B, p = g.shape
    dt = dtype_code(g)
    C = native(g)
    nbytes = C.weighted_row_sum_workspace_bytes(B, p, dt)
    ws, ws_ptr = workspace(g, nbytes)
    C.launch_weighted_row_sum_noise(ptr(g), B, p, dt, ptr(factors), float(noise_std),
                                     float(inv_denom), int(seed), int(offset), ptr(out),
                                     ws_ptr, nbytes, stream(g))


def linear_sq_norms(a, g, bias, sq, accumulate):
    B, T, d = a.shape
    K = g.shape[2]
    native(a).launch_linear_sq_norms(ptr(a), ptr(g), B, T, d, K, dtype_code(a), bool(bias), ptr(sq),
                              bool(accumulate), stream(a))


def clipped_linear_sum(a, g, factors, noise_std, inv_denom, seed, offset, gw, gb, matmul=None):
    # ``matmul`` is the CPU path's BLAS hook; the CUDA launcher has its own GEMM.
    B, T, d = a.shape
    K = g.shape[2]
    dt = dtype_code(a)
    # The workspace lets the GEMM split the B*T reduction over many blocks
    # (slab partials, no atomics): a K x d output alone would fill few SMs.
    C = native(a)
    nbytes = C.clipped_linear_sum_workspace_bytes(B, T, d, K, dt)
    ws, ws_ptr = workspace(a, nbytes)
    C.launch_clipped_linear_sum(ptr(a), ptr(g), ptr(factors), B, T, d, K, dt,
                                 float(noise_std), float(inv_denom), int(seed), int(offset),
                                 ptr(gw), opt_ptr(gb), stream(a), ws_ptr, nbytes)
