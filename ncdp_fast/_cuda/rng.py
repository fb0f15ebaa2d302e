"""The shared Philox stream's normals on CUDA: the signature of ``_numba.rng``."""
from __future__ import annotations

import math

from ._common import dtype_code, native, ptr, stream


def add_gaussian(out, seed, offset, scale, accumulate, post):
    # post = 1 / expected batch size on a ghost block's finishing step: applied
    # in the kernel's float64 before the one rounding, as the numba kernel does.
    native(out).launch_fill_gaussian(ptr(out), math.prod(out.shape), dtype_code(out), int(seed),
                                     int(offset), float(scale), bool(accumulate), float(post),
                                     stream(out))
