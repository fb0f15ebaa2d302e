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

Modules: :mod:`.synthetic_data` (ETF and synthetic data), :mod:`.diagnostics`
(``metrics``), :mod:`.preprocess` (``Centering``, ``PCAProjector``), :mod:`.validate`
(argument checks shared with :mod:`ncdp_fast.train`).
"""
from __future__ import annotations

# No submodule is called ``metrics`` or ``synthetic``: those names are the functions.
from .diagnostics import NCMetrics, metrics
from .preprocess import Centering, PCAProjector
from .synthetic_data import SyntheticNC, adversarial_shift, etf, synthetic
from .._validate import check_features, check_labels

__all__ = ["etf", "synthetic", "SyntheticNC", "adversarial_shift", "metrics", "NCMetrics",
           "Centering", "PCAProjector"]
