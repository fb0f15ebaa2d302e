"""bench/dmma_rate.py (the FP64 tensor cores' rate per mma shape, a phase of
`make gpu-check`) in CI: its CUDA source compiles for sm_90 (all four shapes)
and sm_80 (m8n8k4 only) with the nvcc the package's build finds, its parser
turns the probe's lines into TFLOP/s and ratios, and without a GPU, or with a
bad argument, it refuses by name.  The rates themselves need a GPU."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import bench_script

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "dmma_rate.py"


def _probe():
    return bench_script("dmma_rate")


@pytest.mark.parametrize("arch", ["90", "80"])
def test_the_probe_compiles(arch, tmp_path):
    dmma_rate = _probe()
    if dmma_rate.nvcc() is None:
        pytest.skip("no nvcc on this machine (the package's build is CPU-only here too)")
    exe = dmma_rate.compile_probe(arch, tmp_path)
    assert exe.exists() and exe.stat().st_size > 0


def test_the_parser_gives_rates_and_ratios():
    dmma_rate = _probe()
    lines = [json.dumps(dict(sms=132, compute_capability="9.0")),
             json.dumps(dict(shape="m8n8k4", blocks_per_sm=1, warps_per_sm=8, flops=2e12,
                             ms=100.0)),
             json.dumps(dict(shape="m16n8k16", blocks_per_sm=1, warps_per_sm=8, flops=2e12,
                             ms=50.0)),
             json.dumps(dict(shape="m8n8k4", blocks_per_sm=2, warps_per_sm=16, flops=4e12,
                             ms=125.0))]
    info, rows = dmma_rate.parse(lines)
    assert info == dict(sms=132, compute_capability="9.0")
    assert [round(r["tflops"], 9) for r in rows] == [20.0, 40.0, 32.0]
    assert [r["x_m8n8k4"] for r in rows] == [1.0, 2.0, 1.0]
    assert rows[1]["of_vendor_peak"] == pytest.approx(40.0 / dmma_rate.VENDOR_PEAK_TFLOPS)


@pytest.mark.parametrize("args, what", [(["--compile-only"], "--arch"),
                                        (["--compile-only", "--arch", "sm90"], "--arch"),
                                        (["--iters", "3"], "--iters")])
def test_bad_arguments_are_refused_by_name(args, what, tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), *args, "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and f"{what}: expected" in proc.stderr
    assert not list(tmp_path.glob("*"))


def test_without_a_gpu_it_says_why(tmp_path):
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: make gpu-check runs the probe")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "dmma_rate.py:" in proc.stderr
    assert not list(tmp_path.glob("*"))
