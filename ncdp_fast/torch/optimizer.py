"""FusedDPOptimizer: Opacus's DPOptimizer in one fused clip-and-noise op."""
from __future__ import annotations

import torch

from .._clip import LayersClipResult
from .amp import refuse_grad_scaler
from .mechanism import (CheckpointsNoise, ClippedGaussianStep, ReleasedGrads,
                        foreign_grad_error, optimizer_params)

__all__ = ["FusedDPOptimizer"]


class FusedDPOptimizer(CheckpointsNoise, ClippedGaussianStep):
    """DP-SGD step from Opacus per-sample gradients, in one fused clip-and-noise op.

    Wraps ``optimizer``; on :meth:`step` the ``p.grad_sample`` (B, *p.shape) of
    every parameter that required grad when it was built and still does is
    clipped jointly (one factor per sample from the norm over all parameters, bound
    ``max_grad_norm``), summed, noised with std ``noise_multiplier *
    max_grad_norm`` and, with ``loss_reduction="mean"``, divided by
    ``expected_batch_size``; the result goes to ``p.grad`` and the wrapped
    optimizer steps.  Same semantics as ``opacus.optimizers.DPOptimizer`` except
    the clip factor ``min(1, C/||g||)`` (Opacus uses ``C/(||g|| + 1e-6)``),
    and these refusals (ValueError, nothing stepped, no noise drawn):

    * two backward passes before a step (Opacus's list of ``grad_sample``,
      which it would concatenate into one larger batch: the same samples
      twice, 2C, or two batches under one batch's accounting);
    * a ``.grad`` on a parameter of the optimizer that is not privatized
      (one frozen when this optimizer was built and unfrozen since, one added
      by ``add_param_group``), unless it is a gradient this optimizer released.

    A parameter frozen after construction is left out of the step (no noise
    drawn for it, its ``.grad`` untouched).  Gradient terms outside Opacus's
    per-layer hooks (a penalty in the loss, a tied weight used by
    ``F.linear``) are not in ``grad_sample`` and are dropped, as in Opacus:
    put weight decay in the optimizer.

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
        # GradScaler then hands the step its scale as attributes instead of
        # unscaling p.grad alone: refused by name (amp.py).
        self._step_supports_amp_scaling = True
        self.params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        self._released = ReleasedGrads()
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

    def _active(self) -> list:
        """The parameters this step privatizes: listed at construction and still
        trainable (a parameter frozen since is left out; the optimizer skips it
        when its .grad is None)."""
        return [(i, p) for i, p in enumerate(self.params) if p.requires_grad]

    def _grad_samples(self, active):
        blocks = []
        for i, p in active:
            gs = getattr(p, "grad_sample", None)
            if gs is None:
                raise ValueError(f"parameter {i} (shape {tuple(p.shape)}) has no grad_sample: wrap "
                                 "the model in opacus.GradSampleModule and run backward first")
            if isinstance(gs, (list, tuple)):
                raise ValueError(
                    f"parameter {i} (shape {tuple(p.shape)}): grad_sample holds {len(gs)} "
                    "backward passes (Opacus's list); concatenating them would clip the same "
                    "samples twice (sensitivity 2 * max_grad_norm) or count two batches as one "
                    "step. Run one backward per step (sum the losses first), calling step() or "
                    "zero_grad() in between")
            if gs.dtype != p.dtype:
                gs = gs.to(p.dtype)
            blocks.append(gs)
        return blocks

    def _refuse_foreign(self, active) -> None:
        privatized = {id(p) for _, p in active}
        found = self._released.first_foreign(optimizer_params(self), privatized)
        if found is None:
            return
        p, (gi, i) = found
        listed = any(q is p for q in self.params)
        reason = ("it was frozen since this optimizer was built" if listed else
                  "it did not require grad when this optimizer was built, or was added "
                  "since by add_param_group")
        raise foreign_grad_error(
            "FusedDPOptimizer", f"param_groups[{gi}]['params'][{i}]", p, reason,
            "Build FusedDPOptimizer once the optimizer holds every parameter to train, "
            "unfrozen; to leave one untrained, freeze it (requires_grad_(False)) and set "
            "its .grad to None")

    def privatize_(self) -> LayersClipResult:
        """Overwrite every ``p.grad`` with the private gradient; returns the clip result.
        Refusals (see the class) come before anything is written or drawn."""
        active = self._active()
        blocks = self._grad_samples(active)
        self._refuse_foreign(active)
        result = self._clip_and_noise(blocks)
        for (_, p), g in zip(active, result.grads):
            p.grad = g.view_as(p)
            self._released.wrote(p, p.grad)
        for p in self.params:
            p.grad_sample = None
        return result

    def step(self, closure=None):
        # A GradScaler stepping this optimizer would have unscaled p.grad
        # only: the grad_sample it clips carries the scale (clipped at C / S
        # of the true gradients, the audit of 2026-12-02); refused by name.
        refuse_grad_scaler(self, "FusedDPOptimizer.step")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._active():
            self.privatize_()
        else:
            self._refuse_foreign([])
        out = self.original_optimizer.step()
        return loss if closure is not None else out

    def __repr__(self):
        return (f"FusedDPOptimizer(noise_multiplier={self.noise_multiplier}, "
                f"max_grad_norm={self.max_grad_norm}, expected_batch_size="
                f"{self.expected_batch_size}, {self.original_optimizer!r})")
