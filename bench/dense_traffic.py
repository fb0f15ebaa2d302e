"""Bytes the CUDA dense clip op (``launch_clip_noise_rows``, csrc/clip/clip_noise.cu)
moves per byte of its input, derived from the kernels' code -- not measured
(no GPU yet): every global load and store each kernel issues, L2 hits counted
as accesses, for B rows of p elements of ``itemsize`` bytes on an H100 (50 MiB
of L2, 132 SMs).

    python bench/dense_traffic.py

prints the table of docs/architecture.md, "Dense slab partials (derived
traffic)". The sizing rules are restated from clip_noise.cu (kColumnsPerThread,
kRowSumTargetThreads, kRowSumMinRowsPerSlab, kNormSegment, the L2/2 chunks).
"""
from __future__ import annotations

H100_L2_BYTES = 50 * 2**20
TARGET_THREADS = 132 * 2048 * 4   # kRowSumTargetThreads
MIN_ROWS_PER_SLAB = 8
NORM_SEGMENT = 4096


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def slabs(B: int, p: int) -> int:
    """weighted_row_sum_slabs."""
    column_threads = _ceil_div(_ceil_div(p, 4), 256) * 256
    return max(1, min(_ceil_div(TARGET_THREADS, column_threads), _ceil_div(B, MIN_ROWS_PER_SLAB),
                      65535))


def traffic(B: int, p: int, itemsize: int, partial_bytes: int = 8) -> dict:
    """Bytes per input byte: in total, and of the slab partials alone."""
    data = B * p * itemsize
    chunk = max(1, (H100_L2_BYTES // 2) // (p * itemsize))
    chunks = _ceil_div(B, chunk)
    segments = max(1, _ceil_div(p, NORM_SEGMENT))
    s = slabs(B, p)
    slab_bytes = s * p * partial_bytes
    # Each chunk writes the partials, every chunk after the first reads them
    # first (accumulate), and the final pass reads them once.
    partials = chunks * slab_bytes + (chunks - 1) * slab_bytes + slab_bytes
    total = (2 * data                      # norms pass + weighted-sum pass over the rows
             + B * segments * 8 * 2       # squared-norm segments: written, read
             + B * 8 * 2 + B * 8          # factors and norms written, factors read
             + partials + p * itemsize)   # output
    return dict(B=B, p=p, itemsize=itemsize, slabs=s, chunks=chunks,
                per_input_byte=total / data, partials_per_input_byte=partials / data)


SHAPES = [(64, 1_000_000), (256, 1_000_000), (1024, 100_000), (4096, 4096), (65536, 512)]


def main() -> None:
    print("| B | p | slabs | chunks (fp32) | fp32: total / partials | fp32 with fp32 partials "
          "| fp64: total / partials |")
    print("|---|---|---|---|---|---|---|")
    for B, p in SHAPES:
        f32, f32p, f64 = traffic(B, p, 4), traffic(B, p, 4, 4), traffic(B, p, 8)
        print(f"| {B} | {p} | {f32['slabs']} | {f32['chunks']} | {f32['per_input_byte']:.3f} / "
              f"{f32['partials_per_input_byte']:.3f} | {f32p['per_input_byte']:.3f} / "
              f"{f32p['partials_per_input_byte']:.3f} | {f64['per_input_byte']:.3f} / "
              f"{f64['partials_per_input_byte']:.3f} |")


if __name__ == "__main__":
    main()
