"""What makes one sample's gradient depend on the others' -- refused where it
can be seen cheaply.

Per-sample clipping bounds a sample's contribution by C only when the loss is
a sum or mean of per-sample terms each computed from that sample alone.
Modules that mix the batch (batch norms, a softmax over dimension 0) or
accumulate its statistics into buffers (instance norms tracking running
statistics) are refused when the clipper is built; a ghost-mode criterion is
checked for a reduction that matches ``loss_reduction`` and for the torch
means that divide by a whole-batch count.  What cannot be seen (an in-batch
contrastive loss, ``x - x.mean(0)`` inside a forward) is the user's contract
(docs/torch.md, "The loss contract").
"""
from __future__ import annotations

import torch
from torch import nn

from .._validate import check_choice
from .layout import enclosing_batch_first, layer_batch_first
from .losses import IGNORE_INDEX

__all__ = ["refuse_batch_mixing", "may_mix_the_batch", "batch_dim_hooks", "CheckedCriterion",
           "refuse_whole_batch_loss_kwargs"]

_SOFTMAXES = (nn.Softmax, nn.LogSoftmax, nn.Softmin)
# The classes refuse_batch_mixing can refuse (by class, or by an option).
_MIXING = (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm, *_SOFTMAXES)


def may_mix_the_batch(module: nn.Module) -> bool:
    """Whether :func:`refuse_batch_mixing` can refuse ``module``, whatever its
    options: a module of another class never can (issue 36's host time: the
    forward's model check re-runs the refusal only on these)."""
    return isinstance(module, _MIXING)


def _batchnorm_error(name, module):
    return ValueError(
        f"GhostClipper: {name!r} is {type(module).__name__}: batch normalisation mixes the "
        "samples of a batch, so no per-sample gradient (and no DP guarantee) exists. Replace "
        "it: model = ncdp_fast.torch.fix_batchnorm(model) (GroupNorm, as Opacus's "
        "ModuleValidator.fix), then train")


def refuse_batch_mixing(name: str, module: nn.Module) -> None:
    """Raise for a module that mixes the samples of a batch at train time
    (every ``_BatchNorm``: BatchNorm1d/2d/3d, their Lazy forms, SyncBatchNorm;
    a softmax over dimension 0) or stores their statistics unnoised (instance
    norms with ``track_running_stats=True``)."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        raise _batchnorm_error(name, module)
    if isinstance(module, nn.modules.instancenorm._InstanceNorm) and module.track_running_stats:
        raise ValueError(
            f"GhostClipper: {name!r} is {type(module).__name__} with track_running_stats=True: "
            "in training its running_mean/running_var average the statistics of every batch, "
            "a release of the private data without noise (kept in the state_dict, used in "
            "eval mode). Pass track_running_stats=False (each sample is normalised by its own "
            "statistics either way)")
    if isinstance(module, _SOFTMAXES) and module.dim in (0, None):
        raise ValueError(
            f"GhostClipper: {name!r} is {type(module).__name__}(dim={module.dim!r}), which "
            "normalises across the samples of the batch (dim=None means dimension 0 for 0-, "
            "1- and 3-dimensional inputs); expected a non-batch dim: pass the class dimension "
            "explicitly, e.g. dim=-1 or dim=1")


def batch_dim_hooks(model: nn.Module, batch_first: bool) -> list:
    """Forward pre-hooks on every softmax that refuse an input on which its
    ``dim`` is the batch dimension: dim=-1 of a 1-dimensional input, or dim=1 of
    a (T, B, K) input inside a sequence-first part of the model (the layout of
    :func:`.layout.layer_batch_first`: the enclosing torch module's, else
    ``batch_first``; an input with one leading dimension has its batch at 0).
    The handles, for the clipper to remove."""
    layouts = enclosing_batch_first(model)

    def hook_for(name, module):
        first, _ = layer_batch_first(name, module, layouts, batch_first)

        def hook(module, inputs):
            x = inputs[0] if inputs else None
            if not isinstance(x, torch.Tensor) or not x.ndim:
                return
            batch = 0 if first or x.ndim < 3 else 1
            if module.dim % x.ndim == batch:
                raise ValueError(
                    f"GhostClipper: {name!r} is {type(module).__name__}(dim={module.dim}) and "
                    f"got a {x.ndim}-dimensional input (shape {tuple(x.shape)}, "
                    f"batch_first={first}) on which that dim is the batch: it would normalise "
                    "across samples; expected an input with the batch and a class dimension, "
                    "the softmax over the class dimension")
        return hook
    return [m.register_forward_pre_hook(hook_for(n, m)) for n, m in model.named_modules()
            if isinstance(m, _SOFTMAXES) and isinstance(m.dim, int)]


class CheckedCriterion(nn.Module):
    """A ghost-mode criterion, checked: its ``reduction`` must be the
    ``loss_reduction`` the clipper undoes ("mean", or KLDivLoss's "batchmean";
    or "sum"), and torch means whose denominator counts the whole batch are
    refused -- a class-weighted mean (at construction) and a mean over targets
    some of which equal ``ignore_index`` (at the call, before any backward).
    Otherwise it returns exactly what the criterion returns."""

    def __init__(self, criterion, loss_reduction: str):
        super().__init__()
        check_choice(loss_reduction, "loss_reduction", ("mean", "sum"))
        reduction = getattr(criterion, "reduction", None)
        if not isinstance(reduction, str):
            raise TypeError(
                f"criterion: expected a torch loss with a reduction attribute ('mean' or 'sum', "
                f"as loss_reduction={loss_reduction!r}), got {type(criterion).__name__}; a "
                "custom loss must be a sum or mean of per-sample terms (docs/torch.md): give "
                "it reduction = 'mean' or 'sum' after checking that it is")
        if {"batchmean": "mean"}.get(reduction, reduction) != loss_reduction:
            raise ValueError(
                f"criterion: expected reduction={loss_reduction!r} (loss_reduction), got "
                f"{reduction!r} from {type(criterion).__name__}; the clipper undoes the "
                "loss_reduction, so set both to the same 'mean' or 'sum'")
        self._weighted_mean(criterion, reduction)
        self.criterion = criterion
        self.reduction = reduction

    @staticmethod
    def _weighted_mean(criterion, reduction):
        if isinstance(criterion, (nn.CrossEntropyLoss, nn.NLLLoss)) and \
                criterion.weight is not None and reduction == "mean":
            raise ValueError(
                f"criterion: {type(criterion).__name__}(weight=...) with reduction='mean' "
                "divides by the summed weights of the whole batch's targets, so each sample's "
                "term depends on the others' labels; expected reduction='sum' (with "
                "loss_reduction='sum'), where the weights scale each sample's own term")

    def forward(self, input, target, *args, **kwargs):
        c = self.criterion
        if isinstance(c, (nn.CrossEntropyLoss, nn.NLLLoss)) and self.reduction == "mean" and \
                isinstance(target, torch.Tensor) and not target.is_floating_point() and \
                bool((target == c.ignore_index).any()):
            raise ValueError(
                f"target: contains ignore_index={c.ignore_index} under {type(c).__name__}"
                "(reduction='mean'), which divides by the valid targets of the whole batch, so "
                "each sample's term depends on the others' padding; expected "
                "ncdp_fast.torch.TokenCrossEntropyLoss (each sample's mean over its own valid "
                "tokens), or reduction='sum' with loss_reduction='sum'")
        loss = c(input, target, *args, **kwargs)
        if not (isinstance(loss, torch.Tensor) and loss.ndim == 0):
            raise ValueError(f"criterion: expected a scalar loss, got "
                             f"{tuple(getattr(loss, 'shape', ())) or type(loss).__name__}")
        return loss


def _hf_model(model: nn.Module) -> bool:
    return type(model).__module__.split(".")[0] in ("transformers", "peft")


def refuse_whole_batch_loss_kwargs(model: nn.Module, kwargs: dict) -> None:
    """Raise, before the forward, when a ``transformers`` (or ``peft``) model is
    called so that its own loss (``outputs.loss``) divides by a count over the
    whole batch: ``labels`` holding -100 (its losses average over the batch's
    valid tokens, so one sample's padding rescales every other sample's term)
    or ``num_items_in_batch`` (a token count over the batch or the accumulated
    micro-batches).  Labels without -100 give each sample the same number of
    valid positions: the batch's token mean is then the mean of per-sample
    means, which the clipper's ``loss_reduction="mean"`` undoes exactly."""
    if not kwargs or not _hf_model(model):
        return
    fix = ("call the model without labels and compute the loss from outputs.logits with "
           "ncdp_fast.torch.causal_lm_loss(logits, labels) (language modelling) or "
           "per_sample_token_loss(logits, labels) (token classification): each sample's mean "
           "over its own valid tokens (docs/torch.md, 'The loss contract')")
    if kwargs.get("num_items_in_batch") is not None:
        raise ValueError(
            f"GhostClipper: {type(model).__name__} was called with num_items_in_batch: "
            "transformers divides its loss by that count of the batch's (or the accumulated "
            f"micro-batches') tokens, so each sample's term depends on the others; {fix}")
    labels = kwargs.get("labels")
    if isinstance(labels, torch.Tensor) and not labels.is_floating_point() and \
            bool((labels == IGNORE_INDEX).any()):
        raise ValueError(
            f"GhostClipper: {type(model).__name__} was called with labels containing "
            f"{IGNORE_INDEX} (ignored positions): its own loss (outputs.loss) is the mean "
            "over the valid tokens of the whole batch, so one sample's padding rescales every "
            "other sample's gradient, which per-sample clipping does not bound; " + fix)
