r"""Synthetic Neural Collapse data (paper ``000_82fe6240ae4b04be``, Sections 3, 5.2):
the simplex ETF of eq. 2.2 (:func:`etf`), features at its vertices plus feature-shift
vectors (:func:`synthetic`, :class:`SyntheticNC`, generated lazily in row blocks) and
worst-case test shifts against a linear classifier (:func:`adversarial_shift`).

Conventions: class labels are integers ``0..K-1``; ``means`` are stored as rows, so
``means[k]`` is the ideal feature :math:`M_k` (column k of the paper's M).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from numbers import Real
from typing import Iterator

import numpy as np

from .. import _backend
from .._arrays import to_host
from .._validate import check_int, check_nonneg

__all__ = ["etf", "synthetic", "SyntheticNC", "adversarial_shift"]

_BLOCK = 1024          # rows per deterministic random block of the lazy generator
_SPLIT_ID = {"train": 0, "test": 1, "public": 2}


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
    K = check_int(num_classes, "num_classes", 2)
    p = check_int(dim, "dim", K)
    rng = np.random.Generator(np.random.PCG64(_backend.resolve_seed(seed)))
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
    W = to_host(coef, "coef", dtype=np.float64)
    if W.ndim != 2 or not np.isfinite(W).all():
        raise ValueError(f"coef: expected a finite (K, p) matrix, got shape {W.shape}"
                         + ("" if W.ndim != 2 else " with NaN or Inf"))
    beta = check_nonneg(beta, "beta")
    lab = np.asarray(labels)
    if lab.ndim != 1 or (lab.size and (lab.dtype.kind not in "iu" or lab.min() < 0
                                       or lab.max() >= W.shape[0])):
        raise ValueError(f"labels: expected a 1-D array of classes in [0, {W.shape[0]}) "
                         "(the rows of coef)")
    lab = lab.astype(np.int64)
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

    def shift_kind(self, split):
        if self.shift is None:
            return None
        applies = (self.shift_split == "both" or self.shift_split == split
                   or (split == "public" and self.shift_split == "train"))
        return self.shift if applies else None

    def _class_rows(self, classes, kind):
        # Without stochastic shifts a row depends on its class alone.
        X = self.means[classes].astype(self.dtype)
        if kind == "offset":
            X += self.offset.astype(self.dtype)
        elif kind == "adversarial":
            X += self.adversarial[classes].astype(self.dtype)
        return X

    def _rows(self, split, start, stop):
        y = self.labels(split)[start:stop]
        kind = self.shift_kind(split)
        X = self._class_rows(y, kind)
        if kind == "stochastic":
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
        rows = check_int(rows, "rows", 1)
        y = self.labels(split)
        for s in range(0, len(y), rows):
            yield self.features(split, s, s + rows), y[s:s + rows]

    def grouped(self, split="train"):
        """The split as distinct rows with multiplicities, when the rows of a class are
        identical (no shift, offset or adversarial): ``(X (G, p), y (G,), counts (G,))``
        with G <= K.  Fitting on it with ``counts`` equals fitting on every row."""
        if self.shift_kind(split) == "stochastic":
            raise ValueError(f"split {split!r}: stochastic shifts make every row distinct; "
                             "use features() or chunks()")
        y = self.labels(split)
        counts = np.bincount(y, minlength=self.num_classes)
        present = np.flatnonzero(counts)
        X = self._class_rows(present, self.shift_kind(split))
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
    K = check_int(num_classes, "num_classes", 2)
    n = check_int(n, "n", K)
    p = check_int(dim, "dim", K)
    beta = check_nonneg(beta, "beta")
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
    test_size = max(1, n // 5) if test_size is None else check_int(test_size, "test_size", 1)
    public_size = check_int(public_size, "public_size", 0)
    dt = np.dtype(dtype)
    if dt not in _backend.FLOAT_DTYPES:
        raise TypeError(f"dtype: expected float32 or float64, got {dt}")
    seed = _backend.resolve_seed(seed)
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
        W = to_host(classifier, "classifier", dtype=np.float64)
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

