"""bench/step_idle.py: the device's idle time by phase of a profiled step,
on hand-made timelines whose answers are known (the GPU run cannot check
its own arithmetic)."""
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

# Appended, not prepended: bench/conftest.py must not shadow tests/conftest.py
# for the gloo ranks other tests spawn (they inherit this sys.path).
sys.path.append(str(Path(__file__).resolve().parent.parent / "bench"))
import step_idle  # noqa: E402

CPU, CUDA = "cpu", "cuda"


def test_merge_joins_overlapping_and_touching_intervals():
    assert step_idle.merge([]) == []
    assert step_idle.merge([(5, 6), (0, 2), (1, 3), (3, 4)]) == [(0, 4), (5, 6)]
    assert step_idle.merge([(0, 10), (2, 3)]) == [(0, 10)]


def test_covered_counts_only_the_window():
    busy = step_idle.merge([(0, 2), (4, 6), (8, 20)])
    assert step_idle.covered(busy, 1, 5) == 2       # 1..2 and 4..5
    assert step_idle.covered(busy, 6, 8) == 0
    assert step_idle.covered(busy, 10, 12) == 2
    assert step_idle.covered(busy, -5, 100) == 2 + 2 + 12
    assert step_idle.covered(busy, 5, 5) == 0 and step_idle.covered([], 0, 9) == 0


def test_phase_bounds_partition_the_step_and_clamp_markers():
    phases = step_idle.phase_bounds((0, 100), (20, 50), (60, 90), (65, 70))
    assert [p[0] for p in phases] == list(step_idle.PHASES)
    assert [(a, b) for _, a, b in phases] == [(0, 20), (20, 50), (50, 60), (60, 65),
                                              (65, 70), (70, 90), (90, 100)]
    # No transfer (a non-private step): the optimizer's step is all "after transfer".
    d = dict((n, (a, b)) for n, a, b in step_idle.phase_bounds((0, 100), (20, 50), (60, 90), None))
    assert d["before transfer"] == (60, 60) and d["transfer"] == (60, 60)
    assert d["after transfer"] == (60, 90)
    # A marker past the step's end is cut to it; lengths never negative.
    for _, a, b in step_idle.phase_bounds((0, 10), (5, 30), None, None):
        assert 0 <= a <= b <= 10


def test_idle_by_phase_and_gaps_on_a_known_timeline():
    # Step 0..100 µs: forward 0..40, backward 40..70, optimizer 75..95 with
    # the transfer at 80..85.  Kernels leave the device idle 0..10, 30..40,
    # 85..95 (after the transfer), and run past the step's end to 120.
    phases = step_idle.phase_bounds((0, 100), (40, 70), (75, 95), (80, 85))
    kernels = [(10, 30), (40, 75), (70, 80), (80, 85), (95, 120)]
    busy = step_idle.merge(kernels)
    got = step_idle.idle_by_phase(phases, busy)
    assert got["forward"] == dict(host_ms=0.040, idle_ms=0.020)
    assert got["backward"]["idle_ms"] == 0.0 and got["to optimizer"]["idle_ms"] == 0.0
    assert got["after transfer"] == dict(host_ms=0.010, idle_ms=0.010)
    assert got["after optimizer"]["idle_ms"] == pytest.approx(0.0)
    assert got["drain"]["device_ms"] == pytest.approx(0.020)
    assert got["busy_ms"] == pytest.approx(0.020 + 0.045 + 0.025)      # merged: 40..85 once
    gaps = step_idle.gaps(phases, busy, min_us=5)
    assert gaps == [(0, 10, "forward"), (30, 10, "forward"), (85, 10, "after transfer")]
    assert step_idle.gaps(phases, busy, min_us=11) == []


def test_innermost_names_the_narrowest_covering_range():
    host = [("outer", 0, 100), ("aten::mm", 10, 20), ("aten::empty", 12, 14)]
    assert step_idle.innermost(host, 13) == "aten::empty"
    assert step_idle.innermost(host, 15) == "aten::mm"
    assert step_idle.innermost(host, 50) == "outer"
    assert step_idle.innermost(host, 150) is None


def _event(name, start, end, device=CPU, thread=1, annotation=False):
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end),
                           device_type=device, thread=thread, is_user_annotation=annotation)


def test_analyse_reads_the_markers_autograd_and_kernels():
    u = 10      # µs a unit: the gaps (10 units) pass analyse's GAP_US
    assert 10 * u >= step_idle.GAP_US
    events = [_event(n, a * u, b * u, *rest) for n, a, b, *rest in [
        (step_idle.STEP, 0, 100),
        ("aten::linear", 1, 9),
        ("autograd::engine::evaluate_function: MmBackward0", 40, 50, CPU, 2),
        ("autograd::engine::evaluate_function: AddBackward0", 60, 70, CPU, 2),
        ("Optimizer.step#DPOptimizer.step", 75, 95),
        ("Optimizer.step#SGD.step", 90, 94),          # nested: not the outer span
        (step_idle.TRANSFER, 80, 85),
        ("aten::addmm", 86, 94),
        # The optimizer's step as a device-side user annotation: never busy time.
        ("Optimizer.step#DPOptimizer.step", 0, 200, CUDA, 1, True),
        ("kernel a", 10, 30, CUDA), ("kernel b", 40, 85, CUDA), ("kernel c", 95, 120, CUDA),
    ]]
    got = step_idle.analyse(events, CUDA)
    assert got["forward"] == dict(host_ms=pytest.approx(0.4), idle_ms=pytest.approx(0.2))
    assert got["backward"] == dict(host_ms=pytest.approx(0.3), idle_ms=pytest.approx(0.0))
    assert got["to optimizer"]["host_ms"] == pytest.approx(0.05)
    assert got["before transfer"]["host_ms"] == pytest.approx(0.05)
    assert got["after transfer"] == dict(host_ms=pytest.approx(0.1), idle_ms=pytest.approx(0.1))
    assert got["after optimizer"]["host_ms"] == pytest.approx(0.05)
    assert got["busy_ms"] == pytest.approx(0.9)
    gaps = got["gaps"]
    assert [(g["phase"], g["length_us"]) for g in gaps] == [
        ("forward", 100), ("forward", 100), ("after transfer", 100)]
    assert gaps[0]["host"] == "aten::linear"            # 0..100 µs: aten::linear at 50
    assert gaps[1]["host"] is None                      # 300..400: Python between operators
    assert gaps[2]["host"] == "aten::addmm"             # 850..950: the sums' GEMM at 900


def test_analyse_without_a_device_or_a_marked_step():
    events = [_event(step_idle.STEP, 0, 10), _event("aten::mm", 1, 2)]
    got = step_idle.analyse(events, CUDA)
    assert got["forward"] == dict(host_ms=0.010, idle_ms=None) and got["gaps"] == []
    assert got["busy_ms"] is None
    assert step_idle.analyse([_event("aten::mm", 1, 2)], CUDA) is None


def test_a_fault_of_the_analysis_is_its_reports_error_row_only():
    """bench/profile_step.py keeps the step's other reports when the phase
    analysis fails: the idle report gets one row with the error."""
    saved = list(sys.path)
    try:
        import profile_step     # it puts bench/ first on the path: put back (see above)
    finally:
        sys.path[:] = saved
    got = profile_step._idle([SimpleNamespace(name=step_idle.STEP)], CUDA)   # no time_range
    assert "AttributeError" in got["error"]
    rows = profile_step.idle_rows("w", "m", got)
    assert rows == [dict(workload="w", method="m", entry="step", error=got["error"])]
    assert profile_step.idle_rows("w", "m", None) == []
