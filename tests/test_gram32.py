"""Norms from float32 Grams (``gram_precision="float32"``, docs/privacy.md,
"Norms from float32 Grams"): the error model bounds every Gram a float32
GEMM can give, the twins agree with the reference, and the clip op keeps each
contribution within C, falls back to float64 norms where a float32 Gram
overflows, and changes nothing off the device."""
from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ncdp_fast as nf
from ncdp_fast import reference as R
from ncdp_fast._numba import clip as numba_clip

pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")


def _exact(a, g, bias):
    """(||sum_t g_t [a_t, b]^T||_F^2, sum_t ||g_t|| (||a_t|| + b)^2 as its
    square's bound E^2) of one sample, in exact rational arithmetic: the
    first exactly, the second as E (a float64 within 1e-15 of it)."""
    T, d = a.shape
    A = [[Fraction(float(x)) for x in row] for row in a]
    G = [[Fraction(float(x)) for x in row] for row in g]
    total = Fraction(0)
    for k in range(g.shape[1]):
        for j in range(d):
            s = sum(G[t][k] * A[t][j] for t in range(T))
            total += s * s
        if bias:
            s = sum(G[t][k] for t in range(T))
            total += s * s
    a64, g64 = a.astype(np.float64), g.astype(np.float64)
    E = float((np.linalg.norm(g64, axis=1) * (np.linalg.norm(a64, axis=1) + bias)).sum())
    return total, E


def _operands(draw_or_rng, T, d, K, kind, rng):
    """float32 (a, g) of one sample: ``kind`` picks magnitudes that stress the
    model (cancellation across positions, huge, tiny and subnormal values)."""
    a = rng.standard_normal((T, d))
    g = rng.standard_normal((T, K))
    if kind == "cancel":        # equal inputs, opposite output gradients: sum ~ 0
        a[:] = a[:1]
        g[1::2] = -g[0:T - T % 2:2][:g[1::2].shape[0]]
    elif kind == "scales":      # each position its own scale over 60 decades
        a *= 10.0 ** rng.uniform(-30, 15, (T, 1))
        g *= 10.0 ** rng.uniform(-30, 15, (T, 1))
    elif kind == "subnormal":   # values among float32's subnormals beside normal ones
        a *= 10.0 ** rng.choice([-42.0, -40.0, -20.0, 0.0], (T, d))
        g *= 10.0 ** rng.choice([-41.0, -38.0, 0.0], (T, K))
    return a.astype(np.float32), g.astype(np.float32)


def _worst_grams(a, g, rng):
    """Float32 Grams as a GEMM might give them, pushed to the model's limit:
    each entry moved by up to the whole bound of reference.gram32_rounding,
    in random directions (diagonals kept >= 0, as a sum of squares is)."""
    out = []
    for x in (a, g):
        x64 = x.astype(np.float64)
        exact = x64 @ x64.T
        gamma, eta1, eta0 = R.gram32_rounding(x.shape[1])
        n = np.linalg.norm(x64, axis=1)
        bound = gamma * np.outer(n, n) + eta1 * (n[:, None] + n[None, :]) + eta0
        moved = exact + bound * rng.uniform(-1.0, 1.0, exact.shape)
        np.fill_diagonal(moved, np.maximum(np.diagonal(moved), 0.0))
        out.append(moved)
    return out


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), T=st.integers(1, 4), d=st.integers(1, 5),
       K=st.integers(1, 5), kind=st.sampled_from(["plain", "cancel", "scales", "subnormal"]),
       bias=st.booleans(), worst=st.booleans())
def test_float32_gram_norms_bound_the_exact_norm(seed, T, d, K, kind, bias, worst):
    """For any float32 operands and any Grams within the float32 model of them
    (a GEMM's, or the model's extreme), the reference's norm is at least the
    exact squared norm and its spread at least the exact E: the clip rule's
    bound then holds as for float64 Grams.  (An overflowed Gram gives inf:
    the clip op forms that step's norms again in float64.)"""
    rng = np.random.default_rng(seed)
    a, g = _operands(None, T, d, K, kind, rng)
    if worst:
        w, v = _worst_grams(a, g, rng)
    else:
        w, v = a @ a.T, g @ g.T                  # float32 GEMMs (BLAS)
    sq, spread, _ = R.linear_norms_from_grams(w[None], v[None], bias, lengths=(d, K))
    if not np.isfinite(sq[0]):
        return
    exact, E = _exact(a, g, bias)
    assert Fraction(float(sq[0])) >= exact
    assert spread[0] >= E * (1 - 1e-12)


def test_the_model_constants_are_the_formulas():
    gamma, eta1, eta0 = R.gram32_rounding(768)
    assert gamma == 768 * 2.0 ** -24 / (1 - 768 * 2.0 ** -24)
    assert eta1 == 2.0 ** -125 * np.sqrt(768) and eta0 == 768 * 2.0 ** -124
    for bad in (0, 2**20 + 1):
        with pytest.raises(ValueError, match=f"n: expected a dot-product length in .* got {bad}"):
            R.gram32_rounding(bad)


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_numba_twin_of_float32_grams_matches_the_reference(shared, bias):
    rng = np.random.default_rng(int(shared) + 2 * int(bias))
    B, L, T, d, K = 3, 2, 5, 6, 4
    a = rng.standard_normal((L * B, T, d)).astype(np.float32)
    g = rng.standard_normal((L * B, T, K)).astype(np.float32)
    w, v = a @ a.transpose(0, 2, 1), g @ g.transpose(0, 2, 1)
    if shared:
        w = np.ascontiguousarray(w[:B])
    want = R.linear_norms_from_grams(w, v, bias, L, shared, lengths=(d, K))
    plain = R.linear_norms_from_grams(w, v, bias, L, shared)
    assert np.all(want[0] > plain[0]) and np.all(want[1] > plain[1])
    sq, spread, sizes = np.zeros(B), np.zeros(B), np.zeros((L * B, 2))
    numba_clip.linear_norms_from_grams(w, v, bias, sq, False, spread, sizes, L, shared, (d, K))
    eps = np.finfo(np.float64).eps
    np.testing.assert_allclose(sq, want[0], rtol=(L * T * T + 3 * T + 16) * eps)
    np.testing.assert_allclose(spread, want[1], rtol=(L * T + 8) * eps)
    np.testing.assert_allclose(sizes, want[2], rtol=(T + 1) * eps)


def _pairs(rng, B=5, T=6, d=24, K=16):
    torch = pytest.importorskip("torch")
    a = torch.tensor(rng.standard_normal((B, T, d)), dtype=torch.float32)
    g = torch.tensor(rng.standard_normal((B, T, K)), dtype=torch.float32)
    return a, g


def _clip(layers, device, **kw):
    import ncdp_fast._backend as be
    args = dict(max_norm=1.0, noise_multiplier=0.0, seed=3)
    args.update(kw)
    return nf.clip_and_noise_layers(layers, **args)


@pytest.mark.gpu
def test_the_clip_op_with_float32_grams_clips_within_c(require_cuda):
    """On the device, float32 norms are upper bounds: every norm is at least
    the float64 route's (to its rounding) and above it by no more than the
    model allows, each sample's clipped contribution stays within C, and the
    float64 route's result is unchanged by the option's existence."""
    import torch
    rng = np.random.default_rng(7)
    a, g = _pairs(rng)
    a, g = a.to(require_cuda), g.to(require_cuda)
    a2, g2 = a[:, :, :16].contiguous() * 3, g * 0.5
    r64 = _clip([(a, g), (a2, g2)], require_cuda)
    r32 = _clip([(a, g), (a2, g2)], require_cuda, gram_precision="float32")
    n64, n32 = r64.norms.cpu().numpy(), r32.norms.cpu().numpy()
    # Raised by each layer's (positive) error term: strictly above.
    assert np.all(n32 > n64)
    assert np.all(n32 <= n64 * (1 + 1e-3))
    assert r32.num_nonfinite == 0
    # One sample at a time: its noiseless sum is its clipped contribution.
    for i in range(a.shape[0]):
        one = _clip([(a[i:i + 1], g[i:i + 1]), (a2[i:i + 1], g2[i:i + 1])], require_cuda,
                    gram_precision="float32")
        total = sum(float((x.double() ** 2).sum()) for pair in one.grads for x in pair)
        assert total <= 1.0


@pytest.mark.gpu
def test_a_float32_gram_overflow_falls_back_to_float64_norms(require_cuda):
    """|a_t|^2 past float32's range: the float32 Gram overflows, the step forms
    its norms again in float64, and nothing is dropped: the result is the
    float64 route's, bit for bit; a truly non-finite row is still refused."""
    import torch
    rng = np.random.default_rng(8)
    a, g = _pairs(rng)
    a[1] *= 1e20
    a, g = a.to(require_cuda), g.to(require_cuda)
    r64 = _clip([(a, g)], require_cuda)
    r32 = _clip([(a, g)], require_cuda, gram_precision="float32")
    assert r32.num_nonfinite == 0
    assert torch.equal(r32.norms, r64.norms)
    assert torch.equal(r32.grads[0][0], r64.grads[0][0])
    assert torch.equal(r32.grads[0][1], r64.grads[0][1])
    g[2, 0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"per-sample gradients of rows \[2\]"):
        _clip([(a, g)], require_cuda, gram_precision="float32")
    dropped = _clip([(a, g)], require_cuda, gram_precision="float32", nan_policy="zero")
    assert dropped.num_nonfinite == 1


def test_float32_grams_change_nothing_on_the_cpu():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(9)
    a, g = _pairs(rng)
    r64 = _clip([(a, g)], None)
    r32 = _clip([(a, g)], None, gram_precision="float32")
    assert torch.equal(r64.norms, r32.norms) and torch.equal(r64.grads[0][0], r32.grads[0][0])
    with pytest.raises(ValueError, match="gram_precision: expected one of .* got 'float16'"):
        _clip([(a, g)], None, gram_precision="float16")


@pytest.mark.gpu
def test_ghost_clipper_steps_with_float32_grams(require_cuda):
    """The drop-in's option: a transformer step through PrivacyEngine with
    gram_precision="float32" gives the float64 step's gradients to the
    model's bound (the factors differ by at most its relative error), and an
    unknown precision is refused by name."""
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader, TensorDataset
    from ncdp_fast.torch import PrivacyEngine
    nn = torch.nn

    def step(precision):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(50, 32), nn.Linear(32, 48), nn.GELU(),
                              nn.Linear(48, 32), nn.LayerNorm(32), nn.Linear(32, 5))
        model = model.to(require_cuda)
        ids = torch.randint(0, 50, (8, 12), generator=torch.Generator().manual_seed(1))
        y = torch.randint(0, 5, (8,), generator=torch.Generator().manual_seed(2))
        data = TensorDataset(ids.to(require_cuda), y.to(require_cuda))
        pm, opt, loader = PrivacyEngine(accountant="rdp").make_private(
            module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            data_loader=DataLoader(data, batch_size=8), noise_multiplier=0.0,
            max_grad_norm=0.05, seed=3, gram_precision=precision)
        # The private loader's batch (the step must be on it): one batch a
        # pass, q = 1, so the whole data in index order in both runs.
        xb, yb = next(iter(loader))
        assert torch.equal(xb, data.tensors[0]) and torch.equal(yb, data.tensors[1])
        opt.zero_grad()
        torch.nn.functional.cross_entropy(pm(xb).mean(1), yb).backward()
        opt.step()
        return [p.detach().clone() for p in model.parameters()]

    w64, w32 = step("float64"), step("float32")
    for x, y in zip(w64, w32):
        torch.testing.assert_close(y, x, rtol=1e-3, atol=1e-6)
    # Every sample is clipped (C = 0.05): the tighter bound moves the weights.
    assert any(not torch.equal(x, y) for x, y in zip(w64, w32))
    with pytest.raises(ValueError, match="gram_precision: expected one of"):
        step("bfloat16")


def _tied_uses(device, scale=1.0, B=3, T=4, Te=5, V=200, D=8, seed=11):
    import torch
    from ncdp_fast.torch.tied import IndexUse, PairUse
    gen = torch.Generator().manual_seed(seed)
    a = (torch.randn(B, T, D, generator=gen) * scale).to(device)
    g = torch.randn(B, T, V, generator=gen).to(device)
    idx = torch.randint(0, V, (B, Te), generator=gen).to(device)
    h = torch.randn(B, Te, D, generator=gen).to(device)
    return [PairUse(a, g), IndexUse(idx, h)], (V, D), B


@pytest.mark.gpu
def test_a_tied_heads_ghost_norms_with_float32_grams(require_cuda):
    """A tied weight's ghost form (an LM head tied to its embedding) on the
    device: with float32 Grams its norms and spread are above the float64
    form's by at most the model's bound, and its float64 norms on request are
    the float64 form's, bit for bit."""
    import torch
    from ncdp_fast.torch.tied import combine
    uses, shape, B = _tied_uses(require_cuda)
    b64 = combine(uses, shape, torch.float32, B)
    b32 = combine(uses, shape, torch.float32, B, gram32=True)
    assert b64.float64_norms is None and b32.float64_norms is not None
    assert bool((b32.sq_norms > b64.sq_norms).all())
    assert bool((b32.sq_norms <= b64.sq_norms * (1 + 1e-3)).all())
    assert bool((b32.spread >= b64.spread).all())
    sq, spread = b32.float64_norms()
    assert torch.equal(sq, b64.sq_norms) and torch.equal(spread, b64.spread)


@pytest.mark.gpu
def test_a_tied_heads_float32_gram_overflow_falls_back(require_cuda):
    """|a_t|^2 past float32's range in the tied head: its float32 norms are
    not finite, the op takes the block's float64 norms, and the step equals
    the float64 form's (nothing dropped)."""
    import torch
    from ncdp_fast.torch.tied import combine
    uses, shape, B = _tied_uses(require_cuda, scale=1e20)
    b64 = combine(uses, shape, torch.float32, B)
    b32 = combine(uses, shape, torch.float32, B, gram32=True)
    assert not bool(torch.isfinite(b32.sq_norms).all())
    r64 = _clip([b64], require_cuda)
    r32 = _clip([b32], require_cuda)
    assert r32.num_nonfinite == 0
    assert torch.equal(r32.norms, r64.norms) and torch.equal(r32.grads[0], r64.grads[0])


@pytest.mark.gpu
def test_a_tied_head_masks_its_gradient_only_in_a_step_that_drops_a_row(require_cuda,
                                                                        monkeypatch):
    """The tied head's clipped sum copies its (B, T, V) gradient with dropped
    rows zeroed only when the op dropped one (GhostBlock.unmasked_sum): a
    NaN row is still kept out of the sum, which equals the other samples'."""
    import torch
    from ncdp_fast.torch.tied import IndexUse, PairUse, combine
    calls = []
    real = torch.Tensor.masked_fill
    monkeypatch.setattr(torch.Tensor, "masked_fill",
                        lambda self, *a, **k: calls.append(self.shape) or real(self, *a, **k))
    uses, shape, B = _tied_uses(require_cuda)
    res = _clip([combine(uses, shape, torch.float32, B)], require_cuda)
    assert res.num_nonfinite == 0 and calls == []
    pair, index = uses
    bad = PairUse(pair.a, pair.g.clone())
    bad.g[1, 0, 0] = float("nan")
    res = _clip([combine([bad, index], shape, torch.float32, B)], require_cuda, nan_policy="zero")
    assert res.num_nonfinite == 1 and len(calls) == 2
    keep = [0, 2]
    rest = [PairUse(pair.a[keep], pair.g[keep]), IndexUse(index.idx[keep], index.h[keep])]
    want = _clip([combine(rest, shape, torch.float32, 2)], require_cuda)
    torch.testing.assert_close(res.grads[0], want.grads[0], rtol=1e-5, atol=1e-6)
