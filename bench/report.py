"""The tables of bench/results/ from pytest-benchmark's JSON (bench/README.md).

``python bench/report.py RUN.json [--out bench/results]`` writes, per benchmark
family of the run, ``<family>-<cpu|gpu>-<date>.{json,md}``: the device, the
commit, the date, and per workload the median time of every method (of the
round with the median time, when it ran in several interleaved rounds), the
ratios between methods, the fractions of the measured limits (read bandwidth,
GEMM peak) and peak memory.  bench/conftest.py calls ``run_meta`` and
``add_ratios`` when pytest-benchmark writes its JSON."""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ncdp_fast._report import git_commit, machine, write_report  # noqa: E402
from dense_traffic import one_pass as dense_one_pass  # noqa: E402
from dense_traffic import one_pass_readings  # noqa: E402
from dense_traffic import traffic as dense_traffic  # noqa: E402


def run_meta(device: str, size: str, rounds: int) -> dict:
    """The machine, the commit and the run's options; on a GPU its name, compute
    capability and CUDA versions (reports are tagged "gpu")."""
    import datetime as _dt

    import torch

    import ncdp_fast
    m = machine(torch)
    meta = dict(m, device_tag="gpu" if device == "cuda" else "cpu", size=size,
                rounds=rounds, commit=git_commit(),
                date=_dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
    if device == "cuda" and torch.cuda.is_available():
        cap = torch.cuda.get_device_capability()
        meta.update(device=torch.cuda.get_device_name(), compute_capability=f"{cap[0]}.{cap[1]}",
                    torch_cuda=torch.version.cuda, ncdp_cuda_archs=ncdp_fast._backend.CUDA_ARCHS,
                    ncdp_cuda_runtime_driver=list(ncdp_fast._backend._C.cuda_versions()))
    else:
        meta["device"] = f"CPU: {m['cpu']}, {m['numba_threads']} threads"
    return meta


def _median_rounds(benchmarks) -> dict:
    """{family: {workload: {method: benchmark}}} keeping, per method, the round
    with the median time (the middle one, the faster for an even count)."""
    seen = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for b in benchmarks:
        e = b["extra_info"]
        seen[e["family"]][e["workload"]][e["method"]].append(b)
    return {f: {w: {m: sorted(rs, key=lambda b: b["stats"]["median"])[(len(rs) - 1) // 2]
                    for m, rs in ms.items()} for w, ms in ws.items()} for f, ws in seen.items()}


def _ran(extra_info) -> bool:
    """Whether a benchmark has a time: not where our method failed ("error")
    or a peer refused the workload ("peer_refused"; the one empty call
    pytest-benchmark needs to write the entry is not a time)."""
    return not {"error", "peer_refused"} & extra_info.keys()


def add_ratios(benchmarks) -> None:
    """``extra_info["x_<method>"]``: that method's time over this benchmark's, for
    every other method of the group (> 1: this one is faster; against a limit
    such as ``read_torch_sum`` it is the fraction of the limit achieved)."""
    ran = [b for b in benchmarks if _ran(b["extra_info"])]
    picked = _median_rounds(ran)
    for b in ran:
        e = b["extra_info"]
        for m, other in picked[e["family"]][e["workload"]].items():
            if m != e["method"]:
                e[f"x_{m}"] = other["stats"]["median"] / b["stats"]["median"]


# ------------------------------------------------------------------ the tables

NO_RESULT = "no result (skipped or failed: see the pytest output)"


def _t(ms, m):
    return ms[m]["stats"]["median"] if m in ms else None


def _x(ms, m, key):
    return ms[m]["extra_info"].get(key) if m in ms else None


def _missing(ms, methods):
    gone = [m for m in methods if m not in ms]
    return {"error": "no result for " + ", ".join(gone) + " (failed: see the pytest output)"} \
        if gone else {}


def _shape_ints(label):
    """The integers of a workload label such as "(1024, 409600) float32"."""
    return tuple(int(v) for v in label.split(")")[0].strip("(").split(","))


def _one_pass_ms(B, p):
    got = dense_one_pass(B, p, 4)
    return None if got is None else 1e3 * got["predicted_s"]


def _readings_ms(B, p, rows):
    """(chain, L2 rate) predicted ms of the one-pass kernel (dense_traffic's
    two readings of its measured time), or (None, None)."""
    got = one_pass_readings(B, p, 4, rows=rows)
    return (None, None) if got is None else (1e3 * got["chain_s"], 1e3 * got["l2_rate_s"])


def clip_dense(family):
    rows = []
    for w, ms in family.items():
        row = dict(shape=w, **_missing(ms, ["ncdp", "torch_eager", "torch_eager_f32norm",
                                            "read_torch_sum"]))
        if "error" not in row:
            t = _t(ms, "ncdp")
            peer = min(_t(ms, "torch_eager"), _t(ms, "torch_eager_f32norm"))
            read = min(_t(ms, m) for m in ms if m.startswith("read_"))
            nbytes = _x(ms, "ncdp", "bytes")
            B, p = _shape_ints(w)
            row.update(ncdp_ms=1e3 * t, torch_ms=1e3 * peer, read_ms=1e3 * read,
                       predicted_ms=1e3 * dense_traffic(B, p, 4, l2=0)["predicted_s"],
                       chunked_ms=1e3 * _t(ms, "ncdp_chunked") if "ncdp_chunked" in ms
                       else None,
                       predicted_chunked_ms=1e3 * dense_traffic(B, p, 4)["predicted_s"],
                       one_pass_ms=1e3 * _t(ms, "ncdp_one_pass") if "ncdp_one_pass" in ms
                       else None,
                       predicted_one_pass_ms=_one_pass_ms(B, p),
                       one_pass_rows8_ms=(1e3 * _t(ms, "ncdp_one_pass_rows8")
                                          if "ncdp_one_pass_rows8" in ms else None),
                       l2_gbs=(_x(ms, "l2_torch_sum", "bytes") / _t(ms, "l2_torch_sum") / 1e9
                               if "l2_torch_sum" in ms else None),
                       speedup_vs_torch=peer / t, ncdp_gbs=nbytes / t / 1e9,
                       read_gbs=nbytes / read / 1e9, frac_of_read=read / t,
                       ncdp_mem_mb=_x(ms, "ncdp", "peak_extra_mb"),
                       torch_mem_mb=_x(ms, "torch_eager_f32norm", "peak_extra_mb"))
            (row["chain_one_pass_ms"], row["l2_rate_one_pass_ms"]) = _readings_ms(B, p, None)
            (row["chain_rows8_ms"], row["l2_rate_rows8_ms"]) = _readings_ms(B, p, 8)
        rows.append(row)
    return rows, (
        [("shape", "(B, p) float32", None), ("ncdp_ms", "ncdp ms", "{:.3f}"),
         ("torch_ms", "torch eager ms", "{:.3f}"), ("speedup_vs_torch", "× torch", "{:.2f}"),
         ("ncdp_gbs", "ncdp GB/s", "{:.1f}"), ("read_gbs", "read limit GB/s", "{:.1f}"),
         ("frac_of_read", "fraction of read limit", "{:.2f}"),
         ("predicted_ms", "predicted H200 ms (CUDA op)", "{:.3f}"),
         ("chunked_ms", "L2-chunked ms (GPU)", "{:.3f}"),
         ("predicted_chunked_ms", "predicted H200 ms (L2-chunked)", "{:.3f}"),
         ("one_pass_ms", "one-pass ms (GPU)", "{:.3f}"),
         ("predicted_one_pass_ms", "predicted H200 ms (one pass)", "{:.3f}"),
         ("one_pass_rows8_ms", "one-pass ms, 8-row blocks (GPU)", "{:.3f}"),
         ("chain_one_pass_ms", "chain reading ms (one pass)", "{:.3f}"),
         ("l2_rate_one_pass_ms", "L2-rate reading ms (one pass)", "{:.3f}"),
         ("chain_rows8_ms", "chain reading ms (8-row blocks)", "{:.3f}"),
         ("l2_rate_rows8_ms", "L2-rate reading ms (8-row blocks)", "{:.3f}"),
         ("l2_gbs", "L2 read GB/s (torch.sum, GPU)", "{:.1f}"),
         ("ncdp_mem_mb", "ncdp peak extra MB", "{:.1f}"),
         ("torch_mem_mb", "torch peak extra MB", "{:.1f}"), ("error", "error", None)],
        ["torch eager: the faster of float64-norm and float32-norm variants",
         "predicted H200 ms: a model, not a measurement (bench/dense_traffic.py: the CUDA "
         "op's DRAM bytes at the 4.0 TB/s read limit the first GPU run measured, plus 5 us "
         "for each launch); the CUDA op: one chunk, two passes over DRAM and 4 launches; "
         "L2-chunked (GPU only): the same op with l2_bytes=-1, chunks of half the L2, a "
         "pass from DRAM and one from L2, 3 launches a chunk; one pass (GPU only): "
         "csrc/clip/dense_one_pass.cu, each row read from DRAM once and from the L2 once, "
         "predicted at an assumed L2 read rate of 7 TB/s (no run has measured it; the L2 "
         "column measures it), blank where the rows do not fit its grid (two passes); "
         "8-row blocks (GPU only): the same kernel with row blocks of 8 rows; the two "
         "readings of its 1.662 ms measured at (1024, 409600) on the H200 (2026-11-30), "
         "models: chain, a latency a row block fitted to that time, so fewer larger row "
         "blocks run faster; L2 rate, the second read at the 2.67 TB/s that run's "
         "l2_torch_sum measured, where the row blocks' size does not matter "
         "(bench/dense_traffic.py)",
         "read limit: the faster of torch.sum and (CPU) a numba parallel sum of the same array",
         "targets: CPU >= 1.5x torch eager and >= 0.70 of the read limit; "
         "GPU >= 0.80 of the read limit"])


# The GPU model of the GEMM route's time (issue 36), written beside each row so
# that a GPU run checks a prediction: an H200's FP64 tensor-core peak is 67
# TFLOP/s (datasheet) and its HBM3e 4.8 TB/s; assumed sustained: 40 TFLOP/s on
# these batched DGEMMs, 3.5 TB/s, 5 us per kernel launch (7 launches: two
# upcasts, two GEMMs, the bias add, the product, the sum).
GPU_MODEL = dict(fp64_flops=40e12, bytes_per_s=3.5e12, launch_s=5e-6, launches=7)


# The spread of a sequence block (T > 1) from the norms' own pass: from the
# Gram diagonals, two square roots, the bias, the product, the sum, the add.
SPREAD_LAUNCHES = 5
# The operands' squared norms (the clipped sum's rebalancing decision): two
# row sums of the same float64 squares into the sizes' columns.
SIZES_LAUNCHES = 2
# The Gram route at T > 1: the two float64 copies, the two batched GEMMs and
# linear_norms_from_grams' two launches, which read each Gram once for the
# norms, the spread and the sizes.
GRAM_ROUTE_LAUNCHES = 6


# The float32 Gram route at T > 1 (csrc/clip/gram_f64.cu): a Gram launch for a
# and one for g (each with its k-ranges' sum where it splits d), then
# linear_norms_from_grams' two; the kernel's rate a busy SM is the one the
# H200 measured (ncdp_fast/_cuda/gram.py MODEL_FLOPS_PER_SM_S).
GRAM_KERNEL_LAUNCHES = 4


def predicted_norm_ms(B, T, d, K) -> float:
    """The route a float32 layer takes, predicted on an H200: on the Gram route
    at T > 1 the Gram kernel (:func:`predicted_gram_kernel_ms`), else the
    float64 copies and GEMMs (:func:`predicted_copies_norm_ms`)."""
    if T > 1 and 2 * T * T <= K * d:
        return predicted_gram_kernel_ms(B, T, d, K)
    return predicted_copies_norm_ms(B, T, d, K)


def predicted_gram_kernel_ms(B, T, d, K) -> float:
    """The Gram kernel's route: the upper triangle of 64 x 64 tiles of each
    sample's two Grams, a launch each, at the measured rate of each SM a
    launch keeps busy (_cuda.gram.launch_seconds: its k-ranges counted), a and
    g read once in float32, both Grams written and read once by
    linear_norms_from_grams, :data:`GRAM_KERNEL_LAUNCHES` launches."""
    from ncdp_fast._cuda.gram import launch_seconds
    m = GPU_MODEL
    traffic = 4 * B * T * (d + K) + 2 * 8 * 2 * B * T * T
    return 1e3 * (launch_seconds(1, B, T, d) + launch_seconds(1, B, T, K)
                  + traffic / m["bytes_per_s"] + GRAM_KERNEL_LAUNCHES * m["launch_s"])


def predicted_copies_norm_ms(B, T, d, K) -> float:
    """The GEMM route's predicted ms on an H200 (:data:`GPU_MODEL`): its FLOPs,
    plus its traffic (a, g read in float32, written and read again in float64,
    the Gram or per-sample matrices written and read), plus launches; at T > 1
    with the spread of the same pass (:data:`SPREAD_LAUNCHES`, its B T values'
    traffic; the direct route also reads the float64 copies once more); and
    the operands' squared norms (:data:`SIZES_LAUNCHES`; at T = 1 from the
    rank-1 route's own row sums, no launch); on the Gram route at T > 1 all
    three come from one read of the Grams (:data:`GRAM_ROUTE_LAUNCHES`)."""
    gram = 2 * T * T <= K * d
    n = B * T * (d + K)
    mats = B * (2 * T * T if gram else K * d)
    flops = 2.0 * B * T * T * (d + K) if gram else 2.0 * B * T * d * K
    traffic = 4 * n + 8 * n + 8 * n + 8 * 2 * mats
    m = GPU_MODEL
    launches = m["launches"]
    if T > 1 and gram:
        launches = GRAM_ROUTE_LAUNCHES
    elif T > 1:
        launches += SPREAD_LAUNCHES + SIZES_LAUNCHES
        traffic += 8 * 8 * B * T + 8 * n
    return 1e3 * (flops / m["fp64_flops"] + traffic / m["bytes_per_s"]
                  + launches * m["launch_s"])


def _layer_rows(family, predict, required, cpu_other, more=None):
    """Rows of a per-layer benchmark (bench_linear_norms, bench_linear_sum):
    ncdp's time against the einsum and the other route timed, the predicted
    H200 time, and ``more(ms, t)``'s columns."""
    rows = []
    for w, ms in family.items():
        row = dict(shape=w, **_missing(ms, required))
        B, T, d, K = _shape_ints(w)
        row["predicted_gpu_ms"] = predict(B, T, d, K)
        if "error" not in row:
            t = _t(ms, "ncdp")
            other = "native_kernel" if "native_kernel" in ms else cpu_other
            row.update(ncdp_ms=1e3 * t, ncdp_gflops=_x(ms, "ncdp", "gflops"),
                       einsum_ms=1e3 * _t(ms, "torch_einsum_f32"),
                       x_einsum=_t(ms, "torch_einsum_f32") / t,
                       other=other, other_ms=1e3 * _t(ms, other) if other in ms else None,
                       x_other=_t(ms, other) / t if other in ms else None,
                       ncdp_mem_mb=_x(ms, "ncdp", "peak_extra_mb"), **(more(ms, t) if more else {}))
        rows.append(row)
    return rows


def _layer_columns(route, more=(), after=()):
    return ([("shape", "(B, T, d, K)", None), ("ncdp_ms", "ncdp ms", "{:.3f}"),
             ("ncdp_gflops", "ncdp GFLOP/s", "{:.1f}"), *more,
             ("einsum_ms", "Opacus-style f32 einsum ms", "{:.3f}"),
             ("x_einsum", "× einsum", "{:.2f}"), ("other", "also timed", None),
             ("other_ms", "its ms", "{:.3f}"), ("x_other", "× it", "{:.2f}"),
             ("predicted_gpu_ms", f"predicted H200 ms ({route})", "{:.3f}"), *after,
             ("ncdp_mem_mb", "ncdp peak extra MB", "{:.1f}"), ("error", "error", None)])


# A grouped norms call (ncdp_fast/_cuda/clip.py linear_sq_norms_group): per
# chunk of stacked layers on the Gram route, the Gram kernel's two launches
# (up to 8 layers' operands each) and linear_norms_from_grams' two (the
# layers' norms, spreads and sizes summed in it); the direct route's chunks
# are not grouped here.
GROUP_LAUNCHES = GRAM_KERNEL_LAUNCHES
GROUP_LAYERS = 12               # bench/test_bench_linear.py GROUP
GROUP_CHUNK_BYTES = 128 << 20   # ncdp_fast/_cuda/clip.py GROUP_CHUNK_BYTES


def predicted_group_norm_ms(B, T, d, K, layers=GROUP_LAYERS) -> float:
    """predicted_norm_ms per layer when ``layers`` layers of the shape form
    their norms in one grouped call: the same FLOPs and traffic, the launches
    shared by the layers of a chunk (as many as fit GROUP_CHUNK_BYTES, else
    each layer alone, its own call's launches)."""
    gram = 2 * T * T <= K * d
    per_layer = B * 8 * (T * (d + K) + (2 * T * T if gram else K * d)
                         + (0 if gram else T * max(d, K)))
    alone = predicted_norm_ms(B, T, d, K)
    if T == 1 or not gram or 2 * per_layer > GROUP_CHUNK_BYTES:
        return alone
    m = GPU_MODEL
    own = GRAM_KERNEL_LAUNCHES
    n = GROUP_CHUNK_BYTES // per_layer
    chunks = max(-(-layers // n), -(-layers // 8))   # at most 8 layers a Gram launch
    shared = chunks * GROUP_LAUNCHES / layers
    return alone + 1e3 * (shared - own) * m["launch_s"]


def linear_norms(family):
    """One row per layer shape of bench/test_bench_linear.py::test_linear_norms."""
    group = f"ncdp_group{GROUP_LAYERS}"

    def more(ms, t):
        if group not in ms:
            return {}
        return dict(group_ms=1e3 * _t(ms, group) / GROUP_LAYERS)

    def more_and_copies(ms, t):
        out = more(ms, t)
        if "ncdp_copies" in ms:
            out["copies_ms"] = 1e3 * _t(ms, "ncdp_copies")
        return out

    rows = _layer_rows(family, predicted_norm_ms, ["ncdp", "torch_einsum_f32"], "gemm_f64",
                       more_and_copies)
    for row in rows:
        row["predicted_group_ms"] = predicted_group_norm_ms(*_shape_ints(row["shape"]))
        row["predicted_copies_ms"] = predicted_copies_norm_ms(*_shape_ints(row["shape"]))
    return rows, (
        _layer_columns("its route", after=[
            ("group_ms", f"grouped ({GROUP_LAYERS} layers) ms a layer", "{:.3f}"),
            ("predicted_group_ms", "predicted H200 ms a layer, grouped", "{:.3f}"),
            ("copies_ms", "float64 copies' route ms (GPU)", "{:.3f}"),
            ("predicted_copies_ms", "predicted H200 ms (float64 copies' route)", "{:.3f}")]),
        ["per-sample squared gradient norms of a linear layer with bias, float64 result; "
         "ncdp: numba's kernel on the CPU; on a GPU the route a float32 layer takes: the "
         "Gram kernel of float32 rows on the FP64 tensor cores (csrc/clip/gram_f64.cu) on the "
         "Gram route at T > 1, else the vendor's batched FP64 GEMMs of float64 copies "
         "(ncdp_fast/_cuda/clip.py; 'float64 copies' route': the same layer forced onto "
         "them, GPU only), with the spread of a sequence block (T > 1) and the "
         "operands' squared norms as the clip op computes them, from the same pass (the GPU "
         "table of 2026-11-28 16:25 UTC: the norms alone); also timed (norms alone): on a "
         "GPU the hand-written CUDA kernel it replaced, on the CPU the GEMM route run by torch on the CPU",
         "Opacus-style einsum: float32 Grams (not the clip rule's float64), the speed a user "
         "of Opacus's ghost clipping gets",
         "predicted H200 ms: a model, not a measurement (bench/report.py GPU_MODEL: 40 "
         "TFLOP/s FP64 sustained, 3.5 TB/s, 7 launches of 5 us, 5 more for the spread, 2 "
         "for the operands' squared norms; the Gram kernel: the upper triangle of 64 x 64 "
         "tiles at 30 TFLOP/s, an assumption, a and g read once in float32, 4 launches); "
         "the first GPU profile measured the replaced kernel at 4.4 ms a call averaged "
         "over BERT-base's 72"])


# The clipped sum's GEMM runs in float32 (TF32 off) on CUDA cores: the H200's
# float32 peak is 67 TFLOP/s (datasheet) and bench_ntk's GEMMs measured 51 on
# the 2026-11-28 run; assumed sustained on these K x d outputs over a long B T
# inner dimension: 45 TFLOP/s.
SUM_FP32_FLOPS = 45e12
# scale the narrower operand, the GEMM, the bias (the scaled g's column sums;
# or, the factor in a, the weights repeated over T and one GEMV of g), the
# weight's and the bias's noise in one launch
SUM_LAUNCHES = 5


def predicted_sum_ms(B, T, d, K) -> float:
    """The data-dtype GEMM route's predicted ms on an H200, float32, no
    rebalancing scan (as a step runs it when the norms rule the scan out):
    2 B T d K FLOPs at :data:`SUM_FP32_FLOPS`; traffic at GPU_MODEL's
    bandwidth: the narrower operand read and its scaled copy written, both
    operands read by the GEMM, the output written then read and written by
    the noise, g read once more for the bias; :data:`SUM_LAUNCHES` launches."""
    narrow = B * T * min(d, K)
    traffic = 8 * narrow + 4 * B * T * (d + K) + 12 * d * K + 4 * B * T * K
    m = GPU_MODEL
    return 1e3 * (2.0 * B * T * d * K / SUM_FP32_FLOPS + traffic / m["bytes_per_s"]
                  + SUM_LAUNCHES * m["launch_s"])


def linear_sum(family):
    """One row per layer shape of bench/test_bench_linear.py::test_linear_sum."""
    def more(ms, t):
        return dict(x_mm=t / _t(ms, "torch_mm_f32"),
                    balanced_ms=1e3 * _t(ms, "ncdp_balanced") if "ncdp_balanced" in ms else None)

    rows = _layer_rows(family, predicted_sum_ms, ["ncdp", "torch_mm_f32", "torch_einsum_f32"],
                       "device_route", more)
    return rows, (
        _layer_columns("f32 GEMM route", [("x_mm", "× non-private weight GEMM", "{:.2f}"),
                                          ("balanced_ms", "with the scan ms", "{:.3f}")]),
        ["the clipped sum plus noise of a linear layer with bias (sum_i f_i g_i^T a_i + "
         "sigma xi, divided by B), float32 result; ncdp: numba and BLAS on the CPU, one "
         "float32 GEMM (TF32 off) through torch/CuPy on a GPU (ncdp_fast/_cuda/clip.py), "
         "without the rebalancing scan, as a step runs it when the norms rule the scan out "
         "(ncdp_fast/_balance.py); 'with the scan': the same with it; 'non-private weight "
         "GEMM': g^T a and the bias's column sum in float32, the work the private sum "
         "stands in for; also timed: on a GPU the hand-written CUDA kernel, on the CPU "
         "the device route run by torch on the CPU",
         "Opacus-style einsum: float32 (TF32 as torch is set) plus torch.normal",
         "predicted H200 ms: a model, not a measurement (bench/report.py: 45 TFLOP/s "
         "float32, GPU_MODEL's 3.5 TB/s, 5 launches of 5 us); the float64 route it "
         "replaced measured 0.321 / 0.638 / 0.687 / 7.91 ms at these shapes on the H200 "
         "(2026-11-28)"])


def clip_step(family):
    rows = []
    for w, ms in family.items():
        base, ghost = _t(ms, "nonprivate"), _t(ms, "ncdp_ghost")
        for m in ("nonprivate", "ncdp_ghost", "ncdp_fused", "opacus_hooks", "opacus_ghost"):
            row = dict(shape=w, method=m)
            if m not in ms:
                row["error"] = NO_RESULT
            else:
                t = _t(ms, m)
                row.update(ms=1e3 * t, peak_extra_mb=_x(ms, m, "peak_extra_mb"),
                           x_nonprivate=t / base if base else None,
                           ghost_speedup=t / ghost if ghost else None)
            rows.append(row)
    return rows, (
        [("shape", "(B, [T,] d, K)", None), ("method", "method", None),
         ("ms", "ms/step", "{:.2f}"), ("x_nonprivate", "× non-private", "{:.2f}"),
         ("ghost_speedup", "× ncdp_ghost time", "{:.1f}"),
         ("peak_extra_mb", "peak extra MB", "{:.1f}"), ("error", "error", None)],
        ["one step = zero_grad, forward, cross-entropy (mean), backward, privatize, SGD",
         "the per-sample peers (ncdp_fused, opacus_*) ran in the first round only",
         "targets: ncdp_ghost <= 2x non-private; >= 30x faster than opacus_hooks at "
         "(512, 768, 10) on CPU"])


FINETUNE_METHODS = ("nonprivate", "ncdp_ghost", "ncdp_engine", "opacus_hooks", "opacus_ghost")
# Issue 16's targets on the CPU, for this package's steps on the transformer and
# the EfficientNet: time / non-private, peak memory / non-private, speed-up over
# Opacus fast gradient clipping.
FINETUNE_TARGETS = dict(time=1.3, memory=1.1, vs_opacus_ghost=1.4, checks_pct=2.0)
# Issue 25's, on the transformer: the engine within 3% of GhostClipper alone;
# this package's step at most 1.25x non-private and at least 1.4x faster than
# Opacus fast gradient clipping.  Judged on ratios taken within each round
# (methods adjacent in time, so a shared machine's drift mostly cancels), the
# median over rounds.
ISSUE25_TARGETS = dict(engine_vs_ghost=1.03, time=1.25, vs_opacus_ghost=1.4)


def _round_ratios(times, workload, num, den) -> list:
    """``num``'s time over ``den``'s, one per round both ran in (same-round pairs)."""
    by = defaultdict(dict)
    for t in times:
        if t["workload"] == workload:
            by[t["round"]][t["method"]] = t["median_s"]
    return [r[num] / r[den] for _, r in sorted(by.items()) if num in r and den in r]


def _spread(ratios):
    """(median, min, max) of per-round ratios; Nones when there are none."""
    if not ratios:
        return None, None, None
    r = sorted(ratios)
    return r[(len(r) - 1) // 2], r[0], r[-1]


def _issue25(row, m, times, w):
    """The per-round ratios of issue 25 and its targets for an ncdp_* row of
    the transformer."""
    tg = ISSUE25_TARGETS
    med, lo, hi = _spread(_round_ratios(times, w, m, "nonprivate"))
    row.update(r_nonprivate=med, r_nonprivate_range=None if med is None else f"{lo:.2f}-{hi:.2f}")
    og = [1 / r for r in _round_ratios(times, w, m, "opacus_ghost")]
    med_og, lo, hi = _spread(og)
    row.update(r_opacus_ghost=med_og,
               r_opacus_ghost_range=None if med_og is None else f"{lo:.2f}-{hi:.2f}")
    checks = [(med, lambda v: v <= tg["time"], f"<= {tg['time']}x time",
               _round_ratios(times, w, m, "nonprivate")),
              (med_og, lambda v: v >= tg["vs_opacus_ghost"],
               f">= {tg['vs_opacus_ghost']}x faster than opacus_ghost", og)]
    if m == "ncdp_engine":
        eg = _round_ratios(times, w, m, "ncdp_ghost")
        med_e, lo, hi = _spread(eg)
        row.update(r_ghost=med_e, r_ghost_range=None if med_e is None else f"{lo:.3f}-{hi:.3f}")
        checks.insert(0, (med_e, lambda v: v <= tg["engine_vs_ghost"],
                          f"<= {tg['engine_vs_ghost']}x ncdp_ghost time", eg))
    row["targets25"] = "; ".join(
        f"{label}: {'n/a' if v is None else ('met' if ok(v) else 'NOT met')}"
        + (" (rounds on both sides)" if v is not None and len(set(map(ok, span))) > 1 else "")
        for v, ok, label, span in checks)


def finetune(family, times=()):
    rows = []
    tg = FINETUNE_TARGETS
    for w, ms in family.items():
        base, og = _t(ms, "nonprivate"), _t(ms, "opacus_ghost")
        base_mem = _x(ms, "nonprivate", "peak_extra_mb")
        for m in FINETUNE_METHODS:
            row = dict(workload=w, method=m)
            if m not in ms:
                row["error"] = NO_RESULT
                rows.append(row)
                continue
            t, mem = _t(ms, m), _x(ms, m, "peak_extra_mb")
            row.update(ms=1e3 * t, x_nonprivate=t / base if base else None,
                       peak_extra_mb=mem, weights_mb=_x(ms, m, "weights_mb"),
                       mem_x_nonprivate=mem / base_mem if mem is not None and base_mem else None,
                       speedup_vs_opacus_ghost=og / t if og else None)
            checks = _x(ms, m, "checks_ms")
            if checks is not None:
                row.update(checks_ms=checks, checks_pct=100 * checks / (1e3 * t),
                           checks_target="met" if checks <= tg["checks_pct"] / 100 * 1e3 * t
                           else "NOT met")
            if m.startswith("ncdp") and _x(ms, m, "kind") in ("transformer", "efficientnet"):
                checks = [("time", row["x_nonprivate"], lambda v: v <= tg["time"],
                           f"<= {tg['time']}x time"),
                          ("memory", row["mem_x_nonprivate"], lambda v: v <= tg["memory"],
                           f"<= {tg['memory']}x memory"),
                          ("opacus", row["speedup_vs_opacus_ghost"],
                           lambda v: v >= tg["vs_opacus_ghost"],
                           f">= {tg['vs_opacus_ghost']}x faster than opacus_ghost")]
                row["targets"] = "; ".join(
                    f"{label}: {'n/a' if v is None else ('met' if ok(v) else 'NOT met')}"
                    for _, v, ok, label in checks)
                row["targets_met"] = all(v is not None and ok(v) for _, v, ok, _ in checks)
            engine = _x(ms, m, "engine_ms")
            if engine is not None:
                row.update(engine_ms=engine, engine_pct=100 * engine / (1e3 * t))
            _checks35(row, ms, m, 1e3 * t)
            if m.startswith("ncdp") and _x(ms, m, "kind") == "transformer":
                _issue25(row, m, times, w)
            rows.append(row)
    return rows, (
        [("workload", "workload", None), ("method", "method", None),
         ("ms", "ms/step", "{:.1f}"), ("x_nonprivate", "× non-private time", "{:.2f}"),
         ("peak_extra_mb", "peak extra MB", "{:.1f}"),
         ("mem_x_nonprivate", "× non-private memory", "{:.2f}"),
         ("speedup_vs_opacus_ghost", "speed-up vs opacus_ghost", "{:.2f}"),
         ("weights_mb", "trainable weights MB", "{:.1f}"),
         ("targets", "targets (issue 16)", None),
         ("checks_ms", "checks ms/step", "{:.3f}"), ("checks_pct", "checks % of step", "{:.3f}"),
         ("checks_target", f"checks <= {tg['checks_pct']}% (issue 23)", None),
         ("r_ghost", "× ncdp_ghost time, same round (median)", "{:.3f}"),
         ("r_ghost_range", "× ncdp_ghost, rounds min-max", None),
         ("r_nonprivate", "× non-private, same round (median)", "{:.2f}"),
         ("r_nonprivate_range", "× non-private, rounds min-max", None),
         ("r_opacus_ghost", "speed-up vs opacus_ghost, same round (median)", "{:.2f}"),
         ("r_opacus_ghost_range", "speed-up vs opacus_ghost, rounds min-max", None),
         ("engine_ms", "engine's own ms/step", "{:.3f}"),
         ("engine_pct", "engine's own % of step", "{:.3f}"),
         ("targets25", "targets (issue 25)", None)] + CHECKS35_COLUMNS + [
         ("error", "error", None)],
        ["one step = zero_grad, forward, cross-entropy (mean), backward, privatize (the "
         "private methods), SGD; noise multiplier 1, max_grad_norm 1, flat clipping; fixed "
         "synthetic batches of the stated shapes (bench/test_bench_finetune.py)",
         "ncdp_ghost: GhostClipper; ncdp_engine: the same via ncdp_fast.torch.PrivacyEngine; "
         "opacus_hooks / opacus_ghost: Opacus PrivacyEngine grad_sample_mode 'hooks' / 'ghost' "
         "(the transformer after ModuleValidator.fix: DPMultiheadAttention); opacus_hooks ran "
         "in the first round only",
         "peak extra MB: resident-set growth during one step from a state with no gradients "
         "(gradients and per-sample gradients released, malloc_trim), sampled every ms, the "
         "median over three steps (runs recorded before 2026-11-25 22:00: one step); it "
         "excludes the weights, the optimizer and the batch, which every method holds alike",
         f"targets (issue 16, CPU) for ncdp_* on the transformer and the EfficientNet: "
         f"<= {tg['time']}x non-private time, <= {tg['memory']}x its peak memory, "
         f">= {tg['vs_opacus_ghost']}x faster than opacus_ghost",
         "checks: the per-step checks of issue 23 (batch identity and layout of every layer, "
         "gradients from outside a layer, parameters the mechanism did not privatize), timed "
         "where they run and averaged over every call of the case (CheckTimer in "
         f"bench/test_bench_finetune.py); target <= {tg['checks_pct']}% of the step",
         "same round: in each interleaved round the methods of a workload ran one after the "
         "other (nonprivate, ncdp_ghost, ncdp_engine, [opacus_hooks,] opacus_ghost), so a "
         "ratio of two of them within a round sees the same machine state; the median over "
         "rounds and its range are shown (the columns before use each method's median round, "
         "which may be different rounds)",
         "engine's own ms/step: the time in DPOptimizer.step / zero_grad and the "
         "PrivateModule call less what they wrap (GhostClipper.privatize_, the torch "
         "optimizer, the wrapped module), timed where it runs, errs high (EngineTimer in "
         "bench/test_bench_finetune.py)",
         f"targets (issue 25, CPU, transformer): ncdp_engine <= "
         f"{ISSUE25_TARGETS['engine_vs_ghost']}x ncdp_ghost; ncdp_* <= "
         f"{ISSUE25_TARGETS['time']}x non-private and >= {ISSUE25_TARGETS['vs_opacus_ghost']}x "
         "faster than opacus_ghost; judged on the same-round medians; '(rounds on both "
         "sides)': some rounds' ratios meet the target and some do not, so the mark is within "
         "the run's noise", CHECKS35_NOTE] + _load_note(family))


def _load_note(family) -> list:
    """The machine's load average during the run, where the cases recorded it."""
    loads = [v for ms in family.values() for b in ms.values()
             for v in b["extra_info"].get("loadavg", [])]
    if not loads:
        return []
    return [f"load average (1 min) of the machine, sampled at the start and end of every case "
            f"kept in the table: {min(loads):.1f} to {max(loads):.1f} on "
            f"{next(iter(next(iter(family.values())).values()))['extra_info']['cores']} cores"]


def _extrapolated(ms, m, full):
    """(time at ``full`` rows scaled linearly from the rows measured, whether scaled)."""
    measured = _x(ms, m, "T_measured")
    return _t(ms, m) * full / measured, measured < full


def mix(family):
    rows = []
    for w, ms in family.items():
        row = dict(config=w, T_dense_measured=_x(ms, "dense_torch", "T_measured"),
                   **_missing(ms, ["ncdp", "dense_torch", "read"]))
        if "error" not in row:
            t = _t(ms, "ncdp")
            dense, extrapolated = _extrapolated(ms, "dense_torch", _x(ms, "ncdp", "T_measured"))
            row.update(ncdp_s=t, dense_s=dense, dense_extrapolated=extrapolated,
                       speedup=dense / t, ncdp_mem_mb=_x(ms, "ncdp", "peak_extra_mb"),
                       dense_mem_mb=_x(ms, "dense_torch", "peak_extra_mb"),
                       gather_gbs=_x(ms, "ncdp", "gbs"), read_gbs=_x(ms, "read", "gbs"))
            row["gather_frac"] = row["gather_gbs"] / row["read_gbs"]
        rows.append(row)
    return rows, (
        [("config", "configuration", None), ("ncdp_s", "ncdp s", "{:.3f}"),
         ("dense_s", "dense torch s", "{:.2f}"),
         ("dense_extrapolated", "dense extrapolated", None),
         ("T_dense_measured", "dense T measured", None), ("speedup", "× dense", "{:.1f}"),
         ("gather_gbs", "gather GB/s", "{:.1f}"), ("read_gbs", "read limit GB/s", "{:.1f}"),
         ("gather_frac", "gather / read", "{:.2f}"), ("ncdp_mem_mb", "ncdp peak MB", "{:.0f}"),
         ("dense_mem_mb", "dense peak MB (at T measured)", "{:.0f}"), ("error", "error", None)],
        ["dense torch: the NeuroMixGDP reference formulation (Bernoulli mask, matmul); where "
         "its mask does not fit it runs at T measured and is scaled linearly to T",
         "targets: CPU >= 20x dense at the first size; GPU gather >= 0.60 of the read limit"])


def poisson_batches(family):
    rows = []
    for w, ms in family.items():
        row = dict(config=w, **_missing(ms, ["ncdp", "opacus"]))
        if "error" not in row:
            row.update(ncdp_s=_t(ms, "ncdp"), opacus_s=_t(ms, "opacus"),
                       speedup=_t(ms, "opacus") / _t(ms, "ncdp"),
                       ncdp_mem_mb=_x(ms, "ncdp", "peak_extra_mb"),
                       opacus_mem_mb=_x(ms, "opacus", "peak_extra_mb"))
        rows.append(row)
    return rows, (
        [("config", "configuration", None), ("ncdp_s", "ncdp s", "{:.4f}"),
         ("opacus_s", "Opacus UniformWithReplacementSampler s", "{:.3f}"),
         ("speedup", "× Opacus", "{:.1f}"), ("ncdp_mem_mb", "ncdp peak MB", "{:.0f}"),
         ("opacus_mem_mb", "Opacus peak MB", "{:.0f}"), ("error", "error", None)],
        ["target: >= 10x faster than Opacus's sampler"])


# The float32 GEMM rate of the NTK model: bench_ntk's own GEMM peak row on the
# first GPU run (a 4096^3 float32 torch GEMM, TF32 off, H200, 2026-11-28).
NTK_GPU_FP32_FLOPS = 50.96e12


def predicted_ntk_s(n, d, N, L, route="ncdp") -> float:
    """Seconds on an H200 of the bench's Gram (biased ReLU MLP, K_out = 1, x2 = x):
    the factors' FLOPs (forward, and the (L - 2) backward products) at
    :data:`NTK_GPU_FP32_FLOPS`; each Gram GEMM in waves of the device's 132 SMs
    (ncdp_fast/_cuda/ntk.py's model: TILE x TILE output tiles, a partial wave
    costing a whole one, a wave of a K-long reduction at the per-SM share of
    that rate); the elementwise passes at :data:`GPU_MODEL`'s bandwidth; launches.
    ``route``: "ncdp" (the plan ``plan_jobs`` chooses), "strips" or "halving"
    (that plan: per term P and Q written, then read with the block by addcmul_,
    the constant term added by the GEMM itself; out zeroed and mirrored), or
    "plain_torch" (bench_ntk's peer: full products, P * Q into a temporary,
    then K += it)."""
    from ncdp_fast._cuda import ntk as device_ntk
    m = GPU_MODEL
    terms = [(None, N + 1)] + [((d if l == 0 else N) + 1, N) for l in range(L - 2, -1, -1)]
    factor_flops = 2.0 * n * (d * N + (L - 2) * N * N + N) + 2.0 * (L - 2) * N * N * n
    if route == "plain_torch":
        jobs, launches = [(1, 0, 0, 0, n, n)], 4 * len(terms)
        elementwise = sum(16 if a is None else 32 for a, _ in terms) + 4
    else:
        jobs = device_ntk.plan_jobs(n, n, True, 4,
                                    plans=None if route == "ncdp" else (route,))
        mirror = -(-n // device_ntk.STRIP_ROWS)
        launches = len(jobs) * sum(1 if a is None else 3 for a, _ in terms) + 3 * mirror
        elementwise = sum(8 if a is None else 24 for a, _ in terms)
    cells = float(sum(k * rows * cols for k, _, _, _, rows, cols in jobs))
    if route != "plain_torch":
        elementwise += 8.0 * n * n / cells            # zeroing and the mirror, per cell
    wave_s = 2.0 * device_ntk.TILE ** 2 * device_ntk.DEFAULT_SMS / NTK_GPU_FP32_FLOPS
    gram_s = device_ntk.waves(jobs) * wave_s * sum((a or 0) + c for a, c in terms)
    return (factor_flops / NTK_GPU_FP32_FLOPS + gram_s
            + elementwise * cells / m["bytes_per_s"] + launches * m["launch_s"])


def ntk(family):
    rows, notes = [], []
    peak = next((ms["gemm_peak"]["extra_info"].get("gflops") for ms in family.values()
                 if "gemm_peak" in ms), None)
    for w, ms in family.items():
        if "gemm_peak" in ms:
            continue
        if "lambda_min" in ms:
            e = ms["lambda_min"]["extra_info"]
            notes.append(f"{w} (two-layer ReLU, d = 64, width 1024, x on the unit sphere; Gram "
                         f"+ solver): {_t(ms, 'lambda_min'):.2f} s (Gram {e.get('gram_s', 0):.2f}"
                         f" s), lambda_min {e.get('value')}, residual {e.get('residual')}, "
                         f"{e.get('solver')} (target: under 120 s at n = 20000)")
            continue
        row = dict(shape=w, **_missing(ms, ["ncdp"]))
        n, d, N, L = _shape_ints(w)
        row.update(predicted_s=predicted_ntk_s(n, d, N, L),
                   predicted_strips_s=predicted_ntk_s(n, d, N, L, "strips"),
                   predicted_plain_s=predicted_ntk_s(n, d, N, L, "plain_torch"))
        if "error" not in row:
            t = _t(ms, "ncdp")
            row.update(ncdp_s=t, ncdp_mem_mb=_x(ms, "ncdp", "peak_extra_mb"),
                       gflops=_x(ms, "ncdp", "gflops"), peak_gflops=peak)
            for m in ("plain_torch", "torch_func", "tiled_kernel", "ncdp_strips"):
                if m in ms:
                    row.update({f"{m}_s": _t(ms, m), f"x_{m}": _t(ms, m) / t,
                                f"{m}_mem_mb": _x(ms, m, "peak_extra_mb")})
                else:
                    row[f"{m}_note"] = "not run (J too large, or failed)"
        rows.append(row)
    return rows, (
        [("shape", "(n, d, N, L)", None), ("ncdp_s", "ncdp s", "{:.3f}"),
         ("plain_torch_s", "plain torch s", "{:.3f}"),
         ("x_plain_torch", "× plain torch", "{:.2f}"),
         ("torch_func_s", "torch.func s", "{:.2f}"), ("x_torch_func", "× torch.func", "{:.0f}"),
         ("torch_func_note", "torch.func note", None),
         ("tiled_kernel_s", "tiled kernel s", "{:.3f}"), ("x_tiled_kernel", "× tiled kernel",
                                                            "{:.2f}"),
         ("ncdp_strips_s", "ncdp strips s", "{:.3f}"),
         ("x_ncdp_strips", "× ncdp strips", "{:.2f}"),
         ("gflops", "ncdp GFLOP/s", "{:.1f}"), ("peak_gflops", "GEMM peak GFLOP/s", "{:.1f}"),
         ("predicted_s", "predicted H200 s (ncdp)", "{:.3f}"),
         ("predicted_strips_s", "predicted H200 s (strips)", "{:.3f}"),
         ("predicted_plain_s", "predicted H200 s (plain torch)", "{:.3f}"),
         ("ncdp_mem_mb", "ncdp peak MB", "{:.0f}"),
         ("plain_torch_mem_mb", "plain torch peak MB", "{:.0f}"), ("error", "error", None)],
        ["flop count: 2 n^2 (width_F + width_B) per layer term, halved for the symmetric Gram "
         "(what ncdp computes); peak: a float32 GEMM in torch (its own group)",
         "ncdp: numba's blocks on the CPU; on a GPU the vendor's GEMMs, the upper triangle by "
         "row strips or by halving, whichever the wave model gives fewer waves "
         "(ncdp_fast/_cuda/ntk.py); ncdp strips (GPU only): the same route held to the row "
         "strips; tiled kernel (GPU only): the hand-written CUDA kernel the GEMMs replaced",
         "torch.func ran in the first round only",
         "predicted H200 s: a model, not a measurement (bench/report.py predicted_ntk_s: "
         f"factor FLOPs at the {NTK_GPU_FP32_FLOPS / 1e12:.2f} TFLOP/s float32 GEMM peak "
         "measured on the H200, each Gram GEMM in waves of 128 x 128 tiles over 132 SMs, "
         "elementwise traffic at 3.5 TB/s, 5 us a launch); at (16384, 256, 4096, 4) it gives "
         f"{predicted_ntk_s(16384, 256, 4096, 4):.3f} s for ncdp's plan "
         f"({predicted_ntk_s(16384, 256, 4096, 4, 'strips'):.3f} s for the row strips, which "
         "the H200 run of 2026-11-28 measured at 0.208 s) and "
         f"{predicted_ntk_s(16384, 256, 4096, 4, 'plain_torch'):.3f} s for plain torch "
         "(measured 0.307 s)",
         "targets: CPU >= 100x torch.func, >= 1.2x plain torch with <= half its memory; "
         "GPU >= 1.5x plain torch at (16384, 256, 4096, 4)"] + notes)


def release(family):
    rows = []
    for w, ms in family.items():
        row = dict(config=w, T_dense_measured=_x(ms, "dense_torch", "T_measured"),
                   **_missing(ms, ["ncdp", "dense_torch"]))
        if "error" not in row:
            t, T = _t(ms, "ncdp"), _x(ms, "ncdp", "T_measured")
            dense, extrapolated = _extrapolated(ms, "dense_torch", T)
            e = ms["ncdp"]["extra_info"]
            row.update(features=e["features"], ncdp_s=t, accounting_s=e["accounting_s"],
                       ncdp_mem_mb=e.get("peak_extra_mb"), ncdp_us_per_row=1e6 * t / T,
                       dense_us_per_row=1e6 * dense / T, dense_s=dense,
                       dense_extrapolated=extrapolated, speedup=dense / t,
                       dense_mem_mb=_x(ms, "dense_torch", "peak_extra_mb"),
                       epsilon_clt=e["epsilon_clt"], epsilon_pld=e["epsilon_pld"])
        rows.append(row)
    return rows, (
        [("config", "configuration", None), ("features", "features", None),
         ("ncdp_s", "release() s", "{:.2f}"),
         ("accounting_s", "of which accounting s", "{:.2f}"),
         ("ncdp_us_per_row", "release µs/row", "{:.0f}"),
         ("dense_us_per_row", "dense µs/row (measured)", "{:.0f}"),
         ("T_dense_measured", "dense T measured", None), ("dense_s", "dense s at T", "{:.1f}"),
         ("dense_extrapolated", "dense s extrapolated", None),
         ("speedup", "× dense", "{:.1f}"), ("ncdp_mem_mb", "release peak MB", "{:.0f}"),
         ("dense_mem_mb", "dense peak MB (at T measured)", "{:.0f}"),
         ("epsilon_clt", "eps CLT", "{:.3f}"), ("epsilon_pld", "eps PLD", "{:.3f}"),
         ("error", "error", None)],
        ["release(): Theorem 3.1 calibration + PLD report + ncdp_fast.mix (clip, sample, "
         "average, noise); epsilon = 1, delta = 1e-5",
         "dense: the NeuroMixGDP reference formulation (T x n Bernoulli mask, matmul, noise; "
         "bench/test_bench_mix.py) on random features of the same shape, measured at 'dense T "
         "measured' rows and scaled linearly to T where marked extrapolated"])


def train(family):
    rows = []
    for w, ms in family.items():
        base = _t(ms, "nonprivate")
        n = _x(ms, "noisygd", "n_measured") or _x(ms, "nonprivate", "n_measured")
        for m in ("noisygd", "nonprivate", "naive", "opacus"):
            row = dict(config=w, method=m)
            if m not in ms:
                row["error"] = NO_RESULT
            else:
                measured = _x(ms, m, "n_measured")
                t = _t(ms, m) * n / measured
                flops = _x(ms, m, "flops") * n / measured
                row.update(seconds=t, extrapolated=measured < n, measured_n=measured,
                           gflops=flops / t / 1e9, peak_mb=_x(ms, m, "peak_extra_mb"),
                           vs_nonprivate=t / base if base else None)
            rows.append(row)
    return rows, (
        [("config", "configuration", None), ("method", "method", None),
         ("seconds", "s / step", "{:.4f}"), ("vs_nonprivate", "× non-private", "{:.2f}"),
         ("gflops", "GFLOP/s (4nKp)", "{:.1f}"), ("peak_mb", "peak extra MB", "{:.0f}"),
         ("extrapolated", "extrapolated", None), ("measured_n", "n measured", None),
         ("error", "error", None)],
        ["noisygd: NoisyGDClassifier's step (ghost clipping, no (n, K p) tensor); nonprivate: "
         "torch logits/residual/R^T X, same loss; naive: per-sample (256, K, p) chunks in "
         "torch; opacus: GradSampleModule + DPOptimizer on nn.Linear, run at 'n measured' rows "
         "and scaled linearly to n",
         "target: noisygd <= 2x non-private"])


def privacy(family):
    rows, notes = [], []
    for w, ms in family.items():
        ours = _t(ms, "ncdp_pld")
        for m, b in ms.items():
            e = b["extra_info"]
            tool, acc = m.split("_")
            rows.append(dict(
                tool=(f"ncdp_fast calibrate_noise_multiplier({acc!r})" if tool == "ncdp" else
                      f"opacus get_noise_multiplier(accountant={acc!r})"),
                sigma=e["sigma"], time_s=_t(ms, m), epsilon_own=e["epsilon_own_accountant"],
                epsilon_default=e["epsilon_pld_default_grid"],
                epsilon_fine=e["epsilon_pld_fine_grid"],
                sigma_over_ours=e["sigma"] / ms["ncdp_pld"]["extra_info"]["sigma"]
                if "ncdp_pld" in ms else None,
                time_over_ours=_t(ms, m) / ours if ours else None))
        # What the first round of ours recorded (test_bench_privacy._ours_once).
        o = next((b["extra_info"] for b in family.get(w, {}).values()
                  if "accountant_evaluations" in b["extra_info"]), None)
        e = ms["ncdp_pld"]["extra_info"] if "ncdp_pld" in ms else None
        if e and o:
            notes += [
                f"target {w}; add/remove one (Poisson subsampling)",
                f"ours: PLD grid {e['default_interval']:g}, epsilon_rtol {o['epsilon_rtol']:g}, "
                f"{o['accountant_evaluations']} accountant evaluations, peak traced memory "
                f"{o['peak_traced_mib']:.1f} MiB, first call in the process "
                f"{o['first_call_s']:.2f} s",
                f"accuracy: epsilon(sigma_ours) = {e['epsilon_pld_default_grid']:.6f} (default "
                f"grid), {e['epsilon_pld_fine_grid']:.6f} (grid {e['fine_interval']:g}); "
                f"sigma exceeds the fine-grid calibration "
                f"({o['sigma_fine_grid_calibration']:.5f}, {o['fine_grid_calibration_s']:.2f} s)"
                f" by {e['sigma'] / o['sigma_fine_grid_calibration'] - 1:+.2e}",
                f"time target (< 2 s): {'met' if ours < 2.0 else 'NOT met'}"]
    fine = next((b["extra_info"]["fine_interval"] for ms in family.values()
                 for b in ms.values()), 1e-5)
    return rows, (
        [("tool", "tool", None), ("sigma", "sigma", "{:.5f}"),
         ("sigma_over_ours", "sigma / ours(PLD)", "{:.4f}"),
         ("time_s", "time (median, s)", "{:.3f}"), ("time_over_ours", "time / ours(PLD)",
                                                    "{:.2f}"),
         ("epsilon_own", "eps, own accountant", "{:.5f}"),
         ("epsilon_default", "eps, PLD default grid", "{:.5f}"),
         ("epsilon_fine", f"eps, PLD {fine:g}", "{:.5f}")],
        notes + ["the 'gdp' rows are the central-limit approximation: not an upper bound; "
                 "their PLD epsilon shows by how much they miss the target",
                 "opacus prv ran in the first round only"])


def distributed_ntk(family):
    rows = []
    for w, ms in family.items():
        base = _t(ms, "one_process")
        for m in ("one_process", "sharded_w1", "sharded_w2"):
            row = dict(shape=w, method=m)
            if m not in ms:
                row["error"] = NO_RESULT
            else:
                e, t = ms[m]["extra_info"], _t(ms, m)
                mb = e.get("peak_extra_mb_per_rank")
                row.update(processes=e.get("processes"), seconds=t, gram_s=e.get("gram_s"),
                           lambda_s=e.get("lambda_s"), vs_one_process=t / base if base else None,
                           peak_mb_per_rank=None if mb is None else
                           " / ".join(f"{v:.0f}" for v in mb),
                           mb_sent=max(e["bytes_sent_per_rank"]) / 1e6,
                           mb_received=max(e["bytes_received_per_rank"]) / 1e6,
                           value=e.get("value"), residual=e.get("residual"),
                           solver=e.get("solver"), steps=e.get("steps"))
            rows.append(row)
    return rows, (
        [("shape", "(n, d, N) dtype", None), ("method", "method", None),
         ("processes", "ranks", None), ("seconds", "s (Gram + lambda_min)", "{:.2f}"),
         ("gram_s", "Gram s", "{:.2f}"), ("lambda_s", "lambda_min s", "{:.2f}"),
         ("vs_one_process", "× one_process time", "{:.2f}"),
         ("peak_mb_per_rank", "peak extra MB per rank", None),
         ("mb_sent", "MB sent (max rank)", "{:.1f}"),
         ("mb_received", "MB received (max rank)", "{:.1f}"),
         ("value", "lambda_min", "{:.6e}"), ("residual", "residual", "{:.1e}"),
         ("solver", "solver", None), ("steps", "Lanczos steps", None), ("error", "error", None)],
        ["one call: the Gram and its lambda_min, two-layer ReLU, x on the unit sphere; "
         "one_process: ncdp_fast.ntk_gram + ntk.lambda_min (auto: eigh to n = 4000); "
         "sharded_w1 / sharded_w2: ncdp_fast.distributed.ntk_gram + ntk_lambda_min "
         "(block Lanczos on the sharded rows, tol 1e-10) on 1 process / 2 gloo ranks on "
         "127.0.0.1",
         "each method in its own persistent worker process(es), the machine's threads "
         "divided among the ranks; times: the slowest rank plus the queue round trip; "
         "Gram / lambda_min s: the slowest rank's own timers",
         "bytes: payload handed to torch.distributed by the module's collectives (factor "
         "rows, Lanczos blocks, reductions), per rank, not gloo's wire traffic; "
         "check_same_config's small all_gather_object is not counted"])

def distributed_release(family):
    """One row per (configuration, number of ranks) of test_bench_distributed_release.py."""
    rows = []
    for w, ms in family.items():
        for m in ("W1", "W2"):
            if m not in ms:
                rows.append(dict(config=w, ranks=m[1:], error=NO_RESULT))
                continue
            e = ms[m]["extra_info"]
            rows.append(dict(
                config=w, ranks=e["world"], release_s=_t(ms, m),
                **{k: e.get(k) for k in ("n", "T", "d", "K", "m")},
                vs_w1=_t(ms, m) / _t(ms, "W1") if "W1" in ms else None,
                accounting_s=e["accounting_s"], threads=e["ranks"][0]["threads"],
                rounds_s=e.get("rounds_s_max"), compute_s=e.get("compute_s_max"),
                shard_mb=max(r["shard_mb"] for r in e["ranks"]),
                rss_peak_mb=e["rank_peak_rss_mb_max"], extra_mb=e["rank_extra_mb_max"],
                rs_mb=e["reduce_scatter_bytes_per_rank"] / 2**20,
                written_mb=e["written_bytes_per_rank"] / 2**20,
                rounds=e["ranks"][0]["rounds"], epsilon_pld=e["epsilon_pld"]))
    return rows, (
        [("config", "configuration", None), ("ranks", "ranks", None),
         ("threads", "numba threads / rank", None), ("release_s", "release s", "{:.2f}"),
         ("vs_w1", "time / 1 rank", "{:.2f}"), ("accounting_s", "of which accounting s", "{:.2f}"),
         ("rounds_s", "rounds s (max rank)", "{:.2f}"),
         ("compute_s", "rounds minus reduce-scatter s (max rank)", "{:.2f}"),
         ("shard_mb", "shard MB / rank", "{:.0f}"),
         ("rss_peak_mb", "peak RSS MB / rank (max)", "{:.0f}"),
         ("extra_mb", "RSS growth in call MB / rank (max)", "{:.0f}"),
         ("rs_mb", "reduce-scatter input MB / rank", "{:.0f}"),
         ("written_mb", "bytes written MB / rank (measured)", "{:.0f}"),
         ("rounds", "rounds", None), ("epsilon_pld", "eps PLD", "{:.3f}"),
         ("error", "error", None)],
        ["ncdp_fast.distributed.release_sharded on a gloo group over 127.0.0.1 (1 rank: the "
         "same code, no communication); synthetic float32 features; epsilon = 1, delta = "
         "1e-5; the time of a call is the wall time until every rank has finished",
         "the machine's cores are shared by the ranks (numba threads / rank), so 2 ranks "
         "here measure the cost of sharding, not a speed-up",
         "peak RSS: the rank's resident set, sampled every ms during the call (shard, "
         "labels, outputs, buffers, and the interpreter with torch); bytes written: "
         "/proc/self/io wchar over the call, the gloo socket traffic of that rank"])


# Per-sample convolution gradients (bench/test_bench_conv.py) on an H200, a
# model: the GEMM route at SUM_FP32_FLOPS with its traffic; the two
# convolution kernels as lane-products at an assumed tenth of the 67 TFLOP/s
# float32 CUDA-core peak (each product two loads, from L1/L2): the forward form
# one thread a value over its L products, the folded weight-gradient kernel one
# warp a value over ceil(L / 32) rounds of 32 lanes plus a 5-step warp reduction;
# one launch each (the GEMM route's strided pixels: one more, a copy).  The
# folded kernel launches a block (one warp) per weight value: 1.8 M blocks at
# the 1152-channel 5x5 layer, B = 64; its time is also bounded below by block
# issue, assumed 150 ns a block on each of the 132 SMs.
CONV_LANE_OPS = 6.7e12
CONV_BLOCK_S = 150e-9 / 132


def predicted_conv_ms(B, layer, route) -> float:
    cin, cout, k, s, p, G, size = layer
    L = ((size + 2 * p - k) // s + 1) ** 2
    values = B * cout * (cin // G) * k * k
    m = GPU_MODEL
    if route == "gemm":
        traffic = 4 * (B * cin * size * size + B * cout * L + values)
        return 1e3 * (2.0 * values * L / SUM_FP32_FLOPS + traffic / m["bytes_per_s"]
                      + (2 if s > 1 else 1) * m["launch_s"])
    if route == "forward":
        return 1e3 * (values * L / CONV_LANE_OPS + m["launch_s"])
    lanes = values * 32 * (-(-L // 32) + 5)
    return 1e3 * (max(lanes / CONV_LANE_OPS, values * CONV_BLOCK_S) + m["launch_s"])


def predicted_norm_affine_ms(B, rows, n, run, method) -> float:
    """A normalisation layer's per-sample affine gradients on an H200
    (:data:`GPU_MODEL`'s bandwidth and launch cost), float32. ncdp: the rows'
    statistics read x, then the sums read x again and g, and write the two
    (B, C) outputs (2 launches); torch: the normalisation reads x and writes
    xhat, the product reads g and xhat and writes the product, and two sums
    read it and g (4 launches)."""
    m = GPU_MODEL
    values = B * rows * n
    C = n if run == 0 else rows * (n // run)
    if method == "ncdp":
        traffic, launches = 4 * 3 * values + 2 * 4 * B * C + 32 * B * rows, 2
    else:
        traffic, launches = 4 * 7 * values + 2 * 4 * B * C, 4
    return 1e3 * (traffic / m["bytes_per_s"] + launches * m["launch_s"])


def norm_affine(family):
    """One row per layer of bench/test_bench_norm.py::test_norm_affine."""
    rows = []
    for w, ms in family.items():
        row = dict(layer=w, **_missing(ms, ["ncdp", "torch"]))
        B, R, n, run = (int(v) for v in w[w.index("(") + 1:w.index(")")].split(","))
        row.update(predicted_gpu_ms=predicted_norm_affine_ms(B, R, n, run, "ncdp"),
                   predicted_torch_ms=predicted_norm_affine_ms(B, R, n, run, "torch"))
        if "error" not in row:
            t = _t(ms, "ncdp")
            row.update(ncdp_ms=1e3 * t, ncdp_gbs=_x(ms, "ncdp", "bytes") / t / 1e9,
                       torch_ms=1e3 * _t(ms, "torch"), x_torch=_t(ms, "torch") / t,
                       ncdp_mem_mb=_x(ms, "ncdp", "peak_extra_mb"),
                       torch_mem_mb=_x(ms, "torch", "peak_extra_mb"))
        rows.append(row)
    return rows, (
        [("layer", "layer (B, rows, n, run)", None), ("ncdp_ms", "ncdp ms", "{:.3f}"),
         ("ncdp_gbs", "ncdp GB/s (x and g once)", "{:.1f}"),
         ("torch_ms", "torch composition ms", "{:.3f}"), ("x_torch", "× torch", "{:.2f}"),
         ("predicted_gpu_ms", "predicted H200 ms (ncdp)", "{:.3f}"),
         ("predicted_torch_ms", "predicted H200 ms (torch)", "{:.3f}"),
         ("ncdp_mem_mb", "ncdp peak extra MB", "{:.1f}"),
         ("torch_mem_mb", "torch peak extra MB", "{:.1f}"), ("error", "error", None)],
        ["per-sample gradients of a normalisation layer's weight and bias, float32: run 0 a "
         "LayerNorm (rows = positions, n = features), run > 0 a GroupNorm (rows = groups, "
         "n = a group's values, run = positions); ncdp: ncdp_fast._norm_affine (on a GPU the "
         "clip family's two kernels, on the CPU their numba twin, which the CPU rules do not "
         "use); torch: the rules' composition (normalisation without affine, product, two "
         "sums), what the CPU rules run and the device rules ran before 2026-11-29",
         "predicted H200 ms: a model, not a measurement (bench/report.py "
         "predicted_norm_affine_ms: 3.5 TB/s, 5 us a launch; ncdp moves x twice and g once, "
         "torch seven passes of the layer's values)"])


def conv_grads(family):
    """One row per layer of bench/test_bench_conv.py::test_conv_grads."""
    rows = []
    for w, ms in family.items():
        row = dict(layer=w, **_missing(ms, ["ncdp", "folded", "summed"]))
        layer, B, route = (_x(ms, "ncdp", key) for key in ("layer", "batch", "route"))
        if route is not None:
            row.update(route=route, predicted_gpu_ms=predicted_conv_ms(B, layer, route),
                       predicted_folded_ms=predicted_conv_ms(B, layer, "folded"))
        if "error" not in row:
            t = _t(ms, "ncdp")
            row.update(ncdp_ms=1e3 * t, ncdp_gflops=_x(ms, "ncdp", "gflops"),
                       folded_ms=1e3 * _t(ms, "folded"), x_folded=_t(ms, "folded") / t,
                       summed_ms=1e3 * _t(ms, "summed"), x_summed=t / _t(ms, "summed"),
                       unfold_ms=1e3 * _t(ms, "unfold_bmm") if "unfold_bmm" in ms else None,
                       opacus_ms=1e3 * _t(ms, "opacus") if "opacus" in ms else None,
                       x_opacus=_t(ms, "opacus") / t if "opacus" in ms else None,
                       ncdp_mem_mb=_x(ms, "ncdp", "peak_extra_mb"))
        rows.append(row)
    return rows, (
        [("layer", "B (C_in, C_out, kernel, stride, padding, groups, input)", None),
         ("route", "ncdp route", None), ("ncdp_ms", "ncdp ms", "{:.3f}"),
         ("ncdp_gflops", "ncdp GFLOP/s", "{:.1f}"),
         ("folded_ms", "folded ms", "{:.3f}"), ("x_folded", "speed-up over folded", "{:.2f}"),
         ("summed_ms", "non-private (summed) ms", "{:.3f}"),
         ("x_summed", "× non-private", "{:.2f}"),
         ("opacus_ms", "Opacus ms", "{:.3f}"), ("x_opacus", "speed-up over Opacus", "{:.2f}"),
         ("unfold_ms", "unfold + bmm ms", "{:.3f}"),
         ("predicted_gpu_ms", "predicted H200 ms (ncdp)", "{:.3f}"),
         ("predicted_folded_ms", "predicted H200 ms (folded)", "{:.3f}"),
         ("ncdp_mem_mb", "ncdp peak extra MB", "{:.1f}"), ("error", "error", None)],
        ["per-sample weight gradients (B, C_out, C_in / groups, k, k) of one convolution "
         "of EfficientNet-Lite0 at 96 x 96 (bench_finetune's workload), float32; ncdp: "
         "ncdp_fast/torch/layer_rules.py _conv_per_sample (gemm: one batched GEMM of a 1x1 "
         "layer; forward: a forward convolution of the input by the gradient; folded: the "
         "weight-gradient kernel with the batch folded into the groups); folded: every "
         "layer that way (the rule before 2026-11-29); non-private (summed): the batch's "
         "summed weight gradient, the work the private step skips; Opacus: its conv grad "
         "sampler (unfold, einsum); unfold + bmm: im2col columns and one batched GEMM per "
         "sample and group (not a route of the rule: timed for the comparison)",
         "predicted H200 ms: a model, not a measurement (bench/report.py predicted_conv_ms: "
         "45 TFLOP/s float32 GEMMs and 3.5 TB/s for the gemm route; the convolution kernels "
         "as lane-products at 6.7e12 a second, a tenth of the float32 peak, the folded "
         "kernel's one block a weight value at no less than 150 ns a block on each of 132 "
         "SMs; 5 us a launch)"])


def tied(family):
    """One row per method of bench/test_bench_tied.py: a tied language model's
    private step with the tied weight in ghost and in dense form."""
    rows = []
    for w, ms in family.items():
        base, base_mem = _t(ms, "nonprivate"), _x(ms, "nonprivate", "peak_extra_mb")
        for m in ("nonprivate", "ncdp_tied_ghost", "ncdp_tied_dense", "ncdp_untied"):
            row = dict(workload=w, method=m)
            if m not in ms:
                row["error"] = NO_RESULT
            else:
                t, mem = _t(ms, m), _x(ms, m, "peak_extra_mb")
                row.update(ms=1e3 * t, x_nonprivate=t / base if base else None,
                           peak_extra_mb=mem,
                           mem_x_nonprivate=mem / base_mem if mem is not None and base_mem
                           else None)
            rows.append(row)
    return rows, (
        [("workload", "workload", None), ("method", "method", None),
         ("ms", "ms/step", "{:.1f}"), ("x_nonprivate", "× non-private time", "{:.2f}"),
         ("peak_extra_mb", "peak extra MB", "{:.1f}"),
         ("mem_x_nonprivate", "× non-private memory", "{:.2f}"), ("error", "error", None)],
        ["Embedding(V, D) -> Linear(D, D) + tanh -> Linear(D, V) tied to the embedding, "
         "causal_lm_loss (mean), SGD; noise multiplier 1, max_grad_norm 1, flat clipping "
         "(bench/test_bench_tied.py)",
         "ncdp_tied_ghost: GhostClipper, the cost rule's choice (ghost form of the tied "
         "weight); ncdp_tied_dense: the dense form forced; ncdp_untied: the head with its own "
         "weight",
         "peak extra MB: resident-set growth during one step from a state with no gradients "
         "(malloc_trim first), sampled every ms"])


def noise(family):
    """One row per size of bench/test_bench_noise.py: normals per second of the
    package's generator and its peers, and the fraction of a read-write pass."""
    methods = ("ncdp_add", "ncdp_gaussian", "torch_randn", "torch_normal_", "numpy_pcg64")
    rows = []
    for w, ms in family.items():
        row = dict(workload=w, **_missing(ms, ["ncdp_add", "torch_randn", "write_limit"]))
        if "error" not in row:
            n = _x(ms, "ncdp_add", "normals")
            for m in methods:
                if m in ms:
                    row[f"{m}_mps"] = n / _t(ms, m) / 1e6
            row.update(x_torch_randn=_t(ms, "torch_randn") / _t(ms, "ncdp_add"),
                       x_torch_normal_=(_t(ms, "torch_normal_") / _t(ms, "ncdp_add")
                                        if "torch_normal_" in ms else None),
                       ncdp_gbs=_x(ms, "ncdp_add", "gbs"), limit_gbs=_x(ms, "write_limit", "gbs"),
                       frac_of_limit=_t(ms, "write_limit") / _t(ms, "ncdp_add"),
                       ncdp_mem_mb=_x(ms, "ncdp_gaussian", "peak_extra_mb"),
                       torch_mem_mb=_x(ms, "torch_randn", "peak_extra_mb"))
        rows.append(row)
    return rows, (
        [("workload", "normals", None), ("ncdp_add_mps", "ncdp add M/s", "{:.0f}"),
         ("ncdp_gaussian_mps", "ncdp gaussian M/s", "{:.0f}"),
         ("torch_randn_mps", "torch.randn M/s", "{:.0f}"),
         ("torch_normal__mps", "torch normal_ M/s", "{:.0f}"),
         ("numpy_pcg64_mps", "numpy PCG64 M/s", "{:.0f}"),
         ("x_torch_randn", "ncdp add × torch.randn", "{:.2f}"),
         ("x_torch_normal_", "ncdp add × normal_", "{:.2f}"),
         ("ncdp_gbs", "ncdp add GB/s", "{:.1f}"), ("limit_gbs", "read+write limit GB/s", "{:.1f}"),
         ("frac_of_limit", "fraction of limit", "{:.2f}"),
         ("ncdp_mem_mb", "ncdp gaussian peak extra MB", "{:.1f}"),
         ("torch_mem_mb", "torch.randn peak extra MB", "{:.1f}"), ("error", "error", None)],
        ["ncdp add: the drop-ins' noise step, n stream normals (Philox4x32-10, 0.5 blocks a "
         "normal, radius uniform down to 2^-129, Box-Muller in float64, rounded once) added "
         "in place to a float32 array; ncdp gaussian: ncdp_fast.gaussian into a new array",
         "torch.randn: a new array (torch's CPU generator, mt19937); normal_: in place, "
         "overwriting; numpy PCG64: Generator.standard_normal(out=, dtype=float32), ziggurat",
         "read+write limit: x.add_(1.0) on the same float32 array (one read and one write of "
         "each value, the traffic of ncdp add); fraction of limit: its time over ncdp add's",
         "the peers' normals are not the package's stream: they are the speed a user gives "
         "up or gains, not interchangeable noise"])


# The bag step's model (bench/test_bench_bag.py): each aten operator about one
# kernel launch of 5 us, plus the dense (V, D) float32 passes at the 4.0 TB/s
# read limit the first GPU run measured -- non-private: the weight gradient's
# zero-fill and scatter, SGD's read of weight and gradient and write of the
# weight (4 passes); private: also the clipped sum's zero-fill and scatter
# and the noise's read and write (8).  A model, not a measurement.
BAG_LAUNCH_S, BAG_READ_BPS = 5e-6, 4.0e12


def predicted_bag_ms(V, D, ops, private) -> float:
    return 1e3 * (ops * BAG_LAUNCH_S + (8 if private else 4) * 4.0 * V * D / BAG_READ_BPS)


def bag(family):
    """One row per method of bench/test_bench_bag.py: a bag-of-tokens
    classifier's step, non-private, ncdp and Opacus hooks."""
    rows = []
    for w, ms in family.items():
        base, base_mem = _t(ms, "nonprivate"), _x(ms, "nonprivate", "peak_extra_mb")
        for m in ("nonprivate", "ncdp", "opacus_hooks"):
            row = dict(workload=w, method=m)
            if m not in ms:
                row["error"] = NO_RESULT
            else:
                t, mem, ops = _t(ms, m), _x(ms, m, "peak_extra_mb"), _x(ms, m, "ops")
                row.update(ms=1e3 * t, x_nonprivate=t / base if base else None,
                           x_opacus=(_t(ms, "opacus_hooks") / t if "opacus_hooks" in ms
                                     else None),
                           peak_extra_mb=mem,
                           mem_x_nonprivate=mem / base_mem if mem is not None and base_mem
                           else None, ops=ops,
                           predicted_gpu_ms=(predicted_bag_ms(_x(ms, m, "V"), _x(ms, m, "D"),
                                                              ops, m != "nonprivate")
                                             if ops else None))
            rows.append(row)
    return rows, (
        [("workload", "workload", None), ("method", "method", None),
         ("ms", "ms/step", "{:.2f}"), ("x_nonprivate", "× non-private time", "{:.2f}"),
         ("x_opacus", "Opacus hooks time ÷ this", "{:.1f}"),
         ("peak_extra_mb", "peak extra MB", "{:.1f}"),
         ("mem_x_nonprivate", "× non-private memory", "{:.2f}"),
         ("ops", "aten ops a step", None),
         ("predicted_gpu_ms", "predicted H200 ms", "{:.3f}"), ("error", "error", None)],
        ["EmbeddingBag(V, D, mode='mean') -> Linear(D, 4), flat tokens with offsets, "
         "cross-entropy (mean), SGD; noise multiplier 1, max_grad_norm 1, flat clipping "
         "(bench/test_bench_bag.py)",
         "ncdp: GhostClipper (the step's batch: the number of bags); opacus_hooks: Opacus "
         "make_private(grad_sample_mode='hooks'), its EmbeddingBag grad sampler (timed in "
         "round 1 only; not the same result where a bag repeats a row)",
         "predicted H200 ms: a model, not a measurement: 5 us per aten operator (one launch "
         "each) plus the dense (V, D) float32 passes at 4.0 TB/s (4 non-private, 8 private)",
         "peak extra MB: resident-set growth during one step from a state with no gradients "
         "(malloc_trim first), sampled every ms"])


FAMILIES = {"bench_clip_dense": clip_dense, "bench_clip_step": clip_step,
            "bench_linear_norms": linear_norms, "bench_linear_sum": linear_sum,
            "bench_conv_grads": conv_grads, "bench_norm_affine": norm_affine,
            "bench_mix": mix,
            "bench_poisson_batches": poisson_batches, "bench_ntk": ntk,
            "bench_release": release, "bench_train": train, "privacy": privacy,
             "bench_finetune": finetune, "bench_distributed_ntk": distributed_ntk,
             "bench_distributed_release": distributed_release, "bench_tied": tied,
             "bench_noise": noise, "bench_bag": bag}
# Families whose table also reads every round's times (same-round ratios).
ROUND_AWARE = {"bench_finetune"}


def write_tables(doc: dict, out: str | Path, quiet: bool = False,
                 extra_notes=()) -> list[Path]:
    """Write the tables of a pytest-benchmark JSON document (with the "ncdp" metadata
    of bench/conftest.py) into ``out``; returns the JSON paths written."""
    meta = dict(doc["ncdp"], pytest_benchmark=doc.get("version"))
    picked = _median_rounds(doc["benchmarks"])
    paths = []
    for family, build in FAMILIES.items():
        if family not in picked:
            continue
        # Every round of every method, as measured (the table shows the median round);
        # a method that did not run has no time.
        ran = [b["extra_info"] | {"stats": b["stats"]} for b in doc["benchmarks"]
               if b["extra_info"]["family"] == family and _ran(b["extra_info"])]
        times = [dict(workload=e["workload"], method=e["method"], round=e["round"],
                      median_s=e["stats"]["median"], best_s=e["stats"].get("min"),
                      **{k: e[k] for k in ("peak_extra_mb", "peak_alloc_mb")
                         if e.get(k) is not None})
                 for e in ran]
        rows, (columns, notes) = build(picked[family], times) if family in ROUND_AWARE \
            else build(picked[family])
        notes = [f"pytest-benchmark, one process; the methods of a workload ran in "
                 f"{meta['rounds']} interleaved round(s) and the round with the median time is "
                 f"reported; times are medians of a round's calls; peak memory: CUDA allocator "
                 f"peak, or on the CPU the sampled resident-set growth during one call "
                 f"(and, where a table shows it, the sampled growth of malloc's allocated "
                 f"bytes; bench/README.md)"] + notes + list(extra_notes)
        paths.append(write_report(family, str(out), dict(meta, times=times), rows, columns,
                                  notes=notes, quiet=quiet))
    return paths


def distributed_dpsgd(family):
    """One row per (workload, method) of bench/test_bench_distributed_dpsgd.py: a
    private step (GhostClipper with a process group) and DDP without privacy, at
    1 and 2 gloo ranks."""
    rows, loads = [], []
    for w, ms in family.items():
        for m in ("private_W1", "ddp_W1", "private_W2", "ddp_W2"):
            world = int(m.rsplit("W", 1)[1])
            if m not in ms:
                rows.append(dict(workload=w, ranks=world, method=m.split("_")[0],
                                 error=NO_RESULT))
                continue
            e = ms[m]["extra_info"]
            loads += e.get("loadavg", [])
            ddp = f"ddp_W{world}"
            rows.append(dict(
                workload=w, ranks=world, method=m.split("_")[0], threads=e["threads"],
                ms=1e3 * _t(ms, m), rank_ms=1e3 * e["rank_step_s_max"],
                x_ddp=_t(ms, m) / _t(ms, ddp) if ddp in ms else None,
                x_ddp_rank=e["rank_step_s_max"] / ms[ddp]["extra_info"]["rank_step_s_max"]
                if ddp in ms else None,
                parameters=e["parameters"], rss_peak_mb=e["rank_peak_rss_mb_max"],
                extra_mb=e["rank_extra_mb_max"], allreduce_mb=e["allreduce_bytes"] / 2**20,
                allgather_mb=e["allgather_in_bytes"] / 2**20,
                ring_mb=e["ring_sent_bytes"] / 2**20,
                written_mb=e["written_bytes_max"] / 2**20,
                ddp_buckets=e.get("ddp_bucket_bytes")))
    load = (f"load average (1 min) of the machine during the run, sampled at the start and end "
            f"of every case: {min(loads):.1f} to {max(loads):.1f} on "
            f"{next(iter(next(iter(family.values())).values()))['extra_info']['cores']} cores"
            if loads else "load average not recorded")
    return rows, (
        [("workload", "workload (global batch B)", None), ("ranks", "ranks", None),
         ("method", "method", None), ("threads", "threads / rank", None),
         ("ms", "ms / step", "{:.2f}"), ("rank_ms", "ms / step in rank (max)", "{:.2f}"),
         ("x_ddp", "× DDP (same ranks)", "{:.2f}"),
         ("x_ddp_rank", "× DDP in rank (same ranks)", "{:.2f}"),
         ("parameters", "parameters P", None),
         ("rss_peak_mb", "peak RSS MiB / rank (max)", "{:.0f}"),
         ("extra_mb", "RSS growth in step MiB / rank (max)", "{:.1f}"),
         ("allreduce_mb", "all-reduce MiB / rank", "{:.3f}"),
         ("allgather_mb", "all-gather in MiB / rank", "{:.3f}"),
         ("ring_mb", "ring sends MiB / rank (derived)", "{:.3f}"),
         ("written_mb", "bytes written MiB / rank (measured)", "{:.3f}"),
         ("error", "error", None)],
        ["one step = zero_grad, forward, cross-entropy (mean over the rank's rows), "
         "backward, [GhostClipper.privatize_() with the process group: local clip, "
         "all-reduce of the clipped sums, noise of the rank's slice, all-gather; sigma = 1, "
         "C = 1], SGD; ddp: the same model in DistributedDataParallel (gloo), no privacy; the "
         "global batch B is split across the ranks; at 1 rank both run on a one-rank gloo group",
         "ms / step: the parent's wall time for one step on every rank (a message to each "
         "worker and the wait for all); in rank: the step's own time on a rank after a "
         "barrier (median of the calls, max over ranks); the cores are shared by the ranks "
         "(threads / rank), so 2 ranks measure the cost of splitting, not a speed-up; "
         "× DDP: private over DDP at the same number of ranks, from either time",
         "all-reduce / all-gather MiB (2^20 bytes): the bytes of the tensors the rank hands to "
         "torch.distributed.all_reduce / all_gather in one step, counted by wrapping them "
         "(private: the flattened clipped sum, 4P B, and 16 B of counts; its slice of "
         "ceil(P/W) floats gathered); for DDP (its reducer calls from C++) the gradients' "
         "bytes 4P, all-reduced once in buckets (DDP's own bucket sizes, in the JSON's "
         "ddp_buckets, say the same)",
         "ring sends (derived, not measured): 2(W-1)/W of the all-reduce plus (W-1) times the "
         "all-gather input; bytes written (measured): /proc/self/io wchar of the rank over "
         "the step, the gloo socket traffic on 127.0.0.1",
         "peak RSS: the rank's resident set sampled every ms during one untimed step "
         "(interpreter, torch, model, data shard); growth: that peak minus the set before "
         "the step", load])


FAMILIES["bench_distributed_dpsgd"] = distributed_dpsgd

# Issue 26's targets for this package's step on the Hugging Face models, by
# device: time / non-private, peak memory / non-private.
HF_METHODS = ("nonprivate", "ncdp_engine", "ncdp_engine_gram32", "opacus_ghost", "opacus_hooks")
# Methods a run includes on a GPU only (bench_hf's GPU_METHODS): absent, no row.
HF_GPU_ONLY = ("ncdp_engine_gram32",)
HF_TARGETS = dict(cpu=dict(time=1.25, memory=1.1), cuda=dict(time=1.15, memory=1.1))
# The memory numbers of bench_hf: extra_info key -> (ratio column, what it counts).
HF_MEMORY = {"peak_alloc_mb": ("alloc_x", "allocated"),
             "peak_extra_mb": ("mem_x_nonprivate", "resident")}


def _spread_text(values):
    """(median, 'median (min to max, count)') of per-round ratios."""
    mid, lo, hi = _spread(values)
    return mid, f"{mid:.2f} ({lo:.2f} to {hi:.2f}, {len(values)} round(s))"


CHECKS35_PCT = 2.0
CHECKS35_COLUMNS = [("checks35_ms", "issue-35 checks ms/step", "{:.3f}"),
                    ("checks35_pct", "issue-35 checks % of step", "{:.2f}"),
                    ("checks35_target", f"<= {CHECKS35_PCT:g}% (issue 35)", None)]
CHECKS35_NOTE = (
    "issue-35 checks: the model-tree check before each recorded forward, each layer's "
    "layout read from the graph, and the loss check (layer outputs noted, the torch-function mode armed and taken off, the autograd "
    "graph read at backward, its value conditions read at the step, and each torch call "
    "between forward and backward charged the mode's measured pass-through time), timed "
    f"where they run (Issue35Timer, bench/_common.py); target <= {CHECKS35_PCT:g}% of the "
    "step")


def _checks35(row, ms, m, step_ms):
    value = _x(ms, m, "checks35_ms")
    if value is not None and step_ms:
        pct = 100 * value / step_ms
        row.update(checks35_ms=value, checks35_pct=pct,
                   checks35_target="met" if pct <= CHECKS35_PCT else "NOT met")


def hf(family, times):
    """One row per (workload, method) of bench/test_bench_hf.py; ratios to the
    non-private step of the same round (``times``: every round's median time and
    peak memory, as write_tables lists them), their median and range over rounds."""
    by_round = defaultdict(dict)
    for t in times:
        by_round[(t["workload"], t["round"])][t["method"]] = t
    rows = []
    for w, ms in family.items():
        device = next(iter(ms.values()))["extra_info"].get("device", "cpu")
        tg = HF_TARGETS[device]
        for m in HF_METHODS:
            row = dict(workload=w, method=m)
            if m not in ms and m in HF_GPU_ONLY:
                continue
            if m not in ms:
                row["error"] = NO_RESULT
            elif "error" in ms[m]["extra_info"]:
                row["error"] = ms[m]["extra_info"]["error"]
            elif "peer_refused" in ms[m]["extra_info"]:
                row["peer_refused"] = ms[m]["extra_info"]["peer_refused"]
            else:
                row.update(ms=1e3 * _t(ms, m), peak_extra_mb=_x(ms, m, "peak_extra_mb"),
                           peak_alloc_mb=_x(ms, m, "peak_alloc_mb"),
                           weights_mb=_x(ms, m, "weights_mb"))
                t_x, mem_x = [], {k: [] for k in HF_MEMORY}
                for (rw, _), rm in sorted(by_round.items()):
                    base, own = rm.get("nonprivate"), rm.get(m)
                    if rw != w or base is None or own is None:
                        continue
                    t_x.append(own["median_s"] / base["median_s"])
                    for k in HF_MEMORY:
                        bm, om = base.get(k), own.get(k)
                        if bm and om is not None:
                            mem_x[k].append(om / bm)
                if t_x:
                    row["x_nonprivate"], row["x_nonprivate_rounds"] = _spread_text(t_x)
                for k, (col, _) in HF_MEMORY.items():
                    if mem_x[k]:
                        row[col], row[col + "_rounds"] = _spread_text(mem_x[k])
                _checks35(row, ms, m, row["ms"])
                autocast = ms[m]["extra_info"].get("autocast")
                if autocast and m in ("ncdp_engine", "ncdp_engine_gram32"):
                    row["targets"] = (f"none ({autocast} autocast: measured beside issue "
                                      "26/36's float32 rows)")
                elif m in ("ncdp_engine", "ncdp_engine_gram32"):
                    verdicts = [("time", row.get("x_nonprivate"), tg["time"])] + [
                        (f"memory ({'CUDA allocator' if device == 'cuda' else what})", row.get(col),
                         tg["memory"])
                        for col, what in HF_MEMORY.values() if row.get(col) is not None]
                    row["targets"] = "; ".join(
                        f"<= {bound}x {label}: "
                        f"{'met' if v is not None and v <= bound else 'NOT met'}"
                        for label, v, bound in verdicts)
                    row["targets_met"] = all(v is not None and v <= b for _, v, b in verdicts)
            rows.append(row)
    return rows, (
        [("workload", "workload", None), ("method", "method", None),
         ("ms", "ms/step", "{:.0f}"),
         ("x_nonprivate_rounds", "× non-private time: median (range, rounds)", None),
         ("peak_alloc_mb", "peak allocated MB", "{:.0f}"),
         ("alloc_x_rounds", "× non-private allocated: median (range, rounds)", None),
         ("peak_extra_mb", "peak extra MB (resident; GPU: CUDA allocator)", "{:.0f}"),
         ("mem_x_nonprivate_rounds", "× non-private peak extra: median (range, rounds)", None),
         ("weights_mb", "trainable weights MB", "{:.0f}"),
         ("targets", "targets (issue 26)", None)] + CHECKS35_COLUMNS + [
         ("peer_refused", "peer refused", None), ("error", "error", None)],
        ["one step = zero_grad, forward, loss, backward, privatize (private methods), SGD; "
         "noise multiplier 1, max_grad_norm 1, flat clipping; random-config transformers "
         "models, fixed synthetic token ids of the stated shapes (bench/test_bench_hf.py); "
         "GPT-2: causal-LM loss, each sample's mean over its own tokens "
         "(TokenCrossEntropyLoss), mean over samples; BERT: cross entropy, mean",
         "ncdp_engine: ncdp_fast.torch.PrivacyEngine.make_private (GhostClipper); "
         "ncdp_engine_gram32 (GPU only): the same with gram_precision='float32' (the norms' "
         "Grams as float32 GEMMs, each norm raised by their rounding bound, docs/privacy.md); "
         "opacus_ghost / opacus_hooks: Opacus PrivacyEngine grad_sample_mode 'ghost' / "
         "'hooks', the model called with position_ids (B, T) (Opacus fails on the default "
         "(1, T)); opacus_hooks in the first round only; peer refused: the exception Opacus "
         "raised building or running its first step (its result, not a failure here)",
         "× non-private: the method's time (or peak memory) over the non-private step's in "
         "the same interleaved round; median and range over the rounds",
         "peak allocated MB: growth of the bytes malloc has handed out (glibc mallinfo2: "
         "in-use heap chunks plus mmapped blocks; torch, NumPy and numba all allocate "
         "through malloc), the CPU's counterpart of the CUDA allocator's peak; peak extra MB "
         "(resident): resident-set growth, which adds the freed memory glibc keeps; both "
         "during one step from a state with no gradients (gradients and per-sample gradients "
         "released, malloc_trim), sampled every ms, the median over three steps (runs "
         "recorded before 2026-11-25 22:00: one step, resident only); they exclude the "
         "weights, the optimizer and the batch, which every method holds",
         "targets (issue 26) for ncdp_engine (and ncdp_engine_gram32): on the CPU <= "
         f"{HF_TARGETS['cpu']['time']}x non-private time, on a GPU <= "
         f"{HF_TARGETS['cuda']['time']}x; <= {HF_TARGETS['cpu']['memory']}x its peak memory, "
         "judged on each memory number (medians over rounds); a workload marked "
         "'bfloat16 autocast' (forward and loss of every method under torch.autocast, "
         "float32 weights) has no target", CHECKS35_NOTE])


FAMILIES["bench_hf"] = hf
ROUND_AWARE.add("bench_hf")

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", help="pytest-benchmark's --benchmark-json output")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--note", action="append", default=[],
                    help="a line added to every table's notes (e.g. how busy the machine was "
                         "when the run was not recording it); repeatable")
    args = ap.parse_args(argv)
    doc = json.loads(Path(args.json).read_text())
    if "ncdp" not in doc:
        print(f"{args.json}: no 'ncdp' metadata (not written by bench/conftest.py)",
              file=sys.stderr)
        return 2
    paths = write_tables(doc, args.out, extra_notes=args.note)
    if not paths:
        print(f"{args.json}: no benchmark results (every benchmark skipped or failed?)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
