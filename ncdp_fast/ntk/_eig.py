"""Smallest eigenvalue of a large dense SPD matrix: block Lanczos on its inverse.

Why not ARPACK in shift-invert mode: NTK spectra cluster at the bottom (at
n = 3000 the 12 smallest eigenvalues of a two-layer ReLU NTK lie within 3 % of
each other), so single-vector Lanczos needs ~100+ solves, and each solve with
the Cholesky factor is a memory-bound pass over n^2 doubles (3.2 GB at
n = 20000).  A block of ``b`` right-hand sides costs about the same wall time
as one (dtrsm instead of dtrsv: the factor is read once for all ``b``), and a
block Krylov space of block size >= the cluster resolves the cluster in a few
dozen block steps (convergence of block Lanczos depends on the gap between the
wanted eigenvalue and the (b+1)-th, Saad, "Numerical Methods for Large
Eigenvalue Problems", ch. 6).
"""
from __future__ import annotations

import warnings

import numpy as np


def cholesky_solver(K, tau):
    """(solve, release) for K + tau I = L L^T, with ``solve(X)`` = (K + tau I)^-1 X
    for X (n,) or (n, b) float64.

    Uses torch's LAPACK (MKL in the CPU wheels) when torch is installed: the
    multithreaded dpotrf of the OpenBLAS bundled with NumPy/SciPy 2.x crashed
    (SIGSEGV) at n = 20000 on this project's machines.  Raises
    ``np.linalg.LinAlgError`` when K + tau I is not numerically positive definite.
    """
    try:
        import torch
    except ImportError:
        from scipy.linalg import cho_factor, cho_solve
        A = K.copy()
        A[np.diag_indices(K.shape[0])] += tau
        factor = cho_factor(A, lower=True, overwrite_a=True)
        return lambda X: cho_solve(factor, X)
    A = torch.from_numpy(K).clone()
    A.diagonal().add_(tau)
    L, info = torch.linalg.cholesky_ex(A, out=(A, torch.empty((), dtype=torch.int32)))
    if int(info) != 0:
        raise np.linalg.LinAlgError(f"K + {tau:.3g} I is not positive definite "
                                    f"(leading minor {int(info)})")

    from scipy.linalg import solve_triangular
    # The row-major L seen column-major is U = L^T, upper triangular and already in
    # LAPACK's layout, so the two dtrsm calls read the factor in place.
    # torch.cholesky_solve took 4.8 s per 32-column block at n = 20000 (it re-lays
    # the 3.2 GB factor out on every call); these take ~0.8 s.
    U = L.numpy().T

    def solve(X):
        Y = solve_triangular(U, X, trans="T", lower=False, check_finite=False)
        return solve_triangular(U, Y, lower=False, check_finite=False, overwrite_b=True)
    return solve


def smallest_by_block_lanczos(solve, matvec, n, *, tau=0.0, block=32, tol=1e-10,
                              max_blocks=None, seed=0):
    """Smallest eigenpair of SPD K given ``solve`` = (K + tau I)^-1 on blocks.

    Block Lanczos with full re-orthogonalisation on A = (K + tau I)^-1: the
    largest Ritz value mu of A gives lambda = 1/mu - tau.  Stops when the Ritz
    residual ||A u - mu u|| <= tol * mu (an eigenvalue error of at most about
    tol * lambda, Kato-Temple), or when lambda is zero to working precision
    (|lambda| below n eps ||K||: a numerically singular K, e.g. fewer
    parameters than samples).  The start block is random with a fixed seed:
    this is linear algebra on a matrix already computed, not a privacy draw.

    Returns (lambda, u, steps, converged); lambda is the Rayleigh quotient
    u^T K u computed with ``matvec`` (one extra pass over K).
    """
    from scipy.linalg import eigh
    b = max(1, min(block, n))
    # ceil: a last partial block completes the space (n // b left 32 < n < 64
    # at the random start block alone: lambda 165x to 53 000x too large).
    max_blocks = max_blocks or max(2, min(-(-n // b), 200))
    rng = np.random.default_rng(seed)
    Q, _ = np.linalg.qr(rng.standard_normal((n, b)))
    V = np.empty((n, (max_blocks + 1) * b))         # orthonormal Krylov basis
    AV = np.empty_like(V)                           # A applied to each basis block
    H = np.zeros(((max_blocks + 1) * b,) * 2)       # V^T A V, grown by one block a step
    k, mu, u, converged, steps = 0, None, None, False, 0
    knorm = None
    for steps in range(1, max_blocks + 1):
        w = Q.shape[1]                              # this block's width (b, or the last's)
        V[:, k:k + w] = Q
        AV[:, k:k + w] = solve(Q)
        k += w
        Vk, AVk = V[:, :k], AV[:, :k]
        H[:k, k - w:k] = Vk.T @ AVk[:, k - w:]
        H[k - w:k, :k] = H[:k, k - w:k].T
        Hk = H[:k, :k]
        Hk[k - w:, k - w:] = 0.5 * (Hk[k - w:, k - w:] + Hk[k - w:, k - w:].T)
        theta, S = eigh(Hk, subset_by_index=[k - 1, k - 1])    # the top Ritz pair only
        mu = float(theta[0])
        y = S[:, 0]
        u = Vk @ y
        r = np.linalg.norm(AVk @ y - mu * u)
        if knorm is None:
            # ||K||_2 >= the largest Ritz value of K on the first block.
            Kq = matvec(V[:, :b])
            knorm = float(np.linalg.eigvalsh(V[:, :b].T @ Kq)[-1])
        lam = 1.0 / mu - tau
        if r <= tol * mu or abs(lam) <= n * np.finfo(np.float64).eps * knorm or k == n:
            converged = True                        # k == n: the Ritz pair is exact
            break
        nxt = min(b, n - k, V.shape[1] - k)
        if nxt == 0:
            break
        # Next block: A times the newest block, orthogonalised twice against the basis.
        Z = AV[:, k - w:k][:, :nxt].copy()
        for _ in range(2):
            Z -= Vk @ (Vk.T @ Z)
        Q, R = np.linalg.qr(Z)
        if np.abs(np.diag(R)).min() <= 1e-12 * max(1.0, np.abs(np.diag(R)).max()):
            # Invariant subspace (or lost rank): restart the deficient columns randomly.
            Z = rng.standard_normal((n, nxt))
            for _ in range(2):
                Z -= Vk @ (Vk.T @ Z)
            Q, _ = np.linalg.qr(Z)
    u = u / np.linalg.norm(u)
    if not converged:
        warnings.warn(f"lambda_min: block Lanczos stopped after {steps} blocks of {b} without "
                      f"reaching tol={tol:g}; the value is an upper bound (see the residual)",
                      RuntimeWarning, stacklevel=3)
    return float(u @ matvec(u)), u, steps, converged
