"""Argument checks of the float64 NumPy analysis tools (``ntk.regress`` and the
DP-GD / DP-SGD theory modules): arrays come back as finite float64 NumPy (torch
tensors are copied to the host), numbers as Python ints and floats."""
from __future__ import annotations

import math

import numpy as np

from . import _backend

__all__ = ["as_matrix", "as_targets", "check_pos_int", "check_nonneg", "check_finite"]


def as_matrix(x, name, d=None):
    """x as a finite (n, d) float64 NumPy array (``d``: the columns required, if given)."""
    if _backend.is_torch(x):
        x = x.detach().cpu().numpy()
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2:
        raise ValueError(f"{name}: expected a 2-D array (n, d), got shape {x.shape}")
    if d is not None and x.shape[1] != d:
        raise ValueError(f"{name}: expected {d} columns (the training dimension), "
                         f"got shape {x.shape}")
    if not np.all(np.isfinite(x)):
        raise ValueError(f"{name}: contains NaN or Inf")
    return x


def as_targets(y, n):
    """y as finite (n,) float64 NumPy real labels."""
    if _backend.is_torch(y):
        y = y.detach().cpu().numpy()
    y = np.asarray(y, dtype=np.float64)
    if y.shape != (n,):
        raise ValueError(f"y: expected shape ({n},) (one real label per row of x), got {y.shape}")
    if not np.all(np.isfinite(y)):
        raise ValueError("y: contains NaN or Inf")
    return y


def check_pos_int(v, name):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ValueError(f"{name}: expected an integer >= 1, got {v!r}")
    return int(v)


def check_nonneg(v, name):
    if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)) \
            or not (math.isfinite(v) and v >= 0):
        raise ValueError(f"{name}: expected a finite number >= 0, got {v!r}")
    return float(v)


def check_finite(v, name, *, positive=False, nonneg=False):
    """A finite real as a float (TypeError for a non-number), optionally > 0 or >= 0."""
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name}: expected a real number, got {type(v).__name__} {v!r}")
    v = float(v)
    if not math.isfinite(v) or (positive and v <= 0) or (nonneg and v < 0):
        what = "> 0" if positive else (">= 0" if nonneg else "finite")
        raise ValueError(f"{name}: expected a finite number {what}, got {v!r}")
    return v
