"""NTK analysis on top of the Hadamard-product Gram kernel (004_f44587b9249a6ca9.txt).

* :func:`ncdp_fast.ntk_gram` (re-exported here as :func:`gram`): the empirical
  NTK K = J J^T of an MLP without the Jacobian.
* :func:`gram_from_torch`: the same for an ``nn.Sequential`` of ``nn.Linear``
  and supported activation modules.
* :func:`ntk_matvec`: K v without forming K, O(n * #params).
* :func:`lambda_min`: the smallest eigenvalue, the quantity the notes bound
  ("Bounding the smallest eigenvalue of the NTK"), with a residual.
* :func:`rf_gram`: the random-features Gram phi(X V^T) phi(X V^T)^T.
"""
from __future__ import annotations

import numpy as np

from .. import _arrays
from .._ntk import ACTIVATIONS, namespace, activation, check_finite_network, ntk_factors, ntk_gram
from .._validate import check_choice, check_pos_int, check_positive
from .regress import (RF_ACTIVATIONS, NTKRegressor, RandomFeatures, RFRegressor, random_features,
                      sensitivity)
from ._eig import cholesky_solver, smallest_by_block_lanczos

__all__ = ["ACTIVATIONS", "gram", "ntk_gram", "gram_from_torch", "ntk_matvec", "lambda_min",
           "rf_gram", "EigResult", "RF_ACTIVATIONS", "random_features", "RandomFeatures",
           "RFRegressor", "NTKRegressor", "sensitivity"]

gram = ntk_gram

_TORCH_ACTIVATIONS = {"ReLU": "relu", "Tanh": "tanh", "GELU": "gelu", "Softplus": "softplus",
                      "Identity": "identity"}


def _parse_sequential(model):
    """(weights, biases, activation) of Linear / activation / Linear / ... models."""
    from torch import nn
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Sequential of nn.Linear layers (or one "
                        f"nn.Linear), got {type(model).__name__}")
    mods = [m for m in model.modules() if not isinstance(m, nn.Sequential)] \
        if isinstance(model, nn.Sequential) else [model]
    weights, biases, acts = [], [], set()
    expect_linear = True
    for m in mods:
        if isinstance(m, nn.Linear):
            if not expect_linear:
                raise ValueError("gram_from_torch: two nn.Linear layers without an activation "
                                 "between them are not supported; merge them or add Identity")
            weights.append(m.weight.detach())
            biases.append(None if m.bias is None else m.bias.detach())
            expect_linear = False
        elif type(m).__name__ in _TORCH_ACTIVATIONS:
            if expect_linear:
                raise ValueError(f"gram_from_torch: {type(m).__name__} must follow an nn.Linear")
            if type(m).__name__ == "GELU" and getattr(m, "approximate", "none") != "none":
                raise ValueError("gram_from_torch: only the exact GELU (approximate='none')")
            if type(m).__name__ == "Softplus" and m.beta != 1:
                raise ValueError("gram_from_torch: Softplus with beta != 1 is not supported")
            acts.add(_TORCH_ACTIVATIONS[type(m).__name__])
            expect_linear = True
        else:
            raise ValueError(f"gram_from_torch: unsupported module {type(m).__name__}; expected "
                             f"nn.Linear and one of {sorted(_TORCH_ACTIVATIONS)}")
    if not weights or expect_linear:
        raise ValueError("gram_from_torch: the model must start and end with nn.Linear")
    if len(acts) > 1:
        raise ValueError(f"gram_from_torch: one activation for all layers, got {sorted(acts)}")
    return weights, biases, (acts.pop() if acts else "identity")


def gram_from_torch(model, x, x2=None, **kwargs):
    """Empirical NTK of ``model`` (an ``nn.Sequential`` of ``nn.Linear`` with one
    activation type between them, or a single ``nn.Linear``) at x (and x2),
    trace-averaged over outputs; all parameters count, as in J J^T."""
    weights, biases, act = _parse_sequential(model)
    if all(b is None for b in biases):
        biases = None
    return ntk_gram(x, weights, biases=biases, activation=act, x2=x2, **kwargs)


def ntk_matvec(x, weights, v, *, biases=None, activation="relu", parameterization="standard"):
    """K v for K = ntk_gram(x, weights, ...), without forming K.

    (K v)_i = sum_l <f_l,i, (f_l^T diag(v) b_l) b_l,i> over the Gram's factor
    pairs (f, b): per term one (a x b) matrix f^T diag(v) b and a row-wise
    contraction, cost O(n * #params * K_out).  x, v: NumPy (CPU).
    """
    check_choice(parameterization, "parameterization", ("standard", "ntk"))
    check_choice(activation, "activation", ACTIVATIONS)
    x = np.asarray(x)
    if x.ndim != 2 or x.dtype.kind != "f":
        raise ValueError(f"x: expected a float (n, d) array, got shape {x.shape} dtype {x.dtype}")
    v = np.asarray(v, dtype=x.dtype)
    if v.shape != (x.shape[0],):
        raise ValueError(f"v: expected shape ({x.shape[0]},), got {v.shape}")
    weights = [np.asarray(w) for w in weights]
    biases = None if biases is None else [None if b is None else np.asarray(b) for b in biases]
    check_finite_network([("x", x), ("v", v)] + [(f"weights[{i}]", w) for i, w in enumerate(weights)]
                         + [(f"biases[{i}]", b) for i, b in enumerate(biases or ())])
    terms = ntk_factors(x, weights, biases, activation, parameterization, namespace("numpy"),
                        np.matmul)
    return _matvec_terms(terms, v)


def _matvec_terms(terms, v):
    """K v for v (n,) or a block (n, m): LOBPCG passes (n, 1) columns, which
    broadcast against an (n,) sum to (n, n) (the seventh audit's crash)."""
    V = v.reshape(v.shape[0], -1)
    out = np.zeros(V.shape, dtype=np.result_type(v, np.float64))
    for f, b in terms:
        if f is None:
            out += b @ (b.T @ V)
        else:
            for j in range(V.shape[1]):
                M = f.T @ (V[:, j, None] * b)           # (a, b)
                out[:, j] += np.einsum("ia,ia->i", f @ M, b)
    return out.reshape(v.shape)


class EigResult(tuple):
    """(value, residual) with names: value is lambda_min, residual ||K u - value u||
    for the returned unit eigenvector u."""

    def __new__(cls, value, residual, vector, method):
        self = super().__new__(cls, (value, residual))
        self.value, self.residual, self.vector, self.method = value, residual, vector, method
        return self


def lambda_min(K=None, *, x=None, weights=None, method="auto", tol=1e-10, maxiter=None,
               **network):
    """Smallest eigenvalue of an NTK Gram matrix, in float64.

    Either ``K`` (an explicit symmetric matrix) or ``x`` and ``weights`` (plus
    the keyword arguments of :func:`ntk_gram`: biases, activation,
    parameterization).  Methods:

    * "eigh": dense LAPACK (only the smallest pair is computed);
    * "shift-invert": Cholesky of K + tau I (tau = 1e-12 ||K||_inf keeps it
      definite; raised up to n eps ||K||_inf if rounding makes K indefinite)
      and block Lanczos on its inverse (blocks of 32 solves, each block one
      BLAS-3 pass over the factor; see ``ntk/_eig.py`` for why not ARPACK):
      one n^3/3 factorization plus a few dozen block solves; K is formed with
      ntk_gram when only x and weights are given.  A numerically singular K
      (e.g. fewer parameters than samples) returns a value that is zero to
      working precision;
    * "lanczos": matrix-free ARPACK (smallest algebraic, 64 Lanczos vectors) on
      :func:`ntk_matvec` or on K -- memory O(n * #params), but slow to converge
      when the small eigenvalues cluster, as NTK spectra do;
    * "lobpcg": scipy's LOBPCG with a Jacobi preconditioner, matrix-free likewise;
    * "auto": eigh for n <= 4000, else shift-invert.

    Returns an :class:`EigResult` ``(value, residual)`` with ``.vector`` and
    ``.method``; residual = ||K u - value u|| for the unit vector u.
    """
    from scipy.linalg import eigh
    from scipy.sparse.linalg import LinearOperator, eigsh, lobpcg
    if (K is None) == (x is None):
        raise ValueError("lambda_min: give either K or x (with weights), not both or neither")
    terms = None
    if K is not None:
        K = np.asarray(_arrays.to_numpy(K), dtype=np.float64)
        if K.ndim != 2 or K.shape[0] != K.shape[1] or K.shape[0] == 0:
            raise ValueError(f"K: expected a non-empty square matrix, got shape {K.shape}")
        # The sixth audit: a non-symmetric K gave an eigenvalue with residual 1.26.
        if not np.all(np.isfinite(K)) or not np.allclose(
                K, K.T, rtol=0.0, atol=1e-12 * max(float(np.abs(K).max()), 1e-300)):
            raise ValueError("K: expected a finite symmetric matrix (a Gram)")
        n = K.shape[0]
    else:
        if weights is None:
            raise ValueError("weights: required with x")
        x = np.asarray(_arrays.to_numpy(x), dtype=np.float64)
        weights = [np.asarray(_arrays.to_numpy(w), dtype=np.float64) for w in weights]
        if network.get("biases") is not None:
            network["biases"] = [None if b is None else np.asarray(_arrays.to_numpy(b), np.float64)
                                 for b in network["biases"]]
        terms = ntk_factors(x, weights, network.get("biases"), network.get("activation", "relu"),
                            network.get("parameterization", "standard"), namespace("numpy"),
                            np.matmul)
        n = x.shape[0]
    tol = check_positive(tol, "tol")
    if maxiter is not None:
        maxiter = check_pos_int(maxiter, "maxiter")
    if method == "auto":
        method = "eigh" if n <= 4000 else "shift-invert"
    if method in ("eigh", "shift-invert") and K is None:
        K = ntk_gram(x, weights, **network)

    def mv(v):
        return K @ v if K is not None else _matvec_terms(terms, v)

    if method == "eigh":
        w, U = eigh(K, subset_by_index=[0, 0])
        val, vec = float(w[0]), U[:, 0]
    elif method == "shift-invert":
        # ||K||_inf by row blocks: no n x n temporary beyond the one factored copy.
        knorm = max(float(np.abs(K[i:i + 1024]).sum(axis=1).max()) for i in range(0, n, 1024))
        tau = 1e-12 * knorm
        while True:
            try:
                solve = cholesky_solver(K, tau)
                break
            except np.linalg.LinAlgError:
                if tau >= 4 * n * np.finfo(np.float64).eps * knorm:
                    raise
                tau *= 10.0
        val, vec, _, _ = smallest_by_block_lanczos(solve, mv, n, tau=tau, tol=tol,
                                                   max_blocks=maxiter)
    elif method in ("lanczos", "lobpcg"):
        op = LinearOperator((n, n), matvec=mv, dtype=np.float64)
        if method == "lanczos":
            from scipy.sparse.linalg import ArpackNoConvergence
            try:
                w, U = eigsh(op, k=1, which="SA", tol=tol, ncv=min(n, 64),
                             maxiter=maxiter or 100 * n)
            except ArpackNoConvergence as exc:
                # ARPACK's own error named neither the method nor a way out.
                raise RuntimeError(
                    f"lambda_min(method='lanczos'): ARPACK did not converge ({exc}); Krylov "
                    "iterations on K itself are slow when lambda_min is small against ||K||: "
                    "use method='shift-invert' (or 'auto', or a larger tol / maxiter)") from exc
        else:
            diag = np.array([float(K[i, i]) for i in range(n)]) if K is not None else \
                sum((b * b).sum(1) * (1.0 if f is None else (f * f).sum(1)) for f, b in terms)
            precond = LinearOperator((n, n), matvec=lambda v: (v.T / diag).T, dtype=np.float64)
            X0 = np.random.default_rng(0).standard_normal((n, min(n, 16)))
            w, U = lobpcg(op, X0, M=precond, largest=False, tol=tol, maxiter=maxiter or 5000)
            i = int(np.argmin(w))
            w, U = w[i:i + 1], U[:, i:i + 1]
        val, vec = float(w[0]), U[:, 0] / np.linalg.norm(U[:, 0])
    else:
        raise ValueError(f"method: expected 'auto', 'eigh', 'shift-invert', 'lanczos' or "
                         f"'lobpcg', got {method!r}")
    residual = float(np.linalg.norm(mv(vec) - val * vec))
    return EigResult(val, residual, vec, method)


def rf_gram(x, V, activation_name="relu"):
    """Random-features Gram phi(X V^T) phi(X V^T)^T (NumPy or torch, CPU or CUDA).

    x: (n, d); V: (N, d) random weights.  This is the NTK of the second layer
    of f(x) = a^T phi(V x) alone: ntk_gram with weights [V, a] minus the
    first-layer term.
    """
    check_choice(activation_name, "activation_name", ACTIVATIONS)
    is_t = _arrays.is_torch(x)
    ns = namespace("torch" if is_t else "numpy")
    xs, vs = _arrays.shape(x, "x"), _arrays.shape(V, "V")
    if len(xs) != 2:
        raise ValueError(f"x: expected shape (n, d), got {xs}")
    if len(vs) != 2 or vs[1] != xs[1]:
        raise ValueError(f"V: expected shape (N, {xs[1]}), got {vs}")
    check_finite_network([("x", x), ("V", V)])
    Phi, _ = activation(activation_name, x @ V.T, ns)
    return Phi @ Phi.T
