"""The clip of features in mix (issue 13 leftover): the CPU kernel and the
reference apply the clip ops' rounding-aware rule (reference.clip_factors),
so a clipped member's contribution *as computed* has norm <= clip_x in float32
and float64, at every magnitude the op accepts.

A member's contribution is observed exactly with one example, m = 1 and no
noise: the single member of each row is added to a zero accumulator (one
rounding, fused or not) and scaled by 1/m = 1, so the output row is the
clipped row itself."""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ncdp_fast as nf
from conftest import gamma
from ncdp_fast import reference as R

F64_MAX = float(np.finfo(np.float64).max)


def _exact_norm(x) -> float:
    """Norm of the returned numbers: squares of float32/float64 values summed by
    math.fsum (correctly rounded) -- within one float64 rounding of the truth."""
    x = np.asarray(x, dtype=np.float64).ravel()
    return math.sqrt(math.fsum(x * x))


def _limit(d):
    """Largest entry the op accepts with clip_x (see _mix._check_clip_range)."""
    return math.sqrt(F64_MAX / (2.0 * d))


def _clipped(row, C, seed=7):
    """The numba kernel's clipped row (see the module docstring)."""
    res = nf.mix(row[None, :], np.zeros(1, np.int64), num_samples=2, mixup_degree=1,
                 noise_std_x=0.0, noise_std_y=0.0, num_classes=1, clip_x=C, seed=seed)
    assert res.counts.tolist() == [1, 1]
    np.testing.assert_array_equal(res.x[0], res.x[1])
    return res.x[0]


def _reference(row, C):
    x, _ = R.mix_from_groups(row[None, :], np.ones((1, 1)), [[0]], mixup_degree=1,
                             noise_std_x=0.0, noise_std_y=0.0, seed=7, clip_x=C)
    return x[0]


def _magnitudes(dtype, top):
    """Finite values of either sign, log-uniform from the smallest denormal to
    ``top``, plus zeros and the extremes themselves."""
    lo = math.log10(float(np.finfo(dtype).smallest_subnormal))
    mag = st.one_of(st.floats(lo, math.log10(top)).map(lambda e: min(10.0 ** e, top)),
                    st.sampled_from([top, 3.65e22, 1e38, 1e300, 1.0, 1e-30]).filter(
                        lambda v: v <= top))
    val = st.tuples(st.sampled_from([-1.0, 1.0]), mag).map(lambda t: t[0] * t[1])
    return st.one_of(val, st.just(0.0)).map(lambda v: dtype(v))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@settings(max_examples=150, deadline=None)
@given(data=st.data(), C=st.sampled_from([1e-3, 0.5, 1.0, 3.0, 1e3]))
def test_clipped_member_never_exceeds_clip_x(dtype, data, C):
    d = data.draw(st.integers(1, 40))
    top = min(float(np.finfo(dtype).max), _limit(d))
    row = np.array(data.draw(st.lists(_magnitudes(dtype, top), min_size=d, max_size=d)),
                   dtype=dtype)
    if data.draw(st.booleans()):
        # A row exactly at the bound, or within rounding of it.
        norm = _exact_norm(row)            # 0 also when every square underflows
        scale = C / norm if norm > 0 else 1.0
        with np.errstate(over="ignore", under="ignore"):
            scaled = (row.astype(np.float64) * scale).astype(dtype)
        if np.all(np.isfinite(scaled)) and np.all(np.abs(scaled) <= top):
            row = scaled
    out = _clipped(row, C)
    assert out.dtype == dtype
    assert _exact_norm(out) <= C, (row, C)
    # Rows far above C are clipped to about C, not dropped.
    if _exact_norm(row) > 2 * C:
        assert _exact_norm(out) > C * (1 - 1e-5)
    ref = _reference(row, C)
    assert _exact_norm(ref) <= C
    assert _exact_norm(ref.astype(dtype)) <= C      # the reference rounded to the dtype


@pytest.mark.parametrize("dtype,values", [
    (np.float32, [3.65e22]), (np.float32, [4e22, -4e22]), (np.float32, [1e38]),
    (np.float32, [1e38] * 17), (np.float32, [3.4e38, 1e-45, -3.4e38]),
    (np.float64, [1e150]), (np.float64, [1e153, -1e153, 1e-300]),
    (np.float64, [1e-310, 5e-324]), (np.float32, [1e-45, -1e-45]),
])
@pytest.mark.parametrize("C", [1e-3, 1.0, 1e3])
def test_extreme_rows_are_clipped_not_dropped(dtype, values, C):
    """The audit's magnitudes: the float64 factor of a 1e38 float32 row cast to
    float32 was a denormal (1e-41 for C = 1e-3 has 13 significant bits) and the
    clipped row exceeded C by up to 1e-4 relative; tiny rows keep factor 1."""
    row = np.array(values, dtype=dtype)
    out = _clipped(row, C)
    norm = _exact_norm(out)
    assert norm <= C
    if _exact_norm(row) > C:
        assert norm > C * (1 - 1e-5)
    else:
        np.testing.assert_array_equal(out, row)
    assert _exact_norm(_reference(row, C)) <= C


def test_ordinary_rows_stay_within_clip_x():
    """Ordinary float32 rows clipped to 20-90 % of their norm: rounding the
    factor and the products to float32 exceeded C by up to ~1e-7 relative
    before."""
    rng = np.random.default_rng(0)
    X = rng.standard_normal((400, 5)).astype(np.float32)
    shrink = rng.uniform(0.2, 0.9, 400)
    worst = 0.0
    for i in range(X.shape[0]):
        C = _exact_norm(X[i]) * shrink[i]
        worst = max(worst, _exact_norm(_clipped(X[i], C, seed=100 + i)) / C)
    assert worst <= 1.0, worst


def test_mix_clip_matches_reference_rule():
    # Many members per row: the kernel's factors are the reference's rule on
    # float64 norms summed in another order (relative gamma_{d+4} in float64);
    # the sums agree within the rounding of |I_t| + 3 float32 operations per
    # term (conftest's gamma bound, as in test_mix).
    rng = np.random.default_rng(3)
    X = (rng.standard_normal((200, 9)) * 10.0 ** rng.uniform(-3, 30, (200, 1))).astype(np.float32)
    lab = rng.integers(0, 3, 200)
    kw = dict(num_samples=30, mixup_degree=12, seed=4, offset=0)
    res = nf.mix(X, lab, noise_std_x=0.0, noise_std_y=0.0, num_classes=3, clip_x=2.0,
                 return_groups=True, **kw)
    groups = [list(g) for g in res.groups]
    rx, _ = R.mix_from_groups(X, np.eye(3)[lab], groups, mixup_degree=12, noise_std_x=0.0,
                              noise_std_y=0.0, seed=4, clip_x=2.0)
    f, _ = R.clip_factors([math.fsum(float(v) ** 2 for v in r) for r in X], 2.0,
                          unit=2.0 ** -24, terms=9)
    absterms = np.array([(np.abs(X[g]) * f[g, None]).sum(axis=0) / 12 if g else np.zeros(9)
                         for g in groups])
    n = max(len(g) for g in groups) + 3
    tol = (gamma(n, np.float32) + gamma(9 + 4, np.float64)) * absterms
    assert np.all(np.abs(res.x - rx) <= tol + 1e-45)


def test_float64_rows_whose_squared_norm_may_overflow_are_refused():
    """The rule gives a row with a non-finite bound factor 0; in mix that would
    silently drop a finite example, so the op refuses such features instead
    (NaN/inf features are refused as before)."""
    kw = dict(num_samples=3, mixup_degree=1, noise_std_x=0.0, noise_std_y=0.0, num_classes=1,
              clip_x=1.0)
    lab = np.zeros(2, np.int64)
    X = np.array([[1.0, 2.0], [1e300, 0.0]])
    with pytest.raises(ValueError, match=r"features: rows \[1\] have entries above"):
        nf.mix(X, lab, **kw)
    nf.mix(X, lab, **{**kw, "clip_x": None})             # no clip: no norm needed
    edge = _limit(2)
    nf.mix(np.array([[edge, edge], [0.0, 0.0]]), lab, **kw)
    with pytest.raises(ValueError, match="rows \\[0\\]"):
        nf.mix(np.array([[math.nextafter(edge, math.inf), 0.0], [0.0, 0.0]]), lab, **kw)
    for bad in (np.inf, np.nan):
        with pytest.raises(ValueError, match="features: expected finite values, got NaN or Inf"):
            nf.mix(np.array([[bad, 0.0], [0.0, 0.0]]), lab, **kw)
    # float32 features never reach the limit: the largest float32 rows are clipped.
    big = np.full((1, 3), np.finfo(np.float32).max, np.float32)
    res = nf.mix(big, lab[:1], **kw)
    assert res.counts.tolist() == [1, 1, 1]
    assert all(1.0 - 1e-5 < _exact_norm(res.x[t]) <= 1.0 for t in range(3))
