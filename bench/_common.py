"""Shared plumbing of the benchmarks: timing, peak memory, machine description,
and the JSON + Markdown report written to bench/results/."""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ncdp_fast._report import cpu_name, git_commit, machine, write_report  # noqa: E402,F401








def timeit(fn, *, repeats=10, warmup=2, sync=None, min_time=0.0):
    """Median and best wall time (seconds) of ``fn()`` over ``repeats`` runs."""
    for _ in range(warmup):
        fn()
    if sync:
        sync()
    times = []
    start = time.perf_counter()
    while len(times) < repeats or time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), float(np.min(times))


def alternate(run, cfgs: dict, rounds: int = 3) -> dict:
    """Run ``run(cfg)`` for every method of ``cfgs`` (name -> cfg) in ``rounds``
    interleaved rounds (A B C A B C ...) and keep, per method, the round with the
    median ``median_s``.  On a shared VM the speed drifts by tens of percent over
    minutes; interleaving makes the ratios between methods robust to that drift."""
    seen = {m: [] for m in cfgs}
    for _ in range(rounds):
        for m, cfg in cfgs.items():
            seen[m].append(run(cfg))
    out = {}
    for m, results in seen.items():
        ok = [r for r in results if "median_s" in r]
        if not ok:
            out[m] = results[-1]
            continue
        ok.sort(key=lambda r: r["median_s"])
        out[m] = dict(ok[len(ok) // 2], rounds=len(ok))
    return out


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def current_rss_mb() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return float("nan")


def sync_for(torch, device):
    """A synchronize callable for timing on ``device`` (None on the CPU)."""
    return torch.cuda.synchronize if device == "cuda" else None


def mem_start(torch, device):
    """Reset the peak counter; returns the baseline (MB) that mem_peak subtracts."""
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated() / 2**20
    return current_rss_mb()


def mem_peak(torch, device, start):
    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20 - start
    return peak_rss_mb() - start


def run_worker(script: str, cfg: dict, timeout: float = 1200, *,
               exact_memory: bool = False) -> dict:
    """Run ``script --worker <json cfg>`` in a fresh process (so peak memory is
    that configuration's own) and return the JSON it prints last, or
    ``{"error": ...}``.

    Peak memory on the CPU is peak RSS minus the RSS after a warm-up call, which
    only works if freed buffers leave the process.  glibc raises its mmap
    threshold after the first large free, so later buffers of that size come
    from the heap and stay resident when freed: the warm-up's memory then hides
    in the baseline (two runs of the same (2048, 128, 1024, 3) NTK comparison
    reported 48/96 MB and 80/33 MB).  ``exact_memory`` fixes the threshold, so
    every buffer above 128 KiB is mmap-backed and returned on free; it also
    makes every call page-fault its buffers afresh (25-60 % slower at that size),
    so use it for a memory-only run, not for timings."""
    env = dict(os.environ)
    if exact_memory:
        env["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
    proc = subprocess.run([sys.executable, script, "--worker", json.dumps(cfg)],
                          capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-3:]
        return dict(error=" | ".join(tail))
    return json.loads(proc.stdout.strip().splitlines()[-1])




def _positive_int(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text}")
    return value


def bench_parser(description: str | None = None) -> argparse.ArgumentParser:
    """The options every benchmark takes (--out, --quick, --device) plus the
    hidden --worker used to run one configuration in a fresh process."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--quick", action="store_true", help="smaller shapes, fewer repeats")
    ap.add_argument("--device", default="all", choices=["cpu", "cuda", "all"],
                    help="cuda: fail unless torch and ncdp_fast both see a GPU")
    ap.add_argument("--rounds", type=_positive_int, default=3,
                    help="interleaved rounds of the compared methods (fewer: faster, noisier)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    return ap


def serve_worker(args, dispatch) -> bool:
    """When run as a ``--worker``, run ``dispatch(cfg)`` and print its JSON result;
    returns whether it did (the caller then stops)."""
    if not args.worker:
        return False
    print(json.dumps(dispatch(json.loads(args.worker))))
    return True


def devices(args):
    """(device, report metadata) for each requested device this machine has.
    ``--device cuda`` on a machine without a usable GPU is an error, never a
    silent CPU run.  GPU reports are tagged "gpu" (``*-gpu-<date>.json``) and
    name the device, its compute capability and the CUDA versions."""
    import torch

    import ncdp_fast
    has_cuda = torch.cuda.is_available() and ncdp_fast._backend.CUDA_COMPILED
    if args.device == "cuda" and not has_cuda:
        why = ("ncdp_fast._C was built without CUDA" if not ncdp_fast._backend.CUDA_COMPILED
               else f"torch {torch.__version__} sees no CUDA device")
        raise SystemExit(f"--device cuda: {why}")
    devs = ["cpu"]
    if args.device in ("cuda", "all") and has_cuda:
        devs = ["cuda"] if args.device == "cuda" else ["cpu", "cuda"]
    m = machine(torch)
    for dev in devs:
        meta = dict(m, device_tag="gpu" if dev == "cuda" else "cpu", quick=args.quick,
                    rounds=getattr(args, "rounds", None))
        if dev == "cuda":
            cap = torch.cuda.get_device_capability()
            meta.update(device=torch.cuda.get_device_name(),
                        compute_capability=f"{cap[0]}.{cap[1]}", torch_cuda=torch.version.cuda,
                        ncdp_cuda_archs=ncdp_fast._backend.CUDA_ARCHS,
                        ncdp_cuda_runtime_driver=list(ncdp_fast._backend._C.cuda_versions()))
        else:
            meta["device"] = f"CPU: {m['cpu']}, {m['numba_threads']} threads"
        yield dev, meta
