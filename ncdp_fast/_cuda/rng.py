"""The shared Philox stream's normals on CUDA: the signature of ``_numba.rng``."""
from __future__ import annotations

import math

from ._common import dtype_code, native, pointers_sizes_codes, ptr, stream


def add_gaussian(out, seed, offset, scale, accumulate, post):
    # post = 1 / expected batch size on a ghost block's finishing step: applied
    # in the kernel's float64 before the one rounding, as the numba kernel does.
    native(out).launch_fill_gaussian(ptr(out), math.prod(out.shape), dtype_code(out), int(seed),
                                     int(offset), float(scale), bool(accumulate), float(post),
                                     stream(out))


def finish_gaussian_segments(segments, seed, scale, post):
    """``_numba.rng.finish_gaussian_segments`` on the device: every segment's
    finish in one launch (48 segments a launch), instead of one launch a
    segment (issue 36: a BERT-base step finished 151 of them).  segments:
    (dst, src, offset) of one device, dst contiguous float32/float64, src dst
    itself or a contiguous float64 array of its length."""
    if not segments:
        return
    dst = [d for d, _, _ in segments]
    dst_ptr, counts, dst_code = pointers_sizes_codes(dst)
    src_ptr, _, src_code = pointers_sizes_codes([s for _, s, _ in segments])
    native(dst[0]).launch_finish_gaussian_segments(
        dst_ptr, src_ptr, counts, [int(o) for _, _, o in segments], src_code, dst_code,
        int(seed), float(scale), float(post), stream(dst[0]))
