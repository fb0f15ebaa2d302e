"""Benchmark of op 3 (Hadamard-product NTK Gram) against its peers.

Peers, in the same run: torch.func's Jacobian contraction (vmap(jacrev) then
J J^T, what a user of functorch writes; it forms J, so it cannot run at the
largest size) and the same Hadamard identity written in plain torch (full
F F^T and B B^T matmuls, then Hadamard products: n x n temporaries).
Shapes (n, d, N, L): (512, 64, 512, 3), (2048, 128, 1024, 3), (8192, 256, 2048, 4);
on a GPU also (16384, 256, 4096, 4), float32 with TF32 off.  Reports time,
achieved FLOP/s of the Gram part against a measured GEMM peak, and peak memory.
Also times ntk.lambda_min at n = 20000 on the CPU.
``python bench/bench_ntk.py [--quick] [--out bench/results] [--device cpu|cuda|all]``.
"""
from __future__ import annotations

import json

import numpy as np

from _common import (alternate, bench_parser, devices, mem_peak, mem_start, run_worker,
                     serve_worker, sync_for, timeit, write_report)

SHAPES = [(512, 64, 512, 3), (2048, 128, 1024, 3), (8192, 256, 2048, 4)]
SHAPES_QUICK = [(256, 32, 256, 3), (1024, 64, 512, 3)]
GPU_EXTRA = [(16384, 256, 4096, 4)]
FUNC_MAX_PARAMS_X_N = 4e9      # torch.func's J (n x #params floats) must fit


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


def _gram_flops(n, d, N, L, symmetric):
    """Multiply-adds x 2 of the n x n products: per layer F F^T and B B^T."""
    widths = [d] + [N] * (L - 1)                      # F_{l-1} widths
    bwidths = [N] * (L - 1) + [0]                    # B_l widths (last: constant)
    total = sum(2 * n * n * (a + b) for a, b in zip(widths, bwidths))
    return total / 2 if symmetric else total


def worker(cfg):
    import torch

    from ncdp_fast import ntk
    n, d, N, L, device, method = cfg["n"], cfg["d"], cfg["N"], cfg["L"], cfg["device"], cfg["method"]
    torch.backends.cuda.matmul.allow_tf32 = False
    dtype = torch.float32
    model = _model(d, N, L, dtype, device)
    x = torch.randn(n, d, dtype=dtype, device=device)
    sync = sync_for(torch, device)
    if method == "ncdp":
        def fn():
            return ntk.gram_from_torch(model, x)
    elif method == "plain_torch":
        from ncdp_fast._ntk import _namespace, ntk_factors
        params = [m for m in model if isinstance(m, torch.nn.Linear)]
        W = [p.weight.detach() for p in params]
        B = [p.bias.detach() for p in params]

        def fn():
            # The identity in eager torch: factors (same forward/backward), then
            # full n x n products and Hadamard sums.
            terms = ntk_factors(x, W, B, "relu", "standard", _namespace("torch"), torch.matmul)
            K = torch.zeros(n, n, dtype=dtype, device=x.device)
            for f, b in terms:
                Q = b @ b.T
                K += Q if f is None else (f @ f.T) * Q
            return K
    elif method == "torch_func":
        from torch.func import functional_call, jacrev, vmap
        params = {k: v.detach() for k, v in model.named_parameters()}

        def f(p, xi):
            return functional_call(model, p, (xi[None],))[0]

        def fn():
            J = vmap(jacrev(f), in_dims=(None, 0))(params, x)
            return sum(j.reshape(n, -1) @ j.reshape(n, -1).T for j in J.values())
    elif method == "gemm_peak":
        a = torch.randn(4096, 4096, dtype=dtype, device=device)

        def fn():
            return a @ a
    else:
        raise ValueError(method)
    fn()
    start = mem_start(torch, device)
    med, best = timeit(fn, repeats=cfg["repeats"], warmup=0, sync=sync)
    return dict(median_s=med, best_s=best, peak_extra_mb=mem_peak(torch, device, start))


def worker_lambda(cfg):
    import time

    import ncdp_fast as nf
    from ncdp_fast import ntk
    rng = np.random.default_rng(0)
    n = cfg["n"]
    # Two-layer ReLU, d = 64, width 1024: 66560 parameters > n, so K is
    # positive definite (with fewer parameters than samples K is singular and
    # lambda_min is zero to rounding, which the solver reports in a few steps).
    W = [rng.standard_normal((1024, 64)) / 8, rng.standard_normal((1, 1024)) / 32]
    x = rng.standard_normal((n, 64))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    t0 = time.perf_counter()
    K = nf.ntk_gram(x, W, activation="relu")
    t1 = time.perf_counter()
    r = ntk.lambda_min(K)
    t2 = time.perf_counter()
    return dict(gram_s=round(t1 - t0, 2), lambda_s=round(t2 - t1, 2), total_s=round(t2 - t0, 2),
                value=r.value, residual=r.residual, method=r.method)


def main():
    ap = bench_parser(__doc__.split("\n\n")[0])
    args = ap.parse_args()
    if serve_worker(args, lambda cfg: (worker_lambda(cfg) if cfg.get("kind") == "lambda"
                                      else worker(cfg))):
        return
    for dev, meta in devices(args):
        peak = run_worker(__file__, dict(method="gemm_peak", n=1, d=1, N=1, L=1, device=dev,
                                         repeats=5))
        peak_flops = 2 * 4096 ** 3 / peak["median_s"] if "median_s" in peak else None
        rows = []
        shapes = (SHAPES_QUICK if args.quick else SHAPES) + (GPU_EXTRA if dev == "cuda" and
                                                            not args.quick else [])
        for n, d, N, L in shapes:
            def cfg(m):
                return dict(method=m, n=n, d=d, N=N, L=L, device=dev,
                            repeats=3 if n <= 2048 else 1)
            # ncdp and its bar (plain torch) in interleaved rounds; torch.func once.
            res = alternate(lambda c: run_worker(__file__, c),
                            {m: cfg(m) for m in ("ncdp", "plain_torch")}, args.rounds)
            if dev == "cpu":       # peak memory from a separate run (see run_worker)
                for m in ("ncdp", "plain_torch"):
                    mem = run_worker(__file__, dict(cfg(m), repeats=1), exact_memory=True)
                    if "median_s" in res[m]:
                        res[m]["peak_extra_mb"] = mem.get("peak_extra_mb")
            params = d * N + (L - 2) * N * N + N
            res["torch_func"] = (
                dict(error=f"J would need {n * params * 4 / 2**30:.0f} GiB")
                if n * params > FUNC_MAX_PARAMS_X_N else run_worker(__file__, cfg("torch_func")))
            for m in ("ncdp", "plain_torch", "torch_func"):
                print(dev, (n, d, N, L), m, res[m], flush=True)
            row = dict(shape=f"({n}, {d}, {N}, {L})")
            if "median_s" in res["ncdp"]:
                t = res["ncdp"]["median_s"]
                row.update(ncdp_s=t, ncdp_mem_mb=res["ncdp"]["peak_extra_mb"],
                           gflops=_gram_flops(n, d, N, L, True) / t / 1e9,
                           peak_gflops=None if peak_flops is None else peak_flops / 1e9)
                for m in ("plain_torch", "torch_func"):
                    if "median_s" in res[m]:
                        row[f"{m}_s"] = res[m]["median_s"]
                        row[f"x_{m}"] = res[m]["median_s"] / t
                        row[f"{m}_mem_mb"] = res[m]["peak_extra_mb"]
                    else:
                        row[f"{m}_note"] = res[m]["error"]
            else:
                row["error"] = res["ncdp"]["error"]
            rows.append(row)
        notes = ["flop count: 2 n^2 (width_F + width_B) per layer term, halved for the "
                 "symmetric Gram (what ncdp computes); peak: a 4096^3 float32 GEMM in torch",
                 f"ncdp and plain torch ran in {args.rounds} interleaved round(s) (fresh "
                 "process each; the median round is reported), torch.func once; CPU peak MB of "
                 "ncdp and plain torch from one more run each with a fixed glibc mmap threshold "
                 "(bench/_common.run_worker)",
                 "targets: CPU >= 100x torch.func, >= 1.2x plain torch with <= half its memory; "
                 "GPU >= 1.5x plain torch at (16384, 256, 4096, 4)"]
        if dev == "cpu":
            lam = run_worker(__file__, dict(kind="lambda", n=2000 if args.quick else 20000))
            notes.append(f"lambda_min at n = {2000 if args.quick else 20000} (two-layer ReLU, "
                         f"d = 64, width 1024, x on the unit sphere; Gram + solver): "
                         f"{json.dumps(lam)} (target: under 120 s)")
        write_report(
            "bench_ntk", args.out, meta, rows,
            [("shape", "(n, d, N, L)", None), ("ncdp_s", "ncdp s", "{:.3f}"),
             ("plain_torch_s", "plain torch s", "{:.3f}"), ("x_plain_torch", "× plain torch",
                                                            "{:.2f}"),
             ("torch_func_s", "torch.func s", "{:.2f}"), ("x_torch_func", "× torch.func", "{:.0f}"),
             ("torch_func_note", "torch.func note", None),
             ("gflops", "ncdp GFLOP/s", "{:.1f}"), ("peak_gflops", "GEMM peak GFLOP/s", "{:.1f}"),
             ("ncdp_mem_mb", "ncdp peak MB", "{:.0f}"), ("plain_torch_mem_mb",
                                                         "plain torch peak MB", "{:.0f}"),
             ("error", "error", None)], notes=notes)


if __name__ == "__main__":
    main()
