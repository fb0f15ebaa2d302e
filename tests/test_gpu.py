"""CUDA kernels against ncdp_fast.reference and against the CPU backend (marked gpu;
skipped where torch sees no GPU or _C was built without CUDA)."""
import numpy as np
import pytest

import ncdp_fast as nf
from ncdp_fast import reference as R

from conftest import assert_within_sum_bound
from test_clip import DENSE_SHAPES, LINEAR_SHAPES, _linear_inputs, _rows

pytestmark = pytest.mark.gpu

DTYPES = [np.float32, np.float64]
# Larger than one L2 chunk / many slabs / many GEMM tiles on an H100, with odd sizes.
BIG_DENSE = [(300, 4097), (2049, 1031)]


def _cuda(x, dev):
    import torch
    return torch.from_numpy(np.ascontiguousarray(x)).to(dev)


@pytest.mark.parametrize("shape", DENSE_SHAPES + BIG_DENSE)
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_dense_matches_reference(require_cuda, shape, dtype):
    g = _rows(np.random.default_rng(sum(shape)), shape, dtype)
    kw = dict(max_norm=1.5, noise_multiplier=0.7, seed=11, offset=5, reduction="mean",
              expected_batch_size=3.0)
    res = nf.clip_and_noise(_cuda(g, require_cuda), **kw)
    assert res.grad.is_cuda and res.norms.is_cuda
    ref, ref_norms = R.clip_and_noise(g, **kw)
    np.testing.assert_allclose(res.norms.cpu().numpy(), ref_norms, rtol=4 * shape[1] * 1.2e-16)
    factors, _ = R.clip_factors(ref_norms ** 2, 1.5)
    noise = 1.05 * np.abs(R.gaussian(shape[1], seed=11, offset=5, dtype=np.float64))
    terms = (np.abs(factors[:, None] * g.astype(np.float64)).sum(axis=0) + noise) / 3.0
    # The CUDA sum is split into chunks and slabs; recursive summation of at most
    # B terms bounds any such order.
    assert_within_sum_bound(res.grad.cpu().numpy(), ref, terms, shape[0] + 3, dtype, "cuda dense")


@pytest.mark.parametrize("shape", LINEAR_SHAPES + [(70, 33, 65, 17), (513, None, 129, 10)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
def test_cuda_linear_matches_reference(require_cuda, shape, dtype, bias):
    a, g = _linear_inputs(shape, dtype)
    kw = dict(max_norm=2.0, noise_multiplier=0.3, bias=bias, seed=2, offset=9)
    res = nf.clip_and_noise_linear(_cuda(a, require_cuda), _cuda(g, require_cuda), **kw)
    gw, gb, norms = R.clip_and_noise_linear(a, g, **kw)
    np.testing.assert_allclose(res.norms.cpu().numpy(), norms, rtol=1e-10 if dtype == np.float64
                               else 1e-5)
    B, T, d, K = shape
    T = 1 if T is None else T
    flat = R.per_sample_linear_grads(a, g, bias=bias)
    factors, _ = R.clip_factors(norms ** 2, 2.0)
    noise = 0.6 * np.abs(R.gaussian(K * d + K, seed=2, offset=9, dtype=np.float64))
    terms = np.abs(factors[:, None] * flat).sum(axis=0) + noise[:flat.shape[1]]
    assert_within_sum_bound(res.grad_weight.cpu().numpy().ravel(), gw.ravel(), terms[:K * d],
                            B * T + 3, dtype, "cuda weight")
    if bias:
        assert_within_sum_bound(res.grad_bias.cpu().numpy(), gb, terms[K * d:], B * T + 3, dtype,
                                "cuda bias")


@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_layers_and_nonfinite(require_cuda, dtype):
    rng = np.random.default_rng(3)
    dense = rng.standard_normal((40, 3, 7)).astype(dtype)
    a, g = _linear_inputs((40, 6, 9, 5), dtype)
    dense[4, 1, 2] = np.nan
    a[7, 2, 3] = np.inf
    layers = [_cuda(dense, require_cuda), (_cuda(a, require_cuda), _cuda(g, require_cuda))]
    with pytest.raises(ValueError, match=r"rows \[4, 7\]"):
        nf.clip_and_noise_layers(layers, max_norm=1.0, noise_multiplier=0.5, seed=1)
    res = nf.clip_and_noise_layers(layers, max_norm=1.0, noise_multiplier=0.5, seed=1,
                                   nan_policy="zero")
    cpu = nf.clip_and_noise_layers([dense, (a, g)], max_norm=1.0, noise_multiplier=0.5, seed=1,
                                   nan_policy="zero")
    assert res.num_nonfinite == cpu.num_nonfinite == 2
    tol = 1e-4 if dtype == np.float32 else 1e-10
    np.testing.assert_allclose(res.grads[0].cpu().numpy(), cpu.grads[0], rtol=tol, atol=tol)
    np.testing.assert_allclose(res.grads[1][0].cpu().numpy(), cpu.grads[1][0], rtol=tol, atol=tol)


def test_cuda_same_seed_offset_bitwise_reproducible(require_cuda):
    g = _cuda(np.random.default_rng(0).standard_normal((1000, 3001)).astype(np.float32),
              require_cuda)
    r1 = nf.clip_and_noise(g, max_norm=1.0, noise_multiplier=1.0, seed=9, offset=17).grad
    r2 = nf.clip_and_noise(g, max_norm=1.0, noise_multiplier=1.0, seed=9, offset=17).grad
    assert bool((r1 == r2).all())


def test_cuda_noise_std(require_cuda):
    import torch
    from scipy import stats
    p = 1_000_003
    out = nf.clip_and_noise(torch.zeros(2, p, device=require_cuda), max_norm=0.5,
                            noise_multiplier=2.0, seed=4).grad.double().cpu().numpy()
    lo, hi = stats.chi2.ppf([0.5e-6, 1 - 0.5e-6], p - 1) / (p - 1)  # false alarms 1e-6
    assert lo < out.var(ddof=1) / 1.0 < hi


def test_cuda_ghost_clipper_matches_cpu(require_cuda):
    import torch
    from torch import nn

    from ncdp_fast.torch import GhostClipper
    x = torch.randn(64, 5, 12, dtype=torch.float64)
    y = torch.randint(0, 4, (64,))
    grads = []
    for dev in ("cpu", require_cuda):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(12, 9), nn.Tanh(), nn.Flatten(), nn.Linear(45, 4)).double()
        model = model.to(dev)
        clipper = GhostClipper(model, max_grad_norm=1.0, noise_multiplier=0.5,
                               expected_batch_size=64, seed=3)
        nn.functional.cross_entropy(model(x.to(dev)), y.to(dev)).backward()
        clipper.privatize_()
        grads.append(torch.cat([p.grad.reshape(-1).cpu() for p in model.parameters()]))
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-9, atol=1e-12)


def test_cuda_fused_optimizer_matches_opacus(require_cuda):
    import torch
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer
    from torch import nn

    from ncdp_fast.torch import FusedDPOptimizer
    x = (torch.randn(32, 20, dtype=torch.float64) * 3).to(require_cuda)
    y = torch.randint(0, 5, (32,)).to(require_cuda)
    out = []
    for cls in (DPOptimizer, FusedDPOptimizer):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(20, 17), nn.Tanh(), nn.Linear(17, 5)).double()
        gsm = GradSampleModule(model.to(require_cuda))
        kw = dict(noise_multiplier=0.0, max_grad_norm=1.0, expected_batch_size=32)
        opt = cls(torch.optim.SGD(gsm.parameters(), lr=0.1), **kw)
        nn.functional.cross_entropy(gsm(x), y).backward()
        opt.pre_step() if cls is DPOptimizer else opt.privatize_()
        out.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    assert float((out[0] - out[1]).norm() / out[0].norm()) < 1e-6


def test_cuda_rejects_mixed_devices(require_cuda):
    import torch
    with pytest.raises(ValueError, match="same device"):
        nf.clip_and_noise_linear(torch.ones(3, 4, device=require_cuda), torch.ones(3, 2),
                                 max_norm=1.0, noise_multiplier=1.0, seed=0)


# ------------------------------------------------------------------ kernel 2

@pytest.mark.parametrize("class_rate", [None, 0.5])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("soft", [False, True])
def test_cuda_mix_matches_cpu_and_reference(require_cuda, class_rate, dtype, soft):
    if soft and class_rate is not None:
        pytest.skip("hierarchical sampling needs integer labels")
    from ncdp_fast import reference as R
    rng = np.random.default_rng(1)
    n, d, K = 700, 133, 5                      # d not a multiple of any vector width
    X = (rng.standard_normal((n, d)) * 2).astype(dtype)
    lab = rng.integers(0, K, n)
    labels = np.eye(K, dtype=dtype)[lab] if soft else lab
    kw = dict(num_samples=57, mixup_degree=40, noise_std_x=0.3, noise_std_y=0.1,
              class_rate=class_rate, clip_x=3.0, seed=12, offset=5)
    if not soft:
        kw["num_classes"] = K
    gpu = nf.mix(_cuda(X, require_cuda), _cuda(labels, require_cuda), **kw)
    cpu = nf.mix(X, labels, return_groups=True, **kw)
    gpu_groups = nf.mix(_cuda(X, require_cuda), _cuda(labels, require_cuda), return_groups=True,
                        **kw).groups
    assert [list(g) for g in gpu_groups] == [list(g) for g in cpu.groups]
    assert gpu.x.is_cuda and gpu.counts.is_cuda
    np.testing.assert_array_equal(gpu.counts.cpu().numpy(), cpu.counts)
    groups = R.sample_groups(lab, num_samples=57, mixup_degree=40, class_rate=class_rate,
                             num_classes=K, seed=12, offset=5, row_stride=d + K)
    assert [list(g) for g in cpu.groups] == groups
    rx, ry = R.mix_from_groups(X, np.eye(K)[lab], groups, mixup_degree=40, noise_std_x=0.3,
                               noise_std_y=0.1, seed=12, offset=5, clip_x=3.0)
    u = np.finfo(dtype).eps / 2
    c = int(cpu.counts.max()) + 3
    absx = np.array([np.abs(X[g]).sum(axis=0) / 40 if len(g) else np.zeros(d) for g in groups])
    assert np.all(np.abs(gpu.x.cpu().numpy() - rx) <= c * u * (absx + np.abs(rx)) + 1e-30)
    assert np.all(np.abs(gpu.y.cpu().numpy() - ry) <= c * u * (1 + np.abs(ry)) + 1e-30)


def test_cuda_mix_row_range_and_reproducible(require_cuda):
    rng = np.random.default_rng(2)
    X = _cuda(rng.standard_normal((5000, 64)).astype(np.float32), require_cuda)
    lab = _cuda(rng.integers(0, 10, 5000), require_cuda)
    kw = dict(mixup_degree=64, noise_std_x=0.1, noise_std_y=0.1, num_classes=10, class_rate=0.3,
              seed=4)
    full = nf.mix(X, lab, num_samples=300, offset=0, **kw)
    again = nf.mix(X, lab, num_samples=300, offset=0, **kw)
    part = nf.mix(X, lab, num_samples=50, offset=100 * 74, **kw)
    assert bool((full.x == again.x).all())
    assert bool((part.x == full.x[100:150]).all()) and bool((part.y == full.y[100:150]).all())


# ------------------------------------------------------------------ kernel 3

@pytest.mark.parametrize("dtype,tol", [(np.float64, 1e-10), (np.float32, 1e-4)])
@pytest.mark.parametrize("cross", [False, True])
def test_cuda_ntk_gram_matches_cpu(require_cuda, dtype, tol, cross):
    import torch
    rng = np.random.default_rng(4)
    W = [rng.standard_normal((133, 11)) / 3, rng.standard_normal((70, 133)) / 11,
         rng.standard_normal((3, 70)) / 8]
    b = [rng.standard_normal(133), None, rng.standard_normal(3)]
    x = rng.standard_normal((301, 11))
    x2 = rng.standard_normal((129, 11)) if cross else None
    ref = nf.ntk_gram(x, W, biases=b, activation="gelu", x2=x2)
    t = lambda a: None if a is None else torch.tensor(a, dtype=getattr(torch, np.dtype(dtype).name),  # noqa: E731
                                                     device=require_cuda)
    K = nf.ntk_gram(t(x), [t(w) for w in W], biases=[t(v) for v in b], activation="gelu",
                    x2=t(x2))
    assert K.is_cuda and K.dtype == t(x).dtype
    Kc = K.double().cpu().numpy()
    assert np.abs(Kc - ref).max() <= tol * np.abs(ref).max()
    if not cross:
        assert bool((K == K.T).all())
    if dtype == np.float32:
        K64 = nf.ntk_gram(t(x), [t(w) for w in W], biases=[t(v) for v in b], activation="gelu",
                          x2=t(x2), accumulate_f64=True)
        assert K64.dtype == torch.float64
        assert np.abs(K64.cpu().numpy() - ref).max() <= tol * np.abs(ref).max()
