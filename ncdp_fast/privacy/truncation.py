r"""The delta charged for the sampler's truncated Gaussian tails.

The Gaussian noise of ncdp_fast is Box--Muller on Philox words
(:mod:`ncdp_fast.reference.rng`): each pair of normals has radius
:math:`\sqrt{-2\ln u_1}` with :math:`u_1 \ge 2^{-129}`, so no output lies beyond
``GAUSSIAN_TAIL_BOUND`` (~13.37) standard deviations.  The ideal continuous
sampler is the same map of a uniform :math:`u_1 \in (0, 1)`; the implemented one
folds the ideal mass of its lowest cell :math:`u_1 < 2^{-128}` -- the pair
radii beyond :math:`\sqrt{256 \ln 2}` -- onto its largest radius, and is
otherwise the ideal sampler on the grid of its uniforms (the grid is the
floating-point question, docs/privacy.md, "Noise tails and floating point").
Let :math:`\tau = 1 - (1 - 2^{-128})^{N}` for N pairs in the run.

Derivation (docs/privacy.md): run the implemented mechanism M' and the ideal M
on the same uniforms.  Their outputs differ only on the event B that some
pair's u1 falls in the lowest cell; B concerns the noise alone, so
:math:`P[B] \le \tau` on every dataset, whatever the (adaptive) composition or
the Poisson sampling.  If M is :math:`(\varepsilon, \delta)`-DP then for every
output set E

.. math::
    P[M'(D) \in E] \le P[M(D) \in E] + \tau
    \le e^\varepsilon P[M(D') \in E] + \delta + \tau
    \le e^\varepsilon P[M'(D') \in E] + \delta + (1 + e^\varepsilon)\tau,

so M' is :math:`(\varepsilon, \delta + (1 + e^\varepsilon)\tau)`-DP.  The term
charged, :func:`truncation_delta`, is :math:`(1 + e^\varepsilon)\tau/(1-\tau)`,
which also covers the variant that conditions on the complement of B instead
of folding.

N defaults to :data:`PAIRS_PER_KEY`, the most pairs one key's stream holds
(offsets are 64-bit), which needs no dimension: the functions of one mechanism
(one key, shared by every rank) use it; :class:`~ncdp_fast.privacy.Accountant`
charges one key per event of its history, since composed releases (a private
PCA, then training) may be keyed apart.  With one key :math:`\tau \le 2^{-65}`
and the charge is :math:`(1 + e^\varepsilon)\,2.7 \cdot 10^{-20}`: below 1e-16
up to :math:`\varepsilon = 8`, 1.3e-11 at 20.  A caller that knows the public noise
size (T steps of p coordinates: at most ``T * (p // 2 + 1)`` pairs) may pass it.
"""
from __future__ import annotations

import math

from .._validate import check_delta, check_nonneg, check_pos_int
from ..reference.rng import GAUSSIAN_TRUNCATION_MASS
from .gdp import gdp_to_dp
from .zcdp import zcdp_to_dp

__all__ = ["PAIRS_PER_KEY", "truncation_mass", "truncation_delta", "ideal_delta",
           "epsilon_with_truncation", "gdp_epsilon", "zcdp_epsilon", "beyond_truncation"]

#: Box-Muller pairs one key's stream can produce: 2^64 draws, two per pair.
PAIRS_PER_KEY = 2 ** 63


def truncation_mass(pairs=None, mass=None) -> float:
    """tau: probability that any of ``pairs`` pairs (default :data:`PAIRS_PER_KEY`)
    falls in the folded cell of probability ``mass`` (default the sampler's
    ``GAUSSIAN_TRUNCATION_MASS``), rounded up."""
    n = check_pos_int(PAIRS_PER_KEY if pairs is None else pairs, "pairs")
    m = float(GAUSSIAN_TRUNCATION_MASS if mass is None else mass)
    if not 0.0 < m < 1.0:
        raise ValueError(f"mass: expected a probability in (0, 1), got {mass!r}")
    tau = -math.expm1(n * math.log1p(-m))
    # Round up by a few ulps: this is charged, never saved.
    return min(1.0, tau * (1.0 + 4 * 2.0 ** -52))


def truncation_delta(epsilon, pairs=None, *, mass=None) -> float:
    r"""Delta to add to the ideal Gaussian mechanism's: :math:`(1+e^\varepsilon)\tau/(1-\tau)`.

    Args:
        epsilon: the epsilon of the guarantee, >= 0 (``inf`` gives ``inf``).
        pairs: Box--Muller pairs drawn by the whole run (public: steps times
            noise coordinates / 2, plus one per step for an odd offset);
            default :data:`PAIRS_PER_KEY`, the most one key's stream holds.
        mass: ideal probability of one pair's folded tail; default the
            sampler's ``GAUSSIAN_TRUNCATION_MASS`` = 2^-128 (2^-32 for the old
            32-bit u1).

    Returns:
        the added delta (``inf`` when tau = 1 or epsilon is too large to bound).
    """
    e = float(epsilon) if epsilon == math.inf else check_nonneg(epsilon, "epsilon")
    tau = truncation_mass(pairs, mass)
    if tau >= 1.0 or e > 700.0:
        return math.inf
    return (1.0 + math.exp(e)) * tau / (1.0 - tau)


def ideal_delta(delta, epsilon, pairs=None, *, mass=None) -> float:
    """The delta the ideal-Gaussian accountant may spend so that the implemented
    sampler meets ``delta`` at ``epsilon``; ValueError when truncation alone exceeds it."""
    d = check_delta(delta)
    charge = truncation_delta(epsilon, pairs, mass=mass)
    rest = d - charge
    if not rest > 0.0:
        raise ValueError(
            f"delta: expected more than the truncation charge {charge:.3g} "
            f"of the sampler's Gaussian tails at epsilon={epsilon!r}, got {delta!r}; "
            "use a smaller epsilon or a larger delta (docs/privacy.md, 'Noise tails and "
            "floating point')")
    return rest


def epsilon_with_truncation(epsilon_of, delta, pairs=None, *, mass=None) -> float:
    """Smallest epsilon found with ``epsilon_of(delta - truncation_delta(epsilon)) <= epsilon``.

    ``epsilon_of(d)`` is the ideal mechanism's epsilon at delta d (decreasing in
    d; called a few times, so it should be cheap: compose once, query often).
    The answer e satisfies ideal delta(e) + truncation_delta(e) <= delta, so the
    implemented sampler is (e, delta)-DP; ``inf`` when no such e is found.
    """
    if not callable(epsilon_of):
        raise TypeError(f"epsilon_of: expected a function delta -> epsilon, got "
                        f"{type(epsilon_of).__name__}")
    d = check_delta(delta)

    def fits(e):
        """epsilon_of(delta - charge(e)) when that is <= e (then e is valid), else None."""
        rest = d - truncation_delta(e, pairs, mass=mass)
        if not rest > 0.0:
            return None
        got = epsilon_of(rest)
        return got if got <= e else None

    lo = epsilon_of(d)
    if not math.isfinite(lo):
        return math.inf
    # Widen the gap above the ideal answer until it fits: usually at the first
    # try, the charge being tiny.  The answer fits its own charge too (no larger
    # than the one at the point tried).
    gap = lo * 1e-9 + 1e-12
    got = fits(lo + gap)
    if got is not None:
        return got
    below = lo + gap
    for _ in range(80):
        gap *= 4.0
        above = lo + gap
        if not math.isfinite(above) or truncation_delta(above, pairs, mass=mass) >= d:
            return math.inf      # the charge only grows with epsilon
        got = fits(above)
        if got is not None:
            break
        below = above
    else:
        return math.inf
    # The charge is a visible part of delta: bisect for the smallest fitting epsilon.
    while above - below > 1e-13 * above:
        mid = 0.5 * (below + above)
        g = fits(mid)
        if g is None:
            below = mid
        else:
            above, got = mid, g
    return got


def gdp_epsilon(mu, delta, pairs=None) -> float:
    """epsilon at ``delta`` of a mu-GDP accounting of the sampler as implemented:
    Lemma D.3's exact conversion (:func:`gdp_to_dp`) with the tails charged."""
    if not math.isfinite(mu):
        return math.inf
    return epsilon_with_truncation(lambda d: gdp_to_dp(mu, d), delta, pairs)


def zcdp_epsilon(rho, delta, pairs=None) -> float:
    """epsilon at ``delta`` of a rho-zCDP accounting of the sampler as implemented:
    the tight conversion (:func:`zcdp_to_dp`) with the tails charged."""
    return epsilon_with_truncation(lambda d: zcdp_to_dp(rho, d), delta, pairs)


def _one_step_delta(sigma: float, q: float, epsilon: float) -> float:
    """The ideal delta at ``epsilon`` of ONE Poisson-subsampled Gaussian step
    (noise multiplier sigma, rate q), removal direction: q * delta_G(e') with
    e' = log(1 + (e^epsilon - 1) / q) and delta_G(e) = Phi(1/(2 sigma) - e sigma)
    - e^e Phi(-1/(2 sigma) - e sigma) (Balle and Wang 2018, sensitivity 1).
    A lower bound on any composition's delta at epsilon (dropping the other
    steps' outputs is post-processing).  Computed in logs, the difference as
    -e^A expm1(B - A), so that no term overflows or cancels."""
    from scipy.special import log_ndtr
    e1 = epsilon if q == 1.0 else math.log(math.expm1(epsilon) + q) - math.log(q)
    a = float(log_ndtr(0.5 / sigma - e1 * sigma))
    b = e1 + float(log_ndtr(-0.5 / sigma - e1 * sigma))
    return q * -math.exp(a) * math.expm1(min(b - a, 0.0))


def beyond_truncation(steps, delta, pairs=None, *, mass=None, keep=1.0) -> bool:
    """Whether the answer at ``delta`` is ``inf`` whatever the composition:
    some step (sigma, q) of ``steps`` alone has an ideal delta above ``delta``
    at the epsilon where the truncation charge reaches ``delta`` (so no
    epsilon fits, :func:`epsilon_with_truncation`).  Closed form: the PLD of
    such a run (sigma 0.05 at q = 1, or 1e-3) filled the memory before its
    answer, inf, came (the fifth audit).  Checked with a factor 2 margin on
    the closed form's own rounding; a run near the edge is left to the
    accountant.  ``keep``: each step takes place with this probability,
    independently of the data and revealed (NeuroMixGDP-HS's class
    selection), which multiplies its delta by ``keep``."""
    tau = truncation_mass(pairs, mass)
    if tau >= 1.0:
        return True
    ratio = float(delta) * (1.0 - tau) / tau - 1.0
    if not ratio > 0.0:
        return True
    edge = math.log(ratio)        # truncation_delta(edge) == delta
    return any(keep * _one_step_delta(float(s), float(q), edge) > 2.0 * float(delta)
               for s, q in steps if s > 0)
