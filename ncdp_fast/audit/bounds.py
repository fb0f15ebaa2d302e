r"""The statistics of a one-run audit: from r membership guesses of which v were
correct, the largest privacy parameter the run is still consistent with is
rejected at the stated confidence, and that parameter is a lower bound.

The game (Steinke, Nasr & Jagielski 2023, "Privacy Auditing with One (1) Training
Run"): each of m canaries is included in the training data independently with
probability 1/2; after training, an auditor who sees only the run's output
guesses IN or OUT for r of them (abstaining on the rest); v guesses are correct.

* :func:`one_run_bound` -- their Theorem (approximate DP): if the run is
  (eps, delta)-DP then P[v correct or more] <= P[Binomial(r, p) >= v] +
  2 m delta max_{1<=i<=v} P[v - i <= Binomial(r, p) < v] / i, with p = e^eps /
  (1 + e^eps).  Exact binomial tails (log space), no normal approximation.
* :func:`one_run_bound_gdp` -- Mahloujifar, Melis & Chaudhuri, "Auditing
  f-Differential Privacy in One Run" (ICML 2025): the same game tested against
  the hypothesised trade-off curve of mu-GDP (the curve of the Gaussian
  mechanism), which is tighter for Gaussian mechanisms than going through one
  (eps, delta) pair.

Both bounds are valid lower bounds only for the relation they test: the first
for (eps, delta)-DP, the second for mu-GDP; the eps the second reports at delta
is the eps of a mu-GDP mechanism, i.e. a lower bound on (eps, delta)-DP only
for a mechanism whose trade-off curve is Gaussian (full-batch DP-SGD; Poisson
subsampled DP-SGD only approximately, by the CLT).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

from .._validate import check_int, check_probability, check_real

__all__ = ["one_run_bound", "one_run_bound_gdp", "GDPBound", "one_run_p_value",
           "gdp_rejects"]

_SQRT2 = math.sqrt(2.0)
_STD = NormalDist()


def _check_game(correct, guesses, canaries, *, need_canaries: bool):
    v = check_int(correct, "correct", 0)
    r = check_int(guesses, "guesses", 0)
    if v > r:
        raise ValueError(f"correct: expected at most guesses ({r}) correct guesses, got {v}")
    if canaries is None:
        if need_canaries:
            raise ValueError(
                "canaries: expected the number m of canaries (each included w.p. 1/2), got "
                "None; the bound grows with m (delta's term is 2 m delta, and abstentions "
                "count), so it cannot be left out: pass canaries=m")
        return v, r, None
    m = check_int(canaries, "canaries", 1)
    if r > m:
        raise ValueError(f"guesses: expected at most canaries ({m}) guesses, got {r}")
    return v, r, m


def _tail_level(confidence) -> float:
    """tau = 1 - confidence: the false-alarm rate of one audit."""
    c = check_probability(confidence, "confidence", zero=False, one=False)
    return 1.0 - c


# ------------------------------------------------------------ (eps, delta)-DP

def _log_p_value(eps: float, v: int, r: int, m: int, delta: float) -> float:
    """log of Steinke et al.'s bound on P[W >= v] for an (eps, delta)-DP run."""
    from scipy.stats import binom
    # p = e^eps/(1+e^eps); its complement computed directly so that neither
    # rounds to 0 or 1 before the tails see it.
    p = 1.0 / (1.0 + math.exp(-eps))
    log_beta = float(binom.logsf(v - 1, r, p))             # log P[Bin >= v]
    if delta == 0.0 or v == 0:
        return log_beta
    # log P[v-i <= Bin <= v-1] for i = 1..v: a running log-sum of the pmf going down.
    log_pmf = binom.logpmf(np.arange(v - 1, -1, -1), r, p)
    log_window = np.logaddexp.accumulate(log_pmf)
    log_alpha = float(np.max(log_window - np.log(np.arange(1, v + 1))))
    return float(np.logaddexp(log_beta, math.log(2.0 * m * delta) + log_alpha))


def one_run_p_value(epsilon, correct, guesses, *, delta=0.0, canaries=None) -> float:
    """The bound on P[at least ``correct`` of ``guesses`` right] for an
    (``epsilon``, ``delta``)-DP run (Steinke et al.); float in (0, 1]."""
    eps = check_real(epsilon, "epsilon")
    if eps < 0 or not math.isfinite(eps):
        raise ValueError(f"epsilon: expected a finite number >= 0, got {epsilon!r}")
    delta = check_probability(delta, "delta", zero=True, one=False)
    v, r, m = _check_game(correct, guesses, canaries, need_canaries=delta > 0)
    return min(1.0, math.exp(_log_p_value(eps, v, r, m or r, delta)))


def one_run_bound(correct, guesses, *, delta=0.0, confidence=0.95, canaries=None) -> float:
    r"""Empirical epsilon lower bound of one run (Steinke, Nasr & Jagielski 2023).

    The largest eps such that "the run is (eps, delta)-DP" is still rejected at
    ``confidence`` by v = ``correct`` right guesses out of r = ``guesses``: the
    eps where the theorem's tail bound on P[W >= v] equals 1 - confidence
    (0.0 when even eps = 0 is not rejected).  With all r guesses right and
    delta = 0 it is log(p / (1 - p)), p = (1 - confidence)^(1/r).

    Args:
        correct: v, right guesses (int >= 0, <= guesses).
        guesses: r, guesses made (int; the auditor abstained on the others).
        delta: the delta of the hypothesis tested (the run's claimed delta),
            in [0, 1); delta > 0 needs ``canaries``.
        confidence: in (0, 1); 1 - confidence is the probability that an
            honest (eps, delta)-DP run yields a bound above eps.
        canaries: m, the canaries (each included w.p. 1/2; m >= guesses).
            Required when delta > 0 (its term is 2 m delta).

    Returns:
        float >= 0, found to ~1e-12 absolute by Brent's method on the log of
        the tail bound.  A lower bound: an audit that stays below the claim
        proves nothing about the claim.
    """
    from scipy.optimize import brentq
    delta = check_probability(delta, "delta", zero=True, one=False)
    v, r, m = _check_game(correct, guesses, canaries, need_canaries=delta > 0)
    log_tau = math.log(_tail_level(confidence))
    m = m or r
    g = lambda eps: _log_p_value(eps, v, r, m, delta) - log_tau  # noqa: E731
    if g(0.0) > 0:
        return 0.0
    hi = 1.0
    while g(hi) <= 0:           # the bound tends to 1 > tau as eps grows
        hi *= 2.0
        if hi > 1e4:            # pragma: no cover - v <= r keeps this finite
            raise RuntimeError("one_run_bound: no upper bracket below eps = 1e4")
    return float(brentq(g, hi / 2 if hi > 1 else 0.0, hi, xtol=1e-13, rtol=1e-15))


# --------------------------------------------------------------- mu-GDP (f-DP)

def _phi(x: float) -> float:
    return 0.5 * math.erfc(-x / _SQRT2)


def gdp_rejects(mu, correct, guesses, canaries, *, confidence=0.95) -> bool:
    r"""Whether v right guesses of r (m canaries) reject "the run is mu-GDP" at
    ``confidence`` (Mahloujifar, Melis & Chaudhuri: the recursion of their
    bound for a binary guess per canary with abstention, under the trade-off
    curve of mu-GDP).

    The recursion: with tau = 1 - confidence, start from r_v = tau v / m and
    h_v = tau (r - v) / m; for i = v-1 .. 0, h_i = max(h_{i+1}, F(r_{i+1})),
    r_i = r_{i+1} + i / (r - i) (h_i - h_{i+1}), where F(y) = Phi(Phi^-1(y) - mu)
    is the inverse of mu-GDP's blow-up (the least mass an event can have on the
    neighbour given mass y on the dataset).  The hypothesis is rejected when
    r_0 + h_0 > r / m.  Both sequences only grow as i falls, so the loop stops
    as soon as the sum passes r / m.  At mu = 0 it is exact: all r = m guesses
    right is rejected iff 2^-m <= tau.
    """
    mu = check_real(mu, "mu")
    if not (mu >= 0 and math.isfinite(mu)):
        raise ValueError(f"mu: expected a finite number >= 0, got {mu!r}")
    v, r, m = _check_game(correct, guesses, canaries, need_canaries=True)
    tau = _tail_level(confidence)
    return _gdp_rejects(mu, v, r, m, tau)


def _gdp_rejects(mu: float, v: int, r: int, m: int, tau: float) -> bool:
    if r == 0:
        return False
    limit = r / m
    rr, h = tau * v / m, tau * (r - v) / m
    inv_cdf = _STD.inv_cdf
    for i in range(v - 1, -1, -1):
        if rr + h > limit:
            return True
        if rr >= 1.0:       # pragma: no cover - implies rr + h > limit above
            return True
        h_new = max(h, _phi(inv_cdf(rr) - mu)) if rr > 0 else h
        rr = rr + i / (r - i) * (h_new - h)
        h = h_new
    return rr + h > limit


@dataclass(frozen=True)
class GDPBound:
    """Result of :func:`one_run_bound_gdp`: ``mu`` (lower bound on the GDP
    parameter), ``epsilon`` (the eps of a mu-GDP mechanism at ``delta``; None
    when no delta was given)."""
    mu: float
    epsilon: float | None
    delta: float | None


def one_run_bound_gdp(correct, guesses, canaries, *, delta=None, confidence=0.95) -> GDPBound:
    r"""Empirical mu-GDP lower bound of one run (Mahloujifar, Melis & Chaudhuri).

    The largest mu such that "the run is mu-GDP" is rejected at ``confidence``
    by v = ``correct`` right guesses of r = ``guesses`` on m = ``canaries``
    canaries (:func:`gdp_rejects`; bisection to 1e-10 relative), and, with
    ``delta``, the eps at which a mu-GDP mechanism is (eps, delta)-DP
    (:func:`ncdp_fast.privacy.gdp_to_dp`).

    What it proves: at ``confidence``, the run is not mu'-GDP for any mu' < mu.
    The eps is a lower bound on the run's (eps, delta) only if its trade-off
    curve is Gaussian (full-batch DP-SGD; the Poisson-subsampled one is close
    to Gaussian when it composes many steps, by the CLT, but not equal).

    Args:
        correct, guesses, canaries: v <= r <= m (ints).
        delta: None, or the delta in (0, 1) at which to express mu as eps.
        confidence: in (0, 1).
    """
    v, r, m = _check_game(correct, guesses, canaries, need_canaries=True)
    tau = _tail_level(confidence)
    if delta is not None:
        from .._validate import check_delta
        delta = check_delta(delta)
    if not _gdp_rejects(0.0, v, r, m, tau):
        mu = 0.0
    else:
        lo, hi = 0.0, 1.0
        while _gdp_rejects(hi, v, r, m, tau):
            lo, hi = hi, hi * 2.0
            if hi > 64.0:      # Phi(x - 64) underflows: beyond any finite audit
                break
        while hi - lo > 1e-10 * max(hi, 1e-3):
            mid = 0.5 * (lo + hi)
            if _gdp_rejects(mid, v, r, m, tau):
                lo = mid
            else:
                hi = mid
        mu = lo
    eps = None
    if delta is not None:
        from ..privacy import gdp_to_dp
        eps = 0.0 if mu == 0.0 else float(gdp_to_dp(mu, delta))
    return GDPBound(mu=float(mu), epsilon=eps, delta=delta)
