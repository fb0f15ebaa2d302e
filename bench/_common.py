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
