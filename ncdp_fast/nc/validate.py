"""Argument checks and host conversion shared by ``ncdp_fast.nc`` and ``ncdp_fast.train``.

Messages name the argument, what was expected and what was received."""
from __future__ import annotations

import math
from numbers import Integral, Real

import numpy as np

from .. import _backend

__all__ = ["check_int", "check_nonnegative", "to_host", "check_features", "check_labels"]


def check_int(value, name, minimum):
    """An integer (not bool) >= minimum, as a Python int."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"{name}: expected an integer >= {minimum}, got "
                        f"{type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name}: expected an integer >= {minimum}, got {value}")
    return int(value)


def check_nonnegative(value, name):
    """A finite real number >= 0, as a float."""
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value) \
            or value < 0:
        raise ValueError(f"{name}: expected a finite number >= 0, got {value!r}")
    return float(value)


def to_host(x, name, *, dtype=None):
    """Host NumPy view/copy of a NumPy array or torch tensor (CPU or CUDA)."""
    if _backend.is_torch(x):
        x = x.detach().cpu().numpy()
    elif hasattr(x, "__cuda_array_interface__") and hasattr(x, "get"):
        x = x.get()
    try:
        a = np.asarray(x)
    except Exception:  # pragma: no cover - exotic inputs
        raise TypeError(f"{name}: expected an array, got {type(x).__name__}") from None
    if dtype is not None:
        a = a.astype(dtype, copy=False)
    return a


def check_features(X, name="X"):
    """Validate a (n, p) float feature array (NumPy or torch); returns (n, p)."""
    try:
        shape = tuple(int(s) for s in X.shape)
    except AttributeError:
        raise TypeError(f"{name}: expected an array of shape (n, p), got "
                        f"{type(X).__name__}") from None
    if len(shape) != 2:
        raise ValueError(f"{name}: expected shape (n, p), got {shape}")
    if _backend.is_torch(X):
        import torch
        if not torch.is_floating_point(X):
            raise TypeError(f"{name}: expected a float32/float64 tensor, got {X.dtype}")
        finite = bool(torch.isfinite(X).all())
    else:
        Xa = np.asarray(X)
        if Xa.dtype.kind not in "fiu":
            raise TypeError(f"{name}: expected a real-valued array, got dtype {Xa.dtype}")
        finite = bool(np.isfinite(Xa).all()) if Xa.dtype.kind == "f" else True
    if not finite:
        raise ValueError(f"{name}: features contain NaN or Inf")
    return shape


def check_labels(y, n, num_classes=None, name="y"):
    """Validate labels: n integers in [0, K).  Returns (labels int64 NumPy, K).

    ``num_classes=None`` takes K = max(y) + 1: the label set is then treated as the
    task's public schema (pass ``num_classes`` to avoid reading it from the data)."""
    a = to_host(y, name)
    if a.ndim != 1 or a.shape[0] != n:
        raise ValueError(f"{name}: expected shape ({n},) matching the features, got {a.shape}")
    if a.dtype.kind == "f":
        if not np.isfinite(a).all() or np.any(a != np.round(a)):
            raise ValueError(f"{name}: expected integer class labels 0..K-1, got non-integer "
                             "values")
    elif a.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected integer class labels, got dtype {a.dtype}")
    a = a.astype(np.int64)
    if num_classes is not None:
        K = check_int(num_classes, "num_classes", 2)
    else:
        K = int(a.max()) + 1 if a.size else 0
        if K < 2:
            raise ValueError(f"{name}: expected labels of at least 2 classes 0..K-1, got max "
                             f"{K - 1}")
    if a.size and (a.min() < 0 or a.max() >= K):
        raise ValueError(f"{name}: expected integers in [0, {K}), got min {a.min()} max "
                         f"{a.max()}")
    return a, K

