"""Attacks on the privacy promises, kept in the suite so that the next hole is
caught by CI (issue 13): the clip bound at extreme magnitudes, reconstruction
from published artifacts, presence revealed by fitted shapes, noise reused
across components, and tampered release files.

Each test states the attack and what must make it fail."""
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ncdp_fast as nf
from ncdp_fast import _arrays

from _release_checks import check_key_refusals


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


def _extreme_linear_case(data, dtype):
    """One sample's (a, g) of values from the smallest denormal to the largest
    float, T of None (2-D), 1, 2 or 5, with cancellation across positions."""
    T = data.draw(st.sampled_from([None, 1, 2, 5]))
    d, K = data.draw(st.integers(1, 6)), data.draw(st.integers(1, 6))
    rows = 1 if T is None else T
    a = np.stack([data.draw(_vec(dtype, d)) for _ in range(rows)])
    g = np.stack([data.draw(_vec(dtype, K)) for _ in range(rows)])
    if data.draw(st.booleans()) and rows > 1:
        # Cancellation across positions: the sum over t is far smaller than its terms.
        a[1] = -a[0] * dtype(1 + 2 ** -10)
        g[1] = g[0]
    return (a[0][None], g[0][None]) if T is None else (a[None], g[None])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("bias", [True, False])
@settings(max_examples=100, deadline=None)
@given(data=st.data(), C=C_VALUES)
def test_linear_contribution_never_exceeds_C(dtype, bias, data, C):
    a, g = _extreme_linear_case(data, dtype)
    res = nf.clip_and_noise_linear(a, g, max_norm=C, noise_multiplier=0.0, bias=bias,
                                   nan_policy="zero")
    parts = [res.grad_weight] + ([res.grad_bias] if bias else [])
    _check_contribution(parts, res, C)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("bias", [True, False])
@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])   # one device throughout
@given(data=st.data(), C=C_VALUES)
def test_linear_contribution_never_exceeds_C_on_the_device(require_cuda, dtype, bias, data, C):
    """The device route (norms in float64, the clipped sum one GEMM in the data
    dtype, rebalanced only where the norms' sizes say so): the same attack."""
    import torch
    a, g = _extreme_linear_case(data, dtype)
    res = nf.clip_and_noise_linear(torch.from_numpy(a).to(require_cuda),
                                   torch.from_numpy(g).to(require_cuda), max_norm=C,
                                   noise_multiplier=0.0, bias=bias, nan_policy="zero")
    parts = [res.grad_weight.cpu().numpy()] + ([res.grad_bias.cpu().numpy()] if bias else [])
    _check_contribution(parts, res, C)


@pytest.mark.gpu
@pytest.mark.parametrize("bias", [True, False])
@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])   # one device throughout
@given(data=st.data(), C=C_VALUES)
def test_linear_contribution_never_exceeds_C_with_float32_grams(require_cuda, bias, data, C):
    """gram_precision="float32" (the norms from float32 Grams, raised by their
    rounding bound): the same attack on the Gram route (2 T^2 <= K d), values
    from the smallest denormal to the largest float32, cancelling positions;
    a float32 Gram that overflows sends the step to the float64 norms, so
    again only a norm overflowing float64 may drop a finite row."""
    import torch
    T = data.draw(st.sampled_from([2, 3]))
    d = data.draw(st.integers(3, 6))
    K = data.draw(st.integers(max(1, -(-2 * T * T // d)), 6).filter(lambda k: 2 * T * T <= k * d))
    a = np.stack([data.draw(_vec(np.float32, d)) for _ in range(T)])
    g = np.stack([data.draw(_vec(np.float32, K)) for _ in range(T)])
    if data.draw(st.booleans()):
        a[1] = -a[0] * np.float32(1 + 2 ** -10)
        g[1] = g[0]
    res = nf.clip_and_noise_layers(
        [(torch.from_numpy(a[None]).to(require_cuda), torch.from_numpy(g[None]).to(require_cuda),
          bias)], max_norm=C, noise_multiplier=0.0, nan_policy="zero", gram_precision="float32")
    w, b = res.grads[0]
    _check_contribution([w.cpu().numpy()] + ([b.cpu().numpy()] if bias else []), res, C)


@pytest.mark.gpu
@pytest.mark.parametrize("bias", [True, False])
@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])   # one device throughout
@given(seed=st.integers(0, 2 ** 32 - 1), T=st.sampled_from([2, 3]), d=st.integers(512, 700),
       K=st.integers(512, 700), cancel=st.booleans(), C=C_VALUES)
def test_linear_contribution_never_exceeds_C_through_split_grams(require_cuda, bias, seed, T, d,
                                                                 K, cancel, C):
    """The float64 norms through the Gram kernel's k-ranges (a launch of few
    jobs splits d into ranges whose partial Grams a second kernel adds): float32
    values log-uniform from the smallest denormal to the largest finite, some
    positions cancelling, so a range's partial sum and the order of the
    ranges' addition matter; each sample's contribution stays within C."""
    import torch
    from ncdp_fast._cuda import gram
    assert gram.split(gram.jobs(1, 1, T), min(d, K))[0] > 1       # the ranges are taken
    rng = np.random.default_rng(seed)
    fi = np.finfo(np.float32)
    lo, hi = math.log2(float(fi.smallest_subnormal)), math.log2(float(fi.max)) - 0.01

    def values(shape):
        x = rng.choice([-1.0, 1.0], shape) * np.exp2(rng.uniform(lo, hi, shape))
        x[rng.random(shape) < 0.05] = 0.0
        return x.astype(np.float32)
    a, g = values((1, T, d)), values((1, T, K))
    if cancel:
        a[0, 1] = -a[0, 0] * np.float32(1 + 2 ** -10)
        g[0, 1] = g[0, 0]
    res = nf.clip_and_noise_layers(
        [(torch.from_numpy(a).to(require_cuda), torch.from_numpy(g).to(require_cuda), bias)],
        max_norm=C, noise_multiplier=0.0, nan_policy="zero")
    w, b = res.grads[0]
    _check_contribution([w.cpu().numpy()] + ([b.cpu().numpy()] if bias else []), res, C)


def _denormal_factor_worst(make, rounds=300):
    """The largest contribution / C over rows whose clip factor takes g among
    float32's denormals (f g ~ 2^-131 with a ~ 2^120 and C = 1e-3), where a
    product's rounding is up to 2^-20 relative, past the clip rule's margin."""
    rng = np.random.default_rng(0)
    worst = 0.0
    for _ in range(rounds):
        a = (rng.uniform(1, 2, (1, 1, 3)) * 2.0 ** 120).astype(np.float32)
        g = rng.uniform(1, 2, (1, 1, 2)).astype(np.float32)
        res = nf.clip_and_noise_linear(make(a), make(g), max_norm=1e-3, noise_multiplier=0.0,
                                       bias=False)
        # On a GPU the result is a CUDA tensor: read it back to the host.
        worst = max(worst, _exact_norm(_arrays.to_numpy(res.grad_weight)) / 1e-3)
    return worst


def test_denormal_scaled_operand_is_rebalanced():
    """The attack the rebalancing answers: without it such rows contributed up
    to 1.0000027 C on the device route (measured when this test was written)."""
    assert _denormal_factor_worst(lambda x: x) <= 1.0


@pytest.mark.gpu
def test_denormal_scaled_operand_is_rebalanced_on_the_device(require_cuda, monkeypatch):
    """The device route reads the rebalancing decision from the norms' sizes:
    the same rows stay within C, and, on the emulated device (IEEE denormals
    throughout; a GPU's GEMM may flush them to 0 instead), with the decision
    forced to "no" they exceed it (so the decision, not luck, keeps them in)."""
    import torch
    from conftest import emulated
    from ncdp_fast import _balance

    def make(x):
        return torch.from_numpy(x).to(require_cuda)

    assert _denormal_factor_worst(make) <= 1.0
    if emulated(require_cuda):
        monkeypatch.setattr(_balance, "layers_needing_balancing",
                            lambda factors, sizes, *a: np.zeros(sizes.shape[0], bool))
        assert _denormal_factor_worst(make, rounds=100) > 1.0


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


# ------------------------------------------------- reconstruction from artifacts

def _small_release(seed):
    from ncdp_fast.release import NeuroMixGDP
    rng = np.random.default_rng(0)
    X = rng.standard_normal((60, 5))
    y = np.arange(60) % 3
    g = NeuroMixGDP(epsilon=1.0, delta=1e-5, mixup_degree=8, num_samples=60, seed=seed)
    return X, y, g.release(X, y, num_classes=3)


def _reconstruct(rel, X, y, key):
    """The audit's attack: with the key, regenerate noise and groups and solve."""
    K, (T, d) = 3, rel.x.shape
    noise = nf.gaussian(T * (d + K), seed=key["seed"], offset=key["offset"],
                        dtype=np.float64).reshape(T, d + K)
    with pytest.warns(nf.NoiseReuseWarning):          # the attacker reuses the key
        groups = nf.mix(np.zeros_like(X), y, num_samples=T, mixup_degree=8, noise_std_x=0.0,
                        noise_std_y=0.0, num_classes=K, clip_x=1.0, seed=key["seed"],
                        offset=key["offset"], return_groups=True).groups
    M = np.zeros((T, X.shape[0]))
    for t, gr in enumerate(groups):
        M[t, gr] = 1.0 / 8
    clean = np.asarray(rel.x) - rel.noise_std_x * noise[:, :d]
    return np.linalg.lstsq(M, clean, rcond=None)[0]


def test_release_key_reconstructs_but_is_never_published(tmp_path):
    import pickle
    X, y, rel = _small_release(seed=987654321987)
    key = rel._noise_key
    # The attack works with the key (so this test can fail)...
    Xc = X * np.minimum(1.0, 1.0 / np.linalg.norm(X, axis=1, keepdims=True))
    assert np.abs(_reconstruct(rel, X, y, key) - Xc).max() < 1e-8
    # ... and nothing one publishes carries it.
    p = rel.save(tmp_path / "r.npz")
    blob = p.read_bytes() + pickle.dumps(rel)
    v = key["seed"]
    assert str(v).encode() not in blob and int(v).to_bytes(8, "little") not in blob
    from ncdp_fast.release import Released
    assert Released.load(p)._noise_key is None and pickle.loads(pickle.dumps(rel))._noise_key \
        is None
    with pytest.raises(ValueError, match="no noise key"):
        Released.load(p).save_audit_key(tmp_path / "k.json")
    rel.save_audit_key(tmp_path / "k.json")            # the explicit private opt-in
    assert str(key["seed"]).encode() in (tmp_path / "k.json").read_bytes()


def test_pickled_estimators_carry_no_key():
    import pickle
    from ncdp_fast import nc
    from ncdp_fast.train import NoisyGDClassifier, NoisySGDClassifier
    X = np.random.default_rng(1).standard_normal((40, 4))
    y = np.arange(40) % 2
    seed = 876543210123
    objs = [NoisyGDClassifier(rho=0.5, num_classes=2, seed=seed).fit(X, y),
            NoisySGDClassifier(epsilon=1.0, delta=1e-5, sample_rate=0.2, epochs=1,
                               num_classes=2, seed=nf.NoiseStream(seed)).fit(X, y),
            nc.Centering().fit_private(X, rho=0.5, clip=3.0, seed=seed),
            nc.PCAProjector(2).fit_private(X, rho=0.5, clip=3.0, seed=seed)]
    for obj in objs:
        blob = pickle.dumps(obj)
        assert str(seed).encode() not in blob and seed.to_bytes(8, "little") not in blob, obj
    with pytest.raises(TypeError, match="never pickled"):
        pickle.dumps(nf.NoiseStream(seed))


# ------------------------------------------------------- presence by shapes

def test_fitted_shapes_do_not_reveal_a_record():
    """One record of class 2 present or absent: every fitted array has the same
    shape (K is public and required)."""
    from ncdp_fast.train import NoisyGDClassifier, NoisySGDClassifier
    rng = np.random.default_rng(2)
    X = rng.standard_normal((31, 4))
    y = np.r_[np.arange(30) % 2, 2]
    for cls, kw in [(NoisyGDClassifier, dict(rho=1.0)),
                    (NoisySGDClassifier, dict(epsilon=1.0, delta=1e-5, sample_rate=0.3,
                                              epochs=1))]:
        with pytest.raises(ValueError, match="num_classes: required"):
            cls(**kw).fit(X, y)
        a = cls(num_classes=3, fit_intercept=True, **kw).fit(X, y)
        b = cls(num_classes=3, fit_intercept=True, **kw).fit(X[:30], y[:30])
        for name, v in vars(a).items():
            if hasattr(v, "shape"):
                assert np.shape(v) == np.shape(getattr(b, name)), name


# ------------------------------------------ noise shared across components

def test_one_pass_dpsgd_draws_fresh_noise_and_its_result_holds_no_key():
    """The fifth audit: dpsgd_linear_regression drew its noise from
    np.random.default_rng(seed), restarted at every call, and kept the seed
    (the OS key for seed=None) in its result.  Two calls with one seed on data
    sets differing in the last record differed by exactly the noiseless
    difference (the noise cancelled); one result gave its key away.  Now the
    noise is the stream's next range and the result holds offsets only."""
    import dataclasses
    import pickle
    from ncdp_fast.theory import dpsgd_linear_regression
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((40, 4)), rng.standard_normal(40)
    x2 = x.copy()
    x2[-1] *= -1.0                                   # a neighbour: the last record replaced
    kw = dict(clip=1.0, schedule="output", rho=0.5, lr0=0.5)
    a = dpsgd_linear_regression(x, y, seed=1234, **kw)
    b = dpsgd_linear_regression(x2, y, seed=1234, **kw)
    assert b.offset == a.next_offset > a.offset
    clean_a = dpsgd_linear_regression(x, y, seed=77, **dict(kw, rho=1e300)).theta
    clean_b = dpsgd_linear_regression(x2, y, seed=77, **dict(kw, rho=1e300)).theta
    noise_gap = (a.theta - b.theta) - (clean_a - clean_b)
    # The noise std on theta is 2 C sigma_{n-1} = 2 C eta / rho (output
    # perturbation): fresh noise leaves a gap of that order, reused noise 0.
    assert np.linalg.norm(noise_gap) > 0.1 * 2 * a.clip_norm * a.eta[-1] / 0.5
    for r in (a, dpsgd_linear_regression(x, y, **kw)):
        fields = dataclasses.asdict(r)
        assert "seed" not in fields and not hasattr(r, "seed")
    with pytest.warns(nf.NoiseReuseWarning):
        dpsgd_linear_regression(x, y, seed=1234, offset=a.offset, **kw)
    assert pickle.loads(pickle.dumps(a)).offset == a.offset


def test_random_features_seed_is_a_one_way_function_of_the_key():
    """The fifth audit: rf_seed_ (published with the fitted regressor) was
    NumPy's SeedSequence of (key, offset), whose mixing is invertible word by
    word: no promise that it hides the key.  Now SHA-256 of both."""
    import hashlib
    from ncdp_fast.theory import DPGDRegressor
    X, y = np.random.default_rng(1).standard_normal((20, 3)), np.zeros(20)
    r = DPGDRegressor(num_features=8, clip=1.0, lr=0.1, steps=1, sigma=1.0,
                      seed=nf.NoiseStream(5, 7)).fit(X, y)
    want = hashlib.sha256(b"ncdp_fast rf weights" + (5).to_bytes(8, "little")
                          + (7).to_bytes(8, "little")).digest()[:8]
    assert r.offset_ == 7 and r.rf_seed_ == int.from_bytes(want, "little")


def test_components_given_one_seed_draw_disjoint_noise():
    """Every noisy component handed the same explicit seed draws its own range:
    the audit found Centering and NoisyGD noise with correlation 1.0."""
    from ncdp_fast import nc
    from ncdp_fast.release import NeuroMixGDP
    from ncdp_fast.theory import DPGDRegressor
    from ncdp_fast.train import NoisyGDClassifier, NoisySGDClassifier
    S = 4242
    X = np.zeros((50, 6))
    y = np.arange(50) % 2
    ranges = []
    c = nc.Centering().fit_private(X + 1, rho=0.5, clip=3.0, seed=S)
    ranges.append((c.offset_, c.next_offset_))
    p = nc.PCAProjector(2).fit_private(X + 1, rho=0.5, clip=3.0, seed=S)
    ranges.append((p.offset_, p.next_offset_))
    for _ in range(2):                                  # a refit is a fresh range too
        f = NoisyGDClassifier(rho=0.5, num_classes=2, seed=S).fit(X, y)
        ranges.append((f.offset_, f.next_offset_))
    f = NoisySGDClassifier(epsilon=1.0, delta=1e-5, sample_rate=0.2, epochs=1, num_classes=2,
                           seed=S).fit(X, y)
    ranges.append((f.offset_, f.next_offset_))
    r = DPGDRegressor(features="raw", clip=1.0, lr=0.1, steps=2, sigma=1.0, seed=S).fit(X, y)
    ranges.append((r.offset_, r.next_offset_))
    key = NeuroMixGDP(epsilon=1.0, delta=1e-5, mixup_degree=4, num_samples=10, seed=S).release(
        X, y, num_classes=2)._noise_key
    ranges.append((key["offset"], key["offset"] + key["draws"]))
    res = nf.clip_and_noise(X, max_norm=1.0, noise_multiplier=1.0, seed=S)
    ranges.append((res.offset, res.next_offset))
    from ncdp_fast.theory import dpsgd_linear_regression
    for _ in range(2):
        lin = dpsgd_linear_regression(X, y.astype(float), clip=1.0, schedule="constant",
                                      rho=1.0, lr0=1.0, seed=S)
        ranges.append((lin.offset, lin.next_offset))
    ranges.sort()
    for (a0, a1), (b0, b1) in zip(ranges, ranges[1:]):
        assert a0 < a1 <= b0 < b1, ranges
    # Numerically: two NoisyGD fits on zero features are pure noise; with one seed
    # their weights used to be identical.  |r| < 4.5/sqrt(N): false alarm 7e-6.
    Z = np.zeros((20, 300))
    yz = np.arange(20) % 2
    a = NoisyGDClassifier(rho=0.5, num_classes=2, seed=S).fit(Z, yz).coef_.ravel()
    b = NoisyGDClassifier(rho=0.5, num_classes=2, seed=S).fit(Z, yz).coef_.ravel()
    assert abs(np.corrcoef(a, b)[0, 1]) < 4.5 / np.sqrt(a.size)


def test_optimizer_checkpoint_resumes_the_stream():
    torch = pytest.importorskip("torch")
    from ncdp_fast.torch import FusedDPOptimizer
    p = torch.nn.Parameter(torch.zeros(5))
    opt = FusedDPOptimizer(torch.optim.SGD([p], lr=1.0), noise_multiplier=1.0,
                           max_grad_norm=1.0, expected_batch_size=None, loss_reduction="sum")
    for _ in range(3):
        p.grad_sample = torch.zeros(2, 5)
        opt.step()
    state = opt.state_dict()
    assert state["ncdp_noise"]["offset"] == 15
    opt2 = FusedDPOptimizer(torch.optim.SGD([p], lr=1.0), noise_multiplier=1.0,
                            max_grad_norm=1.0, expected_batch_size=None, loss_reduction="sum")
    opt2.load_state_dict(state)
    assert (opt2.seed, opt2.offset, opt2.steps) == (opt.seed, 15, 3)


# --------------------------------------------------------- tampered files

def _entries(p):
    with np.load(p) as z:
        return {k: z[k] for k in z.files}


def _rehash(tmp_path, entries, meta=None, name="t.npz"):
    """What an attacker does: edit, then recompute the unkeyed checksum."""
    import hashlib
    from ncdp_fast.release.released import _digest
    if meta is not None:
        entries["metadata"] = np.frombuffer(meta.encode(), dtype=np.uint8)
    meta_s = entries["metadata"].tobytes().decode()
    entries["sha256"] = np.frombuffer(_digest(meta_s, entries["x"], entries["y"]).encode(),
                                      dtype=np.uint8)
    np.savez(tmp_path / name, **entries)
    return tmp_path / name


def test_tampered_release_files_are_refused(tmp_path):
    import json
    from ncdp_fast.release import Released, ReleaseFileError
    X, y, rel = _small_release(seed=None)
    key = b"a publisher's secret key of 32 b"
    p = rel.save(tmp_path / "r.npz", key=key)
    assert Released.load(p, key=key).report == rel.report
    meta = json.loads(_entries(p)["metadata"].tobytes().decode())
    # A smaller epsilon claimed, checksum recomputed: the report is recomputed.
    m = dict(meta, report=dict(meta["report"], epsilon_pld=0.01))
    with pytest.raises(ReleaseFileError, match="stated epsilon_pld"):
        Released.load(_rehash(tmp_path, _entries(p), json.dumps(m, sort_keys=True)))
    # Rows cut away, checksum recomputed.
    e = _entries(p)
    e["x"] = e["x"][:5]
    with pytest.raises(ReleaseFileError, match="do not match the metadata"):
        Released.load(_rehash(tmp_path, e))
    # Missing or extra report / metadata fields.
    for m in (dict(meta, report={k: v for k, v in meta["report"].items() if k != "lam"}),
              dict(meta, report=dict(meta["report"], bonus=1)),
              {k: v for k, v in meta.items() if k != "sigma_x"}, dict(meta, seed="1")):
        with pytest.raises(ReleaseFileError, match="fields"):
            Released.load(_rehash(tmp_path, _entries(p), json.dumps(m, sort_keys=True)))
    with pytest.raises(ReleaseFileError, match="not JSON"):
        Released.load(_rehash(tmp_path, _entries(p), "{not json"))
    # Any edit, even with the checksum recomputed, breaks the HMAC.
    e = _entries(p)
    e["y"] = e["y"] + 1e-3
    with pytest.raises(ReleaseFileError, match="HMAC mismatch"):
        Released.load(_rehash(tmp_path, e), key=key)
    check_key_refusals(rel.save, Released.load, p, key, unsigned_path=tmp_path / "u.npz",
                       short_path=tmp_path / "s.npz", short_key="short")


# --------------------------------------------------- errors that name the argument

def test_audit_errors_are_clear_and_early():
    torch = pytest.importorskip("torch")
    from ncdp_fast.release import hs_epsilon
    from ncdp_fast.torch import FusedDPOptimizer, GhostClipper, PoissonBatchSampler
    with pytest.raises(TypeError, match="backprops and activations must be on the same"):
        nf.clip_and_noise_linear(np.zeros((2, 3)), torch.zeros(2, 2, dtype=torch.float64),
                                 max_norm=1.0, noise_multiplier=1.0)
    with pytest.raises(TypeError, match="grads: expected float32 or float64, got dtype "
                                        "torch.bfloat16"):
        nf.clip_and_noise(torch.zeros(2, 3, dtype=torch.bfloat16), max_norm=1.0,
                          noise_multiplier=1.0)
    with pytest.raises(ValueError, match="noise_multiplier: noise std"):
        nf.clip_and_noise(np.zeros((2, 3)), max_norm=1.0, noise_multiplier=1e308)
    with pytest.raises(ValueError, match=r"x: expected shape \(n, d\) with n >= 1"):
        nf.ntk_gram(np.zeros((0, 3)), [np.ones((4, 3)), np.ones((1, 4))])
    for cr in ([0.0], [2.0]):
        with pytest.raises(ValueError, match="class_rates"):
            hs_epsilon(1.0, mixup_degree=2, n=100, num_samples=10, class_rates=cr, delta=1e-5)
    with pytest.raises(ValueError, match="steps"):
        PoissonBatchSampler(10, sample_rate=0.1, steps=-1)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for kw, match in [(dict(max_grad_norm=-1.0), "max_grad_norm"),
                      (dict(noise_multiplier=-1.0), "noise_multiplier"),
                      (dict(expected_batch_size=-3), "expected_batch_size"),
                      (dict(nan_policy="x"), "nan_policy")]:
        args = dict(max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=8)
        args.update(kw)
        with pytest.raises(ValueError, match=match):
            GhostClipper(model, **args)
        with pytest.raises(ValueError, match=match):
            FusedDPOptimizer(opt, **args)
    # An inf row is dropped (non-finite), not also counted as clipped.
    g = np.array([[np.inf, 0.0], [3.0, 4.0]])
    res = nf.clip_and_noise(g, max_norm=1.0, noise_multiplier=0.0, nan_policy="zero")
    assert (res.num_nonfinite, res.num_clipped) == (1, 1)
    # Two backward passes through one recorded forward are refused, not reduced to one.
    clipper = GhostClipper(model, max_grad_norm=1.0, noise_multiplier=0.0,
                           expected_batch_size=4)
    out = model(torch.randn(4, 3)).sum()
    out.backward(retain_graph=True)
    # Refused inside the second backward (only the first was read by the loss
    # check); with the check off, at the step.
    with pytest.raises(RuntimeError, match="a second backward after the one the loss check read"):
        out.backward()
    clipper.remove()
    clipper = GhostClipper(model, max_grad_norm=1.0, noise_multiplier=0.0,
                           expected_batch_size=4, check_loss=False)
    out = model(torch.randn(4, 3)).sum()
    out.backward(retain_graph=True)
    out.backward()
    with pytest.raises(RuntimeError, match="twice through the same recorded forward"):
        clipper.privatize_()


def test_tiny_sampling_rates_stay_in_bounds():
    """Audit item 6: a gap floor(log u / log1p(-q)) over 2^63 wrapped to INT64_MIN
    (index -9223372036854775808 at q = 1e-19; a read of features[INT64_MIN] in mix).
    Gaps are capped at 2^53 as in the CUDA sampler; such rates select nothing."""
    for q in (1e-19, 1e-300, 5e-324):
        plan = nf.poisson_batches(10, sample_rate=q, steps=50)
        assert plan.indices.size == 0 or (plan.indices.min() >= 0 and plan.indices.max() < 10)
        assert plan.indices.size == 0
    from ncdp_fast import reference as R
    for m in (1e-300, 1e-17):
        r = nf.mix(np.ones((10, 3)), np.arange(10) % 2, num_samples=40, mixup_degree=m,
                   noise_std_x=0.0, noise_std_y=0.0, num_classes=2, seed=5 + (m > 1e-100),
                   offset=0, return_groups=True)
        assert int(np.asarray(r.counts).sum()) == 0
        ref = R.sample_groups(np.arange(10) % 2, num_samples=40, mixup_degree=m,
                              seed=5 + (m > 1e-100),
                              offset=0, num_classes=2)
        assert all(len(g) == 0 for g in ref)


def test_no_noise_key_in_the_dict_of_a_result_or_a_release():
    """Issue 35, item 6 (attack): vars() of ClipResult and Released held the key
    (_seed, _noise_key), so a logger of __dict__ wrote it. Now the key is kept
    off the instance: vars(), a JSON dump of it and pickles carry no key, while
    .seed and the audit copy still work."""
    import json
    import pickle
    rng = np.random.default_rng(5)
    res = nf.clip_and_noise(rng.standard_normal((4, 3)), max_norm=1.0, noise_multiplier=1.0)
    key = res.seed
    assert isinstance(key, int)
    assert not any(isinstance(v, int) and v == key for v in vars(res).values())
    assert str(key) not in json.dumps({k: str(v) for k, v in vars(res).items()})
    assert pickle.loads(pickle.dumps(res)).seed is None
    X, y, rel = _small_release(seed=987654321987)
    assert rel._noise_key is not None
    assert not any(isinstance(v, dict) and "seed" in v for v in vars(rel).values())
    assert str(rel._noise_key["seed"]) not in repr(vars(rel))
    assert pickle.loads(pickle.dumps(rel))._noise_key is None


def test_unnoised_values_of_the_data_stay_off_publishable_objects():
    """The sixth audit: fitted estimators, DPSGDResult and the clip ops' results
    (each documented as publishable) carried exact, noise-free counts of the
    private data -- num_clipped_ per step, clip_fraction, contractive, the
    excess risk of unnoised iterates, per-sample norms.  A record scaled x400
    gave num_clipped_ [2, 3, 2] with it and [0, 0, 0] without, through a
    pickle: its presence at any epsilon.  Now they are read on the object in
    the fitting process only: no pickle, copy, vars() or asdict carries them."""
    import copy
    import dataclasses
    import pickle
    from ncdp_fast.theory import DPGDRegressor, dpsgd_linear_regression
    from ncdp_fast.train import NoisyGDClassifier, NoisySGDClassifier
    rng = np.random.default_rng(3)
    X = 0.01 * rng.standard_normal((30, 4))
    X[0] *= 400.0                                   # the record whose presence is at stake
    y = np.arange(30) % 2
    fits = {
        "num_clipped_": [NoisyGDClassifier(rho=0.5, num_classes=2, steps=3).fit(X, y),
                         NoisySGDClassifier(epsilon=1.0, delta=1e-5, sample_rate=1.0, epochs=2,
                                            num_classes=2).fit(X, y),
                         DPGDRegressor(features="raw", clip=0.01, lr=0.5, steps=3,
                                       sigma=1.0).fit(X, y.astype(float))],
    }
    reg = dpsgd_linear_regression(X, y.astype(float), clip=0.01, schedule="output", rho=1.0,
                                  lr0=0.5, theta_star=np.zeros(4))
    res = nf.clip_and_noise(X, max_norm=0.05, noise_multiplier=1.0)
    private = {"num_clipped_": fits["num_clipped_"],
               "clip_fraction": [reg], "contractive": [reg], "excess_risk": [reg],
               "norms": [res], "num_clipped": [res], "num_nonfinite": [res]}
    for name, objs in private.items():
        for obj in objs:
            value = getattr(obj, name)
            assert value is not None and np.size(value) > 0, (name, obj)   # read in process
            assert name not in vars(obj), (name, obj)
            for out in (pickle.loads(pickle.dumps(obj)), copy.copy(obj), copy.deepcopy(obj)):
                assert getattr(out, name) is None, (name, type(obj).__name__)
            if dataclasses.is_dataclass(obj):
                assert name not in dataclasses.asdict(obj) and name not in repr(obj)
    assert np.sum(fits["num_clipped_"][0].num_clipped_) >= 1      # the record was clipped
    assert reg.clip_fraction > 0 and res.num_clipped >= 1
