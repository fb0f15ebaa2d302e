"""bench/ncu_kernels.py (Nsight Compute on the kernels issue 36 left
unexplained, a phase of `make gpu-check`) without a GPU: every case runs on the
emulated device at its smallest shape (what ncu would run), ncu's CSV details
page becomes the report's rows, and a stand-in ncu drives the whole tool --
retries with fewer sections, a machine without counters, no ncu at all.  The
counters themselves need a GPU."""
import json
import stat
import sys

import pytest
from conftest import bench_script, run_bench_script

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream",'
          '"Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit",'
          '"Metric Value"')


def _row(kid, kernel, section, name, unit, value):
    return (f'"{kid}","4242","python3","host","{kernel}","1","7","(256, 1, 1)","(528, 1, 1)",'
            f'"0","9.0","{section}","{name}","{unit}","{value}"')


def _details(kernel="add_gaussian_kernel", kid=0, duration=("usecond", "146.20")):
    rows = [_row(kid, kernel, "GPU Speed Of Light Throughput", "Duration", *duration),
            _row(kid, kernel, "GPU Speed Of Light Throughput", "DRAM Throughput", "%", "27.31"),
            _row(kid, kernel, "GPU Speed Of Light Throughput", "Compute (SM) Throughput", "%",
                 "81.5"),
            _row(kid, kernel, "Occupancy", "Achieved Occupancy", "%", "58.9"),
            _row(kid, kernel, "Launch Statistics", "Registers Per Thread",
                 "register/thread", "48"),
            _row(kid, kernel, "Launch Statistics", "Grid Size", "", "1,056"),
            _row(kid, kernel, "Scheduler Statistics", "Issue Slots Busy", "%", "77.2"),
            _row(kid, kernel, "Command line profiler metrics",
                 "smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio",
                 "ratio", "2.5"),
            _row(kid, kernel, "Command line profiler metrics",
                 "smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio",
                 "ratio", "0.75"),
            _row(kid, kernel, "Command line profiler metrics",
                 "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio", "ratio", "1.1"),
            _row(kid, kernel, "Command line profiler metrics",
                 "smsp__average_warps_issue_stalled_selected_per_issue_active.ratio", "ratio",
                 "1"),
            _row(kid, kernel, "Command line profiler metrics",
                 "sm__inst_executed_pipe_fp64.avg.pct_of_peak_sustained_active", "%", "64.0"),
            _row(kid, kernel, "Command line profiler metrics",
                 "sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active", "%", "40.5")]
    return "\n".join([HEADER] + rows)


def test_the_details_page_becomes_kernels_and_rows():
    ncu = bench_script("ncu_kernels")
    text = "==PROF== Connected to process 4242\n" + _details() + "\n" + "\n".join(
        _details("gram_rows_f64_kernel", 1, ("msecond", "1.5")).splitlines()[1:]) + \
        "\n==PROF== Disconnected from process 4242\n"
    kernels = ncu.parse_details(text)
    assert [k["kernel"] for k in kernels] == ["add_gaussian_kernel", "gram_rows_f64_kernel"]
    assert kernels[0]["metrics"]["Grid Size"] == (1056.0, "")      # thousands separator
    rows = ncu.summarize("noise_add", kernels)
    assert rows[0]["duration_us"] == pytest.approx(146.2)
    assert rows[1]["duration_us"] == pytest.approx(1500.0)
    assert rows[0]["registers"] == 48 and rows[0]["issue_busy_pct"] == pytest.approx(77.2)
    assert rows[0]["stalls"] == "math_pipe_throttle 2.50, wait 1.10, selected 1.00"
    assert rows[0]["pipes"] == "fp64 64.00, alu 40.50"
    assert rows[0]["grid"] == "(528, 1, 1)" and rows[0]["status"] == "measured"


def test_a_text_value_stays_text():
    ncu = bench_script("ncu_kernels")
    kernels = ncu.parse_details("\n".join([HEADER, _row(3, "k", "S", "Duration", "usecond",
                                                        "n/a")]))
    assert kernels[0]["metrics"]["Duration"] == ("n/a", "usecond")
    assert "duration_us" not in ncu.summarize("gram", kernels)[0]


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["noise_add", "torch_randn", "dense_clip", "dense_one_pass",
                                  "dense_torch", "gram"])
def test_each_case_runs_on_the_device(case, require_cuda):
    # What ncu runs, at the smallest shape (on the emulated device the same
    # calls without the CUDA profiler's start and stop), leaving this process
    # as it was: no emulation switched on for the processes later tests start
    # (a resumed run in a subprocess took the device route and its parameters
    # differed in their last bits), the default generator's state kept.
    import os

    import torch
    before = torch.random.get_rng_state()
    assert bench_script("ncu_kernels").run_target(case, "smallest") == 0
    assert "NCDP_CUDA_EMULATION" not in os.environ
    if case not in ("torch_randn", "dense_torch"):    # the peers draw from the default one
        assert torch.equal(torch.random.get_rng_state(), before)
    torch.random.set_rng_state(before)


def test_the_command_leaves_the_clocks_and_profiles_only_the_marked_launch():
    ncu = bench_script("ncu_kernels")
    cmd = ncu.ncu_command("/x/ncu", "gram", "full", ncu.SECTIONS, (ncu.STALLS, ncu.PIPES))
    assert cmd[:8] == ["/x/ncu", "--profile-from-start", "off", "--clock-control", "none",
                       "--csv", "--page", "details"]
    assert cmd[cmd.index("--metrics") + 1] == f"{ncu.STALLS},{ncu.PIPES}"
    assert cmd[-4:] == ["--target", "gram", "--size", "full"]
    assert cmd.count("--section") == len(ncu.SECTIONS)


def _fake_ncu(tmp_path, body: str, name: str = "ncu"):
    """An executable standing in for ncu: ``body`` runs with ``args`` (its argv)
    and ``log`` (a file it may append to)."""
    exe = tmp_path / name
    exe.write_text(f"#!{sys.executable}\nimport sys\nargs = sys.argv[1:]\n"
                   f"log = open({str(tmp_path / 'calls')!r}, 'a')\n"
                   "log.write(' '.join(args) + '\\n'); log.close()\n" + body)
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return exe


def _calls(tmp_path):
    path = tmp_path / "calls"
    return path.read_text().splitlines() if path.exists() else []


def test_the_tool_end_to_end_with_a_stand_in_ncu(tmp_path):
    ncu = bench_script("ncu_kernels")
    # Refuses the metric patterns (an older ncu): the retry without them gives rows.
    fake = _fake_ncu(tmp_path, f"""
if '--metrics' in args:
    print('==ERROR== Failed to find metric regex')
    sys.exit(1)
case = args[args.index('--target') + 1]
print('==PROF== Connected')
print({_details()!r}.replace('add_gaussian_kernel', case + '_kernel'))
""")
    out = tmp_path / "out"
    proc = run_bench_script("ncu_kernels", "--out", str(out), "--cases", "noise_add,gram",
                            "--ncu", str(fake), "--size", "smallest", timeout=300)
    assert proc.returncode == 0, proc.stderr
    calls = _calls(tmp_path)
    assert len(calls) == 4 and "--metrics" in calls[0] and "--metrics" not in calls[1]
    report = json.loads(next(out.glob("ncu_kernels-*.json")).read_text())
    assert [(r["case"], r["kernel"], r["status"]) for r in report["rows"]] == [
        ("noise_add", "noise_add_kernel", "measured"), ("gram", "gram_kernel", "measured")]
    assert report["rows"][0]["metrics"]["DRAM Throughput"] == [27.31, "%"]
    assert "noise_add_kernel" in next(out.glob("ncu_kernels-*.md")).read_text()


def test_a_machine_without_counters_is_reported_once_not_failed(tmp_path):
    ncu = bench_script("ncu_kernels")
    fake = _fake_ncu(tmp_path, """
print('==ERROR== Failed to initialize the profiler: LibraryNotLoaded')
sys.exit(1)
""")
    rows = ncu.measure(["noise_add", "dense_clip", "gram"], "smallest", str(fake), 30)
    assert len(_calls(tmp_path)) == 1           # the others are not tried again
    assert [r["case"] for r in rows] == ["noise_add", "dense_clip", "gram"]
    assert all(r["status"].startswith("not measured: no counters: ==ERROR== Failed to "
                                      "initialize the profiler") for r in rows)
    assert "LibraryNotLoaded" in rows[0]["output"]          # kept for the next run to read
    assert not any("error" in r for r in rows)  # gpu-check fails on an error row


def test_no_ncu_and_a_hung_ncu_say_so(tmp_path):
    ncu = bench_script("ncu_kernels")
    rows = ncu.measure(["gram"], "smallest", None, 30)
    assert rows == [dict(case="gram", status="not measured: ncu not found (PATH, "
                         "/opt/nvidia/nsight-compute)")]
    slow = _fake_ncu(tmp_path, "import time\ntime.sleep(30)\n")
    rows = ncu.measure(["gram", "noise_add"], "smallest", str(slow), 1)
    assert [r["status"] for r in rows] == ["not measured: ncu timed out after 1 s"] * 2
    # An output it cannot read: said, and kept.
    odd = _fake_ncu(tmp_path, "print('Kernel,Duration')\nprint('k,3')\n", "odd_ncu")
    rows = ncu.measure(["gram"], "smallest", str(odd), 30)
    assert rows[0]["status"] == "not measured: exit status 0, no kernel profiled"
    assert "Kernel,Duration" in rows[0]["output"]
    # Its own budget: no case starts that could end past it.
    rows = ncu.measure(["gram", "noise_add"], "smallest", str(slow), 1, budget=1.5)
    assert [r["status"] for r in rows] == ["not measured: ncu timed out after 1 s",
                                           "not measured: the tool's budget of 2 s spent"]


def test_a_budget_shorter_than_the_timeout_shortens_the_runs_not_skips_them(tmp_path,
                                                                            monkeypatch):
    # gpu-check hands the tool what its own budget leaves (40 s for 40 s of
    # timeout on the 2026-11-30 run): every case used to be refused at once
    # there (it waited for a whole timeout of room), so no counter was read.
    ncu = bench_script("ncu_kernels")
    fast = _fake_ncu(tmp_path, f"""
case = args[args.index('--target') + 1]
print({_details()!r}.replace('add_gaussian_kernel', case + '_kernel'))
""")
    saved = []
    rows = ncu.measure(["noise_add", "dense_one_pass"], "smallest", str(fast), 40, budget=40,
                       saved=lambda rows: saved.append([r["case"] for r in rows]))
    assert [(r["case"], r["status"]) for r in rows] == [("noise_add", "measured"),
                                                       ("dense_one_pass", "measured")]
    assert saved == [["noise_add"], ["noise_add", "dense_one_pass"]]   # after every case
    # A run is cut at the budget's end, not at its own timeout (the shortest
    # run worth starting lowered to fit a test).
    monkeypatch.setattr(ncu, "MIN_RUN_S", 1.0)
    slow = _fake_ncu(tmp_path, "import time\ntime.sleep(30)\n", "slow_ncu")
    rows = ncu.measure(["gram", "noise_add"], "smallest", str(slow), 60, budget=1.8)
    assert [r["status"] for r in rows] == ["not measured: ncu timed out after 2 s",
                                           "not measured: the tool's budget of 2 s spent"]


def test_a_run_past_its_time_is_killed_with_the_process_it_profiles(tmp_path):
    # ncu starts the profiled python as its child, which holds the device:
    # killing ncu alone would leave it running into the next case.
    import os
    import time
    ncu = bench_script("ncu_kernels")
    pid_file = tmp_path / "child.pid"
    hanging = _fake_ncu(tmp_path, f"""
import subprocess, time
child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])
open({str(pid_file)!r}, 'w').write(str(child.pid))
time.sleep(60)
""")
    def assert_gone(pid):
        t0 = time.monotonic()
        while time.monotonic() - t0 < 10:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                        return          # dead, not yet reaped
            except FileNotFoundError:
                return
            time.sleep(0.05)
        raise AssertionError(f"process {pid} outlived the kill")

    rows = ncu.measure(["gram"], "smallest", str(hanging), 2)
    assert rows[0]["status"] == "not measured: ncu timed out after 2 s"
    assert_gone(int(pid_file.read_text()))
    # gpu-check kills the tool's process group at its own deadline
    # (_gpu_check_bench._run_until: a session of its own, then killpg): ncu
    # and the process it profiles are in it.
    import signal
    import subprocess
    pid_file.unlink()
    tool = subprocess.Popen([sys.executable, ncu.__file__, "--out", str(tmp_path / "out"),
                             "--cases", "gram", "--ncu", str(hanging), "--size", "smallest"],
                            start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        t0 = time.monotonic()
        while not pid_file.exists() and time.monotonic() - t0 < 120:
            time.sleep(0.05)
        time.sleep(0.2)                 # the pid written whole
    finally:
        os.killpg(tool.pid, signal.SIGKILL)
        tool.wait()
    assert_gone(int(pid_file.read_text()))


def test_a_retry_the_budget_cannot_hold_is_not_started(tmp_path):
    ncu = bench_script("ncu_kernels")
    refusing = _fake_ncu(tmp_path, """
import time
time.sleep(1.0)
print('==ERROR== Failed to find metric regex')
sys.exit(1)
""")
    rows = ncu.measure(["noise_add"], "smallest", str(refusing), 2, budget=2.5)
    assert len(_calls(tmp_path)) == 1
    assert rows[0]["status"] == ("not measured: ==ERROR== Failed to find metric regex; the "
                                 "tool's budget ended before a retry with fewer sections")


def test_a_stopped_tool_leaves_the_cases_it_measured(tmp_path):
    # gpu-check kills the tool at its own deadline: the report is written
    # after every case, the cases not reached listed as such.
    import subprocess
    import time
    ncu = bench_script("ncu_kernels")
    fake = _fake_ncu(tmp_path, f"""
import time
case = args[args.index('--target') + 1]
if case != 'noise_add':
    time.sleep(60)
print({_details()!r})
""")
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, str(ncu.__file__), "--out",
                             str(out), "--cases", "noise_add,gram", "--ncu", str(fake), "--size",
                             "smallest"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        t0 = time.monotonic()
        # The Markdown follows the JSON, each written whole (renamed into place).
        while not list(out.glob("ncu_kernels-*.md")) and time.monotonic() - t0 < 120:
            time.sleep(0.1)
    finally:
        proc.kill()
        proc.wait()
    report = json.loads(next(out.glob("ncu_kernels-*.json")).read_text())
    assert [(r["case"], r["status"]) for r in report["rows"]] == [
        ("noise_add", "measured"), ("gram", ncu.NOT_REACHED)]


def test_bad_arguments_are_refused_by_name(capsys):
    ncu = bench_script("ncu_kernels")
    with pytest.raises(SystemExit):
        ncu.main(["--cases", "noise_add,warp_drive"])
    assert "--cases/--target: expected names among noise_add" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ncu.main(["--timeout", "0"])
    assert "--timeout: expected seconds > 0, got 0.0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ncu.main(["--budget", "0"])
    assert "--budget: expected seconds > 0, got 0.0" in capsys.readouterr().err


@pytest.mark.gpu
def test_the_dense_launch_forms_give_the_ops_bits(require_cuda):
    # bench/_common.dense_rows_launch (bench_clip_dense's ncdp_chunked and
    # ncdp_one_pass, the one-pass case here): at B <= 8 every form sums the
    # rows in one slab in the same order and finishes it alike, so the op's
    # bits (seed 1, offset 0, as the launcher's).
    import torch

    import ncdp_fast as nf
    ncu = bench_script("ncu_kernels")
    torch.manual_seed(0)
    g = torch.randn(5, 1031, device=require_cuda)
    want = nf.clip_and_noise(g, max_norm=1.0, noise_multiplier=1.0, seed=1, offset=0).grad
    for one_pass in (False, True):
        assert torch.equal(ncu.dense_rows_launch(g, 1.0, 1.0, one_pass)(), want), one_pass


def test_a_report_rewritten_in_place_is_whole_or_as_it_was(tmp_path, monkeypatch):
    # The tool rewrites its report after every case and may be killed at
    # gpu-check's deadline, which then reads it: a write cut short must leave
    # the previous report, not a truncated JSON.
    import os

    from ncdp_fast import _report
    cols = [("case", "case", None)]
    first = _report.write_report("probe", str(tmp_path), {}, [dict(case="a")], cols, quiet=True)
    _report.write_report("probe", str(tmp_path), {}, [dict(case="a"), dict(case="b")], cols,
                         quiet=True)
    assert [r["case"] for r in json.loads(first.read_text())["rows"]] == ["a", "b"]

    def killed(src, dst):
        raise KeyboardInterrupt     # stopped between the write and the rename
    monkeypatch.setattr(os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        _report.write_report("probe", str(tmp_path), {}, [dict(case="c")], cols, quiet=True)
    assert [r["case"] for r in json.loads(first.read_text())["rows"]] == ["a", "b"]
    monkeypatch.undo()
    _report.write_report("probe", str(tmp_path), {}, [dict(case="d")], cols, quiet=True)
    assert [r["case"] for r in json.loads(first.read_text())["rows"]] == ["d"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.name, first.with_suffix(".md").name]
