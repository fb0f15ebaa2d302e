"""Hadamard-product NTK Gram on CUDA: the signature of ``_numba.ntk.hadamard_gram``.

The Gram is matrix products, so on a device it goes to the vendor's GEMM
(issue 36): the hand-written tiled kernel (``tiled_kernel_gram``, kept as the
benchmark's peer) ran at 24 of the H200's 51 measured float32 TFLOP/s, 1.13x
the plain torch composition, because it did its products on CUDA cores.

A symmetric Gram needs only its upper triangle.  Two plans cover it, and the
one with fewer GEMM waves in :func:`plan_jobs`'s model runs: row strips (each
strip's columns from its diagonal block on) or halving (at each level the
off-diagonal blocks of equal shape as one batched GEMM, then the diagonal
leaves, whole).  Strips end in GEMMs too small to fill the device: at
(16384, 256, 4096, 4) the H200 run of 2026-11-28 measured the strips at
0.208 s, where the FLOPs at the GEMM peak give 0.188 s and the same FLOPs in
the model's waves 0.2005 s (bench/report.py predicted_ntk_s, which predicts
each row's time from the jobs this module runs).
"""
from __future__ import annotations

from .. import _arrays
from ._common import dtype_code, ieee_float32_matmul, native, opt_ptr, ptr, stream  # noqa: F401

# Rows of one strip: of the strips plan, of the cross Gram and of the mirror.
STRIP_ROWS = 1024
# The halving plan's diagonal leaves have at most this many rows.
LEAF_ROWS = 512
# The plans the symmetric Gram chooses from (tests force one).
PLANS = ("strips", "halving")
# The two product temporaries of one GEMM call stay within this budget, as
# two strips of STRIP_ROWS x n2 would (a block or strip is cut into rows when
# larger; one row at least).
GEMM_CHUNK_BYTES = _arrays.CHUNK_BYTES
# The wave model: output tiles of TILE x TILE (cuBLAS's float32 kernels), a
# launch's tiles spread over the device's SMs, a last partial wave costing a
# whole one; SMs of an H200 where the device has none to report (CPU tensors).
TILE = 128
DEFAULT_SMS = 132


def _budget_cells(n2, itemsize):
    """Cells of one product temporary (two are live at once)."""
    return max(1, min(GEMM_CHUNK_BYTES, STRIP_ROWS * 2 * n2 * itemsize) // (2 * itemsize))


def _strips(n, n2, itemsize):
    return _arrays.sample_chunks(n, 2 * n2 * itemsize,
                                 2 * itemsize * _budget_cells(n2, itemsize))


def _level(jobs, n, size, period, shift):
    """Blocks i = 0, 1, ... with rows [i period, + size) and columns
    [i period + shift, + size), clipped to n: the whole ones (a prefix) as one
    batched job, a clipped one on its own."""
    whole, i = 0, 0
    while i * period < n and i * period + shift < n:
        r0, c0 = i * period, i * period + shift
        rows, cols = min(size, n - r0), min(size, n - c0)
        if rows == cols == size:
            whole += 1
        else:
            jobs.append((1, r0, c0, 0, rows, cols))
        i += 1
    if whole:
        jobs.append((whole, 0, shift, period, size, size))


def halving_jobs(n, leaf):
    """Jobs ``(m, r0, c0, period, rows, cols)`` covering each cell (i, j),
    j >= i, of an n x n Gram once (the diagonal leaves' lower halves too): m
    blocks of rows x cols, block i at rows r0 + i period and columns
    c0 + i period.  Leaves of ceil(n / 2^k) <= leaf rows; level j's blocks are
    2^(k-j) leaves wide."""
    k = 0
    while -(-n // 2 ** k) > leaf:
        k += 1
    s0 = -(-n // 2 ** k)
    jobs = []
    for j in range(1, k + 1):
        size = s0 << (k - j)
        _level(jobs, n, size, 2 * size, size)
    _level(jobs, n, s0, s0, 0)
    return jobs


def _chunked(jobs, cap):
    """The jobs cut so that one call's product has at most ``cap`` cells:
    whole blocks first, then a block's rows."""
    out = []
    for m, r0, c0, period, rows, cols in jobs:
        if rows * cols <= cap:
            step = max(1, cap // (rows * cols))
            out += [(min(step, m - i), r0 + i * period, c0 + i * period, period, rows, cols)
                    for i in range(0, m, step)]
        else:
            step = max(1, cap // cols)
            out += [(1, r0 + i * period + lo, c0 + i * period, 0, min(step, rows - lo), cols)
                    for i in range(m) for lo in range(0, rows, step)]
    return out


def waves(jobs, sms=DEFAULT_SMS):
    """The model's cost of a plan: each call's TILE x TILE output tiles in
    waves of ``sms``, a partial wave counted whole (a term's K scales every
    call alike, so waves rank plans)."""
    return sum(-(-m * -(-rows // TILE) * -(-cols // TILE) // sms)
               for m, _, _, _, rows, cols in jobs)


def plan_jobs(n, n2, symmetric, itemsize, sms=DEFAULT_SMS, plans=None):
    """The GEMM calls of a Gram, as chunked jobs (see :func:`halving_jobs`):
    row strips over every column for a cross Gram; for a symmetric one the
    plan of ``plans`` (default :data:`PLANS`) with the fewest waves, strips on
    a tie."""
    cap = _budget_cells(n2, itemsize)
    if not symmetric:
        return _chunked([(1, lo, 0, 0, hi - lo, n2) for lo, hi in _strips(n, n2, itemsize)],
                        cap)
    candidates = {"strips": [(1, lo, lo, 0, hi - lo, n - lo)
                             for lo, hi in _strips(n, n2, itemsize)],
                  "halving": halving_jobs(n, LEAF_ROWS)}
    chosen = [_chunked(candidates[p], cap) for p in (plans or PLANS)]
    return min(chosen, key=lambda jobs: waves(jobs, sms))


def _rows(x, r0, m, period, rows):
    """x[r0 + i period : + rows] for i < m, as an (m, rows, width) view."""
    s0, s1 = x.stride()
    return x.as_strided((m, rows, x.shape[1]), (period * s0, s0, s1),
                        x.storage_offset() + r0 * s0)


def _block(a, m, r0, c0, period, rows, cols):
    """Block i of a job, a[r0 + i period :, c0 + i period :][:rows, :cols], as
    an (m, rows, cols) view."""
    s0, s1 = a.stride()
    return a.as_strided((m, rows, cols), (period * (s0 + s1), s0, s1),
                        a.storage_offset() + r0 * s0 + c0 * s1)


def _device_sms(t):
    import torch
    if t.is_cuda:
        return torch.cuda.get_device_properties(t.device).multi_processor_count
    return DEFAULT_SMS


def hadamard_gram(f, b, f2, b2, out, symmetric, matmul=None, accumulate_f64=False,
                  accumulate=False):
    """out [n, n2] (=|+=) sum_l (f[l] f2[l]^T) o (b[l] b2[l]^T), by GEMMs on out's device.

    f[l] (n, a_l) or None (a constant-1 factor: the term is b b2^T), f2[l]
    (n2, a_l) or None exactly where f[l] is; b[l] (n, c_l), b2[l] (n2, c_l):
    torch tensors of one float dtype on one device (any torch device: CI runs
    this on CPU tensors).  out: (n, n2) float32/float64 tensor, square when
    ``symmetric`` (the pairs are (t, t)): then only the upper triangle is
    computed (the plan of :func:`plan_jobs`) and mirrored, so out is exactly
    symmetric.  ``accumulate_f64``: the products and the sum in float64
    (float32 factors upcast exactly); otherwise products in the factors'
    dtype, the sum in out's (as the numba twin).  ``matmul`` is the CPU twin's
    BLAS hook, unused here.  TF32 is off for the call.
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
        jobs = plan_jobs(n, n2, symmetric, gemm_dtype.itemsize, _device_sms(out))
        for fl, bl, f2l, b2l in zip(f, b, f2, b2):
            # One layer's factors upcast at a time (float64 route): exact, and
            # the upcast copy of every layer never exists at once.
            bl, b2l = bl.to(gemm_dtype), (bl if symmetric else b2l).to(gemm_dtype)
            if fl is not None:
                fl, f2l = fl.to(gemm_dtype), (fl if symmetric else f2l).to(gemm_dtype)
            for m, r0, c0, period, rows, cols in jobs:
                region = _block(acc, m, r0, c0, period, rows, cols)
                q_left = _rows(bl, r0, m, period, rows)
                q_right = _rows(b2l, c0, m, period, cols).transpose(1, 2)
                if fl is None and acc.dtype == gemm_dtype:
                    # beta = 1: cuBLAS adds the product into the blocks in place.
                    region.baddbmm_(q_left, q_right)
                elif fl is None:
                    region += torch.bmm(q_left, q_right)
                else:
                    region.addcmul_(torch.bmm(_rows(fl, r0, m, period, rows),
                                              _rows(f2l, c0, m, period, cols).transpose(1, 2)),
                                    torch.bmm(q_left, q_right))
    if symmetric:
        for lo, hi in _strips(n, n2, acc.dtype.itemsize):
            # The diagonal block's two triangles came from different summation
            # orders inside the GEMMs: the upper one is kept, so K == K^T bit for bit.
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
