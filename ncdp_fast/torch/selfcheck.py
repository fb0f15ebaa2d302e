"""Check a model before training it privately: is GhostClipper's step on one
batch the per-sample clipping it stands for?

The clipper refuses what it can see (docs/torch.md, "The loss contract"):
in the loss, and between layers where the graph proves the samples combined
(``x - x.mean(0)`` between two recorded layers); what it cannot -- samples
mixed inside a layer's own ``forward`` or by an operation the graph reader
does not know, a loss whose terms see two samples through what the graph
does not show, a custom layer's rule that is wrong -- changes the per-sample
gradients silently.  Here both of the clipper's refusals are off, so that
what a model does is measured.  :func:`check_exact` compares, on
a batch of the user's, the clipper's clipped sum with the one formed from
gradients computed one sample at a time: such a coupling shows as an error of
the order of the gradient itself, rounding as one of the order of the dtype's
precision.
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from torch import nn

from .._validate import check_bool, check_positive

__all__ = ["ExactnessReport", "check_exact"]


@dataclass
class ExactnessReport:
    """What :func:`check_exact` measured on one batch.

    ``max_rel_error``: ``||got - expected|| / ||expected||`` over every
    trainable parameter; ``worst_parameter`` / ``worst_rel_error``: the
    parameter with the largest relative error (its own norm, or 1e-3 of the
    whole where its expected gradient is nearly 0); ``norms_rel_error``: the
    largest relative error of the per-sample norms; ``max_grad_norm``: the
    bound the check clipped at (between the two smallest non-zero per-sample
    norms, so some samples are clipped and one is not; half the norm of a
    single sample); ``passed``: every error within ``rtol``."""
    max_rel_error: float
    worst_parameter: str
    worst_rel_error: float
    norms_rel_error: float
    samples: int
    max_grad_norm: float
    rtol: float
    passed: bool


def _sample(x, i: int, batch_first: bool):
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        return x
    return x[i:i + 1] if batch_first or x.dim() < 2 else x[:, i:i + 1]


def _cast(x, dtype):
    return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def check_exact(model: nn.Module, inputs: tuple, loss_fn, *, dtype=torch.float64,
                rtol: float = 1e-6, batch_first: bool = True) -> ExactnessReport:
    """Compare GhostClipper's private gradient (noise 0) on ``inputs`` with
    per-sample clipping of gradients computed one sample at a time.

    Args:
        model: the ``nn.Module`` to train (not modified: a deep copy in
            ``dtype`` is checked, in training mode).  Its forward must be
            deterministic: dropout off (the check runs the batch twice and
            refuses a forward whose loss changes).
        inputs: a tuple of the batch's tensors, the samples along dimension 0
            (dimension 1 with ``batch_first=False``, for tensors of two or
            more dimensions); at least one sample.  Other objects, and 0-d
            tensors, are passed as they are to every call.
        loss_fn: ``loss_fn(model, *inputs) -> scalar``, the **sum** over the
            given samples of each sample's loss, as training computes it
            (``reduction="sum"``): called on the batch and on each sample.
        dtype: floating dtype of the check (float64: rounding ~1e-12 for
            most models; a model computing in float32 inside, as Gemma's
            norms or transformers' own losses do, rounds at ~1e-7).
        rtol: the largest relative error that passes.
        batch_first: where the inputs' sample dimension is, also the
            clipper's ``batch_first``.

    Returns an :class:`ExactnessReport`.  A model the clipper refuses raises
    its error.  Privacy meaning: none -- run it on data you may look at (a
    public or synthetic batch of the real shapes); it draws no noise and is
    not accounted.
    """
    from .clipper import GhostClipper
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    if not isinstance(inputs, tuple) or not any(isinstance(x, torch.Tensor) for x in inputs):
        raise TypeError(f"inputs: expected a tuple of tensors (the batch), got "
                        f"{type(inputs).__name__}")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn: expected a callable loss_fn(model, *inputs), got "
                        f"{type(loss_fn).__name__}")
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype: expected a floating torch dtype, got {dtype!r}")
    rtol = check_positive(rtol, "rtol")
    batch_first = check_bool(batch_first, "batch_first")
    dim = 0 if batch_first else 1
    sizes = {x.shape[dim if x.dim() > 1 else 0] for x in inputs
             if isinstance(x, torch.Tensor) and x.dim()}
    if len(sizes) != 1 or min(sizes) < 1:
        raise ValueError(f"inputs: expected tensors sharing one number of samples >= 1 along "
                         f"dimension {dim}, got {sorted(sizes)}")
    n = sizes.pop()
    work = copy.deepcopy(model).to(dtype).train()
    inputs = tuple(_cast(x, dtype) for x in inputs)
    params = {k: p for k, p in work.named_parameters() if p.requires_grad}
    if not params:
        raise ValueError("model: has no trainable parameter")
    # Built first, so that what the clipper refuses (batch norms, a layer
    # without a rule) is refused before any forward; the bound is set below.
    clipped = copy.deepcopy(work)
    # The loss check is off: this function measures what a coupled loss does
    # (it reports the error instead of refusing).
    clipper = GhostClipper(clipped, max_grad_norm=1.0, noise_multiplier=0.0,
                           expected_batch_size=n, loss_reduction="sum",
                           batch_first=batch_first, check_loss=False)
    # Nor are samples combined between layers refused (structure.py): measured.
    clipper._layouts.strict = False

    try:
        _refuse_random(work, inputs, loss_fn)
        per_sample = _one_at_a_time(work, params, inputs, loss_fn, n, batch_first)
        norms = sum(g.reshape(n, -1).square().sum(1) for g in per_sample.values()).sqrt()
        C = _bound(norms)
        factors = (C / norms).clamp(max=1.0)
        expected = {k: torch.einsum("b,b...->...", factors, g) for k, g in per_sample.items()}
        clipper.max_grad_norm = C
        loss_fn(clipped, *inputs).backward()
        res = clipper.privatize_()
    finally:
        clipper.remove()
    got = {k: p.grad for k, p in clipped.named_parameters() if k in params}
    max_rel, worst, worst_err = _errors(got, expected)
    got_norms = torch.as_tensor(res.norms, dtype=norms.dtype)
    norms_err = float(((got_norms - norms).abs() / norms.clamp(min=1e-300)).max())
    return ExactnessReport(max_rel_error=max_rel, worst_parameter=worst,
                           worst_rel_error=worst_err, norms_rel_error=norms_err, samples=n,
                           max_grad_norm=C, rtol=rtol,
                           passed=max(max_rel, worst_err, norms_err) <= rtol)


def _refuse_random(model, inputs, loss_fn) -> None:
    with torch.no_grad():
        first, second = loss_fn(model, *inputs), loss_fn(model, *inputs)
    if not isinstance(first, torch.Tensor) or first.ndim != 0:
        raise ValueError(f"loss_fn: expected a scalar tensor (the sum of the samples' losses), "
                         f"got {getattr(first, 'shape', type(first).__name__)}")
    if not torch.equal(first, second):
        raise ValueError("model: two forwards of the same batch gave different losses "
                         f"({float(first)!r}, {float(second)!r}); the check needs a "
                         "deterministic forward: set dropout probabilities to 0")


def _one_at_a_time(model, params: dict, inputs, loss_fn, n: int, batch_first: bool) -> dict:
    """{name: (n, *shape)}: each sample's gradient from the model run on it alone
    (0 where its loss does not reach a parameter)."""
    rows = []
    for i in range(n):
        loss = loss_fn(model, *(_sample(x, i, batch_first) for x in inputs))
        grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
        rows.append([torch.zeros_like(p) if g is None else g
                     for g, p in zip(grads, params.values())])
    return {k: torch.stack([r[j] for r in rows]) for j, k in enumerate(params)}


def _bound(norms: torch.Tensor) -> float:
    """Between the two smallest non-zero norms: one sample unclipped, the others
    clipped (a single one: clipped to half its norm)."""
    positive = norms[norms > 0].sort().values
    if positive.numel() >= 2:
        C = float((positive[0] * positive[1]).sqrt())
    elif positive.numel() == 1:
        C = float(positive[0]) / 2
    else:
        C = 1.0
    if not (math.isfinite(C) and C > 0):
        raise ValueError(f"model: the per-sample gradient norms are not finite "
                         f"({norms.tolist()}); the check needs finite gradients")
    return C


def _errors(got: dict, expected: dict) -> tuple[float, str, float]:
    """(relative error of the whole gradient, the worst parameter, its relative
    error: against its own norm, or 1e-3 of the whole where it is nearly 0)."""
    whole = float(torch.cat([e.reshape(-1) for e in expected.values()]).norm())
    diff = float(torch.cat([(got[k] - e).reshape(-1) for k, e in expected.items()]).norm())
    worst, worst_err = "", 0.0
    for k, e in expected.items():
        scale = max(float(e.norm()), 1e-3 * whole)
        err = float((got[k] - e).norm()) / scale if scale else 0.0
        if err >= worst_err:
            worst, worst_err = k, err
    return (diff / whole if whole else diff), worst, worst_err
