"""The float64 Gram kernel of float32 rows (csrc/clip/gram_f64.cu, ``_cuda.gram``)
and its numba twin against ``reference.gram_rows_f64`` (each entry a correctly
rounded float64 sum of exact products): every entry within gamma_d of the sum
of |products| plus the reference's own rounding, over shapes that reach each
path (one position, a tile's edge, two and three tiles of positions, a partial
staging step, no values), strided views, more sources than one launch takes,
the device check that guards the kernel, and the host wrapper's refusals. The
sanitizer tier runs the same source in tests/test_cuda_emulation.py."""
from __future__ import annotations

import numpy as np
import pytest

from ncdp_fast import reference as R
from ncdp_fast._numba import clip as numba_clip

torch = pytest.importorskip("torch")

U64 = 2.0 ** -53
# (n, T, d): T = 64 is one tile, 65 and 130 two and three tiles of positions
# (one and three off-diagonal tiles), d 16 one staging step, 17 and 40 partial;
# T 9 and 36 (a convolution's positions) leave whole warps and some fragments
# of a warp past T (skipped: their rows or columns hold only zeros).
SHAPES = [(1, 1, 1), (3, 2, 5), (2, 9, 21), (2, 36, 16), (2, 63, 16), (2, 64, 17), (2, 65, 3),
          (1, 130, 40), (0, 4, 3), (2, 5, 0)]


def gamma(n):
    return n * U64 / (1 - n * U64)


def assert_grams_close(w, x):
    x64 = np.asarray(x, np.float64)
    ref = R.gram_rows_f64(x64)
    mags = np.einsum("itk,isk->its", np.abs(x64), np.abs(x64))
    bound = gamma(max(x.shape[2], 1)) * mags + U64 * np.abs(ref)
    w = np.asarray(w)
    assert w.shape == ref.shape and w.dtype == np.float64
    assert np.all(np.abs(w - ref) <= bound)


def rows(shape, seed=0):
    # Magnitudes over 60 binades: cancellation and tiny products both occur.
    rng = np.random.default_rng(seed + sum(shape))
    x = rng.standard_normal(shape) * np.exp2(rng.integers(-30, 30, shape))
    return x.astype(np.float32)


@pytest.fixture
def emulated():
    from ncdp_fast import _arrays
    saved = _arrays.set_emulation(True)
    yield
    _arrays.set_emulation(saved)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_numba_twin(shape):
    x = rows(shape)
    out = np.full((shape[0], shape[1], shape[1]), np.nan)
    numba_clip.gram_rows_f64(x, out)
    assert_grams_close(out, x)
    assert np.array_equal(out, out.swapaxes(1, 2))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_device_kernel(emulated, shape):
    from ncdp_fast._cuda import gram
    x = rows(shape, 1)
    t = torch.from_numpy(x)
    assert gram.applies([t])
    w = gram.grams_f64([t])
    assert_grams_close(w.numpy(), x)
    # An off-diagonal tile is written to both places: exactly symmetric.
    assert torch.equal(w, w.transpose(1, 2))


def test_device_kernel_strided_and_many_sources(emulated, monkeypatch):
    """Views read as they lie (rows further apart than d, samples further
    apart than T rows), and nine sources: two launches of at most eight."""
    from ncdp_fast._cuda import gram
    launches = []
    real = gram._launch
    monkeypatch.setattr(gram, "_launch", lambda parts, layouts, out:
                        launches.append(len(parts)) or real(parts, layouts, out))
    base = torch.from_numpy(rows((6, 9, 23), 2))
    view = base[::2, ::3, 2:13]                       # (3, 3, 11), strides (414, 69, 1)
    assert gram.applies([view])
    assert_grams_close(gram.grams_f64([view]).numpy(), view.numpy())
    parts = [torch.from_numpy(rows((2, 7, 5), s)) for s in range(9)]
    w = gram.grams_f64(parts)
    assert launches == [1, 9]
    assert_grams_close(w.numpy(), np.concatenate([p.numpy() for p in parts]))


def test_copies_route_where_the_kernel_does_not_apply(emulated):
    """float64 rows and the bench's switch take the float64 copies and the
    batched GEMM; the values agree."""
    from ncdp_fast._cuda import gram
    x = rows((2, 6, 7), 3)
    t64 = torch.from_numpy(x.astype(np.float64))
    assert not gram.applies([t64])
    assert_grams_close(gram.grams_f64([t64]).numpy(), x)
    with gram.copies_route():
        assert not gram.applies([torch.from_numpy(x)])
    assert gram.applies([torch.from_numpy(x)])


def test_transposed_parts_reach_the_kernel_through_a_row_major_copy(emulated, monkeypatch):
    """A float32 part whose last axis is not contiguous (attention's key
    gradient, a convolution's columns: transposed views) is copied row-major
    for the kernel, in the same launch as the parts read as they lie, instead
    of sending every part to the float64 copies; the caller's tensor is left
    as it was."""
    from ncdp_fast._cuda import gram
    launches = []
    real = gram._launch
    monkeypatch.setattr(gram, "_launch", lambda parts, layouts, out: launches.append(
        [tuple(x.stride()) for x in parts]) or real(parts, layouts, out))
    x = rows((3, 37, 20), 5)
    transposed = torch.from_numpy(np.ascontiguousarray(x.transpose(0, 2, 1))).transpose(1, 2)
    assert transposed.stride() == (740, 1, 37) and gram.applies([transposed])
    before = transposed.clone()
    plain = [torch.from_numpy(rows((3, 37, 20), s)) for s in (6, 7)]
    w = gram.grams_f64([plain[0], transposed, plain[1]])
    assert launches == [[(740, 20, 1)] * 3]
    assert_grams_close(w.numpy(), np.concatenate([plain[0].numpy(), x, plain[1].numpy()]))
    assert torch.equal(transposed, before) and transposed.stride() == (740, 1, 37)


def test_device_check(emulated, monkeypatch):
    """The once-a-device check passes the kernel's own answer and fails one
    that is off by a relative 1e-10 in one entry; a failed device warns and
    the copies route serves it."""
    from ncdp_fast._cuda import gram
    like = torch.zeros(1, dtype=torch.float32)
    assert gram._check(like)
    real = gram._launch

    def off(parts, layouts, out):
        real(parts, layouts, out)
        out[1, 3, 5] *= 1 + 1e-10
    monkeypatch.setattr(gram, "_launch", off)
    assert not gram._check(like)
    with pytest.warns(RuntimeWarning, match="wrong answer"):
        assert not gram._verdict("cuda:7", False)
    monkeypatch.setattr(gram, "_checked", lambda like: False)
    x = rows((2, 6, 7), 4)
    assert not gram.applies([torch.from_numpy(x)])
    assert_grams_close(gram.grams_f64([torch.from_numpy(x)]).numpy(), x)


def test_host_wrapper_refusals():
    from ncdp_fast import _C_emu as C
    x = np.zeros((2, 3, 4), np.float32)
    out = np.zeros((2, 3, 3))
    p, o = x.ctypes.data, out.ctypes.data
    with pytest.raises(ValueError, match="at most 8 sources"):
        C.launch_gram_rows_f64([p] * 9, [12] * 9, [4] * 9, 2, 3, 4, o, 0, 0, 0)
    with pytest.raises(ValueError, match="one of each per source"):
        C.launch_gram_rows_f64([p], [12, 12], [4], 2, 3, 4, o, 0, 0, 0)
    with pytest.raises(ValueError, match="row stride >= d"):
        C.launch_gram_rows_f64([p], [12], [3], 2, 3, 4, o, 0, 0, 0)
    with pytest.raises(ValueError, match="out is a null pointer"):
        C.launch_gram_rows_f64([p], [12], [4], 2, 3, 4, 0, 0, 0, 0)
    with pytest.raises(ValueError, match="not aligned"):
        C.launch_gram_rows_f64([p + 2], [12], [4], 2, 3, 4, o, 0, 0, 0)
    with pytest.raises(ValueError, match="d must be non-negative"):
        C.launch_gram_rows_f64([p], [12], [4], 2, 3, -1, o, 0, 0, 0)
    with pytest.raises(ValueError, match="d must be non-negative"):
        C.gram_rows_f64_workspace_bytes(1, 2, 3, -1)
    # One sample of 600 values: two k-ranges, whose partials need room.
    y = np.zeros((1, 2, 600), np.float32)
    need = C.gram_rows_f64_workspace_bytes(1, 1, 2, 600)
    assert need == 256
    with pytest.raises(ValueError, match=f"gram_rows_f64 needs {need} workspace bytes, got 8"):
        C.launch_gram_rows_f64([y.ctypes.data], [1200], [600], 1, 2, 600, o, o, 8, 0)
    with pytest.raises(ValueError, match="workspace is a null pointer"):
        C.launch_gram_rows_f64([y.ctypes.data], [1200], [600], 1, 2, 600, o, 0, need, 0)


# (count, n, T, d): no ranges (many jobs, d under two ranges' minimum, no
# values, no samples), 2 and 3 ranges, a range per resident block (one job),
# and rounding to whole staging steps that leaves fewer ranges than wanted
# (19 jobs want 20 ranges of 5130 values: 272 each, 19 of them), and rows
# longer than a range may be (2^30 values: the kernel counts them in an int)
# in a launch of many jobs.
SPLIT_CASES = [(8, 32, 128, 768), (1, 1, 5, 511), (1, 1, 5, 0), (1, 0, 5, 600), (1, 1, 3, 600),
               (2, 1, 5, 1000), (1, 1, 64, 10 ** 6), (1, 19, 64, 5130), (1, 16, 128, 50257),
               (3, 32, 128, 768), (1, 32, 128, 3072), (8, 64, 1, 2 ** 31 + 5)]


@pytest.mark.parametrize("case", SPLIT_CASES, ids=lambda c: "x".join(map(str, c)))
def test_split_plan_is_the_launchers(case):
    """_cuda.gram.split (the models' and the tests' plan) is the launcher's:
    the workspace it asks for is a range's partial Grams each, and every
    range holds values (the last the rest)."""
    from ncdp_fast import _C_emu as C
    from ncdp_fast._cuda import gram
    count, n, T, d = case
    nt = -(-T // 64)
    jobs = count * n * nt * (nt + 1) // 2
    assert gram.jobs(count, n, T) == jobs
    ranges, depth = gram.split(jobs, d)
    want = -(-8 * ranges * count * n * T * T // 256) * 256 if ranges > 1 else 0
    assert C.gram_rows_f64_workspace_bytes(count, n, T, d) == want
    assert ranges * jobs <= gram.TARGET_SMS * 3 or ranges == 1 or d > 2 ** 30
    assert depth % 16 == 0 or ranges == 1
    assert (ranges - 1) * depth < d <= ranges * depth or ranges == 1
    assert depth <= 2 ** 30
    if case == (1, 19, 64, 5130):
        assert (ranges, depth) == (19, 272)
    if case == (1, 16, 128, 50257):        # GPT-2's tied head, one launch: 8 ranges
        assert ranges == 8
    if case == (8, 64, 1, 2 ** 31 + 5):
        assert ranges == 3


@pytest.mark.parametrize("shape", [(1, 3, 600), (1, 5, 1000), (2, 66, 530)],
                         ids=lambda s: "x".join(map(str, s)))
def test_device_kernel_k_ranges(emulated, shape):
    """A launch of few jobs splits d into ranges whose partial Grams a second
    kernel adds in range order: every entry within gamma_d of the reference,
    exactly symmetric, and the same bits on a second run."""
    from ncdp_fast._cuda import gram
    n, T, d = shape
    assert gram.split(gram.jobs(1, n, T), d)[0] > 1
    x = rows(shape, 9)
    t = torch.from_numpy(x)
    w = gram.grams_f64([t])
    assert_grams_close(w.numpy(), x)
    assert torch.equal(w, w.transpose(1, 2))
    assert torch.equal(w, gram.grams_f64([t]))
