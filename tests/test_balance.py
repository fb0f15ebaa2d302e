"""The rebalancing decision of the clipped sums (``ncdp_fast/_balance.py``):
the clip ops skip the scan over both operands when the norms' sizes say no
sample could need a power of two moved.  That skip is exact only if "no"
implies every exponent the scan would find is 0: held here as a property
over magnitudes across float32's and float64's ranges, against the numba
twin's own scan (``_balance_exponents``) and the device twin's formula."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ncdp_fast import _balance
from ncdp_fast._numba import clip as numba_clip


def _data(rng, B, T, d, K, ea, eg, dtype, zero_rows):
    a = rng.uniform(0.5, 1.0, (B, T, d)) * rng.choice([-1.0, 1.0], (B, T, d))
    g = rng.uniform(0.5, 1.0, (B, T, K)) * rng.choice([-1.0, 1.0], (B, T, K))
    a = (a * np.exp2(np.asarray(ea, float))[:, None, None]).astype(dtype)
    g = (g * np.exp2(np.asarray(eg, float))[:, None, None]).astype(dtype)
    for i in zero_rows:
        (a if i % 2 else g)[i % B] = 0
    return a, g


def _scan(a, g, f):
    """The numba twin's exponents, as its clipped sum runs them (none unless
    some factor is below 1)."""
    k = np.zeros(a.shape[0])
    if a.shape[0] and f.min() < 1.0:
        numba_clip._balance_exponents(a, g, f, g.shape[2] <= a.shape[2], k)
    return k


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 5), st.integers(1, 3), st.integers(1, 6), st.integers(1, 6),
       st.sampled_from([np.float32, np.float64]), st.data())
def test_no_flag_means_every_exponent_is_zero(B, T, d, K, dtype, data):
    lim = 120 if dtype == np.float32 else 300
    ea = data.draw(st.lists(st.integers(-lim, lim), min_size=B, max_size=B))
    eg = data.draw(st.lists(st.integers(-lim, lim), min_size=B, max_size=B))
    ef = data.draw(st.lists(st.one_of(st.integers(-150, 0), st.just(None)), min_size=B,
                            max_size=B))
    zero_rows = data.draw(st.lists(st.integers(0, 2 * B - 1), max_size=2))
    f = np.array([0.0 if e is None else 2.0 ** e * 0.75 ** (e != 0) for e in ef])
    rng = np.random.default_rng(B * 7 + T + d * 3 + K)
    a, g = _data(rng, B, T, d, K, ea, eg, dtype, zero_rows)
    sizes = np.empty((B, 2))
    numba_clip.linear_sq_norms(a, g, True, np.zeros(B), False, None, sizes)
    flag = _balance.layers_needing_balancing(f, sizes[None], [T * d], [T * K], [K <= d],
                                             dtype == np.float32)[0]
    k = _scan(a, g, f)
    if not flag:
        assert np.all(k == 0), (k, sizes, f)
    # The device twin's formula gives the numba scan's exponents.
    if f.min() < 1.0:
        ma = np.abs(a.astype(np.float64)).reshape(B, -1).max(1)
        mg = np.abs(g.astype(np.float64)).reshape(B, -1).max(1)
        into_g = K <= d
        dev = _balance.exponents(np, f * (mg if into_g else ma), ma if into_g else mg)
        assert np.array_equal(dev, k)


def test_the_flag_fires_where_the_scan_moves_a_power():
    """Examples on either side: ordinary data (no flag, no scan), a factor
    taking the scaled operand under 2^-40, and float64 values whose squares
    underflow to a zero size (no proof of a zero operand there)."""
    rng = np.random.default_rng(0)
    for ea, eg, f, dtype, want in [([0, 0], [-3, -3], [0.5, 1.0], np.float32, False),
                                   ([0, 0], [-3, -3], [2.0 ** -45, 1.0], np.float32, True),
                                   ([0, 0], [-3, -3], [1.0, 1.0], np.float32, False),
                                   ([-600, 0], [0, 0], [0.5, 0.5], np.float64, True)]:
        a, g = _data(rng, 2, 3, 4, 2, ea, eg, dtype, [])
        f = np.array(f)
        sizes = np.empty((2, 2))
        numba_clip.linear_sq_norms(a, g, True, np.zeros(2), False, None, sizes)
        flag = bool(_balance.layers_needing_balancing(f, sizes[None], [12], [6], [True],
                                                      dtype == np.float32)[0])
        assert flag is want
        assert bool(np.any(_scan(a, g, f) != 0)) is want


@pytest.mark.parametrize("k", [-1100, -1074, -600, -1, 0, 1, 600, 1023, 1100])
def test_times_pow2_is_exact_where_one_power_would_overflow(k):
    """2^k moved into a float64 factor exactly, even where 2^k alone is not a
    float64 (|k| > 1023): the two halves keep every intermediate in range;
    results among the denormals (k = -1074) are rounded once, as ldexp's."""
    from ncdp_fast import _arrays
    torch = pytest.importorskip("torch")
    x = np.array([0.75 * 2.0 ** -40, 1.5 * 2.0 ** 20]) * 2.0 ** (-(k // 2) if abs(k) > 1000 else 0)
    if k >= 1023:
        x[1] = 0.625 * 2.0 ** -(k // 2)
    want = np.ldexp(x, k)
    got = _arrays.times_pow2(torch.from_numpy(x), torch.full((2,), float(k), dtype=torch.float64))
    assert np.array_equal(got.numpy(), want)
    assert np.array_equal(_arrays.times_pow2(x, np.full(2, float(k))), want)


def test_all_layers_at_once_equal_each_layer_alone():
    """The step asks for every linear layer in one call: layers of different
    sizes and either factor side give each layer's own answer."""
    rng = np.random.default_rng(5)
    B = 6
    f = np.array([2.0 ** -45, 0.5, 1.0, 0.0, 2.0 ** -3, 1.0])
    sizes = np.exp2(rng.uniform(-200, 200, (9, B, 2)))
    sizes[2] = 2.0 ** 40                    # norms 2^20: no sample needs the scan
    sizes[4, :, 1] = 0.0                    # zero operands
    n_a, n_g = rng.integers(1, 5000, 9), rng.integers(1, 5000, 9)
    into_g = rng.random(9) < 0.5
    for float32 in (True, False):
        together = _balance.layers_needing_balancing(f, sizes, n_a, n_g, into_g, float32)
        alone = [_balance.layers_needing_balancing(f, sizes[l:l + 1], n_a[l:l + 1],
                                                   n_g[l:l + 1], into_g[l:l + 1], float32)[0]
                 for l in range(9)]
        assert together.tolist() == alone
        assert not together[2] and together.any()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.just(0.0), st.floats(-70, 70).map(lambda e: 2.0 ** e)),
                min_size=0, max_size=6))
def test_weights_in_range_means_each_rounds_relatively_in_float32(w):
    """The GEMV bias's condition (``_cuda.clip.clipped_linear_sum``): every
    weight 0 or within [2^-40, 2^40]; where it holds, each rounds to float32
    within u = 2^-24 of itself, and stays a normal float32 after a product
    with an operand maximum in [2^-40, 2^40] (the balance flag's proof)."""
    w = np.asarray(w, np.float64)
    inside = all(x == 0.0 or 2.0 ** -40 <= x <= 2.0 ** 40 for x in w)
    assert _balance.weights_in_range(w) == inside
    if inside:
        w32 = w.astype(np.float32).astype(np.float64)
        assert np.all(np.abs(w32 - w) <= 2.0 ** -24 * w)
        for m in (2.0 ** -40, 2.0 ** 40):
            p = w32[w32 > 0] * m
            assert np.all((p >= np.finfo(np.float32).tiny) & (p <= np.finfo(np.float32).max))
