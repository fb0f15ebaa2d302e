"""The benchmark suite of bench/ (pytest-benchmark; bench/README.md) in CI: every
benchmark runs once at its smallest shapes with the timing off, so a broken
benchmark fails here, and the tables of bench/results/ come out of a recorded
pytest-benchmark JSON."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Appended, not prepended: bench/conftest.py must not shadow tests/conftest.py
# for the gloo ranks other tests spawn (they inherit this sys.path).
sys.path.append(str(ROOT / "bench"))

import report  # noqa: E402  (bench/report.py)


def test_every_benchmark_runs_at_its_smallest_size():
    pytest.importorskip("pytest_benchmark", reason="pytest-benchmark (make test installs it)")
    proc = subprocess.run([sys.executable, "-m", "pytest", "bench/", "--bench-size", "smallest",
                           "--benchmark-disable", "-q", "-p", "no:cacheprovider"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert " passed" in out and " error" not in out and " failed" not in out, out[-4000:]


# A run of `pytest bench/test_bench_clip.py -k dense --bench-size smallest
# --bench-rounds 2 --benchmark-json=...` (the keys the report reads):
# (median seconds, extra_info), two interleaved rounds of five methods.
RECORDED = [
    (2.743e-05, {"method": "ncdp", "round": 1, "bytes": 2048, "peak_extra_mb": 0.085938}),
    (3.362e-05, {"method": "torch_eager", "round": 1, "bytes": 2048, "peak_extra_mb": 0.007812}),
    (3.259e-05, {"method": "torch_eager_f32norm", "round": 1, "bytes": 2048,
                 "peak_extra_mb": 0.003906}),
    (1.913e-06, {"method": "read_torch_sum", "round": 1, "bytes": 2048,
                 "peak_extra_mb": 0.007812}),
    (0.0117, {"method": "read_numba_sum", "round": 1, "bytes": 2048, "peak_extra_mb": 0.027344}),
    (2.68e-05, {"method": "ncdp", "round": 2, "bytes": 2048, "peak_extra_mb": 0.003906}),
    (3.327e-05, {"method": "torch_eager", "round": 2, "bytes": 2048, "peak_extra_mb": 0.003906}),
    (3.169e-05, {"method": "torch_eager_f32norm", "round": 2, "bytes": 2048,
                 "peak_extra_mb": 0.007812}),
    (1.797e-06, {"method": "read_torch_sum", "round": 2, "bytes": 2048,
                 "peak_extra_mb": 0.003906}),
    (0.009328, {"method": "read_numba_sum", "round": 2, "bytes": 2048, "peak_extra_mb": 0.003906}),
]


def _recorded_doc():
    workload = "(8, 64) float32"
    return {"version": "5.3.1",
            "ncdp": {"device": "CPU: AMD EPYC, 2 threads", "device_tag": "cpu",
                     "size": "smallest", "rounds": 2, "commit": "eef2cfa-dirty",
                     "date": "2026-11-23 14:20 UTC"},
            "benchmarks": [{"group": f"bench_clip_dense {workload} cpu",
                            "name": f"test_clip_dense[{workload}|{e['method']}|r{e['round']}]",
                            "stats": {"median": median},
                            "extra_info": dict(e, family="bench_clip_dense", workload=workload,
                                               device="cpu")}
                           for median, e in RECORDED]}


def test_report_from_recorded_json(tmp_path):
    doc = _recorded_doc()
    report.add_ratios(doc["benchmarks"])
    ncdp_r2 = doc["benchmarks"][5]["extra_info"]
    # Against the median round (of two: the faster) of every other method.
    assert ncdp_r2["x_torch_eager_f32norm"] == pytest.approx(3.169e-05 / 2.68e-05)
    assert ncdp_r2["x_read_torch_sum"] == pytest.approx(1.797e-06 / 2.68e-05)

    path = tmp_path / "run.json"
    path.write_text(json.dumps(doc))
    assert report.main([str(path), "--out", str(tmp_path / "out")]) == 0
    written = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert [n.split("-")[:2] for n in written] == [["bench_clip_dense", "cpu"]] * 2
    table = json.loads((tmp_path / "out" / written[0]).read_text())
    assert table["meta"]["commit"] == "eef2cfa-dirty"
    assert table["meta"]["date"] == "2026-11-23 14:20 UTC"
    (row,) = table["rows"]
    assert row["shape"] == "(8, 64) float32" and "error" not in row
    assert row["ncdp_ms"] == pytest.approx(1e3 * 2.68e-05)
    assert row["speedup_vs_torch"] == pytest.approx(3.169e-05 / 2.68e-05)
    assert row["frac_of_read"] == pytest.approx(1.797e-06 / 2.68e-05)
    assert row["read_gbs"] == pytest.approx(2048 / 1.797e-06 / 1e9)
    assert row["ncdp_mem_mb"] == pytest.approx(0.003906)
    md = (tmp_path / "out" / written[1]).read_text()
    assert "- device: CPU: AMD EPYC, 2 threads" in md and "2 interleaved round(s)" in md
    assert "| (8, 64) float32 | 0.027 |" in md


def test_report_one_pass_and_l2_columns(tmp_path):
    # A GPU run's extra methods: the one-pass form beside its prediction, and
    # the L2 read rate (which must not count as the read limit).
    doc = _recorded_doc()
    workload = "(1024, 409600) float32"
    extra = [(4.2e-4, {"method": "ncdp_one_pass", "round": r, "bytes": 1024 * 409600 * 4})
             for r in (1, 2)] + \
            [(3.1e-4, {"method": "ncdp_one_pass_rows8", "round": r,
                       "bytes": 1024 * 409600 * 4}) for r in (1, 2)] + \
            [(1.6e-4, {"method": "l2_torch_sum", "round": r, "bytes": 64 * (4 << 20) * 4})
             for r in (1, 2)]
    for b in doc["benchmarks"]:
        b["group"] = b["group"].replace("(8, 64) float32", workload)
        b["extra_info"]["workload"] = workload
    doc["benchmarks"] += [{"group": f"bench_clip_dense {workload} cpu",
                           "name": f"test_clip_dense[{workload}|{e['method']}|r{e['round']}]",
                           "stats": {"median": median},
                           "extra_info": dict(e, family="bench_clip_dense", workload=workload,
                                              device="cpu")} for median, e in extra]
    report.write_tables(doc, tmp_path, quiet=True)
    (path,) = tmp_path.glob("*.json")
    (row,) = json.loads(path.read_text())["rows"]
    assert row["one_pass_ms"] == pytest.approx(0.42)
    assert row["l2_gbs"] == pytest.approx(64 * (4 << 20) * 4 / 1.6e-4 / 1e9)
    assert row["read_gbs"] == pytest.approx(2048 / 1.797e-06 / 1e9)     # read_torch_sum's
    # dense_traffic's plan at this shape: 264 blocks, 2 rows a row block.
    assert 0.4 < row["predicted_one_pass_ms"] < 0.7
    assert row["one_pass_rows8_ms"] == pytest.approx(0.31)
    # The chain reading is fitted to the H200's 1.662 ms here; the L2-rate one
    # is not (1.29 ms). With 8-row blocks (128 row blocks, not 512) the chain
    # predicts about half that, the L2 rate the same.
    assert row["chain_one_pass_ms"] == pytest.approx(1.662)
    assert 1.2 < row["l2_rate_one_pass_ms"] < 1.4
    assert 0.6 < row["chain_rows8_ms"] < 0.9
    assert row["l2_rate_rows8_ms"] == pytest.approx(row["l2_rate_one_pass_ms"], rel=0.02)


def test_report_marks_a_missing_method_as_an_error(tmp_path):
    doc = _recorded_doc()
    doc["benchmarks"] = [b for b in doc["benchmarks"]
                         if b["extra_info"]["method"] != "torch_eager"]
    report.write_tables(doc, tmp_path, quiet=True)
    (path,) = tmp_path.glob("*.json")
    (row,) = json.loads(path.read_text())["rows"]
    assert row["error"].startswith("no result for torch_eager")


def test_bag_table_ratios_and_prediction(tmp_path):
    """bench_bag's rows: ratios to the non-private step and to Opacus, and the
    predicted H200 time from the operator count and the dense passes."""
    w, V, D = "bag", 1000, 8
    doc = _recorded_doc()
    doc["benchmarks"] = [
        {"group": f"bench_bag {w} cpu", "name": f"test_bag_step[{w}|{m}|r1]",
         "stats": {"median": t},
         "extra_info": dict(family="bench_bag", workload=w, device="cpu", method=m, round=1,
                            V=V, D=D, ops=ops, peak_extra_mb=mem)}
        for m, t, ops, mem in (("nonprivate", 0.002, 30, 1.0), ("ncdp", 0.005, 100, 1.5),
                               ("opacus_hooks", 0.5, 800, 40.0))]
    report.write_tables(doc, tmp_path, quiet=True)
    (path,) = tmp_path.glob("bench_bag*.json")
    rows = {r["method"]: r for r in json.loads(path.read_text())["rows"]}
    assert rows["ncdp"]["x_nonprivate"] == pytest.approx(2.5)
    assert rows["ncdp"]["x_opacus"] == pytest.approx(100.0)
    assert rows["ncdp"]["mem_x_nonprivate"] == pytest.approx(1.5)
    assert rows["ncdp"]["predicted_gpu_ms"] == pytest.approx(
        1e3 * (100 * 5e-6 + 8 * 4 * V * D / 4e12))
    assert rows["nonprivate"]["predicted_gpu_ms"] == pytest.approx(
        1e3 * (30 * 5e-6 + 4 * 4 * V * D / 4e12))


def test_finetune_table_same_round_ratios_of_issue_25(tmp_path):
    """The transformer's issue-25 columns come from same-round ratios (a helper
    of another table once shadowed the one they use and broke this table)."""
    w = "transformer T"

    def b(method, rnd, median):
        e = dict(family="bench_finetune", workload=w, method=method, round=rnd, device="cpu",
                 kind="transformer", peak_extra_mb=100.0, weights_mb=10.0)
        return {"group": f"bench_finetune {w} cpu", "name": f"test_finetune_step[{method}|r{rnd}]",
                "stats": {"median": median, "min": median}, "extra_info": e}
    # Round 2 is twice as slow for every method: the same-round ratios stay put.
    benchmarks = [b("nonprivate", 1, 1.0), b("ncdp_ghost", 1, 1.2), b("ncdp_engine", 1, 1.26),
                  b("opacus_ghost", 1, 1.8),
                  b("nonprivate", 2, 2.0), b("ncdp_ghost", 2, 2.4), b("ncdp_engine", 2, 2.4),
                  b("opacus_ghost", 2, 3.6)]
    report.add_ratios(benchmarks)
    doc = {"version": "5.3.1", "benchmarks": benchmarks,
           "ncdp": {"device": "CPU: test", "device_tag": "cpu", "size": "full", "rounds": 2,
                    "commit": "abc1234", "date": "2026-11-25 20:00 UTC"}}
    (path,) = [p for p in report.write_tables(doc, tmp_path, quiet=True)
               if p.name.startswith("bench_finetune-") and p.suffix == ".json"]
    rows = {r["method"]: r for r in json.loads(path.read_text())["rows"]}
    eng = rows["ncdp_engine"]
    assert eng["r_ghost"] == pytest.approx(1.0) and eng["r_ghost_range"] == "1.000-1.050"
    assert eng["r_nonprivate"] == pytest.approx(1.2) and eng["r_nonprivate_range"] == "1.20-1.26"
    assert eng["r_opacus_ghost"] == pytest.approx(1.8 / 1.26)      # rounds 1.43, 1.50
    assert eng["targets25"].startswith("<= 1.03x ncdp_ghost time: met (rounds on both sides)")
    assert rows["ncdp_ghost"]["r_nonprivate"] == pytest.approx(1.2)


def test_a_workload_input_is_made_once_and_let_go_at_the_next_workload():
    import gc
    import weakref

    import _common as common     # bench/_common.py (bench/ is on the path, after tests/)
    made = []

    class Input:
        pass

    def make(tag):
        def draw():
            made.append(tag)
            return Input()
        return draw
    first = common.workload_input(("w", 1), make(1))
    assert common.workload_input(("w", 1), make(1)) is first       # its methods and rounds
    gone = weakref.ref(first)
    del first
    second = common.workload_input(("w", 2), make(2))
    gc.collect()
    assert gone() is None and made == [1, 2]        # the last workload's alone is held
    assert common.workload_input(("w", 2), make(2)) is second and made == [1, 2]
