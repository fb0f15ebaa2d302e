"""Benchmark of the NeuroMixGDP release (``ncdp_fast.release.NeuroMixGDP.release``;
report ``bench_release``).

Configuration (issue #7): n = T = 60000, d = 3969 (ScatterNet J=2 on MNIST), K = 10,
m = 64, epsilon = 1, delta = 1e-5; Poisson sampling and hierarchical sampling with 3
classes per row.  Features: the cached MNIST ScatterNet training features when
``make data`` has run, else random unit-norm features of the same shape (the report's
``features`` column says which; timings do not depend on the values).

* ours: the whole ``release()`` call (calibration by Theorem 3.1, the PLD epsilon of the
  report, clipping, sampling, averaging, noise) and, separately, the accounting alone
  (``Released.recompute_report``, in extra_info);
* dense: the formulation of the paper's code -- a dense (T, n) Bernoulli mask (HS: class
  mask times member mask), matmul with the features and the one-hot labels, divided by
  m, plus noise -- reused from ``test_bench_mix.mix_fn``.  A T x n float mask at
  60000^2 is 14.4 GB, so dense runs at the largest T whose mask fits in
  ``DENSE_MAX_GB`` and its time per row is extrapolated linearly to T (mask and matmul
  are both linear in T); the report marks those numbers as extrapolated.
"""
from __future__ import annotations

import time

from _common import cases, measure
from test_bench_mix import dense_rows, mix_fn, mix_label

SHAPES = {"full": [dict(n=60000, T=60000, d=3969, K=10, m=64, classes_per_row=None),
                   dict(n=60000, T=60000, d=3969, K=10, m=64, classes_per_row=3)],
          "quick": [dict(n=6000, T=6000, d=1024, K=10, m=64, classes_per_row=None),
                    dict(n=6000, T=6000, d=1024, K=10, m=64, classes_per_row=3)],
          "smallest": [dict(n=200, T=200, d=16, K=10, m=8, classes_per_row=None),
                       dict(n=200, T=200, d=16, K=10, m=8, classes_per_row=3)]}
DENSE_MAX_GB = 1.5      # memory the dense peer's mask and its temporaries may use


def CASES(size, device):
    return {"test_release": cases("bench_release", [(mix_label(s), s) for s in SHAPES[size]],
                                  ["ncdp", "dense_torch"])}


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


def test_release(benchmark, case, bench_device, bench_size):
    shape, device = case.params, bench_device
    if case.method == "dense_torch":
        T = dense_rows(shape, DENSE_MAX_GB)
        fn, _ = mix_fn(shape, "dense_torch", T, device)
        measure(benchmark, case, fn, device=device, repeats=2, warmup=0, T_measured=T)
        return
    import torch

    import ncdp_fast.privacy.hierarchical as R
    from ncdp_fast.release import NeuroMixGDP
    X, y, source = _features(shape)
    if device == "cuda":
        X, y = torch.from_numpy(X).cuda(), torch.from_numpy(y).cuda()
    g = NeuroMixGDP(epsilon=1.0, delta=1e-5, mixup_degree=shape["m"], num_samples=shape["T"],
                    hierarchical_classes=shape["classes_per_row"], seed=1)

    def fn():
        R._hs_pld_epsilon.cache_clear()    # the HS PLD is memoised: time it every call
        return g.release(X, y, num_classes=shape["K"])
    rel = measure(benchmark, case, fn, device=device, repeats=2 if bench_size != "full" else 3,
                  warmup=0, T_measured=shape["T"], features=source)
    R._hs_pld_epsilon.cache_clear()
    t0 = time.perf_counter()
    rel.recompute_report()
    benchmark.extra_info.update(accounting_s=time.perf_counter() - t0,
                                epsilon_pld=rel.report.epsilon_pld,
                                epsilon_clt=rel.report.epsilon_clt)
