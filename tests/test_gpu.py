"""CUDA kernels against ncdp_fast.reference and against the CPU backend (marked gpu:
on a GPU where torch sees one, else on the emulated device under
NCDP_CUDA_EMULATION=1, as `make test` runs them; conftest.require_cuda)."""
import numpy as np
import pytest

import ncdp_fast as nf
from ncdp_fast import reference as R

from conftest import assert_within_sum_bound, emulated, on_host
from test_clip import (DENSE_SHAPES, LAYER_ORDERS, LINEAR_SHAPES, NORM_AFFINE_SHAPES, _flat,
                       _linear_inputs, _rows, assert_norm_affine_close, norm_affine_case,
                       poisoned_layers_run)

pytestmark = pytest.mark.gpu

DTYPES = [np.float32, np.float64]
# Larger than one L2 chunk / many slabs / many GEMM tiles on an H100, with odd sizes.
BIG_DENSE = [(300, 4097), (2049, 1031)]


def _cuda(x, dev):
    import torch
    return torch.from_numpy(np.ascontiguousarray(x)).to(dev)


def _host(x):
    """A NumPy copy of a device tensor (a NumPy array as it is)."""
    return x.cpu().numpy() if hasattr(x, "cpu") else np.asarray(x)


def _on(x, dev) -> bool:
    """Whether x lives on require_cuda's device (the GPU, or the emulated one)."""
    return x.device.type == dev.type


def _replay():
    """The next call draws a (seed, offset) range this test already drew, on
    purpose (the same noise on another backend, layout or stream): forget the
    drawn ranges, or the op warns NoiseReuseWarning (an error in the suite)."""
    from ncdp_fast import _stream
    _stream._LEDGER.clear()


@pytest.mark.parametrize("shape", DENSE_SHAPES + BIG_DENSE)
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_dense_matches_reference(require_cuda, shape, dtype):
    g = _rows(np.random.default_rng(sum(shape)), shape, dtype)
    kw = dict(max_norm=1.5, noise_multiplier=0.7, seed=11, offset=5, reduction="mean",
              expected_batch_size=3.0)
    res = nf.clip_and_noise(_cuda(g, require_cuda), **kw)
    assert _on(res.grad, require_cuda) and _on(res.norms, require_cuda)
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
    _replay()
    res = nf.clip_and_noise_layers(layers, max_norm=1.0, noise_multiplier=0.5, seed=1,
                                   nan_policy="zero")
    _replay()
    cpu = nf.clip_and_noise_layers([dense, (a, g)], max_norm=1.0, noise_multiplier=0.5, seed=1,
                                   nan_policy="zero")
    assert res.num_nonfinite == cpu.num_nonfinite == 2
    tol = 1e-4 if dtype == np.float32 else 1e-10
    np.testing.assert_allclose(res.grads[0].cpu().numpy(), cpu.grads[0], rtol=tol, atol=tol)
    np.testing.assert_allclose(res.grads[1][0].cpu().numpy(), cpu.grads[1][0], rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B", [0, 1, 6])
def test_cuda_joined_dense_runs_are_the_blocks_own(require_cuda, dtype, B, monkeypatch):
    """Small dense blocks (a LayerNorm's weight and bias, wherever they lie
    among the other blocks) go to the device as one joined block (issue 36:
    fewer launches): the grads, norms and counts equal the call that keeps
    every block apart (JOIN_DENSE_BYTES -1) -- each block's own noise draws
    column for column, the norms within the float64 additions' rounding --,
    and each grad keeps its block's shape.  Layers: three dense blocks, a
    pair, three more; a byte limit starts a new joined block where the next
    block would pass it, and a block left alone keeps the fused kernel."""
    from ncdp_fast import _clip_layers
    from ncdp_fast._cuda import clip as device_clip
    rng = np.random.default_rng(B + 1)
    d1, d2, d3 = (rng.standard_normal((B,) + s).astype(dtype) for s in ((5,), (2, 3), (7,)))
    a, g = _linear_inputs((B, 4, 6, 3), dtype)
    d4, d5, d6 = (rng.standard_normal((B, n)).astype(dtype) for n in (9, 4, 2))
    blocks = [d1, d2, d3, (a, g), d4, d5, d6]
    kw = dict(max_norm=1.0, noise_multiplier=0.5, reduction="mean", expected_batch_size=4.0,
              grad_scale=2.0)
    launches = []
    real = device_clip.weighted_row_sum_noise
    monkeypatch.setattr(device_clip, "weighted_row_sum_noise",
                        lambda g, *rest: launches.append(tuple(g.shape)) or real(g, *rest))

    def run(limit):
        monkeypatch.setattr(_clip_layers, "JOIN_DENSE_BYTES", limit)
        launches.clear()
        _replay()
        res = nf.clip_and_noise_layers(
            [_cuda(x, require_cuda) if not isinstance(x, tuple) else
             tuple(_cuda(y, require_cuda) for y in x) for x in blocks], seed=3, offset=7, **kw)
        return res, list(launches)

    joined, joined_launches = run(_clip_layers.JOIN_DENSE_BYTES)
    apart, apart_launches = run(-1)
    assert apart_launches == [(B, 5), (B, 6), (B, 7), (B, 9), (B, 4), (B, 2)]
    assert joined_launches == [(B, 33)]
    for got, want, x in zip(joined.grads, apart.grads, blocks):
        if isinstance(x, tuple):
            for u, v in zip(got, want):
                assert bool((u == v).all())
            continue
        assert tuple(got.shape) == x.shape[1:]
        # The joined sum is the blocks' own sums; the factors may differ where
        # the joined norm rounded differently (float64: relative 1e-15).
        np.testing.assert_allclose(got.cpu().numpy(), want.cpu().numpy(),
                                   rtol=2e-6 if dtype == np.float32 else 1e-13, atol=1e-30)
    np.testing.assert_allclose(joined.norms.cpu().numpy(), apart.norms.cpu().numpy(),
                               rtol=1e-14)
    assert (joined.num_clipped, joined.draws, joined.offset) == (
        apart.num_clipped, apart.draws, apart.offset)
    # A limit of 15 columns: 5 + 6 join, 7 would pass it and stays alone, 9 + 4
    # + 2 join (with B = 0 every block holds 0 bytes: one joined block).
    _, some = run(B * 15 * np.dtype(dtype).itemsize)
    assert some == ([(B, 11), (B, 7), (B, 15)] if B else [(B, 33)])


# (B, layers, T): no samples, one sample of one position, cells past a block's
# 256 threads, three stacked layers, and 15 row slices of 9 rows of 16 allowed
# (the last one shorter).
@pytest.mark.parametrize("B,layers,T", [(0, 2, 5), (1, 1, 1), (4, 1, 19), (3, 3, 33),
                                        (2, 1, 130)])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_norms_from_grams_twins_match_reference(require_cuda, B, layers, T, bias):
    """The device route's last norm step (one launch) and its numba twin give
    the reference's norms, spreads and sizes within the float64 sums' bound."""
    from ncdp_fast._cuda import clip as cuda_clip
    from ncdp_fast._numba import clip as numba_clip
    rng = np.random.default_rng(B * 100 + T + layers)
    a, g = rng.standard_normal((layers * B, T, 6)), rng.standard_normal((layers * B, T, 4))
    w, v = a @ a.transpose(0, 2, 1), g @ g.transpose(0, 2, 1)
    want_sq, want_spread, want_sizes = R.linear_norms_from_grams(w, v, bias, layers)
    one = 1.0 if bias else 0.0
    cells = np.abs((w + one) * v).reshape(layers, B, T * T).sum(axis=(0, 2))
    dw, dv = np.diagonal(w, 0, 1, 2), np.diagonal(v, 0, 1, 2)
    scale = (np.sqrt(dv) * (np.sqrt(dw) + one)).reshape(layers, B, T).sum(axis=(0, 2))
    sq0, sp0 = np.linspace(1.0, 2.0, B), np.linspace(0.5, 1.5, B)
    for name, mod, conv in (("cuda", cuda_clip, lambda x: _cuda(x, require_cuda)),
                            ("numba", numba_clip, lambda x: x)):
        sq, sp, sizes = conv(sq0.copy()), conv(sp0.copy()), conv(np.full((layers * B, 2), -1.0))
        mod.linear_norms_from_grams(conv(w), conv(v), bias, sq, True, sp, sizes, layers)
        got = [_host(x) for x in (sq, sp, sizes)]
        assert_within_sum_bound(got[0], want_sq + sq0, cells + sq0, layers * T * T + 3,
                                np.float64, f"{name} sq")
        assert_within_sum_bound(got[1], want_spread + sp0, scale + sp0, layers * T + 5,
                                np.float64, f"{name} spread")
        assert_within_sum_bound(got[2], want_sizes, np.abs(want_sizes), T + 1,
                                np.float64, f"{name} sizes")
    # One input's Grams serving every layer (shared_w): as its copy per layer.
    if B:
        want = R.linear_norms_from_grams(np.concatenate([w[:B]] * layers), v, bias, layers)
        w_rep = np.concatenate([w[:B]] * layers)
        cells_rep = np.abs((w_rep + one) * v).reshape(layers, B, T * T).sum(axis=(0, 2))
        for name, mod, conv in (("cuda", cuda_clip, lambda x: _cuda(x, require_cuda)),
                                ("numba", numba_clip, lambda x: x)):
            sq, sizes = conv(np.zeros(B)), conv(np.zeros((layers * B, 2)))
            mod.linear_norms_from_grams(conv(np.ascontiguousarray(w[:B])), conv(v), bias, sq,
                                        False, None, sizes, layers, shared_w=True)
            assert_within_sum_bound(_host(sq), want[0], cells_rep, layers * T * T + 3,
                                    np.float64, f"{name} shared sq")
            assert_within_sum_bound(_host(sizes), want[2], np.abs(want[2]), T + 1, np.float64,
                                    f"{name} shared sizes")
    # Overwriting instead of accumulating; spread and sizes are optional.
    sq = _cuda(np.full(B, 7.0), require_cuda)
    cuda_clip.linear_norms_from_grams(_cuda(w, require_cuda), _cuda(v, require_cuda), bias, sq,
                                      False, None, None, layers)
    assert_within_sum_bound(_host(sq), want_sq, cells, layers * T * T + 3, np.float64,
                            "cuda sq overwritten")


@pytest.mark.parametrize("seed", [0, 1])
def test_cuda_finish_gaussian_segments_are_one_finish_a_segment(require_cuda, seed):
    """More segments than one launch takes (48), of random lengths (empty ones
    among them) and offsets, in place and float64 into float32: bit for bit
    each segment's own add_gaussian on the device, and bit for bit the numba
    twin's (csrc/common/philox.cuh, "The normals": the twin's log, sin, cos
    and finish, operation for operation, none contracted)."""
    import torch
    from ncdp_fast._cuda import rng as crng
    from ncdp_fast._numba import rng as nrng
    rng = np.random.default_rng(seed)
    kinds = [(np.float32, np.float32), (np.float64, np.float64), (np.float64, np.float32)]
    layout = []
    for _ in range(110):
        src_dt, dst_dt = kinds[rng.integers(3)]
        n = int(rng.choice([0, 1, 2, 3, 5, 17, 300]))
        layout.append((src_dt, dst_dt, rng.standard_normal(n).astype(src_dt),
                       int(rng.integers(0, 2 ** 40))))
    scale, post = 0.75, 1.0 / 3.0

    def segments(place):
        out, dsts = [], []
        for src_dt, dst_dt, x, off in layout:
            src = place(x.copy())
            dst = src if src_dt == dst_dt else place(np.zeros(x.size, dst_dt))
            out.append((dst, src, off))
            dsts.append(dst)
        return out, dsts

    dev, dev_out = segments(lambda x: _cuda(x, require_cuda))
    crng.finish_gaussian_segments(dev, np.uint64(seed), scale, post)
    host, host_out = segments(lambda x: x)
    nrng.finish_gaussian_segments(host, np.uint64(seed), scale, post)
    for (src_dt, dst_dt, x, off), got, want in zip(layout, dev_out, host_out):
        one = _cuda(x.astype(np.float64) if src_dt != dst_dt else x, require_cuda)
        crng.add_gaussian(one, np.uint64(seed), np.uint64(off), scale, True, post)
        got = got.cpu().numpy()
        assert got.dtype == np.dtype(dst_dt)
        assert np.array_equal(got, one.cpu().numpy().astype(dst_dt)), (x.size, off)
        assert got.tobytes() == want.tobytes(), (x.size, off)
    assert isinstance(dev_out[0], torch.Tensor)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("accumulate", [False, True])
def test_cuda_normals_are_the_numba_twins_bits(require_cuda, dtype, accumulate):
    """The stream's normals on the device, filled or added (2^20 values from an
    offset of each phase in its Philox block, so deep pairs fall in: one pair
    in 2048), equal the numba kernel's bit for bit."""
    from ncdp_fast._cuda import rng as crng
    from ncdp_fast._numba import rng as nrng
    base = np.random.default_rng(5).standard_normal(2 ** 20 + 3).astype(dtype)
    for offset in (0, 1, 2, 3, 2 ** 40 + 5):
        dev = _cuda(base.copy(), require_cuda)
        crng.add_gaussian(dev, np.uint64(7), np.uint64(offset), 0.5, accumulate, 0.25)
        host = base.copy()
        nrng.add_gaussian(host, np.uint64(7), np.uint64(offset), 0.5, accumulate, 0.25)
        assert dev.cpu().numpy().tobytes() == host.tobytes(), offset


def test_cuda_same_seed_offset_bitwise_reproducible(require_cuda):
    g = _cuda(np.random.default_rng(0).standard_normal((1000, 3001)).astype(np.float32),
              require_cuda)
    r1 = nf.clip_and_noise(g, max_norm=1.0, noise_multiplier=1.0, seed=9, offset=17).grad
    with pytest.warns(nf.NoiseReuseWarning):     # the same noise on purpose
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


def test_cuda_ghost_clipper_mlp_matches_cpu(require_cuda):
    # Named apart from the book-keeping test below: under one name, the later
    # definition replaced this one and it never ran.
    import torch
    from torch import nn

    from ncdp_fast.torch import GhostClipper
    x = torch.randn(64, 5, 12, dtype=torch.float64)
    y = torch.randint(0, 4, (64,))
    grads = []
    for dev in ("cpu", require_cuda):
        _replay()                     # both clippers start at draw 0 of seed 3
        torch.manual_seed(0)
        with on_host(require_cuda) if dev == "cpu" else _nullcontext():
            model = nn.Sequential(nn.Linear(12, 9), nn.Tanh(), nn.Flatten(),
                                  nn.Linear(45, 4)).double()
            model = model.to(dev)
            clipper = GhostClipper(model, max_grad_norm=1.0, noise_multiplier=0.5,
                                   expected_batch_size=64, seed=3)
            nn.functional.cross_entropy(model(x.to(dev)), y.to(dev)).backward()
            clipper.privatize_()
        grads.append(torch.cat([p.grad.reshape(-1).cpu() for p in model.parameters()]))
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-9, atol=1e-12)


def test_cuda_fused_optimizer_matches_opacus(require_cuda):
    # Opacus is the peer, not a dependency: without it the test is skipped and
    # `make gpu-check` names the skip in its summary (not a failure).
    pytest.importorskip("opacus", reason="opacus is not installed (the peer of this comparison)")
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
    # The same library on two devices is a wrong value (ValueError); two
    # libraries are a wrong type (TypeError). On the emulated device every CPU
    # tensor is the device's, so only the second can be made there;
    # test_backend_select_tells_a_device_from_a_library covers the first.
    import torch
    if not emulated(require_cuda):
        with pytest.raises(ValueError, match="backprops and activations must be on the same "
                           "device.*cuda.*cpu|cpu.*cuda"):
            nf.clip_and_noise_linear(torch.ones(3, 4, device=require_cuda), torch.ones(3, 2),
                                     max_norm=1.0, noise_multiplier=1.0, seed=0)
    with pytest.raises(TypeError, match="backprops and activations must be on the same device "
                       "and of the same array library"):
        nf.clip_and_noise_linear(torch.ones(3, 4, device=require_cuda), np.ones((3, 2)),
                                 max_norm=1.0, noise_multiplier=1.0, seed=0)


# ------------------------------------------------------------------ kernel 2

# Hierarchical sampling (class_rate) needs integer labels: soft labels only
# with Poisson sampling.
@pytest.mark.parametrize("soft,class_rate", [(False, None), (False, 0.5), (True, None)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_mix_matches_cpu_and_reference(require_cuda, class_rate, dtype, soft):
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
    _replay()
    cpu = nf.mix(X, labels, return_groups=True, **kw)
    _replay()
    gpu_groups = nf.mix(_cuda(X, require_cuda), _cuda(labels, require_cuda), return_groups=True,
                        **kw).groups
    assert [list(g) for g in gpu_groups] == [list(g) for g in cpu.groups]
    assert _on(gpu.x, require_cuda) and _on(gpu.counts, require_cuda)
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
    _replay()
    again = nf.mix(X, lab, num_samples=300, offset=0, **kw)
    _replay()
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
    assert _on(K, require_cuda) and K.dtype == t(x).dtype
    Kc = K.double().cpu().numpy()
    assert np.abs(Kc - ref).max() <= tol * np.abs(ref).max()
    if not cross:
        assert bool((K == K.T).all())
    if dtype == np.float32:
        K64 = nf.ntk_gram(t(x), [t(w) for w in W], biases=[t(v) for v in b], activation="gelu",
                          x2=t(x2), accumulate_f64=True)
        assert K64.dtype == torch.float64
        assert np.abs(K64.cpu().numpy() - ref).max() <= tol * np.abs(ref).max()


# ------------------------------------------------------- launch paths of issue 14
# Shapes sized from the launchers' own rules (csrc/): what each reaches is said
# where it is chosen.

def _l2_bytes(dev):
    import torch

    from ncdp_fast import _native
    # The emulated device's L2 is small (tests/cuda_emu/cuda_emu_runtime.h), so
    # that these shapes stay small there.
    l2 = (_native.emulated().cuda_l2_cache_bytes(0) if emulated(dev)
          else int(torch.cuda.get_device_properties(dev).L2_cache_size))
    assert l2 > 0, "the device reports no L2 size: launch_clip_noise_rows would not chunk"
    return l2


@pytest.mark.parametrize("p", [8192, 10007])     # 16-byte loads throughout / scalar tails
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_dense_l2_chunks_match_cpu(require_cuda, dtype, p, monkeypatch):
    # launch_clip_noise_rows with the device's L2 (the op's default is one
    # chunk, _cuda/clip.py DENSE_L2_BYTES) takes rows in chunks of (L2 / 2) /
    # row_bytes and accumulates each chunk's slab partials onto the previous
    # ones: three full chunks and a partial fourth (about 1.75 L2 of gradients,
    # 88 MB on an H100).
    from ncdp_fast._cuda import clip as device_clip
    monkeypatch.setattr(device_clip, "DENSE_L2_BYTES", -1)
    chunk = max(1, (_l2_bytes(require_cuda) // 2) // (p * np.dtype(dtype).itemsize))
    B = 3 * chunk + chunk // 2 + 1
    C, sigma, E = 1.5, 0.7, B / 2
    rng = np.random.default_rng(p)
    g = rng.standard_normal((B, p), dtype=dtype)
    g *= rng.uniform(0.0, 2 * C / np.sqrt(p), (B, 1)).astype(dtype)   # norms in (0, 2C)
    g[1] = 0.0
    kw = dict(max_norm=C, noise_multiplier=sigma, seed=21, offset=3, reduction="mean",
              expected_batch_size=E)
    res = nf.clip_and_noise(_cuda(g, require_cuda), **kw)
    _replay()
    cpu = nf.clip_and_noise(g, **kw)
    assert res.grad.device.type == require_cuda.type
    assert 0 < cpu.num_clipped < B - 1 and res.num_clipped == cpu.num_clipped
    # Norms: float64 sums of p squares in two orders.
    np.testing.assert_allclose(res.norms.cpu().numpy(), cpu.norms, rtol=4 * p * 1.2e-16)
    factors, _ = R.clip_factors(cpu.norms ** 2, C, unit=R.unit_roundoff(dtype), terms=p)
    # The CUDA sum is float64 (chunks, slabs) rounded once; the CPU one sums
    # slabs of B/8 rows in the dtype: both within gamma_{B+3} of the sum of
    # |terms| (noise bounded by 6.7 sigma C); |cpu| covers the two final roundings.
    terms = (factors @ np.abs(g) + 6.7 * sigma * C) / E + np.abs(cpu.grad)
    assert_within_sum_bound(res.grad.cpu().numpy(), cpu.grad, terms, B + 3, dtype,
                            f"cuda dense, {B} rows in chunks of {chunk}")


@pytest.mark.parametrize("l2", [-1, 1])         # row blocks by the device's L2 / of one row
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_dense_one_pass_matches_two_passes(require_cuda, dtype, l2, monkeypatch):
    # The one-pass form (csrc/clip/dense_one_pass.cu) on as many blocks as the
    # device holds: on a GPU its blocks run at once and hand rows over through
    # flags (on the emulated device one block does it all), so the same call
    # must give the same bits every time, the two-pass form's norms bit for
    # bit, and its flags must show every row block finished. l2 = 1: rows of
    # one, the most hand-overs (45 row blocks); the op itself takes -1.
    import torch

    from ncdp_fast._cuda import clip as device_clip
    from ncdp_fast._cuda._common import native, ptr, stream, workspace
    # Float32 rows 16-byte aligned; float64 rows of odd length (scalar tails).
    p = (300000 if dtype == np.float32 else 150001) if not emulated(require_cuda) else (
        4000 if dtype == np.float32 else 3001)
    B = 45
    C, sigma, E = 1.5, 0.7, B / 2
    rng = np.random.default_rng(p)
    g = rng.standard_normal((B, p), dtype=dtype)
    g *= rng.uniform(0.0, 2 * C / np.sqrt(p), (B, 1)).astype(dtype)   # norms in (0, 2C)
    g[1] = 0.0
    gd = _cuda(g, require_cuda)
    dt = 0 if dtype == np.float32 else 1
    lib = native(gd)
    blocks, columns, rows, row_blocks, segments, items, flags_at = \
        lib.clip_noise_rows_one_pass_plan(B, p, dt, l2, -1)
    assert blocks > 0 and row_blocks > 1 and (l2 > 0) == (rows == 1), (blocks, rows, row_blocks)
    kw = dict(max_norm=C, noise_multiplier=sigma, seed=21, offset=3, reduction="mean",
              expected_batch_size=E)
    monkeypatch.setattr(device_clip, "DENSE_ONE_PASS_BLOCKS", 0)
    two = nf.clip_and_noise(gd, **kw)
    _replay()
    monkeypatch.setattr(device_clip, "DENSE_ONE_PASS_BLOCKS", -1)
    one = nf.clip_and_noise(gd, **kw)
    _replay()
    assert torch.equal(one.norms, two.norms)
    assert one.num_clipped == two.num_clipped and 0 < two.num_clipped < B - 1
    cpu = nf.clip_and_noise(g, **kw)
    factors, _ = R.clip_factors(cpu.norms ** 2, C, unit=R.unit_roundoff(dtype), terms=p)
    terms = (factors @ np.abs(g) + 6.7 * sigma * C) / E + np.abs(cpu.grad)
    assert_within_sum_bound(one.grad.cpu().numpy(), cpu.grad, terms, B + 3, dtype,
                            f"cuda dense one pass, {blocks} blocks, {rows} rows a row block")
    # Launches of their own (the op refuses to repeat a noise range): the same
    # bits each time, and the flags of each show every row block's items done
    # and its factors ready.
    nbytes = lib.clip_noise_rows_workspace_bytes(B, p, dt)
    ws, ws_ptr = workspace(gd, nbytes)
    outs = []
    for _ in range(4):
        ws.zero_()
        out = torch.empty(p, dtype=gd.dtype, device=gd.device)
        norms = torch.empty(B, dtype=torch.float64, device=gd.device)
        lib.launch_clip_noise_rows(ptr(gd), B, p, dt, C, sigma * C, 1.0, 1, 0, ptr(out),
                                   ptr(norms), ws_ptr, nbytes, stream(gd), l2_bytes=l2,
                                   one_pass_blocks=-1)
        words = ws[flags_at:flags_at + 4 * (2 * B + 2)].view(torch.int32).cpu().numpy()
        assert np.all(words[:row_blocks] == segments) and np.all(words[B:B + row_blocks] == 1)
        assert not words[row_blocks:B].any() and not words[B + row_blocks:2 * B].any()
        tickets = int(words[2 * B:].view(np.uint64)[0])
        assert row_blocks * items <= tickets <= row_blocks * items + blocks
        assert torch.equal(norms, two.norms)
        outs.append(out)
    assert all(torch.equal(out, outs[0]) for out in outs[1:])


def _assert_mix_close(gpu, cpu, X, Y, m, sx, sy, dtype, what, extra_terms=0):
    """Both backends sum a row's (clipped) members in the features' dtype in
    sampler order and finish in float64: each is within gamma_{c+2} of the exact
    sum (c members; the factor's and the product's roundings), so the two differ
    by at most gamma_{2c+4} times the sum of |terms|.  |cpu| covers the output
    roundings, 8 s the float64 noise (|z| < 6.7).  ``extra_terms``: more
    roundings in the sum's length (factors from differently ordered norms)."""
    groups = cpu.groups
    c = int(np.diff(groups.indptr).max(initial=0))
    n = 2 * (c + 3) + extra_terms
    for out, feats, s, name in ((gpu.x, X, sx, "x"), (gpu.y, Y, sy, "y")):
        ref = (cpu.x if name == "x" else cpu.y)
        ref = ref.cpu().numpy() if hasattr(ref, "cpu") else ref
        absf = np.abs(np.asarray(feats, dtype=np.float64))
        scale = np.zeros(ref.shape)
        for t in range(len(groups)):
            g = groups[t]
            if len(g):
                scale[t] = absf[g].sum(axis=0) / m
        assert_within_sum_bound(out.cpu().numpy(), ref, scale + np.abs(ref) + 8 * s, n, dtype,
                                f"{what}: {name}, rows of up to {c} members")


def _assert_same_groups(a, b):
    assert np.array_equal(a.indptr, b.indptr) and np.array_equal(a.indices, b.indices)


# (dtype, d, class_rate, soft labels); vectors per gather thread = ceil(d / 1024)
# (fused up to 8192 float32 / 4096 float64 columns, tiled beyond).
MIX_WIDE = [
    (np.float32, 1500, None, False),    # 2 vectors
    (np.float32, 3000, 0.5, False),     # 4
    (np.float32, 6000, None, True),     # 8, soft labels
    (np.float32, 8193, 0.5, False),     # tiled: one column past the fused limit
    (np.float32, 8193, None, True),     # tiled, soft labels
    (np.float64, 1500, 0.5, False),     # 2
    (np.float64, 3000, None, True),     # 4, the widest fused float64 row
    (np.float64, 4097, 0.5, False),     # tiled
]


@pytest.mark.parametrize("dtype,d,class_rate,soft", MIX_WIDE,
                         ids=lambda v: getattr(v, "__name__", str(v)))
def test_cuda_mix_chunks_and_wide_rows_match_cpu(require_cuda, dtype, d, class_rate, soft):
    # m = 1100 > 2 * 512: the sampling warp hands each row over in 2-3 chunks of
    # 512 ids (hierarchical rows: 0 to ~2200 members, chunks crossing classes);
    # the tiled path keeps the partial sums of earlier chunks in out_x.
    n, K, m, T, sx, sy = 3000, 4, 1100, 24, 0.05, 0.1
    rng = np.random.default_rng(d)
    X = (rng.standard_normal((n, d)) * rng.uniform(0.5, 2.0, (n, 1)) / np.sqrt(d)).astype(dtype)
    lab = rng.integers(0, K, n)
    labels = rng.dirichlet(np.ones(K), n).astype(dtype) if soft else lab
    kw = dict(num_samples=T, mixup_degree=m, noise_std_x=sx, noise_std_y=sy,
              class_rate=class_rate, clip_x=1.0, seed=8, offset=11, return_groups=True)
    if not soft:
        kw["num_classes"] = K
    gpu = nf.mix(_cuda(X, require_cuda), _cuda(labels, require_cuda), **kw)
    _replay()
    cpu = nf.mix(X, labels, **kw)
    assert cpu.counts.max() > 2 * 512
    # The sampler's logarithm is one definition on every backend (philox::sampler_log).
    np.testing.assert_array_equal(gpu.counts.cpu().numpy(), cpu.counts)
    _assert_same_groups(gpu.groups, cpu.groups)
    Y = labels if soft else np.eye(K)[lab]
    _assert_mix_close(gpu, cpu, X, Y, m, sx, sy, dtype, f"cuda mix d={d}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_mix_more_rows_than_blocks_matches_cpu(require_cuda, dtype):
    # One block per output row, at most 2^16 blocks: past 65536 rows a block
    # takes several rows and its sampling warp runs one chunk pipeline through
    # them.  Hierarchical rates mix empty rows, rows of one member and (1 % of
    # rows) ~540 members, two chunks, so rows of different chunk counts follow
    # each other in a block.
    n, d, K, T, m, sx, sy = 1000, 3, 2, 70000, 6, 0.05, 0.1
    if emulated(require_cuda):
        T = 700      # the emulated grid holds 3 blocks (NCDP_EMU_MAX_GRID_BLOCKS)
    rng = np.random.default_rng(70000)
    lab = rng.permutation(np.r_[np.zeros(100, np.int64), np.ones(900, np.int64)])
    X = rng.standard_normal((n, d)).astype(dtype)
    # q = m / (n p): 0.006 for class 0 (always selected), 0.6 for class 1 (p = 1 %).
    kw = dict(num_samples=T, mixup_degree=m, noise_std_x=sx, noise_std_y=sy, num_classes=K,
              class_rate=np.array([1.0, 0.01]), clip_x=1.0, seed=5, offset=0, return_groups=True)
    gpu = nf.mix(_cuda(X, require_cuda), _cuda(lab, require_cuda), **kw)
    _replay()
    cpu = nf.mix(X, lab, **kw)
    assert cpu.counts.max() > 512 and (cpu.counts == 0).any()
    np.testing.assert_array_equal(gpu.counts.cpu().numpy(), cpu.counts)
    _assert_same_groups(gpu.groups, cpu.groups)
    _assert_mix_close(gpu, cpu, X, np.eye(K)[lab], m, sx, sy, dtype, "cuda mix, 70000 rows")


# NTK: a 70-layer MLP is 70 Gram terms, two launches of at most 64; n = 1100
# is 9 tile rows of 128 (float32 accumulation) / 18 of 64 (float64), so the
# symmetric grid's search walks more than one group of 8 tile rows.
_DEEP = {}


def _deep_mlp():
    """Orthogonal weights with gain 1.2 under tanh keep every layer's term of
    the same order: the first six layers (the second launch) make up to a
    third of the largest entry of K; float32 factors are off by ~5e-6."""
    if not _DEEP:
        rng = np.random.default_rng(70)
        L, w, d, K = 70, 12, 9, 2

        def orth(r, c):
            q, _ = np.linalg.qr(rng.standard_normal((max(r, c), max(r, c))))
            return q[:r, :c]
        W = [orth(w, d) * 1.2] + [orth(w, w) * 1.2 for _ in range(L - 2)] + [orth(K, w)]
        b = [rng.standard_normal(w) * 0.1 if l % 3 == 0 else None for l in range(L - 1)] + \
            [rng.standard_normal(K) * 0.1]
        x = rng.standard_normal((1100, d)) / np.sqrt(d)
        x2 = rng.standard_normal((700, d)) / np.sqrt(d)
        _DEEP.update(W=W, b=b, x=x, x2=x2)
        for cross in (False, True):     # the CPU backend in float64
            _DEEP[cross] = nf.ntk_gram(x, W, biases=b, activation="tanh",
                                       x2=x2 if cross else None)
    return _DEEP


@pytest.mark.parametrize("dtype,acc64,tol", [(np.float64, False, 1e-10), (np.float32, False, 1e-4),
                                             (np.float32, True, 1e-4)])
@pytest.mark.parametrize("cross", [False, True])
def test_cuda_ntk_gram_deep_mlp_matches_cpu(require_cuda, dtype, acc64, tol, cross):
    import torch
    net = _deep_mlp()
    td = getattr(torch, np.dtype(dtype).name)

    def t(a):
        return None if a is None else torch.tensor(a, dtype=td, device=require_cuda)
    K = nf.ntk_gram(t(net["x"]), [t(w) for w in net["W"]], biases=[t(v) for v in net["b"]],
                    activation="tanh", x2=t(net["x2"]) if cross else None, accumulate_f64=acc64)
    assert K.dtype == (torch.float64 if acc64 else td)
    ref = net[cross]
    # float32: the factors themselves (70 layers of float32 GEMMs) are off by
    # ~1e-5 relative, as on the CPU; the check is that no term is lost or doubled.
    assert np.abs(K.double().cpu().numpy() - ref).max() <= tol * np.abs(ref).max()
    if not cross:
        assert bool((K == K.T).all())


_GRAM_TERMS = {}


def _gram_terms(dtype, symmetric):
    """200 terms of random factors (widths cycling; a constant-1 F, an F of width
    0 and a B of width 0 among them: 134 terms reach the kernel, three launches)
    and K = sum (F F2^T) o (B B2^T) and the sum of |terms| in float64."""
    key = (np.dtype(dtype).name, symmetric)
    if key not in _GRAM_TERMS:
        rng = np.random.default_rng(200)
        n, n2 = 1100, (1100 if symmetric else 700)
        widths = [(3, 2), (None, 4), (1, 1), (0, 3), (5, 3), (2, 0)]
        terms = []
        ref = np.zeros((n, n2))
        scale = np.zeros((n, n2))
        for l in range(200):
            a, bw = widths[l % len(widths)]

            def draw(rows, cols):
                return None if cols is None else rng.standard_normal((rows, cols)).astype(dtype)
            f, b = draw(n, a), draw(n, bw)
            f2, b2 = (f, b) if symmetric else (draw(n2, a), draw(n2, bw))
            terms.append((f, b, f2, b2))
            f64 = [None if v is None else v.astype(np.float64) for v in (f, b, f2, b2)]
            q, qa = f64[1] @ f64[3].T, np.abs(f64[1]) @ np.abs(f64[3]).T
            if f is None:
                ref += q
                scale += qa
            else:
                ref += (f64[0] @ f64[2].T) * q
                scale += (np.abs(f64[0]) @ np.abs(f64[2]).T) * qa
        _GRAM_TERMS[key] = terms, ref, scale
    return _GRAM_TERMS[key]


@pytest.mark.parametrize("dtype,acc64,out_dtype", [
    (np.float32, False, np.float32), (np.float32, False, np.float64),
    (np.float32, True, np.float32), (np.float32, True, np.float64),
    (np.float64, True, np.float32), (np.float64, True, np.float64)])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("route", ["hadamard_gram", "tiled_kernel_gram", "halving"])
def test_cuda_hadamard_gram_many_terms(require_cuda, dtype, acc64, out_dtype, symmetric, route,
                                       monkeypatch):
    import torch

    from ncdp_fast import _backend
    from ncdp_fast._cuda import ntk as device_ntk
    if route == "halving":
        # The GEMM route's halving plan at this small n: leaves of 64 rows,
        # calls cut to 100 x n cells (batched, strided blocks on cuBLAS).
        monkeypatch.setattr(device_ntk, "PLANS", ("halving",))
        monkeypatch.setattr(device_ntk, "LEAF_ROWS", 64)
        monkeypatch.setattr(device_ntk, "STRIP_ROWS", 100)
        route = "hadamard_gram"
    # The GEMM route the op dispatches to, and the tiled kernel it replaced
    # (kept as the benchmark's peer, so still held to the same bound).
    gram = getattr(_backend.KERNELS["cuda", "ntk"], route)
    terms, ref, scale = _gram_terms(dtype, symmetric)

    def t(a):
        return None if a is None else _cuda(a, require_cuda)
    f = [t(x[0]) for x in terms]
    b = [t(x[1]) for x in terms]
    f2 = f if symmetric else [t(x[2]) for x in terms]
    b2 = b if symmetric else [t(x[3]) for x in terms]
    out = torch.full(ref.shape, float("nan"), dtype=getattr(torch, np.dtype(out_dtype).name),
                     device=require_cuda)
    gram(f, b, f2, b2, out, symmetric, accumulate_f64=acc64)
    K = out.cpu().numpy()
    # Per entry and term, an F product of <= 5 and a B product of <= 4 products,
    # then 134 terms summed: gamma_{5+4+134+2} in the accumulator's precision;
    # the bound's dtype rounding term covers a float32 output.
    acc = np.float64 if (acc64 or dtype == np.float64) else np.float32
    n = 5 + 4 + 134 + 2
    if out_dtype == np.float32 and acc == np.float64:
        acc = np.float32          # the output's rounding dominates
    assert_within_sum_bound(K, ref, scale, n, acc, f"hadamard_gram {np.dtype(dtype).name} "
                            f"acc64={acc64} out {np.dtype(out_dtype).name}")
    if symmetric:
        assert np.array_equal(K, K.T)


# Unaligned views: a tensor starting one element into its buffer (4 or 8 bytes
# past a 16-byte boundary) takes the launchers' scalar-load variants, where an
# aligned copy of the same values takes the 16-byte loads.

def _unaligned(x, dev):
    """(view one element into a buffer, aligned copy) of x on dev."""
    import torch
    x = np.ascontiguousarray(x)
    buf = torch.empty(x.size + 1, dtype=getattr(torch, x.dtype.name), device=dev)
    view = buf[1:].view(x.shape)
    view.copy_(torch.from_numpy(x))
    copy = view.clone()
    assert view.data_ptr() % 16 != 0 and copy.data_ptr() % 16 == 0
    assert view.is_contiguous()          # the op passes it on as is, no copy
    return view, copy


def _bitwise(a, b):
    import torch
    return a is None and b is None or bool(torch.equal(a, b))


@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_dense_unaligned_view(require_cuda, dtype):
    B, p = 300, 1028                   # p a multiple of 4: the copy's rows are all aligned
    g = _rows(np.random.default_rng(1028), (B, p), dtype, scale=0.05)
    view, copy = _unaligned(g, require_cuda)
    for C in (1e6, 1.0):               # nothing clipped (factors exactly 1); most rows clipped
        kw = dict(max_norm=C, noise_multiplier=0.5, seed=5, offset=0)
        ra = nf.clip_and_noise(copy, **kw)
        _replay()
        ru = nf.clip_and_noise(view, **kw)
        _replay()
        # Norms: the rows' head elements up to a 16-byte boundary are summed apart.
        np.testing.assert_allclose(ru.norms.cpu().numpy(), ra.norms.cpu().numpy(),
                                   rtol=4 * p * 1.2e-16)
        if C > 1e3:
            assert ra.num_clipped == 0 and _bitwise(ru.grad, ra.grad)
        else:
            norms = ra.norms.cpu().numpy()
            assert ra.num_clipped > B // 2
            factors, _ = R.clip_factors(norms ** 2, C, unit=R.unit_roundoff(dtype), terms=p)
            ref = ra.grad.cpu().numpy()
            # Same sums, factors from norms that differ by float64 roundings of p terms.
            terms = factors @ np.abs(g.astype(np.float64)) + np.abs(ref)
            assert_within_sum_bound(ru.grad.cpu().numpy(), ref, terms, p + 4, dtype,
                                    "unaligned dense")


@pytest.mark.parametrize("T", [None, 5])
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_linear_unaligned_view(require_cuda, dtype, T):
    # Norms and clipped sums are vendor GEMMs in float64 (issue 36). A float64
    # view reaches cuBLAS as it is, and cuBLAS picks its kernel, and so its
    # summation order, by the operands' alignment: the H200 run of 2026-11-28
    # gave other bits for the one-element-off view than for its aligned copy.
    # So the claim is the rounding bound of those float64 sums, not bit equality.
    B, d, K = 200, 68, 12
    a, g = _linear_inputs((B, T, d, K), dtype)
    av, ac = _unaligned(a, require_cuda)
    gv, gc = _unaligned(g, require_cuda)
    Tn = 1 if T is None else T
    terms = R.linear_terms(d, K, Tn)
    a3 = np.abs(a.astype(np.float64)).reshape(B, Tn, d)
    g3 = np.abs(g.astype(np.float64)).reshape(B, Tn, K)
    for C in (1e6, 2.0):               # nothing clipped (factors exactly 1); rows clipped
        kw = dict(max_norm=C, noise_multiplier=0.3, bias=True, seed=6, offset=0)
        ra = nf.clip_and_noise_linear(ac, gc, **kw)
        _replay()
        ru = nf.clip_and_noise_linear(av, gv, **kw)
        _replay()
        norms = ra.norms.cpu().numpy()
        # Each squared norm is a float64 sum of the rule's `terms` products.
        np.testing.assert_allclose(ru.norms.cpu().numpy(), norms, rtol=4 * terms * 1.2e-16)
        assert (ra.num_clipped == 0) if C > 1e3 else (ra.num_clipped > 0)
        factors, _ = R.clip_factors(norms ** 2, C, unit=R.unit_roundoff(dtype), terms=terms)
        # sum_i f_i sum_t |g_it| |a_it|: the magnitudes each output's B*T-term
        # float64 sum adds up, the factors' own spread counted in n.
        abs_w = np.einsum("i,itk,itd->kd", factors, g3, a3).ravel()
        abs_b = np.einsum("i,itk->k", factors, g3)
        for out, ref_t, part in ((ru.grad_weight, ra.grad_weight, abs_w),
                                 (ru.grad_bias, ra.grad_bias, abs_b)):
            ref = ref_t.cpu().numpy().ravel()
            assert_within_sum_bound(out.cpu().numpy().ravel(), ref, part + np.abs(ref),
                                    B * Tn + terms + 4, dtype, "unaligned linear")


@pytest.mark.parametrize("dtype,d", [(np.float32, 2048), (np.float32, 8196),
                                     (np.float64, 2048), (np.float64, 4100)])
def test_cuda_mix_unaligned_view(require_cuda, dtype, d):
    # d a multiple of 4: fused (2 vectors) and tiled rows, 16-byte loads for the copy.
    n, K, m, T = 600, 3, 40, 16
    rng = np.random.default_rng(d)
    X = (rng.standard_normal((n, d)) * rng.uniform(0.5, 2.0, (n, 1)) / np.sqrt(d)).astype(dtype)
    lab = rng.integers(0, K, n)
    view, copy = _unaligned(X, require_cuda)
    lab_d = _cuda(lab, require_cuda)
    tiled = d > (8192 if dtype == np.float32 else 4096)
    for clip in (None, 1.0):
        kw = dict(num_samples=T, mixup_degree=m, noise_std_x=0.1, noise_std_y=0.1, num_classes=K,
                  clip_x=clip, seed=3, offset=0, return_groups=True)
        ra = nf.mix(copy, lab_d, **kw)
        _replay()
        ru = nf.mix(view, lab_d, **kw)
        _replay()
        assert _bitwise(ru.counts, ra.counts) and _bitwise(ru.y, ra.y)
        _assert_same_groups(ru.groups, ra.groups)
        if clip is None or not tiled:
            # The fused path loads a member's slots into registers either way and
            # sums its squares from there: the same order, the same bits.
            assert _bitwise(ru.x, ra.x)
        else:
            # Tiled: the clip norms are per-warp sums that start at the row's
            # first 16-byte boundary; factors then differ by float64 roundings.
            _assert_mix_close(ru, ra, X, np.eye(K)[lab], m, 0.1, 0.1, dtype,
                              "unaligned tiled mix", extra_terms=d)


# Streams: with the default stream held busy (a spinning kernel), the op runs
# inside `with torch.cuda.stream(s)` and its results are read on s.  Work sent
# to any other stream would still be queued behind the spin and read as
# garbage; the results must equal the default stream's bit for bit.
_SPIN_CYCLES = 2_000_000_000           # about a second of SM clock


def _on_busy_default_stream(dev, fn, monkeypatch):
    import torch
    if emulated(dev):
        return _on_emulated_side_stream(fn, monkeypatch)
    torch.cuda.synchronize(dev)
    s = torch.cuda.Stream(device=dev)
    torch.cuda._sleep(_SPIN_CYCLES)                       # on the default stream
    with torch.cuda.stream(s):
        assert torch.cuda.current_stream(dev) == s
        out = fn()
        host = [None if x is None else x.cpu() for x in out]   # copies ordered on s
    still_busy = not torch.cuda.default_stream(dev).query()
    s.synchronize()
    torch.cuda.synchronize(dev)
    assert still_busy, ("the default stream finished its spin before the results were read on "
                        "s: an op synchronized with it, or the host took over a second")
    return out, host


# The emulated device runs each launch to its end on one queue, so there is no
# other stream to be behind; what is checked there is the adaptors' half: every
# launch is handed the stream that current_stream gives for its arrays (a value
# no launch would otherwise see), and the results are those of stream 0.
_EMULATED_SIDE_STREAM = 0x5EED5


def _on_emulated_side_stream(fn, monkeypatch):
    from ncdp_fast import _native
    from ncdp_fast._cuda import clip, mix, ntk, rng
    native = _native.emulated()
    launches = []

    class Recording:
        def __getattr__(self, name):
            target = getattr(native, name)
            if not name.startswith("launch_"):
                return target

            def launch(*args, **kwargs):
                launches.append((name, [*args, *kwargs.values()]))
                return target(*args, **kwargs)
            return launch
    for module in (clip, mix, ntk, rng):
        monkeypatch.setattr(module, "stream", lambda x: _EMULATED_SIDE_STREAM)
        monkeypatch.setattr(module, "native", lambda x: Recording())
    out = fn()
    monkeypatch.undo()
    assert launches, "no launch reached the emulated device"
    for name, args in launches:
        assert _EMULATED_SIDE_STREAM in args, f"{name} was not given the caller's stream"
    return out, [None if x is None else x.cpu() for x in out]


def test_cuda_dense_on_side_stream(require_cuda, monkeypatch):
    g = _cuda(np.random.default_rng(3).standard_normal((2049, 3001)).astype(np.float32),
              require_cuda)
    kw = dict(max_norm=1.0, noise_multiplier=1.0, seed=13, offset=0)
    ref = nf.clip_and_noise(g, **kw)
    _replay()
    res, host = _on_busy_default_stream(
        require_cuda, lambda: (lambda r: (r.grad, r.norms))(nf.clip_and_noise(g, **kw)),
        monkeypatch)
    assert _bitwise(host[0], ref.grad.cpu()) and _bitwise(host[1], ref.norms.cpu())
    assert _bitwise(res[0], ref.grad)


def test_cuda_mix_on_side_stream(require_cuda, monkeypatch):
    rng = np.random.default_rng(4)
    X = _cuda(rng.standard_normal((3000, 700)).astype(np.float32), require_cuda)
    lab = _cuda(rng.integers(0, 5, 3000), require_cuda)
    kw = dict(num_samples=400, mixup_degree=200, noise_std_x=0.1, noise_std_y=0.1, num_classes=5,
              class_rate=0.6, clip_x=1.0, seed=14, offset=0, return_groups=True)
    ref = nf.mix(X, lab, **kw)
    _replay()
    groups = {}

    def run():
        r = nf.mix(X, lab, **kw)
        groups["plan"] = r.groups
        return r.x, r.y, r.counts
    res, host = _on_busy_default_stream(require_cuda, run, monkeypatch)
    for h, r in zip(host, (ref.x, ref.y, ref.counts)):
        assert _bitwise(h, r.cpu())
    _assert_same_groups(groups["plan"], ref.groups)


def _bookkeeping_model():
    import torch
    from torch import nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(40, 16, padding_idx=0)
            self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(
                16, 4, 32, dropout=0.0, batch_first=True), 2, enable_nested_tensor=False)
            self.conv = nn.Conv1d(16, 8, 3, padding=1, groups=2)
            self.norm = nn.GroupNorm(2, 8)
            self.head = nn.Linear(8, 3)

        def forward(self, idx):
            h = self.enc(self.emb(idx)).transpose(1, 2)          # (B, 16, T)
            return self.head(self.norm(self.conv(h)).mean(2))
    torch.manual_seed(0)
    return Net()


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_cuda_ghost_clipper_matches_cpu(require_cuda, dtype):
    """Book-keeping clipping of an embedding + transformer + grouped conv + group norm
    net on CUDA equals the CPU step (same seed and offset, noise on): every block
    kind (pair, instantiated, GhostBlock) through the CUDA kernels."""
    import torch
    from torch import nn
    from ncdp_fast.torch import GhostClipper
    dt = getattr(torch, dtype)
    idx = torch.randint(0, 40, (6, 9), generator=torch.Generator().manual_seed(1))
    y = torch.arange(6) % 3
    grads = []
    for dev in ("cpu", require_cuda):
        with on_host(require_cuda) if dev == "cpu" else _nullcontext():
            model = _bookkeeping_model().to(device=dev, dtype=dt)
            clipper = GhostClipper(model, max_grad_norm=0.3, noise_multiplier=0.5,
                                   expected_batch_size=6.0, seed=4242, offset=0)
            with pytest.warns(nf.NoiseReuseWarning) if dev != "cpu" else _nullcontext():
                nn.functional.cross_entropy(model(idx.to(dev)), y.to(dev)).backward()
                res = clipper.privatize_()
        assert res.num_clipped > 0
        grads.append(torch.cat([p.grad.reshape(-1).cpu() for p in model.parameters()]))
    tol = 2e-4 if dtype == "float32" else 1e-10
    torch.testing.assert_close(grads[1], grads[0], rtol=tol, atol=tol)


def _nullcontext():
    import contextlib
    return contextlib.nullcontext()


@pytest.mark.parametrize("order", sorted(LAYER_ORDERS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_first_norms_need_no_zeroed_buffer(require_cuda, order, dtype, monkeypatch):
    """On the device the step's first norms are written into a buffer nobody
    zeroed (a kernel fewer a step), the rank-1 kernel writes the operands'
    sizes and the factors' kernel the grad_scale weights: with every fresh
    buffer NaN (or all-ones bytes), the norms and grads are bit for bit the
    clean run's, whichever block comes first."""
    from ncdp_fast import _arrays
    io = type(_arrays.io_for(_cuda(np.zeros(1), require_cuda)))
    _replay()
    clean, dirty = poisoned_layers_run(LAYER_ORDERS[order], dtype,
                                       lambda x: _cuda(x, require_cuda), io, monkeypatch)
    assert np.all(np.isfinite(_host(clean.norms)))
    assert np.array_equal(_host(clean.norms), _host(dirty.norms))
    for x, y in zip(_flat(clean.grads), _flat(dirty.grads)):
        assert np.array_equal(x, y)


@pytest.mark.parametrize("shape", NORM_AFFINE_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_norm_affine_grads_against_the_reference_and_the_cpu(require_cuda, shape, dtype):
    """The normalisation layers' per-sample affine gradients on the device:
    within the float64 sums' rounding of the reference, device arrays out, and
    the CPU twin's values to that rounding too (the two sum in one order but
    may contract differently)."""
    from ncdp_fast._norm_affine import norm_affine_grads
    x, g = norm_affine_case(shape, dtype)
    w, b = norm_affine_grads(_cuda(x, require_cuda), _cuda(g, require_cuda), run=shape[3],
                             eps=1e-5)
    assert _on(w, require_cuda) and _on(b, require_cuda)
    assert_norm_affine_close(w, b, x, g, shape[3], 1e-5, dtype)
    cw, cb = norm_affine_grads(x, g, run=shape[3], eps=1e-5)
    assert_norm_affine_close(cw, cb, x, g, shape[3], 1e-5, dtype)


@pytest.mark.parametrize("shape", [(3, 70, 37), (2, 128, 768), (4, 9, 5), (1, 200, 1),
                                   (1, 66, 2000)], ids=lambda s: "x".join(map(str, s)))
def test_cuda_gram_kernel_against_the_reference_and_the_gemm(require_cuda, shape):
    """The float64 Grams of float32 rows on the FP64 tensor cores (a GPU's
    mma fragments, or their shuffle form on the emulated device): within
    gamma_d of the reference, exactly symmetric, within 2 gamma_d of the
    float64 copies' GEMM, and the device passed the kernel's own check (its
    route is taken).  (2, 128, 768) and (1, 66, 2000) are launches of 6 and 3
    jobs, split into 3 and 7 k-ranges whose partial Grams a second kernel
    adds."""
    from ncdp_fast._cuda import gram as gram_plan
    assert gram_plan.split(gram_plan.jobs(1, shape[0], shape[1]), shape[2])[0] == {
        (2, 128, 768): 3, (1, 66, 2000): 7}.get(shape, 1)
    import torch
    from test_gram_f64 import assert_grams_close, rows
    from ncdp_fast._cuda import gram
    x = rows(shape, 5)
    t = _cuda(x, require_cuda)
    assert gram.applies([t])
    w = gram.grams_f64([t])
    assert _on(w, require_cuda) and torch.equal(w, w.transpose(1, 2))
    assert_grams_close(_host(w), x)
    with gram.copies_route():
        w_gemm = _host(gram.grams_f64([t]))
    x64 = x.astype(np.float64)
    mags = np.einsum("itk,isk->its", np.abs(x64), np.abs(x64))
    d = shape[2]
    assert np.all(np.abs(_host(w) - w_gemm) <= 2 * d * 2.0 ** -53 / (1 - d * 2.0 ** -53) * mags)


def test_cuda_gram_kernel_takes_a_transposed_part_in_its_launch(require_cuda):
    """A float32 part with a strided last axis (attention's key gradient as
    autograd hands it over) goes to the kernel through a row-major copy, in
    one launch with the parts read as they lie, on the device itself: each
    part's Grams within gamma_d of the reference, the caller's view intact."""
    import torch
    from test_gram_f64 import assert_grams_close, rows
    from ncdp_fast._cuda import gram
    x = [rows((2, 70, 37), s) for s in (8, 9)]
    plain = _cuda(x[0], require_cuda)
    transposed = _cuda(x[1].transpose(0, 2, 1), require_cuda).transpose(1, 2)
    assert transposed.stride(2) != 1 and gram.applies([plain, transposed])
    before = transposed.clone()
    w = gram.grams_f64([plain, transposed])
    assert _on(w, require_cuda)
    assert_grams_close(_host(w), np.concatenate(x))
    assert torch.equal(transposed, before) and transposed.stride(2) != 1
