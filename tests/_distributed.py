"""Spawn W gloo processes on 127.0.0.1 for the tests of ncdp_fast.distributed.

``spawn(fn, world, *args)`` starts ``world`` processes (multiprocessing
"forkserver": forked from one clean server process that imported torch once, so
no thread of the test process is forked and torch is not imported again per
child), each of which joins a gloo group
over TCP on 127.0.0.1 only (``GLOO_SOCKET_IFNAME=lo``) with a bounded collective
timeout, calls ``fn(rank, world, *args)`` and sends back its (picklable) result.
The parent waits at most ``timeout`` seconds in all; a child that raises, dies
without a word or outlives the deadline becomes a :class:`RankFailure` in the
parent carrying the child's traceback (or exit code), and every child still
running is terminated.  ``fn`` must be importable (a module-level function).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue as _queue
import socket
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

__all__ = ["spawn", "spawn_outcomes", "free_port", "RankFailure", "Outcome", "torchrun"]


@dataclass
class Outcome:
    """What one rank did: ``status`` is "ok", "error" (raised), "died" or "hung"."""
    rank: int
    status: str
    value: Any = None
    error: str = ""          # the child's formatted traceback, or what happened
    exitcode: int | None = None


class RankFailure(RuntimeError):
    """Some rank did not return; the message holds each failing rank's traceback."""

    def __init__(self, outcomes: list[Outcome]):
        self.outcomes = outcomes
        bad = [o for o in outcomes if o.status != "ok"]
        text = "\n".join(f"--- rank {o.rank}: {o.status} (exit code {o.exitcode})\n{o.error}"
                         for o in bad)
        super().__init__(f"{len(bad)} of {len(outcomes)} ranks failed:\n{text}")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Imported once by the fork server, so that no child pays for them (numba's
# thread pools start on first use, after the fork, so forking after these is safe).
PRELOAD = ["numpy", "torch", "torch.distributed", "ncdp_fast", "ncdp_fast.release",
           "ncdp_fast.distributed._release"]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _child(fn, rank, world, port, args, pg_timeout, q, torchrun_env):
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    try:
        if torchrun_env:        # what torchrun sets; fn initialises the group itself
            os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                              LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(port))
            q.put((rank, "ok", fn(rank, world, *args), ""))
            return
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=pg_timeout))
        try:
            value = fn(rank, world, *args)
        finally:
            dist.destroy_process_group()
        q.put((rank, "ok", value, ""))
    except BaseException:     # noqa: BLE001 - everything goes back to the parent
        q.put((rank, "error", None, traceback.format_exc()))


def spawn_outcomes(fn: Callable, world: int, *args, timeout: float = 60.0,
                   pg_timeout: float = 20.0, torchrun_env: bool = False) -> list[Outcome]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; one :class:`Outcome` per rank.

    ``timeout``: seconds for the whole run (start-up included) before the children
    still running are terminated and reported "hung"; ``pg_timeout``: the process
    group's collective timeout (a rank waiting on a dead peer raises after it).
    ``torchrun_env=True``: no group is initialised; the child gets the environment
    torchrun would set (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR =
    127.0.0.1, MASTER_PORT) and ``fn`` initialises (and destroys) the group itself."""
    ctx = _context()
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world, port, args, pg_timeout, q,
                                                    torchrun_env),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    got: dict[int, Outcome] = {}
    deadline = time.monotonic() + timeout
    dead_since: dict[int, float] = {}
    while len(got) < world and time.monotonic() < deadline:
        try:
            rank, status, value, err = q.get(timeout=0.1)
            got[rank] = Outcome(rank, status, value, err)
            continue
        except _queue.Empty:
            pass
        now = time.monotonic()
        for r, p in enumerate(procs):
            if r not in got and p.exitcode is not None:
                # its message may still be in the pipe: give it a moment
                if now - dead_since.setdefault(r, now) > 2.0:
                    got[r] = Outcome(r, "died", error=f"exited with code {p.exitcode} "
                                     "without a result", exitcode=p.exitcode)
    for r, p in enumerate(procs):
        if r not in got:
            got[r] = Outcome(r, "hung", error=f"still running after {timeout} s; terminated")
        p.join(timeout=0.5 if got[r].status != "hung" else 0)
        if p.is_alive():
            p.terminate()
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        if got[r].exitcode is None:
            got[r].exitcode = p.exitcode
    q.close()
    return [got[r] for r in range(world)]


def spawn(fn: Callable, world: int, *args, timeout: float = 60.0,
          pg_timeout: float = 20.0, torchrun_env: bool = False) -> list:
    """Like :func:`spawn_outcomes` but returns the ranks' values, or raises
    :class:`RankFailure` (with the children's tracebacks) if any rank failed."""
    outs = spawn_outcomes(fn, world, *args, timeout=timeout, pg_timeout=pg_timeout,
                          torchrun_env=torchrun_env)
    if any(o.status != "ok" for o in outs):
        raise RankFailure(outs)
    return [o.value for o in outs]


def torchrun(args, world: int, *, timeout: float = 120.0, env: dict | None = None):
    """``python -m torch.distributed.run --standalone --nproc-per-node world *args``: the
    real launcher (gloo on 127.0.0.1, one numba/OpenMP thread per rank); returns the
    ``subprocess.CompletedProcess`` (its return code is 0 only when every rank exited
    0; stdout and stderr as text).  ``timeout``: seconds before it is killed."""
    import subprocess
    import sys
    full = dict(os.environ, GLOO_SOCKET_IFNAME="lo", NUMBA_NUM_THREADS="1",
                OMP_NUM_THREADS="1", **(env or {}))
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc-per-node={world}", *map(str, args)],
                          env=full, capture_output=True, text=True, timeout=timeout)
