r"""Figure 3(b) / Section 5.3: NoisySGD and SGD versus the feature dimension p, on the
clean test set and with the test features perturbed by :math:`N(0, vI_p)`.

**Trained at p** (:func:`dimension_sweep`): p <= d a fixed coordinate subset, p > d copies
of the whole vector, unit-norm rows (``real_data.resize``); one NoisySGD / SGD pair per
p, every perturbation scale evaluated on fresh test draws.

**Copies, exact reduction** (:func:`copies_accuracy`), for p = r d far beyond what fits
in memory.  With r copies renormalised, :math:`x' = Qx`, :math:`Q = [I;\dots;I]/\sqrt r`
(:math:`Q^TQ = I_d`).  Every training gradient :math:`r_i x_i'^T = (r_i x_i^T)Q^T` lies
in the range of Q, clipping sees the same norms, and the isotropic noise splits into
independent parts on range(Q) and its complement; so :math:`W' = W_dQ^T + W_\perp` where
:math:`W_d` (K, d) is exactly (in distribution) NoisySGD trained on the d-dim rows and
:math:`W_\perp = N(I - QQ^T)`, N with i.i.d. :math:`N(0, s^2)` entries
(``real_fit.weight_noise_sd``).  On a perturbed test row,
:math:`W'(x'+z) = W_dx + W_dQ^Tz + W_\perp z` with :math:`W_dQ^Tz + W_\perp z \sim
N(0, v(W_dW_d^T + G))`, :math:`G = W_\perp W_\perp^T \sim \mathrm{Wishart}_K((r-1)d,
s^2 I)` (one draw per model).  Clean accuracy is therefore exactly that at p = d; SGD
(s = 0) is exactly p-free; NoisySGD's perturbed logits get an extra noise of variance
about :math:`v s^2 (p - d)` per class.  Validated against the trained-at-p rows at 2d/4d.
"""
from __future__ import annotations

import math
import time

import numpy as np

from .real_data import perturb, perturb_var, resize
from .real_fit import accuracy, median_margin, sgd_pair, weight_noise_sd

__all__ = ["wishart_identity", "copies_accuracy", "noise_report", "dimension_sweep",
           "extended_sweep"]


def wishart_identity(K, df, sd, rng) -> np.ndarray:
    r"""A draw of :math:`G = NN^T`, N (K, df) with i.i.d. :math:`N(0, sd^2)` entries
    (Wishart_K(df, sd^2 I)), by the Bartlett decomposition: O(K^2) draws for any df."""
    if df <= 0 or sd == 0:
        return np.zeros((K, K))
    L = np.tril(rng.standard_normal((K, K)), -1)
    L[np.diag_indices(K)] = np.sqrt(rng.chisquare(df - np.arange(K)))
    return sd * sd * (L @ L.T)


def _sqrt_psd(C):
    w, U = np.linalg.eigh(C)
    return U * np.sqrt(np.clip(w, 0.0, None))


def copies_accuracy(W, base, yte, var, r, s, rng, reps=3) -> tuple[float, float]:
    """Perturbed-test accuracy at p = r d of a model trained on r renormalised copies,
    from W (K, d) trained on the d-dim rows and its noise entry std ``s`` (0: SGD),
    by the exact reduction of the module docstring.  ``base`` (n, K): the clean test
    logits X W^T of unit-norm rows X (n, d); yte (n,); ``var`` the perturbation variance
    per coordinate.  Returns (mean, sd) over ``reps`` draws of (G, test perturbation)."""
    W = np.asarray(W, dtype=np.float64)
    K, d = W.shape
    accs = []
    for _ in range(reps):
        C = var * (W @ W.T + wishart_identity(K, (int(r) - 1) * d, s, rng))
        z = base + rng.standard_normal(base.shape) @ _sqrt_psd(C).T
        accs.append(float(np.mean(np.argmax(z, axis=1) == yte)))
    return float(np.mean(accs)), float(np.std(accs))


def noise_report(var, p, s) -> dict:
    """Noise against signal at dimension p for unit-norm rows: ``pert_to_signal`` =
    sqrt(var p) (perturbation norm / signal norm) and ``dp_logit_sd`` = s sqrt(var p),
    the std of the logit noise the DP weight noise (entry std s) adds on a perturbed row."""
    return dict(pert_to_signal=math.sqrt(var * p), dp_logit_sd=s * math.sqrt(var * p))


def dimension_sweep(F, factors, scales, cfg, coords, seeds, progress):
    """Trained-at-p rows: for each factor f, p = max(K, round(f d)); one NoisySGD/SGD
    pair; per scale the perturbed-test accuracies.  ``seeds``: an iterator of ints.
    Returns (rows, models) with models = {p: (W_noisy (K, p), s, W_sgd (K, p))}."""
    rows, models = [], {}
    for f in factors:
        p = max(F.K, int(round(f * F.d)))
        t0 = time.perf_counter()
        Xp, Xt = resize(F.Xpriv, p, coords), resize(F.Xte, p, coords)
        clf, gd = sgd_pair(Xp, F.ypriv, F.K, cfg, next(seeds))
        del Xp
        s = weight_noise_sd(clf)
        models[p] = (np.asarray(clf.coef_), s, gd.W)
        base = dict(dataset=F.tag, p=p, factor=f, method="trained at p",
                    noisy_clean=accuracy(clf, Xt, F.yte), sgd_clean=accuracy(gd, Xt, F.yte),
                    margin=median_margin(clf.coef_, Xt), s=s, sigma=clf.noise_multiplier_,
                    epsilon_=clf.epsilon_, steps=clf.steps_)
        for sc in scales:
            v = perturb_var(sc, F.d)
            Xtp = perturb(Xt.copy(), v, next(seeds))
            rows.append(dict(base, scale=sc, var=v, **noise_report(v, p, s),
                             noisy_pert=accuracy(clf, Xtp, F.yte),
                             sgd_pert=accuracy(gd, Xtp, F.yte)))
            del Xtp
        rows[-1]["seconds"] = time.perf_counter() - t0
        progress(f"{F.tag} p={p}: NoisySGD clean {base['noisy_clean']:.3f}, SGD clean "
                 f"{base['sgd_clean']:.3f} ({time.perf_counter() - t0:.0f} s)")
    return rows, models


def extended_sweep(F, model_d, ratios, scales, coords, seed, reps=3):
    """Copies rows by the exact reduction from the model trained at p = d (on the
    coordinates ``coords``, as :func:`dimension_sweep`): p = r d for r in ``ratios``
    (integers >= 1), every scale; NoisySGD and SGD."""
    Wn, s, Ws = model_d
    Xt = resize(F.Xte, F.d, coords)
    margin = median_margin(Wn, Xt)
    bn = np.asarray(Xt, np.float64) @ np.asarray(Wn, np.float64).T
    bs = np.asarray(Xt, np.float64) @ np.asarray(Ws, np.float64).T
    clean = dict(noisy_clean=float(np.mean(np.argmax(bn, 1) == F.yte)),
                 sgd_clean=float(np.mean(np.argmax(bs, 1) == F.yte)))
    rng = np.random.Generator(np.random.PCG64(seed))
    rows = []
    for r in ratios:
        p = int(r) * F.d
        for sc in scales:
            v = perturb_var(sc, F.d)
            nm, nsd = copies_accuracy(Wn, bn, F.yte, v, r, s, rng, reps)
            gm, _ = copies_accuracy(Ws, bs, F.yte, v, r, 0.0, rng, reps)
            rows.append(dict(dataset=F.tag, p=p, factor=float(r), method="copies, exact reduction",
                             scale=sc, var=v, **noise_report(v, p, s), margin=margin, s=s,
                             **clean, noisy_pert=nm, noisy_pert_sd=nsd, sgd_pert=gm))
    return rows
