"""The collectives of the row-sharded NTK (:mod:`ncdp_fast.distributed.ntk`): one
call's counted broadcasts, point-to-point sends, all-gathers and rank-ordered sums
(:class:`_Comm`), and the argument agreement every rank runs before any of them."""
from __future__ import annotations

import hashlib

import numpy as np

from .. import _arrays
from ._group import check_same_config, rank_world

class _Comm:
    """The collectives of one call: counted (payload bytes) and with errors that say
    which step failed.  ``group=None`` is one process (every method is local).

    Payload model: a broadcast root sends its buffer to each of the W - 1 others
    and each of them receives it once; an all-gather sends a rank's (padded) part
    to W - 1 ranks and receives W - 1 parts; a send/recv counts its buffer once.
    These are the bytes handed to and taken from ``torch.distributed``, not what
    gloo's algorithms put on the wire.
    """

    def __init__(self, group, what):
        self.group, self.what = group, what
        self.rank, self.world = rank_world(group)
        self.sent = self.received = self.calls = 0
        if group is not None:
            import torch
            import torch.distributed as dist
            self.torch, self.dist = torch, dist

    def _run(self, step, fn):
        self.calls += 1
        try:
            return fn()
        except RuntimeError as e:     # gloo: a peer closed its connection, or the timeout
            raise RuntimeError(
                f"{self.what}: the collective '{step}' failed on rank {self.rank} of "
                f"{self.world}: another rank died, raised, or did not reach it within the "
                f"process group's timeout ({type(e).__name__}: {e})") from e

    def _tensor(self, a):
        return self.torch.from_numpy(np.ascontiguousarray(a))

    def bcast(self, a, src, step):
        """``a`` (NumPy) of rank ``src`` into ``a`` on every rank (in place; returned)."""
        if self.world == 1:
            return a
        t = self.torch.from_numpy(a)          # a is C-contiguous: written in place
        self._run(step, lambda: self.dist.broadcast(t, src=self.dist.get_global_rank(
            self.group, src), group=self.group))
        if self.rank == src:
            self.sent += a.nbytes * (self.world - 1)
        else:
            self.received += a.nbytes
        return a

    def send(self, a, dst, step):
        """Blocking point-to-point send of the C-contiguous ``a`` to group rank ``dst``."""
        t = self.torch.from_numpy(a)
        self._run(step, lambda: self.dist.send(t, dst=self.dist.get_global_rank(
            self.group, dst), group=self.group))
        self.sent += a.nbytes

    def recv(self, a, src, step):
        """Blocking receive into ``a`` from group rank ``src``; returns ``a``."""
        t = self.torch.from_numpy(a)
        self._run(step, lambda: self.dist.recv(t, src=self.dist.get_global_rank(
            self.group, src), group=self.group))
        self.received += a.nbytes
        return a

    def allgather(self, a, step):
        """The list of every rank's ``a`` (same shape and dtype on every rank)."""
        if self.world == 1:
            return [a]
        t = self._tensor(a)
        parts = [self.torch.empty_like(t) for _ in range(self.world)]
        self._run(step, lambda: self.dist.all_gather(parts, t, group=self.group))
        self.sent += t.numel() * t.element_size() * (self.world - 1)
        self.received += t.numel() * t.element_size() * (self.world - 1)
        return [p.numpy() for p in parts]

    def allsum(self, a, step):
        """sum over ranks of ``a``, added in rank order: the same bits on every rank."""
        if self.world == 1:
            return a
        parts = self.allgather(np.asarray(a, dtype=np.float64), step)
        out = parts[0].copy()
        for p in parts[1:]:
            out += p
        return out

    def allgather_rows(self, local, counts, step):
        """Rows of every rank stacked in rank order: (sum counts, ...) from (counts[rank], ...)."""
        if self.world == 1:
            return local
        pad = max(counts)
        buf = np.zeros((pad,) + local.shape[1:], dtype=local.dtype)
        buf[:local.shape[0]] = local
        parts = self.allgather(buf, step)
        return np.concatenate([p[:c] for p, c in zip(parts, counts)])

    def agree(self, flag, step):
        """Rank 0's boolean, on every rank."""
        if self.world == 1:
            return bool(flag)
        return bool(self.bcast(np.array([1 if flag else 0], dtype=np.int64), 0, step)[0])

    def stats(self):
        return dict(bytes_sent=self.sent, bytes_received=self.received, collectives=self.calls)


def _sha256(a):
    a = np.ascontiguousarray(_arrays.to_numpy(a))
    return hashlib.sha256(str((a.dtype.str, a.shape)).encode() + a.tobytes()).hexdigest()[:20]


def _agree_on_arguments(comm, config, error, what, secret=None):
    """Every rank exchanges its configuration (and its own argument error, if any)
    before any other collective: a difference raises on every rank, the rank whose
    arguments were wrong raises its own error; identical errors raise everywhere."""
    # Errors first, on their own: a rank whose arguments are wrong has no config to
    # compare, and the others should read its message, not a list of missing keys.
    try:
        check_same_config({"argument_error": None if error is None else
                           f"{type(error).__name__}: {error}"}, comm.group, what)
    except ValueError as mismatch:
        if error is not None:
            raise error from mismatch
        raise
    if error is not None:
        raise error
    check_same_config(config, comm.group, what, secret=secret)


def _row_counts(comm, n_local):
    counts = comm.allgather(np.array([n_local], dtype=np.int64), "row counts")
    return [int(c[0]) for c in counts]
