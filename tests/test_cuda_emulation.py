"""The CUDA kernels' own source, executed on the CPU (tests/cuda_emu), against
ncdp_fast.reference: the tier that proves the kernels where CI runs.

Every case runs under ThreadSanitizer and under AddressSanitizer +
UndefinedBehaviorSanitizer; a sanitizer report or an emulator abort (barrier
mismatch, deadlock, invalid launch) fails it. The emulation build caps grids at
3 blocks (NCDP_EMU_MAX_GRID_BLOCKS), so the small shapes below also run every
grid-stride loop. Shapes are chosen to reach each code path the issue lists:
multi-chunk dense sums (a small L2 size), several slabs, unaligned bases, mix
rows with more than one 512-member chunk, 1/2/4/8 vectors per thread and the
tiled path, several rows per block, NTK Grams with more than 64 terms and more
than 8 tile rows.

Tolerances: the emulator uses the host's libm, so transcendental results may
differ from NumPy's by a few float64 ulps; sums follow Higham's bound
(conftest.assert_within_sum_bound) with the summation length of the kernel.
"""
from __future__ import annotations

import itertools
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from conftest import first_deep_pair, gamma, unit_roundoff
from test_clip import NORM_AFFINE_SHAPES, assert_norm_affine_close, norm_affine_case
from emulation import BUILD, EMU, VARIANTS, Emulator, Server, build, run_program
from ncdp_fast import reference as R
from ncdp_fast._numba import rng as nrng
from ncdp_fast._mix import _population

pytestmark = pytest.mark.emulation
ROOT_CSRC = EMU.parents[1] / "csrc"

DTYPES = (np.float32, np.float64)
# The emulation build's grid cap (tests/cuda_emu/Makefile).
GRID_CAP = 3
# libm vs NumPy: a few ulps of each float64 transcendental, times the largest
# Box-Muller radius (R.GAUSSIAN_TAIL_BOUND ~ 13.37).
NORMAL_ATOL = 64 * 2.0 ** -52 * R.GAUSSIAN_TAIL_BOUND


@pytest.fixture(scope="module")
def built():
    return build()


@pytest.fixture(params=VARIANTS)
def emu(request, built, tmp_path):
    return Emulator(request.param, tmp_path)


def assert_close(actual, expected, abs_terms, n, sum_dtype, out_dtype, what, atol=0.0):
    """|actual - expected| <= gamma_n(sum_dtype) sum|terms| (a sum of n terms in
    sum_dtype) + one rounding to out_dtype + the float64 reference's own error
    + atol (libm differences of the noise)."""
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    bound = ((gamma(n, sum_dtype) + gamma(n, np.float64)) * np.asarray(abs_terms)
             + unit_roundoff(out_dtype) * np.abs(expected) + atol)
    err = np.abs(actual - expected)
    worst = np.max(err - bound) if err.size else 0.0
    assert worst <= 0, (f"{what}: error exceeds the rounding bound by {worst:.3g} (max err "
                        f"{err.max():.3g}, n={n}, sums in {np.dtype(sum_dtype).name})")


def _dt(dtype):
    return 0 if np.dtype(dtype) == np.float32 else 1


def _misalign(dtype, shift):
    """A base `shift` elements past a 16-byte boundary."""
    return shift * np.dtype(dtype).itemsize


# ---------------------------------------------------------------------------
# Philox normals (rng/gaussian.cu).

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("count,offset", [(1, 0), (7, 3), (3100, 5), (9, 2 ** 34 - 3)])
def test_fill_gaussian(emu, dtype, count, offset):
    # 3100 normals need 776 Philox blocks: more than 3 blocks of 256 threads.
    _check_fill_gaussian(emu, dtype, count, offset)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("parity", [0, 1])
def test_fill_gaussian_deep_pairs(emu, dtype, parity):
    # A pair that reads its deep block (one in 2048) in either half of its main
    # block, with the pairs around it.
    _check_fill_gaussian(emu, dtype, 12, 2 * first_deep_pair(12345, parity) - 5)


def _check_fill_gaussian(emu, dtype, count, offset):
    base = np.linspace(-1, 1, count).astype(dtype)
    # post = 1/8: the finishing step's division by the expected batch size.
    for accumulate, post in ((False, 1.0), (True, 1.0), (True, 0.125)):
        out = emu.run("fill_gaussian", dict(dtype=_dt(dtype), count=count, seed=12345,
                                            offset=offset, scale=0.5, post=post,
                                            accumulate=accumulate),
                      {"out": base.copy()})["out"]
        z = R.gaussian(count, seed=12345, offset=offset, dtype=np.float64)
        expected = post * (0.5 * z + (base.astype(np.float64) if accumulate else 0.0))
        tol = unit_roundoff(dtype) * np.abs(expected) + NORMAL_ATOL
        assert np.all(np.abs(out - expected) <= tol), (count, offset, accumulate)
        # The numba twin's bits: the same log, sin, cos and finish, operation
        # for operation (csrc/common/philox.cuh, "The normals").
        twin = base.copy()
        nrng.add_gaussian(twin, np.uint64(12345), np.uint64(offset), 0.5, accumulate, post)
        assert _same_bits(out, twin), (count, offset, accumulate)


def _same_bits(x, y):
    return x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes()


# (src dtype, dst dtype, size, offset) of the segments of one finish launch:
# every phase of the offset mod 4, one- to five-value segments, an empty one
# between others, a float64 sum finishing into float32, a deep pair, a range
# past 2^34, and 3100 values (776 Philox blocks: the grid-stride loop beyond
# the emulation's 3 blocks of 256 threads).
SEGMENTS = [
    (np.float32, np.float32, 1, 0), (np.float64, np.float64, 2, 1),
    (np.float64, np.float32, 3, 6), (np.float32, np.float32, 0, 11),
    (np.float32, np.float32, 5, 11), (np.float64, np.float32, 13, 2 ** 34 - 3),
    (np.float64, np.float64, 3100, 5), (np.float32, np.float32, 12, "deep"),
    (np.float64, np.float32, 4, 19),
]


def _segment_types(src, dst):
    src, dst = np.dtype(src), np.dtype(dst)
    return 0 if dst == src == np.float32 else (1 if dst == src else 2)


@pytest.mark.parametrize("scale,post", [(0.5, 0.125), (0.0, 1.0)])
def test_finish_gaussian_segments(emu, scale, post):
    seed = 12345
    scalars, buffers, srcs = dict(S=len(SEGMENTS), seed=seed, scale=scale, post=post), {}, []
    for s, (src_dt, dst_dt, size, offset) in enumerate(SEGMENTS):
        if offset == "deep":
            offset = 2 * first_deep_pair(seed, 1) - 5
        src = np.linspace(-1, 1, size).astype(src_dt) * (s + 1)
        srcs.append((src, offset, dst_dt))
        scalars.update({f"types{s}": _segment_types(src_dt, dst_dt), f"size{s}": size,
                        f"offset{s}": offset})
        if np.dtype(src_dt) == np.dtype(dst_dt):
            buffers[f"dst{s}"] = src.copy()                 # in place
        else:
            buffers[f"src{s}"] = src
            buffers[f"dst{s}"] = np.full(size, np.nan, dst_dt)
    out = emu.run("finish_gaussian_segments", scalars, buffers)
    expected = R.finish_gaussian_segments([(src, off) for src, off, _ in srcs], seed=seed,
                                          scale=scale, post=post)
    for s, ((src, offset, dst_dt), want) in enumerate(zip(srcs, expected)):
        got = out[f"dst{s}"]
        assert got.dtype == np.dtype(dst_dt) and got.shape == src.shape
        if f"src{s}" in out:
            assert np.array_equal(out[f"src{s}"], src), "the float64 source was written"
        tol = unit_roundoff(dst_dt) * np.abs(want) + NORMAL_ATOL
        assert np.all(np.abs(got - want) <= tol), (s, offset)
        # Bit for bit the single-segment finish of the same range: fill_gaussian
        # accumulating into the source, rounded once to the output.
        if src.size:
            one = emu.run("fill_gaussian", dict(dtype=_dt(src.dtype), count=src.size, seed=seed,
                                                offset=offset, scale=scale, post=post,
                                                accumulate=True), {"out": src.copy()})["out"]
            assert np.array_equal(got, one.astype(dst_dt)), (s, offset)
    # The numba twin's finishes, bit for bit.
    twins = [(np.array(src, dtype=dst_dt) if np.dtype(src.dtype) == np.dtype(dst_dt)
              else np.full(src.size, np.nan, dst_dt), src, offset) for src, offset, dst_dt in srcs]
    nrng.finish_gaussian_segments([(d, d if np.dtype(src.dtype) == d.dtype else src, off)
                                   for d, src, off in twins], np.uint64(seed), scale, post)
    for s, (dst, _, _) in enumerate(twins):
        assert _same_bits(out[f"dst{s}"], dst), s


# ---------------------------------------------------------------------------
# Dense clipping (clip/clip_noise.cu).

def _dense_case(B, p, dtype, seed):
    rng = np.random.default_rng(seed)
    g = rng.standard_normal((B, p)) * rng.uniform(0.1, 3.0, size=(B, 1))
    return g.astype(dtype)


def _expected_dense(g, max_norm, noise_std, inv_denom, seed, offset, factors=None):
    g64 = g.astype(np.float64)
    sq = (g64 * g64).sum(axis=1)
    if factors is None:
        factors, _ = R.clip_factors(sq, max_norm, unit=unit_roundoff(g.dtype), terms=g.shape[1])
    z = R.gaussian(g.shape[1], seed=seed, offset=offset, dtype=np.float64)
    kept = np.where(factors[:, None] != 0, factors[:, None] * np.nan_to_num(g64), 0.0)
    total = kept.sum(axis=0) + noise_std * z
    return inv_denom * total, inv_denom * np.abs(kept).sum(axis=0), sq, factors


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,p,shift,l2_rows", [
    (1, 1, 0, 0),        # one row, one column
    (3, 5, 1, 0),        # p not a multiple of the vector width, unaligned base
    (40, 8, 0, 0),       # aligned vector loads, several slabs, grid-striding norms
    (40, 8, 1, 4),       # unaligned base; chunks of 4 rows accumulate into one slab (the
                         # partials must fit a quarter of the L2 beside the chunk)
    (40, 8, 0, 12),      # chunks of 12 rows, 3 (float32) or 5 (float64) slabs each
    (5, 4097, 0, 2),     # two norm segments per row; one-row chunks
    (0, 6, 0, 0),        # no rows: pure noise
    (3, 0, 0, 0),        # no columns
])
def test_clip_noise_rows(emu, dtype, B, p, shift, l2_rows):
    g = _dense_case(B, p, dtype, seed=B * 1000 + p)
    C, noise_std, inv_denom, seed, offset = 2.0, 0.7, 1.0 / 3.0, 99, 17
    # l2_bytes = 2 * chunk_rows * row_bytes: the launcher takes half the L2 per chunk.
    l2 = 2 * l2_rows * p * np.dtype(dtype).itemsize
    res = emu.run("clip_noise_rows",
                  dict(dtype=_dt(dtype), B=B, p=p, max_norm=C, noise_std=noise_std,
                       inv_denom=inv_denom, seed=seed, offset=offset, l2_bytes=l2,
                       one_pass_blocks=0),
                  {"grads": g, "out": np.zeros(p, dtype), "norms": np.zeros(B)},
                  misalign={"grads": _misalign(dtype, shift)})
    expected, scale, sq, _ = _expected_dense(g, C, noise_std, inv_denom, seed, offset)
    # Norms: float64 sums of p squares, then a square root (one more rounding).
    assert_close(res["norms"] ** 2, sq, sq, p + 3, np.float64, np.float64, "norms")
    # Output: float64 sums of B clipped rows (factor and product in float64), the
    # slab sum, noise and scaling in float64, one rounding to the dtype.
    assert_close(res["out"], expected, scale, B + 4, np.float64, dtype, "out",
                 atol=inv_denom * noise_std * NORMAL_ATOL)


# The one-pass form (clip/dense_one_pass.cu): (B, p, base shift, blocks, rows
# per row block, NaN rows).  Rows per row block are set through the L2 size
# it is given (a row block is at most 1/16 of it).
ONE_PASS_CASES = [
    (1, 1, 0, 1, 1, ()),          # one row, one column, one block
    (3, 5, 1, 1, 2, ()),          # p not a multiple of the vector width, unaligned base
    (7, 2100, 0, 3, 2, ()),       # three column blocks, a last row block of one row
    (5, 4097, 0, 2, 2, ()),       # two norm segments a row, the second of one column
    (9, 4100, 1, 3, 4, (2, 7)),   # unaligned, 4-row groups with a partial last; NaN rows
    (12, 3000, 0, 3, 32, ()),     # one row block (rows capped at B)
    (6, 2049, 0, 2, 1, ()),       # one row a row block; a last block of one group
    (3, 20000, 1, 5, 2, (1,)),    # five segments a row: two norm items a row block (4 + 1)
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,p,shift,blocks,rows,nan_rows", ONE_PASS_CASES)
def test_clip_noise_rows_one_pass(emu, dtype, B, p, shift, blocks, rows, nan_rows):
    g = _dense_case(B, p, dtype, seed=B * 1000 + p + 1)
    g[list(nan_rows)] = np.nan
    C, noise_std, inv_denom, seed, offset = 2.0, 0.7, 1.0 / 3.0, 99, 17
    l2 = 16 * rows * p * np.dtype(dtype).itemsize
    common = dict(dtype=_dt(dtype), B=B, p=p, max_norm=C, noise_std=noise_std,
                  inv_denom=inv_denom, seed=seed, offset=offset, l2_bytes=l2)
    buffers = {"grads": g, "out": np.zeros(p, dtype), "norms": np.zeros(B)}
    misalign = {"grads": _misalign(dtype, shift)}
    one = emu.run("clip_noise_rows", dict(common, one_pass_blocks=blocks), buffers,
                  misalign=misalign)
    two = emu.run("clip_noise_rows", dict(common, one_pass_blocks=0, l2_bytes=0), buffers,
                  misalign=misalign)
    # The same segments, per-thread order and block tree as the two-pass norms.
    assert _same_bits(one["norms"], two["norms"])
    kept = np.ones(B, bool)
    kept[list(nan_rows)] = False
    assert np.all(np.isnan(one["norms"][~kept]))
    # A NaN row has factor 0 and is skipped: the sum of the rows without it,
    # which the reference forms with the row as zeros.
    expected, scale, sq, _ = _expected_dense(np.where(kept[:, None], g, 0), C, noise_std,
                                             inv_denom, seed, offset)
    assert_close(one["norms"][kept] ** 2, sq[kept], sq[kept], p + 3, np.float64, np.float64,
                 "norms")
    assert_close(one["out"], expected, scale, B + 4, np.float64, dtype, "out",
                 atol=inv_denom * noise_std * NORMAL_ATOL)
    if B <= 8:
        # The two-pass form sums at least 8 rows a slab (one slab here): rows
        # summed in the same order, finished by the same slab finish.
        assert _same_bits(one["out"], two["out"])


@pytest.mark.parametrize("dtype", DTYPES)
def test_weighted_row_sum_skips_dropped_rows(emu, dtype):
    # Rows with factor 0 hold NaN: they must not reach the sum (0 * NaN is NaN).
    B, p = 30, 11
    g = _dense_case(B, p, dtype, seed=3)
    g[[2, 17]] = np.nan
    factors = np.random.default_rng(4).uniform(0, 1, B)
    factors[[2, 17]] = 0.0
    res = emu.run("weighted_row_sum_noise",
                  dict(dtype=_dt(dtype), B=B, p=p, noise_std=0.0, inv_denom=1.0, seed=1,
                       offset=0),
                  {"grads": g, "factors": factors, "out": np.zeros(p, dtype)},
                  misalign={"grads": _misalign(dtype, 1)})
    expected, scale, _, _ = _expected_dense(g, 1.0, 0.0, 1.0, 1, 0, factors=factors)
    assert np.all(np.isfinite(res["out"]))
    assert_close(res["out"], expected, scale, B + 4, np.float64, dtype, "out")


@pytest.mark.parametrize("B,p", [(30, 11), (1, 1), (0, 5), (600, 3)])
def test_weighted_row_sum_float64_sum_then_finish_is_the_fused_kernel(emu, B, p):
    """float32 rows summed into float64 (out_dtype 1, noise 0: the clip op's
    joined dense blocks), then finished into float32 by the segments kernel at
    the block's offset, equal the fused float32 kernel's output bit for bit:
    the same float64 slab sum, the same noise, one rounding."""
    g = _dense_case(B, p, np.float32, seed=B + p)
    factors = np.random.default_rng(5).uniform(0, 1, B)
    common = dict(dtype=0, B=B, p=p, seed=77, offset=9)
    fused = emu.run("weighted_row_sum_noise", dict(common, noise_std=0.7, inv_denom=0.25),
                    {"grads": g, "factors": factors, "out": np.zeros(p, np.float32)})["out"]
    sum64 = emu.run("weighted_row_sum_noise", dict(common, noise_std=0.0, inv_denom=1.0,
                                                   out64=1),
                    {"grads": g, "factors": factors, "out": np.zeros(p, np.float64)})["out"]
    expected, scale, _, _ = _expected_dense(g, 1.0, 0.0, 1.0, 77, 9, factors=factors)
    assert_close(sum64, expected, scale, B + 4, np.float64, np.float64, "sum64")
    out = emu.run("finish_gaussian_segments",
                  dict(S=1, seed=77, scale=0.7, post=0.25, types0=2, size0=p, offset0=9),
                  {"src0": sum64, "dst0": np.full(p, np.nan, np.float32)})["dst0"]
    assert np.array_equal(out, fused)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,m,shift", [(3, 8, 0), (3, 5, 0), (1, 1, 0), (0, 4, 0), (4, 12, 1),
                                       (2, 1027, 0)])
def test_scale_rows_rounds_each_float64_product_once(emu, dtype, B, m, shift):
    """out[i] = x[i] * f[i], the product formed in float64 and rounded once to
    the dtype, bit for bit as NumPy forms it (the clipped GEMM's scaled
    operand): the vector path (m a multiple of the width, aligned), the
    element path (m = 5, or a base shifted off the 16-byte boundary), factors
    0, 1, far below float32's denormals and above 1, values across the
    dtype's range."""
    rng = np.random.default_rng(B * 100 + m)
    fi = np.finfo(dtype)
    x = (rng.choice([-1.0, 1.0], (B, m))
         * np.exp2(rng.uniform(np.log2(float(fi.smallest_subnormal)), np.log2(float(fi.max)) - 1,
                               (B, m)))).astype(dtype)
    f = np.array([0.0, 1.0, 2.0 ** -140, 0.37, 2.0 ** 30, 1e-300][:B] + [0.5] * max(0, B - 6))
    res = emu.run("scale_rows", dict(dtype=_dt(dtype), B=B, m=m),
                  {"x": x, "factors": f, "out": np.full((B, m), np.nan, dtype)},
                  misalign={"x": _misalign(dtype, shift), "out": _misalign(dtype, shift)})
    want = (x.astype(np.float64) * f[:, None]).astype(dtype)
    assert np.array_equal(res["out"].reshape(B, m), want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_sq_norms_and_clip_factors(emu, dtype):
    B, p = 7, 13
    g = _dense_case(B, p, dtype, seed=5)
    sq0 = np.arange(B, dtype=np.float64)
    for accumulate in (False, True):
        sq = emu.run("row_sq_norms", dict(dtype=_dt(dtype), B=B, p=p, accumulate=accumulate),
                     {"grads": g, "sq": sq0.copy()})["sq"]
        exact = (g.astype(np.float64) ** 2).sum(axis=1) + (sq0 if accumulate else 0.0)
        assert_close(sq, exact, exact, p + 1, np.float64, np.float64, "sq")


def _grams(n, T, seed):
    """(W, V): n Grams of random (T, 5) and (T, 3) operands (non-negative diagonals)."""
    rng = np.random.default_rng(seed)
    a, g = rng.standard_normal((n, T, 5)), rng.standard_normal((n, T, 3)) * 0.3
    return a @ a.transpose(0, 2, 1), g @ g.transpose(0, 2, 1)


# (B, layers, T): no samples, no positions, one of each, one slice of T * T
# cells past the block's 256 threads, three stacked layers, four row slices
# of 18 rows with a shorter last one (T * T / 1024 cells bounds the slices),
# 39 slices (the finish's warp a sample takes two turns on 7 lanes), and 9
# samples (two blocks of the finish's 8 warps).
@pytest.mark.parametrize("B,layers,T", [(0, 1, 4), (2, 2, 0), (1, 1, 1), (3, 1, 17), (2, 3, 20),
                                        (1, 1, 70), (1, 1, 200), (9, 2, 5)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_norms_from_grams_match_the_reference(emu, B, layers, T, bias):
    w, v = _grams(layers * B, T, seed=B + 7 * T + layers)
    sq0, spread0 = np.linspace(0.5, 2.0, B), np.linspace(1.0, 3.0, B)
    want_sq, want_spread, want_sizes = R.linear_norms_from_grams(w, v, bias, layers)
    one = 1.0 if bias else 0.0
    cells = np.abs((w + one) * v).reshape(layers, B, T * T).sum(axis=(0, 2))
    diag_w, diag_v = np.diagonal(w, 0, 1, 2), np.diagonal(v, 0, 1, 2)
    scale = (np.sqrt(diag_v) * (np.sqrt(diag_w) + one)).reshape(layers, B, T).sum(axis=(0, 2))
    for accumulate, outputs in ((False, True), (True, True), (True, False)):
        res = emu.run("linear_norms_from_grams",
                      dict(B=B, layers=layers, T=T, bias=int(bias), accumulate=int(accumulate)),
                      {"w": w, "v": v, "sq": sq0.copy(),
                       "spread": spread0.copy() if outputs else None,
                       "sizes": np.full((layers * B, 2), np.nan) if outputs else None},
                      misalign={"w": 8, "sizes": 8})
        base = sq0 if accumulate else 0.0
        # Each sample's sum of layers * T^2 products (two roundings each) in
        # float64, the layers' totals and the accumulation in order.
        assert_close(res["sq"], want_sq + base, cells + np.abs(base), layers * T * T + 3,
                     np.float64, np.float64, "sq")
        if outputs:
            assert_close(res["spread"], want_spread + spread0, scale + spread0,
                         layers * T + 5, np.float64, np.float64, "spread")
            assert_close(res["sizes"], want_sizes, np.abs(want_sizes), T + 1, np.float64,
                         np.float64, "sizes")


@pytest.mark.parametrize("B,layers,T", [(2, 3, 20), (1, 2, 70)])
def test_linear_norms_from_grams_with_one_shared_input(emu, B, layers, T):
    """shared_w: the layers read one input, whose B Grams W serve them all
    (W_i = W[b]), as its own copy per layer would."""
    w, v = _grams(layers * B, T, seed=T + layers)
    w = w[:B].copy()
    want_sq, want_spread, want_sizes = R.linear_norms_from_grams(w, v, True, layers,
                                                                 shared_w=True)
    assert np.array_equal(
        R.linear_norms_from_grams(np.concatenate([w] * layers), v, True, layers)[0], want_sq)
    wl = np.concatenate([w] * layers)
    cells = np.abs((wl + 1.0) * v).reshape(layers, B, T * T).sum(axis=(0, 2))
    dw, dv = np.diagonal(wl, 0, 1, 2), np.diagonal(v, 0, 1, 2)
    scale = (np.sqrt(dv) * (np.sqrt(dw) + 1.0)).reshape(layers, B, T).sum(axis=(0, 2))
    res = emu.run("linear_norms_from_grams",
                  dict(B=B, layers=layers, T=T, bias=1, accumulate=0, shared_w=1),
                  {"w": w, "v": v, "sq": np.full(B, np.nan), "spread": np.zeros(B),
                   "sizes": np.full((layers * B, 2), np.nan)})
    assert_close(res["sq"], want_sq, cells, layers * T * T + 3, np.float64, np.float64, "sq")
    assert_close(res["spread"], want_spread, scale, layers * T + 5, np.float64, np.float64,
                 "spread")
    assert_close(res["sizes"], want_sizes, np.abs(want_sizes), T + 1, np.float64, np.float64,
                 "sizes")


# (B, layers, T, shared): one position, a slice past 256 threads, three
# stacked layers, four row slices with a shorter last one, a shared input.
@pytest.mark.parametrize("B,layers,T,shared", [(2, 2, 0, False), (1, 1, 1, False),
                                               (3, 1, 17, False), (2, 3, 20, False),
                                               (1, 1, 70, False), (2, 3, 20, True)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_norms_from_float32_grams_match_the_reference(emu, B, layers, T, shared, bias):
    """gram_dtype float32 (w_length, v_length given): float32 Grams read as
    they are, each layer's norm raised by the float32 model's error term and
    the spread formed from the diagonals' root bounds, as the reference."""
    d, K = 5, 3
    rng = np.random.default_rng(B + 3 * T + layers)
    a = rng.standard_normal((layers * B, T, d)).astype(np.float32)
    g = (rng.standard_normal((layers * B, T, K)) * 0.3).astype(np.float32)
    w, v = a @ a.transpose(0, 2, 1), g @ g.transpose(0, 2, 1)
    if shared:
        w = np.ascontiguousarray(w[:B])
    want_sq, want_spread, want_sizes = R.linear_norms_from_grams(w, v, bias, layers, shared,
                                                                 lengths=(d, K))
    plain_sq = R.linear_norms_from_grams(w, v, bias, layers, shared)[0]
    one = 1.0 if bias else 0.0
    wl = np.concatenate([w] * layers) if shared else w
    w64, v64 = wl.astype(np.float64), v.astype(np.float64)
    cells = np.abs((w64 + one) * v64).reshape(layers, B, T * T).sum(axis=(0, 2))
    res = emu.run("linear_norms_from_grams",
                  dict(B=B, layers=layers, T=T, bias=int(bias), accumulate=0,
                       shared_w=int(shared), w_length=d, v_length=K),
                  {"w": w, "v": v, "sq": np.full(B, np.nan), "spread": np.zeros(B),
                   "sizes": np.full((layers * B, 2), np.nan)},
                  misalign={"w": 4, "v": 4})
    # The Hadamard sums as the float64 Grams' test bounds them; the error
    # terms (about 1e-6 of them here) are products of sums over T diagonals
    # in another order: a few T roundings of their own size.
    err = want_sq - plain_sq
    assert np.all(err > 0) or T == 0      # no positions: nothing to round
    assert_close(res["sq"], want_sq, cells + 8 * err, layers * T * T + 3 * T + 8, np.float64,
                 np.float64, "sq")
    assert_close(res["spread"], want_spread, want_spread, layers * T + 5, np.float64,
                 np.float64, "spread")
    assert_close(res["sizes"], want_sizes, np.abs(want_sizes), T + 1, np.float64, np.float64,
                 "sizes")


@pytest.mark.parametrize("with_spread", [False, True])
@pytest.mark.parametrize("scale", [None, 1.0, 3.0, 0.1])
@pytest.mark.parametrize("groups", [1, 3])
def test_clip_factors_match_the_reference_rule(emu, with_spread, scale, groups):
    # The rule of clip/clip_rule.cuh is reference.clip_bound operation for operation:
    # factors agree bit for bit, including overflowing, zero and non-finite rows.
    # With a grad_scale s: the rule on s^2 sq and s spread, weights = factors s,
    # each product rounded once (the element-wise ops the kernel replaced);
    # None: the launcher's default (1, no weights).  Groups (per-layer
    # clipping): each group's rows on its own rule, its factors and norms at
    # its place of the output (stride past 2 B: what lies between is left).
    base = np.array([0.0, 0.25, 1.0, 1.0 + 2.0 ** -40, 4.0, 1e300, np.inf, np.nan, 1e-300,
                     3.65e22 ** 2, 7.0])
    B = base.size
    sq = np.stack([base * (1.0 + 0.5 * k) for k in range(groups)])
    spread = np.abs(np.random.default_rng(0).standard_normal((groups, B))) * 3
    spread[:, 3] = 1e200  # (sqrt(g) E)^2 must not overflow where g E^2 would
    rules = [(2.0, 37, 4), (0.5, 3, 1), (7.0, 1000, 0)][:groups]
    unit, stride = 2.0 ** -24, 2 * B + 5
    scalars = dict(B=B, groups=groups, unit=unit, stride=stride)
    buffers = {"sq": sq, "spread": spread if with_spread else None,
               "max_norm": np.array([c for c, _, _ in rules]),
               "terms": np.array([t for _, t, _ in rules], dtype=np.int64),
               "seq_len": np.array([T for _, _, T in rules], dtype=np.int64),
               "out": np.full(groups * stride, -1.0)}
    if scale is not None:
        scalars["scale"] = scale
        buffers["weights"] = np.full((groups, B), -1.0)
    res = emu.run("clip_factors", scalars, buffers)
    s = 1.0 if scale is None else scale
    out = res["out"].reshape(groups, stride)
    factors, norms, weights = R.clip_factor_groups(
        sq, rules, unit=unit, spread=spread if with_spread else None, scale=s)
    assert np.array_equal(out[:, :B], factors)
    assert np.array_equal(out[:, B:2 * B], norms, equal_nan=True)
    assert np.all(out[:, 2 * B:] == -1.0)
    if scale is not None:
        assert np.array_equal(res["weights"].reshape(groups, B), weights)


@pytest.mark.parametrize("dtype,magnitudes", [
    (np.float32, [3.65e22, 4e22, 1.5e38, 1.0, 1.0000001, 1e-30]),
    (np.float64, [1e300, 1e150, 1.0, 1.0 + 2.0 ** -52, 1e-300]),
])
def test_clipped_contribution_never_exceeds_the_bound(emu, dtype, magnitudes):
    # Issue 13, item 3: with the factor cast to float32, a row of 3.65e22
    # contributed norm 1.87 > C = 1 and one of 4e22 nothing. Each row alone,
    # without noise: the output is that row's contribution, in both forms of
    # the op (one_pass_blocks 1: dense_one_pass.cu).
    C = 1.0
    for magnitude, p, one_pass in itertools.product(magnitudes, (1, 3, 8), (0, 1)):
        row = np.full((1, p), magnitude / np.sqrt(p), dtype=dtype)
        out = emu.run("clip_noise_rows",
                      dict(dtype=_dt(dtype), B=1, p=p, max_norm=C, noise_std=0.0,
                           inv_denom=1.0, seed=1, offset=0, l2_bytes=0,
                           one_pass_blocks=one_pass),
                      {"grads": row, "out": np.zeros(p, dtype), "norms": np.zeros(1)})["out"]
        norm = np.sqrt((out.astype(np.float64) ** 2).sum())
        assert norm <= C, (magnitude, p, one_pass, norm)
        # ...and costs at most the rounding margin of the bound, unless the
        # squared norm overflows float64 (then the row is dropped: factor 0).
        with np.errstate(over="ignore"):
            sq = (row.astype(np.float64) ** 2).sum()
        floor = min(C, np.sqrt(sq)) * (1 - 4 * (p + 8) * unit_roundoff(dtype))
        assert norm >= floor if np.isfinite(sq) else norm == 0.0, (magnitude, p, norm)


# ---------------------------------------------------------------------------
# Factored (linear-layer) clipping.

def _linear_case(B, T, d, K, dtype, seed):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((B, T, d)).astype(dtype)
    g = rng.standard_normal((B, T, K)).astype(dtype)
    return a, g


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,T,d,K,bias", [
    (5, 1, 7, 3, True),     # rank-1 route (T = 1)
    (4, 3, 8, 5, False),    # Gram route (2 T^2 <= K d), one tile
    (2, 17, 40, 20, True),  # Gram route, two tiles of positions
    (3, 20, 3, 2, True),    # direct route (2 T^2 > K d)
    (1, 5, 0, 4, True),     # no inputs: bias only
])
def test_linear_sq_norms(emu, dtype, B, T, d, K, bias):
    a, g = _linear_case(B, T, d, K, dtype, seed=B + T + d + K)
    buffers = {"acts": a, "grads": g, "sq": np.zeros(B)}
    if T == 1:      # the rank-1 kernel also writes the operands' squared norms
        buffers["sizes"] = np.full((B, 2), np.nan)
    res = emu.run("linear_sq_norms", dict(dtype=_dt(dtype), B=B, T=T, d=d, K=K, bias=bias,
                                          accumulate=False), buffers)
    a64, g64 = a.astype(np.float64), g.astype(np.float64)
    if T == 1:
        # Float64 sums of n non-negative squares: within gamma_(n+1) of the exact sum.
        exact_sizes = np.stack([(a64[:, 0] ** 2).sum(1), (g64[:, 0] ** 2).sum(1)], axis=1)
        n = np.array([d, K])
        assert np.all(np.abs(res["sizes"] - exact_sizes)
                      <= (n + 1) * 2.0 ** -53 * exact_sizes), (res["sizes"], exact_sizes)
    G = np.einsum("btk,btj->bkj", g64, a64)
    exact = (G ** 2).sum(axis=(1, 2)) + (((g64.sum(axis=1)) ** 2).sum(axis=1) if bias else 0)
    # The bound reference.clip_bound assumes of these kernels: |sq - exact| <= gamma E^2,
    # gamma = (terms + 4) 2^-52, E = sum_t ||g_t|| (||a_t|| + bias).
    spread = (np.linalg.norm(g64, axis=2) * (np.linalg.norm(a64, axis=2) + bias)).sum(axis=1)
    gam = (R.linear_terms(d, K, T, bias) + 4) * 2.0 ** -52
    assert np.all(np.abs(res["sq"] - exact) <= gam * spread ** 2), (res["sq"], exact)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,T,d,K,bias,split", [
    (3, 1, 5, 2, True, False),     # tiny, one slab
    (300, 1, 70, 3, True, True),   # R > 256: several slabs, two column tiles
    (40, 9, 3, 66, False, True),   # sequences, two k tiles, no bias
    (6, 2, 4, 3, True, False),     # no workspace: one slab written in place
])
def test_clipped_linear_sum(emu, dtype, B, T, d, K, bias, split):
    a, g = _linear_case(B, T, d, K, dtype, seed=7 * B + T)
    rng = np.random.default_rng(B)
    factors = rng.uniform(0, 1, B)
    factors[0] = 0.0
    a[0] = np.nan  # dropped rows are never read
    seed, offset, noise_std, inv_denom = 5, 11, 0.3, 0.5
    nbytes = int(emu.run("linear_sum_plan", dict(dtype=_dt(dtype), R=B * T, d=d, K=K),
                         {"plan": np.zeros(3, np.int64)})["plan"][1]) if split else 0
    res = emu.run("clipped_linear_sum",
                  dict(dtype=_dt(dtype), B=B, T=T, d=d, K=K, noise_std=noise_std,
                       inv_denom=inv_denom, seed=seed, offset=offset, workspace_bytes=nbytes),
                  {"acts": a, "grads": g, "factors": factors, "gw": np.zeros((K, d), dtype),
                   "gb": np.zeros(K, dtype) if bias else None})
    a64 = np.nan_to_num(a.astype(np.float64))
    g64 = g.astype(np.float64) * factors[:, None, None]
    z = R.gaussian(K * d + K, seed=seed, offset=offset, dtype=np.float64)
    gw = inv_denom * (np.einsum("btk,btj->kj", g64, a64) + noise_std * z[:K * d].reshape(K, d))
    scale = inv_denom * np.einsum("btk,btj->kj", np.abs(g64), np.abs(a64))
    # Products rounded once in the dtype after the float64 factor, sums of B T terms in the
    # dtype, the slab sum and the final scaling: B T + 4 roundings.
    assert_close(res["gw"], gw, scale, B * T + 4, dtype, dtype, "gw",
                 atol=inv_denom * noise_std * NORMAL_ATOL)
    if bias:
        gb = inv_denom * (g64.sum(axis=(0, 1)) + noise_std * z[K * d:])
        scale_b = inv_denom * np.abs(g64).sum(axis=(0, 1))
        assert_close(res["gb"], gb, scale_b, B * T + 4, dtype, dtype, "gb",
                     atol=inv_denom * noise_std * NORMAL_ATOL)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("R_,d,K", [(300, 70, 3), (5000, 10, 10), (257, 1, 1), (4096, 200, 7)])
def test_clipped_linear_sum_uses_the_planned_slabs(emu, dtype, R_, d, K):
    # The workspace the wrapper asks for must give the launcher every slab it planned.
    planned, nbytes, used = emu.run("linear_sum_plan", dict(dtype=_dt(dtype), R=R_, d=d, K=K),
                                    {"plan": np.zeros(3, np.int64)})["plan"]
    assert planned > 1 and used == planned, (planned, nbytes, used)


# ---------------------------------------------------------------------------
# Sampling and mixing (mix/mix.cu).

def _population_case(n, K, m, class_rate, seed):
    labels = np.random.default_rng(seed).integers(0, K, n) if K else np.zeros(n, np.int64)
    group_ptr, members, select, walk = _population(labels, n, K, m, class_rate)
    return labels.astype(np.int64), dict(group_ptr=group_ptr, members=members,
                                         select_rate=select, walk_rate=walk)


@pytest.mark.parametrize("n,K,m,class_rate,rows", [
    (50, 3, 10.0, None, 30),   # Poisson; 30 rows over 3 blocks of 8 sampler warps
    (40, 4, 6.0, 0.5, 9),      # hierarchical
    (700, 2, 650.0, None, 2),  # more than 512 members per row
])
def test_sample_plan_matches_reference(emu, n, K, m, class_rate, rows):
    labels, pop = _population_case(n, K, m, class_rate, seed=n)
    seed, offset, row_stride = 77, 5, 9
    G = pop["group_ptr"].shape[0] - 1
    scalars = dict(G=G, rows=rows, row_stride=row_stride, seed=seed, offset=offset)
    counts = emu.run("sample_counts", scalars, {**pop, "counts": np.zeros(rows, np.int64)})
    counts = counts["counts"]
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    total = int(indptr[-1])
    filled = emu.run("sample_fill", dict(scalars, total=total),
                     {**pop, "indptr": indptr, "indices": np.zeros(max(total, 1), np.int64)})
    groups = R.sample_groups(labels, num_samples=rows, mixup_degree=m, class_rate=class_rate,
                             num_classes=K, seed=seed, offset=offset, row_stride=row_stride)
    assert counts.tolist() == [len(x) for x in groups]
    got = filled["indices"][:total]
    assert [got[indptr[r]:indptr[r + 1]].tolist() for r in range(rows)] == groups


MIX_CASES = [
    # (n, d, K, m, class_rate, rows, soft, clip, shift)
    (30, 5, 3, 4.0, None, 5, False, 1.5, 0),      # 1 vector/thread, unaligned rows, 2 rows/block
    (30, 8, 3, 4.0, 0.7, 4, False, 0.0, 0),       # aligned, hierarchical, no clip
    (20, 1100, 2, 3.0, None, 2, True, 10.0, 0),   # 2 vectors per thread, soft labels
    (20, 2100, 2, 3.0, None, 1, False, 10.0, 1),  # 4 vectors per thread, unaligned base
    (600, 6, 2, 560.0, None, 1, False, 1.0, 0),   # more than 512 members: several chunks
    (12, 0, 3, 3.0, None, 2, False, 0.0, 0),      # labels only
]


def _expected_mix(features, labels, K, m, class_rate, rows, seed, offset, clip, soft):
    n, d = features.shape
    groups = R.sample_groups(labels, num_samples=rows, mixup_degree=m, class_rate=class_rate,
                             num_classes=K, seed=seed, offset=offset, row_stride=d + K)
    Y = soft if soft is not None else np.eye(K)[labels]
    f64 = features.astype(np.float64)
    if clip > 0:
        sq = (f64 * f64).sum(axis=1)
        factors, _ = R.clip_factors(sq, clip, unit=unit_roundoff(features.dtype), terms=d)
        f64 = f64 * factors[:, None]
    x, y = R.mix_from_groups(f64, Y, groups, mixup_degree=m, noise_std_x=0.25,
                             noise_std_y=0.5, seed=seed, offset=offset)
    scale_x = np.array([np.abs(f64[g]).sum(axis=0) / m if len(g) else np.zeros(d)
                        for g in groups]).reshape(rows, d)
    scale_y = np.array([np.abs(Y[g]).sum(axis=0) / m if len(g) else np.zeros(K)
                        for g in groups]).reshape(rows, K)
    return groups, x, y, scale_x, scale_y


def _run_mix(emu, dtype, n, d, K, m, class_rate, rows, soft, clip, shift, seed=31, offset=7):
    rng = np.random.default_rng(n + d)
    features = (rng.standard_normal((n, d)) * rng.uniform(0.2, 2.0, (n, 1))).astype(dtype)
    labels, pop = _population_case(n, K, m, class_rate, seed=n + 1)
    soft_labels = rng.dirichlet(np.ones(K), n).astype(dtype) if soft else None
    res = emu.run("mix_rows",
                  dict(dtype=_dt(dtype), n=n, d=d, K=K, G=pop["group_ptr"].shape[0] - 1,
                       rows=rows, seed=seed, offset=offset, inv_m=1.0 / m, clip_x=clip,
                       noise_std_x=0.25, noise_std_y=0.5),
                  {"features": features, "labels": labels, "soft_labels": soft_labels, **pop,
                   "out_x": np.zeros((rows, d), dtype), "out_y": np.zeros((rows, K), dtype),
                   "counts": np.zeros(rows, np.int64)},
                  misalign={"features": _misalign(dtype, shift)})
    groups, x, y, sx, sy = _expected_mix(features, labels, K, m, class_rate, rows, seed, offset,
                                         clip, soft_labels)
    assert res["counts"].tolist() == [len(g) for g in groups]
    longest = max([len(g) for g in groups] + [1])
    # Sums of the members in the dtype (sampler order), one float64 finish.
    assert_close(res["out_x"], x, sx, longest + 4, dtype, dtype, "x", atol=0.25 * NORMAL_ATOL)
    assert_close(res["out_y"], y, sy, longest + 4, dtype, dtype, "y", atol=0.5 * NORMAL_ATOL)
    return groups


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", MIX_CASES, ids=lambda c: f"n{c[0]}-d{c[1]}-rows{c[5]}")
def test_mix_rows(emu, dtype, case):
    groups = _run_mix(emu, dtype, *case)
    if case[0] == 600:
        assert max(len(g) for g in groups) > 512


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("column", [0, 5])
def test_mix_rows_deep_pairs(emu, dtype, column):
    # Row 0's noise draws d + K = 8 normals from the offset; a pair that reads
    # its deep block starts at its column 0 (features: normals_of_slot) or 5
    # (the first label: normal_at).
    case = MIX_CASES[0]
    assert case[1:3] == (5, 3)
    seed = 31
    _run_mix(emu, dtype, *case, seed=seed, offset=2 * first_deep_pair(seed, 0) - column)


@pytest.mark.parametrize("dtype,d", [(np.float32, 5000), (np.float32, 8193), (np.float64, 4097)])
def test_mix_rows_wide(emu, dtype, d):
    # float32: 8 vectors per thread at d = 5000, the tiled path past 8192 columns;
    # float64: tiled past 4096.
    _run_mix(emu, dtype, 8, d, 2, 2.0, None, 2, False, 30.0, 0)


# ---------------------------------------------------------------------------
# Hadamard-product NTK Gram (ntk/hadamard_gram.cu).

def _gram_terms(L, n, n2, widths, dtype, seed, symmetric):
    rng = np.random.default_rng(seed)
    terms = []
    for l in range(L):
        a, b = widths[l % len(widths)]
        f = None if a is None else rng.standard_normal((n, a)).astype(dtype)
        bb = rng.standard_normal((n, b)).astype(dtype)
        if symmetric:
            f2, b2 = f, bb
        else:
            f2 = None if a is None else rng.standard_normal((n2, a)).astype(dtype)
            b2 = rng.standard_normal((n2, b)).astype(dtype)
        terms.append((f, f2, bb, b2))
    return terms


@pytest.mark.parametrize("dtype,acc64,out64", [
    (np.float32, False, False), (np.float32, True, True), (np.float64, True, False)])
@pytest.mark.parametrize("L,n,n2,symmetric,widths", [
    (3, 1, 1, True, [(2, 3), (None, 4)]),               # one entry; a bias term
    (2, 70, 45, False, [(9, 5), (1, 17)]),              # partial tiles, widths past 8
    (66, 20, 20, True, [(1, 2), (None, 1), (3, 1)]),    # more than 64 terms: two launches
])
def test_hadamard_gram(emu, dtype, acc64, out64, L, n, n2, symmetric, widths):
    _check_gram(emu, dtype, acc64, out64, L, n, n2, symmetric, widths)


@pytest.mark.parametrize("dtype,acc64,n", [(np.float64, True, 520), (np.float32, False, 1030)])
def test_hadamard_gram_many_tile_rows(emu, dtype, acc64, n):
    # 9 tile rows: the grouped tile search spans two groups of 8.
    if emu.variant == "tsan" and dtype == np.float32:
        pytest.skip("the float32 tile (128) makes this case slow under ThreadSanitizer; the "
                    "float64 case covers the same search")
    _check_gram(emu, dtype, acc64, False, 1, n, n, True, [(1, 1)])


def _check_gram(emu, dtype, acc64, out64, L, n, n2, symmetric, widths):
    terms = _gram_terms(L, n, n2, widths, dtype, seed=L + n, symmetric=symmetric)
    scalars = dict(dtype=_dt(dtype), acc64=acc64, out64=out64, n=n, n2=n2, symmetric=symmetric,
                   L=L)
    buffers = {"out": np.zeros((n, n2), np.float64 if out64 else np.float32)}
    expected = np.zeros((n, n2))
    scale = np.zeros((n, n2))
    depth = 0
    for l, (f, f2, b, b2) in enumerate(terms):
        s = str(l)
        scalars["a" + s] = 0 if f is None else f.shape[1]
        scalars["bw" + s] = b.shape[1]
        buffers.update({"f" + s: f, "f2_" + s: f2, "b" + s: b, "b2_" + s: b2})
        q = b.astype(np.float64) @ b2.astype(np.float64).T
        qa = np.abs(b.astype(np.float64)) @ np.abs(b2.astype(np.float64)).T
        if f is None:
            expected += q
            scale += qa
        else:
            pf = f.astype(np.float64) @ f2.astype(np.float64).T
            pa = np.abs(f.astype(np.float64)) @ np.abs(f2.astype(np.float64)).T
            expected += pf * q
            scale += pa * qa
        depth = max(depth, b.shape[1] + (0 if f is None else f.shape[1]))
    out = emu.run("hadamard_gram", scalars, buffers)["out"]
    acc = np.float64 if acc64 or dtype == np.float64 else np.float32
    # Each product: a dot of <= depth terms; then L Hadamard sums (and a re-read per
    # launch of 64 terms in the output dtype), in the accumulator's precision.
    n_terms = depth + L + 2 * (L // 64 + 2)
    # Later launches re-read the output in its dtype: one more rounding per launch.
    launches = L // 64 + 1
    assert_close(out, expected, scale, n_terms, acc, out.dtype, "K",
                 atol=launches * unit_roundoff(out.dtype) * scale)
    if symmetric:
        assert np.array_equal(out, out.T)



# ---------------------------------------------------------------------------
# The tier itself: it must catch what it exists to catch.

@pytest.mark.parametrize("variant", VARIANTS)
def test_tier_runs_a_correct_block_reduction_cleanly(built, variant):
    rc, stderr = run_program([str(BUILD / f"tier-probe-{variant}"), "block_sum"])
    assert rc == 0 and "Sanitizer" not in stderr, stderr


def test_tier_reports_a_removed_syncthreads(built, tmp_path):
    # block_sum's first barrier keeps warp 0 reading the previous call's warp
    # totals from being overwritten; without it ThreadSanitizer must see the race.
    source = (ROOT_CSRC / "common" / "block_reduce.cuh").read_text()
    marker = "  // Warp 0 may still be reading the previous call's totals.\n  __syncthreads();\n"
    assert marker in source, "block_reduce.cuh changed: update this test's marker"
    broken = tmp_path / "include" / "common"
    broken.mkdir(parents=True)
    (broken / "block_reduce.cuh").write_text(source.replace(marker, ""))
    out = tmp_path / "out"
    build_proc = build(targets=(str(out / "tier-probe-tsan"),),
                       extra=(f"OUT={out}", f"PROBE_INCLUDE={tmp_path / 'include'}"))
    assert build_proc == BUILD
    rc, stderr = run_program([str(out / "tier-probe-tsan"), "block_sum"])
    assert rc != 0 and "ThreadSanitizer: data race" in stderr, stderr[-3000:]
    assert "block_reduce.cuh" in stderr


@pytest.mark.parametrize("mode,message", [
    ("divergent", "deadlock"),
    ("mismatched", "this phase expects"),
    ("launch", "invalid launch"),
    # 64 KiB of dynamic shared memory without cudaFuncSetAttribute raising the
    # kernel's 48 KiB limit first, as the hardware refuses it.
    ("dynamic_limit", "invalid launch"),
    ("async_misaligned", "16-byte aligned"),
    ("async_global", "not shared memory"),
])
@pytest.mark.parametrize("variant", VARIANTS)
def test_tier_aborts_on_undefined_barrier_use(built, variant, mode, message):
    rc, stderr = run_program([str(BUILD / f"tier-probe-{variant}"), mode], timeout=120)
    assert rc != 0 and "ncdp_emu: FATAL" in stderr and message in stderr, stderr[-3000:]


# Issue 24: the tier must see races between blocks, shared memory a block did not
# write, and a shared-memory hand-off ordered only by a shuffle (tier_probe.cpp).

@pytest.mark.parametrize("mode", ["blocks_exact", "handoff_barrier", "shared_written",
                                  "dynamic_written", "async_waited", "async_pipeline"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_tier_runs_the_correct_variants_cleanly(built, variant, mode):
    rc, stderr = run_program([str(BUILD / f"tier-probe-{variant}"), mode], timeout=120)
    assert rc == 0 and "Sanitizer" not in stderr, stderr[-3000:]


@pytest.mark.parametrize("mode", ["blocks_racy", "handoff_shuffle", "async_no_barrier"])
def test_tier_reports_races_the_hardware_allows(built, mode):
    # blocks_racy: three blocks add into one total without atomics; they run one
    # after another, so the total is right, but nothing orders them. handoff_shuffle:
    # lane 1 reads what lane 0 stored after only a __shfl_sync, which orders no memory.
    rc, stderr = run_program([str(BUILD / "tier-probe-tsan"), mode], timeout=120)
    assert rc != 0 and "ThreadSanitizer: data race" in stderr, stderr[-3000:]
    assert "tier_probe.cpp" in stderr


@pytest.mark.parametrize("variant", VARIANTS)
def test_tier_poisons_shared_memory_a_block_did_not_write(built, variant):
    # Block 1 reads a slot only block 0 wrote: zero-initialised statics kept
    # block 0's value there and the sum came out right.
    rc, stderr = run_program([str(BUILD / f"tier-probe-{variant}"), "shared_unwritten"],
                             timeout=120)
    assert rc == 1 and "read unwritten shared memory: sum -nan" in stderr, stderr[-3000:]


@pytest.mark.parametrize("variant", VARIANTS)
def test_tier_poisons_dynamic_shared_memory_a_block_did_not_write(built, variant):
    # The launch's 64 KiB buffer is poisoned before every block, as the statics are.
    rc, stderr = run_program([str(BUILD / f"tier-probe-{variant}"), "dynamic_unwritten"],
                             timeout=120)
    assert rc == 1 and "read unwritten shared memory: sum -nan" in stderr, stderr[-3000:]


@pytest.mark.parametrize("mode", ["async_unwaited", "async_early"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_tier_shows_cp_async_data_read_before_its_wait(built, variant, mode):
    # The hardware may complete a cp.async at any time before its wait_group:
    # the tier completes it at the wait and poisons its destination until then,
    # so a kernel that reads it early (no wait; a wait that leaves the group
    # pending) reads NaN and its result is wrong.
    rc, stderr = run_program([str(BUILD / f"tier-probe-{variant}"), mode], timeout=120)
    assert rc == 1 and " is -nan, expected " in stderr and "Sanitizer" not in stderr, \
        stderr[-3000:]


def test_tier_reports_a_leak_at_exit(built):
    rc, stderr = run_program([str(BUILD / "tier-probe-asan"), "leak"], timeout=120)
    assert rc == 67 and "LeakSanitizer: detected memory leaks" in stderr, stderr[-3000:]


@pytest.mark.parametrize("variant,clean,bad,status,report", [
    ("tsan", ["blocks_exact", "handoff_barrier", "block_sum", "async_pipeline"],
     "blocks_racy", 66, "ThreadSanitizer: data race"),
    ("asan", ["blocks_exact", "handoff_barrier", "block_sum", "async_pipeline"],
     "leak", 67, "LeakSanitizer: detected memory leaks"),
    ("asan", ["blocks_exact", "shared_written"], "shared_unwritten", 1,
     "read unwritten shared memory: sum -nan"),
])
def test_served_tier_reports_a_bug_after_clean_cases(built, variant, clean, bad, status,
                                                      report):
    """The driver serves many cases in one process (emulation.Server): a planted
    bug after clean cases in that process still fails its own case (a leak at
    the case's end, not at the process's exit, which no test reads), the clean
    cases before it pass, and the next call runs in a fresh process."""
    served = Server(BUILD / f"tier-probe-{variant}")
    try:
        for mode in clean:
            rc, stderr = served.call(mode, timeout=120)
            assert rc == 0 and "Sanitizer" not in stderr, (mode, stderr[-3000:])
        first = served.proc.pid
        rc, stderr = served.call(bad, timeout=120)
        assert rc == status and report in stderr, stderr[-3000:]
        # The seed of the process's block order, printed at its first launch
        # (unless NCDP_EMU_SEED gave it), comes with the failure.
        if not os.environ.get("NCDP_EMU_SEED"):
            assert "block order seed" in stderr.splitlines()[0], stderr[:500]
        assert served.proc is None
        rc, stderr = served.call(clean[0], timeout=120)
        assert rc == 0 and served.proc.pid != first, stderr[-3000:]
    finally:
        served.close()


def test_cp_async_and_dynamic_shared_compile_for_the_device(tmp_path):
    """The CUDA branch of common/launch.cuh's cp.async and dynamic shared memory,
    compiled by nvcc for the extension's architectures (the tier runs only the
    emulator's): the probe's kernels assemble, and their SASS holds the
    asynchronous copies (LDGSTS) and their waits (DEPBAR) on sm_80 and sm_90."""
    from conftest import bench_script
    sm = bench_script("sass_mix")   # finds cuobjdump where the Makefile installs it
    nvcc, cuobjdump = sm.nvcc_path(), sm.find_cuobjdump()
    if nvcc is None or cuobjdump is None:
        pytest.skip("nvcc or cuobjdump not found (make installs nvidia-cuda-cuobjdump)")
    for arch in ("sm_80", "sm_90"):
        cubin = tmp_path / f"probe-{arch}.cubin"
        proc = subprocess.run([nvcc, "-x", "cu", f"-arch={arch}", "-cubin", "-O3", "-std=c++17",
                               "--expt-relaxed-constexpr", f"-I{ROOT_CSRC}", "-o", str(cubin),
                               str(ROOT_CSRC.parent / "tests" / "cuda_emu" / "tier_probe.cpp")],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        sass = subprocess.run([str(cuobjdump), "-sass", str(cubin)], capture_output=True,
                              text=True, timeout=120)
        assert sass.returncode == 0, sass.stderr[-3000:]
        # The pipeline kernel's own listing: from its header to the next one.
        pipelined = sass.stdout[sass.stdout.index("pipelined_sums"):]
        pipelined = pipelined.split("Function :")[0]
        assert "LDGSTS" in pipelined and "DEPBAR" in pipelined, (arch, pipelined[:3000])


# ---------------------------------------------------------------------------
# Normalisation layers' affine gradients (clip/norm_affine.cu).

# The CPU tests' shapes, the many-row one cut to 9 rows (the sanitizers' threads
# are slow); "w" alone (b a null pointer) on two of them.
EMU_NORM_AFFINE = [(s, "w" if s in ((1, 1, 1, 0), (2, 4, 12, 3)) else "both")
                   for s in NORM_AFFINE_SHAPES if s != (2, 40, 300, 0)] + [((2, 9, 300, 0), "both")]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape, outputs", EMU_NORM_AFFINE)
def test_norm_affine_grads(emu, dtype, shape, outputs):
    B, rows, n, run = shape
    x, g = norm_affine_case(shape, dtype)
    C = n if run == 0 else rows * (n // run)
    buffers = {"x": x, "g": g, "w": np.full((B, C), np.nan, dtype),
               "b": np.full((B, C), np.nan, dtype) if outputs == "both" else None}
    res = emu.run("norm_affine_grads", dict(dtype=_dt(dtype), B=B, rows=rows, n=n, run=run,
                                            eps=1e-5), buffers)
    assert_norm_affine_close(res["w"], res["b"] if outputs == "both" else None, x, g, run, 1e-5,
                             dtype)


# ---------------------------------------------------------------------------
# Float64 Grams of float32 rows (clip/gram_f64.cu): the tensor-core fragments'
# contract (common/mma_f64.cuh, met with shuffles here), a diagonal and
# off-diagonal tiles, a partial staging step, two sources in one launch of
# more samples than the grid's 3 blocks, rows further apart than d, and a
# launch of two jobs whose 600 values split into two k-ranges (partial Grams
# in the workspace, added by a second kernel).

@pytest.mark.parametrize("n, T, d, row_stride", [(1, 1, 1, 1), (2, 5, 17, 17), (2, 65, 3, 4),
                                                 (1, 66, 20, 20), (2, 4, 0, 0), (1, 5, 600, 601)])
def test_gram_rows_f64(emu, n, T, d, row_stride):
    from test_gram_f64 import assert_grams_close, rows
    x = [rows((n, T, max(row_stride, 1)), s) for s in range(2)]
    res = emu.run("gram_rows_f64", dict(S=2, n=n, T=T, d=d, sample_stride0=T * row_stride,
                                        sample_stride1=T * row_stride, row_stride0=row_stride,
                                        row_stride1=row_stride),
                  {"x0": x[0], "x1": x[1], "out": np.full((2 * n, T, T), np.nan)})
    want = np.concatenate([v[:, :, :d] for v in x])
    assert_grams_close(res["out"], want)
