r"""Private last-layer fine-tuning: NoisyGD and NoisySGD linear classifiers.

Paper ``000_82fe6240ae4b04be``: a linear model :math:`f_W(x) = Wx`, :math:`W \in
\mathbb R^{K\times p}`, trained from zero initialisation by NoisyGD (eq. 2.1)

.. math:: \theta_{t+1} = \theta_t - \eta\Big(\sum_{i=1}^n \mathrm{clip}_C\nabla\ell(\theta_t, z_i)
          + \mathcal N(0, \sigma^2 I)\Big),

optionally projected onto the L2 ball of radius R (eq. 3.2), or by NoisySGD (DP-SGD:
Poisson batches, the same clipped noisy sum divided by the expected batch size).

The per-sample gradient of a linear model is the outer product
:math:`r_i x_i^T` of the residual :math:`r_i = \partial\ell/\partial(Wx_i)` and the
feature, so clipping never forms an (n, K p) tensor: the norms are
:math:`\|r_i\|\,\|x_i\|` and the clipped sum is one GEMM
(:func:`ncdp_fast.clip_and_noise_linear`, CPU or CUDA).

Privacy: add/remove one record; per-sample L2 sensitivity ``max_grad_norm`` (C).

* :class:`NoisyGDClassifier`: zCDP.  A budget ``rho`` (or (epsilon, delta)
  converted by :func:`ncdp_fast.privacy.dp_to_zcdp`) minus what private
  preprocessing spent is spread over the T steps: noise std
  :math:`\sigma = C\sqrt{T/(2\rho_{train})}` (:func:`ncdp_fast.privacy.noisygd_sigma`).
* :class:`NoisySGDClassifier`: Poisson-subsampled Gaussian, noise multiplier from
  :func:`ncdp_fast.privacy.calibrate_noise_multiplier` (PLD by default).

Both record their claim on the fitted estimator: ``accountant_`` (an
:class:`ncdp_fast.privacy.Accountant` holding every event, preprocessing included),
``epsilon_``, ``delta_``, ``noise_multiplier_``.  Noise comes from a
:class:`ncdp_fast.NoiseStream` (``seed``: None, an int or a stream; ``offset``):
NoisySGD first takes T draws for its Poisson batches (sub-streams), then each step
takes D = K p (+ K with an intercept) draws; ``offset_``/``next_offset_`` record
the range.  The key itself is never stored on the fitted estimator nor pickled
(docs/privacy.md): a pickled model does not carry its noise.

Modules: ``steps`` (the training loop, :func:`linear_steps`, in the caller's
array library), ``base`` (checks and what both estimators share),
``noisygd`` and ``noisysgd`` (the estimators).
"""
from __future__ import annotations

from .noisygd import NoisyGDClassifier
from .noisysgd import NoisySGDClassifier
from .steps import linear_steps

__all__ = ["NoisyGDClassifier", "NoisySGDClassifier", "linear_steps"]
