"""Op 1 (fused per-sample clipping with noise) against ncdp_fast.reference, properties,
reproducibility, statistics and bad input, on the CPU backend (the GPU versions
of the same comparisons are in test_gpu.py)."""
import contextlib
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from scipy import stats

import ncdp_fast as nf
from ncdp_fast import reference as R
from ncdp_fast._numba.clip import NUM_SLABS

from conftest import assert_within_sum_bound, gamma, unit_roundoff

DTYPES = [np.float32, np.float64]
_nothing = contextlib.nullcontext
# Empty, one row, p = 1, and sizes that are multiples of no tile or slab count.
DENSE_SHAPES = [(0, 5), (1, 1), (1, 7), (3, 1), (5, 33), (17, 129), (65, 1000)]


def _rows(rng, shape, dtype, scale=3.0):
    g = rng.standard_normal(shape) * scale
    if shape[0] > 2:
        g[1] = 0.0          # zero row: factor 1, contributes nothing
        g[2] *= 1e-3        # well inside the ball: unclipped
    return g.astype(dtype)


def _dense_bound_terms(g, factors, noise_std, seed, offset):
    """sum_i |f_i g_ij| + |noise_j|: what the rounding bound scales with."""
    noise = noise_std * R.gaussian(g.shape[1], seed=seed, offset=offset, dtype=np.float64)
    return np.abs(factors[:, None] * g.astype(np.float64)).sum(axis=0) + np.abs(noise)


def _slab_terms(B):
    # Per-slab recursive sum of ceil(B/slabs) rows (grouped by four), then the
    # slabs and the noise are added in float64: n = rows per slab + 2 covers the
    # float32 factor cast and the final scaling.
    return -(-B // NUM_SLABS) + 2 if B else 2


@pytest.mark.parametrize("shape", DENSE_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_dense_matches_reference(shape, dtype, reduction):
    rng = np.random.default_rng(sum(shape))
    g = _rows(rng, shape, dtype)
    kw = dict(max_norm=1.5, noise_multiplier=0.7, seed=11, offset=5, reduction=reduction,
              expected_batch_size=4.0 if reduction == "mean" else None)
    res = nf.clip_and_noise(g, **kw)
    ref, ref_norms = R.clip_and_noise(g, **kw)
    assert res.grad.dtype == dtype and res.grad.shape == (shape[1],)
    assert res.norms.dtype == np.float64 and res.norms.shape == (shape[0],)
    # Norms: float64 sums of p squares, both sides.
    np.testing.assert_allclose(res.norms, ref_norms, rtol=4 * shape[1] * 1.2e-16, atol=0)
    factors, _ = R.clip_factors(ref_norms ** 2, 1.5)
    terms = _dense_bound_terms(g, factors, 0.7 * 1.5, 11, 5) / (4.0 if reduction == "mean" else 1)
    assert_within_sum_bound(res.grad, ref, terms, _slab_terms(shape[0]), dtype, "dense grad")
    assert res.num_clipped == int(np.sum(ref_norms > 1.5))
    assert (res.seed, res.offset, res.draws, res.next_offset) == (11, 5, shape[1], 5 + shape[1])


def test_dense_empty_batch_is_pure_noise():
    res = nf.clip_and_noise(np.zeros((0, 6), np.float32), max_norm=2.0, noise_multiplier=0.5,
                            seed=3)
    expected = (1.0 * R.gaussian(6, seed=3, dtype=np.float64)).astype(np.float32)
    np.testing.assert_allclose(res.grad, expected, rtol=2e-7)
    assert res.norms.shape == (0,) and res.num_clipped == 0


LINEAR_SHAPES = [
    # (B, T or None, d, K): 2-D, Gram (2T^2 <= Kd) and direct (2T^2 > Kd) sequences,
    # one row, empty batch, d = 1 or K = 1.
    (0, None, 4, 3), (1, None, 1, 1), (7, None, 13, 5), (33, None, 70, 11),
    (5, 3, 9, 4), (6, 9, 5, 3), (1, 1, 3, 2), (4, 17, 31, 7), (0, 4, 5, 2), (3, 0, 4, 2),
]


def _linear_inputs(shape, dtype, seed=0):
    B, T, d, K = shape
    rng = np.random.default_rng(seed + B + d)
    sa = (B, d) if T is None else (B, T, d)
    sg = (B, K) if T is None else (B, T, K)
    return (rng.standard_normal(sa) * 2).astype(dtype), (rng.standard_normal(sg)).astype(dtype)


@pytest.mark.parametrize("shape", LINEAR_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
def test_linear_matches_reference(shape, dtype, bias):
    a, g = _linear_inputs(shape, dtype)
    kw = dict(max_norm=2.0, noise_multiplier=0.3, bias=bias, seed=2, offset=9)
    res = nf.clip_and_noise_linear(a, g, **kw)
    gw, gb, norms = R.clip_and_noise_linear(a, g, **kw)
    B, T, d, K = shape
    T = 1 if T is None else T
    assert res.grad_weight.shape == (K, d) and res.grad_weight.dtype == dtype
    assert (res.grad_bias is None) == (not bias)
    # Norm identities vs the explicit per-sample matrix, both in float64: the Gram
    # form sums T^2 signed terms of size |a_t.a_s||g_t.g_s| (cancellation is
    # possible), so the bound is relative to those absolute terms.
    flat = R.per_sample_linear_grads(a, g, bias=bias)
    a3 = a.reshape(B, T, d).astype(np.float64)
    g3 = g.reshape(B, T, K).astype(np.float64)
    abs_terms = np.einsum("bts,bts->b", np.abs(a3 @ a3.transpose(0, 2, 1)),
                          np.abs(g3 @ g3.transpose(0, 2, 1))) + np.abs(flat ** 2).sum(axis=1)
    n_norm = T * T + T * max(d, K) + K * d
    assert np.all(np.abs(res.norms ** 2 - norms ** 2)
                  <= 2 * n_norm * np.finfo(np.float64).eps * abs_terms + 1e-300)
    factors, _ = R.clip_factors(norms ** 2, 2.0)
    noise = 0.6 * R.gaussian(K * d + K, seed=2, offset=9, dtype=np.float64)
    w_terms = np.abs(factors[:, None] * flat).sum(axis=0) + np.abs(noise[:flat.shape[1]])
    # GEMM over B*T rows in the input precision, factor applied in that precision.
    n = B * T + 3
    assert_within_sum_bound(res.grad_weight.ravel(), gw.ravel(), w_terms[:K * d], n, dtype, "weight")
    if bias:
        assert_within_sum_bound(res.grad_bias, gb, w_terms[K * d:], n, dtype, "bias")
    assert res.draws == K * d + (K if bias else 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_layers_share_one_factor(dtype):
    rng = np.random.default_rng(4)
    dense = (rng.standard_normal((9, 3, 4)) * 2).astype(dtype)
    a, g = _linear_inputs((9, 5, 6, 3), dtype)
    a2, g2 = _linear_inputs((9, None, 7, 2), dtype, seed=1)
    kw = dict(max_norm=1.0, noise_multiplier=0.4, seed=8, offset=3)
    res = nf.clip_and_noise_layers([dense, (a, g), (a2, g2, False)], **kw)
    blocks = [dense.reshape(9, -1), R.per_sample_linear_grads(a, g, True),
              R.per_sample_linear_grads(a2, g2, False)]
    ref, norms = R.clip_and_noise_layers([dense, (a, g), (a2, g2, False)], **kw)
    np.testing.assert_allclose(res.norms, norms, rtol=1e-12)
    factors, _ = R.clip_factors(norms ** 2, 1.0)
    noise = 0.4 * R.gaussian(sum(b.shape[1] for b in blocks), seed=8, offset=3, dtype=np.float64)
    terms = np.abs(factors[:, None] * np.concatenate(blocks, axis=1)).sum(axis=0) + np.abs(noise)
    got = np.concatenate([res.grads[0].ravel(), res.grads[1][0].ravel(), res.grads[1][1],
                          res.grads[2][0].ravel()])
    assert res.grads[0].shape == (3, 4) and res.grads[2][1] is None
    assert_within_sum_bound(got, np.concatenate(ref), terms, 9 * 5 + 3, dtype, "layers")
    assert res.draws == 12 + 3 * 6 + 3 + 2 * 7


def test_released_blocks_give_the_same_step_and_are_freed():
    """release_blocks=True forms the sums in another order (most memory freed
    first) and drops each block: the same gradients, norms and stream range bit
    for bit, the caller's list emptied, and a block's arrays freed once the
    caller drops its own references (the op keeps none).  Freed means the
    memory: each operand of the big pair wraps a NumPy array that every view
    of it (the op's reshapes, its NumPy operands) keeps alive, so a weak
    reference to that array dies only with the last view.  (A weak reference
    to the caller's tensor object died with the caller's list while the op
    still held every pair's operands until it returned: the BERT-base step's
    peak grew by all its private gradients, 1.11x the non-private peak on the
    H200.)"""
    import gc
    import weakref
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(5)

    seen = []                 # during the ghost block's sum: was the big pair freed?
    memory = []               # weak references to the big pair's arrays

    def blocks():
        g = torch.from_numpy(rng.standard_normal((6, 40)))
        sq = (g * g).sum(1)

        def clipped_sum(f):
            gc.collect()
            seen.append(bool(memory) and all(w() is None for w in memory))
            return (g * f[:, None]).sum(0).reshape(8, 5)
        ghost = nf.GhostBlock(sq, clipped_sum, (8, 5), 40, dtype=torch.float64)
        arrays = [rng.standard_normal((6, 9, 30)), rng.standard_normal((6, 9, 2))]
        big = tuple(torch.from_numpy(x) for x in arrays)   # frees more than it allocates
        probes = [weakref.ref(x) for x in arrays]
        return [ghost, torch.from_numpy(rng.standard_normal((6, 3, 4))), big], probes
    kw = dict(max_norm=1.0, noise_multiplier=0.6, reduction="mean", expected_batch_size=6.0)
    first, _ = blocks()
    ref = nf.clip_and_noise_layers(first, seed=nf.NoiseStream(9, 0), **kw)
    rng = np.random.default_rng(5)
    second, probes = blocks()
    memory.extend(probes)
    with pytest.warns(nf.NoiseReuseWarning):         # the replay is the point
        res = nf.clip_and_noise_layers(second, seed=nf.NoiseStream(9, 0), release_blocks=True,
                                       **kw)
    assert second == [None, None, None]
    # The big pair frees the most: formed first and its memory let go before
    # the ghost block's sum is allocated.
    assert seen == [False, True]
    assert torch.equal(res.norms, ref.norms) and (res.offset, res.draws) == (ref.offset, ref.draws)
    assert torch.equal(res.grads[0], ref.grads[0]) and torch.equal(res.grads[1], ref.grads[1])
    assert all(torch.equal(x, y) for x, y in zip(res.grads[2], ref.grads[2]))


def test_layers_noise_ranges_are_disjoint_and_in_order():
    zeros = [np.zeros((4, 5)), (np.zeros((4, 3)), np.zeros((4, 2))), np.zeros((4, 2, 2))]
    res = nf.clip_and_noise_layers(zeros, max_norm=1.0, noise_multiplier=1.0, seed=77, offset=10)
    stream = nf.gaussian(5 + 6 + 2 + 4, seed=77, offset=10, dtype=np.float64)
    got = np.concatenate([res.grads[0], res.grads[1][0].ravel(), res.grads[1][1],
                          res.grads[2].ravel()])
    np.testing.assert_allclose(got, stream, rtol=1e-15)


# ------------------------------------------------------------------- properties

finite64 = st.floats(-1e6, 1e6, allow_nan=False, width=64)


@settings(max_examples=60, deadline=None)
@given(g=hnp.arrays(np.float64, hnp.array_shapes(min_dims=2, max_dims=2, min_side=1, max_side=12),
                    elements=finite64),
       max_norm=st.floats(1e-3, 1e3))
def test_property_dense_sensitivity_at_most_c(g, max_norm):
    """Removing any one sample moves the noise-free sum by at most C: the DP
    sensitivity the noise is calibrated to (add/remove neighbours)."""
    full = nf.clip_and_noise(g, max_norm=max_norm, noise_multiplier=0.0, seed=0).grad
    scale = np.abs(g).sum() * 1e-12 + 1e-300   # float64 summation slack
    for i in range(g.shape[0]):
        rest = nf.clip_and_noise(np.delete(g, i, axis=0), max_norm=max_norm,
                                 noise_multiplier=0.0, seed=0).grad
        assert np.linalg.norm(full - rest) <= max_norm * (1 + 1e-6) + scale


@settings(max_examples=60, deadline=None)
@given(row=hnp.arrays(np.float32, hnp.array_shapes(min_dims=1, max_dims=1, min_side=1,
                                                    max_side=300),
                      elements=st.floats(-2.0**50, 2.0**50, allow_nan=False, width=32)),
       max_norm=st.floats(1e-3, 1e3))
def test_property_single_clipped_row_norm_at_most_c(row, max_norm):
    out = nf.clip_and_noise(row[None, :], max_norm=max_norm, noise_multiplier=0.0, seed=0).grad
    assert np.linalg.norm(out.astype(np.float64)) <= max_norm * (1 + 1e-6)


@settings(max_examples=40, deadline=None)
@given(B=st.integers(1, 6), T=st.integers(1, 5), d=st.integers(1, 6), K=st.integers(1, 6),
       seed=st.integers(0, 2**32), bias=st.booleans(), max_norm=st.floats(1e-2, 1e2))
def test_property_linear_sensitivity_at_most_c(B, T, d, K, seed, bias, max_norm):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((B, T, d)) * rng.uniform(0.01, 100)
    g = rng.standard_normal((B, T, K)) * rng.uniform(0.01, 100)
    kw = dict(max_norm=max_norm, noise_multiplier=0.0, bias=bias, seed=0)

    def flat(r):
        return np.concatenate([r.grad_weight.ravel()] + ([r.grad_bias] if bias else []))
    full = flat(nf.clip_and_noise_linear(a, g, **kw))
    for i in range(B):
        rest = flat(nf.clip_and_noise_linear(np.delete(a, i, 0), np.delete(g, i, 0), **kw))
        assert np.linalg.norm(full - rest) <= max_norm * (1 + 1e-6)


# ------------------------------------------------------------- reproducibility

def test_same_seed_offset_same_output_bitwise_any_thread_count():
    import numba
    rng = np.random.default_rng(1)
    g = rng.standard_normal((37, 501)).astype(np.float32)
    before = numba.get_num_threads()
    outs = []
    try:
        for threads in (1, before):
            numba.set_num_threads(threads)
            # Deliberate reuse of (seed, offset): the allocator must say so.
            with pytest.warns(nf.NoiseReuseWarning) if outs else _nothing():
                outs.append(nf.clip_and_noise(g, max_norm=1.0, noise_multiplier=1.0, seed=5,
                                              offset=123).grad)
    finally:
        numba.set_num_threads(before)
    assert np.array_equal(outs[0], outs[1])
    with pytest.warns(nf.NoiseReuseWarning):     # overlaps draws 124..623 of the runs above
        other = nf.clip_and_noise(g, max_norm=1.0, noise_multiplier=1.0, seed=5, offset=124).grad
    assert not np.array_equal(outs[0], other)


def test_seed_defaults_to_os_randomness():
    g = np.zeros((2, 3))
    seeds = {nf.clip_and_noise(g, max_norm=1.0, noise_multiplier=1.0).seed for _ in range(4)}
    assert len(seeds) == 4


def test_noise_has_stated_std():
    # Zero gradients: the output is sigma*C*xi / D exactly.  Chi-square test of
    # the sample variance, two-sided false-alarm rate 1e-6 (fixed seed).
    p, sigma, C, D = 200_000, 1.3, 0.7, 8.0
    out = nf.clip_and_noise(np.zeros((3, p)), max_norm=C, noise_multiplier=sigma, seed=31,
                            reduction="mean", expected_batch_size=D).grad
    std = sigma * C / D
    lo, hi = stats.chi2.ppf([0.5e-6, 1 - 0.5e-6], p - 1) / (p - 1)
    assert lo < out.var(ddof=1) / std ** 2 < hi
    assert abs(out.mean()) < 4.89 * std / np.sqrt(p)


# ------------------------------------------------------------------ non-finite

def test_nonfinite_rows_raise_naming_rows():
    g = np.ones((5, 3))
    g[1, 2] = np.nan
    g[3, 0] = np.inf
    with pytest.raises(ValueError, match=r"rows \[1, 3\]"):
        nf.clip_and_noise(g, max_norm=1.0, noise_multiplier=0.0, seed=0)


@pytest.mark.parametrize("B", [5, 11])  # 11: grouped rows and a tail in one slab
def test_nonfinite_rows_dropped_with_zero_policy(B):
    g = np.full((B, 3), 0.1)
    g[1, 2] = np.nan
    g[3, 0] = -np.inf
    res = nf.clip_and_noise(g, max_norm=10.0, noise_multiplier=0.0, seed=0, nan_policy="zero")
    assert res.num_nonfinite == 2
    np.testing.assert_allclose(res.grad, np.full(3, 0.1 * (B - 2)))
    a = np.ones((4, 2, 3))
    a[2, 1, 1] = np.nan
    r = nf.clip_and_noise_linear(a, np.ones((4, 2, 2)), max_norm=100.0, noise_multiplier=0.0,
                                 seed=0, nan_policy="zero")
    assert r.num_nonfinite == 1 and np.all(np.isfinite(r.grad_weight))
    np.testing.assert_allclose(r.grad_weight, np.full((2, 3), 6.0))
    assert np.isnan(a[2, 1, 1])  # the caller's array is untouched


# ------------------------------------------------------------------- bad input

@pytest.mark.parametrize("kwargs,err,match", [
    (dict(max_norm=0.0), ValueError, "max_norm"),
    (dict(max_norm=-1.0), ValueError, "max_norm"),
    (dict(max_norm=float("inf")), ValueError, "max_norm"),
    (dict(max_norm=float("nan")), ValueError, "max_norm"),
    (dict(max_norm="1"), TypeError, "max_norm"),
    (dict(noise_multiplier=-0.1), ValueError, "noise_multiplier"),
    (dict(reduction="avg"), ValueError, "reduction"),
    (dict(reduction="mean"), ValueError, "expected_batch_size"),
    (dict(reduction="mean", expected_batch_size=0), ValueError, "expected_batch_size"),
    # Not used by a sum, still checked (the sixth audit: 0, -1, NaN went through).
    (dict(expected_batch_size=0), ValueError, "expected_batch_size"),
    (dict(expected_batch_size=float("nan")), ValueError, "expected_batch_size"),
    (dict(expected_batch_size=True), TypeError, "expected_batch_size"),
    (dict(nan_policy="ignore"), ValueError, "nan_policy"),
    (dict(seed=-3), ValueError, "seed"),
    (dict(offset=2**64 - 2), ValueError, "offset"),
])
def test_dense_bad_arguments(kwargs, err, match):
    base = dict(max_norm=1.0, noise_multiplier=1.0, seed=0)
    base.update(kwargs)
    with pytest.raises(err, match=match):
        nf.clip_and_noise(np.ones((2, 3)), **base)


@pytest.mark.parametrize("grads,err,match", [
    (np.ones(3), ValueError, r"grads: expected shape \(B, p\)"),
    (np.ones((2, 3, 4)), ValueError, "grads"),
    (np.ones((2, 3), dtype=np.int64), TypeError, "grads: expected float32 or float64"),
    (np.ones((2, 3), dtype=np.float16), TypeError, "float16"),
    ([[1.0, 2.0]], TypeError, "grads: expected an array"),
])
def test_dense_bad_arrays(grads, err, match):
    with pytest.raises(err, match=match):
        nf.clip_and_noise(grads, max_norm=1.0, noise_multiplier=1.0, seed=0)


@pytest.mark.parametrize("a,g,match", [
    (np.ones((3, 4)), np.ones((2, 5)), "batch size 2 does not match"),
    (np.ones((3, 2, 4)), np.ones((3, 5, 5)), "sequence length"),
    (np.ones((3, 4)), np.ones((3, 2, 5)), "expected shapes"),
    (np.ones(4), np.ones(4), "expected shapes"),
])
def test_linear_bad_shapes(a, g, match):
    with pytest.raises(ValueError, match=match):
        nf.clip_and_noise_linear(a, g, max_norm=1.0, noise_multiplier=1.0, seed=0)


def test_linear_bias_flag_must_be_a_bool():
    """bias='x' or 2 passed as true (the sixth audit)."""
    for bias in ("x", 2, None):
        with pytest.raises(TypeError, match="bias: expected a bool"):
            nf.clip_and_noise_linear(np.ones((2, 3)), np.ones((2, 1)), max_norm=1.0,
                                     noise_multiplier=0.0, bias=bias)


def test_linear_mixed_dtypes_refused():
    with pytest.raises(TypeError, match="backprops"):
        nf.clip_and_noise_linear(np.ones((3, 4)), np.ones((3, 2), np.float32), max_norm=1.0,
                                 noise_multiplier=1.0, seed=0)


def test_layers_bad_input():
    with pytest.raises(TypeError, match="layers"):
        nf.clip_and_noise_layers([], max_norm=1.0, noise_multiplier=1.0)
    with pytest.raises(ValueError, match=r"layers\[1\]: batch size"):
        nf.clip_and_noise_layers([np.ones((3, 2)), np.ones((4, 2))], max_norm=1.0,
                                 noise_multiplier=1.0)


def test_cuda_array_without_cuda_build_is_refused_clearly(monkeypatch):
    import ncdp_fast._backend as be
    monkeypatch.setattr(be, "CUDA_COMPILED", False)

    class FakeCuda:
        __cuda_array_interface__ = {"shape": (2, 3), "typestr": "<f4", "data": (0, False),
                                    "version": 3}
        shape = (2, 3)
        dtype = np.dtype(np.float32)
        device = type("Device", (), {"id": 0})()
    FakeCuda.__module__ = "cupy._core.core"
    with pytest.raises(RuntimeError, match="built without CUDA"):
        nf.clip_and_noise(FakeCuda(), max_norm=1.0, noise_multiplier=1.0, seed=0)


# ------------------------------------------------------------------ array types

def test_torch_cpu_in_torch_out():
    torch = pytest.importorskip("torch")
    g = torch.randn(6, 5, dtype=torch.float64)
    res = nf.clip_and_noise(g, max_norm=1.0, noise_multiplier=0.5, seed=4)
    assert isinstance(res.grad, torch.Tensor) and isinstance(res.norms, torch.Tensor)
    # The same noise on purpose (explicit offset 0 again): the allocator warns.
    with pytest.warns(nf.NoiseReuseWarning):
        ref = nf.clip_and_noise(g.numpy(), max_norm=1.0, noise_multiplier=0.5, seed=4, offset=0)
        assert np.array_equal(res.grad.numpy(), ref.grad)
        # Non-contiguous input: copied once, same answer.
        res_t = nf.clip_and_noise(g.t().contiguous().t(), max_norm=1.0, noise_multiplier=0.5,
                                  seed=4, offset=0)
        assert np.array_equal(res_t.grad.numpy(), ref.grad)
        # requires_grad tensors are read, not differentiated through.
        res_rg = nf.clip_and_noise(g.clone().requires_grad_(), max_norm=1.0,
                                   noise_multiplier=0.5, seed=4, offset=0)
    assert np.array_equal(res_rg.grad.numpy(), ref.grad)


def test_ghost_block_equals_the_dense_block_and_needs_a_dtype_alone():
    """A GhostBlock (norms + clipped-sum function) clips, scales and noises exactly as
    the dense per-sample block it describes, with grad_scale folded in."""
    rng = np.random.default_rng(3)
    g = rng.normal(size=(5, 4, 3)).astype(np.float32)
    sq = (g.astype(np.float64) ** 2).sum((1, 2))

    def clipped_sum(f):
        return np.einsum("b,bij->ij", f, g.astype(np.float64)).astype(np.float32)
    ghost = nf.GhostBlock(sq, clipped_sum, (4, 3), 12, dtype=np.float32)
    kw = dict(max_norm=1.5, noise_multiplier=0.7, seed=11, offset=0, reduction="mean",
              expected_batch_size=4.0)
    a = nf.clip_and_noise_layers([ghost], grad_scale=2.0, **kw)
    with pytest.warns(nf.NoiseReuseWarning):
        b = nf.clip_and_noise_layers([2.0 * g], **kw)
    np.testing.assert_allclose(a.norms, b.norms, rtol=1e-15)
    np.testing.assert_allclose(a.grads[0], b.grads[0], rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match=r"layers\[0\].dtype"):
        nf.clip_and_noise_layers([nf.GhostBlock(sq, clipped_sum, (4, 3), 12)], max_norm=1.0,
                                 noise_multiplier=0.0)
    with pytest.raises(ValueError, match="grad_scale"):
        nf.clip_and_noise_layers([g], max_norm=1.0, noise_multiplier=0.0, grad_scale=0.0)


def test_a_ghost_block_with_gemm_sizes_is_told_whether_to_rebalance():
    """A GhostBlock whose sum is one clipped GEMM hands the op its operands'
    per-sample squared norms (gemm_sizes); the op decides the GEMM's
    rebalancing from them with the linear pairs' (_balance, read in its one
    transfer) and passes it as ``balance=``: "no" for ordinary data, "yes"
    where a factor takes the scaled operand under 2^-40.  A malformed sizes
    array is refused by name."""
    rng = np.random.default_rng(5)
    B, T, d, K = 3, 2, 4, 6
    a = rng.normal(size=(B, T, d))
    g = rng.normal(size=(B, T, K))
    per_sample = np.einsum("btk,btd->bkd", g, a)
    sq = (per_sample ** 2).sum((1, 2))
    sizes = np.stack([(a ** 2).sum((1, 2)), (g ** 2).sum((1, 2))], axis=1)
    told = []

    def clipped_sum(f, balance=True):
        told.append(balance)
        return np.einsum("b,bkd->kd", f, per_sample)

    def run(max_norm, gemm_sizes):
        told.clear()
        block = nf.GhostBlock(sq, clipped_sum, (K, d), K * d, dtype=np.float64,
                              gemm_sizes=gemm_sizes)
        out = nf.clip_and_noise_layers([block], max_norm=max_norm, noise_multiplier=0.0)
        return out, list(told)
    out, seen = run(0.5 * np.sqrt(sq.min()), (sizes, T, d, K))
    assert seen == [False] and out.num_clipped == B
    f = np.minimum(1.0, 0.5 * np.sqrt(sq.min()) / np.sqrt(sq))
    np.testing.assert_allclose(out.grads[0], np.einsum("b,bkd->kd", f, per_sample), rtol=1e-14)
    _, seen = run(2.0 ** -45 * np.sqrt(sq.min()), (sizes, T, d, K))
    assert seen == [True]
    _, seen = run(2.0 ** -45, None)          # no sizes: the block's own default
    assert seen == [True]
    for bad in (sizes[:2], sizes.astype(np.float32), sizes.reshape(-1)):
        with pytest.raises(ValueError, match=r"layers\[0\]\.gemm_sizes\[0\]"):
            run(1.0, (bad, T, d, K))


def test_ghost_blocks_returning_one_array_are_refused():
    """The op adds each ghost block's noise in place to what its clipped_sum
    returns, after every block's sum: two blocks handing back one array (or
    overlapping views of one) would have it noised and divided twice, so the
    call is refused naming both; blocks of their own arrays pass."""
    sq = np.ones(3)
    shared = np.zeros(8, np.float32)

    def views(lo, hi):
        return lambda f: shared[lo:hi].reshape(2, (hi - lo) // 2)
    kw = dict(max_norm=1.0, noise_multiplier=0.5, seed=1)
    blocks = [nf.GhostBlock(sq, views(0, 4), (2, 2), 4, dtype=np.float32),
              np.ones((3, 2), np.float32),
              nf.GhostBlock(sq, views(2, 6), (2, 2), 4, dtype=np.float32)]
    with pytest.raises(ValueError, match=r"layers\[0\].clipped_sum\(\), "
                                         r"layers\[2\].clipped_sum\(\): expected arrays of "
                                         "their own"):
        nf.clip_and_noise_layers(blocks, **kw)
    blocks[2] = nf.GhostBlock(sq, views(4, 8), (2, 2), 4, dtype=np.float32)
    res = nf.clip_and_noise_layers(blocks, **kw)
    assert np.all(res.grads[0] != 0) and np.all(res.grads[2] != 0)


@pytest.mark.parametrize("shape", [(0,), (0, 5), (1,), (3, 7), (768, 3072), ()])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_clip_results_are_64_byte_aligned(shape, dtype):
    """The CPU IOs' results (the clip op's GEMM outputs) start on a 64-byte
    boundary: a GEMM writing a 16-byte-aligned output ran 10-20% slower."""
    from ncdp_fast import _arrays
    for io in (_arrays.NumpyIO(), _arrays.TorchCpuIO()):
        out = io.empty(shape, dtype)
        assert out.shape == shape and out.dtype == dtype and out.flags.c_contiguous
        assert out.size == 0 or out.ctypes.data % 64 == 0
        out[...] = 1
        assert out.sum() == np.prod(shape)
    # and through the op: a linear layer's gradient
    import torch
    a, g = torch.randn(2, 5, 3), torch.randn(2, 5, 4)
    res = nf.clip_and_noise_linear(a, g, max_norm=1.0, noise_multiplier=0.0, seed=1)
    assert res.grad_weight.data_ptr() % 64 == 0


# ------------------------------------------------ buffers the op does not zero

LAYER_ORDERS = {
    "ghost first": ("ghost", "dense", "rank1", "seq"),
    "pair first": ("rank1", "dense", "ghost"),
    "dense first": ("dense", "seq", "rank1"),
    "sequence pair alone": ("seq",),
}


def poisoned_layers_run(order, dtype, to_device, empty_owner, monkeypatch):
    """(clean, poisoned) results of one clip_and_noise_layers call over the
    blocks named in ``order``, with grad_scale 3 (the factors' kernel forms
    the weights); the poisoned run's fresh buffers (``empty_owner.empty``)
    hold NaN (or all-ones bytes): the step's first norms are written into a
    buffer nobody zeroed, so a block that added to it instead would show."""
    rng = np.random.default_rng(len(order))
    B = 5
    dense = rng.standard_normal((B, 2, 3)).astype(dtype)
    gh = rng.standard_normal((B, 4)).astype(dtype)
    a1, g1 = _linear_inputs((B, None, 7, 3), dtype, seed=1)
    a2, g2 = _linear_inputs((B, 3, 6, 4), dtype, seed=2)
    gh_dev = to_device(gh)

    def clipped_sum(f):
        out = (f[:, None] * gh_dev.astype(np.float64) if isinstance(gh_dev, np.ndarray) else
               f[:, None] * gh_dev.double()).sum(0)
        return out.astype(dtype) if isinstance(out, np.ndarray) else out.to(gh_dev.dtype)
    blocks = dict(
        ghost=lambda: nf.GhostBlock(to_device((gh.astype(np.float64) ** 2).sum(1)), clipped_sum,
                                    (4,), 4, dtype=dtype),
        dense=lambda: to_device(dense),
        rank1=lambda: (to_device(a1), to_device(g1)),
        seq=lambda: (to_device(a2), to_device(g2)))
    kw = dict(max_norm=1.0, noise_multiplier=0.5, seed=5, offset=0, grad_scale=3.0,
              reduction="mean", expected_batch_size=4.0)
    clean = nf.clip_and_noise_layers([blocks[n]() for n in order], **kw)
    real = empty_owner.empty

    def poisoned(self, shape, dt):
        out = real(self, shape, dt)
        if np.dtype(dt).kind == "f":
            out[...] = np.nan
        else:
            out[...] = np.iinfo(np.dtype(dt)).max
        return out
    monkeypatch.setattr(empty_owner, "empty", poisoned)
    with pytest.warns(nf.NoiseReuseWarning):        # the same draws again, on purpose
        dirty = nf.clip_and_noise_layers([blocks[n]() for n in order], **kw)
    monkeypatch.undo()
    return clean, dirty


def _flat(grads):
    out = []
    for g in grads:
        out += [x for x in (g if isinstance(g, tuple) else (g,)) if x is not None]
    return [np.asarray(x.cpu() if hasattr(x, "cpu") else x) for x in out]


@pytest.mark.parametrize("order", sorted(LAYER_ORDERS))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_first_norms_need_no_zeroed_buffer(order, dtype, monkeypatch):
    from ncdp_fast import _arrays
    clean, dirty = poisoned_layers_run(LAYER_ORDERS[order], dtype, lambda x: x,
                                       _arrays.NumpyIO, monkeypatch)
    assert np.all(np.isfinite(clean.norms))
    assert np.array_equal(clean.norms, dirty.norms)
    for x, y in zip(_flat(clean.grads), _flat(dirty.grads)):
        assert np.array_equal(x, y)


@pytest.mark.parametrize("scale", [1.0, 3.0, 0.1])
@pytest.mark.parametrize("with_spread", [False, True])
def test_numba_clip_factors_fold_the_grad_scale_as_the_device(scale, with_spread):
    """The CPU twin of the factors' kernel: the rule on s^2 sq and s spread,
    weights = factors s, each product rounded once -- the reference's factors
    on the scaled inputs, bit for bit, as tests/test_cuda_emulation.py holds
    the device kernel to."""
    from ncdp_fast._numba import clip as nclip
    sq = np.array([0.0, 0.25, 1.0, 4.0, 1e300, np.inf, np.nan, 1e-300, 7.0])
    spread = np.abs(np.random.default_rng(1).standard_normal(sq.size)) * 3
    terms, seq_len, unit, C = 37, 4, 2.0 ** -24, 2.0
    factors, norms, weights = (np.full(sq.size, -1.0) for _ in range(3))
    sq_in = sq.copy()
    nclip.clip_factors(sq_in, spread if with_spread else None, C, terms, seq_len, unit, factors,
                       norms, scale, weights)
    want, want_norms = R.clip_factors(sq * (scale * scale), C, unit=unit, terms=terms,
                                      spread=spread * scale if with_spread else None,
                                      seq_len=seq_len)
    assert np.array_equal(factors, want)
    assert np.array_equal(norms, want_norms, equal_nan=True)
    assert np.array_equal(weights, want * scale)
    assert np.array_equal(sq_in, sq, equal_nan=True)       # the caller's norms untouched


@pytest.mark.parametrize("scale", [1.0, 3.0])
@pytest.mark.parametrize("with_spread", [False, True])
@pytest.mark.parametrize("with_weights", [False, True])
def test_numba_clip_factor_groups_give_each_group_its_rule(scale, with_spread, with_weights):
    """The CPU twin of the groups' factors launch (per-layer clipping): each
    group's rows on its own rule, its factors and norms at its place of the
    output, what lies between left as it was -- the reference's, bit for bit,
    as tests/test_cuda_emulation.py holds the device kernel to."""
    from ncdp_fast._numba import clip as nclip
    base = np.array([0.0, 0.25, 1.0, 4.0, 1e300, np.inf, np.nan, 1e-300, 7.0])
    B = base.size
    rules = [(2.0, 37, 4), (0.5, 3, 1), (7.0, 1000, 0)]
    sq = np.stack([base * (1.0 + 0.5 * k) for k in range(len(rules))])
    spread = np.abs(np.random.default_rng(2).standard_normal(sq.shape)) * 3
    unit, stride = 2.0 ** -53, 2 * B + 3
    out = np.full(len(rules) * stride, -1.0)
    weights = np.full(sq.shape, -1.0) if with_weights else None
    nclip.clip_factor_groups(sq, spread if with_spread else None, rules, unit, out, stride,
                             scale, weights)
    out = out.reshape(len(rules), stride)
    want, want_norms, want_weights = R.clip_factor_groups(
        sq, rules, unit=unit, spread=spread if with_spread else None, scale=scale)
    assert np.array_equal(out[:, :B], want)
    assert np.array_equal(out[:, B:2 * B], want_norms, equal_nan=True)
    assert np.all(out[:, 2 * B:] == -1.0)
    if with_weights:
        assert np.array_equal(weights, want_weights)


# ------------------------------------- normalisation layers' affine gradients

# (B, rows, n, run): LayerNorm rows (run 0: one row, one value, no rows, n past
# one block's 256 threads, many rows) and GroupNorm groups (run > 0: one channel
# a group, one value a channel, runs past a warp's 32 lanes, more channels a
# group than a block has warps).
NORM_AFFINE_SHAPES = [(3, 5, 7, 0), (1, 1, 1, 0), (2, 0, 5, 0), (0, 3, 4, 0), (2, 40, 300, 0),
                      (2, 131, 33, 0),   # every row group over two unrolled steps, a partial tile
                      (2, 4, 12, 3), (2, 3, 6, 6), (1, 3, 64, 1), (2, 2, 600, 300),
                      (1, 2, 90, 2)]


def norm_affine_case(shape, dtype, seed=0):
    """x (offset from zero: the mean matters), g of shape (B, rows, n) =
    ``shape[:3]`` in ``dtype``."""
    rng = np.random.default_rng(seed + sum(shape))
    return ((rng.standard_normal(shape[:3]) * 3 + 2).astype(dtype),
            rng.standard_normal(shape[:3]).astype(dtype))


def assert_norm_affine_close(w, b, x, g, run, eps, dtype):
    """Within the float64 sums' rounding of the exact values, twice (the
    kernels' and the reference's own), plus one rounding to ``dtype``: a value
    of channel c adds g (x - mean) rstd, whose mean and rstd carry the row's n
    additions and a few operations, so each term is off by at most gamma_k
    (|x| + |mean|) rstd |g| with k = 2 n + rows + 10 covering those and the
    channel's own sum."""
    rw, rb = R.norm_affine_grads(x, g, run, eps)
    x64, g64 = x.astype(np.float64), g.astype(np.float64)
    B, rows, n = x.shape
    mean = x64.mean(axis=2, keepdims=True) if n else np.zeros((B, rows, 1))
    rstd = 1 / np.sqrt(((x64 - mean) ** 2).mean(axis=2, keepdims=True) + eps) if n else mean
    terms_w = np.abs(g64) * (np.abs(x64) + np.abs(mean)) * rstd
    if run == 0:
        sw, sb = terms_w.sum(axis=1), np.abs(g64).sum(axis=1)
    else:
        sw = terms_w.reshape(B, -1, run).sum(axis=2)
        sb = np.abs(g64).reshape(B, -1, run).sum(axis=2)
    k = 2 * n + rows + 10
    for got, want, s, what in ((w, rw, sw, "w"), (b, rb, sb, "b")):
        if got is None:
            continue
        got = np.asarray(got.cpu() if hasattr(got, "cpu") else got, dtype=np.float64)
        assert got.shape == want.shape, (what, got.shape, want.shape)
        bound = 2 * gamma(k, np.float64) * s + unit_roundoff(dtype) * np.abs(want)
        assert np.all(np.abs(got - want) <= bound), (what, np.max(np.abs(got - want) - bound))


@pytest.mark.parametrize("shape", NORM_AFFINE_SHAPES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_norm_affine_grads_cpu_twin_against_the_reference(shape, dtype):
    from ncdp_fast._norm_affine import norm_affine_grads
    x, g = norm_affine_case(shape, dtype)
    w, b = norm_affine_grads(x, g, run=shape[3], eps=1e-5)
    assert w.dtype == b.dtype == dtype
    assert_norm_affine_close(w, b, x, g, shape[3], 1e-5, dtype)
    # One of the two alone.
    w_only, none = norm_affine_grads(x, g, run=shape[3], eps=1e-5, bias=False)
    assert none is None and np.array_equal(w_only, w)


def test_norm_affine_grads_refuses_bad_arguments():
    from ncdp_fast._norm_affine import norm_affine_grads
    x, g = norm_affine_case((2, 3, 6, 0), np.float32)
    with pytest.raises(ValueError, match=r"run: expected a divisor of n = 6 .*got 4"):
        norm_affine_grads(x, g, run=4, eps=1e-5)
    with pytest.raises(ValueError, match="run"):
        norm_affine_grads(x, g, run=-1, eps=1e-5)
    with pytest.raises(ValueError, match="eps: expected a finite number >= 0"):
        norm_affine_grads(x, g, run=0, eps=-1.0)
    with pytest.raises(ValueError, match=r"x, g: expected two arrays of one shape \(B, rows, n\)"):
        norm_affine_grads(x, g[:, :2], run=0, eps=1e-5)
    with pytest.raises(ValueError, match=r"got \(2, 3, 6\) and \(6, 6\)"):
        norm_affine_grads(x, g.reshape(6, 6), run=0, eps=1e-5)
    with pytest.raises(TypeError, match="g: dtype float64 differs from x's float32"):
        norm_affine_grads(x, g.astype(np.float64), run=0, eps=1e-5)
    with pytest.raises(TypeError, match="x: expected float32 or float64, got dtype int64"):
        norm_affine_grads(x.astype(np.int64), g, run=0, eps=1e-5)
