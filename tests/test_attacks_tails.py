"""Issue 23, item 5: the Gaussian sampler's tails, their accounting, secure_mode.

With 32-bit Box-Muller uniforms no normal exceeded 6.7637, so a record whose
clipped contribution lies on one coordinate produced outputs impossible without
it.  Now u1 has 64 bits, 128 below 2^-11, on every backend (bound ~13.37, the
same words and sums everywhere), and every reported or calibrated (epsilon,
delta) charges the truncation (ncdp_fast.privacy.truncation).
"""
from __future__ import annotations

import math
import struct
import subprocess
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import njit
from scipy import stats

import ncdp_fast
from ncdp_fast import privacy
from ncdp_fast import reference as R
from ncdp_fast.reference import rng as RR
from ncdp_fast._numba import rng as M
from ncdp_fast.privacy import subsampled as S
from ncdp_fast.privacy import truncation

from _host_cpp import build
from conftest import first_deep_pair, gamma

OLD_BOUND = 6.7637          # sqrt(-2 ln(0.5 / 2^32)), the 32-bit sampler's largest |z|
TOP = 2**32 - 1
W32 = st.integers(0, TOP)
# Leading draws of a pair that reads its deep block, and of one that does not.
DEEP_A = st.integers(0, R.DEEP_BELOW - 1)
WIDE_A = st.integers(R.DEEP_BELOW, TOP)
# Words (a, b, y, v, x0, x1): all zero (the smallest u1), all ones, both sides
# of a = 2^21 with the rest at either extreme, single low bits.
EXTREMES = [(0,) * 6, (TOP,) * 6, (0, TOP, 0, TOP, 0, 0),
            (R.DEEP_BELOW - 1, 0, 0, 0, 0, 0), (R.DEEP_BELOW - 1, TOP, TOP, TOP, TOP, TOP),
            (R.DEEP_BELOW, 0, 0, 0, 0, 0), (R.DEEP_BELOW, TOP, TOP, TOP, TOP, TOP),
            (1, 0, 0, 0, 0, 0), (0, 0, 1, 0, 0, 0), (0, 0, 0, 0, 1, 0), (0, 0, 0, 0, 0, 1),
            (0, 0, 0, 1, 0, 0), (0, 1, 0, 0, 0, 0)]
TWO = Fraction(2)


def _bits(x):
    return struct.unpack("<Q", struct.pack("<d", x))[0]


def _from_bits(h):
    return struct.unpack("<d", struct.pack("<Q", int(h, 16)))[0]


DRIVER = r"""
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include "common/philox.cuh"

static void print_bits(double u1, double u2) {
  std::uint64_t b1, b2;
  std::memcpy(&b1, &u1, sizeof u1);
  std::memcpy(&b2, &u2, sizeof u2);
  std::printf("%016" PRIx64 " %016" PRIx64 "\n", b1, b2);
}

// Per line, "w a b y v x0 x1" (uniforms_of_words) or "p seed pair" (pair_blocks,
// then pair_uniforms: the kernels' addressing); prints the bits of u1, u2.
int main() {
  char op;
  unsigned long long v[6];
  while (std::scanf(" %c", &op) == 1) {
    double u1, u2;
    if (op == 'w') {
      if (std::scanf("%llu %llu %llu %llu %llu %llu", &v[0], &v[1], &v[2], &v[3], &v[4],
                     &v[5]) != 6) return 1;
      std::uint32_t w[6];
      for (int i = 0; i < 6; ++i) w[i] = static_cast<std::uint32_t>(v[i]);
      ncdp::philox::uniforms_of_words(w[0], w[1], w[2], w[3], w[4], w[5], &u1, &u2);
    } else {
      if (std::scanf("%llu %llu", &v[0], &v[1]) != 2) return 1;
      ncdp::philox::pair_uniforms(v[0], v[1], ncdp::philox::pair_blocks(v[0], v[1] >> 1), &u1,
                                  &u2);
    }
    print_bits(u1, u2);
  }
  return 0;
}
"""


@pytest.fixture(scope="module")
def cpp(tmp_path_factory):
    """philox.cuh's uniforms_of_words ("w", words) and pair_uniforms ("p", (seed,
    pair)), host build (the CUDA kernels' formula and addressing)."""
    exe = build(DRIVER, tmp_path_factory.mktemp("tails_cpp"), "-O2")

    def run(op, rows):
        out = subprocess.run([str(exe)], input="".join(f"{op} " + " ".join(map(str, w)) + "\n"
                                                       for w in rows),
                             capture_output=True, text=True, check=True).stdout.split()
        return [(_from_bits(a), _from_bits(b)) for a, b in zip(out[0::2], out[1::2])]
    return run


def _numba(w):
    return M.uniforms_of_words(*(np.uint64(x) for x in w))


def _exact_u1(a, y, x0, x1):
    """u1 before rounding: the midpoint of the words' cell, and the cell's width."""
    if a >= R.DEEP_BELOW:
        return (a * TWO**32 + y + Fraction(1, 2)) / TWO**64, TWO**-64
    return (((a * TWO**32 + y) * TWO**32 + x0) * TWO**32 + x1 + Fraction(1, 2)) / TWO**128, \
        TWO**-128


def _check_u1_rounding(w, u1):
    """The 64-bit sum rounds once (a correctly rounded float64); the deep sum's
    three additions of non-negative terms are within gamma_3 (Higham 3.4)."""
    exact, _ = _exact_u1(w[0], w[2], w[4], w[5])
    if w[0] >= R.DEEP_BELOW:
        assert u1 == float(exact), w
    else:
        assert abs(Fraction(u1) - exact) <= Fraction(gamma(3, np.float64)) * exact, w


def test_tail_bound_is_the_reachable_maximum_and_wide():
    # The smallest u1 any backend can form is all-zero words: 0.5 / 2^128.
    u1, u2 = R.uniforms_of_words(0, 0, 0, 0, 0, 0)
    assert u1 == 2.0 ** -129
    z_max = RR.box_muller(u1, u2, False)      # cos(2 pi u2) rounds to 1 at the smallest u2
    assert z_max == ncdp_fast.GAUSSIAN_TAIL_BOUND == R.GAUSSIAN_TAIL_BOUND
    assert ncdp_fast.GAUSSIAN_TAIL_BOUND == pytest.approx(math.sqrt(258 * math.log(2)), rel=4e-16)
    assert ncdp_fast.GAUSSIAN_TAIL_BOUND > 13.37 > OLD_BOUND
    # u1 is monotone in its words within each branch, and every deep u1 is at
    # most the least other one (test_u1_cells_tile_the_unit_interval), so no
    # other words give a smaller one.  The largest rounds to 1.0: radius 0, finite.
    u1_top, _ = R.uniforms_of_words(*(TOP,) * 6)
    assert u1_top == 1.0 and RR.box_muller(u1_top, 0.25, True) == 0.0


def test_u1_cells_tile_the_unit_interval():
    """The contract's claims on u1's grid, from the words' exact values: every
    cell is as probable as it is wide, the cells tile [0, 1), and the lowest,
    u1 < 2^-128, has the mass the accountant charges."""
    # One cell per word tuple that u1 reads: (a, y) when a >= 2^21, each of
    # probability 2^-64; (a, y, x0, x1) when a < 2^21, each 2^-128.
    for w in EXTREMES:
        mid, width = _exact_u1(w[0], w[2], w[4], w[5])
        assert width == TWO**(-32 * (2 if w[0] >= R.DEEP_BELOW else 4))
        # A midpoint: the cell's lower end is a multiple of its width.
        assert ((mid - width / 2) / width).denominator == 1
    # Deep cells fill [0, 2^-11) and the others [2^-11, 1): the top deep cell
    # ends where the least other one starts, each branch's mass is its span.
    top_deep, w_deep = _exact_u1(R.DEEP_BELOW - 1, TOP, TOP, TOP)
    low_wide, w_wide = _exact_u1(R.DEEP_BELOW, 0, 0, 0)
    top_wide, _ = _exact_u1(TOP, TOP, 0, 0)
    assert top_deep + w_deep / 2 == low_wide - w_wide / 2 == TWO**-11 == \
        Fraction(R.DEEP_BELOW, 2**32)
    assert top_wide + w_wide / 2 == 1
    # The lowest cell [0, 2^-128): the all-zero words alone, mass 2^-128.
    low, w_low = _exact_u1(0, 0, 0, 0)
    assert low - w_low / 2 == 0 and low + w_low / 2 == TWO**-128 == \
        Fraction(R.GAUSSIAN_TRUNCATION_MASS)
    # In float64: both branches meet at 2^-11 without crossing, whatever the
    # rounding (the top deep midpoint, 2^-11 - 2^-129, rounds up to it).
    assert R.uniforms_of_words(R.DEEP_BELOW - 1, 0, TOP, 0, TOP, TOP)[0] == 2.0 ** -11
    assert R.uniforms_of_words(R.DEEP_BELOW, 0, 0, 0, 0, 0)[0] == 2.0 ** -11
    for w in EXTREMES:
        _check_u1_rounding(w, R.uniforms_of_words(*w)[0])


@settings(max_examples=60, deadline=None)
@given(a=st.one_of(DEEP_A, WIDE_A), y=W32, x0=W32, x1=W32)
def test_u1_rounds_its_cell_midpoint(a, y, x0, x1):
    _check_u1_rounding((a, 0, y, 0, x0, x1), R.uniforms_of_words(a, 0, y, 0, x0, x1)[0])


def test_deep_words_are_read_only_below_the_threshold():
    # The reference cannot read them above it: None is no number.
    for a in (R.DEEP_BELOW, TOP):
        assert R.uniforms_of_words(a, 5, 7, 9, None, None) == R.uniforms_of_words(a, 5, 7, 9, 1, 2)
        assert _numba((a, 5, 7, 9, 0, 0)) == _numba((a, 5, 7, 9, TOP, TOP))
    # Below it each deep word moves u1 (a = y = 0: the deep words are its top bits).
    assert len({R.uniforms_of_words(0, 5, 0, 9, x0, x1)[0]
                for x0, x1 in ((0, 0), (0, 1), (1, 0))}) == 3


def test_numba_kernel_finds_every_deep_pair_by_its_64_bit_u1():
    # _add_gaussian redoes the pairs whose 64-bit u1 is at most 2^-11: every
    # deep pair's is (its largest words), no other pair's is below (its least).
    assert M._u1_64(np.uint64(R.DEEP_BELOW - 1), np.uint64(TOP)) <= M._DEEP_U1
    assert M._u1_64(np.uint64(R.DEEP_BELOW), np.uint64(0)) >= M._DEEP_U1


def test_extreme_words_agree_bitwise_on_every_backend(cpp):
    got_cpp = cpp("w", EXTREMES)
    for w, c in zip(EXTREMES, got_cpp):
        ref = R.uniforms_of_words(*w)
        assert tuple(map(_bits, _numba(w))) == tuple(map(_bits, ref)) == tuple(map(_bits, c)), w


@pytest.mark.parametrize("leading", [DEEP_A, WIDE_A], ids=["deep", "wide"])
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_uniforms_agree_bitwise_hypothesis(cpp, leading, data):
    words = data.draw(st.lists(st.tuples(leading, W32, W32, W32, W32, W32), min_size=1,
                               max_size=40))
    for w, c in zip(words, cpp("w", words)):
        ref = R.uniforms_of_words(*w)
        assert tuple(map(_bits, _numba(w))) == tuple(map(_bits, ref)) == tuple(map(_bits, c)), w
        assert 0.0 < ref[0] <= 1.0 and 0.0 < ref[1] <= 1.0


def _words_of_pair(seed, pair):
    """A pair's six words read from the blocks the contract names."""
    key = (seed & R.MASK32, seed >> 32)
    m, h = pair >> 1, 2 * (pair & 1)

    def half(block):
        words = R.philox4x32_10(key, (block & R.MASK32, block >> 32, 0, 0))
        return words[h], words[h + 1]
    return (*half(m), *half((1 << 63) + m), *half((1 << 62) + m))


def test_block_ranges_are_disjoint():
    # Draws address blocks < 2^62 (a draw index < 2^64), deep blocks
    # [2^62, 2^63), companions [2^63, 2^63 + 2^62), all below 2^64; main block
    # indices m = pair >> 1 < 2^62.  Sub-streams differ in counter words 2-3.
    last_draw_block, last_m = (2**64 - 1) >> 2, (2**63 - 1) >> 1
    assert last_draw_block < R.DEEP_BLOCK == 2**62
    assert R.DEEP_BLOCK + last_m < R.COMPANION_BLOCK == 2**63
    assert R.COMPANION_BLOCK + last_m < 2**64


def test_pair_words_are_no_draw_and_agree_on_every_backend(cpp):
    # Pairs in each half of their main block, reading their deep block or not,
    # and the last pairs of a stream (the highest blocks of each range).
    seed = 2**40 + 3
    deep = [first_deep_pair(seed, 0), first_deep_pair(seed, 1)]
    pairs = deep + [deep[0] + 2, deep[1] - 2, 2**63 - 2, 2**63 - 1, 0, 1]
    for p in pairs:
        w = _words_of_pair(seed, p)
        assert (w[0] < R.DEEP_BELOW) == (p in deep), p
        assert R.pair_uniforms(seed, p) == R.uniforms_of_words(*w), p
    got_cpp = cpp("p", [(seed, p) for p in pairs])
    for p, c in zip(pairs, got_cpp):
        ref = R.pair_uniforms(seed, p)
        nb = M.pair_uniforms(np.uint64(seed), np.uint64(p))
        assert tuple(map(_bits, nb)) == tuple(map(_bits, ref)) == tuple(map(_bits, c)), p


@njit(error_model="numpy")
def _normals_pair_by_pair(seed, offset, count):
    """The numba kernel's arithmetic, one normal at a time from pair_uniforms."""
    out = np.empty(count)
    for j in range(count):
        k = offset + np.uint64(j)
        u1, u2 = M.pair_uniforms(seed, k >> np.uint64(1))
        c, s = M.cos_sin_2pi(u2)
        out[j] = np.sqrt(-2.0 * M.log_normal(u1)) * (s if k & np.uint64(1) else c)
    return out


@njit(error_model="numpy")
def _radii_the_deep_words_move(seed, first, npairs):
    """Pairs whose radius differs with and without their deep words (most deep
    pairs have a near 2^20, whose 64-bit u1 is already within an ulp)."""
    found = []
    for p in range(first, first + npairs):
        q = np.uint64(p)
        w = M.philox_block(seed, q >> np.uint64(1))
        c = M.philox_block(seed, M._COMPANION_BLOCK + (q >> np.uint64(1)))
        h = 2 * (p & 1)
        if w[h] < M._DEEP_BELOW:
            wide = np.sqrt(-2.0 * M.log_normal(M._u1_64(w[h], c[h])))
            if wide != np.sqrt(-2.0 * M.log_normal(M.pair_uniforms(seed, q)[0])):
                found.append(p)
    return found


def test_numba_kernel_gives_deep_pairs_their_bits():
    # Bit for bit the pair-by-pair form, on a range (2^18 pairs, ~128 deep ones)
    # that holds deep pairs whose radius the deep words change: a kernel that
    # skipped its deep pass, or looked for deep pairs wrongly, would differ there.
    seed, offset, count = np.uint64(77), 2**20 + 3, 2**19
    assert len(_radii_the_deep_words_move(seed, offset // 2, count // 2 + 1)) > 0
    got = ncdp_fast.gaussian(count, seed=int(seed), offset=offset, dtype=np.float64)
    assert np.array_equal(got, _normals_pair_by_pair(seed, np.uint64(offset), count))


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
    # With u1 down to 2^-129 and every pair one key can draw, the charge is tiny.
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
    groups = {(sigma, q): T}
    for acc, ideal in (("pld", S.dpa_epsilon_of(groups, "pld", S.DEFAULT_VALUE_DISCRETIZATION_INTERVAL,
                                                 "steps")),
                       ("rdp", S.dpa_epsilon_of(groups, "rdp", 1.0, "steps"))):
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
