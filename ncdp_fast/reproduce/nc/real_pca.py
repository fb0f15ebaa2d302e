"""Figure 4 / Section 5.4: train and test features perturbed by N(0, v I_p), PCA to k
components (``protocols``: the paper's non-private fit on the private rows, public
rows, DP-PCA), then NoisySGD; with the spiked-covariance prediction (``spiked``) of
which fits can find the class-mean directions.

Per (data set, p): the clean private rows give the class-mean spikes and the best a
PCA can do (top-k of the *clean* second moment, a non-private oracle); per scale v the
rows are perturbed, every protocol fitted once at the largest k (smaller k are its
leading components), and each k trained.
"""
from __future__ import annotations

import time

import numpy as np

from .protocols import components, dp_pca_clip, fit_protocol
from .real_data import perturb, perturb_var, resize
from .real_fit import accuracy, sgd_pair
from .spiked import (analyze_gauss_threshold, captured_fraction, class_mean_spikes, class_means,
                     count_detected, spiked_thresholds)
from . import protocols as _protocols

__all__ = ["pca_experiment"]


def _clean_oracle(F, Xp, mu, pi, ks, seed):
    """Captured class-mean energy of the top-k of the clean private second moment."""
    pca = _protocols.fit_protocol("paper", max(ks), Xpriv=Xp, Xpub=None, seed=seed)
    return {k: captured_fraction(components(pca, k), mu, pi) for k in ks}


def pca_experiment(F, p, scales, protocols, ks, cfg, budget, coords, seeds, progress):
    """Rows of Figure 4 at dimension p for every scale and protocol, and the spiked
    analysis rows.  ``budget``: ``protocols.dp_pca_budget`` output (its ``rho_pca`` is
    DP-PCA's share).  Returns (pca_rows, spiked_rows)."""
    K, n = F.K, F.Xpriv.shape[0]
    Xp0 = resize(F.Xpriv, p, coords)
    mu, pi = class_means(Xp0, F.ypriv, K)
    spikes = class_mean_spikes(mu, pi)
    oracle = _clean_oracle(F, Xp0, mu, pi, ks, next(seeds))
    rows, spiked = [], []
    for sc in scales:
        v = perturb_var(sc, F.d)
        t0 = time.perf_counter()
        Xp = perturb(Xp0.copy(), v, next(seeds))
        Xt = perturb(resize(F.Xte, p, coords), v, next(seeds))
        Xq = perturb(resize(F.Xpub, p, coords), v, next(seeds))
        common = dict(dataset=F.tag, p=p, scale=sc, var=v, pert_to_signal=float(np.sqrt(v * p)))
        clf, _ = sgd_pair(Xp, F.ypriv, K, cfg, next(seeds), reference=False)
        rows.append(dict(common, protocol="none", privacy="no PCA", private_valid=True, k=None,
                         rows=None, noisy_acc=accuracy(clf, Xt, F.yte), epsilon_=clf.epsilon_,
                         sigma=clf.noise_multiplier_))
        progress(f"{F.tag} p={p} {sc}: no PCA NoisySGD {rows[-1]['noisy_acc']:.3f}")
        for name in protocols:
            clip = dp_pca_clip(v, p)
            proj = fit_protocol(name, max(ks), Xpriv=Xp, Xpub=Xq, seed=next(seeds),
                                rho=budget["rho_pca"], clip=clip, delta=cfg.delta)
            m = proj.rows
            th = spiked_thresholds(v, p, m)
            ag = analyze_gauss_threshold(budget["rho_pca"], clip, p, m) \
                if name == "dp-pca" else None
            # rows of norm ~clip are barely clipped: the Wigner threshold is in the units
            # of the spikes; sampling and DP noise add (approximately) for DP-PCA
            ag_th = None if ag is None else ag["threshold"]
            eff = th["threshold"] + (ag_th or 0.0)
            spiked.append(dict(common, protocol=name, rows=m, gamma=th["gamma"],
                               bulk_edge=th["bulk_edge"], threshold=th["threshold"],
                               dp_threshold=ag_th, spikes=[float(x) for x in spikes],
                               detected=count_detected(spikes, eff),
                               oracle={str(k): oracle[k] for k in ks}))
            for k in ks:
                pk = proj.projector.truncate(k)
                tr = np.ascontiguousarray(pk.transform(Xp), dtype=np.float32)
                te = np.ascontiguousarray(pk.transform(Xt), dtype=np.float32)
                # no SGD reference (run time): "class energy kept" measures the subspace
                clf, _ = sgd_pair(tr, F.ypriv, K, cfg, next(seeds), reference=False,
                                  preprocessing=[pk] if proj.private_valid else [])
                rows.append(dict(common, protocol=name, privacy=proj.privacy,
                                 private_valid=proj.private_valid, k=k, rows=m,
                                 captured=captured_fraction(components(proj, k), mu, pi),
                                 oracle=oracle[k], noisy_acc=accuracy(clf, te, F.yte),
                                 epsilon_=clf.epsilon_,
                                 sigma=clf.noise_multiplier_, rho_pca=proj.rho,
                                 epsilon_pca=proj.epsilon_pca))
            best = max((r for r in rows if r["protocol"] == name and r["scale"] == sc),
                       key=lambda r: r["noisy_acc"])
            progress(f"{F.tag} p={p} {sc} {name} (m={m}, detected {spiked[-1]['detected']}/"
                     f"{K} spikes): best k={best['k']} NoisySGD {best['noisy_acc']:.3f}, "
                     f"captured {best['captured']:.2f}")
        rows[-1]["seconds"] = time.perf_counter() - t0
        del Xp, Xt, Xq
    return rows, spiked
