"""Tests of ncdp_fast.nc: ETF, synthetic NC data, metrics, private/public preprocessing."""
from __future__ import annotations

import math

import numpy as np
import pytest

import ncdp_fast as nf
from ncdp_fast import nc

EPS64 = np.finfo(np.float64).eps


# ---------------------------------------------------------------------- ETF

@pytest.mark.parametrize("K,p", [(2, 2), (3, 7), (10, 10), (10, 500)])
def test_etf_unit_norm_and_equiangular(K, p):
    M = nc.etf(K, p, seed=K * p)
    assert M.shape == (K, p)
    G = M @ M.T
    # Entries are O(1) sums of p products, float64: error <= ~p*eps with a margin of 10.
    tol = 10 * p * EPS64
    np.testing.assert_allclose(np.diag(G), 1.0, atol=tol)
    off = G[~np.eye(K, dtype=bool)]
    np.testing.assert_allclose(off, -1.0 / (K - 1), atol=tol)
    np.testing.assert_allclose(M.sum(axis=0), 0.0, atol=tol)        # P(I - 11^T/K) 1 = 0


def test_etf_seed_and_errors():
    np.testing.assert_array_equal(nc.etf(4, 9, seed=3), nc.etf(4, 9, seed=3))
    assert not np.allclose(nc.etf(4, 9), nc.etf(4, 9))               # OS seeds differ
    with pytest.raises(ValueError, match="dim"):
        nc.etf(5, 4)
    with pytest.raises(ValueError, match="num_classes"):
        nc.etf(1, 4)


# ----------------------------------------------------------------- synthetic

def test_synthetic_counts_chunks_and_grouping():
    d = nc.synthetic(1003, 5, 40, shift="offset", beta=0.1, imbalance=0.2, seed=1,
                     test_size=300, public_size=50)
    counts = np.bincount(d.y_train, minlength=5)
    assert counts.sum() == 1003
    # alpha = 0.2 shared by the first floor(K/2) = 2 classes, largest-remainder rounding
    np.testing.assert_allclose(counts[:2], 0.1 * 1003, atol=1)
    np.testing.assert_allclose(counts[2:], 0.8 / 3 * 1003, atol=1)
    X = d.X_train
    np.testing.assert_array_equal(X, np.concatenate([c for c, _ in d.chunks("train", 97)]))
    np.testing.assert_allclose(np.abs(d.offset), 0.1)
    np.testing.assert_allclose(X - d.means[d.y_train], np.broadcast_to(d.offset, X.shape),
                               atol=4 * np.finfo(np.float32).eps)
    Xg, yg, cg = d.grouped()
    np.testing.assert_array_equal(cg, counts)
    np.testing.assert_array_equal(Xg[d.y_train], X)
    assert len(d.y_public) == 50 and len(d.y_test) == 300


def test_synthetic_stochastic_chunk_invariant_and_test_only():
    d = nc.synthetic(2500, 3, 16, shift="stochastic", beta=0.05, seed=7, shift_split="test")
    np.testing.assert_array_equal(d.X_train, d.means[d.y_train].astype(np.float32))
    full = d.features("test")
    part = np.concatenate([c for c, _ in d.chunks("test", 333)])
    np.testing.assert_array_equal(full, part)
    v = full - d.means[d.y_test].astype(np.float32)
    np.testing.assert_allclose(np.abs(v), 0.05, rtol=1e-5)
    with pytest.raises(ValueError, match="stochastic"):
        d.grouped("test")


def test_synthetic_adversarial_lowers_margin():
    d = nc.synthetic(200, 4, 30, seed=2)
    W = d.means + 0.3 * np.random.default_rng(0).standard_normal((4, 30))
    adv = nc.synthetic(200, 4, 30, shift="adversarial", beta=0.02, classifier=W, seed=2)
    np.testing.assert_array_equal(adv.means, d.means)
    X, y = adv.features("test"), adv.y_test
    np.testing.assert_allclose(np.abs(X - d.means[y]), 0.02, rtol=1e-5)
    s_clean, s_adv = d.means[y] @ W.T, X.astype(np.float64) @ W.T
    i = np.arange(len(y))
    margin = lambda s: s[i, y] - np.where(np.eye(4, dtype=bool)[y], -np.inf, s).max(axis=1)
    assert np.all(margin(s_adv) < margin(s_clean))
    with pytest.raises(ValueError, match="classifier"):
        nc.synthetic(200, 4, 30, shift="adversarial", beta=0.02)


def test_synthetic_errors():
    with pytest.raises(ValueError, match="shift"):
        nc.synthetic(100, 3, 5, shift="nope", beta=0.1)
    with pytest.raises(ValueError, match="beta"):
        nc.synthetic(100, 3, 5, shift="offset")
    with pytest.raises(ValueError, match="imbalance"):
        nc.synthetic(100, 3, 5, imbalance=1.5)


# ------------------------------------------------------------------- metrics

def test_metrics_perfect_collapse():
    K, p = 6, 20
    d = nc.synthetic(600, K, p, seed=4, dtype=np.float64, imbalance=0.3)
    m = nc.metrics(d.X_train, d.y_train)
    tol = 100 * p * EPS64
    np.testing.assert_allclose(m.means, d.means, atol=tol)
    assert m.cosine_deviation < tol
    assert m.nc1 < tol and m.equinorm_cv < tol
    assert m.beta.max() < tol
    assert math.isclose(m.min_mean_distance, math.sqrt(2 * K / (K - 1)), rel_tol=1e-12)


def test_metrics_known_beta():
    beta, K, p = 0.1, 4, 300
    d = nc.synthetic(4000, K, p, shift="stochastic", beta=beta, seed=11, dtype=np.float64)
    X, y = d.X_train, d.y_train
    m = nc.metrics(X, y)
    # Deterministic: beta_i = max_j |v_ij - vbar_kj| lies within beta -+ max_j |vbar_kj|.
    vbar = m.means - d.means
    slack = np.abs(vbar).max(axis=1)[y] + 1e-12
    assert np.all(np.abs(m.beta - beta) <= slack)
    # Statistical: vbar_kj is the mean of 1000 +-beta signs; Hoeffding with a union over
    # K*p coordinates bounds max|vbar| by s with false-alarm probability <= 1e-6.
    s = beta * math.sqrt(2 * math.log(2 * K * p / 1e-6) / 1000)
    assert np.all(np.abs(m.beta_median - beta) <= s)
    assert np.abs(vbar).max() <= s


def test_metrics_nc1_matches_explicit_formula():
    rng = np.random.default_rng(5)
    K, p, n = 3, 6, 90
    y = np.repeat(np.arange(K), n // K)
    X = rng.standard_normal((n, p)) * 0.3 + 2 * rng.standard_normal((K, p))[y]
    m = nc.metrics(X, y)
    mu = np.stack([X[y == k].mean(0) for k in range(K)])
    mg = mu.mean(0)
    Sw = sum(np.outer(x - mu[c], x - mu[c]) for x, c in zip(X, y)) / n
    Sb = (mu - mg).T @ (mu - mg) / K
    expected = np.trace(Sw @ np.linalg.pinv(Sb)) / K
    assert math.isclose(m.nc1, expected, rel_tol=1e-9)
    cen = mu - mg
    cos = cen @ cen.T / np.outer(np.linalg.norm(cen, axis=1), np.linalg.norm(cen, axis=1))
    np.testing.assert_allclose(m.cosine, cos, atol=1e-12)
    np.testing.assert_allclose(m.beta, np.abs(X - mu[y]).max(1), atol=1e-12)


def test_metrics_chunks_and_adversarial_shift_inputs_are_checked():
    """The sixth audit: chunk_rows=-1 gave all-zero means, negative labels
    wrapped around in adversarial_shift and a NaN coef gave NaN shifts."""
    X, y = np.random.default_rng(0).standard_normal((10, 3)), np.arange(10) % 2
    with pytest.raises(ValueError, match="chunk_rows: expected an integer >= 1, got -1"):
        nc.metrics(X, y, chunk_rows=-1)
    W = np.random.default_rng(1).standard_normal((2, 3))
    with pytest.raises(ValueError, match=r"labels: expected a 1-D array of classes in \[0, 2\)"):
        nc.adversarial_shift(np.array([-1, 0]), W, 0.1)
    with pytest.raises(ValueError, match="coef: expected a finite"):
        nc.adversarial_shift(np.arange(2), W * np.nan, 0.1)
    assert nc.adversarial_shift(np.arange(2), W, 0.1).shape == (2, 2, 3)


def test_metrics_bad_input():
    X = np.zeros((6, 3))
    with pytest.raises(ValueError, match=r"labels: expected integers in \[0, 2\), "
                       r"got values outside it \(not shown: labels are private\)"):
        nc.metrics(X, np.array([0, 1, 5, 0, 1, 0]), num_classes=2)
    with pytest.raises(ValueError, match="labels"):
        nc.metrics(X, np.array([0, 1, -1, 0, 1, 0]))
    with pytest.raises(ValueError, match="non-integer"):
        nc.metrics(X, np.array([0, 1, 0.5, 0, 1, 0]))
    bad = X.copy()
    bad[2, 1] = np.nan
    with pytest.raises(ValueError, match="features: expected finite features, got NaN or Inf"):
        nc.metrics(bad, np.array([0, 1, 0, 0, 1, 0]))
    with pytest.raises(ValueError, match="empty"):
        nc.metrics(X, np.array([0, 2, 0, 0, 2, 0]))


# ------------------------------------------------------------- preprocessing

@pytest.mark.parametrize("cls", [nc.Centering, lambda: nc.PCAProjector(2)])
def test_preprocessing_refuses_undeclared_or_private(cls):
    X = np.random.default_rng(0).standard_normal((20, 5))
    with pytest.raises(ValueError, match="public=True"):
        cls().fit(X)
    with pytest.raises(ValueError, match="fit_private"):
        cls().fit(X, public=False)
    with pytest.raises(TypeError, match="public"):
        cls().fit(X, public="yes")
    with pytest.raises(RuntimeError, match="fit"):
        cls().transform(X)
    obj = cls().fit(X, public=True)
    assert obj.privacy == dict(fitted_on="public", rho=0.0)
    with pytest.raises(ValueError, match="rho"):
        cls().fit_private(X, rho=0.0, clip=1.0)
    with pytest.raises(ValueError, match="rho"):
        cls().fit_private(X, rho=float("inf"), clip=1.0)
    # A row whose squared norm overflows float64: refused by both (PCA's clip
    # gave it the factor 0, a silent drop, until the sixth audit).
    X[3] = 1e200
    with pytest.raises(ValueError, match=r"rows \[3\] .*(beyond float64|not finite)"):
        cls().fit_private(X, rho=1.0, clip=1.0)


def test_centering_public_and_private_exact_noise():
    rng = np.random.default_rng(1)
    X = rng.standard_normal((50, 7)) + 3.0
    c = nc.Centering().fit(X, public=True)
    np.testing.assert_allclose(c.transform(X).mean(0), 0.0, atol=1e-12)
    rho, clip, seed = 0.5, 2.0, 123
    cp = nc.Centering().fit_private(X, rho=rho, clip=clip, seed=seed)
    z = 1 / math.sqrt(rho)                       # each of the two releases: rho/2
    norms = np.linalg.norm(X, axis=1)
    clipped_sum = (X * np.minimum(1, clip / norms)[:, None]).sum(0)
    g = nf.gaussian(8, seed=seed, offset=0, dtype=np.float64)
    expected = (clipped_sum + z * clip * g[:7]) / (50 + z * g[7])
    np.testing.assert_allclose(cp.mean_, expected, rtol=1e-12)
    assert cp.privacy == dict(fitted_on="private", rho=rho)
    assert (cp.offset_, cp.next_offset_, cp.seed_) == (0, 8, None)     # no key kept
    # OS seeds by default: two fits differ.
    assert not np.array_equal(nc.Centering().fit_private(X, rho=rho, clip=clip).mean_,
                              nc.Centering().fit_private(X, rho=rho, clip=clip).mean_)


def test_pca_public_exact_and_randomized():
    rng = np.random.default_rng(2)
    basis = np.linalg.qr(rng.standard_normal((40, 3)))[0]
    X = (rng.standard_normal((300, 3)) * [10, 6, 3]) @ basis.T + 0.01 * rng.standard_normal(
        (300, 40))
    pca = nc.PCAProjector(3).fit(X, public=True)
    w, V = np.linalg.eigh(X.T @ X / 300)
    np.testing.assert_allclose(np.abs(pca.components_.T @ V[:, ::-1][:, :3]), np.eye(3),
                               atol=1e-9)
    assert pca.transform(X).shape == (300, 3)
    # p > 2048: randomized subspace iteration, same subspace to the noise level.
    big = np.linalg.qr(rng.standard_normal((2100, 3)))[0]
    Xb = (rng.standard_normal((200, 3)) * [10, 6, 3]) @ big.T + 0.01 * rng.standard_normal(
        (200, 2100))
    pb = nc.PCAProjector(3).fit(Xb, public=True, seed=1)
    sv = np.linalg.svd(pb.components_.T @ big, compute_uv=False)
    assert sv.min() > 0.999
    with pytest.raises(ValueError, match="n_components"):
        nc.PCAProjector(50).fit(X, public=True)


def test_pca_private_analyze_gauss_noise():
    rng = np.random.default_rng(3)
    X = rng.standard_normal((100, 6))
    rho, clip, seed = 2.0, 1.5, 9
    pp = nc.PCAProjector(2).fit_private(X, rho=rho, clip=clip, seed=seed)
    Xc = X * np.minimum(1, clip / np.linalg.norm(X, axis=1))[:, None]
    iu = np.triu_indices(6)
    E = np.zeros((6, 6))
    E[iu] = clip ** 2 / math.sqrt(2 * rho) * nf.gaussian(21, seed=seed, dtype=np.float64)
    E = E + np.triu(E, 1).T
    w, V = np.linalg.eigh(Xc.T @ Xc + E)
    np.testing.assert_allclose(np.abs(pp.components_.T @ V[:, ::-1][:, :2]), np.eye(2),
                               atol=1e-9)
    assert pp.rho_ == rho and pp.fitted_on_ == "private"


def test_pca_private_rows_are_clipped_to_at_most_clip_as_computed():
    """The fifth audit: min(1, clip/||x||) left 6043 of 20000 random rows
    above clip (by up to 6.7e-16 relative); the rounding-aware factor leaves
    none, rows at, just above and far above the bound, p = 2..64."""
    from ncdp_fast.nc.preprocess import _clipped_rows
    rng = np.random.default_rng(11)
    for p in (2, 3, 17, 64):
        X = rng.standard_normal((5000, p))
        X *= (1.0 + rng.choice([0.0, 1e-16, 1e-15, 1e-3, 10.0], size=(5000, 1))) / \
            np.linalg.norm(X, axis=1, keepdims=True)
        for clip in (1.0, 0.7, 3.0):
            Xc = _clipped_rows(X * clip, clip)
            assert np.sqrt(np.einsum("ij,ij->i", Xc, Xc)).max() <= clip


def test_preprocessing_torch_roundtrip():
    torch = pytest.importorskip("torch")
    X = np.random.default_rng(4).standard_normal((30, 5)).astype(np.float32)
    c = nc.Centering().fit(torch.from_numpy(X), public=True)
    out = c.transform(torch.from_numpy(X))
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
    np.testing.assert_allclose(out.numpy(), X - X.mean(0), atol=1e-5)


def test_synthetic_reproduction_smoke(tmp_path):
    """The nc-synthetic entry point runs end to end at a tiny size and writes its
    table and figure (the accuracies themselves are the reproduction's business)."""
    import json

    from ncdp_fast.reproduce.nc import synthetic_main
    assert synthetic_main(["--out", str(tmp_path), "--dims", "10,40", "--reps", "1", "--n",
                           "200", "--test-size", "50", "--public-size", "20", "--seed",
                           "1"]) == 0
    (js,) = tmp_path.glob("nc_synthetic-*.json")
    rows = json.loads(js.read_text())["rows"]
    assert {r["p"] for r in rows} == {10, 40} and len(rows) == 2 * 9
    perfect = [r for r in rows if r["setting"] == "balanced"]
    assert all(0.0 <= r["acc_mean"] <= 1.0 for r in perfect)
    assert list(tmp_path.glob("nc_synthetic-*.png"))


def test_pca_truncate_is_nested_fit_and_keeps_cost():
    X = np.random.default_rng(6).standard_normal((80, 12)) * np.linspace(3, 0.5, 12)
    big = nc.PCAProjector(6).fit(X, public=True)
    small = big.truncate(2)
    np.testing.assert_allclose(np.abs(small.components_.T @ nc.PCAProjector(2).fit(
        X, public=True).components_), np.eye(2), atol=1e-9)
    priv = nc.PCAProjector(5).fit_private(X, rho=1.0, clip=4.0, seed=2).truncate(3)
    assert priv.privacy == dict(fitted_on="private", rho=1.0)
    with pytest.raises(ValueError, match="n_components"):
        big.truncate(7)


def test_centering_fit_private_widens_half_precision_as_pca_does():
    """float16 rows reached the clip op, whose error named its own argument
    'grads'; PCAProjector.fit_private widened them.  Both widen exactly now:
    the same key gives the float64 input's mean."""
    X = np.random.default_rng(3).standard_normal((7, 4)).astype(np.float16)
    a = nc.Centering().fit_private(X, rho=1.0, clip=2.0, seed=nf.NoiseStream(991, 0))
    with pytest.warns(nf.NoiseReuseWarning):                 # the same draws, on purpose
        b = nc.Centering().fit_private(X.astype(np.float64), rho=1.0, clip=2.0,
                                    seed=nf.NoiseStream(991, 0))
    np.testing.assert_array_equal(a.mean_, b.mean_)
