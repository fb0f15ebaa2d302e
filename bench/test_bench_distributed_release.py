"""Benchmark of the sharded NeuroMixGDP release on torch.distributed (gloo, 127.0.0.1;
``ncdp_fast.distributed.release_sharded``; report ``bench_distributed_release``).

Configurations (issue #17): n = T = 60000, d = 3969 and n = T = 10^6, d = 512; K = 10,
m = 64, epsilon = 1, delta = 1e-5, Poisson sampling, synthetic float32 features
(row i drawn from its own block generator, so a rank builds only its shard and the
data do not depend on the number of ranks).  Methods: ``W1`` (one process: the same
code with no communication) and ``W2`` (two processes).  The machine's cores are
shared among the ranks (numba threads = cores / W), so W2 measures the cost of
sharding on one machine, not a speed-up; docs/distributed_release_scaling.md carries
the per-rank figures to 8 GPUs on 2 nodes.

Workers are started once per (configuration, W) -- gloo group, shard, compilation --
and each timed call is one release on every rank (a "go" to each worker and the
wait for all of them).  Per rank, in extra_info: the release's wall time on the
rank, the resident set before and the peak during the call (sampled every ms),
the shard's bytes, the bytes handed to reduce-scatter, the bytes the process
wrote (``/proc/self/io`` wchar: on this machine the gloo socket traffic, nothing
else writes during the call) and the call's phases (``ShardedRelease.stats``:
config exchange, accounting on rank 0, rounds, time inside the reduce-scatters);
the accounting is also timed once before, as a first call (imports included).
"""
from __future__ import annotations

import os
import queue
import sys
import time
from pathlib import Path

from _common import cases, measure

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

SHAPES = {"full": [dict(n=60000, T=60000, d=3969, K=10, m=64),
                   dict(n=1_000_000, T=1_000_000, d=512, K=10, m=64)],
          "quick": [dict(n=6000, T=6000, d=1024, K=10, m=64),
                    dict(n=100_000, T=100_000, d=128, K=10, m=64)],
          "smallest": [dict(n=200, T=200, d=16, K=10, m=8)]}
BLOCK = 4096            # rows per generator block of the synthetic features
TIMEOUT = 1800          # seconds any wait on a worker may take


def _label(s):
    return f"n=T={s['n']}, d={s['d']}, K={s['K']}, m={s['m']}, Poisson"


def CASES(size, device):
    return {"test_distributed_release": cases(
        "bench_distributed_release", [(_label(s), s) for s in SHAPES[size]], ["W1", "W2"])}


def shard(cfg, lo, hi):
    """Rows [lo, hi) of the synthetic (n, d) float32 features and all n labels."""
    import numpy as np
    X = np.empty((hi - lo, cfg["d"]), np.float32)
    for b in range(lo // BLOCK, -(-hi // BLOCK)):
        rows = np.random.default_rng([17, b]).standard_normal((BLOCK, cfg["d"]),
                                                              dtype=np.float32)
        a, e = max(lo, b * BLOCK), min(hi, (b + 1) * BLOCK)
        X[a - lo:e - lo] = rows[a - b * BLOCK:e - b * BLOCK]
    y = np.random.default_rng(18).integers(0, cfg["K"], cfg["n"])
    return X, y


def _wchar():
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("wchar")).split()[1])


def _worker(rank, world, port, cfg, threads, inq, outq):
    """One rank: join the group, build the shard, then one release per "go"."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    try:
        import datetime

        import numba
        import numpy as np
        import torch.distributed as dist
        from _common import _RssPeak, current_rss_mb

        from ncdp_fast.distributed import release_sharded, shard_bounds
        from ncdp_fast.release import NeuroMixGDP
        numba.set_num_threads(threads)
        group = None
        if world > 1:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                    world_size=world,
                                    timeout=datetime.timedelta(seconds=TIMEOUT))
            group = dist.group.WORLD
        X, y = shard(cfg, *shard_bounds(cfg["n"], rank, world))
        mech = NeuroMixGDP(epsilon=1.0, delta=1e-5, mixup_degree=cfg["m"],
                           num_samples=cfg["T"], seed=1)
        t0 = time.perf_counter()
        mech.noise(cfg["n"], cfg["K"])
        accounting_s = time.perf_counter() - t0
        # Load the compiled kernels (numba's cache) with a tiny release on the group.
        warm = NeuroMixGDP(epsilon=1.0, delta=1e-5, mixup_degree=2, accountant="clt", seed=2)
        warm.value_discretization_interval = 1e-2
        release_sharded(warm, X[:4], np.arange(4 * world) % cfg["K"], num_classes=cfg["K"],
                        group=group)
        outq.put(("ready", rank, None))
        while inq.get(timeout=TIMEOUT) == "go":
            if group is not None:
                dist.barrier(group)
            w0, t0 = _wchar(), time.perf_counter()
            with _RssPeak() as rss:
                res = release_sharded(mech, X, y, num_classes=cfg["K"], group=group)
            t = time.perf_counter() - t0
            outq.put(("done", rank, dict(
                time_s=t, rss_before_mb=rss.start, rss_peak_mb=rss.peak,
                shard_mb=X.nbytes / 2**20, out_mb=(res.x.nbytes + res.y.nbytes) / 2**20,
                written_bytes=_wchar() - w0, accounting_first_s=accounting_s, threads=threads,
                current_rss_mb=current_rss_mb(), **res.stats,
                epsilon_pld=res.report.epsilon_pld)))
            del res
        if group is not None:
            dist.destroy_process_group()
    except BaseException as e:      # noqa: BLE001 - reported to the parent
        import traceback
        outq.put(("error", rank, f"{e!r}\n{traceback.format_exc()}"))


class Pool:
    """W workers holding their shards; ``run()`` is one release on all of them."""

    def __init__(self, cfg, world):
        import multiprocessing as mp

        from _distributed import free_port
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["numpy", "torch", "torch.distributed", "ncdp_fast.release",
                                    "ncdp_fast.distributed._release"])
        threads = max(1, (os.cpu_count() or 1) // world)
        self.world, self.out = world, ctx.Queue()
        self.ins = [ctx.Queue() for _ in range(world)]
        port = free_port()
        self.procs = [ctx.Process(target=_worker, args=(r, world, port, cfg, threads,
                                                        self.ins[r], self.out), daemon=True)
                      for r in range(world)]
        for p in self.procs:
            p.start()
        self._collect("ready")

    def _collect(self, what):
        got = {}
        while len(got) < self.world:
            try:
                kind, rank, value = self.out.get(timeout=5)
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if p.exitcode is not None]
                if dead:
                    raise RuntimeError(f"ranks {dead} exited") from None
                continue
            if kind == "error":
                raise RuntimeError(f"rank {rank}: {value}")
            got[rank] = value
        return [got[r] for r in range(self.world)]

    def run(self):
        for q in self.ins:
            q.put("go")
        self.last = self._collect("done")
        return self.last

    def close(self):
        for q in self.ins:
            q.put("stop")
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()


def test_distributed_release(benchmark, case, bench_device, bench_size):
    import pytest
    if bench_device != "cpu":
        pytest.skip("the sharded release runs on the CPU (gloo)")
    world = int(case.method[1:])
    pool = Pool(case.params, world)
    try:
        # At full size one timed call and no untimed one: the workers already loaded the
        # kernels (a tiny release) and ran the accounting once.
        measure(benchmark, case, pool.run, device="cpu", memory=False,
                repeats=1 if bench_size == "full" else 2, warmup=0,
                first_call=bench_size != "full", world=world,
                **{k: case.params[k] for k in ("n", "T", "d", "K", "m")})
        ranks = pool.last
    finally:
        pool.close()
    e = benchmark.extra_info
    e.update(ranks=ranks, accounting_s=ranks[0]["accounting_s"],
             accounting_first_s=ranks[0]["accounting_first_s"],
             rounds_s_max=max(r["rounds_s"] for r in ranks),
             compute_s_max=max(r["rounds_s"] - r["reduce_scatter_s"] for r in ranks),
             rank_time_max_s=max(r["time_s"] for r in ranks),
             rank_peak_rss_mb_max=max(r["rss_peak_mb"] for r in ranks),
             rank_extra_mb_max=max(r["rss_peak_mb"] - r["rss_before_mb"] for r in ranks),
             reduce_scatter_bytes_per_rank=max(r["reduce_scatter_bytes"] for r in ranks),
             written_bytes_per_rank=max(r["written_bytes"] for r in ranks),
             epsilon_pld=ranks[0]["epsilon_pld"])
