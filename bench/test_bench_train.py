"""Benchmark of one NoisyGD step of a linear classifier (ncdp_fast.train) against its
peers (report ``bench_train``).

Shape: n = 10^4 rows, p = 10^4 features, K = 10 classes, float32, CE loss, full batch.

* ``noisygd``: the step of :class:`ncdp_fast.train.NoisyGDClassifier` (logits,
  residual, ghost clipping ``clip_and_noise_linear`` -- norms ||r_i|| ||x_i||, the
  clipped sum as one GEMM, Philox noise -- and the update), from a non-zero W.
* ``nonprivate``: the same loss and library without privacy: ``logits = X W^T``,
  ``R = softmax - Y``, ``grad = R^T X`` in torch, and the update.  Target: NoisyGD
  within 2x of it.
* ``naive``: what a user would otherwise write: per-sample gradients
  ``r_i x_i^T`` materialised as (chunk, K, p) tensors in torch (chunks of 256 rows so
  that it fits), their norms, clip factors, weighted sum, torch.normal noise.
* ``opacus``: Opacus 1.6 (GradSampleModule + DPOptimizer) on ``nn.Linear(p, K,
  bias=False)``: its per-sample gradients are (n, K, p) = 4 GB at the full shape, so it
  runs at ``n_opacus`` rows and its time is scaled linearly to n (marked extrapolated).

Achieved FLOP/s counts the two GEMMs every method needs, 4 n K p flops per step.
"""
from __future__ import annotations

import warnings

from _common import cases, measure

SHAPE = {"full": dict(n=10_000, p=10_000, K=10, n_opacus=1000),
         "quick": dict(n=2000, p=2000, K=10, n_opacus=500),
         "smallest": dict(n=64, p=32, K=10, n_opacus=32)}
METHODS = ["noisygd", "nonprivate", "naive", "opacus"]


def CASES(size, device):
    s = SHAPE[size]
    return {"test_train_step": cases("bench_train", [(f"n={s['n']}, p={s['p']}, K={s['K']}", s)],
                                     METHODS)}


def test_train_step(benchmark, case, bench_device, bench_size):
    import torch
    warnings.filterwarnings("ignore")
    device, method, K, p = bench_device, case.method, case.params["K"], case.params["p"]
    n = case.params["n_opacus"] if method == "opacus" else case.params["n"]
    gen = torch.Generator().manual_seed(0)
    X = torch.randn(n, p, generator=gen)
    X /= X.norm(dim=1, keepdim=True)
    y = torch.randint(0, K, (n,), generator=gen)
    W = 0.01 * torch.randn(K, p, generator=gen)
    if device == "cuda":
        X, y, W = X.cuda(), y.cuda(), W.cuda()
    Y = torch.nn.functional.one_hot(y, K).to(X.dtype)
    C, sigma, lr = 1.0, 1.0, 1e-3

    if method == "noisygd":
        from ncdp_fast.train import linear_steps
        state = {"W": W, "t": 0}
        labels = y.cpu().numpy()       # the estimator validates labels on the host

        def fn():
            state["t"] += 1
            state["W"] = linear_steps(X, labels, num_classes=K, steps=1, lr=lr, loss="ce",
                                      max_grad_norm=C, noise_multiplier=sigma,
                                      projection_radius=None, fit_intercept=False,
                                      seed=1 + state["t"], init=(state["W"], None))[0]
    elif method == "nonprivate":
        state = {"W": W}

        def fn():
            R = torch.softmax(X @ state["W"].T, dim=1) - Y
            state["W"] = state["W"] - lr * (R.T @ X)
    elif method == "naive":
        state = {"W": W}
        chunk = 256

        def fn():
            R = torch.softmax(X @ state["W"].T, dim=1) - Y
            g = torch.zeros(K, p, device=X.device)
            for s in range(0, n, chunk):
                G = R[s:s + chunk, :, None] * X[s:s + chunk, None, :]        # (B, K, p)
                norms = G.flatten(1).norm(dim=1)
                f = (C / norms).clamp(max=1.0)
                g += torch.einsum("b,bkp->kp", f, G)
            g += torch.normal(0.0, sigma * C, (K, p), device=X.device)
            state["W"] = state["W"] - lr * g
    elif method == "opacus":
        import pytest
        pytest.importorskip("opacus")
        from opacus import GradSampleModule
        from opacus.optimizers import DPOptimizer
        model = torch.nn.Linear(p, K, bias=False)
        with torch.no_grad():
            model.weight.copy_(W)
        model = model.to(X.device)
        gsm = GradSampleModule(model)
        opt = DPOptimizer(torch.optim.SGD(gsm.parameters(), lr=lr), noise_multiplier=sigma,
                          max_grad_norm=C, expected_batch_size=n)
        crit = torch.nn.CrossEntropyLoss(reduction="sum")

        def fn():
            opt.zero_grad(set_to_none=True)
            crit(gsm(X), y).backward()
            opt.step()
    else:
        raise ValueError(method)
    measure(benchmark, case, fn, device=device, repeats=3 if bench_size != "full" else 5,
            warmup=1, min_time=0.5, n_measured=n, flops=4.0 * n * K * p)
