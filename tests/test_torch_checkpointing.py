"""Activation checkpointing under the clipper (issue 25): a region run through
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` (or
``checkpoint_sequential``) is recomputed inside backward; the recomputation is
the same use of each layer, so the private gradient equals the one of the
model without checkpointing.  ``use_reentrant=True`` is refused.

Oracle and tolerances as tests/test_torch_layers.py: ``torch.func`` per-sample
gradients of the same model with checkpointing off (float64), expected
``sum_i min(1, C/||g_i||) g_i / B`` with C between the two smallest norms;
relative 1e-10 in float64, 1e-5 in float32 (that file's docstring derives
both from the clip factor's rounding margin).
"""
import copy

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.checkpoint import checkpoint, checkpoint_sequential  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from ncdp_fast import _stream  # noqa: E402
from ncdp_fast.torch import GhostClipper, PrivacyEngine  # noqa: E402
from ncdp_fast.torch import recompute  # noqa: E402

from test_torch_layers import (F32, F64, ce, check_exact, per_sample_grads,  # noqa: E402
                               private_grads)


def _run(fn, mode, *args):
    """``fn(*args)`` plainly (mode None, the oracle), or checkpointed."""
    if mode is None:
        return fn(*args)
    return checkpoint(fn, *args, use_reentrant=mode == "reentrant")


class _Checkpointed(nn.Module):
    """``head(pool(block(tanh(inp(x)))))``, the block run through
    :func:`_run` in ``mode``.  ``layers`` are registered in the order given,
    which is the order they were built (and seeded) in."""

    def __init__(self, mode, **layers):
        super().__init__()
        self.mode = mode
        for name, layer in layers.items():
            self.add_module(name, layer)

    def pool(self, h):
        return h

    def forward(self, x):
        return self.head(self.pool(_run(self.block, self.mode, torch.tanh(self.inp(x)))))


class MLP(_Checkpointed):
    """Linear -> [checkpointed: Linear, Linear called twice] -> Linear."""

    def __init__(self, mode="non_reentrant"):
        super().__init__(mode, inp=nn.Linear(5, 8), mid=nn.Linear(8, 8),
                         twice=nn.Linear(8, 8), head=nn.Linear(8, 3))

    def block(self, h):
        h = torch.tanh(self.mid(h))
        return torch.tanh(self.twice(torch.tanh(self.twice(h))))


class TinyTransformer(nn.Module):
    """Embedding -> two checkpointed TransformerEncoderLayers -> mean -> Linear."""

    def __init__(self, mode="non_reentrant", sequential=False):
        super().__init__()
        self.mode, self.sequential = mode, sequential
        self.emb = nn.Embedding(11, 8)
        self.blocks = nn.Sequential(*[
            nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
            for _ in range(2)])
        self.head = nn.Linear(8, 3)

    def forward(self, idx):
        h = self.emb(idx)
        if self.mode is None:
            h = self.blocks(h)
        elif self.sequential:
            h = checkpoint_sequential(self.blocks, 2, h, use_reentrant=False)
        else:
            for blk in self.blocks:
                h = _run(blk, self.mode, h)
        return self.head(h.mean(1))


def _plain(model):
    oracle = copy.deepcopy(model)
    oracle.mode = None
    return oracle


def _mlp_batch(B=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, 5, generator=g, dtype=F64), torch.randint(0, 3, (B,), generator=g)


def _tokens(B=5, T=6, seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 11, (B, T), generator=g), torch.randint(0, 3, (B,), generator=g)


@pytest.mark.parametrize("early_stop", [True, False])
@pytest.mark.parametrize("dtype", [F32, F64])
def test_checkpointed_mlp_equals_per_sample_clipping(dtype, early_stop):
    torch.manual_seed(0)
    model = MLP().double()
    batch = _mlp_batch()
    ps = per_sample_grads(_plain(model), ce, batch)
    # early_stop=False: the whole region is recomputed, not only up to the
    # last tensor backward needs.
    with torch.utils.checkpoint.set_checkpoint_early_stop(early_stop):
        check_exact(model, ce, batch, dtype=dtype, ps=ps)


@pytest.mark.parametrize("sequential", [False, True])
@pytest.mark.parametrize("dtype", [F32, F64])
def test_checkpointed_transformer_blocks_equal_per_sample_clipping(dtype, sequential):
    torch.manual_seed(2)
    model = TinyTransformer(sequential=sequential).double()
    batch = _tokens()
    ps = per_sample_grads(_plain(model), ce, batch)
    check_exact(model, ce, batch, dtype=dtype, ps=ps)


class SeqNet(_Checkpointed):
    """On (B, 8, 3) sequences: the checkpointed block's small Linears take the
    instantiated form (2 T^2 = 128 > K d), the others the factored (ghost) one."""

    def __init__(self, mode="non_reentrant"):
        super().__init__(mode, inp=nn.Linear(3, 16), a=nn.Linear(16, 2), b=nn.Linear(2, 16),
                         head=nn.Linear(16, 3))

    def block(self, h):
        return torch.tanh(self.b(torch.tanh(self.a(h))))

    def pool(self, h):
        return h.mean(1)


@pytest.mark.parametrize("dtype", [F32, F64])
def test_checkpointed_block_in_the_instantiated_form_equals_per_sample_clipping(dtype):
    torch.manual_seed(3)
    model = SeqNet().double()
    g = torch.Generator().manual_seed(4)
    batch = (torch.randn(5, 8, 3, generator=g, dtype=F64), torch.randint(0, 3, (5,), generator=g))
    ps = per_sample_grads(_plain(model), ce, batch)
    check_exact(model, ce, batch, dtype=dtype, ps=ps)


class Attention(nn.Module):
    """Self- and cross-attention, each called twice inside one checkpointed block
    (an attention call records several projections)."""

    def __init__(self, mode="non_reentrant"):
        super().__init__()
        self.mode = mode
        self.emb = nn.Embedding(9, 4)
        self.att = nn.MultiheadAttention(4, 2, batch_first=True)
        self.cross = nn.MultiheadAttention(4, 2, batch_first=True, kdim=3, vdim=3)
        self.head = nn.Linear(4, 3)

    def block(self, h, mem):
        h = self.att(h, h, h, need_weights=False)[0]
        h = self.att(torch.tanh(h), h, h)[0]
        h = self.cross(h, mem, mem)[0]
        return self.cross(torch.tanh(h), mem, mem, need_weights=False)[0]

    def forward(self, idx, mem):
        return self.head(_run(self.block, self.mode, self.emb(idx), mem).mean(1))


@pytest.mark.parametrize("dtype", [F32, F64])
def test_attention_called_twice_in_a_checkpointed_block_equals_per_sample_clipping(dtype):
    torch.manual_seed(8)
    model = Attention().double()
    g = torch.Generator().manual_seed(9)
    batch = (torch.randint(0, 9, (4, 5), generator=g),
             torch.randn(4, 3, 3, generator=g, dtype=F64), torch.tensor([0, 2, 1, 1]))

    def loss(call, idx, mem, y, reduction="sum"):
        return nn.functional.cross_entropy(call(idx, mem), y, reduction=reduction)
    ps = per_sample_grads(_plain(model), loss, batch)
    check_exact(model, loss, batch, dtype=dtype, ps=ps)


def test_whole_model_checkpointed_equals_the_plain_model():
    torch.manual_seed(4)
    model = MLP(mode=None).double()
    x, y = _mlp_batch(seed=5)
    plain, _, _ = private_grads(copy.deepcopy(model), lambda m: ce(m, x, y, "mean"), C=0.3, E=6)

    def loss(m):
        return ce(lambda v: checkpoint(m, v, use_reentrant=False), x, y, "mean")
    got, res, _ = private_grads(copy.deepcopy(model), loss, C=0.3, E=6)
    assert res.num_clipped >= 1
    for k in plain:
        torch.testing.assert_close(got[k], plain[k], rtol=1e-12, atol=0)


def test_privacy_engine_step_equals_the_step_without_checkpointing():
    """One noised make_private step, same seed: the checkpointed model's update
    equals the plain model's (the noise is the same draws; float64)."""
    x, y = _mlp_batch(B=8, seed=6)
    results = []
    for mode in ("non_reentrant", None):
        # Two runs of one key on purpose, to compare them: each is its own run.
        _stream._LEDGER.clear()
        torch.manual_seed(7)
        model = MLP(mode=mode).double()
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        loader = DataLoader(TensorDataset(x, y), batch_size=8)
        pm, popt, ploader = PrivacyEngine().make_private(
            module=model, optimizer=opt, data_loader=loader, noise_multiplier=1.0,
            max_grad_norm=0.2, poisson_sampling=True, seed=11)
        # The private loader's batch (the step must be on it): one batch a
        # pass, q = 1, so x and y whole, in index order, in both runs.
        xb, yb = next(iter(ploader))
        assert torch.equal(xb, x) and torch.equal(yb, y)
        popt.zero_grad()
        ce(pm, xb, yb, "mean").backward()
        popt.step()
        results.append({k: p.detach().clone() for k, p in model.named_parameters()})
    got, plain = results
    for k in plain:
        torch.testing.assert_close(got[k], plain[k], rtol=1e-12, atol=1e-15)


def test_reentrant_checkpoint_is_refused_in_backward():
    torch.manual_seed(0)
    model = MLP(mode="reentrant").double()
    x, y = _mlp_batch()
    clipper = GhostClipper(model, max_grad_norm=1.0, noise_multiplier=0.0,
                           expected_batch_size=6)
    with pytest.raises(RuntimeError, match=r"'mid'.*ran forward inside backward.*"
                                           r"use_reentrant=True.*Expected use_reentrant=False"):
        ce(model, x, y, "mean").backward()
    clipper.clear()
    for p in model.parameters():
        p.grad = None
    # The same clipper steps once checkpointing is non-reentrant.
    model.mode = "non_reentrant"
    ce(model, x, y, "mean").backward()
    clipper.privatize_()


class Mixed(_Checkpointed):
    """One layer, ``inp``, used outside the checkpointed region and inside a
    reentrant one."""

    def __init__(self):
        super().__init__("reentrant", inp=nn.Linear(5, 5), head=nn.Linear(5, 2))

    def block(self, h):
        return torch.tanh(self.inp(h))


def test_reentrant_region_reusing_a_recorded_layer_is_refused():
    torch.manual_seed(0)
    model = Mixed().double()
    x, y = _mlp_batch()
    x = x[:, :5]
    y = y % 2
    GhostClipper(model, max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=6)
    with pytest.raises(RuntimeError, match=r"'inp'.*inside backward.*use_reentrant=True"):
        ce(model, x, y, "mean").backward()


def test_reentrant_region_after_a_recorded_forward_of_the_step_is_refused():
    """Two forwards in one step: the first records the layer, the second runs it
    in a reentrant region; its recomputation is not a replay of the first."""
    torch.manual_seed(0)
    model = MLP(mode=None).double()
    x, y = _mlp_batch()
    GhostClipper(model, max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=6,
                 forwards_per_step=2)
    first = ce(model, x, y, "mean")
    model.mode = "reentrant"
    with pytest.raises(RuntimeError, match=r"'mid'.*inside backward.*use_reentrant=True"):
        (first + ce(model, x, y, "mean")).backward()


def test_without_torchs_autograd_node_a_recomputation_is_refused(monkeypatch):
    monkeypatch.setattr(recompute, "_autograd_node", None)
    torch.manual_seed(0)
    model = MLP().double()
    x, y = _mlp_batch()
    GhostClipper(model, max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=6)
    with pytest.raises(RuntimeError, match=r"'mid'.*no torch._C._current_autograd_node"):
        ce(model, x, y, "mean").backward()


def test_no_grad_evaluation_between_forward_and_backward_is_not_taken_for_reentrant():
    torch.manual_seed(0)
    model = MLP().double()
    x, y = _mlp_batch()
    clipper = GhostClipper(model, max_grad_norm=1.0, noise_multiplier=0.0,
                           expected_batch_size=6)
    loss = ce(model, x, y, "mean")
    with torch.no_grad():
        model(x)
    loss.backward()
    clipper.privatize_()


def test_without_torchs_backward_signal_the_step_is_refused(monkeypatch):
    """Where torch does not report a running backward, a recomputation is
    recorded as a use whose output never gets a gradient: the step is refused,
    nothing written."""
    monkeypatch.setattr(recompute, "_graph_task_id", None)
    torch.manual_seed(0)
    model = MLP().double()
    x, y = _mlp_batch()
    clipper = GhostClipper(model, max_grad_norm=1.0, noise_multiplier=0.0,
                           expected_batch_size=6)
    ce(model, x, y, "mean").backward()
    with pytest.raises(RuntimeError, match=r"backward did not reach it.*checkpoint"):
        clipper.privatize_()
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.gpu
def test_checkpointed_mlp_on_cuda_equals_the_plain_model(require_cuda):
    """On CUDA, autograd runs backward on the device's own thread: the
    recomputation must be recognised there too."""
    torch.manual_seed(0)
    model = MLP().double().to(require_cuda)
    x, y = (t.to(require_cuda) for t in _mlp_batch())
    plain, _, _ = private_grads(_plain(model), lambda m: ce(m, x, y, "mean"), C=0.3, E=6)
    got, res, _ = private_grads(copy.deepcopy(model), lambda m: ce(m, x, y, "mean"), C=0.3, E=6)
    assert res.num_clipped >= 1
    for k in plain:
        torch.testing.assert_close(got[k], plain[k], rtol=1e-12, atol=0)


@pytest.mark.parametrize("name", ["llama"])
def test_hugging_face_gradient_checkpointing_equals_per_sample_clipping(name):
    """A tiny random-config model (tests/test_hf_models.py's) with
    ``gradient_checkpointing_enable(use_reentrant=False)``: exact as without it
    (float64, relative 1e-10, that file's bound); use_reentrant=True refused."""
    pytest.importorskip("transformers")
    import test_hf_models as hf
    from test_torch_layers import low_bound
    model, data = hf.build(name), hf.batch(name)
    ps = hf.one_at_a_time(model, name, data)
    C = low_bound(ps)
    expected = hf.clipped(ps, C, hf.B)
    for reentrant in (False, True):
        work = copy.deepcopy(model)
        work.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        work.train()
        if reentrant:
            with pytest.raises(RuntimeError, match=r"inside backward.*use_reentrant=True"):
                hf.private_step(work, name, data, C, "mean")
            continue
        got, res, _ = hf.private_step(work, name, data, C, "mean")
        assert 1 <= res.num_clipped < hf.B
        assert hf.rel_err(got, expected) <= 1e-10
