"""Features for ``nc-real``: loading, the public/private split, unit-norm rows, the
dimension change of Section 5.3 and the Gaussian perturbation of Sections 5.3/5.4.

Shapes: features are float32 (n, d) C-contiguous; labels int64 (n,).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..._validate import check_int, check_nonneg, check_pos_int

__all__ = ["normalize", "resize", "perturb", "perturb_var", "SplitFeatures", "load_split",
           "split_rows"]


def normalize(X):
    """Rows of X (n, p) to unit L2 norm, in place (Section 5.1's standard normalisation)."""
    norms = np.linalg.norm(X, axis=1, keepdims=True)
    X /= np.maximum(norms, np.float32(1e-12))
    return X


def resize(X, p, coords):
    """Dimension p from X (n, d) unit-norm rows (Section 5.3: "randomly sample a subset of
    coordinates or make copies of the entire feature space"): p <= d takes the
    coordinates ``coords[:p]`` (a public permutation of 0..d-1), p > d concatenates
    copies of the whole vector (a last, partial copy takes ``coords[:w]``); rows are
    renormalised to unit norm, so the signal has norm 1 at every p.  Returns (n, p)."""
    n, d = X.shape
    check_pos_int(p, "p")
    if p <= d:
        out = np.ascontiguousarray(X[:, coords[:p]])
    else:
        out = np.empty((n, p), np.float32)
        for r in range(-(-p // d)):
            w = min(d, p - r * d)
            out[:, r * d:r * d + w] = X[:, coords[:w]] if w < d else X
    return normalize(out)


def perturb(X, var, seed, rows=8192):
    """X + N(0, var I) in place, drawn in row chunks from PCG64(``seed``) (the paper's
    Gaussian perturbation, variance ``var`` per coordinate).  X: (n, p) float32."""
    check_nonneg(var, "var")
    if var == 0:
        return X
    rng = np.random.Generator(np.random.PCG64(seed))
    sd = np.float32(math.sqrt(var))
    for s in range(0, X.shape[0], rows):
        X[s:s + rows] += sd * rng.standard_normal(X[s:s + rows].shape, dtype=np.float32)
    return X


def perturb_var(scale: str, d: int) -> float:
    """The per-coordinate variance on unit-norm rows of a perturbation scale:

    * ``"unit:V"`` -- variance V on the unit-norm rows (the literal reading of "variance
      0.1" applied after Section 5.1's normalisation; noise/signal norm sqrt(V p));
    * ``"rel:V"`` -- variance V relative to the mean squared coordinate 1/d of a unit-norm
      d-dim row: V/d.  On features whose coordinates have mean square ~1 (ViT's last
      LayerNorm output) "variance 0.1" is this relative perturbation (noise/signal norm
      sqrt(V) at p = d).

    The variance is then held fixed per coordinate at every p (Section 5.3)."""
    kind, _, val = scale.partition(":")
    if kind not in ("unit", "rel") or not val:
        raise ValueError(f"scale: expected 'unit:V' or 'rel:V', got {scale!r}")
    v = check_nonneg(float(val), "scale value")
    return v if kind == "unit" else v / check_pos_int(d, "d")


def split_rows(n, public_pool, seed, max_private=None):
    """A seeded permutation of n training rows: the first ``public_pool`` are the public
    pool (never used as private rows), the rest (at most ``max_private``) are private.
    Returns (public_idx, private_idx)."""
    check_pos_int(n, "n")
    check_int(public_pool, "public_pool", 0)
    if public_pool >= n:
        raise ValueError(f"public_pool: expected < {n} (the training rows), got {public_pool}")
    perm = np.random.Generator(np.random.PCG64(seed)).permutation(n)
    priv = perm[public_pool:]
    if max_private:
        priv = priv[:check_pos_int(max_private, "max_private")]
    return perm[:public_pool], priv


@dataclass
class SplitFeatures:
    """Unit-norm features of one data set / extractor: private training rows
    ``Xpriv`` (n, d), ``ypriv`` (n,); the public pool ``Xpub`` (m, d) (its labels are
    never used); the test set ``Xte`` (n_te, d), ``yte``; K classes."""
    tag: str
    Xpriv: np.ndarray
    ypriv: np.ndarray
    Xpub: np.ndarray
    Xte: np.ndarray
    yte: np.ndarray
    K: int

    @property
    def d(self) -> int:
        return self.Xpriv.shape[1]


def load_split(dataset, extractor, *, resolution, public_pool, seed, max_private=None):
    """Load cached features (``ncdp_fast.datasets.load_features``), split the training
    rows (:func:`split_rows`) and normalise every row to unit norm."""
    from ...datasets import NUM_CLASSES, load_features
    from ..._validate import check_labels
    Xtr, ytr = load_features(dataset, extractor, "train", resolution=resolution)
    Xte, yte = load_features(dataset, extractor, "test", resolution=resolution)
    ytr, yte = np.asarray(ytr), np.asarray(yte)
    pub, priv = split_rows(len(ytr), min(public_pool, len(ytr) // 2), seed, max_private)
    priv = np.sort(priv)
    # The data set's schema, not max(y) + 1 of rows that include the private
    # split (which would tell whether a record of the last class is present).
    K = NUM_CLASSES[dataset]
    check_labels(ytr, len(ytr), K)
    check_labels(yte, len(yte), K, "yte")
    return SplitFeatures(tag=f"{dataset}/{extractor}",
                         Xpriv=normalize(np.ascontiguousarray(Xtr[priv], dtype=np.float32)),
                         ypriv=ytr[priv],
                         Xpub=normalize(np.ascontiguousarray(Xtr[pub], dtype=np.float32)),
                         Xte=normalize(np.array(Xte, dtype=np.float32)), yte=yte, K=K)
