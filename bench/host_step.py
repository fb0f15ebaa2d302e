"""The host's share of a private step, measured without a GPU: the benchmarks'
workloads at their GPU depth (the same layers, so the same per-layer host
work) with widths cut until the device's work is negligible, run on the
emulated CUDA device (NCDP_CUDA_EMULATION=1: CPU tensors take the CUDA route,
the same Python and the same launches as on a GPU).

The first H200 run measured the small rows host-bound (issue 36): the linear
head's private step at 2.5 ms against 0.5 ms non-private, the 4-layer
transformer's at 21.3 against 9.7 ms, with little device work added.  What
the host does per step is what this tool measures: a change to it is judged
here, and the next GPU run checks the prediction.

    python bench/host_step.py [--device emulated|cuda] [--launches run|stub]
                              [--workloads linear,transformer,bert,gpt2,efficientnet]
                              [--rounds 15] [--clipping flat|per_layer] [--out bench/results]

``--launches stub`` (emulated device only) replaces every launch of ours but
the clip factors' by a call that returns at once: no emulator work, so no
cold caches after it either (the note below), and the host ms are the host's
own.  Allocations are zero-filled for it (torch.empty and its kin become
torch.zeros in both methods), so a stubbed kernel's output reads 0 (norms 0,
factors 1, sums 0) instead of garbage, and every optimizer steps with a
learning rate of 0, so that the stubbed sums cannot drift the model until a
norm overflows.  The path a step takes is the same; its values are not.

``--device cuda`` runs the same steps on a real GPU (``make gpu-check`` runs
it last, when its budget leaves time): at these widths the device idles and
a step's wall time is its host's, so the H200 host's own figure replaces the
scaling of this machine's.

writes ``host_step-<cpu|gpu>-<date>.{json,md}``: per workload and method
(non-private, then ``ncdp_engine``: PrivacyEngine with its GhostClipper),
the host ms a step with the emulated kernels' own time taken out (their
launch calls are timed and subtracted; the emulator runs a kernel inside its
launch call), the fastest and the median of ``--rounds`` interleaved rounds
(this 2-core VM's neighbours add bursts that the fastest round is least
exposed to), the private step's extra host ms over the non-private one, and
three counts that do not depend on the machine: torch operators dispatched,
Python function calls and kernel launches, each in one step.
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

# Each workload's layers as on the GPU run (bench_finetune's full shapes,
# bench_hf's GPU shapes: 12 layers), its widths cut to a few dozen.
HOST_SHAPES = {
    "linear": ("finetune", dict(B=8, d=16, K=3)),
    "transformer": ("finetune", dict(B=4, T=8, d=32, layers=4, heads=8, ff=64, vocab=100, K=10)),
    "bert": ("hf", dict(B=2, T=8, d=32, heads=2, layers=12, ff=64, vocab=100, K=2)),
    "gpt2": ("hf", dict(B=2, T=8, d=32, heads=2, layers=12, vocab=100)),
    # EfficientNet-Lite0's widths are its own (its 49 convolutions and group
    # norms at full depth); its resolution and batch are cut instead.
    "efficientnet": ("finetune", dict(B=2, res=16, K=3, pretrained=False)),
}
METHODS = ("nonprivate", "ncdp_engine")
STUB_NOTE = ["--launches stub: every launch of ours but the clip factors' returned at once "
             "(none run, none pollutes the caches), allocations zero-filled and optimizers "
             "stepping with a learning rate of 0, in both methods: the host ms are the host's "
             "own, on the path a step takes (its values are not a step's)"]
WARMUP = 3
ROUND_SECONDS = 0.15        # each round times whole steps for about this long


class LaunchClock:
    """Times the emulated device's launch calls (each runs its kernel before it
    returns), so that their time can be taken out of a step's."""

    def __init__(self):
        import ncdp_fast._C_emu as emu
        self.seconds, self.launches = 0.0, 0
        self._emu, self._saved = emu, {}
        for name in dir(emu):
            if name.startswith("launch_"):
                self._saved[name] = fn = getattr(emu, name)
                setattr(emu, name, self._timed(fn))

    def _timed(self, fn):
        def launch(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
                self.launches += 1
        return launch

    def reset(self):
        self.seconds, self.launches = 0.0, 0

    def remove(self):
        for name, fn in self._saved.items():
            setattr(self._emu, name, fn)


def _build(name, method, device, clipping="flat"):
    family, p = HOST_SHAPES[name]
    p = dict(p, kind=name, clipping=clipping)
    if family == "hf":
        import test_bench_hf as hf
        return hf.workload_label(name, p), hf.build_step(p, method, device)[0]
    import test_bench_finetune as ft
    return ft.workload_label(name, p), ft.build_step(p, method, device)[0]


class StubLaunches:
    """``--launches stub``: every launch of ours but the clip factors' returns
    at once (counted), allocations are zero-filled and optimizers step with
    a learning rate of 0 (the module docstring says why).  :meth:`unstub`
    puts the real launches back (the counting pass: its operators would
    otherwise include the zero fills)."""

    KEEP = ("launch_clip_factor_groups",)     # the factors the step's host reads

    def __init__(self):
        import torch
        self.clock = LaunchClock()      # times the kept launches, as in "run"
        self.launches, self._torch, self._hook = 0, torch, None
        self._allocs = {"empty": torch.empty, "empty_like": torch.empty_like}
        self._new_empty = torch.Tensor.new_empty
        self.stub()

    @property
    def seconds(self):
        return self.clock.seconds

    def stub(self):
        from torch.optim.optimizer import register_optimizer_step_pre_hook
        torch = self._torch
        for name in self.clock._saved:
            if name not in self.KEEP:
                setattr(self.clock._emu, name, self._counted)
        torch.empty, torch.empty_like = torch.zeros, torch.zeros_like
        torch.Tensor.new_empty = torch.Tensor.new_zeros

        def still(optimizer, args, kwargs):
            for group in optimizer.param_groups:
                group["lr"] = 0.0
        self._hook = register_optimizer_step_pre_hook(still)

    def unstub(self):
        for name, fn in self.clock._saved.items():
            setattr(self.clock._emu, name, self.clock._timed(fn))
        for name, fn in self._allocs.items():
            setattr(self._torch, name, fn)
        self._torch.Tensor.new_empty = self._new_empty
        self._hook.remove()

    def _counted(self, *args, **kwargs):
        self.launches += 1

    def reset(self):
        self.launches = 0
        self.clock.reset()

    def remove(self):
        self.unstub()
        self.clock.remove()


class _NoClock:
    """A real GPU's launches return at once: nothing to take out, none counted."""
    seconds, launches = 0.0, None

    def reset(self):
        pass

    def remove(self):
        pass


# Operators that launch no kernel on a GPU besides the views: allocations and
# the profiler's markers.
NO_KERNEL = ("aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty",
             "aten::new_empty_strided", "aten::_unsafe_view", "profiler::")


def launches_a_kernel(func) -> bool:
    """Whether a dispatched operator runs device work on a GPU (a view, an
    allocation or a profiler marker does not): on the GPU the kernel-launching
    operators cost the host several times what a view does."""
    return not func.is_view and not func.name().startswith(NO_KERNEL)


def python_opcodes(step) -> int:
    """The Python bytecode instructions one call of ``step`` executes (a trace
    of opcode events: the interpreter's work, machine-independent, where the
    host ms of this shared VM vary by some 10% between runs)."""
    n = [0]

    def tracer(frame, event, arg):
        frame.f_trace_opcodes = True
        frame.f_trace_lines = False
        if event == "opcode":
            n[0] += 1
        return tracer
    run_traced(step, tracer)
    return n[0]


def run_traced(step, tracer) -> None:
    """One call of ``step`` under the trace function ``tracer`` (the one
    in force before is put back)."""
    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        step()
    finally:
        sys.settrace(previous)


def _counts(step, clock):
    """(operators dispatched, those that launch a kernel, Python calls,
    launches of ours, Python opcodes) of one step."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = kernels = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            Count.kernels += launches_a_kernel(func)
            return func(*args, **(kwargs or {}))
    with Count():
        step()
    prof = cProfile.Profile()
    clock.reset()
    prof.enable()
    step()
    prof.disable()
    calls = sum(v[1] for v in pstats.Stats(prof).stats.values())
    return Count.n, Count.kernels, calls, clock.launches, python_opcodes(step)


def measure(names, rounds, device="emulated", launches="run", clipping="flat"):
    """The rows of the report: ``device`` "emulated" (CPU tensors on the
    emulated CUDA device, NCDP_CUDA_EMULATION=1 set before ncdp_fast was
    imported) or "cuda" (a GPU; each round synchronised at both ends);
    ``launches`` "run" (the emulator runs each kernel, its time taken out)
    or "stub" (:class:`StubLaunches`); ``clipping`` the private method's
    ("flat" or "per_layer": each parameter on its own bound)."""
    import torch
    torch.set_num_threads(1)      # the host's own thread, as on a GPU
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    clock = _NoClock() if cuda else StubLaunches() if launches == "stub" else LaunchClock()
    rows = []
    try:
        for name in names:
            steps = {}
            for method in METHODS:
                label, steps[method] = _build(name, method, "cuda" if cuda else "cpu", clipping)
                for _ in range(WARMUP):
                    steps[method]()
            per_round = {}
            for method, step in steps.items():
                sync()
                t0 = time.perf_counter()
                step()
                sync()
                per_round[method] = max(1, int(ROUND_SECONDS / (time.perf_counter() - t0)))
            host = {m: [] for m in METHODS}
            for _ in range(rounds):           # interleaved: each round sees both methods
                for method, step in steps.items():
                    n = per_round[method]
                    clock.reset()
                    sync()
                    t0 = time.perf_counter()
                    for _ in range(n):
                        step()
                    sync()
                    host[method].append(1e3 * (time.perf_counter() - t0 - clock.seconds) / n)
            stub = isinstance(clock, StubLaunches)
            for method in METHODS:
                if stub:
                    clock.unstub()          # counted as the step runs, not its stand-in
                ops, kernel_ops, calls, launches, opcodes = _counts(
                    steps[method], clock.clock if stub else clock)
                if stub:
                    clock.stub()
                rows.append(dict(workload=label, method=method, host_ms_min=min(host[method]),
                                 host_ms_median=statistics.median(host[method]),
                                 operators=ops, kernel_operators=kernel_ops, python_calls=calls,
                                 python_opcodes=opcodes, launches=launches))
            base, priv = rows[-2], rows[-1]
            priv["extra_ms_min"] = priv["host_ms_min"] - base["host_ms_min"]
            priv["x_nonprivate_min"] = priv["host_ms_min"] / base["host_ms_min"]
    finally:
        clock.remove()
    return rows


def main(argv=None) -> int:
    from _common import cuda_missing, workload_names
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("emulated", "cuda"), default="emulated")
    ap.add_argument("--launches", choices=("run", "stub"), default="run")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--clipping", choices=("flat", "per_layer"), default="flat")
    names, args = workload_names(ap, list(HOST_SHAPES), argv)
    if args.rounds < 1:
        ap.error(f"--rounds: expected an integer >= 1, got {args.rounds}")
    if args.launches == "stub" and args.device != "emulated":
        ap.error("--launches stub: expected --device emulated (a GPU's launches are its own), "
                 f"got --device {args.device}")
    if args.device == "emulated":
        os.environ["NCDP_CUDA_EMULATION"] = "1"     # before ncdp_fast is imported
    else:
        why = cuda_missing()
        if why:
            print(f"host_step.py: --device cuda: {why}", file=sys.stderr)
            return 2
    from report import run_meta

    from ncdp_fast._report import write_report
    rows = measure(names, args.rounds, args.device, args.launches, args.clipping)
    meta = run_meta("cuda" if args.device == "cuda" else "cpu", "host", args.rounds)
    if args.device == "emulated":
        meta["device"] += " (the emulated CUDA device: NCDP_CUDA_EMULATION=1)"
        if args.launches == "stub":
            meta["device"] += ", launches of ours stubbed (--launches stub)"
    if args.clipping != "flat":
        meta["device"] += f", ncdp_engine with clipping={args.clipping!r}"
    write_report("host_step", args.out, meta, rows,
                 [("workload", "workload", None), ("method", "method", None),
                  ("host_ms_min", "host ms/step (fastest round)", "{:.3f}"),
                  ("host_ms_median", "host ms/step (median round)", "{:.3f}"),
                  ("extra_ms_min", "private extra host ms (fastest)", "{:.3f}"),
                  ("x_nonprivate_min", "× non-private (fastest)", "{:.2f}"),
                  ("operators", "torch operators a step", None),
                  ("kernel_operators", "of them launching a kernel", None),
                  ("python_calls", "Python calls a step", None),
                  ("python_opcodes", "Python opcodes a step", None),
                  ("launches", "kernel launches a step", None)],
                 notes=[f"bench/host_step.py: {WARMUP} warm-up steps, then {args.rounds} "
                        "interleaved rounds of whole steps (about "
                        f"{ROUND_SECONDS} s each) per method; host ms = the round's wall time "
                        "less the emulated kernels' own time (their launch calls, timed), "
                        "per step; torch on one thread; on a GPU (--device cuda) the wall "
                        "time of the round, synchronised at both ends, per step (at these "
                        "widths the device idles), and no launches counted",
                        "shapes: each workload's layers as in the GPU run (the transformer's 4, "
                        "BERT's and GPT-2's 12), widths cut so that the device's work is "
                        "negligible: what remains is what the host does a step",
                        "counts (one step each): torch operators as a TorchDispatchMode sees "
                        "them (views included), those of them that launch a kernel on a GPU "
                        "(not a view, an allocation or a profiler marker), Python function "
                        "calls as cProfile counts them, Python bytecode instructions "
                        "executed (a trace of opcode events), emulated kernel launches of ours",
                        "on the emulated device a launch of ours also slows the host code "
                        "after it (the emulator's CPU work leaves the caches cold: a torch "
                        "multiply of 2.9 us took 9.3 us right after a launch of the row-norm "
                        "kernel, the launch's own time taken out, 2026-11-29), so "
                        "this host time overstates a launch's cost on a GPU; the counts do "
                        "not depend on it"] + (STUB_NOTE if args.launches == "stub" else []))
    return 0


if __name__ == "__main__":
    sys.exit(main())
