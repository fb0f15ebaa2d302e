"""Capability detection and dispatch: the only place that decides where work runs.

Rule (docs/architecture.md, "Layers"): a CUDA array (a torch CUDA tensor, a CuPy
array) goes to the CUDA kernels of ``ncdp_fast._C``; a CPU array (NumPy, a torch
CPU tensor) goes to the numba kernels.  Results come back as the caller's array
type on the caller's device.  Which library an array belongs to is
:mod:`ncdp_fast._arrays`'s business; this module only reads the answer.

What the build can do is read once, at import, from the compiled module (no
CUDA call), and :data:`KERNELS` is built from it then: the op -> kernel step is
the lookup ``KERNELS[backend, family]``.  Whether a GPU is visible is asked of
the driver once, on first need, so that importing ncdp_fast never initialises
CUDA in a process that may fork.
"""
from __future__ import annotations

import contextlib
import functools
import os
import secrets
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

from . import _arrays, _native, _validate
from ._arrays import is_torch
from ._numba import clip as _numba_clip
from ._numba import mix as _numba_mix
from ._numba import ntk as _numba_ntk
from ._numba import rng as _numba_rng
from ._cuda import clip as _cuda_clip
from ._cuda import mix as _cuda_mix
from ._cuda import ntk as _cuda_ntk
from ._cuda import rng as _cuda_rng

NATIVE_ENV = _native.NATIVE_ENV
EMULATION_ENV = _native.EMULATION_ENV

# The native module is optional for the CPU path. Its absence is said where
# it matters, not at import: select() refuses a CUDA array naming the import
# error and how to rebuild, and info() reports it. A warning here misled the
# one process that imports the package before building it (`make gpu-check`).
try:
    _C = _native.load()
    _C_ERROR: str | None = None
except ImportError as exc:
    _C = None
    _C_ERROR = str(exc)

CUDA_COMPILED: bool = bool(_C is not None and _C.cuda_compiled())
CUDA_ARCHS: str = _C.cuda_archs() if _C is not None else ""
# NCDP_CUDA_EMULATION=1: the process's CPU torch tensors are the emulated
# device's (docs/architecture.md, "The emulated CUDA device").
EMULATION: bool = os.environ.get(EMULATION_ENV) == "1"
if EMULATION:
    _native.emulated()
    _arrays.set_emulation(True)

# (backend, kernel family) -> the module whose functions the ops call.  The
# CUDA adaptors share the numba kernels' signatures, so an op is written once.
KERNELS: dict[tuple[str, str], ModuleType] = {
    ("cpu", "clip"): _numba_clip,
    ("cpu", "mix"): _numba_mix,
    ("cpu", "ntk"): _numba_ntk,
    ("cpu", "rng"): _numba_rng,
}
# The adaptors import no native code: they are the CUDA kernels' entry for a
# CUDA build and for the emulated device alike (select() refuses CUDA arrays
# that no build can take).
KERNELS.update({
    ("cuda", "clip"): _cuda_clip,
    ("cuda", "mix"): _cuda_mix,
    ("cuda", "ntk"): _cuda_ntk,
    ("cuda", "rng"): _cuda_rng,
})

FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


@functools.lru_cache(maxsize=1)
def cuda_devices() -> tuple[str, ...]:
    """Names of the visible CUDA devices (empty without a CUDA build, driver or GPU)."""
    if not CUDA_COMPILED or os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        return ()
    n = _C.cuda_device_count()
    return tuple(_C.cuda_device_name(i) for i in range(n))


# --------------------------------------------------------- arguments every op checks

def resolve_seed(seed: Any) -> int:
    """A 64-bit seed: the caller's, validated, or 64 bits from the OS (never a constant)."""
    if seed is None:
        return secrets.randbits(64)
    return _validate.check_uint64(seed, "seed")


# ------------------------------------------------------------------------ dispatch

@dataclass(frozen=True)
class Backend:
    """Where one op call runs: the array I/O of the caller's library and the kernels."""
    name: str            # "cpu" or "cuda"
    io: Any              # an I/O object of ncdp_fast._arrays (NumpyIO, TorchCudaIO, ...)
    kernels: ModuleType  # KERNELS[name, family]: ncdp_fast._numba.<family> or ._cuda.<family>

    def check_float(self, x, name: str) -> np.dtype:
        try:
            dt = self.io.dtype_of(x)
        except (TypeError, KeyError):       # torch float16/bfloat16: no NumPy twin
            raise TypeError(f"{name}: expected float32 or float64, got dtype {x.dtype} (half "
                            "precision is not supported; cast explicitly)") from None
        if dt not in FLOAT_DTYPES:
            shown = x.dtype if is_torch(x) else dt       # bfloat16, not NumPy's |V2
            raise TypeError(f"{name}: expected float32 or float64, got dtype {shown} "
                            f"({'integers' if dt.kind in 'iub' else 'half precision and other types'}"
                            " are not supported; cast explicitly)")
        return dt


def select(family: str, **arrays) -> Backend:
    """The backend for one call of a kernel family, from its array arguments.

    All arrays must live in one place (all CPU, or all on one CUDA device of one
    library); the error names the arguments that disagree.
    """
    first = first_device = None
    for name, x in arrays.items():
        if x is None:
            continue
        if first_device is not None and _same_tensor_place(x, first_device):
            continue        # a private step passes some 70 tensors of one device
        # (the first tensor of a call is checked here, its fellows on that path
        # are not: a sparse or nested one fails loudly in torch's own calls.)
        _validate.check_plain(x, name)
        io = _arrays.io_for(x)
        if first is None:
            first = (name, io)
            first_device = x.device if _arrays.kind(x) == "torch" else None
        elif io.place != first[1].place and not (io.backend == "cpu" == first[1].backend
                                                 and name == "labels"):
            # Integer labels may come as a NumPy array next to torch CPU features;
            # any other mix would fail later with an unrelated error. Another
            # library is the wrong type; the same library on another device is a
            # wrong value of the right type (torch's own check says "device").
            error = TypeError if io.lib != first[1].lib else ValueError
            raise error(f"{name} and {first[0]} must be on the same device and of the same "
                        f"array library: got {_arrays.describe(x)} and "
                        f"{_arrays.describe(arrays[first[0]])}")
    if first is None:
        raise ValueError("no array argument given")
    name, io = first
    if io.backend == "cuda" and not CUDA_COMPILED and not _arrays.is_emulated(arrays[name]):
        raise RuntimeError(
            f"{name}: got a CUDA array, but ncdp_fast._C was built without CUDA "
            f"({'not importable: ' + _C_ERROR if _C is None else 'no CUDA compiler at build time'}). "
            "Rebuild on a machine with nvcc: `pip install --no-build-isolation -e .` "
            "(NCDP_CUDA_ARCH selects architectures), or pass CPU arrays.")
    return Backend(io.backend, io, KERNELS[io.backend, family])


def _same_tensor_place(x, device) -> bool:
    """Whether x is a torch tensor on ``device`` (the first argument's, a
    tensor's): then io_for(x) has the first's place, without building it."""
    return _arrays.kind(x) == "torch" and x.device == device


# Why a draw is refused while its stream captures a CUDA graph (also said by
# ncdp_fast/torch/graphs.py, and by csrc/common/cuda_check.h for a launch).
GRAPH_CAPTURE_WHY = (
    "a replay of the graph would launch the draw again at the seed and offset fixed at "
    "capture, drawing the same numbers every time (noise reused), and would run no Python, "
    "so nothing would be accounted or checked")


def refuse_graph_capture(be: Backend, x, what: str) -> None:
    """Refuse (ValueError) an op that draws from the Philox stream while the
    current stream of x's device captures a CUDA graph, before anything is
    drawn or read back; x: the op's first array (unread where ``be`` is the
    host's: no capture to ask about)."""
    if be.name == "cuda" and _native.for_array(x).cuda_stream_capturing(
            _arrays.current_stream(x)):
        raise ValueError(
            f"{what}: expected a current CUDA stream that is not capturing a graph, got one "
            f"that is capturing: {GRAPH_CAPTURE_WHY}. Refused before anything was drawn; "
            "call it outside the capture (eagerly)")


@contextlib.contextmanager
def emulated_cuda(enabled: bool = True):
    """Within the block, CPU torch tensors are the emulated CUDA device's
    (``enabled``), or plain CPU tensors (``enabled=False``), whatever
    NCDP_CUDA_EMULATION said at import; for tests, which run the CPU and the
    emulated device in one process.  Not thread-safe: the switch is the process's."""
    if enabled:
        _native.emulated()
    before = _arrays.set_emulation(enabled)
    try:
        yield
    finally:
        _arrays.set_emulation(before)


def host(family: str) -> Backend:
    """The NumPy backend, for ops called without any array argument."""
    return Backend("cpu", _arrays.NumpyIO(), KERNELS["cpu", family])
