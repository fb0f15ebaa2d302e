"""Hadamard-product NTK Gram on CUDA: the signature of ``_numba.ntk.hadamard_gram``."""
from __future__ import annotations

from ._common import dtype_code, native, opt_ptr, ptr, stream


def gram_term_args(f, b, f2, b2) -> dict:
    """The per-term keyword arguments of ``_C.launch_hadamard_gram``.

    Term l: ``f[l]`` (n, a_l) or None for the constant-1 factor of a bias term,
    ``f2[l]`` (n2, a_l), None exactly where ``f[l]`` is, ``b[l]`` (n, b_l),
    ``b2[l]`` (n2, b_l); C-contiguous CUDA arrays of one float dtype.
    Returns lists of L entries: ``f``, ``f2``, ``b_ptrs``, ``b2_ptrs`` (device
    pointers, int), ``a``, ``b`` (widths, int) and ``constant_one`` (bool).
    """
    for l, (x, y) in enumerate(zip(f, f2)):
        if (x is None) != (y is None):
            raise ValueError(f"f2[{l}]: expected None exactly where f[{l}] is None (the "
                             f"constant-1 factor), got {'None' if y is None else 'an array'} "
                             f"with f[{l}] {'None' if x is None else 'an array'}")
    # The constant-1 factor is flagged, not inferred from a null pointer: torch
    # also gives a real F of width 0 (a term that adds zero) data pointer 0.
    return {"f": [opt_ptr(x) for x in f],
            "a": [0 if x is None else int(x.shape[1]) for x in f],
            "constant_one": [x is None for x in f],
            "b_ptrs": [ptr(x) for x in b],
            "b": [int(x.shape[1]) for x in b],
            "f2": [opt_ptr(x) for x in f2],
            "b2_ptrs": [ptr(x) for x in b2]}


def hadamard_gram(f, b, f2, b2, out, symmetric, matmul=None, accumulate_f64=False):
    # ``matmul`` is the CPU path's BLAS hook; the CUDA kernel tiles its own products.
    n, n2 = out.shape
    native(out).launch_hadamard_gram(**gram_term_args(f, b, f2, b2), n=n, n2=n2,
                            dtype=dtype_code(b[0]), symmetric=bool(symmetric),
                            accumulate_f64=bool(accumulate_f64), out=ptr(out),
                            out_dtype=dtype_code(out), stream=stream(out))
