r"""Noise calibration for NeuroMixGDP (private release of mixed-up features).

Paper: ``shared/seeds/002_1ce43e1ce6039d97.txt`` -- Algorithm 1, Theorem 3.1,
Section 3.2, Appendix D-E.

Mechanism (Algorithm 1): T output rows; row t averages the records of a Poisson
subsample with rate q = m/n (m = mixup degree, n = dataset size), dividing by the
nominal m, and adds :math:`N(0, (C_x\sigma_x/m)^2 I)` to the feature mean and
:math:`N(0, (C_y\sigma_y/m)^2 I)` to the label mean. With add/remove-one
sensitivities :math:`C_x/m` and :math:`C_y/m`, one row is
:math:`\sqrt{1/\sigma_x^2 + 1/\sigma_y^2}`-GDP before subsampling (proof of Theorem
E.1), i.e. a single Gaussian mechanism with noise multiplier
:math:`\sigma = (1/\sigma_x^2 + 1/\sigma_y^2)^{-1/2}`. The whole release is therefore
T compositions of the Poisson(q)-subsampled Gaussian with noise multiplier sigma,
which :mod:`ncdp_fast.privacy.subsampled` accounts for exactly (PLD). Hierarchical
sampling with :math:`q_k = m/(n p_k)` has the same per-record inclusion probability
m/n and the same guarantee (Appendix E.2).

Neighbouring relation: add/remove one record (Appendix E).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from scipy.optimize import brentq

from .._validate import check_choice, check_delta, check_pos_int, check_positive
from .gdp import clt_noise_multiplier, dp_to_gdp, gdp_to_dp, poisson_gdp_mu
from .truncation import gdp_epsilon, ideal_delta
from .subsampled import (
    DEFAULT_EPSILON_RTOL,
    DEFAULT_VALUE_DISCRETIZATION_INTERVAL,
    calibrate_noise_multiplier,
    epsilon_poisson_gaussian,
)

__all__ = ["NeuroMixNoise", "neuromix_noise", "optimal_mixup_degree", "NU_STAR_OVER_MU"]


@dataclass(frozen=True)
class NeuroMixNoise:
    r"""Noise levels for NeuroMixGDP and the privacy report behind them.

    Unpacks as ``sigma_x, sigma_y = neuromix_noise(...)``; every field is also an
    attribute, and :meth:`as_dict` gives them all.

    Attributes:
        sigma_x: feature noise multiplier; the feature mean gets
            :math:`N(0, (C_x\sigma_x/m)^2 I)` (Algorithm 1).
        sigma_y: label noise multiplier; the label mean gets
            :math:`N(0, (C_y\sigma_y/m)^2 I)`.
        noise_multiplier: combined :math:`\sigma` with
            :math:`1/\sigma^2 = 1/\sigma_x^2 + 1/\sigma_y^2`.
        mu: :math:`\mu` = ``dp_to_gdp(epsilon, delta)``, the GDP target of Theorem 3.1.
        epsilon_target, delta: the requested (epsilon, delta).
        epsilon_clt: epsilon of the release by the CLT (GDP) accountant,
            ``gdp_to_dp(q*sqrt(T*(exp(1/sigma^2)-1)), delta)``. An approximation.
        epsilon_pld: epsilon by the PLD accountant (pessimistic, rigorous upper bound).
        sample_rate: q = m/n. n, mixup_degree, num_samples, lam: the inputs.
        accountant: ``"clt"`` or ``"pld"``, the one used to calibrate.
        value_discretization_interval: PLD grid step used for ``epsilon_pld``.
    """

    sigma_x: float
    sigma_y: float
    noise_multiplier: float
    mu: float
    epsilon_target: float
    delta: float
    epsilon_clt: float
    epsilon_pld: float
    sample_rate: float
    n: int
    mixup_degree: int
    num_samples: int
    lam: float
    accountant: str
    value_discretization_interval: float

    def __iter__(self):
        """Yield (sigma_x, sigma_y), so the result unpacks like a pair."""
        yield self.sigma_x
        yield self.sigma_y

    def as_dict(self) -> dict:
        """All fields as a JSON-serialisable dict."""
        return asdict(self)


def neuromix_noise(
    epsilon,
    delta,
    *,
    n,
    mixup_degree,
    num_samples,
    lam=1.0,
    accountant: str = "clt",
    value_discretization_interval=DEFAULT_VALUE_DISCRETIZATION_INTERVAL,
    epsilon_rtol=DEFAULT_EPSILON_RTOL,
) -> NeuroMixNoise:
    r"""Feature and label noise multipliers (sigma_x, sigma_y) for NeuroMixGDP.

    Accountant: ``"clt"`` (default) is Theorem 3.1 of the NeuroMixGDP paper, the
    GDP central-limit approximation: with :math:`\mu` = ``dp_to_gdp(epsilon, delta)``,
    q = m/n and T = ``num_samples``,

    .. math::
        \sigma_x = \frac{\sqrt{\lambda^2+1}}{\lambda\sqrt{\ln(1+\mu^2n^2/(m^2T))}},\qquad
        \sigma_y = \frac{\sqrt{\lambda^2+1}}{\sqrt{\ln(1+\mu^2n^2/(m^2T))}},

    so :math:`1/\sigma_x^2 + 1/\sigma_y^2 = 1/\sigma^2 = \ln(1+\mu^2n^2/(m^2T))` and
    :math:`\lambda = \sigma_y/\sigma_x`. The CLT is asymptotic (T to infinity with
    :math:`m\sqrt T/n` fixed) and may *underestimate* epsilon at finite T: e.g.
    epsilon = 1, delta = 1e-5, m = 64, n = T = 50000 gives sigma = 1.2602 whose PLD
    epsilon is about 1.01. ``"pld"`` calibrates sigma by the PLD accountant
    (:func:`calibrate_noise_multiplier`, T compositions of the Poisson(m/n)-subsampled
    Gaussian; rigorous) and splits it by lambda the same way
    (:math:`\sigma_x = \sigma\sqrt{\lambda^2+1}/\lambda`,
    :math:`\sigma_y = \sigma\sqrt{\lambda^2+1}`). Either way the report carries
    epsilon under both CLT and PLD.

    Neighbouring relation: add/remove one record (Appendix E of the paper).

    Args:
        epsilon: target :math:`\varepsilon > 0`.
        delta: target :math:`\delta \in (0, 1)`.
        n: dataset size, integer >= 1.
        mixup_degree: m, integer in [1, n] (expected group size; q = m/n).
        num_samples: T, number of released rows, integer >= 1.
        lam: :math:`\lambda > 0`, ratio sigma_y / sigma_x (paper suggests 0.2 to 4).
        accountant: ``"clt"`` or ``"pld"``.
        value_discretization_interval: PLD grid step (for ``"pld"`` calibration
            and for the ``epsilon_pld`` report).
        epsilon_rtol: calibration tolerance for ``"pld"``
            (see :func:`calibrate_noise_multiplier`).

    Returns:
        :class:`NeuroMixNoise` (unpacks to ``sigma_x, sigma_y``). The noise
        multipliers are relative to the clipping bounds: feature noise std is
        ``C_x * sigma_x / m``, label noise std ``C_y * sigma_y / m``.
    """
    e = check_positive(epsilon, "epsilon")
    d = check_delta(delta)
    n_ = check_pos_int(n, "n")
    m = check_pos_int(mixup_degree, "mixup_degree")
    if m > n_:
        raise ValueError(f"mixup_degree: expected an integer in [1, n={n_}], got {mixup_degree!r}")
    t = check_pos_int(num_samples, "num_samples")
    lam_ = check_positive(lam, "lam")
    check_choice(accountant, "accountant", ("clt", "pld"))
    q = m / n_
    # The GDP target leaves room for the sampler's truncated tails (privacy.truncation).
    mu = dp_to_gdp(e, ideal_delta(d, e))
    if accountant == "clt":
        # ln(1 + mu^2 n^2 / (m^2 T)) = ln(1 + mu^2 / (q^2 T)); Theorem 3.1.
        sigma = clt_noise_multiplier(mu, q, t)
    else:
        sigma = calibrate_noise_multiplier(
            e,
            d,
            q,
            t,
            "pld",
            epsilon_rtol=epsilon_rtol,
            value_discretization_interval=value_discretization_interval,
        )
    scale = math.sqrt(lam_ * lam_ + 1.0)
    sigma_x = sigma * scale / lam_
    sigma_y = sigma * scale
    mu_clt = poisson_gdp_mu(sigma, q, t)
    eps_clt = gdp_epsilon(mu_clt, d)
    eps_pld = epsilon_poisson_gaussian(
        sigma, q, t, d, "pld", value_discretization_interval=value_discretization_interval
    )
    return NeuroMixNoise(
        sigma_x=sigma_x,
        sigma_y=sigma_y,
        noise_multiplier=sigma,
        mu=mu,
        epsilon_target=e,
        delta=d,
        epsilon_clt=eps_clt,
        epsilon_pld=eps_pld,
        sample_rate=q,
        n=n_,
        mixup_degree=m,
        num_samples=t,
        lam=lam_,
        accountant=accountant,
        value_discretization_interval=float(value_discretization_interval),
    )


def _nu_star_over_mu() -> float:
    # nu* = argmax_nu nu*ln(1 + mu^2/nu^2) = c*mu, where x = c maximises
    # x*ln(1 + 1/x^2): derivative ln(1 + 1/x^2) - 2/(1 + x^2) = 0 (unique root > 0).
    return brentq(
        lambda x: math.log1p(1.0 / (x * x)) - 2.0 / (1.0 + x * x), 0.1, 10.0, xtol=1e-15, rtol=1e-15
    )


#: c = nu*/mu, the constant with nu* = argmax_nu nu ln(1 + mu^2/nu^2) = c mu (~0.5050).
NU_STAR_OVER_MU = _nu_star_over_mu()


def optimal_mixup_degree(mu, n, num_samples) -> float:
    r"""Asymptotically optimal mixup degree :math:`m^* = \nu^* n/\sqrt{T}` (Section 3.2).

    Accountant: GDP (the mixup degree is chosen for a :math:`\mu`-GDP release under
    Theorem 3.1). Neighbouring relation: add/remove one.

    In Theorem 3.2 the bias term of the least-squares error is proportional to
    :math:`1/\sqrt{\nu\ln(1+\mu^2/\nu^2)}` with :math:`\nu = m\sqrt{T}/n`; it falls
    as :math:`\nu\ln(1+\mu^2/\nu^2)` grows, so
    :math:`\nu^* = \arg\max_\nu \nu\ln(1+\mu^2/\nu^2)`. Substituting
    :math:`\nu = c\mu` shows :math:`\nu^* = c^*\mu` with :math:`c^*` the root of
    :math:`\ln(1+1/c^2) = 2/(1+c^2)` (:data:`NU_STAR_OVER_MU`, about 0.505).

    Args:
        mu: GDP target :math:`\mu > 0` (e.g. ``dp_to_gdp(epsilon, delta)``).
        n: dataset size, integer >= 1.
        num_samples: T, number of released rows, integer >= 1.

    Returns:
        :math:`m^* = c^*\mu n/\sqrt{T}` as a float (an asymptotic optimum; round it
        and keep it in [1, n] before use).
    """
    mu_ = check_positive(mu, "mu")
    n_ = check_pos_int(n, "n")
    t = check_pos_int(num_samples, "num_samples")
    return NU_STAR_OVER_MU * mu_ * n_ / math.sqrt(t)
