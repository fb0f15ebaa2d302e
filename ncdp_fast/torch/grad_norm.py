"""``torch.nn.utils.clip_grad_norm_`` between backward and the private step.

Scripts clip and log the gradient norm after ``loss.backward()``.  Under the
clipper the parameters' gradients are formed inside ``optimizer.step()``
(each sample's clipped at max_grad_norm, then noised), so at that point they
are None: torch's function sees no gradient, clips nothing and returns 0.0,
a number scripts would log as if it were true.  The function is wrapped once,
when the first clipper is built, to warn when any parameter it is given
belongs to a clipper with a step pending and has no gradient; it then runs
torch's own unchanged.  (Called after ``optimizer.step()`` it sees the
private gradient: clipping that is post-processing.)  A script that bound
``clip_grad_norm_`` by ``from torch.nn.utils import clip_grad_norm_`` before
the first clipper was built keeps torch's unwrapped function: no warning.
"""
from __future__ import annotations

import functools
import warnings
import weakref

import torch

__all__ = ["GradientNotFormedWarning", "watch"]


class GradientNotFormedWarning(UserWarning):
    """clip_grad_norm_ was called on private parameters before their gradient exists."""


# id(parameter) -> (weak parameter, weak clipper): weak both ways, so a dropped
# model or clipper is forgotten; keyed by id because a tensor's == is
# elementwise (a WeakKeyDictionary would compare tensors).
_OWNERS: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def _pending_bound(parameters):
    """The max_grad_norm of a clipper with a step pending over one of
    ``parameters`` whose gradient is None, or None."""
    for p in parameters:
        if not isinstance(p, torch.Tensor) or p.grad is not None:
            continue
        refs = _OWNERS.get(id(p))
        clipper = refs[1]() if refs is not None and refs[0]() is p else None
        if clipper is not None and any(tap.records for tap in clipper.taps):
            return clipper.max_grad_norm
    return None


def _wrap(original):
    @functools.wraps(original)
    def clip_grad_norm_(parameters, *args, **kwargs):
        parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        bound = _pending_bound(parameters)
        if bound is not None:
            warnings.warn(GradientNotFormedWarning(
                "clip_grad_norm_: these parameters are privatized by ncdp_fast, whose "
                "gradients are formed at optimizer.step() (each sample's clipped at "
                f"max_grad_norm={bound:g}, then noised); after backward they are None, so "
                "this call clips nothing and returns 0.0, which is not the gradient's norm. "
                "The per-sample clip already bounds every sample: drop the call, or call it "
                "after optimizer.step() to read (and clip) the private gradient"),
                stacklevel=2)
        return original(parameters, *args, **kwargs)
    clip_grad_norm_._ncdp_original = original
    return clip_grad_norm_


def _install() -> None:
    import torch.nn.utils as utils
    import torch.nn.utils.clip_grad as clip_grad
    for module in (utils, clip_grad):
        if not hasattr(module.clip_grad_norm_, "_ncdp_original"):
            module.clip_grad_norm_ = _wrap(module.clip_grad_norm_)


def watch(clipper, params) -> None:
    """Warn when ``clip_grad_norm_`` is called on ``params`` while ``clipper``
    has a step pending (installs the wrapper on first use)."""
    _install()
    for key in [k for k, (p, c) in _OWNERS.items() if p() is None or c() is None]:
        del _OWNERS[key]
    ref = weakref.ref(clipper)
    for p in params:
        _OWNERS[id(p)] = (weakref.ref(p), ref)
