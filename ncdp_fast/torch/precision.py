"""Half-precision (float16 / bfloat16) parameters under the clipper: their
layer's tensors are upcast to float32 before the rule runs, their blocks
summed and noised in float32 (:func:`.layers.accumulation_dtype`), and the
private gradient rounded to the parameter's dtype once, at the write."""
from __future__ import annotations

import torch

from .._clip import GhostBlock
from .layers import HALF, accumulation_dtype

__all__ = ["upcast", "cast_block", "overflowing", "overflow_error"]


def upcast(x):
    """``x`` in float32 if it is a half tensor, else unchanged."""
    return x.float() if isinstance(x, torch.Tensor) and x.dtype in HALF else x


def cast_block(tap, names, block):
    """The block in its parameter's accumulation dtype (float32 for a half
    parameter; autocast's half activations of a float32 layer, float32)."""
    dtype = accumulation_dtype(tap.params[names[0]].dtype)
    if isinstance(block, tuple):
        a, g, bias = block
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


def overflowing(writes):
    """The first of ``writes`` ``[(tap, name, parameter, gradient)]`` whose
    gradient is not finite in a half dtype, as ``(full name, dtype)``, or None:
    a finite float32 private gradient rounded to float16 (largest 65504) can
    become inf, and writing it would step every weight it touches to inf."""
    for tap, n, p, g in writes:
        if p.dtype in HALF and not bool(torch.isfinite(g).all()):
            return tap.full(n), p.dtype
    return None


def overflow_error(name: str, dtype: torch.dtype, noise_std: float) -> ValueError:
    """The refusal of parameter ``name``'s overflowing gradient; ``noise_std``
    is the step's, before the division by the batch."""
    return ValueError(
        f"GhostClipper: the private gradient of parameter {name!r} overflows "
        f"{dtype} (largest {torch.finfo(dtype).max:g}) when rounded from "
        "float32; expected a gradient within its range (noise std "
        f"{noise_std:g} before the "
        "division by the batch). Keep the parameters in float32 and run the "
        "forward under torch.autocast, or use bfloat16. Nothing was written; this "
        "step's noise is spent")
