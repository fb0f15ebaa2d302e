"""Per-sample float64 Grams of float32 rows on a device (csrc/clip/gram_f64.cu),
the Gram route of the linear norms without float64 copies of a and g.

:func:`grams_f64` is the route's one entry: the kernel where it applies (float32
rows, read as they lie where their last axis is contiguous, else from a
row-major copy, on a device whose kernel passed its check), else the float64
copies and the vendor's batched GEMM, as before."""
from __future__ import annotations

import contextlib
import math
import warnings

import numpy as np

from .. import _arrays
from ._common import native, ptr, stream, workspace

_F32 = np.dtype(np.float32)
_MAX_SOURCES = 8            # kernels::kMaxGramSources
_CHECKED: dict = {}         # device -> whether its kernel passed the check
_ENABLED = [True]


@contextlib.contextmanager
def copies_route():
    """The float64 copies and batched GEMM for every Gram inside the block
    (bench_linear_norms times both routes on one GPU)."""
    _ENABLED.append(False)
    try:
        yield
    finally:
        _ENABLED.pop()


def _layout(x):
    """(sample stride, row stride) in elements of a (B, T, d) float32 array the
    kernel reads as it lies (values along the last axis contiguous, rows at
    least d apart), or None. Strides that index nothing (one sample, one row,
    no values) are a dense layout's: empty arrays carry any strides."""
    if len(x.shape) != 3 or _arrays.numpy_dtype(x) != _F32:
        return None
    B, T, d = x.shape
    if B * T * d == 0:
        return T * d, d
    s0, s1, s2 = x.stride() if _arrays.is_torch(x) else (s // x.itemsize for s in x.strides)
    if not ((d == 1 or s2 == 1) and (T == 1 or s1 >= d) and (B == 1 or s0 >= 0)):
        return None
    return (s0 if B > 1 else T * d), (s1 if T > 1 else d)


def plan(parts):
    """Every part's layout, or None for a float32 part whose last axis is not
    contiguous (a transposed view: attention's key gradient, a convolution's
    columns), which the kernel reads from a row-major copy; None where the
    kernel does not take ``parts`` (float64 data, the bench's switch, a
    device that failed its check).  A caller that asks :func:`sample_bytes`
    first hands the same plan to :func:`grams_f64` (a BERT-base step forms
    some 150 parts' Grams)."""
    if not (_ENABLED[-1] and parts):
        return None
    layouts = []
    for x in parts:
        lay = _layout(x)
        if lay is None and (len(x.shape) != 3 or _arrays.numpy_dtype(x) != _F32):
            return None
        layouts.append(lay)
    return layouts if _checked(parts[0]) else None


def applies(parts) -> bool:
    """Whether :func:`grams_f64` takes the kernel for ``parts``."""
    return plan(parts) is not None


_ASK = object()     # no plan given: grams_f64 and sample_bytes form their own


def sample_bytes(parts, route=_ASK):
    """(bytes, kernel): the bytes a sample of each of ``parts`` (L arrays (B,
    T, d)) holds while ``grams_f64(parts)`` forms their Grams -- its float64
    Gram, and on the kernel's route a row-major float32 copy of a part the
    kernel cannot read as it lies, else (the copies' route) a float64 copy --
    and whether the kernel's route takes them (one plan for all: the host's
    cost of a group's accounting is one call; ``route``: :func:`plan`'s of
    ``parts``, where the caller has it).  The k-ranges' partial Grams
    of a split launch are not counted: a range per resident block of the
    target at most, each a tile's share of its sample's Gram, under 26 MB on
    any shape."""
    route = plan(parts) if route is _ASK else route
    sizes = []
    for i, x in enumerate(parts):
        _, T, d = x.shape
        if route is None:
            sizes.append(8 * (T * d + T * T))
        else:
            sizes.append(8 * T * T + (4 * T * d if route[i] is None else 0))
    return sizes, route is not None


def _launch(parts, layouts, out):
    """out (len(parts) B, T, T) float64 = the parts' Grams, sources in order."""
    B, T, d = parts[0].shape
    C = native(out)
    for lo in range(0, len(parts), _MAX_SOURCES):
        hi = min(lo + _MAX_SOURCES, len(parts))
        # A launch of few (sample, tile) jobs splits d into ranges whose
        # partial Grams need room (gram_f64.cu); held until queued.
        nbytes = C.gram_rows_f64_workspace_bytes(hi - lo, B, T, d)
        ws, ws_ptr = workspace(out, nbytes)
        C.launch_gram_rows_f64([ptr(x) for x in parts[lo:hi]],
                               [lay[0] for lay in layouts[lo:hi]],
                               [lay[1] for lay in layouts[lo:hi]], B, T, d,
                               ptr(out[lo * B:hi * B]), ws_ptr, nbytes, stream(out))


def grams_f64(parts, route=_ASK):
    """(L B, T, T) float64 Grams ``X_i X_i^T`` of the samples of ``parts`` (L
    arrays (B, T, d) of one dtype and device), part by part: each entry a
    float64 sum of exact products (reference.gram_rows_f64, within gamma_d of
    the sum of |products| in any order).  ``route``: :func:`plan`'s of
    ``parts``, where the caller has it."""
    layouts = plan(parts) if route is _ASK else (None if route is None else list(route))
    if layouts is not None:
        # A transposed float32 part is copied row-major (4 bytes a value
        # written and read) for the kernel: the copies route wrote and read
        # 8 of every part's values and formed whole Grams (BERT-base: the
        # query, key and value gradients of each layer, the key's
        # transposed, were 0.14 ms a layer that way by bench/device_model.py).
        parts = list(parts)
        for i, lay in enumerate(layouts):
            if lay is None:
                parts[i] = _arrays.io_for(parts[i]).to_kernel(parts[i])
                layouts[i] = _layout(parts[i])
        B, T, _ = parts[0].shape
        out = _arrays.io_for(parts[0]).empty((len(parts) * B, T, T), np.float64)
        _launch(parts, layouts, out)
        return out
    x = _arrays.as_float64(parts[0]) if len(parts) == 1 else _arrays.cat_float64(parts)
    return _arrays.bmm(x, x.swapaxes(1, 2))


def _check_rows(xp, like):
    """A fixed (3, 70, 37) float32 input of full mantissas (no random stream:
    it is a test of the device, not noise): two tiles of positions, a
    diagonal and an off-diagonal one, and a partial staging step."""
    i = np.arange(3 * 70 * 37, dtype=np.float64).reshape(3, 70, 37)
    host = (np.sin(1.7 * i + 0.3) * (1.0 + (i % 7))).astype(np.float32)
    if _arrays.is_torch(like):
        import torch
        return torch.as_tensor(host, device=like.device)
    return xp.asarray(host)


def _checked(like) -> bool:
    """Whether the kernel passed :func:`_check` on like's device, asked once a
    device (one host wait, the first time a process forms a Gram there): its
    tensor-core fragments are read as PTX lays them out, which only the
    hardware can confirm. A failed device gets a warning and the copies route
    (its norms stay exact)."""
    if _arrays.is_emulated(like):
        return True         # the emulation tier checks the same source
    key = str(like.device) if _arrays.is_torch(like) else f"cupy:{int(like.device.id)}"
    if key not in _CHECKED:
        _CHECKED[key] = _verdict(key, _check(like))
    return _CHECKED[key]


def _check(like) -> bool:
    """The kernel's Grams of a fixed input on like's device against the float64
    GEMM's, both within gamma_37 of the sum of |products|: 2 gamma apart."""
    x = _check_rows(_arrays.module_of(like), like)
    got = _arrays.io_for(x).empty((3, 70, 70), np.float64)
    _launch([x], [_layout(x)], got)
    x64 = _arrays.as_float64(x)
    want = _arrays.bmm(x64, x64.swapaxes(1, 2))
    mags = _arrays.bmm(abs(x64), abs(x64).swapaxes(1, 2))
    gamma = 37 * 2.0 ** -53 / (1 - 37 * 2.0 ** -53)
    return bool((abs(got - want) <= 2 * gamma * mags).all())


def _verdict(key: str, ok: bool) -> bool:
    if not ok:
        warnings.warn(f"ncdp_fast: the float64 Gram kernel gave a wrong answer on {key}; its "
                      "per-sample norms use float64 copies and the vendor's GEMM instead "
                      "(please report this device)", RuntimeWarning, stacklevel=4)
    return ok


# The kernel's rate, measured: the H200 profile of 2026-11-30 (BERT-base,
# B 32, T 128) timed 99 launches at 7.76 ms for 130 GFLOP of tiles, 16.8
# TFLOP/s, each launch of 96 jobs or so before the k-ranges: one block on
# each of 96 SMs.  The models (bench/report.py, bench/device_model.py) charge
# a busy SM this rate and no more, however many of its blocks are resident: a
# prediction that the k-ranges fill the SMs a launch left idle and gain
# nothing from a second block an SM (the lower bound of the gain).
MODEL_FLOPS_PER_SM_S = 16.8e12 / 96
TARGET_SMS = 132                # launch_config.h kTargetSMs
_BLOCKS_PER_SM = 3              # gram_f64.cu kGramBlocksPerSm
_TILE, _DEPTH, _MIN_SPLIT = 64, 16, 256     # kGramTile, kGramDepth, kGramMinSplitDepth
_MAX_RANGE = 1 << 30                        # kGramMaxRangeDepth


def split(jobs: int, d: int):
    """(ranges, depth): the launch's k-ranges of ``jobs`` (sample, tile) pairs
    of d values, as gram_f64.cu's gram_rows_f64_split (tests/test_gram_f64.py
    holds the two together through the workspace each asks for)."""
    want = min(TARGET_SMS * _BLOCKS_PER_SM // jobs, d // _MIN_SPLIT) if jobs > 0 else 1
    want = max(want, _ceil_div(d, _MAX_RANGE))
    if want <= 1:
        return 1, max(d, 0)
    depth = _ceil_div(_ceil_div(d, want), _DEPTH) * _DEPTH
    return _ceil_div(d, depth), depth


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def jobs(count, n, T) -> int:
    """The (sample, upper-triangle tile) jobs of a launch of ``count`` sources
    of n samples of T rows."""
    nt = _ceil_div(T, _TILE)
    return count * n * nt * (nt + 1) // 2


def launch_seconds(count, n, T, d) -> float:
    """The model's time of one launch of ``count`` sources of n samples: its
    tiles' tensor-core FLOPs (:func:`flops`) at MODEL_FLOPS_PER_SM_S on each
    SM that holds a block (at most TARGET_SMS)."""
    launch_jobs = jobs(count, n, T)
    ranges, _ = split(launch_jobs, d)
    busy = min(TARGET_SMS, ranges * launch_jobs)
    return flops(count * n, T, d) / (MODEL_FLOPS_PER_SM_S * max(busy, 1))


def flops(n, T, d) -> float:
    """Tensor-core FLOPs of one launch's n samples (bench/device_model.py): the
    upper triangle of 64 x 64 tiles, each warp's 32 x 16 block 2 * 32 * 16 * d
    where its rows and columns start below T (a warp wholly past T skips its
    products)."""
    nt = math.ceil(T / 64)
    # Live warps of a tile: rows start below T in 2 blocks of 32, columns in
    # 4 of 16, counted over the tile row (ti) and tile column (tj) edges.
    rows = [sum(64 * t + r < T for r in (0, 32)) for t in range(nt)]
    cols = [sum(64 * t + c < T for c in (0, 16, 32, 48)) for t in range(nt)]
    live = sum(rows[i] * cols[j] for i in range(nt) for j in range(i, nt))
    return n * live * 2.0 * 32 * 16 * d
