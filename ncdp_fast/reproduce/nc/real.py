"""``ncdp-fast reproduce nc-real``: paper 000 (Neural Collapse meets DP), Sections 5.1, 5.3,
5.4 / Figures 2-4 on pretrained features (``ncdp_fast.datasets.load_features``).

NC metrics and the per-class feature shift beta; NoisySGD vs dimension (coordinates
sub-sampled or copied), on clean test features and with Gaussian test perturbation;
PCA to K-1 / 50 / 100 components fit on a public split (training rows held out from
private training) with train and test perturbed.
"""
from __future__ import annotations

import argparse
import math
import time
import warnings

import numpy as np

from ... import nc
from ..._backend import resolve_seed
from ..._mix import poisson_batches
from ..._report import save_figure, write_report
from ..._stream import NoiseReuseWarning, NoiseStream
from ...datasets import load_features
from ...train import NoisySGDClassifier, linear_steps
from .common import FixedLinear, run_meta

__all__ = ["real_main"]


def _normalize(X):
    """Rows to unit L2 norm in place (Section 5.1's standard normalisation)."""
    norms = np.linalg.norm(X, axis=1, keepdims=True)
    X /= np.maximum(norms, np.float32(1e-12))
    return X


def _resize(X, p, coords):
    """Feature dimension p from d: a fixed coordinate subset (p < d) or copies of the
    whole feature vector (p > d), rows renormalised to unit norm.  ``coords`` is a
    public permutation of the d coordinates."""
    d = X.shape[1]
    if p <= d:
        out = np.ascontiguousarray(X[:, coords[:p]])
    else:
        reps = -(-p // d)
        out = np.empty((X.shape[0], p), np.float32)
        for r in range(reps):
            w = min(d, p - r * d)
            out[:, r * d:r * d + w] = X[:, coords[:w]] if w < d else X
    return _normalize(out)


def _perturb(X, var, seed, rows=8192):
    """X + N(0, var) in place, row chunks (the paper's Gaussian perturbation)."""
    rng = np.random.Generator(np.random.PCG64(seed))
    sd = np.float32(math.sqrt(var))
    for s in range(0, X.shape[0], rows):
        X[s:s + rows] += sd * rng.standard_normal(X[s:s + rows].shape, dtype=np.float32)
    return X


def _sgd_pair(Xtr, ytr, K, args, seed, preprocessing=(), reference=True):
    """NoisySGD at the budget and (``reference``) the same clipped SGD without noise on
    the same batches."""
    q = args.batch / Xtr.shape[0]
    stream = NoiseStream(seed)
    key = stream.state()         # private to this run: it rebuilds the batches below
    clf = NoisySGDClassifier(epsilon=args.epsilon, delta=args.delta, sample_rate=q,
                             epochs=args.epochs, lr=args.lr, accountant=args.accountant,
                             num_classes=K, seed=stream).fit(Xtr, ytr, preprocessing=preprocessing)
    if not reference:
        return clf, None
    with warnings.catch_warnings():
        # The same batches on purpose, for the noise-free reference (not released).
        warnings.simplefilter("ignore", NoiseReuseWarning)
        plan = poisson_batches(Xtr.shape[0], sample_rate=q, steps=clf.steps_, seed=key["seed"],
                               offset=key["offset"])
    W0 = linear_steps(Xtr, ytr, num_classes=K, steps=clf.steps_, lr=args.lr, loss="ce",
                       max_grad_norm=1.0, noise_multiplier=0.0, projection_radius=None,
                       fit_intercept=False, seed=0, batches=plan,
                       expected_batch_size=clf.expected_batch_size_)[0]
    return clf, FixedLinear(W0)


def _acc(model, X, y):
    return float(np.mean(np.asarray(model.predict(X)) == y))


def real_main(argv: list[str]) -> int:
    """``ncdp-fast reproduce nc-real [--quick] [--datasets fashion-mnist,mnist]
    [--extractor efficientnet-lite0] [--out DIR] [--seed S]``."""

    ap = argparse.ArgumentParser(prog="ncdp-fast reproduce nc-real", description=real_main.__doc__)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--quick", action="store_true",
                    help="10000 private rows, 3 epochs, p in {d/4, 2d}, PCA at p = d")
    ap.add_argument("--seed", type=int, default=None, help="master seed (default: from the OS)")
    ap.add_argument("--datasets", default="fashion-mnist,mnist")
    ap.add_argument("--extractor", default="efficientnet-lite0")
    ap.add_argument("--resolution", type=int, default=None,
                    help="EfficientNet-Lite0 input side of the cached features (default: the "
                         "datasets module's DEFAULT_RESOLUTION)")
    ap.add_argument("--epsilon", type=float, default=1.0)
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--epochs", type=float, default=None, help="default 10 (quick 3)")
    ap.add_argument("--batch", type=int, default=1024, help="expected Poisson batch size")
    ap.add_argument("--lr", type=float, default=2.0)
    ap.add_argument("--accountant", default="pld", choices=["pld", "rdp"])
    ap.add_argument("--public-size", type=int, default=5000,
                    help="training rows held out as the public split (PCA is fit on them)")
    ap.add_argument("--max-private", type=int, default=None,
                    help="cap on private training rows (default all; quick 10000)")
    ap.add_argument("--dim-factors", default=None,
                    help="p / d factors (default 0.125,0.5,1,2,4; quick 0.25,2)")
    ap.add_argument("--pca-factors", default=None,
                    help="p / d factors of the PCA experiment (default 0.5,4; quick 1)")
    ap.add_argument("--pca", default=None, help="components (default K-1,50,100)")
    ap.add_argument("--perturb-var", type=float, default=0.1,
                    help="variance of the Gaussian perturbation per coordinate (paper: 0.1)")
    ap.add_argument("--perturb-scale", default="unit", choices=["unit", "raw", "relative"],
                    help="units of --perturb-var: 'unit' the unit-norm features that are trained "
                         "on; 'raw' the extractor's raw features (variance / mean squared raw "
                         "row norm of the public split on the unit-norm rows); 'relative' the "
                         "mean squared coordinate 1/d of unit-norm d-dim features")
    args = ap.parse_args(argv)
    args.epochs = args.epochs or (3.0 if args.quick else 10.0)
    max_private = args.max_private or (10_000 if args.quick else None)
    factors = [float(f) for f in (args.dim_factors or
                                  ("0.25,2" if args.quick else "0.125,0.5,1,2,4"))
               .split(",")]
    pca_factors = [float(f) for f in (args.pca_factors or ("1" if args.quick else "0.5,4"))
                   .split(",")]
    master = resolve_seed(args.seed)
    ss = np.random.SeedSequence(master)
    t_start = time.perf_counter()
    metric_rows, sweep_rows, pca_rows, beta_data = [], [], [], {}
    for ds in [s.strip() for s in args.datasets.split(",") if s.strip()]:
        try:
            # memory maps: the np.array copies below are the only in-memory copies
            Xtr_all, ytr_all = load_features(ds, args.extractor, "train",
                                             resolution=args.resolution, mmap=True)
            Xte, yte = load_features(ds, args.extractor, "test", resolution=args.resolution,
                                     mmap=True)
        except FileNotFoundError as exc:
            raise SystemExit(f"nc-real: {exc}\n(develop on cached-free data with "
                             "--datasets digits --extractor pixels)") from None
        tag = f"{ds}/{args.extractor}"
        Xtr_all = np.array(Xtr_all, dtype=np.float32)
        Xte = _normalize(np.array(Xte, dtype=np.float32))
        ytr_all, yte = np.asarray(ytr_all), np.asarray(yte)
        K = int(ytr_all.max()) + 1          # label schema (0..9), public
        d = Xtr_all.shape[1]
        # Public split: training rows held out from private training, chosen by a seeded
        # permutation (never reused as private rows).
        s_split, s_coord = (int(x.generate_state(1, np.uint64)[0]) for x in ss.spawn(2))
        perm = np.random.Generator(np.random.PCG64(s_split)).permutation(len(ytr_all))
        n_pub = min(args.public_size, len(ytr_all) // 5)
        pub_idx, priv_idx = perm[:n_pub], perm[n_pub:]
        if max_private:
            priv_idx = priv_idx[:max_private]
        Xpub = Xtr_all[pub_idx]          # labels of the public rows are not needed
        raw_sq = float(np.mean(np.sum(Xpub.astype(np.float64) ** 2, axis=1)))  # public
        _normalize(Xtr_all)
        Xpub = _normalize(Xpub)
        Xpriv, ypriv = Xtr_all[priv_idx], ytr_all[priv_idx]
        del Xtr_all
        # ---- Section 5.1: NC metrics and beta on the (normalised) training features
        m = nc.metrics(Xpriv, ypriv, num_classes=K)
        metric_rows.append(dict(dataset=tag, n=len(ypriv), d=d, **m.summary()))
        beta_data[tag] = (m.beta, ypriv, m.beta_median)
        print(tag, m.summary(), flush=True)
        coords = np.random.Generator(np.random.PCG64(s_coord)).permutation(d)
        # The perturbation's variance per coordinate is the same at every p, so its norm
        # grows like sqrt(p) while the rows keep unit norm (Section 5.3).
        var = args.perturb_var * {"unit": 1.0, "raw": 1.0 / raw_sq,
                                  "relative": 1.0 / d}[args.perturb_scale]
        # ---- Section 5.3: NoisySGD vs dimension, clean and perturbed test
        for f in sorted(set(factors) | set(pca_factors)):
            p = max(K, int(round(f * d)))
            t0 = time.perf_counter()
            Xp = _resize(Xpriv, p, coords)
            Xt = _resize(Xte, p, coords)
            s_fit, s_pert, s_pert2, s_fit2 = (int(x.generate_state(1, np.uint64)[0])
                                              for x in ss.spawn(4))
            if f in factors:
                clf, gd = _sgd_pair(Xp, ypriv, K, args, s_fit)
                Xt_pert = _perturb(Xt.copy(), var, s_pert)
                row = dict(dataset=tag, p=p, factor=f, noisy_clean=_acc(clf, Xt, yte),
                           noisy_pert=_acc(clf, Xt_pert, yte), sgd_clean=_acc(gd, Xt, yte),
                           sgd_pert=_acc(gd, Xt_pert, yte), epsilon_=clf.epsilon_,
                           sigma=clf.noise_multiplier_, steps=clf.steps_,
                           seconds=time.perf_counter() - t0)
                sweep_rows.append(row)
                print(row, flush=True)
                del Xt_pert
            # ---- Section 5.4: train and test perturbed, PCA fit on the public split
            if f in pca_factors:
                Xpp = _perturb(Xp, var, s_pert2)            # in place
                Xtp = _perturb(Xt, var, s_pert2 + 1)
                Xpubp = _perturb(_resize(Xpub, p, coords), var, s_pert2 + 2)
                comps = [int(c) for c in (args.pca.split(",") if args.pca else
                                          (K - 1, 50, 100))]
                comps = [c for c in comps if c <= min(p, len(Xpubp))]
                # one fit at the largest k; smaller k are its leading components (nested)
                full = nc.PCAProjector(max(comps)).fit(Xpubp, public=True, seed=s_fit2) \
                    if comps else None
                for k in [None] + comps:
                    t1 = time.perf_counter()
                    if k is None:
                        clf, gd = _sgd_pair(Xpp, ypriv, K, args, s_fit2)
                        tr, te = Xpp, Xtp
                    else:
                        pca = full.truncate(k)
                        tr, te = pca.transform(Xpp), pca.transform(Xtp)
                        clf, gd = _sgd_pair(np.ascontiguousarray(tr, np.float32), ypriv, K,
                                            args, s_fit2, preprocessing=[pca], reference=False)
                    row = dict(dataset=tag, p=p, factor=f, components=k or "none",
                               noisy_acc=_acc(clf, te, yte),
                               sgd_acc=None if gd is None else _acc(gd, te, yte),
                               epsilon_=clf.epsilon_, seconds=time.perf_counter() - t1)
                    pca_rows.append(row)
                    print(row, flush=True)
                del Xpp, Xtp, Xpubp
            del Xp, Xt
    total = time.perf_counter() - t_start
    meta = run_meta(dict(quick=args.quick, seed=master, datasets=args.datasets,
                      extractor=args.extractor, resolution=args.resolution,
                      epsilon=args.epsilon, delta=args.delta,
                      epochs=args.epochs, batch=args.batch, lr=args.lr,
                      accountant=args.accountant, public_size=args.public_size,
                      max_private=max_private, perturb_var=args.perturb_var,
                      perturb_scale=args.perturb_scale, seconds=total))
    pert = {"unit": f"N(0, {args.perturb_var}) per coordinate of the unit-norm features",
            "raw": f"N(0, {args.perturb_var}) per coordinate in the extractor's raw units "
                   "(divided by the public split's mean squared raw row norm)",
            "relative": f"N(0, {args.perturb_var}/d) per coordinate of the unit-norm "
                        "features"}[args.perturb_scale]
    common = [f"features: {args.extractor}, rows normalised to unit L2 norm (Section 5.1); "
              f"public split: {args.public_size} training rows held out by a seeded permutation "
              "and never used privately; metrics and beta on the private training rows "
              "(non-private diagnostics)",
              f"NoisySGD: Poisson batches of expected size {args.batch}, {args.epochs} epochs, "
              f"lr {args.lr} on the clipped noisy batch mean, C = 1, CE, "
              f"({args.epsilon}, {args.delta})-DP ({args.accountant} accountant); SGD: the same "
              "clipped steps on the same batches without noise", f"master seed {master}",
              f"total time {total:.0f} s"]
    write_report("nc_real_metrics", args.out, meta, metric_rows,
                 [("dataset", "features", None), ("n", "n", None), ("d", "d", None),
                  ("cos_mean", "cos mean", "{:.3f}"), ("cos_median", "cos median", "{:.3f}"),
                  ("cos_min", "cos min", "{:.3f}"), ("cos_max", "cos max", "{:.3f}"),
                  ("cos_dev", "|cos + 1/(K-1)|", "{:.3f}"), ("nc1", "NC1", "{:.3f}"),
                  ("equinorm_cv", "equinorm CV", "{:.3f}"),
                  ("beta_median", "beta median", "{:.4f}"),
                  ("beta_class_median_min", "class median min", "{:.4f}"),
                  ("beta_class_median_max", "class median max", "{:.4f}"),
                  ("min_mean_dist", "min mean dist", "{:.3f}")], common)
    write_report("nc_real_dimension", args.out, meta, sweep_rows,
                 [("dataset", "features", None), ("p", "p", None), ("factor", "p/d", None),
                  ("noisy_clean", "NoisySGD clean", "{:.3f}"),
                  ("noisy_pert", "NoisySGD perturbed test", "{:.3f}"),
                  ("sgd_clean", "SGD clean", "{:.3f}"),
                  ("sgd_pert", "SGD perturbed test", "{:.3f}"),
                  ("sigma", "noise mult.", "{:.3f}"), ("epsilon_", "epsilon", "{:.3f}"),
                  ("seconds", "s", "{:.1f}")],
                 common + [f"p < d: a fixed random subset of coordinates; p > d: copies of the "
                           f"feature vector; perturbed test: + {pert} (Section 5.3)"])
    write_report("nc_real_pca", args.out, meta, pca_rows,
                 [("dataset", "features", None), ("p", "p", None),
                  ("components", "PCA components", None), ("noisy_acc", "NoisySGD", "{:.3f}"),
                  ("sgd_acc", "SGD", "{:.3f}"), ("epsilon_", "epsilon", "{:.3f}"),
                  ("seconds", "s", "{:.1f}")],
                 common + ["SGD (non-private reference) only without PCA",
                           f"train, public and test features + {pert} (Section 5.4); PCA "
                           "(uncentred second moment, Section 4.1) fit on the perturbed public "
                           "split only: no privacy cost"])
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    tags = list(beta_data)
    fig, axes = plt.subplots(1, len(tags), figsize=(6 * len(tags), 4), squeeze=False)
    rng = np.random.default_rng(0)
    for ax, tag in zip(axes[0], tags):
        beta, y, med = beta_data[tag]
        for k in range(len(med)):
            b = beta[y == k]
            show = b if b.size <= 1500 else b[rng.choice(b.size, 1500, replace=False)]
            ax.scatter(k + 0.25 * rng.uniform(-1, 1, show.size), show, s=2, alpha=0.3,
                       color="tab:blue")
        ax.scatter(np.arange(len(med)), med, color="tab:orange", marker="D", label="class median")
        ax.set_xlabel("class")
        ax.set_ylabel(r"$\beta_i = \|x_i - \hat\mu_{y_i}\|_\infty$")
        ax.set_title(tag)
        ax.legend()
    save_figure(fig, "nc_real_beta", args.out)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for tag in tags:
        pts = [r for r in sweep_rows if r["dataset"] == tag]
        ps = [r["p"] for r in pts]
        for key, style in (("noisy_clean", "-o"), ("noisy_pert", "-s"), ("sgd_clean", "--o"),
                           ("sgd_pert", "--s")):
            axes[0].plot(ps, [r[key] for r in pts], style, label=f"{tag} {key}")
        for k in sorted({str(r["components"]) for r in pca_rows if r["dataset"] == tag}):
            pts = [r for r in pca_rows if r["dataset"] == tag and str(r["components"]) == k]
            axes[1].plot([r["p"] for r in pts], [r["noisy_acc"] for r in pts], "-o",
                         label=f"{tag} PCA {k}")
    from matplotlib.ticker import NullFormatter
    for ax, title in zip(axes, ("NoisySGD vs dimension (Fig. 3b)",
                                "perturbed train+test, PCA on public split (Fig. 4)")):
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())   # minor labels overlap on short ranges
        ax.set_xlabel("feature dimension p")
        ax.set_ylabel("test accuracy")
        ax.set_title(title)
        ax.legend(fontsize=6)
    save_figure(fig, "nc_real_dimension", args.out)
    return 0

