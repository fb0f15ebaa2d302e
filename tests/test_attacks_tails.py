"""Issue 23, item 5: the Gaussian sampler's tails, their accounting, secure_mode.

With 32-bit Box-Muller uniforms no normal exceeded 6.7637, so a record whose
clipped contribution lies on one coordinate produced outputs impossible without
it.  Now u1 has 128 bits on every backend (bound ~13.37, the same words and
sums everywhere), and every reported or calibrated (epsilon, delta) charges the
truncation (ncdp_fast.privacy.truncation).
"""
from __future__ import annotations

import math
import struct
import subprocess

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

import ncdp_fast
from ncdp_fast import privacy
from ncdp_fast import reference as R
from ncdp_fast.reference import rng as RR
from ncdp_fast._numba import rng as M
from ncdp_fast.privacy import subsampled as S
from ncdp_fast.privacy import truncation
from ncdp_fast.privacy._validate import import_dp_accounting

from _host_cpp import build

OLD_BOUND = 6.7637          # sqrt(-2 ln(0.5 / 2^32)), the 32-bit sampler's largest |z|
W32 = st.integers(0, 2**32 - 1)
EXTREMES = [(0,) * 6, (2**32 - 1,) * 6, (0, 2**32 - 1, 0, 0, 0, 2**32 - 1),
            (1, 0, 0, 0, 0, 0), (0, 0, 0, 0, 1, 0)]


def _bits(x):
    return struct.unpack("<Q", struct.pack("<d", x))[0]


def _from_bits(h):
    return struct.unpack("<d", struct.pack("<Q", int(h, 16)))[0]


DRIVER = r"""
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include "common/philox.cuh"

// Reads a b x0 x1 x2 x3 (decimal words) per line; prints the bits of u1, u2.
int main() {
  unsigned long long v[6];
  while (std::scanf("%llu %llu %llu %llu %llu %llu", &v[0], &v[1], &v[2], &v[3], &v[4],
                    &v[5]) == 6) {
    const ncdp::philox::Block x{{static_cast<std::uint32_t>(v[2]),
                                 static_cast<std::uint32_t>(v[3]),
                                 static_cast<std::uint32_t>(v[4]),
                                 static_cast<std::uint32_t>(v[5])}};
    double u1, u2;
    ncdp::philox::uniforms_of_words(static_cast<std::uint32_t>(v[0]),
                                    static_cast<std::uint32_t>(v[1]), x, &u1, &u2);
    std::uint64_t b1, b2;
    std::memcpy(&b1, &u1, sizeof u1);
    std::memcpy(&b2, &u2, sizeof u2);
    std::printf("%016" PRIx64 " %016" PRIx64 "\n", b1, b2);
  }
  return 0;
}
"""


@pytest.fixture(scope="module")
def cpp(tmp_path_factory):
    """philox.cuh's uniforms_of_words, host build (the CUDA kernels' formula)."""
    exe = build(DRIVER, tmp_path_factory.mktemp("tails_cpp"), "-O2")

    def run(words):
        out = subprocess.run([str(exe)], input="".join(" ".join(map(str, w)) + "\n"
                                                       for w in words),
                             capture_output=True, text=True, check=True).stdout.split()
        return [(_from_bits(a), _from_bits(b)) for a, b in zip(out[0::2], out[1::2])]
    return run


def _numba(w):
    return M.uniforms_of_words(*(np.uint64(x) for x in w))


def test_tail_bound_is_the_reachable_maximum_and_wide():
    # The smallest u1 any backend can form is all-zero words: 0.5 / 2^128.
    u1, u2 = R.uniforms_of_words(0, 0, 0, 0, 0, 0)
    assert u1 == 2.0 ** -129
    z_max = RR.box_muller(u1, u2, False)      # cos(2 pi u2) rounds to 1 at the smallest u2
    assert z_max == ncdp_fast.GAUSSIAN_TAIL_BOUND == R.GAUSSIAN_TAIL_BOUND
    assert ncdp_fast.GAUSSIAN_TAIL_BOUND == pytest.approx(math.sqrt(258 * math.log(2)), rel=4e-16)
    assert ncdp_fast.GAUSSIAN_TAIL_BOUND > 13.37 > OLD_BOUND
    # u1 is monotone in its words (float64 sums of non-negative terms, rounded
    # to nearest), so no other words give a smaller one.  The largest rounds to
    # 1.0: radius 0, finite.
    u1_top, _ = R.uniforms_of_words(*(2**32 - 1,) * 6)
    assert u1_top == 1.0 and RR.box_muller(u1_top, 0.25, True) == 0.0


def test_extreme_words_agree_bitwise_on_every_backend(cpp):
    got_cpp = cpp(EXTREMES)
    for w, c in zip(EXTREMES, got_cpp):
        ref = R.uniforms_of_words(*w)
        assert tuple(map(_bits, _numba(w))) == tuple(map(_bits, ref)) == tuple(map(_bits, c)), w


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(W32, W32, W32, W32, W32, W32), min_size=1, max_size=40))
def test_uniforms_agree_bitwise_hypothesis(cpp, words):
    for w, c in zip(words, cpp(words)):
        ref = R.uniforms_of_words(*w)
        assert tuple(map(_bits, _numba(w))) == tuple(map(_bits, ref)) == tuple(map(_bits, c)), w
        assert 0.0 < ref[0] <= 1.0 and 0.0 < ref[1] <= 1.0


def test_tail_words_are_no_draw():
    # A pair's tail block 2^63 + p is outside every draw's block (< 2^62) and
    # is keyed like the main stream (counter words 2-3 zero, unlike sub-streams).
    seed, pair = 2**40 + 3, 12345
    main = R.philox_words(4, seed=seed, offset=4 * (pair >> 1))
    lane = 2 * (pair & 1)
    t = (1 << 63) + pair
    tail = R.philox4x32_10((seed & R.MASK32, seed >> 32), (t & R.MASK32, t >> 32, 0, 0))
    assert R.pair_uniforms(seed, pair) == R.uniforms_of_words(main[lane], main[lane + 1], *tail)


# ----------------------------------------------------------------- accounting

def _issue_lower_bound(sigma, q, steps):
    """1 - (1 - q P(Z > 6.7637 - 1/sigma))^T: the issue's delta lower bound of the
    32-bit sampler (a record on one coordinate, output beyond the bound)."""
    return -math.expm1(steps * math.log1p(-q * stats.norm.sf(OLD_BOUND - 1.0 / sigma)))


def test_old_mass_charge_covers_the_issue_lower_bounds():
    old = 2.0 ** -32                              # P(u1 < 2^-32): the 32-bit sampler's cell
    # DP-SGD, eps = 8, n = 60000, batch 64, 10 epochs (delta 1e-5), PLD-calibrated.
    q, steps = 64 / 60000, 10 * 60000 // 64
    sigma = privacy.calibrate_noise_multiplier(8.0, 1e-5, q, steps)
    lb = _issue_lower_bound(sigma, q, steps)
    assert 2.5e-5 < lb < 2.7e-5                   # the issue's 2.6e-5
    # At least one noise pair per step: the charge upper-bounds the true extra delta.
    assert truncation.truncation_delta(8.0, steps, mass=old) >= lb
    # NoisyGD, one full-batch step at sigma = 0.3045 (epsilon ~20 at delta 1e-5).
    eps = privacy.zcdp_to_dp(privacy.gaussian_zcdp(1.0, 0.3045), 1e-5)
    lb = _issue_lower_bound(0.3045, 1.0, 1)
    assert 19.5 < eps < 20.5 and 2.4e-4 < lb < 2.6e-4   # the issue's 2.5e-4
    assert truncation.truncation_delta(eps, 1, mass=old) >= lb
    # With the 128-bit u1 and every pair one key can draw, the charge is tiny.
    assert truncation.truncation_delta(8.0) < 1e-16


@pytest.fixture
def loud_tails(monkeypatch):
    """The 32-bit sampler's cell mass over 1000 pairs: a charge the tests can see."""
    monkeypatch.setattr(truncation, "GAUSSIAN_TRUNCATION_MASS", 2.0 ** -32)
    monkeypatch.setattr(truncation, "PAIRS_PER_KEY", 1000)
    return lambda e: truncation.truncation_delta(e)


def _gdp_ok(mu, eps, delta, charge):
    return privacy.gdp_delta(mu, eps) + charge(eps) <= delta


def test_every_report_charges_truncation(loud_tails):
    d, sigma, q, T = 1e-5, 1.0, 0.01, 200
    mu = privacy.poisson_gdp_mu(sigma, q, T)
    assert _gdp_ok(mu, privacy.epsilon_poisson_gaussian(sigma, q, T, d, "gdp"), d, loud_tails)
    event = S.gaussian_event(import_dp_accounting(), sigma, q, T)
    for acc, ideal in (("pld", S._pld_epsilon_of(event, S.DEFAULT_VALUE_DISCRETIZATION_INTERVAL)),
                       ("rdp", S._rdp_epsilon_of(event))):
        e = privacy.epsilon_poisson_gaussian(sigma, q, T, d, acc)
        charge = loud_tails(e)
        assert 1e-7 < charge < d
        assert ideal(d) < e and ideal(d - charge) <= e
    # The accountant (the torch engine's and trainers' get_epsilon) and its zCDP path.
    a = privacy.Accountant()
    a.step(noise_multiplier=8.0, sample_rate=1.0, steps=10)
    rho = a.zcdp_rho()
    e = a.epsilon(d, "zcdp")
    assert math.isfinite(e) and e > privacy.zcdp_to_dp(rho, d)
    assert privacy.zcdp_to_dp(rho, d - loud_tails(e)) <= e
    e = a.epsilon(d, "gdp")
    assert _gdp_ok(math.sqrt(10) / 8.0, e, d, loud_tails)
    # Composed releases may be keyed apart: one key's pairs per event (zCDP counts too).
    a.add_zcdp(0.01, count=2)
    e = a.epsilon(d, "zcdp")
    three_keys = truncation.truncation_delta(e, 3 * truncation.PAIRS_PER_KEY)
    assert three_keys > loud_tails(e)
    assert privacy.zcdp_to_dp(a.zcdp_rho(), d - three_keys) <= e
    # Hierarchical sampling (the release's accountant), CLT form.
    kw = dict(mixup_degree=4, n=1000, num_samples=200, class_rates=[1.0], delta=d)
    e = privacy.hs_epsilon(1.0, accountant="clt", **kw)
    assert _gdp_ok(privacy.poisson_gdp_mu(1.0, 0.004, 200), e, d, loud_tails)
    # Calibration leaves the charge out of the ideal delta: more noise than without it.
    nz = privacy.neuromix_noise(2.0, d, n=1000, mixup_degree=4, num_samples=200,
                                accountant="clt")
    assert nz.mu == privacy.dp_to_gdp(2.0, d - loud_tails(2.0)) < privacy.dp_to_gdp(2.0, d)
    s_new = privacy.calibrate_noise_multiplier(2.0, d, q, T, "gdp")
    assert _gdp_ok(privacy.poisson_gdp_mu(s_new, q, T), 2.0 * (1 + 1e-12), d, loud_tails)


def test_charge_larger_than_delta_is_refused(loud_tails):
    with pytest.raises(ValueError, match="delta: expected more than the truncation charge"):
        truncation.ideal_delta(1e-9, 8.0)
    assert privacy.epsilon_poisson_gaussian(1.0, 0.01, 200, 1e-9, "gdp") == math.inf


@settings(max_examples=60, deadline=None)
@given(mu=st.floats(0.05, 20.0), log_delta=st.floats(-12.0, -2.0), pairs=st.integers(1, 10**9),
       log_mass=st.floats(-128.0, -20.0))
def test_reported_epsilon_covers_ideal_plus_charge(mu, log_delta, pairs, log_mass):
    # Property: whatever epsilon is reported, ideal delta + truncation charge <= delta.
    delta, mass = 10.0 ** log_delta, 2.0 ** log_mass
    e = truncation.epsilon_with_truncation(lambda d: privacy.gdp_to_dp(mu, d), delta, pairs,
                                           mass=mass)
    if math.isfinite(e):
        charge = truncation.truncation_delta(e, pairs, mass=mass)
        # gdp_to_dp solves to relative 1e-12 in epsilon (its brentq tolerance), so
        # allow gdp_delta's change over that much epsilon.
        slack = privacy.gdp_delta(mu, e * (1 - 1e-11)) - privacy.gdp_delta(mu, e)
        assert privacy.gdp_delta(mu, e) + charge <= delta + slack
        assert charge < delta
    else:
        assert truncation.truncation_delta(privacy.gdp_to_dp(mu, delta), pairs,
                                           mass=mass) > 0.0


@settings(max_examples=40, deadline=None)
@given(e1=st.floats(0.0, 50.0), e2=st.floats(0.0, 50.0), p1=st.integers(1, 2**63),
       p2=st.integers(1, 2**63))
def test_charge_grows_with_epsilon_and_pairs(e1, e2, p1, p2):
    lo_e, hi_e = sorted((e1, e2))
    lo_p, hi_p = sorted((p1, p2))
    assert truncation.truncation_delta(lo_e, lo_p) <= truncation.truncation_delta(hi_e, hi_p)


# ----------------------------------------------------------------- secure_mode

def test_secure_mode_is_refused():
    torch_engine = pytest.importorskip("ncdp_fast.torch.engine")
    with pytest.raises(ValueError, match="secure_mode: expected False, got True.*Mironov"):
        torch_engine.PrivacyEngine(secure_mode=True)
    with pytest.raises(TypeError, match="secure_mode"):
        torch_engine.PrivacyEngine(secure_mode="yes")
    assert torch_engine.PrivacyEngine(secure_mode=False).secure_mode is False
