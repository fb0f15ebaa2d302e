r"""Loss-based membership inference of a trained model: :func:`membership_losses`,
:func:`membership_auc` (NeuroMixGDP paper, Section 5; Yeom et al. 2018) and
:func:`loss_scores`, the black-box canary score of a one-run audit.

Moved here from ``ncdp_fast.release.audit`` (that path still imports these)."""
from __future__ import annotations

import numpy as np

from .._arrays import to_numpy

__all__ = ["membership_auc", "membership_losses", "loss_scores"]


def membership_losses(model, features, labels) -> np.ndarray:
    """Per-example cross-entropy -log p_model(y | x) (n,), float64; probabilities are
    floored at 1e-300 so a confident mistake gives a large finite loss."""
    if not callable(getattr(model, "predict_proba", None)):
        raise TypeError("model: expected a fitted classifier with predict_proba(X) -> (n, K), "
                        f"got {type(model).__name__}")
    y = to_numpy(labels)
    if y.ndim != 1 or y.dtype.kind not in "iu":
        raise ValueError(f"labels: expected integer class ids of shape (n,), got dtype "
                         f"{y.dtype} shape {y.shape}")
    P = np.asarray(model.predict_proba(features), dtype=np.float64)
    if P.shape[0] != y.shape[0]:
        raise ValueError(f"labels: length {y.shape[0]} differs from features' {P.shape[0]} rows")
    if y.size and (y.min() < 0 or y.max() >= P.shape[1]):
        # The labels may be the private training set's (members): their values stay
        # out of a message that may reach a log.
        raise ValueError(f"labels: expected integers in [0, {P.shape[1]}), got values "
                         "outside it (not shown: labels may be private)")
    return -np.log(np.maximum(P[np.arange(y.shape[0]), y], 1e-300))


def membership_auc(model, members, nonmembers) -> float:
    r"""Loss-based membership-inference AUC (Yeom et al. 2018; paper Section 5).

    The attack scores each example by its loss under ``model`` (any object with
    ``predict_proba``); a lower loss says "member".  The AUC is the probability that
    a random member has a lower loss than a random non-member, ties counting 1/2 --
    computed from average ranks (Mann-Whitney U): with :math:`R` the rank sum of the
    members' losses in the pooled sample (ascending, ties averaged),
    :math:`\mathrm{AUC} = 1 - (R - n_1(n_1+1)/2)/(n_1 n_0)`.  0.5 is no leakage.

    Args:
        model: fitted classifier with ``predict_proba(X) -> (n, K)``.
        members, nonmembers: ``(features, labels)`` pairs (labels integer (n,)).
    """
    from scipy.stats import rankdata
    for name, pair in (("members", members), ("nonmembers", nonmembers)):
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            raise TypeError(f"{name}: expected a (features, labels) pair")
    lm = membership_losses(model, *members)
    ln = membership_losses(model, *nonmembers)
    if lm.size == 0 or ln.size == 0:
        raise ValueError(f"members, nonmembers: need at least one of each, got {lm.size} and "
                         f"{ln.size}")
    ranks = rankdata(np.concatenate([lm, ln]))        # ascending loss, ties averaged
    n1, n0 = lm.size, ln.size
    u_lower = ranks[:n1].sum() - n1 * (n1 + 1) / 2.0  # pairs with member loss > non-member
    return float(1.0 - u_lower / (n1 * n0))



def loss_scores(model, features, labels) -> np.ndarray:
    """Black-box canary scores (n,) float64 for a one-run audit: minus each
    example's loss under ``model`` (:func:`membership_losses`), so that higher
    says "trained on" (IN).  ``model`` is anything with ``predict_proba``."""
    return -membership_losses(model, features, labels)
