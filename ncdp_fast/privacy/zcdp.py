r"""Zero-concentrated differential privacy (zCDP) for NoisyGD.

Accountant: zCDP (Bun & Steinke 2016), as used by the NoisyGD paper
(``shared/seeds/000_82fe6240ae4b04be.txt``, Definition 2.1 and eq. 2.1).

Neighbouring relation: add/remove one record (Definition 2.1 of that paper). The
formulas below hold unchanged under replace-one provided the sensitivity is the
replace-one sensitivity.

A mechanism is :math:`\rho`-zCDP when :math:`D_\alpha(M(D)\|M(D')) \le \rho\alpha` for
all :math:`\alpha > 1` and all neighbours. Facts used here:

* Gaussian mechanism, L2 sensitivity :math:`\Delta`, noise :math:`N(0, \sigma^2 I)`:
  :math:`\rho = \Delta^2 / (2\sigma^2)` (Bun & Steinke 2016, Prop. 1.6).
* Composition adds: T such steps are :math:`T\rho`-zCDP (eq. 2.1 of the paper).
* zCDP to (epsilon, delta)-DP: the "standard" conversion
  :math:`\varepsilon = \rho + 2\sqrt{\rho\log(1/\delta)}` (Bun & Steinke 2016,
  Prop. 1.3; the one quoted below Definition 2.1 of the paper) and the tighter
  Canonne--Kamath--Steinke conversion (CKS 2020, "The discrete Gaussian for
  differential privacy", Prop. 12 / Cor. 13):

  .. math::
     \varepsilon(\rho,\delta) = \inf_{\alpha>1}\;
        \rho\alpha + \log(1 - 1/\alpha) - \frac{\log\delta + \log\alpha}{\alpha - 1}.

  The infimum is attained at the unique root of
  :math:`\rho(\alpha-1)^2 + \log\alpha + \log\delta = 0` (the derivative of the
  objective), which is found by bracketed root finding, so the result is exact to
  machine precision rather than limited to a grid of orders.
"""

from __future__ import annotations

import math
import sys

from scipy.optimize import brentq

from .._validate import check_choice, check_delta, check_nonneg, check_pos_int, check_positive

__all__ = ["zcdp_to_dp", "dp_to_zcdp", "gaussian_zcdp", "noisygd_sigma"]

_METHODS = ("tight", "standard")
_RTOL = 4.0 * 2.220446049250313e-16 + 1e-18  # smallest rtol scipy's brentq accepts


def _cks_epsilon(rho: float, log_delta: float) -> float:
    """CKS conversion at the optimal order (rho > 0, log_delta < 0). May be < 0."""
    # Optimal order alpha = 1 + u solves g(u) = rho*u^2 + log1p(u) + log_delta = 0,
    # g(0) = log_delta < 0 and g(u_hi) > 0 for u_hi = sqrt(-log_delta / rho).
    # The margin keeps g(u_hi) > 0 after rounding: at rho = 1e100 the exact bound
    # gave g(u_hi) = 0 in floats and the bracket had no sign change.
    u_hi = math.sqrt(-log_delta / rho) * (1.0 + 1e-6)
    u = brentq(
        lambda v: rho * v * v + math.log1p(v) + log_delta,
        0.0,
        u_hi,
        xtol=1e-300,
        rtol=_RTOL,
        maxiter=500,
    )
    if u <= 0.0:  # pragma: no cover - g(0) < 0 makes this unreachable
        u = 5e-324
    # Objective at alpha = 1 + u, written in u to keep precision when alpha -> 1.
    return rho * (1.0 + u) + math.log(u / (1.0 + u)) - (log_delta + math.log1p(u)) / u


def zcdp_to_dp(rho, delta, method: str = "tight") -> float:
    r"""Convert :math:`\rho`-zCDP to :math:`(\varepsilon, \delta)`-DP; return epsilon.

    Accountant: zCDP. Neighbouring relation: whatever relation the zCDP guarantee
    was proved under (add/remove one in this package); the conversion does not
    change it.

    Args:
        rho: total zCDP parameter :math:`\rho \ge 0` (dimensionless; e.g. from
            :func:`gaussian_zcdp` times the number of steps). ``rho = 0`` gives 0.
        delta: target :math:`\delta \in (0, 1)`.
        method: ``"tight"`` (default) -- the Canonne--Kamath--Steinke conversion
            :math:`\inf_{\alpha>1} \rho\alpha + \log(1-1/\alpha) -
            (\log\delta+\log\alpha)/(\alpha-1)`, minimised exactly over continuous
            :math:`\alpha`; ``"standard"`` -- :math:`\rho + 2\sqrt{\rho\log(1/\delta)}`
            (Bun & Steinke 2016, Prop. 1.3; quoted after Definition 2.1 of the
            NoisyGD paper). ``"tight"`` is never larger than ``"standard"``.

    Returns:
        epsilon >= 0 such that every :math:`\rho`-zCDP mechanism is
        :math:`(\varepsilon, \delta)`-DP. When the bound is negative the mechanism
        is :math:`(0, \delta)`-DP and 0.0 is returned.
    """
    r = check_nonneg(rho, "rho")
    d = check_delta(delta)
    check_choice(method, "method", _METHODS)
    if r == 0.0:
        return 0.0
    log_1_over_delta = -math.log(d)
    if method == "standard":
        return r + 2.0 * math.sqrt(r * log_1_over_delta)
    return max(0.0, _cks_epsilon(r, -log_1_over_delta))


def dp_to_zcdp(epsilon, delta, method: str = "tight") -> float:
    r"""Largest :math:`\rho` whose zCDP-to-DP conversion gives at most epsilon.

    Accountant: zCDP (the inverse of :func:`zcdp_to_dp`). Neighbouring relation:
    add/remove one (inherited from the mechanism being calibrated).

    Use it to turn an :math:`(\varepsilon,\delta)` target into a zCDP budget for
    NoisyGD, then :func:`noisygd_sigma` to get the noise.

    Args:
        epsilon: target :math:`\varepsilon > 0`.
        delta: target :math:`\delta \in (0, 1)`.
        method: ``"tight"`` (inverse of the CKS conversion, solved by bracketed
            root finding to relative precision ~1e-15) or ``"standard"``
            (closed form :math:`\rho = (\sqrt{\varepsilon + L} - \sqrt{L})^2`,
            :math:`L = \log(1/\delta)`, written without cancellation as
            :math:`(\varepsilon/(\sqrt{\varepsilon+L}+\sqrt{L}))^2`).

    Returns:
        :math:`\rho > 0` with ``zcdp_to_dp(rho, delta, method) == epsilon`` up to
        rounding (round trip to ~1e-12 relative).
    """
    e = check_positive(epsilon, "epsilon")
    d = check_delta(delta)
    check_choice(method, "method", _METHODS)
    L = -math.log(d)
    rho_std = (e / (math.sqrt(e + L) + math.sqrt(L))) ** 2
    if method == "standard":
        return rho_std
    # The tight conversion gives a smaller epsilon than the standard one for the
    # same rho, so rho_tight(epsilon) >= rho_std(epsilon): bracket upward from it.
    def f(r: float) -> float:  # increasing in r
        return _cks_epsilon(r, -L) - e

    lo = rho_std
    while f(lo) > 0.0:  # not expected (tight <= standard); kept as a safeguard
        lo *= 0.5
    hi = min(2.0 * lo, sys.float_info.max)   # rho <= epsilon, so the cap brackets
    while f(hi) <= 0.0:
        lo, hi = hi, 2.0 * hi
    return brentq(f, lo, hi, xtol=1e-300, rtol=_RTOL, maxiter=500)


def gaussian_zcdp(sensitivity, sigma) -> float:
    r"""zCDP parameter of one Gaussian mechanism: :math:`\rho = \Delta^2/(2\sigma^2)`.

    Accountant: zCDP (Bun & Steinke 2016, Prop. 1.6). Neighbouring relation:
    add/remove one when ``sensitivity`` is the add/remove L2 sensitivity (for a
    sum of per-example gradients clipped to norm C, :math:`\Delta = C`).

    Args:
        sensitivity: L2 sensitivity :math:`\Delta > 0`, in the units of the released
            vector.
        sigma: standard deviation of the isotropic Gaussian noise, same units as
            ``sensitivity`` (not a noise multiplier; a noise multiplier z
            corresponds to ``sigma = z * sensitivity``).

    Returns:
        :math:`\rho` of one release (``inf`` when it overflows a float: no
        guarantee). T releases compose to :math:`T\rho`.
    """
    s = check_positive(sensitivity, "sensitivity")
    sg = check_positive(sigma, "sigma")
    ratio = s / sg
    return ratio * ratio / 2.0      # a product overflows to inf; ** raised OverflowError


def noisygd_sigma(rho_total, steps, sensitivity=1.0) -> float:
    r"""Noise standard deviation for NoisyGD meeting a total zCDP budget.

    Accountant: zCDP. Neighbouring relation: add/remove one. Implements eq. 2.1
    of the NoisyGD paper: each of the T full-batch steps adds
    :math:`N(0, G^2/(2\rho) I)` to the summed gradient and is :math:`\rho`-zCDP, so T
    steps are :math:`T\rho`-zCDP. With :math:`\rho = \rho_{total}/T`:

    .. math:: \sigma = G\sqrt{T / (2\rho_{total})}.

    Args:
        rho_total: zCDP budget of the whole run, :math:`\rho_{total} > 0`.
        steps: number of NoisyGD iterations T >= 1 (full batch, no subsampling).
        sensitivity: L2 sensitivity G of the summed gradient (the clipping norm
            for per-example clipped gradients), > 0.

    Returns:
        sigma, the standard deviation of the Gaussian noise added to the summed
        gradient at every step, in the units of ``sensitivity``. The noise
        multiplier is ``sigma / sensitivity``.
    """
    r = check_positive(rho_total, "rho_total")
    t = check_pos_int(steps, "steps")
    g = check_positive(sensitivity, "sensitivity")
    return g * math.sqrt(t / (2.0 * r))
