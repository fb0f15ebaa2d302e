"""Bytes the CUDA dense clip op (``launch_clip_noise_rows``, csrc/clip/clip_noise.cu)
moves per byte of its input, derived from the kernels' code -- not measured:
every global load and store each kernel issues, L2 hits counted as accesses,
the DRAM bytes expected of them, and a predicted time, for B rows of p
elements of ``itemsize`` bytes on an H100/H200 (50 MiB of L2, 132 SMs).

    python bench/dense_traffic.py

prints the tables of docs/architecture.md, "Dense slab partials (derived
traffic)" and "The dense op in one pass". The sizing rules are restated from
clip_noise.cu (kColumnsPerThread, kRowSumTargetThreads, kRowSumMinRowsPerSlab,
kDenseNormSegment, the L2/2 chunks, the L2/4 partials) and dense_one_pass.cu
(plan_clip_noise_rows_one_pass).
"""
from __future__ import annotations

H100_L2_BYTES = 50 * 2**20     # H100 and H200 (the same GH100 L2)
TARGET_THREADS = 132 * 2048 * 4   # kRowSumTargetThreads
MIN_ROWS_PER_SLAB = 8
NORM_SEGMENT = 4096
# The first GPU run's read limit (torch.sum of the (1024, 409600) float32 array
# on the H200, bench_clip_dense) and the launch cost of bench/report.py's model.
READ_BYTES_PER_S = 4.006e12
LAUNCH_S = 5e-6


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def slabs(B: int, p: int) -> int:
    """weighted_row_sum_slabs."""
    column_threads = _ceil_div(_ceil_div(p, 4), 256) * 256
    return max(1, min(_ceil_div(TARGET_THREADS, column_threads), _ceil_div(B, MIN_ROWS_PER_SLAB),
                      65535))


def chunk_slabs(B: int, p: int, itemsize: int, partial_bytes: int = 8,
                l2: int = H100_L2_BYTES) -> tuple:
    """(chunk rows, chunks, slabs) of launch_clip_noise_rows: chunks of half the
    L2 (``l2`` 0: one chunk); with more than one chunk the slabs' partials must
    fit a quarter of it."""
    chunk = max(1, (l2 // 2) // (p * itemsize)) if l2 > 0 else max(B, 1)
    chunks = _ceil_div(B, chunk)
    s = slabs(B, p)
    if chunks > 1:
        s = max(1, min(s, (l2 // 4) // (p * partial_bytes)))
    return chunk, chunks, s


def traffic(B: int, p: int, itemsize: int, partial_bytes: int = 8,
            l2: int = H100_L2_BYTES) -> dict:
    """Bytes per input byte: every access (L2 hits counted), the partials' share,
    and the DRAM bytes expected (a chunk's weighted pass and the partials hit the
    L2 they were sized for; the first touch of each row and the final pass's
    read of the partials do not); and the predicted seconds: DRAM bytes at the
    measured read limit plus :data:`LAUNCH_S` for each of the 3 launches a chunk
    and the final pass."""
    data = B * p * itemsize
    chunk, chunks, s = chunk_slabs(B, p, itemsize, partial_bytes, l2)
    segments = max(1, _ceil_div(p, NORM_SEGMENT))
    slab_bytes = s * p * partial_bytes
    # Each chunk writes the partials, every chunk after the first reads them
    # first (accumulate), and the final pass reads them once.
    partials = chunks * slab_bytes + (chunks - 1) * slab_bytes + slab_bytes
    small = B * segments * 8 * 2 + B * 8 * 3 + p * itemsize   # segments, factors, output
    total = 2 * data + small + partials
    resident = min(chunk, B) * p * itemsize <= H100_L2_BYTES // 2
    # Partials kept in the L2 across chunks reach DRAM once (the final pass's
    # read); otherwise every access does.
    fits = chunks > 1 and slab_bytes <= H100_L2_BYTES // 4
    dram = data * (1 if resident else 2) + small + (slab_bytes if fits else partials)
    seconds = dram / READ_BYTES_PER_S + (3 * chunks + 1) * LAUNCH_S
    return dict(B=B, p=p, itemsize=itemsize, slabs=s, chunks=chunks,
                per_input_byte=total / data, partials_per_input_byte=partials / data,
                dram_per_input_byte=dram / data, predicted_s=seconds,
                predicted_frac_of_read=data / READ_BYTES_PER_S / seconds)


# The one-pass form (csrc/clip/dense_one_pass.cu): its plan restated, and the
# L2's read rate it leans on, assumed.  The H200 (2026-11-30) measured the
# kernel at 1.662 ms where this model says 0.509 ms at (1024, 409600), and
# bench_clip_dense's "l2_torch_sum" row (torch.sum over a 16 MB slice read 64
# times) at 2.67 TB/s: the model's premise, a second read served by the L2
# at this rate, did not hold.
ONE_PASS_MAX_COLUMNS = 256 * 4 * 4
ONE_PASS_MIN_COLUMNS = 256 * 4
ONE_PASS_MAX_ROWS = 32
ONE_PASS_L2_SHARE = 16
ONE_PASS_SEGMENTS_PER_ITEM = 4
ONE_PASS_RESIDENT_BLOCKS = 132 * 2     # 128 registers x 256 threads: 2 blocks an SM (ptxas)
L2_BYTES_PER_S = 7e12                  # assumed
TICKET_S = 1e-9                        # assumed: one ticket an L2 atomic's turn on one address


def one_pass_plan(B: int, p: int, itemsize: int, l2: int = H100_L2_BYTES,
                  blocks: int = ONE_PASS_RESIDENT_BLOCKS):
    """plan_clip_noise_rows_one_pass: (blocks, columns, rows, row blocks,
    segments, items), or None where the rows are too wide for the grid (over 4096
    columns a block) or too narrow for it (fewer than half its blocks)."""
    if B <= 0 or p <= 0:
        return None
    wanted, blocks = blocks, min(blocks, _ceil_div(p, ONE_PASS_MIN_COLUMNS))
    if 2 * blocks < wanted:
        return None
    columns = _ceil_div(_ceil_div(p, blocks), 4) * 4
    if columns > ONE_PASS_MAX_COLUMNS:
        return None
    rows = max(1, min(ONE_PASS_MAX_ROWS, B, l2 // (ONE_PASS_L2_SHARE * p * itemsize)))
    segments = max(1, _ceil_div(p, NORM_SEGMENT))
    return (_ceil_div(p, columns), columns, rows, _ceil_div(B, rows), segments,
            _ceil_div(segments, ONE_PASS_SEGMENTS_PER_ITEM))


def one_pass(B: int, p: int, itemsize: int, l2: int = H100_L2_BYTES,
             l2_bytes_per_s: float = L2_BYTES_PER_S) -> dict | None:
    """The one-pass form's bytes per input byte and predicted seconds: the
    gradients cross DRAM once (a row block, at most 1/16 of the L2, is read
    again by the column blocks while about two more pass through the L2: the
    grid's norm items in flight), every row crosses the L2 twice, the norm
    partials, factors and float64 sums are small; the predicted time is the
    slower of DRAM at the measured read limit and the L2 at ``l2_bytes_per_s``,
    plus the ticket hand-outs one after another and 3 launches (flags, the
    kernel, the finish)."""
    plan = one_pass_plan(B, p, itemsize, l2)
    if plan is None:
        return None
    _, _, _, row_blocks, segments, items = plan
    data = B * p * itemsize
    small = B * segments * 8 * 2 + B * 8 * 3 + p * 8 * 2 + p * itemsize
    dram = data + small
    l2_reads = 2 * data + small
    seconds = (max(dram / READ_BYTES_PER_S, l2_reads / l2_bytes_per_s)
               + row_blocks * items * TICKET_S + 3 * LAUNCH_S)
    return dict(plan=plan, dram_per_input_byte=dram / data, l2_per_input_byte=l2_reads / data,
                predicted_s=seconds, predicted_frac_of_read=data / READ_BYTES_PER_S / seconds)


# Two readings of the one-pass kernel's measured time that predict differently
# for larger row blocks (bench_clip_dense's "ncdp_one_pass_rows8" times the
# kernel with 8-row blocks; a GPU run decides):
# - chain: each block walks the row blocks in a chain of dependent round trips
#   (the ready flag, the factors, then the rows' loads), a fixed latency a row
#   block, fitted as the measured time less the bandwidth model above, over the
#   512 row blocks of the measured plan; fewer, larger row blocks shorten it;
# - L2 rate: no chain, the second read served by the L2 at the rate
#   "l2_torch_sum" measured in the same run (not fitted: 1.288 ms at the
#   measured shape, 22% under the measurement); the row blocks' size does not
#   matter while they fit the L2.
MEASURED_ONE_PASS = (1024, 409_600, 4, 1.662e-3)   # (B, p, itemsize, s): H200, 2026-11-30
MEASURED_L2_BYTES_PER_S = 2.67e12                   # l2_torch_sum, the same run


def one_pass_l2_for_rows(p: int, itemsize: int, rows: int) -> int:
    """The launcher's ``l2_bytes`` at which the plan takes ``rows`` rows a row
    block (capped at ONE_PASS_MAX_ROWS and B): the plan's rows are
    l2 // (ONE_PASS_L2_SHARE * row bytes)."""
    return rows * ONE_PASS_L2_SHARE * p * itemsize


def chain_step_s() -> float:
    """The chain reading's latency a row block, fitted to MEASURED_ONE_PASS."""
    B, p, itemsize, measured = MEASURED_ONE_PASS
    model = one_pass(B, p, itemsize)
    return (measured - model["predicted_s"]) / model["plan"][3]


def one_pass_readings(B: int, p: int, itemsize: int, rows: int | None = None) -> dict | None:
    """Both readings' predicted seconds for the one-pass kernel, with the
    device's L2 (``rows`` None) or ``rows``-row blocks: ``chain_s`` (the
    bandwidth model plus a fitted latency a row block) and ``l2_rate_s`` (the
    bandwidth model at the measured L2 rate); None where the plan declines."""
    l2 = H100_L2_BYTES if rows is None else one_pass_l2_for_rows(p, itemsize, rows)
    base = one_pass(B, p, itemsize, l2)
    if base is None:
        return None
    slow_l2 = one_pass(B, p, itemsize, l2, l2_bytes_per_s=MEASURED_L2_BYTES_PER_S)
    return dict(plan=base["plan"], chain_s=base["predicted_s"] + base["plan"][3] * chain_step_s(),
                l2_rate_s=slow_l2["predicted_s"])


SHAPES = [(64, 1_000_000), (256, 1_000_000), (1024, 100_000), (1024, 409_600), (512, 7680),
          (4096, 4096), (65536, 512)]


def main() -> None:
    print("| B | p | slabs | chunks (fp32) | fp32: accesses / partials | fp32: DRAM "
          "| fp32: predicted H200 ms | fraction of read limit | one chunk: DRAM / ms "
          "| fp64: accesses / partials |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for B, p in SHAPES:
        f32, f64, one = traffic(B, p, 4), traffic(B, p, 8), traffic(B, p, 4, l2=0)
        print(f"| {B} | {p} | {f32['slabs']} | {f32['chunks']} | {f32['per_input_byte']:.3f} / "
              f"{f32['partials_per_input_byte']:.3f} | {f32['dram_per_input_byte']:.3f} | "
              f"{1e3 * f32['predicted_s']:.3f} | {f32['predicted_frac_of_read']:.2f} | "
              f"{one['dram_per_input_byte']:.3f} / {1e3 * one['predicted_s']:.3f} | "
              f"{f64['per_input_byte']:.3f} / {f64['partials_per_input_byte']:.3f} |")
    print()
    print("| B | p | one pass (fp32): blocks, columns, rows, row blocks, segments, items "
          "| DRAM / L2 "
          "bytes per input byte | predicted H200 ms at L2 5.5 / 7 / 10 TB/s | fraction of read "
          "limit at 7 TB/s |")
    print("|---|---|---|---|---|---|")
    for B, p in SHAPES:
        runs = [one_pass(B, p, 4, l2_bytes_per_s=r) for r in (5.5e12, 7e12, 10e12)]
        if runs[0] is None:
            print(f"| {B} | {p} | too wide or too narrow for the grid: two passes | | | |")
            continue
        ms = " / ".join(f"{1e3 * r['predicted_s']:.3f}" for r in runs)
        print(f"| {B} | {p} | {runs[1]['plan']} | {runs[1]['dram_per_input_byte']:.3f} / "
              f"{runs[1]['l2_per_input_byte']:.3f} | {ms} | "
              f"{runs[1]['predicted_frac_of_read']:.2f} |")
    print()
    print(f"| B | p | one pass (fp32), predicted H200 ms by two readings of the "
          f"{1e3 * MEASURED_ONE_PASS[3]:.3f} ms measured at {MEASURED_ONE_PASS[:2]}: chain "
          f"(fitted: {1e6 * chain_step_s():.2f} us a row block) / L2 rate "
          f"({MEASURED_L2_BYTES_PER_S / 1e12:.2f} TB/s, measured) | 8-row blocks |")
    print("|---|---|---|---|")
    for B, p in SHAPES:
        now, eight = one_pass_readings(B, p, 4), one_pass_readings(B, p, 4, rows=8)
        if now is None:
            continue
        print(f"| {B} | {p} | {1e3 * now['chain_s']:.3f} / {1e3 * now['l2_rate_s']:.3f} "
              f"({now['plan'][2]} rows) | {1e3 * eight['chain_s']:.3f} / "
              f"{1e3 * eight['l2_rate_s']:.3f} ({eight['plan'][2]} rows) |")


if __name__ == "__main__":
    main()
