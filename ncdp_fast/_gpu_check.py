"""``ncdp-fast gpu-check`` (``make gpu-check``): what a machine with an NVIDIA GPU
has to show before a GPU claim of this project is believed.

1. ``nvidia-smi`` lists the GPUs and their compute capabilities; without one
   the check fails at once ("no NVIDIA GPU found").
2. torch must see the GPU (the tests and benchmarks hand it torch CUDA tensors).
3. ncdp_fast alone is built (``pip install --no-deps --no-build-isolation
   --no-index --target``) with ``NCDP_CUDA_ARCH`` from those capabilities
   ("9.0" -> "90-real") into ``build/gpu-check/`` of the checkout, and every
   later step loads that module (``NCDP_NATIVE_MODULE``): the interpreter's own
   environment is never changed and nothing is downloaded. The fresh module
   must report CUDA kernels for them and see the GPU itself (its static CUDA
   runtime needs a driver at least as new).
4. ``pytest -m gpu``, every GPU test, whatever the budget (in four processes
   where pytest-xdist is installed, each test file in one): fails on any
   failure or error, and when no GPU test ran or any was skipped for want of a
   device -- a GPU check that only skips proves nothing. Tests skipped because
   their peer (Opacus, dp-accounting) is not installed are named in the summary.
   The benchmarks still run after failing tests (the check still fails, and the
   summary says the tables were taken beside them): a device lease is too short
   to run the check twice, and the first H200 lease lost its benchmarks to two
   test failures that had nothing to do with speed.
5. The GPU benchmarks, one ``ncdp-fast bench --device cuda --only NAME`` each
   (the pytest-benchmark suite of bench/ on the GPU, by default at the stated
   shapes with ``--rounds 2``: on a GPU the quick shapes are launch-bound and
   say nothing; issue 36's rows first) with the time the budget leaves; each writes
   ``bench/results/<report>-gpu-<date>.{json,md}`` and fails the check if
   pytest fails, a table reports an error row (a method with no result) or it
   writes nothing. A benchmark the budget leaves no time for, or cuts short,
   is listed as not run: slowness is reported, not failed. After the six
   benchmarks of the goal rows (hf, finetune, clip, noise, mix, ntk),
   ``bench/ncu_kernels.py`` reads Nsight Compute's counters on the noise, the
   dense clip and the Gram kernel (``ncu_kernels`` report, rewritten after
   every case, within 80 s of its own or what the budget leaves; a machine
   without counters is reported in its rows, not failed), then
   ``bench/profile_step.py`` profiles one step of each of the hf and finetune
   workloads, private and not (``profile_step``, ``profile_ops`` and
   ``profile_extra`` reports: busy against wall time, kernels, host waits, the
   largest kernels, every kernel's extra time in the private step; and
   ``profile_idle``: the device's idle time in each host phase of the step), then
   ``bench/dmma_rate.py`` measures the FP64 tensor cores' rate per mma shape
   (``dmma_rate`` report: m8n8k4, sm_80's, against sm_90's m16n8 shapes, the
   Gram kernel's m16n8k4 among them, seconds), then the other benchmarks
   (``linear``, a linear layer's norms and clipped sum, first); last,
   when the budget leaves time, ``bench/host_step.py --device cuda`` measures
   the host's share of a step on this machine's host (``host_step`` report).
6. A summary of the phases in ``bench/results/gpu_check-gpu-<date>.{json,md}``.

Steps 1-3 live in ``_gpu_check_env.py`` (the device, the environment, the
build), step 4 in ``_gpu_check_tests.py``, step 5 in ``_gpu_check_bench.py``;
this module runs them in order (:func:`run`) and writes the summary.

It runs from a source checkout (tests/ and bench/ live next to the package),
with ``sys.executable`` (``make gpu-check PYTHON=...`` picks it).
"""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from ._gpu_check_bench import judge_benches, run_benches
from ._gpu_check_env import (_INFO, BUILD_DIR, ROOT, CheckFailed, _python_json, _say, check_env,
                             check_torch, cuda_arch, find_nvcc, query_gpus, rebuild)
from ._gpu_check_tests import run_tests

BENCH_DEFAULT_ARGS = ["--rounds", "2"]
BENCH_QUICK_ARGS = ["--quick", "--rounds", "1"]
# The whole check inside one 10-minute device call: on the first H200 run the
# torch check, build and tests took 140 s and the seven benchmarks of issue 36
# 274 s at their stated shapes with 2 rounds.
DEFAULT_BUDGET_S = 560
DEFAULT_BUDGET_FULL_S = 3600


# ------------------------------------------------------------------- the check

def run(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="ncdp-fast gpu-check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"),
                    help="where the benchmarks and the summary write their reports")
    ap.add_argument("--full", action="store_true",
                    help="benchmarks with 3 rounds and a 1-hour budget (tens of minutes) "
                    "instead of 2 rounds")
    ap.add_argument("--quick", action="store_true",
                    help="benchmarks at their quick shapes, one round (launch-bound on a GPU)")
    ap.add_argument("--budget", type=float, default=None,
                    help=f"seconds for the whole check (default {DEFAULT_BUDGET_S}, "
                    f"{DEFAULT_BUDGET_FULL_S} with --full); benchmarks get what is left")
    ap.add_argument("--no-build", action="store_true",
                    help=f"keep the extension of an earlier check ({BUILD_DIR}/site), or the "
                    "installed one if there is none (it must have CUDA kernels for this GPU)")
    ap.add_argument("--no-bench", action="store_true", help="stop after the tests")
    args = ap.parse_args(argv)
    budget = args.budget or (DEFAULT_BUDGET_FULL_S if args.full else DEFAULT_BUDGET_S)
    start = time.monotonic()
    deadline = start + budget
    python = sys.executable
    out = Path(args.out)
    phases, problems, meta = [], [], {}
    env = check_env()

    def phase(name, fn):
        t0 = time.monotonic()
        _say(f"{name} ...")
        try:
            detail = fn()
            phases.append(dict(phase=name, status="ok", seconds=time.monotonic() - t0,
                               detail=detail))
            return True
        except CheckFailed as exc:
            phases.append(dict(phase=name, status="failed", seconds=time.monotonic() - t0,
                               detail=str(exc)))
            problems.append(f"{name}: {exc}")
            return False

    try:
        gpus = query_gpus()
    except CheckFailed as exc:
        print(f"gpu-check: {exc}", file=sys.stderr)
        return 1
    archs = sorted({cuda_arch(cap) for _, cap in gpus})
    meta.update(device=", ".join(f"{n} (compute capability {c})" for n, c in gpus),
                device_tag="gpu", archs=";".join(archs), quick=args.quick, budget_s=budget)
    _say(f"{meta['device']}; building for {';'.join(archs)}")

    def torch_phase():
        t = check_torch(python)
        meta["torch"] = t["version"]
        return f"torch {t['version']}, CUDA {t['cuda']}, {t['count']} device(s)"

    def build_phase():
        nonlocal env
        if args.no_build:
            built = sorted((BUILD_DIR / "site").glob("ncdp_fast/_C*.so"))
            env = check_env(built[0] if built else None)
            info = _python_json(python, _INFO, env=env)
        else:
            native, info = rebuild(python, archs, find_nvcc())
            env = check_env(native)
        meta.update(ncdp_cuda_archs=info["cuda_archs"], cuda_runtime=info["cuda_runtime"],
                    cuda_driver=info["cuda_driver"])
        return f"archs {info['cuda_archs']}, runtime {info['cuda_runtime']}, " \
               f"driver {info['cuda_driver']}"

    built = phase("torch", torch_phase) and phase("build", build_phase)
    if built:
        with tempfile.TemporaryDirectory() as tmp:
            def tests_phase():
                s = run_tests(python, Path(tmp), env)
                meta["tests"] = s
                said = f"{s['passed']} passed, {s['skipped']} skipped"
                if s["peer_skips"]:
                    said += f"; peer not installed: {'; '.join(s['peer_skips'])}"
                return said
            tests_ok = phase("pytest -m gpu", tests_phase)
    # Failing tests fail the check (problems) but leave the benchmarks to run.
    if built and not args.no_bench:
        if not tests_ok:
            meta["benchmarks_beside_failing_tests"] = True
            _say("GPU tests failed: the check fails, the benchmarks run all the same")
        bench_args = [] if args.full else BENCH_QUICK_ARGS if args.quick else BENCH_DEFAULT_ARGS
        rows = run_benches(python, out, bench_args, deadline, env)
        phases.extend(rows)
        failed, meta["not_run"] = judge_benches(rows)
        problems.extend(failed)
    total = time.monotonic() - start
    meta["total_s"] = round(total, 1)
    from ._report import write_report
    write_report("gpu_check", str(out), meta, phases,
                 [("phase", "phase", None), ("status", "status", None),
                  ("seconds", "s", "{:.1f}"), ("detail", "detail", None),
                  ("reports", "reports", None)],
                 notes=[f"total {total:.0f} s of a {budget:.0f} s budget",
                        "benchmarks: " + ("stated shapes, 3 rounds" if args.full else
                                          "--quick --rounds 1" if args.quick else
                                          "stated shapes, 2 rounds"),
                        "not run within the budget: " + (", ".join(meta.get("not_run", []))
                                                         or "none")]
                 + (["the benchmarks ran beside failing GPU tests (pytest -m gpu above)"]
                    if meta.get("benchmarks_beside_failing_tests") else []))
    if problems:
        for p in problems:
            print(f"gpu-check: FAILED: {p}", file=sys.stderr)
        return 1
    if meta.get("not_run"):
        _say(f"benchmarks not run within the budget: {', '.join(meta['not_run'])}")
    _say(f"passed in {total:.0f} s")
    return 0
