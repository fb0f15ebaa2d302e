"""Hadamard-product NTK Gram on the CPU (DESIGN.md kernel 3), by blocks.

K[I, J] = sum_l (F_l[I] F2_l[J]^T) o (B_l[I] B2_l[J]^T) for row blocks I, J:
two GEMMs per term and block (the caller library's BLAS), multiplied and
accumulated in place by numba, so the extra memory is O(block^2) however large
n is.  With x2 = x only blocks J >= I are computed and mirrored, which halves
the work and makes K exactly symmetric.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ._dispatch import sized_kernel

# Largest rows per block: 3 block^2 float64 buffers of 8 MB each at 1024.
BLOCK = 1024


def block_rows(n):
    """Block size: small enough that the symmetric case skips a real share of the
    blocks (3 of 4 at n = 2 blocks), large enough for efficient GEMMs."""
    return max(128, min(BLOCK, -(-n // 4)))


@sized_kernel(lambda acc, p, q: acc.size, fastmath={"contract"})
def hadamard_accumulate(acc, p, q):
    """acc += p * q elementwise (all [r, c], acc possibly float64)."""
    for i in prange(acc.shape[0]):
        for j in range(acc.shape[1]):
            acc[i, j] += p[i, j] * q[i, j]


@njit(cache=True)
def _mirror_diagonal_block(blk):
    """Upper triangle of a square diagonal block copied to its lower triangle, so
    the block is symmetric bit for bit (its two halves were computed by
    different summation orders inside BLAS)."""
    for i in range(blk.shape[0]):
        for j in range(i):
            blk[i, j] = blk[j, i]


def hadamard_gram(f, b, f2, b2, out, symmetric, matmul=np.matmul, accumulate_f64=False,
                  accumulate=False):
    """out [n, n2] = sum_l (f[l] f2[l]^T) o (b[l] b2[l]^T); ``f[l] is None`` means a
    constant-1 factor (bias terms).  Arrays are NumPy, C-contiguous.  With
    ``accumulate`` the sum is added to ``out`` (the caller streams terms one
    layer at a time; the arithmetic, and so the result, is the same)."""
    n, n2 = out.shape
    acc_dtype = np.float64 if accumulate_f64 else out.dtype
    step = block_rows(max(n, n2))
    for i0 in range(0, n, step):
        i1 = min(n, i0 + step)
        for j0 in range(i0 if symmetric else 0, n2, step):
            j1 = min(n2, j0 + step)
            acc = (out[i0:i1, j0:j1].astype(acc_dtype) if accumulate else
                   np.zeros((i1 - i0, j1 - j0), dtype=acc_dtype))
            q = np.empty((i1 - i0, j1 - j0), dtype=out.dtype)
            p = np.empty_like(q)
            for fl, bl, f2l, b2l in zip(f, b, f2, b2):
                matmul(bl[i0:i1], b2l[j0:j1].T, out=q)
                if fl is None:
                    acc += q
                    continue
                matmul(fl[i0:i1], f2l[j0:j1].T, out=p)
                hadamard_accumulate(acc, p, q)
            if symmetric and i0 == j0:
                _mirror_diagonal_block(acc)
            out[i0:i1, j0:j1] = acc
            if symmetric and j0 != i0:
                out[j0:j1, i0:i1] = acc.T
