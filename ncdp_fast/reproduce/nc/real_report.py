"""Tables (``_report.write_report``: JSON + Markdown naming machine, commit, date) and
plots (``_report.save_figure``) of ``nc-real``, and the summary of both findings:

* Figure 3(b): per data set and scale, the smallest p at which NoisySGD's
  perturbed-test accuracy falls ``DROP`` below SGD's (the paper's deterioration), if any;
* Figure 4: per data set, scale and protocol, NoisySGD without PCA against k = K-1 and
  the best k (the paper's finding: K-1 best, and better than no PCA).
"""
from __future__ import annotations

import numpy as np

from ..._report import save_figure, write_report
from .common import run_meta

__all__ = ["write_all", "fig3b_summary", "fig4_summary", "DROP"]

DROP = 0.05     # "deteriorates": NoisySGD this far below SGD on the same perturbed test


def fig3b_summary(rows):
    """Per (dataset, scale): accuracies at p = d and at the largest p, and the first p
    where ``noisy_pert < sgd_pert - DROP`` (None: not within the sweep)."""
    out = []
    for key in dict.fromkeys((r["dataset"], r["scale"]) for r in rows):
        pts = sorted((r for r in rows if (r["dataset"], r["scale"]) == key),
                     key=lambda r: (r["p"], r["method"]))
        at_d = [r for r in pts if r["factor"] == 1.0]
        first = next((r for r in pts if r["noisy_pert"] < r["sgd_pert"] - DROP), None)
        out.append(dict(dataset=key[0], scale=key[1], var=pts[0]["var"],
                        noisy_pert_d=at_d[0]["noisy_pert"], sgd_pert_d=at_d[0]["sgd_pert"],
                        p_max=pts[-1]["p"], noisy_pert_max=pts[-1]["noisy_pert"],
                        sgd_pert_max=pts[-1]["sgd_pert"],
                        p_deteriorates=None if first is None else first["p"],
                        ratio_there=None if first is None else first["pert_to_signal"],
                        dp_logit_sd_there=None if first is None else first["dp_logit_sd"],
                        margin=at_d[0]["margin"]))
    return out


def fig4_summary(rows):
    """Per (dataset, p, scale, protocol): NoisySGD without PCA, at k = min k (K-1), the
    best k, and the paper's two findings: K-1 components beat no PCA (by > 0.01), and
    K-1 is the best k (within 0.01)."""
    out = []
    for key in dict.fromkeys((r["dataset"], r["p"], r["scale"]) for r in rows):
        pts = [r for r in rows if (r["dataset"], r["p"], r["scale"]) == key]
        none = next(r for r in pts if r["protocol"] == "none")
        for name in dict.fromkeys(r["protocol"] for r in pts if r["protocol"] != "none"):
            ks = [r for r in pts if r["protocol"] == name]
            kmin = min(ks, key=lambda r: r["k"])
            best = max(ks, key=lambda r: r["noisy_acc"])
            out.append(dict(dataset=key[0], p=key[1], scale=key[2], protocol=name,
                            private_valid=kmin["private_valid"], none=none["noisy_acc"],
                            k_min=kmin["k"], acc_kmin=kmin["noisy_acc"],
                            captured_kmin=kmin["captured"],
                            oracle_kmin=kmin.get("oracle"), best_k=best["k"],
                            acc_best=best["noisy_acc"],
                            kmin_helps=bool(kmin["noisy_acc"] > none["noisy_acc"] + 0.01),
                            kmin_best=bool(best["noisy_acc"] - kmin["noisy_acc"] < 0.01)))
    return out


def _plots(res, out):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter
    tags = list(dict.fromkeys(r["dataset"] for r in res["dimension"]))
    if res["beta"]:
        btags = list(res["beta"])
        fig, axes = plt.subplots(1, len(btags), figsize=(5 * len(btags), 3.6), squeeze=False)
        rng = np.random.default_rng(0)      # plot jitter and subsampling only
        for ax, tag in zip(axes[0], btags):
            beta, y, med = res["beta"][tag]
            for k in range(len(med)):
                b = beta[y == k]
                show = b if b.size <= 1500 else b[rng.choice(b.size, 1500, replace=False)]
                ax.scatter(k + 0.25 * rng.uniform(-1, 1, show.size), show, s=2, alpha=0.3,
                           color="tab:blue")
            ax.scatter(np.arange(len(med)), med, color="tab:orange", marker="D",
                       label="class median")
            ax.set_xlabel("class")
            ax.set_ylabel(r"$\beta_i = \|x_i - \hat\mu_{y_i}\|_\infty$")
            ax.set_title(tag, fontsize=9)
            ax.legend(fontsize=7)
        save_figure(fig, "nc_real_beta", out)
    if not tags:
        return
    scales = list(dict.fromkeys(r["scale"] for r in res["dimension"]))
    fig, axes = plt.subplots(len(scales), len(tags), figsize=(4.2 * len(tags), 3.2 * len(scales)),
                             squeeze=False)
    for i, sc in enumerate(scales):
        for j, tag in enumerate(tags):
            ax = axes[i][j]
            pts = sorted((r for r in res["dimension"] if r["dataset"] == tag and
                          r["scale"] == sc), key=lambda r: r["p"])
            for meth, mk in (("trained at p", "o"), ("copies, exact reduction", "x")):
                q = [r for r in pts if r["method"] == meth]
                ax.plot([r["p"] for r in q], [r["noisy_pert"] for r in q], mk + "-",
                        color="tab:red", label=f"NoisySGD pert. ({meth})")
                ax.plot([r["p"] for r in q], [r["sgd_pert"] for r in q], mk + "--",
                        color="tab:blue", label=f"SGD pert. ({meth})")
            q = [r for r in pts if r["method"] == "trained at p"]
            ax.plot([r["p"] for r in q], [r["noisy_clean"] for r in q], "s:", color="tab:orange",
                    label="NoisySGD clean")
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.set_title(f"{tag}, {sc}", fontsize=8)
            ax.set_xlabel("p")
            ax.set_ylabel("test accuracy")
            ax.set_ylim(0, 1)
    axes[0][0].legend(fontsize=5)
    fig.suptitle("Fig. 3(b): NoisySGD vs dimension, perturbed test")
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    save_figure(fig, "nc_real_dimension", out)
    if not res["pca"]:
        return
    keys = list(dict.fromkeys((r["dataset"], r["p"]) for r in res["pca"]))
    scales = list(dict.fromkeys(r["scale"] for r in res["pca"]))
    fig, axes = plt.subplots(len(scales), len(keys), figsize=(4.2 * len(keys), 3.2 * len(scales)),
                             squeeze=False)
    for i, sc in enumerate(scales):
        for j, (tag, p) in enumerate(keys):
            ax = axes[i][j]
            pts = [r for r in res["pca"] if (r["dataset"], r["p"], r["scale"]) == (tag, p, sc)]
            for name in dict.fromkeys(r["protocol"] for r in pts):
                q = sorted((r for r in pts if r["protocol"] == name), key=lambda r: r["k"] or 0)
                if name == "none":
                    ax.axhline(q[0]["noisy_acc"], color="k", ls=":", label="no PCA")
                else:
                    ax.plot([r["k"] for r in q], [r["noisy_acc"] for r in q], "o-",
                            label=name + ("" if q[0]["private_valid"] else " (not private)"))
            ax.set_xscale("log")
            ax.set_title(f"{tag} p={p}, {sc}", fontsize=8)
            ax.set_xlabel("PCA components k")
            ax.set_ylabel("NoisySGD test accuracy")
            ax.set_ylim(0, 1)
    axes[0][0].legend(fontsize=5)
    fig.suptitle("Fig. 4: PCA before NoisySGD, perturbed train and test")
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    save_figure(fig, "nc_real_pca", out)


def write_all(res, args, extra):
    """Write nc_real_{metrics,dimension,pca,spiked,summary} and the plots into args.out."""
    meta = run_meta(dict(extra, datasets=args.datasets, extractors=args.extractors,
                         resolution=args.resolution, epsilon=args.epsilon, delta=args.delta,
                         epochs=args.epochs, batch=args.batch, lr=args.lr,
                         accountant=args.accountant, public_sizes=args.public_sizes,
                         dp_pca_share=args.dp_pca_share))
    common = [f"rows normalised to unit L2 norm (Section 5.1); the public pool ("
              f"{args.public_sizes.split(',')[-1]} training rows) is held out by a seeded "
              "permutation and never used privately; metrics, spikes and captured fractions are "
              "non-private diagnostics of the private rows",
              f"NoisySGD: Poisson batches of expected size {args.batch}, {args.epochs} epochs, lr "
              f"{args.lr} on the clipped noisy batch mean, C = 1, CE, ({args.epsilon}, "
              f"{args.delta})-DP ({args.accountant}; RDP when DP-PCA shares the budget); SGD: "
              "the same clipped steps on the same batches without noise (not private)",
              f"master seed {extra['seed']}; total time {extra['seconds']:.0f} s"]
    fmt3 = "{:.3f}"
    write_report("nc_real_metrics", args.out, meta, res["metrics"],
                 [("dataset", "features", None), ("n", "n", None), ("d", "d", None),
                  ("cos_median", "cos median", fmt3), ("cos_dev", "|cos + 1/(K-1)|", fmt3),
                  ("nc1", "NC1", fmt3), ("equinorm_cv", "equinorm CV", fmt3),
                  ("beta_median", "beta median", "{:.4f}"),
                  ("min_mean_dist", "min mean dist", fmt3)], common, quiet=True)
    write_report("nc_real_dimension", args.out, meta, res["dimension"],
                 [("dataset", "features", None), ("method", "method", None), ("p", "p", None),
                  ("factor", "p/d", "{:g}"), ("scale", "scale", None), ("var", "v", "{:.3g}"),
                  ("pert_to_signal", "sqrt(v p)", "{:.3g}"), ("s", "DP weight sd", "{:.4f}"),
                  ("dp_logit_sd", "s sqrt(v p)", "{:.3g}"), ("margin", "margin", fmt3),
                  ("noisy_clean", "NoisySGD clean", fmt3),
                  ("noisy_pert", "NoisySGD pert.", fmt3), ("noisy_pert_sd", "+-", fmt3),
                  ("sgd_clean", "SGD clean", fmt3), ("sgd_pert", "SGD pert.", fmt3),
                  ("sigma", "noise mult.", fmt3), ("epsilon_", "epsilon", fmt3)],
                 common + ["trained at p: p < d a fixed random coordinate subset, p > d copies "
                           "of the vector, renormalised; copies, exact reduction: the p = d "
                           "model and W_perp ~ N(0, s^2) on the complement "
                           "(real_dimension.py, docs/nc.md); perturbation N(0, v) per "
                           "coordinate of the test rows; margin: median top-2 logit gap of "
                           "NoisySGD on the clean test set"], quiet=True)
    write_report("nc_real_pca", args.out, meta, res["pca"],
                 [("dataset", "features", None), ("p", "p", None), ("scale", "scale", None),
                  ("pert_to_signal", "sqrt(v p)", "{:.3g}"), ("protocol", "PCA", None),
                  ("privacy", "privacy", None), ("k", "k", None), ("rows", "fit rows", None),
                  ("captured", "class energy kept", "{:.2f}"), ("oracle", "clean top-k", "{:.2f}"),
                  ("noisy_acc", "NoisySGD", fmt3),
                  ("epsilon_", "epsilon (NoisySGD incl. DP-PCA)", fmt3),
                  ("epsilon_pca", "epsilon DP-PCA alone", fmt3), ("sigma", "noise mult.", fmt3)],
                 common + ["train, public and test rows + N(0, v) per coordinate (Section 5.4); "
                           "PCA: uncentred second moment (Section 4.1); 'paper': fitted on the "
                           "private training rows, NOT PRIVATE (its epsilon is NoisySGD's "
                           "only); class energy kept: share of the centred class-mean energy in "
                           "the fitted span; clean top-k: the same for the top-k of the clean "
                           "private rows (oracle)"], quiet=True)
    sp = [dict(r, spikes_txt=" ".join(f"{x:.3g}" for x in r["spikes"]),
               oracle_km1=list(r["oracle"].values())[0]) for r in res["spiked"]]
    write_report("nc_real_spiked", args.out, meta, sp,
                 [("dataset", "features", None), ("p", "p", None), ("scale", "scale", None),
                  ("var", "v", "{:.3g}"), ("protocol", "PCA", None), ("rows", "m", None),
                  ("bulk_edge", "bulk edge v(1+sqrt(p/m))^2", "{:.3g}"),
                  ("threshold", "threshold v sqrt(p/m)", "{:.3g}"),
                  ("dp_threshold", "DP-PCA threshold", "{:.3g}"),
                  ("spikes_txt", "class-mean spikes", None),
                  ("detected", "spikes above", None),
                  ("oracle_km1", "clean top-(K-1) keeps", "{:.2f}")],
                 common + ["class-mean spikes: eigenvalues of sum_k pi_k mu_k mu_k^T of the clean "
                           "unit-norm rows at p; detected: above the threshold (plus the DP-PCA "
                           "one, added, for dp-pca)"], quiet=True)
    write_report("nc_real_fig3b_summary", args.out, meta, fig3b_summary(res["dimension"]),
                 [("dataset", "features", None), ("scale", "scale", None), ("var", "v", "{:.3g}"),
                  ("noisy_pert_d", "NoisySGD pert. p=d", fmt3),
                  ("sgd_pert_d", "SGD pert. p=d", fmt3),
                  ("p_max", "largest p", None), ("noisy_pert_max", "NoisySGD there", fmt3),
                  ("sgd_pert_max", "SGD there", fmt3),
                  ("p_deteriorates", f"first p: NoisySGD < SGD - {DROP}", None),
                  ("ratio_there", "sqrt(v p) there", "{:.3g}"),
                  ("dp_logit_sd_there", "s sqrt(v p) there", "{:.3g}"),
                  ("margin", "margin", fmt3)], common)
    write_report("nc_real_fig4_summary", args.out, meta, fig4_summary(res["pca"]),
                 [("dataset", "features", None), ("p", "p", None), ("scale", "scale", None),
                  ("protocol", "PCA", None), ("private_valid", "private", None),
                  ("none", "no PCA", fmt3), ("k_min", "k", None), ("acc_kmin", "NoisySGD", fmt3),
                  ("captured_kmin", "class energy kept", "{:.2f}"),
                  ("oracle_kmin", "clean top-k keeps", "{:.2f}"), ("best_k", "best k", None),
                  ("acc_best", "NoisySGD best", fmt3), ("kmin_helps", "K-1 > no PCA", None),
                  ("kmin_best", "K-1 best", None)], common)
    _plots(res, args.out)
