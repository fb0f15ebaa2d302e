"""The NTK Gram's device route on the vendor GEMM (issue 36), run by CI on CPU
tensors (``_cuda.ntk.hadamard_gram`` is torch code: the very function a GPU
runs): against the float64 sum over awkward shapes, strips that are not
multiples of each other, the symmetric and the cross Gram, every accumulation
mode; exact symmetry; TF32 off inside the call and the caller's setting back
after it; and ``ntk_gram`` end to end on the device route."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import gamma, unit_roundoff

torch = pytest.importorskip("torch")

from ncdp_fast._cuda import ntk as device_ntk  # noqa: E402

# (n, n2, widths): widths are (a, c) per term, a None for a constant-1 factor,
# 0 for an empty factor (a term that adds zero).
CASES = [(1, 1, [(3, 2)]), (1, 4, [(None, 3), (2, 5)]), (7, 7, [(2, 0), (0, 3), (None, 1)]),
         (13, 5, [(4, 4), (1, 9), (None, 6)]), (33, 33, [(5, 3), (None, 2), (1, 1), (6, 7)]),
         (65, 17, [(2, 3)] * 5)]


def _terms(n, n2, widths, symmetric, dtype, seed):
    """Random factors and, in float64, K = sum (F F2^T) o (B B2^T) and sum |terms|
    (the scale of the rounding bound)."""
    rng = np.random.default_rng(seed)
    f, b, f2, b2 = [], [], [], []
    ref = np.zeros((n, n2))
    scale = np.zeros((n, n2))
    for a, c in widths:
        fa = None if a is None else rng.standard_normal((n, a)).astype(dtype)
        ba = rng.standard_normal((n, c)).astype(dtype)
        fb, bb = (fa, ba) if symmetric else (
            None if a is None else rng.standard_normal((n2, a)).astype(dtype),
            rng.standard_normal((n2, c)).astype(dtype))
        f.append(fa), b.append(ba), f2.append(fb), b2.append(bb)
        q = ba.astype(np.float64) @ bb.astype(np.float64).T
        qa = np.abs(ba.astype(np.float64)) @ np.abs(bb.astype(np.float64)).T
        if fa is None:
            ref += q
            scale += qa
        else:
            ref += (fa.astype(np.float64) @ fb.astype(np.float64).T) * q
            scale += (np.abs(fa.astype(np.float64)) @ np.abs(fb.astype(np.float64)).T) * qa
    return (f, b, f2, b2), ref, scale


def _t(x):
    return None if x is None else torch.from_numpy(x)


# (STRIP_ROWS, plan, LEAF_ROWS): STRIP_ROWS also sets a call's product budget
# (STRIP_ROWS x n2 cells), so at 4 the halving plan's blocks are cut into rows.
PLAN_CASES = [(1, "strips", None), (4, "strips", None), (1024, "strips", None),
              (4, "halving", 1), (1024, "halving", 3), (4, "halving", 8)]


@pytest.mark.parametrize("dtype,acc64,out_dtype", [
    (np.float32, False, np.float32), (np.float32, False, np.float64),
    (np.float32, True, np.float32), (np.float32, True, np.float64),
    (np.float64, False, np.float64), (np.float64, True, np.float32)])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}x{c[1]}-{len(c[2])}terms")
@pytest.mark.parametrize("strip_rows,plan,leaf_rows", PLAN_CASES,
                         ids=lambda v: str(v))
@pytest.mark.parametrize("accumulate", [False, True])
def test_gemm_gram_matches_the_float64_sum(case, dtype, acc64, out_dtype, strip_rows, plan,
                                           leaf_rows, accumulate, monkeypatch):
    n, n2, widths = case
    monkeypatch.setattr(device_ntk, "STRIP_ROWS", strip_rows)
    monkeypatch.setattr(device_ntk, "PLANS", (plan,))
    if leaf_rows is not None:
        monkeypatch.setattr(device_ntk, "LEAF_ROWS", leaf_rows)
    for symmetric in ((True, False) if n == n2 else (False,)):
        (f, b, f2, b2), ref, scale = _terms(n, n2, widths, symmetric, dtype, n * 100 + n2)
        prior = np.random.default_rng(1).standard_normal((n, n2))
        if symmetric:
            prior = prior + prior.T
        prior = prior.astype(out_dtype)
        out = torch.from_numpy(prior.copy()) if accumulate else \
            torch.full((n, n2), float("nan"), dtype=getattr(torch, np.dtype(out_dtype).name))
        device_ntk.hadamard_gram([_t(x) for x in f], [_t(x) for x in b], [_t(x) for x in f2],
                                 [_t(x) for x in b2], out, symmetric, accumulate_f64=acc64,
                                 accumulate=accumulate)
        expected = ref + (prior.astype(np.float64) if accumulate else 0.0)
        # Per entry: an F product of max a terms, a B product of max c terms,
        # their product, the terms and the prior summed: gamma of that length in
        # the accumulator's dtype (float32 unless every step is float64) times
        # the sum of |terms|, plus one rounding to out's dtype, plus the float64
        # reference's own error.
        length = max((a or 0) for a, _ in widths) + max(c for _, c in widths) + len(widths) + 2
        acc = np.float64 if acc64 or dtype == out_dtype == np.float64 else np.float32
        abs_terms = scale + (np.abs(prior.astype(np.float64)) if accumulate else 0.0)
        bound = (gamma(length, acc) + gamma(length, np.float64)) * abs_terms \
            + unit_roundoff(out_dtype) * np.abs(expected)
        err = np.abs(out.numpy().astype(np.float64) - expected)
        assert np.all(err <= bound), (f"{n}x{n2} symmetric={symmetric}: worst excess "
                                      f"{np.max(err - bound):.3g}")
        if symmetric:
            assert torch.equal(out, out.T)


def _covered(n, jobs):
    """How many times each cell of an n x n Gram is written by ``jobs``."""
    seen = np.zeros((n, n), dtype=np.int64)
    for m, r0, c0, period, rows, cols in jobs:
        for i in range(m):
            r, c = r0 + i * period, c0 + i * period
            seen[r:r + rows, c:c + cols] += 1
    return seen


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 300), leaf=st.integers(1, 70), cap=st.integers(1, 5000))
def test_halving_covers_the_upper_triangle_once(n, leaf, cap):
    """Every cell on or above the diagonal is written exactly once, below it
    only inside a diagonal leaf (which the mirror overwrites), by the plan and
    by its calls cut to ``cap`` cells; the leaves are at most ``leaf`` rows."""
    jobs = device_ntk.halving_jobs(n, leaf)
    for plan in (jobs, device_ntk._chunked(jobs, cap)):
        seen = _covered(n, plan)
        assert np.all(np.triu(seen) == np.triu(np.ones_like(seen)))
        leaves = [j for j in jobs if j[1] == j[2]]
        assert all(rows <= leaf for _, _, _, _, rows, _ in leaves)
        below = np.tril(seen, -1)
        inside = np.zeros_like(seen)
        for m, r0, _, period, rows, _ in leaves:
            for i in range(m):
                lo = r0 + i * period
                inside[lo:lo + rows, lo:lo + rows] = 1
        assert np.all(below <= np.tril(inside, -1))
    assert all(m * rows * cols <= max(cap, cols) for m, _, _, _, rows, cols in
               device_ntk._chunked(jobs, cap) if m > 1 or rows > 1)


def test_plan_follows_the_wave_model():
    """At bench_ntk's largest shape the halving plan has fewer waves than the
    strips (the strips' last GEMMs fill a fraction of the SMs) and is chosen;
    a cross Gram is always strips over every column; a tie keeps the strips."""
    n = 16384
    strips = device_ntk.plan_jobs(n, n, True, 4, plans=("strips",))
    halving = device_ntk.plan_jobs(n, n, True, 4, plans=("halving",))
    assert device_ntk.waves(halving) < device_ntk.waves(strips)
    assert device_ntk.plan_jobs(n, n, True, 4) == halving
    cross = device_ntk.plan_jobs(300, 70, False, 4)
    assert all(c0 == 0 and cols == 70 for _, _, c0, _, _, cols in cross)
    assert device_ntk.plan_jobs(64, 64, True, 4) == device_ntk.plan_jobs(64, 64, True, 4,
                                                                         plans=("strips",))


def test_gemm_gram_of_nothing_leaves_out_alone():
    out = torch.zeros(0, 5)
    device_ntk.hadamard_gram([None], [torch.zeros(0, 2)], [None], [torch.zeros(5, 2)], out, False)
    assert out.shape == (0, 5)


def test_constant_one_factor_must_be_paired():
    x = torch.ones(3, 2)
    with pytest.raises(ValueError, match=r"f2\[0\]: expected None exactly where f\[0\] is None"):
        device_ntk.hadamard_gram([None], [x], [x], [x], torch.empty(3, 3), False)


def test_tf32_is_off_inside_and_restored_after(monkeypatch):
    seen = []
    plan = device_ntk.plan_jobs
    monkeypatch.setattr(device_ntk, "plan_jobs",
                        lambda *a: seen.append(torch.backends.cuda.matmul.allow_tf32)
                        or plan(*a))
    x = torch.ones(4, 3)
    for before in (True, False):
        torch.backends.cuda.matmul.allow_tf32 = before
        try:
            device_ntk.hadamard_gram([x], [x], [x], [x], torch.empty(4, 4), True)
            assert torch.backends.cuda.matmul.allow_tf32 is before
        finally:
            torch.backends.cuda.matmul.allow_tf32 = False
    assert seen == [False, False]


def test_tf32_setting_survives_overlapping_calls_on_two_threads():
    """Thread A enters, thread B enters, A leaves, B leaves: TF32 stays off
    until the last one leaves, and the caller's setting comes back after."""
    import threading
    torch.backends.cuda.matmul.allow_tf32 = True
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def a():
        with device_ntk.ieee_float32_matmul():
            a_in.set()
            b_in.wait(10)
        a_out.set()

    def b():
        a_in.wait(10)
        with device_ntk.ieee_float32_matmul():
            b_in.set()
            a_out.wait(10)
            seen["inside_after_a"] = torch.backends.cuda.matmul.allow_tf32
    try:
        threads = [threading.Thread(target=f) for f in (a, b)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert seen == {"inside_after_a": False}
        assert torch.backends.cuda.matmul.allow_tf32 is True
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False


@pytest.mark.parametrize("cross", [False, True])
def test_ntk_gram_on_the_device_route_matches_the_cpu(cross, monkeypatch):
    """ntk_gram's device branch (the emulated device's dispatch, forced here)
    with strips of 64 rows against the CPU backend in float64."""
    import ncdp_fast as nf
    from ncdp_fast import _backend
    monkeypatch.setattr(device_ntk, "STRIP_ROWS", 64)
    rng = np.random.default_rng(4)
    W = [rng.standard_normal((33, 11)) / 3, rng.standard_normal((20, 33)) / 6,
         rng.standard_normal((3, 20)) / 4]
    b = [rng.standard_normal(33), None, rng.standard_normal(3)]
    x = rng.standard_normal((150, 11))
    x2 = rng.standard_normal((70, 11)) if cross else None
    ref = nf.ntk_gram(x, W, biases=b, activation="gelu", x2=x2)
    calls = []
    real = device_ntk.hadamard_gram
    monkeypatch.setattr(device_ntk, "hadamard_gram",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    with _backend.emulated_cuda(True):
        K = nf.ntk_gram(torch.from_numpy(x), [torch.from_numpy(w) for w in W],
                        biases=[None if v is None else torch.from_numpy(v) for v in b],
                        activation="gelu", x2=None if x2 is None else torch.from_numpy(x2))
    assert calls == [1]
    assert np.abs(K.numpy() - ref).max() <= 1e-12 * np.abs(ref).max()
    if not cross:
        assert torch.equal(K, K.T)
