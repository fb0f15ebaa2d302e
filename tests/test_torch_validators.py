"""ncdp_fast.torch.ModuleValidator: Opacus's names over get_compatible_module
and the clipper's check; what it refuses, it refuses loudly."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from ncdp_fast.torch import ModuleValidator  # noqa: E402


def _bn_net():
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Flatten(), nn.Linear(8 * 4 * 4, 2))


def test_fix_copies_and_replaces_batchnorm():
    model = _bn_net()
    fixed = ModuleValidator.fix(model)
    assert isinstance(model[1], nn.BatchNorm2d)          # the argument is left alone
    assert isinstance(fixed[1], nn.GroupNorm) and fixed[1].num_channels == 8
    assert ModuleValidator.is_valid(fixed) and ModuleValidator.validate(fixed) == []
    assert fixed(torch.randn(2, 3, 6, 6)).shape == (2, 2)


def test_validate_reports_or_raises_the_first_refusal():
    model = _bn_net()
    errors = ModuleValidator.validate(model, strict=False)
    assert len(errors) == 1 and "BatchNorm" in str(errors[0])
    assert not ModuleValidator.is_valid(model)
    with pytest.raises(type(errors[0]), match="BatchNorm"):
        ModuleValidator.validate(model, strict=True)


def test_fix_refuses_what_no_fix_makes_private():
    # A projected LSTM has no DP counterpart (a plain one is replaced: test_torch_rnn.py).
    with pytest.raises((TypeError, ValueError), match="LSTM with proj_size=2"):
        ModuleValidator.fix(nn.Sequential(nn.LSTM(4, 4, proj_size=2)))


def test_bad_arguments_refused():
    with pytest.raises(TypeError, match="expected no keyword arguments"):
        ModuleValidator.fix(_bn_net(), num_groups=4)
    with pytest.raises(TypeError, match="module: expected a torch.nn.Module"):
        ModuleValidator.validate("model")
    with pytest.raises(TypeError, match="strict: expected a bool"):
        ModuleValidator.validate(_bn_net(), strict=1)
