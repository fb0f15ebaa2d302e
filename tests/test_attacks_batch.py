"""Attacks on the batch identity of GhostClipper (issue 23, items 2 and 3).

Item 2: a model that folds samples into the batch dimension ((B, k, d) ->
(B*k, d): augmentation multiplicity, patches, chunks) had each of the B*k rows
clipped as a sample (measured sensitivity 3.1-4.6 C).  Must fail: any layer
whose rows are not the samples of the model's input raises, naming the layer,
the rows and the batch, and nothing is written.

Item 3: layers inside a sequence-first (batch_first=False) torch transformer
get (T, B, d); with T == B dimension 0 was taken as the batch (clipping per
position, 2.13-2.27 C).  Must fail: the per-sample gradients differ from
torch.func's per-sample gradients (float64, relative 1e-10 as in
test_torch_layers.py: the clip factor's rounding is 1e-15 relative).
"""
import copy
from collections import UserDict

import numpy as np
import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.func import functional_call, grad, vmap  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from ncdp_fast.torch import GhostClipper, PrivacyEngine, register_layer  # noqa: E402
from ncdp_fast.torch.layers import RULES  # noqa: E402
from ncdp_fast.torch.loss_graph import LossRefused  # noqa: E402

from test_torch_layers import (F64, RTOL, assert_factor_matters,  # noqa: E402
                               assert_grads_close, clipped_mean, low_bound)
from test_embedding_bag import BagNet, D, V  # noqa: E402
from test_embedding_bag import _batch as _bag_batch  # noqa: E402


def _clipper(model, **kw):
    args = dict(max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=4, seed=0)
    args.update(kw)
    return GhostClipper(model, **args)


# ------------------------------------------------------------ item 2: folds

class Fold(nn.Module):
    """(B, k, d) -> reshape -> Linear -> back to one output per sample."""

    def __init__(self, d=4, width=None):
        super().__init__()
        self.width = width or d
        self.lin = nn.Linear(self.width, 3)

    def forward(self, x=None, *, input_ids=None):
        x = input_ids if x is None else x
        x = x["input_ids"] if isinstance(x, UserDict) else x
        B = x.shape[0]
        return self.lin(x.reshape(-1, self.width)).reshape(B, -1).sum(1)


@settings(max_examples=20, deadline=None, derandomize=True)
@given(B=st.integers(1, 5), k=st.integers(2, 4), regroup=st.booleans())
def test_any_fold_of_samples_into_rows_is_refused(B, k, regroup):
    """Every reshape whose row count is not B is refused, whether or not the
    rows are a multiple of B; no gradient is written."""
    d = 4
    width = 2 * d if regroup and (B * k) % 2 == 0 and B * k // 2 != B else d
    model = Fold(d, width).double()
    clipper = _clipper(model)
    x = torch.randn(B, k, d, dtype=F64)
    rows = B * k * d // width
    with pytest.raises(ValueError, match=rf"layer 'lin' \(Linear\) has {rows} rows .* the step "
                                         rf"has {B} samples \(dimension 0 of the model's first"):
        model(x).sum().backward()
    assert all(p.grad is None for p in model.parameters())
    clipper.remove()


def test_fold_message_names_the_fold_and_the_way_out():
    model = Fold().double()
    _clipper(model)
    with pytest.raises(ValueError, match=r"\(3 rows per sample: samples folded into the batch "
                                         r"dimension\).*pass batch_first=False"):
        model(torch.randn(2, 3, 4, dtype=F64)).sum().backward()


@pytest.mark.parametrize("how", ["keyword", "mapping"])
def test_fold_read_from_keyword_or_mapping_input(how):
    """HF-style models get their batch as input_ids= or a BatchEncoding (a
    UserDict): it is read from there."""
    model = Fold().double()
    _clipper(model)
    ids = torch.randn(2, 3, 4, dtype=F64)
    with pytest.raises(ValueError, match=r"has 6 rows .* step has 2 samples \(dimension 0 of "
                                         r"the model's first input tensor, shape \(2, 3, 4\)"):
        out = model(input_ids=ids) if how == "keyword" else model(UserDict(input_ids=ids))
        out.sum().backward()


def test_unfolded_sample_rows_are_exact():
    """The same layer on (B, k, d) as it is: rows are the samples, exact."""
    torch.manual_seed(0)
    lin = nn.Linear(4, 3).double()
    x = torch.randn(5, 3, 4, dtype=F64)

    def loss_one(p, xi):
        return functional_call(lin, p, (xi.unsqueeze(0),)).square().sum()
    params = {k: v.detach() for k, v in lin.named_parameters()}
    ps = vmap(grad(loss_one), in_dims=(None, 0))(params, x)
    C = low_bound(ps)
    clipper = _clipper(lin, max_grad_norm=C, loss_reduction="sum")
    lin(x).square().sum().backward()
    clipper.privatize_()
    assert_grads_close({k: p.grad for k, p in lin.named_parameters()},
                       clipped_mean(ps, C, 1), RTOL[F64])


def test_make_private_refuses_a_fold():
    """Through the engine: the loader's batch of B samples, folded by the model."""
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(16, 3, 4), torch.randn(16))
    model = Fold()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = PrivacyEngine().make_private(
        module=model, optimizer=opt, data_loader=DataLoader(data, batch_size=8),
        noise_multiplier=1.0, max_grad_norm=1.0, seed=1)
    x, _ = next(b for b in loader if len(b[0]) > 0)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="samples folded into the batch dimension"):
        model(x).sum().backward()
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))


class MaskFirst(nn.Module):
    """A model whose first tensor argument is not the batch (a (T, T) mask)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, mask, x):
        return (self.lin(x) * mask.sum()).sum((1, 2))


def test_first_input_not_the_batch_needs_a_declared_size():
    model = MaskFirst().double()
    clipper = _clipper(model)
    mask, x = torch.ones(3, 3, dtype=F64), torch.randn(5, 3, 4, dtype=F64)
    with pytest.raises(ValueError, match=r"has 5 rows .* step has 3 samples \(dimension 0 of "
                                         r"the model's first input tensor, shape \(3, 3\)"):
        model(mask, x).sum().backward()
    clipper.clear()
    clipper.declare_batch_size(5)
    model(mask, x).sum().backward()
    assert clipper.privatize_().norms.shape == (5,)


def test_layer_outside_the_model_forward_is_refused():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)).double()
    _clipper(model)
    with pytest.raises(RuntimeError, match="outside a forward of the model"):
        model[1](torch.randn(3, 4, dtype=F64)).sum().backward()


def test_two_forwards_of_different_batches_in_one_step_are_refused():
    model = nn.Linear(4, 2).double()
    _clipper(model, forwards_per_step=2)
    model(torch.randn(3, 4, dtype=F64))
    with pytest.raises(ValueError, match="batch of 5 samples .* after one of 3"):
        model(torch.randn(5, 4, dtype=F64))


def _paired_release(x1, x2, forwards_per_step=2):
    """GhostClipper's release (noise 0, C = 1) of a linear model x -> w.x
    (each sample's gradient its input) over two forwards of one step."""
    model = nn.Linear(6, 1, bias=False).double()
    clipper = _clipper(model, forwards_per_step=forwards_per_step, max_grad_norm=1.0,
                       noise_multiplier=0.0, loss_reduction="sum")
    (model(x1).sum() + model(x2).sum()).backward()
    clipper.privatize_()
    clipper.remove()
    return model.weight.grad.reshape(-1)


def test_a_second_forward_of_as_many_samples_is_refused_unless_stated():
    """The audit of 2026-12-02: two batches of one size forwarded before one
    step were clipped row by row as one batch of paired samples -- one sample
    b = -3 a (a of norm 2 in the other batch's row) moved the release by 2C.
    A step's second forward is now refused by default, before anything is
    recorded; ``forwards_per_step=2`` states that both see the same samples
    (two views of each), and then row i of both is sample i's: the release is
    the clipped sum of the rows' summed gradients, as stated."""
    torch.manual_seed(1)
    x1 = torch.randn(4, 6, dtype=F64)
    x1[0] = x1[0] / x1[0].norm() * 2.0
    x2 = torch.randn(4, 6, dtype=F64)
    x2[0] = -3 * x1[0]
    model = nn.Linear(6, 1, bias=False).double()
    clipper = _clipper(model)
    model(x1)
    with pytest.raises(ValueError, match=r"ran forward 2 times in one step \(this one on 4 "
                                         r"samples\), past forwards_per_step=1.*2 max_grad_norm"):
        model(x2)
    assert all(not r for t in clipper.taps for r in [t.records[1:]])
    clipper.remove()
    # Stated: two views of each sample, each row's gradients summed, then clipped.
    got = _paired_release(x1, x2)
    rows = x1 + x2
    want = (rows * torch.clamp(1.0 / rows.norm(dim=1, keepdim=True), max=1.0)).sum(0)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_batch_first_must_be_a_bool():
    with pytest.raises(TypeError, match="batch_first: expected a bool"):
        _clipper(nn.Linear(2, 2), batch_first=1)
    assert _clipper(nn.Linear(2, 2), batch_first=np.bool_(False)).batch_first is False


class Total(nn.Module):
    """A layer whose output is one number for the whole batch."""

    def __init__(self):
        super().__init__()
        self.s = nn.Parameter(torch.ones(4, dtype=F64))

    def forward(self, x):
        return (x * self.s).sum()


def test_layer_with_a_0d_output_is_refused():
    register_layer(Total)(lambda module, calls, trainable: [(("s",), calls[0].grad)])
    try:
        model = Total()
        _clipper(model)
        with pytest.raises(ValueError, match=r"layer '' \(Total\) returned a 0-d output"):
            model(torch.randn(3, 4, dtype=F64)).backward()
        assert model.s.grad is None
    finally:
        del RULES[Total]


# ------------------------------------------------- item 3: sequence-first

T = B = 4          # T == B: both dimensions could be the batch
D, K = 8, 3


class SeqFirstTorch(nn.Module):
    """Batch-first input (B, T, D) -> a torch module built with batch_first=False
    on (T, B, D) -> mean over T -> head."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        if kind == "mha":
            self.body = nn.MultiheadAttention(D, 2, dropout=0.0)
        elif kind == "transformer":
            self.body = nn.Transformer(D, 2, 1, 1, 12, dropout=0.0)
        else:
            layer = nn.TransformerEncoderLayer(D, 2, dim_feedforward=12, dropout=0.0)
            self.body = layer if kind == "layer" else nn.TransformerEncoder(
                layer, 2, norm=nn.LayerNorm(D), enable_nested_tensor=False)
        self.head = nn.Linear(D, K)

    def forward(self, x):
        h = x.transpose(0, 1)
        if self.kind == "mha":
            h = self.body(h, h, h, need_weights=False)[0]
        else:
            h = self.body(h, h) if self.kind == "transformer" else self.body(h)
        return self.head(h.mean(0))


V = 17          # > 4 * 4: every sample of a batch gets tokens of its own


class SeqFirstUser(nn.Module):
    """A user model on sequence-first tokens (T, B): its own layers get
    (T, B, .), the pooled head (B, .)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.inp = nn.Linear(D, D)
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, K)

    def forward(self, tokens):
        return self.head(self.norm(torch.tanh(self.inp(self.emb(tokens)))).mean(0))


class SeqFirstConv(nn.Module):
    """Sequence-first tokens (T, B) -> embedding (T, B, D) -> a Conv1d on
    (B, D, T), torch's fixed batch-first layout -> pooled head."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.conv = nn.Conv1d(D, D, 3, padding=1)
        self.head = nn.Linear(D, K)

    def forward(self, tokens):
        h = self.conv(self.emb(tokens).permute(1, 2, 0))           # (B, D, T)
        return self.head(torch.tanh(h).mean(2))


def _oracle(model, x, y, batch_dim):
    """{name: (B, *shape)} per-sample gradients of the summed cross-entropy,
    each sample alone (torch.func), the batch at ``batch_dim`` of x."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def f(p, xi, yi):
        out = functional_call(model, p, (xi.unsqueeze(batch_dim),))
        return nn.functional.cross_entropy(out, yi.unsqueeze(0), reduction="sum")
    return vmap(grad(f), in_dims=(None, batch_dim, 0))(params, x, y)


def _check_exact(model, x, y, batch_dim, **kw):
    ps = _oracle(model, x, y, batch_dim)
    C = low_bound(ps)
    assert_factor_matters(ps, C, 1, RTOL[F64])
    clipper = _clipper(model, max_grad_norm=C, loss_reduction="sum", **kw)
    try:
        nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
        res = clipper.privatize_()
    finally:
        clipper.remove()
    assert res.norms.shape == (y.shape[0],)
    got = {k: p.grad for k, p in model.named_parameters()}
    assert_grads_close(got, clipped_mean(ps, C, 1), RTOL[F64])


@pytest.mark.parametrize("t,b", [(T, B), (3, 5)])
@pytest.mark.parametrize("kind", ["layer", "encoder", "transformer", "mha"])
def test_sequence_first_torch_modules_are_exact(kind, t, b):
    """T == B (both dimensions could be the batch) and T != B."""
    torch.manual_seed(1)
    model = SeqFirstTorch(kind).double()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(b, t, D, generator=g, dtype=F64)
    y = torch.randint(0, K, (b,), generator=g)
    _check_exact(model, x, y, 0)


def test_sequence_first_root_module_needs_its_layout_and_is_exact():
    """The model is the torch layer itself: its inputs are (T, B, D), and the
    clipper must be told so (a contradicting batch_first is refused)."""
    torch.manual_seed(3)
    layer = nn.TransformerEncoderLayer(D, 2, dim_feedforward=12, dropout=0.0).double()
    with pytest.raises(ValueError, match=r"batch_first: expected False, as the model "
                                         r"\(TransformerEncoderLayer\)"):
        _clipper(layer)

    class Wrap(nn.Module):     # the loss's logits from the layer's first K features
        def __init__(self):
            super().__init__()
            self.layer = layer

        def forward(self, x):
            return self.layer(x).mean(0)[:, :K]
    g = torch.Generator().manual_seed(4)
    x = torch.randn(T, B, D, generator=g, dtype=F64)
    y = torch.randint(0, K, (B,), generator=g)
    _check_exact(Wrap(), x, y, 1, batch_first=False)


@settings(max_examples=8, deadline=None, derandomize=True)
@given(t=st.integers(1, 4), b=st.integers(2, 4),
       net=st.sampled_from([SeqFirstUser, SeqFirstConv]))
@example(t=T, b=B, net=SeqFirstUser)
@example(t=T, b=B, net=SeqFirstConv)
def test_sequence_first_user_model_is_exact_with_batch_first_false(t, b, net):
    """Exact for every (T, B), T == B among them: the layout is the argument's
    (a convolution keeps torch's batch-first layout)."""
    # The oracle's limit: torch.func's vmap of conv1d's backward fails at length 1.
    assume(t > 1 or net is SeqFirstUser)
    torch.manual_seed(5)
    model = net().double()
    g = torch.Generator().manual_seed(6)
    x = torch.randperm(V, generator=g)[:t * b].reshape(t, b)
    y = torch.randint(0, K, (b,), generator=g)
    _check_exact(model, x, y, 1, batch_first=False)


def test_sequence_first_user_model_without_the_layout_names_it():
    """T != B and batch_first left True: the error says which layout was assumed
    and how to state the other (with T == B no size can tell: a contract)."""
    model = SeqFirstUser().double()
    _clipper(model)
    x = torch.randint(0, V, (5, 3))
    with pytest.raises(ValueError, match=r"layer 'head' \(Linear\) has 3 rows .*batch_first="
                                         r"True from the batch_first argument.*step has 5 "
                                         r"samples.*pass batch_first=False"):
        model(x).sum().backward()


class BatchFirstInput(SeqFirstUser):
    """Batch-first tokens (B, T) into layers laid out (T, B, .)."""

    def forward(self, tokens):
        return super().forward(tokens.t())


def test_batch_first_input_into_sequence_first_layers_needs_a_declared_size():
    model = BatchFirstInput().double()
    clipper = _clipper(model, batch_first=False)
    x = torch.randint(0, V, (3, 5))
    # Refused at the forward, by the first layer whose rows are not the step's
    # samples (issue 37: before the model's own forward could fail on them).
    with pytest.raises(ValueError, match=r"layer 'emb' \(Embedding\) has 3 rows .* step has 5 "
                                         r"samples .*declare_batch_size"):
        model(x).sum().backward()
    clipper.clear()
    clipper.declare_batch_size(3)
    model(x).sum().backward()
    assert clipper.privatize_().norms.shape == (3,)


def test_make_private_sequence_first_user_model_is_exact():
    """make_private(batch_first=False): the loop feeds (T, B, D); the private
    gradient (noise 0) is the clipped sum of torch.func's per-sample
    gradients over the loader's batch, divided by the expected batch size."""
    torch.manual_seed(7)
    n = 16
    data = TensorDataset(torch.randint(0, V, (n, T)), torch.randint(0, K, (n,)))
    model = SeqFirstUser().double()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    private, opt, loader = PrivacyEngine().make_private(
        module=model, optimizer=opt, data_loader=DataLoader(data, batch_size=4),
        noise_multiplier=0.0, max_grad_norm=0.05, batch_first=False, seed=8)
    x, y = next(b for b in loader if len(b[0]) >= 2)
    x = x.transpose(0, 1)                               # (T, B)
    nn.functional.cross_entropy(private(x), y).backward()
    opt.step()
    ps = _oracle(ref, x, y, 1)
    expected = clipped_mean(ps, 0.05, opt.expected_batch_size)
    assert_grads_close({k: p.grad for k, p in model.named_parameters()}, expected, RTOL[F64])


class PositionTable(nn.Module):
    """A trainable per-position table looked up with arange(T) and broadcast over
    the batch: its T rows are positions, not samples."""

    def __init__(self):
        super().__init__()
        self.pos = nn.Embedding(16, D)
        self.head = nn.Linear(D, K)

    def forward(self, x):                                          # (B, T, D)
        h = x + self.pos(torch.arange(x.shape[1]))
        return self.head(h.mean(1))


def test_broadcast_position_table_with_T_not_B_is_refused():
    """T != B: refused (with T == B no size can tell: docs/privacy.md's contract)."""
    model = PositionTable().double()
    _clipper(model)
    with pytest.raises(ValueError, match=r"layer 'pos' \(Embedding\) has 5 rows .* step has 3"):
        model(torch.randn(3, 5, D, dtype=F64)).sum().backward()
    assert all(p.grad is None for p in model.parameters())


# ------------------------------------ issue 35, item 1: layouts by structure
class TransposedInside(nn.Module):
    """A batch-first model whose own code turns its tokens sequence-first
    before a plain nn.Linear (the audit's case: relative error 0.16 at T == B),
    or turns them back first (``back``)."""

    def __init__(self, back=False):
        super().__init__()
        self.back = back
        self.emb = nn.Embedding(V, D)
        self.lin = nn.Linear(D, D)
        self.head = nn.Linear(D, K)

    def forward(self, tokens):
        h = self.emb(tokens).transpose(0, 1)        # (T, B, D)
        if self.back:
            h = h.transpose(0, 1)                   # (B, T, D)
        h = torch.tanh(self.lin(h))
        return self.head(h.mean(1 if self.back else 0))


@pytest.mark.parametrize("t,b", [(T, B), (3, 5)])
def test_a_sequence_first_layer_inside_a_batch_first_model_is_refused_by_structure(t, b):
    """Where the samples are is followed through the graph from the layer
    before (the embedding's rows are the samples): at T == B no size can
    tell, and the step was silently wrong; now refused at the forward,
    before the layer runs, naming the dimension found and the one read."""
    torch.manual_seed(7)
    model = TransposedInside().double()
    clipper = _clipper(model)
    tokens = torch.randint(0, V, (b, t))
    with pytest.raises(ValueError, match=r"layer 'lin' \(Linear\) gets its input .* samples "
                                         r"along dimension 1.*reads dimension 0"):
        model(tokens)
    assert all(not tap.records for tap in clipper.taps if tap.name == "lin")
    assert all(p.grad is None for p in model.parameters())
    clipper.remove()


@pytest.mark.parametrize("t,b", [(T, B), (3, 5)])
def test_a_layout_turned_back_before_the_layer_is_exact(t, b):
    torch.manual_seed(8)
    model = TransposedInside(back=True).double()
    g = torch.Generator().manual_seed(9)
    x = torch.randint(0, V, (b, t), generator=g)
    y = torch.randint(0, K, (b,), generator=g)
    _check_exact(model, x, y, 0)


class TwoBagsASample(nn.Module):
    """Two bags a sample (a title and a body), joined into one row after the
    bag: taking the bags as the batch would clip each half as a sample."""

    def __init__(self):
        super().__init__()
        self.bag = nn.EmbeddingBag(V, D, mode="sum")
        self.head = nn.Linear(2 * D, 3).requires_grad_(False)

    def forward(self, text, offsets):
        return self.head(self.bag(text, offsets).reshape(-1, 2 * D))


def test_two_bags_a_sample_are_refused_by_the_loss_check():
    """The bags are taken as the step's samples only where flat indices are
    the model's first input (test_embedding_bag.py); a model whose sample is
    two bags, joined after the layer, is refused by the loss check, with
    nothing written, rather than clipped per bag (sensitivity 2C)."""
    model = TwoBagsASample()
    idx, offsets, _, _, _ = _bag_batch("flat", 8, 5)
    y = torch.randint(0, 3, (4,), generator=torch.Generator().manual_seed(0))
    clipper = GhostClipper(model, max_grad_norm=1.0, noise_multiplier=1.0,
                           expected_batch_size=4, seed=0)
    try:
        with pytest.raises(LossRefused, match=r"not a sum of per-sample terms.*mixes the samples"):
            nn.functional.cross_entropy(model(idx, offsets), y).backward()
            clipper.privatize_()
        assert model.bag.weight.grad is None
    finally:
        clipper.remove()


def test_bag_indices_changed_in_place_after_backward_are_refused():
    """The bag's indices and offsets are read again at the step (its clipped
    sum): a loader buffer refilled before the step is refused, nothing written."""
    torch.manual_seed(0)
    model = BagNet(mode="sum")
    idx, offsets, _, y, _ = _bag_batch("flat", 4, 2)
    clipper = GhostClipper(model, max_grad_norm=1.0, noise_multiplier=1.0,
                           expected_batch_size=4, seed=0)
    try:
        nn.functional.cross_entropy(model(idx, offsets), y).backward()
        idx.add_(1).remainder_(V)
        with pytest.raises(RuntimeError, match=r"input of layer 'bag' was modified in place"):
            clipper.privatize_()
        assert all(p.grad is None for p in model.parameters())
    finally:
        clipper.remove()
