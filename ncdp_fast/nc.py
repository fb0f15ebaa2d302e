r"""Neural Collapse toolkit for private last-layer fine-tuning (paper ``000_82fe6240ae4b04be``).

* :func:`etf` -- the simplex equiangular tight frame of eq. 2.2.
* :func:`synthetic` -- features at ETF vertices plus feature-shift vectors (Definition
  2.3; stochastic shifts of Section 3.1.1, the offset of Sections 3.2.2 / 4.2, the
  test-time adversarial shift of Section 3.2.2), class imbalance, train / test /
  public splits generated lazily in row chunks (a 10^4 x 10^5 float32 matrix is 4 GB).
* :func:`metrics` -- NC diagnostics of Section 5.1 and Papyan et al. (2020): class
  means, cosines of centred means, NC1, equinorm, the per-sample feature shift
  beta_i and its per-class medians, the minimum distance between class means.
* :class:`Centering` and :class:`PCAProjector` -- the mitigations of Section 4
  (feature normalisation, eq. of Section 4.2; PCA, Section 4.1), fitted on *public*
  data (``fit(X, public=True)``) or, with an explicit share of the privacy budget, on
  private data (``fit_private(X, rho=..., clip=...)``: a clipped Gaussian mean, or the
  Analyze-Gauss noisy second-moment matrix).  Plain ``fit`` without ``public=True`` is
  refused, so nothing private is used for free.  The zCDP spent is kept on the object
  (``rho_``) and is composed into the estimators' accountant by
  ``NoisyGDClassifier.fit(..., preprocessing=[...])`` (:mod:`ncdp_fast.train`).

``metrics`` is a non-private diagnostic: its outputs are functions of every row they
are given and must not be released for private data.

Conventions: class labels are integers ``0..K-1``; ``means`` are stored as rows, so
``means[k]`` is the ideal feature :math:`M_k` (column k of the paper's M).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from numbers import Integral, Real
from typing import Iterator

import numpy as np

from . import _backend, _stream

__all__ = ["etf", "synthetic", "SyntheticNC", "adversarial_shift", "metrics", "NCMetrics",
           "Centering", "PCAProjector"]

_BLOCK = 1024          # rows per deterministic random block of the lazy generator
_SPLIT_ID = {"train": 0, "test": 1, "public": 2}


# ------------------------------------------------------------------ helpers

def _int(value, name, minimum):
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"{name}: expected an integer >= {minimum}, got "
                        f"{type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name}: expected an integer >= {minimum}, got {value}")
    return int(value)


def _nonneg(value, name):
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value) \
            or value < 0:
        raise ValueError(f"{name}: expected a finite number >= 0, got {value!r}")
    return float(value)


def _seed(seed):
    """A 64-bit seed: the caller's or one drawn from the OS (recorded by the caller)."""
    return _backend.resolve_seed(seed)


def _to_numpy(x, name, *, dtype=None):
    """Host NumPy view/copy of a NumPy array or torch tensor (CPU or CUDA)."""
    if _backend.is_torch(x):
        x = x.detach().cpu().numpy()
    elif hasattr(x, "__cuda_array_interface__") and hasattr(x, "get"):
        x = x.get()
    try:
        a = np.asarray(x)
    except Exception:  # pragma: no cover - exotic inputs
        raise TypeError(f"{name}: expected an array, got {type(x).__name__}") from None
    if dtype is not None:
        a = a.astype(dtype, copy=False)
    return a


def _check_features(X, name="X"):
    """Validate a (n, p) float feature array (NumPy or torch); returns (n, p)."""
    try:
        shape = tuple(int(s) for s in X.shape)
    except AttributeError:
        raise TypeError(f"{name}: expected an array of shape (n, p), got "
                        f"{type(X).__name__}") from None
    if len(shape) != 2:
        raise ValueError(f"{name}: expected shape (n, p), got {shape}")
    if _backend.is_torch(X):
        import torch
        if not torch.is_floating_point(X):
            raise TypeError(f"{name}: expected a float32/float64 tensor, got {X.dtype}")
        finite = bool(torch.isfinite(X).all())
    else:
        Xa = np.asarray(X)
        if Xa.dtype.kind not in "fiu":
            raise TypeError(f"{name}: expected a real-valued array, got dtype {Xa.dtype}")
        finite = bool(np.isfinite(Xa).all()) if Xa.dtype.kind == "f" else True
    if not finite:
        raise ValueError(f"{name}: features contain NaN or Inf")
    return shape


def check_labels(y, n, num_classes=None, name="y"):
    """Validate labels: n integers in [0, K).  Returns (labels int64 NumPy, K).

    ``num_classes=None`` takes K = max(y) + 1: the label set is then treated as the
    task's public schema (pass ``num_classes`` to avoid reading it from the data)."""
    a = _to_numpy(y, name)
    if a.ndim != 1 or a.shape[0] != n:
        raise ValueError(f"{name}: expected shape ({n},) matching the features, got {a.shape}")
    if a.dtype.kind == "f":
        if not np.isfinite(a).all() or np.any(a != np.round(a)):
            raise ValueError(f"{name}: expected integer class labels 0..K-1, got non-integer "
                             "values")
    elif a.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected integer class labels, got dtype {a.dtype}")
    a = a.astype(np.int64)
    if num_classes is not None:
        K = _int(num_classes, "num_classes", 2)
    else:
        K = int(a.max()) + 1 if a.size else 0
        if K < 2:
            raise ValueError(f"{name}: expected labels of at least 2 classes 0..K-1, got max "
                             f"{K - 1}")
    if a.size and (a.min() < 0 or a.max() >= K):
        raise ValueError(f"{name}: expected integers in [0, {K}), got min {a.min()} max "
                         f"{a.max()}")
    return a, K


# ---------------------------------------------------------------------- ETF

def etf(num_classes, dim, seed=None) -> np.ndarray:
    r"""The simplex ETF of eq. 2.2, :math:`M = \sqrt{K/(K-1)}\,P(I_K - \mathbf 1\mathbf 1^T/K)`.

    ``P`` (dim, K) is a random partial orthogonal matrix (:math:`P^TP = I_K`, from the
    QR factorisation of a Gaussian matrix).  Columns :math:`M_k` have unit norm and
    pairwise cosine :math:`-1/(K-1)`.

    Args:
        num_classes: K >= 2.
        dim: feature dimension p >= K.
        seed: int or None (None: drawn from the OS).  Not privacy noise: the ETF is
            the data-generating frame of a synthetic experiment.

    Returns:
        (K, p) float64 NumPy array whose row k is :math:`M_k` (the transpose of the
        paper's M).
    """
    K = _int(num_classes, "num_classes", 2)
    p = _int(dim, "dim", K)
    rng = np.random.Generator(np.random.PCG64(_seed(seed)))
    q, r = np.linalg.qr(rng.standard_normal((p, K)))
    q *= np.sign(np.diag(r))           # Haar-distributed P
    M = math.sqrt(K / (K - 1)) * (q - q.mean(axis=1, keepdims=True))
    return np.ascontiguousarray(M.T)


# ---------------------------------------------------------------- synthetic

def _class_counts(total, props):
    """Largest-remainder rounding of total * props (deterministic, sums to total)."""
    raw = np.asarray(props, dtype=np.float64) * total
    base = np.floor(raw).astype(np.int64)
    rest = total - int(base.sum())
    order = np.argsort(-(raw - base), kind="stable")
    base[order[:rest]] += 1
    return base


def _proportions(imbalance, K):
    if imbalance is None:
        return np.full(K, 1.0 / K)
    if isinstance(imbalance, Real) and not isinstance(imbalance, bool):
        a = float(imbalance)
        if not 0.0 < a < 1.0:
            raise ValueError(f"imbalance: expected alpha in (0, 1) or K proportions, got {a!r}")
        m = K // 2                    # minority classes 0..m-1 share alpha of the samples
        return np.concatenate([np.full(m, a / m), np.full(K - m, (1.0 - a) / (K - m))])
    props = np.asarray(imbalance, dtype=np.float64)
    if props.shape != (K,) or np.any(props <= 0) or not np.isfinite(props).all():
        raise ValueError(f"imbalance: expected alpha in (0, 1) or {K} positive proportions, got "
                         f"{imbalance!r}")
    return props / props.sum()


def adversarial_shift(labels, coef, beta) -> np.ndarray:
    r"""Worst-case test shifts against a linear classifier (Section 3.2.2, test time).

    For a test point of class y at the ideal feature :math:`M_y`, the shift
    :math:`v` with :math:`\|v\|_\infty \le \beta` that most reduces the margin of y over
    class j is :math:`-\beta\,\mathrm{sign}(W_y - W_j)` (it lowers
    :math:`(W_y - W_j)^T x` by :math:`\beta\|W_y - W_j\|_1`); the class j chosen is the
    one whose margin is smallest after its attack.  Needs the ideal means, so it is
    applied by :func:`synthetic`; this function returns, per class y, the shift for
    the margins computed from ``coef`` alone (margins of the ideal features are
    added by the caller).

    Args:
        labels: (K,) classes to attack (usually ``arange(K)``).
        coef: (K, p) classifier weights W (NumPy or torch).
        beta: :math:`\|v\|_\infty` bound >= 0.

    Returns:
        (len(labels), K, p) float64 candidate shifts, one per target class j (the
        j = y entry is zero).
    """
    W = _to_numpy(coef, "coef", dtype=np.float64)
    beta = _nonneg(beta, "beta")
    lab = np.asarray(labels, dtype=np.int64)
    out = np.zeros((lab.size, W.shape[0], W.shape[1]))
    for a, y in enumerate(lab):
        for j in range(W.shape[0]):
            if j != y:
                out[a, j] = -beta * np.sign(W[y] - W[j])
    return out


@dataclass(frozen=True)
class SyntheticNC:
    r"""A synthetic Neural Collapse data set, generated lazily in row blocks.

    Feature of row i of a split: ``means[y_i] + shift_i`` where ``shift_i`` is zero
    (perfect NC), the common offset ``offset`` (``shift="offset"``), a fresh
    Rademacher vector :math:`\beta\,\{\pm1\}^p` (``"stochastic"``, i.i.d. symmetric with
    :math:`\|v\|_\infty = \beta`), or the per-class adversarial vector
    (``"adversarial"``, test split only).  The public split follows the training
    distribution.  Blocks of 1024 rows use their own seed (``SeedSequence((seed, split,
    block))``), so every chunking of a split gives the same rows.
    """
    means: np.ndarray            # (K, p) float64 ideal features M_k (rows)
    y_train: np.ndarray          # (n,) int64
    y_test: np.ndarray           # (test_size,) int64
    y_public: np.ndarray         # (public_size,) int64
    shift: str | None
    beta: float
    shift_split: str             # "train", "test" or "both"
    offset: np.ndarray | None    # (p,) common offset vector of shift="offset"
    adversarial: np.ndarray | None  # (K, p) per-class test shifts of shift="adversarial"
    seed: int
    dtype: np.dtype = field(default=np.dtype(np.float32))

    @property
    def num_classes(self) -> int:
        return self.means.shape[0]

    @property
    def dim(self) -> int:
        return self.means.shape[1]

    def labels(self, split) -> np.ndarray:
        if split not in _SPLIT_ID:
            raise ValueError(f"split: expected 'train', 'test' or 'public', got {split!r}")
        return {"train": self.y_train, "test": self.y_test, "public": self.y_public}[split]

    def _shift_kind(self, split):
        if self.shift is None:
            return None
        applies = (self.shift_split == "both" or self.shift_split == split
                   or (split == "public" and self.shift_split == "train"))
        return self.shift if applies else None

    def _rows(self, split, start, stop):
        y = self.labels(split)[start:stop]
        X = self.means[y].astype(self.dtype)
        kind = self._shift_kind(split)
        if kind == "offset":
            X += self.offset.astype(self.dtype)
        elif kind == "adversarial":
            X += self.adversarial[y].astype(self.dtype)
        elif kind == "stochastic":
            b0 = start // _BLOCK
            for b in range(b0, (stop - 1) // _BLOCK + 1):
                lo, hi = b * _BLOCK, min((b + 1) * _BLOCK, len(self.labels(split)))
                rng = np.random.Generator(np.random.PCG64(
                    np.random.SeedSequence((self.seed, _SPLIT_ID[split], b))))
                signs = rng.integers(0, 2, size=(hi - lo, self.dim), dtype=np.int8)
                v = (2 * signs - 1).astype(self.dtype) * self.dtype.type(self.beta)
                a, c = max(lo, start), min(hi, stop)
                X[a - start:c - start] += v[a - lo:c - lo]
        return X

    def features(self, split="train", start=0, stop=None) -> np.ndarray:
        """Rows ``start:stop`` of a split as a (rows, p) array of ``dtype``."""
        n = len(self.labels(split))
        stop = n if stop is None else min(int(stop), n)
        return self._rows(split, int(start), stop) if stop > start else \
            np.empty((0, self.dim), self.dtype)

    def chunks(self, split="test", rows=4096) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Yield ``(X, y)`` row chunks of a split (bounded memory: rows * p * itemsize)."""
        rows = _int(rows, "rows", 1)
        y = self.labels(split)
        for s in range(0, len(y), rows):
            yield self.features(split, s, s + rows), y[s:s + rows]

    def grouped(self, split="train"):
        """The split as distinct rows with multiplicities, when the rows of a class are
        identical (no shift, offset or adversarial): ``(X (G, p), y (G,), counts (G,))``
        with G <= K.  Fitting on it with ``counts`` equals fitting on every row."""
        if self._shift_kind(split) == "stochastic":
            raise ValueError(f"split {split!r}: stochastic shifts make every row distinct; "
                             "use features() or chunks()")
        y = self.labels(split)
        counts = np.bincount(y, minlength=self.num_classes)
        present = np.flatnonzero(counts)
        X = self.means[present].astype(self.dtype)
        kind = self._shift_kind(split)
        if kind == "offset":
            X += self.offset.astype(self.dtype)
        elif kind == "adversarial":
            X += self.adversarial[present].astype(self.dtype)
        return X, present.astype(np.int64), counts[present].astype(np.int64)

    @property
    def X_train(self):
        return self.features("train")

    @property
    def X_test(self):
        return self.features("test")


def synthetic(n, num_classes, dim, *, shift=None, beta=0.0, imbalance=None, seed=None,
              test_size=None, public_size=0, shift_split=None, classifier=None,
              dtype=np.float32) -> SyntheticNC:
    r"""Synthetic perfect / perturbed Neural Collapse features (Sections 3, 5.2).

    Class k's ideal feature is :math:`M_k` of a random ETF (eq. 2.2, unit norm);
    feature shift vectors (Definition 2.3) are added according to ``shift``:

    * ``None``: perfect NC (:math:`\beta = 0`).
    * ``"stochastic"``: i.i.d. symmetric shifts, every coordinate :math:`\pm\beta`
      (Section 3.1.1; :math:`\|v\|_\infty = \beta`), fresh for every row.
    * ``"offset"``: one fixed vector v (coordinates :math:`\pm\beta`) added to every
      feature, :math:`x_i = M_{y_i} + v` -- the feature model of the gradient
      display of Section 3.2.2 and of Section 4.2 (it cancels from the zero-init
      gradient only under class balance; centering removes it).
    * ``"adversarial"``: test time only; for each class y the shift
      :math:`\|v\|_\infty\le\beta` minimising the smallest margin of ``classifier``
      (Section 3.2.2, :func:`adversarial_shift`).

    Args:
        n: number of training rows (>= num_classes).
        num_classes: K >= 2.
        dim: p >= K.
        shift: None, "stochastic", "offset" or "adversarial".
        beta: :math:`\|v\|_\infty` of the shifts (>= 0).
        imbalance: None (balanced), alpha in (0, 1) (the first floor(K/2) classes
            share a fraction alpha of the rows -- the K-class form of the paper's
            alpha-imbalance), or K positive class proportions.  Every split uses the
            same proportions; counts are rounded deterministically.
        seed: int or None (OS); recorded on the result.  Generates the ETF, the
            offset and the stochastic shifts (no privacy role).
        test_size: rows of the test split (default n // 5).
        public_size: rows of a public split from the training distribution (for
            :class:`Centering` / :class:`PCAProjector`).
        shift_split: which splits get the shift: "train", "test" or "both"
            (default: "both"; "test" for adversarial).
        classifier: (K, p) weights to attack for ``shift="adversarial"``.
        dtype: float32 (default) or float64 for generated features.

    Returns:
        :class:`SyntheticNC`; features are generated on demand
        (``features``, ``chunks``, ``grouped``).
    """
    K = _int(num_classes, "num_classes", 2)
    n = _int(n, "n", K)
    p = _int(dim, "dim", K)
    beta = _nonneg(beta, "beta")
    if shift not in (None, "stochastic", "offset", "adversarial"):
        raise ValueError(f"shift: expected None, 'stochastic', 'offset' or 'adversarial', got "
                         f"{shift!r}")
    if shift is not None and beta == 0.0:
        raise ValueError(f"beta: shift={shift!r} needs beta > 0, got 0")
    if shift_split is None:
        shift_split = "test" if shift == "adversarial" else "both"
    if shift_split not in ("train", "test", "both"):
        raise ValueError(f"shift_split: expected 'train', 'test' or 'both', got {shift_split!r}")
    if shift == "adversarial" and shift_split != "test":
        raise ValueError("shift_split: adversarial shifts are test-time only, expected 'test'")
    test_size = max(1, n // 5) if test_size is None else _int(test_size, "test_size", 1)
    public_size = _int(public_size, "public_size", 0)
    dt = np.dtype(dtype)
    if dt not in _backend.FLOAT_DTYPES:
        raise TypeError(f"dtype: expected float32 or float64, got {dt}")
    seed = _seed(seed)
    props = _proportions(imbalance, K)
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence((seed, 99))))
    means = etf(K, p, seed=int(rng.integers(2**63)))

    def labels(size):
        y = np.repeat(np.arange(K, dtype=np.int64), _class_counts(size, props))
        return y[rng.permutation(size)]

    y_train, y_test, y_public = labels(n), labels(test_size), labels(public_size)
    offset = adv = None
    if shift == "offset":
        offset = beta * (2.0 * rng.integers(0, 2, size=p) - 1.0)
    elif shift == "adversarial":
        if classifier is None:
            raise ValueError("classifier: shift='adversarial' needs the (K, p) weights to attack")
        W = _to_numpy(classifier, "classifier", dtype=np.float64)
        if W.shape != (K, p):
            raise ValueError(f"classifier: expected shape ({K}, {p}), got {W.shape}")
        cands = adversarial_shift(np.arange(K), W, beta)
        adv = np.zeros((K, p))
        scores = means @ W.T                                   # (K, K)
        for y in range(K):
            worst, best = np.inf, None
            for j in range(K):
                if j == y:
                    continue
                m = scores[y, y] - scores[y, j] + (W[y] - W[j]) @ cands[y, j]
                if m < worst:
                    worst, best = m, cands[y, j]
            adv[y] = best
    return SyntheticNC(means=means, y_train=y_train, y_test=y_test, y_public=y_public,
                       shift=shift, beta=beta, shift_split=shift_split, offset=offset,
                       adversarial=adv, seed=seed, dtype=dt)


# ----------------------------------------------------------------- metrics

@dataclass(frozen=True)
class NCMetrics:
    """Neural Collapse diagnostics (non-private: do not release for private data)."""
    means: np.ndarray            # (K, p) class means mu_k
    counts: np.ndarray           # (K,) rows per class
    cosine: np.ndarray           # (K, K) cosines of the centred means
    cosine_deviation: float      # mean |cos_ij + 1/(K-1)| over i != j
    nc1: float                   # tr(Sigma_W Sigma_B^+) / K
    equinorm_cv: float           # std / mean of ||mu_k - mu_G||
    beta: np.ndarray             # (n,) beta_i = ||x_i - mu_{y_i}||_inf
    beta_median: np.ndarray      # (K,) per-class medians of beta_i
    min_mean_distance: float     # min_{i != j} ||mu_i - mu_j||_2

    def summary(self) -> dict:
        """Scalars for a table row."""
        K = self.cosine.shape[0]
        off = self.cosine[~np.eye(K, dtype=bool)]
        return dict(cos_mean=float(off.mean()), cos_median=float(np.median(off)),
                    cos_min=float(off.min()), cos_max=float(off.max()),
                    cos_dev=self.cosine_deviation, nc1=self.nc1, equinorm_cv=self.equinorm_cv,
                    beta_median=float(np.median(self.beta)),
                    beta_class_median_min=float(self.beta_median.min()),
                    beta_class_median_max=float(self.beta_median.max()),
                    min_mean_dist=self.min_mean_distance)


def metrics(features, labels, *, num_classes=None, chunk_rows=8192) -> NCMetrics:
    r"""Neural Collapse metrics of labelled features (Section 5.1; Papyan et al. 2020).

    * class means :math:`\hat\mu_k` and global centre :math:`\mu_G` = the mean of the
      class means (so an ETF scores exactly -1/(K-1) under class imbalance too);
    * cosine matrix of :math:`\hat\mu_k - \mu_G` and its mean absolute deviation from
      :math:`-1/(K-1)` (the equiangularity of eq. 2.2);
    * NC1 :math:`=\mathrm{tr}(\Sigma_W\Sigma_B^+)/K` with
      :math:`\Sigma_W = \frac1n\sum_i (x_i-\hat\mu_{y_i})(x_i-\hat\mu_{y_i})^T`,
      :math:`\Sigma_B = \frac1K\sum_k(\hat\mu_k-\mu_G)(\hat\mu_k-\mu_G)^T`, computed
      through the thin SVD of the centred means (never a p x p matrix);
    * equinorm coefficient of variation of :math:`\|\hat\mu_k-\mu_G\|`;
    * feature shift :math:`\beta_i = \|x_i - \hat\mu_{y_i}\|_\infty` (Definition 2.3 with
      the empirical mean standing in for :math:`M_k`, Section 5.1) and per-class medians;
    * minimum Euclidean distance between class means.

    Args:
        features: (n, p) float array (NumPy or torch, any device); read in chunks of
            ``chunk_rows`` rows in float64.
        labels: (n,) integers in [0, K); every class must occur.
        num_classes: K (default max label + 1).

    Returns:
        :class:`NCMetrics`.  Non-private: computed from every row.
    """
    n, p = _check_features(features, "features")
    y, K = check_labels(labels, n, num_classes, "labels")
    counts = np.bincount(y, minlength=K)
    if np.any(counts == 0):
        raise ValueError(f"labels: every class 0..{K - 1} must occur, classes "
                         f"{np.flatnonzero(counts == 0).tolist()} are empty")

    def chunk(s):
        return _to_numpy(features[s:s + chunk_rows], "features", dtype=np.float64)

    sums = np.zeros((K, p))
    for s in range(0, n, chunk_rows):
        np.add.at(sums, y[s:s + chunk_rows], chunk(s))
    mu = sums / counts[:, None]
    mu_g = mu.mean(axis=0)
    D = mu - mu_g
    norms = np.linalg.norm(D, axis=1)
    cos = (D @ D.T) / np.maximum(np.outer(norms, norms), np.finfo(float).tiny)
    off = ~np.eye(K, dtype=bool)
    cos_dev = float(np.mean(np.abs(cos[off] + 1.0 / (K - 1))))
    # Sigma_B = D^T D / K with D = U S V^T (rank <= K-1), so Sigma_B^+ = K V S^-2 V^T and
    # tr(Sigma_W Sigma_B^+)/K = (1/n) sum_i ||S^-1 V^T w_i||^2 for the within-class residuals w_i.
    U, S, Vt = np.linalg.svd(D, full_matrices=False)
    keep = S > S.max() * max(K, p) * np.finfo(float).eps if S.size and S.max() > 0 else S > 0
    Vk, Sk = Vt[keep], S[keep]
    beta = np.empty(n)
    nc1_acc = 0.0
    for s in range(0, n, chunk_rows):
        W = chunk(s) - mu[y[s:s + chunk_rows]]
        beta[s:s + W.shape[0]] = np.abs(W).max(axis=1) if p else 0.0
        Z = (W @ Vk.T) / Sk
        nc1_acc += float(np.sum(Z * Z))
    nc1 = nc1_acc / n              # = tr(Sigma_W Sigma_B^+)/K, Sigma_B^+ = K V S^-2 V^T
    beta_med = np.array([np.median(beta[y == k]) for k in range(K)])
    dist = np.sqrt(np.maximum(((mu[:, None, :] - mu[None, :, :]) ** 2).sum(-1), 0.0)) \
        if K * K * p <= 5e7 else np.array([[np.linalg.norm(mu[i] - mu[j]) for j in range(K)]
                                           for i in range(K)])
    return NCMetrics(means=mu, counts=counts, cosine=cos, cosine_deviation=cos_dev, nc1=nc1,
                     equinorm_cv=float(norms.std() / norms.mean()) if norms.mean() > 0 else 0.0,
                     beta=beta, beta_median=beta_med,
                     min_mean_distance=float(dist[off].min()))


# ------------------------------------------------------------ preprocessing

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
    if _backend.is_torch(X):
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
        _check_features(X)
        Xn = _to_numpy(X, "X", dtype=np.float64)
        self.mean_ = Xn.mean(axis=0)
        self.fitted_on_, self.rho_, self.seed_ = "public", 0.0, None
        return self

    def fit_private(self, X, *, rho, clip, seed=None, offset=None):
        """DP mean of private rows: rho-zCDP (rho > 0), rows clipped to norm ``clip``.
        ``seed``: the noise key -- None (OS), an int or a :class:`ncdp_fast.NoiseStream`
        shared with the rest of the workflow; ``offset``: first draw (None: the next
        unused one).  Takes p + 1 draws; the key is not stored."""
        from . import _rng
        from ._clip import clip_and_noise
        from .privacy._validate import check_positive
        rho = check_positive("rho", rho)
        clip = check_positive("clip", clip)
        n, p = _check_features(X)
        stream = _stream.resolve(seed, offset)
        z = 1.0 / math.sqrt(rho)
        Xk = X if _backend.is_torch(X) else np.ascontiguousarray(X, dtype=np.float64) \
            if np.asarray(X).dtype.kind != "f" else X
        s = clip_and_noise(Xk, max_norm=clip, noise_multiplier=z, seed=stream)
        total = _to_numpy(s.grad, "sum", dtype=np.float64)
        at = stream.take(1)
        count = n + z * float(_rng.gaussian(1, seed=stream.seed, offset=at, dtype=np.float64)[0])
        self.mean_ = total / max(count, 1.0)
        self.fitted_on_, self.rho_, self.seed_ = "private", rho, None
        self.offset_, self.next_offset_ = s.offset, at + 1
        self.noisy_count_ = count
        return self

    def transform(self, X):
        """X - mean_, in X's library, device and dtype."""
        self._check_fitted()
        n, p = _check_features(X)
        if p != self.mean_.shape[0]:
            raise ValueError(f"X: expected {self.mean_.shape[0]} features, got {p}")
        return X - _like(self.mean_, X)


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
        self.n_components = _int(n_components, "n_components", 1)
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
        m, p = _check_features(X)
        k = self._k(p)
        Xn = _to_numpy(X, "X", dtype=np.float64)
        self.seed_ = None
        if p <= self._EXACT_MAX:
            w, V = np.linalg.eigh(Xn.T @ Xn / m)
            self.components_ = np.ascontiguousarray(V[:, ::-1][:, :k])
            self.explained_ = w[::-1][:k]
        else:
            self.seed_ = _seed(seed)
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
        from . import _rng
        from .privacy._validate import check_positive
        rho = check_positive("rho", rho)
        clip = check_positive("clip", clip)
        m, p = _check_features(X)
        k = self._k(p)
        if p > self._PRIVATE_MAX:
            raise ValueError(f"X: Analyze-Gauss DP PCA forms a p x p matrix; expected p <= "
                             f"{self._PRIVATE_MAX}, got {p}")
        stream = _stream.resolve(seed, offset)
        Xn = _to_numpy(X, "X", dtype=np.float64)
        norms = np.linalg.norm(Xn, axis=1)
        Xc = Xn * np.minimum(1.0, clip / np.maximum(norms, np.finfo(float).tiny))[:, None]
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
        k = _int(n_components, "n_components", 1)
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
        self._check_fitted()
        n, p = _check_features(X)
        if p != self.components_.shape[0]:
            raise ValueError(f"X: expected {self.components_.shape[0]} features, got {p}")
        return X @ _like(self.components_, X)
