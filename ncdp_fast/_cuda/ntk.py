"""Hadamard-product NTK Gram on CUDA: the signature of ``_numba.ntk.hadamard_gram``.

The Gram is matrix products, so on a device it goes to the vendor's GEMM
(issue 36): the hand-written tiled kernel (``tiled_kernel_gram``, kept as the
benchmark's peer until a GPU run has measured both) ran at 24 of the H200's 51
measured float32 TFLOP/s, 1.13x the plain torch composition, because it did
its products on CUDA cores.  The GEMM route computes the Gram in row strips:
with x2 = x only the columns at and right of a strip's diagonal block, about
half the products of the plain composition (bench/report.py predicts its time
beside each row of bench_ntk).
"""
from __future__ import annotations

from .. import _arrays
from ._common import dtype_code, ieee_float32_matmul, native, opt_ptr, ptr, stream  # noqa: F401

# Rows of one strip: GEMMs of 1024 x n2 x width still run near the GEMM peak,
# and with x2 = x the strips skip (R - 1) / 2R of the products for R strips.
STRIP_ROWS = 1024
# The strip's two product temporaries stay within this budget (rows shrink when
# n2 is large; one row at least).
GEMM_CHUNK_BYTES = _arrays.CHUNK_BYTES


def _strips(n, n2, itemsize):
    budget = min(GEMM_CHUNK_BYTES, STRIP_ROWS * 2 * n2 * itemsize)
    return _arrays.sample_chunks(n, 2 * n2 * itemsize, budget)


def hadamard_gram(f, b, f2, b2, out, symmetric, matmul=None, accumulate_f64=False,
                  accumulate=False):
    """out [n, n2] (=|+=) sum_l (f[l] f2[l]^T) o (b[l] b2[l]^T), by GEMMs on out's device.

    f[l] (n, a_l) or None (a constant-1 factor: the term is b b2^T), f2[l]
    (n2, a_l) or None exactly where f[l] is; b[l] (n, c_l), b2[l] (n2, c_l):
    torch tensors of one float dtype on one device (any torch device: CI runs
    this on CPU tensors).  out: (n, n2) float32/float64 tensor, square when
    ``symmetric`` (the pairs are (t, t)): then only strips' columns at and right
    of their diagonal are computed and mirrored, so out is exactly symmetric.
    ``accumulate_f64``: the products and the sum in float64 (float32 factors
    upcast exactly); otherwise products in the factors' dtype, the sum in out's
    (as the numba twin).  ``matmul`` is the CPU twin's BLAS hook, unused here.
    TF32 is off for the call.
    """
    import torch
    check_constant_one(f, f2)
    n, n2 = out.shape
    if n == 0 or n2 == 0:
        return
    acc_dtype = torch.float64 if accumulate_f64 else out.dtype
    acc = out if out.dtype == acc_dtype else (
        out.to(acc_dtype) if accumulate else torch.zeros_like(out, dtype=acc_dtype))
    if acc is out and not accumulate:
        out.zero_()
    gemm_dtype = torch.float64 if accumulate_f64 else b[0].dtype
    with ieee_float32_matmul():
        strips = _strips(n, n2, gemm_dtype.itemsize)
        for fl, bl, f2l, b2l in zip(f, b, f2, b2):
            # One layer's factors upcast at a time (float64 route): exact, and
            # the upcast copy of every layer never exists at once.
            bl, b2l = bl.to(gemm_dtype), (bl if symmetric else b2l).to(gemm_dtype)
            if fl is not None:
                fl, f2l = fl.to(gemm_dtype), (fl if symmetric else f2l).to(gemm_dtype)
            for lo, hi in strips:
                c0 = lo if symmetric else 0
                region = acc[lo:hi, c0:]
                if fl is None and acc.dtype == gemm_dtype:
                    # beta = 1: cuBLAS adds the product into the strip in place.
                    region.addmm_(bl[lo:hi], b2l[c0:].T)
                elif fl is None:
                    region += bl[lo:hi] @ b2l[c0:].T
                else:
                    region.addcmul_(fl[lo:hi] @ f2l[c0:].T, bl[lo:hi] @ b2l[c0:].T)
    if symmetric:
        for lo, hi in strips:
            # The diagonal block's two triangles came from different summation
            # orders inside the GEMM: the upper one is kept, so K == K^T bit for bit.
            blk = acc[lo:hi, lo:hi]
            blk.copy_(torch.triu(blk) + torch.triu(blk, 1).T)
            acc[hi:, lo:hi] = acc[lo:hi, hi:].T
    if acc is not out:
        out.copy_(acc)


def check_constant_one(f, f2):
    """f2[l] is None exactly where f[l] is (the constant-1 factor of a bias term)."""
    for l, (x, y) in enumerate(zip(f, f2)):
        if (x is None) != (y is None):
            raise ValueError(f"f2[{l}]: expected None exactly where f[{l}] is None (the "
                             f"constant-1 factor), got {'None' if y is None else 'an array'} "
                             f"with f[{l}] {'None' if x is None else 'an array'}")


def gram_term_args(f, b, f2, b2) -> dict:
    """The per-term keyword arguments of ``_C.launch_hadamard_gram``.

    Term l: ``f[l]`` (n, a_l) or None for the constant-1 factor of a bias term,
    ``f2[l]`` (n2, a_l), None exactly where ``f[l]`` is, ``b[l]`` (n, b_l),
    ``b2[l]`` (n2, b_l); C-contiguous CUDA arrays of one float dtype.
    Returns lists of L entries: ``f``, ``f2``, ``b_ptrs``, ``b2_ptrs`` (device
    pointers, int), ``a``, ``b`` (widths, int) and ``constant_one`` (bool).
    """
    check_constant_one(f, f2)
    # The constant-1 factor is flagged, not inferred from a null pointer: torch
    # also gives a real F of width 0 (a term that adds zero) data pointer 0.
    return {"f": [opt_ptr(x) for x in f],
            "a": [0 if x is None else int(x.shape[1]) for x in f],
            "constant_one": [x is None for x in f],
            "b_ptrs": [ptr(x) for x in b],
            "b": [int(x.shape[1]) for x in b],
            "f2": [opt_ptr(x) for x in f2],
            "b2_ptrs": [ptr(x) for x in b2]}


def tiled_kernel_gram(f, b, f2, b2, out, symmetric, accumulate_f64=False):
    """The hand-written tiled CUDA kernel (csrc/ntk), one launch over all terms:
    the arguments of :func:`hadamard_gram` as C-contiguous CUDA arrays, out
    overwritten.  The benchmarks' peer of the GEMM route."""
    n, n2 = out.shape
    native(out).launch_hadamard_gram(**gram_term_args(f, b, f2, b2), n=n, n2=n2,
                            dtype=dtype_code(b[0]), symmetric=bool(symmetric),
                            accumulate_f64=bool(accumulate_f64), out=ptr(out),
                            out_dtype=dtype_code(out), stream=stream(out))
