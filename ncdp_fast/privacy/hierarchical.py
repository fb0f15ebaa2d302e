r"""Accounting for NeuroMixGDP with hierarchical sampling (NeuroMixGDP-HS).

Paper: ``shared/seeds/002_1ce43e1ce6039d97.txt`` -- Appendix E.2 (hierarchical
sampling), Proposition E.3, Theorem 3.1.  Used by :class:`ncdp_fast.release.NeuroMixGDP`;
see ``docs/release.md``.

Hierarchical sampling (HS, Procedure 2): class k is kept with probability p_k, then
each example of a kept class joins the group of a released row with probability
q_k = m/(n p_k).  One row, conditioned on the record being in its group, is a
Gaussian mechanism with noise multiplier sigma,
:math:`1/\sigma^2 = 1/\sigma_x^2 + 1/\sigma_y^2` (proof of Theorem E.1).

The paper's Proposition E.3 bounds one row by the Poisson rate
:math:`\max_k p_k q_k = m/n`.  Its proof writes the row on S' as a mixture in which
the new record's inclusion is independent of the other selections; under HS it is
not -- the record of class k can only be chosen in rows that keep class k, and
whether a row kept class k shows in its label mean (about 1/(K p_k) on coordinate
k, far above the label noise at the paper's settings).  We account for the release
with the class selection ``a`` *revealed*: a row is, with probability p_k, a
Poisson(q_k)-subsampled Gaussian, and otherwise independent of the record.
Revealing a only adds information, so this is a rigorous bound on HS, and it is
nearly tight whenever a can be read off the output.  Per row the privacy loss
distribution is the mixture :math:`(1-p_k)\,\delta_0 + p_k\,\mathrm{PLD}_{q_k}`
(hockey-stick divergences are linear in a revealed mixture), composed T times and
maximised over classes (smallest p_k is worst).  Its CLT analogue is
:math:`\mu = q_k\sqrt{T p_k (e^{1/\sigma^2}-1)} = (m/n)\sqrt{T/p_k}\,
\sqrt{e^{1/\sigma^2}-1}`, i.e. Theorem 3.1 with :math:`\mu^2` replaced by
:math:`\mu^2 p_{\min}`; at p = 3/10 HS needs noticeably more noise than the paper
uses.

Neighbouring relation: add/remove one record; the dataset size n is public.
"""
from __future__ import annotations

import functools
import math

import numpy as np

from .._validate import as_real_array, check_choice, check_delta, check_pos_int, check_positive
from ._validate import check_discretization_interval
from .gdp import dp_to_gdp
from .pld import PLDStages
from .truncation import beyond_truncation, epsilon_with_truncation, gdp_epsilon, ideal_delta
from .subsampled import DEFAULT_EPSILON_RTOL, DEFAULT_VALUE_DISCRETIZATION_INTERVAL, \
    accountable_groups, search_noise_multiplier

__all__ = ["hs_epsilon", "hs_noise_multiplier"]


def _hs_rates(class_rates, m: float, n: int) -> tuple[float, float]:
    """(p_min, q at p_min): the worst class (smallest p_k has the largest q_k)."""
    rates = as_real_array(class_rates, "class_rates", "a list of floats")
    if rates.ndim != 1 or rates.size == 0 or not np.all((rates > 0) & (rates <= 1)):
        raise ValueError(f"class_rates: expected a non-empty list of class keep probabilities "
                         f"in (0, 1], got {np.asarray(class_rates).tolist()!r}")
    p = float(np.min(rates))
    return p, m / (n * p)


@functools.lru_cache(maxsize=256)
def _hs_pld_epsilon(sigma: float, p: float, q: float, steps: int, delta: float,
                    interval: float) -> float:
    # The subsampled accountant's guards: extreme sigma (accountable_groups),
    # the truncation edge before any PLD, each PLD stage's memory forecast.
    groups = accountable_groups({(sigma, q): steps})
    if groups is None:
        return math.inf
    ((s, _),) = groups
    if beyond_truncation([(s, q)], delta, keep=p):
        return math.inf
    stages = PLDStages(interval, "num_samples")
    one = stages.one_step(s, q, named=sigma)
    if p < 1.0:
        # Revealed class selection: with probability 1 - p the row is independent of
        # the record (privacy loss exactly 0).
        one = one.compute_mixture(stages.dist.identity(interval, pessimistic_estimate=True), p)
    composed = stages.self_compose(one, steps, sigma, q)
    return epsilon_with_truncation(lambda d: float(composed.get_epsilon_for_delta(d)), delta)


def hs_epsilon(noise_multiplier, *, mixup_degree, n, num_samples, class_rates, delta,
               accountant="pld",
               value_discretization_interval=DEFAULT_VALUE_DISCRETIZATION_INTERVAL) -> float:
    r"""epsilon of NeuroMixGDP-HS (hierarchical sampling) with noise multiplier sigma.

    Accountant: ``"pld"`` -- per row the mixture :math:`(1-p)\delta_0 + p\,
    \mathrm{PLD}(\text{Poisson}(q)\text{-subsampled Gaussian}(\sigma))` with the worst
    class p = min p_k, q = m/(n p), composed T times (dp-accounting, pessimistic
    connect-the-dots; an upper bound for the release with the class selection
    revealed, hence for HS).  ``"clt"`` -- its GDP central-limit analogue
    :math:`\mu = q\sqrt{T p (e^{1/\sigma^2}-1)}` converted by Lemma D.3 (an
    approximation).  With all p_k = 1 both reduce to Poisson sampling at rate m/n.
    Neighbouring relation: add/remove one record; n public.

    Args:
        noise_multiplier: sigma > 0 with 1/sigma^2 = 1/sigma_x^2 + 1/sigma_y^2.
        mixup_degree: m > 0.  n: dataset size.  num_samples: T rows.
        class_rates: (K,) class keep probabilities p_k in (0, 1] with m/(n p_k) <= 1.
        delta: in (0, 1).
    """
    s = check_positive(noise_multiplier, "noise_multiplier")
    d = check_delta(delta)
    check_choice(accountant, "accountant", ("pld", "clt"))
    # Checked, never truncated: int(0.29 * 100) counted 28 of 29 rows (the fifth audit).
    m, n, T = _hs_counts(mixup_degree, n, num_samples)
    p, q = _hs_rates(class_rates, m, n)
    if not (0 < q <= 1):
        raise ValueError(f"class_rates: expected q = m/(n p_min) in (0, 1], got {q!r}")
    if accountant == "clt":
        mu = q * math.sqrt(T * p * math.expm1(1.0 / (s * s)))
        return gdp_epsilon(mu, d)
    return _hs_pld_epsilon(s, p, q, T, d,
                           check_discretization_interval(value_discretization_interval))


def _hs_counts(mixup_degree, n, num_samples) -> tuple[float, int, int]:
    return (check_positive(mixup_degree, "mixup_degree"), check_pos_int(n, "n"),
            check_pos_int(num_samples, "num_samples"))


def hs_noise_multiplier(epsilon, delta, *, mixup_degree, n, num_samples, class_rates,
                        accountant="clt", epsilon_rtol=DEFAULT_EPSILON_RTOL,
                        value_discretization_interval=DEFAULT_VALUE_DISCRETIZATION_INTERVAL
                        ) -> float:
    r"""Smallest sigma (to tolerance) with :func:`hs_epsilon` <= epsilon.

    ``"clt"``: closed form :math:`\sigma = 1/\sqrt{\ln(1 + \mu^2 p\, n^2/(m^2 T))}`,
    :math:`\mu` = ``dp_to_gdp(epsilon, delta)``, p = min p_k (Theorem 3.1 with
    :math:`\mu^2 \to \mu^2 p`).  ``"pld"``: starts there and searches
    (:func:`ncdp_fast.privacy.search_noise_multiplier`, the search of
    :func:`ncdp_fast.privacy.calibrate_noise_multiplier`) until
    ``(1 - epsilon_rtol) * epsilon <= eps(sigma) <= epsilon`` under the PLD
    accountant; the returned sigma always meets the target.  Neighbouring relation:
    add/remove one record; n public.
    """
    e = check_positive(epsilon, "epsilon")
    d = check_delta(delta)
    check_choice(accountant, "accountant", ("pld", "clt"))
    m, n, T = _hs_counts(mixup_degree, n, num_samples)
    p, _ = _hs_rates(class_rates, m, n)
    # The start (the closed form for "clt") leaves room for the truncation charge.
    mu = dp_to_gdp(e, ideal_delta(d, e))
    sigma0 = 1.0 / math.sqrt(math.log1p(mu * mu * p * n * n / (m * m * T)))

    def eps(s):
        return hs_epsilon(s, mixup_degree=m, n=n, num_samples=T, class_rates=[p], delta=d,
                          accountant=accountant,
                          value_discretization_interval=value_discretization_interval)
    return search_noise_multiplier(
        eps, e, sigma0, closed_form=accountant == "clt", epsilon_rtol=epsilon_rtol,
        problem=f"epsilon={e!r} (delta={d!r}, mixup_degree={m:g}, n={n}, num_samples={T}, "
                f"p_min={p!r})", accountant=accountant)
