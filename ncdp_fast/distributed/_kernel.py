"""CPU kernels of the sharded release (numba): one rank's part of ``mix``'s rows.

The one-process ``mix`` (``_numba/mix._mix_block``) gives output row t the float
sum, in sampler order, of ``f_i x_i`` over its group I_t, then adds noise.  Here a
rank holding the feature rows ``[lo, lo + n_r)`` computes, for a block of output
rows, the same sum restricted to the members it holds (in the same sampler order,
with the same clip rule and the same code: ``sample_row``, ``row_clip_factor``), and
the label counts of whole groups (labels are replicated).  The ranks' partial sums
are then reduced across ranks and finished by the row's owner with
:func:`finish_rows` (the expression of ``_mix_block``, on noise drawn at the row's
own offset).  Memberships come from ``sample_row`` itself, so they are the
one-process memberships exactly.
"""
from __future__ import annotations

import numpy as np
from numba import prange

from .._numba._dispatch import sized_kernel
from .._numba.mix import add_clipped_row, row_clip_factor, row_sid, sample_row

__all__ = ["partial_rows", "finish_rows"]


@sized_kernel(lambda features, *args: (features.shape[1] + 1) * 64 * args[-3].shape[0],
              fastmath={"contract"})
def partial_rows(features, lo, labels, group_ptr, members, has_members, select_rate,
                 has_select, walk_rate, seed, offset, row_stride, clip_x, unit, factors,
                 rows, part_x, count_y):
    """For each slot s with ``rows[s] = t >= 0``: ``part_x[s] = sum over i in I_t with
    lo <= i < lo + n_r of f_i x_i`` (features' dtype, sampler order) and
    ``count_y[s, k] = #{i in I_t : labels[i] = k}`` (whole group); ``rows[s] < 0``
    (padding) gives zeros.  ``features``: (n_r, d) this rank's rows; ``labels`` (n,)
    int64, all of them; ``factors`` (n_r,) float64 clip factors (< 0: not computed
    yet), filled on first use."""
    d = features.shape[1]
    K = count_y.shape[1]
    hi = lo + features.shape[0]
    for s in prange(part_x.shape[0]):
        t = rows[s]
        ax = np.zeros(d, dtype=part_x.dtype)
        ay = np.zeros(K, dtype=np.float64)
        if t >= 0:
            buf, c = sample_row(seed, row_sid(offset, t, row_stride), group_ptr, members,
                                has_members, select_rate, has_select, walk_rate,
                                np.empty(128, dtype=np.int64))
            for q in range(c):
                i = buf[q]
                ay[labels[i]] += 1.0
                if i < lo or i >= hi:
                    continue
                xi = features[i - lo]
                f = 1.0
                if clip_x > 0.0:
                    f = factors[i - lo]
                    if f < 0.0:
                        f = row_clip_factor(xi, clip_x, unit)
                        factors[i - lo] = f
                add_clipped_row(ax, xi, f)
        for j in range(d):
            part_x[s, j] = ax[j]
        for k in range(K):
            count_y[s, k] = ay[k]


@sized_kernel(lambda sums, *args: sums.size, fastmath={"contract"})
def finish_rows(sums, count_y, noise, inv_m, noise_std_x, noise_std_y, out_x, out_y):
    """The owner's last step of its rows, as in ``_mix_block``:
    ``out_x = sums / m + noise_std_x * noise[:, :d]`` and
    ``out_y = counts / m + noise_std_y * noise[:, d:]``, computed in float64 and
    rounded once to the output dtype.  ``sums`` (r, d) the reduced feature sums in
    the features' dtype, ``count_y`` (r, K), ``noise`` (r, d + K) float64 standard
    normals drawn at the rows' own stream offsets."""
    d = sums.shape[1]
    K = count_y.shape[1]
    for r in prange(out_x.shape[0]):
        for j in range(d):
            out_x[r, j] = np.float64(sums[r, j]) * inv_m + noise_std_x * noise[r, j]
        for k in range(K):
            out_y[r, k] = count_y[r, k] * inv_m + noise_std_y * noise[r, d + k]
