"""Capability detection and dispatch: the only place that decides where work runs.

Rule (DESIGN.md, "Layers"): an array exposing ``__cuda_array_interface__`` (a
torch CUDA tensor, a CuPy array) goes to the CUDA kernels of ``ncdp_fast._C``; a
CPU array (NumPy, a torch CPU tensor) goes to the numba kernels.  Results come
back as the caller's array type on the caller's device.  torch and CuPy are
never imported here: an array is recognised by its type's module, so importing
ncdp_fast costs neither.

What the build can do is read once, at import, from the compiled module (no
CUDA call); whether a GPU is visible is asked of the driver once, on first need,
so that importing ncdp_fast never initialises CUDA in a process that may fork.
"""
from __future__ import annotations

import functools
import importlib
import os
import secrets
import warnings
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

try:  # The native module is optional for the CPU path.
    from . import _C  # type: ignore[attr-defined]
    _C_ERROR: str | None = None
except ImportError as exc:  # pragma: no cover - exercised only on broken installs
    _C = None
    _C_ERROR = str(exc)
    warnings.warn(
        f"ncdp_fast: the native module could not be imported ({exc}); the CPU (numba) "
        "path works, CUDA arrays will be refused. Rebuild with `pip install -e .`.",
        RuntimeWarning, stacklevel=2)

CUDA_COMPILED: bool = bool(_C is not None and _C.cuda_compiled())
CUDA_ARCHS: str = _C.cuda_archs() if _C is not None else ""

FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


@functools.lru_cache(maxsize=1)
def cuda_devices() -> tuple[str, ...]:
    """Names of the visible CUDA devices (empty without a CUDA build, driver or GPU)."""
    if not CUDA_COMPILED or os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        return ()
    n = _C.cuda_device_count()
    return tuple(_C.cuda_device_name(i) for i in range(n))


def resolve_seed(seed: Any) -> int:
    """A 64-bit seed: the caller's, validated, or 64 bits from the OS (never a constant)."""
    if seed is None:
        return secrets.randbits(64)
    return check_uint64(seed, "seed")


def check_uint64(value: Any, name: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an integer in [0, 2**64), got {type(value).__name__} {value!r}")
    value = int(value)
    if not 0 <= value < 2**64:
        raise ValueError(f"{name}: expected an integer in [0, 2**64), got {value}")
    return value


# --------------------------------------------------------------------------- arrays

def _type_module(x: Any) -> str:
    return type(x).__module__.split(".")[0]


def is_torch(x: Any) -> bool:
    return _type_module(x) == "torch" and hasattr(x, "device")


def is_cuda_array(x: Any) -> bool:
    if is_torch(x):
        return x.device.type == "cuda"
    return hasattr(x, "__cuda_array_interface__")


class _NumpyIO:
    """NumPy arrays (and anything np.asarray takes) on the CPU."""
    lib = "numpy"
    device = "cpu"

    def to_kernel(self, x):
        return np.ascontiguousarray(x)

    def dtype_of(self, x) -> np.dtype:
        return np.asarray(x).dtype if not hasattr(x, "dtype") else np.dtype(x.dtype)

    def empty(self, shape, dtype):
        return np.empty(shape, dtype=dtype)

    def zeros(self, shape, dtype):
        return np.zeros(shape, dtype=dtype)

    def to_user(self, k):
        return k

    def to_numpy(self, k):
        return k

    def copy(self, k):
        return k.copy()

    def all_finite(self, k) -> bool:
        return bool(np.isfinite(k).all())

    # CPU GEMMs run on the caller's library so that a torch training loop never
    # wakes a second BLAS thread pool while torch's OpenMP workers still spin.
    matmul = staticmethod(np.matmul)


class _TorchCpuIO(_NumpyIO):
    """torch CPU tensors: kernels see a zero-copy NumPy view (a copy only when the
    tensor is not C-contiguous); results go back through torch.from_numpy."""
    lib = "torch"

    def to_kernel(self, x):
        return np.ascontiguousarray(x.detach().resolve_conj().numpy())

    def dtype_of(self, x):
        return _torch_to_numpy_dtype(x.dtype)

    def to_user(self, k):
        import torch
        return torch.from_numpy(k)

    @staticmethod
    def matmul(x, y, out):
        import torch
        torch.matmul(torch.from_numpy(x), torch.from_numpy(y), out=torch.from_numpy(out))
        return out


class _TorchCudaIO:
    """torch CUDA tensors: kernels receive the device pointer and the current stream."""
    lib = "torch"

    def __init__(self, device):
        self.device = device

    def to_kernel(self, x):
        # .contiguous() copies only when the layout is not row-major (documented cost).
        return x.detach().contiguous()

    def dtype_of(self, x):
        return _torch_to_numpy_dtype(x.dtype)

    def empty(self, shape, dtype):
        import torch
        return torch.empty(shape, dtype=_numpy_to_torch_dtype(dtype), device=self.device)

    def zeros(self, shape, dtype):
        import torch
        return torch.zeros(shape, dtype=_numpy_to_torch_dtype(dtype), device=self.device)

    def to_user(self, k):
        return k

    def to_numpy(self, k):
        return k.cpu().numpy()

    def copy(self, k):
        return k.clone()

    def all_finite(self, k) -> bool:
        import torch
        return bool(torch.isfinite(k).all())

    def stream(self):
        import torch
        return int(torch.cuda.current_stream(self.device).cuda_stream)


class _CupyIO:
    lib = "cupy"

    def __init__(self, device):
        self.device = device

    def to_kernel(self, x):
        import cupy
        return cupy.ascontiguousarray(x)

    def dtype_of(self, x):
        return np.dtype(x.dtype)

    def empty(self, shape, dtype):
        import cupy
        with cupy.cuda.Device(self.device):
            return cupy.empty(shape, dtype=dtype)

    def zeros(self, shape, dtype):
        import cupy
        with cupy.cuda.Device(self.device):
            return cupy.zeros(shape, dtype=dtype)

    def to_user(self, k):
        return k

    def to_numpy(self, k):
        return k.get()

    def copy(self, k):
        return k.copy()

    def all_finite(self, k) -> bool:
        import cupy
        return bool(cupy.isfinite(k).all())

    def stream(self):
        import cupy
        # CuPy's current stream is per device: this device's, not the thread's.
        with cupy.cuda.Device(self.device):
            return int(cupy.cuda.get_current_stream().ptr)


def _torch_to_numpy_dtype(tdtype) -> np.dtype:
    name = str(tdtype).replace("torch.", "")
    try:
        return np.dtype(name)
    except TypeError:  # bfloat16 and friends have no NumPy twin
        return np.dtype("V2") if "16" in name else np.dtype("V")


def _numpy_to_torch_dtype(dtype):
    import torch
    return {np.dtype(np.float32): torch.float32, np.dtype(np.float64): torch.float64,
            np.dtype(np.int64): torch.int64, np.dtype(np.uint8): torch.uint8}[np.dtype(dtype)]


def _describe(x) -> str:
    if is_torch(x):
        return f"torch.Tensor on {x.device}"
    return f"{type(x).__module__}.{type(x).__name__}"


@dataclass(frozen=True)
class Backend:
    """Where one op call runs: the array I/O of the caller's library and the kernels."""
    name: str            # "cpu" or "cuda"
    io: Any              # one of the *IO classes above
    kernels: ModuleType  # ncdp_fast._numba.<family> or ncdp_fast._cuda

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


def _io_for(x):
    if is_torch(x):
        if x.device.type == "cuda":
            return "cuda", ("torch", x.device.index if x.device.index is not None else 0), \
                _TorchCudaIO(x.device)
        if x.device.type != "cpu":
            raise TypeError(f"torch tensors on {x.device} are not supported (CPU or CUDA only)")
        return "cpu", ("torch", "cpu"), _TorchCpuIO()
    if hasattr(x, "__cuda_array_interface__"):
        if _type_module(x) == "cupy":
            return "cuda", ("cupy", int(x.device.id)), _CupyIO(int(x.device.id))
        raise TypeError(f"{_describe(x)}: CUDA arrays are accepted as torch tensors or CuPy arrays")
    return "cpu", ("numpy", "cpu"), _NumpyIO()


def select(family: str, **arrays) -> Backend:
    """The backend for one call of a kernel family, from its array arguments.

    All arrays must live in one place (all CPU, or all on one CUDA device of one
    library); the error names the arguments that disagree.
    """
    where = None
    for name, x in arrays.items():
        if x is None:
            continue
        kind, key, io = _io_for(x)
        if where is None:
            where = (name, kind, key, io)
        elif (kind, key) != (where[1], where[2]) and not (kind == "cpu" == where[1]
                                                          and name == "labels"):
            # Integer labels may come as a NumPy array next to torch CPU features;
            # any other mix of libraries would fail later with an unrelated error.
            raise TypeError(f"{name} and {where[0]} must be on the same device and of the same "
                            f"array library: got {_describe(x)} and {_describe(arrays[where[0]])}")
    if where is None:
        raise ValueError("no array argument given")
    name, kind, _, io = where
    if kind == "cuda":
        if not CUDA_COMPILED:
            raise RuntimeError(
                f"{name}: got a CUDA array, but ncdp_fast._C was built without CUDA "
                f"({'not importable: ' + _C_ERROR if _C is None else 'no CUDA compiler at build time'}). "
                "Rebuild on a machine with nvcc: `pip install --no-build-isolation -e .` "
                "(NCDP_CUDA_ARCH selects architectures), or pass CPU arrays.")
        from . import _cuda
        return Backend("cuda", io, _cuda)
    return Backend("cpu", io, importlib.import_module(f"._numba.{family}", __package__))
