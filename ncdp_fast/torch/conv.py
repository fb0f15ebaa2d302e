"""Convolutions are recorded at ``_conv_forward``, not at the module's forward:
there the input is what the convolution sees (a subclass may pad in its own
forward first, TF "SAME"), and the parameters' gradients are switched off
around that call only, so a subclass's own use of them keeps its gradients."""
from __future__ import annotations

from .taps import Tap, switch_back, switch_off

__all__ = ["conv_forward"]


def conv_forward(tap: Tap, marker):
    """The instance attribute that replaces ``tap.module._conv_forward``: while
    the layer records, the call's input and output go to ``marker(slot, x,
    output)``, whose return the forward continues with."""
    module = tap.module
    conv = type(module)._conv_forward.__get__(module)

    def forward(x, weight, bias):
        if not tap.recording:
            return conv(x, weight, bias)
        if weight is not module.weight or bias is not module.bias:
            # The rule differentiates with respect to the parameters
            # themselves, not a tensor computed from them.
            raise ValueError(
                f"GhostClipper: layer {tap.name!r} ({type(module).__name__}) passes a "
                "weight or bias to _conv_forward that is not its own parameter (computed "
                "from it in its forward?); the convolution's rule would give the gradient "
                "of the wrong tensor. Register a rule for its own type with "
                "ncdp_fast.torch.register_layer")
        saved = switch_off(tap)
        try:
            return marker(None, x, conv(x, weight, bias))
        finally:
            switch_back(tap, saved)
    return forward
