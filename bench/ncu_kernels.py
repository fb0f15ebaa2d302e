"""Hardware counters of the kernels issue 36 could not explain without them:
Nsight Compute (``ncu``) on one launch of each, at the benchmarks' stated
shapes.

The H200 runs left three kernels below their models and no counter to say
why: the noise (``add_gaussian``: 146 us for 2^24 normals against 55-70 us by
its SASS instruction count, 0.37x torch.randn), the dense clip (two passes at
0.42 of the read limit; the one-pass kernel 1.66 ms against 0.51 ms
predicted) and the per-sample Gram kernel (16.8 TFLOP/s, a third of an SM's
FP64 tensor-core share).  This tool runs each case in its own process under
``ncu --profile-from-start off`` (only the launch between
``torch.cuda.profiler.start()`` and ``stop()`` is profiled, after a warm-up
call), with ``--clock-control none`` (the device's clocks left as they are,
as bench/README.md asks of every GPU measurement), and keeps, per kernel:
its duration, DRAM and SM throughput, occupancy, issue activity, the three
largest warp-stall reasons per issued instruction and the three busiest
pipes; the JSON keeps every metric ncu printed.

    python bench/ncu_kernels.py [--out bench/results] [--cases a,b] [--size full]
                                [--ncu PATH] [--timeout S] [--budget S]
    python bench/ncu_kernels.py --target CASE [--size S]   (what ncu runs)

writes ``ncu_kernels-gpu-<date>.{json,md}``.  Where ncu is missing or cannot
read the counters (a gVisor machine: "LibraryNotLoaded"), the report says so
in its rows and the tool still exits 0: an environment without counters is
reported, not failed.  ``make gpu-check`` runs it after bench/dmma_rate.py.
"""
from __future__ import annotations

import argparse
import csv
import glob
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from _common import dense_rows_launch, dense_torch_eager  # noqa: E402  (bench/ on the path)

# Case -> (what it runs, its shape at each size), the unexplained first (a
# budget cut leaves out the peers): the noise and the dense clip's routes,
# furthest from their goals (0.40x torch.randn, 0.42 of the read limit on the
# 2026-12-01 H200 run), before the Gram kernel.  "full" is the stated shape of
# the benchmark whose row the case explains.
CASES = {
    "noise_add": ("bench_noise ncdp_add: 2^24 float32 normals added in place",
                  {"full": (1 << 24,), "smallest": (4099,)}),
    "dense_one_pass": ("bench_clip_dense ncdp_one_pass: the one-pass kernel on (B, p) "
                       "float32", {"full": (1024, 409600), "smallest": (5, 1031)}),
    "dense_clip": ("bench_clip_dense ncdp: clip_and_noise of the same (B, p), its default "
                   "route", {"full": (1024, 409600), "smallest": (5, 1031)}),
    "gram": ("the per-sample Gram kernel at BERT-base's attention input: Grams of "
             "(B, T, d) float32 rows", {"full": (32, 128, 768), "smallest": (3, 70, 37)}),
    "torch_randn": ("bench_noise torch_randn, the peer: torch.randn of 2^24 float32",
                    {"full": (1 << 24,), "smallest": (4099,)}),
    "dense_torch": ("bench_clip_dense torch_eager, the peer: float64 norms, factors, einsum "
                    "and torch.normal", {"full": (1024, 409600), "smallest": (5, 1031)}),
}
# The Nsight Compute sections read, and the stall reasons and pipe
# utilisations asked by metric-name pattern (their names changed across ncu
# versions; a pattern matching none adds nothing).  Fewer on each retry: a
# version refusing a section or a pattern still gives the basic ones.
SECTIONS = ("SpeedOfLight", "LaunchStats", "Occupancy", "SchedulerStats", "WarpStateStats",
            "ComputeWorkloadAnalysis", "MemoryWorkloadAnalysis")
STALLS = "regex:^smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio$"
PIPES = "regex:^sm__inst_executed_pipe_.*\\.avg\\.pct_of_peak_sustained_active$"
ATTEMPTS = ((SECTIONS, (STALLS, PIPES)), (SECTIONS, ()),
            (("SpeedOfLight", "LaunchStats", "Occupancy"), ()))
# What ncu says when the machine gives it no counters (a gVisor runtime:
# /work/.library/device/KINDS.md) or no permission to read them.
NO_COUNTERS = ("LibraryNotLoaded", "ERR_NVGPUCTRPERM", "Failed to initialize the profiler",
               "profiling is not supported", "Profiling is not supported")
NOT_REACHED = "not measured: not reached (the tool was stopped before this case)"
# The shortest ncu run worth starting (an ncu run of a case starts a process
# that imports torch and initialises CUDA before its one profiled launch).
MIN_RUN_S = 15.0
TIME_UNITS = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3, "second": 1e6,
              "ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6}
# Summary columns: (key, the metric's display name in ncu's details page).
PICKS = (("dram_pct", "DRAM Throughput"), ("memory_pct", "Memory Throughput"),
         ("sm_pct", "Compute (SM) Throughput"), ("l2_hit_pct", "L2 Hit Rate"),
         ("achieved_occupancy_pct", "Achieved Occupancy"),
         ("theoretical_occupancy_pct", "Theoretical Occupancy"),
         ("registers", "Registers Per Thread"), ("ipc", "Executed Ipc Active"),
         ("issue_busy_pct", "Issue Slots Busy"),
         ("cycles_per_issue", "Warp Cycles Per Issued Instruction"))


def find_ncu(given: str | None = None) -> str | None:
    """``given``, else ncu on PATH, else the newest /opt/nvidia/nsight-compute
    install, else CUDA's."""
    if given:
        return given if Path(given).exists() or shutil.which(given) else None
    found = shutil.which("ncu")
    if found:
        return found
    for pattern in ("/opt/nvidia/nsight-compute/*/ncu", "/usr/local/cuda/bin/ncu"):
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[-1]
    return None


def ncu_command(ncu: str, case: str, size: str, sections, metrics) -> list[str]:
    """The command profiling ``case``'s one marked launch (or launches)."""
    cmd = [ncu, "--profile-from-start", "off", "--clock-control", "none", "--csv",
           "--page", "details"]
    for s in sections:
        cmd += ["--section", s]
    if metrics:
        cmd += ["--metrics", ",".join(metrics)]
    return cmd + [sys.executable, str(Path(__file__).resolve()), "--target", case,
                  "--size", size]


# ------------------------------------------------------------------ the cases

def build_case(case: str, size: str, device):
    """A callable running ``case`` once at ``size`` on ``device`` (torch tensors;
    the emulated CUDA device's are CPU ones)."""
    import numpy as np
    import torch

    import ncdp_fast as nf
    shape = CASES[case][1][size]
    # Drawn on the device (420 M host normals took seconds), from a generator
    # of its own: the process's default one is left as it was.
    gen = torch.Generator(device=device).manual_seed(0)
    if case in ("noise_add", "torch_randn"):
        n = shape[0]
        if case == "torch_randn":
            return lambda: torch.randn(n, device=device)
        from ncdp_fast import _backend
        x = torch.zeros(n, dtype=torch.float32, device=device)
        be = _backend.select("rng", like=x)
        out, offset = be.io.to_kernel(x), [0]

        def add():
            offset[0] += n      # a new range each call, as a step takes
            be.kernels.add_gaussian(out, np.uint64(1), np.uint64(offset[0]), 1.0, True, 1.0)
        return add
    if case == "gram":
        from ncdp_fast._cuda.gram import grams_f64
        a = torch.randn(*shape, device=device, generator=gen)
        return lambda: grams_f64([a])
    B, p = shape
    g = torch.randn(B, p, dtype=torch.float32, device=device, generator=gen)
    C, sigma = 1.0, 1.0
    if case == "dense_clip":
        return lambda: nf.clip_and_noise(g, max_norm=C, noise_multiplier=sigma, seed=1).grad
    if case == "dense_torch":
        return dense_torch_eager(g, C, sigma)
    return dense_rows_launch(g, C, sigma, one_pass=True)       # dense_one_pass


def run_target(case: str, size: str) -> int:
    """What ncu runs: a warm-up call, then the profiled one between the CUDA
    profiler's start and stop (without a GPU, the same calls on CPU tensors
    without the profiler: the tests run every case so on the emulated device,
    which they turn on for the call; nothing here sets NCDP_CUDA_EMULATION,
    which processes started later would inherit)."""
    import torch
    cuda = torch.cuda.is_available()
    fn = build_case(case, size, "cuda" if cuda else "cpu")
    fn()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
    fn()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
    return 0


# --------------------------------------------------------------- ncu's output

def _number(text: str):
    """A metric value as ncu prints it ("1,234.5", "12", "n/a"): a float, or the
    text where it is not a number."""
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return text


def parse_details(text: str) -> list[dict]:
    """ncu's ``--csv --page details`` output (its lines of other kinds, the
    ==PROF== messages and the program's own, left out) as kernels in launch
    order: {"id", "kernel", "block", "grid", "metrics": {name: (value,
    unit)}}, a name appearing in two sections kept as "Section: Name" for the
    second."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    if not lines:
        return []
    kernels: dict = {}
    for rec in csv.DictReader(lines):
        if rec.get("ID") is None or rec.get("Metric Name") in (None, ""):
            continue
        k = kernels.setdefault(rec["ID"], dict(id=int(rec["ID"]), kernel=rec.get("Kernel Name", ""),
                                               block=rec.get("Block Size", ""),
                                               grid=rec.get("Grid Size", ""), metrics={}))
        name = rec["Metric Name"]
        if name in k["metrics"]:
            name = f"{rec.get('Section Name', '')}: {name}"
        k["metrics"][name] = (_number(rec.get("Metric Value", "")), rec.get("Metric Unit", ""))
    return sorted(kernels.values(), key=lambda k: k["id"])


def _largest(metrics: dict, prefix: str, suffix: str, n: int = 3) -> str:
    """The ``n`` largest metrics named prefix<part>suffix, as "part value"."""
    found = [(v, name[len(prefix):len(name) - len(suffix)]) for name, (v, _) in metrics.items()
             if name.startswith(prefix) and name.endswith(suffix) and isinstance(v, float)]
    found.sort(reverse=True)
    return ", ".join(f"{part} {v:.2f}" for v, part in found[:n])


def summarize(case: str, kernels: list[dict]) -> list[dict]:
    """One report row per kernel of ``case``."""
    rows = []
    for k in kernels:
        m = k["metrics"]
        row = dict(case=case, kernel=k["kernel"][:90], block=k["block"], grid=k["grid"],
                   status="measured")
        value, unit = m.get("Duration", (None, ""))
        if isinstance(value, float) and unit in TIME_UNITS:
            row["duration_us"] = value * TIME_UNITS[unit]
        for key, name in PICKS:
            v = m.get(name, (None, ""))[0]
            if isinstance(v, float):
                row[key] = v
        row["stalls"] = _largest(m, "smsp__average_warps_issue_stalled_",
                                 "_per_issue_active.ratio")
        row["pipes"] = _largest(m, "sm__inst_executed_pipe_", ".avg.pct_of_peak_sustained_active")
        row["metrics"] = {name: [v, u] for name, (v, u) in m.items()}
        rows.append(row)
    return rows


def _descendants(pid: int) -> list[int]:
    """The processes under ``pid`` (Linux's /proc), children before theirs."""
    children: dict = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:         # gone meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.split("/")[2]))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def _kill_tree(pid: int) -> None:
    """Kill ``pid`` and every process under it: a run past its time takes
    the process ncu profiles (which holds the device) with it, not ncu alone.
    In ncu's process group, which is the tool's, not one of its own: gpu-check
    kills the tool's group at its deadline, and that must take them too."""
    for p in [pid] + _descendants(pid):
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def profile_case(ncu: str, case: str, size: str, timeout: float,
                 deadline: float = float("inf")) -> tuple[list[dict], str | None, str]:
    """(rows, why none were measured or None, the last run's output head):
    ncu on ``case``, with fewer sections on each retry (ATTEMPTS); "no
    counters" stops the tool's run.  Each run may take ``timeout`` seconds,
    less where ``deadline`` (time.monotonic) comes first; a retry that would
    get less than ``min(timeout, MIN_RUN_S)`` is not started."""
    why, head = None, ""
    for sections, metrics in ATTEMPTS:
        allowed = min(timeout, deadline - time.monotonic())
        if allowed < min(timeout, MIN_RUN_S):
            return [], (f"{why}; the tool's budget ended before a retry with fewer sections"
                        if why else "the tool's budget ended before its first run"), head
        cmd = ncu_command(ncu, case, size, sections, metrics)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            stdout, stderr = proc.communicate(timeout=allowed)
        except subprocess.TimeoutExpired:
            _kill_tree(proc.pid)
            proc.communicate()
            return [], f"ncu timed out after {allowed:.0f} s", head
        out = stdout + "\n" + stderr
        head = out[:4000]
        kernels = parse_details(stdout)
        if proc.returncode == 0 and kernels:
            return summarize(case, kernels), None, head
        said = [ln.strip() for ln in out.splitlines() if "ERROR" in ln or "error" in ln]
        why = (said[0] if said else f"exit status {proc.returncode}, no kernel profiled")[:300]
        if any(s in out for s in NO_COUNTERS):
            return [], f"no counters: {why}", head
    return [], why, head


def measure(cases, size: str, ncu: str | None, timeout: float,
            budget: float = float("inf"), saved=None) -> list[dict]:
    """The report's rows: each case's kernels, or one row saying why not.
    A case starts while ``budget`` seconds leave it at least
    ``min(timeout, MIN_RUN_S)`` and its runs end by then (the report is
    written in time for gpu-check's own deadline: a budget shorter than
    ``timeout`` shortens the runs, it does not skip them); ``saved(rows)``
    after each case (the report so far, kept if the tool is killed)."""
    rows = []
    blocked = None if ncu else "not measured: ncu not found (PATH, /opt/nvidia/nsight-compute)"
    deadline = time.monotonic() + budget
    for case in cases:
        if not blocked and deadline - time.monotonic() < min(timeout, MIN_RUN_S):
            blocked = f"not measured: the tool's budget of {budget:.0f} s spent"
        if blocked:
            rows.append(dict(case=case, status=blocked))
            continue
        t0 = time.monotonic()
        got, why, head = profile_case(ncu, case, size, timeout, deadline)
        if why is not None:
            # What ncu printed, kept in the JSON: the next run reads why.
            rows.append(dict(case=case, status=f"not measured: {why}", output=head))
            if why.startswith("no counters"):
                blocked = f"not measured: {why}"
        else:
            for r in got:
                r["profile_s"] = time.monotonic() - t0
            rows.extend(got)
        if saved is not None:
            saved(rows)
    return rows


COLUMNS = [("case", "case", None), ("kernel", "kernel", None), ("grid", "grid", None),
           ("block", "block", None), ("duration_us", "us", "{:.1f}"),
           ("dram_pct", "DRAM %", "{:.1f}"), ("memory_pct", "memory %", "{:.1f}"),
           ("sm_pct", "SM %", "{:.1f}"), ("l2_hit_pct", "L2 hit %", "{:.1f}"),
           ("achieved_occupancy_pct", "occupancy %", "{:.1f}"),
           ("theoretical_occupancy_pct", "theoretical %", "{:.1f}"),
           ("registers", "registers", "{:.0f}"), ("ipc", "IPC", "{:.2f}"),
           ("issue_busy_pct", "issue busy %", "{:.1f}"),
           ("cycles_per_issue", "warp cycles / issue", "{:.1f}"),
           ("stalls", "largest stalls (cycles / issue)", None),
           ("pipes", "busiest pipes (% of peak)", None), ("status", "status", None)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(BENCH / "results"))
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--size", choices=("full", "smallest"), default="full")
    ap.add_argument("--ncu", default=None, help="the ncu executable (default: PATH, then "
                    "/opt/nvidia/nsight-compute/*/ncu)")
    ap.add_argument("--timeout", type=float, default=60.0,
                    help="seconds one ncu run of a case may take")
    ap.add_argument("--budget", type=float, default=120.0,
                    help="seconds for all cases: every run ends by then, a shorter one where "
                    "less is left, and none starts with under min(--timeout, 15) s left")
    ap.add_argument("--target", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    unknown = [c for c in cases + ([args.target] if args.target else []) if c not in CASES]
    if unknown:
        ap.error(f"--cases/--target: expected names among {', '.join(CASES)}, got "
                 f"{', '.join(unknown)}")
    if args.timeout <= 0:
        ap.error(f"--timeout: expected seconds > 0, got {args.timeout}")
    if not args.budget > 0:
        ap.error(f"--budget: expected seconds > 0, got {args.budget}")
    if args.target:
        return run_target(args.target, args.size)
    from report import run_meta

    from ncdp_fast._report import write_report
    ncu = find_ncu(args.ncu)
    if args.ncu and ncu is None:
        ap.error(f"--ncu: expected an executable, got {args.ncu!r}")
    meta = dict(run_meta("cuda", args.size, 1), ncu=ncu)
    notes = [
        "Nsight Compute on one launch of each case after a warm-up call "
        "(--profile-from-start off: torch.cuda.profiler.start/stop around it), "
        "--clock-control none, sections " + ", ".join(SECTIONS) + "; fewer on a retry",
        "cases: " + "; ".join(f"{c}: {CASES[c][0]}, shape {CASES[c][1][args.size]}"
                              for c in cases),
        "largest stalls: smsp__average_warps_issue_stalled_<reason>_per_issue_active "
        "(cycles a warp waits on that reason per issued instruction); busiest pipes: "
        "sm__inst_executed_pipe_<pipe>.avg.pct_of_peak_sustained_active; the JSON keeps "
        "every metric ncu printed",
        "a case ncu could not measure says why in its status (no ncu, no counters: the "
        "report is written and the tool exits 0)"]

    def save(rows):
        # Written after every case, the cases not reached yet listed as such:
        # a tool stopped at gpu-check's deadline leaves what it measured.
        done = {r["case"] for r in rows}
        waiting = [dict(case=c, status=NOT_REACHED) for c in cases if c not in done]
        write_report("ncu_kernels", args.out, meta, rows + waiting, COLUMNS, notes=notes)

    save(measure(cases, args.size, ncu, args.timeout, args.budget, saved=save))
    return 0


if __name__ == "__main__":
    sys.exit(main())
