"""Poisson / hierarchical subsampling with averaging on CUDA: the signatures of
``_numba.mix``.  The population description (labels, group CSR, rates) arrives
on the device, uploaded by the op."""
from __future__ import annotations

import numpy as np

from .. import _arrays
from ._common import dtype_code, native, opt_ptr, ptr, stream


def mix_rows(features, labels, soft, group_ptr, members, select_rate, walk_rate, seed, offset,
             inv_m, clip_x, noise_std_x, noise_std_y, out_x, out_y, counts):
    n, d = features.shape
    K = out_y.shape[1]
    T = out_x.shape[0]
    native(features).launch_mix_rows(ptr(features), dtype_code(features), n, d, ptr(labels), opt_ptr(soft),
                       K, ptr(group_ptr), opt_ptr(members), group_ptr.shape[0] - 1,
                       opt_ptr(select_rate), ptr(walk_rate), T, int(seed), int(offset),
                       float(inv_m), float(clip_x), float(noise_std_x), float(noise_std_y),
                       ptr(out_x), ptr(out_y), ptr(counts), stream(features))


def sample_plan(group_ptr, members, select_rate, walk_rate, seed, offset, row_stride, rows):
    """Memberships as CSR on the host, sampled by the GPU's own sampler (the one
    mix_rows uses), so they match its output exactly."""
    io = _arrays.io_for(walk_rate)
    on = stream(walk_rate)
    counts = io.zeros((rows,), np.int64)
    args = (ptr(group_ptr), opt_ptr(members), group_ptr.shape[0] - 1, opt_ptr(select_rate),
            ptr(walk_rate), rows, int(row_stride), int(seed), int(offset))
    C = native(walk_rate)
    C.launch_sample_counts(*args, ptr(counts), on)
    indptr = np.zeros(rows + 1, dtype=np.int64)
    np.cumsum(io.to_numpy(counts), out=indptr[1:])
    total = int(indptr[-1])
    indptr_d = io.from_host(indptr)
    indices = io.empty((max(1, total),), np.int64)
    C.launch_sample_fill(*args, ptr(indptr_d), ptr(indices), on)
    return indptr, io.to_numpy(indices)[:total].copy()
