"""AMP's GradScaler and the private step: refused by name.

A GradScaler multiplies the loss by its scale S, unscales the parameters'
gradients and checks them for inf before the optimizer steps.  Here there is
nothing to unscale at that point: the private gradient is formed inside
``optimizer.step()`` from each sample's output gradients, which carry S, so
each sample would be clipped at max_grad_norm as if its gradient were S times
larger, and the scaler's own bookkeeping (``update()``) finds no inf check.
The optimizer tells GradScaler it handles scaling itself
(``_step_supports_amp_scaling``), so the scaler hands it the scale as
attributes and the step can refuse with the cause instead of torch's
"No inf checks were recorded".
"""
from __future__ import annotations

__all__ = ["refuse_grad_scaler"]

_ATTRS = ("grad_scale", "found_inf")


def refuse_grad_scaler(optimizer, where: str = "optimizer.step") -> None:
    """Raise if a GradScaler is stepping ``optimizer`` (it set ``grad_scale`` /
    ``found_inf`` on it); the attributes are removed first, so that a later
    step without the scaler is not refused for them."""
    found = [a for a in _ATTRS if a in vars(optimizer)]
    if not found:
        return
    for a in found:
        delattr(optimizer, a)
    raise TypeError(
        f"{where}: called through a torch GradScaler (scaler.step(optimizer)); expected a "
        "plain step. The private gradient is formed inside the step from each sample's "
        "output gradients, which carry the scaler's scale: each sample would be clipped "
        "at max_grad_norm as if its gradient were that many times larger, and the scaler "
        "finds no gradient to unscale or check for inf. Refused, nothing written and no "
        "noise drawn: run the forward under torch.autocast(..., dtype=torch.bfloat16) "
        "with no GradScaler (bfloat16 has float32's range: no loss scaling is needed), "
        "or train in float32")
