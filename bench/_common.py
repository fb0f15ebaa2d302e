"""What every benchmark of bench/ shares: the ``Case`` a test is parametrized
with, and ``measure`` (peak memory of one call, then pytest-benchmark's timing).

The options, the parametrization over rounds and the interleaved ordering are
in bench/conftest.py; the tables in bench/report.py."""
from __future__ import annotations

import ctypes
import functools
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Case:
    """One method on one workload of a benchmark family.

    ``family`` names the report (``bench/results/<family>-<cpu|gpu>-<date>``);
    ``workload`` is the group label (the shape); ``once``: a slow peer timed in
    the first round only.  ``round`` is filled in by bench/conftest.py."""
    family: str
    workload: str
    method: str
    params: dict = field(default_factory=dict, hash=False, compare=False)
    once: bool = False
    round: int = 1

    @property
    def id(self) -> str:
        return f"{self.workload}|{self.method}|r{self.round}"


def cases(family, workloads, methods, once=()):
    """Every (workload, method) of a family: ``workloads`` is a list of (label,
    params); ``methods`` names the methods, ``once`` those timed in round 1 only."""
    return [Case(family, label, m, dict(params), once=m in once)
            for label, params in workloads for m in methods]


def workload_names(ap, known, argv=None) -> tuple[list, object]:
    """(the --workloads named, the parsed arguments) of a profiling script's
    parser ``ap`` (which this adds --workloads and --out to) on ``argv``; an
    unknown name is refused by ``ap.error``."""
    ap.add_argument("--workloads", default=",".join(known),
                    help=f"comma-separated, of {', '.join(known)}")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args(argv)
    names = [n for n in args.workloads.split(",") if n]
    unknown = sorted(set(names) - set(known))
    if unknown:
        ap.error(f"--workloads: unknown {unknown}; expected some of {list(known)}")
    return names, args


def emulated_model_args(doc, known, argv, device) -> tuple[list, object, dict]:
    """(workloads, parsed arguments, report meta) of a model run on the
    emulated CUDA device (bench/device_model.py, bench/memory_model.py):
    --size picks the GPU run's shapes; NCDP_CUDA_EMULATION is set before
    ncdp_fast is imported; ``device`` names the model in the report."""
    import argparse
    import os
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--size", choices=("full", "quick", "smallest"), default="full",
                    help="the GPU run's stated shapes (full), or smaller ones for a check")
    names, args = workload_names(ap, known, argv)
    os.environ["NCDP_CUDA_EMULATION"] = "1"
    from report import run_meta
    meta = run_meta("cpu", args.size, 1)
    meta["device"] = device
    return names, args, meta


def exception_text(exc, limit=400) -> str:
    """"Type: message" of an exception on one line, at most ``limit`` characters:
    what a table's error cell shows."""
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:limit]


def cuda_missing() -> str | None:
    """Why this machine cannot run the CUDA benchmarks (None: it can)."""
    import torch

    import ncdp_fast
    if not ncdp_fast._backend.CUDA_COMPILED:
        return "ncdp_fast._C was built without CUDA"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device"
    return None


_INPUT: dict = {}      # {key: value}: the last workload's input only


def workload_input(key, make):
    """``make()``'s value for ``key``, made once while consecutive tests ask for
    the same key: a workload's methods and rounds run one after another, and
    the previous workload's input is let go before the next is made (one
    workload's input held at a time).  bench_clip_dense's (1024, 409600) draw
    took 3.9 s on the CPU's generator (2-core VM), and it ran once a test: 16
    times a GPU run.  Callers only read the value."""
    if key not in _INPUT:
        _INPUT.clear()
        _INPUT[key] = make()
    return _INPUT[key]


def dense_torch_eager(g, C, sigma):
    """bench_clip_dense's torch peer on g (B, p): float64 norms, the factors in
    g's dtype, one einsum and torch.normal's noise (a callable)."""
    import torch
    p = g.shape[1]

    def eager():
        norms = torch.linalg.vector_norm(g, dim=1, dtype=torch.float64)
        f = (C / norms).clamp(max=1.0).to(g.dtype)
        return torch.einsum("i,ij->j", f, g) + torch.normal(0.0, sigma * C, (p,),
                                                              device=g.device)
    return eager


def dense_rows_launch(g, C, sigma, one_pass: bool, rows: int | None = None):
    """The dense op's CUDA launcher on g (B, p) in its other forms (a
    callable, holding its workspace): ``one_pass`` the one-pass kernel
    (csrc/clip/dense_one_pass.cu, on as many blocks as the device holds), with
    row blocks of ``rows`` rows where given (the plan's l2_bytes set for them:
    dense_traffic.one_pass_l2_for_rows), else of its device-L2 share; else
    rows in chunks of half the device's L2 (l2_bytes=-1: a pass from DRAM,
    one from L2)."""
    import torch

    from ncdp_fast._cuda._common import native, ptr, stream, workspace
    B, p = g.shape
    lib = native(g)
    dtype = 0 if g.dtype == torch.float32 else 1
    nbytes = lib.clip_noise_rows_workspace_bytes(B, p, dtype)
    ws, ws_ptr = workspace(g, nbytes)
    out = torch.empty(p, dtype=g.dtype, device=g.device)
    norms = torch.empty(B, dtype=torch.float64, device=g.device)
    l2_bytes = -1
    if one_pass and rows is not None:
        from dense_traffic import one_pass_l2_for_rows
        l2_bytes = one_pass_l2_for_rows(p, g.element_size(), rows)

    def launch():
        # ws named here: the closure holds the workspace the pointer points into.
        lib.launch_clip_noise_rows(ptr(g), B, p, dtype, C, sigma * C, 1.0, 1, 0, ptr(out),
                                   ptr(norms), ws_ptr if ws is not None else 0, nbytes,
                                   stream(g), l2_bytes=l2_bytes,
                                   one_pass_blocks=-1 if one_pass else 0)
        return out
    return launch


def whole_batch_draw(loader, rows: int):
    """``draw()``: the next batch of ``loader``'s Poisson sampler, drawn
    without collating it.  The benchmarks hand ``make_private`` a loader of
    length 1 over the timed batch: sample rate 1, so every Poisson batch is the
    whole dataset, rows 0..rows-1 in order -- the fixed batch the step is
    timed on.  ``DPOptimizer.step`` accepts only a step on the loader's next
    batch (the accountant's record), so each timed private step draws it
    first; the draw is the sampler's work every private run pays, the
    collation (the same for every method) is left out."""
    sampler = loader.batch_sampler
    if len(sampler) != 1 or sampler.sample_rate != 1.0:
        raise ValueError(f"loader: expected a loader of length 1 (sample rate 1), got "
                         f"{len(sampler)} batches at rate {sampler.sample_rate}")

    def draw():
        # At rate 1 a batch of all the rows is rows 0..rows-1 (the sampler's
        # indices are sorted and distinct): its length says it.
        for batch in sampler:
            if len(batch) != rows:
                raise RuntimeError(f"whole_batch_draw: expected all {rows} rows at sample "
                                   f"rate 1, got {len(batch)}")
    return draw


def current_rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _glibc_mallinfo2():
    try:
        f = ctypes.CDLL(None).mallinfo2
    except (AttributeError, OSError):
        return None
    f.restype = _MallInfo2
    return f


_MALLINFO2 = _glibc_mallinfo2()


def allocated_mb() -> float | None:
    """Bytes glibc's malloc has handed out and not taken back (all arenas' in-use
    chunks plus mmapped blocks), in MB; None without glibc >= 2.33.  torch's CPU
    allocator, NumPy and numba all allocate through malloc, so this is the CPU's
    counterpart of the CUDA allocator's ``memory_allocated``: live data, without
    the freed memory glibc keeps (which the resident set counts)."""
    if _MALLINFO2 is None:
        return None
    m = _MALLINFO2()
    return (m.uordblks + m.hblkhd) / 2**20


class _RssPeak:
    """Peak resident set (MB) above the start, and peak malloc'd bytes above the
    start (``alloc_mb``, None without glibc), sampled every millisecond by a
    thread while the block runs (the process-wide ru_maxrss never comes down, so
    it cannot tell one call of a long-running pytest process from another)."""

    def __enter__(self):
        self.start = self.peak = current_rss_mb()
        self.alloc_start = self.alloc_peak = allocated_mb()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _take(self):
        self.peak = max(self.peak, current_rss_mb())
        if self.alloc_start is not None:
            self.alloc_peak = max(self.alloc_peak, allocated_mb())

    def _sample(self):
        while not self._stop.is_set():
            self._take()
            time.sleep(0.001)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._take()
        self.extra_mb = self.peak - self.start
        self.alloc_mb = None if self.alloc_start is None else self.alloc_peak - self.alloc_start


def peak_memory(fn, device, reset=None, calls=1) -> tuple[float, float | None]:
    """(peak_extra_mb, peak_alloc_mb) of one call of ``fn``: memory it needs
    beyond what was allocated before it.  On a GPU the first is the CUDA
    allocator's peak of allocated bytes, the second None.  On the CPU,
    ``peak_extra_mb`` is the sampled
    resident-set growth, after ``malloc_trim`` has handed the memory glibc kept
    from earlier calls back to the system (else the call reuses it unseen;
    without glibc the number is a lower bound), and ``peak_alloc_mb`` the
    sampled growth of malloc'd bytes (:func:`allocated_mb`; None without glibc).

    The two differ by what glibc keeps: freed heap memory stays resident until
    it lies at the top of the heap, and a block of 32 MB or more always comes
    from a fresh mmap, so the resident set of a training step is up to about
    twice its peak of live data (measured on BERT-shaped steps: 336-340 MB
    resident against 173 MB allocated), and the private and non-private
    forwards, the same torch allocations op for op, ended 206-216 and 194-206
    MB resident.

    ``calls`` > 1: the median of each over that many calls, each after
    ``reset()`` (which frees what a call leaves behind).  One sampled CPU call
    varies by about +-6% resident (measured: eight alternating GhostClipper /
    PrivacyEngine steps of the transformer gave 668-754 and 681-780 MB, the
    same torch allocations op for op), enough to fake a 10% difference between
    two methods."""
    rss, alloc = [], []
    for i in range(calls):
        if i and reset is not None:
            reset()
        r, a = _peak_once(fn, device)
        rss.append(r)
        alloc.append(a)
    mid = len(rss) // 2
    return sorted(rss)[mid], (None if None in alloc else sorted(alloc)[mid])


def record_memory(benchmark, fn, device, reset=None, calls=1):
    """:func:`peak_memory` into ``benchmark.extra_info`` (``peak_extra_mb``, and
    ``peak_alloc_mb`` where it is known)."""
    rss, alloc = peak_memory(fn, device, reset=reset, calls=calls)
    benchmark.extra_info["peak_extra_mb"] = rss
    if alloc is not None:
        benchmark.extra_info["peak_alloc_mb"] = alloc


def record_step_memory(benchmark, step, release, device):
    """A training step's :func:`record_memory` from a state without
    gradients: ``step`` once first (lazy initialisation outside the
    numbers), then ``release`` (its gradients freed), then one measured step."""
    step()
    release()
    record_memory(benchmark, step, device)


def _peak_once(fn, device) -> tuple[float, float | None]:
    if device == "cuda":
        import torch
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20, None
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):
        pass
    with _RssPeak() as rss:
        fn()
    return rss.extra_mb, rss.alloc_mb


def measure(benchmark, case, fn, *, device, repeats, warmup=1, min_time=0.0, memory=True,
            first_call=True, **extra):
    """Time ``fn`` with ``benchmark.pedantic`` (``repeats`` timed calls after
    ``warmup`` untimed ones, more if ``repeats`` calls take less than
    ``min_time`` seconds; a CUDA synchronize ends every call on a GPU) and
    record ``case``, the peak memory of one more call (before the timing; one
    call before it compiles and imports unless not ``first_call``) and
    ``extra`` in ``benchmark.extra_info``; ``bytes`` / ``flops`` there add the
    achieved ``gbs`` / ``gflops`` at the median time.  Returns ``fn``'s last
    result."""
    if device == "cuda":
        import torch

        def call():
            out = fn()
            torch.cuda.synchronize()
            return out
    else:
        call = fn
    benchmark.group = f"{case.family} {case.workload} {device}"
    benchmark.extra_info.update(family=case.family, workload=case.workload,
                                method=case.method, round=case.round, device=device, **extra)
    if benchmark.disabled:              # the CI smoke run: one call, nothing measured
        return benchmark.pedantic(call)
    if first_call:
        call()                          # compile / import / CUDA init outside the numbers
    if memory:
        record_memory(benchmark, call, device)
    if min_time:
        t0 = time.perf_counter()
        call()
        repeats = max(repeats, min(int(min_time / (time.perf_counter() - t0)), 10_000))
    out = benchmark.pedantic(call, rounds=repeats, warmup_rounds=warmup, iterations=1)
    median = benchmark.stats.stats.median
    for key, rate in (("bytes", "gbs"), ("flops", "gflops")):
        if extra.get(key):
            benchmark.extra_info[rate] = extra[key] / median / 1e9
    return out


class StepTimer:
    """Wall time accumulated by wrappers installed on a method's code, per step:
    ``counted(step)`` counts the steps; ``_timed(fn, attr)`` adds each call's
    time to ``self.<attr>``; ``_patch`` / ``remove`` install and undo the
    wrappers (an attribute that was not there before is deleted again).  The
    wrappers' own ``perf_counter`` calls are counted too, so figures err high."""

    def __init__(self):
        self.steps = 0
        self._saved = []

    def _timed(self, fn, attr="seconds", count=None):
        """``fn`` with each call's time added to ``self.<attr>`` (and, given
        ``count``, each call counted in ``self.<count>``)."""
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if count is not None:
                setattr(self, count, getattr(self, count) + 1)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                setattr(self, attr, getattr(self, attr) + time.perf_counter() - t0)
        return timed

    def _patch(self, owner, name, wrapper):
        self._saved.append((owner, name, vars(owner).get(name)))
        setattr(owner, name, wrapper)

    def remove(self) -> None:
        for owner, name, fn in reversed(self._saved):
            if fn is None:
                delattr(owner, name)
            else:
                setattr(owner, name, fn)
        self._saved = []

    def counted(self, step):
        def call():
            self.steps += 1
            return step()
        return call


class Issue35Timer(StepTimer):
    """The wall time of the per-step checks of issue 35 in the torch drop-in,
    where they run: the model-tree check before each recorded forward
    (``tree.ModelSnapshot.check``), each layer's layout read from the graph
    (``GhostClipper._check_layout``) and the loss check (``loss_watch.LossWatch``:
    noting each layer's output, arming the torch-function mode after the
    forward, reading the graph at backward, the value checks at the step,
    taking the mode off).  The mode also passes every torch call between the
    forward and the backward through Python: those calls are counted, and
    each is charged the pass-through cost measured here on a tiny tensor (the
    mode's time, not the call's), so the figure is measured, not modelled.
    The timing wrappers' own time is measured the same way (a no-op method,
    wrapped and bare) and taken out, call by call."""

    def __init__(self):
        super().__init__()
        self.seconds = 0.0
        self.calls = 0
        self.per_call = 0.0
        # Calls of the timed methods, and the timing wrapper's own time a call
        # (measured like the mode's pass-through): taken out of the figure,
        # which otherwise charged the checks some 0.4 us a call of the
        # timer's (BERT-base: about 300 calls a step).  Measured hot, so the
        # figure still errs high, by the wrapper's cache misses in a step.
        self.timed_calls = 0
        self.per_timed_call = 0.0

    def install(self) -> "Issue35Timer":
        from ncdp_fast.torch import loss_watch, recorder, tree
        W = loss_watch.LossWatch
        for owner, name in ((tree.ModelSnapshot, "check"),
                            (recorder.LayerRecorder, "_check_layout"), (W, "source"), (W, "arm"),
                            (W, "on_backward"), (W, "require"), (W, "settle"),
                            (W, "unstack"), (W, "clear")):
            self._patch(owner, name, self._timed(owner.__dict__[name], count="timed_calls"))
        self.per_timed_call = self._wrapper_seconds()
        mode = loss_watch._Catch
        passing = mode.__dict__["__torch_function__"]

        def counted(catch, func, types, args=(), kwargs=None):
            self.calls += 1
            return passing(catch, func, types, args, kwargs)
        self._patch(mode, "__torch_function__", counted)
        self.per_call = self._pass_through_seconds(loss_watch, passing)
        return self

    def _wrapper_seconds(self, n=20000) -> float:
        """The timing wrapper's own time a call: a no-op method n times
        wrapped and bare, the better of three tries each (the wrapper's
        additions to ``seconds`` and the call count put back after)."""
        class Probe:
            def noop(self, x):
                return x
        probe, wrapped = Probe(), self._timed(Probe.noop, count="timed_calls")
        saved = self.seconds, self.timed_calls

        def run(fn):
            t0 = time.perf_counter()
            for _ in range(n):
                fn(probe, 1)
            return time.perf_counter() - t0
        bare = min(run(Probe.noop) for _ in range(3))
        timed = min(run(wrapped) for _ in range(3))
        self.seconds, self.timed_calls = saved
        return max(timed - bare, 0.0) / n

    @staticmethod
    def _pass_through_seconds(loss_watch, passing, n=20000):
        """The mode's own time per torch call: ``torch.neg`` of a 1-element
        tensor n times with an inactive mode on the stack and without, the
        better of three tries each."""
        import torch
        x = torch.zeros(1)

        def run():
            t0 = time.perf_counter()
            for _ in range(n):
                torch.neg(x)
            return time.perf_counter() - t0
        bare = min(run() for _ in range(3))
        catch = loss_watch._Catch(None)
        torch._C._push_on_torch_function_stack(catch)
        try:
            mode = min(run() for _ in range(3))
        finally:
            torch._C._pop_torch_function_stack()
        return max(mode - bare, 0.0) / n

    def counted(self, step):
        """As StepTimer's, but the first call (lazy initialisation: torch's
        first use of an op, the first graph walk of each layer call and input
        shape, kept for later steps) is left out of the figure."""
        first = [True]

        def call():
            out = step()
            if first[0]:
                first[0] = False
                self.seconds, self.calls, self.timed_calls = 0.0, 0, 0
            else:
                self.steps += 1
            return out
        return call

    def ms_per_step(self) -> float | None:
        if not self.steps:
            return None
        own = self.seconds - self.timed_calls * self.per_timed_call
        return 1e3 * (max(own, 0.0) + self.calls * self.per_call) / self.steps
