"""A private step's GPU time predicted from the operators it runs, without a GPU.

The benchmarks' workloads (bench_hf's BERT-base and GPT-2, bench_finetune's
linear head, transformer and EfficientNet-Lite0) run one step at the GPU
run's stated shapes on the emulated CUDA device (NCDP_CUDA_EMULATION=1: CPU
tensors take the CUDA route, the same torch operators and the same launches
of ours as on a GPU).  Every operator that launches a kernel on a GPU and
every launch of ours is charged a roofline time on an H200:

* matrix products (mm, addmm, bmm, baddbmm, convolutions and their
  backward, attention): their FLOPs (torch.utils.flop_counter's formulas) at
  the measured GEMM rate of their dtype, spread over 132 SMs in 128 x 128
  output tiles split along long reductions (a last partial wave runs at the
  full wave's cost), or their bytes at the bandwidth if that is longer;
* everything else: the bytes of its tensor arguments and results (each read
  or written once) at :data:`BYTES_PER_S`;
* launches of ours: the bytes their kernels move (csrc/), the noise at the
  rate the H200 measured for the package's generator;
* each kernel at least :data:`KERNEL_FLOOR_S` (a kernel's fixed cost on the
  device when launches queue back to back).

The step's device time is the sum; the host's share is bench/host_step.py's.
A row's GPU ratio is predicted as the larger of the two per method.  These are
predictions from a model, not measurements: the next GPU run checks them.

    python bench/device_model.py [--workloads bert,gpt2,linear,transformer,efficientnet,
                                               bert_autocast]
                                 [--size full|quick|smallest] [--out bench/results]

writes ``device_model-cpu-<date>.{json,md}`` (a row per workload and method:
predicted device ms, of it GEMM-shaped and memory-bound ms and our launches,
kernels a step, and the private row's ratio) and ``device_model_ops-cpu-<date>``
(per workload, the operators whose predicted time the private step adds
most, against the non-private step's same operators).
"""
from __future__ import annotations

import collections
import contextlib
import math
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

# H200 figures: the float32 GEMM rate bench_ntk measured there (TF32 off,
# 2026-11-28), the float64 rate of bench/report.py's GPU_MODEL (Hopper's FP64
# tensor cores, 40 of their 67 TFLOP/s), the copy bandwidth of GPU_MODEL
# (bench_clip_dense measured 4.0 TB/s for a read alone), the package's noise
# rate (bench_noise, 2^24 normals added to float32: 109 G/s).
GEMM_FLOPS = {"float32": 49.39e12, "float64": 40e12, "bfloat16": 600e12, "float16": 600e12}
BYTES_PER_S = 3.5e12
NORMALS_PER_S = 109e9
KERNEL_FLOOR_S = 2.5e-6
SMS, TILE = 132, 128

WORKLOADS = ("bert", "gpt2", "linear", "transformer", "efficientnet", "bert_autocast")
# bench_hf's workloads; bert_autocast: BERT's forward and loss under bfloat16
# autocast (on the CPU tensors here, CPU autocast: the same products in bfloat16).
HF_WORKLOADS = ("bert", "gpt2", "bert_autocast")
METHODS = ("nonprivate", "ncdp_engine")
# bench_hf's GPU-only method (gram_precision="float32"), modelled for its workloads.
HF_GPU_METHODS = ("ncdp_engine_gram32",)
TOP = 14                    # operators listed a workload


def _shapes(name, size):
    """The GPU run's shapes of ``size`` (bench_hf's GPU shapes, bench_finetune's;
    EfficientNet without its pretrained weights: the same layers)."""
    if name in HF_WORKLOADS:
        import test_bench_hf as hf
        p = dict(hf.shapes(size, "cuda")[name])
        p.setdefault("kind", name)
        return "hf", p
    import test_bench_finetune as ft
    p = dict(ft.SHAPES[size][name], kind=name)
    if name == "efficientnet":
        p["pretrained"] = False
    return "finetune", p


def _build(name, method, size="full"):
    """(label, step, release) of ``method`` on workload ``name`` at ``size``
    (``release``: frees what a step leaves behind, bench_hf's and
    bench_finetune's)."""
    family, p = _shapes(name, size)
    if family == "hf":
        import test_bench_hf as hf
        step, release, _ = hf.build_step(p, method, "cpu")
        return hf.workload_label(p["kind"], p), step, release
    import test_bench_finetune as ft
    step, release, _ = ft.build_step(p, method, "cpu")
    return ft.workload_label(name, p), step, release


def _tensors(x):
    import torch
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


def _bytes(args, kwargs, out) -> int:
    """Bytes read and written: each distinct tensor argument once, each result once."""
    seen, total = set(), 0
    for t in list(_tensors(args)) + list(_tensors(kwargs)):
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total + sum(t.numel() * t.element_size() for t in _tensors(out))


def _efficiency(flops: float, out) -> float:
    """Fraction of the device's GEMM rate a product gets: its output in
    TILE x TILE tiles, each split along the reduction in pieces of 256 (what
    cuBLAS's split-K and stream-K kernels do for a small output over a long
    reduction), spread over SMS SMs with the last wave charged in full."""
    cells = sum(t.numel() for t in _tensors(out))
    if cells == 0 or flops <= 0:
        return 1.0
    k = flops / (2.0 * cells)
    units = math.ceil(cells / TILE ** 2) * max(1, int(k // 256))
    return units / (math.ceil(units / SMS) * SMS)


def _conv_flops(func, args):
    """FLOPs of a convolution and of its backward, from the weight's shape
    (its input channels are per group): flop_counter's backward formula
    ignores the groups, which a per-sample convolution folds the batch into."""
    name = func.name()
    if name == "aten::convolution":
        out_cells, w = None, args[1]
    elif name == "aten::convolution_backward":
        out_cells, w = args[0].numel(), args[2]
    else:
        return None
    per_cell = 2.0 * math.prod(w.shape[1:])
    if out_cells is None:
        return None     # forward: flop_counter's formula is right (set by the caller)
    mask = args[10]
    return per_cell * out_cells * (int(mask[0]) + int(mask[1]))


def _attention_flops(func, args, out):
    """FLOPs of the CPU attention kernels flop_counter does not list (their CUDA
    counterparts' formulas: 4 B H Tq Tk d forward, 2.5x that backward)."""
    name = func.name()
    if "scaled_dot_product" not in name and "flash_attention" not in name:
        return None
    q, k = args[0], args[1]
    if "backward" in name:
        q, k = args[1], args[2]
    b, h, tq, d = q.shape
    fwd = 4.0 * b * h * tq * k.shape[-2] * d
    return fwd * (2.5 if "backward" in name else 1.0)


class OpModel:
    """Records the device time each operator of a step is charged."""

    def __init__(self):
        self.rows = []      # (name, kind, seconds, flops, bytes)

    def charge(self, func, args, kwargs, out):
        import host_step
        from torch.utils.flop_counter import flop_registry
        if not host_step.launches_a_kernel(func):
            return
        name = func.name().replace("aten::", "")
        nbytes = _bytes(args, kwargs, out)
        flops = _conv_flops(func, args)
        counter = flop_registry.get(func._overloadpacket)
        if flops is None and counter is not None:
            flops = counter(*args, **(kwargs or {}), out_val=out)
        if flops is None:
            flops = _attention_flops(func, args, out)
        if flops:
            dtype = next((str(t.dtype).replace("torch.", "") for t in _tensors(args)
                          if t.is_floating_point()), "float32")
            rate = GEMM_FLOPS.get(dtype, GEMM_FLOPS["float32"])
            compute = flops / (rate * _efficiency(flops, out))
            seconds, kind = max(compute, nbytes / BYTES_PER_S), "gemm"
        else:
            seconds, kind = nbytes / BYTES_PER_S, "memory"
        self.rows.append((name, kind, max(seconds, KERNEL_FLOOR_S), flops or 0, nbytes))

    def launch(self, name, seconds, nbytes):
        self.rows.append((name.replace("launch_", "ours:"), "ours",
                          max(seconds, KERNEL_FLOOR_S), 0, nbytes))


_ITEMSIZE = {0: 4, 1: 8}


def _ours(name, kw) -> tuple[float, int]:
    """(seconds, bytes) of a launch of ours from its arguments (the kernels'
    traffic, csrc/clip and csrc/rng)."""
    if name == "launch_row_sq_norms":
        b = kw["B"] * kw["p"] * _ITEMSIZE[kw["dtype"]]
        return b / BYTES_PER_S, b
    if name == "launch_weighted_row_sum_noise":
        b = (kw["B"] + 1) * kw["p"] * _ITEMSIZE[kw["dtype"]]
        return b / BYTES_PER_S + (kw["p"] / NORMALS_PER_S if kw.get("noise_std") else 0), b
    if name == "launch_finish_gaussian_segments":
        n = sum(kw["count"])
        b = sum(c * (_ITEMSIZE[s] + _ITEMSIZE[d])
                for c, s, d in zip(kw["count"], kw["src_dtype"], kw["dst_dtype"]))
        return max(n / NORMALS_PER_S, b / BYTES_PER_S), b
    if name == "launch_fill_gaussian":
        return kw["count"] / NORMALS_PER_S, kw["count"] * _ITEMSIZE[kw["dtype"]]
    if name == "launch_clip_noise_rows":
        b = 2 * kw["B"] * kw["p"] * _ITEMSIZE[kw["dtype"]]
        return b / BYTES_PER_S + kw["p"] / NORMALS_PER_S, b
    if name == "launch_clip_factor_groups":
        return 0.0, 0
    if name == "launch_scale_rows":
        # x read once and the products written once (16-byte accesses), the
        # (B,) factors beside them.
        b = 2 * kw["B"] * kw["m"] * _ITEMSIZE[kw["dtype"]] + 8 * kw["B"]
        return b / BYTES_PER_S, b
    if name == "launch_norm_affine_grads":
        # The rows' statistics (x read once; its second pass from cache), then
        # x again and g once and the (B, C) outputs: two kernels.
        item = _ITEMSIZE[kw["dtype"]]
        count = kw["B"] * kw["rows"] * kw["n"]
        C = kw["n"] if kw["run"] == 0 else kw["rows"] * (kw["n"] // max(kw["run"], 1))
        b = 3 * count * item + 2 * kw["B"] * C * item + 32 * kw["B"] * kw["rows"]
        return b / BYTES_PER_S + KERNEL_FLOOR_S, b
    if name == "launch_linear_sq_norms":
        # A step reaches the rank-1 kernel only (T = 1: a 2-D linear pair): each
        # operand read once, a block a sample; the tiled T > 1 kernels are the
        # hand-written peers of bench_linear_norms, never a step's.
        if kw["T"] > 1:
            raise ValueError("device_model: launch_linear_sq_norms at T > 1 is not a private "
                             "step's (its norms come from the vendor's GEMMs)")
        b = kw["B"] * (kw["d"] + kw["K"]) * _ITEMSIZE[kw["dtype"]]
        return b / BYTES_PER_S, b
    if name == "launch_linear_norms_from_grams":
        # Both Grams read once (float32 or float64), sliced over every SM, then
        # a finish kernel.
        b = 2 * _ITEMSIZE[kw["gram_dtype"]] * kw["layers"] * kw["B"] * kw["T"] ** 2
        return b / BYTES_PER_S + KERNEL_FLOOR_S, b
    if name == "launch_gram_rows_f64":
        # The upper triangle of 64 x 64 tiles a sample on the FP64 tensor cores
        # at the measured rate of each SM the launch keeps busy (its k-ranges
        # counted: gram.launch_seconds), each sample's float32 rows read from
        # DRAM once (a tile's second read from L2) and its float64 Gram written.
        # A split launch's ranges write partial Grams that its second kernel
        # reads and adds (one more launch).
        from ncdp_fast._cuda.gram import jobs, launch_seconds, split
        count, T = len(kw["x"]) * kw["n"], kw["T"]
        b = count * (4 * T * kw["d"] + 8 * T ** 2)
        ranges, _ = split(jobs(len(kw["x"]), kw["n"], T), kw["d"])
        tail = 0.0
        if ranges > 1:
            partials = 8 * ranges * count * T ** 2
            b += 2 * partials
            tail = 2 * partials / BYTES_PER_S + KERNEL_FLOOR_S
        seconds = launch_seconds(len(kw["x"]), kw["n"], T, kw["d"])
        return max(seconds, count * (4 * T * kw["d"] + 8 * T ** 2) / BYTES_PER_S) + tail, b
    raise ValueError(f"device_model: no cost model for {name}; add one from its kernel")


def _patch_launches(model):
    """Charge every launch of ours (the emulator's module: its functions take
    keyword arguments as the package's calls pass them)."""
    import ncdp_fast._C_emu as emu
    saved = {}
    for name in dir(emu):
        if not name.startswith("launch_"):
            continue
        fn = saved[name] = getattr(emu, name)

        def launch(*args, _fn=fn, _name=name, **kwargs):
            kw = dict(kwargs)
            if args:
                params = _signature_names(_fn)
                kw.update(zip(params, args))
            seconds, nbytes = _ours(_name, kw)
            model.launch(_name, seconds, nbytes)
            return _fn(*args, **kwargs)
        setattr(emu, name, launch)
    return emu, saved


def _grams_on_host(x, sample_strides, row_strides, n, T, d, out, workspace, workspace_bytes,
                   stream):
    """launch_gram_rows_f64's Grams formed by the host's BLAS from the same
    memory (the emulated device's is the host's), for every step the model
    runs, warm-up included: the emulator meets the kernel's tensor-core
    contract with a rendezvous of the warp's 32 threads an instruction, many
    minutes a GPT-2 step, and the model needs the values only to take the
    step's own path (within gamma_d of the kernel's)."""
    import ctypes

    import numpy as np
    del workspace, workspace_bytes, stream
    count = len(x) * n * T * T
    if count == 0:
        return None
    grams = np.ctypeslib.as_array((ctypes.c_double * count).from_address(out))
    grams = grams.reshape(-1, T, T)
    for s, (p, s0, s1) in enumerate(zip(x, sample_strides, row_strides)):
        if d == 0:
            grams[s * n:(s + 1) * n] = 0.0
            continue
        size = (n - 1) * s0 + (T - 1) * s1 + d
        buf = np.ctypeslib.as_array((ctypes.c_float * size).from_address(p))
        rows = np.lib.stride_tricks.as_strided(buf, (n, T, d), (4 * s0, 4 * s1, 4))
        rows = rows.astype(np.float64)
        grams[s * n:(s + 1) * n] = rows @ rows.transpose(0, 2, 1)
    return None


def _signature_names(fn):
    """A pybind11 function's parameter names, from its signature line (a
    Python stand-in's from its signature)."""
    if hasattr(fn, "__code__"):
        import inspect
        return list(inspect.signature(fn).parameters)
    head = (fn.__doc__ or "").split("\n")[0]
    inside = head[head.index("(") + 1:head.rindex(")")]
    names, depth, cur = [], 0, ""
    for ch in inside:
        depth += ch in "[(" and 1 or (ch in "])" and -1 or 0)
        if ch == "," and depth == 0:
            names.append(cur.split(":")[0].strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        names.append(cur.split(":")[0].strip())
    return names


def model_step(step) -> list:
    """The charged rows of one call of ``step``."""
    from torch.utils._python_dispatch import TorchDispatchMode
    model = OpModel()

    class Charge(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            model.charge(func, args, kwargs, out)
            return out
    emu, saved = _patch_launches(model)
    try:
        with Charge():
            step()
    finally:
        for name, fn in saved.items():
            setattr(emu, name, fn)
    return model.rows


def summarize(rows) -> dict:
    total = sum(r[2] for r in rows)
    by = collections.Counter()
    for r in rows:
        by[r[1]] += r[2]
    floor = sum(KERNEL_FLOOR_S for r in rows)
    return dict(device_ms=1e3 * total, gemm_ms=1e3 * by["gemm"], memory_ms=1e3 * by["memory"],
                ours_ms=1e3 * by["ours"], kernels=len(rows), floor_ms=1e3 * floor)


def by_operator(rows) -> dict:
    agg = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for name, _kind, s, f, _b in rows:
        a = agg[name]
        a[0] += 1
        a[1] += s
        a[2] += f
    return agg


@contextlib.contextmanager
def grams_on_host():
    """The emulated Gram kernel replaced by :func:`_grams_on_host` inside the
    block (the models' steps: the same path and memory, minutes less)."""
    import ncdp_fast._C_emu as emu
    kernel, emu.launch_gram_rows_f64 = emu.launch_gram_rows_f64, _grams_on_host
    try:
        yield
    finally:
        emu.launch_gram_rows_f64 = kernel


def measure(names, size="full"):
    """(rows, operator rows) of the report for the workloads ``names``."""
    import torch
    torch.manual_seed(0)
    rows, ops = [], []
    with grams_on_host():
        return _measure(names, size, rows, ops)


def _measure(names, size, rows, ops):
    for name in names:
        per = {}
        methods = METHODS + (HF_GPU_METHODS if _shapes(name, size)[0] == "hf" else ())
        for method in methods:
            label, step, _ = _build(name, method, size)
            step()                          # warm-up: the steady state is modelled
            per[method] = model_step(step)
            rows.append(dict(workload=label, method=method, **summarize(per[method])))
            if method != "nonprivate":
                rows[-1]["x_nonprivate"] = (rows[-1]["device_ms"]
                                            / summarize(per["nonprivate"])["device_ms"])
        base, priv = by_operator(per["nonprivate"]), by_operator(per["ncdp_engine"])
        # The largest differences either way: the private step also drops some
        # of the non-private step's work (its weight-gradient products).
        diff = {k: priv.get(k, (0, 0.0))[1] - base.get(k, (0, 0.0))[1]
                for k in set(priv) | set(base)}
        for k in sorted(diff, key=lambda k: -abs(diff[k]))[:TOP]:
            b, q = base.get(k, (0, 0.0, 0.0)), priv.get(k, (0, 0.0, 0.0))
            ops.append(dict(workload=label, operator=k, private_calls=q[0],
                            private_ms=1e3 * q[1], nonprivate_calls=b[0],
                            nonprivate_ms=1e3 * b[1], extra_ms=1e3 * diff[k]))
    return rows, ops


def main(argv=None) -> int:
    from _common import emulated_model_args
    names, args, meta = emulated_model_args(
        __doc__, list(WORKLOADS), argv,
        "H200 model (bench/device_model.py), operators from the emulated CUDA device")
    from ncdp_fast._report import write_report
    rows, ops = measure(names, args.size)
    notes = [f"GEMM rates {', '.join(f'{k} {v / 1e12:g}' for k, v in GEMM_FLOPS.items())} "
             f"TFLOP/s in 128 x 128 tiles over {SMS} SMs; {BYTES_PER_S / 1e12:g} TB/s; "
             f"noise {NORMALS_PER_S / 1e9:g} G normals/s; {KERNEL_FLOOR_S * 1e6:g} us at least "
             f"a kernel; one step after one warm-up, at the GPU run's {args.size} shapes",
             "a model, not a measurement: the next GPU run checks it (bench/README.md)"]
    write_report("device_model", args.out, meta, rows,
                 [("workload", "workload", None), ("method", "method", None),
                  ("device_ms", "predicted device ms", "{:.2f}"),
                  ("gemm_ms", "GEMM-shaped ms", "{:.2f}"),
                  ("memory_ms", "memory-bound ms", "{:.2f}"),
                  ("ours_ms", "launches of ours ms", "{:.2f}"),
                  ("kernels", "kernels", None), ("floor_ms", "of it kernel floors ms", "{:.2f}"),
                  ("x_nonprivate", "× non-private", "{:.2f}")], notes=notes)
    write_report("device_model_ops", args.out, meta, ops,
                 [("workload", "workload", None), ("operator", "operator", None),
                  ("private_calls", "private calls", None),
                  ("private_ms", "private ms", "{:.3f}"),
                  ("nonprivate_calls", "non-private calls", None),
                  ("nonprivate_ms", "non-private ms", "{:.3f}"),
                  ("extra_ms", "extra ms", "{:.3f}")], notes=notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
