"""The shared Philox4x32-10 stream as a public op (DESIGN.md, "Random numbers")."""
from __future__ import annotations

import numpy as np

from . import _arrays, _backend
from ._validate import check_draw_range, check_int, check_uint64
# The largest |z| gaussian (and every noisy op) can produce before rounding to
# the output dtype: sqrt(-2 ln 2^-129) ~ 13.37 (the least Box-Muller radius uniform).
from .reference.rng import GAUSSIAN_TAIL_BOUND  # noqa: F401


def gaussian(count, *, seed, offset=0, dtype=np.float32, like=None):
    """The stream's normals ``offset .. offset+count-1`` for key ``seed``.

    Exactly the variates every noisy op of ncdp_fast adds (see
    :mod:`ncdp_fast.reference` for the formula): an op called with
    ``(seed, offset)`` that consumes ``p`` draws adds ``scale * gaussian(p,
    seed=seed, offset=offset)``.  Backends agree with it to one float32 ulp,
    and the CPU and CUDA kernels with each other bit for bit.  Every
    value satisfies ``|z| <= GAUSSIAN_TAIL_BOUND`` in float64 (its float32
    rounding in float32); the accountants charge that truncation
    (:mod:`ncdp_fast.privacy.truncation`).

    Args:
        count: number of normals (>= 0); consumes ``count`` draws.
        seed: 64-bit key (required: a stream accessor has no default key).
        offset: first draw, in [0, 2**64 - count].
        dtype: float32 or float64, NumPy's or torch's (computed in float64,
            rounded once).
        like: an array whose library and device the result should share
            (NumPy by default; a torch CPU/CUDA tensor or a CuPy array).
    """
    count = check_int(count, "count", 0)
    seed = check_uint64(seed, "seed")
    offset = check_uint64(offset, "offset")
    check_draw_range(offset, count)
    # torch's dtypes too (torch.float32 raised NumPy's "Cannot interpret" error,
    # the seventh audit); None is refused: NumPy reads it as float64.
    dt = None
    if dtype is not None:
        try:
            dt = _arrays.as_numpy_dtype(dtype)
        except TypeError:
            pass
    if dt is None or dt not in _backend.FLOAT_DTYPES:
        raise TypeError(f"dtype: expected float32 or float64 (NumPy's or torch's), got {dtype!r}")
    if like is not None and not (isinstance(like, np.ndarray)
                                 or _arrays.kind(like) in ("torch", "cupy")):
        # A string or list fell through to NumPy silently (the sixth audit).
        raise TypeError("like: expected a NumPy array, torch tensor or CuPy array whose "
                        f"library and device the result takes, got {type(like).__name__}")
    be = _backend.host("rng") if like is None else _backend.select("rng", like=like)
    _backend.refuse_graph_capture(be, like, "gaussian")     # a host draw: nothing to ask
    out = be.io.empty((int(count),), dt)
    if count:
        be.kernels.add_gaussian(out, np.uint64(seed), np.uint64(offset), 1.0, False, 1.0)
    return be.io.to_user(out)
