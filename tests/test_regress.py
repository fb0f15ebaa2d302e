"""Random-features / NTK regression and the sensitivity S_f (ncdp_fast.ntk.regress)."""
from __future__ import annotations

import numpy as np
import pytest

from ncdp_fast import ntk, ntk_gram


def _data(n=24, d=6, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d))
    x *= np.sqrt(d) / np.linalg.norm(x, axis=1, keepdims=True)      # sphere of radius sqrt(d)
    return x, rng.standard_normal(n)


def _central_difference(model, x, h=1e-5):
    d = x.shape[1]
    E = np.eye(d)
    return np.stack([(model.predict(x + h * E[j]) - model.predict(x - h * E[j])) / (2 * h)
                     for j in range(d)], axis=1)


# Central differences: truncation h^2 |f'''|/6 ~ 1e-10 and rounding u |f| / h ~ 1e-11 for the
# O(1..10) values here, so 1e-6 relative to max |grad| leaves a wide margin and still
# catches any wrong term (each is O(1) of the gradient).
FD_RTOL = 1e-6


@pytest.mark.parametrize("activation", ["tanh", "gelu", "softplus", "logcosh"])
def test_rf_interpolates_and_gradient_matches_fd(activation):
    x, y = _data()
    m = ntk.RFRegressor(300, activation=activation, seed=3).fit(x, y)
    assert np.max(np.abs(m.predict(x) - y)) < 1e-8
    xt = _data(5, seed=1)[0]
    g = m.input_gradient(xt)
    assert np.max(np.abs(g - _central_difference(m, xt))) <= FD_RTOL * np.max(np.abs(g))
    s = m.sensitivity(xt)
    np.testing.assert_allclose(s, np.linalg.norm(xt, axis=1) * np.linalg.norm(g, axis=1))


@pytest.mark.parametrize("activation,train", [("logcosh", "first"), ("tanh", "first"),
                                              ("softplus", "all"), ("erf", "all")])
def test_two_layer_ntk_interpolates_and_gradient_matches_fd(activation, train):
    x, y = _data()
    m = ntk.NTKRegressor(8, activation=activation, train=train, seed=5).fit(x, y)
    assert m.num_params >= 2 * 8 * 6 > x.shape[0]            # over-parameterized
    assert np.max(np.abs(m.predict(x) - y)) < 1e-8
    xt = _data(4, seed=2)[0]
    g = m.input_gradient(xt)
    assert np.max(np.abs(g - _central_difference(m, xt))) <= FD_RTOL * np.max(np.abs(g))


def test_two_layer_kernel_is_ntk_gram_first_layer_term():
    """Eq. (1) = ntk_gram of the 2k-neuron net with output weights (1,..,1,-1,..,-1)
    minus its second-layer term 2 phi(XW^T) phi(X'W^T)^T; train='all' is ntk_gram."""
    x, y = _data(20, 5)
    x2 = _data(7, 5, seed=4)[0]
    m = ntk.NTKRegressor(6, activation="tanh", seed=1).fit(x, y)
    net = m._two_layer_net()
    phi, phi2 = np.tanh(x @ m.W_.T), np.tanh(x2 @ m.W_.T)
    full = ntk_gram(x, net, activation="tanh", x2=x2)
    K = m.kernel(x, x2)
    # Sums of <= 2k + d products of O(1) terms: float64 rounding far below 1e-12 relative.
    np.testing.assert_allclose(K, full - 2 * phi @ phi2.T, rtol=0, atol=1e-12 * np.abs(full).max())
    m_all = ntk.NTKRegressor(6, activation="tanh", train="all", seed=1).fit(x, y)
    np.testing.assert_allclose(m_all.kernel(x, x2), full, rtol=0, atol=1e-12 * np.abs(full).max())
    # f(x, w_0) = 0 by symmetry: the network's output at initialisation vanishes
    assert np.allclose(np.tanh(x @ net[0].T) @ net[1][0], 0.0, atol=1e-12)


def test_deep_ntk_interpolates_and_autograd_gradient_matches_fd():
    x, y = _data(20, 5)
    rng = np.random.default_rng(7)
    W = [rng.standard_normal((16, 5)) / np.sqrt(5), rng.standard_normal((16, 16)) / 4,
         rng.standard_normal((1, 16))]
    m = ntk.NTKRegressor(weights=W, activation="gelu").fit(x, y)
    assert m.num_params == 16 * 5 + 16 * 16 + 16
    assert np.max(np.abs(m.predict(x) - y)) < 1e-8
    xt = _data(3, 5, seed=8)[0]
    g = m.input_gradient(xt)
    assert np.max(np.abs(g - _central_difference(m, xt))) <= FD_RTOL * np.max(np.abs(g))


def test_ridge_matches_primal_and_seed_is_recorded():
    x, y = _data(30, 6)
    m = ntk.RFRegressor(50, activation="relu", ridge=0.3).fit(x, y)       # seed from the OS
    assert isinstance(m.seed_, int)
    Phi = ntk.random_features(x, 50, activation="relu", seed=m.seed_)
    np.testing.assert_array_equal(Phi, m.features(x))                      # same V on predict
    theta = np.linalg.solve(Phi.T @ Phi + 0.3 * np.eye(50), Phi.T @ y)
    np.testing.assert_allclose(m.theta_, theta, rtol=1e-9, atol=1e-12)
    rf = ntk.random_features(x, 50, seed=None, return_weights=True)
    assert rf.weights.shape == (50, 6) and rf.features.shape == (30, 50)
    # V_ij ~ N(0, scale/d): empirical variance of 50*6 = 300 draws within 5 standard errors
    # (se of a variance estimate = sqrt(2/300) relative; false alarm < 1e-6)
    v = ntk.random_features(x, 2000, scale=2.0, seed=1, return_weights=True).weights
    assert abs(v.var() * 6 / 2.0 - 1) < 5 * np.sqrt(2 / v.size)


def test_bad_input():
    x, y = _data()
    with pytest.raises(ValueError, match="y: expected shape"):
        ntk.RFRegressor(10).fit(x, y[:-1])
    with pytest.raises(ValueError, match="activation"):
        ntk.RFRegressor(10, activation="sigmoid")
    with pytest.raises(ValueError, match="num_features"):
        ntk.RFRegressor(0)
    with pytest.raises(ValueError, match="cannot interpolate"):
        ntk.NTKRegressor(1, seed=0).fit(x, y)                  # p = 12 < n = 24
    with pytest.raises(ValueError, match="x: expected 6 columns"):
        ntk.RFRegressor(40, seed=0).fit(x, y).predict(x[:, :5])
    with pytest.raises(ValueError, match="either width"):
        ntk.NTKRegressor()
    with pytest.raises(ValueError, match="ntk_gram supports"):
        ntk.NTKRegressor(4, activation="logcosh", train="all")
    with pytest.raises(RuntimeError, match="fit"):
        ntk.NTKRegressor(4).predict(x)
    with pytest.raises(TypeError, match="model"):
        ntk.sensitivity(object(), x)
