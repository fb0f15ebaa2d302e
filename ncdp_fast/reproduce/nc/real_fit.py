r"""NoisySGD and its noise-free reference for ``nc-real``.

NoisySGD (DP-SGD, :class:`ncdp_fast.train.NoisySGDClassifier`): Poisson batches of rate
q, T = epochs/q steps of :math:`W \leftarrow W - \frac{\eta}{qn}\big(\sum_{i\in B_t}
\mathrm{clip}_C(r_i x_i^T) + zC\,\xi_t\big)` from W = 0 (eq. 2.1 with subsampling).  The
accumulated noise :math:`-\frac{\eta zC}{qn}\sum_t\xi_t` has i.i.d. entries of std
:math:`s = \eta z C\sqrt T/(qn)` (:func:`weight_noise_sd`).  "SGD" is the same clipped
steps on the same batches without noise (not released; a reference).
"""
from __future__ import annotations

import math
import warnings

import numpy as np

from ..._mix import poisson_batches
from ..._stream import NoiseReuseWarning, NoiseStream
from ...train import NoisySGDClassifier, linear_steps
from .common import FixedLinear

__all__ = ["sgd_pair", "accuracy", "weight_noise_sd", "median_margin"]


def sgd_pair(Xtr, ytr, K, cfg, seed, preprocessing=(), reference=True):
    """NoisySGD on Xtr (n, p), ytr (n,) at ``cfg``'s (epsilon, delta), batch, epochs, lr,
    accountant; and (``reference``) the same clipped SGD without noise on the same
    batches.  Returns (classifier, FixedLinear or None)."""
    q = min(1.0, cfg.batch / Xtr.shape[0])
    stream = NoiseStream(seed)
    key = stream.state()         # private to this run: it rebuilds the batches below
    clf = NoisySGDClassifier(epsilon=cfg.epsilon, delta=cfg.delta, sample_rate=q,
                             epochs=cfg.epochs, lr=cfg.lr, accountant=cfg.accountant,
                             num_classes=K, seed=stream).fit(Xtr, ytr,
                                                             preprocessing=preprocessing)
    if not reference:
        return clf, None
    with warnings.catch_warnings():
        # The same batches on purpose, for the noise-free reference (not released).
        warnings.simplefilter("ignore", NoiseReuseWarning)
        plan = poisson_batches(Xtr.shape[0], sample_rate=q, steps=clf.steps_, seed=key["seed"],
                               offset=key["offset"])
    W0 = linear_steps(Xtr, ytr, num_classes=K, steps=clf.steps_, lr=cfg.lr, loss="ce",
                      max_grad_norm=1.0, noise_multiplier=0.0, projection_radius=None,
                      fit_intercept=False, seed=0, batches=plan,
                      expected_batch_size=clf.expected_batch_size_)[0]
    return clf, FixedLinear(np.asarray(W0))


def accuracy(model, X, y) -> float:
    """Share of rows of X (n, p) whose predicted class is y (n,)."""
    return float(np.mean(np.asarray(model.predict(X)) == y))


def weight_noise_sd(clf) -> float:
    """Entry std s = lr z C sqrt(T) / (q n) of a fitted NoisySGD's accumulated noise."""
    return float(clf.lr) * float(clf.noise_multiplier_) * float(clf.max_grad_norm) * \
        math.sqrt(clf.steps_) / float(clf.expected_batch_size_)


def median_margin(W, X) -> float:
    """Median over rows of X (n, p) of the gap between the two largest logits of X W^T
    (W (K, p)): the logit scale a perturbation must reach to flip predictions."""
    z = np.sort(np.asarray(X, dtype=np.float32) @ np.asarray(W, dtype=np.float32).T, axis=1)
    return float(np.median(z[:, -1] - z[:, -2]))
