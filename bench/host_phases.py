"""Where a step's host work goes, phase by phase and function by function, in
Python bytecode instructions: a count that does not depend on the machine.

bench/host_step.py times the private step's host work on the emulated device,
but this shared 2-core VM's timings vary by 10% and more between runs, so a
change of a few percent cannot be told from the noise there (issue 36's note
of 2026-12-01: a change that removed 2-3% of a step's Python calls moved no
host time measurably).  The interpreter's work can be counted exactly: this
tool traces one step (after warm-up) and charges each executed opcode to the
phase of the step it ran in and to its function.

    python bench/host_phases.py [--workloads linear,transformer,bert,gpt2,efficientnet]
                                [--top 8] [--out bench/results]

Phases: ``zero_grad``; ``forward`` (the step's first outermost module call:
the model, its hooks and the checks in its pre-hook); ``loss`` (the second:
the criterion); ``backward`` (``Tensor.backward`` and all it runs: the
layers' gradient hooks and rules); ``step, before transfer`` and ``step,
after transfer`` (the optimizer's step, split where the clip op's one
device-to-host transfer, ``_clip_results._accounting``, returns); ``transfer``
(that call); ``other`` (the benchmark's own code, the engine's batch draw).
The workloads and methods are bench/host_step.py's (its widths, on the
emulated CUDA device, launches run: they execute no Python).

writes ``host_phases-cpu-<date>.{json,md}``: per workload and method the
opcodes of each phase and their sum, the private step's extra over the
non-private one per phase, and (JSON, and the Markdown's second table) the
``--top`` functions of each phase of the private step by opcodes.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

PHASES = ("zero_grad", "forward", "loss", "backward", "step, before transfer", "transfer",
          "step, after transfer", "other")
WARMUP = 3


def _marker(code, accounting_code):
    """The phase a frame of ``code`` starts (None: its caller's), before the
    module calls are told apart by their order."""
    if code is accounting_code:
        return "transfer"
    name, file = code.co_name, code.co_filename.replace("\\", "/")
    if name == "zero_grad" and ("torch/optim" in file or "ncdp_fast/torch" in file):
        return "zero_grad"
    if name == "backward" and (file.endswith("torch/_tensor.py")
                               or file.endswith("torch/autograd/__init__.py")):
        return "backward"
    if name == "step" and ("torch/optim" in file or "ncdp_fast/torch" in file):
        return "step"
    if name == "_wrapped_call_impl" and file.endswith("torch/nn/modules/module.py"):
        return "module"
    return None


class PhaseCounter:
    """Counts the opcodes one call of a step executes, by phase and by
    function (``(phase, file, function, first line)``)."""

    def __init__(self):
        import ncdp_fast._clip_results as results
        self.accounting = results._accounting.__code__
        self.phases, self.functions = Counter(), Counter()

    def run(self, step) -> None:
        frames = {}                     # id(frame) -> its phase
        state = {"modules": 0, "after": False}
        top = sys._getframe()

        def phase_of_new(frame):
            parent = frames.get(id(frame.f_back), "other") if frame.f_back is not top else "other"
            mark = _marker(frame.f_code, self.accounting)
            if mark is None:
                return parent
            if mark == "module":
                if parent != "other":
                    return parent       # a module inside a phase: that phase's
                state["modules"] += 1
                return "forward" if state["modules"] == 1 else "loss"
            if mark == "step" and parent == "step":
                return parent           # the optimizer's own step inside the engine's
            return mark if parent in ("other", "step") or mark == "transfer" else parent

        def tracer(frame, event, arg):
            if event == "call":
                frames[id(frame)] = phase_of_new(frame)
                frame.f_trace_opcodes = True
                frame.f_trace_lines = False
                return tracer
            if event == "opcode":
                phase = frames.get(id(frame), "other")
                if phase == "step":
                    phase = "step, after transfer" if state["after"] else "step, before transfer"
                self.phases[phase] += 1
                code = frame.f_code
                self.functions[(phase, _short(code.co_filename), code.co_name,
                                code.co_firstlineno)] += 1
            elif event == "return":
                if frame.f_code is self.accounting:
                    state["after"] = True
                frames.pop(id(frame), None)
            return tracer

        from host_step import run_traced
        run_traced(step, tracer)


def _short(path: str) -> str:
    path = path.replace("\\", "/")
    for root in ("site-packages/", str(BENCH.parent).replace("\\", "/") + "/"):
        if root in path:
            return path.split(root, 1)[1]
    lib = path.rfind("/lib/python")         # the standard library's: lib/python3.x/...
    return path[lib + 1:] if lib >= 0 else path


def measure(names, top):
    """(rows, function rows): each workload's methods' opcodes by phase, and
    the private method's ``top`` functions of each phase."""
    import torch
    torch.set_num_threads(1)
    import host_step
    rows, functions = [], []
    for name in names:
        counted = {}
        for method in host_step.METHODS:
            label, step = host_step._build(name, method, "cpu")
            for _ in range(WARMUP):
                step()
            counter = PhaseCounter()
            counter.run(step)
            counted[method] = counter
            row = dict(workload=label, method=method, total=sum(counter.phases.values()))
            row.update({p: counter.phases.get(p, 0) for p in PHASES})
            rows.append(row)
        base, priv = (counted[m] for m in host_step.METHODS)
        extra = dict(workload=label, method="extra (private - non-private)",
                     total=rows[-1]["total"] - rows[-2]["total"])
        extra.update({p: priv.phases.get(p, 0) - base.phases.get(p, 0) for p in PHASES})
        rows.append(extra)
        for phase in PHASES:
            ranked = sorted(((n, k) for k, n in priv.functions.items() if k[0] == phase),
                            key=lambda t: (-t[0], t[1]))[:top]
            functions += [dict(workload=label, phase=phase, rank=i + 1, opcodes=n,
                               function=f"{k[1]}:{k[3]} {k[2]}")
                          for i, (n, k) in enumerate(ranked)]
    return rows, functions


def main(argv=None) -> int:
    from _common import workload_names
    import host_step
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--top", type=int, default=8)
    names, args = workload_names(ap, list(host_step.HOST_SHAPES), argv)
    if args.top < 0:
        ap.error(f"--top: expected an integer >= 0, got {args.top}")
    os.environ["NCDP_CUDA_EMULATION"] = "1"     # before ncdp_fast is imported
    from report import run_meta

    from ncdp_fast._report import write_report
    rows, functions = measure(names, args.top)
    meta = run_meta("cpu", "host", 1)
    meta["device"] += " (the emulated CUDA device: NCDP_CUDA_EMULATION=1)"
    path = write_report(
        "host_phases", args.out, meta, rows,
        [("workload", "workload", None), ("method", "method", None),
         ("total", "opcodes a step", None)] + [(p, p, None) for p in PHASES],
        notes=["bench/host_phases.py: Python opcodes one step executes (after "
               f"{WARMUP} warm-up steps; sys.settrace opcode events), charged to the phase "
               "of the step they ran in (the module docstring defines them) and to their "
               "function; bench/host_step.py's workloads and methods, launches run"])
    if functions:
        md = path.with_suffix(".md")
        lines = ["", f"The private step's {args.top} largest functions of each phase, by "
                 "opcodes:", "", "| workload | phase | rank | opcodes | function |",
                 "|---|---|---|---|---|"]
        lines += [f"| {f['workload']} | {f['phase']} | {f['rank']} | {f['opcodes']} | "
                  f"{f['function']} |" for f in functions]
        md.write_text(md.read_text() + "\n".join(lines) + "\n")
        data = json.loads(path.read_text())
        data["functions"] = functions
        path.write_text(json.dumps(data, indent=2))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
