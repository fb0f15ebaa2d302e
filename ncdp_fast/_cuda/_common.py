"""What every CUDA adaptor shares: device pointers, dtype codes, the launch
stream and workspaces."""
from __future__ import annotations

import contextlib
import threading

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


_TORCH_DTYPE_CODES: dict = {}


def torch_dtype_code(dtype) -> int:
    """:func:`dtype_code` of a torch dtype, without a library dispatch (the
    launchers a step calls per layer read their arguments from the tensor)."""
    if not _TORCH_DTYPE_CODES:             # _DTYPE_CODES, keyed by torch's dtypes
        _TORCH_DTYPE_CODES.update({_arrays._numpy_to_torch_dtype(k): v
                                   for k, v in _DTYPE_CODES.items()})
    return _TORCH_DTYPE_CODES[dtype]


def pointers_sizes_codes(arrays) -> tuple[list, list, list]:
    """(pointers, element counts, dtype codes) of device arrays of one library:
    a launcher's per-segment vectors.  Torch tensors are read directly (no
    per-array library dispatch: a BERT-base step finishes some 150 segments,
    each several calls of ptr() and dtype_code() -- issue 36's host time)."""
    if arrays and _arrays.is_torch(arrays[0]):
        return ([x.data_ptr() for x in arrays], [x.numel() for x in arrays],
                [torch_dtype_code(x.dtype) for x in arrays])
    return ([ptr(x) for x in arrays], [int(np.prod(x.shape, dtype=np.int64)) for x in arrays],
            [dtype_code(x) for x in arrays])


def workspace(like, nbytes: int):
    """(buffer, pointer) of ``nbytes`` scratch bytes on like's device, from its
    library's allocator; (None, 0) when the launcher needs none.  The caller
    holds the buffer until the launch is queued."""
    if nbytes == 0:
        return None, 0
    buf = _arrays.io_for(like).empty((nbytes,), np.uint8)
    return buf, ptr(buf)


# The flags are the process's: calls on several threads share one save and
# restore per flag (the first in saves, the last out restores), so no thread's
# exit turns TF32 back on under another's products or loses the caller's setting.
_TF32_LOCK = threading.Lock()
_TF32_STATE = {kind: {"depth": 0, "saved": None} for kind in ("matmul", "conv")}


class _IeeeFloat32:
    """The context of :func:`ieee_float32_matmul` and :func:`ieee_float32_products`:
    a class, not a generator, and the API probe only on the outermost entry of
    each flag, because the clip op enters it once a linear layer (a few
    microseconds of host time each, issue 36)."""

    def __init__(self, kinds):
        self.kinds = kinds
        self.matmul = "matmul" in kinds     # counted per thread (ieee_float32_matmul_held)

    def __enter__(self):
        with _TF32_LOCK:
            for kind in self.kinds:
                state = _TF32_STATE[kind]
                if state["depth"] == 0:
                    owner, name, off = _tf32_switch(kind)
                    state["saved"] = (owner, name, getattr(owner, name))
                    setattr(owner, name, off)
                state["depth"] += 1
            if self.matmul:
                _HELD.matmul = getattr(_HELD, "matmul", 0) + 1
        return self

    def __exit__(self, *exc):
        with _TF32_LOCK:
            for kind in self.kinds:
                state = _TF32_STATE[kind]
                state["depth"] -= 1
                if state["depth"] == 0:
                    owner, name, value = state["saved"]
                    setattr(owner, name, value)
            if self.matmul:
                _HELD.matmul -= 1
        return False


# Entries of the matmul flag's context held by this thread: while one is, no
# other thread's exit can turn TF32 back on (the flag's count includes it), so
# a GEMM of this thread needs no entry of its own (the clip op's sums run
# inside its one entry: a lock and a count a layer saved, issue 36).
_HELD = threading.local()


def ieee_float32_matmul_held() -> bool:
    """Whether this thread is inside :func:`ieee_float32_matmul` (or
    :func:`ieee_float32_products`): TF32 is off for its torch GEMMs until it
    leaves."""
    return getattr(_HELD, "matmul", 0) > 0


_MATMUL = _IeeeFloat32(("matmul",))
_PRODUCTS = _IeeeFloat32(("matmul", "conv"))
_NO_SWITCH = contextlib.nullcontext()


def ieee_float32_matmul():
    """TF32 off for the call, restored after: the documented float32 accuracy
    of the NTK Gram and of the clipped sums is that of IEEE float32 products,
    which TF32's 10-bit mantissas would lose whatever the caller set globally.
    Through the API the caller's setting is readable by: the legacy
    ``allow_tf32``, or where reading it raises (torch >= 2.9 once a caller
    set the new ``fp32_precision``) that one -- setting the other would leave
    the two in the mixed state torch refuses to read.  Nested entries (a
    step's sums inside the clip op's one) only count."""
    return _MATMUL


def ieee_float32_products(like):
    """:func:`ieee_float32_matmul` for cuDNN's convolutions too, whose TF32 is
    on by torch's default (``torch.backends.cudnn.allow_tf32``), where ``like``
    is a device array (the emulated device's included, so that CI runs the
    switch); a context that does nothing for a host array (no TF32 there).
    Around the per-sample gradients the torch drop-in's rules form with GEMMs
    and convolutions (``torch/layer_rules.py``, ``torch/hf_layers.py``,
    ``torch/tied.py``), whose norms decide the clip factors (issue 36: no TF32
    there; the H200 run of 2026-11-30 ran a folded weight-gradient kernel in
    TF32, its values outside the float32 rounding bound of the float64 sum)."""
    return _PRODUCTS if _arrays.is_cuda_array(like) else _NO_SWITCH


def _tf32_switch(kind):
    """(owner, attribute, its IEEE float32 value) of the TF32 API in use for
    ``kind``: "matmul" (cuBLAS) or "conv" (cuDNN's convolutions)."""
    import torch
    legacy = torch.backends.cuda.matmul if kind == "matmul" else torch.backends.cudnn
    try:
        legacy.allow_tf32
    except RuntimeError:
        return (legacy if kind == "matmul" else torch.backends.cudnn.conv), "fp32_precision", \
            "ieee"
    return legacy, "allow_tf32", False
