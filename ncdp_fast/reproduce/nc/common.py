"""Helpers shared by the Neural Collapse reproductions (``nc-synthetic``, ``nc-real``)."""
from __future__ import annotations

import numpy as np

from ..._report import machine

__all__ = ["run_meta", "FixedLinear"]


def run_meta(extra):
    """The report's metadata: this machine (CPU runs) and ``extra``."""
    m = machine()
    return dict(m, device=f"CPU: {m['cpu']}, {m['numba_threads']} threads", device_tag="cpu",
                **extra)


class FixedLinear:
    """A fitted linear model from raw (W, b) (the non-private GD reference)."""

    def __init__(self, W):
        self.W = W

    def predict(self, X):
        return np.argmax(X @ self.W.T, axis=1)

