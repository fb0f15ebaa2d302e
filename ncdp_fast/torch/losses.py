"""Losses that keep each sample's term its own.

DP-SGD bounds what one sample changes by clipping its gradient; that holds
only when the loss is a sum or mean of per-sample terms, each depending on
that sample alone.  Token cross-entropy averaged over the valid tokens of the
whole batch (``F.cross_entropy(..., ignore_index=...)`` on flattened tokens)
is not: the denominator counts every sample's tokens, so one sample rescales
all the others' gradients (by 1.35 C in the worst of 150 random batches of
tests/test_attacks_coupling.py).  Here each sample's loss is the mean over its
own valid tokens (the attention mask and ``ignore_index`` respected; for a
causal language model, after the shift by one token).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .._validate import check_bool, check_choice, check_int, check_nonneg

__all__ = ["per_sample_token_loss", "causal_lm_loss", "TokenCrossEntropyLoss", "IGNORE_INDEX"]

# The label a token loss skips: transformers' (and torch's cross entropy's) default.
IGNORE_INDEX = -100


def _shape(x) -> str:
    return str(tuple(x.shape)) if isinstance(x, torch.Tensor) else type(x).__name__


def _valid_targets(logits, target, attention_mask, ignore_index: int, shift: bool):
    """The checked (N, L) targets with ``ignore_index`` wherever a token does
    not count: masked out, or (``shift``) the last position, which predicts
    nothing."""
    if not isinstance(logits, torch.Tensor) or logits.ndim != 3 or \
            not logits.is_floating_point():
        raise ValueError(f"logits: expected a float (N, L, V) tensor (batch, token, class), got "
                         f"{_shape(logits)}"
                         + (f" of {logits.dtype}" if isinstance(logits, torch.Tensor) else ""))
    expected = tuple(logits.shape[:2])
    if not isinstance(target, torch.Tensor) or tuple(target.shape) != expected:
        raise ValueError(f"target: expected a {expected} tensor (one class per token of logits "
                         f"{tuple(logits.shape)}), got {_shape(target)}")
    if target.is_floating_point() or target.is_complex() or target.dtype == torch.bool:
        raise TypeError(f"target: expected an integer tensor of class indices, got {target.dtype}")
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or \
                tuple(attention_mask.shape) != expected:
            raise ValueError(f"attention_mask: expected a {expected} tensor (1 for a real token, "
                             f"0 for padding, as the model's), got {_shape(attention_mask)}")
        if not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
            raise ValueError("attention_mask: expected only 0 (padding) and 1 (real token), got "
                             f"values {torch.unique(attention_mask).tolist()[:8]}")
        target = target.masked_fill(attention_mask == 0, ignore_index)
    if shift:
        # Position t predicts token t + 1 (transformers' causal-LM convention:
        # the labels padded with ignore_index and shifted left by one).
        target = F.pad(target[:, 1:], (0, 1), value=ignore_index)
    return target


def per_sample_token_loss(logits, target, *, attention_mask=None, shift: bool = False,
                          ignore_index: int = IGNORE_INDEX, reduction: str = "mean",
                          label_smoothing: float = 0.0):
    """Token cross-entropy with one term per sample.

    Args:
        logits: (N, L, V) float tensor, batch first (sample, token, class).
        target: (N, L) integer tensor of classes, ``ignore_index`` at padding.
        attention_mask: optional (N, L) tensor of 0/1 (the model's): tokens
            at 0 do not count, whatever their target.
        shift: True for a causal language model: position t is scored
            against ``target[:, t + 1]`` (and its mask), the last position
            against nothing -- ``target`` is then the input ids or labels as
            given to the model, as transformers' ``labels=``.
        ignore_index: the target value of tokens that do not count.
        reduction: ``"mean"`` (the sum of the N per-sample losses divided by N,
            the batch's own size, which :class:`GhostClipper` with
            ``loss_reduction="mean"`` undoes), ``"sum"``, or ``"none"`` ((N,)).
            It must be the clipper's ``loss_reduction``.
        label_smoothing: as :func:`torch.nn.functional.cross_entropy`.

    Returns:
        Sample i's loss is the mean cross-entropy over its own valid tokens
        (target not ``ignore_index``, mask 1; after the shift with
        ``shift=True``); a sample with no valid token has loss 0 and so
        contributes a zero gradient; a scalar, or (N,) for ``"none"``.

    Privacy meaning: each term depends on sample i alone, so clipping its
    gradient at C bounds its contribution by C.  The default of transformers
    (``model(input_ids, labels=...)``, ``ForCausalLMLoss``) is instead the
    mean over all valid tokens of the batch: its denominator counts every
    sample's tokens, so adding or removing one sample rescales every other
    sample's gradient, a change clipping does not bound.  Both agree for a
    batch of one sample (tested).
    """
    check_choice(reduction, "reduction", ("mean", "sum", "none"))
    ignore_index = check_int(ignore_index, "ignore_index")
    label_smoothing = check_nonneg(label_smoothing, "label_smoothing")
    shift = check_bool(shift, "shift")
    target = _valid_targets(logits, target, attention_mask, ignore_index, shift)
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


def causal_lm_loss(logits, labels, *, attention_mask=None, ignore_index: int = IGNORE_INDEX,
                   reduction: str = "mean", label_smoothing: float = 0.0):
    """A causal language model's loss, per sample: :func:`per_sample_token_loss`
    with ``shift=True``.  ``logits`` (N, L, V) as the model returns them
    (``model(input_ids).logits``), ``labels`` (N, L) the input ids (or labels
    with ``ignore_index`` where a token is not scored), ``attention_mask``
    (N, L) the model's.  Each sample's loss is the mean over the tokens it
    predicts; the batch's their mean (or sum) over samples."""
    return per_sample_token_loss(logits, labels, attention_mask=attention_mask, shift=True,
                                 ignore_index=ignore_index, reduction=reduction,
                                 label_smoothing=label_smoothing)


class TokenCrossEntropyLoss(nn.Module):
    """:func:`per_sample_token_loss` as a criterion (``criterion(logits,
    target, attention_mask=None)``; logits (N, L, V), target (N, L));
    ``shift=True`` for a causal language model; usable as the ghost-mode
    criterion of :meth:`PrivacyEngine.make_private`."""

    def __init__(self, *, shift: bool = False, ignore_index: int = IGNORE_INDEX,
                 reduction: str = "mean", label_smoothing: float = 0.0):
        super().__init__()
        self.shift = check_bool(shift, "shift")
        self.ignore_index = check_int(ignore_index, "ignore_index")
        self.reduction = check_choice(reduction, "reduction", ("mean", "sum", "none"))
        self.label_smoothing = check_nonneg(label_smoothing, "label_smoothing")

    def forward(self, logits, target, attention_mask=None):
        return per_sample_token_loss(logits, target, attention_mask=attention_mask,
                                     shift=self.shift, ignore_index=self.ignore_index,
                                     reduction=self.reduction,
                                     label_smoothing=self.label_smoothing)
