"""The shared Philox stream's normals on CUDA: the signature of ``_numba.rng``."""
from __future__ import annotations

import math

from .. import _C
from ._common import dtype_code, ptr, stream


def add_gaussian(out, seed, offset, scale, accumulate, post):
    if post != 1.0:
        raise NotImplementedError("post-scaling is applied by the fused CUDA kernels")
    _C.launch_fill_gaussian(ptr(out), math.prod(out.shape), dtype_code(out), int(seed),
                            int(offset), float(scale), bool(accumulate), stream(out))
