"""The smallest eigenvalue of a row-sharded NTK Gram (:func:`lambda_min`): block
Lanczos with full re-orthogonalisation on vectors sharded like K's rows (the
method: :mod:`ncdp_fast.distributed.ntk`)."""
from __future__ import annotations

import math
import warnings

import numpy as np

from .. import _arrays
from .._validate import check_pos_int, check_positive, check_uint64
from ._group import resolve_group
from ._ntk_comm import _Comm, _agree_on_arguments, _row_counts
from ._ntk_gram import ntk_gram

def _orthonormal_block(Z, V, comm, fresh, step, first_pass=None):
    """Z (n_r, c) made orthonormal over all ranks and orthogonal to V (n_r, k):
    two passes of classical Gram-Schmidt against V (the first with the summed
    coefficients ``first_pass`` = V^T Z when the caller has them already), then
    Z (Z^T Z)^(-1/2) on the kept directions (eigenvalues of the Gram above
    (1e-10 |Z|)^2), twice; directions lost (an invariant subspace) are replaced by
    ``fresh(m)`` rows of new random vectors, treated the same way."""
    c = Z.shape[1]
    kept = np.empty((Z.shape[0], 0))
    for _ in range(4):
        scale = math.sqrt(max(float(np.max(np.diag(comm.allsum(Z.T @ Z, step)))), 0.0))
        basis = np.hstack([V, kept]) if kept.shape[1] else V
        for p in range(2):
            if basis.shape[1]:
                coeffs = first_pass if p == 0 and first_pass is not None else \
                    comm.allsum(basis.T @ Z, step)
                Z = Z - basis @ coeffs
        first_pass = None
        for rep in range(2):
            if Z.shape[1] == 0:
                break
            w, U = np.linalg.eigh(comm.allsum(Z.T @ Z, step))
            keep = w > (1e-10 * scale) ** 2 if rep == 0 else w > 0
            Z = Z @ (U[:, keep] / np.sqrt(w[keep]))
        kept = np.hstack([kept, Z])
        if kept.shape[1] >= c:
            return kept[:, :c]
        Z = fresh(c - kept.shape[1])
    raise np.linalg.LinAlgError(f"{comm.what}: could not extend the Krylov basis "
                                "(random vectors kept falling into it)")


def _smallest_ritz_pair(ab):
    """Smallest eigenpair of the symmetric band matrix in LAPACK's lower band storage
    ``ab`` (ab[d, j] = H[j + d, j]; O(k^2 band) instead of O(k^3) for a dense H).
    With full re-orthogonalisation H = V^T K V is block tridiagonal (bandwidth
    2 block - 1) up to rounding and to the deficiency tolerance of a restarted block,
    so its band gives the Ritz pair up to that; the residual that stops the iteration
    is computed from K V itself, whatever the truncation did."""
    from scipy.linalg import LinAlgError, eig_banded, solveh_banded
    k = ab.shape[1]
    ab = ab[:min(ab.shape[0], k)]
    theta = float(eig_banded(ab, lower=True, eigvals_only=True, select="i",
                             select_range=(0, 0), check_finite=False)[0])
    # The vector by inverse iteration on the band, shifted just below theta so that
    # H - shift I is positive definite (banded Cholesky, O(k band^2)); LAPACK's
    # vectors of a band matrix cost O(k^3) (the reduction's Q is formed).
    scale = max(float(np.abs(ab).max()), np.finfo(np.float64).tiny)
    delta = 1e-12 * scale
    y = np.ones(k) / math.sqrt(k)
    for _ in range(8):
        shifted = ab.copy()
        shifted[0] -= theta - delta
        try:
            for _ in range(3):
                y = solveh_banded(shifted, y, lower=True, check_finite=False)
                y /= np.linalg.norm(y)
            return theta, y
        except LinAlgError:
            delta *= 100.0
    w, S = eig_banded(ab, lower=True, select="i", select_range=(0, 0), check_finite=False)
    return float(w[0]), S[:, 0]


def _block_lanczos(apply_rows, comm, counts, *, block, tol, max_blocks, seed):
    """Smallest eigenpair of the symmetric K whose rows are sharded by ``counts``;
    ``apply_rows(Q)`` = this rank's rows of K times Q (n, c), float64.

    Block Lanczos on K with full re-orthogonalisation.  Every vector is sharded like
    K's rows; the start block is the rows [lo, hi) of an (n, block) standard normal
    matrix drawn from ``numpy.random.default_rng(seed)`` (the same matrix on every
    rank: a public start, linear algebra, not a privacy draw).  After each block the
    smallest Ritz pair (theta, u) of the projected matrix H = V^T K V is computed
    from its band (kept in band storage, (2 block) x k numbers, never k x k;
    identical on every rank: H is reduced in rank order) and the iteration stops
    when ||K u - theta u|| <= tol * knorm, knorm the largest Ritz value of K seen so
    far (<= ||K||_2), or when |theta| <= n eps knorm (K singular to working
    precision); the check runs after every block at first, then every ~steps/8
    blocks.  Rank 0's decision is broadcast.

    Returns (theta_rq, residual, u_rows, steps, converged): the Rayleigh quotient
    u^T K u of the unit Ritz vector, ||K u - theta_rq u||, this rank's rows of u.
    """
    rank, n = comm.rank, sum(counts)
    lo = sum(counts[:rank])
    n_r = counts[rank]
    b = min(block, n)
    rng = np.random.default_rng(seed)

    def fresh(m):
        return rng.standard_normal((n, m))[lo:lo + n_r]

    cap = min(n, max_blocks * b)
    band = 2 * b - 1
    V = np.empty((n_r, cap))
    AV = np.empty((n_r, cap))
    ab = np.zeros((band + 1, cap))        # H = V^T K V in lower band storage
    Q = _orthonormal_block(fresh(b), V[:, :0], comm, fresh, "start block")
    k, knorm, steps, converged, next_check = 0, 0.0, 0, False, 1
    eps = np.finfo(np.float64).eps
    while True:
        steps += 1
        c = Q.shape[1]
        V[:, k:k + c] = Q
        AQ = apply_rows(comm.allgather_rows(Q, counts, "Lanczos block"))
        AV[:, k:k + c] = AQ
        C = comm.allsum(V[:, :k + c].T @ AQ, "projection")   # H[:k + c, k:k + c]
        D = 0.5 * (C[k:] + C[k:].T)                          # the new diagonal block
        for p in range(c):                                   # row k + p of H, in the band
            row = k + p
            j0 = max(0, row - band)
            js = np.arange(j0, row + 1)
            ab[row - js, js] = np.concatenate([C[j0:k, p], D[max(0, j0 - k):p + 1, p]])
        knorm = max(knorm, float(np.linalg.eigvalsh(D)[-1]))
        k += c
        if steps >= next_check or k >= cap:
            # The Ritz pair and its residual every step at first, then every ~steps/8
            # steps (each check costs O(k^2 block) + O(n_r k) against O(n_r k block)
            # for the step itself): at most ~12 % more steps than checking always.
            next_check = steps + max(1, steps // 8)
            theta, y = _smallest_ritz_pair(ab[:, :k])
            R = AV[:, :k] @ y - theta * (V[:, :k] @ y)
            r = math.sqrt(float(comm.allsum(np.array([R @ R]), "residual")[0]))
            done = r <= tol * knorm or abs(theta) <= n * eps * knorm
            if comm.agree(done, "stop decision"):
                converged = True
                break
        if k >= cap:
            break
        c_next = min(b, cap - k)
        # C = V[:, :k]^T AQ (summed over ranks) is the first Gram-Schmidt pass's
        # coefficients for the next block.
        Q = _orthonormal_block(AQ[:, :c_next], V[:, :k], comm, fresh, "re-orthogonalisation",
                               first_pass=C[:, :c_next])
    u = V[:, :k] @ y
    u /= math.sqrt(float(comm.allsum(np.array([u @ u]), "norm")[0]))
    Ku = apply_rows(comm.allgather_rows(u[:, None], counts, "Rayleigh quotient")[:, 0:1])[:, 0]
    value = float(comm.allsum(np.array([u @ Ku]), "Rayleigh quotient")[0])
    res = Ku - value * u
    residual = math.sqrt(float(comm.allsum(np.array([res @ res]), "residual")[0]))
    # Rank 0's numbers, on every rank (identical already when every rank runs the
    # same LAPACK; this makes it so on heterogeneous machines too).
    value, residual = comm.bcast(np.array([value, residual]), 0, "result")
    return float(value), float(residual), u, steps, converged


def _row_product(K_rows):
    """Q (n, c) float64 -> K_rows @ Q in float64; float32 rows are promoted in chunks
    of about 2^22 entries, so no float64 copy of the rows is kept."""
    if K_rows.dtype == np.float64:
        return lambda Q: K_rows @ Q
    step = max(1, (1 << 22) // max(1, K_rows.shape[1]))

    def apply(Q):
        out = np.empty((K_rows.shape[0], Q.shape[1]))
        for i in range(0, K_rows.shape[0], step):
            out[i:i + step] = K_rows[i:i + step].astype(np.float64) @ Q
        return out
    return apply


def lambda_min(K_rows=None, *, x=None, weights=None, group=None, tol=1e-10, block=16,
               maxiter=None, seed=0, stats=None, **network):
    """Smallest eigenvalue of a row-sharded NTK Gram, in float64, the same on every rank.

    Either ``K_rows`` -- this rank's rows of a symmetric K, (n_r, n) float32/float64
    NumPy or torch CPU, the ranks' rows stacking in rank order to the n x n matrix
    (as :func:`ntk_gram` returns them) -- or ``x`` and ``weights`` (plus the keyword
    arguments of :func:`ntk_gram`: biases, activation, parameterization, replicated),
    whose sharded Gram is formed in float64 first, as ``ncdp_fast.ntk.lambda_min``
    does in one process.

    Solver: block Lanczos on K with full re-orthogonalisation (``block`` vectors per
    step, at most ``maxiter`` steps, default ceil(n / block): the whole space, where
    the Ritz value is exact); each step multiplies the rows by the all-gathered block
    (n x block numbers per rank) and sums (k x block) projections over the ranks.
    NTK spectra are dense at the bottom, so the Krylov dimension k it needs is a large
    fraction of n (measured: 1632 of 2000, 2592 of 4000 for a two-layer ReLU NTK, d =
    64, width 1024, x on the sphere); memory per rank is then 2 n_r k float64 (the
    basis and K times it, at most twice the float64 rows) and work O(n_r n k + n_r k^2)
    per rank.  Stopping rule: the Ritz residual ||K u - theta u|| <= tol * knorm
    (knorm: the largest Ritz value seen, a lower bound of ||K||_2), or |theta| <=
    n eps knorm (K singular to working precision).  Then some eigenvalue of K lies
    within ``residual`` of the returned value and lambda_min <= value (a Rayleigh
    quotient); with a gap delta to the next eigenvalue the error is at most
    residual^2 / delta.  Without convergence
    a RuntimeWarning says so and the value is an upper bound.  The start block is
    drawn from ``numpy.random.default_rng(seed)`` (public: linear algebra, not a
    privacy draw), identical on every rank; every reduction sums the ranks' parts
    in rank order and rank 0's result is broadcast, so all ranks return the same
    bits.  With W = 1 (no group) this is the same solver in one process.

    Returns ``ncdp_fast.ntk.EigResult`` (value, residual) with ``.vector`` this
    rank's rows of the unit eigenvector (float64, (n_r,)) and ``.method``
    "block-lanczos (W ranks)"; ``stats`` (a dict, optional) gets ``steps``,
    ``converged``, ``krylov_dim`` and the communication counts of the solver.
    """
    from ..ntk import EigResult
    group = resolve_group(group)
    what = "ncdp_fast.distributed.lambda_min"
    comm = _Comm(group, what)
    if (K_rows is None) == (x is None):
        raise ValueError("lambda_min: give either K_rows or x (with weights), not both or "
                         "neither")
    gram_stats = None
    if x is not None:
        if weights is None:
            raise ValueError("weights: required with x")
        # In float64, as the one-process lambda_min; what cannot be converted goes to
        # ntk_gram as it came, whose checks agree with the other ranks before raising.
        try:
            x = np.asarray(_arrays.to_host(x, "x"), dtype=np.float64)
            weights = [np.asarray(_arrays.to_host(w, f"weights[{l}]"), dtype=np.float64)
                       for l, w in enumerate(weights)]
            if network.get("biases") is not None:
                network["biases"] = [None if b is None else
                                     np.asarray(_arrays.to_host(b, "biases"), np.float64)
                                     for b in network["biases"]]
        except (TypeError, ValueError):
            pass
        gram_stats = {}
        K_rows = ntk_gram(x, weights, group=group, stats=gram_stats, **network)
    elif network:
        raise TypeError(f"lambda_min: {sorted(network)} only go with x and weights")
    error, config = None, {}
    try:
        if stats is not None and not isinstance(stats, dict):
            raise TypeError(f"stats: expected None or a dict, got {type(stats).__name__}")
        tol = check_positive(tol, "tol")
        block = check_pos_int(block, "block")
        seed = check_uint64(seed, "seed")
        if maxiter is not None:
            maxiter = check_pos_int(maxiter, "maxiter")
        K_rows = _arrays.to_host(K_rows, "K_rows")
        if K_rows.ndim != 2 or K_rows.dtype not in (np.float32, np.float64):
            raise ValueError(f"K_rows: expected a float32/float64 (n_r, n) block of rows, got "
                             f"shape {K_rows.shape} dtype {K_rows.dtype}")
        config = dict(n=K_rows.shape[1], dtype=K_rows.dtype.name, tol=tol, block=block,
                      maxiter=maxiter, seed=seed)
    except (TypeError, ValueError) as e:
        error = e
    try:
        _agree_on_arguments(comm, config, error, what)
    finally:
        # A raised error's traceback holds this frame, which would hold the error:
        # a cycle keeping the group alive past destroy_process_group (GroupRef).
        error = None
    n = K_rows.shape[1]
    counts = _row_counts(comm, K_rows.shape[0])
    if sum(counts) != n:
        raise ValueError(f"K_rows: expected the ranks' rows to stack to a square matrix: "
                         f"{n} columns but rows {counts} (sum {sum(counts)}) on the "
                         f"{comm.world} ranks")
    if n == 0:
        raise ValueError("K_rows: expected n >= 1")
    b = min(block, n)
    max_blocks = maxiter or -(-n // b)
    K_rows = np.ascontiguousarray(K_rows)
    value, residual, u, steps, converged = _block_lanczos(
        _row_product(K_rows), comm, counts, block=b, tol=tol, max_blocks=max_blocks,
        seed=seed)
    if not converged:
        warnings.warn(f"{what}: block Lanczos stopped after {steps} blocks of {b} without "
                      f"reaching tol={tol:g}; the value is an upper bound (see the residual)",
                      RuntimeWarning, stacklevel=2)
    if stats is not None:
        stats.update(comm.stats(), steps=steps, converged=converged,
                     krylov_dim=min(steps * b, n))
        if gram_stats is not None:
            stats["gram"] = gram_stats
    return EigResult(value, residual, u, f"block-lanczos ({comm.world} ranks)")
