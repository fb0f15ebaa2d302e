"""Benchmark of op 3 (Hadamard-product NTK Gram) against its peers (report ``bench_ntk``).

Peers, in the same run: torch.func's Jacobian contraction (vmap(jacrev) then
J J^T, what a user of functorch writes; it forms J, so it cannot run at the
largest size, and it is timed in the first round only) and the same Hadamard
identity written in plain torch (full F F^T and B B^T matmuls, then Hadamard
products: n x n temporaries).  Shapes (n, d, N, L): (512, 64, 512, 3),
(2048, 128, 1024, 3), (8192, 256, 2048, 4); on a GPU also (16384, 256, 4096, 4),
float32 with TF32 off; on a GPU also the hand-written tiled CUDA kernel the
GEMM route replaced (issue 36) and the GEMM route's row-strips plan alone
(``ncdp_strips``: the route chooses between strips and halving by a wave
model, which this row checks).  Achieved FLOP/s of the Gram part against a measured GEMM
peak (a 4096^3 float32 torch GEMM, its own group), and peak memory.
``test_lambda_min`` times ntk.lambda_min at n = 20000 on the CPU (no peer).
"""
from __future__ import annotations

import time

import numpy as np
import pytest

from _common import cases, measure

SHAPES = {"full": [(512, 64, 512, 3), (2048, 128, 1024, 3), (8192, 256, 2048, 4)],
          "quick": [(256, 32, 256, 3), (1024, 64, 512, 3)],
          "smallest": [(16, 4, 8, 3)]}
GPU_EXTRA = [(16384, 256, 4096, 4)]
GEMM = {"full": 4096, "quick": 4096, "smallest": 64}
LAMBDA_N = {"full": 20000, "quick": 2000, "smallest": 50}
FUNC_MAX_PARAMS_X_N = 4e9      # torch.func's J (n x #params floats) must fit


def gram_flops(n, d, N, L):
    """Multiply-adds x 2 of the n x n products (per layer F F^T and B B^T),
    halved for the symmetric Gram (what ncdp computes)."""
    widths = [d] + [N] * (L - 1)                      # F_{l-1} widths
    bwidths = [N] * (L - 1) + [0]                    # B_l widths (last: constant)
    return sum(2 * n * n * (a + b) for a, b in zip(widths, bwidths)) / 2


def CASES(size, device):
    shapes = SHAPES[size] + (GPU_EXTRA if device == "cuda" and size == "full" else [])
    work = [(f"({n}, {d}, {N}, {L})", dict(n=n, d=d, N=N, L=L)) for n, d, N, L in shapes]
    g = GEMM[size]
    return {"test_gemm_peak": cases("bench_ntk", [(f"GEMM peak {g}^3", dict(size=g))],
                                    ["gemm_peak"]),
            "test_ntk_gram": cases("bench_ntk", work,
                                   ["ncdp", "plain_torch", "torch_func"]
                                   + (["tiled_kernel", "ncdp_strips"] if device == "cuda" else []),
                                   once=("torch_func",)),
            "test_lambda_min": cases("bench_ntk", [(f"lambda_min n={LAMBDA_N[size]}",
                                                    dict(n=LAMBDA_N[size]))], ["lambda_min"])
            if device == "cpu" else []}


def _model(d, N, L, dtype, device):
    import torch
    from torch import nn
    torch.manual_seed(0)
    layers = []
    for i in range(L):
        layers.append(nn.Linear(d if i == 0 else N, N if i < L - 1 else 1))
        if i < L - 1:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers).to(dtype=dtype, device=device)


def test_gemm_peak(benchmark, case, bench_device):
    import torch
    torch.backends.cuda.matmul.allow_tf32 = False
    g = case.params["size"]
    a = torch.randn(g, g, dtype=torch.float32, device=bench_device)
    measure(benchmark, case, lambda: a @ a, device=bench_device, repeats=5, warmup=0,
            memory=False, flops=2 * g ** 3)


def test_ntk_gram(benchmark, case, bench_device):
    import torch

    from ncdp_fast import ntk
    n, d, N, L = (case.params[k] for k in ("n", "d", "N", "L"))
    method, device = case.method, bench_device
    params_count = d * N + (L - 2) * N * N + N
    if method == "torch_func" and n * params_count > FUNC_MAX_PARAMS_X_N:
        pytest.skip(f"torch.func: J would need {n * params_count * 4 / 2**30:.0f} GiB")
    torch.backends.cuda.matmul.allow_tf32 = False
    dtype = torch.float32
    model = _model(d, N, L, dtype, device)
    x = torch.randn(n, d, dtype=dtype, device=device)
    if method == "ncdp":
        def fn():
            return ntk.gram_from_torch(model, x)
    elif method == "plain_torch":
        from ncdp_fast._ntk import namespace, ntk_factors
        layers = [m for m in model if isinstance(m, torch.nn.Linear)]
        W = [p.weight.detach() for p in layers]
        B = [p.bias.detach() for p in layers]

        def fn():
            # The identity in eager torch: factors (same forward/backward), then
            # full n x n products and Hadamard sums.
            terms = ntk_factors(x, W, B, "relu", "standard", namespace("torch"), torch.matmul)
            K = torch.zeros(n, n, dtype=dtype, device=x.device)
            for f, b in terms:
                Q = b @ b.T
                K += Q if f is None else (f @ f.T) * Q
            return K
    elif method == "ncdp_strips":
        from ncdp_fast._cuda import ntk as device_ntk

        def fn():
            saved, device_ntk.PLANS = device_ntk.PLANS, ("strips",)
            try:
                return ntk.gram_from_torch(model, x)
            finally:
                device_ntk.PLANS = saved
    elif method == "tiled_kernel":
        # The hand-written CUDA kernel the GEMM route replaced (issue 36), on the
        # same factors, until a GPU run has measured both.
        from ncdp_fast._cuda.ntk import ieee_float32_matmul, tiled_kernel_gram
        from ncdp_fast._ntk import namespace, ntk_factors
        layers = [m for m in model if isinstance(m, torch.nn.Linear)]
        W = [p.weight.detach() for p in layers]
        B = [p.bias.detach() for p in layers]

        def fn():
            with ieee_float32_matmul():
                terms = ntk_factors(x, W, B, "relu", "standard", namespace("torch"),
                                    torch.matmul)
            f = [None if t[0] is None else t[0].contiguous() for t in terms]
            b = [t[1].contiguous() for t in terms]
            K = torch.empty(n, n, dtype=dtype, device=x.device)
            tiled_kernel_gram(f, b, f, b, K, True)
            return K
    elif method == "torch_func":
        from torch.func import functional_call, jacrev, vmap
        params = {k: v.detach() for k, v in model.named_parameters()}

        def f(p, xi):
            return functional_call(model, p, (xi[None],))[0]

        def fn():
            J = vmap(jacrev(f), in_dims=(None, 0))(params, x)
            return sum(j.reshape(n, -1) @ j.reshape(n, -1).T for j in J.values())
    else:
        raise ValueError(method)
    measure(benchmark, case, fn, device=device, repeats=3 if n <= 2048 else 1, warmup=0,
            flops=gram_flops(n, d, N, L))


def test_lambda_min(benchmark, case, bench_device):
    import ncdp_fast as nf
    from ncdp_fast import ntk
    rng = np.random.default_rng(0)
    n = case.params["n"]
    # Two-layer ReLU, d = 64, width 1024: 66560 parameters > n, so K is
    # positive definite (with fewer parameters than samples K is singular and
    # lambda_min is zero to rounding, which the solver reports in a few steps).
    W = [rng.standard_normal((1024, 64)) / 8, rng.standard_normal((1, 1024)) / 32]
    x = rng.standard_normal((n, 64))
    x /= np.linalg.norm(x, axis=1, keepdims=True)

    seconds = {}

    def fn():
        t0 = time.perf_counter()
        K = nf.ntk_gram(x, W, activation="relu")
        seconds["gram_s"] = time.perf_counter() - t0
        r = ntk.lambda_min(K)
        seconds["lambda_s"] = time.perf_counter() - t0 - seconds["gram_s"]
        return r
    r = measure(benchmark, case, fn, device="cpu", repeats=1, warmup=0, memory=False,
                first_call=False)
    benchmark.extra_info.update(seconds, value=float(r.value), residual=float(r.residual),
                                solver=r.method)
