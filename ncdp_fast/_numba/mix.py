"""Poisson / hierarchical subsampling with averaging on the CPU (DESIGN.md kernel 2).

The sampler follows ncdp_fast.reference's contract (reference/mix.py) exactly: row r owns sub-stream
``sid = 1 + offset + r * row_stride``; hierarchical sampling spends uniforms
0..G-1 on the groups, then walks each selected group's members, in increasing
group order, by geometric skipping; a uniform is two sub-stream words turned
into a 53-bit float.  The T x n Bernoulli mask is never formed: a row costs
O(G + |I_r|) time and its output row only.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from ._dispatch import sized_kernel
from .clip import TINY_FACTOR, safe_factor, unit_roundoff
from .rng import add_gaussian, philox4x32_10
# The sampler log's constants are the specification's.
from ..reference.mix import (LOG_LG1, LOG_LG2, LOG_LG3, LOG_LG4, LOG_LG5, LOG_LG6, LOG_LG7,
                             LOG_LN2_HI, LOG_LN2_LO, LOG_MANTISSA, LOG_SQRT2_MANTISSA,
                             LOG_TWO_POW_54)

_M32 = np.uint64(0xFFFFFFFF)
_S32 = np.uint64(32)
_TWO_26 = 67108864.0
_INV_2_53 = 1.0 / 9007199254740992.0
_GAP_LIMIT = 9007199254740992.0      # 2^53


@njit(cache=True, inline="always")
def uniform53(seed, sid, j):
    """Uniform ``j`` of sub-stream ``sid``: words 2j and 2j+1 as a 53-bit float in (0, 1)."""
    block = np.uint64(j) >> np.uint64(1)
    w = philox4x32_10(seed & _M32, seed >> _S32, block & _M32, block >> _S32, sid & _M32,
                      sid >> _S32)
    if j & 1:
        hi, lo = w[2], w[3]
    else:
        hi, lo = w[0], w[1]
    return (np.float64(hi >> np.uint64(5)) * _TWO_26 + np.float64(lo >> np.uint64(6)) + 0.5) \
        * _INV_2_53


# The sampler's log and log1p: reference.sampler_log / sampler_log1p operation
# for operation (fdlibm's e_log.c), so that memberships do not depend on the
# libm numba links against.  Plain @njit, never fastmath or inline="always":
# numba-level inlining would lower these lines with a calling kernel's
# fastmath flags (_mix_block allows contraction), and a fused multiply-add
# changes the bits.


@njit(cache=True)
def sampler_log(x):
    """reference.sampler_log: log(x) with the same bits on every backend."""
    if not x > 0.0:
        return -math.inf if x == 0.0 else math.nan
    if x == math.inf:
        return x
    k = 0
    if x < 2.0 ** -1022:
        x *= LOG_TWO_POW_54
        k = -54
    bits = np.float64(x).view(np.int64)
    k += (bits >> 52) - 1023
    mantissa = bits & LOG_MANTISSA
    half = 1 if mantissa >= LOG_SQRT2_MANTISSA else 0
    f = np.int64(mantissa | ((1023 - half) << 52)).view(np.float64) - 1.0
    k += half
    s = f / (2.0 + f)
    z = s * s
    w = z * z
    r = z * (LOG_LG1 + w * (LOG_LG3 + w * (LOG_LG5 + w * LOG_LG7))) + w * (LOG_LG2 + w * (LOG_LG4 + w * LOG_LG6))
    hfsq = 0.5 * f * f
    dk = np.float64(k)
    return dk * LOG_LN2_HI - ((hfsq - (s * (hfsq + r) + dk * LOG_LN2_LO)) - f)


@njit(cache=True)
def sampler_log1p(x):
    """reference.sampler_log1p: log(1 + x) with the same bits on every backend."""
    u = 1.0 + x
    if u == 0.0:
        return -math.inf
    if u == math.inf:
        return u
    c = x - (u - 1.0) if x <= 1.0 else 1.0 - (u - x)
    return sampler_log(u) + c / u


@njit(cache=True, inline="always")
def row_clip_factor(xi, clip_x, unit):
    """The clip factor of one feature row: the rounding-aware rule of the clip ops
    on its float64 squared norm, so that the clipped row as computed in the
    features' dtype has norm <= clip_x."""
    sq = 0.0
    for j in range(xi.shape[0]):
        v = np.float64(xi[j])
        sq += v * v
    return safe_factor(sq, 0.0, clip_x, xi.shape[0], 1.0, unit)


@njit(cache=True, inline="always")
def add_clipped_row(ax, xi, f):
    """ax += f * xi (f: the row's float64 clip factor) in ax's dtype.  f == 0 adds
    nothing: the bound was not finite, and the row is never multiplied."""
    if f >= TINY_FACTOR:
        fc = ax.dtype.type(f)
        for j in range(ax.shape[0]):
            ax[j] += fc * xi[j]
    elif f != 0.0:
        # A float32 factor this small is a denormal (or 0): multiply in float64
        # and round the product once.
        for j in range(ax.shape[0]):
            ax[j] += ax.dtype.type(f * np.float64(xi[j]))


@njit(cache=True, inline="always")
def row_sid(offset, r, row_stride):
    """Sub-stream of output row r: 1 + offset + r * row_stride (uint64, wrapping)."""
    return np.uint64(1) + offset + np.uint64(r) * row_stride


@njit(cache=True)
def sample_row(seed, sid, group_ptr, members, has_members, select_rate, has_select, walk_rate,
               buf):
    """Selected example ids of one row, in sampler order, written to ``buf``
    (grown by doubling when full).  Returns ``(buf, count)``."""
    G = group_ptr.shape[0] - 1
    selected = np.empty(G, dtype=np.bool_)
    j = 0
    for k in range(G):
        if has_select:
            selected[k] = uniform53(seed, sid, j) < select_rate[k]
            j += 1
        else:
            selected[k] = True
    count = 0
    for k in range(G):
        if not selected[k]:
            continue
        start = group_ptr[k]
        size = group_ptr[k + 1] - start
        log1mq = sampler_log1p(-walk_rate[k])
        pos = -1
        while True:
            u = uniform53(seed, sid, j)
            j += 1
            # q = 1: log1p(-1) = -inf and the gap is -0.0, i.e. every member.
            # np.floor keeps a float: numba's math.floor returns int64, which
            # wrapped to INT64_MIN for rates below ~1e-18 and indexed out of bounds.
            gap = np.floor(sampler_log(u) / log1mq) if log1mq != 0.0 else math.inf
            # A gap of 2^53 or more (or NaN) passes the end of every group: the
            # cap the CUDA sampler applies (mix.cu, kGapLimit).
            if not (gap < _GAP_LIMIT) or gap >= size - pos - 1:
                break
            pos += np.int64(gap) + 1
            if count == buf.shape[0]:
                grown = np.empty(2 * buf.shape[0], dtype=buf.dtype)
                grown[:count] = buf
                buf = grown
            buf[count] = members[start + pos] if has_members else start + pos
            count += 1
    return buf, count


@sized_kernel(lambda seed, offset, row_stride, group_ptr, members, has_members, select_rate,
              has_select, walk_rate, counts: 64 * counts.shape[0])
def sample_counts(seed, offset, row_stride, group_ptr, members, has_members, select_rate,
                  has_select, walk_rate, counts):
    """counts[r] = |I_r| for rows r < len(counts)."""
    for r in prange(counts.shape[0]):
        buf, counts[r] = sample_row(seed, row_sid(offset, r, row_stride), group_ptr, members,
                                    has_members, select_rate, has_select, walk_rate,
                                    np.empty(64, dtype=np.int64))


@sized_kernel(lambda seed, offset, row_stride, group_ptr, members, has_members, select_rate,
              has_select, walk_rate, indptr, indices: 64 * indptr.shape[0])
def sample_fill(seed, offset, row_stride, group_ptr, members, has_members, select_rate,
                has_select, walk_rate, indptr, indices):
    """indices[indptr[r]:indptr[r+1]] = I_r (indptr from sample_counts)."""
    for r in prange(indptr.shape[0] - 1):
        # The same draws as sample_counts: the row fills its slice exactly, so
        # sample_row never grows it (an empty row gets a 1-element dummy).
        out = indices[indptr[r]:indptr[r + 1]]
        sample_row(seed, row_sid(offset, r, row_stride), group_ptr, members, has_members,
                   select_rate, has_select, walk_rate,
                   out if out.shape[0] > 0 else np.empty(1, np.int64))


@sized_kernel(lambda features, *args: features.shape[1] * 64 * args[-1].shape[0],
              fastmath={"contract"})
def _mix_block(features, labels, soft, has_soft, group_ptr, members, has_members, select_rate,
               has_select, walk_rate, seed, offset, first_row, row_stride, inv_m, clip_x, unit,
               noise, noise_std_x, noise_std_y, out_x, out_y, counts, factors):
    """Rows first_row .. first_row + len(out_x) - 1 of the mix op (noise: their
    (d+K) float64 normals per row, already drawn).  ``factors`` [n] caches each
    example's clip factor across rows and blocks (negative: not computed yet);
    ``unit``: the features' unit roundoff, for the clip rule's bound."""
    d = features.shape[1]
    K = out_y.shape[1]
    for rr in prange(out_x.shape[0]):
        buf, c = sample_row(seed, row_sid(offset, first_row + rr, row_stride), group_ptr,
                            members, has_members, select_rate, has_select, walk_rate,
                            np.empty(128, dtype=np.int64))
        counts[rr] = c
        ax = np.zeros(d, dtype=out_x.dtype)
        ay = np.zeros(K, dtype=out_y.dtype)
        for s in range(c):
            i = buf[s]
            xi = features[i]
            f = 1.0
            if clip_x > 0.0:
                # An example joins ~m rows; its norm is a serial float64 sum (no
                # reassociation, to match the reference bit for bit), so computing it
                # once instead of at every inclusion took the T = n = 60000,
                # d = 3969, m = 64 release from 19.5 s to 11.5 s.  Threads racing on
                # one entry write the same value.
                f = factors[i]
                if f < 0.0:
                    f = row_clip_factor(xi, clip_x, unit)
                    factors[i] = f
            add_clipped_row(ax, xi, f)
            if has_soft:
                for k in range(K):
                    ay[k] += soft[i, k]
            else:
                ay[labels[i]] += 1
        for j in range(d):
            out_x[rr, j] = np.float64(ax[j]) * inv_m + noise_std_x * noise[rr, j]
        for k in range(K):
            out_y[rr, k] = np.float64(ay[k]) * inv_m + noise_std_y * noise[rr, d + k]


# Rows per block of the mix op: bounds the float64 noise buffer to ~8 MB.
def _rows_per_block(d, K):
    return max(1, min(4096, (1 << 20) // max(1, d + K)))


def mix_rows(features, labels, soft, group_ptr, members, select_rate, walk_rate, seed, offset,
             inv_m, clip_x, noise_std_x, noise_std_y, out_x, out_y, counts):
    """The mix op on [T, d] / [T, K] outputs (see ``_mix_block``).  ``soft`` (n, K)
    or None, ``members`` or None (identity), ``select_rate`` or None (Poisson)."""
    T, d = out_x.shape
    K = out_y.shape[1]
    has_soft = soft is not None
    has_members = members is not None
    has_select = select_rate is not None
    soft_a = soft if has_soft else np.zeros((1, 1), dtype=features.dtype)
    members_a = members if has_members else np.zeros(1, dtype=np.int64)
    select_a = select_rate if has_select else np.zeros(1)
    step = _rows_per_block(d, K)
    row_stride = np.uint64(d + K)
    factors = np.full(features.shape[0] if clip_x > 0.0 else 1, -1.0)
    unit = unit_roundoff(features.dtype)
    for r0 in range(0, T, step):
        r1 = min(T, r0 + step)
        noise = np.empty((r1 - r0, d + K))
        add_gaussian(noise.reshape(-1), np.uint64(seed), np.uint64(offset + r0 * (d + K)), 1.0,
                     False, 1.0)
        _mix_block(features, labels, soft_a, has_soft, group_ptr, members_a, has_members,
                   select_a, has_select, walk_rate, np.uint64(seed), np.uint64(offset), r0,
                   row_stride, float(inv_m), float(clip_x), unit, noise, float(noise_std_x),
                   float(noise_std_y), out_x[r0:r1], out_y[r0:r1], counts[r0:r1], factors)


def sample_plan(group_ptr, members, select_rate, walk_rate, seed, offset, row_stride, rows):
    """CSR (indptr [rows+1], indices) of the memberships of ``rows`` rows."""
    has_members = members is not None
    has_select = select_rate is not None
    members_a = members if has_members else np.zeros(1, dtype=np.int64)
    select_a = select_rate if has_select else np.zeros(1)
    counts = np.empty(rows, dtype=np.int64)
    args = (np.uint64(seed), np.uint64(offset), np.uint64(row_stride), group_ptr, members_a,
            has_members, select_a, has_select, walk_rate)
    sample_counts(*args, counts)
    indptr = np.zeros(rows + 1, dtype=np.int64)
    np.cumsum(counts, out=indptr[1:])
    indices = np.empty(int(indptr[-1]), dtype=np.int64)
    sample_fill(*args, indptr, indices)
    return indptr, indices
