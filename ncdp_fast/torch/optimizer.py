"""FusedDPOptimizer: Opacus's DPOptimizer in one fused clip-and-noise op."""
from __future__ import annotations

import torch

from .._clip import LayersClipResult
from .mechanism import CheckpointsNoise, ClippedGaussianStep

__all__ = ["FusedDPOptimizer"]


class FusedDPOptimizer(CheckpointsNoise, ClippedGaussianStep):
    """DP-SGD step from Opacus per-sample gradients, in one fused clip-and-noise op.

    Wraps ``optimizer``; on :meth:`step` every trainable parameter's
    ``p.grad_sample`` (B, *p.shape) -- or the list of them Opacus accumulates
    over several backward passes, concatenated along the batch -- is clipped
    jointly (one factor per sample from the norm over all parameters, bound
    ``max_grad_norm``), summed, noised with std ``noise_multiplier *
    max_grad_norm`` and, with ``loss_reduction="mean"``, divided by
    ``expected_batch_size``; the result goes to ``p.grad`` and the wrapped
    optimizer steps.  Same semantics as ``opacus.optimizers.DPOptimizer`` except
    the clip factor ``min(1, C/||g||)`` (Opacus uses ``C/(||g|| + 1e-6)``).

    With ``group`` (a torch.distributed process group; the model may be
    DDP-wrapped, its all-reduced ``p.grad`` is replaced), each rank's
    ``grad_sample`` holds its own samples and the step equals the one-process
    step of the union batch (:mod:`ncdp_fast.torch.ranks`).

    Privacy meaning: each step is a Gaussian mechanism with sensitivity
    ``max_grad_norm`` (add/remove one sample) and noise multiplier
    ``noise_multiplier``; account for it with ``ncdp_fast.privacy`` using your
    sampling rate.  ``expected_batch_size`` must be ``sample_rate * n``, not the
    realized batch size.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, noise_multiplier: float,
                 max_grad_norm: float, expected_batch_size: float | None,
                 loss_reduction: str = "mean", seed=None, offset: int | None = None,
                 nan_policy: str = "raise", group=None):
        self.original_optimizer = optimizer
        self.params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        super().__init__(max_grad_norm=max_grad_norm, noise_multiplier=noise_multiplier,
                         expected_batch_size=expected_batch_size,
                         loss_reduction=loss_reduction, seed=seed, offset=offset,
                         nan_policy=nan_policy, group=group, params=self.params)

    # --- optimizer protocol ----------------------------------------------------------
    @property
    def param_groups(self):
        return self.original_optimizer.param_groups

    @property
    def state(self):
        return self.original_optimizer.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.original_optimizer.zero_grad(set_to_none=set_to_none)
        for p in self.params:
            p.grad_sample = None

    def _grad_samples(self):
        blocks = []
        for i, p in enumerate(self.params):
            gs = getattr(p, "grad_sample", None)
            if gs is None:
                raise ValueError(f"parameter {i} (shape {tuple(p.shape)}) has no grad_sample: wrap "
                                 "the model in opacus.GradSampleModule and run backward first")
            if isinstance(gs, (list, tuple)):
                gs = torch.cat(list(gs), dim=0)
            if gs.dtype != p.dtype:
                gs = gs.to(p.dtype)
            blocks.append(gs)
        return blocks

    def privatize_(self) -> LayersClipResult:
        """Overwrite every ``p.grad`` with the private gradient; returns the clip result."""
        result = self._clip_and_noise(self._grad_samples())
        for p, g in zip(self.params, result.grads):
            p.grad = g.view_as(p)
            p.grad_sample = None
        return result

    def step(self, closure=None):
        if closure is not None:
            with torch.enable_grad():
                closure()
        if self.params:
            self.privatize_()
        return self.original_optimizer.step()

    def __repr__(self):
        return (f"FusedDPOptimizer(noise_multiplier={self.noise_multiplier}, "
                f"max_grad_norm={self.max_grad_norm}, expected_batch_size="
                f"{self.expected_batch_size}, {self.original_optimizer!r})")
