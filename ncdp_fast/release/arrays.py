"""Array conversion shared by the release modules."""
from __future__ import annotations

import numpy as np

from .. import _backend

__all__ = ["to_numpy"]


def to_numpy(a) -> np.ndarray:
    """Host NumPy array of a NumPy array, torch tensor (any device) or CuPy array."""
    if isinstance(a, np.ndarray):
        return a
    if _backend.is_torch(a):
        return a.detach().cpu().numpy()
    if hasattr(a, "get"):            # CuPy
        return a.get()
    return np.asarray(a)

