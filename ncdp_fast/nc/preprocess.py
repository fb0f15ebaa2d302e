r"""Centering and PCA for private last-layer fine-tuning (paper ``000_82fe6240ae4b04be``,
Section 4): :class:`Centering` and :class:`PCAProjector`, fitted on *public* data
(``fit(X, public=True)``) or, with an explicit share of the privacy budget, on private
data (``fit_private(X, rho=..., clip=...)``).  Plain ``fit`` without ``public=True`` is
refused, so nothing private is used for free; the zCDP spent is kept in ``rho_`` and
composed into the estimators' accountant by ``fit(..., preprocessing=[...])``
(:mod:`ncdp_fast.train`).
"""
from __future__ import annotations

import math

import numpy as np

from .. import _arrays, _backend, _rng, _stream
from .._clip import clip_and_noise
from .._arrays import to_host
from .._validate import check_features, check_int, check_positive, check_square_sums

__all__ = ["Centering", "PCAProjector"]


_PUBLIC_MSG = ("declare whether X is public data: fit(X, public=True) for data outside the "
               "private training set (the paper's Section 4 fits on public data); for private "
               "data use fit_private(X, rho=..., clip=...), which spends a declared share of the "
               "zCDP budget")


def _check_public(public):
    if public is True:
        return
    if public is None:
        raise ValueError(f"public: {_PUBLIC_MSG}")
    if public is False:
        raise ValueError("public=False: refusing to fit on private data without privacy; use "
                         "fit_private(X, rho=..., clip=...) (a DP estimate whose zCDP cost is "
                         "recorded in rho_ and added by the estimators' accountant)")
    raise TypeError(f"public: expected True (or use fit_private), got {public!r}")


def _like(a, X):
    """A float64 NumPy array ``a`` as X's library, device and dtype."""
    if _arrays.is_torch(X):
        import torch
        return torch.as_tensor(a, dtype=X.dtype, device=X.device)
    return a.astype(np.asarray(X).dtype if np.asarray(X).dtype.kind == "f" else np.float64,
                    copy=False)


class _Preprocessor:
    """Common state: how the object was fitted and what it cost."""

    def __init__(self):
        self.fitted_on_: str | None = None     # "public" or "private"
        self.rho_: float = 0.0                 # zCDP spent on the private data
        self.seed_: int | None = None          # randomized solver of a *public* fit only
        # Draws of the noise stream a private fit used (the key itself is never kept).
        self.offset_: int | None = None
        self.next_offset_: int | None = None

    def _check_fitted(self):
        if self.fitted_on_ is None:
            raise RuntimeError(f"{type(self).__name__}: call fit(X, public=True) or "
                               "fit_private(...) first")

    def _fitted_like(self, X, fitted):
        """``fitted`` ((p, ...) float64, from the fit) in X's library, device and dtype,
        once X is checked to be (n, p)."""
        self._check_fitted()
        n, p = check_features(X)
        if p != fitted.shape[0]:
            raise ValueError(f"X: expected {fitted.shape[0]} features, got {p}")
        return _like(fitted, X)

    @property
    def privacy(self) -> dict:
        """What fitting cost: ``{"fitted_on", "rho"}`` (rho = 0 for public data)."""
        return dict(fitted_on=self.fitted_on_, rho=self.rho_)


class Centering(_Preprocessor):
    r"""Subtract a feature mean (Section 4.2: :math:`\tilde x_i = x_i - \bar x`).

    ``fit(X_public, public=True)`` uses the exact mean of public rows.
    ``fit_private(X, rho=..., clip=...)`` releases a DP mean: the sum of rows clipped
    to L2 norm ``clip`` (:func:`ncdp_fast.clip_and_noise`, sensitivity ``clip``) and the
    row count (sensitivity 1), each with Gaussian noise of multiplier
    :math:`z = 1/\sqrt{\rho}`, so the pair is :math:`1/(2z^2) + 1/(2z^2) = \rho`-zCDP
    (add/remove one; the count is private too).  ``mean_ = noisy_sum /
    max(noisy_count, 1)``.

    Attributes after fitting: ``mean_`` (p,) float64 NumPy, ``fitted_on_``, ``rho_``,
    ``offset_``/``next_offset_`` (the noise draws used; the key is never kept).
    """

    def __init__(self):
        super().__init__()
        self.mean_ = None

    def fit(self, X, *, public=None):
        """Fit on public rows (``public=True`` is required; see the class docstring)."""
        _check_public(public)
        check_features(X)
        Xn = to_host(X, "X", dtype=np.float64)
        self.mean_ = Xn.mean(axis=0)
        self.fitted_on_, self.rho_, self.seed_ = "public", 0.0, None
        return self

    def fit_private(self, X, *, rho, clip, seed=None, offset=None):
        """DP mean of private rows: rho-zCDP (rho > 0), rows clipped to norm ``clip``.
        ``seed``: the noise key -- None (OS), an int or a :class:`ncdp_fast.NoiseStream`
        shared with the rest of the workflow; ``offset``: first draw (None: the next
        unused one).  Takes p + 1 draws; the key is not stored."""
        rho = check_positive(rho, "rho")
        clip = check_positive(clip, "clip")
        n, p = check_features(X)
        stream = _stream.resolve(seed, offset)
        z = 1.0 / math.sqrt(rho)
        # Integers and half precision are widened exactly, as PCAProjector does
        # (float16 reached the clip op, whose error named its own 'grads').
        Xk = X if _arrays.is_torch(X) else np.asarray(X)
        if _arrays.numpy_dtype(Xk) not in _backend.FLOAT_DTYPES:
            Xk = Xk.double() if _arrays.is_torch(Xk) else Xk.astype(np.float64)
        s = clip_and_noise(Xk, max_norm=clip, noise_multiplier=z, seed=stream)
        total = to_host(s.grad, "sum", dtype=np.float64)
        at = stream.take(1)
        count = n + z * float(_rng.gaussian(1, seed=stream.seed, offset=at, dtype=np.float64)[0])
        self.mean_ = total / max(count, 1.0)
        self.fitted_on_, self.rho_, self.seed_ = "private", rho, None
        self.offset_, self.next_offset_ = s.offset, at + 1
        self.noisy_count_ = count
        return self

    def transform(self, X):
        """X - mean_, in X's library, device and dtype."""
        return X - self._fitted_like(X, self.mean_)


def _clipped_rows(X: np.ndarray, clip: float) -> np.ndarray:
    """(m, p) float64 rows scaled by the clip ops' rounding-aware factor
    (reference.clip_factors: min(1, C/b), b a bound on the float64 norm), so
    that each computed row has norm <= ``clip``: min(1, clip/||x||) left 6043
    of 20000 random rows above it, by up to 6.7e-16 relative (the fifth audit;
    Analyze-Gauss's released triangle stayed within clip^2 there)."""
    m, p = X.shape
    sq = np.einsum("ij,ij->i", X, X)
    # A row beyond float64's range would get the factor 0: dropped silently
    # (the sixth audit), where the other private fits refuse it.
    check_square_sums(sq, "X")
    factors, norms = np.empty(m), np.empty(m)
    _backend.host("clip").kernels.clip_factors(sq, None, clip, p, 1, 2.0 ** -53, factors, norms)
    return X * factors[:, None]


class PCAProjector(_Preprocessor):
    r"""Project onto the top ``n_components`` eigenvectors of the second-moment matrix
    :math:`\hat\Sigma = \frac1m\sum_i \hat x_i\hat x_i^T` (Section 4.1; uncentred as in the
    paper -- chain a :class:`Centering` first to centre).

    ``fit(X_public, public=True)``: exact eigenvectors (``eigh`` of the p x p matrix
    when p <= 2048, else a randomized subspace iteration on X with 8 power steps,
    seeded by ``seed``).  ``fit_private(X, rho=..., clip=...)``: Analyze Gauss (Dwork,
    Talwar, Thakurta, Zhang 2014): rows clipped to L2 norm ``clip``,
    :math:`A = \sum_i \tilde x_i\tilde x_i^T + E` with E symmetric, its upper triangle
    i.i.d. :math:`N(0, \sigma^2)`, :math:`\sigma = \mathrm{clip}^2/\sqrt{2\rho}` -- the
    upper triangle of :math:`\tilde x\tilde x^T` has L2 norm at most
    :math:`\|\tilde x\|^2 \le \mathrm{clip}^2`, so the release is rho-zCDP (add/remove
    one); the eigenvectors are post-processing.  Needs p(p+1)/2 noise draws and a p x p
    matrix: p <= 8192.

    Attributes after fitting: ``components_`` (p, k) float64, ``fitted_on_``,
    ``rho_``, ``seed_``.
    """

    _EXACT_MAX = 2048
    _PRIVATE_MAX = 8192

    def __init__(self, n_components):
        super().__init__()
        self.n_components = check_int(n_components, "n_components", 1)
        self.components_ = None

    def _k(self, p):
        if self.n_components > p:
            raise ValueError(f"n_components: expected <= {p} (the feature dimension), got "
                             f"{self.n_components}")
        return self.n_components

    def fit(self, X, *, public=None, seed=None):
        """Fit on public rows (``public=True`` required).  ``seed`` drives the
        randomized solver for p > 2048 (None: OS; kept in ``seed_``)."""
        _check_public(public)
        m, p = check_features(X)
        k = self._k(p)
        Xn = to_host(X, "X", dtype=np.float64)
        self.seed_ = None
        if p <= self._EXACT_MAX:
            w, V = np.linalg.eigh(Xn.T @ Xn / m)
            self.components_ = np.ascontiguousarray(V[:, ::-1][:, :k])
            self.explained_ = w[::-1][:k]
        else:
            self.seed_ = _backend.resolve_seed(seed)
            rng = np.random.Generator(np.random.PCG64(self.seed_))
            Q = np.linalg.qr(Xn.T @ rng.standard_normal((m, min(p, k + 16))))[0]
            for _ in range(8):
                Q = np.linalg.qr(Xn.T @ (Xn @ Q))[0]
            B = Xn @ Q
            w, V = np.linalg.eigh(B.T @ B / m)
            self.components_ = np.ascontiguousarray(Q @ V[:, ::-1][:, :k])
            self.explained_ = w[::-1][:k]
        self.fitted_on_, self.rho_ = "public", 0.0
        return self

    def fit_private(self, X, *, rho, clip, seed=None, offset=None):
        """Analyze-Gauss DP PCA of private rows: rho-zCDP, rows clipped to ``clip``.
        ``seed``/``offset`` as :meth:`Centering.fit_private`; takes p(p+1)/2 draws."""
        rho = check_positive(rho, "rho")
        clip = check_positive(clip, "clip")
        m, p = check_features(X)
        k = self._k(p)
        if p > self._PRIVATE_MAX:
            raise ValueError(f"X: Analyze-Gauss DP PCA forms a p x p matrix; expected p <= "
                             f"{self._PRIVATE_MAX}, got {p}")
        stream = _stream.resolve(seed, offset)
        Xn = to_host(X, "X", dtype=np.float64)
        Xc = _clipped_rows(Xn, clip)
        A = Xc.T @ Xc
        sigma = clip * clip / math.sqrt(2.0 * rho)
        iu = np.triu_indices(p)
        E = np.zeros((p, p))
        at = stream.take(iu[0].size)
        E[iu] = sigma * _rng.gaussian(iu[0].size, seed=stream.seed, offset=at, dtype=np.float64)
        E = E + np.triu(E, 1).T
        w, V = np.linalg.eigh(A + E)
        self.components_ = np.ascontiguousarray(V[:, ::-1][:, :k])
        self.explained_ = w[::-1][:k] / m
        self.fitted_on_, self.rho_, self.seed_ = "private", rho, None
        self.offset_, self.next_offset_ = at, at + iu[0].size
        return self

    def truncate(self, n_components):
        """A projector onto the first ``n_components`` of these components.

        Principal subspaces are nested, so this is the projector a fit with fewer
        components would give (exactly for the ``eigh`` paths).  Post-processing of the
        same release: it carries the same ``fitted_on_`` and ``rho_`` -- pass
        only one of them to an estimator's ``preprocessing``, the cost is paid once."""
        self._check_fitted()
        k = check_int(n_components, "n_components", 1)
        if k > self.components_.shape[1]:
            raise ValueError(f"n_components: expected <= {self.components_.shape[1]}, got {k}")
        out = PCAProjector(k)
        out.components_ = np.ascontiguousarray(self.components_[:, :k])
        out.explained_ = self.explained_[:k]
        out.fitted_on_, out.rho_, out.seed_ = self.fitted_on_, self.rho_, self.seed_
        out.offset_, out.next_offset_ = self.offset_, self.next_offset_
        return out

    def transform(self, X):
        """X @ components_: (n, p) -> (n, k), in X's library, device and dtype."""
        return X @ self._fitted_like(X, self.components_)

