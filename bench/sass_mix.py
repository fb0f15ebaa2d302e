"""The normals' instruction mix on their common path, from the sm_90 SASS
(``cuobjdump``), and the time it predicts for bench_noise's 2^24 normals on an
H200: no GPU needed, nvcc and cuobjdump are.

Every noise kernel (the fill, the finishes, the dense clip's) spends its time
in ``philox::normals_of_block``: a Philox block's four normals, two main and
companion blocks, two logarithms, square roots, sines and cosines in strict
float64. A probe kernel that does only that, one thread a block, is compiled
with the extension's flags; the common path is its main body up to the exit,
less every region a predicated forward branch skips (the deep block of a pair
with a < 2^21, probability 2^-11, and the division's and square root's slow
paths): what a warp issues for four normals almost always.

The model: a warp's instruction takes one issue cycle of its sub-partition
(4 an SM); a float64 add, multiply or FMA 2 cycles of the sub-partition's 16
float64 lanes; a conversion to or from 64 bits 8 (16 an SM a cycle, the CUDA
guide's sm_90 table). Each bound is the pipe's cycles for 2^22 threads over
132 SMs at 1.98 GHz. The 12eb27d run measured 161.1 us for 2^24 normals added
(bench_noise, one H200), 2.13x its own issue bound: so the prediction for a
tree is that run's time scaled by its issue count over 12eb27d's, the
efficiency held; the GPU run checks it.

    python bench/sass_mix.py [--baseline 12eb27d] [--out bench/results]

writes ``sass_mix-sm90-<date>.{json,md}``: the baseline tree's row and the
working tree's. tests/test_sass_mix.py runs the parser and the model on fixed
text and the real compile in CI.
"""
from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from ncdp_fast._gpu_check_env import nvcc_path
from ncdp_fast._report import write_report

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from kernel_resources import NVCC_FLAGS, nvcc_version  # noqa: E402  (CMakeLists.txt's codegen flags)

ROOT = BENCH.parent

PROBE = r"""
#include "common/philox.cuh"
extern "C" __global__ void normals_of_block_probe(unsigned long long seed, double* out, long n) {
  const long t = blockIdx.x * static_cast<long>(blockDim.x) + threadIdx.x;
  if (t >= n) return;
  double z[4];
  ncdp::philox::normals_of_block(seed, static_cast<unsigned long long>(t), z);
  for (int q = 0; q < 4; ++q) out[4 * t + q] = z[q];
}
"""

# H200 (SXM): 132 SMs of 4 sub-partitions; 1.98 GHz boost.
SMS, SUB_PARTITIONS, CLOCK_HZ = 132, 4, 1.98e9
FP64_CYCLES, CONVERSION_CYCLES = 2, 8          # a warp instruction's cycles on its pipe
NORMALS = 1 << 24
# bench_noise at 12eb27d (bench/results/bench_noise_12eb27d-gpu-20261201.md):
# ncdp add of 2^24 float32 normals at the table's 104 136 M normals/s.
MEASURED = dict(commit="12eb27d", seconds=NORMALS / 104136.455e6,
                source="bench/results/bench_noise_12eb27d-gpu-20261201.md")

FP64 = ("DADD", "DMUL", "DFMA", "DSETP")
CONVERSIONS = ("I2F", "F2I", "F2F")
LINE = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def find_cuobjdump() -> str | None:
    """cuobjdump on PATH, next to nvcc, or from the nvidia-cuda-cuobjdump wheel
    (with nvdisasm, which it runs, from nvidia-cuda-nvdisasm beside it)."""
    nvcc = nvcc_path()
    candidates = [shutil.which("cuobjdump"),
                  str(Path(nvcc).resolve().with_name("cuobjdump")) if nvcc else None,
                  "/usr/local/cuda/bin/cuobjdump",
                  *sorted(glob.glob(os.path.join(sysconfig.get_paths()["purelib"],
                                                 "nvidia", "cu*", "bin", "cuobjdump")))]
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


def instructions(sass: str) -> list[tuple[int, str, str, str]]:
    """(address, predicate or '', opcode, operands) of each SASS line."""
    return [(int(m[1], 16), (m[2] or "").strip(), m[3], m[4]) for m in LINE.finditer(sass)]


def common_path(sass: str) -> list[str]:
    """Opcodes of the main body up to its first unpredicated EXIT, less every
    range a predicated forward BRA jumps over (the rare paths)."""
    ins = instructions(sass)
    at = {a: i for i, (a, *_) in enumerate(ins)}
    end = next((i for i, x in enumerate(ins) if x[2] == "EXIT" and not x[1]), None)
    if end is None:
        raise ValueError("sass: no unpredicated EXIT (not one kernel's disassembly?)")
    skipped = set()
    for i in range(end):
        _, pred, op, rest = ins[i]
        if op.split(".")[0] == "BRA" and pred:
            target = at.get(int(re.search(r"0x([0-9a-f]+)", rest)[1], 16))
            if target is None or target <= i:
                raise ValueError(f"sass: branch at {ins[i][0]:#x} is not a forward jump")
            skipped.update(range(i + 1, target))
    return [ins[i][2] for i in range(end + 1) if i not in skipped]


def mix(opcodes: list[str]) -> dict:
    base = collections.Counter(o.split(".")[0] for o in opcodes)
    return dict(instructions=len(opcodes),
                fp64=sum(base[k] for k in FP64),
                conversions=sum(1 for o in opcodes if o.startswith(CONVERSIONS)),
                uniform=sum(v for k, v in base.items() if k.startswith("U")),
                umov=base["UMOV"], uldc=base["ULDC"], mufu=base["MUFU"],
                integer=sum(base[k] for k in ("IMAD", "IADD3", "VIADD", "LOP3", "SHF", "LEA")),
                selects=sum(base[k] for k in ("SEL", "FSEL")))


def model(m: dict, normals: int = NORMALS) -> dict:
    """Each pipe's bound, in seconds, for ``normals`` (one thread per four)."""
    warps_per_sub_partition = normals / 4 / 32 / (SMS * SUB_PARTITIONS)
    cycles = dict(issue=m["instructions"], fp64=FP64_CYCLES * m["fp64"],
                  conversion=CONVERSION_CYCLES * m["conversions"])
    out = {f"{k}_bound_us": warps_per_sub_partition * c / CLOCK_HZ * 1e6 for k, c in cycles.items()}
    out["bound_by"] = max(cycles, key=cycles.get)
    return out


def tree_at(commit: str, dst: Path) -> Path:
    """csrc/ of ``commit``, unpacked under ``dst``."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "csrc"],
                             check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dst)], input=archive, check=True)
    return dst / "csrc"


def probe_mix(nvcc: str, cuobjdump: str, csrc: Path, tmp: Path, arch: str = "sm_90") -> dict:
    src, cubin = tmp / "probe.cu", tmp / "probe.cubin"
    src.write_text(PROBE)
    subprocess.run([nvcc, f"-arch={arch}", "-cubin", *NVCC_FLAGS, f"-I{csrc}", str(src),
                    "-o", str(cubin)], check=True, capture_output=True, text=True, timeout=600)
    # cuobjdump runs nvdisasm; the wheels put the two side by side, off PATH.
    env = dict(os.environ, NVDISASM_PATH=str(Path(cuobjdump).parent))
    sass = subprocess.run([cuobjdump, "-sass", str(cubin)], check=True, capture_output=True,
                          text=True, env=env).stdout
    return mix(common_path(sass))


def rows_for(nvcc: str, cuobjdump: str, baseline: str) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        (t / "base").mkdir()
        (t / "work").mkdir()
        for label, csrc, where in ((baseline, tree_at(baseline, t / "base"), t / "base"),
                                   ("working tree", ROOT / "csrc", t / "work")):
            rows.append(dict(tree=label, **probe_mix(nvcc, cuobjdump, csrc, where)))
    base = rows[0]["instructions"]
    for r in rows:
        r.update(model(r))
        r["predicted_us"] = MEASURED["seconds"] * 1e6 * r["instructions"] / base
        r["predicted_gnormals_s"] = NORMALS / (r["predicted_us"] * 1e-6) / 1e9
    rows[0]["measured_us"] = MEASURED["seconds"] * 1e6 if baseline == MEASURED["commit"] else None
    return rows


def write(rows: list[dict], out_dir: str, nvcc: str) -> Path:
    meta = dict(device="sm_90 (compiled, no GPU: cuobjdump -sass)", device_tag="sm90",
                nvcc=nvcc_version(nvcc), nvcc_flags=" ".join(NVCC_FLAGS),
                model=dict(sms=SMS, sub_partitions=SUB_PARTITIONS, clock_hz=CLOCK_HZ,
                           normals=NORMALS, measured=MEASURED))
    cols = [("tree", "tree", None), ("instructions", "instructions", None),
            ("fp64", "float64 ops", None), ("conversions", "conversions", None),
            ("uniform", "uniform", None), ("umov", "UMOV", None), ("uldc", "ULDC", None),
            ("integer", "integer", None), ("selects", "selects", None),
            ("issue_bound_us", "issue bound us", "{:.1f}"),
            ("fp64_bound_us", "float64 bound us", "{:.1f}"),
            ("conversion_bound_us", "conversion bound us", "{:.1f}"),
            ("measured_us", "measured H200 us", "{:.1f}"),
            ("predicted_us", "predicted H200 us", "{:.1f}"),
            ("predicted_gnormals_s", "predicted G normals/s", "{:.0f}")]
    return write_report(
        "sass_mix", out_dir, meta, rows, cols, quiet=True,
        notes=["the common path of a probe kernel that writes one Philox block's four normals "
               "(philox::normals_of_block) a thread: the main body to its exit less every range "
               "a predicated forward branch skips (the deep block, the division's and square "
               "root's slow paths); per thread, so per four normals",
               f"nvcc {meta['nvcc']} `-arch=sm_90 -cubin {' '.join(NVCC_FLAGS)}`, then "
               "`cuobjdump -sass`",
               "bounds: 2^24 normals (2^22 threads) over 132 SMs x 4 sub-partitions at 1.98 GHz; "
               "a warp instruction takes 1 issue cycle, a float64 add/multiply/FMA 2 cycles of the "
               "16 float64 lanes, a 64-bit conversion 8",
               f"predicted: a model, not a measurement: {MEASURED['commit']}'s measured "
               f"{MEASURED['seconds'] * 1e6:.1f} us ({MEASURED['source']}, ncdp add: the table's "
               "104 136 M normals/s) scaled by the tree's instructions over the baseline's (the issue "
               "efficiency held)"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", default=MEASURED["commit"])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args(argv)
    nvcc, cuobjdump = nvcc_path(), find_cuobjdump()
    if nvcc is None or cuobjdump is None:
        print(f"sass_mix: {'nvcc' if nvcc is None else 'cuobjdump'} not found", file=sys.stderr)
        return 1
    path = write(rows_for(nvcc, cuobjdump, args.baseline), args.out, nvcc)
    print(path.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
