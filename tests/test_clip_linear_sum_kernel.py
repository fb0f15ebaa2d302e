"""The CPU clipped linear sum writes its scaled operand in the data dtype
directly (issue 25: the float64 temporary of B*T*max(K, d) values cost more
than the rest of the op at transformer sizes).  The result must be the one of
the NumPy formulation it replaced, bit for bit: each product f_i * x rounded
once from float64 to the data dtype, one GEMM, the bias summed in float64 row
after row; checked here against that formulation written out, for both
operand choices (K <= d and K > d), clipped and unclipped samples, the
power-of-two rebalancing of extreme samples, float32 and float64, B = 0."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ncdp_fast._numba import clip as kernels


def _numpy_formulation(a, g, factors, gw, gb):
    """gw, gb without noise, as NumPy computes them (float64 products rounded to
    the data dtype; bias sums in float64); the power-of-two moves as the kernel."""
    B, T, d = a.shape
    K = g.shape[2]
    dt = a.dtype
    into_g = K <= d
    f = factors
    a_s, g_s = a, g
    if B and f.min() < 1.0:
        k = np.empty(B)
        kernels._balance_exponents(a, g, f, into_g, k)
        if k.any():
            k = k.astype(np.int64)
            f = np.ldexp(f, k)
            if into_g:
                a_s = np.ldexp(a, -k[:, None, None]).astype(dt)
            else:
                g_s = np.ldexp(g, -k[:, None, None]).astype(dt)
    f3 = f[:, None, None]
    if into_g:
        np.matmul((g_s * f3).astype(dt).reshape(B * T, K).T, a_s.reshape(B * T, d), out=gw)
    else:
        np.matmul(g_s.reshape(B * T, K).T, (a_s * f3).astype(dt).reshape(B * T, d), out=gw)
    if gb is not None:
        # Row after row (np.sum would add a contiguous axis pairwise: K = 1).
        rows = (g * factors[:, None, None]).astype(dt).reshape(B * T, K).astype(np.float64)
        gb[:] = np.cumsum(rows, axis=0)[-1] if B * T else 0.0


def _case(B, T, d, K, dtype, bias, seed, extreme=False):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((B, T, d)).astype(dtype)
    g = rng.standard_normal((B, T, K)).astype(dtype)
    factors = rng.uniform(0.0, 1.0, B)
    factors[::2] = 1.0                       # unclipped samples too
    if extreme and B:
        a[0] *= dtype(2.0 ** 60)             # far outside the well-scaled range
        factors[0] = 2.0 ** -70
    gw = np.empty((K, d), dtype)
    gb = np.empty((K,), dtype) if bias else None
    kernels.clipped_linear_sum(a, g, factors, 0.0, 1.0, 1, 0, gw, gb)
    ref_w = np.empty((K, d), dtype)
    ref_b = np.empty((K,), dtype) if bias else None
    _numpy_formulation(a, g, factors, ref_w, ref_b)
    return gw, gb, ref_w, ref_b


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(5, 3, 7, 4), (5, 3, 4, 7), (0, 3, 4, 7), (1, 1, 6, 6),
                                   (3, 9, 8, 12)])
@pytest.mark.parametrize("bias", [True, False])
def test_bitwise_equal_to_the_numpy_formulation(dtype, shape, bias):
    gw, gb, ref_w, ref_b = _case(*shape, dtype, bias, seed=sum(shape))
    assert np.array_equal(gw, ref_w)
    if bias:
        assert np.array_equal(gb, ref_b)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("K,d", [(3, 8), (8, 3)])
def test_bitwise_equal_with_a_rebalanced_sample(dtype, K, d):
    gw, gb, ref_w, ref_b = _case(4, 5, d, K, dtype, True, seed=7, extreme=True)
    assert np.array_equal(gw, ref_w) and np.array_equal(gb, ref_b)


@settings(max_examples=25, deadline=None)
@given(B=st.integers(0, 6), T=st.integers(1, 5), d=st.integers(1, 9), K=st.integers(1, 9),
       f32=st.booleans(), bias=st.booleans(), seed=st.integers(0, 2 ** 31))
def test_bitwise_equal_property(B, T, d, K, f32, bias, seed):
    gw, gb, ref_w, ref_b = _case(B, T, d, K, np.float32 if f32 else np.float64, bias, seed)
    assert np.array_equal(gw, ref_w)
    if bias:
        assert np.array_equal(gb, ref_b)


def test_parallel_scaling_equals_serial():
    """Above the work threshold the scaling runs in parallel: same values."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 8, 5)).astype(np.float32)
    f = rng.uniform(0.0, 1.0, 4)
    serial, parallel = np.empty_like(x), np.empty_like(x)
    kernels._scale_rows.serial(x, f, serial)
    kernels._scale_rows.parallel(x, f, parallel)
    assert np.array_equal(serial, parallel)
    assert np.array_equal(serial, (x * f[:, None, None]).astype(np.float32))


def _exponents_by_max(a, g, factors, into_g):
    """The rebalancing rule from the maxima themselves (no norm shortcut)."""
    k = np.zeros(a.shape[0])
    for i in range(a.shape[0]):
        ma = float(np.abs(a[i].astype(np.float64)).max(initial=0.0))
        mg = float(np.abs(g[i].astype(np.float64)).max(initial=0.0))
        u, v = factors[i] * (mg if into_g else ma), (ma if into_g else mg)
        if u > 0 and v > 0 and not (2.0**-40 <= u <= 2.0**40 and 2.0**-40 <= v <= 2.0**40):
            k[i] = np.floor(0.5 * (np.log2(v) - np.log2(u)))
    return k


@settings(max_examples=60, deadline=None)
@given(scales=st.lists(st.integers(-70, 70), min_size=6, max_size=6),
       f_exp=st.lists(st.integers(-80, 0), min_size=3, max_size=3),
       into_g=st.booleans(), dtype=st.sampled_from([np.float32, np.float64]),
       zero_row=st.booleans(), seed=st.integers(0, 2**16))
def test_rebalancing_exponents_equal_the_max_rule(scales, f_exp, into_g, dtype, zero_row, seed):
    """The kernel decides from each sample's norms where those bound the maxima
    inside [2^-40, 2^40] and forms the maxima otherwise: the exponents equal the
    rule stated on the maxima, for samples at every scale around the thresholds
    (2^+-40 of the data and the factors), zero samples and zero factors."""
    rng = np.random.default_rng(seed)
    B, T, d, K = 3, 4, 5, 6
    a = rng.standard_normal((B, T, d)) * np.exp2(np.array(scales[:3]))[:, None, None]
    g = rng.standard_normal((B, T, K)) * np.exp2(np.array(scales[3:]))[:, None, None]
    if dtype == np.float32:      # float32 cannot hold 2^+-70: keep its range
        a, g = np.clip(a, -1e37, 1e37), np.clip(g, -1e37, 1e37)
    a, g = a.astype(dtype), g.astype(dtype)
    if zero_row:
        a[1] = 0
    factors = np.exp2(np.array(f_exp, dtype=np.float64))
    factors[2] = 0.0 if zero_row else factors[2]
    k = np.empty(B)
    kernels._balance_exponents(a, g, factors, into_g, k)
    assert np.array_equal(k, _exponents_by_max(a, g, factors, into_g))
