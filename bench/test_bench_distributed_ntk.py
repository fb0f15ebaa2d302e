"""Benchmark of the row-sharded NTK Gram and its lambda_min across gloo ranks
(``ncdp_fast.distributed.ntk``; report ``bench_distributed_ntk``).

Workload: a two-layer ReLU network, d = 64, width N (as ``test_bench_ntk``'s
lambda_min: more parameters than rows, so K is positive definite), n inputs on the
unit sphere, float64; shapes (n, d, N): smallest (64, 8, 32), quick (1000, 64, 1024)
and (2000, 64, 1024), full (4000, 64, 1024) and (8000, 64, 1024) (the distributed
solver needs a Krylov space of a large fraction of n, and n = 4000 is where the
one-process lambda_min leaves eigh).  One call = the
Gram and its lambda_min.  Methods:

* ``one_process``: what a user runs today, ``ncdp_fast.ntk_gram`` then
  ``ncdp_fast.ntk.lambda_min`` (method "auto": eigh up to n = 4000, else Cholesky
  shift-invert block Lanczos), in one worker process with all the machine's threads;
* ``sharded_w1``: ``ncdp_fast.distributed.ntk_gram`` + ``ntk_lambda_min`` in one
  process (no group: the same code with W = 1, its solver is block Lanczos on K);
* ``sharded_w2``: the same on 2 gloo ranks on 127.0.0.1, each with half the threads.

Every method runs in persistent worker processes started once per module (a 1-process
pool for the first two methods, a 2-rank pool for the last, started together; spawned
with the thread counts in their environment, so numpy/torch/numba pools are sized
before import); a timed call sends the job to every worker and waits for all of them,
so the time is the wall time of the slowest rank plus the queue round trip.
extra_info holds per rank: the Gram and solver seconds, the peak resident-set growth
during one untimed call (sampled every millisecond in the worker after malloc_trim),
measured in the first round (after one warm-up call) and reported with every round,
the payload bytes sent and received (counted by the module's collectives; see
``ncdp_fast/distributed/ntk.py``), and the solver's value, residual and steps.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue as _queue
import socket
import time
import traceback
from datetime import timedelta

import numpy as np
import pytest

from _common import cases, measure

SHAPES = {"full": [(4000, 64, 1024), (8000, 64, 1024)],
          "quick": [(1000, 64, 1024), (2000, 64, 1024)],
          "smallest": [(64, 8, 32)]}
METHODS = {"one_process": 1, "sharded_w1": 1, "sharded_w2": 2}
THREADS = max(1, os.cpu_count() or 1)
JOB_TIMEOUT = 1800.0


def CASES(size, device):
    work = [(f"({n}, {d}, {N}) float64", dict(n=n, d=d, N=N)) for n, d, N in SHAPES[size]]
    return {"test_distributed_ntk": cases("bench_distributed_ntk", work, list(METHODS))
            if device == "cpu" else []}


# --------------------------------------------------------------------- the workers

def _problem(n, d, N, rank, world):
    """The inputs of this rank (its shard_bounds rows) and the weights, from seed 0."""
    from ncdp_fast.distributed import shard_bounds
    rng = np.random.default_rng(0)
    W = [rng.standard_normal((N, d)) / np.sqrt(d), rng.standard_normal((1, N)) / np.sqrt(N)]
    x = rng.standard_normal((n, d))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    lo, hi = shard_bounds(n, rank, world)
    return x[lo:hi], W


def _run_job(rank, world, job):
    import ncdp_fast as nf
    from ncdp_fast import ntk
    from ncdp_fast.distributed import ntk_gram, ntk_lambda_min
    x, W = _problem(job["n"], job["d"], job["N"], rank, world)
    gram_stats, solver_stats = {}, {}
    t0 = time.perf_counter()
    if job["method"] == "one_process":
        K = nf.ntk_gram(x, W, activation="relu")
        t1 = time.perf_counter()
        r = ntk.lambda_min(K)
    else:
        K = ntk_gram(x, W, activation="relu", stats=gram_stats)
        t1 = time.perf_counter()
        r = ntk_lambda_min(K, stats=solver_stats)
    t2 = time.perf_counter()
    return dict(gram_s=t1 - t0, lambda_s=t2 - t1, value=float(r.value),
                residual=float(r.residual), solver=r.method, rows=int(K.shape[0]),
                steps=solver_stats.get("steps"),
                bytes_sent=gram_stats.get("bytes_sent", 0) + solver_stats.get("bytes_sent", 0),
                bytes_received=gram_stats.get("bytes_received", 0)
                + solver_stats.get("bytes_received", 0),
                gram_bytes_received=gram_stats.get("bytes_received", 0))


def _worker(rank, world, port, cmd, res):
    try:
        if world > 1:
            import torch.distributed as dist
            os.environ["GLOO_SOCKET_IFNAME"] = "lo"
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                    world_size=world, timeout=timedelta(seconds=600))
        import torch
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        while True:
            job = cmd.get()
            if job is None:
                break
            try:
                if job.get("memory"):
                    from _common import _RssPeak
                    try:
                        import ctypes
                        ctypes.CDLL(None).malloc_trim(0)
                    except (AttributeError, OSError):
                        pass
                    with _RssPeak() as rss:
                        out = _run_job(rank, world, job)
                    out["peak_extra_mb"] = rss.extra_mb
                else:
                    out = _run_job(rank, world, job)
                res.put((rank, True, out))
            except BaseException:     # noqa: BLE001 - back to the parent
                res.put((rank, False, traceback.format_exc()))
    except BaseException:             # noqa: BLE001
        res.put((rank, False, traceback.format_exc()))
    # Leave without the interpreter's teardown of torch and the gloo group (seconds on
    # a loaded machine): everything this worker had to say is flushed first.
    res.close()
    res.join_thread()
    os._exit(0)


class RankPool:
    """``world`` worker processes (a gloo group when world > 1) that run jobs in step."""

    def __init__(self, world):
        self.world = world
        threads = str(max(1, THREADS // world))
        ctx = mp.get_context("spawn")
        self.cmd = [ctx.Queue() for _ in range(world)]
        self.res = ctx.Queue()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        saved = {k: os.environ.get(k) for k in _THREAD_VARS}
        os.environ.update({k: threads for k in _THREAD_VARS})
        try:
            self.procs = [ctx.Process(target=_worker, args=(r, world, port, self.cmd[r],
                                                            self.res), daemon=True)
                          for r in range(world)]
            for p in self.procs:
                p.start()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def run(self, job):
        for q in self.cmd:
            q.put(job)
        got, deadline = {}, time.monotonic() + JOB_TIMEOUT
        while len(got) < self.world:
            try:
                rank, ok, value = self.res.get(timeout=1.0)
            except _queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if p.exitcode is not None]
                if dead or time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError(f"bench worker(s) {dead or 'all'} died or timed out")
                continue
            if not ok:
                self.close()
                raise RuntimeError(f"bench worker rank {rank} failed:\n{value}")
            got[rank] = value
        return [got[r] for r in range(self.world)]

    def close(self):
        for q in self.cmd:
            try:
                q.put(None)
            except (ValueError, OSError):
                pass
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)


# Peak resident-set growth per rank of one untimed call, measured in the first round
# of each (workload, method) and reported with every round.
_PEAK_MB: dict = {}

_THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                "NUMBA_NUM_THREADS")


@pytest.fixture(scope="module")
def pools():
    """One pool per world size, all started at once (their imports overlap); the
    one-process methods share the 1-process pool."""
    started = {}

    def get(world):
        if not started:
            started.update({w: RankPool(w) for w in sorted(set(METHODS.values()))})
        return started[world]
    yield get
    for p in started.values():
        p.close()


def test_distributed_ntk(benchmark, case, pools):
    world = METHODS[case.method]
    pool = pools(world)
    job = dict(case.params, method=case.method)

    def fn():
        return pool.run(job)
    if not benchmark.disabled:
        key = (case.workload, case.method)
        if key not in _PEAK_MB:                     # the first round: warm up, then memory
            fn()                                    # imports, numba compilation, BLAS pools
            _PEAK_MB[key] = [r["peak_extra_mb"] for r in pool.run(dict(job, memory=True))]
        benchmark.extra_info.update(peak_extra_mb_per_rank=_PEAK_MB[key],
                                    peak_extra_mb=max(_PEAK_MB[key]))
    out = measure(benchmark, case, fn, device="cpu", repeats=1, warmup=0, memory=False,
                  first_call=False, processes=world, threads_per_process=max(1, THREADS // world))
    benchmark.extra_info.update(
        gram_s=max(r["gram_s"] for r in out), lambda_s=max(r["lambda_s"] for r in out),
        value=out[0]["value"], residual=out[0]["residual"], solver=out[0]["solver"],
        steps=out[0]["steps"], rows_per_rank=[r["rows"] for r in out],
        bytes_sent_per_rank=[r["bytes_sent"] for r in out],
        bytes_received_per_rank=[r["bytes_received"] for r in out],
        gram_bytes_received_per_rank=[r["gram_bytes_received"] for r in out])
    assert len({r["value"] for r in out}) == 1          # every rank, the same lambda_min
