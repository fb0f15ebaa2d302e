"""Benchmark of the NeuroMixGDP release (``ncdp_fast.release.NeuroMixGDP.release``).

Configuration (issue #7): n = T = 60000, d = 3969 (ScatterNet J=2 on MNIST), K = 10,
m = 64, epsilon = 1, delta = 1e-5; Poisson sampling and hierarchical sampling with 3
classes per row.  Features: the cached MNIST ScatterNet training features when
``make data`` has run, else random unit-norm features of the same shape (the report's
``features`` column says which; timings do not depend on the values).

Measured per configuration, each in a fresh subprocess (peak memory is its own):

* ours: the whole ``release()`` call (calibration by Theorem 3.1, the PLD epsilon of the
  report, clipping, sampling, averaging, noise) and, separately, the accounting alone
  (``Released.recompute_report``), median of the repeats;
* dense: the formulation of the paper's code -- a dense (T, n) Bernoulli mask (HS: class
  mask times member mask), matmul with the features and the one-hot labels, divided by
  m, plus noise -- reused from ``bench_mix.worker_mix``.  A T x n float mask at
  60000^2 is 14.4 GB, so dense runs at the largest T whose mask fits in
  ``--dense-max-gb`` and its time per row is extrapolated linearly to T (mask and matmul
  are both linear in T); the report marks those numbers as extrapolated.

``python bench/bench_release.py [--quick] [--out bench/results] [--device cpu|cuda|all]``.
"""
from __future__ import annotations

from _common import (bench_parser, devices, mem_peak, mem_start, run_worker, serve_worker,
                     sync_for, timeit, write_report)

SHAPES = [dict(n=60000, T=60000, d=3969, K=10, m=64, classes_per_row=None),
          dict(n=60000, T=60000, d=3969, K=10, m=64, classes_per_row=3)]
SHAPES_QUICK = [dict(n=6000, T=6000, d=1024, K=10, m=64, classes_per_row=None),
                dict(n=6000, T=6000, d=1024, K=10, m=64, classes_per_row=3)]


def _features(cfg):
    """(X float32 (n, d), y int64 (n,), source): MNIST ScatterNet if cached and of the
    configured shape, else random unit-norm rows."""
    import numpy as np
    if cfg["d"] == 3969:
        try:
            from ncdp_fast.datasets import load_features
            X, y = load_features("mnist", "scatter", "train")
            if X.shape[0] >= cfg["n"]:
                return X[:cfg["n"]], y[:cfg["n"]], "MNIST ScatterNet (cached)"
        except FileNotFoundError:
            pass
    rng = np.random.default_rng(0)
    X = rng.standard_normal((cfg["n"], cfg["d"]), dtype=np.float32)
    X /= np.linalg.norm(X, axis=1, keepdims=True)
    return X, rng.integers(0, cfg["K"], cfg["n"]), "random (cache missing)" \
        if cfg["d"] == 3969 else "random"


def worker_release(cfg):
    import time

    import torch

    from ncdp_fast.release import NeuroMixGDP
    device = cfg["device"]
    X, y, source = _features(cfg)
    if device == "cuda":
        X, y = torch.from_numpy(X).cuda(), torch.from_numpy(y).cuda()
    sync = sync_for(torch, device)
    g = NeuroMixGDP(epsilon=1.0, delta=1e-5, mixup_degree=cfg["m"], num_samples=cfg["T"],
                    hierarchical_classes=cfg["classes_per_row"], seed=1)
    info = {}
    import ncdp_fast.privacy.hierarchical as R

    def fn():
        R._hs_pld_epsilon.cache_clear()    # the HS PLD is memoised: time it every call
        info["rel"] = g.release(X, y, num_classes=cfg["K"])
    fn()                                   # numba compile / CUDA init outside the timing
    start = mem_start(torch, device)
    med, best = timeit(fn, repeats=cfg["repeats"], warmup=0, sync=sync)
    peak = mem_peak(torch, device, start)
    rel = info["rel"]
    R._hs_pld_epsilon.cache_clear()
    t0 = time.perf_counter()
    rel.recompute_report()
    acc_s = time.perf_counter() - t0
    return dict(median_s=med, best_s=best, peak_extra_mb=peak, accounting_s=acc_s,
                source=source, epsilon_pld=rel.report.epsilon_pld,
                epsilon_clt=rel.report.epsilon_clt)


def worker_dense(cfg):
    from bench_mix import worker_mix
    return worker_mix(dict(cfg, method="dense_torch"))


def bench(device, quick, dense_max_gb):
    rows = []
    for shape in (SHAPES_QUICK if quick else SHAPES):
        label = (f"n=T={shape['n']}, d={shape['d']}, K={shape['K']}, m={shape['m']}, "
                 + ("Poisson" if shape["classes_per_row"] is None else
                    f"HS {shape['classes_per_row']} classes/row"))
        ours = run_worker(__file__, dict(kind="release", device=device,
                                         repeats=2 if quick else 3, **shape))
        # Dense mask: the largest T whose float mask (plus the uniform draws and the
        # boolean temporaries, ~3 masks' worth) fits in dense_max_gb.
        T_fit = int(min(shape["T"], dense_max_gb * 2**30 / (4 * shape["n"] * 3)))
        dense = run_worker(__file__, dict(kind="dense", device=device, repeats=2,
                                          T_run=T_fit, **shape))
        print(label, "ours", ours, "dense", dense, flush=True)
        row = dict(device=device, config=label, T_dense_measured=T_fit)
        if "error" in ours or "error" in dense:
            row["error"] = "; ".join(r.get("error", "") for r in (ours, dense))
            rows.append(row)
            continue
        per_row = dense["median_s"] / T_fit
        dense_full = per_row * shape["T"]
        row.update(features=ours["source"], ncdp_s=ours["median_s"],
                   accounting_s=ours["accounting_s"], ncdp_mem_mb=ours["peak_extra_mb"],
                   ncdp_us_per_row=1e6 * ours["median_s"] / shape["T"],
                   dense_us_per_row=1e6 * per_row, dense_s=dense_full,
                   dense_extrapolated=T_fit < shape["T"], speedup=dense_full / ours["median_s"],
                   dense_mem_mb=dense["peak_extra_mb"], epsilon_clt=ours["epsilon_clt"],
                   epsilon_pld=ours["epsilon_pld"])
        rows.append(row)
    return rows


def main():
    ap = bench_parser(__doc__.split("\n\n")[0])
    ap.add_argument("--dense-max-gb", type=float, default=1.5,
                    help="memory (GB) the dense peer's mask and its temporaries may use")
    args = ap.parse_args()
    if serve_worker(args, lambda cfg: (worker_release(cfg) if cfg["kind"] == "release"
                                      else worker_dense(cfg))):
        return
    for dev, meta in devices(args):
        rows = bench(dev, args.quick, args.dense_max_gb)
        write_report(
            "bench_release", args.out, meta, rows,
            [("config", "configuration", None), ("features", "features", None),
             ("ncdp_s", "release() s", "{:.2f}"), ("accounting_s", "of which accounting s",
                                                   "{:.2f}"),
             ("ncdp_us_per_row", "release µs/row", "{:.0f}"),
             ("dense_us_per_row", "dense µs/row (measured)", "{:.0f}"),
             ("T_dense_measured", "dense T measured", None),
             ("dense_s", "dense s at T", "{:.1f}"),
             ("dense_extrapolated", "dense s extrapolated", None),
             ("speedup", "× dense", "{:.1f}"), ("ncdp_mem_mb", "release peak MB", "{:.0f}"),
             ("dense_mem_mb", "dense peak MB (at T measured)", "{:.0f}"),
             ("epsilon_clt", "eps CLT", "{:.3f}"), ("epsilon_pld", "eps PLD", "{:.3f}"),
             ("error", "error", None)],
            notes=["release(): Theorem 3.1 calibration + PLD report + ncdp_fast.mix (clip, "
                   "sample, average, noise); epsilon = 1, delta = 1e-5",
                   "dense: the NeuroMixGDP reference formulation (T x n Bernoulli mask, "
                   "matmul, noise; bench_mix.worker_mix) on random features of the same shape, "
                   "measured at 'dense T measured' rows and scaled linearly to T where marked "
                   "extrapolated",
                   "peak MB: resident-set growth after loading the features (CPU) / CUDA "
                   "allocator peak"])


if __name__ == "__main__":
    main()
