"""Poisson batches for torch DataLoaders, empty batches included."""
from __future__ import annotations

from collections import deque

import torch
from torch.utils.data import default_collate

from .._mix import poisson_batches
from .._validate import check_int
from .checkpoint import ResumesPass
from .mechanism import UsesNoiseStream

__all__ = ["PoissonBatchSampler", "collate_with_empty", "loader_settings"]


class PoissonBatchSampler(ResumesPass, UsesNoiseStream):
    """True Poisson sampling for ``DataLoader(dataset, batch_sampler=...)``.

    Each of the ``steps`` batches includes every index 0..n-1 independently with
    probability ``sample_rate`` (:func:`ncdp_fast.poisson_batches`); empty
    batches are yielded as empty lists -- skipping them would change the
    privacy analysis -- so pair the loader with :func:`collate_with_empty`.
    Every pass over the sampler (every epoch) draws fresh batches from the next
    range of the stream; ``seed`` defaults to the OS.
    """

    def __init__(self, n: int, *, sample_rate: float, steps: int, seed=None,
                 offset: int | None = None):
        self.n, self.sample_rate, self.batches = n, sample_rate, check_int(steps, "steps", 0)
        self._init_stream(seed, offset)
        poisson_batches(n, sample_rate=sample_rate, steps=0, seed=self._stream)  # validate
        # Called as each pass begins (the optimizer ends a logical batch left
        # unfinished, which must not be noised with a batch of the new pass).
        self._pass_hooks: list = []
        # The sizes of this pass's batches as yielded, oldest first: under the
        # skip-step queue, each released step must be one of them whole (the
        # optimizer pops them, DPOptimizer._check_logical).
        self._drawn: deque = deque()
        # Batches at the start of the next pass handed out only to be skipped
        # by the caller, stepped on before a checkpoint (the Hugging Face
        # Trainer's skip of a resumed pass): not recorded as drawn.
        self._replayed = 0

    @property
    def steps(self) -> int:
        """Batches per pass (the ``steps`` given)."""
        return self.batches

    def __len__(self) -> int:
        return self.batches

    def __iter__(self):
        for hook in self._pass_hooks:
            hook()
        self._begin_drawn(self._drawn)
        self._steps += 1
        replayed, self._replayed = self._replayed, 0
        for batch in self._pass(self.n):
            if replayed:
                replayed -= 1
            else:
                self._drawn.append(len(batch))
            yield batch.tolist()


def _empty_like(item):
    if isinstance(item, (tuple, list)):
        return type(item)(_empty_like(x) for x in item)
    if isinstance(item, dict):
        return {k: _empty_like(v) for k, v in item.items()}
    t = torch.as_tensor(item)
    return t.new_empty((0, *t.shape))


class _CollateWithEmpty:
    """A class, not a closure, so that DataLoader workers started by spawn or
    forkserver can receive it."""

    def __init__(self, dataset, collate_fn):
        self.dataset = dataset
        self.collate = collate_fn or default_collate
        self.template = None

    def __call__(self, batch):
        if len(batch):
            return self.collate(batch)
        if self.template is None:
            self.template = _empty_like(self.dataset[0])
        return self.template


def collate_with_empty(dataset, collate_fn=None):
    """A collate function that turns an empty batch into correctly shaped empty
    tensors (shape (0, *item_shape) for every field), the shapes and dtypes being
    read once from ``dataset[0]`` (shapes are public; no value is used)."""
    return _CollateWithEmpty(dataset, collate_fn)


def loader_settings(data_loader) -> dict:
    """The DataLoader keyword arguments a loader rebuilt around another batch
    sampler keeps from ``data_loader`` (workers, memory pinning, timeout,
    multiprocessing context, prefetching).  Not its ``generator``: the Poisson
    batches are drawn from the noise stream.  ``prefetch_factor`` only with
    workers, where torch accepts it."""
    settings = dict(num_workers=data_loader.num_workers, pin_memory=data_loader.pin_memory,
                    worker_init_fn=data_loader.worker_init_fn,
                    persistent_workers=data_loader.persistent_workers,
                    timeout=data_loader.timeout,
                    multiprocessing_context=data_loader.multiprocessing_context)
    if data_loader.num_workers > 0:
        settings["prefetch_factor"] = data_loader.prefetch_factor
    return settings
