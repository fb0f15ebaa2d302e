"""bench/host_step.py (the host's share of a private step, on the emulated
device) in CI: one workload, one round; its rows, its counts, and a bad
argument refused by name."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import bench_script

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "host_step.py"


def _report(out, *args) -> dict:
    """The JSON report of one run of the script on the linear workload, one
    round, with ``args``."""
    proc = subprocess.run([sys.executable, str(SCRIPT), "--workloads", "linear", "--rounds", "1",
                           *args, "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (report,) = out.glob("host_step-cpu-*.json")
    return json.loads(report.read_text())


def test_host_step_reports_the_private_steps_extra_host_work(tmp_path):
    pytest.importorskip("torch")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--workloads", "linear", "--rounds", "2",
                           "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (report,) = tmp_path.glob("host_step-cpu-*.json")
    data = json.loads(report.read_text())
    assert "emulated CUDA device" in data["meta"]["device"]
    rows = data["rows"]
    assert [(r["workload"].split()[0], r["method"]) for r in rows] == [
        ("linear", "nonprivate"), ("linear", "ncdp_engine")]
    plain, private = rows
    for r in rows:
        assert 0 < r["host_ms_min"] <= r["host_ms_median"]
        assert r["operators"] > r["kernel_operators"] > 0 and r["python_calls"] > 0
    # The private step launches the device route's kernels (norms' factors,
    # two noise draws); the plain one none, and fewer operators and calls.
    assert plain["launches"] == 0 and private["launches"] >= 3
    assert private["operators"] > plain["operators"]
    assert private["kernel_operators"] > plain["kernel_operators"]
    assert private["python_calls"] > plain["python_calls"]
    assert private["python_opcodes"] > plain["python_opcodes"] > plain["python_calls"]
    assert private["extra_ms_min"] == pytest.approx(private["host_ms_min"] - plain["host_ms_min"])
    assert "| linear head" in report.with_suffix(".md").read_text()


@pytest.mark.parametrize("args, what", [(["--workloads", "linear,resnet"], "--workloads"),
                                        (["--rounds", "0"], "--rounds"),
                                        (["--device", "tpu"], "--device"),
                                        (["--launches", "none"], "--launches"),
                                        (["--clipping", "adaptive"], "--clipping"),
                                        (["--launches", "stub", "--device", "cuda"],
                                         "--launches stub")])
def test_host_step_refuses_bad_arguments(tmp_path, args, what):
    proc = subprocess.run([sys.executable, str(SCRIPT), *args, "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and what in proc.stderr


def test_host_step_on_a_machine_without_a_gpu_says_why(tmp_path):
    """--device cuda (what make gpu-check runs) where no GPU or no CUDA build is
    at hand: exit status 2 and the reason, no report."""
    pytest.importorskip("torch")
    import torch

    import ncdp_fast
    if torch.cuda.is_available() and ncdp_fast._backend.CUDA_COMPILED:
        pytest.skip("a GPU is here: make gpu-check runs the cuda mode")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cuda", "--workloads",
                           "linear", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--device cuda" in proc.stderr
    assert not list(tmp_path.iterdir())


def test_host_step_with_stubbed_launches_counts_what_a_step_runs(tmp_path):
    """--launches stub: the launches return at once in the timed rounds, and
    the counts still come from a step with the real launches (the same
    operators, calls and launches as without it), so the stand-in's zero
    fills are not counted as the step's kernels."""
    pytest.importorskip("torch")
    got = {mode: _report(tmp_path / mode, "--launches", mode) for mode in ("run", "stub")}
    assert "stubbed" in got["stub"]["meta"]["device"]
    assert "stubbed" not in got["run"]["meta"]["device"]
    for run, stub in zip(got["run"]["rows"], got["stub"]["rows"]):
        for key in ("operators", "kernel_operators", "launches"):
            assert run[key] == stub[key], key
        assert stub["host_ms_min"] > 0


def test_host_step_measures_per_layer_clipping_when_asked(tmp_path):
    """--clipping per_layer: the private step is PrivacyEngine's with
    clipping='per_layer' (named in the report's device line), whose norms and
    factors are formed a parameter at a time: more of our launches than the
    flat step's on the same workload (the linear head's weight and bias)."""
    pytest.importorskip("torch")
    got = {c: _report(tmp_path / c, "--clipping", c) for c in ("flat", "per_layer")}
    assert "clipping='per_layer'" in got["per_layer"]["meta"]["device"]
    assert "clipping=" not in got["flat"]["meta"]["device"]
    flat, per_layer = (got[c]["rows"][1] for c in ("flat", "per_layer"))
    assert per_layer["method"] == flat["method"] == "ncdp_engine"
    assert per_layer["launches"] > flat["launches"]
    assert got["flat"]["rows"][0]["launches"] == got["per_layer"]["rows"][0]["launches"] == 0


def test_python_opcodes_counts_the_interpreters_work_and_restores_the_trace():
    host_step = bench_script("host_step")

    def loop(n):
        total = 0
        for i in range(n):
            total += i
        return total
    one, ten = host_step.python_opcodes(lambda: loop(1)), host_step.python_opcodes(lambda: loop(10))
    assert 0 < one < ten          # the same code, more iterations: more opcodes
    assert host_step.python_opcodes(lambda: loop(10)) == ten        # deterministic
    import sys
    seen = []
    sys.settrace(lambda *a: seen.append(a) or None)
    try:
        host_step.python_opcodes(lambda: None)
        assert sys.gettrace() is not None      # the caller's trace put back
    finally:
        sys.settrace(None)

