"""What every benchmark of bench/ shares: the ``Case`` a test is parametrized
with, and ``measure`` (peak memory of one call, then pytest-benchmark's timing).

The options, the parametrization over rounds and the interleaved ordering are
in bench/conftest.py; the tables in bench/report.py."""
from __future__ import annotations

import ctypes
import os
import threading
import time
from dataclasses import dataclass, field


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


def cuda_missing() -> str | None:
    """Why this machine cannot run the CUDA benchmarks (None: it can)."""
    import torch

    import ncdp_fast
    if not ncdp_fast._backend.CUDA_COMPILED:
        return "ncdp_fast._C was built without CUDA"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device"
    return None


def current_rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


class _RssPeak:
    """Peak resident set (MB) above the start, sampled every millisecond by a
    thread while the block runs (the process-wide ru_maxrss never comes down, so
    it cannot tell one call of a long-running pytest process from another)."""

    def __enter__(self):
        self.start = self.peak = current_rss_mb()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, current_rss_mb())
            time.sleep(0.001)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, current_rss_mb())
        self.extra_mb = self.peak - self.start


def peak_extra_mb(fn, device, reset=None, calls=1) -> float:
    """Memory one call of ``fn`` needs beyond what was allocated before it: the
    CUDA allocator's peak on a GPU, the sampled resident-set growth on the CPU,
    after ``malloc_trim`` has handed the memory glibc kept from earlier calls
    back to the system (else the call reuses it unseen; without glibc the
    number is a lower bound).

    ``calls`` > 1: the median over that many calls, each after ``reset()``
    (which frees what a call leaves behind).  One sampled CPU call varies by
    about +-6% (measured: eight alternating GhostClipper / PrivacyEngine steps
    of the transformer gave 668-754 and 681-780 MB, the same torch allocations
    op for op), enough to fake a 10% difference between two methods."""
    values = []
    for i in range(calls):
        if i and reset is not None:
            reset()
        values.append(_peak_once(fn, device))
    return sorted(values)[len(values) // 2]


def _peak_once(fn, device) -> float:
    if device == "cuda":
        import torch
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):
        pass
    with _RssPeak() as rss:
        fn()
    return rss.extra_mb


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
        benchmark.extra_info["peak_extra_mb"] = peak_extra_mb(call, device)
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
