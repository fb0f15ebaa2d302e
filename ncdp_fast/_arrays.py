"""Array interop: the one module that tells NumPy arrays, torch tensors and CuPy
arrays apart.

Everything else asks here: :func:`kind` to branch on the library,
:func:`io_for` for the per-call array I/O of an op (kernel views, output
allocation, results back in the caller's type), and the few helpers the CUDA
adaptors need (device pointers, the launch stream).  torch and CuPy are never
imported at module level: an array is recognised by its type's module, so
importing ncdp_fast costs neither, and a library is imported only once an
array of it has arrived.
"""
from __future__ import annotations

import sys
from typing import Any

import numpy as np

__all__ = ["kind", "is_torch", "require_torch", "is_cuda_array", "shape", "describe", "io_for",
           "to_numpy", "to_host", "all_finite", "numpy_dtype", "data_ptr", "current_stream",
           "as_float64", "module_of", "sample_chunks", "CHUNK_BYTES", "NumpyIO",
           "TorchCpuIO", "TorchCudaIO", "TorchEmulatedIO", "CupyIO", "set_emulation",
           "is_emulated"]


def _type_module(x: Any) -> str:
    return type(x).__module__.split(".")[0]


# kind() of the array types met so far: a private step asks it hundreds of
# times (every adaptor call), and each answer depends on the type alone for
# the types kept here (tensors and NumPy arrays).
_KIND_OF_TYPE: dict = {}


def kind(x: Any) -> str:
    """"torch" (a tensor on any device), "cupy", "cuda" (a CUDA array of another
    library, which no op accepts) or "numpy" (NumPy arrays and what np.asarray takes)."""
    known = _KIND_OF_TYPE.get(type(x))
    if known is not None:
        return known
    module = _type_module(x)
    torch = sys.modules.get("torch")
    if (module == "torch" and hasattr(x, "device")) or \
            (torch is not None and isinstance(x, torch.Tensor)):     # a user's subclass too
        found = "torch"
    elif hasattr(x, "__cuda_array_interface__"):
        found = "cupy" if module == "cupy" else "cuda"
    else:
        found = "numpy"
    if found == "torch" or type(x) is np.ndarray:
        _KIND_OF_TYPE[type(x)] = found
    return found


def is_torch(x: Any) -> bool:
    # The cache read inline: a private step asks this of every launch's
    # arrays (a call level fewer each, issue 36's host time).
    known = _KIND_OF_TYPE.get(type(x))
    return known == "torch" if known is not None else kind(x) == "torch"


def require_torch(what: str):
    """The torch module, imported on first use by ``what`` (a function of this
    package that needs it), or an ImportError saying how to install it."""
    try:
        import torch
    except ImportError as exc:
        raise ImportError(f"{what} needs PyTorch: pip install 'ncdp_fast[torch]'") from exc
    return torch


# Whether CPU torch tensors are the emulated CUDA device's (NCDP_CUDA_EMULATION,
# read by _backend at import; _backend.emulated_cuda switches it for tests).
_EMULATION = False


def set_emulation(enabled: bool) -> bool:
    """Switch the emulated device on or off; returns the previous setting."""
    global _EMULATION
    before, _EMULATION = _EMULATION, bool(enabled)
    return before


def emulation_on() -> bool:
    """Whether CPU torch tensors are the emulated CUDA device's now."""
    return _EMULATION


def is_emulated(x: Any) -> bool:
    """Whether x is an array of the emulated CUDA device (a CPU torch tensor
    while the emulation is on)."""
    return _EMULATION and is_torch(x) and x.device.type == "cpu"


def is_cuda_array(x: Any) -> bool:
    k = kind(x)
    if k == "torch":
        return x.device.type == "cuda" or is_emulated(x)
    return k in ("cupy", "cuda")


def shape(x: Any, name: str, where: str = "") -> tuple[int, ...]:
    """x's shape as ints; a TypeError naming ``name + where`` for what is not
    an array (joined only then: a hot caller passes its parts)."""
    try:
        return tuple(map(int, x.shape))     # map: no generator frame a dimension
    except AttributeError:
        raise TypeError(f"{name}{where}: expected an array (NumPy, torch or CuPy), "
                        f"got {type(x).__name__}") from None
    except RuntimeError:         # torch's nested tensors have no one shape
        raise TypeError(f"{name}{where}: expected a dense array, got a tensor with no single "
                        "shape (a nested tensor)") from None


def describe(x: Any) -> str:
    """The array's library and, for torch, its device (for error messages)."""
    if is_torch(x):
        return f"torch.Tensor on {'the emulated CUDA device' if is_emulated(x) else x.device}"
    return f"{type(x).__module__}.{type(x).__name__}"


# ----------------------------------------------------------------- per-call I/O

ALIGN = 64


def aligned_empty(shape, dtype) -> np.ndarray:
    """np.empty on a 64-byte boundary (NumPy's own is 16): a GEMM writing its
    result into a 16-byte-aligned array ran 10-20% slower (torch's CPU GEMM,
    (3072 x 1024) @ (1024 x 768) on the 2-core AMD EPYC: 25.5-29.3 ms against
    22.9-24.5 ms), and the clip op's results are such GEMMs' outputs."""
    dtype = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64))
    raw = np.empty(n * dtype.itemsize + ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start:start + n * dtype.itemsize].view(dtype).reshape(shape)


class NumpyIO:
    """NumPy arrays (and anything np.asarray takes) on the CPU."""
    lib = "numpy"
    backend = "cpu"
    place = ("numpy", "cpu")

    def to_kernel(self, x):
        return np.ascontiguousarray(x)

    def to_operand(self, x):
        """x for the library's own operations (a linear pair's operands, which
        no launcher of ours reads): as :meth:`to_kernel` here."""
        return self.to_kernel(x)

    def dtype_of(self, x) -> np.dtype:
        return np.asarray(x).dtype if not hasattr(x, "dtype") else np.dtype(x.dtype)

    def empty(self, shape, dtype):
        return aligned_empty(shape, dtype)

    def zeros(self, shape, dtype):
        return np.zeros(shape, dtype=dtype)

    def from_host(self, host):
        return host

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


class TorchCpuIO(NumpyIO):
    """torch CPU tensors: kernels see a zero-copy NumPy view (a copy only when the
    tensor is not C-contiguous); results go back through torch.from_numpy."""
    lib = "torch"
    place = ("torch", "cpu")

    def to_kernel(self, x):
        # resolve_neg: a negative view (torch._neg_view, a conjugate's .imag)
        # has no NumPy view of its values.
        return np.ascontiguousarray(x.detach().resolve_conj().resolve_neg().numpy())

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


class TorchCudaIO:
    """torch CUDA tensors: kernels receive the device pointer and the current stream."""
    lib = "torch"
    backend = "cuda"
    matmul = None            # the CUDA kernels run their own GEMMs

    def __init__(self, device):
        self.device = device
        self.place = ("torch", device.index if device.index is not None else 0)

    def to_kernel(self, x):
        # .contiguous() copies only when the layout is not row-major (documented
        # cost); a tensor outside autograd needs no detached alias (an op each).
        x = x.detach() if x.requires_grad else x
        if x.is_neg():
            # A negative view (torch._neg_view, a conjugate's .imag) stores -x:
            # .contiguous() keeps a row-major one as it is, and a kernel reading
            # its pointer would read the negated values (the eighth audit).
            x = x.resolve_neg()
        return x.contiguous()

    def to_operand(self, x):
        # torch's operations read any strides: a layer's output gradient that
        # autograd hands over transposed (an attention projection's) is read as
        # it is, where a row-major copy cost an op and its bytes (issue 36).
        return x.detach() if x.requires_grad else x

    def dtype_of(self, x):
        return _torch_to_numpy_dtype(x.dtype)

    def empty(self, shape, dtype):
        import torch
        return torch.empty(shape, dtype=_numpy_to_torch_dtype(dtype), device=self.device)

    def zeros(self, shape, dtype):
        import torch
        return torch.zeros(shape, dtype=_numpy_to_torch_dtype(dtype), device=self.device)

    def from_host(self, host):
        import torch
        return torch.from_numpy(np.ascontiguousarray(host)).to(self.device)

    def to_user(self, k):
        return k

    def to_numpy(self, k):
        return k.cpu().numpy()

    def copy(self, k):
        return k.clone()

    def all_finite(self, k) -> bool:
        import torch
        return bool(torch.isfinite(k).all())


class TorchEmulatedIO(TorchCudaIO):
    """CPU torch tensors as the emulated CUDA device's arrays: everything a CUDA
    tensor gets (torch tensors to the adaptors, pointers, workspaces from torch,
    results left on the device), with the host's memory as the device's."""

    def __init__(self):
        import torch
        super().__init__(torch.device("cpu"))
        self.place = ("torch", "emulated")

    def from_host(self, host):
        import torch
        return torch.from_numpy(np.array(host, copy=True, order="C"))

    def to_numpy(self, k):
        # A copy, as a device-to-host transfer is: the caller may keep it while
        # the device array is reused.
        return k.detach().numpy().copy()


class CupyIO:
    lib = "cupy"
    backend = "cuda"
    matmul = None

    def __init__(self, device: int):
        self.device = device
        self.place = ("cupy", device)

    def to_kernel(self, x):
        import cupy
        return cupy.ascontiguousarray(x)

    def to_operand(self, x):
        return self.to_kernel(x)

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

    def from_host(self, host):
        import cupy
        with cupy.cuda.Device(self.device):
            return cupy.asarray(np.ascontiguousarray(host))

    def to_user(self, k):
        return k

    def to_numpy(self, k):
        return k.get()

    def copy(self, k):
        return k.copy()

    def all_finite(self, k) -> bool:
        import cupy
        return bool(cupy.isfinite(k).all())


# The I/O objects hold nothing but their device: one a (device, emulation)
# serves every call (building one cost some 4 us of host time, two dozen times
# a transformer's private step; issue 36).
_IO_OF_PLACE: dict = {}


def io_for(x: Any):
    """The I/O object of x's library and device; a TypeError for arrays no op takes."""
    k = kind(x)
    if k == "torch":
        device = x.device
        io = _IO_OF_PLACE.get((device, _EMULATION))
        if io is not None:
            return io
        if device.type == "cuda":
            io = TorchCudaIO(device)
        elif device.type != "cpu":
            raise TypeError(f"torch tensors on {device} are not supported (CPU or CUDA only)")
        else:
            io = TorchEmulatedIO() if _EMULATION else TorchCpuIO()
        _IO_OF_PLACE[(device, _EMULATION)] = io
        return io
    if k == "cupy":
        return CupyIO(int(x.device.id))
    if k == "cuda":
        raise TypeError(f"{describe(x)}: CUDA arrays are accepted as torch tensors or CuPy arrays")
    return NumpyIO()


def to_numpy(x: Any) -> np.ndarray:
    """A host NumPy array with x's values (a view where x already is one)."""
    if kind(x) == "numpy":
        return np.asarray(x)
    io = io_for(x)
    return np.asarray(io.to_numpy(io.to_kernel(x)))


def to_host(x: Any, name: str, *, dtype=None) -> np.ndarray:
    """A host NumPy copy/view of a NumPy array, torch tensor or CuPy array (optionally cast);
    a TypeError naming ``name`` for what is not an array of those."""
    try:
        a = to_numpy(x)
    except TypeError:
        raise TypeError(f"{name}: expected an array (NumPy, torch or CuPy), "
                        f"got {describe(x)}") from None
    return a if dtype is None else a.astype(dtype, copy=False)


def all_finite(x: Any) -> bool:
    """Whether every element of x (NumPy, torch or CuPy, on its own device) is finite."""
    if is_torch(x):                   # any dtype, any device (bfloat16 has no NumPy view)
        import torch
        return bool(torch.isfinite(x).all())
    io = io_for(x)
    return io.all_finite(io.to_kernel(x))


def numpy_dtype(x: Any) -> np.dtype:
    """x's dtype as NumPy's (torch's bfloat16 and friends, which have none, as |V2 / |V)."""
    # A torch dtype met before is a key of the cache (NumPy's dtypes never
    # are): one look-up for the launches' many asks, no library dispatch.
    found = _NUMPY_OF_TORCH_DTYPE.get(x.dtype)
    if found is not None:
        return found
    return _torch_to_numpy_dtype(x.dtype) if is_torch(x) else np.dtype(x.dtype)


def as_numpy_dtype(dtype: Any) -> np.dtype:
    """A dtype given as NumPy's (or a name) or as torch's, as NumPy's."""
    return _torch_to_numpy_dtype(dtype) if _type_module(dtype) == "torch" else np.dtype(dtype)


_NUMPY_OF_TORCH_DTYPE: dict = {}


def _torch_to_numpy_dtype(tdtype) -> np.dtype:
    found = _NUMPY_OF_TORCH_DTYPE.get(tdtype)
    if found is not None:
        return found
    name = str(tdtype).replace("torch.", "")
    try:
        found = np.dtype(name)
    except TypeError:  # bfloat16 and friends have no NumPy twin
        found = np.dtype("V2") if "16" in name else np.dtype("V")
    _NUMPY_OF_TORCH_DTYPE[tdtype] = found
    return found


_TORCH_OF_NUMPY_DTYPE: dict = {}


def _numpy_to_torch_dtype(dtype):
    if not _TORCH_OF_NUMPY_DTYPE:
        import torch
        _TORCH_OF_NUMPY_DTYPE.update({np.dtype(np.float32): torch.float32,
                                      np.dtype(np.float64): torch.float64,
                                      np.dtype(np.int64): torch.int64,
                                      np.dtype(np.uint8): torch.uint8})
    found = _TORCH_OF_NUMPY_DTYPE.get(dtype)
    return found if found is not None else _TORCH_OF_NUMPY_DTYPE[np.dtype(dtype)]


# ------------------------------------------- CUDA arrays (torch or CuPy) as launches see them

def data_ptr(x) -> int:
    """Device address of a torch tensor or CuPy array."""
    if _KIND_OF_TYPE.get(type(x)) == "torch" or is_torch(x):     # the cache first: every launch
        return x.data_ptr()
    return int(x.__cuda_array_interface__["data"][0])


def is_c_contiguous(x) -> bool:
    """Whether a torch tensor or CuPy array is row-major contiguous (a
    kernel may write it as one run of elements)."""
    return bool(x.is_contiguous() if is_torch(x) else x.flags.c_contiguous)


def same_view(x, y) -> bool:
    """Whether two torch tensors or CuPy arrays are the same elements in the
    same layout: one input handed to several layers (an attention block's q,
    k and v projections), however many tensor objects wrap it."""
    if x is y:
        return True
    if type(x) is not type(y) or tuple(x.shape) != tuple(y.shape) or x.dtype != y.dtype:
        return False
    if is_torch(x):
        return x.device == y.device and x.data_ptr() == y.data_ptr() and x.stride() == y.stride()
    return data_ptr(x) == data_ptr(y) and x.strides == y.strides


_RAW_STREAM: list = []      # [torch's raw current-stream reader or None], once torch is in use


def _raw_stream_reader():
    """torch._C._cuda_getCurrentRawStream where this torch has it, else None;
    looked up on the first CUDA launch, not at every one."""
    if not _RAW_STREAM:
        import torch
        _RAW_STREAM.append(getattr(torch._C, "_cuda_getCurrentRawStream", None))
    return _RAW_STREAM[0]


def current_stream(x) -> int:
    """The caller's current stream on x's device (torch tensor or CuPy array)."""
    if is_torch(x):
        device = x.device
        if device.type == "cpu":
            return 0        # the emulated device: one queue, each launch synchronous
        raw = _raw_stream_reader()
        if raw is not None:
            # The handle itself, as torch's compiled kernels read it: the
            # public call builds a torch.cuda.Stream object first, host time
            # at every launch of a step (issue 36).  A tensor's CUDA device
            # always has its index.
            return int(raw(device.index))
        import torch
        return int(torch.cuda.current_stream(device).cuda_stream)
    import cupy
    # CuPy's current stream is per device; the launch runs on the array's
    # device (the native device guard), so read that device's stream.
    with x.device:
        return int(cupy.cuda.get_current_stream().ptr)


def module_of(x):
    """The NumPy-like namespace of x's library: numpy, torch or cupy (for the few
    element-wise ops and reductions the ops run on the caller's device)."""
    k = kind(x)
    if k == "torch":
        import torch
        return torch
    if k == "cupy":
        import cupy
        return cupy
    return np


# The float64 temporaries a chunked device computation may hold at once.
CHUNK_BYTES = 256 << 20


def sample_chunks(n: int, per_sample_bytes: int, budget: int = CHUNK_BYTES):
    """``(lo, hi)`` ranges covering ``range(n)`` whose temporaries, at
    ``per_sample_bytes`` a sample, stay within ``budget`` (one sample at least)."""
    step = max(1, budget // max(per_sample_bytes, 1))
    return [(lo, min(n, lo + step)) for lo in range(0, n, step)]


def as_float64(x):
    """``x`` in float64 (exact from float32), by x's library (torch or CuPy)."""
    if is_torch(x):
        return x.double()
    import cupy
    return x.astype(cupy.float64, copy=False)


def _float64_of(x):
    if is_torch(x):
        import torch
        return torch.float64
    return np.float64


def sum_float64(x, axis):
    """x summed over ``axis`` in float64, by x's library (torch or CuPy): no
    partial sum overflows or loses bits to the data dtype.  torch copies a
    float32 x whole to float64 first (on the CPU and on a GPU), so the clip
    ops call it only where a data-dtype sum could overflow."""
    return x.sum(axis, dtype=_float64_of(x))


def sum_into(x, axis, out):
    """``out`` = x summed over ``axis`` in x's dtype, by x's library (torch or
    CuPy): one read of x, where :func:`sum_float64` of a float32 x writes and
    reads a float64 copy of it first (the H200 run of 2026-11-30: 84 such
    copies, 1.6 ms of a BERT-base step)."""
    return module_of(x).sum(x, axis, out=out)


def repeat_each(x, n, like):
    """(B * n,) array of x's library: each x[i] n times in a row, rounded once
    to the dtype of ``like`` (an array of that library), one copy kernel."""
    B = x.shape[0]
    if is_torch(x):
        import torch
        out = torch.empty((B, n), dtype=like.dtype, device=x.device)
        out.copy_(x[:, None].expand(B, n))
        return out.reshape(B * n)
    out = module_of(x).empty((B, n), dtype=like.dtype)
    out[...] = x[:, None]
    return out.reshape(B * n)


def cat_float64(parts):
    """The arrays of ``parts`` (one library, one device, equal trailing shapes)
    joined along axis 0 into one new float64 array, each cast inside the copy
    (float32 values exactly)."""
    if is_torch(parts[0]):
        import torch
        n = sum(int(p.shape[0]) for p in parts)
        out = torch.empty((n, *parts[0].shape[1:]), dtype=torch.float64, device=parts[0].device)
        return torch.cat(parts, 0, out=out)
    return module_of(parts[0]).concatenate(parts, axis=0, dtype=np.float64)


def cat_rows(parts):
    """Arrays of one library, device and dtype with equal trailing shapes,
    joined along axis 0 into one new array."""
    if is_torch(parts[0]):
        import torch
        return torch.cat(parts, 0)
    return module_of(parts[0]).concatenate(parts, axis=0)


def cat_columns(parts):
    """2-D arrays of one library, device and dtype, (B, p_k) each, side by side
    into one new (B, sum p_k) array."""
    if is_torch(parts[0]):
        import torch
        return torch.cat(parts, 1)
    return module_of(parts[0]).concatenate(parts, axis=1)


def split_sizes(x, sizes):
    """Views of consecutive pieces of a 1-D array of any device library, of
    lengths ``sizes`` (summing to its length): one library call for all of
    them, where a slice each was an operator each (issue 36's host time)."""
    if is_torch(x):
        # The method itself: Tensor.split's Python wrapper cost 5 us against
        # 2 on the 2-core VM (issue 36's host time).
        return x.split_with_sizes(list(sizes))
    cuts = np.cumsum(sizes[:-1], dtype=np.int64).tolist()
    return module_of(x).split(x, cuts)


def byte_range(x) -> tuple[int, int]:
    """(first byte, one past the last) of a C-contiguous array of any library."""
    k = kind(x)
    if k == "numpy":
        start = np.asarray(x).ctypes.data
        return start, start + np.asarray(x).nbytes
    start = data_ptr(x)
    n = x.numel() * x.element_size() if k == "torch" else x.nbytes
    return start, start + n


def assign(out, x):
    """out[...] = x, in place, by out's library (torch or CuPy): for a torch
    tensor one ``copy_`` (indexing's ``out[...] = x`` dispatches more ops, each
    host time on a device, issue 36)."""
    if is_torch(out):
        out.copy_(x)
    else:
        out[...] = x


def bmm(x, y):
    """x @ y for 3-D x (n, p, q) and y (n, q, r) of one library: torch.bmm
    directly for tensors (``@`` decomposes into expands and views first, five
    more ops of host time each, issue 36), ``@`` for CuPy."""
    if is_torch(x):
        import torch
        return torch.bmm(x, y)
    return x @ y


def scale_rows(x, f):
    """x[i] * f[i] for x (B, ...) in its dtype and f (B,) float64: each product
    formed in float64 and rounded once (the numba twin's ``_scale_rows``,
    value for value), without a float64 copy of x on a device (torch and
    CuPy cast inside the element-wise kernel)."""
    shape = (-1,) + (1,) * (len(x.shape) - 1)
    if is_torch(x):
        import torch
        # Row-major whatever x's strides (empty_like would keep a transposed
        # layout, which the GEMM's reshape would then copy).
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        return torch.mul(x, f.reshape(shape), out=out)
    import cupy
    return cupy.multiply(x, f.reshape(shape), out=cupy.empty_like(x), casting="same_kind")


def row_max_abs(x):
    """max |x[i]| over each sample's values, float64: x (B, ...) -> (B,); 0 for
    samples of no values."""
    flat = x.reshape(x.shape[0], int(np.prod(x.shape[1:], dtype=np.int64)))
    if flat.shape[1] == 0:
        return module_of(x).zeros(x.shape[0], dtype=_float64_of(x))
    if is_torch(x):
        import torch
        # ord=inf reduces |x| inside the reduction: no copy of |x|
        return torch.linalg.vector_norm(flat, float("inf"), dim=1).double()
    return abs(flat).max(axis=1).astype(np.float64)


def times_pow2(x, k):
    """x * 2^k exactly (ldexp) for float64 x and integer-valued float64 k of
    any size a product can need: 2^k is built from its exponent bits in two
    halves, so no factor leaves float64's normal range."""
    h = (k * 0.5).floor() if is_torch(k) else module_of(k).floor(k * 0.5)
    return x * _pow2(h) * _pow2(k - h)


def _pow2(k):
    """2^k for integer-valued float64 k in [-1022, 1023], from the exponent bits."""
    if is_torch(k):
        import torch
        return ((k.to(torch.int64) + 1023) << 52).view(torch.float64)
    return ((k.astype(np.int64) + 1023) << 52).view(np.float64)
