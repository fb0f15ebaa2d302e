r"""One-run audit of a NeuroMixGDP release (:class:`ncdp_fast.release.NeuroMixGDP`):
:func:`audit_release`.

m canary records, each included in the private data independently with
probability 1/2, are released with the real records by ``NeuroMixGDP.release``
as a user releases.  Canary i is the feature vector C_x e_j on its own
coordinate j (a Dirac: after clipping it is itself, and each released row that
sampled it carries C_x / m_mix on coordinate j, nothing elsewhere), labelled
class 0.

What the auditor observes (``observe``):

* ``"rows"``: the release itself (every released row -- it is what is
  published); each row's coordinate j, in units of the canary's signal, is
  b + N(0, sigma_x^2), b ~ Bernoulli(m_mix / n) if included; the score is the
  per-row likelihood ratio summed over rows.  Only the feature channel is
  used: with lam = sigma_y / sigma_x the features carry the fraction
  lam^2 / (1 + lam^2) of the mechanism's 1/sigma^2, so the audit of a
  lam = 1 release sees half of it.
* ``"classifier"``: only a :class:`~ncdp_fast.release.SoftLabelClassifier`
  trained on the release (black box): each canary is scored by minus its loss
  (:func:`ncdp_fast.audit.membership.loss_scores`).
"""
from __future__ import annotations

import math
import time

import numpy as np

from .._validate import check_choice, check_int, check_positive, check_probability
from .dpsgd import _seeds, claimed_mu, resolve_k
from .guess import AuditResult, bound_from_scores, subsampled_gaussian_score
from .membership import loss_scores

__all__ = ["audit_release"]


def audit_release(*, canaries: int = 1000, epsilon: float = 4.0, delta: float = 1e-5,
                  real_samples: int = 1000, real_features: int = 16, num_classes: int = 4,
                  mixup_degree="auto", num_samples=None, lam: float = 1.0,
                  observe: str = "rows", confidence: float = 0.95, k="plan",
                  seed=None) -> AuditResult:
    r"""One-run audit of ``NeuroMixGDP(epsilon, delta, ...).release`` with Dirac
    canaries (module docstring).

    Args:
        canaries: m (>= 2).
        epsilon, delta: the release's target; ``epsilon_claimed`` is its
            report's ``epsilon`` (the PLD bound) at ``delta``.
        real_samples, real_features, num_classes: the real records (random
            features of norm about 1, random labels); features have
            real_features + m coordinates.
        mixup_degree, num_samples, lam: as :class:`~ncdp_fast.release.NeuroMixGDP`.
        observe: ``"rows"`` or ``"classifier"``.
        confidence: as :func:`~ncdp_fast.audit.bound_from_scores`.
        k: ``"plan"`` (planned from the feature channel's sigma_x, q = m_mix / n
            and T before the release is looked at), an int, a pair, or None (grid).
        seed: None (OS entropy) or an int fixing membership, data and noise key.
    """
    from ..release import NeuroMixGDP, SoftLabelClassifier

    m = check_int(canaries, "canaries", 2)
    check_positive(epsilon, "epsilon")
    check_probability(delta, "delta", one=False)
    n_real = check_int(real_samples, "real_samples", 0)
    d_real = check_int(real_features, "real_features", 1)
    K = check_int(num_classes, "num_classes", 2)
    check_choice(observe, "observe", ("rows", "classifier"))
    start = time.perf_counter()

    rng, noise_key, plan_rng = _seeds(seed)
    membership = rng.random(m) < 0.5
    d = d_real + m
    canary_x = np.zeros((m, d))
    canary_x[np.arange(m), d_real + np.arange(m)] = 1.0        # C_x = 1: a unit Dirac
    real_x = np.zeros((n_real, d))
    real_x[:, :d_real] = rng.standard_normal((n_real, d_real)) / math.sqrt(d_real)
    X = np.concatenate([real_x, canary_x[membership]])
    y = np.concatenate([rng.integers(0, K, n_real), np.zeros(int(membership.sum()), int)])
    mech = NeuroMixGDP(epsilon=epsilon, delta=delta, mixup_degree=mixup_degree,
                       num_samples=num_samples, lam=lam, clip_x=1.0, seed=noise_key)
    rel = mech.release(X, y, num_classes=K)
    n = X.shape[0]
    q = rel.mixup_degree / n
    if observe == "rows":
        # coordinate j of each row, in units of the canary's signal C_x / m_mix
        g = np.asarray(rel.x, dtype=np.float64)[:, d_real:] * rel.mixup_degree
        scores = subsampled_gaussian_score(g, rel.sigma_x, q)
    else:
        clf = SoftLabelClassifier().fit(rel)
        scores = loss_scores(clf, canary_x, np.zeros(m, dtype=np.int64))
    details = dict(audit="release", observe=observe,
                   noise_multiplier=rel.report.noise_multiplier, sigma_x=rel.sigma_x,
                   sigma_y=rel.sigma_y, sample_rate=q, steps=rel.num_samples,
                   mixup_degree=rel.mixup_degree, lam=lam, real_samples=n_real,
                   epsilon_target=float(epsilon))
    # planned for the feature channel the rows show (sigma_x), before looking at them
    k = resolve_k(k, m, claimed_mu(rel.sigma_x, q, rel.num_samples), delta, confidence,
                  plan_rng)
    res = bound_from_scores(scores, membership, delta=delta, confidence=confidence, k=k,
                            epsilon_claimed=float(rel.report.epsilon), details=details)
    res.details["wall_s"] = time.perf_counter() - start
    return res
