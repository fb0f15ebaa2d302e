"""`make gpu-check` / `ncdp-fast gpu-check` where this suite runs: no GPU.  The
check must refuse such a machine loudly, and its judgement of a GPU test run
and of benchmark reports must not let a run that only skipped pass."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ncdp_fast import _gpu_check as gc

ROOT = Path(__file__).resolve().parent.parent


def _fake_nvidia_smi(tmp_path, script):
    """A PATH whose nvidia-smi is ``script`` (a shell body), then the usual PATH."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    exe = bindir / "nvidia-smi"
    exe.write_text("#!/bin/sh\n" + script + "\n")
    exe.chmod(0o755)
    return f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"


NO_DRIVER = ('echo "NVIDIA-SMI has failed because it couldn\'t communicate with the NVIDIA '
             'driver."; exit 9')


def test_query_gpus_reads_names_and_capabilities(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", _fake_nvidia_smi(
        tmp_path, 'printf "NVIDIA H100 80GB HBM3, 9.0\\nNVIDIA A100-SXM4-40GB, 8.0\\n"'))
    gpus = gc.query_gpus()
    assert gpus == [("NVIDIA H100 80GB HBM3", "9.0"), ("NVIDIA A100-SXM4-40GB", "8.0")]
    assert [gc.cuda_arch(c) for _, c in gpus] == ["90-real", "80-real"]
    assert gc.cuda_arch("12.0") == "120-real"
    with pytest.raises(gc.CheckFailed, match="MAJOR.MINOR"):
        gc.cuda_arch("[N/A]")


@pytest.mark.parametrize("script", [NO_DRIVER, "exit 0"])
def test_query_gpus_without_a_gpu(tmp_path, monkeypatch, script):
    monkeypatch.setenv("PATH", _fake_nvidia_smi(tmp_path, script))
    with pytest.raises(gc.CheckFailed, match="no NVIDIA GPU found"):
        gc.query_gpus()
    monkeypatch.setattr(gc.shutil, "which", lambda name: None)
    with pytest.raises(gc.CheckFailed, match="no NVIDIA GPU found: nvidia-smi is not installed"):
        gc.query_gpus()


def test_cli_gpu_check_fails_without_a_gpu(tmp_path):
    env = dict(os.environ, PATH=_fake_nvidia_smi(tmp_path, NO_DRIVER))
    proc = subprocess.run([sys.executable, "-m", "ncdp_fast.cli", "gpu-check"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "no NVIDIA GPU found" in proc.stderr


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_gpu_check_fails_before_any_set_up(tmp_path):
    env = dict(os.environ, PATH=_fake_nvidia_smi(tmp_path, NO_DRIVER))
    # VENV: a path that must not come into existence (the check stops first).
    venv = tmp_path / "venv"
    proc = subprocess.run(["make", "-s", "gpu-check", f"VENV={venv}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "no NVIDIA GPU found" in proc.stderr
    assert not venv.exists()


def test_bench_device_cuda_refuses_to_run_on_the_cpu():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: this would run the benchmark")
    proc = subprocess.run([sys.executable, "-m", "ncdp_fast.cli", "bench", "--device", "cuda",
                           "--only", "bench_mix.py", "--quick", "--out", "/nonexistent"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "--device cuda:" in proc.stderr


def _junit(tmp_path, cases):
    """A pytest JUnit XML file: cases are (name, kind, message), kind one of
    passed, failure, error, skipped."""
    body = []
    for name, kind, message in cases:
        inner = "" if kind == "passed" else f'<{kind} message="{message}"/>'
        body.append(f'<testcase classname="tests.test_gpu" name="{name}">{inner}</testcase>')
    path = tmp_path / "junit.xml"
    path.write_text('<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">'
                    + "".join(body) + "</testsuite></testsuites>")
    return path


def test_judge_tests(tmp_path):
    ok = gc.summarize_junit(_junit(tmp_path, [
        ("a", "passed", ""), ("b", "skipped", "hierarchical sampling needs integer labels")]))
    assert ok["passed"] == 1 and ok["skipped"] == 1 and gc.judge_tests(0, ok) is None

    only_skips = gc.summarize_junit(_junit(tmp_path, [
        ("a", "skipped", "no CUDA device visible"), ("b", "skipped", "no CUDA device visible")]))
    assert "skipped for want of a device" in gc.judge_tests(0, only_skips)

    cpu_build = gc.summarize_junit(_junit(tmp_path, [
        ("a", "passed", ""), ("b", "skipped", "ncdp_fast._C was built without CUDA")]))
    assert "1 GPU tests were skipped" in gc.judge_tests(0, cpu_build)

    failed = gc.summarize_junit(_junit(tmp_path, [("a", "passed", ""), ("b", "failure", "x"),
                                                  ("c", "error", "y")]))
    assert "1 GPU tests failed and 1 errored" in gc.judge_tests(1, failed)

    assert "no GPU test ran" in gc.judge_tests(5, gc.summarize_junit(_junit(tmp_path, [])))


def test_bench_errors(tmp_path):
    path = tmp_path / "bench_mix-gpu-20260101.json"
    path.write_text(json.dumps({"meta": {}, "rows": [
        {"config": "n=T=4000", "ncdp_s": 0.1},
        {"config": "n=T=8000", "error": "CUDA error: an illegal memory access"}]}))
    assert gc.bench_errors(path) == [
        "bench_mix-gpu-20260101.json: n=T=8000 : CUDA error: an illegal memory access"]
