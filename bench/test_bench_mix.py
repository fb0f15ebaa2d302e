"""Benchmark of op 2 (subsampling with averaging) and of Poisson batch plans.

1. ``ncdp_fast.mix`` vs the formulation of the NeuroMixGDP reference code, in
   torch: a dense Bernoulli mask (T, n) (hierarchical: class mask (T, K) times
   member mask), divided by m, matmul with the features and the one-hot
   labels, plus noise.  Shapes: (n = T = 10000, d = 512, K = 10, m = 64,
   Poisson) and (n = T = 50000, d = 2048, K = 100, m = 64, hierarchical with 3
   classes per row).  The dense mask needs T*n*4 bytes (10 GB at the second
   size), so it is measured at the T that fit (``--dense-max-gb``) and its
   time per row is extrapolated linearly in T (mask and matmul are both
   linear in T), and the report says which numbers are extrapolated.
   Achieved gather bandwidth: bytes of the selected feature rows read
   (sum |I_t| * d * itemsize) per second, against the machine's read limit
   measured by summing the feature matrix.
2. ``poisson_batches`` vs Opacus's ``UniformWithReplacementSampler`` (n = 10^6,
   q = 10^-3, 1000 steps).

Each configuration runs in a fresh subprocess (peak memory is its own).
``python bench/bench_mix.py [--quick] [--out bench/results] [--device cpu|cuda|all]``.
"""
from __future__ import annotations


from _common import (bench_parser, devices, mem_peak, mem_start, run_worker, serve_worker,
                     sync_for, timeit, write_report)

MIX_SHAPES = [dict(n=10000, T=10000, d=512, K=10, m=64, classes_per_row=None),
              dict(n=50000, T=50000, d=2048, K=100, m=64, classes_per_row=3)]
MIX_SHAPES_QUICK = [dict(n=4000, T=4000, d=256, K=10, m=64, classes_per_row=None),
                    dict(n=8000, T=8000, d=512, K=100, m=64, classes_per_row=3)]
BATCH_CFG = dict(n=10**6, q=1e-3, steps=1000)
BATCH_CFG_QUICK = dict(n=10**5, q=1e-3, steps=200)


def _inputs(cfg, torch, device):
    g = torch.Generator().manual_seed(0)
    X = torch.randn(cfg["n"], cfg["d"], generator=g)
    X = X / X.norm(dim=1, keepdim=True).clamp(min=1.0)          # ||x|| <= 1 (clipped)
    y = torch.randint(0, cfg["K"], (cfg["n"],), generator=g)
    if device == "cuda":
        X, y = X.cuda(), y.cuda()
    return X, y


def worker_mix(cfg):
    import torch

    import ncdp_fast as nf
    device, method = cfg["device"], cfg["method"]
    X, y = _inputs(cfg, torch, device)
    n, T, d, K, m = cfg["n"], cfg["T_run"], cfg["d"], cfg["K"], cfg["m"]
    rate = None if cfg["classes_per_row"] is None else cfg["classes_per_row"] / K
    sx, sy = 0.05, 0.05
    sync = sync_for(torch, device)
    info = {}
    if method == "ncdp":
        arr = X if device == "cuda" else X.numpy()
        lab = y if device == "cuda" else y.numpy()

        def fn():
            r = nf.mix(arr, lab, num_samples=T, mixup_degree=m, noise_std_x=sx, noise_std_y=sy,
                       num_classes=K, class_rate=rate, seed=1)
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
    fn()
    start = mem_start(torch, device)
    med, best = timeit(fn, repeats=cfg["repeats"], warmup=0, sync=sync, min_time=0.0)
    return dict(median_s=med, best_s=best, peak_extra_mb=mem_peak(torch, device, start),
                selected=info.get("selected"), bytes=X.numel() * X.element_size())


def worker_batches(cfg):
    import torch

    import ncdp_fast as nf
    n, q, steps = cfg["n"], cfg["q"], cfg["steps"]
    if cfg["method"] == "ncdp":
        def fn():
            return sum(len(b) for b in nf.poisson_batches(n, sample_rate=q, steps=steps, seed=1))
    else:
        from opacus.utils.uniform_sampler import UniformWithReplacementSampler

        def fn():
            s = UniformWithReplacementSampler(num_samples=n, sample_rate=q, steps=steps)
            return sum(len(b) for b in s)
    fn()                                   # compile / import outside the measurement
    start = mem_start(torch, "cpu")
    med, best = timeit(fn, repeats=cfg["repeats"], warmup=0)
    return dict(median_s=med, best_s=best, peak_extra_mb=mem_peak(torch, "cpu", start))


def bench_mix(device, quick, dense_max_gb):
    rows = []
    for shape in (MIX_SHAPES_QUICK if quick else MIX_SHAPES):
        label = (f"n=T={shape['n']}, d={shape['d']}, K={shape['K']}, m={shape['m']}, "
                 + ("Poisson" if shape["classes_per_row"] is None else
                    f"HS {shape['classes_per_row']} classes/row"))
        ours = run_worker(__file__, dict(kind="mix", method="ncdp", device=device, repeats=3,
                                         T_run=shape["T"], **shape))
        read = run_worker(__file__, dict(kind="mix", method="read", device=device, repeats=10,
                                         T_run=1, **shape))
        # Dense mask: the largest T (a divisor-friendly fraction) whose float mask fits.
        T_fit = int(min(shape["T"], dense_max_gb * 2**30 / (4 * shape["n"] * 3)))
        dense = run_worker(__file__, dict(kind="mix", method="dense_torch", device=device,
                                          repeats=2, T_run=T_fit, **shape))
        print(label, "ours", ours, "dense", dense, "read", read, flush=True)
        row = dict(device=device, config=label, T_dense_measured=T_fit)
        if "error" in ours or "error" in dense or "error" in read:
            row["error"] = "; ".join(r.get("error", "") for r in (ours, dense, read))
            rows.append(row)
            continue
        dense_full = dense["median_s"] * shape["T"] / T_fit
        gathered = ours["selected"] * shape["d"] * 4
        row.update(
            ncdp_s=ours["median_s"], dense_s=dense_full, dense_extrapolated=T_fit < shape["T"],
            speedup=dense_full / ours["median_s"], ncdp_mem_mb=ours["peak_extra_mb"],
            dense_mem_mb=dense["peak_extra_mb"],
            gather_gbs=gathered / ours["median_s"] / 1e9,
            read_gbs=read["bytes"] / read["median_s"] / 1e9)
        row["gather_frac"] = row["gather_gbs"] / row["read_gbs"]
        rows.append(row)
    return rows


def bench_batches(quick):
    cfg = BATCH_CFG_QUICK if quick else BATCH_CFG
    ours = run_worker(__file__, dict(kind="batches", method="ncdp", repeats=5, **cfg))
    peer = run_worker(__file__, dict(kind="batches", method="opacus", repeats=2, **cfg))
    print("batches", ours, peer, flush=True)
    row = dict(config=f"n={cfg['n']}, q={cfg['q']}, steps={cfg['steps']}")
    if "error" in ours or "error" in peer:
        row["error"] = "; ".join(r.get("error", "") for r in (ours, peer))
    else:
        row.update(ncdp_s=ours["median_s"], opacus_s=peer["median_s"],
                   speedup=peer["median_s"] / ours["median_s"],
                   ncdp_mem_mb=ours["peak_extra_mb"], opacus_mem_mb=peer["peak_extra_mb"])
    return [row]


def main():
    ap = bench_parser(__doc__.split("\n\n")[0])
    ap.add_argument("--dense-max-gb", type=float, default=6.0,
                    help="largest dense float mask (GB) the peer may allocate")
    args = ap.parse_args()
    if serve_worker(args, lambda cfg: (worker_mix(cfg) if cfg["kind"] == "mix"
                                      else worker_batches(cfg))):
        return
    for dev, meta in devices(args):
        rows = bench_mix(dev, args.quick, args.dense_max_gb)
        write_report(
            "bench_mix", args.out, meta, rows,
            [("config", "configuration", None), ("ncdp_s", "ncdp s", "{:.3f}"),
             ("dense_s", "dense torch s", "{:.2f}"), ("dense_extrapolated", "dense extrapolated",
                                                     None),
             ("T_dense_measured", "dense T measured", None), ("speedup", "× dense", "{:.1f}"),
             ("gather_gbs", "gather GB/s", "{:.1f}"), ("read_gbs", "read limit GB/s", "{:.1f}"),
             ("gather_frac", "gather / read", "{:.2f}"), ("ncdp_mem_mb", "ncdp peak MB", "{:.0f}"),
             ("dense_mem_mb", "dense peak MB (at T measured)", "{:.0f}"), ("error", "error", None)],
            notes=["dense torch: the NeuroMixGDP reference formulation (Bernoulli mask, matmul); "
                   "where its mask does not fit it runs at T measured and is scaled linearly to T",
                   "targets: CPU >= 20x dense at the first size; GPU gather >= 0.60 of the read "
                   "limit"])
        if dev == "cpu":
            write_report(
                "bench_poisson_batches", args.out, meta, bench_batches(args.quick),
                [("config", "configuration", None), ("ncdp_s", "ncdp s", "{:.4f}"),
                 ("opacus_s", "Opacus UniformWithReplacementSampler s", "{:.3f}"),
                 ("speedup", "× Opacus", "{:.1f}"), ("ncdp_mem_mb", "ncdp peak MB", "{:.0f}"),
                 ("opacus_mem_mb", "Opacus peak MB", "{:.0f}"), ("error", "error", None)],
                notes=["target: >= 10x faster than Opacus's sampler"])


if __name__ == "__main__":
    main()
