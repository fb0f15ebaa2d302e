"""BatchMemoryManager: large logical (Poisson) batches trained in physical
batches of bounded size, one private step per logical batch (Opacus's
``opacus.utils.batch_memory_manager`` on ncdp_fast's optimizer), and the
checks of the clipper's accumulator of a logical batch's clipped sums
(``GhostClipper.accumulate_``)."""
from __future__ import annotations

import math
from collections import deque

import numpy as np
from torch.utils.data import DataLoader

from .._validate import check_pos_int, check_positive
from .data import PoissonBatchSampler, loader_settings
from .taps import per_parameter

__all__ = ["BatchMemoryManager", "across_ranks_error", "check_bound_kept", "check_same_parameters",
           "add_clipped", "fold_in"]


class _SplittingSampler:
    """Each logical batch of ``sampler`` as ``ceil(len / max_size)`` chunks of
    near-equal size (Opacus's ``np.array_split``, so both managers train the same
    chunks), tagging each chunk in ``tags`` with whether it ends its logical
    batch.  An empty logical batch is one empty chunk and one step (its noise).

    The tags are read when a chunk reaches the loop (:class:`_PhysicalLoader`),
    not when it is sampled: a loader with workers samples ahead of the loop, and
    the loop may leave a chunk without its step, which a queue of decisions
    consumed by ``step()`` (Opacus's protocol) would silently take for the next
    chunk's."""

    def __init__(self, sampler, max_size: int, tags: deque):
        self.sampler, self.max_size, self.tags = sampler, max_size, tags

    def __len__(self) -> int:
        # Opacus's estimate (the count is random): chunks of the expected batch.
        expected = self.sampler.sample_rate * self.sampler.n
        return math.ceil(len(self.sampler) * expected / self.max_size)

    def __iter__(self):
        for batch in self.sampler:
            if not batch:
                self.tags.append(True)
                yield []
                continue
            chunks = np.array_split(batch, math.ceil(len(batch) / self.max_size))
            for k, chunk in enumerate(chunks):
                self.tags.append(k == len(chunks) - 1)
                yield chunk.tolist()


class _PhysicalLoader(DataLoader):
    """The manager's loader: hands each physical batch's tag to the optimizer as
    the batch reaches the loop, so that the optimizer steps exactly the batch it
    was given and refuses a batch the loop left without its step."""

    def __iter__(self):
        manager = self._manager
        for batch in super().__iter__():
            manager.optimizer._receive_physical(manager.tags.popleft())
            yield batch
        manager.exhausted = True


class BatchMemoryManager:
    """Opacus's ``BatchMemoryManager(data_loader=, max_physical_batch_size=,
    optimizer=)``: a context manager yielding a DataLoader of physical batches
    of at most ``max_physical_batch_size`` samples, each Poisson logical batch
    of ``data_loader`` split into consecutive physical batches.

    The loop is unchanged (forward, backward, ``optimizer.step()``,
    ``optimizer.zero_grad()`` per physical batch): the optimizer clips every
    physical batch's samples and accumulates their clipped sum, and the step of
    a logical batch's last physical batch noises the whole logical batch once
    (one accountant step).  An empty logical batch is one empty physical batch
    and one noise-only step.  Activation memory is that of a physical batch;
    the accumulator is one parameter-sized tensor per trainable parameter.

    ``data_loader`` and ``optimizer`` must come from the same
    ``PrivacyEngine.make_private`` (one process, no ``group=``).  Leaving the
    context (a loop ended early, an exception) discards an unfinished logical
    batch: its clipped sums were never released, so nothing is accounted.

    Privacy meaning: the physical batches of a logical batch hold disjoint
    samples and are trained in order (the returned loader keeps ``in_order``),
    so each logical step is the Gaussian mechanism of the one-batch step, its
    sensitivity ``max_grad_norm``; the mean reduction divides by the logical
    expected batch size.
    """

    def __init__(self, *, data_loader: DataLoader, max_physical_batch_size: int, optimizer):
        from .engine import DPOptimizer
        if not isinstance(optimizer, DPOptimizer):
            raise TypeError(f"optimizer: expected the DPOptimizer returned by "
                            f"ncdp_fast.torch.PrivacyEngine.make_private, got "
                            f"{type(optimizer).__name__}")
        if optimizer.clipper.group is not None:
            raise ValueError(
                "optimizer: expected a one-process DPOptimizer, got one made with group= "
                "(ranks would split their shards of a logical batch into different numbers of "
                "physical batches, and their steps would not pair); train across ranks "
                "without BatchMemoryManager")
        if not isinstance(data_loader, DataLoader):
            raise TypeError(f"data_loader: expected the DataLoader returned by make_private, "
                            f"got {type(data_loader).__name__}")
        sampler = data_loader.batch_sampler
        if not isinstance(sampler, PoissonBatchSampler) or \
                not any(sampler is s for s in optimizer._samplers):
            raise ValueError(
                "data_loader: expected the Poisson loader returned by the same make_private "
                f"call as the optimizer, got a loader whose batch sampler is "
                f"{type(sampler).__name__} (another loader's batches are not the ones the "
                "accountant records); pass make_private's data_loader")
        self.data_loader = data_loader
        self.optimizer = optimizer
        self.max_physical_batch_size = check_pos_int(max_physical_batch_size,
                                                     "max_physical_batch_size")

    def __enter__(self) -> DataLoader:
        loader = self.data_loader
        self.tags: deque = deque()
        self.exhausted = False
        self.optimizer._manage_physical(True)
        # Not in_order=False: a logical batch's last chunk must be stepped after
        # its others, and the tags are read in the sampler's order.
        physical = _PhysicalLoader(loader.dataset,
                                   batch_sampler=_SplittingSampler(loader.batch_sampler,
                                                                   self.max_physical_batch_size,
                                                                   self.tags),
                                   collate_fn=loader.collate_fn, **loader_settings(loader))
        physical._manager = self
        return physical

    def __exit__(self, exc_type, *exc) -> None:
        # A batch the loop received and left without its step, at the end of a
        # pass that ran to its end: an empty logical batch skipped by a guard
        # (`if len(x) == 0: continue`) is the common case. Nothing of it was
        # released; refused all the same, since whether a step happens must not
        # depend on the batch (an empty batch's noise-only step is its release).
        unstepped = self.optimizer._manage_physical(False)
        self.optimizer._end_logical_batches()
        if unstepped and self.exhausted and exc_type is None:
            raise RuntimeError(_UNSTEPPED)


_UNSTEPPED = (
    "BatchMemoryManager: a physical batch reached the loop and was left without its "
    "optimizer.step() (a guard such as `if len(x) == 0: continue`?). Every physical batch "
    "must be stepped, the empty one of an empty logical batch included: its step is the "
    "logical batch's noise-only release, and skipping it would make the released steps "
    "depend on the batch. The logical batch was discarded, nothing of it released")


def across_ranks_error() -> ValueError:
    """The refusal of accumulation across ranks (one process only)."""
    return ValueError(
        "GhostClipper: accumulate_ (a skipped step, BatchMemoryManager) with group=: "
        "expected one process; the ranks' shards of a logical batch split into "
        "different numbers of physical batches, so their steps would not pair. Train "
        "across ranks without BatchMemoryManager, or with a smaller logical batch")


def check_bound_kept(accumulated: dict, bound: float, value) -> None:
    """Refuse a new ``max_grad_norm`` ``value`` (``bound`` now) while physical
    batches are ``accumulated``."""
    if accumulated and check_positive(value, "max_grad_norm") != bound:
        # The logical batch's earlier physical batches were clipped at the old
        # bound: noise at a smaller new one would not cover their samples.
        raise ValueError(
            f"max_grad_norm: expected {bound!r} until the logical batch's "
            f"step (physical batches accumulated at it: BatchMemoryManager), got "
            f"{value!r}; change it between logical steps (a grad-clip scheduler steps "
            "per epoch), or discard_accumulated() first")


def check_same_parameters(accumulated: dict, entries) -> None:
    """The step's ``entries`` [(tap, names, block)] must privatize the
    parameters ``accumulated`` holds (a sum over part of the logical batch)."""
    if accumulated:
        now = {tap.full(n) for tap, names, _ in entries
               for n in names}
        if now != set(accumulated):
            raise RuntimeError(
                "GhostClipper: the trainable parameters changed within one logical batch "
                f"(accumulated: {sorted(accumulated)}, now: {sorted(now)}); freeze "
                "or unfreeze parameters between logical steps, or discard_accumulated()")


def add_clipped(accumulated: dict, entries, grads) -> None:
    """Add a physical batch's clipped sums ``grads`` (of ``entries``) to
    ``accumulated`` {parameter name: sum}, in place."""
    for tap, n, g in per_parameter(entries, grads):
        name = tap.full(n)
        held = accumulated.get(name)
        accumulated[name] = g if held is None else held.add_(g)


def fold_in(accumulated: dict, name: str, g, loss_reduction: str, expected_batch_size):
    """The logical step's private gradient of parameter ``name``: ``g``, the clip
    op's for the last physical batch, plus the earlier ones' ``accumulated``
    clipped sum (in place; ``g`` itself when nothing was accumulated)."""
    held = accumulated.get(name)
    if held is None:
        return g
    # The op returned inv * (S_last + noise); the earlier physical
    # batches' clipped sums take the same division.
    inv = 1.0 / expected_batch_size if loss_reduction == "mean" else 1.0
    return g.add_(held, alpha=inv)
