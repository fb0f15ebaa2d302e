"""Where the host's time goes in the benchmarks' steps at their full shapes:
per workload (bench_finetune's linear head and transformer, bench_hf's BERT)
and method (non-private, GhostClipper, PrivacyEngine) the wall ms a step
(the device synchronised at the end of n steps), the process's CPU ms a step
over n steps queued without a synchronisation (a CUDA synchronisation spins,
so a wait counts as CPU time), and cProfile's 28 largest entries by own time
and 45 by cumulative time over n more steps.

    python bench/host_cprofile.py [cuda|cpu] [linear,transformer,bert] [n]

The H200 run of 2026-11-30 (bench/results/host_cprofile_d6134ab-gpu-20261130.txt)
found the small rows' private steps host-bound: the linear head's process CPU
2.15 ms a step (GhostClipper) against 0.51 non-private, with 0.03 ms of extra
kernels (profile_extra of the same run).  On the CPU (NCDP_CUDA_EMULATION=1
for the CUDA route) the shapes are bench_finetune's and bench_hf's quick ones.
"""
from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

METHODS = ("nonprivate", "ncdp_ghost", "ncdp_engine")
WARMUP, TOP_OWN, TOP_CUMULATIVE = 5, 28, 45


def build(name, method, device):
    """The benchmark's step of ``name`` for ``method``, or None (bench_hf has
    no GhostClipper row)."""
    size = "full" if device == "cuda" else "quick"
    if name == "bert":
        import test_bench_hf as hf
        if method == "ncdp_ghost":
            return None
        return hf.build_step(dict(hf.shapes(size, device)["bert"], kind="bert"), method,
                             device)[0]
    import test_bench_finetune as ft
    step = ft.build_step(dict(ft.SHAPES[size][name], kind=name), method, device)
    return step[0] if isinstance(step, tuple) else step


def _table(prof, key, top):
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats(key).print_stats(top)
    text = out.getvalue()
    return text[text.find("ncalls"):]


def profile(step, n, sync):
    """(wall ms a step, process CPU ms a step, cProfile of n steps)."""
    for _ in range(min(n, WARMUP)):
        step()
    sync()
    t = time.perf_counter()
    for _ in range(n):
        step()
    sync()
    wall = (time.perf_counter() - t) / n * 1e3
    c = time.process_time()
    for _ in range(n):
        step()
    cpu = (time.process_time() - c) / n * 1e3
    sync()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        step()
    sync()
    prof.disable()
    return wall, cpu, prof


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    import torch
    device = argv[0] if argv else "cuda"
    names = argv[1].split(",") if len(argv) > 1 else ["linear", "transformer", "bert"]
    steps = int(argv[2]) if len(argv) > 2 else None

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()
    for name in names:
        for method in METHODS:
            step = build(name, method, device)
            if step is None:
                continue
            n = steps or (8 if name == "bert" else 30)
            wall, cpu, prof = profile(step, n, sync)
            print(f"===== {name} {method}: wall {wall:.3f} ms/step, process cpu {cpu:.3f} "
                  f"ms/step (n={n})")
            if method != "nonprivate":
                print(_table(prof, "tottime", TOP_OWN))
                print(_table(prof, "cumtime", TOP_CUMULATIVE))
    return 0


if __name__ == "__main__":
    sys.exit(main())
