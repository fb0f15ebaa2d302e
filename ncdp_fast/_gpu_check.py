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
4. ``pytest -m gpu``, every GPU test, whatever the budget: fails on any
   failure or error, and when no GPU test ran or any was skipped for want of a
   device -- a GPU check that only skips proves nothing. Tests skipped because
   their peer (Opacus, dp-accounting) is not installed are named in the summary.
5. The GPU benchmarks, one ``ncdp-fast bench --device cuda --only NAME`` each
   (the pytest-benchmark suite of bench/ on the GPU, by default ``--quick
   --rounds 1``) with the time the budget leaves; each writes
   ``bench/results/<report>-gpu-<date>.{json,md}`` and fails the check if
   pytest fails, a table reports an error row (a method with no result) or it
   writes nothing. A benchmark the budget leaves no time for, or cuts short,
   is listed as not run: slowness is reported, not failed.
6. A summary of the phases in ``bench/results/gpu_check-gpu-<date>.{json,md}``.

It runs from a source checkout (tests/ and bench/ live next to the package),
with ``sys.executable`` (``make gpu-check PYTHON=...`` picks it).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from ._backend import NATIVE_ENV as _NATIVE_ENV

ROOT = Path(__file__).resolve().parent.parent
BENCH_QUICK_ARGS = ["--quick", "--rounds", "1"]
DEFAULT_BUDGET_S = 480          # the whole check on one H100, quick benchmarks
DEFAULT_BUDGET_FULL_S = 3600
# require_cuda's skip reasons (tests/conftest.py): a GPU test skipped for these
# did not test the GPU.
DEVICE_SKIPS = re.compile(r"no CUDA device visible|built without CUDA|torch is not installed")
# A benchmark is not started with less time than this left.
MIN_BENCH_S = 20
# The check's own build, under the checkout: CMake's tree and pip's --target.
BUILD_DIR = ROOT / "build" / "gpu-check"
# Skip reasons of tests whose comparison peer is not installed (importorskip's
# "could not import 'opacus'"): listed in the summary, not counted as failures.
PEER_SKIPS = re.compile(r"opacus|dp_accounting|dp-accounting")
NOT_RUN = "not run"


class CheckFailed(Exception):
    """A step of the check failed; the message says which and why."""


def _say(text: str) -> None:
    print(f"gpu-check: {text}", flush=True)


# ------------------------------------------------------------------ the device

def query_gpus(run=subprocess.run) -> list[tuple[str, str]]:
    """(name, compute capability "M.m") of every GPU nvidia-smi lists."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        raise CheckFailed("no NVIDIA GPU found: nvidia-smi is not installed (no NVIDIA driver)")
    try:
        proc = run([exe, "--query-gpu=name,compute_cap", "--format=csv,noheader"],
                   capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise CheckFailed(f"no NVIDIA GPU found: nvidia-smi did not answer ({exc})") from None
    said = " ".join((proc.stdout + " " + proc.stderr).split())[-300:]
    if proc.returncode != 0:
        if "compute_cap" in said and "valid" in said:
            raise CheckFailed(f"nvidia-smi cannot report compute capabilities (driver too old?): "
                              f"{said}")
        raise CheckFailed(f"no NVIDIA GPU found: nvidia-smi exited with status "
                          f"{proc.returncode}: {said}")
    gpus = []
    for line in proc.stdout.splitlines():
        if line.strip():
            name, _, cap = line.rpartition(",")
            gpus.append((name.strip(), cap.strip()))
    if not gpus:
        raise CheckFailed("no NVIDIA GPU found: nvidia-smi lists none")
    return gpus


def cuda_arch(cap: str) -> str:
    """CMake's architecture for a compute capability: "9.0" -> "90-real"."""
    m = re.fullmatch(r"(\d+)\.(\d+)", cap)
    if m is None:
        raise CheckFailed(f"nvidia-smi reported compute capability {cap!r}; expected MAJOR.MINOR")
    return f"{m[1]}{m[2]}-real"


def nvcc_path() -> str | None:
    """The CUDA compiler CMake would find (CUDACXX, PATH, /usr/local/cuda), or None."""
    for candidate in (os.environ.get("CUDACXX"), shutil.which("nvcc"),
                      "/usr/local/cuda/bin/nvcc"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def find_nvcc() -> str:
    nvcc = nvcc_path()
    if nvcc is not None:
        return nvcc
    raise CheckFailed("nvcc not found (CUDACXX, PATH, /usr/local/cuda/bin): install the CUDA "
                      "toolkit to build the kernels")


def check_env(native: Path | None = None) -> dict:
    """The environment of every process the check starts: the checkout first
    on the path (``python -m`` from ROOT) and, once built, the check's module."""
    env = dict(os.environ)
    env.pop(_NATIVE_ENV, None)
    if native is not None:
        env[_NATIVE_ENV] = str(native)
    return env


_INFO = "import json, ncdp_fast; print(json.dumps(ncdp_fast.info(print_it=False)))"


def _python_json(python, code, env=None) -> dict | list:
    proc = subprocess.run([python, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env=env, timeout=300)
    if proc.returncode != 0:
        raise CheckFailed(f"{python} -c {code!r} failed: {proc.stderr.strip()[-1000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def check_torch(python) -> dict:
    t = _python_json(python, "import json, torch; print(json.dumps(dict(version=torch.__version__, "
                             "cuda=torch.version.cuda, available=torch.cuda.is_available(), "
                             "count=torch.cuda.device_count())))")
    if not t["available"]:
        what = "a CPU-only build" if t["cuda"] is None else f"built for CUDA {t['cuda']}"
        base = t["version"].split("+")[0]
        raise CheckFailed(
            f"torch {t['version']} ({what}) sees no GPU; the GPU tests and benchmarks take torch "
            "CUDA tensors. Run the check with an interpreter that has a CUDA build of torch "
            "(`make gpu-check PYTHON=/path/to/python`), or install one into this environment, "
            f"e.g. `{python} -m pip install --force-reinstall torch=={base}` from PyPI (its "
            "Linux x86-64 wheels are CUDA builds) or from a wheel file (/opt/wheels holds the "
            "CPU build), then run the check again")
    return t


# ------------------------------------------------------------------- the build

def rebuild(python, archs: list[str], nvcc: str, build_dir: Path = BUILD_DIR) -> tuple[Path, dict]:
    """Builds ncdp_fast for ``archs`` from scratch into ``build_dir`` (CMake's
    tree in ``cmake/``, pip's ``--target`` in ``site/``) without touching the
    interpreter's environment or any package index; returns the built
    ``_C`` module's path and ``ncdp_fast.info()`` of a fresh process using it."""
    shutil.rmtree(build_dir, ignore_errors=True)
    env = dict(check_env(), NCDP_CUDA_ARCH=";".join(archs), CUDACXX=nvcc)
    if env.pop("NCDP_DISABLE_CUDA", None) is not None:
        _say("ignoring NCDP_DISABLE_CUDA for this build")
    site = build_dir / "site"
    rc = subprocess.call([python, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                          "--no-build-isolation", "--no-deps", "--no-index", "--no-cache-dir",
                          "--target", str(site),
                          "--config-settings", f"build-dir={build_dir / 'cmake'}", str(ROOT)],
                         cwd=ROOT, env=env)
    if rc != 0:
        raise CheckFailed(f"building the extension failed (pip exit status {rc}; output above); "
                          "the interpreter needs scikit-build-core, pybind11, cmake and ninja "
                          "(nothing is downloaded)")
    built = sorted(site.glob("ncdp_fast/_C*.so"))
    if len(built) != 1:
        raise CheckFailed(f"the build left {len(built)} ncdp_fast/_C*.so under {site}; expected 1")
    info = _python_json(python, _INFO, env=check_env(built[0]))
    if info.get("native_file") != str(built[0]):
        raise CheckFailed(f"the tests would load ncdp_fast._C from {info.get('native_file')}, "
                          f"not the module just built ({built[0]})")
    if not info["cuda_compiled"]:
        raise CheckFailed("ncdp_fast._C was built without CUDA kernels: CMake found no CUDA "
                          f"compiler (nvcc: {nvcc})")
    missing = sorted(set(archs) - set(info["cuda_archs"]))
    if missing:
        raise CheckFailed(f"ncdp_fast._C has architectures {info['cuda_archs']}, not {missing}")
    if not info["cuda_devices"]:
        raise CheckFailed(f"ncdp_fast._C sees no GPU (CUDA runtime {info['cuda_runtime']}, "
                          f"driver {info['cuda_driver']}): the driver must support the CUDA "
                          "version nvcc built the kernels with")
    return built[0], info


# ------------------------------------------------------------------- the tests

def summarize_junit(path) -> dict:
    """Counts of a pytest JUnit XML file and the skip messages that mean the
    test never reached a GPU."""
    root = ET.parse(path).getroot()
    out = dict(passed=0, failed=0, errors=0, skipped=0, device_skips=[], peer_skips=[])
    for case in root.iter("testcase"):
        if case.find("failure") is not None:
            out["failed"] += 1
        elif case.find("error") is not None:
            out["errors"] += 1
        elif case.find("skipped") is not None:
            out["skipped"] += 1
            message = case.find("skipped").get("message", "")
            if DEVICE_SKIPS.search(message):
                out["device_skips"].append(f"{case.get('classname')}::{case.get('name')}: "
                                           f"{message}")
            elif PEER_SKIPS.search(message):
                out["peer_skips"].append(f"{case.get('name')}: {message}")
        else:
            out["passed"] += 1
    return out


def judge_tests(rc: int, summary: dict) -> str | None:
    """Why the GPU test run does not count as a pass (None: it does)."""
    if summary["failed"] or summary["errors"]:
        return (f"{summary['failed']} GPU tests failed and {summary['errors']} errored "
                "(pytest output above)")
    if summary["device_skips"]:
        shown = "; ".join(summary["device_skips"][:3])
        return (f"{len(summary['device_skips'])} GPU tests were skipped for want of a device, "
                f"e.g. {shown}")
    if summary["passed"] == 0:
        return "no GPU test ran (all skipped or none collected)"
    if rc != 0:
        return f"pytest exited with status {rc}"
    return None


def run_tests(python, workdir: Path, env=None) -> dict:
    junit = workdir / "gpu-tests.xml"
    rc = subprocess.call([python, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                          "-rfEs", f"--junitxml={junit}", "tests"], cwd=ROOT, env=env)
    if not junit.exists():
        raise CheckFailed(f"pytest wrote no report (exit status {rc})")
    summary = summarize_junit(junit)
    why = judge_tests(rc, summary)
    if why:
        raise CheckFailed(why)
    return summary


# -------------------------------------------------------------- the benchmarks

def _run_until(cmd, deadline, env=None) -> int | None:
    """Exit status of ``cmd``, or None if it was still running at ``deadline``
    (then it and every process it started are killed)."""
    proc = subprocess.Popen(cmd, cwd=ROOT, start_new_session=True, env=env)
    try:
        return proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return None


def bench_errors(path) -> list[str]:
    rows = json.loads(Path(path).read_text()).get("rows", [])
    return [f"{Path(path).name}: {r.get('shape') or r.get('config') or ''} "
            f"{r.get('method', '')}: {r['error']}".strip() for r in rows if r.get("error")]


# What a GPU benchmark cannot run without (its workloads are built from it); a
# benchmark whose needs are not installed is listed as not run, with why.
BENCH_NEEDS = {"hf": ("transformers",)}


def missing_modules(python, names, env=None) -> list[str]:
    """Those of ``names`` this interpreter cannot import."""
    return _python_json(python, "import importlib.util, json; print(json.dumps([m for m in "
                                f"{tuple(names)!r} if importlib.util.find_spec(m) is None]))",
                        env=env)


def missing_peers(python, env=None) -> list[str]:
    """The benchmarks' comparison peers this interpreter cannot import (their
    methods are skipped by the suite and missing from its tables)."""
    return missing_modules(python, ("opacus", "dp_accounting"), env)


def run_benches(python, out: Path, bench_args, deadline, env=None) -> list[dict]:
    from .cli import GPU_BENCHES
    results = []
    peers = missing_peers(python, env)
    needs = sorted({m for ms in BENCH_NEEDS.values() for m in ms})
    absent = set(missing_modules(python, needs, env)) if needs else set()
    for name in GPU_BENCHES:
        left = deadline - time.monotonic()
        row = dict(phase=name, status="ok")
        if peers:
            row["detail"] = f"{', '.join(peers)} not installed: its methods skipped"
        lacking = [m for m in BENCH_NEEDS.get(name, ()) if m in absent]
        if lacking:
            row.update(status=NOT_RUN, detail=f"{', '.join(lacking)} not installed (its "
                       "workloads are built from it; it can travel as wheels)")
            results.append(row)
            continue
        if left < MIN_BENCH_S:
            row.update(status=NOT_RUN, detail=f"time budget spent ({left:.0f} s left)")
            results.append(row)
            continue
        started = time.time()
        t0 = time.monotonic()
        _say(f"{name} ({left:.0f} s of the budget left)")
        rc = _run_until([python, "-m", "ncdp_fast.cli", "bench", "--device", "cuda", "--out",
                         str(out), "--only", name, *bench_args], deadline, env)
        row["seconds"] = time.monotonic() - t0
        written = sorted(p for p in out.glob("*-gpu-*.json") if p.stat().st_mtime >= started)
        row["reports"] = ", ".join(p.stem for p in written)
        errors = [e for p in written for e in bench_errors(p)]
        if rc is None:
            row.update(status=NOT_RUN, detail="cut short at the end of the time budget "
                       f"after {row['seconds']:.0f} s (--budget gives it more)")
        elif rc != 0:
            row.update(status="failed", detail=f"exit status {rc}")
        elif not written:
            row.update(status="failed", detail=f"no *-gpu-*.json written to {out}")
        elif errors:
            row.update(status="failed", detail="; ".join(errors)[:1000])
        results.append(row)
    return results


def judge_benches(rows) -> tuple[list[str], list[str]]:
    """(problems, benchmarks not run): a benchmark the budget left out or cut
    short is listed, not failed -- a slow machine is not a broken one."""
    problems = [f"{r['phase']}: {r['status']}: {r.get('detail', '')}" for r in rows
                if r["status"] not in ("ok", NOT_RUN)]
    return problems, [r["phase"] for r in rows if r["status"] == NOT_RUN]


# ------------------------------------------------------------------- the check

def run(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(prog="ncdp-fast gpu-check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"),
                    help="where the benchmarks and the summary write their reports")
    ap.add_argument("--full", action="store_true",
                    help="benchmarks at their stated shapes with 3 rounds (tens of minutes) "
                    "instead of --quick --rounds 1")
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
                device_tag="gpu", archs=";".join(archs), quick=not args.full, budget_s=budget)
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

    ok = phase("torch", torch_phase) and phase("build", build_phase)
    if ok:
        with tempfile.TemporaryDirectory() as tmp:
            def tests_phase():
                s = run_tests(python, Path(tmp), env)
                meta["tests"] = s
                said = f"{s['passed']} passed, {s['skipped']} skipped"
                if s["peer_skips"]:
                    said += f"; peer not installed: {'; '.join(s['peer_skips'])}"
                return said
            ok = phase("pytest -m gpu", tests_phase)
    if ok and not args.no_bench:
        bench_args = [] if args.full else BENCH_QUICK_ARGS
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
                                          "--quick --rounds 1"),
                        "not run within the budget: " + (", ".join(meta.get("not_run", []))
                                                         or "none")])
    if problems:
        for p in problems:
            print(f"gpu-check: FAILED: {p}", file=sys.stderr)
        return 1
    if meta.get("not_run"):
        _say(f"benchmarks not run within the budget: {', '.join(meta['not_run'])}")
    _say(f"passed in {total:.0f} s")
    return 0
