"""Reproductions of paper 000 (Neural Collapse meets DP): ``ncdp-fast reproduce nc-synthetic``
(:func:`synthetic_main`, Section 5.2 / Figure 3(a), module :mod:`.synthetic`) and
``ncdp-fast reproduce nc-real`` (:func:`real_main`, Sections 5.1, 5.3, 5.4 / Figures 2-4
on pretrained features, module :mod:`.real`, with :mod:`.real_data` (features, splits,
perturbation), :mod:`.real_fit` (NoisySGD / SGD), :mod:`.real_dimension` (Figure 3(b)
and its exact copies reduction), :mod:`.real_pca` (Figure 4), :mod:`.protocols` (where
the PCA is fitted and what it costs), :mod:`.spiked` (spiked-covariance thresholds) and
:mod:`.real_report` (tables, plots, summaries)).
"""
from __future__ import annotations

from .real import real_main
from .synthetic import synthetic_main

__all__ = ["synthetic_main", "real_main"]
