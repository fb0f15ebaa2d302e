"""The one-run audit statistics (ncdp_fast.audit.bounds, .guess), checked against
values computed independently: closed forms, the regularized incomplete beta's
inverse, mpmath at 50 digits, the exact binomial test at mu = 0, and a Monte
Carlo of the Gaussian game."""
from __future__ import annotations

import math

import numpy as np
import pytest

from ncdp_fast.audit import (bound_from_scores, gdp_rejects, guess_grid, one_run_bound,
                             one_run_bound_gdp, one_run_p_value)

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

FAST = settings(max_examples=40, deadline=None, derandomize=True)


@pytest.mark.parametrize("r", [1, 2, 10, 100, 1000, 5000])
@pytest.mark.parametrize("confidence", [0.9, 0.95, 0.99])
def test_all_correct_closed_form(r, confidence):
    # All r guesses right, delta = 0: P[Bin(r, p) >= r] = p^r = 1 - confidence.
    p = (1 - confidence) ** (1 / r)
    expected = max(0.0, math.log(p / (1 - p)))
    got = one_run_bound(r, r, confidence=confidence)
    assert got == pytest.approx(expected, rel=1e-10, abs=1e-12)


@pytest.mark.parametrize("v,r", [(1, 1), (6, 10), (60, 100), (90, 100), (180, 200),
                                 (520, 1000), (999, 1000)])
def test_delta_zero_matches_incomplete_beta_inverse(v, r):
    # P[Bin(r, p) >= v] = I_p(v, r - v + 1): its inverse in p is scipy's betaincinv,
    # a computation that shares nothing with the bound's root finding on logsf.
    from scipy.special import betaincinv
    p = float(betaincinv(v, r - v + 1, 0.05))
    expected = max(0.0, math.log(p / (1 - p)))
    assert one_run_bound(v, r) == pytest.approx(expected, rel=1e-9, abs=1e-11)


@pytest.mark.parametrize("v,r,m,delta", [(90, 100, 1000, 1e-5), (40, 40, 1000, 1e-5),
                                         (150, 200, 200, 1e-4), (45, 50, 500, 1e-4)])
def test_delta_term_against_mpmath(v, r, m, delta):
    # At the returned eps the theorem's bound, recomputed term by term in
    # 50-digit arithmetic, equals 1 - confidence.
    mp = pytest.importorskip("mpmath")
    mp.mp.dps = 50
    eps = one_run_bound(v, r, delta=delta, canaries=m)
    assert eps > 0
    p = 1 / (1 + mp.e ** (-mp.mpf(eps)))
    pmf = [mp.binomial(r, j) * p ** j * (1 - p) ** (r - j) for j in range(r + 1)]
    beta = mp.fsum(pmf[v:])
    alpha = max(mp.fsum(pmf[v - i:v]) / i for i in range(1, v + 1))
    bound = beta + 2 * m * delta * alpha
    assert float(bound) == pytest.approx(0.05, rel=1e-9)
    assert one_run_p_value(eps, v, r, delta=delta, canaries=m) == pytest.approx(0.05, rel=1e-9)


def test_delta_only_weakens_the_bound():
    assert one_run_bound(90, 100, delta=1e-5, canaries=1000) < one_run_bound(90, 100)
    assert one_run_bound(90, 100, delta=1e-2, canaries=1000) < \
        one_run_bound(90, 100, delta=1e-5, canaries=1000)


@FAST
@given(st.integers(1, 400), st.data(), st.sampled_from([0.0, 1e-5, 1e-3]))
def test_monotone_in_correct_and_guesses(r, data, delta):
    m = r + data.draw(st.integers(0, 300))
    v = data.draw(st.integers(0, r))
    b = one_run_bound(v, r, delta=delta, canaries=m)
    # one more right guess cannot lower the bound, one more wrong one cannot raise it
    if v < r:
        assert one_run_bound(v + 1, r, delta=delta, canaries=m) >= b
    if r < m:
        assert one_run_bound(v, r + 1, delta=delta, canaries=m) <= b + 1e-12
        assert one_run_bound(v + 1, r + 1, delta=delta, canaries=m) >= b - 1e-12


@FAST
@given(st.integers(1, 300), st.data())
def test_gdp_monotone_in_correct_and_guesses(r, data):
    m = r + data.draw(st.integers(0, 300))
    v = data.draw(st.integers(0, r))
    b = one_run_bound_gdp(v, r, m).mu
    if v < r:
        assert one_run_bound_gdp(v + 1, r, m).mu >= b
    if r < m:
        assert one_run_bound_gdp(v, r + 1, m).mu <= b * (1 + 1e-9) + 1e-12


@FAST
@given(st.integers(1, 60), st.data(), st.sampled_from([0.01, 0.05, 0.2]))
def test_gdp_at_mu_zero_is_sound_against_the_exact_test(r, data, tau):
    # mu = 0: the run tells nothing, the right guesses are Binomial(r, 1/2) exactly.
    # The recursion may reject only where the exact binomial test rejects.
    from scipy.stats import binom
    m = r + data.draw(st.integers(0, 40))
    v = data.draw(st.integers(0, r))
    if gdp_rejects(0.0, v, r, m, confidence=1 - tau):
        assert binom.sf(v - 1, r, 0.5) <= tau


@pytest.mark.parametrize("m", [1, 4, 5, 10])
def test_gdp_at_mu_zero_all_guessed_right_is_exact(m):
    # r = m, all right: P = 2^-m, rejected iff 2^-m <= tau (tau = 1/16 at m = 4: the edge).
    assert gdp_rejects(0.0, m, m, m, confidence=1 - 1 / 16) == (2.0 ** -m <= 1 / 16)
    assert gdp_rejects(0.0, m, m, m) == (2.0 ** -m <= 0.05)


def test_gdp_false_alarm_rate_monte_carlo():
    # The Gaussian game: canary i's observation is mu * S_i + N(0, 1) with S_i a fair
    # bit (exactly mu-GDP in each canary); guesses: top k IN, bottom k OUT.  Testing
    # the true mu must reject in at most tau = 5 % of runs.  With N = 1500 runs the
    # count exceeds Bin(N, 0.05)'s 1 - 1e-6 quantile with probability < 1e-6 when
    # the bound is valid (the false-alarm rate of this test).
    from scipy.stats import binom
    rng = np.random.default_rng(20261125)
    N = 1500
    for m, k, mu in ((20, 10, 2.0), (200, 20, 1.0), (1000, 50, 0.925)):
        rejections = power = 0
        for _ in range(N):
            s = rng.random(m) < 0.5
            order = np.argsort(mu * s + rng.standard_normal(m))
            v = int(s[order[-k:]].sum() + (~s[order[:k]]).sum())
            rejections += gdp_rejects(mu, v, 2 * k, m)
            power += gdp_rejects(mu / 2, v, 2 * k, m)
        assert rejections <= binom.ppf(1 - 1e-6, N, 0.05), (m, k, mu, rejections)
        if m == 1000:
            # not vacuous: half the true mu is rejected in most runs (measured 89 %)
            assert power > 0.5 * N


def test_gdp_bound_at_least_the_dp_bound_where_nontrivial():
    # Mahloujifar et al.: for the Gaussian curve the f-DP analysis is tighter.  Measured
    # on this grid wherever the (eps, delta) bound is >= 0.1; near 0 it can be below
    # (m = 1000, r = 100, v = 60: 0.044 against 0.050).
    for m in (100, 1000):
        for r in sorted({m // 10, m // 5, m // 2, m}):
            for acc in (0.6, 0.7, 0.8, 0.9, 0.95, 1.0):
                v = int(round(acc * r))
                dp = one_run_bound(v, r, delta=1e-5, canaries=m)
                gdp = one_run_bound_gdp(v, r, m, delta=1e-5)
                if dp >= 0.1:
                    assert gdp.epsilon >= dp, (m, r, v, dp, gdp)


def test_gdp_epsilon_is_the_gdp_conversion():
    from ncdp_fast.privacy import gdp_to_dp
    b = one_run_bound_gdp(90, 100, 1000, delta=1e-5)
    assert b.mu > 0 and b.epsilon == pytest.approx(gdp_to_dp(b.mu, 1e-5), rel=1e-12)
    assert one_run_bound_gdp(90, 100, 1000).epsilon is None
    assert not gdp_rejects(b.mu * (1 + 1e-8), 90, 100, 1000)
    assert gdp_rejects(b.mu * (1 - 1e-8), 90, 100, 1000)


def test_no_information_no_bound():
    assert one_run_bound(50, 100) == 0.0
    assert one_run_bound(0, 0) == 0.0
    assert one_run_bound_gdp(50, 100, 100, delta=1e-5).mu == 0.0
    assert one_run_bound_gdp(0, 0, 10).mu == 0.0


@pytest.mark.parametrize("call,name", [
    (lambda: one_run_bound(11, 10), "correct"),
    (lambda: one_run_bound(-1, 10), "correct"),
    (lambda: one_run_bound(5, 10, delta=1e-5), "canaries"),
    (lambda: one_run_bound(5, 10, delta=1e-5, canaries=9), "guesses"),
    (lambda: one_run_bound(5, 10, confidence=1.0), "confidence"),
    (lambda: one_run_bound(5, 10, delta=1.0, canaries=10), "delta"),
    (lambda: one_run_bound(5.0, 10), "correct"),
    (lambda: one_run_bound(True, 10), "correct"),
    (lambda: one_run_bound_gdp(5, 10, 5), "guesses"),
    (lambda: one_run_bound_gdp(5, 10, 10, delta=0.0), "delta"),
    (lambda: gdp_rejects(-1.0, 5, 10, 10), "mu"),
    (lambda: one_run_p_value(-0.5, 5, 10), "epsilon"),
])
def test_argument_errors_name_the_argument(call, name):
    with pytest.raises((ValueError, TypeError)) as e:
        call()
    assert str(e.value).startswith(name + ":")


def test_bound_from_scores_perfect_and_errors():
    m = 200
    mem = np.arange(m) % 2 == 0
    res = bound_from_scores(mem.astype(float) + 1e-3 * np.arange(m), mem, delta=1e-5, k=50)
    assert (res.k, res.guesses, res.correct) == (50, 100, 100)
    assert mem[res.guessed_in].all() and not mem[res.guessed_out].any()
    assert res.epsilon_lower_bound == pytest.approx(
        one_run_bound(100, 100, delta=1e-5, canaries=m), rel=1e-12)
    # the grid: Bonferroni over its k, each bound at 1 - 0.05 / len(grid)
    res = bound_from_scores(mem.astype(float), mem, delta=1e-5)
    grid = guess_grid(m)
    assert res.k_grid == grid and res.k in grid
    assert res.epsilon_lower_bound == pytest.approx(one_run_bound(
        2 * res.k, 2 * res.k, delta=1e-5, canaries=m, confidence=1 - 0.05 / len(grid)))
    with pytest.raises(ValueError, match="^k:"):
        bound_from_scores(mem.astype(float), mem, delta=1e-5, k=101)
    with pytest.raises(ValueError, match="^scores: expected finite"):
        bound_from_scores(np.full(m, np.nan), mem, delta=1e-5)
    with pytest.raises(ValueError, match="^scores, membership"):
        bound_from_scores(np.zeros(m), mem.astype(int), delta=1e-5)


def test_planned_k_pair_is_used_at_full_confidence():
    from ncdp_fast.audit import plan_k
    m = 200
    mem = np.arange(m) % 2 == 0
    res = bound_from_scores(mem.astype(float), mem, delta=1e-5, k=(10, 50))
    assert (res.k, res.k_gdp, res.k_grid) == (10, 50, (10, 50))
    assert res.epsilon_lower_bound == pytest.approx(
        one_run_bound(20, 20, delta=1e-5, canaries=m), rel=1e-12)
    assert res.mu_lower_bound == pytest.approx(one_run_bound_gdp(100, 100, m).mu, rel=1e-12)
    # the plan depends only on (m, mu, delta, confidence) and its own generator
    a = plan_k(m, 1.0, delta=1e-5, rng=np.random.default_rng(1))
    assert a == plan_k(m, 1.0, delta=1e-5, rng=np.random.default_rng(1))
    assert all(x in guess_grid(m) for x in a)
    with pytest.raises(ValueError, match="^k:"):
        bound_from_scores(mem.astype(float), mem, delta=1e-5, k=(1, 2, 3))


def test_each_result_says_which_analysis_can_detect_a_break_of_the_claim():
    """Issue 35, item 6: the (eps, delta) bound of r = 100 guesses (k = 50) cannot
    exceed 3.47 at delta 1e-5, confidence 0.95, so against a claim of 4 it could
    never detect a break, while the mu-GDP bound of the same guesses reaches 5.5.
    The result reports each analysis's reachable bound (its bound with every
    guess right) and whether it can exceed the claim."""
    rng = np.random.default_rng(0)
    m = 1000
    mem = rng.random(m) < 0.5
    res = bound_from_scores(mem * 3.0 + rng.standard_normal(m), mem, delta=1e-5, k=(50, 50),
                            epsilon_claimed=4.0)
    assert res.epsilon_reachable == pytest.approx(3.465, abs=1e-3)
    assert res.epsilon_lower_bound <= res.epsilon_reachable < 4.0 < res.epsilon_reachable_gdp
    assert res.can_detect() == {"eps_delta": False, "gdp": True}
    assert res.summary()["can_detect"] == {"eps_delta": False, "gdp": True}
    # With every guess right, the bound is the reachable one (so it is reachable).
    perfect = bound_from_scores(mem * 100.0, mem, delta=1e-5, k=(50, 50), epsilon_claimed=4.0)
    assert perfect.epsilon_lower_bound == pytest.approx(perfect.epsilon_reachable)
    assert bound_from_scores(mem * 3.0, mem, delta=1e-5, k=(50, 50)).can_detect() == \
        {"eps_delta": None, "gdp": None}


def test_guess_helpers_check_their_arguments():
    """The sixth audit: guess_grid(0 / -1 / 2.5 / NaN) answered (1,), plan_k
    took mu NaN or -1 and delta 0, and subsampled_gaussian_score sigma -1 or
    q 0 / 1.5 / NaN."""
    from ncdp_fast.audit.guess import guess_grid, plan_k, subsampled_gaussian_score
    for m in (0, -1):
        with pytest.raises(ValueError, match="m: expected an integer >= 1"):
            guess_grid(m)
    with pytest.raises(TypeError, match="m: expected"):
        guess_grid(2.5)
    for kw, match in ((dict(mu=float("nan"), delta=1e-5), "mu"), (dict(mu=-1.0, delta=1e-5), "mu"),
                      (dict(mu=1.0, delta=0.0), "delta")):
        with pytest.raises(ValueError, match=f"{match}: expected"):
            plan_k(100, **kw)
    g = np.zeros((2, 3))
    for sigma, q, match in ((-1.0, 0.5, "sigma"), (1.0, 1.5, "q"), (1.0, float("nan"), "q"),
                            (1.0, 0.0, "q")):
        with pytest.raises(ValueError, match=f"{match}: expected"):
            subsampled_gaussian_score(g, sigma, q)
