"""What every CUDA adaptor shares: device pointers, dtype codes, the launch
stream and workspaces."""
from __future__ import annotations

import numpy as np

from .. import _arrays
from .._native import for_array as native  # noqa: F401  (_C, or _C_emu for the emulated device)
from .._arrays import current_stream as stream  # noqa: F401  (the families launch on it)
from .._arrays import data_ptr as ptr

_DTYPE_CODES = {np.dtype(np.float32): 0, np.dtype(np.float64): 1}


def opt_ptr(x) -> int:
    """ptr(x), or the null pointer for an absent (None) buffer."""
    return 0 if x is None else ptr(x)


def dtype_code(x) -> int:
    """The launchers' element type: 0 float32, 1 float64."""
    return _DTYPE_CODES[_arrays.numpy_dtype(x)]


def workspace(like, nbytes: int):
    """(buffer, pointer) of ``nbytes`` scratch bytes on like's device, from its
    library's allocator; (None, 0) when the launcher needs none.  The caller
    holds the buffer until the launch is queued."""
    if nbytes == 0:
        return None, 0
    buf = _arrays.io_for(like).empty((nbytes,), np.uint8)
    return buf, ptr(buf)
