"""Losses that keep each sample's term its own.

DP-SGD bounds what one sample changes by clipping its gradient; that holds
only when the loss is a sum or mean of per-sample terms, each depending on
that sample alone.  Token cross-entropy averaged over the valid tokens of the
whole batch (``F.cross_entropy(..., ignore_index=...)`` on flattened tokens)
is not: the denominator counts every sample's tokens, so one sample rescales
all the others' gradients (by 1.35 C in the worst of 150 random batches of
tests/test_attacks_coupling.py).  Here each sample's loss is the mean over its
own valid tokens.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .._validate import check_choice, check_int, check_nonneg

__all__ = ["per_sample_token_loss", "TokenCrossEntropyLoss"]


def per_sample_token_loss(logits, target, *, ignore_index: int = -100, reduction: str = "mean",
                          label_smoothing: float = 0.0):
    """Token cross-entropy with one term per sample.

    Args:
        logits: (N, L, V) float tensor, batch first (sample, token, class).
        target: (N, L) integer tensor of classes, ``ignore_index`` at padding.
        ignore_index: the target value of tokens that do not count.
        reduction: ``"mean"`` (the sum of the N per-sample losses divided by N,
            the batch's own size, which :class:`GhostClipper` with
            ``loss_reduction="mean"`` undoes), ``"sum"``, or ``"none"`` ((N,)).
        label_smoothing: as :func:`torch.nn.functional.cross_entropy`.

    Returns:
        Sample i's loss is the mean cross-entropy over its own tokens with
        ``target != ignore_index`` (0 when it has none); a scalar, or (N,)
        for ``"none"``.  Privacy meaning: each term depends on sample i
        alone, so clipping its gradient at C bounds its contribution by C.
    """
    check_choice(reduction, "reduction", ("mean", "sum", "none"))
    ignore_index = check_int(ignore_index, "ignore_index")
    label_smoothing = check_nonneg(label_smoothing, "label_smoothing")
    if not isinstance(logits, torch.Tensor) or logits.ndim != 3:
        raise ValueError(f"logits: expected a (N, L, V) tensor (batch, token, class), got "
                         f"{tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__}")
    if not isinstance(target, torch.Tensor) or tuple(target.shape) != tuple(logits.shape[:2]):
        raise ValueError(f"target: expected a {tuple(logits.shape[:2])} tensor (one class per "
                         f"token of logits), got "
                         f"{tuple(target.shape) if isinstance(target, torch.Tensor) else type(target).__name__}")
    n, length, classes = logits.shape
    tokens = F.cross_entropy(logits.reshape(n * length, classes), target.reshape(n * length),
                             ignore_index=ignore_index, reduction="none",
                             label_smoothing=label_smoothing).reshape(n, length)
    valid = (target != ignore_index).sum(1).clamp(min=1).to(tokens.dtype)
    per_sample = tokens.sum(1) / valid           # ignored tokens' terms are 0
    if reduction == "none":
        return per_sample
    total = per_sample.sum()
    # An empty Poisson batch gives 0, not the NaN of a mean over nothing.
    return total / max(n, 1) if reduction == "mean" else total


class TokenCrossEntropyLoss(nn.Module):
    """:func:`per_sample_token_loss` as a criterion (``criterion(logits,
    target)``; logits (N, L, V), target (N, L)); usable as the ghost-mode
    criterion of :meth:`PrivacyEngine.make_private`."""

    def __init__(self, *, ignore_index: int = -100, reduction: str = "mean",
                 label_smoothing: float = 0.0):
        super().__init__()
        self.ignore_index = check_int(ignore_index, "ignore_index")
        self.reduction = check_choice(reduction, "reduction", ("mean", "sum", "none"))
        self.label_smoothing = check_nonneg(label_smoothing, "label_smoothing")

    def forward(self, logits, target):
        return per_sample_token_loss(logits, target, ignore_index=self.ignore_index,
                                     reduction=self.reduction,
                                     label_smoothing=self.label_smoothing)
