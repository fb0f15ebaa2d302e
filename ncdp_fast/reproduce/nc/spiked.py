r"""Spiked-covariance analysis of the PCA step of Section 5.4 / Figure 4.

The PCA of Section 4.1 takes the top eigenvectors of :math:`\hat\Sigma = \frac1m\sum_i
\hat x_i\hat x_i^T` (uncentred).  With perturbed rows :math:`\hat x = x + z`,
:math:`z\sim N(0, vI_p)`, the population matrix is :math:`S + vI_p`, S the second
moment of the clean unit-norm features.  For m rows and aspect ratio
:math:`\gamma = p/m` (Baik, Ben Arous, Peche 2005; Paul 2007):

* the noise eigenvalues fill the Marchenko-Pastur bulk up to
  :math:`v(1+\sqrt\gamma)^2` (:func:`spiked_thresholds`, ``bulk_edge``);
* a signal direction of strength :math:`\lambda` (an eigenvalue of S) separates from the
  bulk, and its sample eigenvector correlates with it, only if
  :math:`\lambda > v\sqrt\gamma` (``threshold``); below it the sample eigenvector is
  asymptotically orthogonal to the signal.

Analyze-Gauss DP PCA (``PCAProjector.fit_private``) adds a symmetric Gaussian matrix
with entry std :math:`\sigma = c^2/\sqrt{2\rho}` to :math:`\sum_i \tilde x_i\tilde x_i^T`;
in per-row units (divided by m) it is a Wigner matrix of semicircle radius
:math:`2\sigma\sqrt p/m`, and a spike is detected only above :math:`\sigma\sqrt p/m`
(:func:`analyze_gauss_threshold`).

The signal strengths compared with these thresholds are the eigenvalues of the
class-mean second moment :math:`B = \sum_k \pi_k\mu_k\mu_k^T` (:func:`class_mean_spikes`;
the first is mostly the global mean, the other K-1 carry the class differences).  They
are computed from private rows: a non-private diagnostic (like ``nc.metrics``), never
released by the private pipelines.
"""
from __future__ import annotations

import math

import numpy as np

from ..._validate import check_features, check_labels, check_nonneg, check_pos_int, check_positive

__all__ = ["spiked_thresholds", "analyze_gauss_threshold", "class_means", "class_mean_spikes",
           "captured_fraction", "count_detected"]


def spiked_thresholds(var, p, m) -> dict:
    r"""Noise bulk edge :math:`v(1+\sqrt{p/m})^2` and spike detection threshold
    :math:`v\sqrt{p/m}` of the sample second moment of m rows of dimension p with isotropic
    noise of variance ``var`` per coordinate.  Returns ``{"gamma", "bulk_edge",
    "threshold"}`` (floats, in the units of ``var``)."""
    v = check_nonneg(var, "var")
    g = check_pos_int(p, "p") / check_pos_int(m, "m")
    return dict(gamma=g, bulk_edge=v * (1.0 + math.sqrt(g)) ** 2, threshold=v * math.sqrt(g))


def analyze_gauss_threshold(rho, clip, p, m) -> dict:
    r"""Analyze Gauss at zCDP ``rho`` with rows clipped to ``clip``: entry std
    :math:`\sigma = c^2/\sqrt{2\rho}` of the symmetric noise added to the sum of m outer
    products; in per-row units the semicircle radius :math:`2\sigma\sqrt p/m`
    (``radius``) and the spike threshold :math:`\sigma\sqrt p/m` (``threshold``).
    Both in the units of the clipped rows' second moment."""
    rho = check_positive(rho, "rho")
    clip = check_positive(clip, "clip")
    p, m = check_pos_int(p, "p"), check_pos_int(m, "m")
    sigma = clip * clip / math.sqrt(2.0 * rho)
    return dict(sigma=sigma, radius=2.0 * sigma * math.sqrt(p) / m,
                threshold=sigma * math.sqrt(p) / m)


def class_means(X, y, num_classes, chunk=8192):
    """Class means ``mu`` (K, p) float64 and class frequencies ``pi`` (K,) of X (n, p)
    with labels y (n,) in 0..K-1 (every class must occur).  Non-private diagnostic."""
    n, p = check_features(X)
    y, K = check_labels(y, n, num_classes)
    sums = np.zeros((K, p))
    for s in range(0, n, chunk):          # one-hot GEMM per chunk (np.add.at is slow)
        onehot = np.eye(K)[y[s:s + chunk]]
        sums += onehot.T @ np.asarray(X[s:s + chunk], dtype=np.float64)
    counts = np.bincount(y, minlength=K).astype(np.float64)
    if np.any(counts == 0):
        raise ValueError("y: every class must occur")
    return sums / counts[:, None], counts / n


def class_mean_spikes(mu, pi) -> np.ndarray:
    r"""Eigenvalues (K,), descending, of :math:`B = \sum_k \pi_k \mu_k\mu_k^T` (p x p, rank
    <= K), the class-mean part of the uncentred second moment, from ``mu`` (K, p) and
    ``pi`` (K,) (:func:`class_means`): the eigenvalues of the K x K matrix
    :math:`D D^T`, :math:`D = \mathrm{diag}(\sqrt\pi) M`."""
    mu = np.asarray(mu, dtype=np.float64)
    D = np.sqrt(np.asarray(pi, dtype=np.float64))[:, None] * mu
    return np.clip(np.linalg.eigvalsh(D @ D.T)[::-1], 0.0, None)


def captured_fraction(components, mu, pi) -> float:
    r"""Share of the centred class-mean energy :math:`\mathrm{tr}(B_c)`,
    :math:`B_c = \sum_k\pi_k(\mu_k-\bar\mu)(\mu_k-\bar\mu)^T`, :math:`\bar\mu = \sum_k\pi_k\mu_k`,
    inside the span of ``components`` (p, k) orthonormal columns:
    :math:`\|D_c P\|_F^2/\|D_c\|_F^2` in [0, 1] (1: the projection keeps every class
    difference; about k/p for a random subspace)."""
    mu = np.asarray(mu, dtype=np.float64)
    pi = np.asarray(pi, dtype=np.float64)
    P = np.asarray(components, dtype=np.float64)
    if P.ndim != 2 or P.shape[0] != mu.shape[1]:
        raise ValueError(f"components: expected shape ({mu.shape[1]}, k), got {P.shape}")
    Dc = np.sqrt(pi)[:, None] * (mu - pi @ mu)
    total = float(np.sum(Dc * Dc))
    return float(np.sum((Dc @ P) ** 2) / total) if total > 0 else 0.0


def count_detected(spikes, threshold) -> int:
    """How many of ``spikes`` exceed ``threshold``."""
    return int(np.sum(np.asarray(spikes, dtype=np.float64) > float(threshold)))
