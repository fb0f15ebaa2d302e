r"""The sharded NeuroMixGDP release: :func:`release_sharded`.

Rank r of W holds the contiguous feature rows ``[lo_r, lo_r + n_r)`` of the private
dataset (``n_r`` may be 0) and all n labels.  The result is the one-process release
``NeuroMixGDP.release`` over the concatenated rows, cut into pieces:

* **Randomness.**  The release claims ``T (d + K)`` draws at one ``(seed, offset)``
  exactly as the one-process call does.  Output row t's group I_t comes from its
  own sampling sub-stream ``1 + offset + t (d + K)`` and its noise from main-stream
  draws ``offset + t (d + K) ...`` (docs/architecture.md, "Random numbers").  Every
  rank samples every row (the memberships, O(T m) uniforms, are cheap next to the
  O(T m d / W) sums); only the owner of row t draws its noise, once.
* **Work.**  Output rows are split into W contiguous shards (``shard_bounds(T, ...)``).
  In rounds of ``b`` rows per owner, every rank sums ``f_i x_i`` over the members it
  holds, in sampler order (features' dtype), for the round's ``W b`` rows; a
  reduce-scatter by output rows hands each owner the sums of its ``b`` rows, and
  the owner adds the noise (``_kernel.finish_rows``).  Label counts need no
  communication: labels are replicated.
* **Privacy accounting.**  Rank 0 calibrates the noise and builds the report of the
  one-process release (n = the total rows) and broadcasts it; it does not depend on W.

Memory per rank: the shard ``(n_r, d)`` (a memory map is read in place), its clip
factors (n_r float64), the labels and the sampler's class order (2 n int64), the
owned output rows ``(T/W, d + K)`` and one round's buffers, at most about
``chunk_bytes`` for the partial sums plus the owned rows' float64 noise.

Memberships are the one-process memberships exactly and label outputs are bitwise
equal; feature outputs differ from one process only by the rounding of the
cross-rank sum (each rank's partial is a float sum in sampler order, as one
process's; the reduce adds W partials).
"""
from __future__ import annotations

import time

import numpy as np

from .. import _arrays, _backend
from .._mix import _check_clip_range, _population
from .._numba.clip import unit_roundoff
from .._numba.rng import add_gaussian
from .._validate import check_pos_int
from ..release.mechanism import NeuroMixGDP, _labels_host
from ..release.report import privacy_report
from ._group import check_same_config, rank_world, resolve_group, shard_bounds
from ._kernel import finish_rows, partial_rows
from ._sharded import ShardedRelease

__all__ = ["release_sharded"]

WHAT = "NeuroMixGDP.release"


def _shard(features):
    """This rank's (n_r, d) float32/float64 host rows (a view: memory maps stay maps)."""
    shape = _arrays.shape(features, "features")
    if len(shape) != 2 or shape[1] < 1:
        raise ValueError(f"features: expected this rank's shard of shape (n_r, d) with d >= 1 "
                         f"(n_r may be 0), got {shape}")
    if _arrays.is_cuda_array(features):
        raise TypeError(f"features: the sharded release runs on the CPU (gloo); expected a "
                        f"host array, got {_arrays.describe(features)}")
    x = _arrays.to_numpy(features)
    if x.dtype not in (np.float32, np.float64):
        raise TypeError(f"features: expected float32 or float64, got dtype {x.dtype}")
    step = max(1, (1 << 24) // max(1, x.shape[1]))    # a bounded temporary, not n_r x d
    for i in range(0, x.shape[0], step):
        if not np.isfinite(x[i:i + step]).all():
            raise ValueError("features: expected finite values, got NaN or Inf")
    return x


def _config(mech, n, d, K, dtype, labels, stream):
    hc = mech.hierarchical_classes
    cfg = dict(epsilon=mech.epsilon, delta=mech.delta, mixup_degree=mech.mixup_degree,
               num_samples=mech.num_samples, lam=mech.lam, clip_x=mech.clip_x,
               clip_y=mech.clip_y, accountant=mech.accountant,
               hierarchical_classes=hc.tolist() if isinstance(hc, np.ndarray) else hc,
               value_discretization_interval=mech.value_discretization_interval,
               num_classes=K, d=d, dtype=str(dtype), n=n,
               seed_source="explicit" if stream._explicit else "os")
    # Private labels and the key are compared by salted digest, never shown.
    secret = dict(labels=labels)
    if stream._explicit:
        secret["seed"] = stream.seed
        cfg["offset"] = stream.position
    return cfg, secret


def noise_draws(mech: NeuroMixGDP, n: int, d: int, K: int) -> int:
    """Draws of the noise stream a release of n rows of width d and K classes takes."""
    return mech.resolve(n, K)["T"] * (d + K)


def _calibrate(mech, n, K, T, m, rates):
    s, sx, sy, known = mech._calibrate(n, m, T, rates)
    report = privacy_report(sigma=s, epsilon=mech.epsilon, delta=mech.delta,
                            accountant=mech.accountant, class_rates=rates, n=n, m=m, T=T,
                            lam=mech.lam, clip_x=mech.clip_x, clip_y=mech.clip_y,
                            interval=mech.value_discretization_interval, known=known)
    return sx, sy, report


def _broadcast_from_0(payload, group, rank):
    """Rank 0's ``("ok", value)`` / ``("error", text)`` on every rank."""
    import torch.distributed as dist
    box = [payload if rank == 0 else None]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    status, value = box[0]
    if status == "error":
        raise ValueError(f"{WHAT}: rank 0 failed to calibrate the noise: {value}")
    return value


def _reduce_scatter(out, part, group):
    import torch
    import torch.distributed as dist
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(torch.from_numpy(out), torch.from_numpy(part), group=group)


def release_sharded(mech: NeuroMixGDP, features, labels, *, num_classes, group=None,
                    chunk_bytes: int = 1 << 25, progress=None) -> ShardedRelease:
    r"""``mech.release(features, labels, num_classes=...)`` over the rows of all ranks.

    Args:
        mech: the :class:`~ncdp_fast.release.NeuroMixGDP` (same arguments on every
            rank; a different epsilon, seed, m, ... on some rank is a ``ValueError`` on
            every rank).  With ``seed=None`` the key drawn from the OS on rank 0 is
            the one used (sent to the other ranks: it stays inside the group).
        features: this rank's contiguous shard, (n_r, d) float32/float64, finite, host
            memory (NumPy, a ``np.load(..., mmap_mode="r")`` map, or a CPU tensor);
            n_r may be 0.  Ranks hold the rows in rank order.  Private.
        labels: (n,) integer class ids of *all* rows, the same on every rank.  Private.
        num_classes: K, public.
        group: a ``torch.distributed`` process group; ``None``: the default group if
            initialised, else one process (the same code, no communication).
        chunk_bytes: bound on one round's partial-sum buffer (``W b d`` elements).
        progress: optional ``progress(rows_done, rows_owned)`` called after each round.

    Returns:
        :class:`ShardedRelease` holding this rank's output rows ``[t_lo, t_hi)`` (NumPy,
        the features' dtype) and the one-process :class:`PrivacyReport`; its
        ``gather()`` / ``save()`` assemble the whole release.
    """
    t_start = time.perf_counter()
    group = resolve_group(group)
    rank, world = rank_world(group)
    stream = mech._stream
    err, cfg, secret, local = None, {}, {}, None
    try:
        x = _shard(features)
        d = x.shape[1]
        K = check_pos_int(num_classes, "num_classes")
        n = _arrays.shape(labels, "labels")[0] if _arrays.shape(labels, "labels") else 0
        lab = _labels_host(labels, n, K).astype(np.int64)
        if n < 1:
            raise ValueError("labels: n = 0 examples; nothing to sample from")
        r = mech.resolve(n, K)
        m, T, rates = r["m"], r["T"], r["class_rates"]
        if mech.clip_x > 0 and x.shape[0]:
            _check_clip_range(_backend.host("mix"), x, d, x.dtype)
        cfg, secret = _config(mech, n, d, K, x.dtype, lab, stream)
        draws = noise_draws(mech, n, d, K)
        offset = stream.take(draws)
        local = (x.shape[0], stream.seed if rank == 0 and not stream._explicit else None,
                 offset)
    except Exception as e:      # every rank learns of it: no rank waits for a lost peer
        err = e
    locals_ = check_same_config(cfg, group, WHAT, secret=secret, local=local, error=err)
    sizes = [loc[0] for loc in locals_]
    if sum(sizes) != n:
        raise ValueError(f"features: the ranks' shards hold {sizes} rows, {sum(sizes)} in all; "
                         f"expected n = {n} (the labels' length)")
    seed = stream.seed if stream._explicit else locals_[0][1]
    offset = locals_[0][2]
    t_checked = time.perf_counter()
    if group is None:
        sx, sy, report = _calibrate(mech, n, K, T, m, rates)
    else:
        try:
            payload = ("ok", _calibrate(mech, n, K, T, m, rates)) if rank == 0 else None
        except Exception as e:
            payload = ("error", f"{type(e).__name__}: {e}")
        sx, sy, report = _broadcast_from_0(payload, group, rank)
    t_calibrated = time.perf_counter()

    s_y = min(1.0, mech.clip_y)
    std_x = sx * mech.clip_x / m
    std_y = sy * mech.clip_y / (m * s_y)
    lo = int(np.sum(sizes[:rank]))
    t_lo, t_hi = shard_bounds(T, rank, world)
    out_x = np.empty((t_hi - t_lo, d), x.dtype)
    out_y = np.empty((t_hi - t_lo, K), x.dtype)
    group_ptr, members, select, walk = _population(lab, n, K, m, rates)
    has_members, has_select = members is not None, select is not None
    members = members if has_members else np.zeros(1, np.int64)
    select = select if has_select else np.zeros(1)
    factors = np.full(max(1, x.shape[0]), -1.0)
    unit = unit_roundoff(x.dtype)
    owned = [shard_bounds(T, q, world) for q in range(world)]
    most = max(hi - lo_ for lo_, hi in owned)
    b = max(1, min(most, int(chunk_bytes) // (world * d * x.dtype.itemsize)))
    rounds = -(-most // b)
    b = -(-most // rounds)          # the same rounds, as little padding as possible
    stride = d + K
    part = np.empty((world * b, d), x.dtype)
    count_y = np.empty((world * b, K))
    mine = np.empty((b, d), x.dtype)
    comm_s = 0.0
    for k in range(rounds):
        rows = np.full(world * b, -1, np.int64)
        for q, (a, e) in enumerate(owned):
            a1, e1 = min(a + k * b, e), min(a + (k + 1) * b, e)
            rows[q * b:q * b + e1 - a1] = np.arange(a1, e1)
        partial_rows(x, lo, lab, group_ptr, members, has_members, select, has_select, walk,
                     np.uint64(seed), np.uint64(offset), np.uint64(stride),
                     float(mech.clip_x), unit, factors, rows, part, count_y)
        if group is None:
            mine[:] = part[:b]
        else:
            t0 = time.perf_counter()
            _reduce_scatter(mine, part, group)
            comm_s += time.perf_counter() - t0
        a1 = min(t_lo + k * b, t_hi)
        e1 = min(t_lo + (k + 1) * b, t_hi)
        if e1 > a1:
            noise = np.empty((e1 - a1, stride))
            add_gaussian(noise.reshape(-1), np.uint64(seed), np.uint64(offset + a1 * stride),
                         1.0, False, 1.0)
            finish_rows(mine[:e1 - a1], count_y[rank * b:rank * b + e1 - a1], noise,
                        1.0 / m, float(std_x), float(std_y), out_x[a1 - t_lo:e1 - t_lo],
                        out_y[a1 - t_lo:e1 - t_lo])
        if progress is not None:
            progress(e1 - t_lo, t_hi - t_lo)
    if s_y != 1.0:
        out_y *= s_y
    return ShardedRelease(x=out_x, y=out_y, row_start=t_lo, row_stop=t_hi, sigma_x=sx,
                          sigma_y=sy, report=report, mixup_degree=m, num_samples=T,
                          num_classes=K, clip_x=mech.clip_x, clip_y=mech.clip_y, group=group,
                          stats=dict(rounds=rounds, rows_per_round=b, rows_sampled=T,
                                     reduce_scatter_bytes=0 if group is None else
                                     rounds * part.nbytes, check_s=t_checked - t_start,
                                     accounting_s=t_calibrated - t_checked,
                                     rounds_s=time.perf_counter() - t_calibrated,
                                     reduce_scatter_s=comm_s),
                          _noise_key=dict(seed=seed, offset=offset, draws=T * stride))
