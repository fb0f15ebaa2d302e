"""Attacks on the privacy promises, kept in the suite so that the next hole is
caught by CI (issue 13): the clip bound at extreme magnitudes, reconstruction
from published artifacts, presence revealed by fitted shapes, noise reused
across components, and tampered release files.

Each test states the attack and what must make it fail."""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ncdp_fast as nf


# ------------------------------------------------------------ the clip bound

def _exact_norm(x) -> float:
    """The L2 norm of an output as computed: squares of float32 values are exact
    in float64, ``math.fsum`` is correctly rounded, so this is within one
    float64 rounding of the true norm of the returned numbers."""
    x = np.asarray(x, dtype=np.float64).ravel()
    return math.sqrt(math.fsum(x * x))


def _magnitudes(dtype):
    """Finite values of either sign from the smallest denormal to the largest
    finite number of the dtype, log-uniform, plus exact zeros."""
    fi = np.finfo(dtype)
    lo, hi = math.log10(float(fi.smallest_subnormal)), math.log10(float(fi.max)) - 0.01
    mag = st.floats(lo, hi).map(lambda e: 10.0 ** e)
    val = st.tuples(st.sampled_from([-1.0, 1.0]), mag).map(lambda t: t[0] * t[1])
    return st.one_of(val, st.just(0.0)).map(lambda v: dtype(v))


def _vec(dtype, n):
    return st.lists(_magnitudes(dtype), min_size=n, max_size=n).map(
        lambda v: np.array(v, dtype=dtype))


C_VALUES = st.sampled_from([1e-3, 0.5, 1.0, 3.0, 1e3])


def _check_contribution(out_parts, res, C):
    norm = _exact_norm(np.concatenate([np.asarray(p, np.float64).ravel() for p in out_parts]))
    assert norm <= C, f"contribution {norm!r} exceeds C = {C!r} (norms {res.norms})"
    if res.num_nonfinite:
        # Only a norm that overflows float64 may drop a finite row.
        assert norm == 0.0


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@settings(max_examples=150, deadline=None)
@given(data=st.data(), C=C_VALUES)
def test_dense_contribution_never_exceeds_C(dtype, data, C):
    p = data.draw(st.integers(1, 40))
    g = data.draw(_vec(dtype, p))[None, :]
    res = nf.clip_and_noise(g, max_norm=C, noise_multiplier=0.0, seed=None,
                            nan_policy="zero")
    _check_contribution([res.grad], res, C)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("bias", [True, False])
@settings(max_examples=100, deadline=None)
@given(data=st.data(), C=C_VALUES)
def test_linear_contribution_never_exceeds_C(dtype, bias, data, C):
    T = data.draw(st.sampled_from([None, 1, 2, 5]))
    d, K = data.draw(st.integers(1, 6)), data.draw(st.integers(1, 6))
    rows = 1 if T is None else T
    a = np.stack([data.draw(_vec(dtype, d)) for _ in range(rows)])
    g = np.stack([data.draw(_vec(dtype, K)) for _ in range(rows)])
    if data.draw(st.booleans()) and rows > 1:
        # Cancellation across positions: the sum over t is far smaller than its terms.
        a[1] = -a[0] * dtype(1 + 2 ** -10)
        g[1] = g[0]
    if T is None:
        a, g = a[0][None], g[0][None]
    else:
        a, g = a[None], g[None]
    res = nf.clip_and_noise_linear(a, g, max_norm=C, noise_multiplier=0.0, bias=bias,
                                   nan_policy="zero")
    parts = [res.grad_weight] + ([res.grad_bias] if bias else [])
    _check_contribution(parts, res, C)


def test_audit_example_large_float32_row_is_clipped_not_dropped():
    """The audit's case: a = g = 3.65e22 (float32) has ||G|| = 1.33e45; the factor
    7.5e-46 is not a float32 number.  It contributed norm 1.87 with C = 1; at
    4e22 it contributed nothing at all."""
    for v in (3.65e22, 4e22, 1e38):
        x = np.array([[v]], np.float32)
        res = nf.clip_and_noise_linear(x, x, max_norm=1.0, noise_multiplier=0.0, seed=None)
        norm = _exact_norm(np.concatenate([res.grad_weight.ravel(), res.grad_bias]))
        assert 1.0 - 1e-5 < norm <= 1.0, (v, norm)
        assert res.num_clipped == 1 and res.num_nonfinite == 0


def test_ordinary_rounding_stays_within_C():
    """Clipped float32 rows, dense and linear: rounding the factor and the
    products to float32 used to exceed C by up to 8e-8 relative."""
    rng = np.random.default_rng(0)
    worst = 0.0
    for _ in range(400):
        g = rng.standard_normal((1, 5)).astype(np.float32)
        a = rng.standard_normal((1, 3)).astype(np.float32)
        C = float(np.linalg.norm(g.astype(np.float64))) * 0.5
        res = nf.clip_and_noise(g, max_norm=C, noise_multiplier=0.0, seed=None)
        worst = max(worst, _exact_norm(res.grad) / C)
        res = nf.clip_and_noise_linear(a, g, max_norm=C, noise_multiplier=0.0, seed=None)
        worst = max(worst, _exact_norm(np.concatenate([res.grad_weight.ravel(),
                                                       res.grad_bias])) / C)
    assert worst <= 1.0
