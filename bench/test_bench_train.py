"""Benchmark of one NoisyGD step of a linear classifier (ncdp_fast.train) against its peers.

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
Each configuration runs in a fresh subprocess (peak memory is its own).
``python bench/bench_train.py [--quick] [--out bench/results] [--device cpu|cuda|all]``.
"""
from __future__ import annotations

import warnings

from _common import (bench_parser, devices, mem_peak, mem_start, run_worker, serve_worker,
                     sync_for, timeit, write_report)

SHAPE = dict(n=10_000, p=10_000, K=10, n_opacus=1000)
SHAPE_QUICK = dict(n=2000, p=2000, K=10, n_opacus=500)
METHODS = ["noisygd", "nonprivate", "naive", "opacus"]


def worker(cfg):
    import torch
    warnings.filterwarnings("ignore")
    device, method, K, p = cfg["device"], cfg["method"], cfg["K"], cfg["p"]
    n = cfg["n_opacus"] if method == "opacus" else cfg["n"]
    gen = torch.Generator().manual_seed(0)
    X = torch.randn(n, p, generator=gen)
    X /= X.norm(dim=1, keepdim=True)
    y = torch.randint(0, K, (n,), generator=gen)
    W = 0.01 * torch.randn(K, p, generator=gen)
    if device == "cuda":
        X, y, W = X.cuda(), y.cuda(), W.cuda()
    Y = torch.nn.functional.one_hot(y, K).to(X.dtype)
    C, sigma, lr = 1.0, 1.0, 1e-3
    sync = sync_for(torch, device)

    if method == "noisygd":
        from ncdp_fast.train import linear_steps as _linear_steps
        state = {"W": W, "t": 0}
        labels = y.cpu().numpy()       # the estimator validates labels on the host

        def fn():
            state["t"] += 1
            state["W"] = _linear_steps(X, labels, num_classes=K, steps=1, lr=lr, loss="ce",
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
    fn()
    start = mem_start(torch, device)
    med, best = timeit(fn, repeats=cfg["repeats"], warmup=1, sync=sync, min_time=0.5)
    return dict(median_s=med, best_s=best, peak_extra_mb=mem_peak(torch, device, start), n=n)


def bench(device, quick):
    cfg = SHAPE_QUICK if quick else SHAPE
    res = {}
    for m in METHODS:
        res[m] = run_worker(__file__, dict(method=m, device=device, repeats=3 if quick else 5,
                                           **cfg))
        print(f"{device} {m}: {res[m]}", flush=True)
    n, p, K = cfg["n"], cfg["p"], cfg["K"]
    flops = 4.0 * n * K * p
    base = res["nonprivate"].get("median_s")
    rows = []
    for m in METHODS:
        r = res[m]
        row = dict(device=device, method=m, config=f"n={n}, p={p}, K={K}")
        if "error" in r:
            row["error"] = r["error"]
            rows.append(row)
            continue
        t = r["median_s"] * (n / r["n"])
        row.update(seconds=t, extrapolated=r["n"] < n, measured_n=r["n"],
                   gflops=flops / t / 1e9, peak_mb=r["peak_extra_mb"],
                   vs_nonprivate=(t / base) if base else None)
        rows.append(row)
    return rows


def main():
    ap = bench_parser(__doc__.split("\n\n")[0])
    args = ap.parse_args()
    if serve_worker(args, worker):
        return
    for dev, meta in devices(args):
        rows = bench(dev, args.quick)
        write_report(
            "bench_train", args.out, meta, rows,
            [("config", "configuration", None), ("method", "method", None),
             ("seconds", "s / step", "{:.4f}"), ("vs_nonprivate", "× non-private", "{:.2f}"),
             ("gflops", "GFLOP/s (4nKp)", "{:.1f}"), ("peak_mb", "peak extra MB", "{:.0f}"),
             ("extrapolated", "extrapolated", None), ("measured_n", "n measured", None),
             ("error", "error", None)],
            notes=["noisygd: NoisyGDClassifier's step (ghost clipping, no (n, K p) tensor); "
                   "nonprivate: torch logits/residual/R^T X, same loss; naive: per-sample "
                   "(256, K, p) chunks in torch; opacus: GradSampleModule + DPOptimizer on "
                   "nn.Linear, run at 'n measured' rows and scaled linearly to n",
                   "target: noisygd <= 2x non-private"])


if __name__ == "__main__":
    main()
