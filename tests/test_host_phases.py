"""bench/host_phases.py (a step's opcodes by phase and function) in CI: the
linear head's two methods; the phases add up to the step's own opcode count
(bench/host_step.py's), each phase lies where the step puts it, and a bad
argument is refused by name."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_bench_script

ROOT = Path(__file__).resolve().parent.parent


def test_host_phases_report(tmp_path):
    pytest.importorskip("torch")
    proc = run_bench_script("host_phases", "--workloads", "linear", "--top", "3",
                            "--out", str(tmp_path), timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (report,) = tmp_path.glob("host_phases-cpu-*.json")
    data = json.loads(report.read_text())
    plain, private, extra = data["rows"]
    assert (plain["method"], private["method"]) == ("nonprivate", "ncdp_engine")
    phases = ("zero_grad", "forward", "loss", "backward", "step, before transfer", "transfer",
              "step, after transfer", "other")
    for r in data["rows"]:
        assert sum(r[p] for p in phases) == r["total"]
        if r is not extra:
            assert r["forward"] > 0 and r["loss"] > 0 and r["backward"] > 0
            assert r["zero_grad"] > 0 and r["step, before transfer"] > 0
    # No transfer in the plain step; the private one has its one transfer and
    # its sums and noise after it.
    assert plain["transfer"] == plain["step, after transfer"] == 0
    assert private["transfer"] > 0 and private["step, after transfer"] > 0
    assert all(extra[p] == private[p] - plain[p] for p in phases)
    # The private step's functions: 3 a phase at most, ranked by opcodes, the
    # recorder's hooks in the forward and the clip op before the transfer.
    funcs = data["functions"]
    by_phase = {}
    for f in funcs:
        by_phase.setdefault(f["phase"], []).append(f)
    assert all(len(v) <= 3 for v in by_phase.values())
    assert all([f["opcodes"] for f in v] == sorted((f["opcodes"] for f in v), reverse=True)
               for v in by_phase.values())
    assert any("_clip_layers.py" in f["function"] for f in by_phase["step, before transfer"])
    assert "| linear head" in report.with_suffix(".md").read_text()


def test_host_phases_match_the_steps_opcode_count():
    """The same step traced whole (host_step.python_opcodes) and by phase:
    the same count, in one process (the emulated device decided before
    ncdp_fast is imported)."""
    pytest.importorskip("torch")
    code = (
        "import os, sys; os.environ['NCDP_CUDA_EMULATION'] = '1'; "
        f"sys.path.insert(0, {str(ROOT / 'bench')!r}); "
        "import torch; torch.set_num_threads(1); import host_step, host_phases; "
        "label, step = host_step._build('linear', 'ncdp_engine', 'cpu'); "
        "[step() for _ in range(3)]; c = host_phases.PhaseCounter(); c.run(step); "
        "print(sum(c.phases.values()), host_step.python_opcodes(step))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=300,
                          env=dict(os.environ, NCDP_CUDA_EMULATION="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    phased, whole = map(int, proc.stdout.split())
    assert phased == whole > 0


@pytest.mark.parametrize("args, what", [(["--workloads", "linear,resnet"], "--workloads"),
                                        (["--top", "-1"], "--top")])
def test_host_phases_refuses_bad_arguments(tmp_path, args, what):
    proc = run_bench_script("host_phases", *args, "--out", str(tmp_path), timeout=120)
    assert proc.returncode == 2 and what in proc.stderr
