"""Op 3 (Hadamard-product NTK Gram) and the NTK analysis functions."""
import numpy as np
import pytest

import ncdp_fast as nf
from ncdp_fast import ntk
from ncdp_fast import reference as R

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.func import functional_call, jacrev, vmap  # noqa: E402

ACTS = {"relu": nn.ReLU, "tanh": nn.Tanh, "gelu": nn.GELU, "softplus": nn.Softplus,
        "identity": nn.Identity}


def _mlp(d, widths, act, bias, dtype, seed):
    torch.manual_seed(seed)
    layers = []
    for i, w in enumerate(widths):
        layers.append(nn.Linear(d if i == 0 else widths[i - 1], w, bias=bias))
        if i < len(widths) - 1:
            layers.append(ACTS[act]())
    return nn.Sequential(*layers).to(dtype)


def _jac_gram(model, x, x2=None, ntk_scale=False):
    """torch.func oracle: mean over outputs of J_o(x) J_o(x2)^T."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def f(p, xi):
        return functional_call(model, p, (xi[None],))[0]
    J1 = vmap(jacrev(f), in_dims=(None, 0))(params, x)
    J2 = J1 if x2 is None else vmap(jacrev(f), in_dims=(None, 0))(params, x2)
    K = sum(torch.einsum("iop,jop->ij", J1[k].reshape(x.shape[0], J1[k].shape[1], -1),
                         J2[k].reshape(J2[k].shape[0], J2[k].shape[1], -1)) for k in params)
    return K / J1[next(iter(params))].shape[1]


CASES = [  # (depth widths, activation, bias)
    ([1], "identity", True), ([13, 1], "relu", True), ([17, 9, 3], "tanh", False),
    ([11, 7, 5, 4], "gelu", True), ([10, 6, 2], "softplus", True), ([9, 5], "relu", False),
]


@pytest.mark.parametrize("widths,act,bias", CASES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_gram_equals_torch_func(widths, act, bias, dtype):
    model = _mlp(6, widths, act, bias, dtype, seed=len(widths))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(19, 6, generator=g, dtype=dtype)
    x2 = torch.randn(7, 6, generator=g, dtype=dtype)
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    for xa, xb in ((x, None), (x, x2)):
        K = ntk.gram_from_torch(model, xa, xb)
        ref = _jac_gram(model, xa, xb)
        assert isinstance(K, torch.Tensor) and K.dtype == dtype
        assert float((K - ref).abs().max() / ref.abs().max()) < tol
    Kd = ntk.gram_from_torch(model, x, diagonal=True)
    assert float((Kd - _jac_gram(model, x).diagonal()).abs().max() /
                 Kd.abs().max()) < tol


@pytest.mark.parametrize("act", ["relu", "erf", "gelu", "tanh"])
@pytest.mark.parametrize("parameterization", ["standard", "ntk"])
def test_gram_equals_reference_jacobian(act, parameterization):
    rng = np.random.default_rng(3)
    W = [rng.standard_normal((9, 4)), rng.standard_normal((5, 9)), rng.standard_normal((3, 5))]
    b = [rng.standard_normal(9), None, rng.standard_normal(3)]
    x, x2 = rng.standard_normal((11, 4)), rng.standard_normal((6, 4))
    for xb in (None, x2):
        K = nf.ntk_gram(x, W, biases=b, activation=act, parameterization=parameterization, x2=xb)
        ref = R.ntk_gram(x, W, b, act, xb, parameterization)
        assert np.abs(K - ref).max() <= 1e-10 * np.abs(ref).max()


def test_ntk_parameterization_matches_scaled_model():
    # z = W x / sqrt(fan_in): same as the standard Gram of a model whose forward
    # scales, with gradients w.r.t. the unscaled W (checked via torch.func).
    rng = np.random.default_rng(0)
    W = [rng.standard_normal((8, 5)), rng.standard_normal((2, 8))]
    x = rng.standard_normal((6, 5))

    def f(params, xi):
        h = torch.relu(params[0] @ xi / np.sqrt(5))
        return params[1] @ h / np.sqrt(8)
    P = [torch.tensor(w) for w in W]
    J = vmap(jacrev(f), in_dims=(None, 0))(P, torch.tensor(x))
    ref = sum(torch.einsum("iop,jop->ij", j.reshape(6, 2, -1), j.reshape(6, 2, -1)) for j in J) / 2
    K = nf.ntk_gram(x, W, activation="relu", parameterization="ntk")
    np.testing.assert_allclose(K, ref.numpy(), rtol=1e-10, atol=1e-12)


def test_symmetric_psd_and_blocks(monkeypatch):
    import ncdp_fast._numba.ntk as kn
    monkeypatch.setattr(kn, "block_rows", lambda n: 37)   # many blocks, none a tile multiple
    rng = np.random.default_rng(5)
    W = [rng.standard_normal((23, 8)) / 3, rng.standard_normal((17, 23)) / 5,
         rng.standard_normal((4, 17)) / 4]
    x = rng.standard_normal((100, 8))
    K = nf.ntk_gram(x, W, biases=[np.ones(23), np.ones(17), np.ones(4)], activation="tanh")
    assert np.array_equal(K, K.T)
    ev = np.linalg.eigvalsh(K)
    assert ev.min() >= -1e-10 * np.abs(K).max()
    ref = R.ntk_gram(x, W, [np.ones(23), np.ones(17), np.ones(4)], "tanh")
    assert np.abs(K - ref).max() <= 1e-10 * np.abs(ref).max()


def test_matvec_and_lambda_min():
    rng = np.random.default_rng(7)
    W = [rng.standard_normal((40, 10)) / np.sqrt(10), rng.standard_normal((1, 40)) / np.sqrt(40)]
    x = rng.standard_normal((300, 10))
    K = nf.ntk_gram(x, W, activation="relu")
    v = rng.standard_normal(300)
    np.testing.assert_allclose(ntk.ntk_matvec(x, W, v), K @ v, rtol=1e-10, atol=1e-10)
    dense = ntk.lambda_min(K, method="eigh")
    it = ntk.lambda_min(x=x, weights=W, method="lanczos")          # matrix-free
    si = ntk.lambda_min(K, method="shift-invert")
    for r in (it, si):
        assert abs(r.value - dense.value) <= 1e-6 * abs(dense.value), r.method
        assert r.residual < 1e-6 * np.abs(K).max()
    assert dense.residual < 1e-8 * np.abs(K).max()
    assert dense.value == pytest.approx(np.linalg.eigvalsh(K)[0], rel=1e-10)


@pytest.mark.parametrize("n", [33, 50, 63, 70, 200])
def test_lambda_min_iterative_methods_at_sizes_that_are_not_block_multiples(n):
    """The seventh audit: shift-invert's block Lanczos (blocks of 32) never
    added a last partial block, so for 32 < n < 64 it answered from its random
    start block alone (165x to 53 000x too large, warned as an upper bound);
    matrix-free LOBPCG crashed on its (n, 1) and (n, m) blocks.  Each method's
    value now lies within its own residual of the dense one (for a symmetric
    K some eigenvalue lies within ||K u - value u|| of the Rayleigh quotient),
    plus the dense solver's rounding."""
    import warnings
    rng = np.random.default_rng(5)
    x = rng.standard_normal((n, 3))
    W = [rng.standard_normal((60, 3)), rng.standard_normal((2, 60))]
    K = nf.ntk_gram(x, W, activation="tanh")
    dense = ntk.lambda_min(K, method="eigh").value
    slack = 8 * n * np.finfo(np.float64).eps * np.abs(K).sum(axis=1).max()
    with warnings.catch_warnings():
        # SciPy switches LOBPCG to a dense solver below 5 x its block, saying so.
        warnings.filterwarnings("ignore", "The problem size", UserWarning)
        found = [ntk.lambda_min(K, method="shift-invert")]
        if n <= 70:      # at n = 200 (lambda_min 1e-5 ||K||) K's own Krylov space stalls
            found += [ntk.lambda_min(x=x, weights=W, activation="tanh", method="lobpcg"),
                      ntk.lambda_min(x=x, weights=W, activation="tanh", method="lanczos")]
        else:
            with pytest.raises(RuntimeError, match=r"method='lanczos'\): ARPACK did not "
                                                   r"converge.*use method='shift-invert'"):
                ntk.lambda_min(x=x, weights=W, activation="tanh", method="lanczos", maxiter=50)
        for r in found:
            assert abs(r.value - dense) <= r.residual + slack, (r.method, r.value, dense)
            assert r.residual <= 1e-8 * np.abs(K).max(), r.method


def test_lambda_min_iterative_at_2048():
    rng = np.random.default_rng(8)
    W = [rng.standard_normal((64, 16)) / 4, rng.standard_normal((64, 64)) / 8,
         rng.standard_normal((1, 64)) / 8]
    x = rng.standard_normal((2048, 16))
    K = nf.ntk_gram(x, W, activation="tanh")
    dense = ntk.lambda_min(K, method="eigh")
    # Shift-invert ARPACK (matrix-free Lanczos converges too slowly on NTK
    # spectra at this size for CI; it is checked at n = 300 above).
    it = ntk.lambda_min(K, method="shift-invert")
    assert abs(it.value - dense.value) <= 1e-6 * abs(dense.value)


def test_hadamard_lower_bound_on_layer_factors():
    # lambda_min(P o Q) >= lambda_min(P) * min_i Q_ii for PSD P, Q (Schur), on a
    # layer's factors P = F F^T, Q = B B^T.
    rng = np.random.default_rng(9)
    W = [rng.standard_normal((50, 6)), rng.standard_normal((1, 50))]
    x = rng.standard_normal((40, 6))
    from ncdp_fast._ntk import namespace, ntk_factors
    terms = ntk_factors(x, W, None, "relu", "standard", namespace("numpy"), np.matmul)
    for f, b in terms:
        if f is None:
            continue
        P, Q = f @ f.T, b @ b.T
        lhs = np.linalg.eigvalsh(P * Q)[0]
        rhs = np.linalg.eigvalsh(P)[0] * np.diag(Q).min()
        assert lhs >= rhs - 1e-9 * np.abs(P * Q).max()


def test_rf_gram_and_two_layer_special_case():
    rng = np.random.default_rng(11)
    V = rng.standard_normal((30, 5))
    a = rng.standard_normal((1, 30))
    x = rng.standard_normal((12, 5))
    Phi = np.maximum(x @ V.T, 0)
    np.testing.assert_allclose(ntk.rf_gram(x, V, "relu"), Phi @ Phi.T, rtol=1e-12)
    # Two-layer NTK = second-layer (RF) term + first-layer term.
    K = nf.ntk_gram(x, [V, a], activation="relu")
    Da = ((x @ V.T) > 0) * a[0]              # B_1 = phi'(V x) o a
    first = (x @ x.T) * (Da @ Da.T)
    np.testing.assert_allclose(K, Phi @ Phi.T + first, rtol=1e-10)


def test_memory_without_jacobian():
    # n = 4096, width 4096, depth 3: J would be 4096 x 33.6M params (> 500 GB).
    import subprocess
    import sys
    code = (
        "import resource, numpy as np, ncdp_fast as nf\n"
        "rng = np.random.default_rng(0)\n"
        "n, w = 4096, 4096\n"
        "x = rng.standard_normal((n, 32), dtype=np.float32)\n"
        "W = [rng.standard_normal((w, 32), dtype=np.float32) / 6,\n"
        "     rng.standard_normal((w, w), dtype=np.float32) / 64,\n"
        "     rng.standard_normal((1, w), dtype=np.float32) / 64]\n"
        "nf.ntk_gram(x[:8], W, activation='relu')\n"
        "K = nf.ntk_gram(x, W, activation='relu')\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, float(K[0, 0]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr
    peak = int(out.stdout.split()[0])
    assert peak < 2 * 2**30, f"peak RSS {peak / 2**30:.2f} GiB"


@pytest.mark.parametrize("kwargs,err,match", [
    (dict(weights=[np.ones((3, 4)), np.ones((2, 5))]), ValueError, "weights\\[1\\]: expects inputs of width 5"),
    (dict(x=np.ones((5, 3))), ValueError, "weights\\[0\\]: expects inputs of width 4 but x has 3"),
    (dict(activation="swish"), ValueError, "activation"),
    (dict(parameterization="mup"), ValueError, "parameterization"),
    (dict(output="full"), TypeError, "output"),    # no such parameter: K is the trace kernel
    (dict(weights=[np.ones((3, 4), np.float32), np.ones((2, 3))]), TypeError, "dtype"),
    (dict(biases=[np.ones(2), None]), ValueError, "biases\\[0\\]"),
    (dict(x2=np.ones((3, 5))), ValueError, "x2"),
])
def test_bad_input(kwargs, err, match):
    base = dict(x=np.ones((5, 4)), weights=[np.ones((3, 4)), np.ones((2, 3))])
    base.update(kwargs)
    x = base.pop("x")
    with pytest.raises(err, match=match):
        nf.ntk_gram(x, **base)


def test_gram_from_torch_refuses_unsupported():
    with pytest.raises(ValueError, match="unsupported module"):
        ntk.gram_from_torch(nn.Sequential(nn.Linear(3, 3), nn.Sigmoid(), nn.Linear(3, 1)),
                            torch.ones(2, 3))
    with pytest.raises(ValueError, match="one activation"):
        ntk.gram_from_torch(nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 3), nn.Tanh(),
                                          nn.Linear(3, 1)), torch.ones(2, 3))
    for model in (None, "mlp", [nn.Linear(3, 1)]):     # was "unsupported module NoneType"
        with pytest.raises(TypeError, match=r"model: expected an nn\.Sequential of nn\.Linear "
                           rf"layers \(or one nn\.Linear\), got {type(model).__name__}"):
            ntk.gram_from_torch(model, torch.ones(2, 3))


def test_lambda_min_of_a_singular_ntk_is_zero_to_rounding():
    # 180 parameters, 600 samples: K has rank <= 180, so lambda_min = 0 exactly;
    # the block solver must say so (|value| at rounding level) instead of
    # chasing a 420-fold degenerate eigenvalue.
    rng = np.random.default_rng(3)
    W = [rng.standard_normal((20, 8)) / np.sqrt(8), rng.standard_normal((1, 20)) / np.sqrt(20)]
    x = rng.standard_normal((600, 8))
    K = nf.ntk_gram(x, W, activation="relu")
    r = ntk.lambda_min(K, method="shift-invert")
    scale = np.abs(K).sum(axis=1).max()
    assert abs(r.value) <= 600 * np.finfo(np.float64).eps * scale
    assert abs(np.linalg.eigvalsh(K)[0]) <= 600 * np.finfo(np.float64).eps * scale


@pytest.mark.gpu
def test_cuda_gram_of_an_input_of_width_zero(require_cuda):
    # torch gives the empty first-layer input data pointer 0; its term is zero and
    # must not be taken for the constant-1 factor of a bias (issue 14). tanh'(0) = 1
    # makes that layer's B non-zero, so the mistake would add ||W_1||_F^2 / 2.
    g = torch.Generator().manual_seed(5)
    x = torch.empty(6, 0, dtype=torch.float64)
    weights = [torch.randn(4, 0, generator=g, dtype=torch.float64),
               torch.randn(2, 4, generator=g, dtype=torch.float64)]
    biases = [None, torch.randn(2, generator=g, dtype=torch.float64)]
    expected = nf.ntk_gram(x, weights, biases=biases, activation="tanh")
    torch.testing.assert_close(expected, torch.ones(6, 6, dtype=torch.float64))
    got = nf.ntk_gram(x.to(require_cuda), [w.to(require_cuda) for w in weights],
                      biases=[None, biases[1].to(require_cuda)], activation="tanh")
    torch.testing.assert_close(got.cpu(), expected, rtol=0, atol=1e-12)


def test_non_finite_networks_and_unknown_choices_are_refused():
    """The sixth audit: NaN or Inf in x, a weight or V made every Gram entry
    NaN without a word; ntk_matvec took parameterization='bogus'."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 3))
    W = [rng.standard_normal((4, 3)), rng.standard_normal((2, 4))]
    bad = x.copy()
    bad[2, 1] = np.nan
    with pytest.raises(ValueError, match=r"^x: expected finite values"):
        ntk.ntk_gram(bad, W)
    with pytest.raises(ValueError, match=r"^weights\[1\]: expected finite values"):
        ntk.ntk_gram(x, [W[0], W[1] * np.inf])
    with pytest.raises(ValueError, match=r"^x: expected finite values"):
        ntk.ntk_matvec(bad, W, np.ones(6))
    with pytest.raises(ValueError, match=r"^parameterization: expected one of"):
        ntk.ntk_matvec(x, W, np.ones(6), parameterization="bogus")
    with pytest.raises(ValueError, match=r"^V: expected finite values"):
        ntk.rf_gram(x, np.full((5, 3), np.inf))
    with pytest.raises(ValueError, match=r"^V: expected shape \(N, 3\), got \(5,\)"):
        ntk.rf_gram(x, np.ones(5))


def test_lambda_min_checks_its_matrix_and_tolerances():
    """The sixth audit: a non-symmetric K gave an eigenvalue whose residual was
    1.26, a (0, 0) K an IndexError, and tol -1 / NaN or maxiter 0 were ignored."""
    K = np.array([[2.0, 1.0], [0.0, 2.0]])
    with pytest.raises(ValueError, match="K: expected a finite symmetric matrix"):
        ntk.lambda_min(K)
    with pytest.raises(ValueError, match="K: expected a non-empty square matrix"):
        ntk.lambda_min(np.zeros((0, 0)))
    S = np.array([[2.0, 1.0], [1.0, 2.0]])
    for kw in (dict(tol=-1.0), dict(tol=float("nan")), dict(maxiter=0)):
        with pytest.raises((ValueError, TypeError), match="(tol|maxiter): expected"):
            ntk.lambda_min(S, **kw)
    assert ntk.lambda_min(S).value == pytest.approx(1.0, rel=1e-12)
