"""Op 2 (Poisson / hierarchical subsampling with averaging) and batch plans:
exactness against ncdp_fast.reference, sampling statistics, sharding, memory, bad input.

Every statistical assertion uses a fixed seed and has a stated false-alarm rate:
the probability that a correct sampler fails it (z-tests at |z| < 4.89 and
chi-square tests at the 1e-6 quantiles are two-sided 1e-6)."""
import subprocess
import sys

import numpy as np
import pytest
from scipy import stats

import ncdp_fast as nf
from ncdp_fast import reference as R

Z6 = 4.89  # two-sided 1e-6 normal quantile


def _data(n=300, d=7, K=4, seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, d)).astype(dtype) * 2, rng.integers(0, K, n), K


@pytest.mark.parametrize("class_rate", [None, 0.5, [0.3, 0.6, 0.9, 1.0]])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("clip_x", [None, 1.5])
def test_mix_matches_reference(class_rate, dtype, clip_x):
    X, lab, K = _data(dtype=dtype)
    kw = dict(num_samples=37, mixup_degree=10, class_rate=class_rate, seed=3, offset=11)
    res = nf.mix(X, lab, noise_std_x=0.1, noise_std_y=0.2, num_classes=K, clip_x=clip_x,
                 return_groups=True, **kw)
    groups = R.sample_groups(lab, num_classes=K, row_stride=X.shape[1] + K, **kw)
    assert [list(g) for g in res.groups] == groups
    assert res.counts.tolist() == [len(g) for g in groups]
    rx, ry = R.mix_from_groups(X, np.eye(K)[lab], groups, mixup_degree=10, noise_std_x=0.1,
                               noise_std_y=0.2, seed=3, offset=11, clip_x=clip_x)
    assert res.x.dtype == dtype and res.x.shape == (37, X.shape[1]) and res.y.shape == (37, K)
    # Each output is a sum of |I_t| <= 40 terms (clip factors rounded to dtype),
    # scaled and added to noise: gamma_{c+3} relative to the absolute terms.
    u = np.finfo(dtype).eps / 2
    for got, ref, G, full in ((res.x, rx, np.abs(X), X.shape[1]), (res.y, ry, np.ones((300, K)), K)):
        absterms = np.array([G[g].sum(axis=0) / 10 if len(g) else np.zeros(full) for g in groups])
        bound = (max(res.counts.max(), 1) + 3) * u * (absterms + np.abs(ref)) + 1e-300
        assert np.all(np.abs(got - ref) <= bound)
    assert res.draws == 37 * (X.shape[1] + K) and res.next_offset == 11 + res.draws
    x, y, counts = res  # unpacks like a tuple
    assert x is res.x


def test_soft_labels_equal_one_hot():
    X, lab, K = _data()
    a = nf.mix(X, lab, num_samples=20, mixup_degree=8, noise_std_x=0.3, noise_std_y=0.3,
               num_classes=K, seed=5)
    with pytest.warns(nf.NoiseReuseWarning):     # the same noise on purpose
        b = nf.mix(X, np.eye(K)[lab], num_samples=20, mixup_degree=8, noise_std_x=0.3,
                   noise_std_y=0.3, seed=5, offset=0)
    np.testing.assert_array_equal(a.counts, b.counts)
    np.testing.assert_allclose(a.x, b.x, rtol=0, atol=1e-14)
    np.testing.assert_allclose(a.y, b.y, rtol=0, atol=1e-14)


def test_row_range_alone_equals_full_run():
    X, lab, K = _data()
    stride = X.shape[1] + K
    for cr in (None, 0.5):
        full = nf.mix(X, lab, num_samples=30, mixup_degree=12, noise_std_x=0.5, noise_std_y=0.5,
                      num_classes=K, class_rate=cr, seed=9 + (cr is None), offset=100)
        with pytest.warns(nf.NoiseReuseWarning):     # rows 13..22 again, on purpose
            part = nf.mix(X, lab, num_samples=10, mixup_degree=12, noise_std_x=0.5,
                          noise_std_y=0.5, num_classes=K, class_rate=cr, seed=9 + (cr is None),
                          offset=100 + 13 * stride)
        np.testing.assert_array_equal(part.x, full.x[13:23])
        np.testing.assert_array_equal(part.y, full.y[13:23])
        np.testing.assert_array_equal(part.counts, full.counts[13:23])


def test_empty_group_is_pure_noise_and_noise_std():
    # m tiny: most groups are empty; x = noise exactly for them.  Variance test on
    # all rows with zero features: chi-square, false alarms 1e-6.
    n, d, K, T = 50, 40, 3, 2000
    X = np.zeros((n, d))
    lab = np.arange(n) % K
    res = nf.mix(X, lab, num_samples=T, mixup_degree=0.01, noise_std_x=0.7, noise_std_y=0.2,
                 num_classes=K, seed=21)
    empty = res.counts == 0
    assert empty.mean() > 0.9
    noise = nf.gaussian(T * (d + K), seed=21, dtype=np.float64).reshape(T, d + K)
    np.testing.assert_allclose(res.x[empty], 0.7 * noise[empty, :d], rtol=1e-15, atol=0)
    np.testing.assert_allclose(res.y[empty], 0.2 * noise[empty, d:], rtol=1e-15, atol=0)
    N = res.x.size
    lo, hi = stats.chi2.ppf([0.5e-6, 1 - 0.5e-6], N - 1) / (N - 1)
    assert lo < res.x.var(ddof=1) / 0.49 < hi


# ----------------------------------------------------------- sampling statistics

def _membership_matrix(plan, n):
    M = np.zeros((len(plan), n), dtype=bool)
    for t, g in enumerate(plan):
        M[t, g] = True
    return M


def test_poisson_inclusion_rates_and_independence():
    n, T, q = 400, 3000, 0.05
    plan = nf.poisson_batches(n, sample_rate=q, steps=T, seed=1234)
    M = _membership_matrix(plan, n)
    N = M.size
    # Per-pair inclusion frequency q.
    assert abs(M.sum() - N * q) < Z6 * np.sqrt(N * q * (1 - q))
    # Per-example counts ~ Binomial(T, q) independently: dispersion chi-square.
    c = M.sum(axis=0)
    chi = ((c - T * q) ** 2 / (T * q * (1 - q))).sum()
    assert stats.chi2.sf(chi, n) > 1e-6 and stats.chi2.cdf(chi, n) > 1e-6
    # Pairs of examples within a row, and pairs of rows for one example: q^2.
    pair_examples = (M[:, 0::2] & M[:, 1::2]).sum()
    Np = T * (n // 2)
    assert abs(pair_examples - Np * q * q) < Z6 * np.sqrt(Np * q * q * (1 - q * q))
    pair_rows = (M[0::2] & M[1::2]).sum()
    Nr = (T // 2) * n
    assert abs(pair_rows - Nr * q * q) < Z6 * np.sqrt(Nr * q * q * (1 - q * q))


def test_poisson_batch_sizes_are_binomial():
    n, T, q = 200, 20000, 0.04
    sizes = nf.poisson_batches(n, sample_rate=q, steps=T, seed=77).sizes()
    k = np.arange(n + 1)
    expected = T * stats.binom.pmf(k, n, q)
    # Pool the tails so every bin expects >= 5.
    lo, hi = k[expected >= 5][[0, -1]]
    obs = np.bincount(np.clip(sizes, lo, hi), minlength=hi + 1)[lo:hi + 1]
    exp = expected[lo:hi + 1].copy()
    exp[0] += expected[:lo].sum()
    exp[-1] += expected[hi + 1:].sum()
    assert stats.chisquare(obs, exp).pvalue > 1e-6


def test_hierarchical_class_and_within_class_rates():
    n, K, m, T = 600, 3, 30.0, 6000
    lab = np.repeat(np.arange(K), [100, 200, 300])
    p = np.array([0.3, 0.5, 0.8])
    res = nf.mix(np.zeros((n, 1)), lab, num_samples=T, mixup_degree=m, noise_std_x=0,
                 noise_std_y=0, num_classes=K, class_rate=p, seed=5, return_groups=True)
    M = _membership_matrix(res.groups, n)
    q = m / (n * p)
    for k in range(K):
        Mk = M[:, lab == k]
        nk = Mk.shape[1]
        present = Mk.any(axis=1)
        # A class appears iff selected and at least one member drawn.
        pr = p[k] * (1 - (1 - q[k]) ** nk)
        assert abs(present.sum() - T * pr) < Z6 * np.sqrt(T * pr * (1 - pr))
        # Given it appears, its count is Binomial(nk, q_k) conditioned on >= 1.
        cnt = Mk[present].sum(axis=1)
        mean = nk * q[k] / (1 - (1 - q[k]) ** nk)
        var = nk * q[k] * (1 - q[k]) / (1 - (1 - q[k]) ** nk) - mean ** 2 * (1 - q[k]) ** nk
        assert abs(cnt.mean() - mean) < Z6 * np.sqrt(var / len(cnt))
        # Marginal inclusion of each member: p_k q_k = m / n.
        N = Mk.size
        assert abs(Mk.sum() - N * m / n) < Z6 * np.sqrt(N * m / n * (1 - m / n))
    # The y rows are the class proportions over m (noise 0).
    np.testing.assert_allclose(res.y.sum(axis=1), res.counts / m, rtol=1e-12)


def test_batch_plan_interface_and_stream_advance():
    plan = nf.poisson_batches(50, sample_rate=0.1, steps=7, seed=3, offset=5)
    assert len(plan) == 7 and plan.next_offset == 12
    assert [list(b) for b in plan] == [list(plan[i]) for i in range(7)]
    assert list(plan[-1]) == list(plan[6]) and len(plan[1:3]) == 2
    with pytest.raises(IndexError):
        plan[7]
    nxt = nf.poisson_batches(50, sample_rate=0.1, steps=7, seed=3, offset=plan.next_offset)
    ref = R.sample_groups(np.zeros(50, int), num_samples=14, mixup_degree=5, seed=3, offset=5)
    assert [list(b) for b in plan] + [list(b) for b in nxt] == ref
    assert all(np.all(np.diff(b) > 0) for b in plan)
    empty = nf.poisson_batches(5, sample_rate=1e-3, steps=50, seed=1)
    assert (empty.sizes() == 0).sum() > 40        # empty batches stay in the plan


def test_numpy_labels_next_to_torch_cpu_features():
    # The mix the dispatch allows (torch CPU features, NumPy class ids) runs and
    # equals the all-NumPy call; it used to fail reading the labels as a tensor.
    torch = pytest.importorskip("torch")
    X, lab, K = _data(n=40, d=3, K=3)
    kw = dict(num_samples=5, mixup_degree=6, noise_std_x=0.1, noise_std_y=0.1, num_classes=K,
              seed=2)
    got = nf.mix(torch.from_numpy(X), lab, offset=0, **kw)
    with pytest.warns(nf.NoiseReuseWarning):      # the same draws again, on purpose
        want = nf.mix(X, lab, offset=0, **kw)
    assert isinstance(got.x, torch.Tensor)
    np.testing.assert_array_equal(got.x.numpy(), want.x)
    np.testing.assert_array_equal(got.y.numpy(), want.y)


def test_torch_sampler_and_empty_collate():
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader, TensorDataset

    from ncdp_fast.torch import PoissonBatchSampler, collate_with_empty
    ds = TensorDataset(torch.randn(30, 3), torch.arange(30))
    sampler = PoissonBatchSampler(30, sample_rate=0.02, steps=40, seed=8)
    loader = DataLoader(ds, batch_sampler=sampler, collate_fn=collate_with_empty(ds))
    sizes = []
    for xb, yb in loader:
        assert xb.shape[1:] == (3,) and xb.shape[0] == yb.shape[0] and yb.dtype == torch.int64
        sizes.append(xb.shape[0])
    assert len(sizes) == 40 and 0 in sizes
    with pytest.warns(nf.NoiseReuseWarning):     # the sampler's first epoch, on purpose
        first = list(nf.poisson_batches(30, sample_rate=0.02, steps=40, seed=8, offset=0))
    assert [len(b) for b in first] == sizes
    second = [len(b) for b in sampler]              # the next epoch: fresh draws
    assert sampler.offset == 80 and second != sizes


def test_memory_far_below_a_dense_mask():
    # T = n = 200000, d = 16: a T x n byte mask would be 40 GB.  Run in a fresh
    # process and bound the peak resident growth.
    code = (
        "import resource, numpy as np, ncdp_fast as nf\n"
        "n = 200_000\n"
        "X = np.random.default_rng(0).standard_normal((n, 16)).astype(np.float32)\n"
        "lab = np.arange(n) % 10\n"
        "nf.mix(X[:100], lab[:100], num_samples=10, mixup_degree=5, noise_std_x=1, "
        "noise_std_y=1, num_classes=10, seed=1)\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "r = nf.mix(X, lab, num_samples=n, mixup_degree=64, noise_std_x=1, noise_std_y=1, "
        "num_classes=10, seed=1)\n"
        "after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "print((after - before) * 1024, int(r.counts.sum()))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    extra, total = map(int, out.stdout.split())
    # Outputs are 200000 x 26 float32 (21 MB); allow 10x that, still 200x below the mask.
    assert extra < 200e6, f"peak extra memory {extra / 1e6:.0f} MB"
    assert abs(total - 64 * 200_000) < Z6 * np.sqrt(64 * 200_000)


# ------------------------------------------------------------------- bad input

@pytest.mark.parametrize("kwargs,err,match", [
    (dict(mixup_degree=301), ValueError, "mixup_degree"),
    (dict(mixup_degree=0), ValueError, "mixup_degree"),
    (dict(class_rate=0.01), ValueError, r"q_k = m / \(n p_k\)"),
    (dict(class_rate=[0.5, 0.5]), ValueError, "class_rate"),
    (dict(class_rate=1.5), ValueError, "class_rate"),
    # '1' and True were taken as rate 1.0, 'abc' raised NumPy's conversion error.
    (dict(class_rate="1"), TypeError, "class_rate: expected a float or an array of floats, "
                                      "got str"),
    (dict(class_rate=True), TypeError, "class_rate: expected a float or an array of floats, "
                                       "got bool"),
    (dict(class_rate=["0.5", "abc"]), TypeError, "class_rate: expected a float or an array"),
    (dict(num_classes=None), ValueError, "num_classes"),
    (dict(num_classes=2), ValueError, "labels: class ids"),
    (dict(noise_std_x=-1.0), ValueError, "noise_std_x"),
    (dict(noise_std_y=float("nan")), ValueError, "noise_std_y"),
    (dict(num_samples=0), ValueError, "num_samples"),
    (dict(clip_x=0.0), ValueError, "clip_x"),
    (dict(seed=-1), ValueError, "seed"),
])
def test_mix_bad_arguments(kwargs, err, match):
    X, lab, K = _data()
    base = dict(num_samples=5, mixup_degree=10, noise_std_x=1.0, noise_std_y=1.0, num_classes=K)
    base.update(kwargs)
    with pytest.raises(err, match=match):
        nf.mix(X, lab, **base)


def test_mix_bad_arrays():
    X, lab, K = _data()
    kw = dict(num_samples=5, mixup_degree=10, noise_std_x=1.0, noise_std_y=1.0, num_classes=K)
    bad = X.copy()
    bad[3, 2] = np.inf
    with pytest.raises(ValueError, match="features: expected finite values, got NaN or Inf"):
        nf.mix(bad, lab, **kw)
    with pytest.raises(ValueError, match="length 299"):
        nf.mix(X, lab[:-1], **kw)
    with pytest.raises(TypeError, match="integer class ids"):
        nf.mix(X, lab.astype(float), **kw)
    with pytest.raises(ValueError, match="n = 0"):
        nf.mix(X[:0], lab[:0], **kw)
    with pytest.raises(TypeError, match="features: expected float32 or float64"):
        nf.mix(X.astype(np.int32), lab, **kw)
    with pytest.raises(ValueError, match="soft labels"):
        nf.mix(X, np.eye(K)[lab], class_rate=0.5, **{k: v for k, v in kw.items()
                                                    if k != "num_classes"})


@pytest.mark.parametrize("kwargs,err,match", [
    (dict(n=0, sample_rate=0.1, steps=3), ValueError, "n:"),
    (dict(n=10, sample_rate=0.0, steps=3), ValueError, "sample_rate"),
    (dict(n=10, sample_rate=1.2, steps=3), ValueError, "sample_rate"),
    (dict(n=10, sample_rate=0.1, steps=-1), ValueError, "steps"),
    (dict(n=10.5, sample_rate=0.1, steps=3), TypeError, "n:"),
])
def test_poisson_batches_bad_input(kwargs, err, match):
    n = kwargs.pop("n")
    with pytest.raises(err, match=match):
        nf.poisson_batches(n, **kwargs)
