"""Arrays in unusual layouts and types at the kernel-level API (the eighth
audit): what is accepted equals the same call on a plain C-contiguous copy,
bit for bit; what the conversions would misread is refused naming the
argument."""
from __future__ import annotations

import numpy as np
import pytest

import ncdp_fast as nf
from ncdp_fast import GhostBlock, _stream

torch = pytest.importorskip("torch")

KW = dict(max_norm=1.0, noise_multiplier=0.5, seed=11, offset=0)


def _replay(fn, *variants):
    """fn(variant) for each variant at the same seed and offset: equal bits are
    the point, so each call starts from a clear record of drawn ranges."""
    out = []
    for v in variants:
        _stream._LEDGER.clear()
        out.append(fn(v))
    return out


def _neg_view(x):
    """x's values held as a negative view (the neg bit set, row-major): what
    a conjugate's ``.imag`` or torch._neg_view hands over."""
    v = torch._neg_view(-x)
    assert v.is_neg() and v.is_contiguous() and torch.equal(v, x)
    return v


def _ops_on(g, a, b, X, y):
    """Each op whose device route reads a pointer of its input, on these
    inputs: (clip grads, linear sums, mix features)."""
    clip = nf.clip_and_noise(g, **KW).grad
    lin = nf.clip_and_noise_linear(a, b, **{**KW, "offset": 1000})
    mixed = nf.mix(X, y, num_classes=3, num_samples=4, mixup_degree=2, noise_std_x=0.1,
                   noise_std_y=0.1, seed=5, offset=0)
    return clip, lin.grad_weight, lin.grad_bias, mixed.x, mixed.y


def _inputs(dtype):
    r = torch.Generator().manual_seed(3)
    g = torch.randn(6, 10, generator=r, dtype=dtype)
    a = torch.randn(5, 3, 7, generator=r, dtype=dtype)        # K = 4 < d = 7
    b = torch.randn(5, 3, 4, generator=r, dtype=dtype)
    X = torch.randn(9, 5, generator=r, dtype=dtype)
    y = torch.arange(9) % 3
    return g, a, b, X, y


def _check_negative_views_read_as_their_values(dtype):
    g, a, b, X, y = _inputs(dtype)
    plain, neg = _replay(lambda f: _ops_on(*f(g, a, b, X)), lambda *t: (*t, y),
                         lambda *t: (*map(_neg_view, t), y))
    for p, n in zip(plain, neg):
        assert torch.equal(p, n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_negative_views_on_the_cpu_route(dtype):
    # torch's .numpy() refuses a negative view (a raw RuntimeError naming no argument)
    _check_negative_views_read_as_their_values(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_negative_views_on_the_device_route(require_cuda, dtype):
    # The device route read a row-major negative view's pointer: the negated
    # values (clip, linear, mix differed by 1.2 to 5 on the emulated device).
    _check_negative_views_read_as_their_values(dtype)


def test_a_ghost_blocks_negative_sum_reads_as_its_values():
    H = torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    sq = (H ** 2).sum(1)

    def run(wrap):
        block = GhostBlock(sq, lambda f: wrap((f[:, None] * H).sum(0)), (4,), 4)
        return nf.clip_and_noise_layers([H.clone(), block], **KW).grads[1]
    plain, neg = _replay(run, lambda t: t, _neg_view)
    assert torch.equal(plain, neg)


def test_a_torch_tensor_subclass_is_a_tensor():
    class Sub(torch.Tensor):
        pass
    g = torch.randn(4, 6, dtype=torch.float64)
    plain, sub = _replay(lambda x: nf.clip_and_noise(x, **KW).grad, g, g.as_subclass(Sub))
    assert torch.equal(plain, torch.Tensor(sub))


@pytest.mark.parametrize("make, said", [
    (lambda g: np.ma.masked_array(g, mask=np.zeros(g.shape, bool)), "masked array"),
    (lambda g: torch.from_numpy(g).to_sparse(), "layout torch.sparse_coo"),
    (lambda g: torch.nested.nested_tensor([torch.from_numpy(g[0]), torch.from_numpy(g[1])]),
     "nested tensor"),
])
def test_arrays_whose_conversion_would_misread_them_are_refused(make, said):
    # A masked array's mask was dropped (its masked rows clipped and summed:
    # norms [2, 200, 2] for rows of 1, 100, 1); sparse and nested tensors
    # raised torch's own errors naming no argument.
    g = np.ones((3, 4))
    with pytest.warns(UserWarning) if "nested" in said else _nothing():
        x = make(g)
    with pytest.raises(TypeError, match=f"grads: expected a .*{said}"):
        nf.clip_and_noise(x, **KW)
    if "masked" in said:          # the host-side conversions of the estimators and release
        from ncdp_fast import _validate
        for check in (_validate.as_matrix, _validate.check_features):
            with pytest.raises(TypeError, match="X: expected a plain array, got a NumPy masked"):
                check(np.ma.masked_array(np.ones((4, 2))), "X")


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_ghost_block_spread_is_each_samples():
    r = np.random.default_rng(0)
    H, D = r.standard_normal((5, 3, 4)), r.standard_normal((5, 6))
    sq = (H.sum(1) ** 2).sum(1)
    spread = np.sqrt((H ** 2).sum(2)).sum(1)

    def run(sp):
        block = GhostBlock(sq, lambda f: (f[:, None] * H.sum(1)).sum(0), (4,), 16, spread=sp,
                           seq_len=3)
        return nf.clip_and_noise_layers([D, block], **KW)
    _stream._LEDGER.clear()
    run(spread)
    # (1,) and 0-d were broadcast (sample 0's margin for every sample); (B, 1)
    # and (2B,) raised NumPy's broadcasting error; float32 was taken as it came.
    for bad in (spread[:1], spread[0], spread[:, None], np.r_[spread, spread],
                spread.astype(np.float32)):
        _stream._LEDGER.clear()
        with pytest.raises(ValueError, match=r"layers\[1\]\.spread: expected a \(5,\) float64"):
            run(bad)
    with pytest.raises(TypeError, match=r"layers\[1\]\.spread: expected an array"):
        run(list(spread))


def test_ghost_blocks_read_only_sum_is_refused_by_name():
    H = np.random.default_rng(0).standard_normal((5, 4))

    def read_only(f):
        out = (f[:, None] * H).sum(0)
        out.setflags(write=False)
        return out
    # numba's TypingError (setitem on a readonly array) before
    with pytest.raises(ValueError, match=r"clipped_sum\(\): expected a freshly allocated, "
                                         r"writable array"):
        nf.clip_and_noise_layers([H.copy(), GhostBlock((H ** 2).sum(1), read_only, (4,), 4)],
                                 **KW)


@pytest.mark.parametrize("flag", ["False", 0.0, np.array([0, 1])])
def test_a_pairs_bias_flag_is_a_bool(flag):
    # read with bool(): "False" turned the bias on, 0.0 off
    a, g = np.ones((3, 4)), np.ones((3, 2))
    with pytest.raises(TypeError, match=r"layers\[0\]\[2\] \(bias\): expected a bool"):
        nf.clip_and_noise_layers([(a, g, flag)], **KW)


@pytest.mark.parametrize("bias, message", [
    (np.ones(6, complex), r"biases\[0\]: expected float32 or float64, got dtype complex128"),
    (np.ones(6, object), r"biases\[0\]: expected float32 or float64, got dtype object"),
    (np.ones(6, np.float32), r"biases\[0\]: dtype float32 differs from x's float64"),
])
def test_ntk_gram_checks_the_biases_dtype(bias, message):
    r = np.random.default_rng(0)
    x, W = r.standard_normal((5, 3)), [r.standard_normal((6, 3)), r.standard_normal((2, 6))]
    with pytest.raises(TypeError, match=message):
        nf.ntk_gram(x, W, biases=[bias, None])
    with pytest.raises(TypeError, match=r"biases\[1\]: expected float32 or float64"):
        nf.ntk_gram(x, W, biases=[None, np.ones(2) + 1j])      # was accepted, imaginary part dropped


def test_mix_class_rate_takes_any_float_tensor():
    X = torch.randn(12, 5, dtype=torch.float64)
    y = torch.arange(12) % 3

    def run(rate):
        return nf.mix(X, y, num_classes=3, class_rate=rate, num_samples=2, mixup_degree=3,
                      noise_std_x=0.1, noise_std_y=0.1, seed=1, offset=0).x
    # torch's raw errors from np.asarray before (requires grad, bfloat16, neg bit)
    half = torch.full((3,), 0.5)
    want, *got = _replay(run, 0.5, half.requires_grad_(), half.detach().bfloat16(),
                         _neg_view(torch.full((3,), 0.5, dtype=torch.float64)))
    for g in got:
        assert torch.equal(want, g)
    # Refused before the draw's range is claimed (after it, until the eighth
    # audit: a corrected call at the same offset was then warned as reuse).
    with pytest.raises(TypeError, match="class_rate: expected"):
        run(torch.full((3,), 0.5) + 0j)
    with pytest.raises(ValueError, match="class_rate: q_k"):
        run(0.01)
