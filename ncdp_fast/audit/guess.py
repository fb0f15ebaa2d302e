"""From canary scores to guesses, counts and both bounds (:class:`AuditResult`).

The auditor guesses IN for the k highest-scored canaries and OUT for the k
lowest, abstaining on the rest.  k must not be chosen after seeing the scores.
Two valid ways: a fixed grid of k, each bound taken at confidence
1 - (1 - confidence) / len(grid) (Bonferroni), the maximum over the grid then
valid at ``confidence``; or one k per analysis planned before the run
(:func:`plan_k`: the k with the best mean bound in simulated games of the
mechanism as claimed), used at ``confidence`` itself.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import math

import numpy as np

from .._validate import check_delta, check_int, check_nonneg, check_pos_int, check_probability
from .bounds import one_run_bound, one_run_bound_gdp

__all__ = ["AuditResult", "bound_from_scores", "guess_grid", "plan_k", "subsampled_gaussian_score"]

_GRID_FRACTIONS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5)


@dataclass
class AuditResult:
    """An audit's outcome.

    ``epsilon_lower_bound``: Steinke et al.'s (eps, delta)-DP bound;
    ``epsilon_lower_bound_gdp`` / ``mu_lower_bound``: the mu-GDP bound of
    Mahloujifar et al. and the eps of a mu-GDP mechanism at ``delta``;
    ``epsilon_claimed``: the accountant's eps of the audited run at ``delta``
    (None where nothing was claimed).  ``canaries`` m; for each analysis the k
    (IN and OUT guesses each), guesses r = 2k and right guesses v it was reached
    with (``k``, ``guesses``, ``correct`` for the first, ``*_gdp`` for the
    second); ``guessed_in`` / ``guessed_out``: canary indices of the first
    analysis's guesses; ``confidence`` (of each bound, after the Bonferroni
    correction over ``k_grid`` when k was not fixed before the run; ``k_grid`` is
    then the grid, else the pair of planned k).  ``details``: what was audited
    and how.

    ``epsilon_reachable`` / ``epsilon_reachable_gdp``: the largest bound each
    analysis could have given with its guesses, all of them right. An analysis
    whose reachable bound is below the claim cannot detect a violation of it,
    whatever the run (the issue-35 audit: the (eps, delta) bound of 100
    guesses stops at 3.47, so it missed breaks of a claim of 4 that the mu-GDP
    bound caught); :meth:`can_detect` says which can.
    """
    epsilon_lower_bound: float
    epsilon_lower_bound_gdp: float | None
    mu_lower_bound: float
    epsilon_claimed: float | None
    delta: float
    canaries: int
    k: int
    guesses: int
    correct: int
    k_gdp: int
    guesses_gdp: int
    correct_gdp: int
    guessed_in: np.ndarray
    guessed_out: np.ndarray
    confidence: float
    k_grid: tuple
    details: dict = field(default_factory=dict)
    epsilon_reachable: float = math.inf
    epsilon_reachable_gdp: float | None = None

    def can_detect(self) -> dict:
        """{"eps_delta": bool, "gdp": bool}: whether each analysis's bound can
        exceed the claim at all (None where nothing was claimed)."""
        if self.epsilon_claimed is None:
            return {"eps_delta": None, "gdp": None}
        gdp = self.epsilon_reachable_gdp
        return {"eps_delta": bool(self.epsilon_reachable > self.epsilon_claimed),
                "gdp": None if gdp is None else bool(gdp > self.epsilon_claimed)}

    def summary(self) -> dict:
        """Plain JSON types: the numbers of a results table."""
        keys = ("epsilon_claimed", "epsilon_lower_bound", "epsilon_lower_bound_gdp",
                "mu_lower_bound", "delta", "canaries", "k", "guesses", "correct", "k_gdp",
                "guesses_gdp", "correct_gdp", "confidence", "epsilon_reachable",
                "epsilon_reachable_gdp")
        out = {k: getattr(self, k) for k in keys}
        out["k_grid"] = list(self.k_grid)
        out["can_detect"] = self.can_detect()
        out.update(self.details)
        return out


def subsampled_gaussian_score(g, sigma: float, q: float) -> np.ndarray:
    """Per-canary sum over steps of the log likelihood ratio "included" / "not":
    ``g`` (T, m) holds each step's observation of each canary in units of its
    signal, g ~ N(b, sigma^2) with b ~ Bernoulli(q) if included and b = 0 if not
    (a Dirac canary of a Poisson-subsampled Gaussian mechanism: DP-SGD's noisy
    gradient on its coordinate, a NeuroMixGDP row's).  The Neyman-Pearson
    statistic of each step; (m,) float64.  sigma = 0 has no likelihood ratio:
    the plain sum is returned."""
    g = np.asarray(g, dtype=np.float64)
    # The sixth audit: sigma -1, q 0, 1.5 or NaN gave numbers or NaN.
    sigma = check_nonneg(sigma, "sigma")
    q = check_probability(q, "q")
    if sigma == 0:
        return g.sum(axis=0)
    a = (g - 0.5) / sigma ** 2
    if q >= 1.0:
        return a.sum(axis=0)
    return np.logaddexp(np.log1p(-q), np.log(q) + a).sum(axis=0)


def guess_grid(m: int) -> tuple:
    """The k tried for m canaries: fractions 1, 2, 5, 10, 20, 50 % of m (at least 1,
    distinct)."""
    m = check_pos_int(m, "m")
    return tuple(sorted({max(1, int(round(f * m))) for f in _GRID_FRACTIONS if f * m >= 0.5}
                        or {1}))


def plan_k(m: int, mu: float, *, delta, confidence=0.95, games: int = 12, rng=None) -> tuple:
    """(k for the (eps, delta) bound, k for the mu-GDP bound), planned before a run:
    each maximises the mean bound over ``games`` simulated one-run games in which
    canary i's score is mu S_i + N(0, 1) (a mu-GDP mechanism, the claim's;
    S_i a fair bit), over :func:`guess_grid`.  Uses no data of the run, so the
    k it returns may be used at the full ``confidence``.

    Args:
        m: canaries.  mu: the GDP parameter of the mechanism as claimed (>= 0).
        delta, confidence: those of the audit.  games: simulated games.
        rng: a numpy Generator (None: fresh OS entropy); the plan is not secret.
    """
    mu = check_nonneg(mu, "mu")
    delta = check_delta(delta)
    confidence = check_delta(confidence, "confidence")
    games = check_pos_int(games, "games")
    rng = np.random.default_rng() if rng is None else rng
    grid = tuple(g for g in guess_grid(m) if g <= m // 2)
    dp = np.zeros(len(grid))
    gdp = np.zeros(len(grid))
    for _ in range(check_int(games, "games", 1)):
        s = rng.random(m) < 0.5
        order = np.argsort(-(mu * s + rng.standard_normal(m)), kind="stable")
        for j, kk in enumerate(grid):
            v = int(s[order[:kk]].sum() + (~s[order[m - kk:]]).sum())
            dp[j] += one_run_bound(v, 2 * kk, delta=delta, confidence=confidence, canaries=m)
            gdp[j] += one_run_bound_gdp(v, 2 * kk, m, confidence=confidence).mu
    return grid[int(np.argmax(dp))], grid[int(np.argmax(gdp))]


def bound_from_scores(scores, membership, *, delta, confidence=0.95, k=None,
                      epsilon_claimed=None, details=None) -> AuditResult:
    """Guess from ``scores`` (m,) (higher says IN), count against ``membership``
    (m,) bool, and compute both bounds.

    Args:
        scores: (m,) float; ties are broken by index (a fixed, score-free order).
        membership: (m,) bool, True where the canary was included.
        delta: the delta of the hypothesis (the run's claimed delta), in (0, 1).
        confidence: of the returned bounds, in (0, 1).
        k: one k (int, 1 <= k <= m // 2) for both analyses, a pair (k for the
            (eps, delta) bound, k for the mu-GDP bound) fixed before the run
            (:func:`plan_k`), or None for :func:`guess_grid` with the
            Bonferroni correction.
    """
    s = np.asarray(scores, dtype=np.float64)
    mem = np.asarray(membership)
    if s.ndim != 1 or mem.shape != s.shape or mem.dtype != bool:
        raise ValueError(f"scores, membership: expected (m,) floats and (m,) bools, got "
                         f"{s.shape} {s.dtype} and {mem.shape} {mem.dtype}")
    if not np.all(np.isfinite(s)):
        raise ValueError("scores: expected finite scores, got NaN or inf; a score that "
                         "cannot be computed cannot be ranked")
    m = s.size
    confidence = check_probability(confidence, "confidence", one=False)
    if m < 2:
        raise ValueError(f"scores: expected at least 2 canaries, got {m}")
    if k is None:
        grids = (tuple(g for g in guess_grid(m) if g <= m // 2),) * 2
    else:
        pair = tuple(k) if isinstance(k, (tuple, list)) else (k, k)
        if len(pair) != 2:
            raise ValueError(f"k: expected an int, a pair of ints or None, got {k!r}")
        for kk in pair:
            check_int(kk, "k", 1)
            if kk > m // 2:
                raise ValueError(f"k: expected at most m // 2 = {m // 2} (k IN and k OUT "
                                 f"guesses), got {kk}")
        grids = ((int(pair[0]),), (int(pair[1]),))
    grid = tuple(sorted(set(grids[0]) | set(grids[1])))
    levels = [1.0 - (1.0 - confidence) / len(g) for g in grids]
    order = np.argsort(-s, kind="stable")       # highest first
    best = best_gdp = None
    for kk in grid:
        g_in, g_out = order[:kk], order[m - kk:]
        v = int(mem[g_in].sum() + (~mem[g_out]).sum())
        if kk in grids[0]:
            eps = one_run_bound(v, 2 * kk, delta=delta, confidence=levels[0], canaries=m)
            if best is None or eps > best[0]:
                best = (eps, kk, v, g_in, g_out)
        if kk in grids[1]:
            gdp = one_run_bound_gdp(v, 2 * kk, m, delta=delta, confidence=levels[1])
            if best_gdp is None or gdp.mu > best_gdp[0].mu:
                best_gdp = (gdp, kk, v)
    eps, kk, v, g_in, g_out = best
    gdp, kg, vg = best_gdp
    # What each analysis could certify with its guesses all right.
    reach = one_run_bound(2 * kk, 2 * kk, delta=delta, confidence=levels[0], canaries=m)
    reach_gdp = one_run_bound_gdp(2 * kg, 2 * kg, m, delta=delta, confidence=levels[1]).epsilon
    return AuditResult(
        epsilon_lower_bound=float(eps), epsilon_lower_bound_gdp=gdp.epsilon,
        mu_lower_bound=gdp.mu, epsilon_claimed=epsilon_claimed, delta=float(delta),
        canaries=m, k=kk, guesses=2 * kk, correct=v, k_gdp=kg, guesses_gdp=2 * kg,
        correct_gdp=vg, guessed_in=np.sort(g_in), guessed_out=np.sort(g_out),
        confidence=confidence, k_grid=grids[0] if k is None else (kk, kg),
        details=dict(details or {}), epsilon_reachable=float(reach),
        epsilon_reachable_gdp=reach_gdp)
