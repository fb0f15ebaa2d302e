"""Tied weights (issues 25, 26): one Parameter used by several supported layers
(the embedding of a language model tied to its output Linear; one Linear
weight in two Linear layers) is one parameter of the private gradient, in the
ghost form (ncdp_fast/torch/tied.py: no per-sample V*D tensor) or the dense one,
whichever costs less; the ``form`` fixture forces each in turn, so that every
exactness test runs through both.

Oracle.  ``torch.func`` per-sample gradients of the model's parameters
(``functional_call`` ties the shared weight, so its per-sample gradient is the
sum over its uses); expected private gradient ``sum_i min(1, C/||g_i||) g_i /
B`` with the norm over all parameters (tests/test_torch_layers.py's helpers).
Tolerance: float64, relative 1e-10, as test_torch_layers.py (the clip factor's
rounding margin is ~1e-15 there).  C lies between the two smallest per-sample
norms, so every sample but one is clipped, and the factor moves the result by
far more than the tolerance.
"""
import copy
import math

import numpy as np

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from ncdp_fast.torch import GhostClipper, PrivacyEngine, tied  # noqa: E402

from test_torch_layers import (F64, RTOL, assert_factor_matters, assert_grads_close,  # noqa: E402
                               clipped_mean, flat_norms, low_bound, per_sample_grads,
                               private_grads)
from conftest import gamma  # noqa: E402

V, D, T, B = 11, 6, 5, 6


@pytest.fixture(params=["ghost", "dense"])
def form(request, monkeypatch):
    """Force the ghost or the dense form of every tied weight (the cost rule
    would pick dense at these tiny shapes); yields the calls each form got."""
    used = {"ghost": 0, "dense": 0}
    ghost, dense = tied._ghost, tied._dense

    def count_ghost(*a, **kw):
        used["ghost"] += 1
        return ghost(*a, **kw)

    def count_dense(*a, **kw):
        used["dense"] += 1
        return dense(*a, **kw)
    monkeypatch.setattr(tied, "_ghost", count_ghost)
    monkeypatch.setattr(tied, "_dense", count_dense)
    monkeypatch.setattr(tied, "ghost_cheaper", lambda uses, shape: request.param == "ghost")
    yield used
    assert used[request.param] >= 1 and used["dense" if request.param == "ghost" else "ghost"] == 0


class TinyLM(nn.Module):
    """Embedding(V, D) -> Linear(D, D) -> Linear(D, V), head tied to the embedding."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.mid = nn.Linear(D, D)
        self.head = nn.Linear(D, V)
        self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(torch.tanh(self.mid(self.emb(idx))))


def lm_loss(call, idx, y, reduction="mean"):
    """Token cross-entropy, mean over the tokens of each sample (and the batch)."""
    logits = call(idx)
    per_token = nn.functional.cross_entropy(logits.reshape(-1, V), y.reshape(-1),
                                            reduction="none").reshape(y.shape)
    per_sample = per_token.mean(1)
    return per_sample.mean() if reduction == "mean" else per_sample.sum()


def _lm(seed=0):
    torch.manual_seed(seed)
    return TinyLM().double()


def _tokens(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)


def _check(model, loss_one, batch):
    ps = per_sample_grads(model, loss_one, batch)
    C = low_bound(ps)
    assert_factor_matters(ps, C, B, RTOL[F64])
    work = copy.deepcopy(model)
    got, res, clipper = private_grads(work, lambda m: loss_one(m, *batch), C=C, E=B)
    assert res.num_clipped >= 1 and res.num_clipped < B
    assert_grads_close(got, clipped_mean(ps, C, B), RTOL[F64])
    assert torch.allclose(torch.as_tensor(res.norms, dtype=F64), flat_norms(ps),
                          rtol=RTOL[F64], atol=0)
    return ps, clipper


def test_language_model_with_tied_head_equals_per_sample_clipping(form):
    model = _lm()
    idx, y = _tokens()
    ps, clipper = _check(model, lm_loss, (idx, y))
    # One parameter, listed once under its first layer.
    assert clipper.param_names == ["emb.weight", "mid.weight", "mid.bias", "head.bias"]
    assert list(ps) == ["emb.weight", "mid.weight", "mid.bias", "head.bias"]
    # The cross terms between the two uses matter: the norm of the summed
    # gradient is not the root of the uses' squared norms.
    uses = {}
    for part in ("emb", "head"):
        frozen = copy.deepcopy(model)
        for n, p in frozen.named_parameters():
            p.requires_grad_(False)
        # The gradient of one use alone: the weight as a fresh leaf in that use.
        w = model.emb.weight.detach().clone()
        other = nn.Parameter(w.clone(), requires_grad=False)
        if part == "emb":
            frozen.head.weight = other
            frozen.emb.weight = nn.Parameter(w.clone())
        else:
            frozen.emb.weight = other
            frozen.head.weight = nn.Parameter(w.clone())
        uses[part] = per_sample_grads(frozen, lm_loss, (idx, y))[f"{part}.weight"]
    assert torch.allclose(uses["emb"] + uses["head"], ps["emb.weight"], rtol=1e-12, atol=1e-15)
    tied = ps["emb.weight"].reshape(B, -1).norm(dim=1)
    apart = (uses["emb"].reshape(B, -1).norm(dim=1) ** 2
             + uses["head"].reshape(B, -1).norm(dim=1) ** 2).sqrt()
    assert float(((tied - apart).abs() / tied).min()) > 1e-3


class TwoTied(nn.Module):
    """One Linear weight used by two Linear layers (own biases)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.b.weight = self.a.weight
        self.out = nn.Linear(4, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _ce(call, x, y, reduction="mean"):
    return nn.functional.cross_entropy(call(x), y, reduction=reduction)


def test_two_linear_layers_sharing_a_weight_equal_per_sample_clipping(form):
    torch.manual_seed(3)
    model = TwoTied().double()
    g = torch.Generator().manual_seed(4)
    x = torch.randn(B, 4, generator=g, dtype=F64)
    y = torch.randint(0, 3, (B,), generator=g)
    _, clipper = _check(model, _ce, (x, y))
    assert clipper.param_names == ["a.weight", "a.bias", "b.bias", "out.weight", "out.bias"]


def test_shared_linear_weight_on_sequences_in_the_instantiated_form():
    """Inputs (B, 3, 4): 2 T^2 = 18 > K d = 16, so the Linear rule forms the
    per-sample weight gradient itself (the (B, 4) case above is its ghost pair,
    instantiated for the tie)."""
    torch.manual_seed(5)
    model = TwoTied().double()
    g = torch.Generator().manual_seed(6)
    x = torch.randn(B, 3, 4, generator=g, dtype=F64)
    y = torch.randint(0, 3, (B, 3), generator=g)

    def loss(call, x, y, reduction="mean"):
        per_sample = nn.functional.cross_entropy(call(x).reshape(-1, 3), y.reshape(-1),
                                                 reduction="none").reshape(y.shape).sum(1)
        return per_sample.mean() if reduction == "mean" else per_sample.sum()
    _check(model, loss, (x, y))


class TiedConvs(nn.Module):
    """One Conv2d weight in two convolutions; the second's output is small
    (stride 2 without padding on 5x5: one position; or 2x2 positions on 7x7),
    so its rule takes the pair on im2col columns while the first forms its
    per-sample gradient: two uses laid out differently, summed as the weight."""

    def __init__(self, stride):
        super().__init__()
        self.c1 = nn.Conv2d(3, 3, 3, padding=1)
        self.c2 = nn.Conv2d(3, 3, 3, stride=stride)
        self.c2.weight = self.c1.weight
        self.out = nn.Linear(3, 2)

    def forward(self, x):
        return self.out(self.c2(torch.tanh(self.c1(x))).mean((2, 3)))


@pytest.mark.parametrize("size, stride", [(5, 2), (7, 2), (3, 1), (9, 1)])
def test_two_convolutions_sharing_a_weight_equal_per_sample_clipping(size, stride):
    """Until 2026-12-02 a small second use (a pair, (B, out, in*k*k)) was added
    to the other's (B, out, in, k, k) and failed with a raw shape error."""
    torch.manual_seed(7)
    model = TiedConvs(stride).double()
    g = torch.Generator().manual_seed(8)
    x = torch.randn(B, 3, size, size, generator=g, dtype=F64)
    y = torch.randint(0, 2, (B,), generator=g)
    _check(model, _ce, (x, y))


def test_per_layer_clipping_gives_the_shared_weight_one_bound(form):
    model = _lm()
    idx, y = _tokens()
    ps = per_sample_grads(model, lm_loss, (idx, y))
    bounds = [0.05, 0.3, 0.2, 0.1]
    work = copy.deepcopy(model)
    got, _, clipper = private_grads(work, lambda m: lm_loss(m, idx, y), C=bounds, E=B,
                                    clipping="per_layer")
    expected = {}
    for (name, g), c in zip(ps.items(), bounds):
        f = (c / g.reshape(B, -1).norm(dim=1)).clamp(max=1.0)
        assert float(f.min()) < 1.0
        expected[name] = torch.einsum("i,i...->...", f, g) / B
    assert_grads_close(got, expected, RTOL[F64])


def test_noise_is_drawn_once_for_the_shared_weight():
    model = _lm()
    idx, y = _tokens()
    clipper = GhostClipper(model, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=B,
                           seed=0, offset=0)
    lm_loss(model, idx, y).backward()
    clipper.privatize_()
    assert clipper.offset == sum(p.numel() for p in model.parameters())  # shared counted once
    assert model.head.weight.grad is model.emb.weight.grad


def test_make_private_with_a_tied_language_model_equals_per_sample_clipping(form):
    model = _lm()
    idx, y = _tokens()
    loader = DataLoader(TensorDataset(idx, y), batch_size=3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pm, popt, ploader = PrivacyEngine().make_private(
        module=model, optimizer=opt, data_loader=loader, noise_multiplier=0.0,
        max_grad_norm=0.05, seed=0)
    assert pm.clipper.param_names == ["emb.weight", "mid.weight", "mid.bias", "head.bias"]
    steps = 0
    for xb, yb in ploader:
        if xb.shape[0] == 0:
            continue
        oracle = _lm()                    # the clipper's hooks are on model
        oracle.load_state_dict(model.state_dict())
        ps = per_sample_grads(oracle, lm_loss, (xb, yb))
        expected = clipped_mean(ps, 0.05, popt.expected_batch_size)
        popt.zero_grad()
        lm_loss(pm, xb, yb).backward()
        popt.step()
        got = {n: p.grad for n, p in model.named_parameters()}
        assert_grads_close(got, expected, RTOL[F64])
        steps += 1
    assert steps >= 1 and model.head.weight is model.emb.weight


def test_shared_bias_is_refused():
    model = TwoTied()
    model.b.bias = model.a.bias
    with pytest.raises(ValueError, match=r"parameter 'b\.bias' is shared with 'a\.bias'.*weight"):
        GhostClipper(model, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=4)


def test_tied_use_outside_a_layer_stays_refused():
    model = _lm()
    idx, y = _tokens()
    clipper = GhostClipper(model, max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=B,
                           seed=0)
    loss = lm_loss(model, idx, y) + nn.functional.linear(
        model.mid(model.emb(idx)), model.emb.weight).square().mean()
    loss.backward()
    with pytest.raises(RuntimeError, match=r"'emb\.weight' \(Embedding\).*outside"):
        clipper.privatize_()


@settings(max_examples=15, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**31 - 1), C=st.floats(1e-3, 10.0))
def test_every_clipped_contribution_of_the_tied_model_is_within_C(seed, C):
    """Each sample's contribution (the private gradient of a batch holding only
    it, sum reduction, no noise) has norm <= C (1 + 1e-12: float64 rounding)."""
    model = _lm(seed % 1000)
    idx, y = _tokens(seed)
    clipper = GhostClipper(model, max_grad_norm=C, noise_multiplier=0.0, expected_batch_size=1,
                           loss_reduction="sum", seed=0)
    for i in range(2):
        model.zero_grad()
        lm_loss(model, idx[i:i + 1], y[i:i + 1], reduction="sum").backward()
        clipper.privatize_()
        norm = math.sqrt(sum(float(p.grad.square().sum()) for p in model.parameters()))
        assert norm <= C * (1 + 1e-12)


def test_physical_batches_of_a_tied_model_accumulate_to_the_logical_step(form):
    """accumulate_ (BatchMemoryManager's skipped steps) on two physical batches,
    privatize_ on the third: the clipped sum of the whole logical batch."""
    model = _lm()
    idx, y = _tokens()
    ps = per_sample_grads(model, lm_loss, (idx, y))
    C = low_bound(ps)
    clipper = GhostClipper(model, max_grad_norm=C, noise_multiplier=0.0, expected_batch_size=B,
                           seed=0)
    for lo, hi in ((0, 2), (2, 3), (3, B)):
        lm_loss(model, idx[lo:hi], y[lo:hi]).backward()
        if hi < B:
            clipper.accumulate_()
    clipper.privatize_()
    got = {n: p.grad for n, p in model.named_parameters()}
    assert_grads_close(got, clipped_mean(ps, C, B), RTOL[F64])


# ------------------------------------------------- the ghost form (issue 26)

class FlexLM(nn.Module):
    """Embedding(V, D) read at idx (B, T'), the tied head (no bias) reading T
    positions made from them: ``shift`` T = T' - 1 (a causal LM's), ``last``
    T = 1, ``twice`` T = 2 T'.  ``third``: a second Embedding sharing the
    weight, read at idx2 (B, T''), added as its mean over positions."""

    def __init__(self, v, d, mode, padding_idx=None, third=False):
        super().__init__()
        self.mode = mode
        self.emb = nn.Embedding(v, d, padding_idx=padding_idx)
        self.mid = nn.Linear(d, d)
        self.head = nn.Linear(d, v, bias=False)
        self.head.weight = self.emb.weight
        if third:
            self.emb2 = nn.Embedding(v, d)
            self.emb2.weight = self.emb.weight

    def forward(self, idx, idx2=None):
        h = self.emb(idx)
        if idx2 is not None:
            h = h + self.emb2(idx2).mean(1, keepdim=True)
        h = torch.tanh(self.mid(h))
        if self.mode == "shift":
            h = h[:, 1:]
        elif self.mode == "last":
            h = h[:, -1:]
        elif self.mode == "twice":
            h = torch.cat([h, h.flip(1)], 1)
        return self.head(h)


def _flex_loss(call, *xs, reduction="mean"):
    *inputs, y = xs
    logits = call(*inputs)
    per_sample = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                                             reduction="none").reshape(y.shape).mean(1)
    return per_sample.mean() if reduction == "mean" else per_sample.sum()


CASES = {
    # name: (V, D, mode, T', padding_idx, third, index range)
    "T=1": (9, 4, "last", 1, None, False, 9),
    "T!=T', padding_idx": (10, 5, "shift", 6, 0, False, 10),
    "T=2T', repeated rows": (12, 4, "twice", 4, None, False, 3),
    "three uses": (8, 3, "shift", 5, None, True, 8),
}


def _flex(case, seed=0, dtype=F64):
    v, d, mode, tp, pad, third, hi = CASES[case]
    torch.manual_seed(seed)
    model = FlexLM(v, d, mode, pad, third).to(dtype)
    g = torch.Generator().manual_seed(seed + 1)
    idx = torch.randint(0, hi, (B, tp), generator=g)
    if pad is not None:
        idx[::2, 0] = pad                   # padding in half of the samples
    t = {"shift": tp - 1, "last": 1, "twice": 2 * tp}[mode]
    y = torch.randint(0, v, (B, t), generator=g)
    batch = (idx, torch.randint(0, v, (B, 3), generator=g), y) if third else (idx, y)
    return model, batch


@pytest.mark.parametrize("case", sorted(CASES))
def test_awkward_shapes_equal_per_sample_clipping(case, form):
    """float64, relative 1e-10 against torch.func per-sample gradients, each
    form: T = 1, T != T' with padding rows, repeated rows, three uses."""
    model, batch = _flex(case)
    _check(model, _flex_loss, batch)


@pytest.mark.parametrize("case", ["T!=T', padding_idx", "three uses"])
def test_float32_ghost_form_within_its_rounding(case, monkeypatch):
    """float32 model, ghost form, against the float64 oracle of the same weights.
    Tolerance: the longest float32 sum of the step has at most n = 2 B T' + V + D
    terms (the clipped sum over the batch's positions of both uses, T <= T',
    after the head's dot products); gamma_n(float32) times 4 for the forward,
    the backward, the clipped sum and the factor: 2.1e-5 at the larger case
    (n = 87)."""
    monkeypatch.setattr(tied, "ghost_cheaper", lambda uses, shape: True)
    model, batch = _flex(case)
    ps = per_sample_grads(model, _flex_loss, batch)
    C = low_bound(ps)
    v, d, _, tp, *_ = CASES[case]
    rtol = 4 * gamma(B * 2 * tp + v + d, np.float32)
    assert_factor_matters(ps, C, B, rtol)
    work = copy.deepcopy(model).float()
    got, res, _ = private_grads(work, lambda m: _flex_loss(m, *batch), C=C, E=B)
    assert res.num_clipped >= 1 and res.num_clipped < B
    assert_grads_close(got, clipped_mean(ps, C, B), rtol)


def test_the_ghost_form_clipped_sum_runs_ieee_float32_whatever_tf32_is_set(monkeypatch):
    """The head's part of a tied weight's clipped sum is the linear layers'
    clipped GEMM (_cuda.clip.clipped_gemm): run with TF32 off even where the
    caller turned it on (TF32's 10-bit mantissas would pass the clip rule's
    margin on a GPU), the caller's setting back afterwards, and the result
    within float32's rounding as in the test above."""
    from ncdp_fast._cuda import clip as clip_ops
    monkeypatch.setattr(tied, "ghost_cheaper", lambda uses, shape: True)
    seen = []
    real = clip_ops.clipped_gemm

    def spy(*args, **kwargs):
        real_matmul = torch.matmul

        def watch(*a, **k):
            seen.append(torch.backends.cuda.matmul.allow_tf32)
            return real_matmul(*a, **k)
        with monkeypatch.context() as m:
            m.setattr(torch, "matmul", watch)
            return real(*args, **kwargs)

    monkeypatch.setattr(clip_ops, "clipped_gemm", spy)
    case = "three uses"
    model, batch = _flex(case)
    ps = per_sample_grads(model, _flex_loss, batch)
    C = low_bound(ps)
    v, d, _, tp, *_ = CASES[case]
    rtol = 4 * gamma(B * 2 * tp + v + d, np.float32)
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        got, res, _ = private_grads(copy.deepcopy(model).float(),
                                    lambda m: _flex_loss(m, *batch), C=C, E=B)
        assert torch.backends.cuda.matmul.allow_tf32 is True
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    assert seen and not any(seen)
    assert_grads_close(got, clipped_mean(ps, C, B), rtol)


def test_the_cost_rule_picks_ghost_for_a_large_vocabulary_and_dense_for_long_sequences():
    """Ghost when T_L^2 (V + D) + T_L T_E D + T_E D <= T_L V D + V D + T_E D."""
    def uses(t, v, d):
        return [tied.PairUse(torch.zeros(1, t, d), torch.zeros(1, t, v)),
                tied.IndexUse(torch.zeros(1, t, dtype=torch.long), torch.zeros(1, t, d))]
    assert tied.ghost_cheaper(uses(128, 50257, 768), (50257, 768))      # GPT-2's head
    assert not tied.ghost_cheaper(uses(64, 11, 6), (11, 6))
    # Embeddings only (no pair): rows, always ghost; any dense use: dense.
    assert tied.ghost_cheaper(uses(500, 4, 2)[1:], (4, 2))
    assert not tied.ghost_cheaper([torch.zeros(1, 5, 4)] + uses(1, 5, 4), (5, 4))


def _largest_allocation(run):
    """The largest number of bytes one operator allocated while ``run`` ran."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    return max(e.self_cpu_memory_usage for e in prof.events())


def test_the_ghost_form_allocates_no_per_sample_vocabulary_tensor():
    """V = 20000, D = 64, B = 8, T = 4, float32: the cost rule picks ghost, and
    no operator of backward and the step allocates B V D bytes or more, a
    quarter of the dense form's per-sample gradient (B V D * 4 bytes: 41 MB;
    its detection is checked by forcing the dense form).  The ghost form's
    largest are the head's output gradient in float64 and the weight's
    gradient, B T V * 8 and V D * 4 bytes: 5.1 MB each."""
    v, d, b, t = 20000, 64, 8, 4

    def step(force):
        torch.manual_seed(0)
        model = FlexLM(v, d, "shift")
        idx = torch.randint(0, v, (b, t + 1), generator=torch.Generator().manual_seed(1))
        y = torch.randint(0, v, (b, t), generator=torch.Generator().manual_seed(2))
        clipper = GhostClipper(model, max_grad_norm=1.0, noise_multiplier=0.0,
                               expected_batch_size=b, seed=0)
        loss = _flex_loss(model, idx, y)
        real = tied.ghost_cheaper
        try:
            if force:
                tied.ghost_cheaper = lambda uses, shape: False
            else:
                assert real([tied.PairUse(torch.zeros(1, t, d), torch.zeros(1, t, v)),
                             tied.IndexUse(idx[:1], torch.zeros(1, t + 1, d))], (v, d))
            return _largest_allocation(lambda: (loss.backward(), clipper.privatize_()))
        finally:
            tied.ghost_cheaper = real
            clipper.remove()
    dense_bytes = b * v * d * 4
    assert step(force=True) >= dense_bytes
    assert step(force=False) < dense_bytes // 4


@settings(max_examples=15, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**31 - 1), C=st.floats(1e-3, 10.0), exponent=st.integers(-8, 8),
       case=st.sampled_from(sorted(CASES)), dtype=st.sampled_from([torch.float32, F64]))
def test_every_clipped_contribution_of_the_ghost_form_is_within_C(seed, C, exponent, case, dtype):
    """One sample, sum reduction, no noise, ghost form: the private gradient is
    the sample's clipped contribution, of norm <= C (1 + gamma_{n+2}) over all
    n parameters (the norm's own float64 rounding), at loss scales 10^-8..10^8."""
    model, batch = _flex(case, seed % 1000, dtype)
    _assert_ghost_contributions_within_C(model, batch, C, 10.0 ** exponent, samples=2)


def _assert_ghost_contributions_within_C(model, batch, C, scale, samples):
    """The ghost form forced; each of the first ``samples`` rows of ``batch``
    alone, its loss (sum reduction) times ``scale``, no noise: the private
    gradient is that sample's clipped contribution, finite and of norm <= C
    (1 + gamma_{n+2}) over all n parameters (the norm's own float64 rounding)."""
    clipper = GhostClipper(model, max_grad_norm=C, noise_multiplier=0.0, expected_batch_size=1,
                           loss_reduction="sum", seed=0)
    real = tied.ghost_cheaper
    tied.ghost_cheaper = lambda uses, shape: True
    try:
        for i in range(samples):
            model.zero_grad()
            (_flex_loss(model, *[x[i:i + 1] for x in batch], reduction="sum") * scale).backward()
            clipper.privatize_()
            flat = torch.cat([p.grad.reshape(-1).to(F64) for p in model.parameters()])
            assert torch.isfinite(flat).all()
            assert float(flat.norm()) <= C * (1 + gamma(flat.numel() + 2, np.float64))
    finally:
        tied.ghost_cheaper = real
        clipper.remove()


def test_transformers_gpt2_tied_embedding_and_head_equal_per_sample_clipping(form):
    """transformers' GPT2LMHeadModel ties lm_head.weight to transformer.wte.weight;
    with every other parameter frozen (their layers need no rule), the tied
    weight's private gradient equals per-sample clipping of gradients computed
    one sample at a time (float64, relative 1e-10), with padding."""
    transformers = pytest.importorskip("transformers")
    from ncdp_fast.torch import causal_lm_loss
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=32, n_embd=16, n_layer=1, n_head=2, n_positions=8,
                                  bos_token_id=0, eos_token_id=0, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg).double()
    assert model.lm_head.weight is model.transformer.wte.weight
    for n, p in model.named_parameters():
        p.requires_grad_(n == "transformer.wte.weight")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 32, (B, 6), generator=g)
    mask = torch.ones_like(ids)
    mask[0, 4:] = 0
    mask[1, :2] = 0

    def loss(m, i, k, reduction="mean"):
        return causal_lm_loss(m(input_ids=i, attention_mask=k).logits, i, attention_mask=k,
                              reduction=reduction)
    oracle = copy.deepcopy(model)
    per = []
    for i in range(B):
        oracle.zero_grad()
        loss(oracle, ids[i:i + 1], mask[i:i + 1], "sum").backward()
        per.append(oracle.transformer.wte.weight.grad.clone())
    per = torch.stack(per)
    C = low_bound({"w": per})
    assert_factor_matters({"w": per}, C, B, RTOL[F64])
    got, res, clipper = private_grads(model, lambda m: loss(m, ids, mask), C=C, E=B)
    assert clipper.param_names == ["transformer.wte.weight"]
    assert_grads_close({"w": got["transformer.wte.weight"]}, clipped_mean({"w": per}, C, B),
                       RTOL[F64])


def _tied_ranks(rank, world):
    """A tied LM whose shapes make the cost rule pick the ghost form, the batch
    split into ``world`` shards; the clipped sum (noise 0, sum reduction)."""
    import torch.distributed as dist

    from ncdp_fast.distributed import shard_bounds
    torch.manual_seed(0)
    model = FlexLM(64, 4, "shift").double()
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 64, (B, 4), generator=g)
    y = torch.randint(0, 64, (B, 3), generator=g)
    lo, hi = shard_bounds(B, rank, world)
    clipper = GhostClipper(model, max_grad_norm=0.05, noise_multiplier=0.0,
                           expected_batch_size=B, loss_reduction="sum", seed=0,
                           group=dist.group.WORLD if world > 1 else None)
    _flex_loss(model, idx[lo:hi], y[lo:hi], reduction="sum").backward()
    res = clipper.privatize_()
    # NumPy: a torch tensor would cross the queue as shared memory of a child that exits.
    return {n: p.grad.numpy().copy() for n, p in model.named_parameters()}, res.num_clipped


def test_tied_ghost_form_across_two_gloo_ranks_equals_one_process():
    """Each rank clips its own samples' tied gradients in ghost form; the union
    is the one-process clipped sum (float64, relative 1e-12: two partial sums
    added in another order)."""
    from _distributed import spawn
    assert tied.ghost_cheaper([tied.PairUse(torch.zeros(1, 3, 4), torch.zeros(1, 3, 64)),
                               tied.IndexUse(torch.zeros(1, 4, dtype=torch.long),
                                             torch.zeros(1, 4, 4))], (64, 4))
    ref, clipped = _tied_ranks(0, 1)
    assert 0 < clipped
    ref = {n: torch.from_numpy(g) for n, g in ref.items()}
    for got, _ in spawn(_tied_ranks, 2, timeout=90):
        assert_grads_close({n: torch.from_numpy(g) for n, g in got.items()}, ref, 1e-12)


def test_embedding_use_with_indices_broadcast_over_the_batch():
    """tied.as_use on an embedding call whose indices are (1, T) and output
    gradients (B, T, D) (position ids): every sample's rows at the same
    indices, its dense form the per-sample scatter; indices of another number
    of rows refused, naming both shapes."""
    from ncdp_fast import GhostBlock
    from ncdp_fast.torch.layers import Call
    emb = nn.Embedding(7, 3).double()
    block = GhostBlock(None, None, (7, 3), 1)          # the rule's; the use reads the calls
    g = torch.Generator().manual_seed(0)
    pos = torch.tensor([[0, 2, 2, 5]])
    h = torch.randn(B, 4, 3, generator=g, dtype=F64)
    use = tied.as_use(emb, [Call((pos,), h)], block, (7, 3), B, F64)
    assert use.idx.shape == (B, 4)
    dense = tied.combine([use], (7, 3), F64, B)        # rows only: the ghost form
    expected = torch.zeros(B, 7, 3, dtype=F64)
    for i in range(B):
        for t in range(4):
            expected[i, pos[0, t]] += h[i, t]
    assert torch.allclose(tied._dense(use, (7, 3), B), expected, rtol=0, atol=0)
    assert torch.allclose(dense.sq_norms, expected.reshape(B, -1).square().sum(1), rtol=1e-14,
                          atol=0)
    with pytest.raises(ValueError, match=r"indices of shape \(2, 4\) for output gradients of "
                                         r"\(6, 4, 3\)"):
        tied.as_use(emb, [Call((pos.expand(2, -1),), h)], block, (7, 3), B, F64)


@pytest.mark.parametrize("name", ["gpt2", "llama_tied"])
def test_whole_transformers_models_with_tied_heads_in_each_form(name, form):
    """GPT-2 and a LLaMA with tie_word_embeddings, every parameter trainable
    (tests/test_hf_models.py's models, oracle and 1e-10), in each form."""
    pytest.importorskip("transformers")
    from test_hf_models import test_float64_private_gradient_equals_per_sample_clipping as check
    check(name, "mean")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_the_head_rebalances_only_where_its_norms_say_a_sample_may_need_it(require_cuda, dtype):
    """On a device the ghost form hands the op each sample's squared operand
    norms (GhostBlock.gemm_sizes), and the op decides the head GEMM's
    exponent rebalancing from them as it does a linear pair's
    (_balance.layers_needing_balancing, in the step's one transfer): no scan
    of a and g (GPT-2's g: a 412 MB read, and a 412 MB write where scaled) in
    an ordinary step; the scan where a factor could take an operand towards
    the denormals.  Skipping it is exact: with no power moved the scan's
    operands are the same bits (test_balance.py proves "no flag" means every
    exponent is 0), so the step's gradients are the same bits either way."""
    from ncdp_fast import _balance
    from ncdp_fast._cuda import clip as clip_ops
    dev = require_cuda
    idx, y = (t.to(dev) for t in _tokens())
    seen, scans = [], []
    real_gemm, real_rebalanced = clip_ops.clipped_gemm, clip_ops._rebalanced

    def gemm(a, g, factors, out, balance=True):
        if a.shape[-1] == D and g.shape[-1] == V:       # the head's GEMM
            seen.append(balance)
        return real_gemm(a, g, factors, out, balance=balance)

    def rebalanced(a, g, f, into_g):
        scans.append(g.shape[-1])
        return real_rebalanced(a, g, f, into_g)

    def step(C, force_scan=False):
        model = _lm().to(dtype).to(dev)
        seen.clear()
        scans.clear()
        real_need = _balance.layers_needing_balancing
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(tied, "ghost_cheaper", lambda uses, shape: True)
            mp.setattr(clip_ops, "clipped_gemm", gemm)
            mp.setattr(clip_ops, "_rebalanced", rebalanced)
            if force_scan:
                mp.setattr(_balance, "layers_needing_balancing",
                           lambda *a: np.ones_like(real_need(*a)))
            got, res, _ = private_grads(model, lambda m: lm_loss(m, idx, y), C=C, E=B)
        return got, res, list(seen), list(scans)

    # Ordinary data, every sample clipped (factors below 1): no scan.
    got, res, seen_, scans_ = step(1e-3)
    assert res.num_clipped == B and seen_ == [False] and V not in scans_
    forced, _, seen_f, scans_f = step(1e-3, force_scan=True)
    assert seen_f == [True] and V in scans_f
    for name in got:
        assert torch.equal(got[name], forced[name]), name
    # A factor of about 2^-45 takes the head's scaled operand below 2^-40: the
    # norms flag the head and the GEMM scans (and moves a power).
    got, res, seen_, scans_ = step(2.0 ** -45)
    assert seen_ == [True] and V in scans_
    flat = torch.cat([g.reshape(-1).to(F64) for g in got.values()])
    assert torch.isfinite(flat).all() and float(flat.norm()) > 0


@pytest.mark.gpu
# require_cuda is the same device for every example (nothing of it to reset).
@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**31 - 1), log_c=st.integers(-40, 1), exponent=st.integers(-30, 25),
       case=st.sampled_from(sorted(CASES)))
def test_device_ghost_head_contribution_within_C_where_the_norms_decide(require_cuda, seed,
                                                                        log_c, exponent, case):
    """The device route's tied head takes its rebalancing decision from its
    norms (GhostBlock.gemm_sizes) instead of always scanning: at float32 loss
    scales 10^-30..10^25 and bounds C = 10^-40..10 (factors far below 2^-40,
    where the decision must say "scan"), one sample's clipped contribution
    stays within C (1 + gamma_{n+2}) over all n parameters."""
    model, batch = _flex(case, seed % 1000, torch.float32)
    _assert_ghost_contributions_within_C(model.to(require_cuda),
                                         [x.to(require_cuda) for x in batch], 10.0 ** log_c,
                                         10.0 ** exponent, samples=1)
