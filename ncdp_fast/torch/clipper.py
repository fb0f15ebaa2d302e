"""GhostClipper: private gradients of all-nn.Linear models from one ordinary
backward pass, with no per-sample gradient ever formed.

Hooks record each layer's inputs and output gradients; the per-sample norms and
the clipped sum come from the factored identities (DESIGN.md kernel 1).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .._clip import LayersClipResult
from .mechanism import ClippedGaussianStep

__all__ = ["GhostClipper"]


class _CaptureGrad(torch.autograd.Function):
    """Identity on a layer's output whose backward hands the output gradient to
    ``store`` and passes it on unchanged.  Returns a copy, not a view: a view
    made in a custom Function may not be modified in place (an inplace ReLU
    after the layer would fail), and the copy (B x K) costs far less than the
    weight-gradient GEMM (B x K x d) it lets backward skip."""

    @staticmethod
    def forward(ctx, output, anchor, store):
        ctx.store = store
        return output.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.store(grad.detach())
        return grad, None, None


class _LinearTap:
    """Inputs and output gradients of one nn.Linear across the forward calls of a step."""

    def __init__(self, name: str, module: nn.Linear):
        self.name = name
        self.module = module
        self.has_bias = module.bias is not None and module.bias.requires_grad
        self.params = [module.weight] + ([module.bias] if self.has_bias else [])
        self.recording = False
        self.acts: list = []
        self.grads: dict[int, Any] = {}

    def clear(self):
        self.acts.clear()
        self.grads.clear()


def _as_sequence(x, width):
    """(B, ..., width) -> (B, T, width); explicit T so that B = 0 reshapes too."""
    T = 1
    for s in x.shape[1:-1]:
        T *= s
    return x.reshape(x.shape[0], T, width)


def _cat_calls(parts):
    """Several calls of a layer in one forward are one longer sequence; a single
    call is used as is (no copy)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


class GhostClipper(ClippedGaussianStep):
    """Private gradients for all-``nn.Linear`` models with no per-sample gradient.

    Usage::

        clipper = GhostClipper(model, max_grad_norm=1.0, noise_multiplier=1.1,
                               expected_batch_size=256)
        loss = criterion(model(x), y)      # loss reduced by mean (or sum)
        loss.backward()                   # ordinary backward: hooks record a, g
        clipper.privatize_()              # p.grad <- clipped, noised, reduced
        optimizer.step()

    Every trainable parameter of ``model`` must be the weight or bias of an
    ``nn.Linear`` and appear in exactly one such layer; anything else (a
    trainable norm layer, an embedding, tied weights) raises at construction.
    Inputs may be (B, d) or (B, ..., d) (a sequence: every position is summed
    into the per-sample gradient), and a layer may run several times in one
    forward.  The per-sample norm over all layers is computed from the
    factored identities (DESIGN.md kernel 1) and the clipped sum is one GEMM
    per layer: memory O(B*(d+K)) per layer instead of O(B*K*d).

    Privacy meaning as :class:`FusedDPOptimizer`: each :meth:`privatize_` is one
    Gaussian mechanism (sensitivity ``max_grad_norm``, noise multiplier
    ``noise_multiplier``) over the batch; the realized batch size is used only
    to undo the mean of a mean-reduced loss, never to normalise the output.
    """

    def __init__(self, model: nn.Module, *, max_grad_norm: float, noise_multiplier: float,
                 expected_batch_size: float | None, loss_reduction: str = "mean",
                 seed=None, offset: int | None = None, nan_policy: str = "raise"):
        self.model = model
        super().__init__(max_grad_norm=max_grad_norm, noise_multiplier=noise_multiplier,
                         expected_batch_size=expected_batch_size,
                         loss_reduction=loss_reduction, seed=seed, offset=offset,
                         nan_policy=nan_policy)
        self.taps = self._find_layers(model)
        # A leaf that requires grad, so that a layer's output enters the graph
        # (and its gradient reaches us) even when neither its input nor, during
        # the forward, its parameters require grad.
        self._anchor = torch.zeros((), requires_grad=True)
        self._handles = []
        for tap in self.taps:
            self._handles.append(tap.module.register_forward_pre_hook(self._pre_hook(tap)))
            self._handles.append(tap.module.register_forward_hook(self._forward_hook(tap),
                                                                  always_call=True))

    @staticmethod
    def _find_layers(model: nn.Module) -> list[_LinearTap]:
        owner: dict[int, str] = {}
        taps = []
        for name, module in model.named_modules(remove_duplicate=False):
            for pname, p in module.named_parameters(recurse=False):
                if not p.requires_grad:
                    continue
                full = f"{name}.{pname}" if name else pname
                if not isinstance(module, nn.Linear):
                    raise ValueError(f"GhostClipper: trainable parameter {full!r} belongs to "
                                     f"{type(module).__name__}; only nn.Linear layers are supported "
                                     "(freeze it, or use opacus.GradSampleModule + FusedDPOptimizer)")
                if id(p) in owner:
                    raise ValueError(f"GhostClipper: parameter {full!r} is shared with "
                                     f"{owner[id(p)]!r} (tied weights are not supported)")
                owner[id(p)] = full
            if isinstance(module, nn.Linear) and module.weight.requires_grad:
                if any(t.module is module for t in taps):
                    raise ValueError(f"GhostClipper: layer {name!r} appears twice in the model "
                                     "(shared modules are not supported)")
                taps.append(_LinearTap(name, module))
            elif isinstance(module, nn.Linear) and module.bias is not None \
                    and module.bias.requires_grad:
                raise ValueError(f"GhostClipper: layer {name!r} has a trainable bias but a frozen "
                                 "weight; not supported")
        if not taps:
            raise ValueError("GhostClipper: the model has no trainable nn.Linear layer")
        return taps

    def _pre_hook(self, tap: _LinearTap):
        def hook(module, inputs):
            # The weight (and bias) gradient of the ordinary backward would be
            # overwritten by privatize_(); switching requires_grad off for the
            # duration of this forward keeps autograd from computing it at all
            # (one GEMM of the size of the forward saved per layer).
            tap.recording = torch.is_grad_enabled()
            if tap.recording:
                for p in tap.params:
                    p.requires_grad_(False)
        return hook

    def _forward_hook(self, tap: _LinearTap):
        def hook(module, inputs, output):
            if not getattr(tap, "recording", False):
                return None
            tap.recording = False
            for p in tap.params:       # always_call=True: restored even on error
                p.requires_grad_(True)
            if not isinstance(output, torch.Tensor):
                return None
            call = len(tap.acts)
            tap.acts.append(inputs[0].detach())

            def keep_grad(grad, call=call):
                if call in tap.grads:
                    # A second backward through the same recorded forward (retain_graph):
                    # keeping either gradient alone would silently drop the other.
                    tap.grads[call] = None
                    return
                tap.grads[call] = grad
            return _CaptureGrad.apply(output, self._anchor, keep_grad)
        return hook

    def clear(self) -> None:
        """Forget recorded activations and gradients (e.g. after an aborted step)."""
        for tap in self.taps:
            tap.clear()

    def remove(self) -> None:
        """Detach the hooks from the model."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()

    def _layer_specs(self):
        batch = None
        for tap in self.taps:
            if any(g is None for g in tap.grads.values()):
                raise RuntimeError(
                    f"GhostClipper: backward reached layer {tap.name!r} twice through the same "
                    "recorded forward; run exactly one loss.backward() per forward (sum the "
                    "losses first), or call clear() to discard the step")
            if len(tap.grads) != len(tap.acts):
                raise RuntimeError(
                    f"GhostClipper: layer {tap.name!r} ran forward {len(tap.acts)} time(s) but "
                    f"backward reached it {len(tap.grads)} time(s); run exactly one "
                    "loss.backward() per recorded forward (call clear() to discard a forward)")
            for a in tap.acts:
                if batch is None:
                    batch = a.shape[0]
                elif a.shape[0] != batch:
                    raise RuntimeError(f"GhostClipper: layer {tap.name!r} saw batch size "
                                       f"{a.shape[0]}, another layer {batch}")
        if batch is None:
            raise RuntimeError("GhostClipper: no forward/backward was recorded since the last step")
        specs = []
        for tap in self.taps:
            w = tap.module.weight
            d, K = w.shape[1], w.shape[0]
            if tap.acts:
                a = _cat_calls([_as_sequence(x, d) for x in tap.acts])
                g = _cat_calls([_as_sequence(tap.grads[i], K) for i in range(len(tap.acts))])
                if self.loss_reduction == "mean":
                    # Undo the batch mean so g holds each sample's own loss gradient.
                    g = g * batch
            else:  # unused this step: zero per-sample gradient, pure noise
                a = w.new_zeros((batch, 0, d))
                g = w.new_zeros((batch, 0, K))
            if a.dim() == 3 and a.shape[1] == 1:
                a, g = a[:, 0], g[:, 0]
            specs.append((a.to(w.dtype), g.to(w.dtype), tap.has_bias))
        return specs

    def privatize_(self) -> LayersClipResult:
        """Overwrite every trainable ``p.grad`` with its private gradient and forget
        the recorded tensors.  Returns the clip result (norms, clipped count,
        stream position)."""
        result = self._clip_and_noise(self._layer_specs())
        for tap, (gw, gb) in zip(self.taps, result.grads):
            tap.module.weight.grad = gw
            if tap.has_bias:
                tap.module.bias.grad = gb
        self.clear()
        return result
