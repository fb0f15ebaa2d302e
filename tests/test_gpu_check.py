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
from conftest import bench_script

from ncdp_fast import _gpu_check_bench as gpu_bench
from ncdp_fast import _gpu_check_env as gpu_env
from ncdp_fast import _gpu_check_tests as gpu_tests

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
    gpus = gpu_env.query_gpus()
    assert gpus == [("NVIDIA H100 80GB HBM3", "9.0"), ("NVIDIA A100-SXM4-40GB", "8.0")]
    assert [gpu_env.cuda_arch(c) for _, c in gpus] == ["90-real", "80-real"]
    assert gpu_env.cuda_arch("12.0") == "120-real"
    with pytest.raises(gpu_env.CheckFailed, match="MAJOR.MINOR"):
        gpu_env.cuda_arch("[N/A]")


@pytest.mark.parametrize("script", [NO_DRIVER, "exit 0"])
def test_query_gpus_without_a_gpu(tmp_path, monkeypatch, script):
    monkeypatch.setenv("PATH", _fake_nvidia_smi(tmp_path, script))
    with pytest.raises(gpu_env.CheckFailed, match="no NVIDIA GPU found"):
        gpu_env.query_gpus()
    monkeypatch.setattr(gpu_env.shutil, "which", lambda name: None)
    with pytest.raises(gpu_env.CheckFailed,
                       match="no NVIDIA GPU found: nvidia-smi is not installed"):
        gpu_env.query_gpus()


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
    ok = gpu_tests.summarize_junit(_junit(tmp_path, [
        ("a", "passed", ""), ("b", "skipped", "hierarchical sampling needs integer labels")]))
    assert ok["passed"] == 1 and ok["skipped"] == 1 and gpu_tests.judge_tests(0, ok) is None

    only_skips = gpu_tests.summarize_junit(_junit(tmp_path, [
        ("a", "skipped", "no CUDA device visible"), ("b", "skipped", "no CUDA device visible")]))
    assert "skipped for want of a device" in gpu_tests.judge_tests(0, only_skips)

    cpu_build = gpu_tests.summarize_junit(_junit(tmp_path, [
        ("a", "passed", ""), ("b", "skipped", "ncdp_fast._C was built without CUDA")]))
    assert "1 GPU tests were skipped" in gpu_tests.judge_tests(0, cpu_build)

    failed = gpu_tests.summarize_junit(_junit(tmp_path, [("a", "passed", ""),
                                                         ("b", "failure", "x"),
                                                         ("c", "error", "y")]))
    assert "1 GPU tests failed and 1 errored" in gpu_tests.judge_tests(1, failed)

    assert "no GPU test ran" in gpu_tests.judge_tests(
        5, gpu_tests.summarize_junit(_junit(tmp_path, [])))


def test_the_gpu_tests_run_in_several_processes_where_xdist_is_there(tmp_path, monkeypatch):
    cmd = gpu_tests.test_command(sys.executable, tmp_path / "j.xml")
    assert cmd[-1] == "tests" and cmd[cmd.index("-m", 3) + 1] == "gpu"
    assert cmd[cmd.index("-n") + 1] == str(gpu_tests.GPU_TEST_WORKERS)     # make test has it
    assert cmd[cmd.index("--dist") + 1] == "loadfile"
    monkeypatch.setattr(gpu_tests, "missing_modules", lambda python, names, env=None: ["xdist"])
    alone = gpu_tests.test_command(sys.executable, tmp_path / "j.xml")
    assert "-n" not in alone and "--dist" not in alone and alone[-1] == "tests"


def test_bench_errors(tmp_path):
    path = tmp_path / "bench_mix-gpu-20260101.json"
    path.write_text(json.dumps({"meta": {}, "rows": [
        {"config": "n=T=4000", "ncdp_s": 0.1},
        {"config": "n=T=8000", "error": "CUDA error: an illegal memory access"},
        # A peer's refusal (bench_hf: Opacus ghost on tied weights) is a result.
        {"workload": "GPT-2", "method": "opacus_ghost", "peer_refused": "NotImplementedError"}]}))
    assert gpu_bench.bench_errors(path) == [
        "bench_mix-gpu-20260101.json: n=T=8000 : CUDA error: an illegal memory access"]


def _listing(root):
    """Every file under ``root`` with its size and modification time."""
    return sorted((str(p), p.stat().st_size, p.stat().st_mtime_ns)
                  for p in Path(root).rglob("*") if p.is_file())


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_gpu_check_with_python_uses_that_interpreter_as_it_is(tmp_path):
    # Issue 24: on a GPU machine with its CUDA stack preinstalled and no network,
    # `make gpu-check PYTHON=...` must not build a venv or download anything, and
    # must leave the interpreter's site-packages as they were. Here torch is the
    # CPU build, so the check must get past nvidia-smi and stop at its own
    # "torch sees no GPU" phase.
    python = sys.executable
    site_dirs = json.loads(subprocess.check_output(
        [python, "-c", "import json, site; print(json.dumps(site.getsitepackages()))"], text=True))
    before = [_listing(d) for d in site_dirs]
    venv, pip_log, out = tmp_path / "venv", tmp_path / "pip.log", tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k != "PYTHON"}
    env.update(PATH=_fake_nvidia_smi(tmp_path, 'printf "NVIDIA H100 80GB HBM3, 9.0\\n"'),
               PIP_NO_INDEX="1", PIP_INDEX_URL="http://127.0.0.1:9/simple",
               PIP_LOG=str(pip_log))
    proc = subprocess.run(["make", "-s", "gpu-check", f"PYTHON={python}", f"VENV={venv}",
                           f"GPU_CHECK_FLAGS=--out {out}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "NVIDIA H100 80GB HBM3 (compute capability 9.0)" in proc.stdout
    assert "sees no GPU" in proc.stderr, proc.stderr
    assert not venv.exists()
    assert not pip_log.exists(), "pip ran"
    assert [_listing(d) for d in site_dirs] == before
    # The summary names the failed phase.
    summary = json.loads(next(out.glob("gpu_check-gpu-*.json")).read_text())
    assert [(r["phase"], r["status"]) for r in summary["rows"]] == [("torch", "failed")]


def test_peer_skips_are_named_and_do_not_fail(tmp_path):
    s = gpu_tests.summarize_junit(_junit(tmp_path, [
        ("a", "passed", ""),
        ("test_cuda_fused_optimizer_matches_opacus", "skipped",
         "opacus is not installed (the peer of this comparison)")]))
    assert gpu_tests.judge_tests(0, s) is None
    assert s["peer_skips"] == ["test_cuda_fused_optimizer_matches_opacus: opacus is not "
                               "installed (the peer of this comparison)"]


def test_benchmarks_the_budget_leaves_out_are_listed_not_failed(tmp_path, monkeypatch):
    from ncdp_fast.cli import GPU_BENCHES
    monkeypatch.setattr(gpu_bench, "missing_peers", lambda python, env=None: ["opacus"])
    monkeypatch.setattr(gpu_bench, "missing_modules", lambda python, names, env=None: [])
    # No time left: none starts.
    rows = gpu_bench.run_benches(sys.executable, tmp_path, [], deadline=0.0)
    assert [r["status"] for r in rows] == [gpu_bench.NOT_RUN] * (len(GPU_BENCHES) + 4)
    order = gpu_bench.check_order()
    assert sorted(order) == sorted(GPU_BENCHES + [gpu_bench.PROFILE, gpu_bench.DMMA,
                                                  gpu_bench.NCU, gpu_bench.HOST])
    # The goal rows' benchmarks first (issue 36: every run measures them), then
    # the counters (no run has read them yet), the profile and the mma probe,
    # then a linear layer's parts and the convolution attribution; the host's
    # share last (what the budget leaves).
    assert order[:10] == ["hf", "finetune", "clip", "noise", "mix", "ntk", gpu_bench.NCU,
                          gpu_bench.PROFILE, gpu_bench.DMMA, "linear"]
    assert order.index("conv") == order.index("tied") + 1
    assert order[-1] == gpu_bench.HOST
    assert gpu_bench.judge_benches(rows) == ([], order)
    # Cut short at the deadline: not run; a failing one still fails the check.
    monkeypatch.setattr(gpu_bench, "_run_until", lambda cmd, deadline, env=None: None)
    cut = gpu_bench.run_benches(sys.executable, tmp_path, [], deadline=float("inf"))
    assert {r["status"] for r in cut} == {gpu_bench.NOT_RUN}
    assert "cut short" in cut[0]["detail"]
    failed = dict(phase="mix", status="failed", detail="exit status 1")
    assert gpu_bench.judge_benches(cut[:1] + [failed]) == (["mix: failed: exit status 1"],
                                                           [cut[0]["phase"]])


def test_a_benchmark_without_what_it_is_built_from_is_not_run(tmp_path, monkeypatch):
    """bench_hf on a GPU machine without transformers: listed as not run, with
    why, and never started (the others run as before)."""
    from ncdp_fast.cli import GPU_BENCHES
    assert "hf" in GPU_BENCHES and gpu_bench.BENCH_NEEDS["hf"] == ("transformers",)
    real = gpu_bench.missing_modules
    monkeypatch.setattr(gpu_bench, "missing_peers", lambda python, env=None: [])
    monkeypatch.setattr(gpu_bench, "missing_modules",
                        lambda python, names, env=None: ["transformers"])
    started = []
    monkeypatch.setattr(gpu_bench, "_run_until", lambda cmd, deadline, env=None:
                        started.append(cmd[cmd.index("--only") + 1] if "--only" in cmd
                                       else Path(cmd[1]).stem))
    rows = {r["phase"]: r for r in gpu_bench.run_benches(sys.executable, tmp_path, [],
                                                          deadline=float("inf"))}
    # The profile and the host's share build bench_hf's models too.
    for name in ("hf", gpu_bench.PROFILE, gpu_bench.HOST):
        assert rows[name]["status"] == gpu_bench.NOT_RUN
        assert "transformers not installed" in rows[name]["detail"]
    assert "hf" not in started and \
        set(started) == set(GPU_BENCHES) - {"hf"} | {"dmma_rate", "ncu_kernels"}
    # The real query: this interpreter has torch, and no module of that name.
    assert real(sys.executable, ("torch", "no_such_module_xyz")) == [
        "no_such_module_xyz"]


def test_info_says_why_the_module_is_cpu_only(monkeypatch):
    import types

    from ncdp_fast import _backend, info
    note = "nvcc was not found on PATH, CUDACXX or /usr/local/cuda, so this is a CPU-only module"
    fake = types.SimpleNamespace(__file__="/x/_C.so", cuda_compiled=lambda: False,
                                 cuda_archs=lambda: "", build_note=lambda: note)
    monkeypatch.setattr(_backend, "_C", fake)
    monkeypatch.setattr(_backend, "CUDA_COMPILED", False)
    monkeypatch.setattr(_backend, "CUDA_ARCHS", "")
    monkeypatch.setattr(_backend, "cuda_devices", lambda: ())
    report = info(print_it=False)
    assert report["cpu_only"] == note and report["native_file"] == "/x/_C.so"


def test_native_module_override_loads_that_file_or_refuses(tmp_path):
    from ncdp_fast import _backend
    if _backend._C is None:
        pytest.skip("ncdp_fast._C is not built")
    code = "import ncdp_fast; print(ncdp_fast.info(print_it=False)['native_file'])"
    built = _backend._C.__file__
    env = dict(os.environ, NCDP_NATIVE_MODULE=built)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == built, proc.stderr
    env["NCDP_NATIVE_MODULE"] = str(tmp_path / "missing.so")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0
    assert "NCDP_NATIVE_MODULE: expected the path of a built ncdp_fast._C" in proc.stderr


@pytest.mark.parametrize("tests_pass", [True, False])
def test_benchmarks_run_beside_failing_gpu_tests(tmp_path, monkeypatch, tests_pass):
    # A device lease is too short to run the check twice: failing GPU tests
    # fail the check, but the benchmarks still measure, and the summary says
    # the tables were taken beside failing tests.
    from ncdp_fast import _gpu_check as check
    benched = []
    monkeypatch.setattr(check, "query_gpus", lambda: [("NVIDIA H200", "9.0")])
    monkeypatch.setattr(check, "check_torch",
                        lambda python: dict(version="t", cuda="13.0", count=1))
    monkeypatch.setattr(check, "check_env", lambda native=None: None)
    monkeypatch.setattr(check, "find_nvcc", lambda: "nvcc")
    monkeypatch.setattr(check, "rebuild", lambda python, archs, nvcc: (
        "m.so", dict(cuda_archs=["90-real"], cuda_runtime=13000, cuda_driver=13000)))

    def run_tests(python, workdir, env=None):
        if not tests_pass:
            raise gpu_env.CheckFailed("2 GPU tests failed and 0 errored")
        return dict(passed=3, skipped=0, peer_skips=[])

    monkeypatch.setattr(check, "run_tests", run_tests)
    monkeypatch.setattr(check, "run_benches", lambda python, out, args, deadline, env=None:
                        benched.append(1) or [dict(phase="ntk", status="ok")])
    rc = check.run(["--out", str(tmp_path)])
    assert benched == [1]
    assert rc == (0 if tests_pass else 1)
    summary = json.loads(next(tmp_path.glob("gpu_check-gpu-*.json")).read_text())
    assert [p["phase"] for p in summary["rows"]] == ["torch", "build", "pytest -m gpu", "ntk"]
    beside = "the benchmarks ran beside failing GPU tests (pytest -m gpu above)"
    assert (beside in (tmp_path / next(tmp_path.glob("gpu_check-gpu-*.md")).name).read_text()) \
        is (not tests_pass)


def test_the_profile_phase_runs_bench_profile_step(tmp_path):
    cmd = gpu_bench._command("py", gpu_bench.PROFILE, tmp_path, ["--rounds", "2"])
    assert cmd[1].endswith("bench/profile_step.py") and cmd[cmd.index("--size") + 1] == "full"
    assert cmd[cmd.index("--device") + 1] == "cuda" and cmd[cmd.index("--out") + 1] == str(tmp_path)
    quick = gpu_bench._command("py", gpu_bench.PROFILE, tmp_path, ["--quick", "--rounds", "1"])
    assert quick[quick.index("--size") + 1] == "quick"
    assert gpu_bench._command("py", "mix", tmp_path, ["--rounds", "2"])[-4:] == [
        "--only", "mix", "--rounds", "2"]
    dmma = gpu_bench._command("py", gpu_bench.DMMA, tmp_path, ["--rounds", "2"])
    assert dmma[1].endswith("bench/dmma_rate.py") and dmma[dmma.index("--out") + 1] == str(tmp_path)
    ncu = gpu_bench._command("py", gpu_bench.NCU, tmp_path, ["--rounds", "2"])
    assert ncu[1].endswith("bench/ncu_kernels.py") and ncu[ncu.index("--size") + 1] == "full"
    assert float(ncu[ncu.index("--budget") + 1]) == gpu_bench.NCU_BUDGET_S
    # The package's kernels, furthest from their goals first (the tool's order).
    cases = ncu[ncu.index("--cases") + 1].split(",")
    assert cases == ["noise_add", "dense_one_pass", "dense_clip", "gram"]
    assert cases == list(bench_script("ncu_kernels").CASES)[:4]
    quick = gpu_bench._command("py", gpu_bench.NCU, tmp_path, ["--quick", "--rounds", "1"])
    assert quick[quick.index("--size") + 1] == "smallest"
    # Its budget within what the check's leaves, its report written before.
    short = gpu_bench._command("py", gpu_bench.NCU, tmp_path, [], left=55.0)
    assert short[short.index("--budget") + 1] == "40" == short[short.index("--timeout") + 1]
    host = gpu_bench._command("py", gpu_bench.HOST, tmp_path, ["--rounds", "2"])
    assert host[1].endswith("bench/host_step.py") and host[host.index("--device") + 1] == "cuda"
    assert host[host.index("--out") + 1] == str(tmp_path)


def test_check_env_puts_the_checkout_first_on_the_path(monkeypatch):
    # bench/profile_step.py and bench/host_step.py run as scripts: the
    # checkout must be on their path whatever PYTHONPATH the caller set.
    import os
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["/tmp/site", ""]))
    env = gpu_env.check_env()
    assert env["PYTHONPATH"].split(os.pathsep) == [str(gpu_env.ROOT), "/tmp/site"]
    monkeypatch.delenv("PYTHONPATH")
    assert gpu_env.check_env()["PYTHONPATH"] == str(gpu_env.ROOT)
