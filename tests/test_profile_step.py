"""bench/profile_step.py (what `make gpu-check` runs after issue 36's
benchmarks) in CI: on the CPU at the smallest shapes, both reports come out
with a row per workload and method, and a bad argument is refused by name."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "profile_step.py"


def test_profile_step_reports_each_workload_and_method(tmp_path):
    pytest.importorskip("torch")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--size", "smallest",
                           "--workloads", "linear", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (steps,) = tmp_path.glob("profile_step-cpu-*.json")
    (ops,) = tmp_path.glob("profile_ops-cpu-*.json")
    rows = json.loads(steps.read_text())["rows"]
    # One workload keeps this under 15 s on a 2-core machine; the others share the code.
    assert [(r["workload"].split()[0], r["method"]) for r in rows] == [
        ("linear", "nonprivate"), ("linear", "ncdp_engine")]
    for r in rows:
        assert "error" not in r and r["wall_ms"] > 0 and r["operators"] > 0
        assert r["busy_ms"] is None and r["kernels"] is None      # no device on the CPU
        assert r["num_device_alloc"] is None and r["num_alloc_retries"] is None
        assert r["host_waits"] == 0
    assert rows[0]["x_nonprivate"] == 1.0
    # The private step dispatches more operators than the plain one.
    assert all(p["operators"] > n["operators"] for n, p in zip(rows[::2], rows[1::2]))
    top = json.loads(ops.read_text())["rows"]
    assert {r["method"] for r in top} == {"ncdp_engine"}
    for w in {r["workload"] for r in top}:
        ranks = [r["rank"] for r in top if r["workload"] == w]
        assert ranks == list(range(1, len(ranks) + 1)) and 0 < len(ranks) <= 15
    assert all(r["entry"].startswith("aten::") and 0 < r["share"] <= 1 for r in top)
    md = steps.with_suffix(".md").read_text()
    assert "busy / wall" in md and "| linear head" in md
    # Every entry of either step, with the private step's extra time, largest first.
    (extra,) = tmp_path.glob("profile_extra-cpu-*.json")
    diff = json.loads(extra.read_text())["rows"]
    assert diff and [r["rank"] for r in diff] == list(range(1, len(diff) + 1))
    assert [r["extra_ms"] for r in diff] == sorted((r["extra_ms"] for r in diff), reverse=True)
    for r in diff:
        assert r["extra_ms"] == r["private_ms"] - r["nonprivate_ms"]
        assert r["private_calls"] + r["nonprivate_calls"] > 0
    names = {r["entry"] for r in diff}
    assert {r["entry"] for r in top} <= names       # the private step's top entries among them
    assert any(r["nonprivate_calls"] and r["private_calls"] for r in diff)
    assert any(r["private_calls"] and not r["nonprivate_calls"] for r in diff)
    md_extra = extra.with_suffix(".md").read_text()
    assert md_extra.count("| linear head") == min(len(diff), 25)
    # The step's phases (bench/step_idle.py): found by their markers in both
    # steps, the private one's transfer among them; no device, no idle time.
    (idle,) = tmp_path.glob("profile_idle-cpu-*.json")
    phases = {(r["method"], r["entry"]): r for r in json.loads(idle.read_text())["rows"]}
    for method in ("nonprivate", "ncdp_engine"):
        assert phases[method, "forward"]["host_ms"] > 0
        assert phases[method, "backward"]["host_ms"] > 0
        assert phases[method, "after transfer"]["host_ms"] > 0     # the optimizer's step
        assert all(r.get("idle_ms") is None for (m, _), r in phases.items() if m == method)
        total = sum(phases[method, p]["host_ms"] for p in
                    ("forward", "backward", "to optimizer", "before transfer", "transfer",
                     "after transfer", "after optimizer"))
        assert phases[method, "step"]["host_ms"] == pytest.approx(total)
    assert phases["nonprivate", "transfer"]["host_ms"] == 0
    assert phases["ncdp_engine", "transfer"]["host_ms"] > 0
    assert phases["ncdp_engine", "before transfer"]["host_ms"] > 0


def test_profile_step_refuses_an_unknown_workload(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--workloads", "linear,resnet",
                           "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert "--workloads: unknown ['resnet']" in proc.stderr
    assert not list(tmp_path.glob("*"))


def test_host_cprofile_reports_each_method_with_its_profile():
    """bench/host_cprofile.py (the H200's host profile of 2026-11-30): a block a
    method, its wall and CPU ms, and the private methods' cProfile tables
    naming the clip op."""
    pytest.importorskip("torch")
    from conftest import run_bench_script
    proc = run_bench_script("host_cprofile", "cpu", "linear", "2", timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    heads = [line for line in proc.stdout.splitlines() if line.startswith("=====")]
    assert [h.split(":")[0] for h in heads] == [
        "===== linear nonprivate", "===== linear ncdp_ghost", "===== linear ncdp_engine"]
    for h in heads:
        wall, cpu = (float(h.split(what)[1].split()[0]) for what in ("wall ", "process cpu "))
        assert wall > 0 and cpu > 0
    blocks = proc.stdout.split("=====")[2:]
    assert all("clip_and_noise_layers" in b for b in blocks)
