"""Where the PCA of Section 5.4 / Figure 4 is fitted, and what it costs.

* ``paper`` -- the paper's protocol as stated: "we apply PCA to the covariance matrix of
  private feature instead of a DP-PCA".  The top eigenvectors of the (perturbed)
  private training rows' second moment, **not private**: the projector is marked
  ``fitted_on_ = NOT_PRIVATE``, so an estimator refuses it as ``preprocessing`` (it can
  never be charged as free), and the rows' epsilon covers NoisySGD only.
* ``public-M`` -- fitted on M public rows (training rows held out from the private set,
  perturbed like them): no privacy cost.
* ``dp-pca`` -- Analyze-Gauss DP PCA of the private rows (``PCAProjector.fit_private``),
  its zCDP ``rho = share * dp_to_zcdp(epsilon, delta)`` spent from the same (epsilon,
  delta) budget as NoisySGD (the estimator composes it, RDP accountant) and reported.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ... import nc
from ...privacy import dp_to_zcdp
from ...privacy.truncation import PAIRS_PER_KEY, ideal_delta, zcdp_epsilon
from ..._validate import check_delta, check_pos_int, check_positive, check_probability

__all__ = ["NOT_PRIVATE", "Projection", "protocol_names", "dp_pca_budget", "fit_protocol",
           "dp_pca_clip", "components"]

NOT_PRIVATE = "private rows, NOT PRIVATE (paper's protocol, unaccounted)"


def protocol_names(public_sizes, dp_pca=True) -> list[str]:
    """``["paper", "public-M" for M in public_sizes, "dp-pca"]``."""
    return ["paper"] + [f"public-{check_pos_int(m, 'public size')}" for m in public_sizes] + \
        (["dp-pca"] if dp_pca else [])


def dp_pca_budget(epsilon, delta, share) -> dict:
    """The DP-PCA share of an (epsilon, delta) budget: ``rho_total`` (the zCDP of the whole
    budget, ``dp_to_zcdp``), ``rho_pca = share * rho_total`` and ``epsilon_pca``, the
    epsilon of the PCA release alone at ``delta`` (``zcdp_to_dp``).  NoisySGD gets the
    rest: its noise is calibrated so that the composition meets (epsilon, delta)."""
    eps = check_positive(epsilon, "epsilon")
    delta = check_delta(delta)
    share = check_probability(share, "share", one=False)
    # The zCDP budget leaves room for the sampler's truncated tails (privacy.truncation)
    # of two keys: the PCA's and training's.
    rho_total = dp_to_zcdp(eps, ideal_delta(delta, eps, 2 * PAIRS_PER_KEY))
    rho = share * rho_total
    return dict(rho_total=rho_total, rho_pca=rho, epsilon_pca=zcdp_epsilon(rho, delta))


@dataclass
class Projection:
    """A fitted PCA with its privacy label.  ``projector``: ``nc.PCAProjector`` with the
    largest k (smaller k are its ``truncate``); ``rows``: rows it was fitted on;
    ``private_valid``: whether a pipeline using it is (epsilon, delta)-DP;
    ``preprocessing``: what to pass to the estimator's ``fit(..., preprocessing=)``."""
    protocol: str
    projector: object
    rows: int
    private_valid: bool
    privacy: str
    rho: float = 0.0
    epsilon_pca: float | None = None
    clip: float | None = None
    preprocessing: list = field(default_factory=list)


def fit_protocol(name, k, *, Xpriv, Xpub, seed, rho=None, clip=None, delta=None) -> Projection:
    """Fit the top-``k`` projector of protocol ``name``.  Xpriv (n, p): the perturbed
    private training rows; Xpub (m, p): the perturbed public pool (``public-M`` uses
    its first M rows); ``rho``/``clip``: the zCDP share and row clip of ``dp-pca``,
    ``delta``: where its epsilon alone is reported."""
    k = check_pos_int(k, "k")
    if name == "paper":
        # The library's public solver applied to private rows: the paper's protocol.  The
        # label below replaces the "public" declaration so that no estimator can take it
        # as free preprocessing (prior_rho raises on an unknown fitted_on_).
        pca = nc.PCAProjector(k).fit(Xpriv, public=True, seed=seed)
        pca.fitted_on_ = NOT_PRIVATE
        return Projection(name, pca, Xpriv.shape[0], False, NOT_PRIVATE)
    if name.startswith("public-"):
        m = check_pos_int(int(name.split("-", 1)[1]), "public size")
        if m > Xpub.shape[0]:
            raise ValueError(f"{name}: the public pool has only {Xpub.shape[0]} rows")
        pca = nc.PCAProjector(k).fit(Xpub[:m], public=True, seed=seed)
        return Projection(name, pca, m, True, f"public rows ({m}): no cost", preprocessing=[pca])
    if name == "dp-pca":
        rho = check_positive(rho, "rho")
        clip = check_positive(clip, "clip")
        pca = nc.PCAProjector(k).fit_private(Xpriv, rho=rho, clip=clip, seed=seed)
        return Projection(name, pca, Xpriv.shape[0], True,
                          f"Analyze-Gauss DP-PCA, rho={rho:.3g} from the budget", rho=rho,
                          epsilon_pca=None if delta is None else
                          zcdp_epsilon(rho, check_delta(delta)),
                          clip=clip, preprocessing=[pca])
    raise ValueError(f"protocol: expected 'paper', 'public-M' or 'dp-pca', got {name!r}")


def dp_pca_clip(var, p) -> float:
    """Row clip of DP-PCA: the expected norm sqrt(1 + var p) of a perturbed unit-norm row
    (a function of public settings only)."""
    return math.sqrt(1.0 + float(var) * check_pos_int(p, "p"))


def components(projection: Projection, k) -> np.ndarray:
    """The (p, k) leading components of a fitted protocol."""
    return np.asarray(projection.projector.components_[:, :k])
