"""Attacks on what the torch drop-ins privatize (issue 23, items 1, 4 and the
double backward of 9): a parameter the mechanism never saw, or a gradient
term outside the layer its rule describes, would be applied raw while the
step is accounted as private.

Each test states the pattern; each must end exact or refused, and a refusal
must leave every parameter as it was (nothing stepped, nothing accounted)."""
import warnings

import pytest

torch = pytest.importorskip("torch")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from conftest import loader_batches  # noqa: E402

from ncdp_fast.torch import (FusedDPOptimizer, GhostClipper, PrivacyEngine,  # noqa: E402
                             register_layer)
from ncdp_fast.torch.layer_rules import linear_rule  # noqa: E402
from ncdp_fast.torch.layers import RULES  # noqa: E402

warnings.filterwarnings("ignore", module="opacus")

B = 4


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3)).double()


def _batch(seed=1, d=6, K=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, d, generator=g, dtype=torch.float64), torch.randint(0, K, (B,),
                                                                               generator=g)


def _snapshot(*modules_or_params):
    out = []
    for m in modules_or_params:
        ps = m.parameters() if isinstance(m, nn.Module) else [m]
        out += [p.detach().clone() for p in ps]
    return out


def _unchanged(before, *modules_or_params):
    return all(torch.equal(b, a) for b, a in zip(before, _snapshot(*modules_or_params)))


def _private(model, optimizer, sigma=1.0, C=1.0, data=None):
    """make_private on a loader of the B samples ``data`` (default ``_batch()``)
    in one batch (sample rate 1, E = 4 = B): each Poisson batch is ``data``
    whole, so every step (DPOptimizer.step expects each on the private
    loader's next batch) is on a full batch.  Also returns those batches."""
    engine = PrivacyEngine(accountant="rdp")
    data = TensorDataset(*(_batch() if data is None else data))
    module, opt, ploader = engine.make_private(module=model, optimizer=optimizer,
                                               data_loader=DataLoader(data, batch_size=B),
                                               noise_multiplier=sigma, max_grad_norm=C,
                                               seed=None)
    return engine, module, opt, loader_batches(ploader)


def _step(module, opt, batch, extra=None):
    """A step on ``batch`` (the private loader's next; a refused step leaves it
    the next one expected)."""
    x, y = batch
    opt.zero_grad()
    loss = F.cross_entropy(module(x), y)
    if extra is not None:
        loss = loss + extra
    loss.backward()
    opt.step()


# ------------------------------------------------ item 1: parameters never seen

def test_layer_unfrozen_after_make_private_is_refused_and_nothing_steps():
    model = _mlp()
    model[0].requires_grad_(False)
    engine, module, opt, batches = _private(model, torch.optim.SGD(model.parameters(), lr=1.0))
    model[0].requires_grad_(True)
    before = _snapshot(model)
    with pytest.raises(ValueError, match=r"'0\.weight'.*did not produce.*frozen when the "
                                         r"clipper was built.*make_private"):
        _step(module, opt, next(batches))
    assert _unchanged(before, model) and len(engine.accountant) == 0


def test_add_param_group_after_make_private_is_refused():
    model = _mlp()
    sgd = torch.optim.SGD(model.parameters(), lr=1.0)
    engine, module, opt, batches = _private(model, sgd)
    head = nn.Linear(3, 3).double()
    sgd.add_param_group({"params": head.parameters()})
    before = _snapshot(model, head)
    x, y = next(batches)
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['params'\]\[0\].*add_param_group"):
        F.cross_entropy(head(module(x)), y).backward()
        opt.step()
    assert _unchanged(before, model, head) and len(engine.accountant) == 0


def test_extra_parameter_given_to_the_optimizer_is_refused():
    model = _mlp()
    extra = nn.Parameter(torch.zeros(3, dtype=torch.float64))
    engine, module, opt, batches = _private(model,
                                            torch.optim.SGD([*model.parameters(), extra], lr=1.0))
    before = _snapshot(model, extra)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[4\].*extra parameter"):
        x, y = next(batches)
        F.cross_entropy(module(x) + extra, y).backward()
        opt.step()
    assert _unchanged(before, model, extra) and len(engine.accountant) == 0


def test_standalone_clipper_refuses_a_layer_unfrozen_after_attach():
    model = _mlp()
    model[2].requires_grad_(False)
    clipper = GhostClipper(model, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=B)
    model[2].requires_grad_(True)
    x, y = _batch()
    F.cross_entropy(model(x), y).backward()
    raw = model[2].weight.grad.clone()
    offset = clipper.offset
    with pytest.raises(ValueError, match=r"'2\.weight'"):
        clipper.privatize_()
    # Nothing written, no noise drawn.
    assert torch.equal(model[2].weight.grad, raw) and model[0].weight.grad is None
    assert clipper.offset == offset


def test_freezing_after_attach_is_honoured_and_exact():
    """A layer frozen after the clipper was built stays frozen, gets no gradient
    and draws no noise; the rest is the private gradient of a clipper built
    with that layer frozen from the start."""
    x, y = _batch()
    ref = _mlp()
    ref[0].requires_grad_(False)
    rc = GhostClipper(ref, max_grad_norm=0.5, noise_multiplier=0.0, expected_batch_size=B, seed=3)
    F.cross_entropy(ref(x), y).backward()
    rc.privatize_()

    model = _mlp()
    clipper = GhostClipper(model, max_grad_norm=0.5, noise_multiplier=0.0, expected_batch_size=B,
                           seed=3)
    model[0].requires_grad_(False)
    F.cross_entropy(model(x), y).backward()
    clipper.privatize_()
    assert not model[0].weight.requires_grad and not model[0].bias.requires_grad
    assert model[0].weight.grad is None and model[0].bias.grad is None
    assert torch.equal(model[2].weight.grad, ref[2].weight.grad)
    assert torch.equal(model[2].bias.grad, ref[2].bias.grad)
    assert clipper.offset == rc.offset            # noise drawn for layer 2 only
    # Unfrozen again: trained again, and its old private gradient is no refusal.
    model[0].requires_grad_(True)
    F.cross_entropy(model(x), y).backward()
    clipper.privatize_()
    assert model[0].weight.grad is not None


def test_frozen_with_a_stale_private_gradient_is_not_refused():
    """zero_grad(set_to_none=False) keeps the released tensors: a layer frozen
    then still holds its own private (zeroed) gradient, which may be applied."""
    model = _mlp()
    engine, module, opt, batches = _private(model, torch.optim.SGD(model.parameters(), lr=1.0))
    _step(module, opt, next(batches))
    model[0].requires_grad_(False)
    opt.zero_grad(set_to_none=False)
    before = _snapshot(model[0])
    x, y = next(batches)
    F.cross_entropy(module(x), y).backward()
    opt.step()
    assert _unchanged(before, model[0]) and module.clipper.steps == 2


def _tiny_head(C, sigma):
    return dict(max_grad_norm=C, noise_multiplier=sigma, expected_batch_size=B)


@settings(max_examples=25, deadline=None)
@given(frozen_at=st.lists(st.booleans(), min_size=3, max_size=3),
       flipped=st.lists(st.booleans(), min_size=3, max_size=3),
       extra=st.booleans())
def test_every_update_is_bounded_by_the_private_bound(frozen_at, flipped, extra):
    """The issue's attack as a property: sigma = 0, loss x 1000, any pattern of
    layers frozen at attach and flipped after, an optional extra parameter.
    Either the step is refused and nothing moves, or the whole update has norm
    <= lr * C * B / E (each of the B samples contributes at most C; E = B)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(),
                          nn.Linear(4, 2)).double()
    layers = [model[0], model[2], model[4]]
    for layer, f in zip(layers, frozen_at):
        layer.requires_grad_(not f)
    if all(frozen_at):
        return
    bonus = nn.Parameter(torch.zeros(2, dtype=torch.float64))
    params = [*model.parameters()] + ([bonus] if extra else [])
    lr, C = 1.0, 0.125
    opt = torch.optim.SGD(params, lr=lr)
    clipper = GhostClipper(model, **_tiny_head(C, 0.0), seed=0)
    now = [f if flip else not f for f, flip in zip(frozen_at, flipped)]
    if not any(now) and not extra:
        return                      # nothing requires grad: torch refuses the backward
    for layer, trainable in zip(layers, now):
        layer.requires_grad_(trainable)
    before = _snapshot(*params)
    x = torch.randn(B, 4, dtype=torch.float64)
    out = model(x) + (bonus if extra else 0)
    (1000 * out.square().sum()).backward()
    try:
        clipper.privatize_(opt)
    except (ValueError, RuntimeError):      # RuntimeError: every layer frozen since
        assert _unchanged(before, *params)
        return
    opt.step()
    moved = torch.cat([(a - b).reshape(-1) for a, b in zip(_snapshot(*params), before)])
    # The sum of B factors <= 1 times norms <= C, in float64: relative rounding
    # of a few ulps of the (B*P)-term sums, far below the 1e-9 allowed.
    E = B
    assert float(moved.norm()) <= lr * C * B / E * (1 + 1e-9)


# ------------------------------------------ item 4: gradient terms outside a layer

class TiedLM(nn.Module):
    """Output projection tied to the embedding through F.linear."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 4)
        self.mix = nn.Linear(4, 4)

    def forward(self, idx):
        h = self.mix(self.emb(idx)).mean(1)
        return F.linear(h, self.emb.weight)


def test_tied_weight_used_outside_its_layer_is_refused():
    torch.manual_seed(0)
    model = TiedLM().double()
    data = torch.randint(0, 7, (B, 3)), torch.randint(0, 7, (B,))
    engine, module, opt, batches = _private(model, torch.optim.SGD(model.parameters(), lr=1.0),
                                            data=data)
    before = _snapshot(model)
    idx, y = next(batches)
    F.cross_entropy(module(idx), y).backward()
    with pytest.raises(RuntimeError, match=r"'emb\.weight' \(Embedding\).*outside the layer"
                                           r".*F\.linear.*tie weights by calling the layer"):
        opt.step()
    assert _unchanged(before, model) and len(engine.accountant) == 0
    module.clipper.clear()               # discarded: the next step is clean
    opt.zero_grad()
    model.emb.weight.grad = None


def test_l2_penalty_in_the_loss_is_refused_and_weight_decay_is_the_fix():
    model = _mlp()
    engine, module, opt, batches = _private(model, torch.optim.SGD(model.parameters(), lr=1.0))
    before = _snapshot(model)
    penalty = 1e-3 * sum(p.square().sum() for p in model.parameters())
    batch = next(batches)
    with pytest.raises(RuntimeError, match=r"'0\.weight' \(Linear\).*penalty.*weight_decay"):
        _step(module, opt, batch, extra=penalty)
    assert _unchanged(before, model) and len(engine.accountant) == 0
    # After clear(), a step with the decay in the optimizer is accepted: on the
    # same batch, which the refused step left the next one expected.
    module.clipper.clear()
    opt.original_optimizer.param_groups[0]["weight_decay"] = 1e-3
    _step(module, opt, batch)
    assert len(engine.accountant) == 1


class DirectConv(nn.Conv2d):
    """Overrides forward and calls F.conv2d itself: _conv_forward never runs."""

    def forward(self, x):
        return F.conv2d(x, self.weight, self.bias, self.stride, self.padding)


class StandardisedInForward(nn.Conv2d):
    """Weight standardisation in forward, then the module's own _conv_forward."""

    def forward(self, x):
        w = self.weight - self.weight.mean(dim=(1, 2, 3), keepdim=True)
        return self._conv_forward(x, w, self.bias)


class StandardisedConv(nn.Conv2d):
    """Weight standardisation in an overridden _conv_forward."""

    def _conv_forward(self, x, weight, bias):
        w = weight - weight.mean(dim=(1, 2, 3), keepdim=True)
        return super()._conv_forward(x, w, bias)


def _conv_net(conv_cls):
    torch.manual_seed(0)
    return nn.Sequential(conv_cls(2, 3, 3), nn.Flatten(), nn.Linear(12, 2)).double()


def test_conv_subclass_with_own_forward_bypassing_conv_forward_is_refused():
    model = _conv_net(DirectConv)
    clipper = GhostClipper(model, **_tiny_head(1.0, 1.0))
    x = torch.randn(B, 2, 4, 4, dtype=torch.float64)
    F.cross_entropy(model(x), torch.zeros(B, dtype=torch.long)).backward()
    offset = clipper.offset
    with pytest.raises(RuntimeError, match=r"'0\.weight' \(DirectConv\).*outside the layer"):
        clipper.privatize_()
    assert clipper.offset == offset


def test_conv_subclass_transforming_its_weight_in_forward_is_refused():
    model = _conv_net(StandardisedInForward)
    GhostClipper(model, **_tiny_head(1.0, 1.0))
    with pytest.raises(ValueError, match=r"'0' \(StandardisedInForward\).*not its own "
                                         r"parameter.*register_layer"):
        model(torch.randn(B, 2, 4, 4, dtype=torch.float64))
    assert model[0].weight.requires_grad          # restored after the refusal


def test_conv_with_overridden_conv_forward_is_refused_at_construction():
    with pytest.raises(ValueError, match=r"'0' \(StandardisedConv\) overrides _conv_forward.*"
                                         r"register_layer"):
        GhostClipper(_conv_net(StandardisedConv), **_tiny_head(1.0, 1.0))


class PairOut(nn.Linear):
    """A registered layer whose forward returns a tuple."""

    def forward(self, x):
        y = super().forward(x)
        return y, y.detach()


@pytest.fixture
def pair_rule():
    register_layer(PairOut)(linear_rule)
    yield
    del RULES[PairOut]


def test_registered_layer_returning_a_tuple_is_refused(pair_rule):
    torch.manual_seed(0)
    first = PairOut(6, 5).double()
    model = nn.Sequential(first, nn.Linear(5, 3)).double()
    GhostClipper(model, **_tiny_head(1.0, 1.0))
    with pytest.raises(TypeError, match=r"'0' \(PairOut\) returned tuple, expected one tensor"):
        model[1](first(_batch()[0])[0])
    assert first.weight.requires_grad


@pytest.mark.parametrize("option, match", [("scale_grad_by_freq", "couples the samples"),
                                           ("sparse", "dense")])
def test_embedding_options_without_a_per_sample_gradient_are_refused(option, match):
    emb = nn.Embedding(7, 4, **{option: True})
    with pytest.raises(ValueError, match=rf"'0' \(nn.Embedding\): {option}=True.*{match}"):
        GhostClipper(nn.Sequential(emb, nn.Linear(4, 2)), **_tiny_head(1.0, 1.0))
    # Switched on after attach: refused at the step.
    emb = nn.Embedding(7, 4)
    model = nn.Sequential(emb, nn.Linear(4, 2))
    GhostClipper(model, **_tiny_head(1.0, 1.0))
    setattr(emb, option, True)
    with pytest.raises(ValueError, match=rf"{option}=True"):
        model(torch.randint(0, 7, (B, 3))).sum().backward()


# -------------------------------------- FusedDPOptimizer (Opacus grad_sample path)

def _fused(model, sigma=1.0):
    from opacus import GradSampleModule
    gsm = GradSampleModule(model)
    opt = FusedDPOptimizer(torch.optim.SGD(gsm.parameters(), lr=1.0), noise_multiplier=sigma,
                           max_grad_norm=1.0, expected_batch_size=B)
    return gsm, opt


def _opacus_backward(gsm):
    x, y = _batch()
    F.cross_entropy(gsm(x), y).backward()


def test_fused_two_backward_passes_are_refused():
    pytest.importorskip("opacus")
    model = _mlp()
    gsm, opt = _fused(model)
    _opacus_backward(gsm)
    _opacus_backward(gsm)
    before, offset = _snapshot(model), opt.offset
    with pytest.raises(ValueError, match=r"grad_sample holds 2 backward passes.*one backward "
                                         r"per step"):
        opt.step()
    assert _unchanged(before, model) and opt.offset == offset and opt.steps == 0


def test_fused_unfrozen_or_added_parameters_are_refused():
    pytest.importorskip("opacus")
    model = _mlp()
    model[0].requires_grad_(False)
    gsm, opt = _fused(model)
    model[0].requires_grad_(True)
    _opacus_backward(gsm)
    before = _snapshot(model)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[0\].*did not require "
                                         r"grad when this optimizer was built"):
        opt.step()
    assert _unchanged(before, model) and opt.steps == 0

    model = _mlp()
    gsm, opt = _fused(model)
    extra = nn.Parameter(torch.zeros(3, dtype=torch.float64))
    opt.original_optimizer.add_param_group({"params": [extra]})
    x, y = _batch()
    F.cross_entropy(gsm(x) + extra, y).backward()
    before = _snapshot(model, extra)
    with pytest.raises(ValueError, match=r"param_groups\[1\]\['params'\]\[0\].*add_param_group"):
        opt.step()
    assert _unchanged(before, model, extra) and opt.steps == 0


def test_fused_freezing_after_construction_is_honoured():
    pytest.importorskip("opacus")
    model = _mlp()
    gsm, opt = _fused(model, sigma=1.0)
    model[0].requires_grad_(False)
    before = _snapshot(model[0])
    offset = opt.offset
    opt.zero_grad()
    _opacus_backward(gsm)
    opt.step()
    assert _unchanged(before, model[0]) and model[0].weight.grad is None
    assert opt.offset - offset == sum(p.numel() for p in model[2].parameters())
