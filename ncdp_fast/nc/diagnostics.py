r"""Neural Collapse diagnostics (paper ``000_82fe6240ae4b04be``, Section 5.1; Papyan et
al. 2020): :func:`metrics` and its result :class:`NCMetrics`.

A non-private diagnostic: its outputs are functions of every row they are given and
must not be released for private data.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .._arrays import to_host
from .._validate import check_features, check_labels, check_pos_int

__all__ = ["metrics", "NCMetrics"]


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
    n, p = check_features(features, "features")
    y, K = check_labels(labels, n, num_classes, "labels")
    chunk_rows = check_pos_int(chunk_rows, "chunk_rows")
    counts = np.bincount(y, minlength=K)
    if np.any(counts == 0):
        raise ValueError(f"labels: every class 0..{K - 1} must occur, classes "
                         f"{np.flatnonzero(counts == 0).tolist()} are empty")

    def chunk(s):
        return to_host(features[s:s + chunk_rows], "features", dtype=np.float64)

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

