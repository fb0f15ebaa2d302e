"""Tests of ncdp_fast.train: NoisyGD / NoisySGD estimators on the ghost-clipping op."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ncdp_fast as nf
from ncdp_fast import nc
from ncdp_fast.privacy import Accountant, dp_to_zcdp, noisygd_sigma
from ncdp_fast.train import NoisyGDClassifier, NoisySGDClassifier
from ncdp_fast.train import linear_steps as _linear_steps

EPS64 = np.finfo(np.float64).eps


def _data(n=60, p=7, K=3, seed=0):
    rng = np.random.default_rng(seed)
    y = rng.integers(0, K, n)
    X = rng.standard_normal((n, p)) + 2 * rng.standard_normal((K, p))[y]
    return X, y


def _plain_gd(X, y, K, steps, lr, loss, intercept, radius=None):
    """Textbook full-batch GD on the summed loss, float64, from zero."""
    n, p = X.shape
    W, b = np.zeros((K, p)), np.zeros(K)
    Y = np.eye(K)[y]
    for _ in range(steps):
        z = X @ W.T + (b if intercept else 0)
        if loss == "ce":
            e = np.exp(z - z.max(1, keepdims=True))
            R = e / e.sum(1, keepdims=True) - Y
        else:
            R = z - Y
        W = W - lr * R.T @ X
        if intercept:
            b = b - lr * R.sum(0)
        if radius is not None:
            nrm = math.sqrt((W ** 2).sum() + (b ** 2).sum())
            if nrm > radius:
                W, b = W * radius / nrm, b * radius / nrm
    return W, (b if intercept else None)


@pytest.mark.parametrize("loss,intercept,radius", [("ce", False, None), ("ce", True, None),
                                                   ("square", True, None), ("ce", False, 0.5)])
def test_zero_noise_equals_plain_gd(loss, intercept, radius):
    X, y = _data()
    # C far above every per-sample gradient norm: nothing is clipped, noise is 0.
    W, b, info = _linear_steps(X, y, num_classes=3, steps=4, lr=0.01, loss=loss,
                               max_grad_norm=1e9, noise_multiplier=0.0,
                               projection_radius=radius, fit_intercept=intercept, seed=1)
    assert info["num_clipped"] == 0
    W0, b0 = _plain_gd(X, y, 3, 4, 0.01, loss, intercept, radius)
    # Sums of n = 60 terms in float64 per step, errors compounding over 4 steps.
    np.testing.assert_allclose(W, W0, rtol=1e-10, atol=1e-10 * np.abs(W0).max())
    if intercept:
        np.testing.assert_allclose(b, b0, rtol=1e-10, atol=1e-10 * np.abs(b0).max())


def test_noise_fresh_per_step_offsets():
    # Zero features: gradients vanish, so W is exactly -lr * z*C * (xi_0 + xi_1) with
    # xi_t the Philox draws [t*D, (t+1)*D) of the seed (D = K*p + K with intercept).
    X, y = np.zeros((5, 4)), np.array([0, 1, 2, 0, 1])
    clf = NoisyGDClassifier(num_classes=3, rho=0.3, steps=2, lr=0.5, max_grad_norm=2.0, fit_intercept=True,
                            seed=77).fit(X, y)
    D = 3 * 4 + 3
    xi = nf.gaussian(2 * D, seed=77, dtype=np.float64)
    std = clf.sigma_
    assert math.isclose(std, noisygd_sigma(0.3, 2, 2.0), rel_tol=1e-15)
    # The intercept still gets the residual sum; W only the noise.
    np.testing.assert_allclose(clf.coef_.ravel(), -0.5 * std * (xi[:12] + xi[D:D + 12]),
                               rtol=1e-12)
    assert (clf.offset_, clf.next_offset_) == (0, 2 * D) and not hasattr(clf, "seed_")


def test_zcdp_sigma_matches_accountant():
    X, y = _data()
    for rho, T, C in [(0.5, 1, 1.0), (0.02, 7, 3.0)]:
        clf = NoisyGDClassifier(num_classes=3, rho=rho, steps=T, max_grad_norm=C, delta=1e-5, seed=0).fit(X, y)
        assert math.isclose(clf.sigma_, C * math.sqrt(T / (2 * rho)), rel_tol=1e-14)
        assert math.isclose(clf.accountant_.zcdp_rho(), rho, rel_tol=1e-12)
        assert clf.accountant_.total_steps == T
        assert math.isclose(clf.epsilon_, clf.accountant_.epsilon(1e-5, accountant="zcdp"),
                            rel_tol=1e-12)
    clf = NoisyGDClassifier(num_classes=3, epsilon=1.0, delta=1e-4, seed=0).fit(X, y)
    assert math.isclose(clf.rho_, dp_to_zcdp(1.0, 1e-4), rel_tol=1e-12)
    assert math.isclose(clf.epsilon_, 1.0, rel_tol=1e-9)
    assert clf.delta_ == 1e-4


def test_preprocessing_budget_is_composed():
    X, y = _data()
    cen = nc.Centering().fit_private(X, rho=0.01, clip=5.0, seed=3)
    clf = NoisyGDClassifier(num_classes=3, epsilon=1.0, delta=1e-4, seed=1).fit(cen.transform(X), y,
                                                                 preprocessing=[cen])
    total = dp_to_zcdp(1.0, 1e-4)
    assert math.isclose(clf.rho_, total, rel_tol=1e-12)
    assert math.isclose(clf.rho_train_, total - 0.01, rel_tol=1e-12)
    assert math.isclose(clf.epsilon_, 1.0, rel_tol=1e-9)
    pub = nc.Centering().fit(X[:10], public=True)
    clf2 = NoisyGDClassifier(num_classes=3, rho=0.1, seed=1).fit(pub.transform(X), y, preprocessing=[pub])
    assert clf2.rho_train_ == 0.1
    with pytest.raises(ValueError, match="nothing is left"):
        NoisyGDClassifier(num_classes=3, rho=0.005).fit(X, y, preprocessing=[cen])
    with pytest.raises(ValueError, match="preprocessing"):
        NoisyGDClassifier(num_classes=3, rho=0.1).fit(X, y, preprocessing=[nc.Centering()])


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 6), p=st.integers(1, 5), K=st.integers(2, 4),
       C=st.floats(0.01, 10.0), scale=st.floats(0.01, 100.0), intercept=st.booleans(),
       loss=st.sampled_from(["ce", "square"]), seed=st.integers(0, 2**32))
def test_clip_invariant_each_contribution_at_most_C(n, p, K, C, scale, intercept, loss, seed):
    rng = np.random.default_rng(seed)
    X = scale * rng.standard_normal((n, p))
    y = rng.integers(0, K, n)
    kw = dict(num_classes=K, steps=1, lr=1.0, loss=loss, max_grad_norm=C, noise_multiplier=0.0,
              projection_radius=None, fit_intercept=intercept, seed=1)
    total_W, total_b = _linear_steps(X, y, **kw)[:2]
    sum_W, sum_b = np.zeros((K, p)), np.zeros(K)
    for i in range(n):
        Wi, bi, _ = _linear_steps(X[i:i + 1], y[i:i + 1], **kw)
        sq = (Wi ** 2).sum() + ((bi ** 2).sum() if intercept else 0.0)
        assert math.sqrt(sq) <= C * (1 + 1e-12)          # one sample moves theta by <= lr*C
        sum_W += Wi
        if intercept:
            sum_b += bi
    # At zero init the update is the plain sum of the clipped contributions.
    np.testing.assert_allclose(total_W, sum_W, rtol=1e-12, atol=1e-12 * C * n)
    # The grouped (counts) path clips the same way.
    Wg = _linear_steps(X, y, counts=np.full(n, 3), **kw)[0]
    np.testing.assert_allclose(Wg, 3 * sum_W, rtol=1e-12, atol=1e-12 * C * n)


def test_counts_equals_repeated_rows_same_noise():
    X, y = _data(n=12)
    counts = np.arange(1, 13)
    kw = dict(rho=0.2, steps=3, lr=0.05, max_grad_norm=0.7, fit_intercept=True, seed=5, offset=0)
    a = NoisyGDClassifier(num_classes=3, **kw).fit(X, y, counts=counts)
    with pytest.warns(nf.NoiseReuseWarning):     # the same noise on purpose
        b = NoisyGDClassifier(num_classes=3, **kw).fit(np.repeat(X, counts, 0),
                                                       np.repeat(y, counts))
    np.testing.assert_allclose(a.coef_, b.coef_, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(a.intercept_, b.intercept_, rtol=1e-10, atol=1e-12)
    assert a.num_clipped_ == b.num_clipped_
    with pytest.raises(ValueError, match="counts"):
        NoisyGDClassifier(num_classes=3, **kw).fit(X, y, counts=np.zeros(12, dtype=int))


def test_torch_cpu_matches_numpy_same_seed():
    torch = pytest.importorskip("torch")
    X, y = _data(n=80, p=9)
    for cls, kw in [(NoisyGDClassifier, dict(epsilon=2.0, delta=1e-5, steps=3, lr=0.02)),
                    (NoisySGDClassifier, dict(epsilon=2.0, delta=1e-5, sample_rate=0.25,
                                              epochs=2, accountant="rdp"))]:
        a = cls(num_classes=3, seed=11 + (cls is NoisySGDClassifier), offset=0, fit_intercept=True,
                **kw).fit(X, y)
        with pytest.warns(nf.NoiseReuseWarning):     # the same noise on purpose
            b = cls(num_classes=3, seed=11 + (cls is NoisySGDClassifier), offset=0, fit_intercept=True,
                    **kw).fit(torch.from_numpy(X), torch.from_numpy(y))
        assert isinstance(b.coef_, torch.Tensor)
        # Same noise draws; only the summation order of float64 GEMMs differs.
        np.testing.assert_allclose(b.coef_.numpy(), a.coef_, rtol=1e-9, atol=1e-11)
        assert a.epsilon_ == b.epsilon_
        pa, pb = a.predict(X), b.predict(torch.from_numpy(X))
        assert isinstance(pb, torch.Tensor)
        np.testing.assert_array_equal(pa, pb.numpy())
        assert a.score(X, y) == b.score(torch.from_numpy(X), y)


def test_seed_none_draws_from_os():
    X, y = _data()
    a = NoisyGDClassifier(num_classes=3, rho=0.1).fit(X, y)
    b = NoisyGDClassifier(num_classes=3, rho=0.1).fit(X, y)
    assert not np.allclose(a.coef_, b.coef_)
    # The key is never kept on the fitted model: nothing to reuse or leak.
    assert not hasattr(a, "seed_") and a.seed is None
    # A NoiseStream reproduces a run when restored from its (private) state.
    s = nf.NoiseStream()
    state = s.state()
    c = NoisyGDClassifier(num_classes=3, rho=0.1, seed=s).fit(X, y)
    # Its draws were recorded once its state was handed out: the same process
    # redrawing them is reuse, said so (the audit of 2026-12-02).
    with pytest.warns(nf.NoiseReuseWarning):
        d = NoisyGDClassifier(num_classes=3, rho=0.1,
                              seed=nf.NoiseStream.restore(state)).fit(X, y)
    np.testing.assert_array_equal(c.coef_, d.coef_)


def test_noisysgd_privacy_claim_and_determinism():
    X, y = _data(n=200)
    kw = dict(epsilon=1.5, delta=1e-5, sample_rate=0.1, epochs=3, lr=0.5, seed=4, offset=0,
              accountant="rdp")
    a = NoisySGDClassifier(num_classes=3, **kw).fit(X, y)
    assert a.steps_ == 30
    assert a.epsilon_ <= 1.5 and a.epsilon_ >= 1.5 * (1 - 2e-3)
    ev = a.accountant_.history[-1]
    assert (ev.noise_multiplier, ev.sample_rate, ev.steps) == (a.noise_multiplier_, 0.1, 30)
    with pytest.warns(nf.NoiseReuseWarning):     # the same run again, on purpose
        b = NoisySGDClassifier(num_classes=3, **kw).fit(X, y)
    np.testing.assert_array_equal(a.coef_, b.coef_)
    kw["seed"] = 5
    # Private preprocessing: calibrated jointly (RDP), total within the target.
    cen = nc.Centering().fit_private(X, rho=0.05, clip=10.0, seed=1)
    c = NoisySGDClassifier(num_classes=3, **kw).fit(cen.transform(X), y, preprocessing=[cen])
    assert c.noise_multiplier_ > a.noise_multiplier_
    assert c.epsilon_ <= 1.5 and c.epsilon_ >= 1.5 * (1 - 1e-3)
    acc = Accountant().add_zcdp(0.05).step(noise_multiplier=c.noise_multiplier_,
                                           sample_rate=0.1, steps=30)
    assert math.isclose(acc.epsilon(1e-5, accountant="rdp"), c.epsilon_, rel_tol=1e-12)


def test_noisygd_learns_perfect_collapse():
    # Perfect NC, (1, 1e-4)-DP, one step: the signal n/K * M_k dwarfs the noise
    # (sigma ~ 3.5 per entry; score noise std ~ 3.5 vs margin ~ 100), so the error
    # probability per test point is < 1e-100: the test cannot fail by chance.
    d = nc.synthetic(1000, 10, 300, seed=1)
    clf = NoisyGDClassifier(num_classes=10, epsilon=1.0, delta=1e-4, seed=2).fit(*d.grouped()[:2],
                                                                 counts=d.grouped()[2])
    assert clf.score(d.X_test, d.y_test) == 1.0


def test_bad_input_errors():
    X, y = _data()
    with pytest.raises(ValueError, match="epsilon: expected a finite number > 0"):
        NoisyGDClassifier(num_classes=3, epsilon=0.0, delta=1e-5).fit(X, y)
    with pytest.raises(ValueError, match="epsilon: expected a finite number > 0"):
        NoisySGDClassifier(num_classes=3, epsilon=-1.0, delta=1e-5, sample_rate=0.1, epochs=1).fit(X, y)
    with pytest.raises(ValueError, match="rho"):
        NoisyGDClassifier(num_classes=3, rho=float("inf")).fit(X, y)
    with pytest.raises(ValueError, match="either rho or"):
        NoisyGDClassifier(num_classes=3, rho=0.1, epsilon=1.0, delta=1e-5).fit(X, y)
    with pytest.raises(ValueError, match="budget is required"):
        NoisyGDClassifier(num_classes=3, ).fit(X, y)
    with pytest.raises(ValueError, match=r"y: expected integers in \[0, 3\), "
                       r"got values outside it \(not shown: labels are private\)"):
        NoisyGDClassifier(rho=1.0, num_classes=3).fit(X, np.where(y == 2, 7, y))
    with pytest.raises(ValueError, match="y: expected integers"):
        NoisyGDClassifier(num_classes=3, rho=1.0).fit(X, y - 1)
    with pytest.raises(ValueError, match="non-integer"):
        NoisyGDClassifier(num_classes=3, rho=1.0).fit(X, y + 0.5)
    bad = X.copy()
    bad[3, 2] = np.nan
    with pytest.raises(ValueError, match="X: expected finite features, got NaN or Inf"):
        NoisyGDClassifier(num_classes=3, rho=1.0).fit(bad, y)
    with pytest.raises(ValueError, match=r"y: expected shape \(60,\)"):
        NoisyGDClassifier(num_classes=3, rho=1.0).fit(X, y[:10])
    with pytest.raises(ValueError, match="loss"):
        NoisyGDClassifier(num_classes=3, rho=1.0, loss="hinge").fit(X, y)
    with pytest.raises(ValueError, match="steps"):
        NoisyGDClassifier(num_classes=3, rho=1.0, steps=0).fit(X, y)
    with pytest.raises(ValueError, match="sample_rate"):
        NoisySGDClassifier(num_classes=3, epsilon=1.0, delta=1e-5, sample_rate=0.0, epochs=1).fit(X, y)
    clf = NoisyGDClassifier(num_classes=3, rho=1.0, seed=0).fit(X, y)
    with pytest.raises(ValueError, match="X: expected 7 features, got 3"):
        clf.predict(X[:, :3])
    with pytest.raises(RuntimeError, match="fit"):
        NoisyGDClassifier(num_classes=3, rho=1.0).predict(X)


@pytest.mark.parametrize("grouped", [False, True])
def test_diverging_square_loss_raises_not_nan(grouped):
    # lr 1e200 makes the second step's residuals ~1e200 and their squared norms overflow:
    # both paths must refuse rather than return NaN weights.
    X, y = _data(n=8)
    kw = dict(counts=np.ones(8, dtype=np.int64)) if grouped else {}
    with pytest.raises(ValueError, match="not finite"):
        NoisyGDClassifier(num_classes=3, rho=1.0, loss="square", lr=1e200, steps=3, seed=0).fit(X, y, **kw)


def test_a_fit_whose_noise_cannot_fit_the_stream_is_refused_before_any_step():
    """steps=10**30 ran for minutes before the stream refused (the sixth audit)."""
    X, y = np.random.default_rng(0).standard_normal((10, 3)), np.arange(10) % 2
    with pytest.raises(ValueError, match=r"steps: expected steps x 6 draws a step to fit in "
                                         r"the noise stream's 2\*\*64 draws"):
        NoisyGDClassifier(rho=1.0, num_classes=2, steps=10**30).fit(X, y)
