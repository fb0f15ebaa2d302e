"""``ncdp-fast reproduce nc-synthetic``: paper 000 (Neural Collapse meets DP), Section 5.2 /
Figure 3(a).

NoisyGD (one step from zero, eq. 2.1) on synthetic perfect-NC features, K = 10, n = 10^4,
(1, 1e-4)-DP, p from 10 to 10^5, in the settings balanced / class imbalance / offset +
imbalance / perturbed test / offset + imbalance after centering (public mean; and a DP
mean where the private matrix fits in memory) / adversarial test; each point next to
the non-private GD step and the error bounds of Theorems 3.2-3.3 where they apply.
Training rows are K distinct vectors, so NoisyGD runs on the grouped rows
(``fit(..., counts=...)``, exactly the full-data estimator); perturbed test features
are generated and scored in row chunks (memory O(chunk * p)).
"""
from __future__ import annotations

import argparse
import math
import time

import numpy as np

from ... import nc
from ..._backend import resolve_seed
from ..._report import save_figure, write_report
from ...privacy import dp_to_zcdp
from ...privacy.truncation import ideal_delta
from ...train import NoisyGDClassifier, linear_steps
from .common import FixedLinear, run_meta

__all__ = ["synthetic_main"]


def _bounds(setting, n, rho, beta, p):
    """Binary-classification error bounds of Theorems 3.2 / 3.3 (None where none applies).

    Thm 3.2 (stochastic shifts, used for the perturbed test):
      exp(-n^2 rho / (2 (1 + b^2 p)^2)) + exp(-n / (8 (b^4 p^2 + b^2 p / 3))).
    Thm 3.3 (deterministic shifts, 1 - b^2 p > 0), sigma^2 = (1 + b^2 p) / (2 rho):
      exp(-n^2 (1 - b^2 p)^2 / ((1 + b^2 p) sigma^2)).
    """
    def ex(x):
        return math.exp(-x) if x < 745 else 0.0
    if setting in ("balanced", "imbalanced"):
        return min(1.0, ex(n * n * rho / 2)), "Thm 3.2 (beta=0)"
    if setting in ("offset (balanced)", "offset+imbalance"):
        s = beta * beta * p
        if s >= 1:
            return None, "Thm 3.3 needs beta^2 p < 1"
        sigma2 = (1 + s) / (2 * rho)
        return min(1.0, ex(n * n * (1 - s) ** 2 / ((1 + s) * sigma2))), "Thm 3.3"
    if setting == "perturbed test":
        s = beta * beta * p
        second = ex(n / (8 * (beta ** 4 * p * p + s / 3)))
        return min(1.0, ex(n * n * rho / (2 * (1 + s) ** 2)) + second), "Thm 3.2"
    return None, "n/a"


def _score_chunks(models, data, split="test", rows=512, transform=None):
    """Accuracies of several models on one split: on its distinct rows weighted by their
    counts when every row of a class is identical (exactly the per-row accuracy), else
    in row chunks generated once and scored by every model."""
    if data.shift_kind(split) != "stochastic":
        X, y, counts = data.grouped(split)
        if transform is not None:
            X = transform(X)
        return [float(np.sum(counts * (np.asarray(m.predict(X)) == y)) / counts.sum())
                for m in models]
    correct = np.zeros(len(models))
    for X, y in data.chunks(split, rows):
        if transform is not None:
            X = transform(X)
        for i, m in enumerate(models):
            correct[i] += int(np.sum(np.asarray(m.predict(X)) == y))
    return list(correct / len(data.labels(split)))



def synthetic_main(argv: list[str]) -> int:
    """``ncdp-fast reproduce nc-synthetic [--quick] [--out DIR] [--seed S] [--reps R]``."""

    ap = argparse.ArgumentParser(prog="ncdp-fast reproduce nc-synthetic",
                                 description=synthetic_main.__doc__)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--quick", action="store_true", help="p <= 10^4, 2 repetitions")
    ap.add_argument("--seed", type=int, default=None, help="master seed (default: from the OS)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions per point (default 5)")
    ap.add_argument("--n", type=int, default=10_000)
    ap.add_argument("--classes", type=int, default=10)
    ap.add_argument("--dims", default=None, help="comma-separated p (default 10..10^5)")
    ap.add_argument("--epsilon", type=float, default=1.0)
    ap.add_argument("--delta", type=float, default=1e-4)
    ap.add_argument("--beta", type=float, default=0.1, help="||v||_inf of offset / perturbation")
    ap.add_argument("--imbalance", type=float, default=0.2,
                    help="alpha: the first K/2 classes share this fraction of the rows")
    ap.add_argument("--test-size", type=int, default=2000)
    ap.add_argument("--public-size", type=int, default=1000)
    ap.add_argument("--dp-center-share", type=float, default=0.1,
                    help="share of rho spent on the DP mean of the 'centred (DP)' setting")
    args = ap.parse_args(argv)
    dims = ([int(float(d)) for d in args.dims.split(",")] if args.dims else
            ([10, 100, 1000, 10_000] if args.quick else [10, 100, 1000, 10_000, 100_000]))
    reps = args.reps or (2 if args.quick else 5)
    master = resolve_seed(args.seed)
    ss = np.random.SeedSequence(master)
    K, n, beta, alpha = args.classes, args.n, args.beta, args.imbalance
    rho = dp_to_zcdp(args.epsilon, ideal_delta(args.delta, args.epsilon))
    budget = dict(epsilon=args.epsilon, delta=args.delta)
    settings = ["balanced", "imbalanced", "offset (balanced)", "offset+imbalance",
                "perturbed test", "perturbed test (n/10)",
                "offset+imbalance, centred (public mean)", "offset+imbalance, centred (DP mean)",
                "adversarial test (beta/10)"]
    rows = []
    t_start = time.perf_counter()
    for p in dims:
        for setting in settings:
            if setting.endswith("(DP mean)") and n * p * 4 > 1 << 30:
                rows.append(dict(p=p, setting=setting, note="skipped: the private matrix "
                                 f"({n}x{p} float32) exceeds 1 GB"))
                continue
            accs, gd_accs, t0 = [], [], time.perf_counter()
            for r in range(reps):
                s_data, s_fit, s_pre = (int(x.generate_state(1, np.uint64)[0])
                                        for x in ss.spawn(3))
                kw = dict(seed=s_data, test_size=args.test_size, public_size=args.public_size)
                if setting == "balanced":
                    data = nc.synthetic(n, K, p, **kw)
                elif setting == "imbalanced":
                    data = nc.synthetic(n, K, p, imbalance=alpha, **kw)
                elif setting == "offset (balanced)":
                    data = nc.synthetic(n, K, p, shift="offset", beta=beta, **kw)
                elif setting.startswith("offset"):
                    data = nc.synthetic(n, K, p, shift="offset", beta=beta, imbalance=alpha, **kw)
                elif setting.startswith("perturbed test"):
                    data = nc.synthetic(n // 10 if setting.endswith("(n/10)") else n, K, p,
                                        shift="stochastic", beta=beta, shift_split="test", **kw)
                else:
                    data = nc.synthetic(n, K, p, **kw)
                Xg, yg, cg = data.grouped("train")
                pre, transform = [], None
                if setting.endswith("(public mean)"):
                    Xpub, _, cpub = data.grouped("public")
                    cen = nc.Centering().fit(np.repeat(Xpub, cpub, axis=0), public=True)
                    pre, transform = [cen], cen.transform
                elif setting.endswith("(DP mean)"):
                    # clip = the largest row norm sqrt(1 + beta^2 p), known from the design
                    cen = nc.Centering().fit_private(
                        data.X_train, rho=args.dp_center_share * rho,
                        clip=math.sqrt(1 + beta * beta * p), seed=s_pre)
                    pre, transform = [cen], cen.transform
                Xfit = Xg if transform is None else transform(Xg)
                clf = NoisyGDClassifier(**budget, num_classes=K, seed=s_fit).fit(Xfit, yg, counts=cg,
                                                                  preprocessing=pre)
                # non-private reference: the same clipped step without noise
                W0 = linear_steps(Xfit, yg, num_classes=K, steps=1, lr=1.0, loss="ce",
                                   max_grad_norm=1.0, noise_multiplier=0.0,
                                   projection_radius=None, fit_intercept=False, seed=0,
                                   counts=cg)[0]
                if setting.startswith("adversarial"):
                    adv = nc.synthetic(n, K, p, shift="adversarial", beta=beta / 10,
                                       classifier=clf.coef_, **kw)
                    adv0 = nc.synthetic(n, K, p, shift="adversarial", beta=beta / 10,
                                        classifier=W0, **kw)
                    accs.append(_score_chunks([clf], adv)[0])
                    gd_accs.append(_score_chunks([FixedLinear(W0)], adv0)[0])
                else:
                    a, g = _score_chunks([clf, FixedLinear(W0)], data, transform=transform)
                    accs.append(a)
                    gd_accs.append(g)
            bound, which = _bounds(setting.replace(" (n/10)", ""),
                                   n // 10 if setting.endswith("(n/10)") else n, rho, beta, p)
            row = dict(p=p, setting=setting, acc_mean=float(np.mean(accs)),
                       acc_std=float(np.std(accs)), acc_min=float(np.min(accs)),
                       gd_acc=float(np.mean(gd_accs)), bound_err=bound,
                       bound_acc=None if bound is None else max(0.0, 1.0 - bound), bound=which,
                       epsilon_=clf.epsilon_, reps=reps, seconds=time.perf_counter() - t0)
            rows.append(row)
            print(f"p={p:>6} {setting:<42} NoisyGD acc {row['acc_mean']:.3f} ± "
                  f"{row['acc_std']:.3f}  GD {row['gd_acc']:.3f}  bound {which}: {bound}",
                  flush=True)
    total = time.perf_counter() - t_start
    meta = run_meta(dict(quick=args.quick, seed=master, n=n, K=K, dims=dims, reps=reps,
                      epsilon=args.epsilon, delta=args.delta, rho=rho, beta=beta,
                      imbalance=alpha, test_size=args.test_size, public_size=args.public_size,
                      seconds=total))
    notes = [
        f"NoisyGD: one full-batch step from zero (eq. 2.1), CE loss, clip C = 1, "
        f"({args.epsilon}, {args.delta})-DP = rho {rho:.5f}-zCDP; {reps} repetitions per point "
        f"(fresh data, ETF and noise); master seed {master}",
        f"imbalance alpha = {alpha}: classes 0..{K // 2 - 1} share {alpha:.0%} of the rows; "
        f"offset: x = M_y + v, v in {{+-{beta}}}^p fixed; perturbed test: fresh v in "
        f"{{+-{beta}}}^p per test row; adversarial: worst-case ||v||_inf <= {beta / 10} per class "
        "against the trained W",
        f"centred (public mean): mean of {args.public_size} public rows of the training "
        f"distribution; centred (DP mean): Centering.fit_private with "
        f"{args.dp_center_share:.0%} of rho, clip sqrt(1 + beta^2 p), the rest to NoisyGD",
        "GD: the same clipped step without noise (non-private reference); "
        f"perturbed test (n/10): {n // 10} training rows, the same test split size",
        "bound: binary-classification misclassification bounds of Thm 3.2 / 3.3 applied "
        "with this n and rho (a reference for the shape; the experiment is 10-class); "
        "bound_acc = 1 - bound",
        f"total time {total:.0f} s"]
    cols = [("p", "p", None), ("setting", "setting", None),
            ("acc_mean", "NoisyGD acc", "{:.3f}"), ("acc_std", "± std", "{:.3f}"),
            ("acc_min", "min", "{:.3f}"), ("gd_acc", "GD acc", "{:.3f}"),
            ("bound_acc", "theory acc >=", "{:.3f}"), ("bound", "bound", None),
            ("seconds", "s", "{:.1f}"), ("note", "note", None)]
    write_report("nc_synthetic", args.out, meta, rows, cols, notes)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for setting in settings:
        pts = [r for r in rows if r["setting"] == setting and "acc_mean" in r]
        if pts:
            ax.errorbar([r["p"] for r in pts], [r["acc_mean"] for r in pts],
                        yerr=[r["acc_std"] for r in pts], marker="o", capsize=3, label=setting)
    ax.set_xscale("log")
    ax.set_xlabel("feature dimension p")
    ax.set_ylabel("test accuracy")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"NoisyGD, synthetic NC, K={K}, n={n}, ({args.epsilon}, {args.delta})-DP")
    ax.legend(fontsize=7)
    save_figure(fig, "nc_synthetic", args.out)
    return 0

