"""The FP64 tensor cores' rate per mma shape on this GPU (bench/dmma_rate.cu).

The Gram kernel of the per-sample norms (csrc/clip/gram_f64.cu) multiplied
with ``mma.m8n8k4.f64``, the only f64 shape before sm_90, when the H200 run of
2026-11-30 measured it at 16.8 TFLOP/s with one block on each of 96 SMs, 34% of
an SM's share of the 67 TFLOP/s peak; sm_90 added m16n8k4, m16n8k8 and
m16n8k16, and the kernel now takes m16n8k4 there (the same products in half
the mma instructions, no more registers).  This probe says what the shape is
worth: register operands only, independent chains, 1 to 4 blocks of 8 warps an
SM, each shape's TFLOP/s and its ratio to m8n8k4's at the same occupancy.  If
m16n8k4 issues the products markedly faster than m8n8k4, the move paid; if
k8 or k16 is faster still, the next step is theirs (more fragment registers);
if none is, the kernel's staging (shared memory, barriers) holds it back.

    python bench/dmma_rate.py [--out bench/results] [--iters N]
    python bench/dmma_rate.py --compile-only --arch 90     # nvcc only (CI)

writes ``dmma_rate-gpu-<date>.{json,md}``.  ``make gpu-check`` runs it after
the step profile; tests/test_dmma_rate.py compiles it in CI.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
SOURCE = BENCH / "dmma_rate.cu"
# An SM's share of the H100/H200 SXM FP64 tensor-core peak (67 TFLOP/s over
# 132 SMs, the vendor's figure): the table's reference line, not a measurement.
VENDOR_PEAK_TFLOPS = 67.0


def nvcc() -> str | None:
    """The CUDA compiler the package's build would find (CMakeLists.txt: CUDACXX,
    PATH, /usr/local/cuda)."""
    for candidate in (os.environ.get("CUDACXX"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if candidate and Path(candidate).exists():
            return candidate
    return None


def compile_probe(arch: str, workdir: Path) -> Path:
    """The probe's executable for compute capability ``arch`` ("90", "80")."""
    compiler = nvcc()
    if compiler is None:
        raise RuntimeError("nvcc not found (CUDACXX, PATH, /usr/local/cuda/bin)")
    exe = workdir / "dmma_rate"
    cmd = [compiler, "-O3", "-std=c++17", f"-gencode=arch=compute_{arch},code=sm_{arch}",
           "-o", str(exe), str(SOURCE)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"nvcc failed ({' '.join(cmd)}):\n{proc.stderr[-3000:]}")
    return exe


def parse(lines):
    """(device info, rows) from the probe's JSON lines: each row's TFLOP/s and
    its ratio to m8n8k4's at the same blocks an SM."""
    info, rows = {}, []
    for line in lines:
        rec = json.loads(line)
        if "shape" not in rec:
            info.update(rec)
            continue
        rec["tflops"] = rec["flops"] / (rec["ms"] * 1e-3) / 1e12
        rows.append(rec)
    base = {r["blocks_per_sm"]: r["tflops"] for r in rows if r["shape"] == "m8n8k4"}
    for r in rows:
        r["x_m8n8k4"] = r["tflops"] / base[r["blocks_per_sm"]]
        r["of_vendor_peak"] = r["tflops"] / VENDOR_PEAK_TFLOPS
    return info, rows


def run(out: str, iters: int) -> list[dict]:
    import torch

    from report import run_meta

    from ncdp_fast._report import write_report
    major, minor = torch.cuda.get_device_capability()
    with tempfile.TemporaryDirectory() as tmp:
        exe = compile_probe(f"{major}{minor}", Path(tmp))
        proc = subprocess.run([str(exe), str(iters)], capture_output=True, text=True,
                              timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"dmma_rate failed:\n{proc.stderr[-3000:]}")
    info, rows = parse(proc.stdout.splitlines())
    meta = dict(run_meta("cuda", "full", 1), probe=info, iters=iters)
    write_report("dmma_rate", out, meta, rows,
                 [("shape", "mma shape", None), ("blocks_per_sm", "blocks an SM", None),
                  ("warps_per_sm", "warps an SM", None), ("ms", "ms", "{:.3f}"),
                  ("tflops", "TFLOP/s", "{:.2f}"), ("x_m8n8k4", "× m8n8k4", "{:.2f}"),
                  ("of_vendor_peak", f"of {VENDOR_PEAK_TFLOPS:g} TFLOP/s", "{:.2f}")],
                 notes=[f"{info.get('sms', '?')} SMs, compute capability "
                        f"{info.get('compute_capability', '?')}; register operands only, "
                        "independent accumulator chains (8 of m8n8k4, 4 of m16n8), blocks of "
                        "8 warps, one timed launch after a warm-up of a tenth of it",
                        "the Gram kernel (csrc/clip/gram_f64.cu) uses m8n8k4; sm_90 added the "
                        "m16n8 shapes (none below it)",
                        f"{VENDOR_PEAK_TFLOPS:g} TFLOP/s: the vendor's FP64 tensor-core peak of "
                        "an H100/H200 SXM, a reference line, not a measurement"])
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(BENCH / "results"))
    # 1000 rounds: a launch of one block an SM does 4.3 TFLOP, some 0.1 s at
    # the kernel's measured rate; the 16 launches and their warm-ups take seconds.
    ap.add_argument("--iters", type=int, default=1000)
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--arch", default=None, help="compute capability for --compile-only, e.g. 90")
    args = ap.parse_args(argv)
    if args.iters < 40:
        ap.error(f"--iters: expected at least 40 (a tenth warms up), got {args.iters}")
    if args.compile_only:
        if not args.arch or not args.arch.isdigit():
            ap.error(f"--arch: expected a compute capability such as 90, got {args.arch!r}")
        with tempfile.TemporaryDirectory() as tmp:
            exe = compile_probe(args.arch, Path(tmp))
            print(f"dmma_rate: compiled {exe.name} for sm_{args.arch}")
        return 0
    from _common import cuda_missing
    why = cuda_missing()
    if why:
        print(f"dmma_rate.py: {why}", file=sys.stderr)
        return 2
    run(args.out, args.iters)
    return 0


if __name__ == "__main__":
    sys.exit(main())
