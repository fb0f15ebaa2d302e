"""``ncdp-fast reproduce nc-real``: paper 000 (Neural Collapse meets DP), Sections 5.1, 5.3,
5.4 / Figures 2-4 on pretrained features (``ncdp_fast.datasets.load_features``), for
each feature extractor (ScatterNet, EfficientNet-Lite0) and data set.

1. NC metrics and the per-class feature shift beta (Section 5.1, Figure 2).
2. Figure 3(b): NoisySGD / SGD versus p, clean and perturbed test, trained at each p
   (``real_dimension.dimension_sweep``) and, for copies, extended to very large p by an
   exact reduction (``real_dimension.extended_sweep``), with the noise-to-signal report.
3. Figure 4: perturbed train and test, PCA to k components under the paper's protocol
   (not private) and the private-valid ones (public rows, DP-PCA), with the
   spiked-covariance analysis (``real_pca``, ``protocols``, ``spiked``).

Every perturbation scale of ``--scales`` is run.  Modules: ``real_data`` (features),
``real_fit`` (NoisySGD/SGD), ``real_report`` (tables, plots).
"""
from __future__ import annotations

import argparse
import logging
import time

import numpy as np

from ... import nc
from ..._backend import resolve_seed
from .protocols import dp_pca_budget, protocol_names
from .real_data import load_split, perturb_var
from .real_dimension import dimension_sweep, extended_sweep
from .real_pca import pca_experiment
from .real_report import write_all

__all__ = ["real_main"]


def _floats(text):
    return [float(f) for f in text.split(",") if f.strip()]


def _parser():
    ap = argparse.ArgumentParser(prog="ncdp-fast reproduce nc-real",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--quick", action="store_true",
                    help="8000 private rows, 3 epochs, fewer p, scales and k (a smoke run)")
    ap.add_argument("--seed", type=int, default=None, help="master seed (default: from the OS)")
    ap.add_argument("--datasets", default="fashion-mnist,mnist")
    ap.add_argument("--extractors", "--extractor", default="efficientnet-lite0,scatter",
                    help="comma list of feature extractors")
    ap.add_argument("--resolution", type=int, default=None,
                    help="EfficientNet-Lite0 input side of the cached features (default: "
                         "the datasets module's DEFAULT_RESOLUTION)")
    ap.add_argument("--epsilon", type=float, default=1.0)
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--epochs", type=float, default=None, help="default 10 (quick 3)")
    ap.add_argument("--batch", type=int, default=1024, help="expected Poisson batch size")
    ap.add_argument("--lr", type=float, default=2.0)
    ap.add_argument("--accountant", default="pld", choices=["pld", "rdp"])
    ap.add_argument("--public-sizes", default="5000,20000",
                    help="public row counts for PCA (the largest is held out of training)")
    ap.add_argument("--max-private", type=int, default=None,
                    help="cap on private training rows (default all; quick 8000)")
    ap.add_argument("--dim-factors", default=None,
                    help="p/d trained at p (default 0.125,0.5,1,2,4; quick 0.25,1,2)")
    ap.add_argument("--extend", default=None,
                    help="integer copy ratios r = p/d of the exact reduction (default "
                         "1,2,4,16,64,256,1024,4096,16384,65536; quick 1,2,64)")
    ap.add_argument("--reps", type=int, default=3, help="draws per reduced point")
    ap.add_argument("--max-trained-p", type=int, default=4096,
                    help="largest p trained at p (larger p: the exact copies reduction only)")
    ap.add_argument("--pca-factors", default="1", help="p/d of the Figure 4 runs")
    ap.add_argument("--pca-max-p", type=int, default=1280,
                    help="cap on the Figure 4 p (a coordinate subset above it)")
    ap.add_argument("--pca", default=None, help="components (default K-1,50,100)")
    ap.add_argument("--pca-scales", default=None,
                    help="perturbation scales of Figure 4 (default unit:0.1,unit:0.01,rel:0.1)")
    ap.add_argument("--scales", default=None,
                    help="perturbation scales, 'unit:V' (variance V per coordinate of the "
                         "unit-norm rows) or 'rel:V' (V/d: the same relative perturbation "
                         "as V on features of mean squared coordinate 1) (default "
                         "unit:0.1,unit:0.01,unit:0.001,rel:0.1; quick unit:0.1,rel:0.1)")
    ap.add_argument("--wait-for-cache", type=float, default=0.0,
                    help="seconds to wait for a feature cache that a concurrent `ncdp-fast "
                         "data` is still writing (default 0: fail at once)")
    ap.add_argument("--threads", type=int, default=None,
                    help="BLAS/OpenMP/numba threads for the run (default: unchanged; 1 is "
                         "much faster on a machine shared with other jobs)")
    ap.add_argument("--dp-pca-share", type=float, default=0.1,
                    help="share of the zCDP budget spent by DP-PCA (0: no DP-PCA)")
    return ap


def real_main(argv: list[str]) -> int:
    """``ncdp-fast reproduce nc-real [--quick] [--datasets ...] [--extractors ...]
    [--scales ...] [--out DIR] [--seed S]`` (``--help``)."""
    args = _parser().parse_args(argv)
    # dp_accounting's RDP orders that fail to converge are excluded with a warning per
    # order (the DP-PCA compositions): valid, and too many lines for the progress log
    logging.getLogger("absl").setLevel(logging.ERROR)
    if args.threads:
        import numba
        from threadpoolctl import threadpool_limits
        threadpool_limits(args.threads)
        numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
    q = args.quick
    args.epochs = args.epochs or (3.0 if q else 10.0)
    max_private = args.max_private or (8000 if q else None)
    factors = _floats(args.dim_factors or ("0.25,1,2" if q else "0.125,0.5,1,2,4"))
    if 1.0 not in factors:
        factors.append(1.0)               # the reduction starts from the model at p = d
    ratios = [int(r) for r in _floats(args.extend or (
        "1,2,64" if q else "1,2,4,16,64,256,1024,4096,16384,65536"))]
    scales = [s.strip() for s in (args.scales or ("unit:0.1,rel:0.1" if q else
              "unit:0.1,unit:0.01,unit:0.001,rel:0.1")).split(",") if s.strip()]
    pca_scales = [s.strip() for s in (args.pca_scales or ("unit:0.1,rel:0.1" if q else
                  "unit:0.1,unit:0.01,rel:0.1")).split(",") if s.strip()]
    for s in scales + pca_scales:
        perturb_var(s, 1)                 # fail early on a bad scale
    public_sizes = [int(m) for m in args.public_sizes.split(",") if m.strip()]
    protos = protocol_names(public_sizes, dp_pca=args.dp_pca_share > 0)
    budget = dp_pca_budget(args.epsilon, args.delta, args.dp_pca_share) \
        if args.dp_pca_share > 0 else dict(rho_pca=None, epsilon_pca=None, rho_total=None)
    master = resolve_seed(args.seed)
    ss = np.random.SeedSequence(master)
    seeds = (int(x.generate_state(1, np.uint64)[0]) for x in iter(lambda: ss.spawn(1)[0], None))
    t_start = time.perf_counter()

    def progress(msg):
        m, s = divmod(int(time.perf_counter() - t_start), 60)
        print(f"[nc-real {m:3d}:{s:02d}] {msg}", flush=True)

    res = dict(metrics=[], dimension=[], pca=[], spiked=[], beta={})
    pairs = [(e.strip(), d.strip()) for e in args.extractors.split(",") if e.strip()
             for d in args.datasets.split(",") if d.strip()]
    for i, (ext, ds) in enumerate(pairs):
        progress(f"({i + 1}/{len(pairs)}) loading {ds}/{ext}")
        split_seed, waited = next(seeds), 0.0
        while True:
            try:
                F = load_split(ds, ext, resolution=args.resolution,
                               public_pool=max(public_sizes), seed=split_seed,
                               max_private=max_private)
                break
            except FileNotFoundError as exc:
                if waited >= args.wait_for_cache:
                    raise SystemExit(f"nc-real: {exc}\n(develop on cache-free data with "
                                     "--datasets digits --extractors pixels)") from None
                progress(f"waiting for the {ds}/{ext} feature cache ({waited:.0f} s)")
                time.sleep(30.0)
                waited += 30.0
        m = nc.metrics(F.Xpriv, F.ypriv, num_classes=F.K)
        res["metrics"].append(dict(dataset=F.tag, n=len(F.ypriv), d=F.d, **m.summary()))
        res["beta"][F.tag] = (m.beta, F.ypriv, m.beta_median)
        progress(f"{F.tag}: n={len(F.ypriv)} private, {len(F.Xpub)} public, d={F.d}; NC "
                 f"cos median {m.summary()['cos_median']:.3f}")
        coords = np.random.Generator(np.random.PCG64(next(seeds))).permutation(F.d)
        trained = [f for f in factors if f == 1.0 or round(f * F.d) <= args.max_trained_p]
        rows, models = dimension_sweep(F, trained, scales, args, coords, seeds, progress)
        res["dimension"] += rows
        res["dimension"] += extended_sweep(F, models[F.d], ratios, scales, coords, next(seeds),
                                           args.reps)
        progress(f"{F.tag}: extended sweep to p = {max(ratios) * F.d} done")
        ks = sorted({int(c) for c in (args.pca.split(",") if args.pca else
                                      (F.K - 1, 50, 100))})
        avail = [m for m in public_sizes if m <= len(F.Xpub)]
        use_protos = [pr for pr in protos if not pr.startswith("public-") or
                      int(pr.split("-", 1)[1]) in avail]
        for f in _floats(args.pca_factors):
            p = max(F.K, min(int(round(f * F.d)), args.pca_max_p))
            use = [k for k in ks if k <= min([p] + avail)]
            rows, spiked = pca_experiment(F, p, pca_scales, use_protos, use, args, budget,
                                          coords, seeds, progress)
            res["pca"] += rows
            res["spiked"] += spiked
        del F
    total = time.perf_counter() - t_start
    progress(f"all runs done in {total:.0f} s; writing reports")
    write_all(res, args, dict(quick=q, seed=master, max_private=max_private, scales=scales,
                              pca_scales=pca_scales,
                              factors=factors, ratios=ratios, protocols=protos,
                              budget=budget, seconds=total))
    return 0
