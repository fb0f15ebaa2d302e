"""Issue 25: the accountant and optimizer API Opacus user code calls, the
compatibility checks, disable_hooks / enable_hooks and eval-mode forwards."""
import copy
import math
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import ncdp_fast as nf  # noqa: E402
from ncdp_fast import privacy  # noqa: E402
from ncdp_fast.torch import DPLSTM, GhostClipper, PrivacyEngine  # noqa: E402
from conftest import loader_batches  # noqa: E402

warnings.filterwarnings("ignore", module="opacus")

N, BATCH, C = 24, 6, 0.5
Q = BATCH / N


def _setup(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, 5, generator=g, dtype=torch.float64)
    y = torch.randint(0, 3, (N,), generator=g)
    loader = DataLoader(TensorDataset(x, y), batch_size=BATCH)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 8), nn.LayerNorm(8), nn.ReLU(), nn.Linear(8, 3)).double()
    return model, x, y, loader


def _private(model, loader, sigma=1.0, lr=0.1, seed=None, engine=None, **kw):
    engine = engine or PrivacyEngine(accountant="rdp")   # the cheapest rigorous accountant
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    pm, popt, ploader = engine.make_private(module=model, optimizer=opt, data_loader=loader,
                                            noise_multiplier=sigma, max_grad_norm=C, seed=seed,
                                            **kw)
    return engine, pm, popt, ploader


def _step(pm, popt, x, y):
    """One step on ``(x, y)``: the private loader's next batch (the
    optimizer refuses a step on any other, and the accountant records each
    step as one Poisson batch at rate Q = 1 / len(loader))."""
    popt.zero_grad()
    nn.functional.cross_entropy(pm(x), y).backward()
    popt.step()


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _same(a, b):
    return all(torch.equal(p, q) for p, q in zip(a, b))


# ------------------------------------------------------------------ accountant
def test_accountant_answers_opacus_calls():
    model, _, _, loader = _setup()
    engine, pm, popt, ploader = _private(model, loader)
    assert engine.accountant.get_epsilon(1e-5) == 0.0 and len(engine.accountant) == 0
    assert engine.accountant.history == [] and engine.accountant.mechanism() == "rdp"
    batches = loader_batches(ploader)
    for _ in range(3):
        _step(pm, popt, *next(batches))
    acc = engine.accountant
    # Opacus's format: a list of (noise_multiplier, sample_rate, num_steps), one
    # entry per run of equal steps; len() counts entries.
    assert acc.history == [(1.0, Q, 3)] and len(acc) == 1
    sigma, q, steps = acc.history[0]
    assert (sigma, q, steps) == (1.0, Q, 3)
    eps = privacy.epsilon_poisson_gaussian(1.0, Q, 3, 1e-5, "rdp")
    assert acc.get_epsilon(1e-5) == engine.get_epsilon(1e-5) == eps
    # The list handed out is a copy: changing it changes nothing recorded.
    acc.history.append((0.1, 1.0, 100))
    assert acc.history == [(1.0, Q, 3)]
    assert privacy.Accountant.from_dict(acc.state_dict()) == acc
    with pytest.raises(ValueError, match="delta: expected"):
        acc.get_epsilon(2.0)


def test_opacus_attributes_scripts_read_and_its_optimizer_constructor():
    """Opacus's examples read data_loader.sample_rate and
    optimizer.loss_reduction (missing until 2026-12-02, the sixth audit); its
    DPOptimizer(optimizer, noise_multiplier=..., ...) met a bare TypeError and
    is now refused naming make_private."""
    from ncdp_fast.torch import DPOptimizer
    model, _, _, loader = _setup()
    engine, pm, popt, ploader = _private(model, loader)
    assert ploader.sample_rate == Q and popt.loss_reduction == "mean"
    with pytest.raises(TypeError, match=r"DPOptimizer: expected \(optimizer, clipper: "
                                        r"GhostClipper, on_step\).*\['expected_batch_size', "
                                        r"'max_grad_norm', 'noise_multiplier'\].*make_private"):
        DPOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), noise_multiplier=1.0,
                    max_grad_norm=1.0, expected_batch_size=4)


def test_gaussian_events_read_as_opacus_history_tuples():
    acc = privacy.Accountant().step(noise_multiplier=1.1, sample_rate=0.01, steps=250)
    assert acc.history == ((1.1, 0.01, 250),)
    assert acc.history[0] == privacy.GaussianEvent(1.1, 0.01, 250)
    assert acc.history[0].noise_multiplier == 1.1 and acc.history[0].to_dict()["steps"] == 250


def test_noise_free_step_makes_the_accountant_infinite():
    model, _, _, loader = _setup()
    engine, pm, popt, ploader = _private(model, loader, sigma=0.0)
    _step(pm, popt, *next(loader_batches(ploader)))
    assert engine.accountant.get_epsilon(1e-5) == engine.get_epsilon(1e-5) == math.inf


# ------------------------------------------------------------ noise_multiplier
def test_set_noise_multiplier_noises_and_accounts_each_step_at_its_own_sigma():
    """Each step's noise equals the reference draws of its stream slice times
    that step's sigma * C / E, and the accountant holds each step at its sigma."""
    model, _, _, loader = _setup()
    ref = copy.deepcopy(model)
    engine, pm, popt, ploader = _private(model, loader, lr=0.0)   # lr 0: the models stay equal
    ref_clipper = GhostClipper(ref, max_grad_norm=C, noise_multiplier=0.0,
                               expected_batch_size=popt.expected_batch_size)
    E = popt.expected_batch_size
    batches = loader_batches(ploader)
    for sigma in (1.0, 1.0, 0.25, 3.0):
        xb, yb = next(batches)                  # the reference clips the same batch
        popt.noise_multiplier = sigma
        assert popt.noise_multiplier == sigma == pm.clipper.noise_multiplier
        _step(pm, popt, xb, yb)
        res = pm.clipper.last_result
        for p in ref.parameters():
            p.grad = None
        nn.functional.cross_entropy(ref(xb), yb).backward()
        ref_clipper.privatize_()
        noisy = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        clean = torch.cat([p.grad.reshape(-1) for p in ref.parameters()])
        noise = sigma * C / E * torch.from_numpy(
            nf.gaussian(noisy.numel(), seed=pm.clipper.seed, offset=res.offset,
                        dtype=np.float64))
        assert res.draws == noisy.numel()
        # Same clipped sum on both sides; each side holds a few float64 roundings
        # (the sum plus noise, the product by 1/E): 8 ulps of the largest term.
        tol = 8 * 2.0 ** -53 * (noisy.abs() + clean.abs() + noise.abs())
        assert ((noisy - clean - noise).abs() <= tol).all()
    assert engine.accountant.history == [(1.0, Q, 2), (0.25, Q, 1), (3.0, Q, 1)]
    fresh = privacy.Accountant()
    for sigma in (1.0, 1.0, 0.25, 3.0):
        fresh.step(noise_multiplier=sigma, sample_rate=Q)
    assert engine.get_epsilon(1e-5) == fresh.epsilon(1e-5, "rdp")


@settings(max_examples=15, deadline=None, derandomize=True)
@given(st.lists(st.sampled_from([0.5, 1.0, 2.0]), min_size=1, max_size=5))
def test_any_sigma_schedule_is_recorded_step_by_step_on_fresh_noise(sigmas):
    """Property: whatever the schedule, the history is its run-length encoding
    (each step at the sigma it was noised with) and each step's noise is the
    next unused range of the stream (the loader draws each pass's batches from
    the same stream as the pass begins, so the range starts after them)."""
    model, _, _, loader = _setup()
    engine, pm, popt, ploader = _private(model, loader)
    P = sum(p.numel() for p in model.parameters())
    batches = loader_batches(ploader)
    for sigma in sigmas:
        popt.noise_multiplier = sigma
        xb, yb = next(batches)
        start = pm.clipper.offset
        _step(pm, popt, xb, yb)
        assert pm.clipper.last_result.offset == start and pm.clipper.offset == start + P
    runs = []
    for sigma in sigmas:
        if runs and runs[-1][0] == sigma:
            runs[-1] = (sigma, Q, runs[-1][2] + 1)
        else:
            runs.append((sigma, Q, 1))
    assert engine.accountant.history == runs


def test_opacus_noise_scheduler_drives_the_optimizer():
    schedulers = pytest.importorskip("opacus.schedulers")
    model, _, _, loader = _setup()
    engine, pm, popt, ploader = _private(model, loader, sigma=2.0)
    scheduler = schedulers.ExponentialNoise(popt, gamma=0.5)
    batches = loader_batches(ploader)
    for _ in range(2):
        _step(pm, popt, *next(batches))
        scheduler.step()
    assert popt.noise_multiplier == 0.5
    assert engine.accountant.history == [(2.0, Q, 1), (1.0, Q, 1)]


@pytest.mark.parametrize("value, error, match", [
    (-0.5, ValueError, "noise_multiplier: expected a finite number >= 0, got -0.5"),
    (float("nan"), ValueError, "noise_multiplier: expected a real number, got nan"),
    (float("inf"), ValueError, "noise_multiplier: expected a finite number >= 0, got inf"),
    ("1.0", TypeError, "noise_multiplier: expected a real number, got str"),
    (1e300, ValueError, "noise_multiplier: .*too large a noise std"),
])
def test_bad_noise_multiplier_is_refused_and_changes_nothing(value, error, match):
    model, x, y, loader = _setup()
    _, pm, popt, _ = _private(model, loader)
    with pytest.raises(error, match=match):
        popt.noise_multiplier = value
    assert popt.noise_multiplier == 1.0
    with pytest.raises(error, match=match):
        pm.clipper.noise_multiplier = value
    assert pm.clipper.noise_multiplier == 1.0


def _set_across_ranks(rank, world, name):
    import torch.distributed as dist
    clipper = GhostClipper(nn.Linear(3, 2).double(), max_grad_norm=C, noise_multiplier=1.0,
                           expected_batch_size=4.0, group=dist.group.WORLD)
    agreed = getattr(clipper, name)
    setattr(clipper, name, agreed)          # the value the ranks agreed on: allowed
    try:
        setattr(clipper, name, agreed / 2)
    except ValueError as e:
        return str(e), getattr(clipper, name)
    return None, getattr(clipper, name)


@pytest.mark.parametrize("name, agreed", [("noise_multiplier", 1.0), ("max_grad_norm", C)])
def test_noise_multiplier_or_bound_change_across_ranks_is_refused(name, agreed):
    """noise_multiplier (noise schedulers) and max_grad_norm (grad-clip schedulers)."""
    pytest.importorskip("torch.distributed")
    from _distributed import spawn
    message, value = spawn(_set_across_ranks, 1, name, timeout=90)[0]
    assert value == agreed
    assert message.startswith(f"{name}: expected {agreed}") and "group=" in message


# --------------------------------------------------------------- compatibility
def test_get_compatible_module_is_compatible_and_validate():
    engine = PrivacyEngine()
    bn = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    assert not engine.is_compatible(module=bn, optimizer=None, data_loader=None)
    with pytest.raises(ValueError, match="BatchNorm1d"):
        engine.validate(module=bn, optimizer=None, data_loader=None)
    fixed = PrivacyEngine.get_compatible_module(bn)
    assert isinstance(fixed[1], nn.GroupNorm)
    opt = torch.optim.SGD(fixed.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=2)
    assert engine.is_compatible(module=fixed, optimizer=opt, data_loader=loader)
    engine.validate(module=fixed, optimizer=opt, data_loader=loader)
    # Validation attaches nothing to the model.
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in fixed.modules())
    lstm = nn.Sequential(nn.Linear(3, 3), nn.LSTM(3, 3))
    assert not engine.is_compatible(module=lstm, optimizer=None, data_loader=None)
    # The fix replaces it by DPLSTM (issue 25; tests/test_torch_rnn.py); what no
    # fix makes private is refused, naming the layer.
    assert isinstance(PrivacyEngine.get_compatible_module(lstm)[1], DPLSTM)
    with pytest.raises(ValueError, match="LSTM with proj_size=2"):
        PrivacyEngine.get_compatible_module(nn.Sequential(nn.LSTM(3, 3, proj_size=2)))
    with pytest.raises(TypeError, match="optimizer: expected a torch.optim.Optimizer, got str"):
        engine.validate(module=fixed, optimizer="sgd", data_loader=loader)
    empty = DataLoader(TensorDataset(torch.randn(0, 4)), batch_size=2)
    with pytest.raises(ValueError, match="data_loader: expected at least one batch"):
        engine.validate(module=fixed, optimizer=opt, data_loader=empty)
    assert not engine.is_compatible(module=fixed, optimizer=opt, data_loader=empty)


# ------------------------------------------------------- hooks off, eval mode
def test_disabled_hooks_give_ordinary_gradients_and_the_step_is_refused():
    """The refused step is on the loader's next batch, which it leaves awaiting
    its step: the step after enable_hooks() is on that batch again."""
    model, _, _, loader = _setup()
    plain = copy.deepcopy(model)
    engine, pm, popt, ploader = _private(model, loader)
    xb, yb = next(loader_batches(ploader))
    pm.disable_hooks()
    popt.zero_grad()
    nn.functional.cross_entropy(pm(xb), yb).backward()
    nn.functional.cross_entropy(plain(xb), yb).backward()
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(),
                                                           plain.parameters()))
    before, offset = _params(model), pm.clipper.offset
    with pytest.raises(RuntimeError, match=r"disable_hooks\(\)"):
        popt.step()
    assert _same(before, model.parameters()) and pm.clipper.offset == offset
    assert len(engine.accountant) == 0
    pm.enable_hooks()
    _step(pm, popt, xb, yb)
    assert not _same(before, model.parameters()) and len(engine.accountant) == 1


def test_eval_forward_with_grad_records_nothing_and_training_goes_on():
    model, x, y, loader = _setup()
    engine, pm, popt, ploader = _private(model, loader)
    pm.eval()
    nn.functional.cross_entropy(pm(x), y)           # an evaluation loss, no backward
    pm.train()
    _step(pm, popt, *next(loader_batches(ploader)))
    assert len(engine.accountant) == 1


@pytest.mark.parametrize("wrap_model", [True, False])
def test_step_after_an_eval_mode_backward_is_refused_naming_eval(wrap_model):
    """The refused steps are on the loader's next batch, which they leave
    awaiting its step: the step that goes through is on that batch again."""
    model, _, _, loader = _setup()
    engine, pm, popt, ploader = _private(model, loader, wrap_model=wrap_model)
    clipper = popt.clipper
    xb, yb = next(loader_batches(ploader))
    pm.eval()
    popt.zero_grad()
    nn.functional.cross_entropy(pm(xb), yb).backward()
    before, offset = _params(model), clipper.offset
    with pytest.raises(RuntimeError, match=r"ran in eval mode .*model\.eval\(\)"):
        popt.step()
    assert _same(before, model.parameters()) and clipper.offset == offset
    assert len(engine.accountant) == 0
    # The same with a training step after the eval backward: its gradient is
    # still held, so the step is still refused.
    pm.train()
    nn.functional.cross_entropy(pm(xb), yb).backward()
    with pytest.raises(RuntimeError, match="ran in eval mode"):
        popt.step()
    assert _same(before, model.parameters()) and len(engine.accountant) == 0
    # Discarded, training goes on.
    popt.zero_grad()
    clipper.clear()
    _step(pm, popt, xb, yb)
    assert len(engine.accountant) == 1


def test_an_eval_mode_gradient_zeroed_in_place_is_not_refused():
    """zero_grad(set_to_none=False) discards an eval-mode backward's gradient
    as surely as set_to_none=True: the next training step goes through (it was
    refused until 2026-12-02, a false positive), and its gradient is the
    batch's clipped mean alone (sigma 0: a clipper of its own on a copy)."""
    model, _, _, loader = _setup()
    twin = copy.deepcopy(model)
    engine, pm, popt, ploader = _private(model, loader, sigma=0.0)
    xb, yb = next(loader_batches(ploader))
    pm.eval()
    nn.functional.cross_entropy(pm(xb), yb).backward()
    pm.train()
    popt.zero_grad(set_to_none=False)
    nn.functional.cross_entropy(pm(xb), yb).backward()
    popt.step()
    assert len(engine.accountant) == 1
    clipper = GhostClipper(twin, max_grad_norm=C, noise_multiplier=0.0, expected_batch_size=N * Q)
    nn.functional.cross_entropy(twin(xb), yb).backward()
    clipper.privatize_()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_a_discriminator_on_a_real_and_a_fake_batch_pairs_their_rows_with_two_forwards():
    """Opacus's dcgan.py runs D on the real batch and on a fake one before one
    backward; refused by default (two forwards a step), with
    forwards_per_step=2 real row i and fake row i are clipped as one sample,
    as Opacus's per-sample gradients sum them (docs/torch.md's table)."""
    torch.manual_seed(0)
    disc = nn.Sequential(nn.Linear(4, 8), nn.LeakyReLU(0.2), nn.Linear(8, 1)).double()
    g = torch.Generator().manual_seed(1)
    real, fake = (torch.randn(5, 4, generator=g, dtype=torch.float64) for _ in range(2))
    bce = nn.BCEWithLogitsLoss(reduction="sum")

    def loss(m, r, f):
        return (bce(m(r).squeeze(1), torch.ones(len(r), dtype=torch.float64))
                + bce(m(f).squeeze(1), torch.zeros(len(f), dtype=torch.float64)))
    bound = 1.0
    expected = [torch.zeros_like(p) for p in disc.parameters()]
    clipped = 0
    for i in range(5):
        m = copy.deepcopy(disc)
        loss(m, real[i:i + 1], fake[i:i + 1]).backward()
        grads = [p.grad for p in m.parameters()]
        f = min(1.0, bound / float(torch.sqrt(sum(x.square().sum() for x in grads))))
        clipped += f < 1
        expected = [e + f * x for e, x in zip(expected, grads)]
    assert 0 < clipped < 5
    m = copy.deepcopy(disc)
    clipper = GhostClipper(m, max_grad_norm=bound, noise_multiplier=0.0, expected_batch_size=1,
                           loss_reduction="sum")
    with pytest.raises(ValueError, match=r"ran forward 2 times in one step .*forwards_per_step"):
        loss(m, real, fake)
    clipper.remove()
    m = copy.deepcopy(disc)
    clipper = GhostClipper(m, max_grad_norm=bound, noise_multiplier=0.0, expected_batch_size=1,
                           loss_reduction="sum", forwards_per_step=2)
    loss(m, real, fake).backward()
    clipper.privatize_()
    for p, e in zip(m.parameters(), expected):
        torch.testing.assert_close(p.grad, e, rtol=1e-10, atol=0)
