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


def test_bad_arguments_are_refused_by_name(capsys):
    ncu = bench_script("ncu_kernels")
    with pytest.raises(SystemExit):
        ncu.main(["--cases", "noise_add,warp_drive"])
    assert "--cases/--target: expected names among noise_add" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ncu.main(["--timeout", "0"])
    assert "--timeout: expected seconds > 0, got 0.0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ncu.main(["--budget", "10", "--timeout", "60"])
    assert "--budget: expected at least --timeout (60 s), got 10.0" in capsys.readouterr().err


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
