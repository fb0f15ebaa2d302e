"""Step 4 of ``ncdp-fast gpu-check`` (``_gpu_check.py``): ``pytest -m gpu`` and
its judgement -- a run that failed, only skipped, or skipped for want of a
device does not pass."""
from __future__ import annotations

import re
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

from ._gpu_check_env import ROOT, CheckFailed, missing_modules

# require_cuda's skip reasons (tests/conftest.py): a GPU test skipped for these
# did not test the GPU.
DEVICE_SKIPS = re.compile(r"no CUDA device visible|built without CUDA|torch is not installed")
# Skip reasons of tests whose comparison peer is not installed (importorskip's
# "could not import 'opacus'"): listed in the summary, not counted as failures.
PEER_SKIPS = re.compile(r"opacus|dp_accounting|dp-accounting")


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


# Test processes on the GPU where the interpreter has pytest-xdist (the H200
# image does): each test file in one of them, as `make test` runs the suite
# (--dist loadfile), all on the one device.  The 2026-12-01 H200 run's 304 GPU
# tests took 121 s in one process, a fifth of the check's 560-s budget, for
# little device work: most of it each test's own set-up on the host.
GPU_TEST_WORKERS = 4


def test_command(python, junit: Path, env=None) -> list[str]:
    """The ``pytest -m gpu`` command, in GPU_TEST_WORKERS processes where
    ``python`` has pytest-xdist, else in one."""
    cmd = [python, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-rfEs",
           f"--junitxml={junit}"]
    if not missing_modules(python, ("xdist",), env):
        cmd += ["-n", str(GPU_TEST_WORKERS), "--dist", "loadfile"]
    return cmd + ["tests"]


def run_tests(python, workdir: Path, env=None) -> dict:
    junit = workdir / "gpu-tests.xml"
    rc = subprocess.call(test_command(python, junit, env), cwd=ROOT, env=env)
    if not junit.exists():
        raise CheckFailed(f"pytest wrote no report (exit status {rc})")
    summary = summarize_junit(junit)
    why = judge_tests(rc, summary)
    if why:
        raise CheckFailed(why)
    return summary

