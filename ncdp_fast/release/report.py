r"""The privacy report of a NeuroMixGDP release: what one release guarantees
(epsilon under the CLT and PLD accountants) and the inputs that recompute it."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from ..privacy import dp_to_gdp, epsilon_poisson_gaussian, poisson_gdp_mu
from ..privacy.hierarchical import hs_epsilon
from ..privacy.truncation import gdp_epsilon, ideal_delta

__all__ = ["PrivacyReport", "privacy_report"]


@dataclass(frozen=True)
class PrivacyReport:
    r"""What one :meth:`NeuroMixGDP.release` call guarantees (add/remove-one neighbours,
    n public), and the inputs needed to recompute it.

    Attributes:
        epsilon_target, delta: the requested (epsilon, delta).
        mu: ``dp_to_gdp(epsilon_target, delta)``, the GDP target of Theorem 3.1.
        epsilon_clt: epsilon by the GDP CLT (Theorem 3.1 / E.2; HS: corrected, see the
            :mod:`ncdp_fast.privacy.hierarchical`).  An approximation that can
            *underestimate*.
        epsilon_pld: epsilon by the PLD accountant (pessimistic; a rigorous upper
            bound).  Quote this one for a claim you must defend.
        epsilon_paper: HS only -- the CLT epsilon that the paper's Proposition E.3
            (Poisson rate m/n) would claim for the same noise; ``None`` for Poisson.
        noise_multiplier: sigma, 1/sigma^2 = 1/sigma_x^2 + 1/sigma_y^2.
        accountant: ``"clt"`` or ``"pld"``, the accountant that calibrated sigma
            (``"fixed"`` when the noise was given, not calibrated).
        sampling: ``"poisson"`` or ``"hierarchical"``; class_rates: the p_k (HS).
        n, mixup_degree, num_samples, lam, clip_x, clip_y: the inputs.
        value_discretization_interval: PLD grid step (nats).
    """
    epsilon_target: float | None
    delta: float
    mu: float | None
    epsilon_clt: float
    epsilon_pld: float
    epsilon_paper: float | None
    noise_multiplier: float
    accountant: str
    sampling: str
    class_rates: tuple | None
    n: int
    mixup_degree: float
    num_samples: int
    lam: float
    clip_x: float
    clip_y: float
    value_discretization_interval: float
    neighbouring: str = "add/remove one record; dataset size n public"

    @property
    def epsilon(self) -> float:
        """The defensible epsilon: ``epsilon_pld`` (a rigorous upper bound)."""
        return self.epsilon_pld

    def as_dict(self) -> dict:
        d = asdict(self)
        d["class_rates"] = None if self.class_rates is None else list(self.class_rates)
        return d


def privacy_report(*, sigma, epsilon, delta, accountant, class_rates, n, m, T, lam, clip_x,
                   clip_y, interval, known=None) -> PrivacyReport:
    """The :class:`PrivacyReport` of a release with noise multiplier ``sigma``: epsilon
    under CLT and PLD (Poisson sampling when ``class_rates`` is None, else hierarchical
    sampling, plus the paper's ``epsilon_paper``).  ``epsilon`` is the target (None when
    sigma was given, not calibrated); ``known``: the :class:`~ncdp_fast.privacy.NeuroMixNoise`
    that calibrated sigma, whose epsilons are reused instead of recomputed."""
    q = m / n
    if class_rates is None and known is not None:
        # neuromix_noise already accounted for exactly this sigma, q, T, delta and grid.
        eps_clt, eps_pld, eps_paper = known.epsilon_clt, known.epsilon_pld, None
    elif class_rates is None:
        mu_clt = poisson_gdp_mu(sigma, q, T)
        eps_clt = gdp_epsilon(mu_clt, delta)
        eps_pld = epsilon_poisson_gaussian(sigma, q, T, delta, "pld",
                                           value_discretization_interval=interval)
        eps_paper = None
    else:
        kw = dict(mixup_degree=m, n=n, num_samples=T, class_rates=class_rates, delta=delta,
                  value_discretization_interval=interval)
        eps_clt = hs_epsilon(sigma, accountant="clt", **kw)
        eps_pld = hs_epsilon(sigma, accountant="pld", **kw)
        mu_paper = poisson_gdp_mu(sigma, q, T)
        eps_paper = gdp_epsilon(mu_paper, delta)
    return PrivacyReport(
        epsilon_target=epsilon, delta=delta,
        mu=None if epsilon is None else dp_to_gdp(epsilon, ideal_delta(delta, epsilon)),
        epsilon_clt=eps_clt, epsilon_pld=eps_pld, epsilon_paper=eps_paper,
        noise_multiplier=sigma, accountant=accountant,
        sampling="poisson" if class_rates is None else "hierarchical",
        class_rates=None if class_rates is None else tuple(float(v) for v in class_rates),
        n=n, mixup_degree=float(m), num_samples=T, lam=lam, clip_x=clip_x, clip_y=clip_y,
        value_discretization_interval=interval)

