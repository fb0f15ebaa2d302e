"""nn.EmbeddingBag's rule (torch/embedding_bag.py) against per-sample gradients
of each bag run alone.

Oracle: sample b's gradient is the float64 gradient of its own loss with the
model run on its bag alone (a one-row 2-D input, or its slice of the flat
indices with offsets [0]): no batch, so no coupling the rule could share.
Each case is checked with C between the two smallest per-sample norms (one
sample unclipped, the rest clipped, the factor moving the result by far more
than the tolerance), at test_torch_layers' tolerances (relative 1e-5 in
float32, 1e-10 in float64), on the CPU and on the device route (a GPU, or
the emulated device in CI)."""
from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import ncdp_fast as nf  # noqa: E402
from ncdp_fast.torch import GhostClipper  # noqa: E402

from test_torch_layers import (F32, F64, RTOL, assert_factor_matters,  # noqa: E402
                               assert_grads_close, clipped_mean, low_bound, private_grads)

V, D = 11, 5


class BagNet(nn.Module):
    """A bag of rows, a head; ``twice``: the bag layer runs a second time on
    shifted indices (two calls a forward)."""

    def __init__(self, twice=False, **bag):
        super().__init__()
        self.bag = nn.EmbeddingBag(V, D, **bag)
        self.head = nn.Linear(D, 3)
        self.twice = twice

    def forward(self, idx, offsets=None, psw=None, by_keyword=False):
        if by_keyword:
            h = self.bag(idx, offsets=offsets, per_sample_weights=psw)
        else:
            h = self.bag(idx, offsets, psw)
        if self.twice:
            h = h - 0.7 * self.bag((idx * 3 + 1) % V, offsets, psw)
        return self.head(torch.tanh(h))


def _batch(form, B, seed, *, psw=False, empty=False, last=False):
    """(idx, offsets, psw, y, bags): a batch with repeated rows in a bag; bags
    the (start, end) of each bag in the flat form."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 3, (B,), generator=g)
    if form == "2d":
        idx = torch.randint(0, 4, (B, 6), generator=g)          # few rows: repeats
        idx[:, -1] = idx[:, 0]
        w = torch.randn(B, 6, generator=g, dtype=F64) if psw else None
        return idx, None, w, y, None
    sizes = torch.randint(1, 7, (B,), generator=g)
    if empty and B > 1:
        sizes[1] = 0
    n = int(sizes.sum())
    idx = torch.randint(0, 4, (n,), generator=g)
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)[:-1]])
    bags = [(int(s), int(s + k)) for s, k in zip(starts, sizes)]
    offsets = torch.cat([starts, torch.tensor([n])]) if last else starts
    w = torch.randn(n, generator=g, dtype=F64) if psw else None
    return idx, offsets, w, y, bags


def _per_sample(model, idx, offsets, psw, y, bags, by_keyword=False):
    """{name: (B, *shape)} float64 gradients of each sample's loss, its bag alone."""
    params = [p for p in model.parameters() if p.requires_grad]
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    out = {n: [] for n in names}
    last = model.bag.include_last_offset
    for b in range(y.shape[0]):
        if bags is None:
            args = (idx[b:b + 1], None, None if psw is None else psw[b:b + 1])
        else:
            s, e = bags[b]
            one = torch.tensor([0, e - s] if last else [0])
            args = (idx[s:e], one, None if psw is None else psw[s:e])
        loss = nn.functional.cross_entropy(model(*args, by_keyword=by_keyword), y[b:b + 1],
                                           reduction="sum")
        for n, gr in zip(names, torch.autograd.grad(loss, params, allow_unused=True)):
            out[n].append(torch.zeros_like(dict(model.named_parameters())[n])
                          if gr is None else gr)
    return {n: torch.stack(v) for n, v in out.items()}


def _check(model64, batch, dtype, reduction="mean", device=None, by_keyword=False):
    idx, offsets, psw, y, bags = batch
    B = y.shape[0]
    ps = _per_sample(model64, idx, offsets, psw, y, bags, by_keyword)
    C = low_bound(ps)
    denom = B if reduction == "mean" else 1
    assert_factor_matters(ps, C, denom, RTOL[dtype])
    expected = clipped_mean(ps, C, denom)
    model = copy.deepcopy(model64).to(dtype)
    dev = device if device is not None else torch.device("cpu")
    model = model.to(dev)
    cast = [None if t is None else t.to(dev, dtype) if t.is_floating_point() else t.to(dev)
            for t in (idx, offsets, psw)]

    def run(m):
        # Flat indices: the model's first tensor is the bag's input, and the
        # step's batch its number of bags (no declaration).
        out = m(*cast, by_keyword=by_keyword)
        return nn.functional.cross_entropy(out, y.to(dev), reduction=reduction)
    clipper = GhostClipper(model, max_grad_norm=C, noise_multiplier=0.0, expected_batch_size=B,
                           loss_reduction=reduction, seed=0)
    try:
        run(model).backward()
        res = clipper.privatize_()
    finally:
        clipper.remove()
    got = {k: p.grad.detach().cpu() for k, p in model.named_parameters() if p.requires_grad}
    assert 1 <= res.num_clipped < B
    assert_grads_close(got, expected, RTOL[dtype], "EmbeddingBag")


CASES = {
    "sum 2d": (dict(mode="sum"), "2d", {}),
    "mean 2d": (dict(mode="mean"), "2d", {}),
    "sum 2d weights": (dict(mode="sum"), "2d", dict(psw=True)),
    "mean 2d padding": (dict(mode="mean", padding_idx=2), "2d", {}),
    "sum flat empty bag": (dict(mode="sum"), "flat", dict(empty=True)),
    "mean flat padding": (dict(mode="mean", padding_idx=1), "flat", dict(empty=True)),
    "sum flat weights": (dict(mode="sum"), "flat", dict(psw=True)),
    "mean flat last offset": (dict(mode="mean", include_last_offset=True), "flat",
                              dict(last=True, empty=True)),
    "sum flat weights padding last": (dict(mode="sum", padding_idx=0, include_last_offset=True),
                                      "flat", dict(psw=True, last=True)),
    "max 2d": (dict(mode="max"), "2d", {}),
    "max flat empty bag padding": (dict(mode="max", padding_idx=1), "flat", dict(empty=True)),
    "max flat last offset": (dict(mode="max", include_last_offset=True), "flat",
                             dict(last=True)),
}


@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("case", sorted(CASES))
def test_embedding_bag_equals_per_sample_clipping(case, dtype):
    opts, form, kw = CASES[case]
    torch.manual_seed(3)
    model = BagNet(**opts).double()
    _check(model, _batch(form, 5, 4, **kw), dtype)


@pytest.mark.parametrize("form", ["2d", "flat"])
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_embedding_bag_called_twice_and_by_keyword(form, mode):
    """Two calls a forward (K = 2: the Gram of the calls' output gradients,
    terms that may cancel), offsets and weights given by keyword, sum loss."""
    torch.manual_seed(5)
    model = BagNet(twice=True, mode=mode).double()
    batch = _batch(form, 6, 7, psw=mode == "sum")
    _check(model, batch, F64, reduction="sum", by_keyword=True)
    _check(model, batch, F32, reduction="sum", by_keyword=True)


class TiedBag(BagNet):
    """The bag's weight tied to an output layer over the V rows (the
    combined per-sample gradient of a tied weight, torch/tied.py)."""

    def __init__(self, **bag):
        super().__init__(**bag)
        self.out = nn.Linear(D, V, bias=False)
        self.out.weight = self.bag.weight

    def forward(self, idx, offsets=None, psw=None, by_keyword=False):
        return self.out(torch.tanh(self.bag(idx, offsets, psw)))[:, :3]


@pytest.mark.parametrize("form", ["2d", "flat"])
def test_embedding_bag_tied_to_an_output_layer(form):
    torch.manual_seed(6)
    model = TiedBag(mode="sum").double()
    model.head.requires_grad_(False)
    batch = _batch(form, 5, 12, psw=True)
    _check(model, batch, F64)
    _check(model, batch, F32)


@pytest.mark.parametrize("B", [0, 1])
def test_embedding_bag_empty_and_one_sample_batches(B):
    """B = 0: a step of pure noise; B = 1: the one bag's gradient clipped."""
    torch.manual_seed(2)
    model = BagNet(mode="mean")
    idx, offsets, _, y, bags = _batch("flat", max(B, 1), 3)
    if B == 0:
        idx, offsets, y = idx[:0], offsets[:0], y[:0]
    clipper = GhostClipper(model, max_grad_norm=0.5, noise_multiplier=0.0,
                           expected_batch_size=2, loss_reduction="sum", seed=0)
    try:
        clipper.declare_batch_size(B)
        nn.functional.cross_entropy(model(idx, offsets), y, reduction="sum").backward()
        res = clipper.privatize_()
    finally:
        clipper.remove()
    grads = [p.grad for p in model.parameters()]
    total = float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads)))
    assert res.num_clipped == B
    if B == 0:
        assert total == 0.0
    else:
        assert total == pytest.approx(0.5, rel=1e-5)


@pytest.mark.parametrize("opts, what", [
    (dict(max_norm=1.0), "max_norm"),
    (dict(scale_grad_by_freq=True), "scale_grad_by_freq"),
    (dict(sparse=True), "sparse=True"),
])
def test_embedding_bag_options_without_an_exact_rule_are_refused_by_name(opts, what):
    model = BagNet(**opts)
    with pytest.raises(ValueError, match=rf"'bag' \(nn.EmbeddingBag\).*{what}"):
        GhostClipper(model, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=4)
    model = BagNet(mode="sum")
    clipper = GhostClipper(model, max_grad_norm=1.0, noise_multiplier=1.0,
                           expected_batch_size=4, seed=0)
    try:
        # The options are mutable: set after construction, refused at the forward.
        for k, v in opts.items():
            setattr(model.bag, k, v)
        with pytest.raises(ValueError, match=what):
            model(torch.zeros(4, 3, dtype=torch.int64))
    finally:
        clipper.remove()


class CopiedTokens(BagNet):
    """The bag reads a copy of the model's first tensor: the tokens are not
    recognised as the bag's own, so the step's batch stays the token count."""

    def forward(self, idx, offsets=None, psw=None, by_keyword=False):
        return self.head(torch.tanh(self.bag(idx + 0, offsets)))


class TokensFirst(BagNet):
    """A layer records rows of every token before the bag: the tokens were
    already checked as the samples, so the bags are not taken as the batch."""

    def __init__(self, **bag):
        super().__init__(**bag)
        self.tok = nn.Linear(1, 1)

    def forward(self, idx, offsets=None, psw=None, by_keyword=False):
        w = torch.sigmoid(self.tok(idx.unsqueeze(1).to(self.tok.weight.dtype))).squeeze(1)
        return self.head(torch.tanh(self.bag(idx, offsets, per_sample_weights=w)))


@pytest.mark.parametrize("before, after", [("sum", "max"), ("max", "mean")])
def test_a_mode_changed_between_forward_and_backward_is_refused(before, after):
    """The forward's op ran in one mode; the rule would read another: refused
    at the step's backward, nothing written."""
    model = BagNet(mode=before)
    idx, offsets, _, y, _ = _batch("flat", 4, 3)
    clipper = GhostClipper(model, max_grad_norm=1.0, noise_multiplier=1.0,
                           expected_batch_size=4, seed=0)
    try:
        out = model(idx, offsets)
        model.bag.mode = after
        with pytest.raises(ValueError, match=f"mode='{after}' now.*another mode"):
            nn.functional.cross_entropy(out, y).backward()
        assert model.bag.weight.grad is None
    finally:
        clipper.remove()


@pytest.mark.parametrize("cls", [CopiedTokens, TokensFirst])
def test_flat_indices_not_the_models_own_are_refused_unless_declared(cls):
    """Flat indices give the batch (the number of bags) only as the model's
    first input tensor itself, read by the first recorded layer; otherwise
    the bag's rows are refused against the token count, loudly, naming the
    way out, and a declared batch runs."""
    model = cls(mode="sum")
    idx, offsets, _, y, _ = _batch("flat", 4, 1)
    clipper = GhostClipper(model, max_grad_norm=1.0, noise_multiplier=1.0,
                           expected_batch_size=4, seed=0)
    try:
        with pytest.raises(ValueError, match=r"'bag' \(EmbeddingBag\) has 4 rows.*"
                                             r"first input tensor itself.*declare_batch_size"):
            model(idx, offsets)
        clipper.clear()
        if cls is TokensFirst:      # per-token rows before the bag: refused even declared
            clipper.declare_batch_size(4)
            with pytest.raises(ValueError, match=r"'tok' \(Linear\) has \d+ rows"):
                model(idx, offsets)
            return
        clipper.declare_batch_size(4)
        nn.functional.cross_entropy(model(idx, offsets), y).backward()
        assert clipper.privatize_().num_clipped >= 0
    finally:
        clipper.remove()


def test_the_batch_is_the_number_of_bags_in_every_forward_of_a_step():
    """Two forwards of one step on the same flat tokens: the second keeps the
    bags as the batch; a forward on other tokens in the same step is refused."""
    torch.manual_seed(1)
    model = BagNet(mode="mean")
    idx, offsets, _, y, _ = _batch("flat", 4, 2)
    clipper = GhostClipper(model, max_grad_norm=1.0, noise_multiplier=0.0,
                           expected_batch_size=4, loss_reduction="sum", seed=0,
                           forwards_per_step=2)
    try:
        loss = (nn.functional.cross_entropy(model(idx, offsets), y, reduction="sum")
                + nn.functional.cross_entropy(model(idx, offsets), y, reduction="sum"))
        loss.backward()
        assert clipper.privatize_().num_clipped >= 0
        model(idx, offsets)
        with pytest.raises(ValueError, match="after one of"):
            model(idx[:-1], offsets)
    finally:
        clipper.remove()


def test_every_clipped_contribution_is_at_most_C():
    """Each sample's private gradient alone (the others' rows zero, no noise)
    has norm <= C over the whole model, for bags with repeated rows,
    negative weights and two calls."""
    torch.manual_seed(9)
    model = BagNet(twice=True, mode="sum")
    idx, offsets, psw, y, bags = _batch("flat", 6, 11, psw=True)
    psw = psw.float() * 1e3
    C = 1e-3
    for b in range(6):
        s, e = bags[b]
        one = torch.tensor([0])
        clipper = GhostClipper(model, max_grad_norm=C, noise_multiplier=0.0,
                               expected_batch_size=1, loss_reduction="sum", seed=0)
        try:
            clipper.declare_batch_size(1)
            nn.functional.cross_entropy(model(idx[s:e], one, psw[s:e]), y[b:b + 1],
                                        reduction="sum").backward()
            clipper.privatize_()
        finally:
            clipper.remove()
        total = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters()))
        assert float(total) <= C
        model.zero_grad(set_to_none=True)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["sum 2d weights", "mean flat padding",
                                  "max flat empty bag padding", "twice"])
def test_embedding_bag_on_the_device(require_cuda, case):
    """The device route (scale_rows on the device, no unique): the same
    oracle on a GPU, or the emulated device in CI."""
    torch.manual_seed(3)
    if case == "twice":
        model, batch = BagNet(twice=True, mode="sum").double(), _batch("flat", 5, 8, psw=True)
    else:
        opts, form, kw = CASES[case]
        model, batch = BagNet(**opts).double(), _batch(form, 5, 4, **kw)
    _check(model, batch, F32, device=require_cuda)
    _check(model, batch, F64, device=require_cuda)


def _text_batch(rows):
    """The text-classification tutorial's collate: flat tokens, offsets, labels."""
    tokens = [t[t >= 0] for t, _ in rows]           # -1 pads the stored rows
    offsets = torch.tensor([0] + [len(t) for t in tokens[:-1]]).cumsum(0)
    labels = torch.stack([y for _, y in rows]) if rows else torch.zeros(0, dtype=torch.int64)
    flat = torch.cat(tokens) if rows else torch.zeros(0, dtype=torch.int64)
    return flat, offsets[:len(rows)], labels


def test_make_private_trains_a_bag_classifier_with_offsets():
    """The drop-in loop a text classifier takes (flat tokens and offsets by
    the tutorial's collate, nothing declared: the bags are the batch): steps
    run, the bag's weight moves and stays finite, and the accountant counts
    them."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(1, 6, (32,), generator=g)
    rows = torch.randint(0, V, (32, 5), generator=g)
    rows[torch.arange(5).unsqueeze(0) >= lengths.unsqueeze(1)] = -1
    data = torch.utils.data.TensorDataset(rows, torch.randint(0, 3, (32,), generator=g))
    loader = torch.utils.data.DataLoader(data, batch_size=8, collate_fn=_text_batch)
    model = BagNet(mode="mean")
    before = model.bag.weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    engine = nf.torch.PrivacyEngine(accountant="rdp")
    pm, popt, ploader = engine.make_private(module=model, optimizer=opt, data_loader=loader,
                                            noise_multiplier=1.0, max_grad_norm=1.0, seed=2)
    steps = 0
    for flat, offsets, y in ploader:        # the tutorial's loop, unchanged
        popt.zero_grad()
        nn.functional.cross_entropy(pm(flat, offsets), y).backward()
        popt.step()
        steps += 1
    assert steps == 4 and pm.clipper.steps == 4
    assert torch.isfinite(model.bag.weight).all()
    assert not torch.equal(model.bag.weight.detach(), before)
    assert engine.get_epsilon(1e-5) > 0

