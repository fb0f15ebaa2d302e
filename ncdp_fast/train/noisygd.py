"""NoisyGDClassifier: full-batch NoisyGD under a zCDP budget (paper eq. 2.1, 3.2)."""
from __future__ import annotations

from .. import _stream
from ..privacy import Accountant, dp_to_zcdp, noisygd_sigma
from ..privacy.truncation import PAIRS_PER_KEY, ideal_delta
from .._validate import check_delta, check_positive
from .._validate import check_int
from .base import LinearClassifierBase, prior_rho
from .steps import check_counts, linear_steps

__all__ = ["NoisyGDClassifier"]


class NoisyGDClassifier(LinearClassifierBase):
    r"""Full-batch NoisyGD linear classifier from zero initialisation (eq. 2.1, eq. 3.2).

    Args:
        epsilon, delta: target (epsilon, delta)-DP of everything fitted on the private
            data (this fit plus private preprocessing), converted to a zCDP budget by
            :func:`ncdp_fast.privacy.dp_to_zcdp` (tight CKS conversion).  epsilon > 0,
            delta in (0, 1).
        rho: alternatively the zCDP budget itself (> 0, finite); give either rho or
            (epsilon, delta).  With ``rho`` a ``delta`` may still be given to report
            ``epsilon_``.
        steps: T >= 1 full-batch steps; each is a Gaussian mechanism of zCDP
            :math:`\rho_{train}/T`.
        lr: step size eta on the *sum* of clipped gradients (eq. 2.1).  With one step
            from zero, any lr gives the same predictions (Section 3.1).
        loss: "ce" (softmax cross entropy) or "square" (:math:`\frac12\|Wx-y\|^2`).
        max_grad_norm: C, the per-sample L2 clipping bound = sensitivity of the sum.
        projection_radius: R of eq. 3.2 (None: no projection); applied to
            (W, b) jointly after every step.  Post-processing, no privacy cost.
        fit_intercept: learn a bias (its gradient shares the sample's clip factor).
        num_classes: K >= 2, required: it is public, never read from the labels.
        seed: the noise key: None (from the OS), a 64-bit int, or a
            :class:`ncdp_fast.NoiseStream` shared with the rest of the workflow.
            Not stored on the fitted estimator, never pickled.
        offset: first draw (None: the next unused draw of ``seed``'s stream).

    Fitted attributes: ``coef_`` (K, p) and ``intercept_`` (K,) or None in the
    training data's library/device; ``rho_`` (total zCDP spent, preprocessing
    included), ``rho_train_``, ``sigma_`` (noise std), ``noise_multiplier_``
    (sigma / C), ``accountant_`` (:class:`~ncdp_fast.privacy.Accountant` with the
    preprocessing zCDP events and T Gaussian steps of sample rate 1),
    ``epsilon_``/``delta_`` (the accountant's epsilon at delta under zCDP; None when
    only rho was given), ``offset_``/``next_offset_`` (the draws used),
    ``num_clipped_`` (the private data's, without noise: read it in the fitting
    process; no pickle or copy carries it).
    """

    def __init__(self, *, epsilon=None, delta=None, rho=None, steps=1, lr=1.0, loss="ce",
                 max_grad_norm=1.0, projection_radius=None, fit_intercept=False,
                 num_classes=None, seed=None, offset=None):
        self.epsilon, self.delta, self.rho = epsilon, delta, rho
        self.offset = offset
        self.steps, self.lr, self.loss = steps, lr, loss
        self.max_grad_norm, self.projection_radius = max_grad_norm, projection_radius
        self.fit_intercept, self.num_classes, self.seed = fit_intercept, num_classes, seed

    def _budget(self, keys=1):
        if self.rho is not None:
            if self.epsilon is not None:
                raise ValueError("rho: give either rho or (epsilon, delta), got both")
            rho = check_positive(self.rho, "rho")
            delta = None if self.delta is None else check_delta(self.delta)
            return rho, delta
        if self.epsilon is None or self.delta is None:
            raise ValueError("epsilon, delta: a privacy budget is required: (epsilon, delta) or "
                             f"rho; got epsilon={self.epsilon!r}, delta={self.delta!r}")
        eps = check_positive(self.epsilon, "epsilon")
        delta = check_delta(self.delta)
        # The zCDP budget leaves room for the sampler's truncated tails (privacy.truncation)
        # of every key: training's and each private preprocessing's.
        return dp_to_zcdp(eps, ideal_delta(delta, eps, keys * PAIRS_PER_KEY)), delta

    def fit(self, X, y, *, counts=None, preprocessing=()):
        r"""Train on private features.

        Args:
            X: (n, p) float32/float64 features, NumPy or torch (CPU or CUDA); the
                computation stays in that library and device.
            y: (n,) integer labels in [0, K).
            counts: optional (n,) integers >= 1: row i stands for ``counts[i]``
                identical private records (exactly the same estimator, privacy and
                noise as fitting on ``np.repeat(X, counts, 0)``; used for synthetic
                NC data whose rows are K distinct vectors).
            preprocessing: fitted :class:`~ncdp_fast.nc.Centering` /
                :class:`~ncdp_fast.nc.PCAProjector` objects applied to X; those fitted
                on private data (``fit_private``) have their ``rho_`` subtracted from
                the budget and recorded in ``accountant_``.
        """
        self._validate_common()
        T = check_int(self.steps, "steps", 1)
        spent = prior_rho(preprocessing)
        rho, delta = self._budget(keys=1 + len(spent))
        rho_train = rho - sum(spent)
        if not rho_train > 0:
            raise ValueError(f"preprocessing: private preprocessing spent rho={sum(spent)!r}, "
                             f"the whole budget rho={rho!r}; nothing is left for training")
        X, labels, n, p, K = self._prepare(X, y)
        cnt = check_counts(counts, n)
        stream = _stream.resolve(self.seed, self.offset)
        self._check_draws(stream, T, K, p)
        self.offset_ = stream.position
        C = float(self.max_grad_norm)
        sigma = noisygd_sigma(rho_train, T, sensitivity=C)
        z = sigma / C
        W, b, info = linear_steps(X, labels, num_classes=K, steps=T, lr=float(self.lr),
                                  loss=self.loss, max_grad_norm=C, noise_multiplier=z,
                                  projection_radius=self.projection_radius,
                                  fit_intercept=bool(self.fit_intercept), seed=stream,
                                  counts=cnt)
        acc = Accountant()
        for r in spent:
            acc.add_zcdp(r)
        acc.step(noise_multiplier=z, sample_rate=1.0, steps=T)
        self._set_fitted(W, b, K, p)
        self.next_offset_ = stream.position
        self.sigma_, self.noise_multiplier_ = sigma, z
        self.rho_train_, self.rho_ = rho_train, acc.zcdp_rho()
        self.accountant_, self.delta_ = acc, delta
        self.epsilon_ = None if delta is None else acc.epsilon(delta, "zcdp")
        self.num_clipped_ = info["num_clipped"]
        self.n_steps_ = T
        return self
