"""DP-SGD across the ranks of a torch.distributed process group, equal to one process.

A sharded step is the one-process step cut into pieces (docs/architecture.md,
"Across ranks: DP-SGD"):

* batches: every rank computes the one-process Poisson plan of the whole
  dataset (O(expected batch) per step, the same stream on every rank) and
  keeps the members in its own contiguous shard of the indices, so the union
  over ranks is exactly the one-process batch, empty batches included, and
  every rank runs the same number of steps;
* gradients: each rank clips its own samples (the clip factor of a sample
  depends on that sample alone) and sums them without noise; the sums are
  all-reduced; rank r then adds the noise of its slice [lo_r, hi_r) of the
  flattened gradient -- the draws the one-process step adds to those entries,
  from the same (seed, offset) -- and the slices are all-gathered.  The noise is
  drawn once in total, and the result equals one process's to float rounding
  (the order of the float sums differs).
"""
from __future__ import annotations

from collections import deque

import torch

# torch.distributed.nn.functional binds group.WORLD as default arguments when it is
# first imported, and the first torch.optim optimizer imports it (through
# torch._dynamo).  Imported after init_process_group, those defaults keep the
# default group alive past destroy_process_group; its gloo worker threads can then
# still be freeing a collective's tensors while the interpreter shuts down, and the
# rank dies by SIGABRT at exit (issue 27).  Imported here -- with ncdp_fast.torch,
# before a script initialises its group -- the defaults are None; imported late
# (issue 37), they are set back to None here and wherever a group is resolved.
if torch.distributed.is_available():
    import torch.distributed.nn.functional  # noqa: F401

from ..distributed._group import unpin_world_defaults  # noqa: E402

unpin_world_defaults()

from .. import _stream
from .._clip import LayersClipResult, clip_and_noise_layers
from .._mix import poisson_batches
from .._rng import gaussian
from .._validate import check_int
from ..distributed._group import check_same_config, rank_world, resolve_group, shard_bounds
from .checkpoint import ResumesPass

__all__ = ["DistributedPoissonBatchSampler", "agree_stream", "broadcast_state", "state_tensors",
           "check_not_ddp", "reduce_clip_and_noise", "refuse_with_ranks"]


def _dist():
    import torch.distributed as dist
    return dist


def agree_stream(seed, offset, group, what: str):
    """The noise stream every rank of ``group`` uses: ``seed=None`` -> 64 bits from
    rank 0's OS, broadcast (the key crosses the process group, which must be
    private to the job, as the gradients themselves do); a given seed (or
    :class:`ncdp_fast.NoiseStream`, kept as the same object so that components
    sharing it keep taking disjoint ranges) must be the same on every rank,
    at the same position (the seed compared by salted digest, never shown)."""
    if isinstance(seed, _stream.NoiseStream):
        stream = _stream.resolve(seed, offset)
    else:
        if seed is None:
            box = [_stream.NoiseStream().seed if rank_world(group)[0] == 0 else None]
            _dist().broadcast_object_list(box, src=_dist().get_global_rank(group, 0),
                                          group=group)
            seed = box[0]
        stream = _stream.resolve(seed, offset)
    check_same_config({"offset": stream.position}, group, what, secret={"seed": stream.seed})
    return stream


def check_not_ddp(module, what: str) -> None:
    """Refuse a ``DistributedDataParallel`` model: its backward all-reduces the
    gradients that a private step clips, reduces and noises itself (with
    ``group=``), or, without ``group=``, each rank would noise its own shard and
    the replicas would step apart unseen.  ``what``: the refusing call."""
    if isinstance(module, torch.nn.parallel.DistributedDataParallel):
        raise ValueError(
            f"{what}: module: expected the plain model, got a DistributedDataParallel "
            "wrapper (DDP all-reduces gradients that the private step clips, reduces and "
            "noises itself; without group= each rank would noise only its own samples and "
            "the replicas would diverge). Pass model.module and group=<process group> "
            "(the step is then the one-process step of the union batch)")


def state_tensors(module, params) -> list:
    """``[(name, tensor)]`` that every rank must start from: with ``module``, all of
    its parameters (frozen ones included) and buffers, as DDP broadcasts at
    wrapping; without, ``params`` (a bare optimizer's parameters)."""
    if module is None:
        return [(f"params[{i}]", p) for i, p in enumerate(params)]
    return list(module.named_parameters()) + list(module.named_buffers())


def broadcast_state(tensors, group) -> None:
    """Every rank starts from group rank 0's values, in place (as DDP does at
    wrapping).  Broadcast rather than compared and refused: it is what DDP users
    expect, costs one pass over the state at construction, and copies bits, so a
    frozen layer or a buffer initialised differently per rank (an unseeded
    ``torch.manual_seed``) can no longer make the ranks compute different steps.
    Only rank 0's state crosses the group, which is private to the job."""
    dist = _dist()
    src = dist.get_global_rank(group, 0)
    with torch.no_grad():
        for t in tensors:
            dist.broadcast(t.data, src=src, group=group)


class DistributedPoissonBatchSampler(ResumesPass):
    """The one-process Poisson batches (:class:`ncdp_fast.torch.PoissonBatchSampler`),
    each rank yielding the members in its contiguous shard of ``range(n)``
    (``shard_bounds(n, rank, world)``), as indices into the full dataset.

    The union over ranks of step s's batches is exactly the one-process batch
    of step s for the same seed; every rank yields ``steps`` batches per pass,
    empty ones included (pair the loader with ``collate_with_empty``).
    ``seed=None`` draws the key on rank 0 and broadcasts it.  Privacy meaning:
    sample rate ``sample_rate`` over the whole dataset -- the rate the
    accountant must be given.
    """

    def __init__(self, n: int, *, sample_rate: float, steps: int, seed=None, offset=None,
                 group=None):
        # Not kept: the batches need no collective after construction, and a group
        # held past destroy_process_group aborts the process at exit (GroupRef).
        group = resolve_group(group)
        self.n = check_int(n, "n", 1)
        self.sample_rate, self.batches = sample_rate, check_int(steps, "steps", 0)
        poisson_batches(self.n, sample_rate=sample_rate, steps=0, seed=0, offset=0)  # validate
        check_same_config({"n": self.n, "sample_rate": float(sample_rate), "steps": self.batches},
                          group, "DistributedPoissonBatchSampler")
        self._stream = agree_stream(seed, offset, group, "DistributedPoissonBatchSampler")
        self.rank, self.world = rank_world(group)
        self.lo, self.hi = shard_bounds(self.n, self.rank, self.world)
        self.passes = 0
        # The sizes of this rank's shards as yielded, oldest first: each step
        # of the optimizer must be the next one (DPOptimizer._check_logical).
        self._drawn: deque = deque()

    def __len__(self) -> int:
        return self.batches

    def __iter__(self):
        self.passes += 1
        self._begin_drawn(self._drawn)
        for batch in self._pass(self.n):
            shard = batch[(batch >= self.lo) & (batch < self.hi)].tolist()
            self._drawn.append(len(shard))
            yield shard


def _flatten(grads) -> list:
    parts = []
    for g in grads:
        for t in (g if isinstance(g, tuple) else (g,)):
            if t is not None:
                parts.append(t.reshape(-1))
    return parts


def _unflatten(flat, like) -> list:
    out, at = [], 0
    for g in like:
        if isinstance(g, tuple):
            pieces = []
            for t in g:
                if t is None:
                    pieces.append(None)
                else:
                    pieces.append(flat[at:at + t.numel()].view(t.shape))
                    at += t.numel()
            out.append(tuple(pieces))
        else:
            out.append(flat[at:at + g.numel()].view(g.shape))
            at += g.numel()
    return out


def _step_counts(clipped: int, nonfinite: int, refused: int):
    """The step's first collective's tensor (summed over ranks): clipped and
    non-finite samples, ranks refusing the step."""
    return torch.tensor([clipped, nonfinite, refused], dtype=torch.int64)


def refuse_with_ranks(group, refusal: Exception):
    """Raise this rank's ``refusal`` of its step on every rank of ``group``: it
    joins the step's first collective (the count reduction of
    :func:`reduce_clip_and_noise`) with its refusal flag set, so each other
    rank raises there too, naming the count, instead of waiting for this one
    until the group's timeout.  Never returns."""
    _dist().all_reduce(_step_counts(0, 0, 1), group=group)
    raise refusal


def reduce_clip_and_noise(blocks, *, group, stream, max_norm, noise_multiplier, reduction,
                          expected_batch_size, nan_policy, grad_scale) -> LayersClipResult:
    """One private step of a sharded batch: this rank's ``blocks`` (its samples)
    clipped and summed locally, the sums all-reduced, the noise of the one-process
    step added slice by slice (rank r draws entries [lo_r, hi_r) of the flattened
    gradient, at the one-process draws ``offset + lo_r ...``), the slices gathered.
    Norms are this rank's samples'; ``num_clipped``/``num_nonfinite`` are global.

    A rank that refuses its step (here, or before: :func:`refuse_with_ranks`)
    makes every rank raise at the count reduction, before any noise is drawn,
    so that no rank waits on one that left the step."""
    dist = _dist()
    rank, world = rank_world(group)
    try:
        local = clip_and_noise_layers(blocks, max_norm=max_norm, noise_multiplier=0.0,
                                      seed=_stream.NoiseStream(), reduction="sum",
                                      nan_policy="zero", grad_scale=grad_scale)
        parts = _flatten(local.grads)
        flat = torch.cat(parts) if len(parts) > 1 else parts[0].clone()
    except Exception as refusal:
        refuse_with_ranks(group, refusal)
    counts = _step_counts(local.num_clipped, local.num_nonfinite, 0)
    dist.all_reduce(counts, group=group)
    if counts[2] > 0:
        raise RuntimeError(f"GhostClipper: the step was refused on {int(counts[2])} other "
                           f"rank(s) of the {world} (each raised why); nothing was written "
                           "or drawn")
    if nan_policy == "raise" and counts[1] > 0:
        raise ValueError(f"per-sample gradients of {int(counts[1])} samples (over all {world} "
                         "ranks) are not finite; fix the model or pass nan_policy='zero'")
    P = flat.numel()
    dist.all_reduce(flat, group=group)
    offset = stream.take(P)
    lo, hi = shard_bounds(P, rank, world)
    std = noise_multiplier * max_norm
    inv = 1.0 / expected_batch_size if reduction == "mean" else 1.0
    noise = gaussian(hi - lo, seed=stream.seed, offset=offset + lo, dtype="float64", like=flat)
    mine = ((flat[lo:hi].to(torch.float64) + std * noise) * inv).to(flat.dtype)
    width = -(-P // world)
    chunks = [flat.new_empty(width) for _ in range(world)]
    padded = flat.new_zeros(width)
    padded[:hi - lo] = mine
    dist.all_gather(chunks, padded, group=group)
    full = torch.cat([c[:b - a] for c, (a, b) in
                      zip(chunks, (shard_bounds(P, r, world) for r in range(world)))])
    return LayersClipResult(norms=local.norms, num_clipped=int(counts[0]),
                            num_nonfinite=int(counts[1]), seed=stream.seed, offset=offset,
                            draws=P, grads=_unflatten(full, local.grads))
