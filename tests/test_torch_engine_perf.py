"""Issue 25, engine overhead: ``PrivacyEngine.noise_multiplier`` reads through to
the optimizer (a noise scheduler's change shows there, it never goes stale),
and the per-step foreign-gradient check, now walked once per distinct
parameter, still refuses every gradient the step would apply raw."""
import warnings

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from ncdp_fast.torch import GhostClipper, PrivacyEngine  # noqa: E402
from conftest import loader_batches  # noqa: E402

warnings.filterwarnings("ignore", module="opacus")

N, BATCH = 24, 6


def _setup(sigma=1.0, lr=0.1):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N, 5, generator=g)
    y = torch.randint(0, 3, (N,), generator=g)
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
    engine = PrivacyEngine(accountant="rdp")
    pm, popt, ploader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=lr),
        data_loader=DataLoader(TensorDataset(x, y), batch_size=BATCH),
        noise_multiplier=sigma, max_grad_norm=1.0, seed=7)
    # A step is taken on the private loader's next batch only (DPOptimizer.step).
    return engine, pm, popt, loader_batches(ploader)


def _step(pm, popt, x, y):
    popt.zero_grad()
    nn.functional.cross_entropy(pm(x), y).backward()
    popt.step()


def test_engine_noise_multiplier_follows_an_opacus_noise_scheduler():
    """ExponentialNoise sets optimizer.noise_multiplier each scheduler step: the
    engine's attribute shows the same sigma (it was make_private's value
    forever before), and the accountant records each step at its own sigma."""
    schedulers = pytest.importorskip("opacus.schedulers")
    engine, pm, popt, batches = _setup(sigma=2.0)
    sched = schedulers.ExponentialNoise(popt, gamma=0.5)
    seen = []
    for _ in range(3):
        _step(pm, popt, *next(batches))
        seen.append(engine.noise_multiplier)
        sched.step()
    assert seen == [2.0, 1.0, 0.5]
    assert engine.noise_multiplier == popt.noise_multiplier == pm.clipper.noise_multiplier == 0.25
    assert [(h.noise_multiplier, h.steps) for h in engine.accountant.history] == \
        [(2.0, 1), (1.0, 1), (0.5, 1)]


def test_engine_noise_multiplier_set_goes_to_the_optimizer_checked():
    engine, pm, popt, batches = _setup()
    engine.noise_multiplier = 1.5
    assert popt.noise_multiplier == pm.clipper.noise_multiplier == 1.5
    with pytest.raises(ValueError, match="noise_multiplier"):
        engine.noise_multiplier = -1.0
    assert engine.noise_multiplier == 1.5          # a refused value changes nothing
    _step(pm, popt, *next(batches))
    assert engine.accountant.history[-1].noise_multiplier == 1.5


def test_engine_noise_multiplier_before_make_private():
    engine = PrivacyEngine(accountant="rdp")
    assert engine.noise_multiplier is None
    with pytest.raises(RuntimeError, match="after make_private"):
        engine.noise_multiplier = 1.0


def _grads_of(model):
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def test_foreign_gradient_on_an_optimizer_only_parameter_is_refused_every_step():
    """A parameter the optimizer holds outside the model (added by
    add_param_group after make_private) with a raw gradient is refused at each
    step, before anything is written; the model's gradients stay as backward
    left them (none: the clipper switches them off). The refused steps are on
    the loader's next batch, which they leave awaiting its step: the step that
    goes through is on that batch again."""
    engine, pm, popt, batches = _setup()
    x, y = next(batches)
    extra = nn.Parameter(torch.ones(2))
    popt.original_optimizer.add_param_group({"params": [extra]})
    for _ in range(2):
        popt.zero_grad()
        nn.functional.cross_entropy(pm(x), y).backward()
        extra.grad = torch.ones(2)
        before = _grads_of(pm)
        with pytest.raises(ValueError, match=r"param_groups\[1\]\['params'\]\[0\].*raw"):
            popt.step()
        assert all(b is None for b in before)
        assert _grads_of(pm) == before
        pm.clipper.clear()
        extra.grad = None
    _step(pm, popt, x, y)                            # without it the step goes through
    assert len(engine.accountant.history) == 1


def test_foreign_gradient_on_a_model_parameter_unfrozen_after_construction_is_refused():
    """A model parameter frozen at construction and unfrozen since, listed in the
    optimizer too (once by the model, once by the optimizer): refused, named
    by its model name."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
    model[2].bias.requires_grad_(False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    clipper = GhostClipper(model, max_grad_norm=1.0, noise_multiplier=1.0,
                           expected_batch_size=float(BATCH), seed=9)
    x, y = torch.randn(BATCH, 5), torch.randint(0, 3, (BATCH,))
    model[2].bias.requires_grad_(True)
    for _ in range(2):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        assert model[2].bias.grad is not None
        with pytest.raises(ValueError, match=r"'2\.bias'.*frozen when the clipper was built"):
            clipper.privatize_(opt)
        clipper.clear()


def test_released_gradient_passes_and_a_replaced_one_is_refused():
    """The gradient the step released passes the next step's check (identity);
    the same values in a new tensor do not (each step on the loader's next batch)."""
    engine, pm, popt, batches = _setup()
    _step(pm, popt, *next(batches))
    layer = pm._module[0]
    layer.weight.requires_grad_(False)     # left out of the next step: its released grad stays
    popt.zero_grad(set_to_none=False)      # zeroed in place: the same tensors
    x, y = next(batches)
    nn.functional.cross_entropy(pm(x), y).backward()
    popt.step()
    layer.weight.grad = layer.weight.grad.clone()   # equal values, not the released tensor
    x, y = next(batches)
    nn.functional.cross_entropy(pm(x), y).backward()
    with pytest.raises(ValueError, match=r"'0\.weight'.*frozen when this step's forward ran"):
        popt.step()
