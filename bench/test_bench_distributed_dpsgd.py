"""Benchmark of DP-SGD across torch.distributed ranks (gloo, 127.0.0.1;
``GhostClipper(..., group=)``, ncdp_fast/torch/ranks.py; report
``bench_distributed_dpsgd``) against DDP without privacy.

Workloads (issue #17): the (B, d, K) = (1024, 4096, 100) linear head and the MLP
784-512-256-10 (ReLU) at B = 256, float32, synthetic data; B is the *global*
batch, split across the ranks (rank r holds rows ``shard_bounds(B, r, W)``).
Methods, each at W = 1 and 2 ranks:

* ``private_W<W>``: one private step -- zero_grad, forward, cross-entropy (mean
  over the rank's rows), backward, ``GhostClipper.privatize_()`` with the group
  (local clip, all-reduce of the clipped sums, each rank adds the noise of its
  slice, all-gather; noise multiplier 1, C = 1, expected batch B), SGD;
* ``ddp_W<W>``: the same model wrapped in ``DistributedDataParallel`` on the same
  gloo group, same data split, the same step without ``privatize_``.

At W = 1 both still run on a one-rank gloo group (the same code paths as at W =
2; the collectives move nothing).  The machine's cores are shared by the ranks
(torch and numba threads per rank = cores / W), so W = 2 measures the cost of
splitting the step on one machine, not a speed-up.

Two workers are started once for the module (forkserver; a gloo group of both
and a one-rank group of the first; one tiny private and DDP step each, so that
numba's cached kernels and gloo's first collectives are loaded before any case)
and kept; each case builds its model on the first W of them, runs two untimed
steps, one step with the resident set sampled every ms, one step counting the
bytes of the tensors handed to ``torch.distributed`` collectives, then each
timed call is one step on every rank (a "go" to each worker and the wait for all
of them).  Per rank, in extra_info: the step's wall time on the rank (after a
barrier), the resident set before / peak during the sampled step, the bytes
handed to all-reduce and all-gather (counted by wrapping
``torch.distributed.all_reduce/all_gather`` in that one step; DDP's reducer
all-reduces from C++, so for DDP the bytes are the gradients' bytes, every
trainable parameter's gradient once in its buckets, whose sizes DDP's logging
data gives), and the bytes the process
wrote during the step (``/proc/self/io`` wchar: on this machine the gloo socket
traffic); and the machine's 1-minute load average at the start and end of the
case (the machine may be shared).

The smallest size (tests/test_bench_suite.py) runs the same code on tiny shapes;
``free_port`` and the worker pool are this file's own (the sibling
bench/test_bench_distributed_release.py has its own).
"""
from __future__ import annotations

import os
import queue
import socket
import time

import pytest
from _common import cases, measure

SHAPES = {"full": [dict(model="linear", B=1024, dims=(4096, 100)),
                   dict(model="mlp", B=256, dims=(784, 512, 256, 10))],
          "quick": [dict(model="linear", B=256, dims=(1024, 100)),
                    dict(model="mlp", B=64, dims=(784, 512, 256, 10))],
          "smallest": [dict(model="linear", B=8, dims=(16, 3)),
                       dict(model="mlp", B=8, dims=(12, 8, 6, 3))]}
METHODS = ["private_W1", "ddp_W1", "private_W2", "ddp_W2"]
TIMEOUT = 600           # seconds any wait on a worker may take


def _world(method):
    return int(method.rsplit("W", 1)[1])


WORLDS = {_world(m) for m in METHODS}
RANKS = max(WORLDS)     # workers started
C, SIGMA = 1.0, 1.0


def _label(s):
    if s["model"] == "linear":
        return f"linear head (B, d, K) = ({s['B']}, {s['dims'][0]}, {s['dims'][1]})"
    return f"MLP {'-'.join(map(str, s['dims']))}, B = {s['B']}"


def CASES(size, device):
    return {"test_distributed_dpsgd": cases(
        "bench_distributed_dpsgd", [(_label(s), s) for s in SHAPES[size]], METHODS)}


def _free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (as tests/_distributed.py)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wchar():
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("wchar")).split()[1])


def _trim():
    import ctypes
    import gc
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):
        pass


class _CountCollectives:
    """Within the block, the bytes of the tensors this rank hands to
    ``torch.distributed.all_reduce`` (its input, reduced in place) and
    ``all_gather`` (its input; ``gather_out``: the list it receives)."""

    def __enter__(self):
        import torch.distributed as dist
        self.dist, self.reduce, self.gather_in, self.gather_out = dist, 0, 0, 0
        self._ar, self._ag = dist.all_reduce, dist.all_gather

        def all_reduce(t, *a, **k):
            self.reduce += t.numel() * t.element_size()
            return self._ar(t, *a, **k)

        def all_gather(out, t, *a, **k):
            self.gather_in += t.numel() * t.element_size()
            self.gather_out += sum(o.numel() * o.element_size() for o in out)
            return self._ag(out, t, *a, **k)
        dist.all_reduce, dist.all_gather = all_reduce, all_gather
        return self

    def __exit__(self, *exc):
        self.dist.all_reduce, self.dist.all_gather = self._ar, self._ag


def _build(rank, world, group, method, p):
    """This rank's step of ``method`` on workload ``p``: (step function, parameters)."""
    import torch
    from torch import nn

    from ncdp_fast.distributed import shard_bounds
    B, dims = p["B"], p["dims"]
    lo, hi = shard_bounds(B, rank, world)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, dims[0], generator=g)[lo:hi].clone()
    y = torch.randint(0, dims[-1], (B,), generator=g)[lo:hi].clone()
    torch.manual_seed(1)
    layers = []
    for i, (a, b) in enumerate(zip(dims[:-1], dims[1:])):
        layers += [nn.Linear(a, b)] + ([nn.ReLU()] if i < len(dims) - 2 else [])
    model = layers[0] if len(layers) == 1 else nn.Sequential(*layers)
    if method.startswith("private"):
        from ncdp_fast.torch import GhostClipper
        clipper = GhostClipper(model, max_grad_norm=C, noise_multiplier=SIGMA,
                               expected_batch_size=float(B), seed=None, group=group)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def step():
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), y).backward()
            clipper.privatize_()
            opt.step()
        keep = (clipper, opt)
    else:
        from torch.nn.parallel import DistributedDataParallel
        ddp = DistributedDataParallel(model, process_group=group)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)

        def step():
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
        keep = (ddp, opt)
    step.keep = keep
    return step, [q for q in model.parameters() if q.requires_grad]


def _setup(rank, world, group, method, p):
    """Build the step, two untimed steps, one with the resident set sampled, one
    counting the collectives' bytes."""
    import torch.distributed as dist
    from _common import _RssPeak
    step, params = _build(rank, world, group, method, p)
    step()
    step()
    _trim()
    dist.barrier(group=group)
    with _RssPeak() as rss:
        step()
    dist.barrier(group=group)
    with _CountCollectives() as count:
        step()
    grad_bytes = sum(q.numel() * q.element_size() for q in params)
    buckets = None
    if method.startswith("ddp"):
        # DDP's reducer all-reduces its buckets from C++, out of the wrapper's
        # sight: every trainable parameter's gradient, once (its logging data
        # says the buckets' sizes in bytes).
        count.reduce = grad_bytes
        buckets = step.keep[0]._get_ddp_logging_data().get("bucket_sizes")
    info = dict(ddp_bucket_bytes=buckets, rss_before_mb=rss.start, rss_peak_mb=rss.peak,
                rss_extra_mb=rss.extra_mb,
                parameters=sum(q.numel() for q in params), grad_bytes=grad_bytes,
                allreduce_bytes=count.reduce, allgather_in_bytes=count.gather_in,
                allgather_out_bytes=count.gather_out)
    return step, info


def _worker(rank, port, inq, outq):
    """One of the ``RANKS`` workers: join a gloo group of all of them and make a
    group of the first W for every W of ``METHODS``, then serve commands (the
    first W workers get those of a W-rank case): ("build", (W, method, params)),
    ("go", None): one step, ("free", None), ("stop", None).  Torch and numba use
    cores / W threads in a W-rank case."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    try:
        import datetime

        import numba
        import torch
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=RANKS, timeout=datetime.timedelta(seconds=TIMEOUT))
        groups = {w: dist.group.WORLD if w == RANKS else dist.new_group(list(range(w)))
                  for w in sorted(WORLDS)}
        # First calls (numba's cached kernels, gloo's first collectives) on every
        # worker at once, before any case.
        t0 = time.perf_counter()
        for method in ("private", "ddp"):
            _build(rank, RANKS, groups[RANKS], method, dict(B=2 * RANKS, dims=(4, 3)))[0]()
        outq.put(("ready", rank, time.perf_counter() - t0))
        step = group = None
        while True:
            cmd, arg = inq.get(timeout=TIMEOUT)
            if cmd == "stop":
                break
            if cmd == "build":
                world, method, params = arg
                threads = max(1, (os.cpu_count() or 1) // world)
                torch.set_num_threads(threads)
                numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
                group = groups[world]
                step, value = _setup(rank, world, group, method, params)
                value["threads"] = threads
            elif cmd == "go":
                dist.barrier(group=group)
                w0, t0 = _wchar(), time.perf_counter()
                step()
                value = dict(time_s=time.perf_counter() - t0, written_bytes=_wchar() - w0)
            elif cmd == "free":
                step = value = None
            outq.put(("done", rank, value))
        dist.destroy_process_group()
    except BaseException as e:      # noqa: BLE001 - reported to the parent
        import traceback
        outq.put(("error", rank, f"{e!r}\n{traceback.format_exc()}"))


class _Pool:
    """``RANKS`` gloo workers, kept for the module; ``build`` a W-rank case on the
    first W of them, ``run()`` is one step on each of those."""

    def __init__(self):
        import multiprocessing as mp
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["numpy", "torch", "torch.distributed", "ncdp_fast.torch"])
        self.out = ctx.Queue()
        self.ins = [ctx.Queue() for _ in range(RANKS)]
        port = _free_port()
        self.procs = [ctx.Process(target=_worker, args=(r, port, self.ins[r], self.out),
                                  daemon=True) for r in range(RANKS)]
        for p in self.procs:
            p.start()
        self.world = RANKS
        self._collect()
        self.world = None

    def _collect(self):
        got = {}
        deadline = time.monotonic() + TIMEOUT
        while len(got) < self.world:
            try:
                kind, rank, value = self.out.get(timeout=1)
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if p.exitcode is not None]
                if dead or time.monotonic() > deadline:
                    raise RuntimeError(f"ranks {dead} exited" if dead else "workers hung") \
                        from None
                continue
            if kind == "error":
                raise RuntimeError(f"rank {rank}: {value}")
            got[rank] = value
        return [got[r] for r in range(self.world)]

    def _all(self, cmd, arg=None):
        for q in self.ins[:self.world]:
            q.put((cmd, arg))
        return self._collect()

    def build(self, world, method, params):
        self.world, self.steps = world, []
        return self._all("build", (world, method, params))

    def run(self):
        self.steps.append(self._all("go"))

    def free(self):
        self._all("free")

    def close(self):
        for q in self.ins:
            q.put(("stop", None))
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)


def _median(xs):
    xs = sorted(xs)
    return xs[(len(xs) - 1) // 2]


def _ring_sent(world, allreduce, gather_in):
    """Bytes one rank sends per step in ring collectives (derived, not measured):
    all-reduce 2 (W-1)/W of its input, all-gather (W-1) times its input."""
    return 2 * (world - 1) / world * allreduce + (world - 1) * gather_in


@pytest.fixture(scope="module")
def pools():
    """The workers, started at the first case and kept for the module."""
    made = {}
    yield made
    for pool in made.values():
        pool.close()


def test_distributed_dpsgd(benchmark, case, bench_device, bench_size, pools):
    if bench_device != "cpu":
        pytest.skip("the ranks run on gloo, on the CPU")
    world = _world(case.method)
    if "pool" not in pools:
        pools["pool"] = _Pool()
    pool = pools["pool"]
    load = [os.getloadavg()[0]]
    ranks = pool.build(world, case.method, case.params)
    try:
        measure(benchmark, case, pool.run, device="cpu", memory=False, first_call=False,
                repeats=10, warmup=1, min_time=1.0 if bench_size == "full" else 0.5,
                world=world, B=case.params["B"], dims=list(case.params["dims"]))
        steps = pool.steps
    finally:
        pool.free()
    load.append(os.getloadavg()[0])
    e = benchmark.extra_info
    r0 = ranks[0]
    e.update(
        ranks=ranks, threads=r0["threads"], cores=os.cpu_count(), loadavg=load,
        parameters=r0["parameters"], grad_bytes=r0["grad_bytes"],
        rank_step_s=[_median([s[r]["time_s"] for s in steps]) for r in range(world)],
        written_bytes=[_median([s[r]["written_bytes"] for s in steps]) for r in range(world)],
        rank_peak_rss_mb_max=max(r["rss_peak_mb"] for r in ranks),
        rank_extra_mb_max=max(r["rss_extra_mb"] for r in ranks),
        allreduce_bytes=max(r["allreduce_bytes"] for r in ranks),
        allgather_in_bytes=max(r["allgather_in_bytes"] for r in ranks),
        allgather_out_bytes=max(r["allgather_out_bytes"] for r in ranks),
        ddp_bucket_bytes=r0["ddp_bucket_bytes"],
        ring_sent_bytes=max(_ring_sent(world, r["allreduce_bytes"], r["allgather_in_bytes"])
                            for r in ranks))
    e["rank_step_s_max"] = max(e["rank_step_s"])
    e["written_bytes_max"] = max(e["written_bytes"])
