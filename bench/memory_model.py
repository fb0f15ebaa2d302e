"""A step's peak GPU memory predicted without a GPU, from the allocations it makes.

The benchmarks' workloads (bench_hf's BERT-base and GPT-2, bench_finetune's
linear head, transformer and EfficientNet-Lite0) run one step at the GPU
run's stated shapes on the emulated CUDA device (NCDP_CUDA_EMULATION=1: CPU
tensors take the CUDA route, the same tensors allocated and freed in the same
order as on a GPU).  torch's profiler records every allocation and free of
the step; their running sum, each size rounded up to the CUDA caching
allocator's 512-byte blocks, is the memory the CUDA allocator would hand out,
and its largest growth over the step's start is what the benchmarks report
as "peak extra MB" on a GPU (``torch.cuda.max_memory_allocated`` from a state
with no gradients).

Two of the CPU's kernels keep more for backward than a GPU's do, so the
model runs the GPU's forms instead (:func:`gpu_forms`):

* attention: torch's CPU ``scaled_dot_product_attention`` keeps the (B, H, T,
  T) probabilities (and a dropout mask); a GPU's memory-efficient kernel keeps
  q, k, v, its output and a log-sum-exp per row, and recomputes the rest in
  backward (:func:`gpu_sdpa`; no attention dropout, which that kernel draws
  again from its seed);
* dropout: the CPU's ``F.dropout`` multiplies by a float mask and keeps it (4
  bytes a value); a GPU's fused kernel keeps a bool mask (:func:`gpu_dropout`,
  ``torch.native_dropout``).

The first comparison with a GPU (BERT-base, H200, 2026-11-30, before the
clip op let go of each layer's operands as its sum formed): non-private
2606 MB here against 2488 MB measured, the private step's peak (in its
optimizer step) 2759 MB against 2770 MB.  A model, not a measurement: the next
GPU run checks it.

    python bench/memory_model.py [--workloads bert,gpt2,linear,transformer,efficientnet]
                                 [--size full|quick|smallest] [--out bench/results]

writes ``memory_model-cpu-<date>.{json,md}``: per workload and method the
predicted peak extra MB, the phase of the step it falls in (forward, backward
or optimizer step), the live MB the backward leaves to the optimizer step, and
the private row's ratio to the non-private one.
"""
from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import torch
import torch.utils._python_dispatch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

WORKLOADS = ("bert", "gpt2", "linear", "transformer", "efficientnet")
METHODS = ("nonprivate", "ncdp_engine")
# The CUDA caching allocator hands out multiples of 512 bytes (its small and
# large pools alike); max_memory_allocated counts those.
BLOCK_BYTES = 512
PHASES = ("forward", "backward", "optimizer step")


class EfficientAttention(torch.autograd.Function):
    """Attention keeping for backward what a GPU's memory-efficient kernel
    keeps (q, k, v, the output, a log-sum-exp a row), the probabilities
    recomputed in backward; both passes a few samples at a time, since the
    GPU kernel holds its score tiles on chip, not the (B, H, T, S) scores."""

    @staticmethod
    def forward(ctx, q, k, v, mask, scale):
        out = q.new_empty(q.shape[:-1] + v.shape[-1:])
        lse = q.new_empty(q.shape[:-1] + (1,))
        with torch.no_grad():
            for lo, hi in _attention_rows(q, k):
                s = _scores(q[lo:hi], k[lo:hi], _rows_of(mask, q, lo, hi), scale)
                lse[lo:hi] = torch.logsumexp(s, -1, keepdim=True)
                out[lo:hi] = torch.exp(s - lse[lo:hi]) @ v[lo:hi]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mask, ctx.scale = mask, scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        for lo, hi in _attention_rows(q, k):
            p = torch.exp(_scores(q[lo:hi], k[lo:hi], _rows_of(ctx.mask, q, lo, hi), ctx.scale)
                          - lse[lo:hi])
            g = grad[lo:hi]
            dv[lo:hi] = p.transpose(-2, -1) @ g
            ds = p * (g @ v[lo:hi].transpose(-2, -1) - (g * out[lo:hi]).sum(-1, keepdim=True))
            del p
            ds = ds * ctx.scale
            dq[lo:hi] = ds @ k[lo:hi]
            dk[lo:hi] = ds.transpose(-2, -1) @ q[lo:hi]
        return dq, dk, dv, None, None


def _attention_rows(q, k):
    """Slices of the leading (batch) axis whose scores hold about
    CAST_CHUNK_BYTES (one sample at least)."""
    per = math.prod(q.shape[1:-1]) * k.shape[-2] * q.element_size()
    step = max(1, CAST_CHUNK_BYTES // max(per, 1))
    return [(lo, min(q.shape[0], lo + step)) for lo in range(0, q.shape[0], step)]


def _rows_of(mask, q, lo, hi):
    """The mask's rows lo:hi where it has the batch axis, else all of it."""
    if mask is not None and mask.dim() == q.dim() and mask.shape[0] == q.shape[0] > 1:
        return mask[lo:hi]
    return mask


def _scores(q, k, mask, scale):
    s = (q @ k.transpose(-2, -1)) * scale
    return s if mask is None else s + mask


def gpu_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
             enable_gqa=False):
    """``F.scaled_dot_product_attention`` through :class:`EfficientAttention`:
    the same values, without attention dropout (the GPU kernel keeps no mask
    for it: it draws it again from its seed)."""
    del dropout_p, enable_gqa
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    mask = attn_mask
    if is_causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(
            ~mask, float("-inf"))
    return EfficientAttention.apply(q, k, v, mask, scale)


def gpu_dropout(input, p=0.5, training=True, inplace=False):
    """``F.dropout`` as a GPU runs it: the fused kernel, its mask kept as bool."""
    del inplace
    if not training or p == 0.0:
        return input
    return torch.native_dropout(input, p, True)[0]


# Operands of more bytes than this, of mixed dtypes, are cast a chunk at a time.
CAST_CHUNK_BYTES = 1 << 20


class GpuCasts(torch.utils._python_dispatch.TorchDispatchMode):
    """A CUDA element-wise kernel or reduction casts its operands as it loads
    them; the CPU's first copies an operand of another dtype whole:
    ``torch.mul`` of a float32 array by float64 factors into a float32 result
    (``_arrays.scale_rows``) made two float64 temporaries of the array's size,
    a float64 sum of a float32 array one (as on a GPU, where torch's reduction
    copies it too: the H200 run of 2026-11-30; the clip op's biases now sum in
    the data dtype), and GPT-2's (16, 128, 50257) head gradient is 785 MB in
    float64.  Here such an op runs
    a chunk of its output at a time, its temporaries a chunk's: element-wise
    ops (torch's pointwise tag) cut along their output's first axis (the same
    values), float64 sums of float32 along a kept axis (the same up to the
    order of their float64 additions)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if tensors and max(t.numel() * t.element_size() for t in tensors) > CAST_CHUNK_BYTES:
            floats = {t.dtype for t in tensors if t.is_floating_point()}
            if torch.Tag.pointwise in func.tags and len(floats) > 1:
                return self._pointwise(func, args, kwargs)
            dtype = kwargs.get("dtype")
            if func is torch.ops.aten.sum.dim_IntList and dtype not in (None, args[0].dtype):
                return self._sum(func, args, kwargs)
        return func(*args, **kwargs)

    @staticmethod
    def _rows(n, row_bytes):
        step = max(1, CAST_CHUNK_BYTES // max(row_bytes, 1))
        return [(lo, min(n, lo + step)) for lo in range(0, n, step)]

    def _pointwise(self, func, args, kwargs):
        first = func._schema.arguments[0].alias_info
        inplace = first is not None and first.is_write      # add_, mul_: the first operand
        out = args[0] if inplace else kwargs.get("out")
        given = out is not None
        shape = torch.broadcast_shapes(*(a.shape for a in args if isinstance(a, torch.Tensor)))
        if len(shape) == 0 or shape[0] < 2:
            return func(*args, **kwargs)

        def cut(a, lo, hi):
            # Only operands that carry the output's first axis are cut.
            if isinstance(a, torch.Tensor) and a.dim() == len(shape) and a.shape[0] > 1:
                return a[lo:hi]
            return a
        row_bytes = math.prod(shape[1:]) * 8
        for lo, hi in self._rows(shape[0], row_bytes):
            part = [cut(a, lo, hi) for a in args]
            if inplace:
                func(*part, **kwargs)
            elif given:
                func(*part, **dict(kwargs, out=out[lo:hi]))
            else:
                got = func(*part, **kwargs)
                if out is None:
                    out = torch.empty((shape[0],) + tuple(got.shape[1:]), dtype=got.dtype,
                                      device=got.device)
                out[lo:hi].copy_(got)
        return out

    def _sum(self, func, args, kwargs):
        x, dims = args[0], args[1]
        keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
        dims = [d % x.dim() for d in (dims or range(x.dim()))]
        kept = [d for d in range(x.dim()) if d not in dims]
        if not kept:
            return func(*args, **kwargs)
        k = max(kept, key=lambda d: x.shape[d])
        at = k if keepdim else k - sum(d < k for d in dims)
        result = None
        row_bytes = x.numel() // max(x.shape[k], 1) * 8
        for lo, hi in self._rows(x.shape[k], row_bytes):
            part = func(x.narrow(k, lo, hi - lo), *args[1:], **kwargs)
            if result is None:
                shape = list(part.shape)
                shape[at] = x.shape[k]
                result = torch.empty(shape, dtype=part.dtype, device=part.device)
            result.narrow(at, lo, hi - lo).copy_(part)
        return result


class gpu_forms:
    """Context: :func:`gpu_sdpa` and :func:`gpu_dropout` in place of torch's
    (``torch.nn.functional``'s names, which torch's own modules and
    transformers' models look up at each call), and :class:`GpuCasts`."""

    def __enter__(self):
        F = torch.nn.functional
        self._saved = F.scaled_dot_product_attention, F.dropout
        F.scaled_dot_product_attention, F.dropout = gpu_sdpa, gpu_dropout
        self._casts = GpuCasts()
        self._casts.__enter__()
        return self

    def __exit__(self, *exc):
        self._casts.__exit__(*exc)
        F = torch.nn.functional
        F.scaled_dot_product_attention, F.dropout = self._saved


def live_curve(timeline) -> list:
    """(time ns, live bytes grown since the start) after each allocation or
    free of a profiler memory timeline (``MemoryProfile.timeline``), sizes in
    the allocator's blocks; tensors alive before the step count only when
    freed (negative growth)."""
    from torch.profiler._memory_profiler import Action
    live, points = 0, []
    for t, action, _key, size in timeline:
        if t < 0:               # alive before the profile: not the step's
            continue
        rounded = -(-size // BLOCK_BYTES) * BLOCK_BYTES
        if action == Action.CREATE:
            live += rounded
        elif action == Action.DESTROY:
            live -= rounded
        else:
            continue
        points.append((t, live))
    return points


def peak_by_phase(points, marks) -> dict:
    """The peak growth and the phase it falls in, and the growth left when
    the optimizer step starts.  ``marks``: the phases' start times (ns, the
    profiler's clock), ``{"forward": t0, "backward": t1, "optimizer step": t2}``."""
    peak, when = 0, PHASES[0]
    at_step = 0
    for t, live in points:
        if live > peak:
            peak = live
            when = max((p for p in PHASES if marks.get(p, math.inf) <= t),
                       key=lambda p: marks[p], default=PHASES[0])
        if t < marks.get("optimizer step", math.inf):
            at_step = live
    return dict(peak_mb=peak / 2**20, peak_phase=when, at_step_mb=at_step / 2**20)


def measure_step(step, release) -> dict:
    """One step of ``step`` (after a warm-up and ``release``), profiled."""
    from torch.optim.optimizer import register_optimizer_step_pre_hook
    from torch.profiler import ProfilerActivity, profile
    from torch.profiler._memory_profiler import MemoryProfile
    step()
    marks = {}

    def at_backward(*args, _run=torch.autograd._engine_run_backward, **kwargs):
        marks.setdefault("backward", time.time_ns())
        return _run(*args, **kwargs)

    def at_step(*args):
        marks.setdefault("optimizer step", time.time_ns())
    hook = register_optimizer_step_pre_hook(at_step)
    saved, torch.autograd._engine_run_backward = torch.autograd._engine_run_backward, at_backward
    try:
        release()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            marks["forward"] = time.time_ns()
            step()
    finally:
        torch.autograd._engine_run_backward = saved
        hook.remove()
    return peak_by_phase(live_curve(MemoryProfile(prof.profiler.kineto_results).timeline), marks)


def measure(names, size="full") -> list:
    import device_model as dm
    torch.manual_seed(0)
    rows = []
    # The Gram kernel's values from the host's BLAS: the same allocations.
    with dm.grams_on_host(), gpu_forms():
        for name in names:
            plain = None
            for method in METHODS:
                label, step, release = dm._build(name, method, size)
                row = dict(workload=label, method=method, **measure_step(step, release))
                if plain is None:
                    plain = row["peak_mb"]
                else:
                    row["x_nonprivate"] = row["peak_mb"] / plain if plain else None
                rows.append(row)
                del step, release
    return rows


def main(argv=None) -> int:
    from _common import emulated_model_args
    names, args, meta = emulated_model_args(
        __doc__, list(WORKLOADS), argv,
        "GPU memory model (bench/memory_model.py), allocations of the emulated CUDA device")
    from ncdp_fast._report import write_report
    rows = measure(names, args.size)
    notes = [f"one step after one warm-up, at the GPU run's {args.size} shapes, from a state "
             "with no gradients; each allocation rounded up to the CUDA allocator's "
             f"{BLOCK_BYTES}-byte blocks; attention, dropout and mixed-dtype operations in "
             "their GPU forms (memory-efficient attention, bool dropout masks, operands cast "
             "a chunk at a time: the module docstring)",
             "peak extra MB: the largest growth of the allocated bytes over the step's start, "
             "what the benchmarks' GPU tables report (torch.cuda.max_memory_allocated); "
             "at the optimizer step: the growth the forward and backward leave to it",
             "a model, not a measurement: the next GPU run checks it (bench/README.md)"]
    write_report("memory_model", args.out, meta, rows,
                 [("workload", "workload", None), ("method", "method", None),
                  ("peak_mb", "predicted peak extra MB", "{:.2f}"),
                  ("peak_phase", "peak in", None),
                  ("at_step_mb", "at the optimizer step MB", "{:.2f}"),
                  ("x_nonprivate", "× non-private", "{:.3f}")], notes=notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
