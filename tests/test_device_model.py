"""bench/device_model.py (a step's GPU time predicted from its operators, on the
emulated device) in CI: the smallest shapes of two workloads end to end, the
FLOP and tile formulas against hand counts, and refusals by name."""
import json
import math
from pathlib import Path

import pytest
from conftest import bench_script, run_bench_script

ROOT = Path(__file__).resolve().parent.parent


def _module():
    return bench_script("device_model")


def test_device_model_reports_each_workloads_predicted_device_time(tmp_path):
    pytest.importorskip("torch")
    proc = run_bench_script("device_model", "--workloads", "linear,transformer",
                            "--size", "smallest", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (report,) = tmp_path.glob("device_model-cpu-*.json")
    rows = json.loads(report.read_text())["rows"]
    assert [(r["workload"].split()[0], r["method"]) for r in rows] == [
        ("linear", "nonprivate"), ("linear", "ncdp_engine"),
        ("transformer", "nonprivate"), ("transformer", "ncdp_engine")]
    dm = _module()
    for r in rows:
        # The parts add up to the whole, and no kernel is charged under the floor.
        assert r["device_ms"] == pytest.approx(r["gemm_ms"] + r["memory_ms"] + r["ours_ms"])
        assert r["device_ms"] >= r["floor_ms"] == pytest.approx(
            r["kernels"] * dm.KERNEL_FLOOR_S * 1e3)
    for plain, private in (rows[:2], rows[2:]):      # bench_finetune's: no GPU-only method
        # The private step launches the package's kernels (norms, noise) on top
        # of the model's operators; the plain one none.
        assert plain["ours_ms"] == 0 and private["ours_ms"] > 0
        assert private["kernels"] > plain["kernels"]
        assert private["x_nonprivate"] == pytest.approx(private["device_ms"] / plain["device_ms"])
    (ops,) = tmp_path.glob("device_model_ops-cpu-*.json")
    op_rows = json.loads(ops.read_text())["rows"]
    assert op_rows and all(r["extra_ms"] == pytest.approx(r["private_ms"] - r["nonprivate_ms"])
                           for r in op_rows)
    assert any(r["operator"].startswith("ours:") for r in op_rows)


def test_convolution_flops_count_the_groups():
    """A per-sample depthwise convolution's backward (the batch folded into the
    groups) costs what its weight's per-group shape says, not what
    flop_counter's backward formula gives (it ignores the groups)."""
    torch = pytest.importorskip("torch")
    dm = _module()
    B, C, H, k = 4, 6, 10, 3
    x = torch.zeros(1, B * C, H, H)
    w = torch.zeros(B * C, 1, k, k)
    gy = torch.zeros(1, B * C, H, H)
    args = (gy, x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], B * C, [False, True, False])
    flops = dm._conv_flops(torch.ops.aten.convolution_backward.default, args)
    assert flops == 2 * gy.numel() * k * k           # the weight's gradient alone
    both = args[:-1] + ([True, True, False],)
    assert dm._conv_flops(torch.ops.aten.convolution_backward.default, both) == 2 * flops
    # Without groups the formula is flop_counter's own.
    from torch.utils.flop_counter import conv_backward_flop
    x1, w1, gy1 = torch.zeros(2, 3, H, H), torch.zeros(5, 3, k, k), torch.zeros(2, 5, H, H)
    plain = (gy1, x1, w1, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, True, False])
    expected = conv_backward_flop(gy1.shape, x1.shape, w1.shape, None, [1, 1], [1, 1], [1, 1],
                                  False, [0, 0], 1, [True, True, False],
                                  out_val=(x1, w1, None))
    assert dm._conv_flops(torch.ops.aten.convolution_backward.default, plain) == expected


def test_gemm_efficiency_follows_tiles_and_waves():
    torch = pytest.importorskip("torch")
    dm = _module()
    # One 128 x 128 tile over a short reduction: one SM of 132 works.
    out = torch.zeros(dm.TILE, dm.TILE)
    assert dm._efficiency(2.0 * out.numel() * 64, out) == pytest.approx(1 / dm.SMS)
    # A long reduction splits: 16 pieces of 256 on one tile.
    assert dm._efficiency(2.0 * out.numel() * 4096, out) == pytest.approx(16 / dm.SMS)
    # Exactly one full wave, then one tile more: the second wave is charged in full.
    full = torch.zeros(dm.SMS * dm.TILE, dm.TILE)
    assert dm._efficiency(2.0 * full.numel() * 64, full) == 1.0
    more = torch.zeros((dm.SMS + 1) * dm.TILE, dm.TILE)
    assert dm._efficiency(2.0 * more.numel() * 64, more) == pytest.approx(
        (dm.SMS + 1) / (2 * dm.SMS))
    assert math.isclose(dm._efficiency(0.0, out), 1.0)


def test_a_launch_without_a_cost_model_is_refused_by_name():
    dm = _module()
    with pytest.raises(ValueError, match="launch_new_kernel"):
        dm._ours("launch_new_kernel", {})
    seconds, nbytes = dm._ours("launch_row_sq_norms", dict(B=4, p=10, dtype=0))
    assert nbytes == 160 and seconds == pytest.approx(160 / dm.BYTES_PER_S)


def _launchers():
    """{launcher: parameter names} of the extension, read from its binding file
    (importing the emulator here would fix its block order before the suite's
    own first use of it)."""
    import re
    text = (ROOT / "csrc" / "bindings.cpp").read_text()
    found = {}
    for chunk in text.split("m.def(")[1:]:          # one binding each
        m = re.match(r'"(launch_\w+)"', chunk)
        if m:
            found[m.group(1)] = re.findall(r'py::arg\("(\w+)"\)', chunk)
    return found


def test_every_launcher_has_a_cost_model_or_is_not_a_training_step():
    """A new launcher used by a private step must get a cost model (_ours raises
    otherwise, so the report fails loudly); the ones a step never reaches
    (the mix, the NTK, the sampler, the old clip kernels) are listed here."""
    dm = _module()
    not_in_a_step = {"launch_hadamard_gram", "launch_mix_rows", "launch_sample_counts",
                     "launch_sample_fill", "launch_clipped_linear_sum"}
    launchers = _launchers()
    assert "launch_linear_norms_from_grams" in launchers and not_in_a_step <= set(launchers)
    for name, params in launchers.items():
        if name in not_in_a_step:
            continue
        assert params, name
        kw = {p: 0 for p in params}
        if name == "launch_finish_gaussian_segments":
            kw.update(count=[1], src_dtype=[0], dst_dtype=[0])
        if name == "launch_gram_rows_f64":
            kw.update(x=[0], sample_strides=[0], row_strides=[0])
        dm._ours(name, kw)       # raises for a launcher without a model


@pytest.mark.parametrize("args, what", [(["--workloads", "linear,resnet"], "--workloads"),
                                        (["--size", "huge"], "--size")])
def test_device_model_refuses_bad_arguments(tmp_path, args, what):
    proc = run_bench_script("device_model", *args, "--out", str(tmp_path), timeout=120)
    assert proc.returncode == 2 and what in proc.stderr
