"""Philox4x32-10 stream: known answers, backends agree, statistics, offsets."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import njit
from scipy import stats

import ncdp_fast as nf
from conftest import first_deep_pair
from ncdp_fast import reference as R
from ncdp_fast._numba import rng as nrng

# DESIGN.md's known-answer vectors (Random123's kat_vectors for philox4x32_10).
KAT = [
    ((0x00000000, 0x00000000), (0, 0, 0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF,) * 4, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0xA4093822, 0x299F31D0), (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("key,counter,expected", KAT)
def test_reference_known_answers(key, counter, expected):
    assert R.philox4x32_10(key, counter) == expected


@pytest.mark.parametrize("key,counter,expected", KAT)
def test_numba_block_known_answers(key, counter, expected):
    words = [np.uint64(v) for v in (*key, *counter)]
    assert tuple(int(w) for w in nrng.philox4x32_10(*words)) == expected


def test_stream_layout_is_key_seed_counter_block():
    seed, block = 0x299F31D0A4093822, 0x05A308D3243F6A88
    assert tuple(int(w) for w in nrng.philox_block(np.uint64(seed), np.uint64(block))) == \
        R.philox4x32_10((seed & 0xFFFFFFFF, seed >> 32), (block & 0xFFFFFFFF, block >> 32, 0, 0))
    assert np.array_equal(R.philox_words(4, seed=seed, offset=4 * block),
                          np.array(nrng.philox_block(np.uint64(seed), np.uint64(block)), np.uint32))


# The last four cross the kernel's tiles of 2048 pairs (4096 normals) with each
# of the four positions of the first normal in its Philox block (offset % 4).
CASES = [(0, 0, 1), (1, 3, 9), (7, 1, 2), (2**40 + 5, 2**33 + 1, 13), (2**64 - 1, 2**64 - 21, 21),
         (12345, 0, 257), (5, 1, 8193), (5, 2, 4095), (6, 3, 4097), (2**63 + 1, 2**62 + 4, 4099)]
# Around a pair that reads its deep block (one in 2048), in either half of its
# main block: from its first normal, its second, and a few pairs before it.
CASES += [(77, 2 * pair + lead, 9) for pair in (first_deep_pair(77, 0), first_deep_pair(77, 1))
          for lead in (-5, 0, 1)]


@pytest.mark.parametrize("seed,offset,count", CASES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_numba_matches_reference(seed, offset, count, dtype):
    got = nf.gaussian(count, seed=seed, offset=offset, dtype=dtype)
    ref = R.gaussian(count, seed=seed, offset=offset, dtype=np.float64)
    assert got.dtype == dtype
    if dtype == np.float32:
        # Both round the same float64 value once: within one float32 ulp.
        ulp = np.spacing(np.abs(ref).astype(np.float32)).astype(np.float64)
        assert np.all(np.abs(got.astype(np.float64) - ref) <= ulp)
    else:
        # Vectorized and scalar log/sin/cos may differ by a few ulp each; near a
        # zero of cos/sin the error is absolute, ~ulp(2 pi) * r with
        # r <= GAUSSIAN_TAIL_BOUND.
        eps = np.finfo(np.float64).eps
        assert np.allclose(got, ref, rtol=8 * eps,
                           atol=8 * eps * nf.GAUSSIAN_TAIL_BOUND * 2 * np.pi)


def test_offsets_index_one_stream():
    whole = nf.gaussian(1000, seed=99, offset=0, dtype=np.float64)
    for start, n in [(0, 1), (1, 7), (3, 100), (513, 487)]:
        part = nf.gaussian(n, seed=99, offset=start, dtype=np.float64)
        assert np.array_equal(part, whole[start:start + n])


@settings(max_examples=25, deadline=None)
@given(cuts=st.lists(st.integers(0, 140_000), max_size=4), offset=st.integers(0, 2**20),
       accumulate=st.booleans())
def test_any_split_of_a_range_gives_the_same_bits(cuts, offset, accumulate):
    """Ranks, chunks and the serial/parallel twins compute pieces of one range:
    every normal depends on its index alone, so the pieces equal the whole bit
    for bit (the whole, 140,001 normals, runs on the parallel twin; small pieces
    on the serial one)."""
    n = 140_001
    start = np.full(n, 0.25)           # accumulated into, or overwritten (NaN below)
    whole = start.copy()
    nrng.add_gaussian(whole, np.uint64(11), np.uint64(offset), 0.5, accumulate, 3.0)
    pieces = start.copy() if accumulate else np.full(n, np.nan)
    bounds = [0, *sorted(cuts), n]
    for a, b in zip(bounds, bounds[1:]):
        nrng.add_gaussian(pieces[a:b], np.uint64(11), np.uint64(offset + a), 0.5, accumulate, 3.0)
    assert np.array_equal(pieces, whole)


_SEGMENT_KINDS = [(np.float32, np.float32), (np.float64, np.float64), (np.float64, np.float32)]


@settings(max_examples=25, deadline=None)
@given(layout=st.lists(st.tuples(st.sampled_from(range(3)), st.integers(0, 300),
                                 st.integers(0, 2**64 - 301)), max_size=6),
       seed=st.integers(0, 2**64 - 1))
def test_segment_finishes_are_each_segments_own_and_the_references(layout, seed):
    """finish_gaussian_segments (the clip ops' one finish for every layer's
    sum): each segment's values are, bit for bit, add_gaussian's on that
    segment alone (in place, or a float64 sum finished into float32, rounded
    once), and within one rounding of the output (plus the float64 libm
    differences of test_numba_matches_reference) of the reference's."""
    scale, post = 0.5, 0.25
    rng = np.random.default_rng(len(layout))
    srcs = [rng.standard_normal(n).astype(_SEGMENT_KINDS[k][0]) for k, n, _ in layout]
    segments, outs = [], []
    for (k, n, offset), src in zip(layout, srcs):
        src = src.copy()
        dst = src if _SEGMENT_KINDS[k][0] == _SEGMENT_KINDS[k][1] else \
            np.full(n, np.nan, _SEGMENT_KINDS[k][1])
        segments.append((dst, src, offset))
        outs.append(dst)
    nrng.finish_gaussian_segments(segments, np.uint64(seed), scale, post)
    expected = R.finish_gaussian_segments([(x, off) for x, (_, _, off) in zip(srcs, layout)],
                                          seed=seed, scale=scale, post=post)
    eps = np.finfo(np.float64).eps
    for (k, n, offset), src, got, want in zip(layout, srcs, outs, expected):
        one = src.astype(np.float64)
        nrng.add_gaussian(one, np.uint64(seed), np.uint64(offset), scale, True, post)
        assert got.dtype == _SEGMENT_KINDS[k][1]
        assert np.array_equal(got, one.astype(got.dtype))
        tol = (np.finfo(got.dtype).eps / 2 * np.abs(want) + 8 * eps * np.abs(want)
               + 8 * eps * nf.GAUSSIAN_TAIL_BOUND * 2 * np.pi * scale * post)
        assert np.all(np.abs(got.astype(np.float64) - want) <= tol)


def test_branch_free_log_is_within_one_ulp_of_libm():
    """The kernel's log (fdlibm's algorithm without branches) on u1's whole
    range [2^-129, 1]: uniform mantissas at every binade, powers of two, 1 and
    the neighbours of sqrt(2)/2 and sqrt(2), where its reduction switches."""
    rng = np.random.default_rng(0)
    u = np.ldexp(rng.uniform(0.5, 1.0, 200_000), rng.integers(-128, 1, 200_000))
    edges = np.array([2.0**-129, 2.0**-128, 0.5, 1.0, np.sqrt(0.5), np.sqrt(2) / 2])
    u = np.concatenate([u, edges, np.nextafter(edges, 0), np.nextafter(edges[:-3], 2)])
    got = _log_all(u)
    want = np.log(u)
    assert np.all(np.abs(got - want) <= np.spacing(np.abs(want)))


@njit(cache=True)
def _log_all(u):
    out = np.empty_like(u)
    for i in range(u.shape[0]):
        out[i] = nrng.log_normal(u[i])
    return out


def test_disjoint_offsets_give_independent_draws():
    a = nf.gaussian(100_000, seed=5, offset=0, dtype=np.float64)
    b = nf.gaussian(100_000, seed=5, offset=100_000, dtype=np.float64)
    c = nf.gaussian(100_000, seed=6, offset=0, dtype=np.float64)
    assert len(np.intersect1d(a, b)) == 0 and len(np.intersect1d(a, c)) == 0
    # Correlation of independent N(0,1) samples: sd 1/sqrt(n); |r| > 5.3 sd has
    # probability 1e-7 (false-alarm rate of this assertion, per pair).
    for u, v in ((a, b), (a, c)):
        assert abs(np.corrcoef(u, v)[0, 1]) < 5.3 / np.sqrt(len(u))


def test_moments_and_ks_on_a_million_draws():
    z = nf.gaussian(10**6, seed=2024, offset=17, dtype=np.float64)
    n = z.size
    # Each test below has false-alarm rate 1e-6 under the null (fixed seed: the
    # outcome is deterministic; the rate says how surprising a failure would be).
    assert abs(z.mean()) < 4.89 / np.sqrt(n)
    var = z.var(ddof=1)
    lo, hi = stats.chi2.ppf([0.5e-6, 1 - 0.5e-6], n - 1) / (n - 1)
    assert lo < var < hi
    assert stats.kstest(z, "norm").pvalue > 1e-6
    # The radius uniform, at least 2^-129, truncates at GAUSSIAN_TAIL_BOUND ~ 13.37 (a
    # hard bound: this cannot fail by chance).
    assert np.max(np.abs(z)) <= nf.GAUSSIAN_TAIL_BOUND


def test_gaussian_returns_like_type():
    torch = pytest.importorskip("torch")
    t = nf.gaussian(5, seed=3, like=torch.zeros(1))
    assert isinstance(t, torch.Tensor) and t.dtype == torch.float32
    assert np.array_equal(t.numpy(), nf.gaussian(5, seed=3))
    # torch's dtypes name the same results (torch.float32 raised NumPy's
    # "Cannot interpret 'torch.float32' as a data type", the seventh audit).
    for tdt, ndt in ((torch.float32, np.float32), (torch.float64, np.float64)):
        t = nf.gaussian(5, seed=3, dtype=tdt, like=torch.zeros(1))
        assert t.dtype == tdt and np.array_equal(t.numpy(), nf.gaussian(5, seed=3, dtype=ndt))
        assert nf.gaussian(5, seed=3, dtype=tdt).dtype == ndt
    for bad in (torch.bfloat16, torch.int32, "abc", None):     # None read as float64
        with pytest.raises(TypeError, match=r"dtype: expected float32 or float64 \(NumPy's or "
                                            r"torch's\), got"):
            nf.gaussian(5, seed=3, dtype=bad)


@pytest.mark.parametrize("kwargs,err", [
    (dict(count=-1, seed=1), ValueError),
    (dict(count=3, seed=-1), ValueError),
    (dict(count=3, seed=2**64), ValueError),
    (dict(count=3, seed=1.5), TypeError),
    (dict(count=3, seed=1, offset=2**64 - 2), ValueError),
    (dict(count=3, seed=1, dtype=np.float16), TypeError),
    (dict(count=3, seed=True), TypeError),
])
def test_gaussian_bad_input(kwargs, err):
    count = kwargs.pop("count")
    with pytest.raises(err):
        nf.gaussian(count, **kwargs)


def test_gaussian_empty():
    assert nf.gaussian(0, seed=1).shape == (0,)


@pytest.mark.gpu
@pytest.mark.parametrize("seed,offset,count", CASES + [(3, 5, 100_003)])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_cuda_matches_reference(require_cuda, seed, offset, count, dtype):
    import torch
    like = torch.zeros(1, device=require_cuda)
    got = nf.gaussian(count, seed=seed, offset=offset, dtype=dtype, like=like)
    assert got.device.type == require_cuda.type
    cpu = nf.gaussian(count, seed=seed, offset=offset, dtype=dtype)
    ref64 = nf.gaussian(count, seed=seed, offset=offset, dtype=np.float64)
    if dtype == "float32":
        ulp = np.spacing(np.abs(ref64).astype(np.float32)).astype(np.float64)
        assert np.all(np.abs(got.cpu().numpy().astype(np.float64) - ref64) <= ulp)
    else:
        assert np.allclose(got.cpu().numpy(), cpu, rtol=8 * np.finfo(np.float64).eps, atol=1e-300)
