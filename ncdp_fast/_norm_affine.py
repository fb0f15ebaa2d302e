"""Per-sample gradients of a normalisation layer's affine parameters: the
clip family's kernel (``csrc/clip/norm_affine.cu``, its numba twin and
``reference.norm_affine_grads``) behind one op.

Layer 2 code, like ``_clip_layers``: validates, picks the backend, allocates
the outputs and calls the kernel.  The torch drop-in's LayerNorm and GroupNorm
rules call it on a device (``torch/layer_rules.py``, through
:func:`device_grads`), where it is two kernels a layer instead of four.
"""
from __future__ import annotations

from . import _arrays, _backend
from ._cuda import clip as device_clip
from ._validate import check_int, check_nonneg

__all__ = ["norm_affine_grads"]


def norm_affine_grads(x, g, *, run: int, eps: float, weight: bool = True, bias: bool = True):
    """(w, b) of ``y = w_c xhat + b_c``: ``w[i, c] = sum g xhat`` and ``b[i, c]
    = sum g`` over sample i's values of channel c (None where not asked for).

    x, g: (B, rows, n) arrays of one library and device, float32 or float64:
    the layer's input and output gradient, each row normalised on its own
    (``xhat = (x - mean) / sqrt(var + eps)``, biased variance, as torch's layer
    and group norms).  ``run`` 0 (LayerNorm): value (r, e) is channel e, C =
    n, summed over the rows (positions); ``run`` > 0 (GroupNorm, a row a
    group): a row holds n / run channels of ``run`` consecutive values, C =
    rows n / run.  Returns (B, C) arrays in x's dtype, each value a float64
    sum rounded once (``reference.norm_affine_grads``, within that rounding).
    They are a sample's gradient blocks, whose norms and sums the clip op
    forms from these very values: no privacy meaning of their own.
    """
    run = check_int(run, "run", minimum=0)
    eps = check_nonneg(eps, "eps")
    sx, sg = _arrays.shape(x, "x"), _arrays.shape(g, "g")
    if len(sx) != 3 or sg != sx:
        raise ValueError(f"x, g: expected two arrays of one shape (B, rows, n), got {sx} and {sg}")
    B, rows, n = sx
    if run and n % run:
        raise ValueError(f"run: expected a divisor of n = {n} (a row holds whole channels), "
                         f"got {run}")
    be = _backend.select("clip", x=x, g=g)
    dtype = be.check_float(x, "x")
    if be.check_float(g, "g") != dtype:
        raise TypeError(f"g: dtype {be.io.dtype_of(g)} differs from x's {dtype}")
    C = channels(rows, n, run)
    w = be.io.empty((B, C), dtype) if weight else None
    b = be.io.empty((B, C), dtype) if bias else None
    if (w is not None or b is not None) and B * C:
        be.kernels.norm_affine_grads(be.io.to_kernel(x), be.io.to_kernel(g), run, eps, w, b)
    return tuple(None if out is None else be.io.to_user(out) for out in (w, b))


def channels(rows: int, n: int, run: int) -> int:
    """C, the channels of a (rows, n) sample: n (run 0), or rows n / run."""
    return n if run == 0 else rows * (n // run)


def device_grads(x, g, dims, run: int, eps: float, weight: bool, bias: bool):
    """:func:`norm_affine_grads` for the torch drop-in's rules on a device
    (``torch/layer_rules.py``), without the op's checks, which those rules
    make themselves (torch tensors of one CUDA or emulated device, one dtype,
    float32 or float64, of one non-empty shape, read as ``dims`` = (B, rows,
    n) in their row-major order, ``run`` dividing n: the rule passes the
    dimensions, not a (B, rows, n) view of each, an op each): a rule runs
    once a normalisation layer a step, and the op's validation and dispatch
    were some 100 Python calls of host time each, three times the torch
    composition they replace (issue 36)."""
    import torch
    B, rows, n = dims
    C = channels(rows, n, run)
    w = torch.empty((B, C), dtype=x.dtype, device=x.device) if weight else None
    b = torch.empty((B, C), dtype=x.dtype, device=x.device) if bias else None
    device_clip.norm_affine_grads(x.contiguous(), g.contiguous(), run, eps, w, b, dims)
    return w, b
