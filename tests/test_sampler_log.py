"""The sampler's logarithm (issue 14): reference.sampler_log / sampler_log1p,
their numba copies (_numba/mix.py) and the C++ ones (csrc/common/philox.cuh,
compiled here for the host with g++) give the same bits; they are accurate;
and memberships at rates where one ulp of log decides a gap agree between the
reference and numba.

The geometric gap floor(log(u) / log1p(-q)) moves by one when the quotient
crosses an integer, so a one-ulp difference between two libms (NumPy's
AVX-512 log and glibc's differ on ~0.3 % of stream uniforms on the x86-64
development machine; the GPU has a third) used to change memberships."""
import math
import struct
import subprocess

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ncdp_fast as nf
from ncdp_fast import _stream
from ncdp_fast import reference as R
from ncdp_fast._numba import mix as M

from _host_cpp import build


EDGES = [1.0, 0.5, 2.0 ** -53, 2.0 ** -54, 1.0 - 2.0 ** -53, 1.0 - 2.0 ** -52, 1.0 + 2.0 ** -52,
         2.0, 0.75, 0.7071067811865476, 1.4142135623730951, 1e-300, 1e-19, 1e-16, 1.0 - 1e-16,
         5e-324, 2.0 ** -1022, 2.2250738585072009e-308, 1.7976931348623157e308, math.inf,
         0.0, -0.0, -1.0, -0.5, math.nan]
# log1p(-q) at the rates the brief names, and their neighbours.
RATES = [0.0, 1e-300, 1e-19, 0.5, 1.0 - 1e-16, 1.0, 5e-324, 2.0 ** -53, 2.0 ** -54,
         1.5 * 2.0 ** -53, 1e-10, 0.1, 0.25, 0.2928932188134524, 0.3, 0.75, 0.999]


def _bits(x):
    return struct.unpack("<Q", struct.pack("<d", x))[0]


def _same(a, b):
    """Bitwise equal, any NaN equal to any NaN (payloads are not part of the contract)."""
    return (math.isnan(a) and math.isnan(b)) or _bits(a) == _bits(b)


def _inputs():
    """Edge values, stream uniforms and values over the whole float range."""
    rng = np.random.default_rng(20240614)
    xs = list(EDGES) + [-q for q in RATES]
    xs += ((rng.integers(0, 2 ** 53, 4000) + 0.5) / 2.0 ** 53).tolist()     # uniform53's grid
    xs += (2.0 ** rng.uniform(-54.0, 0.0, 3000)).tolist()
    xs += (1.0 - 2.0 ** rng.uniform(-53.0, -1.0, 2000) * rng.random(2000)).tolist()
    xs += (2.0 ** rng.uniform(-1074.0, 1023.0, 2000)).tolist()
    xs += [-q for q in (2.0 ** rng.uniform(-1074.0, 0.0, 3000)).tolist()]
    xs += [M.uniform53(np.uint64(7), np.uint64(s), j) for s in range(1, 6) for j in range(200)]
    return xs


# --------------------------------------------------------------- the C++ copy

DRIVER = r"""
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include "common/philox.cuh"

// Reads float64 bit patterns (hex, one per line); prints the bits of
// sampler_log(x) and sampler_log1p(x).
int main() {
  std::uint64_t in;
  while (std::scanf("%" SCNx64, &in) == 1) {
    double x;
    std::memcpy(&x, &in, sizeof x);
    const double a = ncdp::philox::sampler_log(x);
    const double b = ncdp::philox::sampler_log1p(x);
    std::uint64_t ba, bb;
    std::memcpy(&ba, &a, sizeof a);
    std::memcpy(&bb, &b, sizeof b);
    std::printf("%016" PRIx64 " %016" PRIx64 "\n", ba, bb);
  }
  return 0;
}
"""


@pytest.fixture(scope="module", params=["-O0", "-O2"])
def cpp(request, tmp_path_factory):
    """The host build of philox.cuh's sampler_log/sampler_log1p as a function
    of a list of floats (default x86-64 target: no FMA instructions, the same
    as the extension's host code)."""
    exe = build(DRIVER, tmp_path_factory.mktemp("sampler_log_cpp"), request.param)

    def run(xs):
        out = subprocess.run([str(exe)], input="".join(f"{_bits(x):x}\n" for x in xs),
                             capture_output=True, text=True, check=True).stdout.split()
        to_f = lambda h: struct.unpack("<d", struct.pack("<Q", int(h, 16)))[0]  # noqa: E731
        return [to_f(h) for h in out[0::2]], [to_f(h) for h in out[1::2]]
    return run


def test_cpp_python_numba_bitwise(cpp):
    xs = _inputs()
    logs, log1ps = cpp(xs)
    assert len(logs) == len(xs)
    for x, a, b in zip(xs, logs, log1ps):
        assert _same(a, R.sampler_log(x)), (x, a, R.sampler_log(x))
        assert _same(b, R.sampler_log1p(x)), (x, b, R.sampler_log1p(x))
        assert _same(M.sampler_log(x), a), x
        assert _same(M.sampler_log1p(x), b), x


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(allow_nan=True, allow_infinity=True), min_size=1, max_size=50))
def test_cpp_python_bitwise_hypothesis(cpp, xs):
    logs, log1ps = cpp(xs)
    for x, a, b in zip(xs, logs, log1ps):
        assert _same(a, R.sampler_log(x)) and _same(b, R.sampler_log1p(x)), x


# ------------------------------------------------------------ Python / numba

@settings(max_examples=300, deadline=None)
@given(st.floats(min_value=0.0, max_value=1.0))
def test_numba_equals_reference_on_the_sampler_domain(u):
    assert _same(M.sampler_log(u), R.sampler_log(u))
    assert _same(M.sampler_log1p(-u), R.sampler_log1p(-u))


@settings(max_examples=300, deadline=None)
@given(st.floats(allow_nan=True, allow_infinity=True))
def test_numba_equals_reference_everywhere(x):
    assert _same(M.sampler_log(x), R.sampler_log(x))
    assert _same(M.sampler_log1p(x), R.sampler_log1p(x))


def test_numba_copy_is_not_contracted_inside_fastmath_callers():
    # _mix_block compiles with fastmath={"contract"}; the sampler's log must keep
    # its own (exact) flags there.  Contracting sampler_log into FMAs changes
    # about 1 result in 10^5 on an FMA machine, so 10^5 stream uniforms show it.
    from numba import njit

    @njit(fastmath=True)
    def logs(xs, out):
        for i in range(xs.shape[0]):
            out[i] = M.sampler_log(xs[i])

    xs = (np.random.default_rng(1).integers(0, 2 ** 53, 100_000) + 0.5) / 2.0 ** 53
    out = np.empty_like(xs)
    logs(xs, out)
    assert all(_bits(a) == _bits(R.sampler_log(x)) for a, x in zip(out.tolist(), xs.tolist()))


# ------------------------------------------------------------------ values

def test_special_values():
    L, L1 = R.sampler_log, R.sampler_log1p
    assert _bits(L(1.0)) == _bits(0.0)
    assert L(0.0) == -math.inf and L(-0.0) == -math.inf and L(math.inf) == math.inf
    assert math.isnan(L(-1.0)) and math.isnan(L(math.nan)) and math.isnan(L(-math.inf))
    assert _bits(L1(-0.0)) == _bits(0.0) and _bits(L1(0.0)) == _bits(0.0)   # q = 0: exactly 0
    assert L1(-1.0) == -math.inf                           # q = 1
    for tiny in (1e-300, 1e-19, 5e-324, 2.0 ** -54):       # log1p(-q) = -q to within q^2/2
        assert L1(-tiny) == -tiny
    assert math.isnan(L1(-1.5)) and math.isnan(L1(math.nan))   # q > 1 or NaN: NaN as libm
    assert L1(math.inf) == math.inf
    assert L1(1e-300) == 1e-300 and L1(3.0) > 0            # negative rates: positive, as before


def _ulps(got, exact):
    return abs(got - exact) / math.ulp(exact)


def test_accuracy_against_libm():
    """fdlibm's log is within 1 ulp of log(x); sampler_log1p within 2 ulp of
    log1p(x) (x <= -1/2: sampler_log of the exact 1 + x; otherwise u = 1 + x is
    in [1/2, 2], where sampler_log's < 1 ulp, the last addition's 1/2 ulp and
    the correction c/u's < 1/2 ulp add up); glibc's log and log1p are within
    1 ulp (its documented bounds).  So they differ by at most 2 and 3 ulp.
    Measured on these inputs: 1.0 ulp for both."""
    worst_log = worst_log1p = 0.0
    for x in _inputs():
        if x > 0 and math.isfinite(x) and x != 1.0:
            worst_log = max(worst_log, _ulps(R.sampler_log(x), math.log(x)))
        if -1.0 < x <= 1.0 and x != 0.0:
            worst_log1p = max(worst_log1p, _ulps(R.sampler_log1p(x), math.log1p(x)))
    assert worst_log <= 2.0 and worst_log1p <= 3.0, (worst_log, worst_log1p)


def test_accuracy_against_exact():
    """The bounds themselves (1 ulp, 2 ulp; see above) against 200-bit mpmath."""
    mpmath = pytest.importorskip("mpmath")
    with mpmath.workprec(200):
        xs = _inputs()[::3]
        for x in xs:
            if x > 0 and math.isfinite(x) and x != 1.0:
                exact = mpmath.log(mpmath.mpf(x))
                assert abs(mpmath.mpf(R.sampler_log(x)) - exact) < math.ulp(float(exact)), x
            if -1.0 < x <= 1.0 and x != 0.0:
                exact = mpmath.log1p(mpmath.mpf(x))
                err = abs(mpmath.mpf(R.sampler_log1p(x)) - exact)
                assert err <= 2 * math.ulp(float(exact)), x


# ------------------------------------------------------------- memberships

# (seed, q) where the first gap of sub-stream 1 sits within an ulp of an integer
# and NumPy's log (the old reference) and glibc's (the old numba path) put it on
# different sides: found by search on the development machine (x86-64, AVX-512).
SENSITIVE = [(132, "0x1.521135f8244bdp-3"), (132, "0x1.f5471fb2723aep-5"),
             (856, "0x1.f43d56175a264p-7"), (856, "0x1.aea98044cd754p-8"),
             (856, "0x1.2e1c12262559cp-9"), (1400, "0x1.d794626268d51p-7"),
             (1400, "0x1.95e2c463dcbe1p-8"), (1400, "0x1.1cb1a3f6c2d5ap-9")]
N = 1024        # a power of two: m = q N and m / N = q exactly


def _first_gap(seed, q):
    u = R._Uniforms(seed, 1).next()
    return math.floor(R.sampler_log(u) / R.sampler_log1p(-q))


def _knife_edge_rates():
    """Rates around q* = 1 - u^(1/g) for the first uniform u of a few seeds: the
    first gap is g - 1 on one side of q* and g on the other, within ulps."""
    rates = [(s, float.fromhex(h)) for s, h in SENSITIVE]
    for seed in (1, 2, 3):
        u = R._Uniforms(seed, 1).next()
        for g in (1, 4, 30):
            qs = -math.expm1(R.sampler_log(u) / g)
            near = [qs]
            lo = hi = qs
            for _ in range(12):
                lo, hi = math.nextafter(lo, 0.0), math.nextafter(hi, 1.0)
                near += [lo, hi]
            gaps = {_first_gap(seed, q) for q in near}
            assert gaps == {g - 1, g}, (seed, g, gaps)   # the crossing is in the set
            rates += [(seed, q) for q in near]
    return rates


def test_memberships_at_knife_edge_rates_numba_equals_reference():
    for seed, q in _knife_edge_rates():
        plan = nf.poisson_batches(N, sample_rate=q, steps=2, seed=seed, offset=0)
        ref = R.sample_groups(np.zeros(N, np.int64), num_samples=2, mixup_degree=q * N,
                              seed=seed, offset=0)
        assert [list(b) for b in plan] == ref, (seed, q.hex())
        if ref[0]:
            assert ref[0][0] == _first_gap(seed, q)
        _stream._LEDGER.clear()             # the same (seed, offset) per rate, on purpose


@pytest.mark.parametrize("seed,q", [(s, float.fromhex(h)) for s, h in SENSITIVE])
def test_mix_at_knife_edge_rates_equals_reference(seed, q):
    # mix's counts come from _mix_block (compiled with contraction allowed) and
    # its groups from the plan kernels: both must follow the reference.
    X = np.ones((N, 2))
    lab = np.zeros(N, np.int64)
    res = nf.mix(X, lab, num_samples=3, mixup_degree=q * N, noise_std_x=0.0, noise_std_y=0.0,
                 num_classes=1, seed=seed, offset=0, return_groups=True)
    ref = R.sample_groups(lab, num_samples=3, mixup_degree=q * N, num_classes=1, seed=seed,
                          offset=0, row_stride=3)
    assert [list(g) for g in res.groups] == ref
    assert res.counts.tolist() == [len(g) for g in ref]
