"""Everyday training scripts run unchanged (issue 37): the optimizer
``make_private`` returns is a ``torch.optim.Optimizer`` to what checks (LR
schedulers, ``isinstance``, step hooks, ``add_param_group``), with its privacy
checks intact."""
import copy

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from ncdp_fast.torch import PrivacyEngine  # noqa: E402


def _private(lr=0.1):
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    data = TensorDataset(torch.randn(64, 4), torch.randint(0, 3, (64,)))
    engine = PrivacyEngine()
    pm, opt, loader = engine.make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=lr),
        data_loader=DataLoader(data, batch_size=16), noise_multiplier=1.0, max_grad_norm=1.0,
        seed=1)
    return engine, model, pm, opt, loader


def _step(pm, opt, loader):
    x, y = next(iter(loader))
    opt.zero_grad()
    nn.functional.cross_entropy(pm(x), y).backward()
    return opt.step()


def _schedulers():
    out = [("StepLR", lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5),
            lambda k: 0.1 * 0.5 ** k),
           ("CosineAnnealingLR", lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, 4),
            None)]
    try:
        from transformers import get_linear_schedule_with_warmup
        out.append(("linear_warmup", lambda o: get_linear_schedule_with_warmup(o, 2, 10),
                    lambda k: 0.1 * min((k) / 2, (10 - k) / 8)))
    except ImportError:
        pass
    return out


@pytest.mark.parametrize("name, make, expected", _schedulers(), ids=lambda v: v
                         if isinstance(v, str) else "")
def test_lr_schedulers_drive_the_private_optimizer(name, make, expected):
    """Before: TypeError "DPOptimizer is not an Optimizer" at the scheduler's
    construction.  The learning rate each step uses is the scheduler's, on the
    wrapped optimizer's groups, and every step is still private and counted."""
    engine, model, pm, opt, loader = _private()
    assert isinstance(opt, torch.optim.Optimizer)
    scheduler = make(opt)
    twin = make(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1))
    for k in range(4):
        lr = opt.param_groups[0]["lr"]
        assert lr == twin.optimizer.param_groups[0]["lr"]
        if expected is not None:
            assert lr == pytest.approx(expected(k))
        before = model.weight.detach().clone()
        _step(pm, opt, loader)
        scheduler.step()
        twin.optimizer.step()
        twin.step()
        assert not torch.equal(before, model.weight) or lr == 0
    assert opt.original_optimizer.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert sum(h[2] for h in engine.accountant.history) == 4


def test_step_hooks_state_dict_and_copies():
    engine, model, pm, opt, loader = _private()
    calls = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: calls.append("post"))
    _step(pm, opt, loader)
    assert calls == ["pre", "post"]
    assert "ncdp_noise" in opt.state_dict()
    # Optimizer's own pickling keeps only the groups (a silently broken copy);
    # the wrapper's is all of it, and the clipper (the noise key) refuses to be copied.
    with pytest.raises(TypeError, match="GhostClipper: the clipper is not deep-copied"):
        copy.deepcopy(opt)


def test_a_group_added_outside_the_model_is_refused_at_the_step():
    engine, model, pm, opt, loader = _private()
    outside = nn.Parameter(torch.zeros(3))
    opt.add_param_group({"params": [outside]})
    assert opt.original_optimizer.param_groups[-1]["params"][0] is outside
    x, y = next(iter(loader))
    (nn.functional.cross_entropy(pm(x), y) + outside.sum()).backward()
    before = model.weight.detach().clone()
    with pytest.raises(ValueError, match=r"param_groups\[1\].*not a parameter of the model"):
        opt.step()
    assert torch.equal(before, model.weight) and not engine.accountant.history


def test_is_compatible_with_the_returned_optimizer():
    engine, model, pm, opt, loader = _private()
    assert PrivacyEngine().is_compatible(module=nn.Linear(4, 3), optimizer=opt)
