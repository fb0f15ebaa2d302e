"""Benchmark of op 2 (subsampling with averaging) and of Poisson batch plans.

1. ``test_mix`` (report ``bench_mix``): ``ncdp_fast.mix`` vs the formulation of the
   NeuroMixGDP reference code, in torch: a dense Bernoulli mask (T, n)
   (hierarchical: class mask (T, K) times member mask), divided by m, matmul with
   the features and the one-hot labels, plus noise.  Shapes: (n = T = 10000,
   d = 512, K = 10, m = 64, Poisson) and (n = T = 50000, d = 2048, K = 100, m = 64,
   hierarchical with 3 classes per row).  The dense mask needs T*n*4 bytes (10 GB
   at the second size), so it is measured at the T that fits (``DENSE_MAX_GB``)
   and its time per row is extrapolated linearly in T (mask and matmul are both
   linear in T); the report says which numbers are extrapolated.  A third row
   repeats the second with ``clip_x = 1`` (the kernel's clip path).  Achieved gather
   bandwidth: bytes of the selected feature rows read (sum |I_t| * d * itemsize)
   per second, against the machine's read limit measured by summing the features.
2. ``test_poisson_batches`` (report ``bench_poisson_batches``, CPU only):
   ``poisson_batches`` vs Opacus's ``UniformWithReplacementSampler`` (n = 10^6,
   q = 10^-3, 1000 steps).
"""
from __future__ import annotations

from _common import cases, measure

# The third row of each size is the second with a clip bound (clip_x = 1):
# every member's norm and clip factor formed inside the gather (issue 36: the
# kernel's clip path); the features already have norm <= 1, so the dense peer,
# which does not clip, computes the same rows.
MIX_SHAPES = {
    "full": [dict(n=10000, T=10000, d=512, K=10, m=64, classes_per_row=None),
             dict(n=50000, T=50000, d=2048, K=100, m=64, classes_per_row=3),
             dict(n=50000, T=50000, d=2048, K=100, m=64, classes_per_row=3, clip_x=1.0)],
    "quick": [dict(n=4000, T=4000, d=256, K=10, m=64, classes_per_row=None),
              dict(n=8000, T=8000, d=512, K=100, m=64, classes_per_row=3),
              dict(n=8000, T=8000, d=512, K=100, m=64, classes_per_row=3, clip_x=1.0)],
    "smallest": [dict(n=200, T=200, d=16, K=10, m=8, classes_per_row=None),
                 dict(n=200, T=200, d=16, K=10, m=8, classes_per_row=3),
                 dict(n=200, T=200, d=16, K=10, m=8, classes_per_row=3, clip_x=1.0)]}
BATCH_CFG = {"full": dict(n=10**6, q=1e-3, steps=1000), "quick": dict(n=10**5, q=1e-3, steps=200),
             "smallest": dict(n=1000, q=1e-2, steps=5)}
DENSE_MAX_GB = 6.0          # the largest dense float mask (GB) the peer may allocate


def mix_label(shape):
    return (f"n=T={shape['n']}, d={shape['d']}, K={shape['K']}, m={shape['m']}, "
            + ("Poisson" if shape["classes_per_row"] is None else
               f"HS {shape['classes_per_row']} classes/row")
            + (f", clip_x={shape['clip_x']:g}" if shape.get("clip_x") else ""))


def dense_rows(shape, max_gb):
    """The largest T whose float mask (plus the uniform draws and the boolean
    temporaries, ~3 masks' worth) fits in ``max_gb``."""
    return int(min(shape["T"], max_gb * 2**30 / (4 * shape["n"] * 3)))


def CASES(size, device):
    mix = [(mix_label(s), s) for s in MIX_SHAPES[size]]
    b = BATCH_CFG[size]
    batches = [(f"n={b['n']}, q={b['q']}, steps={b['steps']}", b)]
    return {"test_mix": cases("bench_mix", mix, ["ncdp", "dense_torch", "read"]),
            "test_poisson_batches": cases("bench_poisson_batches", batches, ["ncdp", "opacus"])
            if device == "cpu" else []}


def mix_fn(shape, method, T, device):
    """(fn, info): one call of ``method`` producing T mixed rows; ``info["selected"]``
    is the number of feature rows the last call averaged."""
    import torch

    import ncdp_fast as nf
    g = torch.Generator().manual_seed(0)
    X = torch.randn(shape["n"], shape["d"], generator=g)
    X = X / X.norm(dim=1, keepdim=True).clamp(min=1.0)          # ||x|| <= 1 (clipped)
    y = torch.randint(0, shape["K"], (shape["n"],), generator=g)
    if device == "cuda":
        X, y = X.cuda(), y.cuda()
    n, d, K, m = shape["n"], shape["d"], shape["K"], shape["m"]
    rate = None if shape["classes_per_row"] is None else shape["classes_per_row"] / K
    sx, sy = 0.05, 0.05
    info = {"bytes": X.numel() * X.element_size()}
    if method == "ncdp":
        arr = X if device == "cuda" else X.numpy()
        lab = y if device == "cuda" else y.numpy()

        def fn():
            r = nf.mix(arr, lab, num_samples=T, mixup_degree=m, noise_std_x=sx, noise_std_y=sy,
                       num_classes=K, class_rate=rate, clip_x=shape.get("clip_x"), seed=1)
            info["selected"] = int(r.counts.sum())
            return r
    elif method == "dense_torch":
        onehot = torch.nn.functional.one_hot(y, K).to(X.dtype)

        def fn():
            if rate is None:
                mask = (torch.rand(T, n, device=X.device) < m / n).to(X.dtype)
            else:
                classes = torch.rand(T, K, device=X.device) < rate
                members = torch.rand(T, n, device=X.device) < m / (n * rate)
                mask = (classes[:, y] & members).to(X.dtype)
            info["selected"] = int(mask.sum())
            xt = mask @ X / m + sx * torch.randn(T, d, device=X.device)
            yt = mask @ onehot / m + sy * torch.randn(T, K, device=X.device)
            return xt, yt
    elif method == "read":
        def fn():
            return X.sum()
    else:
        raise ValueError(method)
    return fn, info


def test_mix(benchmark, case, bench_device):
    shape, method = case.params, case.method
    T = {"ncdp": shape["T"], "read": 1,
         "dense_torch": dense_rows(shape, DENSE_MAX_GB)}[method]
    fn, info = mix_fn(shape, method, T, bench_device)
    measure(benchmark, case, fn, device=bench_device,
            repeats={"ncdp": 3, "read": 10, "dense_torch": 2}[method],
            warmup=2 if method == "read" else 0,
            T_measured=T, **({"bytes": info["bytes"]} if method == "read" else {}))
    if method == "ncdp" and not benchmark.disabled:
        # Achieved gather bandwidth: the selected feature rows read per second.
        benchmark.extra_info["gbs"] = (info["selected"] * shape["d"] * 4
                                       / benchmark.stats.stats.median / 1e9)


def test_poisson_batches(benchmark, case, bench_device):
    import ncdp_fast as nf
    n, q, steps = case.params["n"], case.params["q"], case.params["steps"]
    if case.method == "ncdp":
        def fn():
            return sum(len(b) for b in nf.poisson_batches(n, sample_rate=q, steps=steps, seed=1))
    else:
        import pytest
        pytest.importorskip("opacus")
        from opacus.utils.uniform_sampler import UniformWithReplacementSampler

        def fn():
            s = UniformWithReplacementSampler(num_samples=n, sample_rate=q, steps=steps)
            return sum(len(b) for b in s)
    measure(benchmark, case, fn, device="cpu", repeats=5 if case.method == "ncdp" else 2,
            warmup=0)
