r"""Gaussian differential privacy (mu-GDP) and the central-limit accountant.

Accountant: f-DP / mu-GDP (Dong, Roth & Su 2022, "Gaussian differential privacy";
Bu, Dong, Long & Su 2020, "Deep learning with Gaussian differential privacy"), as used
for NeuroMixGDP (``shared/seeds/002_1ce43e1ce6039d97.txt``, Theorem 3.1, Appendix D-E).

Neighbouring relation: add/remove one record (the relation under which Appendix E
proves Theorem 3.1 and under which Poisson subsampling is analysed; Opacus's and
dp-accounting's default).

* mu-GDP to (epsilon, delta): Lemma D.3 of the NeuroMixGDP paper (Corollary 1 of
  Dong et al.): a mechanism is mu-GDP iff it is (epsilon, delta(epsilon))-DP for all
  epsilon >= 0 with

  .. math:: \delta(\varepsilon) = \Phi(-\varepsilon/\mu + \mu/2)
            - e^{\varepsilon}\,\Phi(-\varepsilon/\mu - \mu/2).

  This is the exact tradeoff: :func:`gdp_to_dp` and :func:`dp_to_gdp` invert it by
  bracketing (doubling) and Brent's method on its logarithm, evaluated without
  cancellation through the scaled complementary error function
  (:math:`\delta = \tfrac12 e^{-A^2/2}[\mathrm{erfcx}(A/\sqrt2) - \mathrm{erfcx}(B/\sqrt2)]`,
  :math:`A = \varepsilon/\mu - \mu/2`, :math:`B = \varepsilon/\mu + \mu/2`), so they
  work for any epsilon, including where the two terms above underflow or cancel
  (fixed brackets such as ``[0, 500]`` fail there).
* CLT for Poisson-subsampled Gaussian (Theorem E.2 = Bu et al. Theorem 5 with the
  typo corrected): T steps with sampling rate q and noise multiplier sigma are
  asymptotically mu-GDP with :math:`\mu = q\sqrt{T(e^{1/\sigma^2} - 1)}` as
  :math:`T\to\infty`, :math:`q\sqrt{T}\to\nu`. This is an approximation, not a
  bound: at finite T it can underestimate epsilon (see
  :func:`ncdp_fast.privacy.neuromix_noise`).
"""

from __future__ import annotations

import math
import warnings

from scipy.optimize import brentq
from scipy.special import erf, erfcx, log_ndtr, ndtr

from .._validate import check_delta, check_nonneg, check_pos_int, check_positive, check_probability

__all__ = ["gdp_delta", "gdp_to_dp", "dp_to_gdp", "poisson_gdp_mu", "clt_noise_multiplier",
           "warn_clt"]


def warn_clt(what: str, sample_rate: float, stacklevel: int = 3) -> None:
    """Warn that ``what`` answers with the CLT of Poisson-subsampled Gaussian steps.

    Away from q = 1 the CLT mu is a limit, not a bound: one step at sigma 0.5,
    q = 0.01 has a GDP epsilon of 0.284 at delta 1e-6 against 4.285 by PLD, and
    200 such steps calibrated to a GDP target of 4 (sigma 0.528) have a PLD
    epsilon of 7.94 (the seventh audit; privacy/subsampled.py measures both).
    Every GDP answer on subsampled steps goes through here, so none is silent."""
    warnings.warn(
        f"{what} with sample_rate={sample_rate!r} < 1 uses the central limit theorem of "
        "Poisson-subsampled Gaussian steps, an approximation that can understate epsilon "
        "many times over (one step at sigma 0.5, q 0.01: 0.28 against 4.29 by PLD at "
        "delta 1e-6); use accountant='pld' (or 'prv' / 'rdp') for a guarantee",
        UserWarning, stacklevel=stacklevel)

_RTOL = 4.0 * 2.220446049250313e-16 + 1e-18  # smallest rtol scipy's brentq accepts
_SQRT2 = math.sqrt(2.0)


_TWO_OVER_SQRT_PI = 2.0 / math.sqrt(math.pi)


def _inv_pow_drop(x: float, h: float, n: int) -> float:
    """x**-n - (x+h)**-n for x, h > 0, as a sum of positive terms (no cancellation)."""
    z = x + h
    return h * sum(x ** -(n - j) * z ** -(j + 1) for j in range(n))


# Coefficients of the asymptotic series erfcx(x) ~ sum_k c_k x^-(2k+1) / sqrt(pi),
# c_k = (-1)^k (2k-1)!! / 2^k; ten terms leave a relative error < 1e-20 for x >= 30.
_ERFCX_ASYMPTOTIC = []
_c = 1.0
for _k in range(10):
    _ERFCX_ASYMPTOTIC.append(_c)
    _c *= -(2 * _k + 1) / 2.0
del _c, _k


def _erfcx_drop(x: float, h: float) -> float:
    """erfcx(x) - erfcx(x + h) for h > 0, without catastrophic cancellation.

    x >= 30: difference of the asymptotic series term by term, each term's
    difference written as a sum of positive numbers. Small h: Taylor series about x
    with the derivative recursion y' = 2xy - 2/sqrt(pi),
    y^(k+1) = 2k y^(k-1) + 2x y^(k). Otherwise direct subtraction (relative error
    ~1e-16 * x / h, below 1e-12 in that range).
    """
    z = x + h
    if x >= 30.0:
        total = 0.0
        for k, c in enumerate(_ERFCX_ASYMPTOTIC):
            total += c * _inv_pow_drop(x, h, 2 * k + 1)
        return total / math.sqrt(math.pi)
    if h > 1e-2:
        return float(erfcx(x)) - float(erfcx(z))
    y_prev = float(erfcx(x))  # y^(0)
    y_k = 2.0 * x * y_prev - _TWO_OVER_SQRT_PI  # y^(1)
    total = 0.0
    coef = 1.0
    for k in range(1, 40):
        coef *= h / k  # h^k / k!
        term = y_k * coef
        total -= term
        if abs(term) <= 1e-17 * abs(total):
            break
        y_prev, y_k = y_k, 2.0 * k * y_prev + 2.0 * x * y_k
    return total


def _log_gdp_delta(mu: float, eps: float) -> float:
    """log delta(eps) of mu-GDP, mu > 0, eps >= 0, stable for all magnitudes."""
    a = eps / mu - mu / 2.0
    b = eps / mu + mu / 2.0
    if a > -5.0:
        # delta = 0.5*exp(-a^2/2) * (erfcx(a/sqrt2) - erfcx(b/sqrt2)); exact identity
        # because b^2/2 - eps = a^2/2. erfcx is decreasing, so the bracket is > 0.
        diff = _erfcx_drop(a / _SQRT2, mu / _SQRT2)
        if diff <= 0.0:
            return -math.inf
        return math.log(0.5) - 0.5 * a * a + math.log(diff)
    # a <= -5: Phi(-a) ~ 1, no cancellation in the difference.
    d = float(ndtr(-a)) - math.exp(eps + float(log_ndtr(-b)))
    return math.log(d) if d > 0.0 else -math.inf


def gdp_delta(mu, epsilon) -> float:
    r"""delta(epsilon) of a mu-GDP mechanism (Lemma D.3; Dong et al. Cor. 1).

    Accountant: mu-GDP (exact tradeoff curve). Neighbouring relation: that of the
    mu-GDP guarantee (add/remove one in this package).

    .. math:: \delta(\varepsilon) = \Phi(-\varepsilon/\mu + \mu/2)
              - e^{\varepsilon}\Phi(-\varepsilon/\mu - \mu/2)

    evaluated in a cancellation-free form (module docstring).

    Args:
        mu: GDP parameter :math:`\mu \ge 0` (dimensionless); 0 gives delta 0.
        epsilon: :math:`\varepsilon \ge 0`.

    Returns:
        delta in [0, 1).
    """
    m = check_nonneg(mu, "mu")
    e = check_nonneg(epsilon, "epsilon")
    if m == 0.0:
        return 0.0
    return math.exp(_log_gdp_delta(m, e))


def gdp_to_dp(mu, delta) -> float:
    r"""Smallest epsilon such that a mu-GDP mechanism is (epsilon, delta)-DP.

    Accountant: mu-GDP, exact conversion (Lemma D.3 of the NeuroMixGDP paper).
    Neighbouring relation: that of the mu-GDP guarantee (add/remove one here).

    Solves :math:`\delta(\varepsilon) = \delta` for epsilon (delta(epsilon) is strictly
    decreasing) by doubling an upper bracket and Brent's method on
    :math:`\log\delta(\varepsilon)`; relative precision ~1e-15.

    Args:
        mu: :math:`\mu \ge 0`, finite.
        delta: :math:`\delta \in (0, 1)`.

    Returns:
        epsilon >= 0. It is 0.0 when :math:`\delta \ge \delta(0) = 2\Phi(\mu/2) - 1`
        (the mechanism is then (0, delta)-DP), and ``inf`` when epsilon exceeds
        the largest float (mu above about 1.3e154).
    """
    m = check_nonneg(mu, "mu")
    d = check_delta(delta)
    if m == 0.0:
        return 0.0
    if float(erf(m / (2.0 * _SQRT2))) <= d:  # delta(0) = 2 Phi(mu/2) - 1
        return 0.0
    log_d = math.log(d)

    def h(e: float) -> float:  # decreasing in e, h(0) > 0
        return _log_gdp_delta(m, e) - log_d

    hi = max(1.0, m * m)
    while math.isfinite(hi) and h(hi) > 0.0:
        hi *= 2.0
    if not math.isfinite(hi):
        return math.inf          # delta(epsilon) > delta at the largest float epsilon
    return brentq(h, 0.0, hi, xtol=1e-300, rtol=_RTOL, maxiter=1000)


def dp_to_gdp(epsilon, delta) -> float:
    r"""The mu for which mu-GDP is exactly (epsilon, delta)-DP at this epsilon.

    Accountant: mu-GDP, exact (Lemma D.3; Dong et al. Cor. 1). Neighbouring
    relation: add/remove one (inherited by whatever mechanism is calibrated to mu).

    Solves :math:`\Phi(-\varepsilon/\mu + \mu/2) - e^{\varepsilon}\Phi(-\varepsilon/\mu
    - \mu/2) = \delta` for mu (the left side is strictly increasing in mu), by
    doubling/halving a bracket around mu = 1 and Brent's method on the logarithm of
    the left side, which is evaluated without cancellation. Robust for any
    epsilon > 0 and delta in (0, 1); relative precision ~1e-15.

    Args:
        epsilon: :math:`\varepsilon > 0`.
        delta: :math:`\delta \in (0, 1)`.

    Returns:
        mu > 0. Any mu'-GDP mechanism with mu' <= mu is (epsilon, delta)-DP.
    """
    e = check_positive(epsilon, "epsilon")
    d = check_delta(delta)
    log_d = math.log(d)

    def h(m: float) -> float:  # increasing in m
        return _log_gdp_delta(m, e) - log_d

    lo, hi = 0.5, 1.0
    if h(hi) > 0.0:
        while h(lo) > 0.0:
            lo, hi = 0.5 * lo, lo
    else:
        lo, hi = hi, 2.0
        while h(hi) <= 0.0:
            lo, hi = hi, 2.0 * hi
    return brentq(h, lo, hi, xtol=1e-300, rtol=_RTOL, maxiter=1000)


def poisson_gdp_mu(noise_multiplier, sample_rate, steps) -> float:
    r"""CLT mu of T compositions of the Poisson-subsampled Gaussian mechanism.

    Accountant: GDP central-limit approximation (Theorem E.2 of the NeuroMixGDP
    paper = Bu et al. 2020, Theorem 5, typo corrected; same formula as Opacus's
    ``compute_mu_poisson``). Neighbouring relation: add/remove one.

    .. math:: \mu = q\sqrt{T\,(e^{1/\sigma^2} - 1)}

    This is the limit as :math:`T\to\infty` with :math:`q\sqrt T` fixed; at finite T it
    is an approximation that can *underestimate* the privacy loss, so use the PLD
    accountant for a claim you must defend. For q = 1 (no subsampling) the exact
    value is :math:`\sqrt{T}/\sigma`, which :func:`epsilon_poisson_gaussian` uses; this
    function returns the formula above for every q.

    Args:
        noise_multiplier: :math:`\sigma > 0`, noise standard deviation divided by
            the L2 sensitivity.
        sample_rate: Poisson sampling probability :math:`q \in (0, 1]`.
        steps: number of compositions T >= 1.

    Returns:
        mu >= 0 (``inf`` when :math:`e^{1/\sigma^2}` overflows the result).
    """
    s = check_positive(noise_multiplier, "noise_multiplier")
    q = check_probability(sample_rate, "sample_rate")
    t = check_pos_int(steps, "steps")
    x = 1.0 / (s * s) if s * s > 0.0 else math.inf     # s below ~1e-162
    if x < 700.0:
        return q * math.sqrt(t * math.expm1(x))
    log_mu = math.log(q) + 0.5 * (math.log(t) + x + math.log1p(-math.exp(-x)))
    return math.exp(log_mu) if log_mu < 709.0 else math.inf


def clt_noise_multiplier(mu, sample_rate, steps) -> float:
    r"""Noise multiplier whose CLT mu (:func:`poisson_gdp_mu`) equals ``mu``.

    Accountant: GDP central-limit approximation (inverse of Theorem E.2;
    the combined noise multiplier of Theorem 3.1 of the NeuroMixGDP paper with
    q = m/n). Neighbouring relation: add/remove one.

    .. math:: \sigma = 1/\sqrt{\log(1 + \mu^2/(q^2 T))}

    Args:
        mu: target :math:`\mu > 0`.
        sample_rate: :math:`q \in (0, 1]`.
        steps: T >= 1.

    Returns:
        sigma > 0.
    """
    m = check_positive(mu, "mu")
    q = check_probability(sample_rate, "sample_rate")
    t = check_pos_int(steps, "steps")
    return 1.0 / math.sqrt(math.log1p(m * m / (q * q * t)))
