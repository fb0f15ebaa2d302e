"""The device routes on the vendor GEMM (issue 36), run by CI on CPU tensors
(library-generic array code: the very functions a GPU runs):
``_cuda.clip.linear_sq_norms`` (a linear layer's per-sample norms) against
the float64 reference over awkward shapes, both routes (Gram and direct),
chunked and whole, float32 and float64; ``_cuda.clip.clipped_linear_sum``
(the clipped sum plus noise, one GEMM in the data dtype, rebalanced where the
norms say so) against the exact sum and the numba twin's noise; and the
embedding's sync-free route of ``_rows_sq`` (a masked Gram instead of
``unique``) against its CPU route."""
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ncdp_fast._cuda import clip as device_clip  # noqa: E402
from ncdp_fast.reference.clip import linear_terms, per_sample_linear_grads  # noqa: E402

U64 = 2.0 ** -53

SHAPES = [  # (B, T, d, K): empty, one row, T = 1, each route, not tile multiples
    (0, 3, 4, 5), (1, 1, 4, 5), (3, 1, 7, 2), (2, 4, 9, 11), (5, 17, 9, 11),
    (4, 40, 3, 2), (2, 64, 5, 700), (7, 13, 33, 65), (3, 0, 4, 5)]


def _device_norms(*args):
    """device_clip.linear_sq_norms on the emulated device: its T = 1 route
    launches the dense blocks' row_sq_norms kernel (_C_emu's on CPU tensors);
    its other routes are the same torch code either way."""
    import ncdp_fast._backend as be
    with be.emulated_cuda():
        device_clip.linear_sq_norms(*args)


def _device_group_norms(*args):
    """device_clip.linear_sq_norms_group, as :func:`_device_norms`."""
    import ncdp_fast._backend as be
    with be.emulated_cuda():
        device_clip.linear_sq_norms_group(*args)


def _reference(a, g, bias):
    w = per_sample_linear_grads(a, g, bias)
    return (np.asarray(w, np.float64) ** 2).sum(axis=1)


def _bound(a, g, bias):
    """The float64 rounding allowed to either route and to the reference,
    each: terms * u * (sum_t ||g_t|| (||a_t|| + [bias]))^2 (reference.clip_bound's
    model of a sum of `terms` products, any order)."""
    a64, g64 = a.astype(np.float64), g.astype(np.float64)
    spread = (np.linalg.norm(g64, axis=2) * (np.linalg.norm(a64, axis=2) + float(bias))).sum(1)
    B, T, d = a.shape
    return 2 * linear_terms(d, g.shape[2], T, bias) * U64 * spread ** 2


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("chunked", [False, True])
def test_gemm_norms_match_the_reference(shape, bias, dtype, chunked, monkeypatch):
    B, T, d, K = shape
    rng = np.random.default_rng(B * 1000 + T * 10 + d)
    a = rng.standard_normal((B, T, d)).astype(dtype)
    g = (rng.standard_normal((B, T, K)) * 1e-3).astype(dtype)
    if chunked:
        # Chunks of 2 samples (the last one short where B is odd): the Gram
        # route's temporaries (no copy where the kernel reads a part as it
        # lies), the direct route's copies and K x d matrices.
        import ncdp_fast._backend as be
        gram = 2 * T * T <= K * d
        with be.emulated_cuda():
            per_sample = (sum(device_clip.gram_sample_bytes(
                [torch.from_numpy(a), torch.from_numpy(g)])[0]) if gram
                else 8 * (T * (d + K) + K * d))
        monkeypatch.setattr(device_clip, "GEMM_CHUNK_BYTES", 2 * per_sample + 1)
    ref = _reference(a, g, bias)
    prior = rng.random(B)
    for accumulate in (False, True):
        sq = torch.tensor(prior)
        _device_norms(torch.from_numpy(a), torch.from_numpy(g), bias, sq,
                                    accumulate)
        got = sq.numpy() - (prior if accumulate else 0.0)
        tol = _bound(a, g, bias) + (4 * U64 * prior if accumulate else 0.0)
        assert got.shape == (B,)
        assert np.all(np.abs(got - ref) <= tol), (np.abs(got - ref) / np.maximum(tol, 1e-300))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("chunked", [False, True])
def test_gemm_spread_matches_the_reference(shape, bias, dtype, chunked, monkeypatch):
    """The spread the norms' pass adds (Gram diagonals, or the direct route's
    squares) against reference.linear_spread. Every term is non-negative, so
    each side is within (d + K + T + 4) u of the exact sum, relatively: squared
    norms of d (K) terms, a square root, a product, the bias, T terms summed."""
    from ncdp_fast.reference import linear_spread
    B, T, d, K = shape
    if chunked:
        monkeypatch.setattr(device_clip, "GEMM_CHUNK_BYTES", 1)   # one sample a chunk
    rng = np.random.default_rng(B * 1000 + T * 10 + d + 7)
    a = rng.standard_normal((B, T, d)).astype(dtype)
    g = (rng.standard_normal((B, T, K)) * 1e-3).astype(dtype)
    ref = np.asarray(linear_spread(a, g, bias), np.float64).reshape(B)
    prior = rng.random(B)
    sq, spread = torch.zeros(B, dtype=torch.float64), torch.tensor(prior)
    _device_norms(torch.from_numpy(a), torch.from_numpy(g), bias, sq, False,
                                spread)
    got = spread.numpy() - prior
    tol = 2 * (d + K + T + 4) * U64 * ref + 4 * U64 * prior
    assert np.all(np.abs(got - ref) <= tol), np.abs(got - ref) / np.maximum(tol, 1e-300)
    # The norms are those of the call without a spread, bit for bit.
    alone = torch.zeros(B, dtype=torch.float64)
    _device_norms(torch.from_numpy(a), torch.from_numpy(g), bias, alone, False)
    assert torch.equal(sq, alone)
    # The numba twin takes the same argument (its own pass over the positions).
    from ncdp_fast._numba import clip as numba_clip
    sqn, spread_n = np.zeros(B), prior.copy()
    numba_clip.linear_sq_norms(a, g, bias, sqn, False, spread_n)
    assert np.all(np.abs(spread_n - prior - ref) <= tol)


def test_both_routes_are_reached():
    """The shapes above reach each route (the numba twin's rule, 2 T^2 <= K d)."""
    routes = {2 * T * T <= K * d for B, T, d, K in SHAPES if B and T > 1}
    assert routes == {True, False}


def test_large_values_keep_float64_range():
    """float32 inputs whose squares overflow float32 (2^66 squared is past its
    2^128): products formed in float64 stay finite and exact (powers of two)."""
    a = torch.full((2, 3, 4), 2.0 ** 66, dtype=torch.float32)
    g = torch.full((2, 3, 5), 2.0 ** 33, dtype=torch.float32)
    sq = torch.zeros(2, dtype=torch.float64)
    _device_norms(a, g, False, sq, False)
    expected = (3 * 2.0 ** 99) ** 2 * 4 * 5
    assert math.isfinite(expected)
    assert sq.tolist() == [expected] * 2


# ------------------------------------------------------------- embedding rows
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("B, T, V, D", [(0, 3, 5, 4), (1, 1, 5, 4), (3, 7, 4, 5),
                                        (6, 9, 50, 3), (2, 33, 3, 17)])
@pytest.mark.parametrize("chunked", [False, True])
def test_embedding_rows_device_route_matches_the_scatter(B, T, V, D, dtype, chunked, monkeypatch):
    """Repeated rows within a sample (V small against T) are where the two
    routes differ most: the scatter adds a row's positions first, the masked
    Gram forms every cross term.  Both are float64 sums of the same terms;
    their difference is held to the clip rule's model of that rounding, for
    the device route's terms (T^2 + D) and the scatter's (T D), each."""
    import ncdp_fast._backend as be
    from ncdp_fast.torch import layer_rules
    gen = torch.Generator().manual_seed(B * 100 + T)
    idx = torch.randint(0, V, (B, T), generator=gen)
    h = torch.randn(B, T, D, generator=gen, dtype=dtype)
    with be.emulated_cuda(False):
        scatter = layer_rules._rows_sq(idx, h, V)
    if chunked:
        monkeypatch.setattr(layer_rules, "_ROWS_CHUNK_BYTES", 2 * 8 * (T * D + 2 * T * T))
    with be.emulated_cuda():         # float32 h: the Gram kernel; float64: the GEMM
        device = layer_rules._rows_sq(idx, h, V)
    spread = torch.linalg.vector_norm(h.double(), dim=2).sum(1)
    tol = (T * T + D + T * D) * U64 * spread ** 2
    assert device.shape == (B,) and device.dtype == torch.float64
    assert bool(((device - scatter).abs() <= tol).all()), (device - scatter).abs() / tol
    # The exact value, formed one sample at a time from its rows.
    for i in range(B):
        rows = torch.zeros(V, D, dtype=torch.float64).index_add_(0, idx[i], h[i].double())
        assert abs(float(device[i]) - float(rows.square().sum())) <= float(tol[i])


# ---------------------------------------------------------------- clipped sum
def _device_sum(a, g, f, noise_std, inv_denom, seed, offset, bias, balance=True, bias_gemv=None):
    """The device adaptor on the emulated device (its noise kernel is _C_emu's)."""
    import ncdp_fast._backend as be
    K, d = g.shape[2], a.shape[2]
    with be.emulated_cuda():
        gw = torch.empty((K, d), dtype=torch.from_numpy(a).dtype)
        gb = torch.empty((K,), dtype=gw.dtype) if bias else None
        device_clip.clipped_linear_sum(torch.from_numpy(a), torch.from_numpy(g),
                                       torch.from_numpy(f), noise_std, inv_denom, seed, offset,
                                       gw, gb, balance=balance, bias_gemv=bias_gemv)
    return gw.numpy(), (gb.numpy() if bias else None)


def _sum_bound(a, g, f, inv, bias, dtype):
    """The exact clipped sum (float64 of the float64 per-sample gradients) and
    the rounding each twin is allowed: weight entries sum n = B T products
    fl(f_i g_itk) a_itj in the data dtype (the factor's rounding, the
    product's, n - 1 additions: gamma_{n+1} of the sum of their absolute
    values), then x inv in float64, rounded once (u of the value); the bias
    likewise: the device sums its B T products in the data dtype where the
    factor went into g, or into a with ``bias_gemv`` (g's rows against the
    factors rounded to the data dtype: that rounding, the product's, n - 1
    additions), else g's rows in float64, then their factor-weighted sum; the
    numba twin its products in float64 (its products rounded to the data
    dtype first: half the smallest denormal where one underflows)."""
    B, T, d = a.shape
    K = g.shape[2]
    flat = per_sample_linear_grads(a, g, bias) * f[:, None]
    exact = flat.sum(axis=0) * inv
    scale = np.abs(per_sample_linear_grads(np.abs(a), np.abs(g), bias) * f[:, None]).sum(0) * inv
    u = np.finfo(dtype).eps / 2
    n = B * T + 1
    gamma = np.full(exact.shape, n * u / (1 - n * u))
    tol = u * np.abs(exact) + gamma * scale * (1 + u)
    if bias:
        tol[K * d:] += B * T * np.finfo(dtype).smallest_subnormal / 2 * inv
    return exact, tol


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("balance,gemv", [(True, False), (False, False), (False, True)])
def test_gemm_clipped_sum_within_the_data_dtype_gemm_bound(shape, bias, dtype, balance, gemv):
    """Noise off: each twin's entries are the exact sum of f_i g_it a_it^T
    divided by the expected batch, to within the rounding of one GEMM in the
    data dtype (``_sum_bound``), with the rebalancing scan run or skipped,
    factors into either operand (K <= d and K > d both occur), and the
    device's bias of an unscaled g by its float64 sum or its GEMV."""
    from ncdp_fast._numba import clip as numba_clip
    B, T, d, K = shape
    rng = np.random.default_rng(7 + B + T + d)
    a = rng.standard_normal((B, T, d)).astype(dtype)
    g = rng.standard_normal((B, T, K)).astype(dtype)
    f = rng.uniform(0.0, 1.0, B)
    inv = 1 / 3
    exact, tol = _sum_bound(a, g, f, inv, bias, dtype)
    gw, gb = _device_sum(a, g, f, 0.0, inv, 1, 0, bias, balance, {} if gemv else None)
    nw, nb = np.empty((K, d), dtype), (np.empty((K,), dtype) if bias else None)
    numba_clip.clipped_linear_sum(a, g, f, 0.0, inv, np.uint64(1), np.uint64(0), nw, nb,
                                  balance=balance)
    for w, b in ((gw, gb), (nw, nb)):
        got = np.concatenate([w.ravel()] + ([b] if bias else []))
        assert got.dtype == dtype
        assert np.all(np.abs(got - exact) <= tol), np.abs(got - exact) / np.maximum(tol, 1e-300)


@pytest.mark.parametrize("K,d,gemv", [(4, 6, False), (6, 4, True), (6, 4, False)])
def test_gemm_clipped_sum_sums_the_bias_without_widening_its_operand(K, d, gemv):
    """With the factor in g (K <= d, no power moved) the bias is the GEMM's
    scaled rows summed in the data dtype, and with the factor in a (K > d)
    and ``bias_gemv`` one GEMV of g against the factors in the data dtype:
    no torch sum(dtype=float64) of a float32 operand, which copies it whole
    to float64 first on the CPU and on a GPU (the profiler's allocation
    below; 84 such copies in a BERT-base step on the H200, 2026-11-30, 12 of
    them still after the scaled rows: its FF1 layers'); within the GEMM
    bound.  Without ``bias_gemv`` an unscaled g is still widened."""
    from torch.utils._python_dispatch import TorchDispatchMode
    B, T = 3, 5
    rng = np.random.default_rng(K)
    a = rng.standard_normal((B, T, d)).astype(np.float32)
    g = rng.standard_normal((B, T, K)).astype(np.float32)
    f = np.array([0.25, 1.0, 0.5])
    widened = []

    class Sums(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if (func.overloadpacket is torch.ops.aten.sum and args[0].dtype == torch.float32
                    and kwargs.get("dtype") == torch.float64):
                widened.append(tuple(args[0].shape))
            return func(*args, **kwargs)
    with Sums():
        gw, gb = _device_sum(a, g, f, 0.0, 1.0, 1, 0, True, balance=False,
                             bias_gemv={} if gemv else None)
    assert widened == ([] if K <= d or gemv else [(B, T, K)])
    exact, tol = _sum_bound(a, g, f, 1.0, True, np.float32)
    assert np.all(np.abs(np.concatenate([gw.ravel(), gb]) - exact) <= tol)
    # What the test guards against, measured here: torch's widening sum
    # allocates a float64 copy of its operand.
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        torch.from_numpy(g).sum((0, 1), dtype=torch.float64)
    assert any(e.name == "aten::_to_copy" and e.cpu_memory_usage >= 8 * g.size
               for e in prof.events())


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_device_scale_rows_is_the_libraries_multiply_bit_for_bit(dtype, monkeypatch):
    """The clipped GEMM's scaled operand on the emulated device: the kernel for
    a row-major operand, torch's multiply for a strided view (it reads any
    strides); both the float64 product rounded once, as NumPy forms it."""
    import ncdp_fast._backend as be
    from ncdp_fast import _arrays
    rng = np.random.default_rng(5)
    x = rng.standard_normal((4, 3, 6)).astype(dtype)
    f = np.array([0.0, 2.0 ** -140, 0.3, 1.0])
    want = (x.astype(np.float64) * f[:, None, None]).astype(dtype)
    launched = []
    real = _arrays.scale_rows
    monkeypatch.setattr(_arrays, "scale_rows", lambda *a: launched.append("torch") or real(*a))
    with be.emulated_cuda():
        t, ft = torch.from_numpy(x), torch.from_numpy(f)
        dense = device_clip.scale_rows(t, ft)
        strided = device_clip.scale_rows(t.transpose(1, 2), ft)
    assert launched == ["torch"]                      # the view only
    assert np.array_equal(dense.numpy(), want)
    assert np.array_equal(strided.numpy(), want.transpose(0, 2, 1))


def test_gemm_clipped_sum_uses_ieee_float32_products(tf32_on_matmuls):
    """The GEMM runs with TF32 off whatever the caller set (TF32 would keep
    10 mantissa bits, outside the clip rule's (1 + 4u) margin), and the
    caller's setting is back afterwards (the fixture checks it)."""
    a, g = np.ones((2, 3, 4), np.float32), np.ones((2, 3, 5), np.float32)
    _device_sum(a, g, np.array([0.5, 1.0]), 0.0, 1.0, 1, 0, True, True)
    assert tf32_on_matmuls == [False]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gemm_clipped_sum_noise_is_the_numba_twins(dtype):
    """Zero data: the output is the noise alone, the stream's draws offset ..
    offset + K d - 1 for the weight, then K for the bias, scaled and divided
    by the expected batch in float64 and rounded once: in float32 bit for bit
    the numba twin's (the same (seed, offset), the same values, every
    backend); in float64 within the noise kernels' documented float64 ulp of
    each other (their log, sin, cos: _numba/rng.py add_gaussian)."""
    from ncdp_fast._numba import clip as numba_clip
    B, T, d, K = 3, 4, 5, 6
    a = np.zeros((B, T, d), dtype)
    g = np.zeros((B, T, K), dtype)
    f = np.ones(B)
    gw, gb = _device_sum(a, g, f, 1.7, 0.25, 99, 12345, True)
    nw, nb = np.empty((K, d), dtype), np.empty((K,), dtype)
    numba_clip.clipped_linear_sum(a, g, f, 1.7, 0.25, np.uint64(99), np.uint64(12345), nw, nb)
    if dtype == np.float32:
        assert np.array_equal(gw, nw) and np.array_equal(gb, nb)
    else:
        ulp = np.spacing(np.abs(np.concatenate([nw.ravel(), nb])))
        assert np.all(np.abs(np.concatenate([gw.ravel(), gb]) -
                             np.concatenate([nw.ravel(), nb])) <= 2 * ulp)
    assert np.all(gw != 0)


@pytest.mark.parametrize("K, d", [(4, 6), (6, 4)])
def test_gemm_clipped_sum_rebalances_extreme_float32_inputs(K, d):
    """A clipped sample whose scaled operand would fall among float32's
    denormals (f x ~ 2^-140) while its products are ordinary (the other
    operand ~ 2^90): the norms' sizes flag the layer, and with the scan both
    twins stay within the GEMM bound; without it the denormal's lost bits
    show (the test's teeth: the bound is tight enough to see them)."""
    from ncdp_fast import _balance
    from ncdp_fast._numba import clip as numba_clip
    rng = np.random.default_rng(3)
    B, T = 3, 2
    big, small = 2.0 ** 90, 2.0 ** -100
    into_g = K <= d
    a = (rng.uniform(1, 2, (B, T, d)) * (big if into_g else small)).astype(np.float32)
    g = (rng.uniform(1, 2, (B, T, K)) * (small if into_g else big)).astype(np.float32)
    f = np.array([2.0 ** -40, 2.0 ** -41, 2.0 ** -39])     # every sample far clipped
    exact, tol = _sum_bound(a, g, f, 1.0, True, np.float32)
    sizes = np.empty((B, 2))
    numba_clip.linear_sq_norms(a, g, True, np.zeros(B), False, None, sizes)
    assert _balance.layers_needing_balancing(f, sizes[None], [T * d], [T * K], [into_g], True)[0]
    nw, nb = np.empty((K, d), np.float32), np.empty((K,), np.float32)
    numba_clip.clipped_linear_sum(a, g, f, 0.0, 1.0, np.uint64(1), np.uint64(0), nw, nb)
    for balance in (True, False):
        gw, gb = _device_sum(a, g, f, 0.0, 1.0, 1, 0, True, balance)
        err = np.abs(np.concatenate([gw.ravel(), gb]) - exact)
        assert np.all(err <= tol) == balance, (balance, (err / tol).max())
    err = np.abs(np.concatenate([nw.ravel(), nb]) - exact)
    assert np.all(err <= tol)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("chunked", [False, True])
def test_norm_pass_sizes_are_the_operands_squared_norms(shape, dtype, chunked, monkeypatch):
    """sizes[i] = (||a_i||^2, ||g_i||^2) from the norm pass, each twin, every
    route (T = 1, Gram, direct), within the float64 sum of T d (T K)
    non-negative squares, relatively; the norms are those of the call
    without sizes, bit for bit."""
    from ncdp_fast._numba import clip as numba_clip
    B, T, d, K = shape
    if chunked:
        monkeypatch.setattr(device_clip, "GEMM_CHUNK_BYTES", 1)   # one sample a chunk
    rng = np.random.default_rng(B + T + d + K)
    a = rng.standard_normal((B, T, d)).astype(dtype)
    g = (rng.standard_normal((B, T, K)) * 1e-3).astype(dtype)
    exact = np.stack([(a.astype(np.float64) ** 2).sum(axis=(1, 2)),
                      (g.astype(np.float64) ** 2).sum(axis=(1, 2))], axis=1)
    tol = (T * max(d, K) + 2) * U64 * exact
    sq, sizes = torch.zeros(B, dtype=torch.float64), torch.full((B, 2), np.nan,
                                                                dtype=torch.float64)
    _device_norms(torch.from_numpy(a), torch.from_numpy(g), True, sq, False,
                                torch.zeros(B, dtype=torch.float64), sizes)
    alone = torch.zeros(B, dtype=torch.float64)
    _device_norms(torch.from_numpy(a), torch.from_numpy(g), True, alone, False)
    assert torch.equal(sq, alone)
    sqn, sizes_n, alone_n = np.zeros(B), np.full((B, 2), np.nan), np.zeros(B)
    numba_clip.linear_sq_norms(a, g, True, sqn, False, None, sizes_n)
    numba_clip.linear_sq_norms(a, g, True, alone_n, False)
    assert np.array_equal(sqn, alone_n)
    for got in (sizes.numpy(), sizes_n):
        assert np.all(np.abs(got - exact) <= tol), (got, exact)


def test_tf32_switch_works_under_torchs_new_precision_api():
    """A caller who set TF32 through ``fp32_precision`` (torch >= 2.9, where
    reading the legacy ``allow_tf32`` then raises): the clipped sum still runs
    IEEE float32 and leaves the caller's setting as it was."""
    from ncdp_fast._cuda._common import ieee_float32_matmul
    m = torch.backends.cuda.matmul
    try:
        before = m.fp32_precision
    except (AttributeError, RuntimeError):
        pytest.skip("this torch has no fp32_precision (the legacy flag is the only one)")
    m.fp32_precision = "tf32"
    try:
        with ieee_float32_matmul():
            assert m.fp32_precision == "ieee"
            a, g = np.ones((2, 3, 4), np.float32), np.ones((2, 3, 5), np.float32)
            gw, _ = _device_sum(a, g, np.array([0.5, 1.0]), 0.0, 1.0, 1, 0, True)
        assert m.fp32_precision == "tf32"
        assert np.all(gw == np.float32(1.5 * 3))
    finally:
        m.fp32_precision = before


def test_tf32_switch_nests_and_restores_the_callers_setting():
    """The clip op enters the switch once around a step's sums and each sum
    enters it again (issue 36: only the outermost entry reads and sets the
    flag): TF32 stays off until the outermost exit, which restores what the
    caller had, also after an error inside."""
    from ncdp_fast._cuda._common import ieee_float32_matmul
    m = torch.backends.cuda.matmul
    try:
        m.allow_tf32
    except RuntimeError:
        pytest.skip("a test before set the new precision API; the legacy flag is unreadable")
    before = m.allow_tf32
    m.allow_tf32 = True
    try:
        with ieee_float32_matmul():
            assert m.allow_tf32 is False
            with ieee_float32_matmul():
                assert m.allow_tf32 is False
            assert m.allow_tf32 is False          # an inner exit keeps it off
            with pytest.raises(ZeroDivisionError):
                with ieee_float32_matmul():
                    1 / 0
            assert m.allow_tf32 is False
        assert m.allow_tf32 is True
    finally:
        m.allow_tf32 = before


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(3, 1, 7, 2), (2, 4, 9, 11), (2, 64, 5, 700), (4, 40, 3, 2),
                                   (0, 3, 4, 5)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("L, per_chunk", [(1, None), (5, None), (5, 2)])
def test_group_norms_are_each_layers_norms_summed(shape, dtype, L, per_chunk, monkeypatch):
    """linear_sq_norms_group (layers of one shape stacked along the batch, in
    chunks of ``per_chunk`` layers where set) against the float64 reference of
    each layer summed: within the layers' own bounds plus L float64 additions;
    the spread likewise, and each layer's sizes within the float64 sum of its
    squares.  The numba twin's group call is held to the same bounds."""
    from ncdp_fast._numba import clip as numba_clip
    from ncdp_fast.reference import linear_spread
    B, T, d, K = shape
    rng = np.random.default_rng(B + T + d + K + L)
    a = [rng.standard_normal((B, T, d)).astype(dtype) for _ in range(L)]
    g = [(rng.standard_normal((B, T, K)) * 1e-3).astype(dtype) for _ in range(L)]
    import ncdp_fast._backend as be
    with be.emulated_cuda():
        a_bytes, g_bytes, *_ = device_clip._layer_bytes([torch.from_numpy(x) for x in a],
                                                          [torch.from_numpy(y) for y in g], False)
    for budget in ("GROUP_CHUNK_BYTES", "GRAM_GROUP_CHUNK_BYTES"):
        monkeypatch.setattr(device_clip, budget, (per_chunk or L) * (a_bytes[0] + g_bytes[0]))
    ref = sum(_reference(x, y, True) for x, y in zip(a, g))
    tol = sum(_bound(x, y, True) for x, y in zip(a, g)) + (L + 1) * U64 * ref
    ref_sp = sum(np.asarray(linear_spread(x, y, True), np.float64).reshape(B)
                 for x, y in zip(a, g)) if T > 1 else np.zeros(B)
    tol_sp = 2 * (d + K + T + 4 + L) * U64 * ref_sp
    sizes_ref = np.stack([np.stack([(x.astype(np.float64) ** 2).sum(axis=(1, 2)),
                                    (y.astype(np.float64) ** 2).sum(axis=(1, 2))], axis=1)
                          for x, y in zip(a, g)])
    tol_sz = (T * max(d, K) + 2) * U64 * sizes_ref
    from ncdp_fast import _arrays
    stacked = []
    gram = 2 * T * T <= K * d
    # The Gram route stacks through grams_f64 (the kernel reads float32 parts
    # in place; float64 ones are joined inside it), the direct one copies.
    if gram:
        real_grams = device_clip.grams_f64
        monkeypatch.setattr(device_clip, "grams_f64", lambda parts, *route:
                            stacked.append(len(parts)) or real_grams(parts, *route))
    else:
        real_cat = _arrays.cat_float64
        monkeypatch.setattr(_arrays, "cat_float64", lambda parts: stacked.append(len(parts))
                            or real_cat(parts))
    sq, sp = torch.zeros(B, dtype=torch.float64), torch.zeros(B, dtype=torch.float64)
    sizes = torch.full((L, B, 2), np.nan, dtype=torch.float64)
    _device_group_norms([torch.from_numpy(x) for x in a],
                                      [torch.from_numpy(y) for y in g], True, sq, sp, sizes)
    sqn, spn, sizes_n = np.zeros(B), np.zeros(B), np.full((L, B, 2), np.nan)
    numba_clip.linear_sq_norms_group(a, g, True, sqn, spn, sizes_n)
    # The layers were stacked (two Gram launches or copies a chunk) wherever
    # there is more than one layer of sequences; else each ran alone.
    grouped = L > 1 and T > 1 and B > 0
    alone = [1, 1] * L if gram and T > 1 and B > 0 else []     # a Gram of each operand
    assert stacked == ([min(per_chunk or L, L - c) for c in range(0, L, per_chunk or L)
                        for _ in (0, 1)] if grouped else alone), stacked
    for q, s, z in ((sq.numpy(), sp.numpy(), sizes.numpy()), (sqn, spn, sizes_n)):
        assert np.all(np.abs(q - ref) <= tol), np.abs(q - ref) / np.maximum(tol, 1e-300)
        assert np.all(np.abs(s - ref_sp) <= tol_sp)
        assert np.all(np.abs(z - sizes_ref) <= tol_sz)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(2, 4, 9, 11), (7, 13, 33, 65), (4, 40, 3, 2)],
                         ids=lambda s: "x".join(map(str, s)))
def test_group_norms_share_one_inputs_copy_and_grams(shape, dtype, monkeypatch):
    """Layers that read one input (an attention block's q, k and v: the same
    elements, here through different tensor objects) share its float64 copy
    and Grams on the Gram route; the norms, spreads and sizes are each
    layer's own within the bounds of the test above, and the direct route
    (2 T^2 > K d) shares nothing."""
    from ncdp_fast import _arrays
    from ncdp_fast.reference import linear_spread
    B, T, d, K = shape
    rng = np.random.default_rng(B + T)
    x, y, z = (rng.standard_normal((B, T, d)).astype(dtype) for _ in range(3))
    tx, tz = torch.from_numpy(x), torch.from_numpy(z)
    a_t = [tx, tx[:], tx.view(B, T, d), torch.from_numpy(y), tz, tz.detach()]
    a = [x, x, x, y, z, z]
    g = [(rng.standard_normal((B, T, K)) * 1e-3).astype(dtype) for _ in a]
    gram = 2 * T * T <= K * d
    import ncdp_fast._backend as be
    with be.emulated_cuda():
        a_bytes, g_bytes, stack, budget, _ = device_clip._layer_bytes(
            a_t, [torch.from_numpy(v) for v in g], False)
    # The kernel's route (float32 on the emulated device) has its own budget.
    assert budget == (device_clip.GRAM_GROUP_CHUNK_BYTES if gram and dtype == np.float32
                      else device_clip.GROUP_CHUNK_BYTES)
    assert device_clip._group_chunks(a_t, a_bytes, g_bytes, stack, budget) == (
        [(0, 3, True), (3, 4, False), (4, 6, True)] if gram else [(0, 6, False)])
    # A budget for two of the shared run's layers: the run is cut, the rest alone.
    if gram:
        assert device_clip._group_chunks(a_t, a_bytes, g_bytes, stack,
                                         a_bytes[0] + 2 * g_bytes[0])[:2] == [
            (0, 2, True), (2, 3, False)]
    upcasts, grams = [], []
    real, real_grams = _arrays.as_float64, device_clip.grams_f64
    monkeypatch.setattr(_arrays, "as_float64", lambda t: upcasts.append(t.dtype) or real(t))
    monkeypatch.setattr(device_clip, "grams_f64", lambda parts, *route:
                        grams.append(len(parts)) or real_grams(parts, *route))
    sq, sp = torch.zeros(B, dtype=torch.float64), torch.zeros(B, dtype=torch.float64)
    sizes = torch.full((len(a), B, 2), np.nan, dtype=torch.float64)
    _device_group_norms(a_t, [torch.from_numpy(v) for v in g], True, sq, sp, sizes)
    # A shared run forms its input's Gram once: Grams of 3 inputs (runs) and 6
    # output gradients on the Gram route, none on the direct one; float32 rows
    # go to the Gram kernel as they lie (no float64 copy).
    assert sum(grams) == (9 if gram else 0)
    assert torch.float32 not in upcasts or not gram
    ref = sum(_reference(u, v, True) for u, v in zip(a, g))
    tol = sum(_bound(u, v, True) for u, v in zip(a, g)) + (len(a) + 1) * U64 * ref
    ref_sp = sum(np.asarray(linear_spread(u, v, True), np.float64).reshape(B)
                 for u, v in zip(a, g))
    sizes_ref = np.stack([np.stack([(u.astype(np.float64) ** 2).sum(axis=(1, 2)),
                                    (v.astype(np.float64) ** 2).sum(axis=(1, 2))], axis=1)
                          for u, v in zip(a, g)])
    assert np.all(np.abs(sq.numpy() - ref) <= tol)
    assert np.all(np.abs(sp.numpy() - ref_sp) <= 2 * (d + K + T + 4 + len(a)) * U64 * ref_sp)
    assert np.all(np.abs(sizes.numpy() - sizes_ref) <= (T * max(d, K) + 2) * U64 * sizes_ref)


def test_tf32_switch_for_convolutions_turns_both_backends_off_and_restores_them():
    """ieee_float32_products (the per-sample gradients' GEMMs and convolutions):
    on a device array cuBLAS's and cuDNN's TF32 are off inside, nested entries
    only count, the caller's flags come back after (also after an error); on a
    host array it touches neither."""
    from ncdp_fast._cuda._common import ieee_float32_matmul, ieee_float32_products
    import ncdp_fast._backend as be
    m, c = torch.backends.cuda.matmul, torch.backends.cudnn
    try:
        before = (m.allow_tf32, c.allow_tf32)
    except RuntimeError:
        pytest.skip("a test before set the new precision API; the legacy flags are unreadable")
    m.allow_tf32 = c.allow_tf32 = True
    try:
        with ieee_float32_products(torch.zeros(1)):
            assert (m.allow_tf32, c.allow_tf32) == (True, True)      # a host array
        with be.emulated_cuda():
            device = torch.zeros(1)
            with ieee_float32_products(device):
                assert (m.allow_tf32, c.allow_tf32) == (False, False)
                with ieee_float32_matmul():
                    pass
                assert (m.allow_tf32, c.allow_tf32) == (False, False)   # an inner exit
                with pytest.raises(ZeroDivisionError):
                    with ieee_float32_products(device):
                        1 / 0
                assert (m.allow_tf32, c.allow_tf32) == (False, False)
            assert (m.allow_tf32, c.allow_tf32) == (True, True)
    finally:
        m.allow_tf32, c.allow_tf32 = before


def test_tf32_switch_for_convolutions_works_under_torchs_new_precision_api():
    """A caller who set cuDNN's convolution precision through ``fp32_precision``
    (reading the legacy ``allow_tf32`` then raises): the switch sets and
    restores that one."""
    from ncdp_fast._cuda._common import ieee_float32_products
    import ncdp_fast._backend as be
    conv = getattr(torch.backends.cudnn, "conv", None)
    if conv is None or not hasattr(conv, "fp32_precision"):
        pytest.skip("this torch has no cudnn.conv.fp32_precision")
    rnn = torch.backends.cudnn.rnn
    before = conv.fp32_precision, rnn.fp32_precision
    # conv and rnn set apart: the legacy flag, shared by both, is unreadable.
    conv.fp32_precision, rnn.fp32_precision = "tf32", "ieee"
    try:
        with pytest.raises(RuntimeError):
            torch.backends.cudnn.allow_tf32
        with be.emulated_cuda(), ieee_float32_products(torch.zeros(1)):
            assert conv.fp32_precision == "ieee"
        assert (conv.fp32_precision, rnn.fp32_precision) == ("tf32", "ieee")
    finally:
        conv.fp32_precision, rnn.fp32_precision = before


@pytest.mark.parametrize("scale,C,gemv", [(1.0, 1e-3, True), (2.0 ** 35, 1.0, False)])
def test_clip_op_takes_the_gemv_bias_only_for_weights_in_range(scale, C, gemv, monkeypatch):
    """The clip op reads the step's weights on the host and lets the device
    form an unscaled g's bias (K > d) as a GEMV only where each is 0 or
    within [2^-40, 2^40] (``_balance.weights_in_range``): rows of norm ~2^72
    clipped to 1 give factors near 2^-74, whose float32 rounding need not be
    relative, and take the float64 sum, though their operands are well
    scaled (no power would move: the balance flag is off in both cases, so
    the weights' range alone decides).  Both within C; the GEMV's result
    within the GEMM bound of the factors it was given."""
    import ncdp_fast as nf
    import ncdp_fast._backend as be
    from ncdp_fast import _arrays
    rng = np.random.default_rng(3)
    a = (rng.standard_normal((3, 4, 2)) * scale).astype(np.float32)
    g = (rng.standard_normal((3, 4, 5)) * scale).astype(np.float32)
    from ncdp_fast import _balance
    taken, flags = [], []
    real, need = _arrays.repeat_each, _balance.layers_needing_balancing
    monkeypatch.setattr(_arrays, "repeat_each",
                        lambda *x: taken.append((x[1], x[0].numpy().copy())) or real(*x))
    monkeypatch.setattr(_balance, "layers_needing_balancing",
                        lambda *x: flags.append(need(*x)) or flags[-1])
    with be.emulated_cuda():
        res = nf.clip_and_noise_layers([(torch.from_numpy(a), torch.from_numpy(g), True)],
                                       max_norm=C, noise_multiplier=0.0)
    assert [f.tolist() for f in flags] == [[False]]
    assert res.num_clipped == 3
    assert [T for T, _ in taken] == ([4] if gemv else [])
    w, b = res.grads[0]
    got = np.concatenate([w.numpy().ravel(), b.numpy()]).astype(np.float64)
    assert 0 < np.sqrt(np.sum(got ** 2)) <= C * 3     # B = 3 samples, each within C
    if gemv:
        exact, tol = _sum_bound(a, g, taken[0][1], 1.0, True, np.float32)
        assert np.all(np.abs(got - exact) <= tol)
