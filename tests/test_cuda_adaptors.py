"""The CUDA adaptors (``ncdp_fast._cuda.*``) without a GPU: what they hand to
``_C``, observed through recording fakes of ``_C`` and of CuPy, and the native
wrapper's argument validation (which runs before any CUDA call)."""
from __future__ import annotations

import copy
import sys
import types

import numpy as np
import pytest

from ncdp_fast import _arrays, _backend
from ncdp_fast._cuda import _common
from ncdp_fast._cuda import clip as cuda_clip
from ncdp_fast._cuda import ntk as cuda_ntk


class _Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, *args, **kwargs):
        self.calls.append((args, kwargs))


# ---------------------------------------------------------------- NTK Gram terms

def _recorded_gram_call(monkeypatch, f, b, f2, b2, out, symmetric):
    launch = _Recorder()
    monkeypatch.setattr(cuda_ntk, "native", lambda x: types.SimpleNamespace(
        launch_hadamard_gram=launch))
    monkeypatch.setattr(cuda_ntk, "stream", lambda x: 0)
    # The tiled kernel's adaptor (the GEMM route, hadamard_gram, launches nothing
    # of ours: tests/test_device_ntk.py holds its zero-width terms).
    cuda_ntk.tiled_kernel_gram(f, b, f2, b2, out, symmetric)
    assert len(launch.calls) == 1
    return launch.calls[0]


def test_gram_tells_a_width_zero_factor_from_the_constant_one(monkeypatch):
    torch = pytest.importorskip("torch")
    n = 4
    empty = torch.empty(n, 0, dtype=torch.float64)
    # The ambiguity of issue 14: an empty tensor's pointer is the null pointer.
    assert empty.data_ptr() == 0
    B = torch.ones(n, 3, dtype=torch.float64)
    out = torch.empty(n, n, dtype=torch.float64)
    # Term 0 adds (F F^T) o (B B^T) = 0; term 1 (bias) adds B B^T.
    args, kwargs = _recorded_gram_call(monkeypatch, [empty, None], [B, B], [empty, None], [B, B],
                                       out, True)
    per_term = [v for v in (*args, *kwargs.values()) if isinstance(v, list) and len(v) == 2]
    encodings = [tuple(v[l] for v in per_term) for l in range(2)]
    assert encodings[0] != encodings[1], (
        "the launcher cannot tell an F of width 0 (a zero term) from the constant-1 factor "
        f"(a term adding B B'^T): both reach it as {encodings[0]}")


def test_gram_term_args_flag_the_constant_one_explicitly():
    torch = pytest.importorskip("torch")
    n, n2 = 4, 3
    F, F2 = torch.ones(n, 2), torch.ones(n2, 2)
    E, E2 = torch.empty(n, 0), torch.empty(n2, 0)
    B, B2 = torch.ones(n, 5), torch.ones(n2, 5)
    args = cuda_ntk.gram_term_args([F, E, None], [B, B, B], [F2, E2, None], [B2, B2, B2])
    assert args == {"f": [F.data_ptr(), 0, 0], "a": [2, 0, 0],
                    "constant_one": [False, False, True],
                    "b_ptrs": [B.data_ptr()] * 3, "b": [5, 5, 5],
                    "f2": [F2.data_ptr(), 0, 0], "b2_ptrs": [B2.data_ptr()] * 3}


def test_gram_term_args_need_f2_none_exactly_with_f():
    torch = pytest.importorskip("torch")
    B = torch.ones(3, 2)
    with pytest.raises(ValueError, match=r"f2\[0\]: expected None exactly where f\[0\]"):
        cuda_ntk.gram_term_args([None], [B], [torch.ones(3, 1)], [B])


@pytest.fixture
def native():
    if not _backend.CUDA_COMPILED:
        pytest.skip("ncdp_fast._C was built without CUDA")
    return _backend._C


def _gram_kwargs(**changes):
    # One bias term on fake (aligned, never dereferenced) device pointers: the
    # validation under test raises before the wrapper asks CUDA anything.
    kwargs = dict(f=[0], a=[0], constant_one=[True], b_ptrs=[4096], b=[3], f2=[0],
                  b2_ptrs=[4096], n=2, n2=2, dtype=1, symmetric=True, accumulate_f64=False,
                  out=8192, out_dtype=1, stream=0)
    kwargs.update(changes)
    return kwargs


def test_native_gram_refuses_data_for_a_constant_one_factor(native):
    with pytest.raises(ValueError, match=r"constant_one\[0\] is set.*got 0x100, 0x100 and 0"):
        native.launch_hadamard_gram(**_gram_kwargs(f=[256], f2=[256]))
    with pytest.raises(ValueError, match=r"constant_one\[0\] is set.*and 2"):
        native.launch_hadamard_gram(**_gram_kwargs(a=[2]))


def test_native_gram_refuses_a_null_pointer_for_a_non_empty_factor(native):
    with pytest.raises(ValueError, match=r"f\[0\] is a null pointer but the buffer is not empty"):
        native.launch_hadamard_gram(**_gram_kwargs(constant_one=[False], a=[2]))


def test_native_gram_needs_one_flag_per_term(native):
    with pytest.raises(ValueError, match="constant_one has 0 entries, f has 1"):
        native.launch_hadamard_gram(**_gram_kwargs(constant_one=[]))


def test_native_clip_factors_validates_the_rule(native):
    # Checked before any CUDA call, so these run without a GPU.
    args = dict(sq=0, spread=0, groups=1, B=0, max_norm=[1.0], terms=[3], seq_len=[1],
                unit=2.0 ** -24, out=0, stride=0, stream=0)
    native.launch_clip_factor_groups(**args)  # B = 0: nothing to do
    native.launch_clip_factor_groups(**dict(args, groups=0, max_norm=[], terms=[], seq_len=[]))
    # seq_len 0 (a sequence block with no positions) is valid, as on the CPU path.
    native.launch_clip_factor_groups(**dict(args, seq_len=[0]))
    with pytest.raises(ValueError, match="seq_len must be non-negative, got -1"):
        native.launch_clip_factor_groups(**dict(args, seq_len=[-1]))
    with pytest.raises(ValueError, match="unit must be a unit roundoff in"):
        native.launch_clip_factor_groups(**dict(args, unit=1.0))
    with pytest.raises(ValueError, match="terms must be non-negative, got -1"):
        native.launch_clip_factor_groups(**dict(args, terms=[-1]))
    with pytest.raises(ValueError, match="one entry a group \\(2\\), got 1, 2 and 2"):
        native.launch_clip_factor_groups(**dict(args, groups=2, terms=[3, 3], seq_len=[1, 1]))
    with pytest.raises(ValueError, match="stride must be at least 2 B = 4, got 3"):
        native.launch_clip_factor_groups(**dict(args, B=2, stride=3))
    with pytest.raises(ValueError, match="sq is a null pointer but the buffer is not empty"):
        native.launch_clip_factor_groups(**dict(args, B=2, stride=4))


def test_native_linear_sq_norms_forms_sizes_at_rank_one_only(native):
    # Checked before any CUDA call, so these run without a GPU.
    args = dict(a=4096, g=8192, B=2, T=3, d=4, K=5, dtype=1, bias=True, sq=16384,
                accumulate=False, stream=0)
    with pytest.raises(ValueError, match="sizes: formed at T = 1 only .*got T = 3"):
        native.launch_linear_sq_norms(**dict(args, sizes=32768))
    with pytest.raises(ValueError, match="sizes is not aligned to 8 bytes"):
        native.launch_linear_sq_norms(**dict(args, T=1, sizes=32772))
    native.launch_linear_sq_norms(**dict(args, B=0, a=0, g=0, sq=0, T=1, sizes=32768))


def test_native_linear_norms_from_grams_validates_its_buffers(native):
    # Checked before any CUDA call, so these run without a GPU.
    needed = native.linear_norms_from_grams_workspace_bytes(2, 2, 3)
    assert needed >= 2 * 2 * 6 * 8          # 6 float64 partials a sample and slice
    args = dict(w=4096, v=8192, B=2, layers=2, T=3, bias=True, shared_w=False, gram_dtype=1,
                w_length=0, v_length=0, sq=16384, accumulate=False,
                spread=0, sizes=0, workspace=32768, workspace_bytes=needed, stream=0)
    native.launch_linear_norms_from_grams(**dict(args, B=0, sq=0))   # no samples: nothing
    with pytest.raises(ValueError, match="layers must be non-negative, got -1"):
        native.launch_linear_norms_from_grams(**dict(args, layers=-1))
    with pytest.raises(ValueError, match="T must be non-negative, got -2"):
        native.linear_norms_from_grams_workspace_bytes(2, 2, -2)
    with pytest.raises(ValueError, match="w is a null pointer but the buffer is not empty"):
        native.launch_linear_norms_from_grams(**dict(args, w=0))
    with pytest.raises(ValueError, match="sq is a null pointer but the buffer is not empty"):
        native.launch_linear_norms_from_grams(**dict(args, sq=0))
    with pytest.raises(ValueError, match="sizes is not aligned to 8 bytes"):
        native.launch_linear_norms_from_grams(**dict(args, sizes=4100))
    with pytest.raises(ValueError, match=f"linear_norms_from_grams needs {needed} workspace"):
        native.launch_linear_norms_from_grams(**dict(args, workspace_bytes=needed - 8))
    with pytest.raises(ValueError, match="layers \\* B \\* T \\* T"):
        native.launch_linear_norms_from_grams(**dict(args, T=2 ** 31))
    # float32 Grams: 4-byte alignment, and dot lengths inside the rounding model.
    f32 = dict(args, gram_dtype=0, w_length=5, v_length=7)
    with pytest.raises(ValueError, match="dtype must be 0 \\(float32\\) or 1 \\(float64\\), got 2"):
        native.launch_linear_norms_from_grams(**dict(f32, gram_dtype=2))
    with pytest.raises(ValueError, match="w_length: expected a float32 Gram's dot length in "
                                         "\\[1, 1048576\\], got 0"):
        native.launch_linear_norms_from_grams(**dict(f32, w_length=0))
    with pytest.raises(ValueError, match="v_length: expected .* got 1048577"):
        native.launch_linear_norms_from_grams(**dict(f32, v_length=2 ** 20 + 1))
    with pytest.raises(ValueError, match="v is not aligned to 4 bytes"):
        native.launch_linear_norms_from_grams(**dict(f32, v=8194))
    with pytest.raises(ValueError, match="v is not aligned to 8 bytes"):
        native.launch_linear_norms_from_grams(**dict(args, v=8196))


def _segments_kwargs(**changes):
    # Two segments on fake (aligned, never dereferenced) device pointers: the
    # validation under test raises before the wrapper asks CUDA anything.
    kwargs = dict(dst=[4096, 8192], src=[4096, 16384], count=[3, 2], offset=[0, 3],
                  src_dtype=[0, 1], dst_dtype=[0, 0], seed=1, scale=1.0, post=1.0, stream=0)
    kwargs.update(changes)
    return kwargs


def test_native_finish_gaussian_segments_validates_every_segment(native):
    # Nothing to finish: no CUDA call, whatever the pointers.
    native.launch_finish_gaussian_segments(**_segments_kwargs(count=[0, 0]))
    native.launch_finish_gaussian_segments(**_segments_kwargs(
        dst=[], src=[], count=[], offset=[], src_dtype=[], dst_dtype=[]))
    with pytest.raises(ValueError, match="one entry a segment, got 2, 1, 2, 2, 2 and 2"):
        native.launch_finish_gaussian_segments(**_segments_kwargs(src=[4096]))
    with pytest.raises(ValueError, match=r"segment 1: \(src_dtype, dst_dtype\) must be "
                                         r"\(0, 0\), \(1, 1\) or \(1, 0\), got \(0, 1\)"):
        native.launch_finish_gaussian_segments(**_segments_kwargs(src_dtype=[0, 0],
                                                                  dst_dtype=[0, 1]))
    with pytest.raises(ValueError, match="dtype must be 0 .float32. or 1 .float64., got 2"):
        native.launch_finish_gaussian_segments(**_segments_kwargs(src_dtype=[0, 2]))
    with pytest.raises(ValueError, match="count must be non-negative, got -1"):
        native.launch_finish_gaussian_segments(**_segments_kwargs(count=[3, -1]))
    with pytest.raises(ValueError, match="src is a null pointer but the buffer is not empty"):
        native.launch_finish_gaussian_segments(**_segments_kwargs(src=[4096, 0]))
    with pytest.raises(ValueError, match="src is not aligned to 8 bytes"):
        native.launch_finish_gaussian_segments(**_segments_kwargs(src=[4096, 4100]))
    with pytest.raises(ValueError, match="segment 1: an in-place finish .src == dst. needs one"):
        native.launch_finish_gaussian_segments(**_segments_kwargs(src=[4096, 8192]))


def test_native_weighted_row_sum_refuses_an_output_dtype_it_cannot_write(native):
    # float64 rows into float32: only the data dtype or float64 (the sum before
    # its finish) can be written; refused before any CUDA call.
    args = dict(g=4096, B=2, p=3, dtype=1, factors=8192, noise_std=0.0, inv_denom=1.0, seed=1,
                offset=0, out=16384, workspace=0, workspace_bytes=0, stream=0)
    needed = native.weighted_row_sum_workspace_bytes(2, 3, 1)
    with pytest.raises(ValueError, match="out_dtype must be -1, dtype or 1 .float64., got 0"):
        native.launch_weighted_row_sum_noise(**dict(args, workspace=32768,
                                                    workspace_bytes=needed), out_dtype=0)
    with pytest.raises(ValueError, match="out_dtype must be -1, dtype or 1 .float64., got 7"):
        native.launch_weighted_row_sum_noise(**dict(args, dtype=0, workspace=32768,
                                                    workspace_bytes=needed), out_dtype=7)


# ------------------------------------------------------------- CuPy streams

class _FakeDevice:
    """cupy.cuda.Device: a context manager that makes its device current."""

    def __init__(self, cupy, device_id):
        self._cupy = cupy
        self.id = device_id

    def __enter__(self):
        self._cupy.previous.append(self._cupy.current)
        self._cupy.current = self.id
        return self

    def __exit__(self, *exc):
        self._cupy.current = self._cupy.previous.pop()


def _fake_cupy():
    """A cupy whose current device is `current` and whose stream of device d
    has ptr 1000 + d; `reads` records whose stream each read returned."""
    cupy = types.ModuleType("cupy")
    cupy.current, cupy.previous, cupy.reads = 0, [], []
    cuda = types.ModuleType("cupy.cuda")

    def get_current_stream(device_id=-1):
        device = cupy.current if device_id == -1 else device_id
        cupy.reads.append(device)
        return types.SimpleNamespace(ptr=1000 + device)

    cuda.get_current_stream = get_current_stream
    cuda.Device = lambda device_id=None: _FakeDevice(
        cupy, cupy.current if device_id is None else device_id)
    cupy.cuda = cuda
    return cupy


class _FakeCupyArray:
    def __init__(self, cupy, device_id, shape, dtype):
        self.device = _FakeDevice(cupy, device_id)
        self.shape = shape
        self.dtype = np.dtype(dtype)
        self.__cuda_array_interface__ = {"data": (4096 * (device_id + 1), False),
                                         "shape": shape, "typestr": self.dtype.str,
                                         "version": 3}


@pytest.fixture
def fake_cupy(monkeypatch):
    cupy = _fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupy.cuda", cupy.cuda)
    return cupy


def test_stream_of_a_cupy_array_is_its_devices(fake_cupy):
    x = _FakeCupyArray(fake_cupy, 1, (2, 3), np.float32)
    assert fake_cupy.current == 0
    assert _common.stream(x) == 1001, f"read the stream of device(s) {fake_cupy.reads}, not 1"
    assert fake_cupy.reads == [1]
    assert fake_cupy.current == 0, "the caller's current device must be left as it was"


def test_cupy_launch_gets_the_stream_of_the_arrays_device(fake_cupy, monkeypatch):
    launch = _Recorder()
    monkeypatch.setattr(cuda_clip, "native", lambda x: types.SimpleNamespace(
        launch_row_sq_norms=launch))
    g = _FakeCupyArray(fake_cupy, 2, (4, 5), np.float64)
    sq = _FakeCupyArray(fake_cupy, 2, (4,), np.float64)
    cuda_clip.row_sq_norms(g, sq, False)
    (args, _), = launch.calls
    assert args[-1] == 1002


def test_cupy_stream_is_its_devices_whatever_device_is_current(fake_cupy):
    # The one stream reader (_arrays.current_stream; the I/O objects' own
    # copies are gone), with a current device that is neither 0 nor the array's.
    fake_cupy.current = 2
    x = _FakeCupyArray(fake_cupy, 3, (1,), np.float32)
    assert _arrays.current_stream(x) == 1003, f"read the stream of device(s) {fake_cupy.reads}, not 3"
    assert fake_cupy.current == 2


# ----------------------------------------------------------- which device an op runs on

def test_backend_select_tells_a_device_from_a_library(monkeypatch):
    """Two arrays of one library on two devices: ValueError (a wrong value of the
    right type, as torch's own device check); of two libraries: TypeError. The
    places are forced, so this runs without two devices."""
    torch = pytest.importorskip("torch")
    a, b = torch.ones(3, 4), torch.ones(3, 2)
    forced = {id(a): ("torch", 0), id(b): ("torch", 1)}
    real = _arrays.io_for

    def io_for(x):
        io = copy.copy(real(x))       # io_for's objects are shared: force a copy's place
        io.place = forced.get(id(x), io.place)
        return io
    monkeypatch.setattr(_arrays, "io_for", io_for)
    # The forced places are io_for's: select's shortcut for tensors of one
    # torch device (which these two really are) is taken out.
    monkeypatch.setattr(_backend, "_same_tensor_place", lambda x, device: False)
    with pytest.raises(ValueError, match="backprops and activations must be on the same device"):
        _backend.select("clip", activations=a, backprops=b)
    with pytest.raises(TypeError, match="backprops and activations must be on the same device "
                       "and of the same array library: got numpy.ndarray"):
        _backend.select("clip", activations=a, backprops=np.ones((3, 2)))


def test_cpu_tensors_take_the_cpu_path_outside_the_gpu_tests():
    """make test sets NCDP_CUDA_EMULATION=1 for the gpu tests alone: every other
    test, and every process a test starts, sees plain CPU tensors (pytest
    imports ncdp_fast before conftest runs, to read pyproject's warning filter)."""
    torch = pytest.importorskip("torch")
    import os
    assert "NCDP_CUDA_EMULATION" not in os.environ
    assert _arrays.io_for(torch.ones(2)).backend == "cpu"
    assert not _arrays.is_emulated(torch.ones(2))


class _FakeCudaTensor:
    """What current_stream reads of a torch tensor on CUDA device 2: its
    type's module says torch, its device says cuda:2."""
    __module__ = "torch.fake"

    def __init__(self):
        import torch
        self.device = torch.device("cuda", 2)


def test_stream_of_a_cuda_tensor_is_its_devices_raw_stream(monkeypatch):
    """The launches' stream of a CUDA tensor: torch's raw current stream of the
    tensor's device (no Stream object a launch), or, where this torch has no
    such call, the public current_stream's handle; never another device's."""
    torch = pytest.importorskip("torch")
    x = _FakeCudaTensor()
    asked = []

    def raw(index):
        asked.append(index)
        return 1000 + index
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", raw, raising=False)
    monkeypatch.setattr(_arrays, "_RAW_STREAM", [])        # looked up again: found
    assert _arrays.current_stream(x) == 1002 and asked == [2]
    monkeypatch.delattr(torch._C, "_cuda_getCurrentRawStream")
    monkeypatch.setattr(_arrays, "_RAW_STREAM", [])        # looked up again: absent
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device: types.SimpleNamespace(cuda_stream=2000 + device.index))
    assert _arrays.current_stream(x) == 2002
