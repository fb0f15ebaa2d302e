"""Opacus's ``ModuleValidator`` (``opacus.validators``), so that a script that
calls ``ModuleValidator.fix(model)`` migrates by changing its import alone.

It is a thin face over :class:`~ncdp_fast.torch.PrivacyEngine`'s
``get_compatible_module`` (the fixes: batch norm -> group norm, ``nn.LSTM`` /
``nn.GRU`` / ``nn.RNN`` -> ``DPLSTM`` / ``DPGRU`` / ``DPRNN`` with their weights)
and the
clipper's construction-time check (:meth:`GhostClipper.check_model`), which
is what ``make_private`` refuses; nothing here decides compatibility itself.
"""
from __future__ import annotations

import copy

from torch import nn

from .clipper import GhostClipper
from .engine import PrivacyEngine

__all__ = ["ModuleValidator"]


def _check_module(module) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"module: expected a torch.nn.Module, got {type(module).__name__}")


class ModuleValidator:
    """Opacus's ``ModuleValidator``: ``fix``, ``validate``, ``is_valid``,
    ``fix_and_validate`` (class methods, Opacus's signatures).

    Differences, each on the side of refusing: ``validate`` reports the first
    refusal the clipper finds (a list of at most one exception, the
    ``TypeError``/``ValueError`` ``make_private`` would raise), not one entry
    per layer; and ``fix`` raises, naming the layer, when something remains
    that no fix makes private (Opacus's ``fix`` returns it and lets
    ``validate`` say so).  Eval mode is not an error here (a step over an
    eval-mode backward is refused at the step instead).
    """

    @classmethod
    def fix(cls, module: nn.Module, **kwargs) -> nn.Module:
        """A copy of ``module`` (the argument is left as it was, as Opacus's
        ``fix`` clones) with every batch norm replaced by a group norm over the
        same channels (:func:`~ncdp_fast.torch.fix_batchnorm`) and every torch
        recurrent layer by its DP counterpart with the same weights
        (:func:`~ncdp_fast.torch.fix.fix_recurrent`), then checked."""
        _check_module(module)
        if kwargs:
            # Opacus passes these to its per-layer fixers; ours takes none, and
            # a silently ignored option would be a fix the user did not get.
            raise TypeError(f"ModuleValidator.fix: expected no keyword arguments, got "
                            f"{sorted(kwargs)}; the fixes here (batch norm -> group norm "
                            f"with gcd(32, C) groups, recurrent -> DPLSTM/DPGRU/DPRNN) have "
                            f"no options")
        return PrivacyEngine.get_compatible_module(copy.deepcopy(module))

    @classmethod
    def validate(cls, module: nn.Module, *, strict: bool = False) -> list:
        """``[]`` when ``make_private`` accepts the model's layers; else, with
        ``strict=False``, a list holding the first refusal (an exception naming
        the layer), and with ``strict=True`` that refusal raised."""
        _check_module(module)
        if not isinstance(strict, bool):
            raise TypeError(f"strict: expected a bool, got {type(strict).__name__}")
        try:
            GhostClipper.check_model(module)
        except (TypeError, ValueError) as exc:
            if strict:
                raise
            return [exc]
        return []

    @classmethod
    def is_valid(cls, module: nn.Module) -> bool:
        """Whether :meth:`validate` finds nothing."""
        return not cls.validate(module, strict=False)

    @classmethod
    def fix_and_validate(cls, module: nn.Module, **kwargs) -> nn.Module:
        """:meth:`fix` (which already raises what remains refused)."""
        return cls.fix(module, **kwargs)
