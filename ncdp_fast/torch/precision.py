"""Half-precision (float16 / bfloat16) parameters under the clipper: their
layer's tensors are upcast to float32 before the rule runs, their blocks
summed and noised in float32 (:func:`.layers.accumulation_dtype`), and the
private gradient rounded to the parameter's dtype once, at the write."""
from __future__ import annotations

import torch

from .._clip import GhostBlock
from .layers import HALF, accumulation_dtype

__all__ = ["upcast", "cast_block", "overflowing", "overflow_error", "refuse_mixed_dtypes",
           "SpentStepError", "half_mean_error"]


def upcast(x):
    """``x`` in float32 if it is a half tensor, else unchanged."""
    return x.float() if isinstance(x, torch.Tensor) and x.dtype in HALF else x


def cast_block(tap, names, block):
    """The block in its parameter's accumulation dtype (float32 for a half
    parameter; autocast's half activations of a float32 layer, float32)."""
    dtype = accumulation_dtype(tap.params[names[0]].dtype)
    if isinstance(block, tuple):
        a, g, bias = block
        if a.ndim == 2 and g.ndim == 2:
            # A user's rule giving a pair of one position, (B, d) and (B, K):
            # the (B, T, .) layout every consumer of pairs reads, T = 1 (the
            # per-layer split summed the bias over a dimension it lacked).
            a, g = a.unsqueeze(1), g.unsqueeze(1)
            block = (a, g, bias)
        if a.dtype == dtype and g.dtype == dtype:
            return block        # the usual case: no .to() calls (host time a layer)
        return (a.to(dtype), g.to(dtype), bias)
    if isinstance(block, torch.Tensor):
        return block if block.dtype == dtype else block.to(dtype)
    if isinstance(block, GhostBlock) and block.dtype in HALF:
        raise TypeError(
            f"GhostClipper: the rule of {type(tap.module).__name__} ({tap.name!r}) returned "
            f"a GhostBlock for {list(names)} of dtype {block.dtype}, expected "
            f"{dtype}: the private gradient of a half-precision parameter is summed and "
            f"noised in {dtype} and rounded to {block.dtype} once; give the block "
            f"dtype={dtype} and a clipped_sum returning {dtype} (call clear() to discard "
            "this step)")
    return block


def refuse_mixed_dtypes(entries) -> None:
    """Refuse a step whose parameters' accumulation dtypes differ (float32 and
    float64 layers in one model): one clip op takes one dtype, and the op's own
    refusal named its internal block index, not the layers (the sixth audit).
    ``entries``: ``[(tap, names, block)]`` of the step."""
    dtypes = {tap.params[names[0]].dtype for tap, names, _ in entries}
    if len(dtypes) <= 1 or len({accumulation_dtype(d) for d in dtypes}) <= 1:
        return          # the usual step (names formed only for the refusal)
    seen: dict = {}
    for tap, names, _ in entries:
        seen.setdefault(accumulation_dtype(tap.params[names[0]].dtype), []).append(
            tap.full(names[0]))
    shown = "; ".join(f"{str(d).replace('torch.', '')}: {ns[:3]}"
                      + (f" and {len(ns) - 3} more" if len(ns) > 3 else "")
                      for d, ns in seen.items())
    raise TypeError(
        f"GhostClipper: the trainable parameters have different dtypes ({shown}); "
        "expected one (float16/bfloat16 count as float32): the step clips and noises "
        "every parameter in one dtype. Convert the model to one dtype (model.float() "
        "or model.double()) or freeze the odd layers; call clear() to discard this "
        "step (nothing was written or drawn)")


def half_mean_error(layer: str, dtype: torch.dtype) -> ValueError:
    """The refusal of a batch-mean loss whose output gradients reached layer
    ``layer`` in ``dtype`` (float16 or bfloat16): the mean's 1/B is rounded
    into each sample's gradient there, to a value that depends on B."""
    return ValueError(
        f"GhostClipper: layer {layer or '<model>'!r}'s output gradient arrived in {dtype} "
        "(torch.autocast or a half-precision model) with loss_reduction='mean': the batch "
        f"mean's 1/B is rounded into every sample's {dtype} gradient, and how it rounds "
        "depends on the batch size, so one sample's presence moves every other sample's "
        "clipped contribution (the eighth audit: removing one sample moved the clipped sum "
        "by 1.42 C at B = 999 under bfloat16, 1.65 C at B = 4096 under float16). Use a "
        "summed loss (the criterion's reduction='sum' and loss_reduction='sum'; the mean's "
        "step is the learning rate divided by the expected batch size), or float32. "
        "Nothing was drawn; optimizer.zero_grad() (or the clipper's clear()) discards this "
        "step")


def overflowing(writes):
    """The first of ``writes`` ``[(tap, name, parameter, gradient)]`` whose
    gradient is not finite in a half dtype, as ``(full name, dtype)``, or None:
    a finite float32 private gradient rounded to float16 (largest 65504) can
    become inf, and writing it would step every weight it touches to inf."""
    for tap, n, p, g in writes:
        if p.dtype in HALF and not bool(torch.isfinite(g).all()):
            return tap.full(n), p.dtype
    return None


class SpentStepError(ValueError):
    """A step refused after its noise was drawn (a half gradient overflowing
    on its rounding): nothing was written, but the release happened -- the
    refusal itself depends on the noised gradient -- so the step is spent: the
    private optimizer accounts it and consumes its batch before raising."""


def overflow_error(name: str, dtype: torch.dtype, noise_std: float) -> ValueError:
    """The refusal of parameter ``name``'s overflowing gradient; ``noise_std``
    is the step's, before the division by the batch."""
    return SpentStepError(
        f"GhostClipper: the private gradient of parameter {name!r} overflows "
        f"{dtype} (largest {torch.finfo(dtype).max:g}) when rounded from "
        "float32; expected a gradient within its range (noise std "
        f"{noise_std:g} before the "
        "division by the batch). Keep the parameters in float32 and run the "
        "forward under torch.autocast, or use bfloat16. Nothing was written; this "
        "step's noise is spent (the private optimizer accounts the step and its batch is "
        "discarded: go on with the next one)")
