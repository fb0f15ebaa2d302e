"""Where one training step's time goes, private against non-private, on the
benchmarks' own workloads (bench_hf's BERT and GPT-2, bench_finetune's linear
head, transformer and EfficientNet): one torch.profiler step each, after
warm-up, so that a GPU run says what to change next instead of only how far
a row is from its goal (the first H200 run's profile found the norm kernel at
76% of a BERT step; issue 36).

    python bench/profile_step.py [--device cuda] [--size full|quick|smallest]
                                 [--workloads bert,gpt2,linear,transformer,efficientnet]
                                 [--out bench/results]

writes four reports into ``--out``:

* ``profile_step-<cpu|gpu>-<date>``: a row per (workload, method): the step's
  wall time (median of timed steps, the device synchronised), the device's busy
  time in the profiled step (the sum of its kernels' durations; on the CPU
  none) and their ratio -- well under 1 means the host, not the device, sets
  the pace --, kernels launched, the host waits the CUDA runtime saw
  (synchronisations and copies), and the operators the step dispatched;
* ``profile_ops-<cpu|gpu>-<date>``: the private step's most expensive entries
  (kernels and operators by their own device time on a GPU, operators by their
  own CPU time on the CPU);
* ``profile_idle-<cpu|gpu>-<date>``: the profiled step's phases (forward,
  backward, the optimizer's step before and after the clip op's host
  transfer, ...) with the host's ms in each and the device's idle ms there,
  and the longest idle gaps with the host operator running at their middle
  (bench/step_idle.py): where the host, not the device, sets the pace;
* ``profile_extra-<cpu|gpu>-<date>``: every entry of either step with the
  private step's own time, the non-private step's and their difference, the
  largest difference first (the Markdown shows the first 25 a workload, the
  JSON all): where the private step's extra time goes, kernel by kernel (the
  H200 run of 2026-11-30 kept only the private step's 15 largest entries, and
  a BERT-base step's 14 extra ms were half unexplained).

A workload that cannot be built or run here gets a row with its ``error``
(which fails ``make gpu-check``).  ``make gpu-check`` runs it after bench_hf
and bench_finetune; tests/test_profile_step.py runs it in CI.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import step_idle  # noqa: E402  (bench/ on the path first)

WORKLOADS = ("bert", "gpt2", "linear", "transformer", "efficientnet")
METHODS = ("nonprivate", "ncdp_engine")
WARMUP, TIMED, TOP, EXTRA_TOP = 3, 5, 15, 25
# CUDA runtime calls that make the host wait for the device (or copy across).
HOST_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
              "cudaMemcpy", "cudaMemcpyAsync")


def _workload(name, size, device):
    """(label, build(method) -> step) for a workload of bench_hf or bench_finetune."""
    if name in ("bert", "gpt2"):
        import test_bench_hf as hf
        p = dict(hf.shapes(size, device)[name], kind=name)
        return hf.workload_label(name, p), lambda m: hf.build_step(p, m, device)[0]
    import test_bench_finetune as ft
    p = dict(ft.SHAPES[size][name], kind=name)
    return ft.workload_label(name, p), lambda m: ft.build_step(p, m, device)[0]


def _sync(torch, device):
    if device == "cuda":
        torch.cuda.synchronize()


def _own_device_us(e):
    """An event's or an average's own device time, µs (torch >= 2.4 names it
    device time, older versions cuda time); a kernel's is its duration."""
    own = getattr(e, "self_device_time_total", None)
    return e.self_cuda_time_total if own is None else own


def _own_cpu_us(e):
    return e.self_cpu_time_total


# The caching allocator's calls to the driver in a warm step, from
# torch.cuda.memory_stats: a cudaFree makes the host wait for the device (a
# retry frees every cached block first), so a steady step should make none;
# the 2026-12-01 run's GPT-2 step varied from 1.17x to 1.55x non-private.
ALLOCATOR_COUNTS = {"num_device_alloc": "device mallocs", "num_device_free": "device frees",
                    "num_alloc_retries": "alloc retries"}


def _allocator_counts(torch, device):
    if device != "cuda":
        return None
    stats = torch.cuda.memory_stats()
    return {k: stats.get(k, 0) for k in ALLOCATOR_COUNTS}


def _idle(events, device_type):
    """step_idle.analyse of the profiled step, or {"error": ...}: a fault of
    the phase analysis is its report's error row, not the loss of the step's
    other reports."""
    from _common import exception_text
    try:
        return step_idle.analyse(events, device_type)
    except Exception as exc:  # noqa: BLE001  -- the row says why
        return {"error": exception_text(exc)}


def profile(step, torch, device):
    """(summary, top entries, every entry's own ms by name) of one profiled
    ``step`` after warm-up and timing."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity
    for _ in range(WARMUP):
        step()
    _sync(torch, device)
    before = _allocator_counts(torch, device)
    times = []
    for _ in range(TIMED):
        t0 = time.perf_counter()
        step()
        _sync(torch, device)
        times.append(time.perf_counter() - t0)
    after = _allocator_counts(torch, device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with torch.profiler.profile(activities=acts) as prof:
        with step_idle.markers(torch):
            with torch.profiler.record_function(step_idle.STEP):
                step()
        _sync(torch, device)
    events = prof.events()
    kernels = step_idle.device_events(events, DeviceType.CUDA)
    ops = [e for e in events if e.name.startswith("aten::") and
           (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]
    busy_ms = sum(map(_own_device_us, kernels)) / 1e3 if device == "cuda" else None
    wall_ms = 1e3 * statistics.median(times)
    summary = dict(wall_ms=wall_ms, busy_ms=busy_ms,
                   busy_fraction=None if busy_ms is None else busy_ms / wall_ms,
                   kernels=len(kernels) if device == "cuda" else None,
                   host_waits=sum(1 for e in events if e.name in HOST_WAITS),
                   operators=len(ops), idle=_idle(events, DeviceType.CUDA),
                   **{k: None if before is None else (after[k] - before[k]) / TIMED
                      for k in ALLOCATOR_COUNTS})
    # On a GPU kernels and operators by their own device time; on the CPU the
    # operators by their own CPU time.
    own = _own_device_us if device == "cuda" else _own_cpu_us
    avgs = sorted((a for a in prof.key_averages()
                   if own(a) > 0 and (device == "cuda" or a.key.startswith("aten::"))),
                  key=own, reverse=True)
    total = sum(map(own, avgs)) or 1.0
    top = [dict(entry=a.key[:120], calls=a.count, ms=own(a) / 1e3, share=own(a) / total)
           for a in avgs[:TOP]]
    entries = {}
    for a in avgs:                  # names cut to 120 characters may meet: summed
        calls, ms = entries.get(a.key[:120], (0, 0.0))
        entries[a.key[:120]] = (calls + a.count, ms + own(a) / 1e3)
    return summary, top, entries


def extra_rows(label, private, base):
    """A row per entry of either step (``entries`` of :func:`profile`): its
    calls and own ms in each, and the private step's extra ms, largest
    first."""
    rows = []
    for name in set(private) | set(base):
        pc, pm = private.get(name, (0, 0.0))
        nc, nm = base.get(name, (0, 0.0))
        rows.append(dict(workload=label, entry=name, private_calls=pc, private_ms=pm,
                         nonprivate_calls=nc, nonprivate_ms=nm, extra_ms=pm - nm))
    rows.sort(key=lambda r: r["extra_ms"], reverse=True)
    for i, r in enumerate(rows):
        r["rank"] = i + 1
    return rows


def run(device, size, names, out):
    import torch

    from _common import exception_text
    from report import run_meta

    from ncdp_fast._report import write_report
    meta = run_meta(device, size, 1)
    steps, ops, extra, idle = [], [], [], []
    for name in names:
        try:
            label, build = _workload(name, size, device)
        except Exception as exc:  # noqa: BLE001  -- the row says why
            steps.append(dict(workload=name, method="", error=exception_text(exc)))
            continue
        base_ms = base_entries = None       # the non-private step's, METHODS[0]
        for method in METHODS:
            row = dict(workload=label, method=method)
            try:
                summary, top, entries = profile(build(method), torch, device)
                idle += idle_rows(label, method, summary.pop("idle"))
                row.update(summary)
                if method == "nonprivate":
                    base_ms, base_entries = summary["wall_ms"], entries
                if base_ms is not None:
                    row["x_nonprivate"] = summary["wall_ms"] / base_ms
                if method != "nonprivate":
                    ops += [dict(workload=label, method=method, rank=i + 1, **t)
                            for i, t in enumerate(top)]
                    if base_entries is not None:
                        extra += extra_rows(label, entries, base_entries)
            except Exception as exc:  # noqa: BLE001
                row["error"] = exception_text(exc)
            steps.append(row)
            if device == "cuda":
                torch.cuda.empty_cache()
    what = "device" if device == "cuda" else "CPU"
    common = [f"size {size}; {WARMUP} warm-up steps, wall time the median of {TIMED} steps "
              "(the device synchronised after each), then one step under torch.profiler "
              "(bench/profile_step.py)",
              "nonprivate / ncdp_engine: the steps of bench_hf and bench_finetune "
              "(PrivacyEngine with its GhostClipper)"]
    write_report("profile_step", str(out), meta, steps,
                 [("workload", "workload", None), ("method", "method", None),
                  ("wall_ms", "wall ms/step", "{:.2f}"),
                  ("x_nonprivate", "× non-private", "{:.2f}"),
                  ("busy_ms", "device busy ms", "{:.2f}"),
                  ("busy_fraction", "busy / wall", "{:.2f}"),
                  ("kernels", "kernels", None), ("host_waits", "host waits", None),
                  ("operators", "operators dispatched", None),
                  *[(k, f"{name} / step", "{:.1f}") for k, name in ALLOCATOR_COUNTS.items()],
                  ("error", "error", None)],
                 notes=common + ["device busy: the sum of the profiled step's kernel and copy durations "
                                 "(not the device-side ranges of user annotations, as the "
                                 "optimizer's step); "
                                 "busy / wall well under 1: the host sets the pace",
                                 "host waits: CUDA runtime synchronisations and copies seen "
                                 f"by the profiler ({', '.join(HOST_WAITS)}; none on the CPU)",
                                 "device mallocs, frees, alloc retries: the CUDA caching "
                                 "allocator's calls to the driver a timed step "
                                 "(torch.cuda.memory_stats over the timed steps; a free makes "
                                 "the host wait for the device; none on the CPU)"])
    write_report("profile_ops", str(out), meta, ops,
                 [("workload", "workload", None), ("method", "method", None),
                  ("rank", "rank", None), ("entry", "kernel or operator", None),
                  ("calls", "calls", None), ("ms", f"own {what} ms", "{:.3f}"),
                  ("share", f"share of the step's {what} time", "{:.3f}")],
                 notes=common + [f"the private step's {TOP} largest entries by their own "
                                 f"{what} time"])
    extra_cols = [("workload", "workload", None), ("rank", "rank", None),
                  ("entry", "kernel or operator", None),
                  ("private_calls", "private calls", None),
                  ("private_ms", f"private own {what} ms", "{:.3f}"),
                  ("nonprivate_calls", "non-private calls", None),
                  ("nonprivate_ms", f"non-private own {what} ms", "{:.3f}"),
                  ("extra_ms", "extra ms", "{:.3f}")]
    extra_notes = common + [
        f"every kernel or operator of either step by its own {what} time in one profiled "
        "step, the private step's extra time (private - non-private) largest first; a "
        "kernel the private step runs in place of another (a GEMM of another tile shape) "
        f"shows as one extra and one saving; the Markdown keeps {EXTRA_TOP} rows a workload, "
        "the JSON every row"]
    write_report("profile_extra", str(out), meta, extra, extra_cols, notes=extra_notes,
                 md_rows=[r for r in extra if r["rank"] <= EXTRA_TOP])
    write_report("profile_idle", str(out), meta, idle,
                 [("workload", "workload", None), ("method", "method", None),
                  ("entry", "phase, or an idle gap", None),
                  ("host_ms", "host ms", "{:.3f}"),
                  ("idle_ms", "device idle ms", "{:.3f}"),
                  ("device_ms", "device busy ms", "{:.3f}"),
                  ("host_op", "host operator at the gap's middle", None),
                  ("error", "error", None)],
                 notes=common + [
                     "the profiled step's host phases laid over the device's busy intervals "
                     "(bench/step_idle.py): device idle ms in a phase is time the host set "
                     "the pace there; drain: the device still busy after the step returned; "
                     "step: the whole step (device busy ms: its merged kernel intervals)",
                     f"gaps: the {step_idle.TOP_GAPS} longest device idle gaps of at least "
                     f"{step_idle.GAP_US:.0f} µs and the innermost host operator running at "
                     "their middle (none: Python between operators)",
                     "under the profiler each host operator costs more than without it: the "
                     "idle times are upper bounds; on the CPU no device, host ms only"])
    return steps


def idle_rows(label, method, idle) -> list:
    """The ``profile_idle`` rows of one step's :func:`step_idle.analyse`."""
    if idle is None:
        return []
    if "error" in idle:
        return [dict(workload=label, method=method, entry="step", error=idle["error"])]
    rows = [dict(workload=label, method=method, entry=name, host_ms=idle[name]["host_ms"],
                 idle_ms=idle[name]["idle_ms"]) for name in step_idle.PHASES]
    rows.append(dict(workload=label, method=method, entry="drain",
                     device_ms=idle["drain"]["device_ms"]))
    known = [r["idle_ms"] for r in rows if r.get("idle_ms") is not None]
    rows.append(dict(workload=label, method=method, entry="step",
                     host_ms=sum(r.get("host_ms") or 0.0 for r in rows),
                     idle_ms=sum(known) if known else None, device_ms=idle["busy_ms"]))
    rows += [dict(workload=label, method=method, entry=f"gap in {g['phase']}",
                  idle_ms=g["length_us"] / 1e3, host_op=g["host"] or "none")
             for g in idle["gaps"]]
    return rows


def main(argv=None) -> int:
    from _common import workload_names
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--size", choices=("full", "quick", "smallest"), default="full")
    names, args = workload_names(ap, WORKLOADS, argv)
    if args.device == "cuda":
        from _common import cuda_missing
        why = cuda_missing()
        if why:
            print(f"profile_step.py: --device cuda: {why}", file=sys.stderr)
            return 2
    steps = run(args.device, args.size, names, args.out)
    return 1 if any("error" in r for r in steps) else 0


if __name__ == "__main__":
    sys.exit(main())
