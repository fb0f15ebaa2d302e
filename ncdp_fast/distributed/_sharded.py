r"""The output of the sharded release: :class:`ShardedRelease`, one rank's rows of it,
and the two ways to assemble the whole: :meth:`~ShardedRelease.gather` (a
:class:`~ncdp_fast.release.Released` on one rank) and :meth:`~ShardedRelease.save`
(the release directory -- ``x.npy``, ``y.npy`` in row order, ``report.json`` and a
checksum manifest -- written by rank 0 from rows streamed to it in bounded chunks;
no shared filesystem needed)."""
from __future__ import annotations

import datetime as _dt
import json
from dataclasses import InitVar, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .._stream import SecretSlot
from ..release.released import Released
from ..release.report import PrivacyReport
from ._group import rank_world, shard_bounds

__all__ = ["ShardedRelease"]


def _p2p(group):
    import torch
    import torch.distributed as dist
    return torch, dist


@dataclass(frozen=True, eq=False)
class ShardedRelease:
    r"""This rank's rows of a sharded NeuroMixGDP release.

    Attributes:
        x: (t_hi - t_lo, d) released features of output rows ``[row_start, row_stop)``,
            NumPy, the features' dtype.  Publishable (together with the other ranks').
        y: (t_hi - t_lo, K) released noisy soft labels of the same rows.
        row_start, row_stop: this rank's output rows (``shard_bounds(T, rank, W)``).
        sigma_x, sigma_y, report, mixup_degree, num_samples, num_classes, clip_x,
            clip_y: as :class:`~ncdp_fast.release.Released`; the report is the
            one-process report (the same on every rank).
        group: the process group (``None``: one process).
        stats: what this rank did: ``rounds``, ``rows_per_round`` (b, per owner),
            ``reduce_scatter_bytes`` (bytes this rank handed to reduce-scatters: W b d
            elements per round; a ring sends (W-1)/W of them), ``rows_sampled``, and
            seconds: ``check_s`` (arguments and the config exchange), ``accounting_s``
            (rank 0's calibration and report, the others' wait for it), ``rounds_s``
            (sampling, sums, reduce-scatters, noise), ``reduce_scatter_s`` (in the
            collective, waiting for the slowest rank included).

    The noise key is kept on the object only (never pickled or saved), as for
    :class:`Released`.
    """
    x: Any
    y: Any
    row_start: int
    row_stop: int
    sigma_x: float
    sigma_y: float
    report: PrivacyReport
    mixup_degree: float
    num_samples: int
    num_classes: int
    clip_x: float
    clip_y: float
    group: Any = field(default=None, repr=False)
    stats: dict = field(default_factory=dict, repr=False)
    created: str = field(default_factory=lambda: _dt.datetime.now(_dt.timezone.utc)
                         .strftime("%Y-%m-%dT%H:%M:%SZ"))
    # Init-only and kept off the instance's __dict__ (_stream.SecretSlot), as
    # Released's: never in repr, ==, dataclasses.asdict/astuple, vars() (the
    # fifth audit found it there: a logged vars() gave the noise away), pickles
    # or copies.
    _noise_key: InitVar[Any] = None

    def __post_init__(self, _noise_key):
        _NOISE_KEY.put(self, _noise_key)

    def __getstate__(self):
        return dict(self.__dict__, group=None)

    def __setstate__(self, state):
        for k, v in state.items():
            object.__setattr__(self, k, v)

    def _released(self, x, y) -> Released:
        return Released(x=x, y=y, sigma_x=self.sigma_x, sigma_y=self.sigma_y,
                        report=self.report, mixup_degree=self.mixup_degree,
                        num_samples=self.num_samples, num_classes=self.num_classes,
                        clip_x=self.clip_x, clip_y=self.clip_y, created=self.created,
                        _noise_key=self._noise_key)

    def _stream_rows(self, dst: int, sink, chunk_rows: int):
        """Send every rank's rows to group rank ``dst`` in chunks; on ``dst``
        ``sink(t0, x_rows, y_rows)`` receives them in row order (collective)."""
        rank, world = rank_world(self.group)
        T, d, K = self.num_samples, self.x.shape[1], self.y.shape[1]
        if self.group is None:
            sink(0, self.x, self.y)
            return
        torch, dist = _p2p(self.group)
        peer = dist.get_global_rank(self.group, dst)
        for q in range(world):
            lo, hi = shard_bounds(T, q, world)
            for a in range(lo, hi, chunk_rows):
                e = min(hi, a + chunk_rows)
                if q == dst:
                    if rank == dst:
                        sink(a, self.x[a - lo:e - lo], self.y[a - lo:e - lo])
                elif rank == q:
                    dist.send(torch.from_numpy(np.ascontiguousarray(self.x[a - lo:e - lo])),
                              dst=peer, group=self.group)
                    dist.send(torch.from_numpy(np.ascontiguousarray(self.y[a - lo:e - lo])),
                              dst=peer, group=self.group)
                elif rank == dst:
                    src = dist.get_global_rank(self.group, q)
                    bx = np.empty((e - a, d), self.x.dtype)
                    by = np.empty((e - a, K), self.y.dtype)
                    dist.recv(torch.from_numpy(bx), src=src, group=self.group)
                    dist.recv(torch.from_numpy(by), src=src, group=self.group)
                    sink(a, bx, by)

    def gather(self, dst: int = 0) -> Released | None:
        """The whole release as a :class:`Released` (NumPy (T, d) and (T, K)) on group
        rank ``dst``, ``None`` on the others (collective: every rank calls it).
        Memory on ``dst``: the full T x (d + K)."""
        rank, _ = rank_world(self.group)
        T, d, K = self.num_samples, self.x.shape[1], self.y.shape[1]
        full = (np.empty((T, d), self.x.dtype), np.empty((T, K), self.y.dtype)) \
            if rank == dst else None

        def sink(t0, bx, by):
            full[0][t0:t0 + len(bx)] = bx
            full[1][t0:t0 + len(by)] = by
        self._stream_rows(dst, sink, max(1, (1 << 24) // max(1, 4 * (d + K))))
        return self._released(*full) if full is not None else None

    def save(self, out_dir, *, overwrite: bool = False, key: bytes | None = None,
             chunk_bytes: int = 1 << 24) -> Path:
        """Write the release directory ``out_dir``: ``x.npy`` (T, d), ``y.npy`` (T, K)
        in row order, ``report.json`` (the release's metadata and privacy report; no
        noise key) and ``manifest.json`` (each file's size and SHA-256, and with
        ``key`` -- the publisher's secret, bytes, at least 16 -- an HMAC-SHA256);
        ``ncdp_fast.release.load(out_dir, key=...)`` reads and verifies it.  Rank 0
        writes, from rows the others stream to it in chunks of about ``chunk_bytes``
        (memory bounded; no shared filesystem needed); collective.

        Before any row moves, rank 0 checks ``out_dir`` (a release there without
        ``overwrite``, another run writing it, a file of that name: an error on every
        rank) and takes its lock; files are written as ``*.part`` and renamed when all
        are complete, and any failure (here or on another rank) removes the ``.part``
        files (layout and leftovers of a killed process: ``release/_directory.py``)."""
        from ..release._directory import DirectoryWriter
        from ..release.released import _check_key
        rank, _ = rank_world(self.group)
        writer, problem = None, None
        if rank == 0:
            try:
                if key is not None:
                    _check_key(key)
                writer = DirectoryWriter(out_dir, overwrite=overwrite).open()
            except (OSError, TypeError, ValueError) as e:
                if self.group is None:
                    raise
                problem = (type(e).__name__, str(e))
        if self.group is not None:          # every rank raises, none waits for rank 0
            box = [problem]
            _, dist = _p2p(self.group)
            dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0),
                                       group=self.group)
            problem = box[0]
        if problem:
            cls = {c.__name__: c for c in (FileExistsError, NotADirectoryError, TypeError,
                                           ValueError)}.get(problem[0], OSError)
            raise cls(problem[1] if rank == 0 else f"rank 0: {problem[1]}")
        return self.write(out_dir, writer, key=key, chunk_bytes=chunk_bytes)

    def write(self, out_dir, writer, *, key: bytes | None = None,
              chunk_bytes: int = 1 << 24) -> Path:
        """:meth:`save` after its checks: ``writer`` is rank 0's opened
        ``DirectoryWriter`` for ``out_dir`` (None on the other ranks).  On any
        exception rank 0 aborts the writer (its ``.part`` files and lock go)."""
        rank, _ = rank_world(self.group)
        if rank == 0 and getattr(writer, "out", None) != Path(out_dir):
            raise TypeError(f"writer: expected on rank 0 the opened DirectoryWriter of "
                            f"{out_dir} (see save()), got {type(writer).__name__}")
        T, d, K = self.num_samples, self.x.shape[1], self.y.shape[1]
        try:
            maps = None
            if rank == 0:
                maps = (writer.array("x.npy", self.x.dtype, (T, d)),
                        writer.array("y.npy", self.y.dtype, (T, K)))

            def sink(t0, bx, by):
                maps[0][t0:t0 + len(bx)] = bx
                maps[1][t0:t0 + len(by)] = by
            self._stream_rows(0, sink,
                              max(1, int(chunk_bytes) // (self.x.dtype.itemsize * (d + K))))
            if rank != 0:
                return Path(out_dir)
            meta_s = json.dumps(self._released(None, None).metadata(), indent=1,
                                sort_keys=True)
            writer.text("report.json", meta_s)
            del maps
            return writer.commit(meta_s, key)
        except BaseException:
            if writer is not None:
                writer.abort()
            raise


# Added after the class is made: a property named like the InitVar would be its default.
_NOISE_KEY = SecretSlot()
ShardedRelease._noise_key = property(lambda self: _NOISE_KEY.get(self),
                                     doc="The secret noise key of this release (this "
                                         "rank's object only).")
