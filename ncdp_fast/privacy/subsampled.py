r"""Poisson-subsampled Gaussian mechanism (DP-SGD, NeuroMixGDP): epsilon and calibration.

Accountants:

* ``"pld"`` -- privacy loss distributions, dp-accounting's
  :class:`dp_accounting.pld.PLDAccountant` composition, taken stage by stage with
  each stage's memory forecast first (:mod:`.pld`) (Koskela et al.; Doroshenko et al.
  2022, "Connect the dots"). The event is ``SelfComposedDpEvent(PoissonSampledDpEvent(q,
  GaussianDpEvent(sigma)), T)`` (``GaussianDpEvent(sigma)`` self-composed when q = 1).
  Discretisation is *pessimistic*: dp-accounting's connect-the-dots construction with
  ``pessimistic_estimate=True`` and truncated tail mass counted as infinite privacy
  loss, so the reported epsilon is an upper bound on the true epsilon of the
  mechanism. The grid step ``value_discretization_interval`` (default
  :data:`DEFAULT_VALUE_DISCRETIZATION_INTERVAL` = 1e-4, dp-accounting's default) sets
  how loose that bound is: measured at T = 1e5, q = 0.01, epsilon near 1, it is
  within 0.1 % of the 1e-5 grid.
* ``"rdp"`` -- Renyi DP, dp-accounting's :class:`dp_accounting.rdp.RdpAccountant`
  with its default orders (1.1 ... 10.9, 11 ... 63, 128, 256, 512, 1024) and the
  RDP-to-DP conversion of Balle et al. 2020 / Canonne et al. 2020 (Prop. 12). A
  rigorous upper bound, looser than PLD.
* ``"gdp"`` -- the GDP central-limit approximation
  :math:`\mu = q\sqrt{T(e^{1/\sigma^2}-1)}` (Bu et al. 2020, Thm 5; NeuroMixGDP
  Theorem E.2) converted exactly to (epsilon, delta). For q = 1 it uses the exact
  :math:`\mu = \sqrt{T}/\sigma` (Dong et al. 2022, Thm 1 and Cor. 2). Not an upper
  bound for q < 1: at finite T it can underestimate epsilon.

Neighbouring relation: add/remove one record (``NeighboringRelation.ADD_OR_REMOVE_ONE``,
the relation of dp-accounting's and Opacus's Poisson-subsampled accountants). For
PLD, dp-accounting takes the worse of the "remove" and "add" privacy loss
distributions.

The noise multiplier sigma is the noise standard deviation divided by the L2
sensitivity of one record's contribution (the clipping norm for DP-SGD).
"""

from __future__ import annotations

import math

from .._validate import check_choice, check_delta, check_pos_int, check_positive, check_probability
from ._validate import check_discretization_interval, check_epsilon_rtol, import_dp_accounting
from .gdp import clt_noise_multiplier, dp_to_gdp, poisson_gdp_mu, warn_clt
from .pld import pld_epsilon_of
from .truncation import beyond_truncation, epsilon_with_truncation, gdp_epsilon, ideal_delta

__all__ = [
    "DEFAULT_VALUE_DISCRETIZATION_INTERVAL",
    "DEFAULT_EPSILON_RTOL",
    "epsilon_poisson_gaussian",
    "calibrate_noise_multiplier",
    "search_noise_multiplier",
]

#: PLD grid step (in nats of privacy loss) used unless the caller gives another.
#: dp-accounting's own default; pessimistic (upper-bound) discretisation.
DEFAULT_VALUE_DISCRETIZATION_INTERVAL = 1e-4

#: Relative tolerance in epsilon of :func:`calibrate_noise_multiplier`: the returned
#: sigma has target*(1 - rtol) <= epsilon(sigma) <= target.
DEFAULT_EPSILON_RTOL = 1e-3

_ACCOUNTANTS = ("pld", "rdp", "gdp")

# Search limits for calibration (noise multipliers outside are not meaningful).
_SIGMA_MIN = 1e-2
_SIGMA_MAX = 1e6


def gaussian_event(dpa, sigma: float, q: float, steps: int):
    """dp-accounting event for T steps of the Poisson-subsampled Gaussian."""
    if q == 1.0:
        inner = dpa.GaussianDpEvent(sigma)
    else:
        inner = dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma))
    return dpa.SelfComposedDpEvent(inner, steps)


# dp-accounting squares the noise multiplier in its loss and order formulas: past
# these bounds a float overflows (OverflowError) or a division by zero raises.
_SIGMA_CAP = 1e100
_SIGMA_FLOOR = 1e-100


def accountable_groups(groups):
    """``{(sigma, q): steps}`` as dp-accounting can take it, or None when a sigma
    lies below 1e-100 (the answer is then reported as inf, a valid bound).  A
    sigma above 1e100 is accounted at 1e100: its output is the capped
    mechanism's plus independent noise (post-processing), so the cap's epsilon
    bounds it from above."""
    out: dict = {}
    for (s, q), t in groups.items():
        if s < _SIGMA_FLOOR:
            return None
        key = (min(s, _SIGMA_CAP), q)
        out[key] = out.get(key, 0) + t
    return out


def history_event(dpa, groups, rho: float = 0.0):
    """The Gaussian groups ``{(sigma, q): steps}`` (and a rho-zCDP term) as one
    dp-accounting ``ComposedDpEvent``."""
    events = [gaussian_event(dpa, s, q, t) for (s, q), t in groups.items()]
    if rho > 0.0:
        events.append(dpa.ZCDpEvent(rho))
    return dpa.ComposedDpEvent(events)


def dpa_epsilon_of(groups, accountant: str, interval: float, what: str, rho: float = 0.0):
    """delta -> epsilon of the Gaussian groups ``{(sigma, q): steps}`` by
    dp-accounting's PLD (:mod:`.pld`, which forecasts the memory first; no
    zCDP term) or RDP accountant (plus a rho-zCDP term); a composition too
    large is refused naming ``what``."""
    if accountant == "pld":
        return pld_epsilon_of(groups, interval, what)
    dpa = import_dp_accounting()
    acc = dpa.rdp.RdpAccountant(neighboring_relation=dpa.NeighboringRelation.ADD_OR_REMOVE_ONE)
    acc.compose(history_event(dpa, groups, rho))
    return lambda delta: float(acc.get_epsilon(delta))


def _epsilon(sigma, q, steps, delta, accountant, interval) -> float:
    """epsilon at delta of the sampler as implemented: the ideal accountant's, with
    the truncated tails charged (privacy.truncation)."""
    if accountant == "gdp":
        mu = math.sqrt(steps) / sigma if q == 1.0 else poisson_gdp_mu(sigma, q, steps)
        return gdp_epsilon(mu, delta)
    if accountant == "pld" and beyond_truncation([(sigma, q)], delta):
        return math.inf          # before a PLD that would not fit in memory
    groups = accountable_groups({(sigma, q): steps})
    if groups is None:
        return math.inf
    return epsilon_with_truncation(dpa_epsilon_of(groups, accountant, interval, "steps"), delta)


def epsilon_poisson_gaussian(
    noise_multiplier,
    sample_rate,
    steps,
    delta,
    accountant: str = "pld",
    *,
    value_discretization_interval=DEFAULT_VALUE_DISCRETIZATION_INTERVAL,
) -> float:
    r"""epsilon of T compositions of the Poisson-subsampled Gaussian mechanism.

    Each step includes every record independently with probability q and releases
    the sum of the included records' contributions (L2 norm <= C) plus
    :math:`N(0, \sigma^2 C^2 I)`; this is DP-SGD, and NeuroMixGDP's Algorithm 1 with
    q = m/n and :math:`1/\sigma^2 = 1/\sigma_x^2 + 1/\sigma_y^2`.

    Accountant: ``"pld"`` (default; dp-accounting PLD, pessimistic, a rigorous
    upper bound), ``"rdp"`` (dp-accounting RDP, rigorous, looser) or ``"gdp"``
    (CLT approximation :math:`\mu = q\sqrt{T(e^{1/\sigma^2}-1)}` converted exactly by
    Lemma D.3; exact :math:`\mu=\sqrt T/\sigma` when q = 1; *not* an upper bound when
    q < 1). See the module docstring for the formulas.

    Neighbouring relation: add/remove one record.

    Args:
        noise_multiplier: :math:`\sigma > 0`: noise standard deviation / L2 sensitivity.
        sample_rate: Poisson sampling probability :math:`q \in (0, 1]` (1 = full batch).
        steps: number of compositions T >= 1.
        delta: target :math:`\delta \in (0, 1)`.
        accountant: ``"pld"``, ``"rdp"`` or ``"gdp"``.
        value_discretization_interval: PLD grid step in nats (``"pld"`` only),
            in (0, 1]; smaller is tighter and slower.

    Returns:
        epsilon >= 0 (``inf`` when the accountant finds no finite epsilon), with the
        sampler's truncated tails charged: the accountant's delta at it plus
        :func:`~ncdp_fast.privacy.truncation_delta` is at most ``delta``.  A noise
        multiplier above 1e100 is accounted at 1e100 (an upper bound); below
        1e-100 the answer is ``inf`` (dp-accounting's arithmetic overflows there).

    Raises:
        ValueError: a PLD too large to build (``steps`` around 1e12 asked 38 GiB);
            ``accountant="rdp"`` answers in constant memory.
        UserWarning: ``"gdp"`` with ``sample_rate < 1`` (the CLT, not a bound).
    """
    s = check_positive(noise_multiplier, "noise_multiplier")
    q = check_probability(sample_rate, "sample_rate")
    t = check_pos_int(steps, "steps")
    d = check_delta(delta)
    check_choice(accountant, "accountant", _ACCOUNTANTS)
    interval = check_discretization_interval(value_discretization_interval)
    if accountant == "gdp" and q < 1.0:
        warn_clt("epsilon_poisson_gaussian(accountant='gdp')", q)
    return _epsilon(s, q, t, d, accountant, interval)


def calibrate_noise_multiplier(
    target_epsilon,
    delta,
    sample_rate,
    steps,
    accountant: str = "pld",
    *,
    epsilon_rtol=DEFAULT_EPSILON_RTOL,
    value_discretization_interval=DEFAULT_VALUE_DISCRETIZATION_INTERVAL,
) -> float:
    r"""Smallest noise multiplier whose epsilon does not exceed ``target_epsilon``.

    Accountant: as in :func:`epsilon_poisson_gaussian` (``"pld"`` default, ``"rdp"``,
    ``"gdp"``). Neighbouring relation: add/remove one record, Poisson subsampling.

    Guarantee: the returned sigma satisfies ``epsilon(sigma) <= target_epsilon`` as
    computed by the chosen accountant with the same ``value_discretization_interval``
    (for PLD this is a pessimistic bound, so the true epsilon is lower still), and
    ``epsilon(sigma) >= (1 - epsilon_rtol) * target_epsilon``, so sigma is within the
    tolerance of the smallest admissible one (sigma is searched to relative
    precision 1e-9 at most; if epsilon(sigma) jumps across the tolerance band, the
    smallest evaluated sigma with epsilon <= target is returned).

    Method: ``"gdp"`` is the closed form :math:`\sigma = 1/\sqrt{\log(1 +
    \mu^2/(q^2T))}` with :math:`\mu` = :func:`dp_to_gdp` (target, delta) (exact
    :math:`\sigma = \sqrt T/\mu` for q = 1). ``"pld"`` and ``"rdp"`` start from that
    CLT value, bracket the root by geometric steps in sigma (epsilon is decreasing
    in sigma), then narrow the bracket by the Illinois variant of regula falsi on
    (log sigma, log epsilon), which needs ~3-6 accountant evaluations (up to ~15), keeping an
    upper endpoint whose epsilon is <= target at every step.

    Args:
        target_epsilon: :math:`\varepsilon > 0` to meet.
        delta: :math:`\delta \in (0, 1)`.
        sample_rate: :math:`q \in (0, 1]`.
        steps: T >= 1.
        accountant: ``"pld"``, ``"rdp"`` or ``"gdp"``.
        epsilon_rtol: relative tolerance in epsilon, in (0, 0.5]; default 1e-3.
        value_discretization_interval: PLD grid step (``"pld"`` only).

    Returns:
        sigma > 0 (noise standard deviation / L2 sensitivity).

    Raises:
        ValueError: bad arguments, or no sigma in [1e-2, 1e6] meets the target
            (target too small for the search range / too large to need noise).

    Warns:
        UserWarning: ``"gdp"`` with ``sample_rate < 1``: the CLT is an
            approximation there and can understate epsilon (measured: a target
            of 8 at q = 0.01, T = 1000 has a PLD epsilon above 10).
    """
    e_t = check_positive(target_epsilon, "target_epsilon")
    d = check_delta(delta)
    q = check_probability(sample_rate, "sample_rate")
    t = check_pos_int(steps, "steps")
    check_choice(accountant, "accountant", _ACCOUNTANTS)
    rtol = check_epsilon_rtol(epsilon_rtol)
    interval = check_discretization_interval(value_discretization_interval)

    if accountant == "gdp" and q < 1.0:
        # The issue-35 audit: the CLT sigma for a target of 8 had a PLD epsilon of 10.26.
        warn_clt("calibrate_noise_multiplier(accountant='gdp')", q)
    # The start (the closed form for "gdp") leaves room for the truncation charge.
    mu = dp_to_gdp(e_t, ideal_delta(d, e_t))
    sigma0 = math.sqrt(t) / mu if q == 1.0 else clt_noise_multiplier(mu, q, t)

    def eps(sigma: float) -> float:
        return _epsilon(sigma, q, t, d, accountant, interval)

    return search_noise_multiplier(
        eps,
        e_t,
        sigma0,
        closed_form=accountant == "gdp",
        epsilon_rtol=rtol,
        problem=f"target_epsilon={e_t!r} (delta={d!r}, sample_rate={q!r}, steps={t})",
        accountant=accountant,
    )


def search_noise_multiplier(
    epsilon_of,
    target_epsilon: float,
    sigma0: float,
    *,
    closed_form: bool = False,
    epsilon_rtol=DEFAULT_EPSILON_RTOL,
    problem: str | None = None,
    accountant: str = "",
) -> float:
    r"""Smallest sigma with ``epsilon_of(sigma) <= target_epsilon``, to tolerance.

    The search behind :func:`calibrate_noise_multiplier`, for any accountant whose
    epsilon is non-increasing in the noise multiplier (the hierarchical-sampling
    accountant of :mod:`ncdp_fast.privacy.hierarchical` uses it too).

    ``closed_form=True``: ``sigma0`` already solves ``epsilon_of(sigma) = target`` (a
    CLT closed form); it is only nudged upward, by relative steps of 1e-12, until
    rounding no longer puts epsilon a hair above the target. Otherwise ``sigma0`` (a
    starting guess, clamped to [1e-2, 1e6]) is bracketed by geometric steps and the
    bracket narrowed by the Illinois variant of regula falsi on
    (log sigma, log epsilon), keeping an upper endpoint whose epsilon is <= target at
    every step, until ``epsilon(sigma) >= (1 - epsilon_rtol) * target`` or sigma is
    known to relative precision 1e-9.

    Args:
        epsilon_of: sigma -> epsilon (may return ``inf``).
        target_epsilon: epsilon > 0 to meet.
        sigma0: starting noise multiplier > 0.
        closed_form: see above.
        epsilon_rtol: relative tolerance in epsilon, in (0, 0.5].
        problem, accountant: named in the error raised when no sigma in [1e-2, 1e6]
            meets the target (``problem`` defaults to ``"target_epsilon=..."``).

    Returns:
        sigma with ``epsilon_of(sigma) <= target_epsilon`` (an evaluated point).
    """
    if not callable(epsilon_of):
        raise TypeError(f"epsilon_of: expected a function sigma -> epsilon, got "
                        f"{type(epsilon_of).__name__}")
    e_t = check_positive(target_epsilon, "target_epsilon")
    # A NaN start never brackets (the search looped forever: the sixth audit).
    sigma0 = check_positive(sigma0, "sigma0")
    rtol = check_epsilon_rtol(epsilon_rtol)
    problem = f"target_epsilon={e_t!r}" if problem is None else problem
    under = f" under {accountant!r}" if accountant else ""

    if closed_form:
        sigma = sigma0
        for _ in range(64):
            if epsilon_of(sigma) <= e_t:
                return sigma
            sigma *= 1.0 + 1e-12
        raise RuntimeError("closed-form calibration failed to meet the target")  # pragma: no cover

    sigma0 = min(max(sigma0, _SIGMA_MIN), _SIGMA_MAX)
    e0 = epsilon_of(sigma0)
    # Bracket: lo has eps > target, hi has eps <= target.
    factor = 1.25
    if e0 > e_t:
        lo, e_lo, hi = sigma0, e0, sigma0 * factor
        while True:
            if hi > _SIGMA_MAX:
                raise ValueError(
                    f"{problem} needs a noise multiplier above {_SIGMA_MAX:g}{under}"
                )
            e_hi = epsilon_of(hi)
            if e_hi <= e_t:
                break
            lo, e_lo = hi, e_hi
            factor = factor * factor
            hi = hi * factor
    else:
        hi, e_hi, lo = sigma0, e0, sigma0 / factor
        while True:
            if lo < _SIGMA_MIN:
                raise ValueError(
                    f"{problem} is met by every noise multiplier >= {_SIGMA_MIN:g}{under}; "
                    "calibration below that is not supported"
                )
            e_lo = epsilon_of(lo)
            if e_lo > e_t:
                break
            hi, e_hi = lo, e_lo
            factor = factor * factor
            lo = lo / factor

    # Illinois regula falsi on x = log sigma, y = log eps - log target
    # (y is decreasing in x and close to linear); bisection where eps is infinite.
    log_t = math.log(e_t)

    def y_of(e: float) -> float:
        return math.inf if not math.isfinite(e) else (math.log(e) - log_t if e > 0 else -math.inf)

    x_lo, x_hi = math.log(lo), math.log(hi)
    y_lo, y_hi = y_of(e_lo), y_of(e_hi)
    sigma_hi = hi  # the evaluated sigma itself, not exp(log(sigma))
    side = 0
    for _ in range(200):
        if e_hi >= e_t * (1.0 - rtol) or x_hi - x_lo <= 1e-9:
            break
        if math.isfinite(y_lo) and math.isfinite(y_hi) and y_lo > y_hi:
            x = x_hi - y_hi * (x_hi - x_lo) / (y_hi - y_lo)
            width = x_hi - x_lo
            # keep the step strictly inside the bracket
            x = min(max(x, x_lo + 1e-3 * width), x_hi - 1e-3 * width)
        else:
            x = 0.5 * (x_lo + x_hi)
        sigma = math.exp(x)
        e = epsilon_of(sigma)
        y = y_of(e)
        if e <= e_t:
            x_hi, y_hi, e_hi, sigma_hi = x, y, e, sigma
            if side == 1:
                y_lo *= 0.5
            side = 1
        else:
            x_lo, y_lo, e_lo = x, y, e
            if side == -1:
                y_hi *= 0.5
            side = -1
    return sigma_hi
