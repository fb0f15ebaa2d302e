"""Registers, spills, shared memory and theoretical occupancy of every CUDA
kernel instantiation at sm_90 (H100), from ``ptxas -v``: no GPU needed.

Each translation unit of csrc/ that the extension builds is compiled to PTX
with the extension's code-generation flags (CMakeLists.txt), the PTX is
assembled by ``ptxas -v``, and each entry's launch block size is read from
its ``.maxntid`` (every kernel carries ``__launch_bounds__`` with the block
size it is launched with). Theoretical occupancy follows the sm_90 limits
below; the first GPU run should confirm it with Nsight Compute's achieved
occupancy.

    python bench/kernel_resources.py [--out bench/results] [--arch sm_90]

writes ``bench/results/kernel_resources-sm90-<date>.{json,md}`` (nvcc version,
commit and date inside). tests/test_kernel_resources.py runs it in CI.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ncdp_fast._gpu_check_env import nvcc_path as find_nvcc
from ncdp_fast._report import write_report

ROOT = Path(__file__).resolve().parent.parent

# sm_90 per-SM limits (CUDA C Programming Guide, "Technical Specifications per
# Compute Capability", 9.0).
REGS_PER_SM = 65536
THREADS_PER_SM = 2048
BLOCKS_PER_SM = 32
WARPS_PER_SM = THREADS_PER_SM // 32
SMEM_PER_SM = 228 * 1024
SMEM_RESERVED_PER_BLOCK = 1024   # the runtime's own shared memory per resident block
REG_ALLOC_UNIT = 256             # registers are granted per warp in units of 256
# The register file is split over the SM's 4 sub-partitions and a warp lives
# on one, so warps fit per partition: 96 registers x 288 threads gives 2 blocks
# (4 x 5 warps), the count ptxas itself aims for at __launch_bounds__(288, 2).
SUB_PARTITIONS = 4

# The flags of CMakeLists.txt that change code generation (-lineinfo does not).
NVCC_FLAGS = ["-O3", "-std=c++17", "--expt-relaxed-constexpr"]


def sources() -> list[Path]:
    """The .cu files CMakeLists.txt builds into the extension."""
    text = (ROOT / "CMakeLists.txt").read_text()
    return [ROOT / s for s in dict.fromkeys(re.findall(r"csrc/[\w/]+\.cu\b", text))]


def max_threads(ptx: str) -> dict[str, int]:
    """Mangled entry name -> the x*y*z of its ``.maxntid``."""
    out = {}
    for m in re.finditer(r"\.entry\s+(\w+)\s*\((.*?)\)\s*((?:\.\w+[^{]*?)*)\{", ptx, re.S):
        n = re.search(r"\.maxntid\s+(\d+)(?:,\s*(\d+))?(?:,\s*(\d+))?", m[3])
        if n:
            out[m[1]] = int(n[1]) * int(n[2] or 1) * int(n[3] or 1)
    return out


def parse_ptxas(log: str) -> dict[str, dict]:
    """Mangled entry name -> registers, stack, spill bytes, static shared memory
    (``ptxas -v``'s lines for each "Compiling entry function")."""
    out, current = {}, None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            current = out.setdefault(m[1], dict(registers=0, stack_bytes=0, spill_store_bytes=0,
                                                spill_load_bytes=0, smem_bytes=0))
            continue
        if current is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
                      line)
        if m:
            current.update(stack_bytes=int(m[1]), spill_store_bytes=int(m[2]),
                           spill_load_bytes=int(m[3]))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            current["registers"] = int(m[1])
            s = re.search(r"(\d+) bytes smem", line)
            current["smem_bytes"] = int(s[1]) if s else 0
            # Properties of callees (__internal_trig_reduction_slowpathd, ...)
            # follow the entry's "Used" line: they are not the entry's.
            current = None
    return out


def occupancy(registers: int, threads: int, smem_bytes: int) -> dict:
    """Resident blocks per SM and theoretical occupancy (resident warps / 64) at
    sm_90, with the resource that limits them."""
    warps = -(-threads // 32)
    regs_per_warp = -(-registers * 32 // REG_ALLOC_UNIT) * REG_ALLOC_UNIT
    limits = {
        "threads": min(BLOCKS_PER_SM, THREADS_PER_SM // (warps * 32)),
        "registers": (SUB_PARTITIONS * (REGS_PER_SM // SUB_PARTITIONS // regs_per_warp) // warps
                      if registers else BLOCKS_PER_SM),
        "shared memory": SMEM_PER_SM // (smem_bytes + SMEM_RESERVED_PER_BLOCK),
    }
    blocks = min(limits.values())
    limiter = min(limits, key=lambda k: (limits[k], k != "threads"))
    return dict(blocks_per_sm=blocks, occupancy=blocks * warps / WARPS_PER_SM,
                limited_by=limiter)


def demangle(names: list[str]) -> dict[str, str]:
    """Readable names, the namespaces of csrc/ dropped."""
    cxxfilt = shutil.which("cu++filt") or shutil.which("c++filt")
    if cxxfilt is None or not names:
        return {n: n for n in names}
    out = subprocess.run([cxxfilt], input="\n".join(names), capture_output=True, text=True,
                         check=True).stdout.splitlines()
    short = [re.sub(r"ncdp::(kernels::)?(\(anonymous namespace\)::)?", "", o) for o in out]
    return dict(zip(names, short))


def compile_unit(nvcc: str, src: Path, arch: str, tmp: Path) -> list[dict]:
    ptx = tmp / f"{src.stem}.ptx"
    subprocess.run([nvcc, f"-arch={arch}", "-ptx", *NVCC_FLAGS, f"-I{ROOT / 'csrc'}", str(src),
                    "-o", str(ptx)], check=True, capture_output=True, text=True)
    ptxas = Path(nvcc).with_name("ptxas")
    log = subprocess.run([str(ptxas) if ptxas.exists() else "ptxas", "-v", f"-arch={arch}",
                          str(ptx), "-o", os.devnull], check=True, capture_output=True,
                         text=True).stderr
    text = ptx.read_text()
    threads = max_threads(text)
    rows = []
    for name, res in parse_ptxas(log).items():
        if name not in threads:
            raise RuntimeError(f"{src.name}: kernel {name} has no .maxntid (__launch_bounds__): "
                               "its launch block size, and so its occupancy, is unknown")
        rows.append(dict(unit=str(src.relative_to(ROOT)), mangled=name, threads=threads[name],
                         **res, **occupancy(res["registers"], threads[name], res["smem_bytes"])))
    return rows


def collect(nvcc: str, arch: str = "sm_90", units: list[Path] | None = None) -> list[dict]:
    """One row per kernel instantiation of ``units`` (default: every .cu of the
    extension), compiled two at a time (the units are independent)."""
    with tempfile.TemporaryDirectory() as tmp:
        with ThreadPoolExecutor(max_workers=2) as pool:
            parts = list(pool.map(lambda s: compile_unit(nvcc, s, arch, Path(tmp)),
                                  units or sources()))
    rows = [r for part in parts for r in part]
    names = demangle([r["mangled"] for r in rows])
    for r in rows:
        r["kernel"] = names[r["mangled"]]
    return sorted(rows, key=lambda r: (r["unit"], r["kernel"]))


def nvcc_version(nvcc: str) -> str:
    text = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"release ([\d.]+), (V[\d.]+)", text)
    return f"{m[1]} ({m[2]})" if m else text.strip().splitlines()[-1]


def write(rows: list[dict], out_dir: str, nvcc: str, arch: str) -> Path:
    spilled = [r["kernel"] for r in rows if r["spill_store_bytes"] or r["spill_load_bytes"]]
    meta = dict(device=f"{arch} (compiled, no GPU: ptxas -v)", device_tag=arch.replace("_", ""),
                nvcc=nvcc_version(nvcc), nvcc_flags=" ".join(NVCC_FLAGS), arch=arch)
    return write_report(
        "kernel_resources", out_dir, meta, rows,
        [("kernel", "kernel", None), ("unit", "unit", None), ("threads", "threads", None),
         ("registers", "regs", None), ("spill_store_bytes", "spill st B", None),
         ("spill_load_bytes", "spill ld B", None), ("stack_bytes", "stack B", None),
         ("smem_bytes", "smem B", None), ("blocks_per_sm", "blocks/SM", None),
         ("occupancy", "occupancy", "{:.0%}"), ("limited_by", "limited by", None)],
        notes=[f"nvcc {meta['nvcc']}, `-arch={arch} -ptx {' '.join(NVCC_FLAGS)}` then "
               "`ptxas -v`; threads: the kernel's __launch_bounds__ (.maxntid)",
               "occupancy: theoretical, resident warps / 64 from 65536 registers (4 "
               "sub-partitions of 16384, granted per warp in units of 256), 2048 threads, 32 blocks and 228 KiB shared memory "
               "(+1 KiB reserved per block) per SM; to be confirmed on the first GPU run "
               "(Nsight Compute, achieved occupancy)",
               "kernels with spills: " + (", ".join(spilled) or "none")],
        quiet=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--arch", default="sm_90")
    args = ap.parse_args(argv)
    nvcc = find_nvcc()
    if nvcc is None:
        print("kernel_resources: nvcc not found (CUDACXX, PATH, /usr/local/cuda/bin)",
              file=sys.stderr)
        return 1
    path = write(collect(nvcc, args.arch), args.out, nvcc, args.arch)
    print(path.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
