"""bench/memory_model.py (a step's peak GPU memory predicted from its
allocations on the emulated device) in CI: the GPU forms of attention and
dropout against torch's own, the timeline arithmetic on fixed inputs, and
the smallest shapes of two workloads end to end."""
import json

import pytest
from conftest import bench_script, run_bench_script

torch = pytest.importorskip("torch")
mm = bench_script("memory_model")


@pytest.mark.parametrize("chunk", [1, 1 << 20])
@pytest.mark.parametrize("mask", ["none", "float", "bool", "causal", "per_sample"])
def test_gpu_attention_is_torchs_and_keeps_no_probabilities(mask, chunk, monkeypatch):
    """The same values and gradients as torch's attention (float64, no
    dropout: within a few float64 roundings of its sums), a sample at a time
    (chunk 1 byte) or all at once, and nothing of size T x S kept for
    backward but the additive mask the caller made."""
    monkeypatch.setattr(mm, "CAST_CHUNK_BYTES", chunk)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, 7, 4, generator=g, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    kw = {}
    if mask == "float":
        kw["attn_mask"] = torch.randn(7, 7, generator=g, dtype=torch.float64)
    elif mask == "bool":
        kw["attn_mask"] = torch.rand(7, 7, generator=g) > 0.3
        kw["attn_mask"].fill_diagonal_(True)       # no row without a key
    elif mask == "causal":
        kw["is_causal"] = True
    elif mask == "per_sample":                     # a key-padding mask (B, 1, 1, S)
        kw["attn_mask"] = torch.randn(2, 1, 1, 7, generator=g, dtype=torch.float64)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, **kw)
    out = mm.gpu_sdpa(q, k, v, **kw)
    assert torch.allclose(out, ref, rtol=1e-12, atol=1e-13)
    w = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    want = torch.autograd.grad((ref * w).sum(), (q, k, v))
    got = torch.autograd.grad((mm.gpu_sdpa(q, k, v, **kw) * w).sum(), (q, k, v))
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=1e-11, atol=1e-12)
    kept = mm.gpu_sdpa(q, k, v, **kw).grad_fn.saved_tensors
    assert [tuple(t.shape) for t in kept] == [(2, 3, 7, 4)] * 4 + [(2, 3, 7, 1)]


def test_gpu_dropout_keeps_a_bool_mask():
    x = torch.randn(50, 40, dtype=torch.float64, requires_grad=True)
    torch.manual_seed(3)
    y = mm.gpu_dropout(x, 0.25, True)
    kept = y != 0
    assert torch.allclose(y[kept], x[kept] / 0.75, rtol=4e-16, atol=0)
    assert 0.6 < kept.double().mean() < 0.9
    assert y.grad_fn.name() == "NativeDropoutBackward0"
    assert y.grad_fn._saved_result1.dtype == torch.bool
    assert mm.gpu_dropout(x, 0.25, False) is x and mm.gpu_dropout(x, 0.0, True) is x


def test_gpu_forms_are_put_back():
    F = torch.nn.functional
    before = F.scaled_dot_product_attention, F.dropout
    from torch.utils._python_dispatch import _get_current_dispatch_mode
    with mm.gpu_forms():
        assert (F.scaled_dot_product_attention, F.dropout) == (mm.gpu_sdpa, mm.gpu_dropout)
        assert isinstance(_get_current_dispatch_mode(), mm.GpuCasts)
    assert (F.scaled_dot_product_attention, F.dropout) == before
    assert _get_current_dispatch_mode() is None


def test_live_curve_and_peak_by_phase():
    """Growth over the step's start in the allocator's 512-byte blocks; a
    tensor alive before the step counts only when freed; the peak's phase is
    the last phase started before it."""
    from torch.profiler._memory_profiler import Action
    tl = [(-1, Action.PREEXISTING, "w", 4096),
          (10, Action.CREATE, "a", 1000),          # 1024
          (20, Action.CREATE, "b", 512),           # 1536
          (30, Action.DESTROY, "w", 4096),         # -2560
          (40, Action.CREATE, "c", 10_000),        # 7680
          (45, Action.INCREMENT_VERSION, "c", 10_000),
          (50, Action.DESTROY, "a", 1000),         # 6656
          (60, Action.CREATE, "d", 1)]             # 7168
    points = mm.live_curve(tl)
    assert points == [(10, 1024), (20, 1536), (30, -2560), (40, 7680), (50, 6656), (60, 7168)]
    marks = {"forward": 5, "backward": 25, "optimizer step": 45}
    got = mm.peak_by_phase(points, marks)
    assert got == dict(peak_mb=7680 / 2**20, peak_phase="backward", at_step_mb=7680 / 2**20)
    late = mm.peak_by_phase(points + [(70, 9000)], marks)
    assert late["peak_phase"] == "optimizer step" and late["at_step_mb"] == 7680 / 2**20


def test_memory_model_reports_each_workloads_peak(tmp_path):
    proc = run_bench_script("memory_model", "--workloads", "linear,bert", "--size", "smallest",
                            "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (report,) = tmp_path.glob("memory_model-cpu-*.json")
    rows = json.loads(report.read_text())["rows"]
    assert [(r["workload"].split()[0], r["method"]) for r in rows] == [
        ("linear", "nonprivate"), ("linear", "ncdp_engine"),
        ("BERT", "nonprivate"), ("BERT", "ncdp_engine")]
    for plain, private in (rows[:2], rows[2:]):
        assert plain["peak_mb"] > 0 and private["peak_mb"] > 0
        assert {plain["peak_phase"], private["peak_phase"]} <= set(mm.PHASES)
        assert private["x_nonprivate"] == pytest.approx(private["peak_mb"] / plain["peak_mb"])
        # The backward of a step with gradients released holds more than nothing.
        assert plain["at_step_mb"] > 0


def _peak_mb(fn):
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import MemoryProfile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    points = mm.live_curve(MemoryProfile(prof.profiler.kineto_results).timeline)
    return max(live for _, live in points) / 2**20, out


def test_gpu_casts_cut_mixed_dtype_ops_without_changing_them():
    """The CPU's float32-by-float64 product into float32 holds two float64
    copies of the array, its float64 sum one; under GpuCasts each holds a
    chunk's (1 MiB), as a CUDA kernel holds none; element-wise results are
    the same bits, sums within their float64 rounding."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(64, 50, 400, generator=g)                 # 4.9 MiB of float32
    f = torch.rand(64, generator=g, dtype=torch.float64).reshape(-1, 1, 1)
    size = x.numel() * 4 / 2**20
    plain, want = _peak_mb(lambda: torch.mul(x, f, out=torch.empty_like(x)))
    assert plain >= 4 * size                                  # the result and two float64 copies
    with mm.GpuCasts():
        peak, got = _peak_mb(lambda: torch.mul(x, f, out=torch.empty_like(x)))
        assert peak <= size + 3 * mm.CAST_CHUNK_BYTES / 2**20 and torch.equal(got, want)
        peak, got = _peak_mb(lambda: x * f)                   # a float64 result, as on a GPU
        assert peak <= 2 * size + 3 and torch.equal(got, x.double() * f)
        y = x.clone()
        y.mul_(f)
        assert torch.equal(y, want)
        for dim in (0, 1):
            flat = x.reshape(64 * 50, 400) if dim == 0 else x.reshape(64, -1)
            peak, got = _peak_mb(lambda: flat.sum(dim, dtype=torch.float64))
            ref = flat.double().sum(dim)
            assert peak <= 3 * mm.CAST_CHUNK_BYTES / 2**20 + ref.numel() * 8 / 2**20
            assert torch.allclose(got, ref, rtol=1e-12, atol=1e-12)
