"""Op 2 of DESIGN.md: Poisson / hierarchical subsampling with averaging, and
DP-SGD Poisson batch plans.

Layer 2 code: validates, prepares the population description (class CSR,
selection and walk rates), allocates, calls one backend.  The stream layout
(sub-streams for sampling, main stream for noise) is written out in
:mod:`ncdp_fast.reference`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _arrays, _backend, _stream
from ._validate import (as_real_array, check_bool, check_int, check_nonneg, check_positive,
                        check_probability, check_real)

__all__ = ["BatchPlan", "MixResult", "mix", "poisson_batches"]


@dataclass(frozen=True)
class BatchPlan:
    """Row-wise index sets in CSR form: row r is ``indices[indptr[r]:indptr[r+1]]``.

    For :func:`poisson_batches` a row is one DP-SGD step's batch (each example
    included independently with probability ``sample_rate``; empty batches
    stay in the plan, as the privacy analysis requires).  ``seed``/``offset``
    locate the sampling in the Philox stream; ``next_offset`` is where the next
    call should start so that no randomness is reused.
    """
    indptr: np.ndarray    # (rows + 1,) int64
    indices: np.ndarray   # (indptr[-1],) int64 example ids
    seed: int
    offset: int
    next_offset: int

    def __len__(self) -> int:
        return self.indptr.shape[0] - 1

    def __getitem__(self, r):
        if isinstance(r, slice):
            return [self[i] for i in range(*r.indices(len(self)))]
        r = int(r)
        if r < 0:
            r += len(self)
        if not 0 <= r < len(self):
            raise IndexError(f"row {r} out of range for a plan of {len(self)} rows")
        return self.indices[self.indptr[r]:self.indptr[r + 1]]

    def __iter__(self):
        for r in range(len(self)):
            yield self[r]

    def sizes(self) -> np.ndarray:
        return np.diff(self.indptr)


@dataclass(frozen=True)
class MixResult:
    """Released rows of :func:`mix`; unpacks as ``x, y, counts = mix(...)``."""
    x: Any               # (T, d), features' dtype and array type
    y: Any               # (T, K)
    counts: Any          # (T,) int64, |I_t| (not private: keep it to yourself)
    seed: int
    offset: int
    draws: int           # main-stream draws consumed: T * (d + K)
    groups: BatchPlan | None = None

    @property
    def next_offset(self) -> int:
        return self.offset + self.draws

    def __iter__(self):
        return iter((self.x, self.y, self.counts))


def _population(labels_host, n, K, m, class_rate):
    """(group_ptr, members, select_rate, walk_rate) of the sampler."""
    if class_rate is None:
        q = m / n
        return (np.array([0, n], dtype=np.int64), None, None, np.array([q]))
    p = as_real_array(class_rate, "class_rate", "a float or an array of floats")
    if p.ndim == 0:
        p = np.full(K, float(p))
    if p.shape != (K,):
        raise ValueError(f"class_rate: expected a float or an array of shape ({K},), got shape "
                         f"{p.shape}")
    if not np.all((p > 0) & (p <= 1)):
        bad = np.flatnonzero(~((p > 0) & (p <= 1)))
        raise ValueError(f"class_rate: every p_k must be in (0, 1]; classes {bad.tolist()} are not")
    q = m / (n * p)
    if np.any(q > 1):
        bad = np.flatnonzero(q > 1)
        raise ValueError(f"class_rate: q_k = m / (n p_k) must be <= 1; for classes {bad.tolist()} "
                         f"it is {q[bad].round(4).tolist()} (raise p_k or lower mixup_degree)")
    order = np.argsort(labels_host, kind="stable").astype(np.int64)
    group_ptr = np.zeros(K + 1, dtype=np.int64)
    np.cumsum(np.bincount(labels_host, minlength=K), out=group_ptr[1:])
    return group_ptr, order, p, q


def mix(features, labels, *, num_samples, mixup_degree, noise_std_x, noise_std_y,
        num_classes=None, class_rate=None, clip_x=None, seed=None, offset=None,
        return_groups=False) -> MixResult:
    """Averages of Poisson- or hierarchically-subsampled groups plus Gaussian noise.

    DESIGN.md kernel 2; NeuroMixGDP's Algorithm 1 with Procedures 1 and 2
    (002_1ce43e1ce6039d97.txt, Definitions 2.3-2.4).  For each of the T output rows:

    * Poisson sampling (``class_rate=None``): I_t = {i : b_ti = 1}, b_ti ~ Bernoulli(m/n).
    * Hierarchical sampling (``class_rate`` p, a float or (K,) array): classes are
      kept with probability p_k, then each example of a kept class with
      q_k = m / (n p_k) (an error if > 1).
    * x_t = (1/m) sum_{i in I_t} clip(x_i) + N(0, noise_std_x^2 I_d),
      y_t = (1/m) sum_{i in I_t} onehot(y_i) + N(0, noise_std_y^2 I_K):
      divided by the nominal m, never |I_t|; an empty group gives pure noise.

    Privacy meaning: with ||x_i|| <= C_x (``clip_x`` enforces it) and one-hot
    labels, adding or removing one example changes a row's x by at most C_x/m
    and its y by at most 1/m in L2 norm (add/remove neighbours); NeuroMixGDP calibrates
    ``noise_std_x = sigma_x C_x / m`` and ``noise_std_y = sigma_y C_y / m``
    (Theorem 3.1; see ncdp_fast.privacy.neuromix_noise).  ``counts`` is not
    private: release only x and y.

    Args:
        features: (n, d) float32/float64, finite; NumPy, torch (CPU/CUDA) or CuPy.
        labels: (n,) integer class ids in [0, num_classes), or (n, K) soft labels
            (Poisson sampling only).
        num_samples: T >= 1 output rows.
        mixup_degree: m, 0 < m <= n (the expected group size).
        noise_std_x, noise_std_y: absolute noise standard deviations (>= 0).
        num_classes: K; required with integer labels (the label set is public;
            inferring it from the private labels would leak).
        class_rate: None (Poisson) or p_k for hierarchical sampling.
        clip_x: None, or C > 0 to use f_i x_i with the clip ops' rounding-aware
            factor (reference.clip_factors: min(1, C/||x_i||) applied to a bound
            on the float64 norm, about 3e-7 relative tighter in float32), so the
            clipped row as computed in the features' dtype has norm <= C; a
            factor below 2^-60 multiplies in float64 on the CPU, every factor
            does on CUDA (csrc/clip/clip_rule.cuh).  A ValueError
            refuses float64 features with entries above sqrt(max_float64 / (2 d)),
            whose squared norms may overflow.
        seed, offset: Philox key (None: from the OS) and first main-stream draw;
            the call consumes T*(d+K) draws and the sub-streams
            1 + offset + t*(d+K) (see reference.py), so a row range
            [t0, t1) computed alone with ``offset + t0*(d+K)`` equals those rows.
        return_groups: also return the memberships I_t as a :class:`BatchPlan`
            (CPU arrays; for audits and tests -- they are private).

    Returns a :class:`MixResult` (unpacks as ``x, y, counts``).
    """
    n, d = _features_shape(features)
    T = check_int(num_samples, "num_samples", 1)
    m = check_real(mixup_degree, "mixup_degree")
    if not 0 < m <= n:
        raise ValueError(f"mixup_degree: expected 0 < m <= n = {n}, got {mixup_degree!r}")
    sx = check_nonneg(noise_std_x, "noise_std_x")
    sy = check_nonneg(noise_std_y, "noise_std_y")
    cx = 0.0 if clip_x is None else check_positive(clip_x, "clip_x")
    be = _backend.select("mix", features=features, labels=labels)
    _backend.refuse_graph_capture(be, features, "mix")
    dtype = be.check_float(features, "features")
    xk = be.io.to_kernel(features)
    if not be.io.all_finite(xk):
        raise ValueError("features: expected finite values, got NaN or Inf")
    if cx > 0.0:
        _check_clip_range(be, xk, d, dtype)

    sl = _arrays.shape(labels, "labels")
    soft = None
    if len(sl) == 2:
        if sl[0] != n:
            raise ValueError(f"labels: {sl[0]} soft-label rows for {n} feature rows")
        if class_rate is not None:
            raise ValueError("class_rate: hierarchical sampling needs integer class labels, got "
                             "soft labels of shape " + str(sl))
        if num_classes is not None and num_classes != sl[1]:
            raise ValueError(f"num_classes: {num_classes} differs from the soft labels' {sl[1]}")
        K = sl[1]
        if be.check_float(labels, "labels") != dtype:
            raise TypeError(f"labels: soft labels must have the features' dtype {dtype}")
        soft = be.io.to_kernel(labels)
        if not be.io.all_finite(soft):
            raise ValueError("labels: expected finite soft labels, got NaN or Inf")
        labels_host = None
    elif len(sl) == 1:
        if sl[0] != n:
            raise ValueError(f"labels: length {sl[0]} differs from features' {n} rows")
        if num_classes is None:
            raise ValueError("num_classes: required with integer labels (inferring it from the "
                             "private labels would leak it)")
        K = check_int(num_classes, "num_classes", 1)
        labels_host = _arrays.to_numpy(labels)
        if labels_host.dtype.kind not in "iu":
            raise TypeError(f"labels: expected integer class ids, got dtype {labels_host.dtype}")
        if n and (labels_host.min() < 0 or labels_host.max() >= K):
            bad = np.flatnonzero((labels_host < 0) | (labels_host >= K))
            raise ValueError(f"labels: class ids must be in [0, {K}); rows {bad[:10].tolist()} "
                             "are not")
        labels_host = labels_host.astype(np.int64)
    else:
        raise ValueError(f"labels: expected shape (n,) or (n, K), got {sl}")

    return_groups = check_bool(return_groups, "return_groups")     # before the draw
    draws = T * (d + K)
    # class_rate's refusals before the draw's range is claimed: a corrected
    # call at the same explicit offset is then no reuse (the eighth audit).
    population = _population(labels_host, n, K, m, class_rate)
    seed, offset = _stream.claim(seed, offset, draws)
    # The population description goes where the kernels run (a no-op on the CPU).
    group_ptr, members, select, walk = (None if a is None else be.io.from_host(a)
                                        for a in population)
    lab = be.io.from_host(labels_host if labels_host is not None else np.zeros(1, dtype=np.int64))
    out_x = be.io.empty((T, d), dtype)
    out_y = be.io.empty((T, K), dtype)
    counts = be.io.empty((T,), np.dtype(np.int64))
    be.kernels.mix_rows(xk, lab, soft, group_ptr, members, select, walk, seed, offset,
                        1.0 / m, cx, sx, sy, out_x, out_y, counts)
    groups = None
    if return_groups:
        # The backend's own sampler, so the groups are exactly those behind x, y.
        indptr, indices = be.kernels.sample_plan(group_ptr, members, select, walk, seed, offset,
                                                 d + K, T)
        groups = BatchPlan(indptr, indices, seed, offset, offset + draws)
    return MixResult(x=be.io.to_user(out_x), y=be.io.to_user(out_y),
                     counts=be.io.to_user(counts), seed=seed, offset=offset, draws=draws,
                     groups=groups)


def _check_clip_range(be, xk, d, dtype):
    """Refuses features whose squared row norms may overflow float64.

    The clip rule (reference.clip_factors) gives a row whose rounding bound is
    not finite the factor 0: the row would silently contribute nothing.  With
    every |x_ij| <= sqrt(max / (2d)) no float64 sum of a row's squares, in any
    order, can reach the overflow threshold, so the bound is finite; float32
    features always pass (3.4e38^2 d is far below it)."""
    limit = math.sqrt(float(np.finfo(np.float64).max) / (2.0 * d))
    if float(np.finfo(dtype).max) <= limit:
        return
    if max(abs(float(xk.max())), abs(float(xk.min()))) <= limit:
        return
    host = np.asarray(be.io.to_numpy(xk))
    bad = np.flatnonzero(np.abs(host).max(axis=1) > limit)
    shown = ", ".join(str(i) for i in bad[:10]) + (", ..." if bad.size > 10 else "")
    raise ValueError(f"features: rows [{shown}] have entries above sqrt(max_float64 / (2 d)) = "
                     f"{limit:.4g}; their squared norms may overflow float64, so clip_x cannot "
                     "bound them (rescale the features)")


def _features_shape(features):
    s = _arrays.shape(features, "features")
    if len(s) != 2:
        raise ValueError(f"features: expected shape (n, d), got {s}")
    n, d = s
    if n == 0:
        raise ValueError("features: n = 0 examples; nothing to sample from")
    if d == 0:
        raise ValueError("features: d = 0 columns")
    return n, d


def poisson_batches(n, *, sample_rate, steps, seed=None, offset=None) -> BatchPlan:
    """DP-SGD batches by true Poisson sampling: ``steps`` rows, each including every
    example 0..n-1 independently with probability ``sample_rate``.

    Every (step, example) pair is an independent Bernoulli(q) draw (geometric
    skipping, O(expected batch) per step, never an n-sized mask); empty batches
    are kept.  This is the sampling the subsampled-Gaussian accountants of
    :mod:`ncdp_fast.privacy` assume (add/remove neighbours).  Step s uses
    sub-stream ``1 + offset + s``; the plan's ``next_offset`` is ``offset +
    steps``.  CPU arrays (NumPy int64).
    """
    n = check_int(n, "n", 1, 2**63 - 1)            # the plan's int64 indices
    q = check_probability(sample_rate, "sample_rate")
    steps = check_int(steps, "steps", 0)
    seed, offset = _stream.claim(seed, offset, steps)
    if offset + steps + 1 > 2**64:
        raise ValueError(f"offset: {offset} + {steps} steps runs past the end of the stream")
    be = _backend.host("mix")
    indptr, indices = be.kernels.sample_plan(np.array([0, n], dtype=np.int64), None, None,
                                             np.array([q]), seed, offset, 1, steps)
    return BatchPlan(indptr, indices, seed, offset, offset + steps)
