"""Fast tests of ``ncdp-fast reproduce nc-real``'s logic (ncdp_fast/reproduce/nc/): the
spiked-covariance thresholds, the PCA protocols' privacy labels and budget split, the
exact copies reduction of Figure 3(b) and its noise-to-signal report, the summaries.
Small synthetic arrays (and scikit-learn's bundled digits for the smoke run): no
downloads, no cached real features."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from ncdp_fast import nc
from ncdp_fast.privacy import dp_to_zcdp, zcdp_to_dp
from ncdp_fast.reproduce.nc import protocols, real_data, real_dimension, real_report, spiked
from ncdp_fast.reproduce.nc.real_fit import sgd_pair, weight_noise_sd
from ncdp_fast.train import NoisySGDClassifier


# ------------------------------------------------------------------ spiked covariance

def test_spiked_thresholds_values():
    th = spiked.spiked_thresholds(0.1, 1280, 5000)
    assert th["gamma"] == pytest.approx(0.256)
    assert th["bulk_edge"] == pytest.approx(0.1 * (1 + math.sqrt(0.256)) ** 2)
    assert th["threshold"] == pytest.approx(0.1 * math.sqrt(0.256))
    # the comparison: 5000 public rows against 55000 private ones
    ratio = th["threshold"] / spiked.spiked_thresholds(0.1, 1280, 55000)["threshold"]
    assert ratio == pytest.approx(math.sqrt(11))
    with pytest.raises(ValueError):
        spiked.spiked_thresholds(-0.1, 10, 10)


def test_analyze_gauss_threshold_values():
    ag = spiked.analyze_gauss_threshold(0.002, 2.0, 400, 1000)
    sigma = 4.0 / math.sqrt(0.004)
    assert ag["sigma"] == pytest.approx(sigma)
    assert ag["threshold"] == pytest.approx(sigma * 20 / 1000)
    assert ag["radius"] == pytest.approx(2 * ag["threshold"])


def _two_class(n, p, a, rng):
    y = rng.integers(0, 2, n)
    X = np.zeros((n, p))
    X[:, 0] = np.where(y == 1, a, -a)
    return X, y


def test_class_mean_spikes_match_explicit_matrix():
    rng = np.random.default_rng(0)
    X = rng.standard_normal((300, 7))
    y = rng.integers(0, 3, 300)
    mu, pi = spiked.class_means(X, y, 3)
    B = sum(pi[k] * np.outer(mu[k], mu[k]) for k in range(3))
    np.testing.assert_allclose(spiked.class_mean_spikes(mu, pi),
                               np.sort(np.linalg.eigvalsh(B))[::-1][:3], atol=1e-12)


def test_captured_fraction_span_and_orthogonal():
    rng = np.random.default_rng(1)
    X, y = _two_class(200, 6, 0.5, rng)
    mu, pi = spiked.class_means(X, y, 2)
    e = np.eye(6)
    assert spiked.captured_fraction(e[:, :1], mu, pi) == pytest.approx(1.0)
    assert spiked.captured_fraction(e[:, 1:4], mu, pi) == pytest.approx(0.0)
    with pytest.raises(ValueError, match="components"):
        spiked.captured_fraction(e[:5, :1], mu, pi)


@pytest.mark.parametrize("factor, found", [(4.0, True), (0.25, False)])
def test_spiked_threshold_predicts_pca(factor, found):
    """A class-mean spike above v sqrt(p/m) is found by the top eigenvector of the
    perturbed rows; one well below it is not (the BBP transition the analysis uses)."""
    rng = np.random.default_rng(2)
    p, m, v = 400, 1600, 1.0
    lam = factor * spiked.spiked_thresholds(v, p, m)["threshold"]
    X, y = _two_class(m, p, math.sqrt(lam), rng)
    mu, pi = spiked.class_means(X, y, 2)
    assert spiked.count_detected(spiked.class_mean_spikes(mu, pi), lam / factor) == int(found)
    Xp = X + math.sqrt(v) * rng.standard_normal(X.shape)
    pca = protocols.fit_protocol("paper", 1, Xpriv=Xp, Xpub=None, seed=0)
    kept = spiked.captured_fraction(protocols.components(pca, 1), mu, pi)
    assert (kept > 0.5) == found


# ------------------------------------------------------------------ protocols

def _data(n=300, p=12, K=3, seed=3):
    rng = np.random.default_rng(seed)
    y = np.arange(n) % K
    M = rng.standard_normal((K, p))
    X = M[y] + 0.3 * rng.standard_normal((n, p))
    return real_data.normalize(X.astype(np.float32)), y


class _Cfg:
    epsilon, delta, batch, epochs, lr, accountant = 1.0, 1e-5, 64, 2.0, 1.0, "pld"


def test_paper_protocol_is_labelled_not_private_and_refused_as_free():
    X, y = _data()
    proj = protocols.fit_protocol("paper", 2, Xpriv=X, Xpub=None, seed=0)
    assert not proj.private_valid and proj.privacy == protocols.NOT_PRIVATE
    assert proj.projector.fitted_on_ == protocols.NOT_PRIVATE
    assert proj.projector.truncate(1).fitted_on_ == protocols.NOT_PRIVATE
    clf = NoisySGDClassifier(epsilon=1.0, delta=1e-5, sample_rate=0.2, epochs=1,
                             num_classes=3, seed=0)
    with pytest.raises(ValueError, match="preprocessing"):
        clf.fit(proj.projector.transform(X), y, preprocessing=[proj.projector])


def test_public_protocol_uses_first_m_public_rows_at_no_cost():
    X, y = _data()
    pub = _data(seed=4)[0]
    proj = protocols.fit_protocol("public-100", 2, Xpriv=X, Xpub=pub, seed=0)
    assert proj.private_valid and proj.rho == 0.0 and proj.rows == 100
    assert proj.projector.privacy == dict(fitted_on="public", rho=0.0)
    ref = nc.PCAProjector(2).fit(pub[:100], public=True)
    np.testing.assert_allclose(np.abs(ref.components_.T @ proj.projector.components_),
                               np.eye(2), atol=1e-6)
    with pytest.raises(ValueError, match="public pool"):
        protocols.fit_protocol("public-1000", 2, Xpriv=X, Xpub=pub, seed=0)
    with pytest.raises(ValueError, match="protocol"):
        protocols.fit_protocol("oracle", 2, Xpriv=X, Xpub=pub, seed=0)


def test_dp_pca_budget_split_is_spent_and_reported():
    b = protocols.dp_pca_budget(1.0, 1e-5, 0.1)
    assert b["rho_total"] == pytest.approx(dp_to_zcdp(1.0, 1e-5))
    assert b["rho_pca"] == pytest.approx(0.1 * b["rho_total"])
    assert b["epsilon_pca"] == pytest.approx(zcdp_to_dp(b["rho_pca"], 1e-5))
    assert 0 < b["epsilon_pca"] < 1.0
    X, y = _data()
    proj = protocols.fit_protocol("dp-pca", 2, Xpriv=X, Xpub=None, seed=5, rho=b["rho_pca"],
                                  clip=protocols.dp_pca_clip(0.0, X.shape[1]), delta=1e-5)
    assert proj.private_valid and proj.rho == b["rho_pca"]
    assert proj.epsilon_pca == pytest.approx(b["epsilon_pca"])
    pk = proj.projector.truncate(1)
    clf, _ = sgd_pair(np.ascontiguousarray(pk.transform(X), np.float32), y, 3, _Cfg, 6,
                      preprocessing=[pk], reference=False)
    # the PCA's zCDP is in the estimator's accountant and the total meets the budget
    assert clf.epsilon_ <= 1.0 + 1e-9
    assert any(getattr(e, "rho", None) == pytest.approx(b["rho_pca"])
               for e in clf.accountant_.history)
    plain, _ = sgd_pair(X, y, 3, _Cfg, 6, reference=False)
    assert clf.noise_multiplier_ > plain.noise_multiplier_


def test_protocol_names_and_clip():
    assert protocols.protocol_names([5000, 20000]) == ["paper", "public-5000", "public-20000",
                                                       "dp-pca"]
    assert protocols.protocol_names([7], dp_pca=False) == ["paper", "public-7"]
    assert protocols.dp_pca_clip(0.1, 90) == pytest.approx(math.sqrt(10.0))


# ------------------------------------------------------------------ features, Figure 3(b)

def test_perturb_var_scales():
    assert real_data.perturb_var("unit:0.1", 1280) == pytest.approx(0.1)
    assert real_data.perturb_var("rel:0.1", 1280) == pytest.approx(0.1 / 1280)
    for bad in ("0.1", "abs:0.1", "unit:"):
        with pytest.raises(ValueError):
            real_data.perturb_var(bad, 10)


def test_resize_copies_is_an_isometry_and_split_is_disjoint():
    X, _ = _data(n=20, p=5)
    coords = np.arange(5)
    C = real_data.resize(X, 15, coords)
    np.testing.assert_allclose(C, np.tile(X, 3) / np.sqrt(3), rtol=1e-6)
    np.testing.assert_allclose(np.linalg.norm(real_data.resize(X, 3, coords), axis=1), 1, rtol=1e-6)
    pub, priv = real_data.split_rows(100, 30, seed=1, max_private=50)
    assert len(pub) == 30 and len(priv) == 50 and not set(pub) & set(priv)


def test_noise_report_values():
    r = real_dimension.noise_report(0.1, 1280, 0.07)
    assert r["pert_to_signal"] == pytest.approx(math.sqrt(128))
    assert r["dp_logit_sd"] == pytest.approx(0.07 * math.sqrt(128))


def test_wishart_identity_moments():
    rng = np.random.default_rng(7)
    G = np.mean([real_dimension.wishart_identity(3, 50, 0.5, rng) for _ in range(4000)], axis=0)
    np.testing.assert_allclose(G, 50 * 0.25 * np.eye(3), atol=0.3)
    assert not real_dimension.wishart_identity(3, 0, 0.5, rng).any()


def test_weight_noise_in_the_complement_of_the_copies():
    """NoisySGD on r renormalised copies: the part of W off range(Q) is pure noise with
    entry std s = lr z C sqrt(T) / (q n) (the reduction's W_perp)."""
    X, y = _data(n=256, p=4)
    r = 100
    Xc = real_data.resize(X, 4 * r, np.arange(4))
    clf, _ = sgd_pair(Xc, y, 3, _Cfg, 8, reference=False)
    Q = np.tile(np.eye(4), (r, 1)) / math.sqrt(r)
    Wp = np.asarray(clf.coef_, np.float64) @ (np.eye(4 * r) - Q @ Q.T)
    s = weight_noise_sd(clf)
    assert np.std(Wp) * math.sqrt(4 * r / (4 * r - 4)) == pytest.approx(s, rel=0.08)


def test_copies_accuracy_limits():
    rng = np.random.default_rng(9)
    X, y = _data(n=400, p=6)
    W = np.stack([X[y == k].mean(0) for k in range(3)])
    clean = float(np.mean(np.argmax(X @ W.T, 1) == y))
    base = X.astype(np.float64) @ W.T
    assert real_dimension.copies_accuracy(W, base, y, 0.0, 50, 0.3, rng)[0] == clean
    # SGD (s = 0) does not depend on r; huge DP noise drives NoisySGD to chance
    a1 = real_dimension.copies_accuracy(W, base, y, 0.05, 1, 0.0, np.random.default_rng(1), 1)
    a2 = real_dimension.copies_accuracy(W, base, y, 0.05, 10 ** 6, 0.0, np.random.default_rng(1),
                                        1)
    assert a1 == a2
    low = real_dimension.copies_accuracy(W, base, y, 0.05, 10 ** 6, 1.0, rng, 3)[0]
    assert low < 0.5


def test_summaries():
    base = dict(dataset="a", scale="unit:1", var=1.0, margin=1.0, dp_logit_sd=0.0)
    rows = [dict(base, p=p, factor=p / 10, method="m", noisy_pert=acc, sgd_pert=0.8,
                 pert_to_signal=math.sqrt(p)) for p, acc in ((10, 0.8), (20, 0.78), (40, 0.7))]
    (s,) = real_report.fig3b_summary(rows)
    assert s["p_deteriorates"] == 40 and s["noisy_pert_d"] == 0.8
    pca = [dict(dataset="a", p=10, scale="x", protocol="none", noisy_acc=0.5, k=None,
                private_valid=True, captured=None)]
    pca += [dict(dataset="a", p=10, scale="x", protocol="paper", k=k, noisy_acc=a,
                 private_valid=False, captured=c) for k, a, c in ((9, 0.7, 0.9), (50, 0.6, 1.0))]
    (f,) = real_report.fig4_summary(pca)
    assert f["kmin_helps"] and f["kmin_best"] and f["best_k"] == 9 and not f["private_valid"]


def test_real_main_smoke_on_digits(tmp_path):
    """End to end on scikit-learn's bundled digits (no cache): the reports exist, the
    paper's rows are labelled not private, DP-PCA rows carry their epsilon."""
    from ncdp_fast.reproduce.nc import real_main
    assert real_main(["--out", str(tmp_path), "--datasets", "digits", "--extractors", "pixels",
                      "--epochs", "1", "--max-private", "600", "--public-sizes", "100,300",
                      "--dim-factors", "1", "--extend", "1,8", "--reps", "1", "--scales",
                      "unit:0.1", "--pca", "9,20", "--seed", "1", "--quick"]) == 0
    pca = json.loads(next(tmp_path.glob("nc_real_pca-*.json")).read_text())["rows"]
    assert {r["protocol"] for r in pca} == {"none", "paper", "public-100", "public-300", "dp-pca"}
    assert all(not r["private_valid"] and "NOT PRIVATE" in r["privacy"]
               for r in pca if r["protocol"] == "paper")
    dp = [r for r in pca if r["protocol"] == "dp-pca"]
    assert all(r["epsilon_pca"] > 0 and r["epsilon_"] <= 1.0 + 1e-9 for r in dp)
    dim = json.loads(next(tmp_path.glob("nc_real_dimension-*.json")).read_text())["rows"]
    assert {r["p"] for r in dim if r["method"].startswith("copies")} == {64, 512}
    for name in ("spiked", "fig3b_summary", "fig4_summary", "metrics"):
        assert list(tmp_path.glob(f"nc_real_{name}-*.md"))
    assert list(tmp_path.glob("nc_real_pca-*.png"))


def test_the_class_count_is_the_data_sets_schema_not_read_from_the_labels(monkeypatch):
    """The sixth audit: load_split took K = max(y) + 1 over training rows that
    include the private split, so removing the last class's records changed K
    (and the classifier's shape).  K is now the data set's schema."""
    import ncdp_fast.datasets as datasets
    rng = np.random.default_rng(0)
    X = rng.standard_normal((60, 5))
    y = np.arange(60) % 9                          # no record of class 9

    def fake(dataset, extractor, split, resolution):
        return (X, y) if split == "train" else (X[:10], y[:10])
    monkeypatch.setattr(datasets, "load_features", fake)
    F = real_data.load_split("mnist", "pixels", resolution=96, public_pool=20, seed=1)
    assert F.K == datasets.NUM_CLASSES["mnist"] == 10
    monkeypatch.setattr(datasets, "load_features",
                        lambda *a, **k: (X, np.r_[y[:-1], 10]))
    with pytest.raises(ValueError, match=r"expected integers in \[0, 10\)"):
        real_data.load_split("mnist", "pixels", resolution=96, public_pool=20, seed=1)
